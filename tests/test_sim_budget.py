"""A budget is a ceiling, on real workflow traces in the simulator: the default policy with
``budget=`` (0.8x what the balanced default spends on the same trace) never bills more, and its
launches in the journal cite the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidepool.sim import load_workload, make_policy, preset_cluster, simulate
from tidepool.sim.wfformat import fit_memory


def _traces_dir() -> Path | None:
    root = Path(__file__).resolve().parents[1]
    for up in (root.parent, root.parent.parent, Path("/work")):
        cand = up / "shared" / "workloads" / "wfinstances"
        if cand.is_dir():
            return cand
    return None


TRACES = _traces_dir()


@pytest.mark.skipif(TRACES is None, reason="no ../shared/workloads/wfinstances beside the repository")
@pytest.mark.parametrize("name", ["montage-chameleon-2mass-01d-001.json", "1000genome-chameleon-10ch-250k-001.json",
                                  "1000genome-chameleon-22ch-100k-001.json"])
def test_a_budget_is_never_exceeded_on_a_real_trace(name: str, tmp_path: Path) -> None:
    assert TRACES is not None
    cluster = preset_cluster("cloud:50:4")
    cluster.interval = 1.0
    wl = load_workload(str(TRACES / name), seed=0)
    fit_memory(wl, [0.0])
    base = simulate(wl, cluster, make_policy("default"), seed=0, task_records=False, tail=900.0)
    assert base.makespan is not None
    budget = round(0.8 * base.total_cost, 3)
    journal = tmp_path / "j.jsonl"
    r = simulate(wl, cluster, make_policy(f"default(budget={budget})"), seed=0, task_records=False, tail=900.0,
                 journal=str(journal))  # fmt: skip
    assert r.makespan is not None  # the graph still finishes
    assert r.total_cost <= budget
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    launches = [str(x.get("reason", "")) for x in records if x["kind"] == "launch"]
    planned = [x for x in launches if not x.startswith("no progress")]
    assert planned and all(x.startswith(f"budget {budget:g}") for x in planned)
