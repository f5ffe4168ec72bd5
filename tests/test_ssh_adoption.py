"""SSH workers of a durable scheduler: they outlive its death and its restart adopts them.

The pure parts (the ``ps`` parser, the durable launch script, the watch script) run locally; the
rest against the real sshd of ``test_ssh_provider.py`` (its session fixtures, imported here):
a tagged provider's worker survives the loss of the provider's connection and a second provider
with the same tag lists and terminates it; an orphaned worker exits past its reconnect window;
and ``tidepool scheduler --state-dir --cluster`` (SSH provider) killed -9 and restarted adopts the
worker it autoscaled (same pid), launches nothing, and stops it when it is closed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

import test_ssh_provider
import tidepool
from test_ssh_provider import Sshd, pid_gone, wait_until, whereami
from tidepool.providers.slurm import cluster_tag
from tidepool.providers.ssh import EXIT_NO_WORKDIR, SSHProvider
from tidepool.providers.ssh_adopt import (
    MARKER_VAR,
    SCAN_COMMAND,
    TaggedProcess,
    durable_script,
    parse_tagged_processes,
    tag_marker,
    watch_script,
)
from tidepool.scaling.node_types import NodeType
from tidepool.testing import journal_records

keys = test_ssh_provider.keys  # the session fixtures: sshd on 127.0.0.1 with throw-away keys
sshd = test_ssh_provider.sshd
TAG = cluster_tag("ssh-adoption-test")


# ---- pure: the parser and the scripts, run locally ------------------------------------------------
def test_parse_tagged_processes_keeps_only_the_workers_of_its_tag() -> None:
    mine = tag_marker(TAG, "big cpu", "a1", "big cpu-a1-1")
    assert mine == f"{TAG}:big%20cpu:a1:big%20cpu-a1-1"  # one ps token: no spaces, four fields
    text = "\n".join([
        "    PID COMMAND",
        f"    11 /usr/bin/python3 -m tidepool.worker tcp://h:1 --id 'big cpu-a1-1' --env {MARKER_VAR}={mine}",
        f"    12 /usr/bin/python3 -m tidepool.worker tcp://h:1 --id w2 --env {MARKER_VAR}={TAG}:sh:a2:sh-a2-1",
        f"    13 python -m tidepool.worker tcp://h:1 --env {MARKER_VAR}={cluster_tag('other')}:sh:a1:sh-a1-9",
        f"    14 sh -c while read ... -m tidepool.worker --env \"{MARKER_VAR}=${MARKER_VAR}\"",
        f"    15 sleep 100 {MARKER_VAR}={TAG}:sh:a3:sh-a3-1",  # carries the tag, not a worker
        f"    16 python -m tidepool.worker --env {MARKER_VAR}={TAG}:sh:a4",  # malformed: 3 fields
        f"    17 python -m tidepool.worker --env {MARKER_VAR}={TAG}::a5:w",  # empty node type
        f"    18 python -m tidepool.worker --env {MARKER_VAR}={TAG}:sh:a2:sh-a2-1",  # same worker again
        f"    19 python -m tidepool.worker --env {MARKER_VAR}={TAG}x:sh:a6:sh-a6-1",  # a longer tag
        f"   pid python -m tidepool.worker --env {MARKER_VAR}={TAG}:sh:a7:sh-a7-1",
        "    20 python -m tidepool.worker tcp://h:1 --id untagged",
        "",
    ])  # fmt: skip
    assert parse_tagged_processes(text, TAG) == [
        TaggedProcess(11, "big cpu", "a1", "big cpu-a1-1"),
        TaggedProcess(12, "sh", "a2", "sh-a2-1"),
    ]
    assert parse_tagged_processes(text, cluster_tag("nobody")) == []
    assert parse_tagged_processes("", TAG) == []


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_durable_script_worker_outlives_its_channel_and_reports_its_status(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    code = ("import os, sys, time\nprint('up', os.environ['TIDEPOOL_TOKEN'], flush=True)\n"
            f"while not os.path.exists({str(flag)!r}): time.sleep(0.05)\n"
            "for i in range(200): print('after the channel closed', i, flush=True)\nsys.exit(3)")  # fmt: skip
    marker = tag_marker(TAG, "nt", "r1", "w-1")
    script = durable_script([sys.executable, "-c", code, "tidepool.worker", "w-1"], str(tmp_path), EXIT_NO_WORKDIR)
    assert "s3cret" not in script and marker not in script  # both come on stdin
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(f"TIDEPOOL_TOKEN=s3cret\n{MARKER_VAR}={marker}\n\n")
        proc.stdin.flush()
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert first.startswith("tidepool-pid ") and second == "up s3cret\n"
        pid = int(first.split()[1])
        assert _cmdline(pid)[-2:] == ["--env", f"{MARKER_VAR}={marker}"]  # the tag is on its command line
        ps = subprocess.run(["sh", "-c", SCAN_COMMAND], capture_output=True, text=True).stdout  # what a provider runs
        assert TaggedProcess(pid, "nt", "r1", "w-1") in parse_tagged_processes(ps, TAG)
        for f in (proc.stdin, proc.stdout, proc.stderr):  # the channel is gone (a killed scheduler)
            f.close()
        assert not pid_gone(pid)  # no watchdog
        watcher = subprocess.Popen(["sh", "-c", watch_script(pid, "w-1", 0.1)])
        assert watcher.poll() is None
        flag.touch()  # it prints into the dead channel, then exits 3: the relay kept it alive
        assert proc.wait(60) == 3
        assert watcher.wait(60) == 0  # the watch channel ends with the process
    finally:
        proc.kill()
        proc.wait()
    missing = durable_script(["true"], str(tmp_path / "nope"), EXIT_NO_WORKDIR)
    r = subprocess.run(["sh", "-c", missing], input="\n", text=True, capture_output=True, timeout=30)
    assert r.returncode == EXIT_NO_WORKDIR and "cannot cd" in r.stderr


# ---- against the real sshd --------------------------------------------------------------------------
async def _crash(provider: SSHProvider) -> None:
    """What the hosts see when the provider's process is SIGKILLed: its connections drop."""
    for h in provider._hosts:
        for c in h.conns:
            c.conn.abort()


def _leftovers(wid: str) -> list[int]:
    """Live processes (the worker, or the shell and relay around it) whose command line names ``wid``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(wid in a for a in p.info["cmdline"] or []):
            out.append(p.pid)
    return out


@pytest.mark.integration
def test_a_second_provider_with_the_same_tag_adopts_lists_and_terminates_the_workers(sshd: Sshd) -> None:
    nt = NodeType("dur", {"cpu": 1})
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        first = sshd.provider()
        first.bind(cluster.address, cluster.token)
        first.tag_with(TAG)
        try:
            [w1] = first.launch_now(nt, 1, "r1")
            [w2] = first.launch_now(nt, 1, "r2")
            cluster.wait_for_workers([w1, w2], timeout=60)
            pids = {w: first.list()[w]["pid"] for w in (w1, w2)}
            first._run(_crash(first))
            wait_until(lambda: not any(i["alive"] for i in first.list().values()), 60, "the channels to close")
            # the workers outlive the connection and still serve tasks
            got = client.submit(whereami, 1, 0.0, workers=[w1], pure=False).result(timeout=120)
            assert got[2:] == (pids[w1], w1)

            other = sshd.provider()
            other.tag_with(cluster_tag("another-cluster"))
            assert other.list() == {}  # another cluster's tag: nothing is taken
            other.close()
            assert not pid_gone(pids[w1]) and not pid_gone(pids[w2])

            second = sshd.provider()
            second.tag_with(TAG)
            listed = second.list()
            assert {w: (i["request_id"], i["node_type"], i["pid"], i["alive"], i["adopted"])
                    for w, i in listed.items()} == {w1: ("r1", "dur", pids[w1], True, True),
                                                    w2: ("r2", "dur", pids[w2], True, True)}  # fmt: skip
            second.terminate([w1])
            wait_until(lambda: pid_gone(pids[w1]), 30, f"{w1} to be stopped by the second provider")
            wait_until(lambda: not second.list()[w1]["alive"], 30, "its watch channel to see it end")
            assert second.poll_errors() == [] and not pid_gone(pids[w2])

            third = sshd.provider()  # closing a tagged provider stops what it re-finds, listed or not
            third.tag_with(TAG)
            third.close()
            wait_until(lambda: pid_gone(pids[w2]), 30, f"{w2} to be stopped by the third provider's close")
            wait_until(lambda: not second.list()[w2]["alive"], 30, "the second provider to see it end")
            second.close()
            wait_until(lambda: not _leftovers(w1) and not _leftovers(w2), 30, "no process left behind")
        finally:
            first.close()


@pytest.mark.integration
def test_a_tagged_worker_that_cannot_start_is_still_reported_with_its_exit_code(sshd: Sshd) -> None:
    provider = sshd.provider(python="/nonexistent/python3")
    provider.bind("tcp://127.0.0.1:9", "x" * 32)
    provider.tag_with(TAG)
    try:
        [wid] = provider.worker_ids(NodeType("bad", {"cpu": 1}), 1, "r1")
        provider.launch(NodeType("bad", {"cpu": 1}), 1, "r1")
        errors: list[Any] = []
        wait_until(lambda: errors.extend(provider.poll_errors()) or errors, 60, "the failure report")
        assert errors[0].request_id == "r1" and errors[0].worker_id == wid
        assert "exited with code 127" in errors[0].message and "python=" in errors[0].message
    finally:
        provider.close()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_an_orphaned_durable_ssh_worker_exits_past_its_reconnect_window(sshd: Sshd, tmp_path: Path) -> None:
    cluster = tidepool.LocalCluster(0, state_dir=str(tmp_path / "state"), reconnect_window=20.0, timeout=120)
    provider = sshd.provider()
    try:
        provider.bind(cluster.address, cluster.token)
        provider.tag_with(cluster_tag(cluster.token))
        [wid] = provider.launch_now(NodeType("orph", {"cpu": 1}), 1, "a1")
        wait_until(lambda: cluster.workers() == [wid], 120, "the SSH worker to register")
        pid = provider.list()[wid]["pid"]
        provider._run(_crash(provider))  # the scheduler process and its provider die, for good
        cluster.kill_scheduler()
        assert not pid_gone(pid)  # still there: retrying the scheduler within its window
        wait_until(lambda: not provider.list()[wid]["alive"], 60, "the channel to close")
        wait_until(lambda: pid_gone(pid), 180, "the worker to exit past its 20 s window")
        wait_until(lambda: not _leftovers(wid), 60, "its shell and relay to exit with it")
    finally:
        provider.close()
        cluster.close()



@pytest.mark.integration
@pytest.mark.timeout(900)  # process starts are slow on a loaded machine
def test_a_restarted_durable_scheduler_adopts_its_ssh_worker(sshd: Sshd, tmp_path: Path) -> None:
    """kill -9 ``tidepool scheduler --state-dir --cluster`` (SSH provider): the restarted one
    re-finds the worker by its tag, adopts it (no new launch) and stops it when it is closed."""
    state = tmp_path / "state"
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    cluster = tidepool.LocalCluster(0, state_dir=str(state), reconnect_window=300.0, recovery_wait=120.0,
                                    timeout=180)  # fmt: skip
    pid = 0
    try:
        cluster.use_cluster_file(
            f'[provider]\nkind = "ssh"\nhosts = ["{sshd.host}:{sshd.port}"]\nclient_keys = ["{sshd.client_key}"]\n'
            f'known_hosts = "{sshd.known_hosts}"\npython = "{sys.executable}"\nconnect_timeout = 10.0\n'
            f'term_timeout = 3.0\nenv = {{ PYTHONPATH = "{os.environ.get("PYTHONPATH", "")}" }}\n\n'
            '[[node_types]]\nname = "sh"\nresources = { cpu = 1 }\nmin_nodes = 1\nmax_nodes = 1\n'
            "startup_estimate = 60\n",
            journal=str(before),
        )  # fmt: skip
        wait_until(lambda: len(cluster.workers()) == 1, 300, "the SSH worker")
        [worker] = cluster.workers()
        wait_until(lambda: [r["request"] for r in journal_records(before, "launch")] == [worker.split("-")[1]], 60,
                   "the journal's launch record")  # fmt: skip
        with tidepool.Client(cluster.address, cluster.token, timeout=120) as client:
            _, _, pid, wid = client.submit(whereami, 1, 0.0, pure=False).result(timeout=120)
            assert wid == worker and f"{MARKER_VAR}={cluster_tag(cluster.token)}:" in " ".join(_cmdline(pid))
            cluster.kill_scheduler()
            assert not pid_gone(pid)
            cluster.restart_scheduler(str(after))
            wait_until(lambda: journal_records(after, "adopt"), 120, "the journal's adopt record")
            _, _, pid2, wid2 = client.submit(whereami, 2, 0.0, pure=False).result(timeout=300)
            assert (pid2, wid2) == (pid, worker)  # the same process serves the graph
        adopted = journal_records(after, "adopt")
        assert [(r["worker"], r["outcome"]) for r in adopted] == [(worker, "adopted")]
        assert journal_records(after, "launch") == []  # no duplicate launched
    finally:
        cluster.close()
    assert pid
    wait_until(lambda: pid_gone(pid), 120, "the adopted worker to be stopped at close")
    wait_until(lambda: not _leftovers(worker), 60, "no process of it left behind")
