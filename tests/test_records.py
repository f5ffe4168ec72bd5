"""Task records' compact collections (records.py): tuples while small, sets beyond, NOSET when empty."""

from __future__ import annotations

from tidepool.resources import task_shape
from tidepool.scheduler.records import NOSET, SMALL, TaskRecord
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver


def record(key: str) -> TaskRecord:
    return TaskRecord(key, "f", None, task_shape({}), 0, 0, "g")


def test_one_dependent_becoming_two_leaves_the_shared_waiter_alone() -> None:
    a, b, c = record("a"), record("b"), record("c")
    a.add_dependent(b)
    a.add_waiter(b)
    assert a.waiters is a.dependents == (b,)  # the one waiter shares the one dependent's tuple
    a.add_dependent(c)
    assert a.dependents == (b, c) and a.waiters == (b,)
    a.add_waiter(c)
    assert a.waiters == (b, c)
    a.drop_waiter(b)
    assert a.waiters == (c,) and a.dependents == (b, c)
    a.drop_dependent(c)
    assert a.dependents == (b,) and a.waiters == (c,)
    a.drop_waiter(c)
    a.drop_dependent(b)
    assert a.waiters is NOSET and a.dependents is NOSET


def test_a_collection_is_a_tuple_up_to_small_then_a_set_and_noset_once_empty() -> None:
    a = record("a")
    others = [record(f"d{i}") for i in range(SMALL + 2)]
    for i, d in enumerate(others[:SMALL]):
        a.add_waiting_on(d)
        a.add_waiting_on(d)  # given twice: held once
        assert type(a.waiting_on) is tuple and len(a.waiting_on) == i + 1
    a.add_waiting_on(others[SMALL])
    assert type(a.waiting_on) is set and a.waiting_on == set(others[: SMALL + 1])
    a.drop_waiting_on(others[SMALL + 1])  # not held: nothing happens
    assert len(a.waiting_on) == SMALL + 1
    for d in others:
        a.drop_waiting_on(d)
        assert d not in a.waiting_on
    assert a.waiting_on is NOSET
    a.drop_waiting_on(others[0])  # dropping from the empty one is harmless
    assert a.waiting_on is NOSET


def test_an_input_given_twice_is_linked_once_and_the_task_runs() -> None:
    d = StateDriver(SchedulerState())
    d.add_worker("w1", {"cpu": 1})
    d.submit([("a", []), ("b", ["a", "a"])], ["b"])
    a, b = d.state.tasks["a"], d.state.tasks["b"]
    assert b.deps == (a,) and a.dependents == (b,)
    d.submit([("b", ["a", "a"])], ["b"])  # the same task again: no collision
    assert not [r for r in d.reports if r.status == "erred"]
    d.run_until_idle()
    assert d.status()["b"] == "memory"
    d.state.validate()
    d.release(["b"])
    assert d.state.tasks == {}


def test_an_input_with_more_dependents_than_small_runs_them_all_and_is_forgotten() -> None:
    d = StateDriver(SchedulerState())
    d.add_worker("w1", {"cpu": 2})
    n = SMALL + 4
    d.submit([("src", [])] + [(f"use-{i}", ["src"]) for i in range(n)], [f"use-{i}" for i in range(n)])
    src = d.state.tasks["src"]
    assert type(src.dependents) is set and len(src.dependents) == n
    d.run_until_idle()
    d.state.validate()
    assert all(d.status()[f"use-{i}"] == "memory" for i in range(n))
    assert src.waiters is NOSET  # every dependent finished: the value is not needed any more
    d.release([f"use-{i}" for i in range(n)])
    assert d.state.tasks == {}


def test_holders_and_wanters_are_small_collections_too() -> None:
    a = record("a")
    for w in ("w1", "w2", "w1"):
        a.add_holder(w)
    a.add_wanter("c")
    assert a.who_has == ("w1", "w2") and a.wanted_by == ("c",) and a.needed
    a.drop_holder("w1")
    a.drop_holder("w3")  # not a holder: nothing happens
    assert a.who_has == ("w2",)
    a.drop_holder("w2")
    a.drop_wanter("c")
    assert a.who_has is NOSET and a.wanted_by is NOSET
    for i in range(SMALL + 1):
        a.add_holder(f"w{i}")
    assert a.who_has == {f"w{i}" for i in range(SMALL + 1)}


def test_a_failure_is_one_error_its_dependents_share() -> None:
    d = StateDriver(SchedulerState())
    d.add_worker("w1")
    d.submit([("a", []), ("b", ["a"]), ("c", ["b"]), ("x", ["gone"]), ("y", ["x"])], ["c", "y"])
    x, y = d.state.tasks["x"], d.state.tasks["y"]  # x names an unknown input: it fails when computed
    assert x.state == y.state == "erred" and x.exc_type == y.exc_type == "DependencyError"
    assert x.error_origin == "" and y.error_origin == "x" and y.message == x.message
    d.fail("w1", "a", "it broke")
    a, b, c = (d.state.tasks[k] for k in "abc")
    assert a.error is not None and b.error is a.error and c.error is a.error
    assert c.state == "erred" and c.error_origin == "a" and c.message == "it broke" and c.exc_type == a.exc_type
    fresh = record("fresh")
    assert (fresh.error, fresh.exc_type, fresh.message, fresh.error_origin, fresh.exception) == (None, "", "", "", None)


def test_a_value_whose_many_waiters_turn_out_infeasible_fails_them_all() -> None:
    # the value arrives and its waiters become ready one by one; each one no node type can run fails
    # at once (the autoscaler's rule), and its failure drops it from the value's waiters: with more
    # than SMALL waiters (a set) that changed the set being walked (RuntimeError: the batch's commands
    # were lost)
    from tidepool.scheduler import events as ev

    def rule(shape: tuple[tuple[str, float], ...]) -> str | None:
        return "no node type offers a gpu" if any(k == "gpu" for k, _ in shape) else None

    for n in (1, SMALL + 2):
        d = StateDriver(SchedulerState())
        d.add_worker("w1", {"cpu": 1})
        d.send(ev.CheckFeasible(d.clock(), rule))
        uses = [f"use-{i}" for i in range(n)]
        d.submit([("src", []), *((k, ["src"], {"gpu": 1}) for k in uses), ("sum", uses)], [*uses, "sum"])
        d.run_until_idle()
        assert all(d.status()[k] == "erred" for k in [*uses, "sum"])
        assert all(d.state.tasks[k].exc_type == "InfeasibleTaskError" for k in uses)
        d.state.validate()
        d.release([*uses, "sum"])
        assert d.state.tasks == {}
