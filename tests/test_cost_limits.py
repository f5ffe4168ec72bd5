"""Cost limits (scaling/limits.py): the meter bills from launch to release, max_cost_per_hour and a
budget cut whatever a policy asks for, each cut is journaled; plus a real-process run."""

from __future__ import annotations

import time
import urllib.request

import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.scaling.adoption import instance_rows
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.instances import IS, InstanceTable
from tidepool.scaling.limits import CostLimits, CostMeter, cap_launches, on_this_clock, over_budget
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import Joined, Named, step_with_state
from tidepool.scaling.snapshot import ScaleDecision
from tidepool.testing import StateDriver

CPU = NodeType("cpu", {"cpu": 1}, max_nodes=10, cost=2.0, startup_estimate=1.0)
PAIR = NodeType("pair", {"cpu": 2}, max_nodes=10, workers_per_node=2, cost=4.0, startup_estimate=1.0)
TYPES = {"cpu": CPU, "pair": PAIR}


def test_limits_are_checked() -> None:
    for bad in (0, -1, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ConfigError, match="max_cost_per_hour"):
            CostLimits(max_cost_per_hour=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="budget"):
            CostLimits(budget=bad)  # type: ignore[arg-type]
    assert not CostLimits().any and CostLimits(budget=1).any


def test_meter_bills_from_launch_to_release_per_worker_share() -> None:
    table = InstanceTable()
    meter = CostMeter(TYPES)
    table.request("a1", "pair", 1, 0.0, 100.0, "test")
    meter.launched("a1", "pair", 1, 0.0)
    assert meter.rate == 4.0
    table.move_request(table.requests["a1"], IS.NAMED, 360.0, "named")
    for w in ("p1", "p2"):
        table.add(w, "pair", "a1", IS.NAMED, 360.0, "named")
        table.requests["a1"].workers.append(w)
    meter.settle(table)
    assert meter.rate == pytest.approx(4.0)  # two workers, each half the node's price
    assert meter.spent(360.0) == pytest.approx(0.4)  # 0.1 h of a 4/h node
    table.move(table.instances["p1"], IS.JOINED, 400.0, "joined")
    table.move(table.instances["p1"], IS.GONE, 720.0, "left")
    meter.settle(table)
    assert meter.rate == pytest.approx(2.0)
    assert meter.spent(720.0) == pytest.approx(0.4 + 0.2 + 0.2)
    assert meter.spent(1080.0) == pytest.approx(0.8 + 0.2)  # p2 still billed


def test_a_failed_launch_stops_billing_when_it_failed() -> None:
    table = InstanceTable()
    meter = CostMeter(TYPES)
    table.request("a1", "cpu", 3, 0.0, 100.0, "test")
    meter.launched("a1", "cpu", 3, 0.0)
    table.move_request(table.requests["a1"], IS.FAILED, 60.0, "sbatch refused")
    meter.settle(table)
    assert meter.rate == 0.0 and meter.spent(1000.0) == pytest.approx(3 * 2.0 / 60)


def test_cap_launches_holds_the_hourly_ceiling_across_types() -> None:
    limits = CostLimits(max_cost_per_hour=9.0)
    out, cuts = cap_launches({"cpu": 3, "pair": 2}, TYPES, limits, rate=1.0, spent=0.0)
    assert out == {"cpu": 3}  # 1 + 3 x 2 = 7: no room for a 4/h node
    assert cuts == [("pair", 2, 0, cuts[0][3])] and "max_cost_per_hour 9" in cuts[0][3]
    out, cuts = cap_launches({"cpu": 10}, TYPES, limits, rate=0.0, spent=0.0)
    assert out == {"cpu": 4} and cuts[0][:3] == ("cpu", 10, 4)


def test_cap_launches_keeps_the_budget_for_the_least_a_node_is_held() -> None:
    limits = CostLimits(budget=1.0)
    # 60 s (MIN_HOLD) of a 2/h node costs 1/30: with 0.9 spent and nothing running, 3 fit
    out, cuts = cap_launches({"cpu": 5}, TYPES, limits, rate=0.0, spent=0.9)
    assert out == {"cpu": 3} and cuts[0][:3] == ("cpu", 5, 3) and "budget 1" in cuts[0][3]
    assert cap_launches({"cpu": 1}, TYPES, limits, rate=0.0, spent=1.0)[0] == {}
    assert over_budget(limits, 1.0) and not over_budget(limits, 0.99) and not over_budget(CostLimits(), 1e9)


def test_controller_never_exceeds_the_ceiling_whatever_the_policy_asks_and_journals_why() -> None:
    d = StateDriver()
    greedy = ScalingController((CPU,), lambda s: ScaleDecision(launch={"cpu": 10}, reasons=("greedy",)),
                               max_cost_per_hour=5.0, forecast_interval=0.25)  # fmt: skip
    acts = step_with_state(greedy, d.state, 0.0)
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("cpu", 2)]  # 2 x 2/h <= 5/h
    cut = [r for r in acts.records if r["kind"] == "cost-limit"]
    assert cut and cut[0]["asked"] == 10 and cut[0]["allowed"] == 2 and "max_cost_per_hour 5" in cut[0]["reason"]
    assert acts.view.cost.rate == 4.0
    rid = acts.launch[0][0]
    ids = (f"cpu-{rid}-1", f"cpu-{rid}-2")
    for w in ids:
        d.add_worker(w, node_type="cpu")
    acts = step_with_state(greedy, d.state, 1.0, reports=[Named(rid, ids, 0.5), *(Joined(w, 1.0) for w in ids)])
    assert not acts.launch and acts.view.cost.rate == 4.0
    assert acts.view.cost.spent == pytest.approx(4.0 / 3600)
    assert not [r for r in acts.records if r["kind"] == "cost-limit"]  # said once, not every step


def test_controller_with_a_spent_budget_launches_nothing_and_retires_idle_workers() -> None:
    d = StateDriver()
    floor = NodeType("cpu", {"cpu": 1}, min_nodes=1, max_nodes=3, cost=3600.0, startup_estimate=1.0)
    with pytest.raises(ConfigError, match="budget 2 is below what one node costs at the least"):
        ScalingController((floor,), lambda s: None, budget=2.0, forecast_interval=0.25)  # 60 s of it cost 60
    c2 = ScalingController((floor,), lambda s: None, budget=100.0, forecast_interval=0.25)
    (rid, _, _), = step_with_state(c2, d.state, 0.0).launch  # 60 s of it fit the budget: min_nodes
    wid = f"cpu-{rid}-1"
    d.add_worker(wid, node_type="cpu")
    acts = step_with_state(c2, d.state, 0.5, reports=[Named(rid, (wid,), 0.0), Joined(wid, 0.5, ready=True)])
    assert not acts.retire
    acts = step_with_state(c2, d.state, 120.0)  # 2 minutes at 3600/h: 120 > 100 spent
    assert acts.retire == [wid] and any("budget 100 spent" in r["reason"] for r in acts.records if "reason" in r)


def test_the_meter_goes_on_after_a_restart_and_bills_adopted_instances_for_the_downtime() -> None:
    table = InstanceTable()
    meter = CostMeter(TYPES)
    table.request("a1", "cpu", 2, 0.0, 100.0, "test")
    meter.launched("a1", "cpu", 2, 0.0)
    table.move_request(table.requests["a1"], IS.NAMED, 0.0, "named")
    for w in ("w1", "w2"):
        table.add(w, "cpu", "a1", IS.NAMED, 0.0, "named")
        table.requests["a1"].workers.append(w)
    meter.settle(table)
    stored = meter.export(1800.0)  # the last step the dead scheduler stored
    assert stored is not None and stored["spent"] == pytest.approx(2.0)  # two 2/h workers for half an hour
    assert sorted(stored["open"]) == [["worker", "w1", 2.0], ["worker", "w2", 2.0]]
    # the new process's clock starts elsewhere; 600 s of wall time passed while it was down
    here = on_this_clock({**stored, "wall": 10_000.0}, 50.0, 10_600.0)
    assert here is not None and here["at"] == pytest.approx(-550.0)
    adopted = InstanceTable()
    adopted.add("w1", "cpu", "a1", IS.NAMED, 50.0, "adopted")  # w2 is gone: not listed any more
    meter2 = CostMeter(TYPES)
    meter2.restore(here, adopted, 50.0)
    meter2.settle(adopted)
    assert meter2.rate == pytest.approx(2.0)
    assert meter2.spent(50.0) == pytest.approx(2.0 + 2.0 * 600 / 3600)  # w1 billed while the scheduler was down
    assert meter2.spent(1850.0) == pytest.approx(2.0 + 2.0 * 2400 / 3600)
    assert CostMeter(TYPES).export(10.0) is None  # nothing billed: nothing to store
    assert on_this_clock(None, 1.0, 2.0) is None


def test_a_restarted_controller_keeps_the_spent_budget_and_launches_nothing_over_it() -> None:
    d = StateDriver()
    floor = NodeType("cpu", {"cpu": 1}, min_nodes=1, max_nodes=3, cost=3600.0, startup_estimate=1.0)
    c = ScalingController((floor,), lambda s: None, budget=100.0, forecast_interval=0.25)
    (rid, _, _), = step_with_state(c, d.state, 0.0).launch
    wid = f"cpu-{rid}-1"
    d.add_worker(wid, node_type="cpu")
    step_with_state(c, d.state, 0.5, reports=[Named(rid, (wid,), 0.0), Joined(wid, 0.5, ready=True)])
    acts = step_with_state(c, d.state, 80.0)
    assert acts.cost is not None and acts.cost["spent"] == pytest.approx(80.0)
    rows = instance_rows(c.instances)  # the instance rows the durable scheduler stored
    stored = {**acts.cost, "wall": 1000.0}
    # the scheduler dies with its worker (not listed any more); 10 s later a new one starts at clock 0
    d2 = StateDriver()
    c2 = ScalingController((floor,), lambda s: None, budget=100.0, forecast_interval=0.25, restored=rows,
                           restored_cost=on_this_clock(stored, 0.0, 1010.0))  # fmt: skip
    acts = step_with_state(c2, d2.state, 0.0, listing={})
    assert acts.launch == [], "80 of the budget of 100 are spent: min_nodes may not launch a node held 60 s"
    assert [r for r in acts.records if r["kind"] == "cost-limit"]
    assert acts.cost is not None and acts.cost["spent"] == pytest.approx(80.0)
    fresh = ScalingController((floor,), lambda s: None, budget=100.0, forecast_interval=0.25, restored=rows)
    assert step_with_state(fresh, StateDriver().state, 0.0, listing={}).launch != []  # the control: budget reset


# ---- real processes ---------------------------------------------------------------------------
def nap(i: int) -> int:
    time.sleep(0.2)
    return i


def ask_for_ten(snapshot):  # type: ignore[no-untyped-def]
    """A policy that wants ten more nodes whenever there is work (far above the ceiling)."""
    if snapshot.demand_tasks or snapshot.running:
        return ScaleDecision(launch={"cpu": 10}, reasons=("ask for ten",))
    return None


@pytest.mark.integration
def test_max_cost_per_hour_holds_on_real_workers_and_the_refusal_is_journaled() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=10, cost=1.0, startup_estimate=1.0)
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    with tidepool.LocalCluster(n_workers=0, dashboard=True) as cluster, tidepool.Client(cluster) as client:
        scaler = cluster.adapt(node_types=[nt], policy=ask_for_ten, max_cost_per_hour=3.0)
        seen: list[float] = []
        futs = client.map(nap, range(30))
        deadline = time.monotonic() + 120  # generous: a loaded machine starts workers slowly
        while not all(f.done() for f in futs) and time.monotonic() < deadline:
            seen.append(scaler.view.cost.rate)
            assert len(cluster.workers) <= 3
            time.sleep(0.05)
        assert client.gather(futs, timeout=120) == list(range(30))
        journal = cluster.journal
        assert journal is not None
        assert max(seen) <= 3.0 and max(seen) > 0
        launched = sum(r["nodes"] for r in journal.of_kind("launch"))
        assert launched <= 3 + sum(1 for r in journal.records if r["kind"] in ("retire-done", "launch-failed"))
        cuts = journal.of_kind("cost-limit")
        assert cuts and cuts[0]["asked"] == 10 and "max_cost_per_hour 3" in cuts[0]["reason"]
        assert scaler.view.cost.spent > 0
        with urllib.request.urlopen(cluster.dashboard_link + "metrics", timeout=30) as r:  # noqa: S310 - loopback
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        spent = fams["tidepool_cost_spent"].samples[0].value
        assert spent > 0 and 0 < fams["tidepool_cost_per_hour"].samples[0].value <= 3  # (a sample of the last 0.5 s)


def test_cluster_file_autoscaler_table_is_strict() -> None:
    from tidepool.config import parse

    base = {"node_types": [{"name": "cpu", "resources": {"cpu": 1}}]}
    cfg = parse({**base, "autoscaler": {"max_cost_per_hour": 12, "budget": 40.5}})
    assert cfg.autoscaler == {"max_cost_per_hour": 12, "budget": 40.5}
    assert ScalingController(cfg.node_types, **cfg.autoscaler).limits == CostLimits(12, 40.5)
    with pytest.raises(ConfigError, match=r"unknown key 'max_cost' \(did you mean 'max_cost_per_hour'\?\)"):
        parse({**base, "autoscaler": {"max_cost": 3}})
    for bad in (0, -2, float("inf"), "3", True):
        with pytest.raises(ConfigError, match=r"\[autoscaler\] budget must be a finite number > 0"):
            parse({**base, "autoscaler": {"budget": bad}})


@pytest.mark.integration
def test_adapt_takes_a_budget_with_any_policy_as_a_hard_limit() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=2)
    with tidepool.LocalCluster(n_workers=0) as cluster:
        scaler = cluster.adapt(node_types=[nt], policy=ask_for_ten, budget=3.0, max_cost_per_hour=2.0)
        assert scaler.controller.limits == CostLimits(max_cost_per_hour=2.0, budget=3.0)
        assert scaler.controller.policy is ask_for_ten
    with tidepool.LocalCluster(n_workers=0) as cluster, pytest.raises(ConfigError, match="objective, deadline and guess_budget set the default policy"):
        cluster.adapt(node_types=[nt], policy=ask_for_ten, deadline=60.0)


def test_a_budget_left_under_one_nodes_least_bill_ends_launches_and_the_waiting_task_fails() -> None:
    # found by a bug hunt: with less left than one node's least bill (60 s), the policy asked for a
    # node and the limit refused it every 10 s, for ever; the task waited silently ("no-worker")
    from tidepool.scaling.planned import default_policy
    from tidepool.scheduler import events as ev
    from tidepool.scheduler.state import SchedulerState

    # 60/h: a node's least bill (60 s) is 1.0, and the budget pays for one and a bit
    node = NodeType("default", {"cpu": 1}, max_nodes=2, cost=60.0, startup_estimate=0.5)
    d = StateDriver(SchedulerState(no_worker_timeout=30.0))
    c = ScalingController((node,), default_policy(budget=1.01), budget=1.01, forecast_interval=0.25)
    d.send(ev.CheckFeasible(d.clock(), c.view.feasibility))
    d.submit([("first", [])], ["first"])
    acts = step_with_state(c, d.state, 0.0)
    (rid, _, _), = acts.launch
    wid = f"default-{rid}-1"
    d.add_worker(wid, node_type="default")
    acts = step_with_state(c, d.state, 0.25, reports=[Named(rid, (wid,), 0.0), Joined(wid, 0.25, ready=True)])
    assert acts.feasibility is None  # 1.01 - 0.004 left still pays a node
    d.finish(wid, "first")
    d.remove_worker(wid)  # gone after a second: about 0.017 spent, less than 1.0 left
    d.clock.advance(1.0)
    d.submit([("second", [])], ["second"])
    acts = step_with_state(c, d.state, d.clock())
    assert not acts.launch
    said = [r for r in acts.records if r["kind"] == "cost-limit"]
    assert said and "no more launches" in said[0]["reason"] and "budget 1.01" in said[0]["reason"], acts.records
    assert acts.feasibility is not None and [n for n, _ in acts.feasibility.never] == ["default"]
    assert not [r for r in acts.records if r["kind"] == "decision" and "more default node" in r["reason"]]
    d.send(ev.CheckFeasible(d.clock(), acts.feasibility))
    d.clock.advance(31.0)
    d.send(ev.Tick(d.clock()))
    ts = d.state.tasks["second"]
    assert d.status()["second"] == "erred" and ts.exc_type == "InfeasibleTaskError", ts.state
    assert "budget 1.01" in ts.message
