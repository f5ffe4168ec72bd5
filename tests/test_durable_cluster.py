"""``LocalCluster(state_dir=...)`` as a user meets it: the keywords ``LocalCluster`` takes, the
workers' memory, and a program killed without ``close()`` (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration
SRC = str(Path(tidepool.__file__).resolve().parents[1])


def test_a_durable_cluster_takes_local_clusters_memory_and_failure_keywords(tmp_path: Path) -> None:
    """Found by a bug hunt: memory_limit, allowed_failures and dashboard were refused with a bare
    TypeError, a typo got no "did you mean", and the workers' default limit was the whole machine's
    memory instead of its share per core."""
    with pytest.raises(ConfigError, match=r"did you mean 'n_workers'"):
        tidepool.LocalCluster(n_worker=1, state_dir=str(tmp_path / "typo"))
    with pytest.raises(ConfigError, match="allowed_failures must be a whole number"):
        tidepool.LocalCluster(0, state_dir=str(tmp_path / "bad"), allowed_failures=-1)
    with tidepool.LocalCluster(1, state_dir=str(tmp_path / "s"), memory_limit="700MB", allowed_failures=0,
                               dashboard=True) as cluster, tidepool.Client(cluster) as client:  # fmt: skip
        (worker,) = client.scheduler_info()["workers"]
        assert worker["memory_limit"] == 700_000_000
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
    with tidepool.LocalCluster(1, state_dir=str(tmp_path / "d")) as cluster, tidepool.Client(cluster) as client:
        (worker,) = client.scheduler_info()["workers"]
        share = psutil.virtual_memory().total // (os.cpu_count() or 1)
        assert abs(worker["memory_limit"] - share) < share * 0.05


def test_a_killed_program_leaves_no_durable_scheduler_or_worker_behind(tmp_path: Path) -> None:
    """Found by a bug hunt: after a SIGKILL of the program, its durable scheduler and workers ran on
    for ever and the next LocalCluster on the same state_dir failed with "Address already in use"."""
    state = tmp_path / "state"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        import tidepool
        cluster = tidepool.LocalCluster(1, state_dir={str(state)!r}, port=0)
        client = tidepool.Client(cluster)
        print(client.submit(sum, [1, 2]).result(timeout=60), flush=True)
        time.sleep(600)
    """)
    prog = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TIDEPOOL_LOOP": "asyncio"})  # fmt: skip
    children: list[psutil.Process] = []
    try:
        assert prog.stdout is not None and prog.stdout.readline().strip() == "3"
        children = psutil.Process(prog.pid).children(recursive=True)
        assert children
        prog.send_signal(signal.SIGKILL)
        prog.wait(10)
        wait_until(lambda: not [c for c in children if _alive(c)], timeout=60,
                   what="the durable scheduler and its workers to stop")  # fmt: skip
    finally:
        prog.kill()
        for c in children:  # (only if the test failed: nothing of it is left for the next one)
            if _alive(c):
                c.kill()
    with tidepool.LocalCluster(1, state_dir=str(state)) as cluster, tidepool.Client(cluster) as client:
        assert client.submit(sum, [3, 4]).result(timeout=60) == 7  # the same state_dir starts again


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def die() -> None:
    os._exit(3)


def test_a_task_that_kills_its_worker_fails_as_killed_and_the_workers_are_replaced(tmp_path: Path) -> None:
    """Found by a bug hunt: on a durable cluster both workers died and were not replaced; the task
    failed after 60 s with "no worker has offered that" and so did every later task."""
    cluster = tidepool.LocalCluster(2, state_dir=str(tmp_path / "s"), allowed_failures=1)
    with cluster, tidepool.Client(cluster) as client:
        with pytest.raises(tidepool.KilledWorkerError):
            client.submit(die).result(timeout=60)
        assert client.submit(sum, [1, 2]).result(timeout=60) == 3  # replacements took the work
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60,
                   what="both crashed workers to be replaced")  # fmt: skip


def test_a_crash_seen_while_adding_workers_is_replaced_not_reported_as_a_failed_start(tmp_path: Path) -> None:
    """Review: add_workers() polled the provider's errors, which forgets exited processes: a worker
    that crashed meanwhile was never replaced (and a crash with an error code was reported as the
    new workers failing to start)."""
    with tidepool.LocalCluster(1, state_dir=str(tmp_path / "s"), fork_server=False) as cluster, \
            tidepool.Client(cluster) as client:  # fmt: skip
        ((wid, proc),) = list(cluster.provider.procs.items())
        os.kill(proc.proc.pid, signal.SIGKILL)
        cluster.add_workers(1)  # waits, polling errors, while the crash is there to be seen
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60,
                   what="the crashed worker's replacement and the added one")  # fmt: skip
        assert wid in cluster._replaced


def test_a_durable_clusters_cluster_file_sets_the_schedulers_port(tmp_path: Path) -> None:
    # the review of "flags win over the cluster file": the durable cluster always passed --host and
    # --port, so a cluster file's [scheduler] host/port (0.0.0.0 for remote workers) was ignored
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = tidepool.LocalCluster(0, state_dir=str(tmp_path / "sd"), timeout=120)
    try:
        assert not cluster.address.endswith(f":{port}")
        cluster.use_cluster_file(f"[scheduler]\nport = {port}\n\n[[node_types]]\nname = 'cpu'\nmax_nodes = 1\n")
        assert cluster.address == f"tcp://127.0.0.1:{port}"
    finally:
        cluster.close()


def test_a_second_durable_cluster_on_a_state_dir_in_use_raises_store_in_use(tmp_path: Path) -> None:
    # found by a docs review: the documented StoreInUseError came as a ConfigError wrapping the
    # second scheduler's exit, so `except tidepool.StoreInUseError` missed it
    state = str(tmp_path / "s")
    with tidepool.LocalCluster(0, state_dir=state) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(tidepool.StoreInUseError, match="in use by another scheduler"):
            tidepool.LocalCluster(0, state_dir=state)
        assert client.scheduler_info()["workers"] == []  # the first one is untouched
    with tidepool.LocalCluster(0, state_dir=state):  # free again once the first one closed
        pass
