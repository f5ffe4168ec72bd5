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
from tidepool.testing import journal_records, wait_until


def slow(i: int, flag: str) -> int:
    while not os.path.exists(flag):
        time.sleep(0.05)
    return i + 100



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
            wait_until(lambda: any(r["kind"] == "adopt" for r in journal_records(after)), timeout=120,
                       what="the journal's adopt records")  # fmt: skip
            Path(flag).touch()
            assert client.gather(futures, timeout=300) == [i + 100 for i in range(6)]
            assert sorted(cluster.workers()) == workers
            assert _pids(state / "local-workers") == pids and all(_alive(p) for p in pids.values())
    recs = journal_records(after)
    adopted = {r["worker"]: (r["outcome"], r["request"]) for r in recs if r["kind"] == "adopt"}
    assert adopted == {w: ("adopted", "a1") for w in workers}
    assert [r for r in recs if r["kind"] == "launch"] == []  # no duplicate launched
    # closing the cluster ended them: nothing leaks
    wait_until(lambda: not any(_alive(p) for p in pids.values()), timeout=60, what="the adopted workers' exit")


def _stored_cost(state: Path) -> dict[str, object] | None:
    db = sqlite3.connect(f"file:{state / 'state.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        row = db.execute("SELECT v FROM meta WHERE k = 'cost'").fetchone()
        return json.loads(row[0]) if row else None
    finally:
        db.close()


def _spent(state: Path) -> float:
    cost = _stored_cost(state)
    return float(cost["spent"]) if cost is not None else 0.0  # type: ignore[arg-type]


@pytest.mark.timeout(600)
def test_the_spent_budget_survives_a_restart_and_the_adopted_worker_is_billed_on(tmp_path: Path) -> None:
    """A pool at 1 cost unit per second (cost 3600 per node-hour): the meter the restarted
    scheduler stores goes on from what the dead one stored, plus the time it was down."""
    state = tmp_path / "state"
    after = tmp_path / "after.jsonl"
    with LocalCluster(0, state_dir=str(state), reconnect_window=180.0, recovery_wait=120.0, timeout=120) as cluster:
        cluster.use_cluster_file('[provider]\nkind = "local"\n\n[autoscaler]\nbudget = 1000000\n\n'
                        '[[node_types]]\nname = "paid"\nresources = { cpu = 1 }\nmin_nodes = 1\nmax_nodes = 1\n'
                        "cost = 3600\nstartup_estimate = 0.5\n")  # fmt: skip
        wait_until(lambda: _spent(state) >= 3.0, timeout=180, what="three seconds of the paid node billed")
        cluster.kill_scheduler()
        before = _stored_cost(state)
        assert before is not None
        cluster.restart_scheduler(journal=str(after))
        wait_until(lambda: any(r["kind"] == "adopt" for r in journal_records(after)), timeout=120, what="the adoption")
        wait_until(lambda: (_stored_cost(state) or {}).get("wall") != before["wall"], timeout=60,
                   what="the restarted scheduler's first stored meter")  # fmt: skip
        now = _stored_cost(state)
        assert now is not None
        down = float(now["wall"]) - float(before["wall"])  # type: ignore[arg-type]
        # billed on from the stored step at 1/s, through the downtime (a little slack for rounding)
        assert float(now["spent"]) >= float(before["spent"]) + 0.9 * down  # type: ignore[arg-type]
        assert [r["outcome"] for r in journal_records(after) if r["kind"] == "adopt"] == ["adopted"]
