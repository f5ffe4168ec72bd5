"""Cheap size estimates of results (bytes), for locality and memory accounting.

Objects of other libraries (a pandas ``DataFrame`` has no ``nbytes``) go to Dask's ``sizeof`` when
Dask is already loaded in this process (it is on any worker that ran a Dask task): it samples
object columns, while ``sys.getsizeof`` on a frame measures every string (``deep=True``), which
cost more than the task itself on small pandas partitions.
"""

from __future__ import annotations

import sys
from typing import Any


def sizeof(obj: Any, _depth: int = 0) -> int:
    """``obj``'s size in bytes, roughly; never raises (a result's odd ``nbytes`` or ``__len__``
    must not fail the worker loop that sizes it, nor the outcomes handed in with it)."""
    try:
        return _estimate(obj, _depth)
    except Exception:  # noqa: BLE001 - a size estimate must never fail a task
        return 64


def _estimate(obj: Any, _depth: int) -> int:
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(obj, type):
        return nbytes + 100
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj) + 50
    if isinstance(obj, memoryview):
        return obj.nbytes
    if _depth < 2 and isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)[:100]
        if not items:
            return sys.getsizeof(obj)
        per = sum(sizeof(x, _depth + 1) for x in items) / len(items)
        return int(sys.getsizeof(obj) + per * len(obj))
    if _depth < 2 and isinstance(obj, dict):
        items2 = list(obj.items())[:100]
        if not items2:
            return sys.getsizeof(obj)
        per = sum(sizeof(k, _depth + 1) + sizeof(v, _depth + 1) for k, v in items2) / len(items2)
        return int(sys.getsizeof(obj) + per * len(obj))
    dask_sizeof = sys.modules.get("dask.sizeof")
    if dask_sizeof is not None and type(obj).__module__.partition(".")[0] not in ("builtins", "tidepool"):
        try:
            return int(dask_sizeof.sizeof(obj))
        except Exception:  # noqa: BLE001 - a size estimate must never fail a task
            pass
    try:
        return sys.getsizeof(obj)
    except Exception:
        return 64
