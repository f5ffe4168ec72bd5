"""The ``concurrent.futures`` contract, run against tidepool's executor *and* the standard library's.

Each test in the first part is written from the documentation of ``concurrent.futures`` (Executor,
Future, wait, as_completed, shutdown with ``cancel_futures``) and runs twice: on a
``ThreadPoolExecutor(max_workers=1)`` and on ``client.get_executor()`` over a cluster of one worker
with one slot, the same shape.  That both pass shows the tests check the contract, not tidepool's
own behaviour.  The second part checks Dask's cancel semantics, which tidepool follows for
``Client.cancel`` (tidepool only).

Tasks that must stay running wait for a "gate" file; the test opens it.  "It never ran" is shown on
the single slot, which runs tasks in order: once a task submitted later has finished, a cancelled
task would have run before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidepool
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration



# ---- task functions (module level: workers import them by reference) ------------------------------
def identity(x: Any) -> Any:
    return x


def inc(x: int) -> int:
    return x + 1


def touch(path: str) -> str:
    Path(path).touch()
    return path


def gated(gate: str, value: Any = None, timeout: float = 30.0) -> Any:
    """Return ``value`` once the file ``gate`` exists."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.005)
    return value


def step(gate: str | None, marker: str | None) -> str:
    """Wait for ``gate`` (if given), then leave ``marker`` (if given)."""
    if gate is not None:
        gated(gate)
    if marker is not None:
        touch(marker)
    return "ok"


class Box:
    """A result that can be weakly referenced (to see when nothing holds it any more)."""

    def __init__(self, value: int) -> None:
        self.value = value


def make_box(value: int) -> Box:
    return Box(value)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def bump(self, by: int) -> int:
        return self.n + by


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=1, slots=1) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: tidepool.LocalCluster) -> Iterator[tidepool.Client]:
    with tidepool.Client(cluster) as c:
        yield c




@pytest.fixture(params=["ThreadPoolExecutor", "tidepool"])
def ex(request: pytest.FixtureRequest, gate: Path) -> Iterator[cf.Executor]:
    """One slot either way: the first task runs, later ones queue behind it in order."""
    if request.param == "ThreadPoolExecutor":
        executor: cf.Executor = cf.ThreadPoolExecutor(max_workers=1)
    else:
        executor = request.getfixturevalue("client").get_executor()
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)


def is_tidepool(ex: cf.Executor) -> bool:
    return not isinstance(ex, cf.ThreadPoolExecutor)


def occupy_the_slot(ex: cf.Executor, gate: Path) -> cf.Future[Any]:
    blocker = ex.submit(gated, str(gate), "blocker")
    wait_until(blocker.running, what="the blocker to be running in the only slot")
    return blocker


def scheduler_keys(cluster: tidepool.LocalCluster) -> set[str]:
    return cluster.run(lambda s: set(s.state.tasks))  # type: ignore[no-any-return]


def after_the_queue(submit: Any) -> None:
    """Run one more task through the slot and wait for it: everything queued before it has run."""
    assert submit(identity, "after").result(timeout=20) == "after"


# ==== part 1: the concurrent.futures contract, on both executors ====================================
def test_cancel_before_start_cancels_notifies_and_never_runs(ex: cf.Executor, gate: Path, tmp_path: Path) -> None:
    blocker = occupy_the_slot(ex, gate)
    marker = tmp_path / "queued-ran"
    queued = ex.submit(touch, str(marker))
    assert queued.cancel() is True
    assert queued.cancelled() and queued.done() and not queued.running()
    assert queued.cancel() is True  # cancelling again: still True
    with pytest.raises(cf.CancelledError):
        queued.result(timeout=5)
    with pytest.raises(cf.CancelledError):
        queued.exception(timeout=5)
    calls: list[Any] = []
    queued.add_done_callback(lambda f: calls.append((f, threading.current_thread())))
    assert calls == [(queued, threading.current_thread())]  # done already: called at once, here
    if is_tidepool(ex):
        # wait() counts cancelled futures as done.  ThreadPoolExecutor only notifies waiters when its
        # worker thread reaches the cancelled item (after the blocker), so this part is tidepool's
        done, not_done = cf.wait([blocker, queued], timeout=10, return_when=cf.FIRST_COMPLETED)
        assert done == {queued} and not_done == {blocker}
    gate.touch()
    after_the_queue(ex.submit)
    # "cancelled and notified": wait and as_completed count it as done (they used to block forever)
    done, not_done = cf.wait([queued], timeout=10)
    assert done == {queued} and not not_done
    assert list(cf.as_completed([queued], timeout=10)) == [queued]
    assert blocker.result(timeout=10) == "blocker"
    assert not marker.exists()


def test_cancel_of_running_or_finished_work_returns_false(ex: cf.Executor, gate: Path) -> None:
    running = occupy_the_slot(ex, gate)
    assert running.cancel() is False
    assert running.running() and not running.cancelled() and not running.done()
    gate.touch()
    assert running.result(timeout=15) == "blocker"
    assert running.done() and not running.running()
    assert running.cancel() is False and not running.cancelled()


def test_cancel_runs_the_done_callbacks(ex: cf.Executor, gate: Path) -> None:
    occupy_the_slot(ex, gate)
    queued = ex.submit(identity, 1)
    seen: list[cf.Future[Any]] = []
    queued.add_done_callback(seen.append)
    assert queued.cancel() is True
    assert seen == [queued]


def test_shutdown_with_cancel_futures_cancels_what_has_not_started_and_waits_for_the_rest(
    ex: cf.Executor, gate: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tidepool_ex = is_tidepool(ex)
    blocker = occupy_the_slot(ex, gate)
    markers = [tmp_path / f"queued-{i}" for i in range(3)]
    queued = [ex.submit(touch, str(m)) for m in markers]
    stopper = threading.Thread(target=ex.shutdown, kwargs={"wait": True, "cancel_futures": True})
    stopper.start()
    wait_until(lambda: all(f.cancelled() for f in queued), what="shutdown to cancel the queued futures")
    assert stopper.is_alive() and not blocker.done()  # it waits for the running one: gate closed
    gate.touch()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "shutdown(wait=True, cancel_futures=True) did not return"
    assert blocker.result(timeout=10) == "blocker"
    with pytest.raises(RuntimeError):
        ex.submit(identity, 1)
    if tidepool_ex:
        # ThreadPoolExecutor never notifies the futures its shutdown(cancel_futures=True) cancelled
        # (CPython 3.11: cf.wait() blocks on them for ever); tidepool notifies them
        done, not_done = cf.wait([blocker, *queued], timeout=10)
        assert not not_done
        after_the_queue(request.getfixturevalue("client").submit)
    assert not any(m.exists() for m in markers)


def test_done_callback_of_a_finished_future_runs_before_add_done_callback_returns(ex: cf.Executor) -> None:
    for _ in range(20):  # it used to be run later, on another thread (199 of 200 tries)
        f = ex.submit(identity, 5)
        assert f.result(timeout=15) == 5
        calls: list[Any] = []
        f.add_done_callback(lambda fut, calls=calls: calls.append((fut, threading.current_thread())))
        assert calls == [(f, threading.current_thread())]


def test_an_exception_in_a_callback_is_logged_and_the_next_callbacks_still_run(
    ex: cf.Executor, caplog: pytest.LogCaptureFixture
) -> None:
    boom = ValueError("callback boom")

    def bad(_: cf.Future[Any]) -> None:
        raise boom

    later = threading.Event()
    with caplog.at_level(logging.ERROR):
        f = ex.submit(identity, 1)
        f.add_done_callback(bad)
        f.add_done_callback(lambda _: later.set())
        assert later.wait(15)
        assert f.result(timeout=5) == 1
        f.add_done_callback(bad)  # on a done future: called at once, and logged the same way
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is boom]
    assert len(logged) == 2, [r.getMessage() for r in caplog.records]


def test_a_future_nobody_holds_still_fires_its_callbacks(ex: cf.Executor, gate: Path) -> None:
    occupy_the_slot(ex, gate)
    fired = threading.Event()
    ex.submit(identity, 1).add_done_callback(lambda _: fired.set())  # the future is dropped at once
    gc.collect()
    gate.touch()
    assert fired.wait(20)


def test_work_submitted_and_dropped_still_runs_before_shutdown_returns(
    ex: cf.Executor, gate: Path, tmp_path: Path
) -> None:
    occupy_the_slot(ex, gate)
    marker = tmp_path / "dropped-ran"
    ex.submit(touch, str(marker))  # nobody keeps the future
    gc.collect()
    gate.touch()
    ex.shutdown(wait=True)
    assert marker.exists()


def test_map_yields_in_order_and_keeps_no_result_already_yielded(ex: cf.Executor) -> None:
    results = ex.map(make_box, range(4))
    first = next(results)
    assert first.value == 0
    ref = weakref.ref(first)
    del first
    wait_until(lambda: gc.collect() >= 0 and ref() is None, what="the yielded result to be freed")
    assert [b.value for b in results] == [1, 2, 3]


def test_leaving_map_early_cancels_the_calls_not_started(ex: cf.Executor, gate: Path, tmp_path: Path) -> None:
    markers = [tmp_path / f"mapped-{i}" for i in range(3)]
    results = ex.map(step, [str(gate), None, None, None], [None, *map(str, markers)], timeout=0.2)
    with pytest.raises(TimeoutError):
        next(results)  # the gate is closed: the first call cannot finish in time
    gate.touch()
    after_the_queue(ex.submit)
    assert not any(m.exists() for m in markers)


def test_a_submitted_bound_method_does_not_keep_its_object_alive(ex: cf.Executor) -> None:
    obj = Counter()
    ref = weakref.ref(obj)
    assert ex.submit(obj.bump, 2).result(timeout=15) == 2
    assert list(ex.map(obj.bump, [1, 2])) == [1, 2]
    del obj
    wait_until(lambda: gc.collect() >= 0 and ref() is None, what="the object to be freed")


@pytest.mark.parametrize("kind", ["ProcessPoolExecutor", "tidepool"])
def test_map_refuses_a_chunksize_below_one(kind: str, request: pytest.FixtureRequest) -> None:
    # ThreadPoolExecutor ignores chunksize; ProcessPoolExecutor, which uses it, checks it
    if kind == "ProcessPoolExecutor":
        executor: cf.Executor = cf.ProcessPoolExecutor(max_workers=1)
    else:
        executor = request.getfixturevalue("client").get_executor()
    try:
        for bad in (0, -1):
            with pytest.raises(ValueError, match="chunksize"):
                executor.map(identity, [1], chunksize=bad)
        assert list(executor.map(identity, [1, 2], chunksize=5)) == [1, 2]
    finally:
        executor.shutdown(wait=True)


# ==== part 2: Dask's cancel semantics (tidepool) ======================================================
def test_client_cancel_cancels_pending_running_and_finished_futures(client: tidepool.Client, gate: Path) -> None:
    finished = client.submit(identity, "finished")
    assert finished.result(timeout=15) == "finished"
    running = occupy_the_slot(client, gate)
    pending = client.submit(identity, "pending")
    client.cancel([finished, running, pending])
    for f in (finished, running, pending):
        assert f.cancelled() and f.done() and f.status == "cancelled"
        with pytest.raises(cf.CancelledError):
            f.result(timeout=5)
    assert not cf.wait([finished, running, pending], timeout=10).not_done
    client.cancel(finished)  # a single future, and again: no error


def test_cancelling_a_future_cancels_the_futures_that_depend_on_it(
    client: tidepool.Client, gate: Path, tmp_path: Path
) -> None:
    a = client.submit(gated, str(gate), 1)
    b = client.submit(inc, a)
    c = client.submit(inc, b)
    client.cancel(a)
    assert b.cancelled() and c.cancelled()  # at once, when cancel returns
    with pytest.raises(cf.CancelledError):
        c.result(timeout=5)
    # a running call cannot be interrupted: its slot is busy until it returns (its result is dropped)
    gate.touch()
    # the same rule for the standard-library form, on a task that has not started
    second_gate = tmp_path / "second-gate"
    try:
        blocker = occupy_the_slot(client, second_gate)
        d = client.submit(identity, 1)
        e = client.submit(inc, d)
        assert d.cancel() is True
        assert e.cancelled()
    finally:
        second_gate.touch()
    assert blocker.result(timeout=15) == "blocker"
    assert client.submit(inc, 1).result(timeout=15) == 2


def test_gather_and_await_of_a_cancelled_future_raise_cancelled_error(client: tidepool.Client, gate: Path) -> None:
    ok = client.submit(identity, 1)
    f = client.submit(gated, str(gate), 2)
    client.cancel(f)
    with pytest.raises(cf.CancelledError):
        client.gather([ok, f], timeout=15)
    assert client.gather([ok, f], errors="skip", timeout=15) == [1]

    async def main() -> Any:
        return await f

    with pytest.raises(cf.CancelledError):
        asyncio.run(main())


def test_cancelling_is_per_client(cluster: tidepool.LocalCluster, client: tidepool.Client, gate: Path) -> None:
    with tidepool.Client(cluster) as other:
        mine = client.submit(gated, str(gate), 5, key="shared-by-two-clients")
        theirs = other.submit(gated, str(gate), 5, key="shared-by-two-clients")
        client.cancel(mine)
        assert mine.cancelled() and not theirs.done()
        gate.touch()
        assert theirs.result(timeout=15) == 5


def test_running_is_learned_from_the_scheduler_and_then_cancel_is_refused(client: tidepool.Client, gate: Path) -> None:
    f = client.submit(gated, str(gate), 7)
    wait_until(f.running, what="the task to execute")
    assert f.cancel() is False and f.running()
    gate.touch()
    assert f.result(timeout=15) == 7 and not f.running()


def test_a_dropped_client_future_with_a_callback_lives_until_done(
    cluster: tidepool.LocalCluster, client: tidepool.Client, gate: Path
) -> None:
    occupy_the_slot(client, gate)
    fired = threading.Event()
    got: list[Any] = []

    def cb(f: cf.Future[Any]) -> None:
        got.append(f.result(timeout=10))  # a callback may fetch the value
        fired.set()

    keys: list[str] = []
    f = client.submit(identity, "kept")
    keys.append(f.key)
    f.add_done_callback(cb)
    del f
    gc.collect()
    gate.touch()
    assert fired.wait(20) and got == ["kept"]
    # kept only until done: then it is released like any dropped future
    wait_until(lambda: gc.collect() >= 0 and keys[0] not in scheduler_keys(cluster),
               what="the scheduler to forget the key once the future is done and dropped")  # fmt: skip


def test_releasing_a_pending_future_cancels_it(client: tidepool.Client, gate: Path) -> None:
    f = client.submit(gated, str(gate), 1)
    f.release()
    assert f.cancelled()  # it used to stay pending for ever: no report reaches a released key
    with pytest.raises(cf.CancelledError):
        f.result(timeout=5)


def test_client_shutdown_keeps_the_executor_contract(cluster: tidepool.LocalCluster, gate: Path) -> None:
    c = tidepool.Client(cluster)
    try:
        blocker = occupy_the_slot(c, gate)
        queued = c.submit(identity, 1)
        stopper = threading.Thread(target=c.shutdown, kwargs={"wait": True, "cancel_futures": True})
        stopper.start()
        wait_until(queued.cancelled, what="shutdown to cancel the queued future")
        assert stopper.is_alive()
        gate.touch()
        stopper.join(timeout=20)
        assert not stopper.is_alive() and c.closed
        assert blocker.done() and not blocker.cancelled() and blocker.exception() is None
    finally:
        c.close()


def test_a_future_made_from_a_key_and_a_client_reattaches_as_in_dask(client: tidepool.Client) -> None:
    """Before: ``Future(key, client)`` was never registered with the client, so its ``result()``
    waited for ever (and ``result(timeout=)`` raised an AttributeError)."""
    held = client.submit(identity, 42, key="reattach-answer")
    assert held.result(timeout=30) == 42
    again: tidepool.Future[int] = tidepool.Future("reattach-answer", client)
    assert again is held and again.result(timeout=30) == 42  # the client's one future of the key
    unknown: tidepool.Future[int] = tidepool.Future("reattach-never-submitted", client)
    with pytest.raises(tidepool.TaskCancelledError):  # said, not waited for
        unknown.result(timeout=30)


def test_a_cancelled_call_still_running_keeps_its_slot_so_new_work_goes_to_the_idle_worker(tmp_path: Path) -> None:
    """Before: cancelling a running task freed its slot in the scheduler at once, though the call ran
    on (a thread cannot be stopped); of the next two tasks one queued behind it while the other
    worker idled, and waited until the call returned."""
    gate = tmp_path / "gate"
    with tidepool.LocalCluster(n_workers=2, slots=1) as cluster, tidepool.Client(cluster) as client:
        state = cluster.scheduler.state
        blocker = client.submit(gated, str(gate), "blocker", 300.0)
        wait_until(blocker.running, what="the blocker executing")
        where = state.tasks[blocker.key].worker
        assert where is not None
        client.cancel([blocker])
        wait_until(lambda: blocker.key in state.workers[where].abandoned, what="the abandoned run counted")
        # the gate is shut: a task queued behind the cancelled call would not finish before it opens
        assert client.gather(client.map(inc, [1, 2]), timeout=120) == [2, 3]
        assert not gate.exists()
        gate.touch()  # the call returns; its worker says so and has its slot back
        wait_until(lambda: not state.workers[where].abandoned, 60, what="the ended run reported")
        assert client.submit(inc, 3).result(timeout=60) == 4


def test_exception_with_a_timeout_says_what_the_task_waits_for(client: tidepool.Client, gate: Path) -> None:
    """Before: ``exception(timeout=)`` raised a TimeoutError with an empty message."""
    blocked = occupy_the_slot(client.get_executor(), gate)
    with pytest.raises(TimeoutError, match="running") as info:
        blocked.exception(timeout=0.2)
    assert str(info.value)
    gate.touch()
    assert blocked.exception(timeout=30) is None


def test_a_key_can_be_given_to_another_task_right_after_its_last_future_is_dropped(client: tidepool.Client) -> None:
    """Found by a bug hunt: the second submit failed with KeyCollisionError, though docs/errors.md
    says to release the first future before reusing its key, which dropping it does."""
    first = client.submit(identity, 1, key="reused-key")
    assert first.result(timeout=30) == 1
    del first
    second = client.submit(identity, 2, key="reused-key")
    assert second.result(timeout=30) == 2


def test_an_argument_nested_deeper_than_the_walks_used_to_reach_runs(client: tidepool.Client) -> None:
    """Found by a bug hunt: an argument nested about 500 deep (pickle takes more) failed submit
    with a RecursionError from the walk that swaps futures for refs."""
    inner = client.submit(identity, 41)
    arg: Any = inner
    depth = 600  # past the old walks' limit, within what the pickler takes from a test's stack
    for _ in range(depth):
        arg = (arg,)
    out = client.submit(identity, arg).result(timeout=60)
    for _ in range(depth):
        (out,) = out
    assert out == 41
