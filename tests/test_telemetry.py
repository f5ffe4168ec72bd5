"""Telemetry: the progress bar, the timeline plot and summary, the Chrome trace, ``tidepool report``.

Two kinds of input: a journal from a real adaptive run (a cluster that starts with no worker, grows
to two for 20 short tasks, one of which fails), shared by the tests of this module, and hand-made
records whose numbers are known exactly (two node types, a retirement, a failed task, a worker that
joined before the journal began).  The progress bar runs against a real two-worker cluster; its text
goes to a non-terminal rich console on a StringIO.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import tidepool
from tidepool.client import Client
from tidepool.cluster import LocalCluster
from tidepool.errors import ConfigError
from tidepool.telemetry import journal as jr
from tidepool.telemetry.progress import format_seconds, progress_line, show_progress
from tidepool.telemetry.report import (
    format_summary,
    load_records,
    plot_timeline,
    summary,
    worker_spans,
)
from tidepool.telemetry.trace import to_chrome_trace, write_chrome_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_TASKS = 20
FAILING = 13


def sleepy(i: int) -> int:
    time.sleep(0.1)  # the task's work: 0.1 s of "compute"
    if i == FAILING:
        raise ValueError(f"task {i} fails on purpose")
    return i


def quick(i: int) -> int:
    time.sleep(0.05)
    if i == 3:
        raise ValueError("boom")
    return i * 2


@tidepool.task
def inc(x: int) -> int:
    return x + 1


def console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=100), buf


# ---- inputs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL journal of an adaptive run: 0 workers -> at most 2 -> closed."""
    path = tmp_path_factory.mktemp("journal") / "j.jsonl"
    with LocalCluster(n_workers=0) as cluster:
        cluster.adapt(maximum=2, journal=str(path))
        with Client(cluster) as client:
            futs = client.map(sleepy, range(N_TASKS))
            client.gather(futs, errors="skip")
    # LocalCluster.close() leaves the journal file open (records after the autoscaler's last flush
    # reach the disk only when it is garbage-collected): close it, as a reader after a run needs.
    assert cluster.journal is not None
    cluster.journal.close()
    return path


def handmade() -> list[dict[str, Any]]:
    """Two cpu workers and a gpu worker; c2 retired; one failed task.  Origin t=100."""
    return [
        {"t": 100.0, "kind": "launch", "request": "r1", "node_type": "cpu", "nodes": 2, "reason": "backlog of 3"},
        {"t": 100.5, "kind": "worker-join", "worker": "c1", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 100.6, "kind": "worker-join", "worker": "c2", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 101.0, "kind": "launch", "request": "r2", "node_type": "gpu", "nodes": 1, "reason": "needs gpu"},
        {"t": 101.5, "kind": "task", "key": "a-0", "worker": "c1", "start": 100.5, "duration": 1.0, "ok": True},
        {"t": 101.5, "kind": "worker-join", "worker": "g1", "node_type": "gpu", "resources": {"gpu": 1}},
        {"t": 101.6, "kind": "task", "key": "a-1", "worker": "c2", "start": 100.6, "duration": 1.0, "ok": False},
        {"t": 102.0, "kind": "task", "key": "a-2", "worker": "c1", "start": 101.5, "duration": 0.5, "ok": True},
        {"t": 102.5, "kind": "task", "key": "g-0", "worker": "g1", "start": 101.5, "duration": 1.0, "ok": True},
        {"t": 102.6, "kind": "retire", "worker": "c2", "node_type": "cpu", "reason": "c2 idle 1.0s"},
        {"t": 102.6, "kind": "worker-close", "worker": "c2", "reason": "retired (autoscaler)"},
        {"t": 102.6, "kind": "retire-done", "worker": "c2", "outcome": "retired"},
        {"t": 102.7, "kind": "worker-leave", "worker": "c2", "reason": "closed", "graceful": True},
        {"t": 103.0, "kind": "worker-leave", "worker": "c1", "reason": "closed", "graceful": False},
        {"t": 103.0, "kind": "worker-leave", "worker": "g1", "reason": "closed", "graceful": False},
    ]


# ---- summary ---------------------------------------------------------------------------------------
def test_summary_of_handmade_records_is_exact() -> None:
    s = summary(handmade())
    assert s["start"] == 100.0
    assert s["makespan"] == pytest.approx(2.5)  # last task (g-0) ends at 102.5
    assert s["tasks"] == 4 and s["failed"] == 1
    assert s["task_seconds"] == pytest.approx(3.5)
    # held: c1 100.5-103, c2 100.6-102.6 (the leave after the close changes nothing), g1 101.5-103
    assert s["held_worker_seconds"] == pytest.approx(2.5 + 2.0 + 1.5)
    assert s["busy_worker_seconds"] == pytest.approx(1.5 + 1.0 + 1.0)
    assert s["efficiency"] == pytest.approx(3.5 / 6.0)
    assert s["time_to_first_worker"] == pytest.approx(0.5)
    assert s["workers"] == 3 and s["peak_workers"] == 3
    assert s["node_types"] == {"cpu": 2, "gpu": 1}
    assert (s["launches"], s["launched_nodes"], s["retirements"]) == (2, 3, 1)
    text = format_summary(s)
    assert "58.3% (busy / held)" in text and "makespan" in text and "2.50 s" in text


def test_summary_counts_a_busy_multi_slot_worker_once_and_workers_from_before_the_journal() -> None:
    # w0 joined before the journal began (no join record) and ran two tasks at once; w1 joined later.
    recs = [
        {"t": 10.0, "kind": "task", "key": "x", "worker": "w0", "start": 9.0, "duration": 1.0, "ok": True},
        {"t": 10.5, "kind": "task", "key": "y", "worker": "w0", "start": 9.5, "duration": 1.0, "ok": True},
        {"t": 11.0, "kind": "worker-join", "worker": "w1", "node_type": "default"},
        {"t": 12.0, "kind": "worker-leave", "worker": "w0", "reason": "closed"},
        {"t": 12.0, "kind": "worker-leave", "worker": "w1", "reason": "closed"},
    ]
    spans = {s.worker: s for s in worker_spans(recs)}
    assert (spans["w0"].start, spans["w0"].end, spans["w0"].joined) == (9.0, 12.0, False)
    s = summary(recs)
    assert s["busy_worker_seconds"] == pytest.approx(1.5)  # 9.0-10.5, not 2.0
    assert s["task_seconds"] == pytest.approx(2.0)
    assert s["held_worker_seconds"] == pytest.approx(3.0 + 1.0)
    assert s["held_worker_seconds"] >= s["busy_worker_seconds"]
    assert s["time_to_first_worker"] == pytest.approx(2.0)


def test_summary_of_empty_records() -> None:
    s = summary([])
    assert s["tasks"] == 0 and s["workers"] == 0 and s["efficiency"] is None
    assert s["time_to_first_worker"] is None and s["makespan"] == 0.0


def test_summary_of_a_real_adaptive_run(real_journal: Path) -> None:
    records = jr.load(str(real_journal))
    s = summary(records)
    assert s["tasks"] == N_TASKS and s["failed"] == 1
    assert s["launches"] >= 1 and 1 <= s["workers"] <= 2 and s["peak_workers"] <= 2
    assert s["node_types"] == {"default": s["workers"]}
    assert s["held_worker_seconds"] >= s["busy_worker_seconds"] > 0
    assert 0 < s["efficiency"] <= 1
    assert s["time_to_first_worker"] > 0  # the pool started empty
    assert s["makespan"] >= N_TASKS * 0.1 / 2  # at most two workers ran the 0.1 s tasks
    # every worker joined inside the journal, so the journal's own accounting agrees (up to the
    # rounding of start and duration to microseconds: a task's end may pass its record's time)
    assert s["held_worker_seconds"] == pytest.approx(jr.held_worker_seconds(records), abs=1e-4)
    assert s["busy_worker_seconds"] <= jr.busy_worker_seconds(records) + 1e-6


# ---- the plot --------------------------------------------------------------------------------------
def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # a drawn figure, not an empty canvas


def test_plot_timeline_of_a_real_run(real_journal: Path, tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    fig = plot_timeline(jr.load(str(real_journal)), str(out))
    _check_png(out)
    top, gantt = fig.axes[0], fig.axes[1]
    assert top.get_ylabel() == "workers" and "seconds" in gantt.get_xlabel()
    assert [ln.get_gid() for ln in top.get_lines() if str(ln.get_gid()).startswith("held")] == ["held:default"]
    assert any(str(ln.get_gid()) == "marker:launch" for ln in gantt.get_lines())
    assert top.get_legend() is not None and gantt.get_legend() is not None
    assert gantt.get_xlim()[0] < 0.0 < gantt.get_xlim()[1]  # time from the origin, in seconds


def test_plot_timeline_draws_one_line_per_node_type(tmp_path: Path) -> None:
    out = tmp_path / "two-types.png"
    fig = plot_timeline(handmade(), str(out), title="two node types")
    _check_png(out)
    top, gantt = fig.axes[0], fig.axes[1]
    held = [ln for ln in top.get_lines() if str(ln.get_gid()).startswith("held:")]
    assert len(held) == 2
    assert sorted(str(ln.get_label()) for ln in held) == ["held: cpu", "held: gpu"]
    cpu = next(ln for ln in held if ln.get_label() == "held: cpu")
    xs, ys = cpu.get_data()
    assert list(ys) == [0, 1, 2, 1, 0]  # c1 and c2 join, c2 retired, c1 leaves
    assert list(xs) == pytest.approx([0.0, 0.5, 0.6, 2.6, 3.0])
    assert any(ln.get_gid() == "held-total" for ln in top.get_lines())
    markers = [ln.get_gid() for ln in gantt.get_lines()]
    assert markers.count("marker:launch") == 2 and markers.count("marker:retire") == 1
    assert [t.get_text() for t in gantt.get_yticklabels()] == ["c1 (cpu)", "c2 (cpu)", "g1 (gpu)"]
    assert fig.texts[0].get_text() == "two node types"


def test_plot_timeline_without_a_path_and_without_records() -> None:
    fig = plot_timeline([], None)
    assert len(fig.axes) == 2


# ---- the Chrome trace ------------------------------------------------------------------------------
def test_chrome_trace_of_handmade_records(tmp_path: Path) -> None:
    recs = handmade()
    out = tmp_path / "trace.json"
    write_chrome_trace(recs, str(out))
    trace = json.loads(out.read_text())
    assert trace == json.loads(json.dumps(to_chrome_trace(recs)))
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "autoscaler", 1: "c1 (cpu)", 2: "c2 (cpu)", 3: "g1 (gpu)"}
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 4
    a0 = next(e for e in xs if e["name"] == "a-0")
    assert (a0["ts"], a0["dur"], a0["tid"], a0["pid"]) == (500_000, 1_000_000, 1, 1)  # microseconds
    a1 = next(e for e in xs if e["name"] == "a-1")
    assert a1["cat"] == "task,failed" and a1["args"]["ok"] is False and a1["tid"] == 2
    instants = [e for e in events if e["ph"] == "i" and e["cat"] == "autoscaler"]
    assert [(e["name"], e["ts"]) for e in instants] == [("launch", 0), ("launch", 1_000_000), ("retire", 2_600_000)]
    assert instants[0]["args"]["reason"] == "backlog of 3"
    assert instants[2]["args"]["reason"] == "c2 idle 1.0s"
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "workers"]
    assert [(e["ts"], e["args"]) for e in counters] == [
        (500_000, {"cpu": 1, "gpu": 0}),
        (600_000, {"cpu": 2, "gpu": 0}),
        (1_500_000, {"cpu": 2, "gpu": 1}),
        (2_600_000, {"cpu": 1, "gpu": 1}),
        (3_000_000, {"cpu": 0, "gpu": 0}),
    ]
    busy = [e["args"]["busy"] for e in events if e["ph"] == "C" and e["name"] == "busy workers"]
    assert max(busy) == 3 and busy[-1] == 0


def test_chrome_trace_of_a_real_run(real_journal: Path) -> None:
    records = jr.load(str(real_journal))
    trace = json.loads(json.dumps(to_chrome_trace(records)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(1 for r in records if r["kind"] == "task") == N_TASKS
    durations = sorted(r["duration"] for r in records if r["kind"] == "task")
    assert sorted(e["dur"] for e in xs) == pytest.approx([d * 1e6 for d in durations])  # microseconds
    for e in xs:
        assert e["dur"] >= 0.09e6  # 0.1 s tasks: never shorter
        assert e["ts"] >= 0
    threads = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in xs} <= threads - {0}
    launches = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] == "launch"]
    assert launches and all(e["args"]["reason"] for e in launches)


# ---- journal files and the command line --------------------------------------------------------------
def test_load_records_skips_a_cut_off_last_line_only(tmp_path: Path) -> None:
    good = "\n".join(json.dumps(r) for r in handmade()[:3]) + "\n"
    cut = tmp_path / "cut.jsonl"
    cut.write_text(good + '{"t": 101.0, "kind": "lau')
    assert load_records(str(cut)) == handmade()[:3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1\n' + good)
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_records(str(bad))
    with pytest.raises(ConfigError, match="cannot read journal"):
        load_records(str(tmp_path / "missing.jsonl"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidepool.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MPLBACKEND": "Agg"})  # fmt: skip


def test_cli_report_end_to_end(real_journal: Path, tmp_path: Path) -> None:
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    res = _cli("report", str(real_journal), "-o", str(png), "--trace", str(trace))
    assert res.returncode == 0, res.stderr
    _check_png(png)
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X") == N_TASKS
    assert f"{N_TASKS} (1 failed" in res.stdout
    for name in ("makespan", "held worker-seconds", "busy worker-seconds", "efficiency",
                 "time to first worker", "launches", "retirements"):  # fmt: skip
        assert name in res.stdout


def test_cli_report_missing_journal_is_a_clean_error(tmp_path: Path) -> None:
    res = _cli("report", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2
    assert "cannot read journal" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("line", "said"), [
    ('{"t": 1, "kind": "launch", "request": "a1", "node_type": "cpu", "nodes": "x"}', "'nodes' must be a finite number"),
    ('{"t": null, "kind": "launch"}', "'t' must be a finite number, got None"),
    ('{"t": 2, "kind": "task", "key": "k", "worker": "w", "start": "soon", "duration": 1}', "'start' must be"),
])  # fmt: skip
def test_cli_report_on_a_record_with_a_field_of_the_wrong_type_is_a_clean_error(tmp_path: Path, line: str,
                                                                                said: str) -> None:  # fmt: skip
    journal = tmp_path / "j.jsonl"
    journal.write_text('{"t": 0, "kind": "journal-start"}\n' + line + "\n")
    res = _cli("report", str(journal), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2, res.stderr  # a ValueError/TypeError traceback before
    assert said in res.stderr and "j.jsonl:2" in res.stderr and "Traceback" not in res.stderr


# ---- the progress bar --------------------------------------------------------------------------------
def test_progress_line() -> None:
    assert progress_line(3, 10, 1, {"gpu": 1, "cpu": 2}, 4.3) == "3/10 done | 1 failed | workers cpu:2 gpu:1 | ETA 4.3s"
    assert progress_line(0, 5, 0, {}, None) == "0/5 done | 0 failed | no workers | ETA ?"
    assert progress_line(5, 5, 0, {"cpu": 1, "gpu": 0}, 0.0, show_eta=False) == "5/5 done | 0 failed | workers cpu:1"
    assert progress_line(1, 2, 0, {"a": 1}, 125.0).endswith("ETA 2m05s")
    assert [format_seconds(s) for s in (-1, 0.04, 9.96, 42.4, 3599.6, 7260)] == [
        "0.0s", "0.0s", "10s", "42s", "1h00m", "2h01m"]  # fmt: skip


class InfoOnlyClient:
    """A client with ``scheduler_info`` and no ``eta`` (rich's time-remaining column is used)."""

    def __init__(self) -> None:
        self.asked = 0

    def scheduler_info(self) -> dict[str, Any]:
        self.asked += 1
        return {"workers": [{"id": "w1", "node_type": "cpu", "running": 0, "state": "running"},
                            {"id": "w2", "node_type": "cpu", "running": 0, "state": "gone"}],
                "tasks": {}, "counters": {}}  # fmt: skip


def test_show_progress_on_done_futures_without_eta() -> None:
    ok: concurrent.futures.Future[int] = concurrent.futures.Future()
    ok.set_result(1)
    bad: concurrent.futures.Future[int] = concurrent.futures.Future()
    bad.set_exception(ValueError("x"))
    con, buf = console()
    client = InfoOnlyClient()
    show_progress(client, [ok, bad, ok], console=con)
    out = buf.getvalue()
    assert out.startswith("2/2 done | 1 failed | workers cpu:1 in "), out
    assert out.count("\n") == 1 and client.asked == 1
    con, buf = console()
    show_progress(client, [], console=con)
    assert buf.getvalue().startswith("0/0 done | 0 failed")


class SteppingClient:
    """Finishes one pending future (and the forecast drops) each time the bar asks for info."""

    def __init__(self, futures: list[concurrent.futures.Future[int]]) -> None:
        self.futures = futures
        self.etas: list[float | None] = []

    def scheduler_info(self) -> dict[str, Any]:
        pending = [f for f in self.futures if not f.done()]
        if pending:
            if len(pending) == 2:
                pending[0].set_exception(RuntimeError("x"))
            else:
                pending[0].set_result(0)
        return {"workers": [{"id": "g", "node_type": "gpu", "state": "running"}], "tasks": {}, "counters": {}}

    def eta(self) -> float | None:
        left = sum(1 for f in self.futures if not f.done())
        self.etas.append(None if left == 4 else 30.0 * left)
        return self.etas[-1]


def test_show_progress_live_bar_on_a_terminal() -> None:
    futs: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in range(5)]
    client = SteppingClient(futs)
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=120, color_system=None)
    show_progress(client, futs, console=con, refresh=0.01)
    assert all(f.done() for f in futs)
    out = buf.getvalue()
    assert "0/5 done | 0 failed | workers gpu:1 | ETA ?" in out  # first draw: no forecast yet
    assert "/5 done" in out and "1 failed" in out
    assert "5/5 done | 1 failed | workers gpu:1 in " in out.rstrip().splitlines()[-1]  # after erasing the bar
    assert client.etas[0] is None  # asked once; later asks are at most once a second


def test_show_progress_blocks_until_a_real_cluster_is_done() -> None:
    with LocalCluster(n_workers=2) as cluster, Client(cluster) as client:
        futs = client.map(quick, range(10))
        con, buf = console()
        show_progress(client, futs, console=con, refresh=0.05)
        assert all(f.done() for f in futs)
    out = buf.getvalue()
    assert "10/10 done | 1 failed | workers default:2 in " in out, out


def test_compute_with_progress(capsys: pytest.CaptureFixture[str]) -> None:
    with LocalCluster(n_workers=1) as cluster, Client(cluster) as client:
        futs = client.compute([inc(i) for i in range(3)], progress=True)
        assert all(f.done() for f in futs)
        assert [f.result() for f in futs] == [1, 2, 3]
    assert "3/3 done | 0 failed | workers default:1" in capsys.readouterr().out


def test_a_call_off_is_no_failed_launch_in_the_report_and_a_closed_pipe_is_no_network_error(tmp_path: Path) -> None:
    # found by a bug hunt: `tidepool report` counted a policy's call-off as a failed launch, and a
    # reader gone (`| head`) was told "Broken pipe (is the address right and the port free?)"
    recs = [
        {"t": 0.0, "kind": "journal-start"},
        {"t": 0.1, "kind": "launch", "request": "a1", "node_type": "cpu", "nodes": 3, "reason": "wide"},
        {"t": 1.0, "kind": "cancel-launch", "request": "a1", "node_type": "cpu", "nodes": 1, "called_off": True,
         "workers": ["w3"], "reason": "called off: custom"},
        {"t": 2.0, "kind": "worker-join", "worker": "w1", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 3.0, "kind": "cancel-launch", "request": "a2", "node_type": "cpu", "reason": "did not register"},
    ]  # fmt: skip
    s = summary(recs)
    assert s["launch_failures"] == 1 and s["called_off_nodes"] == 1  # only the give-up failed
    assert "1 failed, 1 nodes called off" in format_summary(s)
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = subprocess.Popen([sys.executable, "-m", "tidepool", "report", str(path), "-o", str(tmp_path / "t.png")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert p.stdout is not None
    p.stdout.close()  # the reader is gone before the report prints
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and b"address" not in err and b"Traceback" not in err, err
