"""Quick tasks run in lanes on one slot thread (``worker/executor.py``, ``worker/state.py``).

The pool itself is driven with a real event loop and deterministic work (a task that blocks on an
event until the test lets it go); the end-to-end tests use real worker processes: a map of tiny
tasks runs in lanes, and a task that kills its worker from inside a lane is blamed alone in the
end (the lane's other tasks are retried one by one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

import tidepool
from tidepool.errors import KilledWorkerError
from tidepool.testing import wait_until
from tidepool.worker import executor
from tidepool.worker.context import current_task, get_worker
from tidepool.worker.executor import Outcome, SlotPool, WorkItem


def _pool_run(items: list[WorkItem], monkeypatch: pytest.MonkeyPatch, meanwhile: object = None,
              expect: int | None = None) -> tuple[list[Outcome], int, SlotPool]:  # fmt: skip
    """Run one lane; ``meanwhile(pool)`` is called in the loop once it was submitted.  Returns the
    outcomes, how many times the loop was woken for them, and the pool (stopped)."""
    monkeypatch.setattr(executor, "WAKE_EVERY", 1e9)  # only the lane's end wakes the loop
    n = len(items) if expect is None else expect

    async def main() -> tuple[list[Outcome], int, SlotPool]:
        got: list[Outcome] = []
        wakes = 0
        done = asyncio.Event()

        def on_done() -> None:
            nonlocal wakes
            wakes += 1
            got.extend(pool.drain())
            if len(got) >= n:
                done.set()

        pool = SlotPool(asyncio.get_running_loop(), on_done)
        pool.submit_lane(7, items)
        if callable(meanwhile):
            await asyncio.get_running_loop().run_in_executor(None, meanwhile, pool)
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.get_running_loop().run_in_executor(None, wait_until, lambda: pool.busy == 0)
        pool.stop()
        return got, wakes, pool

    return asyncio.run(main())


def test_a_lane_runs_in_order_on_one_thread_and_wakes_the_loop_once(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def record(x: int) -> int:
        threads.append(threading.current_thread().name)
        if x == 3:
            raise ValueError("three")
        return x * 10

    items = [WorkItem(f"k{i}", lambda i=i: record(i), None, {}) for i in range(8)]
    outcomes, wakes, pool = _pool_run(items, monkeypatch)
    assert [o.key for o in outcomes] == [f"k{i}" for i in range(8)]
    assert [o.value for o in outcomes if o.ok] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(outcomes[3].value, ValueError) and "three" in outcomes[3].tb  # one failure, the rest ran
    assert wakes == 1 and len(set(threads)) == 1 and pool.lanes == {}


def blocked_lane() -> tuple[threading.Event, threading.Event, list[str], list[WorkItem]]:
    """A lane a, b, c, d whose first call blocks until ``go`` (``running`` says it started); the
    others append their key to ``ran``."""
    go, running = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocking() -> str:
        running.set()
        go.wait(30)
        return "a"

    items = [WorkItem("a", blocking, None, {})] + [WorkItem(k, lambda k=k: ran.append(k), None, {}) for k in "bcd"]
    return go, running, ran, items


def test_tasks_the_slot_has_not_reached_can_be_taken_out_of_its_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``a`` runs, ``c`` and ``d`` come out (they never run); ``a`` itself is taken already."""
    go, running, ran, items = blocked_lane()

    def meanwhile(pool: SlotPool) -> None:
        assert running.wait(30)
        assert pool.running_long(0.0) == ["a"] and pool.members() == ["a"]
        assert [w.key for w in pool.unline(7, ("a", "c", "d"))] == ["c", "d"]
        go.set()

    outcomes, _, pool = _pool_run(items, monkeypatch, meanwhile, expect=2)
    assert [o.key for o in outcomes] == ["a", "b"] and ran == ["b"]
    assert pool.unline(7, ("b",)) == [] and pool.running_long(0.0) == [] and pool.members() == []  # the lane ended


def test_a_stopped_pool_runs_no_lane_member_its_slot_had_not_reached() -> None:
    """A worker closing (retired, restarted, lost its scheduler) stops its pool: the running task
    ends as it will, but the rest of its lane (up to 31 calls of user code) must not start."""
    go, running, ran, items = blocked_lane()

    async def main() -> SlotPool:
        pool = SlotPool(asyncio.get_running_loop(), lambda: None)
        pool.submit_lane(3, items)
        assert await asyncio.get_running_loop().run_in_executor(None, running.wait, 30)
        pool.stop()
        go.set()
        await asyncio.get_running_loop().run_in_executor(None, pool.threads[0].join, 30)
        return pool

    pool = asyncio.run(main())
    assert not pool.threads[0].is_alive() and ran == []


# ---- end to end ---------------------------------------------------------------------------------
def in_batch(x: int) -> bool:
    """True if this task runs inside a lane on its worker."""
    st = get_worker().state  # type: ignore[attr-defined]
    key = current_task()
    t = st.lined.get(key) or st.running.get(key)
    return t is not None and t.batch is not None


@pytest.mark.integration
def test_a_map_of_tiny_tasks_runs_mostly_in_batches() -> None:
    with tidepool.LocalCluster(n_workers=1, slots=1) as cluster, tidepool.Client(cluster) as client:
        flags = client.gather(client.map(in_batch, range(300)))
    assert sum(flags) >= 150, f"only {sum(flags)} of 300 tiny tasks ran in a lane"


def quick_or_crash(x: int) -> int:
    if x == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


@pytest.mark.integration
def test_a_task_that_kills_its_worker_inside_a_lane_is_blamed_alone() -> None:
    """The first crash blames no task (a quick task is not reported started): all of the dead
    worker's tasks come back ``solo`` and run one by one with "started" sent first, so only the
    crasher dies again, and it alone fails once two crashes are blamed on it (allowed_failures=1):
    after two or three crashes in all, never more."""
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


def gated_mark(gate: str, marker: str) -> str:
    """Wait for the file ``gate`` (if given), then leave the file ``marker`` (if given)."""
    if gate:
        wait_until(lambda: os.path.exists(gate), timeout=30, what="the gate")
    if marker:
        with open(marker, "w"):
            pass
    return "ok"


@pytest.mark.integration
def test_lined_calls_behind_a_running_one_can_be_cancelled_and_the_running_one_says_so(tmp_path: os.PathLike) -> None:
    """``gated_mark`` is quick (it ran at once), so the four calls form one lane on the one slot.
    The first blocks: after ``LONG`` the worker reports it started (``running()``), and the other
    three, not reached yet, are cancelled out of the lane and never run."""
    gate, marks = os.path.join(tmp_path, "gate"), [os.path.join(tmp_path, f"m{i}") for i in range(3)]
    with tidepool.LocalCluster(n_workers=1, slots=1) as cluster, tidepool.Client(cluster) as client:
        assert client.gather(client.map(gated_mark, ["", ""], ["", ""])) == ["ok", "ok"]
        first, *rest = client.map(gated_mark, [gate, "", "", ""], ["", *marks])
        wait_until(first.running, timeout=30, what="the blocked call to be reported running")
        client.cancel(rest)
        # the scheduler answers the cancel once it has sent the worker its free; a run goes to the
        # worker after it on the same connection, so when it returns the worker has dropped them
        # (else the gate could open, and the slot start the next call, before the free was read)
        client.run(os.getpid)
        with open(gate, "w"):
            pass
        assert first.result(timeout=30) == "ok"
        assert client.submit(gated_mark, "", "").result(timeout=30) == "ok"  # the slot went on past them
    assert not any(os.path.exists(m) for m in marks)
