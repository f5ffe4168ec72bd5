"""What runs on a worker for a Dask graph node (imported there by reference; no Dask import here).

State: one context variable, the values of the futures a node carries inline while that node is
unpickled.  Data flow: the client's converter (``tidepool.dask.convert``) pickles each Dask node to
bytes with the futures inside it turned into :func:`inline_value` calls; the worker substitutes the
task's dependencies into ``values`` and calls :func:`run_node`, which unpickles the node with those
values at hand and calls it the way Dask's own schedulers do, ``node(values)``.
"""

from __future__ import annotations

import contextvars
import pickle
import weakref
from collections.abc import Mapping
from typing import Any

_INLINE: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "tidepool_dask_inline", default=None
)


def inline_value(key: str) -> Any:
    """Unpickling hook: the value of the future (tidepool key ``key``) that a node held inline."""
    values = _INLINE.get()
    if values is None or key not in values:
        raise RuntimeError(f"the value of future {key!r} was not delivered with this Dask task")
    return values[key]


def run_node(blob: bytes, values: Mapping[Any, Any], inline: Mapping[str, Any]) -> Any:
    """Unpickle one Dask graph node and compute it from its dependencies' ``values`` (Dask key ->
    value); ``inline`` holds the values of futures embedded in the node (tidepool key -> value)."""
    token = _INLINE.set(inline)
    try:
        node = pickle.loads(blob)
    finally:
        _INLINE.reset(token)
    value = node(values)
    if isinstance(value, weakref.ProxyTypes):
        _keep_alive(node)
    return value


#: task key -> the unpickled node of a task whose result is a weak proxy (see _keep_alive)
_KEPT: dict[str, Any] = {}


def _keep_alive(node: Any) -> None:
    """Keep ``node`` (its function and closure) while its result is held on this worker.

    A task may return ``weakref.proxy(x)`` with ``x`` kept alive only by its own closure (Dask's
    ``test_use_of_weakref_proxy``); the node would be dropped after the call and the proxy die
    before the next task reads it.  Entries of results this worker no longer holds are dropped."""
    from tidepool.worker.context import current_task, get_worker

    key = current_task()
    if key is None:
        return
    try:
        held = get_worker().data
    except Exception:  # noqa: BLE001 - not on a worker (a test calling run_node directly)
        held = None
    if held is not None:
        for k in [k for k in _KEPT if k not in held]:
            del _KEPT[k]
    _KEPT[key] = node


def data_value(value: Any) -> Any:
    """A Dask ``DataNode``: the literal value, shipped with the task."""
    return value


__all__ = ["data_value", "inline_value", "run_node"]
