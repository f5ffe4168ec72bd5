"""Dask collections on tidepool: ``client.get`` (Dask's scheduler protocol), ``persist`` and
``compute`` of ``dask.array`` / ``dask.dataframe`` / ``dask.bag`` / ``dask.delayed`` values.

Dask is an optional extra (``pip install 'tidepool[dask]'``); nothing here imports it until a Dask
graph arrives.  ``convert`` turns graphs into tidepool tasks on the client, ``run`` is what
workers execute (part of tidepool, so nothing needs shipping; a worker unpickling a task imports
only that module), ``client`` holds the calls :class:`~tidepool.Client` delegates to, built on the
client's public API alone.  Names are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidepool.dask.client import is_dask_collection
    from tidepool.dask.convert import require_dask

_LAZY = {"is_dask_collection": "tidepool.dask.client", "require_dask": "tidepool.dask.convert"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidepool.dask' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["is_dask_collection", "require_dask"]
