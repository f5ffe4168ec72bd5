"""kill -9 a durable scheduler that autoscales, start it again: it adopts its workers.

Real processes: ``tidepool scheduler --state-dir --cluster`` (``LocalCluster(state_dir=...)``
with ``adapt()``: the autoscaler and its local provider live in the scheduler process and die
with it), the worker processes it launched, a client here.  After the restart the same worker
processes (same ids, same pids) serve the graph, nothing is launched again, and the journal says
they were adopted.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest

from tidepool import Client, LocalCluster
from tidepool.testing import wait_until


def slow(i: int, flag: str) -> int:
    while not os.path.exists(flag):
        time.sleep(0.05)
    return i + 100


def _journal(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stored_instances(state: Path) -> dict[str, dict[str, object]]:
    db = sqlite3.connect(f"file:{state / 'state.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        return {w: json.loads(d) for w, d in db.execute("SELECT id, data FROM instances")}
    finally:
        db.close()


def _pids(registry: Path) -> dict[str, int]:
    return {p.stem: int(json.loads(p.read_text())["pid"]) for p in registry.glob("*.json")}


def _alive(pid: int) -> bool:
    """Running (not ended, not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(600)  # a loaded machine: process starts are slow
def test_a_restarted_scheduler_adopts_the_workers_its_autoscaler_launched(tmp_path: Path) -> None:
    state = tmp_path / "state"
    flag = str(tmp_path / "go")
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    with LocalCluster(0, state_dir=str(state), reconnect_window=180.0, recovery_wait=120.0, timeout=120) as cluster:
        cluster.adapt(minimum=2, maximum=2, journal=str(before))
        wait_until(lambda: len(cluster.workers()) == 2, timeout=180, what="the two autoscaled workers")
        workers = sorted(cluster.workers())
        wait_until(lambda: sorted(_stored_instances(state)) == workers, timeout=60, what="the stored instance rows")
        rows = _stored_instances(state)
        assert {(r["request"], r["origin"]) for r in rows.values()} == {("a1", "launched")}  # launched by it
        pids = _pids(state / "local-workers")
        assert sorted(pids) == workers
        with Client(cluster, timeout=60) as client:
            futures = [client.submit(slow, i, flag, key=f"slow-{i}") for i in range(6)]
            wait_until(lambda: [w["running"] > 0 for w in client.scheduler_info()["workers"]] == [True, True],
                       timeout=120, what="tasks on both workers")  # fmt: skip
            cluster.kill_scheduler()
            assert all(_alive(p) for p in pids.values())  # workers outlive the scheduler (their window)
            cluster.restart_scheduler(journal=str(after))
            wait_until(lambda: any(r["kind"] == "adopt" for r in _journal(after)), timeout=120,
                       what="the journal's adopt records")  # fmt: skip
            Path(flag).touch()
            assert client.gather(futures, timeout=300) == [i + 100 for i in range(6)]
            assert sorted(cluster.workers()) == workers
            assert _pids(state / "local-workers") == pids and all(_alive(p) for p in pids.values())
    recs = _journal(after)
    adopted = {r["worker"]: (r["outcome"], r["request"]) for r in recs if r["kind"] == "adopt"}
    assert adopted == {w: ("adopted", "a1") for w in workers}
    assert [r for r in recs if r["kind"] == "launch"] == []  # no duplicate launched
    # closing the cluster ended them: nothing leaks
    wait_until(lambda: not any(_alive(p) for p in pids.values()), timeout=60, what="the adopted workers' exit")
