"""The journal reaches its file while the run goes on; launch labels on the timeline never overlap."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tidepool.scheduler import events as ev
from tidepool.telemetry.journal import Journal
from tidepool.telemetry.report import launch_labels
from tidepool.testing import FakeClock


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_records_reach_the_file_within_a_second_even_if_nothing_else_happens(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "run.jsonl"
    j = Journal(str(path), clock=clock)
    j.record("launch", 0.0, request="a1", nodes=2, reason="backlog")
    clock.advance(0.5)
    j.observe([ev.Tick(0.5)], [])
    clock.advance(0.6)  # a second since the last flush: the next tick writes it out
    j.observe([ev.Tick(1.1)], [])
    assert [r["kind"] for r in lines(path)] == ["launch"]  # there before close(): survives a SIGKILL
    j.record("retire", 1.2, worker="w1", reason="idle")
    clock.advance(1.0)
    j.observe([ev.Tick(2.2)], [])
    assert [r["kind"] for r in lines(path)] == ["launch", "retire"]
    j.close()


def test_launch_labels_close_in_time_share_one_label() -> None:
    recs = [{"t": 10.0, "kind": "launch", "nodes": 1}, {"t": 10.05, "kind": "launch", "nodes": 3},
            {"t": 10.1, "kind": "launch", "nodes": 2}, {"t": 30.0, "kind": "launch", "nodes": 1}]  # fmt: skip
    labels = launch_labels(recs, 10.0, 40.0)
    assert labels == [(0.0, " +6"), (20.0, " +1")]
    xs = [x for x, _ in labels]
    assert all(b - a >= 0.04 * 40.0 for a, b in zip(xs, xs[1:], strict=False))


def test_scheduler_journal_is_written_while_it_runs_and_survives_sigkill(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tidepool.testing import wait_until

    path = tmp_path / "run.jsonl"
    token = tmp_path / "token"
    sched = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "scheduler", "--port", "0", "--token-file",
                              str(token), "--journal", str(path)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    worker = None
    try:
        line = sched.stdout.readline() if sched.stdout else ""
        address = line.split(" at ", 1)[1].strip()
        env = {**os.environ, "TIDEPOOL_TOKEN_FILE": str(token)}
        worker = subprocess.Popen([sys.executable, "-m", "tidepool.worker", address], env=env)
        wait_until(lambda: path.exists() and "worker-join" in path.read_text(), timeout=30,
                   what="the worker's join in the journal file while the scheduler runs")  # fmt: skip
        sched.send_signal(signal.SIGKILL)
        sched.wait(timeout=30)
        assert any(r["kind"] == "worker-join" for r in lines(path))
    finally:
        for p in (worker, sched):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_compute_progress_counts_every_task_of_the_graph(capsys: pytest.CaptureFixture[str]) -> None:
    import tidepool
    from tidepool.testing import wait_until

    @tidepool.task
    def inc(x: int) -> int:
        return x + 1

    @tidepool.task
    def total(xs: list[int]) -> int:
        return sum(xs)

    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        root = total([inc(i) for i in range(48)])  # 49 tasks, one root
        fut = client.compute(root, progress=True)
        assert fut.result() == sum(range(1, 49))
        assert "49/49 done" in capsys.readouterr().out
        wait_until(lambda: not cluster.scheduler.watches, what="the progress watch dropped")


def test_a_journal_that_cannot_be_written_says_so_once_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    # found by a bug hunt: `tidepool scheduler --journal` on a full disk logged a traceback every
    # half second, and a clean SIGTERM then exited 2 (close() raised)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    t = [0.0]
    j = Journal("/dev/full", clock=lambda: t[0])
    with caplog.at_level(logging.ERROR, "tidepool.journal"):
        for i in range(20):
            t[0] += 2.0  # every record is due a flush
            j.record("tick", t[0], n=i)
        j.flush()
        j.close()
    said = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and "/dev/full" in said[0].getMessage()
    assert len(j.records) == 20  # kept in memory


def test_a_journal_path_used_before_keeps_the_run_before_as_dot_1(tmp_path: Path) -> None:
    # found by a bug hunt: a scheduler restarted with the same --journal erased the crash's history
    path = tmp_path / "run.jsonl"
    first = Journal(str(path))
    first.record("journal-start", 0.0, run=1)
    first.close()
    second = Journal(str(path))
    second.record("journal-start", 0.0, run=2)
    second.close()
    assert json.loads(path.read_text())["run"] == 2
    assert json.loads((tmp_path / "run.jsonl.1").read_text())["run"] == 1


def test_a_journal_whose_directory_is_not_writable_is_replaced_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    # the second review: keeping the run before as PATH.1 needs the directory writable; a writable
    # /var/log/tidepool.jsonl in a root-owned directory made every restart fail
    path = tmp_path / "run.jsonl"
    path.write_text('{"t": 0, "kind": "journal-start"}\n')

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING, "tidepool.journal"):
        j = Journal(str(path))
        j.record("journal-start", 0.0, run=2)
        j.close()
    assert json.loads(path.read_text())["run"] == 2 and "could not keep the run before" in caplog.text


def test_progress_never_counts_back_when_finished_values_are_released() -> None:
    # found by a bug hunt: the bar went 10/12 -> 1/12 -> 12/12: a finished value released while a
    # dependent still holds its record is "released", and was counted not done
    from tidepool.scheduler.server import Scheduler
    from tidepool.testing import StateDriver

    s = Scheduler("tcp://127.0.0.1:0", "t" * 32)
    d = StateDriver(s.state)
    d.add_worker("w1")
    d.submit([("a", []), ("b", ["a"])], ["b"])  # the client wants b only: a is freed once b ran
    s.watches[1] = ["a", "b"]
    assert s.progress(1) == {"done": 0, "failed": 0, "total": 2}
    d.finish("w1", "a")
    assert s.progress(1)["done"] == 1
    d.finish("w1", "b")
    assert s.state.tasks["a"].state == "released"  # finished, let go; b's record still names it
    assert s.progress(1) == {"done": 2, "failed": 0, "total": 2}


def test_a_key_finished_and_released_between_two_polls_is_counted_done() -> None:
    # a review: the first fix counted a key done only if a poll saw it in memory
    from tidepool.scheduler.server import Scheduler
    from tidepool.testing import StateDriver

    s = Scheduler("tcp://127.0.0.1:0", "t" * 32)
    d = StateDriver(s.state)
    d.add_worker("w1")
    d.submit([("a", []), ("b", ["a"]), ("c", ["b"])], ["c"])
    s.watches[1] = ["a", "b", "c"]
    assert s.progress(1)["done"] == 0
    d.finish("w1", "a")
    d.finish("w1", "b")  # a finished and was let go between two polls
    assert s.state.tasks["a"].state == "released"
    assert s.progress(1) == {"done": 2, "failed": 0, "total": 3}
