"""Persisting the scheduler state per tick and rebuilding it after a restart (no sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

from tidepool.scheduler import events as ev
from tidepool.scheduler.audit import validate
from tidepool.scheduler.recovery import Durability, Persister
from tidepool.scheduler.state import SchedulerState
from tidepool.scheduler.store import StateStore
from tidepool.testing import FakeClock, StateDriver

TOKEN = "k" * 32


def _durable_driver(tmp_path: Path) -> tuple[StateDriver, Persister, StateStore]:
    store = StateStore(tmp_path, TOKEN)
    d = StateDriver(SchedulerState(no_worker_timeout=None), FakeClock())
    p = Persister(store, d.state)
    d.observers.append(p.observe)
    return d, p, store


def _tick(d: StateDriver) -> None:
    d.send(ev.Tick(d.clock.advance(0.5)))


def _chain_graph(n: int) -> list[tuple[str, list[str]]]:
    """``n`` independent pairs: ``a-i`` then ``b-i`` needing it."""
    return [t for i in range(n) for t in ((f"a-{i}", []), (f"b-{i}", [f"a-{i}"]))]


def _restart(tmp_path: Path, **kw: float) -> tuple[Durability, StateDriver]:
    dur = Durability(str(tmp_path), TOKEN, **kw)
    st = SchedulerState(no_worker_timeout=None)
    d = StateDriver(st, FakeClock(100.0))
    dur.restore(st, d.clock())
    d.observers.append(dur.observe)  # as the server subscribes it
    return dur, d


def test_a_tick_persists_outcomes_and_forgets_released_tasks(tmp_path: Path) -> None:
    d, p, store = _durable_driver(tmp_path)
    d.add_worker("w1", {"cpu": 4.0})
    d.submit(_chain_graph(3), [f"b-{i}" for i in range(3)])
    d.finish("w1", "a-0")
    d.finish("w1", "b-0")
    d.fail("w1", "a-1", "broken")
    _tick(d)
    store.drain()
    snap = store.load()
    status = {t.key: t.status for t in snap.tasks}
    assert status["b-0"] == "m" and status["a-1"] == "e" and status["b-1"] == "e"
    assert status["a-2"] == "p" and status["b-2"] == "p"
    assert snap.wants == {"c": ["b-0", "b-1", "b-2"]} or sorted(snap.wants["c"]) == ["b-0", "b-1", "b-2"]
    assert next(t for t in snap.tasks if t.key == "b-0").holders == ["w1"]
    d.release(["b-0", "b-1"])  # their records (and their inputs') leave the store
    _tick(d)
    store.drain()
    snap = store.load()
    assert sorted(t.key for t in snap.tasks) == ["a-2", "b-2"]
    assert sorted(snap.wants["c"]) == ["b-2"]
    store.close()


def test_a_restart_waits_for_its_workers_then_counts_held_values_as_finished(tmp_path: Path) -> None:
    d, p, store = _durable_driver(tmp_path)
    d.add_worker("w1", {"cpu": 1.0})
    d.add_worker("w2", {"cpu": 1.0})
    d.submit(_chain_graph(4), [f"b-{i}" for i in range(4)])
    for wid in ("w1", "w2"):
        for key in list(d.running[wid]):
            d.finish(wid, key)  # an a-i on each worker
    held = {w: sorted(k for k, ts in d.state.tasks.items() if w in ts.who_has) for w in ("w1", "w2")}
    running = {w: list(d.running[w]) for w in ("w1", "w2")}  # b-i now executing there
    assert all(held.values()) and all(running.values())
    _tick(d)
    store.close()  # the scheduler dies here

    dur, d2 = _restart(tmp_path, recovery_wait=30.0)
    st = d2.state
    assert not dur.gate_open
    assert st.restored_at is not None  # known before any worker can rejoin (not at the next tick)
    assert sorted(st.clients["c"]) == [f"b-{i}" for i in range(4)]
    # w1 comes back first: it holds values and runs a task, but is given nothing new yet
    d2.send(ev.WorkerJoin("w1", "tcp://w1:1", {"cpu": 1.0}, d2.clock(), ready=False),
            ev.WorkerRejoin("w1", [(k, 8) for k in held["w1"]], running["w1"], [], d2.clock()))  # fmt: skip
    assert d2.send(*dur.worker_joined("w1", d2.clock())) == []  # w2 is still expected
    assert not any(isinstance(c, ev.Execute) for c in d2.log), "nothing runs before the workers are back"
    d2.send(ev.WorkerJoin("w2", "tcp://w2:1", {"cpu": 1.0}, d2.clock(), ready=False),
            ev.WorkerRejoin("w2", [(k, 8) for k in held["w2"]], running["w2"], [], d2.clock()))  # fmt: skip
    opened = dur.worker_joined("w2", d2.clock())
    d2.send(*opened)
    assert dur.gate_open
    report = next(e for e in opened if isinstance(e, ev.RecoveryReport) and e.stage == "resumed")
    assert report.fields["adopted_running"] == sum(map(len, running.values())) and report.fields["workers_missing"] == []
    executed = [c.key for c in d2.log if isinstance(c, ev.Execute)]
    assert not set(executed) & set(held["w1"] + held["w2"] + running["w1"] + running["w2"]), executed
    for w in ("w1", "w2"):
        for key in running[w]:
            assert st.tasks[key].state == "running" and st.tasks[key].worker == w
            d2.finish(w, key)  # the result of a task that kept running is accepted
            assert st.tasks[key].state == "memory"
    d2.run_until_idle()
    assert all(st.tasks[f"b-{i}"].state == "memory" for i in range(4))
    st.validate()
    dur.close()


def test_values_whose_holder_never_returns_are_recomputed_after_the_wait(tmp_path: Path) -> None:
    d, p, store = _durable_driver(tmp_path)
    d.add_worker("w1", {"cpu": 1.0})
    d.submit([("a-0", []), ("b-0", ["a-0"])], ["b-0"])
    d.finish("w1", "a-0")
    _tick(d)
    store.close()
    dur, d2 = _restart(tmp_path, recovery_wait=5.0)
    d2.send(ev.WorkerJoin("w9", "tcp://w9:1", {"cpu": 1.0}, d2.clock(), ready=False))
    assert d2.send(*dur.worker_joined("w9", d2.clock())) == []
    assert d2.send(*dur.on_tick(d2.clock.advance(1.0))) == []  # still waiting for w1
    d2.send(*dur.on_tick(d2.clock.advance(5.0)))
    assert dur.gate_open
    assert [c.key for c in d2.log if isinstance(c, ev.Execute)] == ["a-0"]  # recomputed on w9
    d2.send(*dur.on_tick(d2.clock.advance(0.5)))  # the next tick's flush
    dur.close()
    dur2, _ = _restart(tmp_path)
    assert dur2.expected == {"w9"}, "a worker that never came back is not waited for again"
    dur2.close()


def test_errors_come_back_without_running_again(tmp_path: Path) -> None:
    d, p, store = _durable_driver(tmp_path)
    d.add_worker("w1")
    d.submit([("a-0", []), ("b-0", ["a-0"])], ["b-0"])
    d.fail("w1", "a-0", "it broke")
    _tick(d)
    store.close()
    dur, d2 = _restart(tmp_path)
    ts = d2.state.tasks["b-0"]
    assert ts.state == "erred" and ts.message == "it broke" and ts.error_origin == "a-0"
    dur.close()


def test_restored_clients_that_do_not_come_back_are_released(tmp_path: Path) -> None:
    d, p, store = _durable_driver(tmp_path)
    d.submit([("x-0", [])], ["x-0"], client="client-7")
    _tick(d)
    store.close()
    dur, d2 = _restart(tmp_path, reconnect_window=60.0)
    assert "x-0" in d2.state.tasks
    d2.send(*dur.on_tick(d2.clock.advance(30.0)))
    assert "x-0" in d2.state.tasks
    d2.send(*dur.on_tick(d2.clock.advance(31.0)))
    assert "x-0" not in d2.state.tasks
    assert not dur.claim_client("client-7")  # too late to claim it
    dur.close()


def test_setup_hooks_are_stored_at_the_next_tick_and_given_back_at_a_restart(tmp_path: Path) -> None:
    from tidepool.comm.serialize import serialize

    dur, d = _restart(tmp_path)  # a fresh durable scheduler
    dur.record_setup("one", serialize("spec-1"))
    dur.record_setup("two", serialize("spec-2"))
    dur.close()  # the last tick's batch is flushed at close; a crash before a tick would lose it
    dur2, _ = _restart(tmp_path)
    assert [(n, blob.load()) for n, blob in dur2.setups] == [("one", "spec-1"), ("two", "spec-2")]
    dur2.forget_setup("one")  # client.unregister_setup: workers joining after the next restart skip it
    dur2.record_setup("three", serialize("spec-3"))
    dur2.close()
    dur3, _ = _restart(tmp_path)
    assert [(n, blob.load()) for n, blob in dur3.setups] == [("two", "spec-2"), ("three", "spec-3")]
    dur3.close()


def test_fire_and_forget_tasks_wanted_by_no_client_are_kept_and_run_after_a_restart(tmp_path: Path) -> None:
    from tidepool.scheduler.state import FIRE_AND_FORGET

    d, p, store = _durable_driver(tmp_path)
    d.submit(_chain_graph(2), ["b-0", "b-1"], client="client-3")
    d.send(ev.FireAndForget(["b-0"], d.clock()))
    d.send(ev.ClientGone("client-3", d.clock()))  # nobody holds a future of b-0 any more; b-1 goes
    assert set(d.state.tasks) == {"a-0", "b-0"}
    _tick(d)
    store.drain()
    assert store.load().wants == {FIRE_AND_FORGET: ["b-0"]}
    store.close()  # the scheduler dies before any worker ran them

    dur, d2 = _restart(tmp_path)
    st = d2.state
    assert set(st.tasks) == {"a-0", "b-0"} and FIRE_AND_FORGET in st.tasks["b-0"].wanted_by
    assert dur.restored_clients == {}  # not a client that must reconnect
    d2.add_worker("w1")
    d2.run_until_idle()
    for key in ("a-0", "b-0"):
        assert [c.key for c in d2.log if isinstance(c, ev.Execute) and c.key == key] == [key]
        d2.finish("w1", key)
        d2.run_until_idle()
    assert st.tasks == {}, "run to the end, then forgotten as before the restart"
    d2.send(*dur.on_tick(d2.clock.advance(0.5)), ev.Tick(d2.clock()))
    dur.close()
    left = StateStore(tmp_path, TOKEN)
    snap = left.load()
    assert snap.tasks == [] and snap.wants == {}, "their rows and the want leave the store"
    left.close()


def test_the_cost_meter_is_stored_at_the_next_tick_and_given_back_at_a_restart(tmp_path: Path) -> None:
    dur, d = _restart(tmp_path)
    assert dur.cost is None
    dur.record_cost({"spent": 3.0, "open": [["worker", "w1", 2.0]], "at": 99.0, "wall": 5000.0})
    d.send(ev.Tick(d.clock.advance(0.5)))  # the tick's flush
    dur.store.drain()
    dur.store.close()  # dies after that tick
    dur2, _ = _restart(tmp_path)
    assert dur2.cost == {"spent": 3.0, "open": [["worker", "w1", 2.0]], "at": 99.0, "wall": 5000.0}
    dur2.close()


def test_an_observer_that_subscribes_after_a_restart_still_sees_its_recovery_reports(tmp_path: Path) -> None:
    """The "loaded" report of a scheduler restarted from its state directory comes with its first
    tick, which can run before the command line attaches its journal: a late observer gets the
    reports applied before it subscribed (the restart test found a journal without "loaded")."""
    from tidepool.scheduler.server import Scheduler

    s = Scheduler(state_dir=str(tmp_path / "state"))
    try:
        report = ev.RecoveryReport("loaded", {"tasks": 3, "finished": 2}, 0.0)
        asyncio.run(s.apply([ev.Tick(0.0, 0.0), report]))
        seen: list[ev.Event] = []
        s.subscribe(lambda events, cmds: seen.extend(events))
        assert seen == [report]
        asyncio.run(s.apply([ev.Tick(1.0, 0.0)]))
        assert seen[1:] == [ev.Tick(1.0, 0.0)]  # later batches as usual, the report not again
    finally:
        assert s.durable is not None
        s.durable.close()


def _restored_with_a_worker_holding(keys: list[str]) -> StateDriver:
    d = StateDriver()
    d.send(ev.RecoveryReport("loaded", {}, d.clock()))  # a scheduler restarted from its store
    d.add_worker("w1")
    d.log.clear()
    d.send(ev.WorkerRejoin("w1", [(k, 100) for k in keys], [], [], d.clock()))
    return d


def _executed(d: StateDriver) -> list[str]:
    return [c.key for c in d.log if isinstance(c, ev.Execute)]


def _freed(d: StateDriver) -> list[str]:
    return [k for c in d.log if isinstance(c, ev.Free) for k in c.keys]


def test_a_graph_resent_after_the_workers_rejoined_finds_their_values_and_runs_nothing_again() -> None:
    # found by a bug hunt: a graph submitted < 0.5 s before a kill was not stored yet; the workers
    # rejoined first, their values of its keys were freed, and the resent graph ran them again
    d = _restored_with_a_worker_holding(["a", "c"])
    assert _freed(d) == []  # kept for the graph that names them
    d.submit([("a", []), ("b", ["a"])], ["b"])
    assert d.state.tasks["a"].state == "memory" and _executed(d) == ["b"]
    assert d.state.counters.get("recovered") == 1
    d.clock.advance(121.0)
    d.send(ev.Tick(d.clock()))  # "c" was never claimed: freed on its worker after UNCLAIMED_KEEP
    assert _freed(d) == ["c"] and not d.state.unclaimed


def test_a_graph_resent_after_the_workers_rejoined_takes_their_runs_and_runs_nothing_twice() -> None:
    # found by a bug hunt: tasks started less than a tick before a kill ran twice when the workers
    # rejoined before the client resent their graph (their runs of unknown keys were freed)
    d = StateDriver()
    d.send(ev.RecoveryReport("loaded", {}, d.clock()))
    d.add_worker("w1")
    d.log.clear()
    d.send(ev.WorkerRejoin("w1", [], ["run", "done-first"], ["queued"], d.clock()))
    assert _freed(d) == []  # kept for the graph that names them
    d.finish("w1", "done-first", nbytes=30)  # one ends before the graph is back: its value is kept
    assert _freed(d) == [] and "done-first" in d.state.unclaimed
    d.submit([("run", []), ("queued", []), ("done-first", []), ("total", ["run", "queued", "done-first"])],
             ["total"])  # fmt: skip
    assert _executed(d) == []  # nothing sent again: "total" waits for the runs
    assert d.state.tasks["run"].state == "running" and d.state.tasks["run"].executing
    assert d.state.tasks["queued"].state == "running" and not d.state.tasks["queued"].executing
    assert d.state.tasks["done-first"].state == "memory"
    validate(d.state)
    d.finish("w1", "run")
    d.finish("w1", "queued")
    assert _executed(d) == ["total"]
    d.run_until_idle()
    assert d.status()["total"] == "memory"
    # a review: the same worker rejoining again (it dropped before a tick) kept no entry and was
    # told to free the run, and the claim then waited on a run that had stopped
    d.send(ev.WorkerRejoin("w1", [], [], ["again"], d.clock()))
    d.send(ev.WorkerRejoin("w1", [], [], ["again"], d.clock()))
    assert "again" not in _freed(d) and d.state.unclaimed_runs["again"][0] == "w1"
    d.start("w1", "again")  # it left the queue for a slot before the graph came back
    d.submit([("again", [])], ["again"])
    assert d.state.tasks["again"].state == "running" and d.state.tasks["again"].executing
    d.finish("w1", "again")
    # a worker that leaves takes its parked runs with it: the graph then computes them anew
    d.send(ev.WorkerRejoin("w1", [], ["lost"], [], d.clock()))
    d.add_worker("w2")
    d.remove_worker("w1")
    assert "lost" not in d.state.unclaimed_runs
    d.log.clear()
    d.submit([("lost", [])], ["lost"])
    assert _executed(d) == ["lost"]
    d.run_until_idle()
    d.add_worker("w1")
    # a run no graph claims is freed (stopped) on its worker after UNCLAIMED_KEEP
    d.send(ev.WorkerRejoin("w1", [], ["orphan"], [], d.clock()))
    d.clock.advance(121.0)
    d.send(ev.Tick(d.clock()))
    assert "orphan" in _freed(d) and not d.state.unclaimed_runs


def test_a_kept_value_nothing_wants_is_freed_and_a_scheduler_not_restored_frees_unknown_keys_at_once() -> None:
    d = _restored_with_a_worker_holding(["a"])
    d.submit([("a", [])], [])  # named, but wanted by nobody
    assert "a" in _freed(d)
    plain = StateDriver()  # a worker reconnecting after a network blip: unknown keys were released here
    plain.add_worker("w1")
    plain.send(ev.WorkerRejoin("w1", [("gone", 100)], [], [], plain.clock()))
    assert _freed(plain) == ["gone"] and not plain.state.unclaimed


def test_a_reconnecting_clients_resync_releases_what_it_released_just_before_the_kill(tmp_path: Path) -> None:
    # found by a bug hunt: futures released ~0.1 s before a kill came back: the store (written per
    # tick) still had them as wanted, and the resync only ever added wants, so they were computed
    # again and held for good
    d, p, store = _durable_driver(tmp_path)
    d.add_worker("w1")
    keys = [f"a-{i}" for i in range(4)]
    d.submit([(k, []) for k in keys], keys)
    d.run_until_idle()
    _tick(d)  # stored: c wants all four
    d.release(["a-1"])  # reaches the scheduler, which dies before its next tick
    store.close()
    dur, d2 = _restart(tmp_path)
    assert sorted(d2.state.clients["c"]) == keys  # the store's wants are one release behind
    d2.send(ev.UpdateGraph("c", [], ["a-0", "a-2", "a-3"], d2.clock(), exact=True))  # the client's resync
    assert sorted(d2.state.clients["c"]) == ["a-0", "a-2", "a-3"]
    a1 = d2.state.tasks.get("a-1")
    assert a1 is None or not a1.needed  # nobody wants it: not computed again, not held
    d2.send(ev.UpdateGraph("c", [], ["a-0"], d2.clock()))  # a plain update only adds
    assert sorted(d2.state.clients["c"]) == ["a-0", "a-2", "a-3"]
    dur.close()


def test_the_resync_a_reconnecting_client_sends_names_every_key_it_holds_as_exact() -> None:
    import threading
    from collections import deque
    from types import SimpleNamespace

    from tidepool.client.reconnect import _resync
    from tidepool.comm.messages import UpdateGraph

    conn = SimpleNamespace(recent_graphs=deque(), lock=threading.Lock(),
                           core=SimpleNamespace(futures={"a-0": object(), "a-2": object()}))
    msg = UpdateGraph.decode(_resync(conn))  # type: ignore[arg-type]
    assert msg.exact and sorted(msg.wanted) == ["a-0", "a-2"]
    assert not UpdateGraph.decode(UpdateGraph([], ["x"]).encode()).exact  # ordinary updates only add


def test_a_retirement_asked_again_after_a_restart_waits_for_its_worker_to_rejoin(tmp_path: Path) -> None:
    """A client's retire_workers() cut by a kill is asked again as the client reconnects, which
    is often before the worker rejoins: it was answered "unknown worker" and the worker stayed
    (found by a bug hunt).  It now waits for a worker of the last run to come back."""
    from tidepool.scheduler.server import Scheduler

    s = Scheduler(state_dir=str(tmp_path / "state"))
    assert s.durable is not None
    s.durable.expected = {"w1"}  # as restored: w1 was registered at the last flush
    s.durable.expected_at = {"tcp://w1:1": "w1"}
    seen: list[ev.Event] = []
    s.subscribe(lambda events, cmds: seen.extend(events))

    async def main() -> bool:
        asked = asyncio.ensure_future(s.retire_workers(["tcp://w1:1", "nobody"]))  # by address, too
        for _ in range(5):
            await asyncio.sleep(0)
        waited = not asked.done()
        await s.apply([ev.WorkerJoin("w1", "tcp://w1:1", {"cpu": 1.0}, s.clock())])
        for _ in range(5):
            await asyncio.sleep(0)
        assert any(isinstance(e, ev.RetireWorkers) and e.workers == ["w1"] for e in seen)
        asked.cancel()
        return waited

    try:
        assert asyncio.run(main())
    finally:
        s.durable.close()


_HOOK_GATE = threading.Event()
_HOOK_RUNS: list[int] = []


def _gated_hook() -> None:
    _HOOK_RUNS.append(threading.get_ident())
    _HOOK_GATE.wait(30)


def test_a_rejoining_worker_is_sent_the_setups_it_has_not_run_to_their_end(tmp_path: Path) -> None:
    """A review found a worker that lost its scheduler during its setups rejoined as ready without
    the rest of them, and one that was away while a setup was registered never got it (rejoining
    workers were sent no setups).  A worker records each setup it ran to its end; the scheduler
    sends a rejoining worker the others.  The hook cut off is waited for, never run twice at once,
    and not again when it ended well."""
    import cloudpickle

    from tidepool.comm.serialize import serialize
    from tidepool.errors import CommError
    from tidepool.scheduler.server import _setups_missed
    from tidepool.setup import SetupSpec, setup_digest
    from tidepool.worker.jobs import SetupRuns, apply_setups

    gate, runs_of = _HOOK_GATE, _HOOK_RUNS
    a = serialize(SetupSpec("a", fn=cloudpickle.dumps(_gated_hook)))
    b = serialize(SetupSpec("b", env={"TP_SETUP_B": "1"}))
    digests = {"a": setup_digest(a), "b": setup_digest(b)}
    assert _setups_missed({"a": a, "b": b}, digests, {"a": setup_digest(a)}) == [["b", b]]
    assert _setups_missed({"a": a, "b": b}, digests, {"a": "another version"}) == [["a", a], ["b", b]]
    assert _setups_missed({"a": a}, digests, None) == [["a", a]]  # a worker that does not say: all of them

    class Conn:
        closed = False
        sent: list[dict[str, object]] = []

        async def send(self, msg: dict[str, object]) -> None:
            self.sent.append(msg)

    async def main() -> SetupRuns:
        runs, conn = SetupRuns(), Conn()
        first = asyncio.ensure_future(apply_setups(conn, [["a", a], ["b", b]], tmp_path, True, runs))  # type: ignore[arg-type]
        while not runs_of:
            await asyncio.sleep(0.01)
        conn.closed = True  # the scheduler is lost while "a" runs
        try:
            await first
            raise AssertionError("apply_setups went on without its scheduler")
        except CommError:
            pass
        assert runs.ran == {} and runs.running is not None
        conn.closed = False  # rejoined: the scheduler sends what did not run to its end
        again = asyncio.ensure_future(apply_setups(conn, [["a", a], ["b", b]], tmp_path, False, runs))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert len(runs_of) == 1, "the hook ran again while its first run went on"
        gate.set()
        assert await again
        return runs

    runs = asyncio.run(main())
    # the cut-off run ended well: recorded, and not run a second time (a third review)
    assert len(runs_of) == 1 and runs.ran == {"a": setup_digest(a), "b": setup_digest(b)}


def test_a_rejoining_worker_sent_missed_setups_is_given_no_task_in_its_join() -> None:
    """A review: the join of a worker sent setups it missed placed tasks on it in its own batch,
    before it was marked preparing (they waited behind the setups while other workers idled)."""
    from tidepool.comm.serialize import serialize
    from tidepool.scheduler.server import Scheduler
    from tidepool.setup import SetupSpec

    class FakeWorker:
        """A worker connection: its register message, then silence (it is running the setups)."""

        info = {"role": "worker"}
        closed = False

        def __init__(self, register: dict[str, object]) -> None:
            self.inbox: list[dict[str, object]] = [register]
            self.sent: list[dict[str, object]] = []

        async def recv(self) -> dict[str, object]:
            if self.inbox:
                return self.inbox.pop(0)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(self, msg: dict[str, object]) -> None:
            self.sent.append(msg)

        def send_nowait(self, msg: dict[str, object]) -> bool:
            self.sent.append(msg)
            return True

        def recv_buffered(self, op: str) -> None:
            return None

    async def main() -> None:
        s = Scheduler("tcp://127.0.0.1:0", "t0ken")
        s._keep_setup("env", serialize(SetupSpec("env", env={"TP_X": "1"})))
        await s.apply([ev.UpdateGraph("c", [ev.TaskSpec(f"t-{i}", "f", None, (), {}, 0, "t") for i in range(4)],
                                      [f"t-{i}" for i in range(4)], s.clock())])  # fmt: skip
        conn = FakeWorker({"op": "register", "id": "w1", "address": "tcp://w1:1", "resources": {"cpu": 1},
                           "rejoin": {"setups": {}, "held": [], "running": [], "queued": []}})  # fmt: skip
        task = asyncio.ensure_future(s._handle_worker(conn))  # type: ignore[arg-type]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "w1" in s.state.workers:
                break
        try:
            if task.done():
                task.result()  # how it failed
            ws = s.state.workers["w1"]
            assert ws.preparing and not ws.processing, ws.processing  # the setup first, then tasks
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    asyncio.run(main())
