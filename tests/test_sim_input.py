"""``tidepool simulate`` with bad input ends in one clear ConfigError line naming the field, never a
traceback or a run that spins; and what it prints agrees with ``tidepool report``.

Each case was a traceback, a silent acceptance or an endless run before (issue 32, issue 33's views).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from test_sim_budget import TRACES  # noqa: E402
from tidepool.cli import main
from tidepool.errors import ConfigError
from tidepool.sim import validate
from tidepool.sim.workload import SimTask, from_dict, load_workload
from tidepool.telemetry.report import count_retirements, format_summary, load_records, summary

TRACE = TRACES / "montage-chameleon-2mass-01d-001.json" if TRACES is not None else None
needs_trace = pytest.mark.skipif(TRACE is None, reason="no ../shared/workloads/wfinstances beside the repository")


def simulate_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(["simulate", *argv, "--no-plot", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err


# ---- parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["bag", "--param", "n=abc"], "bag: --param n must be a number, got 'abc'"),
    (["bag", "--param", "nn=3"], "unknown --param 'nn' (did you mean 'n'?); it takes n, duration, nbytes"),
    (["layers", "--param", "width=-5"], "--param width must be >= 0, got -5"),
    (["layers", "--param", "width=1.5"], "--param width must be a whole number"),
    (["bag", "--param", "n=NaN"], "--param n must be a finite number"),
    (["layers", "--param", "width=1e12"], "more than the simulator's limit of 2,000,000"),
    (["bag", "--until", "nan"], "--until must be a finite number, got nan"),
    (["bag", "--until", "0"], "--until must be a positive number of seconds"),
    (["bag", "--tail", "-5"], "--tail must be >= 0, got -5"),
    (["bag", "--interval", "inf"], "--interval must be a finite number"),
    (["bag", "--interval", "-1"], "--interval must be a positive number of seconds"),  # said ">= 0" before
    (["bag", "--until", "-3"], "--until must be a positive number of seconds"),
    (["bag", "--max-tasks", "0"], "--max-tasks must be at least 1"),
    # found by a bug hunt: 0 CPUs per node "completed" with every result failed; a trace's unknown
    # --param was a TypeError traceback
    (["bag", "--cluster", "local:2:0"], "NODES must be at least 1 and CPUS (per node) above 0"),
    (["bag", "--cluster", "cloud:0:4"], "NODES must be at least 1"),
])  # fmt: skip
def test_bad_parameters_and_flags_are_config_errors_naming_the_field(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert message in simulate_error(capsys, *argv)


@needs_trace
def test_a_traces_unknown_param_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a bug hunt: a TypeError traceback from the trace reader."""
    assert "unknown --param 'width'; it takes scale, memory" in simulate_error(capsys, str(TRACE), "--param", "width=10")


@needs_trace
def test_a_run_whose_wanted_keys_failed_exits_non_zero_and_says_why(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:  # fmt: skip
    """Found by a bug hunt: nodes too small for every task 'completed' with exit status 0."""
    rc = main(["simulate", str(TRACE), "--cluster", "local:2:0.5", "--no-plot", "--quiet", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "wanted keys failed; the first:" in out and "InfeasibleTaskError" in out


def test_a_graph_with_no_tasks_ends_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a bug hunt: ``{"tasks": []}`` simulated for ever (the stall check waits for a submit
    that never comes)."""
    graph = tmp_path / "empty.json"
    graph.write_text('{"tasks": []}')
    rc = main(["simulate", str(graph), "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
               "--no-plot", "--quiet"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    (result,) = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] and result["tasks"] == 0 and result["makespan"] < 1.0


def test_output_files_that_cannot_be_written_are_refused_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Found by a bug hunt: ``--plot p.txt`` (and ``tidepool report -o timeline.txt``) ran the whole
    simulation, then ended in matplotlib's traceback."""
    assert main(["simulate", "wide", "--out", str(tmp_path), "--plot", str(tmp_path / "p.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and ".png" in err and "Traceback" not in err
    assert not (tmp_path / "default.jsonl").exists()  # refused before the run
    err = simulate_error(capsys, "wide", "--out", str(tmp_path), "--json", str(tmp_path / "no" / "r.json"))
    assert "does not exist" in err
    assert main(["report", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert "-o" in err and ".png" in err and "Traceback" not in err


def test_the_graph_size_limit_is_documented_and_can_be_raised() -> None:
    with pytest.raises(ConfigError, match=r"raise it with --max-tasks 3000"):
        load_workload("bag", params={"n": 3000}, max_tasks=2500)
    assert load_workload("bag", params={"n": 3000}, max_tasks=3000).n_tasks == 3000
    assert f"{validate.MAX_TASKS:,}" in Path(__file__).parents[1].joinpath("docs/simulation.md").read_text()


# ---- graphs and journals -----------------------------------------------------------------------
def test_random_bytes_are_a_clear_error_for_every_kind_of_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    noise = os.urandom(4096)
    for name in ("noise.jsonl", "noise.json"):
        (tmp_path / name).write_bytes(noise)
        err = simulate_error(capsys, str(tmp_path / name))
        assert name in err and ("not a journal" in err or "not JSON" in err), err
    assert "not a journal" in simulate_error(capsys, "--journal", str(tmp_path / "noise.jsonl"))


@pytest.mark.parametrize(("duration", "message"), [
    ("NaN", "must be a finite number, got nan"),  # the journal reader refuses it (telemetry/report.py)
    ("1e300", "duration must be between 0 and 1e+09"),
    ('"abc"', "got 'abc'"),
    ("-1", "duration must be between 0"),
])  # fmt: skip
def test_a_journal_task_with_a_bad_duration_is_refused_not_simulated_forever(
        tmp_path: Path, duration: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = tmp_path / "run.jsonl"
    path.write_text('{"t": 1, "kind": "task", "key": "a", "worker": "w", "start": 0, "duration": 1}\n'
                    f'{{"t": 2, "kind": "task", "key": "b", "worker": "w", "start": 1, "duration": {duration}}}\n')  # fmt: skip
    err = simulate_error(capsys, str(path))
    assert ("task record #2 ('b')" in err or "run.jsonl:2: not a journal record ('duration'" in err) and message in err, err


def test_a_task_longer_than_until_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"tasks": [{"key": "a", "duration": 5e8}]}))
    assert "lasts 5e+08s, longer than --until" in simulate_error(capsys, str(path))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("nbytes", "lots", "nbytes must be a whole number, got 'lots'"),
    ("nbytes", 1e300, "nbytes must be between 0 and"),
    ("nbytes", -1, "nbytes must be between 0 and"),
    ("priority", "high", "priority must be a whole number"),
    ("retries", -2, "retries must be >= 0"),
    ("submit", math.inf, "submit must be a finite number"),
    ("duration", "expo(nan)", "parameters must be finite numbers"),
])  # fmt: skip
def test_json_graph_fields_are_checked_and_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict({"tasks": [{"key": "a", field: value}]}, source="g.json")
    assert message in str(info.value) and "'a'" in str(info.value)


def test_every_reader_builds_tasks_through_the_same_checks() -> None:
    """A reader added later (WfFormat, a user's callable) cannot skip them: SimTask checks itself."""
    with pytest.raises(ConfigError, match="task 'x': duration must be a finite number"):
        SimTask("x", float("inf"))
    with pytest.raises(ConfigError, match="task 'x': nbytes"):
        SimTask("x", 1.0, nbytes=2**60)
    assert SimTask("x", 2, nbytes=5.0).nbytes == 5


# ---- what it prints --------------------------------------------------------------------------
def run_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    out = tmp_path / "out"
    rc = main(["simulate", *argv, "--out", str(out), "--json", str(tmp_path / "r.json"), "--no-plot"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out, cap.err, json.loads((tmp_path / "r.json").read_text())[0]


def test_simulate_and_report_agree_on_held_and_busy_worker_seconds_with_multi_core_nodes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Before: with 32-core nodes "busy w-s" (task-seconds) read 22x "held w-s", and tidepool
    report gave a third number for the same journal."""
    out, _, row = run_simulate(tmp_path, capsys, "bag", "--param", "n=300", "--cluster", "slurm:2:32",
                               "--seed", "3")  # fmt: skip
    s = summary(load_records(str(tmp_path / "out" / "default.jsonl")))
    assert row["held_w_s_total"] == pytest.approx(s["held_worker_seconds"], abs=1e-3)
    assert row["busy_w_s"] == pytest.approx(s["busy_worker_seconds"], abs=1e-3)
    assert row["task_s"] == pytest.approx(s["task_seconds"], abs=1e-3)
    assert row["busy_w_s"] <= row["held_w_s_total"] + 1e-6 < row["task_s"]  # 32 slots a worker
    assert re.search(r"held w-s \(whole run\)\s+busy w-s\s+task-s", out)


def test_retirements_count_those_done_not_refused_attempts() -> None:
    recs = [
        {"t": 1.0, "kind": "retire", "worker": "a"}, {"t": 1.0, "kind": "retire-done", "worker": "a", "outcome": "refused: holds data"},
        {"t": 2.0, "kind": "retire", "worker": "a"}, {"t": 2.0, "kind": "retire-done", "worker": "a", "outcome": "refused: busy"},
        {"t": 3.0, "kind": "retire", "worker": "a"}, {"t": 3.0, "kind": "retire-done", "worker": "a", "outcome": "retired"},
    ]  # fmt: skip
    assert count_retirements(recs) == (1, 2)
    s = summary(recs)
    assert (s["retirements"], s["retire_refused"]) == (1, 2)
    assert "1 done (2 refused)" in format_summary(s)


def test_the_table_says_its_units_and_speed_lines_need_v(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, err, row = run_simulate(tmp_path, capsys, "bursty", "--cluster", "local:4")
    assert "cost (node-h x cost/node-h)" in out and "retirements done" in out
    assert "events/s" not in err and "wall time" not in err and "controller:" not in err
    assert row["retirements"] == count_retirements(load_records(str(tmp_path / "out" / "default.jsonl")))[0]
    _, err_v, _ = run_simulate(tmp_path, capsys, "bursty", "--cluster", "local:4", "-v")
    assert "events/s" in err_v and "wall time" in err_v


def test_a_policy_that_raises_is_said_and_fails_the_simulation(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Found by a bug hunt: a policy raising on every round printed the default policy's numbers
    under its name, exit 0 (the fallback is right for a live pool, not for judging a policy)."""
    (tmp_path / "raising_policy_mod.py").write_text("def scale(snapshot):\n    raise RuntimeError('my bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["simulate", "chain", "--param", "n=3", "--cluster", "local:2", "--policy", "raising_policy_mod:scale",
               "--policy", "default", "--out", str(tmp_path / "out"), "--no-plot", "--quiet"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 1
    assert re.search(r"raising_policy_mod:scale: the policy raised in (\d+) of \1 rounds \(first: RuntimeError: my bug\)", out)
    assert "policy 'raising_policy_mod:scale' raised" in err and "default: the policy raised" not in out


def test_a_graph_function_missing_an_argument_says_which_param_to_pass(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # found by a bug hunt: a TypeError traceback
    (tmp_path / "graph_fn_mod.py").write_text("def make(n, width, scale=1.0):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = simulate_error(capsys, "graph_fn_mod:make", "--param", "n=3")
    assert "graph_fn_mod:make needs 'width': pass --param width=VALUE" in err
