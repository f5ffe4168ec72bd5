"""kill -9 a durable scheduler under a running graph, start it again: nothing finished is lost.

Real processes: ``tidepool scheduler --state-dir`` (LocalCluster(state_dir=...)), worker processes,
a client in this process.  Every task appends its key to a file per worker process when it starts,
so executions are counted, not guessed.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from tidepool import Client, LocalCluster
from tidepool.testing import journal_records, wait_until


def _log_run(runs: str, key: str) -> None:
    with open(os.path.join(runs, str(os.getpid())), "a") as f:
        f.write(key + "\n")


def quick(i: int, runs: str) -> int:
    _log_run(runs, f"quick-{i}")
    return i * 2


def slow(i: int, runs: str, flag: str) -> int:
    """Starts, says so, and runs until ``flag`` exists (across the scheduler's death and restart)."""
    _log_run(runs, f"slow-{i}")
    while not os.path.exists(flag):
        time.sleep(0.05)
    return 1000 + i


def after(x: int, i: int, runs: str) -> int:
    _log_run(runs, f"after-{i}")
    return x + 1


def _executions(runs: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in runs.iterdir():
        for line in p.read_text().splitlines():
            counts[line] = counts.get(line, 0) + 1
    return counts



def test_kill_9_the_scheduler_under_a_running_graph_and_restart_it(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    flag = str(tmp_path / "go")
    n_quick, n_slow = 4990, 5
    journal = tmp_path / "after-restart.jsonl"
    with LocalCluster(3, slots=3, state_dir=str(tmp_path / "state"), reconnect_window=180.0,
                      recovery_wait=120.0, timeout=120) as cluster:  # a loaded machine: wait for every worker
        with Client(cluster, timeout=60) as client:
            slows = [client.submit(slow, i, str(runs), flag, key=f"slow-{i}") for i in range(n_slow)]
            waits = [client.submit(after, s, i, str(runs), key=f"after-{i}") for i, s in enumerate(slows)]
            quicks = client.map(quick, range(n_quick), [str(runs)] * n_quick, key=[f"quick-{i}" for i in range(n_quick)])
            assert len(quicks) + len(slows) + len(waits) == 5000
            # some results held, some tasks running, a few waiting
            wait_until(lambda: sum(f.done() for f in quicks) >= n_quick // 2, timeout=300, what="half the quick tasks")
            wait_until(lambda: all(c == 1 for c in [_executions(runs).get(f"slow-{i}", 0) for i in range(n_slow)]),
                       timeout=300, what="every slow task executing")  # fmt: skip
            # the store writes in batches: kill only once some finished results are on disk, or the
            # restarted scheduler has nothing finished to load (a faster map can outrun the writer)
            wait_until(lambda: _stored_finished(tmp_path / "state", "quick-") > 0, timeout=60,
                       what="finished quick tasks in the store")  # fmt: skip
            cluster.kill_scheduler()
            assert not any(f.done() for f in waits)
            cluster.restart_scheduler(journal=str(journal))
            wait_until(lambda: any(r.get("stage") == "resumed" for r in journal_records(journal)), timeout=120,
                       what="the journal's 'resumed' record")  # fmt: skip
            Path(flag).touch()  # the slow tasks, still running on their workers, finish now
            assert client.gather(slows, timeout=300) == [1000 + i for i in range(n_slow)]
            assert client.gather(waits, timeout=300) == [1001 + i for i in range(n_slow)]
            assert client.gather(quicks, timeout=300) == [2 * i for i in range(n_quick)]
    counts = _executions(runs)
    assert len(counts) == 5000
    reran = {k: n for k, n in counts.items() if n != 1}
    assert not reran, f"tasks executed more than once: {dict(list(reran.items())[:10])}"
    resumed = next(r for r in journal_records(journal) if r.get("stage") == "resumed")
    loaded = next(r for r in journal_records(journal) if r.get("stage") == "loaded")
    assert int(loaded["finished"]) > 0  # type: ignore[call-overload]
    assert int(resumed["recovered"]) > 0 and int(resumed["adopted_running"]) >= n_slow  # type: ignore[call-overload]
    assert resumed["recomputed"] == 0 and resumed["workers_missing"] == []


def test_a_worker_past_its_reconnect_window_exits_cleanly(tmp_path: Path) -> None:
    with LocalCluster(1, state_dir=str(tmp_path / "state"), reconnect_window=2.0, timeout=120) as cluster:
        (wid,) = cluster.workers()
        proc = cluster.provider.procs[wid].proc
        cluster.kill_scheduler()
        wait_until(lambda: proc.poll() is not None, timeout=120, what="the worker to give up and exit")
        assert proc.returncode == 0


def _stored_wants(state: Path, prefix: str) -> int:
    import sqlite3

    db = sqlite3.connect(state / "state.sqlite3")
    try:
        return int(db.execute("SELECT count(*) FROM wants WHERE key LIKE ?", (prefix + "%",)).fetchone()[0])
    finally:
        db.close()


def _stored_finished(state: Path, prefix: str) -> int:
    import sqlite3

    db = sqlite3.connect(f"file:{state / 'state.sqlite3'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM tasks WHERE status = 'm' AND key LIKE ?",
                              (prefix + "%",)).fetchone()[0])  # fmt: skip
    finally:
        db.close()


_DOOMED_CLIENT = """
import sys, time
from tidepool import Client
from test_scheduler_restart_e2e import quick
c = Client(sys.argv[1], sys.argv[2], timeout=60)
futs = [c.submit(quick, i, sys.argv[3], key=f"kept-{i}") for i in range(20)]
c.gather(futs, timeout=120)
print("done", flush=True)
time.sleep(600)
"""


def test_a_killed_client_re_attaches_to_its_keys_after_a_restart(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    runs = tmp_path / "runs"
    runs.mkdir()
    with LocalCluster(2, state_dir=str(tmp_path / "state"), reconnect_window=120.0, timeout=120) as cluster:
        doomed = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, cluster.address, cluster.token, str(runs)],
                                  stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})  # fmt: skip
        try:
            assert doomed.stdout is not None and doomed.stdout.readline().strip() == b"done"
            # a store tick has passed since (what is not flushed yet only comes back with its client)
            wait_until(lambda: _stored_wants(tmp_path / "state", "kept-") == 20, timeout=60,
                       what="the client's keys in the store")  # fmt: skip
            cluster.kill_scheduler()  # the machine both ran on went down
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(60)
        finally:
            if doomed.poll() is None:
                doomed.kill()
        cluster.restart_scheduler()
        with Client(cluster, timeout=60) as client:
            futs = client.futures_of([f"kept-{i}" for i in range(20)])
            assert client.gather(futs, timeout=120) == [2 * i for i in range(20)]
            (gone,) = client.futures_of(["never-submitted"])
            try:
                gone.result(timeout=60)
                raise AssertionError("an unknown key must fail")
            except Exception as exc:  # noqa: BLE001
                assert type(exc).__name__ == "TaskCancelledError", exc
    assert all(n == 1 for n in _executions(runs).values())


def test_a_client_cut_off_from_a_live_durable_scheduler_keeps_its_keys_and_one_that_closes_does_not(
        tmp_path: Path) -> None:  # fmt: skip
    runs = tmp_path / "runs"
    runs.mkdir()
    n = 20
    with LocalCluster(2, state_dir=str(tmp_path / "state"), reconnect_window=120.0, timeout=120) as cluster:
        with Client(cluster, timeout=60) as client:
            futs = client.map(quick, range(n), [str(runs)] * n, key=[f"cut-{i}" for i in range(n)])
            assert client.gather(futs, timeout=120) == [2 * i for i in range(n)]
            me, conn = client.id, client._connection
            old = conn._conn
            # the network drops this client's connection (a reset); the scheduler stays up
            conn.loop.call_soon(old.transport.abort)
            wait_until(lambda: conn._conn is not old and conn.resuming is None and not conn._conn.closed,
                       timeout=120, what="the client's reconnection")  # fmt: skip
            assert client.id == me  # the scheduler kept its id, and with it its keys
            later = client.submit(after, futs[3], 3, str(runs), key="after-cut")
            assert later.result(timeout=120) == 7
            assert client.gather(futs, timeout=120) == [2 * i for i in range(n)]
        # closed on purpose: its keys go at once, not after the reconnect window
        with Client(cluster, timeout=60) as other:
            wait_until(lambda: sum(other.scheduler_info()["tasks"].values()) == 0, timeout=60,
                       what="the closed client's keys released")  # fmt: skip
    counts = _executions(runs)
    assert len(counts) == n + 1 and all(c == 1 for c in counts.values()), counts  # nothing ran twice


def env_of(name: str) -> str:
    return os.environ.get(name, "<unset>")


def test_setup_hooks_reach_workers_started_after_a_restart(tmp_path: Path) -> None:
    """The setups a client registered are in the store: a worker that joins the restarted
    scheduler runs them although no client registers them again."""
    with LocalCluster(1, state_dir=str(tmp_path / "state"), reconnect_window=120.0, timeout=120) as cluster:
        with Client(cluster, timeout=60) as client:
            client.register_setup(name="mark", env={"TP_RESTART_MARK": "kept"})
            assert client.submit(env_of, "TP_RESTART_MARK", pure=False).result(timeout=60) == "kept"
        wait_until(lambda: _stored_setups(tmp_path / "state") == ["mark"], timeout=60, what="the setup in the store")
        cluster.kill_scheduler()
        cluster.restart_scheduler()
        (new,) = cluster.add_workers(1)
        with Client(cluster, timeout=60) as client:
            assert client.submit(env_of, "TP_RESTART_MARK", pure=False, workers=[new]).result(timeout=120) == "kept"


def _stored_setups(state: Path) -> list[str]:
    import sqlite3

    db = sqlite3.connect(state / "state.sqlite3")
    try:
        return [str(r[0]) for r in db.execute("SELECT name FROM setups ORDER BY seq")]
    finally:
        db.close()


def write_when(flag: str, out: str) -> str:
    """Waits for ``flag``, then leaves ``out`` behind (its only visible effect)."""
    while not os.path.exists(flag):
        time.sleep(0.05)
    Path(out).write_text("done")
    return out


def test_a_fire_and_forget_task_runs_to_the_end_after_a_restart(tmp_path: Path) -> None:
    """Kept for nobody (its client is gone), its worker killed with the scheduler: the restarted
    scheduler still has it and runs it on a new worker."""
    flag, out = str(tmp_path / "go"), str(tmp_path / "out")
    with LocalCluster(1, state_dir=str(tmp_path / "state"), reconnect_window=120.0, recovery_wait=5.0,
                      timeout=120) as cluster:  # fmt: skip
        (old,) = cluster.workers()
        with Client(cluster, timeout=60) as client:
            fut = client.submit(write_when, flag, out, key="forgotten-1")
            client.fire_and_forget(fut)
        wait_until(lambda: _stored_wants(tmp_path / "state", "forgotten-") == 1, timeout=60,
                   what="the fire-and-forget task in the store")  # fmt: skip
        cluster.kill_scheduler()
        proc = cluster.provider.procs[old].proc
        proc.kill()  # the task's run is lost with its worker
        proc.wait(60)
        cluster.restart_scheduler()
        cluster.add_workers(1)
        Path(flag).touch()
        wait_until(lambda: os.path.exists(out), timeout=120, what="the fire-and-forget task to run to its end")
        wait_until(lambda: _stored_wants(tmp_path / "state", "forgotten-") == 0, timeout=60,
                   what="its want to leave the store once it ran")  # fmt: skip


def _pid() -> int:
    return os.getpid()


def _failing_setup() -> None:
    raise RuntimeError("cannot reach the license server")


def test_a_setup_registered_as_a_restarted_scheduler_waits_for_its_workers_answers_for_them(tmp_path: Path) -> None:
    """Found by a recovery hunt: a register_setup cut off by a kill, asked again by the
    reconnecting client before the workers were back, answered {} at once (a success) though the
    setup then failed on every worker."""
    import concurrent.futures
    import signal

    import pytest

    from tidepool.errors import WorkerSetupError

    with LocalCluster(2, state_dir=str(tmp_path / "state"), reconnect_window=120.0, timeout=120) as cluster:
        with Client(cluster, timeout=60) as client:
            pids = sorted(client.run(_pid).values())
            cluster.kill_scheduler()
            for p in pids:  # the workers cannot rejoin until they go on
                os.kill(p, signal.SIGSTOP)
            try:
                cluster.restart_scheduler()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    call = pool.submit(client.register_setup, _failing_setup, name="bad")
                    # two round trips to the restarted scheduler after the request: it was read
                    # and, before the fix, answered by then
                    assert client.scheduler_info()["workers"] == []
                    assert client.scheduler_info()["workers"] == []
                    assert not call.done()  # it waits for the workers of the last run
                    for p in pids:
                        os.kill(p, signal.SIGCONT)
                    with pytest.raises(WorkerSetupError, match="failed on 2 of 2 workers"):
                        call.result(timeout=120)
            finally:
                for p in pids:  # (a worker whose setup failed has exited and may be reaped already)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGCONT)
