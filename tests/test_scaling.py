"""Pure tests of planning, policies, forecasts and the scaling controller (fake clock, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.errors import ConfigError
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.forecast import critical_path, list_schedule
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import (
    Joined,
    LaunchFailed,
    Named,
    Report,
    remaining_work,
    step_with_state,
)
from tidepool.scaling.planner import plan, rank_types
from tidepool.scaling.policies import (
    Adaptive,
    Backlog,
    CompletionTarget,
    IdleRetire,
    MemoryPressure,
    NoProgress,
    as_decision,
)
from tidepool.scaling.snapshot import ClusterSnapshot, Demand, ScaleDecision, WorkerView
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver

CPU = NodeType("cpu", {"cpu": 8}, max_nodes=4, startup_estimate=1.0)
GPU = NodeType("gpu", {"cpu": 4, "gpu": 2}, max_nodes=2, cost=3.0, startup_estimate=1.0)
CPU_SHAPE = (("cpu", 1.0),)
GPU_SHAPE = (("cpu", 1.0), ("gpu", 1.0))


def snap(demand=(), workers=(), now=10.0, types=(CPU, GPU), **kw) -> ClusterSnapshot:  # type: ignore[no-untyped-def]
    return ClusterSnapshot(now=now, node_types=types, demand=tuple(demand), workers=tuple(workers), **kw)


def worker(wid: str, nt: str = "cpu", running: int = 0, idle_since: float | None = 0.0, unique: int = 0,
           joined: float = 0.0, resources: dict | None = None) -> WorkerView:  # type: ignore[type-arg]  # fmt: skip
    res = resources or ({"cpu": 8.0} if nt == "cpu" else {"cpu": 4.0, "gpu": 2.0})
    return WorkerView(wid, nt, "running", res, int(res["cpu"]), running, 0.0, 0, unique, unique * 10,
                      idle_since if running == 0 else None, joined)  # fmt: skip


# ---- node types and planner -------------------------------------------------------------------
def test_node_type_validation_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="min_nodes <= max_nodes"):
        NodeType("x", {"cpu": 1}, min_nodes=3, max_nodes=1)
    with pytest.raises(ConfigError, match="workers_per_node"):
        NodeType("x", {"cpu": 1}, workers_per_node=0)
    with pytest.raises(ConfigError, match="byte amount"):
        NodeType("x", {"cpu": 1, "memory": "lots"})
    assert NodeType("m", {"cpu": 8, "memory": "16GB"}, workers_per_node=2).worker_resources == {
        "cpu": 4.0, "memory": 8e9}
    with pytest.raises(ConfigError, match="billed_startup must be a finite number >= 0"):
        NodeType("x", billed_startup=float("nan"))
    assert NodeType("s", startup_estimate=200, billed_startup=10).billed_startup == 10.0
    assert NodeType("c").billed_startup is None  # all of a start-up is billed (a cloud VM)


def test_simulated_presets_say_which_part_of_a_start_up_is_billed() -> None:
    from tidepool.sim import preset_cluster

    # the simulator bills from allocation: a Slurm queue wait is free, its boot is not
    slurm = preset_cluster("slurm:4").node_types[0]
    assert slurm.billed_startup == 10.0 and slurm.startup_estimate > 150
    assert preset_cluster("cloud:4").node_types[0].billed_startup is None


def test_gpu_demand_only_goes_to_gpu_types_and_cpu_demand_avoids_them() -> None:
    assert [nt.name for nt in rank_types(GPU_SHAPE, (CPU, GPU))] == ["gpu"]
    assert [nt.name for nt in rank_types(CPU_SHAPE, (GPU, CPU))] == ["cpu", "gpu"]
    p = plan(snap([Demand(GPU_SHAPE, "g", 3, 1.0), Demand(CPU_SHAPE, "c", 10, 1.0)]))
    assert p.nodes == {"gpu": 2, "cpu": 2}  # 3 gpu tasks need 2 gpu nodes; 10 cpu tasks 2 cpu nodes
    assert not p.infeasible


def test_cpu_demand_spills_to_gpu_type_only_when_cpu_type_is_full() -> None:
    s = snap([Demand(CPU_SHAPE, "c", 40, 1.0)])  # 4 cpu nodes hold 32
    p = plan(s)
    assert p.nodes == {"cpu": 4, "gpu": 2}


def test_demand_packs_onto_free_capacity_before_new_nodes() -> None:
    s = snap([Demand(CPU_SHAPE, "c", 6, 1.0)], [worker("w1", running=2)])
    assert plan(s).nodes == {}  # 6 free slots on w1
    s = snap([Demand(CPU_SHAPE, "c", 7, 1.0)], [worker("w1", running=2)])
    assert plan(s).nodes == {"cpu": 1}


def test_infeasible_demand_is_reported_with_the_node_types() -> None:
    p = plan(snap([Demand((("cpu", 1.0), ("tpu", 1.0)), "t", 1, 1.0)]))
    assert p.infeasible and "tpu" in p.reasons[0] and "gpu" in p.reasons[0]


def test_blocked_type_is_skipped() -> None:
    s = snap([Demand(CPU_SHAPE, "c", 4, 1.0)], backoff=(("cpu", 99.0),))
    assert plan(s).nodes == {"gpu": 1}


# ---- policies ---------------------------------------------------------------------------------
def test_backlog_waits_then_ramps_1_2_4() -> None:
    b = Backlog(delay=1.0, interval=1.0)
    d = [Demand(CPU_SHAPE, "c", 200, 1.0)]
    many = NodeType("cpu", {"cpu": 1}, max_nodes=100)
    assert b(snap(d, now=10.5, backlog_since=10.0, types=(many,))).empty
    launches = []
    for t in (11.0, 11.5, 12.0, 13.0):
        launches.append(b(snap(d, now=t, backlog_since=10.0, types=(many,))).launch.get("cpu", 0))
    assert launches == [1, 0, 2, 4]
    assert b(snap([], now=14.0, types=(many,))).empty  # backlog gone: ramp resets
    assert b(snap(d, now=16.0, backlog_since=14.5, types=(many,))).launch == {"cpu": 1}


def test_no_progress_launches_one_node_after_stall() -> None:
    p = NoProgress(seconds=30)
    d = [Demand(CPU_SHAPE, "c", 5, 1.0)]
    assert p(snap(d, now=20.0, last_progress=0.0)).empty
    dec = p(snap(d, now=31.0, last_progress=0.0))
    assert dec.launch == {"cpu": 1} and "no progress" in dec.reasons[0]


def test_idle_retire_only_empty_workers_unless_cached_timeout_passed() -> None:
    pol = IdleRetire(idle_timeout=5, cached_idle_timeout=60, lookahead=False)
    ws = [worker("empty", idle_since=0.0), worker("holder", idle_since=0.0, unique=3),
          worker("busy", running=1), worker("fresh", idle_since=8.0)]  # fmt: skip
    assert pol(snap([], ws, now=10.0)).retire == ("empty",)
    assert set(pol(snap([], ws, now=61.0)).retire) == {"empty", "holder", "fresh"}


def test_idle_holder_retires_after_the_plain_timeout_when_no_work_can_come_before_a_new_node() -> None:
    """Bursty graphs whose client keeps every result: the workers of a finished wide phase all hold
    data.  When the forecast says nothing can run before a new node could start, they go after the
    plain idle timeout (their data moved), not after cached_idle_timeout (60 s of 1,000 idle VMs)."""
    pol = IdleRetire(idle_timeout=5, cached_idle_timeout=60, lookahead=True)
    ws = [worker("holder", idle_since=0.0, unique=3)]
    assert pol(snap([], ws, now=6.0, next_demand_in=300.0)).retire == ("holder",)
    assert pol(snap([], ws, now=4.0, next_demand_in=300.0)).retire == ()  # not before the timeout
    assert pol(snap([], ws, now=6.0, next_demand_in=2.0)).retire == ()  # work comes soon: keep it


def test_idle_retire_keeps_workers_that_fit_demand_and_the_controller_keeps_min_nodes() -> None:
    pol = IdleRetire(idle_timeout=1, lookahead=False)
    gpu_demand = [Demand(GPU_SHAPE, "g", 1, 1.0)]
    ws = [worker("c1"), worker("g1", nt="gpu")]
    assert pol(snap(gpu_demand, ws, now=10.0)).retire == ("c1",)  # g1 fits the waiting gpu task
    # limits live in one place, the controller: the policy proposes, min_nodes=1 keeps one
    keep_one = NodeType("cpu", {"cpu": 1}, min_nodes=1, max_nodes=4)
    d = StateDriver()
    d.add_worker("c1", node_type="cpu")
    d.add_worker("c2", node_type="cpu")
    c = ScalingController((keep_one,), IdleRetire(idle_timeout=1, lookahead=False), forecast_interval=0.25,
                          manage_foreign=True)  # fmt: skip
    assert len(step_with_state(c, d.state, 10.0).retire) == 1


def test_idle_retire_lookahead_retires_at_once_when_no_work_can_arrive() -> None:
    pol = IdleRetire(idle_timeout=5, lookahead=True)
    ws = [worker("w", idle_since=9.9)]
    assert pol(snap([], ws, now=10.0, next_demand_in=None)).retire == ("w",)
    assert pol(snap([], ws, now=10.0, next_demand_in=0.5)).retire == ()
    assert IdleRetire()(snap([], ws, now=10.0, next_demand_in=None)).retire == ("w",)  # the default looks ahead


def test_an_idle_timeout_the_user_sets_is_kept_even_when_no_work_is_forecast() -> None:
    # found by a bug hunt: IdleRetire(idle_timeout=5) retired idle workers 0.1 s after a graph
    # ended (the forecast saw no more work), so between an interactive session's graphs the pool
    # was always gone
    pol = IdleRetire(idle_timeout=5)
    ws = [worker("w", idle_since=9.9), worker("holder", idle_since=9.9, unique=2)]
    assert pol(snap([], ws, now=10.0, next_demand_in=None)).retire == ()
    assert pol(snap([], ws, now=15.0, next_demand_in=None)).retire == ("w",)


def test_adaptive_keeps_young_workers_and_the_controller_never_launches_and_retires_one_type() -> None:
    ws = [worker("young", joined=9.5, idle_since=9.5), worker("old", idle_since=0.0)]

    def wants_both(s: ClusterSnapshot) -> ScaleDecision:
        return ScaleDecision(launch={"gpu": 1}, retire=("young", "old"))

    a = Adaptive(launcher=wants_both, no_progress=None, idle=None, min_lifetime=1.0)
    dec = a(snap([], ws, now=10.0))
    assert dec.retire == ("old",) and dec.launch == {"gpu": 1}
    d = StateDriver()
    d.add_worker("old", node_type="cpu")
    one = NodeType("cpu", {"cpu": 1}, max_nodes=4)
    c = ScalingController((one,), lambda s: ScaleDecision(launch={"cpu": 1}, retire=("old",)),
                          forecast_interval=0.25, manage_foreign=True)  # fmt: skip
    acts = step_with_state(c, d.state, 10.0)
    assert acts.launch and acts.retire == []  # the same type is launched this round: keep it


def test_user_policies_may_return_dicts_and_bad_returns_are_rejected() -> None:
    assert as_decision({"launch": {"cpu": 2}}).launch == {"cpu": 2}
    assert as_decision(None).empty
    with pytest.raises(ConfigError, match="unknown fields"):
        as_decision({"lanch": {}})
    with pytest.raises(ConfigError, match="ScaleDecision or a dict"):
        as_decision(42)


# ---- forecasts ---------------------------------------------------------------------------------
def test_list_schedule_and_critical_path() -> None:
    from tidepool.scaling.forecast import RemainingWork

    wide = RemainingWork((0.5,) * 40, ((),) * 40, ())
    assert list_schedule(wide, 4) == pytest.approx(5.0)
    assert list_schedule(wide, 1, (1.0,) * 3) == pytest.approx(6.0)  # 2 tasks, then 38 on 4 slots
    chain = RemainingWork((1.0,) * 20, tuple((i - 1,) if i else () for i in range(20)), ())
    assert critical_path(chain) == list_schedule(chain, 1) == list_schedule(chain, 8) == 20.0
    diamond = RemainingWork((1.0, 2.0, 3.0, 1.0), ((), (0,), (0,), (1, 2)), ())
    assert critical_path(diamond) == 5.0 and list_schedule(diamond, 1) == 7.0


def driver_with(tasks: list, durations: dict[str, float]) -> StateDriver:  # type: ignore[type-arg]
    d = StateDriver(SchedulerState())
    for group, dur in durations.items():  # teach the estimates
        d.state.estimates.observe(group, dur)
    d.submit(tasks, [t[0] for t in tasks if not any(t[0] in u[1] for u in tasks)])
    return d


def controller(types: tuple[NodeType, ...] = (CPU,), **kw) -> ScalingController:  # type: ignore[no-untyped-def]
    return ScalingController(types, Adaptive(), forecast_interval=0.25, **kw)


ONE = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=0.5)


def test_completion_target_chain_adds_nothing_beyond_one_worker() -> None:
    d = driver_with([(f"c-{i}", [f"c-{i - 1}"] if i else []) for i in range(20)], {"c": 0.5})
    c = controller((ONE,))
    acts = step_with_state(c, d.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 1)]
    d.add_worker("cpu-1")
    for t in range(1, 40):
        d.step(duration=0.5)
        d.clock.advance(0.5)
        acts = step_with_state(c, d.state, 0.5 * t)
        assert not acts.launch, acts.snapshot


def test_completion_target_wide_phase_adds_enough_at_once() -> None:
    d = driver_with([(f"w-{i}", []) for i in range(40)], {"w": 0.5})
    acts = step_with_state(controller((ONE,)), d.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 4)]


def test_completion_target_narrow_phase_and_diamond() -> None:
    d = driver_with([("a", []), ("b", ["a"]), ("c", ["a"]), ("z", ["b", "c"])], {"a": 0.2, "b": 0.2, "c": 0.2, "z": 0.2})
    d.add_worker("w0")
    acts = step_with_state(controller((ONE,)), d.state, 0.0)
    assert not acts.launch  # a 0.2 s fan-out of two cannot win back a 0.5 s startup
    d2 = driver_with([("a", []), ("b", ["a"]), ("c", ["a"]), ("z", ["b", "c"])], {"a": 5, "b": 5, "c": 5, "z": 5})
    d2.add_worker("w0")
    d2.finish("w0", "a", duration=5)
    acts = step_with_state(controller((ONE,)), d2.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 1)]  # b and c in parallel


def test_completion_target_max_eta_and_deadline() -> None:
    d = driver_with([(f"w-{i}", []) for i in range(40)], {"w": 0.5})
    d.add_worker("w0")
    relaxed = ScalingController((ONE,), CompletionTarget(max_eta=60), forecast_interval=0.25)
    assert not step_with_state(relaxed, d.state, 0.0).launch  # 20 s on one worker is within 60 s
    tight = ScalingController((ONE,), CompletionTarget(max_eta=8), forecast_interval=0.25)
    assert [(nt.name, n) for _, nt, n in step_with_state(tight, d.state, 0.0).launch] == [("cpu", 2)]  # ~7 s


def test_remaining_work_uses_elapsed_time_of_running_tasks() -> None:
    d = driver_with([("slow-1", [])], {"fast": 0.1})
    d.add_worker("w0")
    d.state.now = 30.0
    work = remaining_work(d.state, 30.0)
    assert work.durations[0] == pytest.approx(7.5)  # ran 30 s already: expect a quarter more
    assert work.unknown == frozenset({0})


def test_remaining_work_as_a_launch_and_as_holding_see_kinds_never_seen() -> None:
    d = driver_with([("slow-1", []), ("after-1", ["slow-1"])], {"fast": 10.0})
    d.add_worker("w0")
    d.state.now = 30.0
    work = remaining_work(d.state, 30.0)
    assert work.durations == pytest.approx((7.5, 10.0))  # the forecast: a quarter more; the mean of known kinds
    assert work.for_hold == pytest.approx((30.0, 10.0))  # holding: at least as long again as it ran
    assert work.for_launch == pytest.approx((7.5, 0.5))  # a launch: the scheduler's prior until one finishes
    d.state.estimates.observe("after", 10.0)
    assert remaining_work(d.state, 30.0).for_launch is None  # nothing unseen waits: one view


def test_remaining_work_a_launch_raises_an_unseen_kind_to_its_elapsed_time_not_the_known_mean() -> None:
    # one task of a kind that never finished has started: its waiting siblings are no longer the
    # prior, but neither are they the mean of the other kinds (300 s here, 308 s on the montage)
    d = driver_with([("diff-1", []), ("diff-2", [])], {"proj": 300.0})
    d.add_worker("w0")  # one slot: diff-1 runs, diff-2 waits
    d.state.now = 2.0
    work = remaining_work(d.state, 2.0)
    assert work.durations == pytest.approx((298.0, 300.0))  # the forecast: the mean of known kinds
    assert work.for_launch == pytest.approx((0.5, 2.0))  # a launch: what the running one has shown
    d.state.now = 40.0
    assert remaining_work(d.state, 40.0).for_launch == pytest.approx((10.0, 40.0))


# ---- controller --------------------------------------------------------------------------------
def test_controller_tracks_arrivals_and_learns_startup() -> None:
    d = driver_with([(f"w-{i}", []) for i in range(8)], {"w": 10.0})
    c = controller((ONE,))
    (rid, nt, n), *_ = step_with_state(c, d.state, 0.0).launch
    ids = tuple(f"cpu-{rid}-{i}" for i in range(n))
    assert not step_with_state(c, d.state, 0.1, reports=[Named(rid, ids, 0.0)]).launch  # in flight: not launched again
    for w in ids:
        d.add_worker(w)
    acts = step_with_state(c, d.state, 2.1, reports=[Joined(w, 2.0) for w in ids])
    assert acts.view.startup["cpu"] == 2.0 and not acts.view.pending
    assert any(r["kind"] == "launch-arrived" for r in acts.records)
    inst = c.instances.instances[ids[0]]
    assert [s for _, s, _ in inst.history] == ["named", "joined"] and c.instances.requests[rid].state == "joined"


def test_controller_cancels_launch_that_never_arrives_backs_off_and_tries_another_type() -> None:
    cpu = NodeType("cpu", {"cpu": 1}, max_nodes=2, startup_estimate=1.0)
    big = NodeType("big", {"cpu": 4}, max_nodes=1, cost=5.0, startup_estimate=1.0)
    d = driver_with([(f"w-{i}", []) for i in range(2)], {"w": 30.0})
    c = ScalingController((cpu, big), Adaptive(), launch_timeout=10.0, forecast_interval=0.25)
    acts = step_with_state(c, d.state, 0.0)
    assert [nt.name for _, nt, _ in acts.launch] == ["cpu"]
    rid = acts.launch[0][0]
    acts = step_with_state(c, d.state, 11.0, reports=[Named(rid, ("cpu-x-1", "cpu-x-2"), 0.0)])
    assert sorted(acts.terminate) == ["cpu-x-1", "cpu-x-2"]  # no leak: cancelled ones are stopped
    assert [nt.name for _, nt, _ in acts.launch] == ["big"]  # cpu is in backoff: use what else fits
    kinds = [r["kind"] for r in c.journal.records]
    assert "cancel-launch" in kinds and "backoff" in kinds


def test_controller_disables_type_after_repeated_failures_and_says_why() -> None:
    d = driver_with([("w-0", [])], {"w": 30.0})
    c = ScalingController((ONE,), Adaptive(), max_type_failures=2, backoff_base=1.0, forecast_interval=0.25)
    t = 0.0
    reports: list[Report] = []
    for _ in range(2):
        acts = step_with_state(c, d.state, t, reports=reports)
        assert acts.launch
        reports = [LaunchFailed(acts.launch[0][0], "sbatch: invalid partition", t)]
        t += 10
    acts = step_with_state(c, d.state, t + 100, reports=reports)
    assert "cpu" in acts.view.unusable and "invalid partition" in acts.view.unusable["cpu"]
    assert not acts.launch
    assert acts.feasibility is not None and acts.feasibility.disabled[0][0] == "cpu"  # for the scheduler


def test_controller_enforces_min_and_max_nodes_and_max_workers() -> None:
    d = StateDriver()
    floor = NodeType("cpu", {"cpu": 1}, min_nodes=2, max_nodes=3)
    c = ScalingController((floor,), lambda s: ScaleDecision(launch={"cpu": 10}), forecast_interval=0.25)
    acts = step_with_state(c, d.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 3)]
    c2 = ScalingController((floor,), lambda s: None, forecast_interval=0.25)
    assert [(nt.name, n) for _, nt, n in step_with_state(c2, d.state, 0.0).launch] == [("cpu", 2)]  # min_nodes
    c3 = ScalingController((floor,), lambda s: ScaleDecision(launch={"cpu": 10}), max_workers=1,
                           forecast_interval=0.25)  # fmt: skip
    assert [(nt.name, n) for _, nt, n in step_with_state(c3, d.state, 0.0).launch] == [("cpu", 1)]
    # each cut is said in the launch's journal record (it was silent: "the policy asked")
    said = [r["reason"] for r in c.journal.records if r["kind"] == "launch"]
    assert said and "cpu: 10 node(s) asked, 3 launched: max_nodes is 3" in said[0]
    said = [r["reason"] for r in c3.journal.records if r["kind"] == "launch"]
    assert said and "cpu: 3 node(s) asked, 1 launched: max_workers is 1" in said[0]
    # at the limit nothing is launched: the decision record says why (the review of this fix)
    step_with_state(c, d.state, 20.0)
    said = [r["reason"] for r in c.journal.records if r["kind"] == "decision"]
    assert any("cpu: 10 node(s) asked, 0 launched: max_nodes is 3 (3 held or coming)" in x for x in said), said


def test_infeasible_tasks_fail_at_once_with_a_clear_error() -> None:
    from tidepool.scheduler import events as ev

    c = controller((CPU, GPU))
    state = SchedulerState()
    d = StateDriver(state)
    d.send(ev.CheckFeasible(0.0, c.view.feasibility))  # as the shell does when autoscaling starts
    d.submit([("t-1", [], {"tpu": 1}), ("ok-1", [])], ["t-1", "ok-1"])
    ts = state.tasks["t-1"]
    assert ts.state == "erred" and ts.exc_type == "InfeasibleTaskError"
    assert "tpu" in ts.message and "gpu" in ts.message
    assert state.tasks["ok-1"].state == "no-worker"  # feasible: waits as demand
    assert d.status()["t-1"] == "erred"


def test_list_schedule_counts_each_task_once_behind_a_running_task() -> None:
    from tidepool.scaling.forecast import RemainingWork

    chain = RemainingWork((0.15,) + (0.2,) * 10, tuple((i - 1,) if i else () for i in range(11)), (0,))
    assert list_schedule(chain, 1) == pytest.approx(2.15)
    assert list_schedule(chain, 1, (0.1,)) == pytest.approx(2.15)  # another slot cannot help a chain


def test_completion_target_on_the_bursty_graph_phase_by_phase() -> None:
    tasks = [(f"w-{i}", []) for i in range(40)] + [("r-1", [f"w-{i}" for i in range(40)])]
    tasks += [(f"b-{i}", ["r-1"]) for i in range(40)] + [("z-1", [f"b-{i}" for i in range(40)])]
    d = driver_with(tasks, {"w": 0.5, "b": 0.5})
    c = controller((ONE,))
    acts = step_with_state(c, d.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 4)]  # wide phase: all at once
    reports: list[Report] = [Named(acts.launch[0][0], tuple(f"cpu-{i}" for i in range(4)), 0.0)]
    for i in range(4):
        d.add_worker(f"cpu-{i}", node_type="cpu")
        reports.append(Joined(f"cpu-{i}", 0.5))
    for _ in range(10):
        d.step(duration=0.5)
    assert d.state.tasks["r-1"].state == "running"  # the reduce: one task, duration never seen
    runner = d.state.tasks["r-1"].worker
    from tidepool.scheduler import events as ev

    for i in range(40):  # the reduce's worker fetched its inputs (as a real worker reports)
        d.send(ev.AddReplica(runner, f"w-{i}", 8, d.clock()))  # type: ignore[arg-type]
    d.state.now = d.clock.advance(7.0)
    acts = step_with_state(c, d.state, d.clock(), reports=reports)
    assert not acts.launch
    assert len(acts.retire) == 3  # nothing can use them before the reduce ends: let them go
    for w in acts.retire:
        d.remove_worker(w, graceful=True)
    assert list(d.state.workers) == [runner]
    d.finish(runner, "r-1", duration=3.0)  # type: ignore[arg-type]
    d.state.now = d.clock.advance(3.0)
    acts = step_with_state(c, d.state, d.clock())
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 3)], acts.snapshot  # second wide phase


def test_duration_estimates_adapt_but_resist_outliers() -> None:
    from tidepool.scheduler.estimates import DurationEstimates

    est = DurationEstimates(default_prior=0.5)
    assert est.estimate("new") == 0.5
    for _ in range(20):
        est.observe("f", 1.0)
    assert est.estimate("never-seen") == pytest.approx(1.0)  # the prior follows what was seen
    est.observe("f", 1000.0)  # one freak sample
    assert est.estimate("f") < 1.3
    for _ in range(60):
        est.observe("f", 3.0)  # a real shift is followed
    assert est.estimate("f") == pytest.approx(3.0, rel=0.05)


def test_tasks_waiting_when_autoscaling_starts_fail_at_once_if_no_node_type_can_run_them() -> None:
    """The feasibility rule reaches the state as an event when the autoscaler starts: a task that
    was already waiting for a worker (submitted before adapt) fails then, instead of waiting for
    ever (the state had no rule, and with an autoscaler no no_worker_timeout either)."""
    from tidepool.scheduler import events as ev

    d = StateDriver(SchedulerState())
    d.submit([("t-1", [], {"tpu": 1}), ("ok-1", [])], ["t-1", "ok-1"])
    tasks = d.state.tasks
    assert tasks["t-1"].state == tasks["ok-1"].state == "no-worker"
    d.send(ev.CheckFeasible(d.clock(), controller((CPU, GPU)).view.feasibility))  # adapt() starts
    assert d.status() == {"t-1": "erred"} and tasks["ok-1"].state == "no-worker"
    assert tasks["t-1"].exc_type == "InfeasibleTaskError" and "tpu" in tasks["t-1"].message


def test_workers_named_after_their_launch_was_given_up_are_terminated() -> None:
    d = driver_with([(f"w-{i}", []) for i in range(2)], {"w": 30.0})
    c = ScalingController((ONE,), Adaptive(), launch_timeout=5.0, forecast_interval=0.25)
    (rid, _, _), *_ = step_with_state(c, d.state, 0.0).launch
    acts = step_with_state(c, d.state, 6.0)  # timed out before the provider named anything
    assert c.instances.requests[rid].state == "failed" and not acts.terminate
    acts = step_with_state(c, d.state, 6.5, reports=[Named(rid, ("late-1",), 6.2)])
    assert acts.terminate == ["late-1"]  # they would join uncounted otherwise
    assert c.instances.instances["late-1"].state == "failed"


@pytest.mark.parametrize("make", [
    lambda: IdleRetire(idle_timeout=float("nan")),  # switched idle retirement off, silently
    lambda: IdleRetire(cached_idle_timeout=-1),
    lambda: NoProgress(-3),
    lambda: CompletionTarget(max_eta=-1),
    lambda: Backlog(delay=-1),
    lambda: Backlog(interval=float("nan")),
    lambda: MemoryPressure(fraction="0.5"),
    lambda: Adaptive(min_lifetime=-1),
])  # fmt: skip
def test_built_in_policy_objects_refuse_what_a_cluster_files_policy_table_refuses(make: Any) -> None:
    # found by a bug hunt: all of these were accepted
    with pytest.raises(ConfigError, match="must be"):
        make()
    IdleRetire(idle_timeout=float("inf"), cached_idle_timeout=0)  # "never" and "at once" stay allowed


def test_the_simulators_dask_rule_refuses_a_minimum_above_its_maximum() -> None:
    from tidepool.sim.policies import DaskLike

    with pytest.raises(ConfigError, match="minimum must be <= maximum"):
        DaskLike(minimum=5, maximum=2)  # ran at 2 and never retired anyone
    with pytest.raises(ConfigError, match="number of workers >= 0"):
        DaskLike(maximum=-1)
    DaskLike(maximum=float("inf"))  # Dask's own default maximum
    import numpy as np

    IdleRetire(idle_timeout=np.int64(30))  # numpy numbers are numbers (the review of this fix)
