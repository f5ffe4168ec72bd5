"""One worker brain, two shells: the real asyncio worker and the simulator drive the same
``WorkerState`` (worker/state.py), so one behaviour gives the same commands in both (issue 26).

The behaviour: a worker with one slot gets three independent tasks and one that needs all three
(on the same worker, so no fetch).  Every ``WorkerState.handle`` call is recorded, in whichever
shell makes it; the commands (kind and key) must be the same sequence in a real run
(scheduler + worker + client in one process, real sockets and threads) and in a simulated one.
A change to the state's rules shows in both: the second test changes one rule (results are
reported before they are stored) and both shells' commands change alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

import tidepool
from tidepool.scaling.node_types import NodeType
from tidepool.scheduler.server import Scheduler
from tidepool.sim import simulate
from tidepool.sim.cluster import SimCluster
from tidepool.sim.provider import PRESETS
from tidepool.sim.workload import SimTask, single
from tidepool.worker import state as ws
from tidepool.worker.server import Worker

KEYS = ("x0", "x1", "x2")


def nap(i: int) -> int:
    time.sleep(0.2)
    return i


def total(*xs: int) -> int:
    return sum(xs)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """(command kind, key) of every command any WorkerState returns, in order."""
    seen: list[tuple[str, str]] = []
    handle = ws.WorkerState.handle

    def recording(self: ws.WorkerState, event: Any) -> list[Any]:
        cmds = handle(self, event)
        for c in cmds:
            if isinstance(c, ws.MemorySample):
                continue
            key = getattr(c, "key", None)
            if isinstance(c, ws.Report):
                item = c.item
                key = item[0] if isinstance(item, list) else item["key"] if isinstance(item, dict) else item
                seen.append((f"report:{c.kind}", str(key)))
            else:
                seen.append((type(c).__name__, str(key if key is not None else getattr(c, "keys", ""))))
        return cmds

    monkeypatch.setattr(ws.WorkerState, "handle", recording)
    yield seen


def real_run() -> None:
    async def main() -> None:
        sched = await Scheduler().start()
        worker = await Worker(sched.address, sched.token, slots=1, memory_limit=0).start()

        def client() -> int:
            with tidepool.Client(sched.address, token=sched.token) as c:
                xs = [c.submit(nap, i, key=k) for i, k in enumerate(KEYS)]
                return int(c.submit(total, *xs, key="y").result(timeout=120))

        try:
            assert await asyncio.to_thread(client) == 3
        finally:
            await worker.close()
            await sched.close()

    asyncio.run(main())


def sim_run() -> None:
    tasks = [SimTask(k, 0.2) for k in KEYS] + [SimTask("y", 0.0, deps=KEYS)]
    cluster = SimCluster([NodeType("default", {"cpu": 1}, min_nodes=1, max_nodes=1, startup_estimate=0.5)],
                         {"default": PRESETS["local"]}, interval=0.05)  # fmt: skip
    result = simulate(single("shells", tasks, ["y"]), cluster, seed=1, tail=1.0)
    assert result.completed


def _commands(seen: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [c for c in seen if c[0] not in ("Drop",)]  # the client's release frees y at different times


def test_one_behaviour_through_both_shells_gives_the_same_commands(recorded: list[tuple[str, str]]) -> None:
    real_run()
    real = _commands(recorded)
    recorded.clear()
    sim_run()
    simulated = _commands(recorded)
    assert real == simulated
    started = [k for kind, k in real if kind == "Run"]
    assert started == ["x0", "x1", "x2", "y"]  # one slot: one at a time, in order, then the sum


def test_a_change_to_the_worker_state_changes_both_shells(recorded: list[tuple[str, str]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    store = ws.WorkerState._store

    def report_then_store(self: ws.WorkerState, key: str, nbytes: int, out: list[Any]) -> None:
        # the "fix": a worker that tells before it keeps (for the test only)
        out.append(ws.Report("stored", key))
        store(self, key, nbytes, out)

    monkeypatch.setattr(ws.WorkerState, "_store", report_then_store)
    real_run()
    real = _commands(recorded)
    recorded.clear()
    sim_run()
    simulated = _commands(recorded)
    assert real == simulated
    assert [k for kind, k in real if kind == "report:stored"] == ["x0", "x1", "x2", "y"]


class _Big:
    """A task's result that can be watched with a weak reference."""


def test_a_slot_thread_keeps_no_reference_to_the_last_result_it_made() -> None:
    """Found by a bug hunt: the slot thread's local kept the last result alive while it waited for
    work, so a 400 MiB result stayed in memory after it was spilled to disk, and reading it back
    passed the worker's limit: the worker restarted for ever."""
    import asyncio
    import gc
    import weakref

    from tidepool.testing import wait_until
    from tidepool.worker.executor import SlotPool, WorkItem

    loop = asyncio.new_event_loop()
    try:
        pool = SlotPool(loop, lambda: None)
        pool.submit(WorkItem("k", _Big, None, {}))
        outcomes: list = []
        wait_until(lambda: outcomes.extend(pool.drain()) or bool(outcomes), what="the task to finish")
        ref = weakref.ref(outcomes[0].value)
        outcomes.clear()  # the worker stored it (spilled it, say) and dropped its own reference
        gc.collect()
        wait_until(lambda: ref() is None, timeout=5, what="the result to be freed while the slot thread idles")
        pool.q.put(None)  # the slot thread ends
    finally:
        loop.close()
