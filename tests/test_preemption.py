"""Preemptible node types: notices retire a worker gracefully and launch its replacement at once;
repeated preemptions or capacity errors send launches to the fallback type until it is healthy
again (scaling/preemption.py); LocalProvider.preempt on real worker processes."""

from __future__ import annotations

import time
from typing import Any

import pytest

import tidepool
from tidepool.config import parse
from tidepool.errors import ConfigError
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import Joined, LaunchFailed, Named, step_with_state
from tidepool.scaling.preemption import FallbackTracker
from tidepool.scaling.snapshot import ScaleDecision
from tidepool.testing import StateDriver, wait_until

SPOT = NodeType("spot", {"cpu": 1}, max_nodes=4, cost=0.7, preemptible=True, fallback="ondemand",
                fallback_after=2, fallback_window=60.0, fallback_healthy=100.0, startup_estimate=1.0)  # fmt: skip
ONDEMAND = NodeType("ondemand", {"cpu": 1}, max_nodes=4, cost=1.0, startup_estimate=1.0)


def test_node_type_preemption_and_warm_pool_fields_are_checked() -> None:
    for kw in ({"preemptible": 1}, {"replace_before": "yes"}, {"fallback": "x y"}, {"fallback": "a"},
               {"fallback_after": 0}, {"fallback_window": -1}, {"fallback_healthy": float("nan")},
               {"min_idle": -1}, {"min_idle": 11}, {"min_idle": 1.5}):  # fmt: skip
        with pytest.raises(ConfigError):
            NodeType("a", max_nodes=10, **kw)
    with pytest.raises(ConfigError, match="fallback 'nope' is not one of the node types"):
        ScalingController((NodeType("a", fallback="nope"),))
    base = {"name": "spot", "resources": {"cpu": 1}, "preemptible": True, "fallback": "od"}
    with pytest.raises(ConfigError, match="fallback 'od' is not one of the node types"):
        parse({"node_types": [base]})
    cfg = parse({"node_types": [base, {"name": "od", "min_idle": 1, "replace_before": True}]})
    assert cfg.node_types[0].preemptible and cfg.node_types[1].min_idle == 1
    # a fallback that lacks the type's special resources would bring nodes its waiting tasks cannot use
    gspot = NodeType("gspot", {"cpu": 1, "gpu": 1}, preemptible=True, fallback="cpu")
    with pytest.raises(ConfigError, match="fallback 'cpu' offers less gpu per worker than 'gspot'"):
        ScalingController((gspot, NodeType("cpu", {"cpu": 8})))
    ScalingController((gspot, NodeType("cpu", {"cpu": 2, "gpu": 1})))  # same special resources: fine
    ScalingController((SPOT, NodeType("ondemand", {"cpu": 1, "memory": 1e9})))  # cpu/memory may differ
    with pytest.raises(ConfigError, match="unknown key 'preemptable'"):
        parse({"node_types": [{"name": "x", "preemptable": True}]})


def test_tracker_switches_after_n_troubles_in_the_window_and_back_after_a_healthy_period() -> None:
    t = FallbackTracker({"spot": SPOT, "ondemand": ONDEMAND})
    assert t.trouble("spot", 0.0, "notice") is None
    assert t.trouble("spot", 70.0, "notice") is None  # the first one left the 60 s window
    rec = t.trouble("spot", 80.0, "capacity error")
    assert rec is not None and rec["kind"] == "fallback" and rec["to"] == "ondemand"
    assert "2 preemptions or capacity errors of 'spot' within 60s" in rec["reason"]
    assert t.route("spot") == "ondemand" and t.route("ondemand") == "ondemand"
    assert t.trouble("ondemand", 80.0, "x") is None  # not preemptible, no fallback: not tracked
    assert t.blocked_until(90.0) == {"spot": 180.0}
    assert t.recover(179.0) == []
    back = t.recover(180.0)
    assert [r["kind"] for r in back] == ["fallback-end"] and t.route("spot") == "spot"


def hold(snapshot: Any) -> None:
    """A policy that asks for nothing: only min_nodes and replacements launch."""
    return None


def joined_pool(c: ScalingController, d: StateDriver, n: int, t: float = 0.0) -> list[str]:
    acts = step_with_state(c, d.state, t)
    (rid, nt, nodes), = acts.launch
    ids = tuple(f"{nt.name}-{rid}-{i}" for i in range(nodes))
    for w in ids:
        d.add_worker(w, node_type=nt.name)
    step_with_state(c, d.state, t + 1, reports=[Named(rid, ids, t), *(Joined(w, t + 1, ready=True) for w in ids)])
    assert len(ids) == n
    return list(ids)


def test_a_notice_retires_the_worker_and_launches_its_replacement_at_once() -> None:
    d = StateDriver()
    d.submit([(f"x-{i}", []) for i in range(4)], [f"x-{i}" for i in range(4)])
    spot = NodeType("spot", {"cpu": 1}, min_nodes=2, max_nodes=2, preemptible=True, startup_estimate=1.0)
    c = ScalingController((spot,), hold, forecast_interval=0.25)
    a, _ = joined_pool(c, d, 2)
    acts = step_with_state(c, d.state, 5.0, notices={a: 35.0})
    assert acts.retire == [a]
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("spot", 1)]  # above max_nodes: a leaves
    launch = [r for r in acts.records if r["kind"] == "launch"][0]
    assert f"replacement for {a} (preemption notice: it ends in 30.0s)" in launch["reason"]
    notice = [r for r in acts.records if r["kind"] == "preemption-notice"]
    assert notice and notice[0]["worker"] == a and notice[0]["seconds"] == 30.0
    again = step_with_state(c, d.state, 6.0, notices={a: 35.0})
    assert not again.launch and not [r for r in again.records if r["kind"] == "preemption-notice"]


def test_no_replacement_for_a_notice_on_a_quiet_pool() -> None:
    d = StateDriver()
    spot = NodeType("spot", {"cpu": 1}, min_nodes=1, max_nodes=2, preemptible=True, startup_estimate=1.0)
    c = ScalingController((spot,), hold, forecast_interval=0.25)
    [a] = joined_pool(c, d, 1)
    acts = step_with_state(c, d.state, 5.0, notices={a: 35.0})
    assert acts.retire == [a]
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("spot", 1)]  # min_nodes, not a replacement
    assert "replacement" not in [r for r in acts.records if r["kind"] == "launch"][0]["reason"]


def test_repeated_notices_send_launches_to_the_fallback_and_the_journal_says_why() -> None:
    d = StateDriver()
    d.submit([(f"x-{i}", []) for i in range(4)], [f"x-{i}" for i in range(4)])
    spot = NodeType("spot", {"cpu": 1}, min_nodes=3, max_nodes=3, preemptible=True, fallback="ondemand",
                    fallback_after=2, startup_estimate=1.0)  # fmt: skip
    c = ScalingController((spot, ONDEMAND), hold, forecast_interval=0.25)
    a, b, _ = joined_pool(c, d, 3)
    first = step_with_state(c, d.state, 5.0, notices={a: 30.0})
    assert [nt.name for _, nt, _ in first.launch] == ["spot"]
    second = step_with_state(c, d.state, 6.0, notices={a: 30.0, b: 31.0})
    switch = [r for r in second.records if r["kind"] == "fallback"]
    assert switch and switch[0]["node_type"] == "spot" and switch[0]["to"] == "ondemand"
    assert "fallback_after=2" in switch[0]["reason"]
    assert [nt.name for _, nt, _ in second.launch] == ["ondemand"]
    assert "as ondemand (fallback of spot)" in [r for r in second.records if r["kind"] == "launch"][0]["reason"]
    assert second.snapshot is not None and second.snapshot.blocked("spot")  # the policy plans without it
    greedy = ScalingController((spot, ONDEMAND), lambda s: ScaleDecision(launch={"spot": 1}), forecast_interval=0.25)
    greedy.fallbacks.switched["spot"] = (0.0, "test")
    greedy.fallbacks.last_trouble["spot"] = 0.0
    assert [nt.name for _, nt, _ in step_with_state(greedy, StateDriver().state, 1.0).launch] == ["ondemand"]


def test_capacity_errors_count_and_spot_comes_back_after_a_healthy_period() -> None:
    d = StateDriver()
    spot = NodeType("spot", {"cpu": 1}, min_nodes=1, max_nodes=2, preemptible=True, fallback="ondemand",
                    fallback_after=2, fallback_healthy=50.0, startup_estimate=1.0)  # fmt: skip
    c = ScalingController((spot, ONDEMAND), hold, forecast_interval=0.25, backoff_base=1.0, max_type_failures=10)
    t, reports = 0.0, []
    for _ in range(2):
        acts = step_with_state(c, d.state, t, reports=reports)
        assert [nt.name for _, nt, _ in acts.launch] == ["spot"]
        reports = [LaunchFailed(acts.launch[0][0], "InsufficientInstanceCapacity", t)]
        t += 5.0
    acts = step_with_state(c, d.state, t, reports=reports)
    assert [r for r in acts.records if r["kind"] == "fallback"]
    assert not acts.launch  # min_nodes of a switched type is not kept (its launches would be refused)
    back = step_with_state(c, d.state, t + 50.0)
    assert [r for r in back.records if r["kind"] == "fallback-end"]
    assert [nt.name for _, nt, _ in back.launch] == ["spot"]


def test_a_noticed_worker_whose_work_cannot_finish_in_time_is_ended_at_once() -> None:
    d = StateDriver()
    d.state.estimates.observe("long", 500.0)  # each task takes 500 s: none finishes in a 30 s notice
    spot = NodeType("spot", {"cpu": 1}, min_nodes=2, max_nodes=2, preemptible=True, startup_estimate=1.0)
    c = ScalingController((spot,), hold, forecast_interval=0.25)
    a, b = joined_pool(c, d, 2)
    d.submit([(f"long-{i}", []) for i in range(2)], [f"long-{i}" for i in range(2)])
    assert d.state.workers[a].processing and d.state.workers[b].processing
    acts = step_with_state(c, d.state, 5.0, notices={a: 35.0})
    assert acts.terminate == [a] and a not in acts.retire  # its work restarts elsewhere now, not in 30 s
    why = [r for r in acts.records if r["kind"] == "terminate"][0]["reason"]
    assert "cannot finish in the 30s notice" in why
    assert [(nt.name, n) for _, nt, n in acts.launch] == [("spot", 1)]  # replaced all the same
    c2 = ScalingController((spot,), hold, forecast_interval=0.25)
    d2 = StateDriver()
    x, _ = joined_pool(c2, d2, 2)
    d2.state.estimates.observe("short", 1.0)  # short work: retired gracefully instead
    d2.submit([(f"short-{i}", []) for i in range(2)], [f"short-{i}" for i in range(2)])
    acts = step_with_state(c2, d2.state, 5.0, notices={x: 35.0})
    assert acts.retire == [x] and not acts.terminate


# ---- real processes ---------------------------------------------------------------------------
def slow(i: int, d: float = 0.5) -> int:
    time.sleep(d)
    return i


def kinds(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


@pytest.mark.integration
def test_local_preemption_moves_sole_results_before_the_kill_and_replaces_at_once() -> None:
    spot = NodeType("spot", {"cpu": 1}, min_nodes=2, max_nodes=2, preemptible=True, startup_estimate=1.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[spot], policy=hold)
        journal = cluster.journal
        assert journal is not None
        first = client.map(slow, range(8), [0.05] * 8)
        assert client.gather(first, timeout=120) == list(range(8))
        holders = cluster.run(lambda s: {w: len(s.state.unique_data(ws)) for w, ws in s.state.workers.items()})
        victim = max(holders, key=lambda w: holders[w])
        assert holders[victim]  # it holds results only it has (the client still wants them)
        busy = client.map(slow, range(100, 124), [0.5] * 24)  # work: the pool must be replaced
        wait_until(lambda: cluster.run(lambda s: s.state.counters["finished"]) > 8, 60, "the second phase to run")
        cluster.provider.preempt(victim, notice=60.0)  # generous: a loaded machine moves data slowly
        wait_until(lambda: any(r["kind"] == "retire-done" and r["worker"] == victim for r in journal.records), 90,
                   "the preempted worker to retire")  # fmt: skip
        done = [r for r in kinds(journal.records, "retire-done") if r["worker"] == victim]
        assert done[0]["outcome"] == "retired"  # gracefully: its data moved before the kill
        lost = [r for r in kinds(journal.records, "worker-leave") if r["worker"] == victim and not r.get("graceful")]
        assert not lost and [r for r in kinds(journal.records, "worker-close") if r["worker"] == victim]
        assert client.gather(first, timeout=60) == list(range(8))
        assert client.gather(busy, timeout=120) == list(range(100, 124))
        assert cluster.run(lambda s: s.state.counters["recomputed"]) == 0
        notice = [r for r in kinds(journal.records, "preemption-notice") if r["worker"] == victim]
        repl = [r for r in kinds(journal.records, "launch") if f"replacement for {victim}" in r["reason"]]
        assert notice and repl and repl[0]["t"] >= notice[0]["t"]
        rid = repl[0]["request"]
        wait_until(lambda: any(r["kind"] == "worker-join" and f"-{rid}-" in r["worker"] for r in journal.records),
                   90, "the replacement to join")  # fmt: skip


@pytest.mark.integration
def test_repeated_local_preemptions_send_launches_to_the_fallback() -> None:
    spot = NodeType("spot", {"cpu": 1}, min_nodes=2, max_nodes=2, cost=0.7, preemptible=True, fallback="ondemand",
                    fallback_after=2, fallback_window=600.0, startup_estimate=1.0)  # fmt: skip
    ondemand = NodeType("ondemand", {"cpu": 1}, max_nodes=2, startup_estimate=1.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[spot, ondemand], policy=hold)
        journal = cluster.journal
        assert journal is not None
        futs = client.map(slow, range(60), [0.5] * 60)  # work outlasts both notices (each 5 s)
        preempted: list[str] = []

        def spot_workers() -> list[str]:
            return sorted(w for w in cluster.workers if w.startswith("spot") and w not in preempted)

        for _ in range(2):
            wait_until(spot_workers, 90, "a spot worker not preempted yet")
            victim = spot_workers()[0]
            preempted.append(victim)
            cluster.provider.preempt(victim, notice=5.0)
            wait_until(lambda v=victim: any(r["kind"] == "preemption-notice" and r["worker"] == v  # type: ignore[misc]
                                            for r in journal.records), 60, "the notice")  # fmt: skip
        assert client.gather(futs, timeout=180) == list(range(60))
        switch = kinds(journal.records, "fallback")
        assert switch and switch[0]["node_type"] == "spot" and switch[0]["to"] == "ondemand"
        after = [r for r in kinds(journal.records, "launch") if r["t"] >= switch[0]["t"]]
        assert after and {r["node_type"] for r in after} == {"ondemand"}
        wait_until(lambda: any(w.startswith("ondemand") for w in cluster.workers) or any(
            r["kind"] == "worker-join" and r["worker"].startswith("ondemand") for r in journal.records), 90,
                   "a fallback worker to join")  # fmt: skip
