"""When a refused retirement is asked again (``scaling/shrink.py``), and what a round of many
retirements costs: each worker's signature used to read the whole pool, so a round that retired
10,000 workers did 10^8 steps (the 10,000-worker policy study spent most of its time there)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tidepool.scaling import controller as ctl
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import step_with_state
from tidepool.scaling.shrink import PoolSummary, ShrinkSignature, pool_summary, shrink_signature
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision, WorkerView
from tidepool.testing import StateDriver


def view(wid: str, state: str = "running", held: int = 0, unique: int = 0) -> WorkerView:
    return WorkerView(wid, "cpu", state, {"cpu": 1.0}, 1, 0, 0.0, held, 1 if unique else 0, unique, 0.0, 0.0)


def sig(workers: list[WorkerView], wid: str) -> ShrinkSignature:
    return shrink_signature(pool_summary(workers), next((w for w in workers if w.id == wid), None), wid)


def test_a_signature_changes_with_a_new_survivor_less_unique_data_or_more_room_only() -> None:
    before = [view("a", held=10, unique=10), view("b", held=100), view("c", state="starting")]
    s = sig(before, "a")
    assert s.survivors == {"b"} and s.survivors_held == 100 and s.unique_bytes == 10
    assert not s.changed(sig(before, "a"))
    assert not s.changed(sig([view("a", held=10, unique=10), view("b", held=100)], "a"))
    assert not s.changed(sig([*before[:2], view("c", state="retiring")], "a"))
    assert s.changed(sig([*before[:2], view("c")], "a"))  # c is up now
    assert s.changed(sig([view("a", held=4, unique=4), before[1]], "a"))
    assert s.changed(sig([before[0], view("b", held=60)], "a"))
    assert not s.changed(sig([view("a", held=999, unique=10), before[1]], "a"))


def test_a_round_that_retires_many_workers_reads_the_pool_once(monkeypatch: pytest.MonkeyPatch) -> None:
    d = StateDriver()
    n = 300
    for i in range(n):
        d.add_worker(f"w{i}", node_type="cpu")
    summaries: list[PoolSummary] = []

    def counted(workers: Iterable[WorkerView]) -> PoolSummary:
        out = pool_summary(workers)
        summaries.append(out)
        return out

    monkeypatch.setattr(ctl, "pool_summary", counted)

    def policy(snap: ClusterSnapshot) -> ScaleDecision:
        return ScaleDecision(retire=tuple(w.id for w in snap.workers), why=tuple((w.id, "idle") for w in snap.workers))

    c = ScalingController((NodeType("cpu", {"cpu": 1}, max_nodes=n, startup_estimate=1.0),), policy,
                          manage_foreign=True)  # fmt: skip
    assert len(step_with_state(c, d.state, 1.0).retire) == n
    assert len(summaries) == 1 and len(summaries[0].running) == n
