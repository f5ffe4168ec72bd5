"""Memory as a reason to scale, and tasks that need more memory than any node offers (pure: hand-made
snapshots and the controller on a fake clock)."""

from __future__ import annotations

from tidepool.scaling.controller import ScalingController, largest_offers
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.policies import Adaptive, MemoryPressure
from tidepool.scaling.snapshot import ClusterSnapshot, Demand, WorkerView
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver

GB = 10**9
SMALL = NodeType("small", {"cpu": 2, "memory": "4GB"}, max_nodes=4, cost=1.0)
BIG = NodeType("big", {"cpu": 2, "memory": "32GB"}, max_nodes=2, cost=2.0)  # 16 GB per cost: the pick
PLAIN = NodeType("plain", {"cpu": 8}, max_nodes=4, cost=0.5)


def view(wid: str, held: int, limit: int = 4 * GB, nt: str = "small") -> WorkerView:
    return WorkerView(wid, nt, "running", {"cpu": 2.0}, 2, 1, 1.0, held, 0, 0, None, 0.0, limit)


def snap(workers: list[WorkerView], types: tuple[NodeType, ...] = (SMALL, BIG), **kw: object) -> ClusterSnapshot:
    kw.setdefault("demand", (Demand((("cpu", 1.0),), "g", 5, 1.0),))
    return ClusterSnapshot(now=10.0, node_types=types, workers=tuple(workers), **kw)  # type: ignore[arg-type]


def test_held_data_near_the_pool_memory_launches_the_most_memory_per_cost() -> None:
    d = MemoryPressure()(snap([view("a", int(3.0 * GB)), view("b", int(2.8 * GB))]))
    assert d.launch == {"big": 1}
    assert "memory" in d.reasons[0] and "72%" in d.reasons[0] and "'big'" in d.reasons[0]


def test_no_memory_launch_below_the_fraction_without_work_or_while_one_is_pending() -> None:
    p = MemoryPressure()
    assert p(snap([view("a", 2 * GB), view("b", 2 * GB)])).empty  # 50%
    full = [view("a", int(3.5 * GB)), view("b", int(3.5 * GB))]
    assert p(snap(full, demand=())).empty  # nothing left to start
    assert not p(snap(full, demand=(), waiting=3)).empty  # tasks still to come
    from tidepool.scaling.snapshot import PendingLaunch

    assert p(snap(full, pending=(PendingLaunch("r1", "big", 1, ("x",), 9.0),))).empty
    assert p(snap([view("a", 3 * GB, limit=0)])).empty  # no limits known: no memory reasoning


def test_types_without_declared_memory_count_as_the_smallest_worker_and_limits_hold() -> None:
    full = [view("a", int(3.5 * GB)), view("b", int(3.5 * GB))]
    # plain: 4 GB (smallest worker) per 0.5 cost = 8 GB/cost beats small's 4 GB/cost
    assert MemoryPressure()(snap(full, types=(SMALL, PLAIN))).launch == {"plain": 1}
    at_max = [view(f"s{i}", int(3.5 * GB)) for i in range(4)]
    d = MemoryPressure()(snap(at_max, types=(SMALL,)))
    assert d.empty and "every node type is at its limit" in d.reasons[0]


def test_the_default_policy_includes_memory_pressure() -> None:
    d = Adaptive(launcher=None, no_progress=None, idle=None)(snap([view("a", int(3.9 * GB))]))
    assert d.launch == {"big": 1}


def test_a_task_needing_more_memory_than_any_node_type_fails_at_once_naming_the_biggest() -> None:
    assert largest_offers((("memory", 64.0 * GB),), [SMALL, BIG]) == (
        " (the most memory any node type offers is 29.8GiB per worker, on 'big')")
    assert largest_offers((("tpu", 1.0),), [SMALL]) == " (no node type has tpu)"
    assert largest_offers((("memory", 1.0 * GB),), [SMALL]) == ""
    # every amount is offered by some type, never all at once (a bug hunt got no explanation)
    gpu = NodeType("gpu", {"cpu": 2, "gpu": 1, "memory": 0.5 * GB})
    assert largest_offers((("gpu", 0.5), ("memory", 1.0 * GB)), [SMALL, gpu]) == (
        " (each amount is offered by some node type, but none offers all of them at once: 'small' has "
        "only gpu 0; 'gpu' has only memory 0.5GiB)")
    c = ScalingController((SMALL, BIG), Adaptive(), forecast_interval=0.25)
    state = SchedulerState()
    d = StateDriver(state)
    d.send(ev.CheckFeasible(0.0, c.view.feasibility))
    d.submit([("huge-1", [], {"memory": 64 * GB}), ("fine-1", [], {"memory": 8 * GB})], ["huge-1", "fine-1"])
    ts = state.tasks["huge-1"]
    assert ts.state == "erred" and ts.exc_type == "InfeasibleTaskError"
    assert "29.8GiB per worker, on 'big'" in ts.message
    assert state.tasks["fine-1"].state == "no-worker"  # the big type can take it: it waits as demand
