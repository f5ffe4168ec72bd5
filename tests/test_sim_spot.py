"""Spot capacity in the simulator: preemption notices, kills after the notice, capacity errors,
the fallback and lost work (sim/provider.py, sim/engine.py), replayed exactly by seed."""

from __future__ import annotations

import pytest

from tidepool.errors import ConfigError
from tidepool.scaling.node_types import NodeType
from tidepool.sim import SimCluster, SimTask, Simulation, StartupModel, make_policy
from tidepool.sim.dists import Dist
from tidepool.sim.provider import model_from
from tidepool.sim.workload import single

BOOT = Dist("const", (10.0,))


def spot_cluster(rate: float, capacity: float = 0.0) -> SimCluster:
    spot = NodeType("spot", {"cpu": 1}, max_nodes=4, cost=0.7, startup_estimate=10.0, preemptible=True,
                    fallback="ondemand", fallback_after=2)  # fmt: skip
    od = NodeType("ondemand", {"cpu": 1}, max_nodes=4, cost=1.0, startup_estimate=10.0)
    models = {"spot": StartupModel(boot=BOOT, preempt_rate=rate, notice=30.0, capacity_errors=capacity),
              "ondemand": StartupModel(boot=BOOT)}  # fmt: skip
    c = SimCluster([spot, od], models)
    c.interval = 0.5
    return c


def run(rate: float, capacity: float = 0.0, seed: int = 3) -> tuple[object, list[dict[str, object]]]:
    bag = [SimTask(f"job-{i}", 200.0) for i in range(16)]
    sim = Simulation(single("bag", bag), spot_cluster(rate, capacity), make_policy("default"), seed=seed,
                     controller_kwargs={"max_workers": 4})  # fmt: skip
    r = sim.run()
    return r, sim.journal.records


def test_model_keys_are_checked() -> None:
    m = model_from({"startup": "cloud", "preempt_rate": 2, "notice": 120, "capacity_errors": 0.1}, "spot")
    assert (m.preempt_rate, m.notice, m.capacity_errors) == (2.0, 120.0, 0.1)
    assert "preempted 2/node-h, 120s notice" in m.describe()
    for bad in ({"preempt_rate": -1}, {"notice": float("inf")}, {"capacity_errors": 1.5}, {"notice": "soon"}):
        with pytest.raises(ConfigError):
            model_from(bad, "spot")


def test_preempted_workers_get_a_notice_then_die_and_the_run_still_completes() -> None:
    r, recs = run(rate=20.0)  # a notice every 3 node-minutes: several during the run
    assert r.completed and r.preempted > 0  # type: ignore[attr-defined]
    notices = [x for x in recs if x["kind"] == "preemption-notice"]
    assert notices and all(x["seconds"] <= 30.0 for x in notices)
    killed = [x for x in recs if x["kind"] == "worker-leave" and "preempted" in str(x.get("reason"))]
    assert killed and all(x["graceful"] is False for x in killed)
    assert r.lost_seconds > 0  # type: ignore[attr-defined]
    assert [x for x in recs if x["kind"] == "launch" and "replacement for" in str(x["reason"])]
    switch = [x for x in recs if x["kind"] == "fallback"]
    assert switch and switch[0]["to"] == "ondemand"
    after = [x for x in recs if x["kind"] == "launch" and x["t"] > switch[0]["t"]]
    assert after and all(x["node_type"] == "ondemand" for x in after if x["t"] < switch[0]["t"] + 900)
    again, _ = run(rate=20.0)
    assert (again.makespan, again.total_cost, again.lost_seconds) == (r.makespan, r.total_cost, r.lost_seconds)  # type: ignore[attr-defined]


def test_no_preemption_and_no_capacity_error_is_a_plain_run() -> None:
    r, recs = run(rate=0.0)
    assert r.completed and r.preempted == 0 and r.lost_seconds == 0.0  # type: ignore[attr-defined]
    assert not [x for x in recs if x["kind"] in ("preemption-notice", "fallback")]
    assert set(r.cost) == {"spot"}  # type: ignore[attr-defined]


def test_capacity_errors_send_launches_to_the_fallback() -> None:
    r, recs = run(rate=0.0, capacity=1.0)  # spot never has capacity
    assert r.completed
    assert [x for x in recs if x["kind"] == "fallback"]
    assert set(r.cost) == {"ondemand"}  # type: ignore[attr-defined]  # nothing billed for refused launches
