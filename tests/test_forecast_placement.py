"""The completion forecast assumes the placement the scheduler really makes: a GPU worker is no
capacity for CPU work while GPU work exists, and a seceded task holds no slot."""

from __future__ import annotations

from tidepool.scaling.forecast import type_forecasts
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import graph_view, remaining_work, worker_views
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver

CPU = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=1.0)
GPU = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=1.0)


def _cpu_eta_now(d: StateDriver) -> float:
    fcs, _, _ = type_forecasts(graph_view(d.state, 0.0), worker_views(d.state), (CPU, GPU), {"gpu": 1}, (), 0.0,
                               set())  # fmt: skip
    (cpu,) = [f for f in fcs if f.node_type == "cpu"]
    return cpu.etas[0]  # with the pool as it is (no extra node)


def test_a_gpu_worker_is_not_cpu_capacity_while_gpu_work_waits() -> None:
    d = StateDriver()
    d.state.estimates.observe("c", 1.0)
    d.state.estimates.observe("g", 1.0)
    d.add_worker("g1", {"cpu": 1.0, "gpu": 1.0}, node_type="gpu")
    d.submit([(f"c-{i}", []) for i in range(4)] + [(f"g-{i}", [], {"gpu": 1}) for i in range(4)],
             [f"c-{i}" for i in range(4)] + [f"g-{i}" for i in range(4)])  # fmt: skip
    assert _cpu_eta_now(d) == float("inf")  # CPU work needs a CPU node: the GPU is spoken for
    for _ in range(10):  # run the GPU work to the end; CPU tasks stay out of g1 meanwhile
        gpu_running = [k for k in d.running.get("g1", []) if k.startswith("g-")]
        if not gpu_running:
            break
        for k in gpu_running:
            d.finish("g1", k)
    assert all(d.state.tasks[f"g-{i}"].state == "memory" for i in range(4))
    assert _cpu_eta_now(d) < float("inf")  # no GPU work left: g1 counts as CPU capacity again


def test_a_seceded_task_is_not_forecast_as_holding_a_slot() -> None:
    d = StateDriver(SchedulerState(queue_seconds=0.0))
    d.add_worker("w1")
    d.submit([("outer", [])], ["outer"])
    assert "outer" in remaining_work(d.state, 0.0).keys
    d.send(ev.TaskSeceded("w1", "outer", d.clock()))
    assert "outer" not in remaining_work(d.state, 0.0).keys


def test_a_worker_view_counts_the_unique_values_a_task_still_needs_apart_from_results() -> None:
    d = StateDriver()
    d.add_worker("w1")
    # "a" feeds "b"; "a" and "b" are both wanted by the client; one worker runs them in turn
    d.submit([("a", []), ("b", ["a"])], ["a", "b"])
    d.finish("w1", "a")
    (view,) = worker_views(d.state)
    assert (view.unique_keys, view.unique_for_tasks) == (1, 1)  # "b" still needs "a"
    d.finish("w1", "b")
    (view,) = worker_views(d.state)
    assert (view.unique_keys, view.unique_for_tasks) == (2, 0)  # only the client wants them now


def test_tasks_asking_for_no_cpu_count_one_slot_each_and_a_huge_node_type_stays_small() -> None:
    """Found by a bug hunt: ``resources={"cpu": 0}`` counted a million slots per node (every
    autoscaler step spent seconds in the forecast) and a node type offering 10**12 cpu failed every
    step with a MemoryError; a node runs at most its slots (one per cpu), and no more than the tasks."""
    from tidepool.scaling.forecast import RemainingWork
    from tidepool.scaling.observation import GraphView
    from tidepool.scaling.planner import plan
    from tidepool.scaling.snapshot import ClusterSnapshot, Demand

    free = (("cpu", 0.0),)
    work = RemainingWork((0.5,) * 60, ((),) * 60, ())
    graph = GraphView(work, (free,) * 60)
    four = NodeType("default", {"cpu": 4}, max_nodes=20, startup_estimate=1.0)
    (f,), _, _ = type_forecasts(graph, (), (four,), {}, (), 0.0, set())
    assert f.slots_per_node == 4
    huge = NodeType("big", {"cpu": 1e12}, max_nodes=2, startup_estimate=1.0)
    (g,), _, _ = type_forecasts(graph, (), (huge,), {}, (), 0.0, set())
    assert g.slots_per_node == 60 and g.etas[-1] < float("inf")
    snap = ClusterSnapshot(now=0.0, node_types=(four,), demand=(Demand(free, "f", 60, 0.5),), workers=())
    assert plan(snap).nodes == {"default": 15}
