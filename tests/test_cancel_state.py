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
