"""The worker shell's own bookkeeping around lanes and outcomes (``worker/server.py``), without
threads, sockets or a clock.

A :class:`Worker` is built but not started; its slot pool is a fake (:class:`FakePool`) whose lanes
the test moves by hand (which member the slot took, which ran long, which outcomes are done), its
loop a fake that records the timers set, and its outbox records what would go to the scheduler.
The events are fed in as the real shell feeds them (``_compute`` + ``_apply``, ``_on_done``,
``_watch``), so what is checked is the shell's code, driven by the real ``WorkerState``.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tidepool.comm.messages import TaskBatch
from tidepool.worker import state as ws
from tidepool.worker.executor import Outcome, WorkItem
from tidepool.worker.outbox import Outbox
from tidepool.worker.server import Worker


class FakePool:
    """A slot pool the test moves: lanes are lists of work items not taken yet, ``now`` the member
    each lane's slot runs; ``long`` the keys the pool would say run ``LONG``."""

    def __init__(self) -> None:
        self.lanes: dict[int, list[WorkItem]] = {}
        self.now: dict[int, str | None] = {}
        self.done: list[Outcome] = []
        self.long: set[str] = set()
        self.solo: list[str] = []  # keys given to a slot on their own (Run)

    def submit(self, item: WorkItem) -> None:
        self.solo.append(item.key)

    def submit_lane(self, lane_id: int, items: list[WorkItem]) -> None:
        self.lanes[lane_id] = list(items)
        self.now[lane_id] = None

    def take(self, lane_id: int) -> str:
        """The lane's slot takes its next member."""
        key = self.lanes[lane_id].pop(0).key
        self.now[lane_id] = key
        return key

    def end(self, lane_id: int) -> None:
        """The lane's slot found it empty: it ends."""
        assert not self.lanes[lane_id]
        del self.lanes[lane_id], self.now[lane_id]

    def unline(self, lane_id: int, keys: tuple[str, ...]) -> list[WorkItem]:
        items = self.lanes.get(lane_id, [])
        out = [w for w in items if w.key in keys]
        self.lanes[lane_id] = [w for w in items if w.key not in keys] if lane_id in self.lanes else []
        return out

    def running_long(self, seconds: float) -> list[str]:
        return [k for k in self.now.values() if k is not None and k in self.long]

    def members(self) -> list[str | None]:
        return list(self.now.values())

    def drain(self) -> list[Outcome]:
        out, self.done = self.done, []
        return out

    def stop(self) -> None:
        pass


class FakeLoop:
    """Records the timers set (``call_later``) instead of running them."""

    def __init__(self) -> None:
        self.timers: list[Callable[[], None]] = []

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.timers.append(fn)

    def fire(self) -> int:
        """Run the timers set so far; returns how many there were."""
        timers, self.timers = self.timers, []
        for fn in timers:
            fn()
        return len(timers)


class RecordingOutbox(Outbox):
    """Every report the shell adds (``sent``: all of them; ``batch``: those since the last flush);
    nothing is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = TaskBatch()
        self.flushed: list[TaskBatch] = []

    def add(self, kind: str, item: Any) -> None:
        super().add(kind, item)
        self.sent.add(kind, item)

    def soon(self) -> None:
        pass

    def flush(self) -> None:
        self.flushed.append(self.batch)
        self.batch = TaskBatch()


def f(*args: Any) -> int:
    return 1


@pytest.fixture
def worker() -> Iterator[Worker]:
    """A one-slot worker (not started) whose function ``f`` last ran in a millisecond: quick."""
    w = Worker("tcp://127.0.0.1:1", "token", slots=1, memory_limit=0)
    w.pool = FakePool()  # type: ignore[assignment]
    w.loop = FakeLoop()  # type: ignore[assignment]
    w.outbox = RecordingOutbox()
    w.closed = asyncio.Event()  # open (never set: the worker does not close here)
    w.functions["f"] = f
    w.state.last_run["f"] = 0.001
    try:
        yield w
    finally:
        shutil.rmtree(w.setup_dir, ignore_errors=True)


def pool(w: Worker) -> FakePool:
    assert isinstance(w.pool, FakePool)
    return w.pool


def compute(w: Worker, *keys: str, func: str = "f") -> None:
    """The scheduler assigns ``keys`` (no inputs), as ``_serve_scheduler`` handles ``compute``."""
    c = w._compute({"tasks": [{"key": k, "func": func, "resources": [["cpu", 1.0]]} for k in keys]})
    w._apply(w.state.handle(c))
    w._forget(tuple(t.key for t in c.tasks))


def finish(w: Worker, key: str, duration: float = 0.001) -> None:
    """``key`` returned in its slot; the loop wakes for it."""
    pool(w).done.append(Outcome(key, True, 1, duration))
    w._on_done()


def only_open(w: Worker) -> None:
    """The shell holds a spec or a taken-back work item only for tasks the state has not ended."""
    st = w.state
    open_keys = set(st.queued) | set(st.waiting) | set(st.running) | set(st.lined)
    assert set(w._specs) <= open_keys, (w._specs, open_keys)
    assert set(w._returned) <= open_keys, (w._returned, open_keys)


def reported(w: Worker) -> tuple[list[str], list[str]]:
    """Keys reported finished and erred so far."""
    assert isinstance(w.outbox, RecordingOutbox)
    return [item[0] for item in w.outbox.sent.finished], [e["key"] for e in w.outbox.sent.erred]


# ---- lanes cut -----------------------------------------------------------------------------------
def test_members_cut_from_a_lane_go_back_to_the_queue_in_their_order(worker: Worker) -> None:
    """The shell answered a cut with the members it took out as a set: they went back to the front
    of the queue in hash order, not in the order they were assigned (31 members: never by chance)."""
    w, p = worker, pool(worker)
    keys = [f"t{i:02d}" for i in range(ws.BATCH)]
    compute(w, *keys)
    (lane,) = p.lanes
    assert p.take(lane) == "t00"
    p.long.add("t00")
    w.loop.fire()  # type: ignore[attr-defined]  # the lane clock: t00 runs LONG, the rest is cut
    assert [t.key for t in w.state.queue] == keys[1:] and list(w._returned) == keys[1:]


# ---- specs of tasks cut from a lane ------------------------------------------------------------
def test_a_task_cut_from_its_lane_and_assigned_again_leaves_no_spec_behind(worker: Worker) -> None:
    """b and c are cut from a's lane (a runs long) and go back to the queue; the scheduler assigns
    them again while they wait there.  They run once, from their lane's work items; the new specs
    were left in ``_specs`` for ever (one per such task: arguments of finished tasks held)."""
    w, p = worker, pool(worker)
    compute(w, "a", "b", "c")
    (lane,) = p.lanes
    assert p.take(lane) == "a"
    p.long.add("a")
    w.loop.fire()  # type: ignore[attr-defined]  # the lane clock: a runs LONG, b and c are cut
    assert set(w._returned) == {"b", "c"} and [t.key for t in w.state.queue] == ["b", "c"]
    compute(w, "b", "c")  # assigned again while they wait
    only_open(w)
    finish(w, "a", 0.5)  # f is slow now: b runs alone, then c
    p.end(lane)
    assert p.solo == ["b"]
    finish(w, "b", 0.5)
    finish(w, "c", 0.5)
    assert p.solo == ["b", "c"] and reported(w) == (["a", "b", "c"], [])
    assert not w.state.running and not w.state.queued
    only_open(w)
    assert w._specs == {} and w._returned == {}


def test_cut_cancelled_or_stolen_lane_members_leave_no_spec_behind(worker: Worker) -> None:
    """Every way a lane member's life ends here (it ran, was freed or stolen before its slot
    reached it, or was cut and then freed or stolen in the queue) leaves nothing in ``_specs``."""
    w, p = worker, pool(worker)
    compute(w, *"abcdef")
    (lane,) = p.lanes
    assert p.take(lane) == "a"
    w._apply(w.state.handle(ws.FreeKeys(("b",))))  # lined: taken out, never runs
    w._forget(("b",))
    w._apply(w.state.handle(ws.StealKeys(("c",))))
    only_open(w)
    p.long.add("a")
    w.loop.fire()  # type: ignore[attr-defined]  # cut: d, e and f back to the queue
    compute(w, "d", "e", "f")
    w._apply(w.state.handle(ws.FreeKeys(("d",))))
    w._forget(("d",))
    w._apply(w.state.handle(ws.StealKeys(("e",))))
    only_open(w)
    finish(w, "a", 0.5)
    p.end(lane)
    finish(w, "f", 0.5)
    assert p.solo == ["f"] and w.outbox.sent.stolen == ["c", "e"]  # type: ignore[attr-defined]
    assert reported(w) == (["a", "f"], [])
    assert w._specs == {} and w._returned == {} and not w._inline_wanted


# ---- one outcome whose handling fails --------------------------------------------------------
class Poison:
    """A result the test makes the shell choke on."""


@pytest.mark.parametrize("where", ["outcome", "store"])
def test_an_outcome_whose_handling_raises_is_reported_erred_and_the_others_of_its_wake_up_still_go(
        worker: Worker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str) -> None:  # fmt: skip
    """Three lane members return in one wake-up; handling b's outcome raises, either before the
    state hears of it (sizing its value) or after (storing it).  b is logged and reported erred
    with a clear message, a and c are reported finished, all in the wake-up's flush.  Before, the
    exception left ``_on_done``: c's outcome was lost (its task hung for ever) and nothing was
    flushed."""
    w, p = worker, pool(worker)
    compute(w, "a", "b", "c")
    (lane,) = p.lanes
    for k in "abc":
        assert p.take(lane) == k
        p.done.append(Outcome(k, True, Poison() if k == "b" else 1, 0.001))
    p.end(lane)
    if where == "outcome":
        from tidepool.worker import server

        real = server.sizeof
        monkeypatch.setattr(server, "sizeof", lambda v: 1 // 0 if isinstance(v, Poison) else real(v))
    else:
        real_store = w._store

        def store(key: str, value: Any, nbytes: int) -> None:
            if key == "b":
                raise OSError(28, "No space left on device")
            real_store(key, value, nbytes)

        monkeypatch.setattr(w, "_store", store)
    assert isinstance(w.outbox, RecordingOutbox)
    w.outbox.flushed.clear()
    with caplog.at_level("ERROR", "tidepool.worker"):
        w._on_done()
    assert reported(w) == (["a", "c"], ["b"])
    (err,) = w.outbox.sent.erred
    assert err["type"] == "RuntimeError" and "task 'b'" in err["message"]
    assert ("ZeroDivisionError" if where == "outcome" else "No space left") in err["message"]
    assert [r for r in caplog.records if "task b" in r.getMessage()]
    assert len(w.outbox.flushed) == 1 and not w.outbox.batch  # one flush for the wake-up, all in it
    assert not w.state.running and not w.state.lined and w.state.free["cpu"] == 1.0  # the slot is free
    w.state.validate()


# ---- the lane clock ----------------------------------------------------------------------------
def timers(w: Worker) -> int:
    """Fire the lane timers set; how many were set again by them."""
    loop = w.loop
    assert isinstance(loop, FakeLoop)
    loop.fire()
    return len(loop.timers)


def test_the_lane_clock_stops_while_only_a_seceded_lane_member_runs(worker: Worker) -> None:
    """a secedes from its lane (it waits on other tasks, maybe for minutes); b and c run in a new
    lane.  Once that lane ended, only a runs, which the state no longer watches: the timer is not
    set again (it fired every ``LONG / 2`` s for as long as a ran).  A new lane sets it again."""
    w, p = worker, pool(worker)
    compute(w, "a", "b", "c")
    (first,) = p.lanes
    assert len(w.loop.timers) == 1  # type: ignore[attr-defined]  # a lane opened: the clock runs
    assert p.take(first) == "a"
    w._apply(w.state.handle(ws.Secede("a")))  # as Worker.secede: its lane is cut, b and c go on
    second = max(p.lanes)
    assert second != first and [w.key for w in p.lanes[second]] == ["b", "c"] and p.lanes[first] == []
    assert timers(w) == 1  # the new lane's slot has not taken b yet
    p.long.add("a")  # a runs long: nothing to say (it seceded)
    assert p.take(second) == "b" and timers(w) == 1
    finish(w, "b")
    assert p.take(second) == "c"
    finish(w, "c")
    p.end(second)
    assert timers(w) == 0  # only a runs: the clock stops
    assert reported(w) == (["b", "c"], []) and w.outbox.sent.started == []  # type: ignore[attr-defined]
    compute(w, "d")  # a lane opens: the clock runs again
    assert len(w.loop.timers) == 1  # type: ignore[attr-defined]


def test_the_lane_clock_stops_while_only_a_member_reported_running_long_runs(worker: Worker) -> None:
    """x ran ``LONG``: it is reported started once and its lane cut; then it is not watched any
    more, and the timer is not set again while it runs on."""
    w, p = worker, pool(worker)
    compute(w, "x", "y")
    (lane,) = p.lanes
    assert p.take(lane) == "x"
    assert timers(w) == 1  # x runs, not long yet
    p.long.add("x")
    assert timers(w) == 0  # reported, its lane cut: nothing more to watch
    assert w.outbox.sent.started == ["x"] and p.lanes[lane] == []  # type: ignore[attr-defined]
    assert [t.key for t in w.state.queue] == ["y"]  # waits for x's slot
    finish(w, "x", 0.5)
    p.end(lane)
    assert p.solo == ["y"] and not w.loop.timers  # type: ignore[attr-defined]  # y is not quick: no lane


# ---- closing -------------------------------------------------------------------------------------
def test_an_outcome_arriving_while_the_worker_closes_is_dropped_not_handled(worker: Worker,
                                                                            caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Found by a bug hunt: a memory restart closed the store while a slot's outcome was still to be
    handled; handling it started the next queued task, which read its inputs from the emptied store
    (a KeyError logged as 'handling the outcome ... failed', and the task reported erred)."""
    w, p = worker, pool(worker)
    compute(w, "a")
    w.state.last_run["f"] = 1.0  # slow now: b runs on its own after a
    compute(w, "b")
    w._closing = True  # close() began: the store is being closed
    with caplog.at_level("ERROR", logger="tidepool.worker"):
        finish(w, "a")
    assert not [r for r in caplog.records if "handling the outcome" in r.getMessage()]
    assert p.solo == [] and reported(w) == ([], [])  # nothing more started, nothing reported
