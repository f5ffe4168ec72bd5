"""Warm pools (scaling/warm.py): min_idle idle workers kept ready apart from min_nodes,
replace_before replacements ahead of a known end, and a quiet pool scaled to zero."""

from __future__ import annotations

import time
from typing import Any

import pytest

import tidepool
from tidepool.config import parse
from tidepool.errors import ConfigError
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import Joined, Named, step_with_state
from tidepool.scaling.snapshot import ScaleDecision
from tidepool.testing import StateDriver, wait_until


def hold(snapshot: Any) -> None:
    return None


def retire_idle(snapshot: Any) -> ScaleDecision:
    """Retire every idle worker (min_idle and min_nodes are the controller's to keep)."""
    return ScaleDecision(retire=tuple(w.id for w in snapshot.workers if w.idle))


def join(c: ScalingController, d: StateDriver, acts: Any, t: float) -> list[str]:
    ids: list[str] = []
    for rid, nt, n in acts.launch:
        got = tuple(f"{nt.name}-{rid}-{i}" for i in range(n * nt.workers_per_node))
        for w in got:
            d.add_worker(w, node_type=nt.name)
        step_with_state(c, d.state, t, reports=[Named(rid, got, t), *(Joined(w, t, ready=True) for w in got)])
        ids += got
    return ids


def test_min_idle_launches_and_keeps_idle_workers_apart_from_min_nodes() -> None:
    d = StateDriver()
    nt = NodeType("cpu", {"cpu": 1}, min_nodes=1, max_nodes=5, min_idle=2, startup_estimate=1.0)
    c = ScalingController((nt,), retire_idle, forecast_interval=0.25)
    acts = step_with_state(c, d.state, 0.0)
    assert [(t.name, n) for _, t, n in acts.launch] == [("cpu", 2)]  # 2 idle ones cover min_nodes=1 too
    assert "below min_idle=2" in acts.records[-1]["reason"]
    ids = join(c, d, acts, 1.0)
    acts = step_with_state(c, d.state, 2.0)
    assert not acts.retire and not acts.launch  # the policy would retire both: min_idle keeps them
    d.submit([("busy-0", [])], ["busy-0"])  # one starts working: one idle left, one more launched
    assert any(d.state.workers[w].processing for w in ids)
    acts = step_with_state(c, d.state, 3.0)
    assert [(t.name, n) for _, t, n in acts.launch] == [("cpu", 1)]


def test_scale_to_zero_after_a_quiet_period_drops_warm_workers_but_keeps_min_nodes() -> None:
    d = StateDriver()
    warm = NodeType("cpu", {"cpu": 1}, min_nodes=0, max_nodes=5, min_idle=2, startup_estimate=1.0)
    floor = NodeType("floor", {"cpu": 1}, min_nodes=1, max_nodes=1, startup_estimate=1.0)
    c = ScalingController((warm, floor), hold, scale_to_zero_after=30.0, forecast_interval=0.25)
    ids = join(c, d, step_with_state(c, d.state, 0.0), 1.0)
    assert sorted(w.split("-")[0] for w in ids) == ["cpu", "cpu", "floor"]
    assert not step_with_state(c, d.state, 20.0).retire
    acts = step_with_state(c, d.state, 40.0)
    assert sorted(acts.retire) == sorted(w for w in ids if w.startswith("cpu"))
    assert "scale_to_zero_after=30s" in [r for r in acts.records if r["kind"] == "retire"][0]["reason"]
    with pytest.raises(ConfigError, match="scale_to_zero_after"):
        ScalingController((warm,), scale_to_zero_after=0)
    cfg = parse({"node_types": [{"name": "a"}], "autoscaler": {"scale_to_zero_after": 300}})
    assert ScalingController(cfg.node_types, **cfg.autoscaler).scale_to_zero_after == 300


def test_replace_before_launches_a_start_up_ahead_and_the_retirement_waits_for_it() -> None:
    d = StateDriver()
    d.submit([(f"x-{i}", []) for i in range(3)], [f"x-{i}" for i in range(3)])
    nt = NodeType("job", {"cpu": 1}, min_nodes=1, max_nodes=1, replace_before=True, startup_estimate=10.0)
    c = ScalingController((nt,), hold, forecast_interval=0.25)
    [old] = join(c, d, step_with_state(c, d.state, 0.0), 10.0)  # measured start-up: 10 s
    assert not step_with_state(c, d.state, 20.0, ends={old: 40.0}).launch  # 20 s ahead > 1.5 x 10 s
    acts = step_with_state(c, d.state, 26.0, ends={old: 40.0})
    assert [(t.name, n) for _, t, n in acts.launch] == [("job", 1)]  # above max_nodes: it replaces
    assert f"replacement for {old} (it ends in 14.0s" in [r for r in acts.records if r["kind"] == "launch"][0]["reason"]
    waits = step_with_state(c, d.state, 40.0, expiring=[old], ends={old: 40.0})
    assert not waits.retire and not waits.launch  # its replacement is still coming: no gap
    late = step_with_state(c, d.state, 56.0, expiring=[old], ends={old: 40.0})
    assert late.retire == [old]  # waited 1.5 start-ups: retired anyway (its margin is for this)


# ---- real processes ---------------------------------------------------------------------------
def nap(i: int, d: float) -> int:
    time.sleep(d)
    return i


@pytest.mark.integration
def test_min_idle_keeps_that_many_idle_workers_on_real_processes() -> None:
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4, min_idle=2, startup_estimate=0.5)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], policy=retire_idle)

        def idle() -> int:
            return int(cluster.run(lambda s: sum(1 for w in s.state.workers.values()
                                                 if w.state == "running" and not w.processing)))  # fmt: skip

        wait_until(lambda: idle() >= 2, 90, "two idle workers")
        long = client.submit(nap, 1, 600.0)  # one becomes busy: another is started to stay at 2 idle
        wait_until(lambda: len(cluster.workers) >= 3 and idle() >= 2, 90, "a third worker, two idle")
        assert idle() == 2 and len(cluster.workers) == 3  # and no more (the policy retires extra idle ones)
        client.cancel([long])
        wait_until(lambda: len(cluster.workers) == 2, 90, "back to two workers, both idle")
        assert idle() == 2


def test_a_replacement_above_max_nodes_does_not_make_the_controller_retire_a_healthy_worker() -> None:
    # the review of the over-max_nodes retirement: the replacement in flight counted as a node over
    # max_nodes, and the next step retired an idle worker (the healthy one, or the one replaced)
    d = StateDriver()
    nt = NodeType("job", {"cpu": 1}, min_nodes=2, max_nodes=2, replace_before=True, startup_estimate=10.0)
    c = ScalingController((nt,), hold, forecast_interval=0.25)
    ids = join(c, d, step_with_state(c, d.state, 0.0), 10.0)
    acts = step_with_state(c, d.state, 26.0, ends={ids[1]: 40.0})
    assert [n for _, _, n in acts.launch] == [1]  # the replacement
    assert step_with_state(c, d.state, 27.0, ends={ids[1]: 40.0}).retire == []
