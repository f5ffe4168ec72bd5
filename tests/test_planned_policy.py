"""The default policy (scaling/planned.py) on hand-made snapshots: launch and retire from one model
of holding cost, the two retirements of issue 33, objectives, deadlines and budgets."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from tidepool.errors import ConfigError
from tidepool.scaling.forecast import RemainingWork, peak_in_use, type_forecasts
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import GraphView
from tidepool.scaling.planned import BUDGET_GROWTH, BUDGET_MARGIN, GraphPlan, default_policy
from tidepool.scaling.policies import Adaptive
from tidepool.scaling.snapshot import ClusterSnapshot, Demand, PendingLaunch, WorkerView

CPU = (("cpu", 1.0),)


def worker(wid: str, *, running: int = 0, idle_since: float | None = 0.0, node_type: str = "default",
           resources: dict[str, float] | None = None) -> WorkerView:  # fmt: skip
    return WorkerView(wid, node_type, "running", resources or {"cpu": 1.0}, 1, running, 0.0, 0, 0, 0,
                      None if running else idle_since, joined=-100.0)  # fmt: skip


def snapshot(now: float, nt: NodeType, workers: tuple[WorkerView, ...], work: RemainingWork | None,
             demand: tuple[Demand, ...] = (), finished: int = 10) -> ClusterSnapshot:  # fmt: skip
    """A snapshot with the controller's forecasts computed from ``work`` (None: no graph at all)."""
    forecasts: tuple = ()
    eta = nxt = None
    if work is not None and len(work):
        graph = GraphView(work, (CPU,) * len(work))
        nodes = {nt.name: len(workers)}
        forecasts, eta, nxt = type_forecasts(graph, workers, (nt,), nodes, (), now, set())
    return ClusterSnapshot(now=now, node_types=(nt,), demand=demand, workers=workers, finished=finished,
                           waiting=sum(1 for d in (work.deps if work else ()) if d),
                           running=sum(w.running for w in workers), forecasts=forecasts, eta=eta,
                           next_demand_in=nxt)  # fmt: skip


def two_phases(reduce_left: float, n: int = 40, work: float = 0.5) -> RemainingWork:
    """The README demo during its reduce: the reduce runs (``reduce_left`` s to go), then ``n``
    tasks that need it, then a final reduce."""
    durations = (reduce_left, *([work] * n), 0.1)
    deps = ((), *([(0,)] * n), tuple(range(1, n + 1)))
    return RemainingWork(durations, deps, (0,))


# ---- issue 33, bug 4: workers retired just before they are needed -------------------------------
def test_readme_demo_keeps_its_workers_through_a_reduce_shorter_than_a_start_up() -> None:
    # measured start-up 2 s (a loaded machine); the reduce has 1.5 s to go; 3 workers idle
    nt = NodeType("default", max_nodes=4, startup_estimate=2.0)
    ws = (worker("w0", running=1), worker("w1", idle_since=0.0), worker("w2", idle_since=0.0),
          worker("w3", idle_since=0.0))  # fmt: skip
    snap = snapshot(0.5, nt, ws, two_phases(1.5))
    assert snap.next_demand_in == pytest.approx(1.5)
    assert default_policy()(snap).retire == ()
    # the rule it replaces retired all three ("no work expected soon"): the bug of issue 33
    assert set(Adaptive()(snap).retire) == {"w1", "w2", "w3"}


def test_a_gap_longer_than_a_start_up_retires_and_the_next_launch_does_not_undo_it() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=2.0)
    ws = (worker("w0", running=1), worker("w1"), worker("w2"), worker("w3"))
    policy = default_policy()
    d = policy(snapshot(0.5, nt, ws, two_phases(60.0)))  # a minute of reduce: idle nodes cost more
    assert set(d.retire) == {"w1", "w2", "w3"}
    assert all("holding it costs more than a relaunch" in text for _, text in d.why)
    # the same graph on the pool without them: nothing to launch now (they come back just in time)
    after = policy(snapshot(1.5, nt, ws[:1], two_phases(59.0)))
    assert after.launch == {}
    # ... and when the reduce ends within a start-up, the launch for the second phase comes
    later = policy(snapshot(58.0, nt, ws[:1], two_phases(1.5)))
    assert later.launch.get("default", 0) >= 1


def test_between_gather_and_the_next_compute_idle_workers_wait_a_start_up() -> None:
    # the mixed pipeline of issue 33: nothing is known between a gather() and the next compute
    nt = NodeType("default", max_nodes=4, startup_estimate=2.0)
    ws = tuple(worker(f"w{i}", idle_since=0.0) for i in range(4))
    policy = default_policy()
    assert policy(snapshot(1.0, nt, ws, None)).retire == ()  # 1 s idle < the 2 s a relaunch costs
    assert Adaptive()(snapshot(1.0, nt, ws, None)).retire != ()  # the old rule dropped them at once
    d = policy(snapshot(2.5, nt, ws, None))
    assert set(d.retire) == {"w0", "w1", "w2", "w3"}
    assert "no work is known" in d.why[0][1]


def test_gpu_node_is_not_held_for_work_nobody_asked_for() -> None:
    nt = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=2.0)
    ws = (worker("g1", node_type="gpu", resources={"cpu": 1.0, "gpu": 1.0}),)
    d = default_policy()(snapshot(0.2, nt, ws, None))
    assert d.retire == ("g1",) and "gpu" in d.why[0][1]


# ---- launches ----------------------------------------------------------------------------------
def wide(n: int, seconds: float) -> RemainingWork:
    return RemainingWork((seconds,) * n, ((),) * n, ())


def test_launch_as_many_nodes_as_the_graph_keeps_busy_longer_than_their_start_up() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=10.0)
    demand = (Demand(CPU, "work", 20, 100.0),)
    d = GraphPlan()(snapshot(0.0, nt, (), wide(20, 100.0), demand))
    assert d.launch == {"default": 20}  # 20 tasks of 100 s: one node each
    chain = RemainingWork((5.0,) * 10, ((),) + tuple((i,) for i in range(9)), ())
    d = GraphPlan()(snapshot(0.0, nt, (), chain, (Demand(CPU, "step", 1, 5.0),)))
    assert d.launch == {"default": 1}  # a chain keeps one node busy


def test_cheapest_launches_fewer_nodes_than_fastest() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=30.0)
    demand = (Demand(CPU, "work", 200, 20.0),)
    snap = snapshot(0.0, nt, (worker("w0", running=1),), wide(200, 20.0), demand)
    fast = GraphPlan("fastest")(snap).launch.get("default", 0)
    cheap = GraphPlan("cheapest")(snap).launch.get("default", 0)
    assert fast > cheap >= 0
    assert fast == 99  # every node shortens the run (up to max_nodes)


def test_before_anything_finished_it_launches_for_the_runnable_tasks() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=60.0)
    demand = (Demand(CPU, "work", 12, 0.5),)  # the 0.5 s prior: a guess
    d = GraphPlan()(snapshot(0.0, nt, (), wide(12, 0.5), demand, finished=0))
    assert d.launch == {"default": 12}
    assert GraphPlan("cheapest")(snapshot(0.0, nt, (), wide(12, 0.5), demand, finished=0)).launch.get(
        "default", 0) < 12  # fmt: skip


# ---- objectives, deadline, budget --------------------------------------------------------------
def test_objective_deadline_and_budget_are_checked() -> None:
    with pytest.raises(ConfigError, match="did you mean 'cheapest'"):
        GraphPlan("cheapset")
    with pytest.raises(ConfigError, match="deadline must be a positive number"):
        GraphPlan(deadline=-1)
    with pytest.raises(ConfigError, match="not both"):
        GraphPlan(deadline=10, budget=1)
    with pytest.raises(ConfigError, match="unknown options"):
        default_policy(idle_timeout=3)


def test_deadline_takes_the_cheapest_pool_that_meets_it() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=10.0)
    demand = (Demand(CPU, "work", 100, 60.0),)
    snap = snapshot(0.0, nt, (), wide(100, 60.0), demand)
    d = GraphPlan(deadline=400.0)(snap)
    k = d.launch["default"]
    f = snap.forecasts[0]
    i = f.extra.index(k)
    meets = [j for j in range(len(f.extra)) if f.etas[j] <= 400.0]
    assert i in meets and f.etas[0] > 400.0
    assert all(k * f.etas[i] <= f.extra[j] * f.etas[j] for j in meets)  # the least node-seconds that meet it
    assert "least cost that meets it" in d.reasons[0]
    assert GraphPlan(deadline=4000.0)(snap).launch["default"] < k  # a later deadline: fewer nodes


def test_an_infeasible_deadline_says_so_at_once_and_runs_as_fast_as_it_can(caplog: pytest.LogCaptureFixture) -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=10.0)
    demand = (Demand(CPU, "work", 100, 60.0),)
    snap = snapshot(0.0, nt, (), wide(100, 60.0), demand)
    with caplog.at_level(logging.WARNING, "tidepool.scaling"):
        d = GraphPlan(deadline=100.0)(snap)
    assert d.launch == {"default": 10}
    assert any("infeasible" in r for r in d.reasons)
    assert "cannot be met" in caplog.text


def test_budget_buys_the_fastest_pool_it_can_pay_for() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=10.0, cost=3.6)  # 0.001 per node-second
    demand = (Demand(CPU, "work", 100, 60.0),)
    snap = snapshot(0.0, nt, (), wide(100, 60.0), demand)
    f = snap.forecasts[0]
    budget = 10.0
    d = GraphPlan(budget=budget)(snap)
    k = d.launch["default"]
    cost = k * f.etas[f.extra.index(k)] * 0.001
    assert cost <= BUDGET_MARGIN * budget
    # no node has joined yet: the pool grows at most BUDGET_GROWTH-fold on one
    assert k <= BUDGET_GROWTH
    faster = [j for j in range(len(f.extra)) if f.etas[j] < f.etas[f.extra.index(k)]]
    assert all(f.extra[j] * f.etas[j] * 0.001 > BUDGET_MARGIN * budget or f.extra[j] > BUDGET_GROWTH
               for j in faster)  # fmt: skip
    assert "the fastest that fits" in d.reasons[0]
    # with 10 nodes joined and busy the cap is 40 nodes held: a faster pool that fits is bought
    ws = tuple(worker(f"w{i}", running=1) for i in range(10))
    snap = snapshot(0.0, nt, ws, wide(100, 60.0), (Demand(CPU, "work", 90, 60.0),))
    more = GraphPlan(budget=20.0)(snap).launch.get("default", 0)
    assert BUDGET_GROWTH < more <= 30


def test_an_infeasible_budget_says_so_at_once() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=10.0, cost=3.6)
    demand = (Demand(CPU, "work", 100, 60.0),)
    d = GraphPlan(budget=0.5)(snapshot(0.0, nt, (), wide(100, 60.0), demand))
    assert any("budget 0.5 infeasible" in r and "> 0.500 left" in r for r in d.reasons)
    assert d.launch == {"default": 1}  # the least cost: one node


def test_plain_work_beyond_the_plain_types_never_launches_a_gpu_node() -> None:
    """Before anything finished the policy launches for every runnable task; the plan it asks then
    overflowed plain work onto the gpu type once the cpu type was full (found by Dask's annotated
    blocks test: CPU blocks launched a GPU node)."""
    cpu = NodeType("cpu", {"cpu": 1}, max_nodes=2, startup_estimate=0.5)
    gpu = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=0.5, cost=4.0)
    work = wide(16, 1.0)
    graph = GraphView(work, (CPU,) * len(work))
    forecasts, eta, nxt = type_forecasts(graph, (), (cpu, gpu), {"cpu": 0, "gpu": 0}, (), 0.0, set())
    snap = ClusterSnapshot(now=0.0, node_types=(cpu, gpu), demand=(Demand(CPU, "work", 16, 1.0),), workers=(), finished=0,
                           waiting=0, running=0, forecasts=forecasts, eta=eta, next_demand_in=nxt)  # fmt: skip
    d = default_policy()(snap)
    assert dict(d.launch) == {"cpu": 2}, d


# ---- spending on evidence, not on guesses (issue 24, the remainder) ----------------------------
def behind_one_running(now_left: float, hold_left: float, n: int = 8) -> RemainingWork:
    """A running task of a kind that never finished, then ``n`` short tasks that need it: the
    forecast gives it ``now_left`` to go (elapsed / 4), holding sees ``hold_left`` (as long as it ran)."""
    durations = (now_left, *([0.5] * n))
    hold = (hold_left, *([0.5] * n))
    return RemainingWork(durations, ((), *([(0,)] * n)), (0,), unknown=frozenset({0}), for_hold=hold)


def test_idle_nodes_are_not_held_for_work_behind_a_task_of_a_kind_never_seen() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=10.0)  # balanced's horizon: 15 s
    ws = (worker("w0", running=1), worker("w1"), worker("w2"), worker("w3"))
    # it ran 40 s: elapsed / 4 says 10 s to go (within the horizon), as long as it ran says 40 s
    d = default_policy()(snapshot(5.0, nt, ws, behind_one_running(10.0, 40.0)))
    assert set(d.retire) == {"w1", "w2", "w3"}
    # after 8 s of running it may well end within the horizon: the nodes stay
    assert default_policy()(snapshot(5.0, nt, ws, behind_one_running(2.0, 8.0))).retire == ()


def test_a_launch_sees_a_kind_never_seen_at_the_prior_and_a_deadline_at_the_mean() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=60.0)
    # 40 waiting tasks of a kind never finished: the mean of the other kinds says 60 s, the prior 0.5 s
    work = RemainingWork((60.0,) * 40, ((),) * 40, (), for_launch=(0.5,) * 40)
    snap = snapshot(0.0, nt, (worker("w0", idle_since=None),), work, (Demand(CPU, "new", 40, 60.0),))
    f = snap.forecasts[0]
    assert f.evidence is not None and f.evidence.etas[0] < f.etas[0]
    assert GraphPlan()(snap).launch == {}  # 40 x 0.5 s: done on the pool as it is before a node boots
    assert GraphPlan(deadline=400.0)(snap).launch.get("default", 0) >= 5  # the deadline plans on the mean


def test_balanced_does_not_buy_a_node_that_would_barely_work() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=100.0)
    # a running task with 100.5 s to go, then two 5 s tasks that need it: a new node (up at 100 s)
    # takes one of them and saves 5 s, working 5 s for a 100 s start-up
    work = RemainingWork((100.5, 5.0, 5.0), ((), (0,), (0,)), (0,))
    snap = snapshot(0.0, nt, (worker("w0", running=1),), work)
    f = snap.forecasts[0]
    assert f.etas[1] < f.etas[0] * 0.995 and f.new_busy[1] < 0.1 * f.startup
    assert GraphPlan("fastest")(snap).launch == {"default": 1}  # fastest takes every node that shortens
    assert GraphPlan()(snap).launch == {}


def test_a_budget_reserves_finishing_on_the_held_nodes_before_it_buys_more() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=10.0, cost=3.6)  # 0.001 per node-second
    ws = tuple(worker(f"w{i}", running=1) for i in range(10))
    demand = (Demand(CPU, "work", 90, 60.0),)
    snap = snapshot(0.0, nt, ws, wide(100, 60.0), demand)
    f = snap.forecasts[0]
    budget = 9.0  # finishing on the 10 held costs 6; 80% of 9 leaves 1.2 for more nodes
    d = GraphPlan(budget=budget)(snap)
    reserve = 10 * f.etas[0] * 0.001
    k = d.launch.get("default", 0)
    assert k > 0
    # the margin bounds reserve + purchase together, not the purchase alone
    assert reserve + k * f.etas[f.extra.index(k)] * 0.001 <= BUDGET_MARGIN * budget
    assert "reserved for the 10 node(s) held" in d.reasons[0]


def test_a_budget_the_held_nodes_already_use_up_buys_nothing_and_retires_idle_nodes_at_once() -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=10.0, cost=3.6)
    # a 5 s task runs, then four 100 s tasks need it: the idle nodes are needed within a start-up
    work = RemainingWork((5.0, 100.0, 100.0, 100.0, 100.0), ((), (0,), (0,), (0,), (0,)), (0,))
    ws = (worker("w0", running=1), *(worker(f"w{i}", idle_since=0.0) for i in (1, 2, 3)))
    snap = snapshot(1.0, nt, ws, work)
    assert GraphPlan(objective="cheapest")(snap).retire == ()  # without a budget they are kept
    d = GraphPlan(budget=0.2)(snap)  # 4 nodes x ~105 s = 0.42 > 0.2: over the ceiling already
    assert d.launch == {}
    assert set(d.retire) == {"w1", "w2", "w3"}


def test_a_missed_deadline_is_said_while_nothing_is_runnable() -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=10.0)
    work = RemainingWork((100.0, 100.0), ((), (0,)), (0,))  # a chain: nothing to launch for
    snap = snapshot(0.0, nt, (worker("w0", running=1),), work)
    d = GraphPlan(deadline=50.0)(snap)
    assert d.launch == {}
    assert any("deadline 50s cannot be met" in r for r in d.reasons)


def test_a_deadline_shorter_than_any_start_up_is_said_before_a_forecast_exists() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=10.0)
    demand = (Demand(CPU, "work", 4, 1.0),)
    snap = ClusterSnapshot(now=0.0, node_types=(nt,), demand=demand, workers=(), finished=0)
    assert any("cannot be met" in r for r in GraphPlan(deadline=5.0)(snap).reasons)
    assert not any("cannot be met" in r for r in GraphPlan(deadline=50.0)(snap).reasons)


def test_while_every_duration_is_a_guess_idle_nodes_are_held_a_shorter_time() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=10.0)  # balanced's horizon: 15 s
    ws = (worker("w0", running=1), worker("w1"), worker("w2"), worker("w3"))
    # the running task (a kind never seen) is expected to need 8 s more: within 15 s, so once a task
    # has finished the idle nodes wait for the work behind it ...
    work = behind_one_running(2.0, 8.0)
    assert default_policy()(snapshot(5.0, nt, ws, work, finished=10)).retire == ()
    # ... but while nothing has finished, 8 s is itself a guess: the montage-dss trace held 23 idle
    # nodes ~2 minutes behind 11-minute tasks; a guess holds only what the forecast uses now
    d = default_policy()(snapshot(5.0, nt, ws, work, finished=0))
    assert set(d.retire) == {"w1", "w2", "w3"}
    assert all("within 0.0s" in text for _, text in d.why)


def test_balanced_buys_a_node_on_measured_durations_only_if_it_works_half_its_start_up() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=100.0)
    # a running task with 100.5 s to go, then two 30 s tasks: a new node (up at 100 s) takes one and
    # works 30 s for a 100 s start-up (on montage-dss such nodes, 23 of them, were retired at once)
    work = RemainingWork((100.5, 30.0, 30.0), ((), (0,), (0,)), (0,))
    snap = snapshot(0.0, nt, (worker("w0", running=1),), work)
    f = snap.forecasts[0]
    assert f.etas[1] < f.etas[0] * 0.995 and 0.1 * f.startup < f.new_busy[1] < 0.5 * f.startup
    assert GraphPlan()(snap).launch == {}
    # 60 s of work for it is enough
    work = RemainingWork((100.5, 60.0, 60.0), ((), (0,), (0,)), (0,))
    assert GraphPlan()(snapshot(0.0, nt, (worker("w0", running=1),), work)).launch == {"default": 1}


def test_under_a_budget_the_no_progress_net_does_not_grow_a_pool_that_is_working() -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=10.0, cost=3.6)
    # one node runs a long task of a kind never seen, four more wait: no task finished for 100 s
    ws = (worker("w0", running=1),)
    work = RemainingWork((600.0,) * 5, ((),) * 5, (0,))
    snap = snapshot(100.0, nt, ws, work, (Demand(CPU, "long", 4, 0.5),), finished=0)
    assert default_policy()(snap).launch.get("default", 0) >= 1  # balanced: a launch
    d = default_policy(budget=5.0)(snap)
    assert d.launch == {}, d
    assert not any("no progress" in r for r in d.reasons)
    # an empty pool is still restarted
    empty = snapshot(100.0, nt, (), work, (Demand(CPU, "long", 5, 0.5),), finished=0)
    assert default_policy(budget=5.0)(empty).launch.get("default", 0) >= 1


def test_an_idle_node_is_held_for_values_a_task_needs_not_for_results_only_a_client_wants() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=10.0)  # a moment: 10 s; horizon 15 s

    def holding(wid: str, unique: int, for_tasks: int) -> WorkerView:
        return WorkerView(wid, "default", "running", {"cpu": 1.0}, 1, 0, 0.0, unique * 1000, unique,
                          unique * 1000, 0.0, joined=-100.0, unique_for_tasks=for_tasks)  # fmt: skip

    # a task with a minute to go, then one more: the forecast keeps one node busy; three idle 2 s
    ws = (worker("w0", running=1), holding("results", 3, 0), holding("inputs", 3, 3), holding("empty", 0, 0))
    work = RemainingWork((60.0, 5.0), ((), (0,)), (0,))
    d = default_policy()(snapshot(2.0, nt, ws, work))
    # the run's results move to a survivor (or the client) whether the node waits or not: on the
    # 1000genome traces every node of the last phase waited 22-30 s for nothing (cost -2% to -4%)
    assert set(d.retire) == {"empty", "results"}
    # values a waiting task needs: held a moment, the task may yet run there
    later = default_policy()(snapshot(10.5, nt, ws, work))
    assert "inputs" in later.retire


def test_values_a_task_needs_hold_an_unneeded_node_ten_seconds_not_a_slow_start_up() -> None:
    nt = NodeType("default", max_nodes=4, startup_estimate=90.0)  # a cloud VM: horizon 135 s
    inputs = WorkerView("inputs", "default", "running", {"cpu": 1.0}, 1, 0, 0.0, 3000, 3, 3000, 0.0,
                        joined=-100.0, unique_for_tasks=3)  # fmt: skip
    # one node busy for a minute, then one 5 s task: the forecast never needs a second node
    ws = (worker("w0", running=1), inputs)
    work = RemainingWork((60.0, 5.0), ((), (0,)), (0,))
    assert default_policy()(snapshot(8.0, nt, ws, work)).retire == ()  # a moment: the task may run there
    # not a quarter of the start-up (22.5 s): the forecast already said no node is needed within
    # 135 s, and the values move to the survivor (1000genome on Slurm held such nodes 30 s each)
    assert default_policy()(snapshot(12.0, nt, ws, work)).retire == ("inputs",)


def test_a_launch_in_flight_does_not_count_as_a_node_to_retire_a_live_one_against() -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=10.0)  # horizon 15 s
    # w0's task ends in 8 s, then 5 tasks of 20 s: four start at once on the four live nodes, the
    # fifth on one of 4 nodes launched a moment ago (due in ~10 s): the forecast needs 5 nodes
    ws = (worker("w0", running=1), worker("w1"), worker("w2"), worker("w3"))
    work = RemainingWork((8.0, *([20.0] * 5)), ((), *([(0,)] * 5)), (0,))
    graph = GraphView(work, (CPU,) * len(work))
    forecasts, eta, nxt = type_forecasts(graph, ws, (nt,), {"default": 8}, (("default", 4, 0.0),), 0.5, set())
    pending = (PendingLaunch("a2", "default", 4, (), 0.0),)
    snap = ClusterSnapshot(now=0.5, node_types=(nt,), demand=(), workers=ws, pending=pending, finished=10,
                           waiting=5, running=1, forecasts=forecasts, eta=eta, next_demand_in=nxt)  # fmt: skip
    assert -(-peak_in_use(forecasts[0].profile, 15.0) // 1) == 5
    # counted with the 4 in flight (8 nodes for 5 needed), three live idle nodes went; on Slurm
    # those 4 may queue for minutes: the 5-degree montage ran its last wave on 1-5 nodes (246 s;
    # 218 s when the live ones stay)
    assert default_policy()(snap).retire == ()


def test_a_worker_being_retired_does_not_count_as_a_node_to_retire_another_against() -> None:
    nt = NodeType("default", max_nodes=10, startup_estimate=2.0)  # horizon 3 s
    # w0's task ends in 1.5 s, then 2 tasks of 10 s: the forecast (on the nodes that stay: w0, w2,
    # w3) needs 2 nodes within the horizon; w1 is being retired already (the forecast leaves its
    # slot out, as the controller's ``standing`` does), so only one of w2 and w3 is surplus
    retiring = WorkerView("w1", "default", "retiring", {"cpu": 1.0}, 1, 0, 0.0, 0, 0, 0, None, joined=-100.0)
    ws = (worker("w0", running=1), retiring, worker("w2"), worker("w3"))
    snap = snapshot(0.5, nt, ws, two_phases(1.5, n=2, work=10.0))
    assert -(-peak_in_use(snap.forecasts[0].profile, 3.0) // 1) == 2
    # counting w1 as live (4 nodes for 2 needed) retired both idle ones: one node left for two tasks
    d = default_policy()(snap)
    assert len(d.retire) == 1 and d.retire[0] in {"w2", "w3"}


# ---- the billed part of a start-up (a Slurm job's queue wait is free) ---------------------------
def test_an_idle_node_is_held_past_a_start_up_only_for_what_a_relaunch_would_bill() -> None:
    # a Slurm-like type: 200 s from request to worker, of which 190 s in the queue (not billed) and
    # 10 s of boot after the job starts (billed); w0's task ends in 250 s, then two 30 s tasks
    work = RemainingWork((250.0, 30.0, 30.0), ((), (0,), (0,)), (0,))
    ws = (worker("w0", running=1), worker("w1"))
    cloud = NodeType("default", max_nodes=4, startup_estimate=200.0)  # all billed: horizon 1.5 x 200
    assert default_policy()(snapshot(1.0, cloud, ws, work)).retire == ()
    # billed 10 s: holding w1 idle 250 s costs more than a relaunch that bills 10 s and arrives in
    # time (horizon 200 + 0.5 x 10); launched then, not now (the launch horizon is unchanged)
    slurm = NodeType("default", max_nodes=4, startup_estimate=200.0, billed_startup=10.0)
    d = default_policy()(snapshot(1.0, slurm, ws, work))
    assert d.retire == ("w1",) and "within 205.0s" in d.why[0][1]
    # ... but one needed within the start-up itself is kept: a relaunch would come too late
    work = RemainingWork((150.0, 30.0, 30.0), ((), (0,), (0,)), (0,))
    assert default_policy()(snapshot(1.0, slurm, ws, work)).retire == ()


def test_with_no_work_known_an_idle_node_is_held_for_what_a_relaunch_would_bill() -> None:
    # between two computes (or after the last): the ski-rental hold is what a relaunch bills, 10 s
    # of boot on Slurm, not a share of its queue wait (six nodes that came after 1000genome-10ch
    # finished were each held 30 s)
    ws = (worker("w0", idle_since=0.0),)
    slurm = NodeType("default", max_nodes=4, startup_estimate=200.0, billed_startup=10.0)
    assert default_policy()(snapshot(9.0, slurm, ws, None)).retire == ()
    d = default_policy()(snapshot(10.5, slurm, ws, None))
    assert d.retire == ("w0",) and "kept 10.0s" in d.why[0][1]
    cloud = NodeType("default", max_nodes=4, startup_estimate=200.0)  # billed from the request
    assert default_policy()(snapshot(10.5, cloud, ws, None)).retire == ()


# ---- the bet on guessed durations and its guess_budget --------------------------------------------
def gate(n: int) -> RemainingWork:
    """blast's and bwa's shape while nothing has run: one runnable task of a kind never seen, then
    ``n`` tasks that need it, every duration the scheduler's 0.5 s prior."""
    return RemainingWork((0.5,) * (n + 1), ((), *([(0,)] * n)), ())


def launched(snap: ClusterSnapshot, *counts: tuple[str, int]) -> ClusterSnapshot:
    """``snap`` one round later with these launches (request id, nodes) pending: carried out."""
    pending = tuple(PendingLaunch(rid, "default", n, (), snap.now) for rid, n in counts)
    return replace(snap, now=snap.now + 1.0, pending=pending)


def test_a_bet_on_guessed_durations_buys_at_most_guess_budget_of_start_ups() -> None:
    # a cloud of 200 nodes booting in 90 s: 1.25 node-hours of start-ups buys 50 of them
    nt = NodeType("default", max_nodes=200, startup_estimate=90.0)
    demand = (Demand(CPU, "split", 1, 0.5),)
    snap = snapshot(0.0, nt, (), gate(400), demand, finished=0)
    fastest = GraphPlan("fastest")(snap)
    assert fastest.launch["default"] > 100  # the unlimited bet: every node that gets work
    # the prior's 200 task-seconds keep 4 nodes busy half a start-up each: no bet, those 4
    assert GraphPlan(guess_budget=0.0)(snap).launch == {"default": 4}
    plan = GraphPlan()
    d = plan(snap)
    assert d.launch == {"default": 50}
    assert any("limited to 50 by guess_budget=1.25" in r for r in d.reasons)
    # the launch was carried out: the bet is spent, later rounds buy only what the forecast justifies
    later = launched(snap, ("a1", 50))
    again = plan(later)
    assert again.launch == {"default": 4}
    assert any("limited to 0" in r and "50 launched while guessing" in r for r in again.reasons)
    assert GraphPlan(guess_budget=3.0)(snap).launch == {"default": 120}
    # node-hours of start-up, not cost: a spot type at a tenth of the price bets on as many nodes
    spot = NodeType("default", max_nodes=200, startup_estimate=90.0, cost=0.1)
    assert GraphPlan()(snapshot(0.0, spot, (), gate(400), demand, finished=0)).launch == d.launch
    # a deadline bets as balanced does while durations are guesses, whatever the objective
    for objective in ("balanced", "fastest"):
        assert GraphPlan(objective, deadline=3600.0)(snap).launch == d.launch
    # ... on the launch view (a kind never seen at the prior, not at the mean of the others)
    view = RemainingWork((0.5,) + (300.0,) * 70, ((),) + ((0,),) * 70, (), for_launch=(0.5,) * 71)
    shown = snapshot(0.0, nt, (), view, demand, finished=0)
    assert GraphPlan(deadline=3600.0)(shown).launch == GraphPlan()(shown).launch
    assert GraphPlan(deadline=3600.0, guess_budget=0.0)(shown).launch == GraphPlan(guess_budget=0.0)(shown).launch


def test_a_bet_the_controller_did_not_carry_out_is_not_charged() -> None:
    nt = NodeType("default", max_nodes=200, startup_estimate=90.0)
    snap = snapshot(0.0, nt, (), gate(400), (Demand(CPU, "split", 1, 0.5),), finished=0)
    plan = GraphPlan()
    first = plan(snap).launch
    # dropped (a stale forecast, a limit): no launch appears, so the next round asks again in full
    assert plan(replace(snap, now=1.0)).launch == first
    # carried out only in part (clamped to 30 nodes): the rest of the bet is left
    assert plan(launched(snap, ("a1", 30))).launch == {"default": 20}
    # a launch first seen after some of its nodes joined counts whole (its ``nodes`` are those to come)
    part = replace(snap, now=1.0, pending=(PendingLaunch("a9", "default", 10, (), 0.0, requested=60),))
    plan2 = GraphPlan()
    plan2(snap)
    assert plan2(part).launch == {"default": 4}


def test_a_new_graph_after_an_idle_pool_gets_a_new_bet() -> None:
    nt = NodeType("default", max_nodes=200, startup_estimate=90.0)
    demand = (Demand(CPU, "split", 1, 0.5),)
    snap = snapshot(0.0, nt, (), gate(400), demand, finished=0)
    plan = GraphPlan()
    plan(snap)
    assert plan(launched(snap, ("a1", 50))).launch == {"default": 4}  # spent
    # the graph was cancelled (nothing finished): no work known, nothing running or waiting
    plan(snapshot(600.0, nt, (), None, (), finished=0))
    assert plan(snapshot(3600.0, nt, (), gate(400), demand, finished=0)).launch == {"default": 50}


def test_guess_budget_zero_means_no_bet_even_for_a_free_start_up() -> None:
    free = NodeType("default", max_nodes=200, startup_estimate=90.0, billed_startup=0.0)
    snap = snapshot(0.0, free, (), gate(400), (Demand(CPU, "split", 1, 0.5),), finished=0)
    assert GraphPlan(guess_budget=0.0)(snap).launch == {"default": 4}
    assert GraphPlan()(snap).launch["default"] > 100  # nothing billed: no limit


def test_the_runnable_tasks_and_the_nodes_the_forecast_justifies_are_launched_whatever_the_bet() -> None:
    nt = NodeType("default", max_nodes=400, startup_estimate=90.0)
    # 100 runnable tasks at the prior, each gating 4 more: 100 nodes for the runnable ones (beyond
    # the bet's 50, which they serve too: the work behind them runs on them)
    n = 100
    durations = (0.5,) * (n * 5)
    deps = tuple(() for _ in range(n)) + tuple((k % n,) for k in range(4 * n))
    plan = GraphPlan()
    snap = snapshot(0.0, nt, (), RemainingWork(durations, deps, ()), (Demand(CPU, "w", n, 0.5),), finished=0)
    assert plan(snap).launch == {"default": n}
    later = launched(snap, ("a1", n))  # they count: no bet on top, only what the forecast justifies
    assert plan(later).launch == GraphPlan(guess_budget=0.0)(later).launch
    # behind a gate, 70 tasks the user says take 300 s (the forecast justifies a node each) and 400
    # at the prior: the 70, not limited by the bet's 50
    durations = (0.5,) + (300.0,) * 70 + (0.5,) * 400
    work = RemainingWork(durations, ((),) + ((0,),) * 470, ())
    snap = snapshot(0.0, nt, (), work, (Demand(CPU, "split", 1, 0.5),), finished=0)
    justified = GraphPlan(guess_budget=0.0)(snap).launch["default"]
    assert justified >= 70
    assert GraphPlan()(snap).launch == {"default": justified}


def test_guess_budget_is_checked() -> None:
    for bad in (-1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ConfigError, match="guess_budget must be a number >= 0"):
            GraphPlan(guess_budget=bad)  # type: ignore[arg-type]
    assert default_policy(guess_budget=0.5).plan.guess_budget == 0.5


def test_a_budget_buys_no_node_that_would_work_less_than_its_start_up() -> None:
    # 10 nodes held; 30 tasks of 40 s: a node arriving after its 60 s start-up gets one 40 s task at
    # most, so it would pay more for booting than for working.  The money is there (budget 100).
    nt = NodeType("default", max_nodes=100, startup_estimate=60.0, cost=3.6)
    ws = tuple(worker(f"w{i}", running=1) for i in range(10))
    snap = snapshot(0.0, nt, ws, wide(30, 40.0), (Demand(CPU, "work", 20, 40.0),))
    f = snap.forecasts[0]
    assert any(0 < b < nt.startup_estimate for b in f.new_busy[1:])  # a purchase would work under S
    d = GraphPlan(budget=100.0)(snap)
    assert d.launch.get("default", 0) == 0
    assert any("under their start-up of 60.0s; none bought" in r for r in d.reasons)
    # 30 tasks of 400 s: a new node works several start-ups, and it is bought
    snap = snapshot(0.0, nt, ws, wide(30, 400.0), (Demand(CPU, "work", 20, 400.0),))
    d = GraphPlan(budget=100.0)(snap)
    k = d.launch.get("default", 0)
    assert k > 0
    f = snap.forecasts[0]
    assert f.new_busy[f.extra.index(k)] >= nt.startup_estimate


def test_a_budget_with_no_node_held_buys_the_first_whatever_it_would_work() -> None:
    nt = NodeType("default", max_nodes=100, startup_estimate=60.0, cost=3.6)
    d = GraphPlan(budget=100.0)(snapshot(0.0, nt, (), wide(2, 5.0), (Demand(CPU, "work", 2, 5.0),)))
    assert d.launch.get("default", 0) >= 1


@pytest.mark.parametrize("objective", ["cheapest", "balanced"])
@pytest.mark.parametrize("finished", [0, 10])
def test_an_empty_pool_with_runnable_work_gets_a_node_whatever_the_objective(objective: str, finished: int) -> None:
    # found by a bug hunt: adapt(objective="cheapest") on an empty pool launched nothing for one
    # 0.1 s task (it would work less than 3 start-ups) until the no-progress net fired 30 s later;
    # balanced did the same for short work once a task had finished
    nt = NodeType("default", max_nodes=2, startup_estimate=5.0)
    demand = (Demand(CPU, "work", 1, 0.1),)
    d = GraphPlan(objective)(snapshot(0.0, nt, (), wide(1, 0.1), demand, finished=finished))
    assert d.launch == {"default": 1}, d
    assert d.reasons, "a launch carries its reason"
    if finished == 0 and objective == "balanced":
        return  # on guessed durations balanced launches for every runnable task (tested above)
    # with a node up, short measured work does not buy a second one
    assert GraphPlan(objective)(snapshot(0.0, nt, (worker("w0", running=1),), wide(2, 0.1), demand,
                                         finished=finished)).launch == {}  # fmt: skip


def test_the_first_node_rule_buys_only_the_best_type_for_work_nothing_can_run() -> None:
    # a review: it bought a gpu node at t=0 for a gpu task behind an hour of cpu work the cpu
    # workers were running (the per-type forecast saw the gpu task as runnable)
    from tidepool.scaling.forecast import type_forecasts as forecasts_of

    gpu_shape = (("cpu", 1.0), ("gpu", 1.0))
    cpu = NodeType("cpu", {"cpu": 1.0}, max_nodes=4, startup_estimate=30.0, cost=1.0)
    gpu = NodeType("gpu", {"cpu": 1.0, "gpu": 1.0}, max_nodes=2, startup_estimate=30.0, cost=20.0)
    work = RemainingWork((3600.0,) * 4 + (10.0,), ((),) * 4 + ((0, 1, 2, 3),), (0, 1, 2, 3),
                         tuple(f"k{i}" for i in range(5)))  # fmt: skip
    ws = tuple(worker(f"c{i}", running=1, node_type="cpu") for i in range(4))
    fc, eta, nxt = forecasts_of(GraphView(work, (CPU,) * 4 + (gpu_shape,)), ws, (cpu, gpu), {"cpu": 4}, (), 0.0, set())
    snap = ClusterSnapshot(now=0.0, node_types=(cpu, gpu), demand=(Demand(CPU, "work", 4, 3600.0),), workers=ws,
                           finished=10, waiting=1, running=4, forecasts=fc, eta=eta, next_demand_in=nxt)  # fmt: skip
    for objective in ("cheapest", "balanced"):
        assert "gpu" not in GraphPlan(objective)(snap).launch
    # an empty pool with cpu work and both types: one cpu node, not a gpu one as well
    wide1 = RemainingWork((0.1,), ((),), (), ("k0",))
    fc, eta, nxt = forecasts_of(GraphView(wide1, (CPU,)), (), (cpu, gpu), {}, (), 0.0, set())
    empty = ClusterSnapshot(now=0.0, node_types=(cpu, gpu), demand=(Demand(CPU, "work", 1, 0.1),), workers=(),
                            finished=10, forecasts=fc, eta=eta, next_demand_in=nxt)  # fmt: skip
    assert GraphPlan("cheapest")(empty).launch == {"cpu": 1}
    leaving = replace(worker("c0", node_type="cpu"), state="retiring")  # a review: it takes no new task
    assert GraphPlan("cheapest")(replace(empty, workers=(leaving,))).launch == {"cpu": 1}
