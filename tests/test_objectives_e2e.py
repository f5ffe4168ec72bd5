"""adapt(deadline=...) and adapt(budget=...) on real worker processes: each decision says which
objective made it, an infeasible deadline is said at once, and a budget is not overspent."""

from __future__ import annotations

import time

import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.scaling.planned import Planned

pytestmark = pytest.mark.integration


def work(x: int, d: float = 0.2) -> int:
    time.sleep(d)
    return x


def reasons(cluster: tidepool.LocalCluster, kind: str) -> list[str]:
    assert cluster.journal is not None
    return [str(r.get("reason", "")) for r in cluster.journal.records if r["kind"] == kind]


def test_an_infeasible_deadline_is_said_in_the_first_launch_and_the_graph_still_runs() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(maximum=2, deadline=0.001)
        futs = client.map(work, range(8))
        assert client.gather(futs, timeout=120) == list(range(8))
        launches = reasons(cluster, "launch")
        assert launches, "no launch"
        assert "deadline 0.001s cannot be met" in launches[0]  # at once: the very first decision


def test_a_budget_is_cited_by_its_launches_and_not_overspent() -> None:
    budget = 0.05  # node-hours at the default cost of 1: 180 node-seconds
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        scaler = cluster.adapt(maximum=4, budget=budget)
        futs = client.map(work, range(12))
        assert client.gather(futs, timeout=120) == list(range(12))
        launches = reasons(cluster, "launch")
        assert launches and all(f"budget {budget:g}" in r for r in launches)
        policy = scaler.controller.policy
        assert isinstance(policy, Planned) and 0 < policy.plan.spent <= budget


def test_adapt_refuses_an_objective_with_a_policy_of_its_own() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster:
        with pytest.raises(ConfigError, match="one or the other"):
            cluster.adapt(objective="cheapest", policy=lambda snap: None)
        with pytest.raises(ConfigError, match="did you mean 'fastest'"):
            cluster.adapt(objective="fast")
        with pytest.raises(ConfigError, match="one or the other"):
            cluster.adapt(guess_budget=1.0, policy=lambda snap: None)
        with pytest.raises(ConfigError, match="guess_budget must be a number >= 0"):
            cluster.adapt(guess_budget=-1.0)
        assert cluster.autoscaler is None  # refused before anything started


def test_adapt_takes_the_default_policys_guess_budget() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster:
        scaler = cluster.adapt(maximum=2, guess_budget=0.25)
        policy = scaler.controller.policy
        assert isinstance(policy, Planned) and policy.plan.guess_budget == 0.25


def test_adapt_refuses_a_guess_budget_that_would_do_nothing() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster:
        for kwargs, said in (({"objective": "fastest"}, "bets without a limit"),
                             ({"objective": "cheapest"}, "does not bet"),
                             ({"budget": 2.0}, "does not bet")):  # fmt: skip
            with pytest.raises(ConfigError, match=said):
                cluster.adapt(guess_budget=0.0, **kwargs)  # type: ignore[arg-type]
        assert cluster.autoscaler is None


def test_adapt_refuses_to_replace_a_cluster_files_own_policy() -> None:
    from tidepool.config import parse

    cfg = parse({"policy": {"kind": "backlog"}, "node_types": [{"name": "cpu", "max_nodes": 2}]}, "c.toml")
    with tidepool.LocalCluster(n_workers=0) as cluster:
        for kwargs in ({"guess_budget": 1.0}, {"objective": "cheapest"}, {"deadline": 60.0}):
            with pytest.raises(ConfigError, match="c.toml has a \\[policy\\] of its own"):
                cluster.adapt(config=cfg, **kwargs)  # type: ignore[arg-type]
        assert cluster.autoscaler is None
