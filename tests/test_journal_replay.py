"""Journals the simulator can replay (issue 34): task records carry their inputs and submit time,
the autoscaler records each worker's measured start-up, and ``tidepool simulate --journal``
replays the recorded graph with the run's own start-up distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidepool.cli import main as cli_main
from tidepool.scheduler import events as ev
from tidepool.sim.cluster import preset_cluster
from tidepool.sim.replay import calibrate_latency, calibrate_startup, dispatch_gaps
from tidepool.sim.workload import load_workload
from tidepool.telemetry.journal import Journal
from tidepool.telemetry.report import load_records
from tidepool.telemetry.startup import StartupTracker, startup_delays


def spec(key: str, *deps: str, resources: dict[str, float] | None = None) -> ev.TaskSpec:
    return ev.TaskSpec(key, "f", None, deps, resources or {})


def recorded_run(path: Path, gpu: bool = True) -> list[dict[str, object]]:
    """A small run as the journal sees it: a -> (b, c) -> d, workers launched and ready."""
    j = Journal(str(path))
    j.record("journal-start", 0.0)
    j.observe([ev.UpdateGraph("c1", [spec("a"), spec("b", "a"), spec("c", "a", resources={"gpu": 1} if gpu else None)],
                              ["b", "c"], 1.0)], [])  # fmt: skip
    j.add({"t": 1.0, "kind": "launch", "request": "a1", "node_type": "default", "nodes": 2})
    tracker = StartupTracker()
    tracker.launched(["w1", "w2"], "a1", "default", 1.0)
    tracker.started_by("w1", "fork-server")
    for w, at in (("w1", 1.1), ("w2", 1.3)):
        j.observe([ev.WorkerJoin(w, "tcp://x", {"cpu": 1}, at)], [])
        tracker.joined(w, at)
        rec = tracker.ready(w, at + 0.05)
        assert rec is not None
        j.add(rec)
    j.observe([ev.TaskFinished("w1", "a", 100, 1.0, 2.5)], [])
    j.observe([ev.UpdateGraph("c1", [spec("d", "b", "c")], ["d"], 3.0)], [])
    j.observe([ev.TaskFinished("w1", "b", 8, 1.0, 3.5), ev.TaskFinished("w2", "c", 8, 2.0, 4.5)], [])
    j.observe([ev.TaskFinished("w2", "d", 8, 0.5, 5.1)], [])  # started 0.1 s after c ended: a dispatch gap
    j.close()
    return load_records(str(path))


def test_task_records_carry_inputs_submit_time_size_and_resources(tmp_path: Path) -> None:
    recs = recorded_run(tmp_path / "run.jsonl")
    tasks = {r["key"]: r for r in recs if r["kind"] == "task"}
    assert tasks["a"]["deps"] == [] and tasks["a"]["submitted"] == 1.0 and tasks["a"]["nbytes"] == 100
    assert tasks["c"]["deps"] == ["a"] and tasks["c"]["resources"] == {"gpu": 1}
    assert tasks["d"]["deps"] == ["b", "c"] and tasks["d"]["submitted"] == 3.0
    startup = [r for r in recs if r["kind"] == "worker-startup"]
    assert [(r["worker"], r["how"], r["to_registered"], r["to_ready"]) for r in startup] == [
        ("w1", "fork-server", pytest.approx(0.1), pytest.approx(0.15)),
        ("w2", None, pytest.approx(0.3), pytest.approx(0.35))]  # fmt: skip


def test_task_records_carry_the_clients_group_for_the_post_mortem_and_the_replay(tmp_path: Path) -> None:
    """Found by a bug hunt: journal task records had no group, so the post-mortem dashboard read it
    off the key: one group per ``map`` call (``slow-99bc...00000000``), one per task of a WfFormat
    trace (``mAdd_ID0000033``) instead of the function or the program."""
    from tidepool.dashboard.replay import ReplayModel

    path = tmp_path / "run.jsonl"
    j = Journal(str(path))
    j.record("journal-start", 0.0)
    keys = ["slow-99bc00000000", "slow-99bc00000001", "mAdd_ID0000033"]
    groups = ["slow", "slow", "mAdd"]
    j.observe([ev.UpdateGraph("c1", [ev.TaskSpec(k, "f", None, (), {}, 0, g) for k, g in zip(keys, groups, strict=True)],
                              keys, 1.0)], [])  # fmt: skip
    j.observe([ev.WorkerJoin("w1", "tcp://x", {"cpu": 1}, 1.0)], [])
    j.observe([ev.TaskFinished("w1", k, 8, 0.5, 2.0 + i) for i, k in enumerate(keys)], [])
    j.close()
    records = load_records(str(path))
    assert [r.get("group") for r in records if r["kind"] == "task"] == groups
    view = ReplayModel(records).view(10.0)["view"]
    assert set(view["groups"]) == {"slow", "mAdd"}, view["groups"]
    replayed = load_workload(str(path))
    assert sorted({t.group for t in replayed.tasks()}) == ["mAdd", "slow"]


def test_a_journal_replays_as_its_graph_with_its_own_start_up(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    recorded_run(path)
    w = load_workload(str(path))
    assert [(s.at, [(t.key, t.deps) for t in s.tasks]) for s in w.stages] == [
        (0.0, [("a", ()), ("b", ("a",)), ("c", ("a",))]), (2.0, [("d", ("b", "c"))])]  # fmt: skip
    by_key = {t.key: t for t in w.tasks()}
    assert by_key["c"].resources == {"gpu": 1} and by_key["a"].nbytes == 100 and by_key["c"].duration == 2.0
    assert "4 task records, 4 dependencies" in w.notes[0]
    cluster = preset_cluster("local:4")
    notes = calibrate_startup(cluster, load_records(str(path)))
    boot = cluster.models["default"].boot
    assert boot.kind == "choice" and sorted(boot.params) == pytest.approx([0.15, 0.35])  # request -> ready
    assert "2 measured workers" in notes[0] and "normal(0.1, 0.03)" in notes[0]
    # gaps before a runnable task: b right after a (0 s), d 0.1 s after c; one message = half the mean
    assert sorted(dispatch_gaps(load_records(str(path)))) == pytest.approx([0.0, 0.1])
    assert calibrate_latency(cluster, load_records(str(path)))
    assert cluster.latency == pytest.approx(0.025)


def test_start_ups_of_an_older_journal_come_from_launches_and_joins() -> None:
    recs = [{"t": 1.0, "kind": "launch", "request": "a1", "node_type": "cpu"},
            {"t": 1.4, "kind": "worker-join", "worker": "cpu-a1-1-p42"},
            {"t": 2.0, "kind": "worker-join", "worker": "by-hand"}]  # fmt: skip
    assert startup_delays(recs) == {"cpu": [pytest.approx(0.4)]}


def test_tidepool_simulate_replays_a_journal_with_a_benchmark_window_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """benchmarks/elastic.py starts its journals with a ``bench-window`` record: simulate reads it."""
    path = tmp_path / "run.jsonl"
    recs = recorded_run(tmp_path / "raw.jsonl", gpu=False)  # local:2 has no GPU
    with path.open("w") as f:
        f.write(json.dumps({"t": 1.0, "kind": "bench-window", "t0": 1.0, "t1": 5.0}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in recs)
    out = tmp_path / "out"
    rc = cli_main(["simulate", "--journal", str(path), "--cluster", "local:2", "--no-plot", "--quiet",
                   "--out", str(out), "--json", str(tmp_path / "r.json")])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "start-up of 'default' from the journal: 2 measured workers" in text
    [result] = json.loads((tmp_path / "r.json").read_text())
    assert result["makespan"] is not None and result["makespan"] >= 4.0 - 1e-6  # a, then c (2 s), then d
