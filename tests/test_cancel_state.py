"""Cancelling in the pure scheduler state (``ReleaseKeys(cancel=True)``), driven by ``StateDriver``.

The rules under test (docs/design.md, "Futures and cancellation"): cancelling is per client; the
client's futures of the cancelled keys and of every unfinished task downstream of them are reported
"cancelled"; tasks nobody else needs stop (a queued task is freed from its worker's queue, an
executing one's result is dropped) and their values are freed on every holder.  With
``unless_started`` (``Future.cancel``) an executing task is kept and reported "running", a finished
one is kept.
"""

from __future__ import annotations

from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver


def cancel(d: StateDriver, keys: list[str], client: str = "c", *, unless_started: bool = False) -> list[ev.Command]:
    return d.send(ev.ReleaseKeys(client, keys, d.clock(), cancel=True, unless_started=unless_started))


def reports(cmds: list[ev.Command], client: str = "c") -> dict[str, str]:
    return {c.key: c.status for c in cmds if isinstance(c, ev.Report) and c.client == client}


def frees(cmds: list[ev.Command]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for c in cmds:
        if isinstance(c, ev.Free):
            out.setdefault(c.worker, set()).update(c.keys)
    return out


def one_slot_worker(d: StateDriver) -> None:
    d.add_worker("w1", {"cpu": 1})


def test_a_queued_task_is_cancelled_freed_from_the_queue_and_forgotten() -> None:
    d = StateDriver(SchedulerState(queue_seconds=60.0), auto_start=False)  # workers queue deeply
    one_slot_worker(d)
    d.submit([("a", []), ("b", [])], ["a", "b"])
    assert d.running["w1"] == ["a", "b"]  # both sent: b queued behind a
    d.start("w1", "a")
    cmds = cancel(d, ["b"], unless_started=True)
    assert reports(cmds) == {"b": "cancelled"}
    assert frees(cmds) == {"w1": {"b"}}  # the worker drops it from its queue: it never runs
    assert "b" not in d.state.tasks and "b" not in d.state.clients["c"]
    d.state.validate()


def test_an_executing_task_is_kept_and_reported_running_unless_forced() -> None:
    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    d.submit([("a", [])], ["a"])
    d.start("w1", "a")
    cmds = cancel(d, ["a"], unless_started=True)
    assert reports(cmds) == {"a": "running"} and not frees(cmds)
    assert set(d.state.tasks["a"].wanted_by) == {"c"} and d.state.tasks["a"].state == "running"
    cmds = cancel(d, ["a"])  # Client.cancel: whatever the state
    assert reports(cmds) == {"a": "cancelled"} and frees(cmds) == {"w1": {"a"}}
    assert "a" not in d.state.tasks
    # the run ends anyway: its result is not taken, the worker is told to drop it, nobody hears of it
    finished = d.state.counters["finished"]
    cmds = d.finish("w1", "a")
    assert frees(cmds) == {"w1": {"a"}} and not reports(cmds)
    assert d.state.counters["finished"] == finished and "a" not in d.state.tasks
    d.state.validate()


def test_a_finished_task_is_kept_by_future_cancel_and_freed_by_client_cancel() -> None:
    d = StateDriver()
    one_slot_worker(d)
    d.submit([("a", [])], ["a"])
    d.step()
    assert d.state.tasks["a"].state == "memory"
    cmds = cancel(d, ["a"], unless_started=True)
    assert not cmds and d.state.tasks["a"].state == "memory"
    cmds = cancel(d, ["a"])
    assert reports(cmds) == {"a": "cancelled"} and frees(cmds) == {"w1": {"a"}}
    assert "a" not in d.state.tasks and not d.state.workers["w1"].has_what
    d.state.validate()


def test_unfinished_tasks_downstream_are_cancelled_with_their_input() -> None:
    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    # a -> b -> c, a -> d; the client holds futures of a, c and d (b is an intermediate)
    d.submit([("a", []), ("b", ["a"]), ("c", ["b"]), ("d", ["a"])], ["a", "c", "d"])
    cmds = cancel(d, ["a"], unless_started=True)
    assert reports(cmds) == {"a": "cancelled", "c": "cancelled", "d": "cancelled"}
    assert frees(cmds) == {"w1": {"a"}}
    assert d.state.tasks == {} and d.state.clients["c"] == set()
    d.state.validate()


def test_finished_downstream_tasks_keep_their_values() -> None:
    d = StateDriver()
    one_slot_worker(d)
    d.submit([("a", []), ("b", ["a"])], ["a", "b"])
    d.run_until_idle()
    d.submit([("c", ["a"])], ["c"])  # a later dependent, not finished yet
    cmds = cancel(d, ["a"])
    assert reports(cmds) == {"a": "cancelled", "c": "cancelled"}
    assert d.state.tasks["b"].state == "memory" and set(d.state.tasks["b"].wanted_by) == {"c"}
    d.state.validate()


def test_cancelling_is_per_client() -> None:
    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    d.submit([("a", []), ("b", ["a"])], ["a", "b"], client="c1")
    d.submit([("b", ["a"])], ["b"], client="c2")  # another client holds b (and so needs a)
    cmds = cancel(d, ["a"], client="c1")
    assert reports(cmds, "c1") == {"a": "cancelled", "b": "cancelled"}
    assert reports(cmds, "c2") == {} and not frees(cmds)
    assert set(d.state.tasks["b"].wanted_by) == {"c2"} and d.state.tasks["a"].state == "running"
    d.start("w1", "a")
    d.run_until_idle()
    assert d.state.tasks["b"].state == "memory"
    assert d.status("c2") == {"b": "memory"}
    assert "b" not in d.status("c1") or d.status("c1")["b"] == "cancelled"
    d.state.validate()


def test_a_key_the_client_does_not_hold_is_reported_cancelled_and_nothing_else_changes() -> None:
    d = StateDriver()
    one_slot_worker(d)
    d.submit([("a", [])], ["a"], client="other")
    cmds = cancel(d, ["a", "never-submitted"], client="c")
    assert reports(cmds, "c") == {"a": "cancelled", "never-submitted": "cancelled"}
    assert set(d.state.tasks["a"].wanted_by) == {"other"} and not frees(cmds)
    d.state.validate()


def test_a_replicated_value_is_freed_on_every_holder() -> None:
    d = StateDriver()
    d.add_worker("w1", {"cpu": 1})
    d.add_worker("w2", {"cpu": 1})
    d.submit([("a", [])], ["a"])
    d.step()
    holder = next(iter(d.state.tasks["a"].who_has))
    other = "w2" if holder == "w1" else "w1"
    d.send(ev.AddReplica(other, "a", 8, d.clock()))
    cmds = cancel(d, ["a"])
    assert frees(cmds) == {"w1": {"a"}, "w2": {"a"}}
    assert all(not w.has_what for w in d.state.workers.values())
    d.state.validate()


def test_a_plain_release_still_lets_dependents_run() -> None:
    d = StateDriver()
    one_slot_worker(d)
    d.submit([("a", []), ("b", ["a"])], ["a", "b"])
    cmds = d.release(["a"])
    assert not reports(cmds)
    d.run_until_idle()
    assert d.state.tasks["b"].state == "memory"
    d.state.validate()


def test_an_outcome_of_a_released_record_is_not_taken_for_the_new_record_under_its_key() -> None:
    """Found by a review: a task cancelled as it finished, and a different task submitted under the
    same key and placed on the same worker: the old run's "finished" (or "erred"), in flight when
    the worker got the free, was taken as the new task's outcome (171 of 400 tries gave the old
    value).  Each record has a serial the worker echoes; another serial's outcome is ignored, and no
    free is sent for it (the worker may be running the new record)."""
    d = StateDriver(auto_start=False)  # a quick task in a lane: "started" is never sent for it
    one_slot_worker(d)
    d.submit([("k", [])], ["k"])
    old = d.state.tasks["k"].run
    cancel(d, ["k"])  # while its "finished" is on the way
    d.submit([("k", [])], ["k"])
    new = d.state.tasks["k"]
    assert new.run != old and new.worker == "w1"
    for stale in (ev.TaskFinished("w1", "k", 8, 1.0, d.clock(), old),
                  ev.TaskErred("w1", "k", None, "", "ValueError", "old", 1.0, d.clock(), old)):  # fmt: skip
        cmds = d.send(stale)
        assert not [c for c in cmds if isinstance(c, ev.Free | ev.Report)], cmds
        assert new.state == "running" and new.worker == "w1"
    assert d.state.counters["stale_outcomes"] == 2
    cmds = d.send(ev.TaskFinished("w1", "k", 16, 0.5, d.clock(), new.run))
    assert reports(cmds) == {"k": "memory"} and new.nbytes == 16


def test_a_run_abandoned_for_one_record_still_holds_its_slot_when_another_takes_the_key() -> None:
    """Review: placing a new record under the key of a run still executing there counted that run as
    kept, so the worker looked free (the new task waits behind the old run on the worker) and was
    never stolen from while another worker idled."""
    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    for i in range(3):  # the group's tasks are quick: a worker queues them beyond its slot
        d.submit([(f"k-{i}", [])], [f"k-{i}"])
        d.start("w1", f"k-{i}")
        d.finish("w1", f"k-{i}", duration=0.001)
    d.submit([("k-x", [])], ["k-x"])
    d.start("w1", "k-x")  # it runs long this time, and is cancelled
    cancel(d, ["k-x"])
    ws = d.state.workers["w1"]
    assert "k-x" in ws.abandoned
    d.submit([("k-x", [])], ["k-x"])  # another record: the worker parks it behind the old run
    assert d.state.tasks["k-x"].worker == "w1"
    assert "k-x" in ws.abandoned and ws.assigned == 2  # before: 1 (the old run taken for the new one)
    cmds = d.add_worker("w2", {"cpu": 1})  # an idle worker: the parked task is asked back for it
    assert [(c.worker, c.keys) for c in cmds if isinstance(c, ev.Steal)] == [("w1", ["k-x"])]
    d.send(ev.AbandonedRunsEnded("w1", ["k-x"], d.clock()))
    assert not ws.abandoned


def test_a_run_that_finished_before_its_free_arrived_frees_its_slot_with_that_report() -> None:
    """Review of the fix above: a task known to execute was cancelled just as it finished; its
    worker had sent "finished" (not "ended", which comes only for a run still going when the free
    arrives), so the abandoned run held the only slot for ever and the next task never started."""
    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    d.submit([("k", [])], ["k"])
    d.start("w1", "k")
    old = d.state.tasks["k"].run
    cancel(d, ["k"])
    ws = d.state.workers["w1"]
    assert "k" in ws.abandoned
    d.submit([("k", [])], ["k"])
    assert d.state.tasks["k"].worker is None  # w1's slot is the old run's
    cmds = d.send(ev.TaskFinished("w1", "k", 8, 1.0, d.clock(), old))  # sent before the free arrived
    assert not ws.abandoned and d.state.tasks["k"].worker == "w1"  # its slot is free: the new one goes there
    assert [c.key for c in cmds if isinstance(c, ev.Execute)] == ["k"] and not reports(cmds)
    d.submit([("gone", [])], ["gone"])  # the same when the key is not reused: the record is forgotten
    d.send(ev.TaskFinished("w1", "k", 8, 0.5, d.clock(), d.state.tasks["k"].run))
    d.start("w1", "gone")
    cancel(d, ["gone"])
    assert "gone" in ws.abandoned
    d.send(ev.TaskFinished("w1", "gone", 8, 1.0, d.clock()))
    assert not ws.abandoned and ws.assigned == 0


def _adopted(d: StateDriver) -> None:
    """w1 rejoins (a restarted scheduler) running K, which is adopted."""
    d.submit([("K", [], {}, 1)], ["K"])
    now = d.clock()
    d.send(ev.WorkerJoin("w1", "tcp://w1:1", {"cpu": 2.0}, now, ready=False), ev.WorkerRejoin("w1", [], ["K"], [], now))
    d.send(ev.WorkerReady("w1", d.clock()))


def test_an_adopted_run_takes_any_serial_and_its_next_assignment_gets_a_serial_of_its_own() -> None:
    """Review: the adopted run's serial was another scheduler's (0 here: take any), but a slot it
    left abandoned was never freed by its own finished report, and the record stayed at 0 for life:
    a retry went out without a serial, unprotected against stale outcomes."""
    d = StateDriver(auto_start=False)
    _adopted(d)
    ts = d.state.tasks["K"]
    assert ts.run == 0 and ts.worker == "w1"
    cmds = d.fail("w1", "K")  # its run errs: retried, now with a serial of its own
    assert [c.key for c in cmds if isinstance(c, ev.Execute)] == ["K"] and ts.run != 0
    d2 = StateDriver(auto_start=False)
    _adopted(d2)
    d2.start("w1", "K")
    cancel(d2, ["K"])
    ws = d2.state.workers["w1"]
    assert ws.abandoned_run == {"K": 0}
    d2.send(ev.TaskFinished("w1", "K", 8, 1.0, d2.clock(), 123456))  # the old scheduler's serial
    assert not ws.abandoned and ws.assigned == 0  # its slot is free


def test_serials_differ_between_scheduler_processes() -> None:
    """Review: serials restarted at 1 in a restarted scheduler, so a worker's run tagged by the
    previous process matched a new record by chance (its old value came back)."""
    firsts = set()
    for _ in range(3):
        d = StateDriver()
        one_slot_worker(d)
        d.submit([("k", [])], ["k"])
        firsts.add(d.state.tasks["k"].run)
    assert len(firsts) == 3


def test_a_stale_reports_inline_pickle_never_rides_on_the_new_records_report() -> None:
    """Review: the state ignored the old run's outcome, but the server kept its inline pickle under
    the key and sent it with the new record's report."""
    from tidepool.scheduler.server import _inline_values

    d = StateDriver(auto_start=False)
    one_slot_worker(d)
    d.submit([("k", [])], ["k"])
    new = d.state.tasks["k"].run
    stale, fresh = ["k", 8, 0.1, b"old pickle", new - 1], ["k", 8, 0.1, b"new pickle", new]
    assert _inline_values([stale], d.state.tasks) == {}
    assert _inline_values([fresh], d.state.tasks) == {"k": b"new pickle"}
    assert _inline_values([["k", 8, 0.1, b"sim"]], d.state.tasks) == {"k": b"sim"}  # no serial: taken
