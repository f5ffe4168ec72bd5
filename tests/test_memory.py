"""Memory limits without processes: the thresholds' verdicts, where a limit comes from, and the
spill store (values on disk come back byte for byte; spilled bytes are still held)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tidepool.errors import ConfigError
from tidepool.worker.memory import Action, MemoryThresholds, memory_action, resolve_limit
from tidepool.worker.spill import SpillStore

MB = 2**20
T = MemoryThresholds()


@pytest.mark.parametrize(("rss_frac", "paused", "want"), [
    (0.50, False, Action.NOTHING),
    (0.65, False, Action.NOTHING),   # between target and spill: the store's own LRU handles it
    (0.75, False, Action.SPILL),
    (0.85, False, Action.PAUSE),
    (0.85, True, Action.SPILL),      # still paused: keep spilling
    (0.75, True, Action.RESUME),     # below pause again: resume
    (0.96, False, Action.TERMINATE),
    (0.96, True, Action.TERMINATE),
])  # fmt: skip
def test_memory_action_follows_the_documented_levels(rss_frac: float, paused: bool, want: Action) -> None:
    assert memory_action(int(rss_frac * 1000 * MB), 1000 * MB, T, paused) is want


def test_no_limit_never_acts() -> None:
    assert memory_action(10**12, 0, T, False) is Action.NOTHING


def test_thresholds_must_rise() -> None:
    with pytest.raises(ConfigError, match="must rise"):
        MemoryThresholds(target=0.9, spill=0.7)
    with pytest.raises(ConfigError, match="must rise"):
        MemoryThresholds(terminate=1.5)


def test_limit_comes_from_the_flag_then_the_memory_resource_then_the_machine() -> None:
    total = psutil.virtual_memory().total
    assert resolve_limit("1GB", {"memory": 8e9}) == 10**9
    assert resolve_limit(None, {"memory": 8e9}) == 8 * 10**9
    assert resolve_limit(None, {"cpu": 2}) == total
    assert resolve_limit(None, {}, share=4) == total // 4
    assert resolve_limit("none", {"memory": 8e9}) == 0
    with pytest.raises(ConfigError, match="byte amount"):
        resolve_limit("lots", {})


def test_values_past_the_target_spill_least_recently_used_first(tmp_path: Path) -> None:
    store = SpillStore(tmp_path / "spill", target=50 * MB)
    arrays = {f"k{i}": np.full(10 * MB, i, dtype=np.uint8) for i in range(8)}
    for k, v in arrays.items():
        store[k] = v
    assert 0 < store.memory_bytes <= 50 * MB + 1000
    assert set(store.on_disk) >= {"k0", "k1", "k2"}  # the oldest went first
    assert store.spilled_bytes + store.memory_bytes == sum(store.sizes.values())
    assert len(store) == 8 and "k0" in store and sorted(store) == sorted(arrays)
    assert any((tmp_path / "spill").iterdir())
    for k, v in arrays.items():  # every byte comes back
        got = store[k]
        assert got.dtype == v.dtype and np.array_equal(got, v)
    del store["k7"]
    assert "k7" not in store and "k7" not in store.sizes
    store.close()
    assert not (tmp_path / "spill").exists()


def test_evict_spills_on_demand_and_a_value_over_the_target_goes_to_disk(tmp_path: Path) -> None:
    store = SpillStore(tmp_path / "s", target=100 * MB)
    store["a"] = b"x" * (10 * MB)
    store["b"] = {"nested": [1, 2, 3], "blob": b"y" * MB}
    assert store.spilled_bytes == 0
    freed = store.evict(5 * MB)
    assert freed >= 5 * MB and "a" in store.on_disk
    assert store["a"] == b"x" * (10 * MB) and store["b"]["nested"] == [1, 2, 3]
    store["big"] = np.zeros(150 * MB, dtype=np.uint8)
    assert "big" in store.on_disk
    assert store.evict(10**12) > 0 and store.memory_bytes == 0  # everything can go
    store.close()


class ShortOfMemory:
    """Pickling it raises MemoryError (as a worker under an address-space limit would)."""

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        raise MemoryError


def test_a_reply_under_a_memory_limit_carries_an_eighth_of_it_at_most_and_defers_the_rest() -> None:
    """Found by a bug hunt: a client gathering 150 spilled 10 MiB results from workers with a 300 MB
    limit got replies of up to the frame limit (4 GiB), read back from disk at once: every worker
    passed its limit and restarted (34 restarts; KilledWorkerError for tasks running then)."""
    from tidepool.worker.server import Worker

    # (a limit well above what this test process uses: the whole suite runs in it)
    w = Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit="8GB")
    keys = [f"v{i}" for i in range(20)]
    for k in keys:  # (zeros: pages never touched, so the test itself stays small)
        w.data[k] = np.zeros(100 * MB, dtype=np.uint8)
        w.state.memory[k] = 100 * MB
    reply = w._data_reply(keys, 2**32)
    assert 1 <= len(reply["data"]) <= 8_000_000_000 // 8 // (100 * MB) + 1
    assert sorted([*reply["data"], *reply["deferred"]]) == sorted(keys)  # the rest is asked for again
    unlimited = Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit="none")
    for k in keys:
        unlimited.data[k] = np.zeros(100 * MB, dtype=np.uint8)
        unlimited.state.memory[k] = 100 * MB
    assert len(unlimited._data_reply(keys, 2**32)["data"]) == 20  # no limit: one frame's worth
    w.data["big"] = np.zeros(1200 * MB, dtype=np.uint8)
    w.state.memory["big"] = 1200 * MB
    assert list(w._data_reply(["big"], 2**32)["data"]) == ["big"]  # one value always goes


def test_a_spilled_value_that_cannot_be_read_back_under_the_limit_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a bug hunt: reading back a spilled value that does not fit under the terminate level
    restarted the worker, which lost it; its recompute was spilled and asked for again: restarts
    for ever, ended only by the client's timeout."""
    from tidepool.worker.server import Worker

    w = Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit="8GB")
    w.data["big"] = np.zeros(MB, dtype=np.uint8)
    w.state.spilled["big"] = 600 * MB  # on disk, as the state knows it
    w.data["small"] = np.zeros(MB, dtype=np.uint8)
    w.state.memory["small"] = MB
    monkeypatch.setattr(w, "_rss", lambda: int(0.95 * 8e9) - 100 * MB)  # 100 MiB of room left

    async def serve() -> dict[str, object]:  # as the data server does, in the worker's loop
        return w._data_reply(["big", "small"], 2**32)

    reply = asyncio.run(serve())
    assert list(reply["data"]) == ["small"]  # an in-memory value is served as ever
    assert "cannot be read back from disk" in reply["failed"]["big"] and "more memory" in reply["failed"]["big"]
    assert "big" not in w.state and "small" in w.state  # dropped here; the scheduler hears and errs its task


def test_out_of_memory_while_serving_keeps_the_value_and_closes_only_that_connection() -> None:
    from tidepool.worker.server import Worker

    w = Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit="8GB")
    w.data["k"] = ShortOfMemory()
    w.state.memory["k"] = 64
    with pytest.raises(MemoryError):  # the listener closes that connection: the asker fails over at once
        w._data_reply(["k"], 2**30)
    assert "k" in w.data and "k" in w.state and not w.outbox.batch.unservable  # not reported, not dropped


def test_a_terminate_sample_is_measured_again_on_the_loop_and_the_monitor_keeps_watching() -> None:
    """Found by a bug hunt: the monitor's thread measured the process while the loop was spilling
    a value just made (freed only when the spill returned); the stale reading restarted a worker
    that held nothing in memory any more, losing every value, in about half the runs of 200 MiB
    values under a 400 MB limit.  The loop measures again before it acts on a terminate; and the
    thread no longer stops after posting one."""
    from tidepool.worker.memory import MemoryMonitor

    acted: list[tuple[Action, int]] = []
    readings = iter([960, 100])
    loop = asyncio.new_event_loop()
    try:
        mon = MemoryMonitor(1000, MemoryThresholds(), loop, lambda a, r: acted.append((a, r)), interval=0.001)
        mon.sample = lambda: next(readings)  # type: ignore[method-assign]
        mon._handle(Action.TERMINATE, 970)  # measured again on the loop: 960, still over 95%
        assert acted == [(Action.TERMINATE, 960)]
        mon._handle(Action.TERMINATE, 990)  # measured again: 100, the spill freed it
        assert acted == [(Action.TERMINATE, 960)]
        samples = iter([990] + [100] * 100_000)  # the thread: a terminate posted, then it goes on
        seen: list[int] = []

        def sample() -> int:
            rss = next(samples)
            seen.append(rss)
            return rss

        mon.sample = sample  # type: ignore[method-assign]
        mon.start()
        deadline = time.monotonic() + 30  # a bound, not a wait: it goes on at once unless it stopped
        while len(seen) <= 2 and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.01))
        mon.stop()
        assert len(seen) > 2, "the thread stopped watching after one terminate"
    finally:
        loop.close()


def test_a_spilled_value_is_read_back_after_the_values_in_memory_make_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a bug hunt: a 100 MiB spilled value failed for good ("cannot be read back") on a
    worker holding another 100 MiB value in memory, far under its limit: the room counted only what
    was free, not what spilling the values in memory frees.  They are spilled first now."""
    from tidepool.worker.server import Worker

    w = Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit="8GB")
    w.data["big"] = np.zeros(MB, dtype=np.uint8)
    w.state.spilled["big"] = 600 * MB  # on disk, as the state knows it
    for k in ("held1", "held2"):  # 2 x 300 MB in memory, the oldest first
        w.data[k] = np.zeros(MB, dtype=np.uint8)
        w.state.memory[k] = 300 * MB
        w.state._memory_bytes += 300 * MB
    monkeypatch.setattr(w, "_rss", lambda: int(0.95 * 8e9) - 100 * MB)  # 100 MiB of room left

    async def serve() -> dict[str, object]:
        return w._data_reply(["big"], 2**32)

    reply = asyncio.run(serve())
    assert list(reply["data"]) == ["big"] and not reply.get("failed")
    assert set(w.state.spilled) == {"big", "held1", "held2"} and not w.state.memory  # both made room
    w.state.validate()
