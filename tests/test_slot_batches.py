"""Quick tasks run in batches on one slot thread (``worker/executor.py``, ``worker/state.py``).

The pool itself is driven with a real event loop and deterministic work; the end-to-end tests use
real worker processes: a map of tiny tasks runs in batches, and a task that kills its worker from
inside a batch is blamed alone in the end (the batch's other tasks are retried one by one).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import tidepool
from tidepool.errors import KilledWorkerError
from tidepool.testing import wait_until
from tidepool.worker import executor
from tidepool.worker.context import current_task, get_worker
from tidepool.worker.executor import Outcome, SlotPool, WorkItem


def _pool_run(items: list[WorkItem], monkeypatch: pytest.MonkeyPatch) -> tuple[list[Outcome], int]:
    """Run one batch; return its outcomes and how many times the loop was woken for them."""
    monkeypatch.setattr(executor, "WAKE_EVERY", 1e9)  # only the batch's end wakes the loop

    async def main() -> tuple[list[Outcome], int]:
        got: list[Outcome] = []
        wakes = 0
        done = asyncio.Event()

        def on_done() -> None:
            nonlocal wakes
            wakes += 1
            got.extend(pool.drain())
            if got and got[-1].last:
                done.set()

        pool = SlotPool(asyncio.get_running_loop(), on_done)
        pool.submit_batch(items)
        await asyncio.wait_for(done.wait(), 30)
        pool.stop()
        assert pool.busy == 0
        return got, wakes

    return asyncio.run(main())


def test_a_batch_runs_in_order_on_one_thread_and_wakes_the_loop_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    threads: list[str] = []

    def record(x: int) -> int:
        threads.append(threading.current_thread().name)
        if x == 3:
            raise ValueError("three")
        return x * 10

    items = [WorkItem(f"k{i}", lambda i=i: record(i), None, {}) for i in range(8)]
    outcomes, wakes = _pool_run(items, monkeypatch)
    assert [o.key for o in outcomes] == [f"k{i}" for i in range(8)]
    assert [o.value for o in outcomes if o.ok] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(outcomes[3].value, ValueError) and "three" in outcomes[3].tb  # one failure, the rest ran
    assert [o.last for o in outcomes] == [False] * 7 + [True]
    assert wakes == 1 and len(set(threads)) == 1


def test_a_task_that_secedes_hands_the_rest_of_its_batch_back(monkeypatch: pytest.MonkeyPatch) -> None:
    rest: list[WorkItem] = []

    def seceding() -> str:
        rest.extend(SlotPool.detach_rest())
        return "left"

    items = [WorkItem("a", lambda: 1, None, {}), WorkItem("b", seceding, None, {}),
             WorkItem("c", lambda: 3, None, {}), WorkItem("d", lambda: 4, None, {})]  # fmt: skip
    outcomes, _ = _pool_run(items, monkeypatch)
    assert [(o.key, o.value, o.last) for o in outcomes] == [("a", 1, False), ("b", "left", True)]
    assert [w.key for w in rest] == ["c", "d"]  # not run by that thread: the caller submits them again


# ---- end to end ---------------------------------------------------------------------------------
def in_batch(x: int) -> bool:
    """True if this task runs inside a batch on its worker."""
    st = get_worker().state  # type: ignore[attr-defined]
    return st.batch_of.get(current_task()) is not None


@pytest.mark.integration
def test_a_map_of_tiny_tasks_runs_mostly_in_batches() -> None:
    with tidepool.LocalCluster(n_workers=1, slots=1) as cluster, tidepool.Client(cluster) as client:
        flags = client.gather(client.map(in_batch, range(300)))
    assert sum(flags) >= 150, f"only {sum(flags)} of 300 tiny tasks ran in a batch"


def quick_or_crash(x: int) -> int:
    if x == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


@pytest.mark.integration
def test_a_task_that_kills_its_worker_inside_a_batch_is_blamed_alone() -> None:
    """The first crash blames no task, or every task of the batch once (a quick task's "started"
    may not have left yet); either way all of them come back ``solo`` and run one by one with
    "started" sent first, so only the crasher dies again, and it alone fails once two crashes are
    blamed on it (allowed_failures=1): after two or three crashes in all, never more."""
    with tidepool.LocalCluster(n_workers=1, slots=1, allowed_failures=1) as cluster, \
            tidepool.Client(cluster) as client:  # fmt: skip
        futs = client.map(quick_or_crash, range(40))

        def alive() -> bool:
            return any(p["alive"] for p in cluster.provider.list().values())

        for _ in range(6):
            wait_until(lambda: futs[20].done() or not alive(), timeout=60, what="a crash")
            if futs[20].done():
                break
            cluster.add_workers(1, wait=False)
        with pytest.raises(KilledWorkerError, match="2 workers that died"):
            futs[20].result(timeout=30)
        if not alive():
            cluster.add_workers(1, wait=False)
        others = [f for i, f in enumerate(futs) if i != 20]
        assert client.gather(others, timeout=60) == [i for i in range(40) if i != 20]
        assert client.scheduler_info()["counters"]["workers_lost"] in (2, 3)
