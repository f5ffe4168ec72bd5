"""Calling off launches in flight (``ScaleDecision.cancel``): the controller gives up and terminates
the nodes of a launch that have not registered (a queued Slurm job, a booting VM), and the default
policy asks for it when the forecast leaves them no work.  Fake clock, FakeProvider and the shared
round only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_reconcile import run_round, shell
from test_sim_budget import TRACES
from tidepool.errors import ConfigError
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.forecast import RemainingWork
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import GraphView
from tidepool.scaling.planned import default_policy
from tidepool.scaling.policies import as_decision, check_decision, merge
from tidepool.scaling.snapshot import (
    ClusterSnapshot,
    Demand,
    PendingLaunch,
    ScaleDecision,
    WorkerView,
)
from tidepool.testing import FakeClock, FakeProvider, StateDriver

CPU = NodeType("cpu", {"cpu": 1}, max_nodes=8, startup_estimate=1.0)


def scripted(*decisions: ScaleDecision):  # type: ignore[no-untyped-def]
    """A policy that returns ``decisions`` in turn, then nothing."""
    left = list(decisions)

    def policy(snap: ClusterSnapshot) -> ScaleDecision:
        return left.pop(0) if left else ScaleDecision()

    return policy


def started(nt: NodeType, policy, *, startup: float = 100.0):  # type: ignore[no-untyped-def]
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = FakeProvider(clock, startup=startup)
    c = ScalingController((nt,), policy, launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    return clock, d, p, c, rnd


def test_calling_off_terminates_the_newest_nodes_still_coming_and_the_rest_stay_pending() -> None:
    policy = scripted(ScaleDecision(launch={"cpu": 4}), ScaleDecision(cancel={"cpu": 3}, reasons=("call off 3",)))
    clock, d, p, c, rnd = started(CPU, policy)
    ids = run_round(rnd, d, p, clock)
    assert len(ids) == 4
    clock.advance(10.0)
    run_round(rnd, d, p, clock)
    alive = [w for w in ids if p.workers[w]["alive"]]
    assert alive == ids[:1]  # the three newest were terminated (a queued job cancelled)
    for w in ids[1:]:
        inst = c.instances.instances[w]
        assert inst.state == "failed" and inst.reason.startswith("called off")
    (rec,) = [r for r in rnd.journal.records if r["kind"] == "cancel-launch"]
    assert rec["nodes"] == 3 and rec["workers"] == ids[1:] and "call off 3" in rec["reason"]
    # the one left is still coming and joins; the call-off was no failure of the node type
    for _ in range(100):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert set(d.state.workers) == {ids[0]}
    kinds = [r["kind"] for r in rnd.journal.records]
    assert "launch-arrived" in kinds and "backoff" not in kinds and "launch-failed" not in kinds
    assert rnd.view.failures.get("cpu", 0) == 0 and not rnd.view.unusable and not c.instances.open


def test_a_launch_called_off_as_a_whole_ends_without_counting_as_a_failure() -> None:
    policy = scripted(ScaleDecision(launch={"cpu": 2}), ScaleDecision(cancel={"cpu": 5}))
    clock, d, p, c, rnd = started(CPU, policy)
    ids = run_round(rnd, d, p, clock)
    clock.advance(1.0)
    run_round(rnd, d, p, clock)
    assert not any(p.workers[w]["alive"] for w in ids)
    req = c.instances.requests["a1"]
    assert req.state == "failed" and "called off" in req.history[-1][2]
    for _ in range(5):  # the listing now shows them gone: not reconciled as failures
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    kinds = [r["kind"] for r in rnd.journal.records]
    assert "reconcile" not in kinds and "backoff" not in kinds and rnd.view.failures.get("cpu", 0) == 0
    assert rnd.view.pending == ()


def test_calling_off_never_goes_below_min_nodes() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=8, min_nodes=2, startup_estimate=1.0)
    policy = scripted(ScaleDecision(cancel={"cpu": 8}))
    clock, d, p, c, rnd = started(nt, policy)
    ids = run_round(rnd, d, p, clock)  # min_nodes launches 2; the policy calls off all
    assert len(ids) == 2
    clock.advance(1.0)
    run_round(rnd, d, p, clock)
    assert all(p.workers[w]["alive"] for w in ids)
    assert not [r for r in rnd.journal.records if r["kind"] == "cancel-launch"]


def test_workers_that_joined_are_never_called_off() -> None:
    policy = scripted(ScaleDecision(launch={"cpu": 3}))
    clock, d, p, c, rnd = started(CPU, policy)
    ids = run_round(rnd, d, p, clock)
    p.workers[ids[2]]["up_at"] = 1e9  # the last one queues; the first two arrive
    clock.advance(101.0)
    run_round(rnd, d, p, clock)
    assert set(d.state.workers) == set(ids[:2])
    c.policy = scripted(ScaleDecision(cancel={"cpu": 3}))
    run_round(rnd, d, p, clock)
    assert [w for w in ids if p.workers[w]["alive"]] == ids[:2]
    assert c.instances.requests["a1"].state == "joined"  # the rest of it came: the launch is done
    assert set(d.state.workers) == set(ids[:2])


def test_a_node_of_several_workers_partly_joined_is_left_alone() -> None:
    nt = NodeType("cpu", {"cpu": 2}, max_nodes=8, startup_estimate=1.0, workers_per_node=2)
    clock, d, p, c, rnd = started(nt, scripted(ScaleDecision(launch={"cpu": 2})))
    ids = run_round(rnd, d, p, clock)
    assert len(ids) == 4
    for w in ids[1:]:
        p.workers[w]["up_at"] = 1e9
    clock.advance(101.0)
    run_round(rnd, d, p, clock)
    c.policy = scripted(ScaleDecision(cancel={"cpu": 2}))
    run_round(rnd, d, p, clock)
    # which workers share a node is the provider's business: nothing is terminated
    assert [w for w in ids if p.workers[w]["alive"]] == ids


def test_a_decision_that_launches_and_calls_off_one_type_is_a_policy_bug() -> None:
    snap = ClusterSnapshot(now=0.0, node_types=(CPU,), demand=(), workers=())
    with pytest.raises(ConfigError, match="launch and to call off"):
        check_decision(ScaleDecision(launch={"cpu": 1}, cancel={"cpu": 1}), snap)
    with pytest.raises(ConfigError, match="unknown node type 'gpu'"):
        check_decision(ScaleDecision(cancel={"gpu": 1}), snap)
    with pytest.raises(ConfigError, match="whole number"):
        check_decision(ScaleDecision(cancel={"cpu": -1}), snap)
    assert as_decision({"cancel": {"cpu": 2}}).cancel == {"cpu": 2}
    # merged with a safety net that launches the type, the launch wins
    merged = merge([ScaleDecision(cancel={"cpu": 2}), ScaleDecision(launch={"cpu": 1})])
    assert merged.launch == {"cpu": 1} and merged.cancel == {}


# ---- the default policy ------------------------------------------------------------------------
SLURM = NodeType("default", {"cpu": 1}, max_nodes=10, startup_estimate=200.0, billed_startup=10.0)


def snap_with(workers: tuple[WorkerView, ...], coming: int, work: RemainingWork, *, finished: int = 10,
              demand: tuple[Demand, ...] = (), node_type: NodeType = SLURM) -> ClusterSnapshot:  # fmt: skip
    from tidepool.scaling.forecast import type_forecasts

    graph = GraphView(work, ((("cpu", 1.0),),) * len(work))
    pending = (PendingLaunch("a1", "default", coming, tuple(f"default-a1-{i}" for i in range(coming)), 0.0, coming),)
    forecasts, eta, nxt = type_forecasts(graph, workers, (node_type,), {"default": len(workers) + coming},
                                         (("default", coming, 0.0),), 50.0, set())  # fmt: skip
    return ClusterSnapshot(now=50.0, node_types=(node_type,), demand=demand, workers=workers, pending=pending,
                           finished=finished, running=sum(w.running for w in workers), forecasts=forecasts,
                           eta=eta, next_demand_in=nxt)  # fmt: skip


def busy(wid: str) -> WorkerView:
    return WorkerView(wid, "default", "running", {"cpu": 1.0}, 1, 1, 0.0, 0, 0, 0, None, joined=-100.0)


def test_the_default_calls_off_nodes_still_queued_that_the_forecast_leaves_no_work() -> None:
    # two nodes busy with the last two long tasks; eight more still in the queue: none would work
    work = RemainingWork((300.0, 300.0), ((), ()), (0, 1))
    d = default_policy()(snap_with((busy("w0"), busy("w1")), 8, work))
    assert d.cancel == {"default": 8} and d.launch == {}
    assert any("call off 8 of the 8 default node(s) still coming" in r for r in d.reasons)


def test_the_default_keeps_the_nodes_still_coming_that_the_forecast_gives_work() -> None:
    # 40 tasks of 300 s behind the two running ones: every node coming is needed
    work = RemainingWork((300.0, 300.0, *([300.0] * 40)), ((), (), *([(0,)] * 40)), (0, 1))
    d = default_policy()(snap_with((busy("w0"), busy("w1")), 8, work))
    assert d.cancel == {}


def test_the_default_calls_nothing_off_while_durations_are_guesses_or_tasks_wait() -> None:
    work = RemainingWork((300.0, 300.0), ((), ()), (0, 1))
    workers = (busy("w0"), busy("w1"))
    assert default_policy()(snap_with(workers, 8, work, finished=0)).cancel == {}
    waiting = (Demand((("cpu", 1.0),), "x", 3, 1.0),)
    assert default_policy()(snap_with(workers, 8, work, demand=waiting)).cancel == {}


def test_on_a_cloud_a_booting_node_whose_work_comes_after_the_horizon_is_called_off() -> None:
    # all of a start-up is billed (no queue): a node booting now whose first work comes long after
    # it arrives costs more held idle than a relaunch in time; on Slurm the same node would wait
    # in the queue for free and is kept (it would get work if it started now)
    cloud = NodeType("default", {"cpu": 1}, max_nodes=10, startup_estimate=90.0)
    work = RemainingWork((400.0, 400.0, *([60.0] * 40)), ((), (), *([(0,)] * 40)), (0, 1))
    workers = (busy("w0"), busy("w1"))
    d = default_policy()(snap_with(workers, 8, work, node_type=cloud))
    assert d.cancel == {"default": 8}
    assert default_policy()(snap_with(workers, 8, work)).cancel == {}


@pytest.mark.skipif(TRACES is None, reason="no ../shared/workloads/wfinstances beside the repository")
def test_a_simulated_slurm_run_calls_off_queued_jobs_none_of_which_joins(tmp_path: Path) -> None:
    from tidepool.sim import load_workload, make_policy, preset_cluster, simulate
    from tidepool.sim.wfformat import fit_memory

    assert TRACES is not None
    cluster = preset_cluster("slurm:50:4")
    cluster.interval = 1.0
    path = tmp_path / "j.jsonl"
    wl = load_workload(str(TRACES / "montage-chameleon-2mass-01d-001.json"), seed=0)
    fit_memory(wl, [0.0])  # the preset's nodes give no memory: the trace's peaks are not limits here
    r = simulate(wl, cluster, make_policy("default"), seed=0, task_records=False, tail=300.0, journal=str(path))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert r.completed and r.failed_keys == 0
    calls = [rec for rec in recs if rec["kind"] == "cancel-launch"]
    off = [w for rec in calls for w in rec["workers"]]
    joined = {rec["worker"] for rec in recs if rec["kind"] == "worker-join"}
    assert off and not set(off) & joined
    assert all("call off" in rec["reason"] and "still coming" in rec["reason"] for rec in calls)


# ---- from a review of the call-off ---------------------------------------------------------------
def test_a_retirement_and_a_call_off_in_one_step_never_go_below_min_nodes() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=8, min_nodes=2, startup_estimate=1.0)
    clock, d, p, c, rnd = started(nt, scripted(ScaleDecision()))
    first = run_round(rnd, d, p, clock)  # min_nodes launches 2
    clock.advance(101.0)
    run_round(rnd, d, p, clock)
    c.policy = scripted(ScaleDecision(launch={"cpu": 2}))
    run_round(rnd, d, p, clock)
    clock.advance(10.0)
    c.policy = scripted(ScaleDecision(retire=tuple(first), cancel={"cpu": 2}, reasons=("call off 2",)))
    run_round(rnd, d, p, clock)
    recs = rnd.journal.records
    retired = [r["worker"] for r in recs if r["kind"] == "retire"]
    called = [w for r in recs if r["kind"] == "cancel-launch" for w in r["workers"]]
    assert 2 - len(retired) + 2 - len(called) >= nt.min_nodes, (retired, called)


def idle(wid: str) -> WorkerView:
    return WorkerView(wid, "default", "running", {"cpu": 1.0}, 1, 0, 0.0, 0, 0, 0, -500.0, joined=-600.0)


def test_the_default_does_not_retire_and_call_off_against_the_same_nodes() -> None:
    # 2 busy for 150 s more, then 4 tasks of 400 s; 2 idle workers; 4 nodes booting: retiring the
    # idle two and calling off all four (each counted against the same 4 live nodes) left 2 nodes
    # for a peak of 4, and the policy bought 2 back 15 s later
    from tidepool.scaling.forecast import peak_in_use

    cloud = NodeType("default", {"cpu": 1}, max_nodes=10, startup_estimate=90.0)
    work = RemainingWork((150.0, 150.0, *([400.0] * 4)), ((), (), *([(0,)] * 4)), (0, 1))
    workers = (busy("w0"), busy("w1"), idle("w2"), idle("w3"))
    snap = snap_with(workers, 4, work, node_type=cloud)
    d = default_policy()(snap)
    after = len(workers) - len(d.retire) + 4 - d.cancel.get("default", 0)
    assert after >= peak_in_use(snap.forecasts[0].profile, 400.0), (d.retire, d.cancel)


def test_a_called_off_worker_that_joins_anyway_is_billed_again() -> None:
    priced = NodeType("cpu", {"cpu": 1}, max_nodes=8, startup_estimate=1.0, cost=3600.0)  # 1 per second
    policy = scripted(ScaleDecision(launch={"cpu": 2}), ScaleDecision(cancel={"cpu": 1}, reasons=("call off 1",)))
    clock, d, p, c, rnd = started(priced, policy)
    ids = run_round(rnd, d, p, clock)
    clock.advance(10.0)
    p.terminate = lambda worker_ids: None  # type: ignore[method-assign]  # the cancel missed (raced its start)
    run_round(rnd, d, p, clock)
    assert c.instances.instances[ids[1]].state == "failed"
    for _ in range(100):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert set(d.state.workers) == set(ids)
    assert rnd.view.cost.rate == 2 * 3600.0  # both are held, both are billed


def test_a_launch_partly_called_off_teaches_no_start_up() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=10, startup_estimate=200.0)
    policy = scripted(ScaleDecision(launch={"cpu": 10}), ScaleDecision(cancel={"cpu": 8}, reasons=("call off 8",)))
    clock, d, p, c, rnd = started(nt, policy, startup=200.0)
    run_round(rnd, d, p, clock)
    clock.advance(5.0)
    run_round(rnd, d, p, clock)  # 8 called off 5 s in: their 5 s is no start-up
    for _ in range(200):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert len(d.state.workers) == 2 and c.instances.requests["a1"].state == "joined"
    assert "cpu" not in rnd.view.startup  # (it learned 5 s; the two that came took 200 s)


def test_a_launch_mostly_arrived_teaches_the_median_counting_its_called_off_nodes_as_later() -> None:
    # 6 of 10 arrive (after 10, 20, ..., 60 s), 4 are called off at 65 s: the median of all ten is
    # the 5th arrival (50 s): the called-off ones would all have come later (the quick ones'
    # median alone, 35 s, would be too short; counting the call-off time 65 s as theirs, too long)
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=10, startup_estimate=200.0)
    clock, d, p, c, rnd = started(nt, scripted(ScaleDecision(launch={"cpu": 10})), startup=1000.0)
    ids = run_round(rnd, d, p, clock)
    for i, w in enumerate(ids[:6]):
        p.workers[w]["up_at"] = 10.0 * (i + 1)
    for _ in range(65):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert len(d.state.workers) == 6
    c.policy = scripted(ScaleDecision(cancel={"cpu": 4}, reasons=("call off 4",)))
    run_round(rnd, d, p, clock)
    assert c.instances.requests["a1"].state == "joined"
    assert rnd.view.startup["cpu"] == pytest.approx(50.0, abs=1.0)


def test_a_user_policys_own_reason_is_journaled_with_its_call_off() -> None:
    # found by a bug hunt: only reasons with the words "call off" were kept ("no reason given")
    policy = scripted(ScaleDecision(launch={"cpu": 2}),
                      ScaleDecision(cancel={"cpu": 1}, reasons=("custom: the burst was cancelled by the user",)))  # fmt: skip
    clock, d, p, c, rnd = started(CPU, policy)
    run_round(rnd, d, p, clock)
    clock.advance(1.0)
    run_round(rnd, d, p, clock)
    (rec,) = [r for r in rnd.journal.records if r["kind"] == "cancel-launch"]
    assert rec["reason"] == "called off: custom: the burst was cancelled by the user" and rec["called_off"] is True
