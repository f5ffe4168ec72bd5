"""Nothing left behind and nothing printed on the way out: worker temp directories, signal noise.

Real worker processes.  Waits are bounded waits on observable conditions (``wait_until``,
``Popen.wait(timeout)``), never sleeps.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

import tidepool
from tidepool.loop import LoopThread
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def temp_dirs(root: str | Path, wid: str) -> list[str]:
    """The directories a worker made with ``tempfile.mkdtemp(prefix=f"tidepool-{wid}-")``."""
    prefix = f"tidepool-{wid}-"
    return sorted(n for n in os.listdir(root) if n.startswith(prefix) and len(n) == len(prefix) + 8)


def test_killed_worker_temp_dir_is_removed_once_the_provider_sees_it_exit(tmp_path: Path) -> None:
    with tidepool.LocalCluster(n_workers=2, env={"TMPDIR": str(tmp_path)}) as cluster:
        victim, survivor = cluster.workers
        assert temp_dirs(tmp_path, victim) and temp_dirs(tmp_path, survivor)  # made at worker start
        # look-alikes of other workers' directories: never touched
        decoys = [tmp_path / f"tidepool-{victim}0-abcdefgh", tmp_path / f"tidepool-{victim}-abcdefgh-x"]
        for d in decoys:
            d.mkdir()
        cluster.kill_worker(victim)  # SIGKILL: the worker cannot clean up after itself
        provider = cluster.provider
        wait_until(lambda: not provider.list().get(victim, {"alive": False})["alive"],
                   what="the provider to see the killed worker exit")  # fmt: skip
        assert temp_dirs(tmp_path, victim) == []
        assert temp_dirs(tmp_path, survivor)  # the live worker's directory stays
        assert all(d.is_dir() for d in decoys)
        left = {n for n in os.listdir(tmp_path) if n.startswith(f"tidepool-{victim}")} - {d.name for d in decoys}
        assert left == set()  # nothing else of the victim either (its spill directory is inside its own)


def test_close_removes_the_temp_dirs_of_every_worker_it_started() -> None:
    root = tempfile.gettempdir()
    cluster = tidepool.LocalCluster(n_workers=2)
    try:
        ids = cluster.workers
        killed = ids[0]
        proc = cluster.provider.procs[killed].proc
        cluster.kill_worker(killed)
        assert proc.wait(10) == -9  # dead, and nobody has polled the provider since
        assert temp_dirs(root, killed)  # what a SIGKILL leaves behind
    finally:
        cluster.close()
    assert {w: temp_dirs(root, w) for w in ids} == {w: [] for w in ids}


MB = 2**20
#: preloaded by the workers below: spill files of at most 20 MiB (a real limit, not a mock)
FSIZE_PRELOAD = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, 20 * 2**20))\n"


def big(i: int) -> bytes:
    return bytes([i % 251]) * (60 * MB)


def grow() -> int:
    held = []
    for _ in range(40):
        held.append(bytearray(50 * MB))
    return len(held)


def test_nothing_of_a_worker_stays_after_spill_failures_and_memory_restarts(tmp_path: Path) -> None:
    (tmp_path / "fsize20.py").write_text(FSIZE_PRELOAD)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(tmp_path)}
    cluster = tidepool.LocalCluster(n_workers=1, memory_limit="600MB", env=env, preload=["fsize20"],
                                    allowed_failures=0)  # fmt: skip
    try:
        (wid,) = cluster.workers
        with tidepool.Client(cluster) as client:
            held = client.map(big, range(7))  # 420 MB past the 360 MB target: a spill write fails
            tidepool.wait(held)
            state = cluster.scheduler.state
            wait_until(lambda: bool(state.workers[wid].metrics.get("spill_disabled")), 30,
                       what="the worker to report that spilling is off")  # fmt: skip
            with pytest.raises(tidepool.KilledWorkerError, match="memory"):
                client.submit(grow).result(timeout=120)  # a memory restart, with values held
            wait_until(lambda: cluster.workers == [wid], 60, what="the worker to come back")
            assert len(temp_dirs(tmp_path, wid)) == 1  # the restarted process's own, not the old one's
    finally:
        cluster.close()
    assert [n for n in os.listdir(tmp_path) if n.startswith("tidepool-")] == []


def test_worker_ids_from_two_clusters_never_collide() -> None:
    """Temp directories are matched by worker id, so ids must be unique on the machine."""
    with tidepool.LocalCluster(n_workers=1) as a, tidepool.LocalCluster(n_workers=1) as b:
        assert set(a.workers).isdisjoint(b.workers)


# ---- the private event loop's shutdown --------------------------------------------------------------
def test_loop_thread_stop_finishes_every_task_even_one_that_swallows_a_cancel() -> None:
    """Python 3.11's wait_for can swallow a cancellation; stop() cancels again, then closes."""
    lt = LoopThread("test-stop")
    started, finished = threading.Event(), threading.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed, as asyncio.wait_for does when its awaitable finished meanwhile
        try:
            await asyncio.Event().wait()
        finally:
            finished.set()

    fut = lt.submit(stubborn())
    assert started.wait(10)
    lt.stop()
    assert finished.is_set() and fut.cancelled()  # not destroyed pending with the loop
    assert lt.loop.is_closed() and not lt.thread.is_alive()


# ---- signal wakeup fd noise ----------------------------------------------------------------------
LATE_SIGTERM = textwrap.dedent("""
    import os, signal
    from asyncio import selector_events
    from tidepool.cli import _run_until_signal

    close_self_pipe = selector_events.BaseSelectorEventLoop._close_self_pipe

    def closing(self):
        close_self_pipe(self)
        os.kill(os.getpid(), signal.SIGTERM)  # the provider's SIGTERM, just as the loop closes

    selector_events.BaseSelectorEventLoop._close_self_pipe = closing

    async def main():
        return None

    _run_until_signal(main())
    print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
""")


@pytest.mark.parametrize("notice", [False, True])
def test_a_sigterm_while_the_cli_loop_closes_is_quiet(notice: bool) -> None:
    """``notice``: as ``tidepool worker`` runs, with its SIGUSR1 (preemption notice) handler on the
    loop, which kept the wakeup fd set while the loop closed it (bug hunts saw the message again)."""
    script = LATE_SIGTERM
    if notice:
        script = script.replace("async def main():\n", "async def main():\n"
                                "    from tidepool.worker.signals import on_preemption_notice\n"
                                "    on_preemption_notice()\n")  # fmt: skip
        assert "on_preemption_notice()" in script
        script += "os.kill(os.getpid(), signal.SIGUSR1)\nprint('survived a late notice', flush=True)\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "signal wakeup fd" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0 and "handler restored: True" in r.stdout, (r.stdout, r.stderr)
    # a review: a notice after the loop closed killed the exiting worker (SIGUSR1's default action)
    assert not notice or "survived a late notice" in r.stdout, (r.returncode, r.stdout)


AUTOSCALED_RUN = textwrap.dedent("""
    import time
    import tidepool
    from tidepool import NodeType

    def work(x):
        time.sleep(0.05)
        return x

    cpu = NodeType("cpu", {"cpu": 1}, max_nodes=2, startup_estimate=0.5)
    gpu = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=0.5)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[cpu, gpu])
        assert client.gather(client.map(work, range(8))) == list(range(8))
        assert client.gather(client.map(work, range(2), resources={"gpu": 1})) == [0, 1]
    print("ok")
""")


def test_autoscaled_cluster_shuts_down_without_signal_wakeup_noise() -> None:
    r = subprocess.run([sys.executable, "-c", AUTOSCALED_RUN], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout, r.stderr)
    assert "signal wakeup fd" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Task was destroyed" not in r.stderr, r.stderr
