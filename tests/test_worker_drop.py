"""The worker shell carries out ``Drop`` without reading the dropped values (``worker/server.py``)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tidepool.worker import state as ws
from tidepool.worker.server import Worker
from tidepool.worker.spill import SpillStore


def _refuse_to_load() -> Any:
    raise RuntimeError("this value must not be read back")


class _LoadsBadly:
    """Pickles fine; reading it back raises (a class gone since, a full memory ...)."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())


def test_dropping_a_spilled_value_does_not_read_it_back(tmp_path: Any) -> None:
    # Drop used data.pop(key, None): MutableMapping.pop reads the value first, so a spilled value
    # was loaded from disk (all of it) only to be dropped, and one that failed to load raised in
    # the worker's loop and the key was never dropped.  (An in-process worker: its limit must be
    # far above the test process's own memory, which a long run grows past 800 MiB.)
    w = Worker("tcp://127.0.0.1:1", "token", slots=1, memory_limit=8 * 2**30, spill_dir=str(tmp_path))
    try:
        store = w.data
        assert isinstance(store, SpillStore)
        store.put("spilled", _LoadsBadly(), 100)
        store.put("kept", 7, 28)
        assert store.spill(["spilled"]) == [] and "spilled" in store.on_disk
        assert [f for f in os.listdir(store.directory) if f.endswith(".spill")] != []
        with pytest.raises(RuntimeError):
            store["spilled"]  # what pop() did
        w._apply([ws.Drop(("spilled", "kept", "never-held"))])
        assert "spilled" not in store and "kept" not in store and len(store) == 0
        assert [f for f in os.listdir(store.directory) if f.endswith(".spill")] == []
    finally:
        if isinstance(w.data, SpillStore):
            w.data.close()
        shutil.rmtree(w.setup_dir, ignore_errors=True)
