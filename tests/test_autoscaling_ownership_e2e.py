"""Autoscaling next to workers it did not launch, on real processes: a LocalCluster's own first
worker, and a worker started by hand with ``tidepool worker``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import tidepool
from tidepool.scaling.policies import Adaptive, IdleRetire
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def nap(x: int) -> int:
    time.sleep(0.3)
    return x


def test_growing_from_a_non_empty_pool_never_kills_the_first_worker() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        (first,) = cluster.workers
        scaler = cluster.adapt(maximum=3)
        assert client.gather(client.map(nap, range(30)), timeout=120) == list(range(30))
        kinds = [r["kind"] for r in scaler.journal.records]
        assert "launch" in kinds and "cancel-launch" not in kinds, scaler.journal.records
        joined = {r["worker"] for r in scaler.journal.records if r["kind"] == "worker-join"}
        assert len(joined - {first}) >= 1  # it grew beyond the first worker
        left = [r for r in scaler.journal.records if r["kind"] in ("worker-leave", "worker-close")
                and r["worker"] == first and not r.get("graceful", True)]  # fmt: skip
        assert not left  # the first worker was never killed as a "launch that did not register"


def test_a_worker_started_by_hand_is_left_alone_and_the_journal_says_so() -> None:
    policy = Adaptive(idle=IdleRetire(idle_timeout=0.5))
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        scaler = cluster.adapt(maximum=2, policy=policy)
        env = {**os.environ, "TIDEPOOL_TOKEN": cluster.token}
        hand = subprocess.Popen([sys.executable, "-m", "tidepool.worker", cluster.address, "--id", "by-hand"],
                                env=env)  # fmt: skip
        try:
            wait_until(lambda: "by-hand" in cluster.workers, timeout=30, what="hand-started worker")
            assert client.gather(client.map(nap, range(6)), timeout=60) == list(range(6))
            journal = scaler.journal
            wait_until(lambda: any(r["kind"] == "not-managed" and r["worker"] == "by-hand" for r in journal.records),
                       timeout=30, what="the journal noting the hand-started worker")  # fmt: skip
            assert "by-hand" in cluster.workers and hand.poll() is None  # still there, still running
            assert not [r for r in journal.records if r["kind"] == "retire" and r.get("worker") == "by-hand"]
        finally:
            hand.terminate()
            hand.wait(timeout=30)


def test_connecting_to_a_scheduler_that_never_answers_fails_within_the_timeout_naming_it() -> None:
    # a socket that completes TCP but never speaks (the kernel accepts into the backlog): the
    # client must give up after its timeout, name the address, and leave no asyncio noise
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    addr = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    code = (
        "import tidepool\n"
        "try:\n"
        f"    tidepool.Client({addr!r}, token='x' * 32, timeout=2)\n"
        "except tidepool.ConnectionLostError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        silent.close()
    assert "ERROR" in proc.stdout and addr.removeprefix("tcp://") in proc.stdout, proc.stdout + proc.stderr
    assert "Event loop is closed" not in proc.stderr and "Task was destroyed" not in proc.stderr, proc.stderr
