"""Every failure reaches the user as a clear error in bounded time (real processes and sockets).

Each test here hung, or threw healthy workers away, before the never-hang work; the waits are
bounded by ``result(timeout=...)`` / ``wait_until`` on observable conditions, never blind sleeps.
"""

from __future__ import annotations

import operator
import os
import signal
import threading
import time
from typing import Any

import pytest

import tidepool
from tidepool.errors import (
    ConnectionLostError,
    CycleError,
    DependencyError,
    InfeasibleTaskError,
    KeyCollisionError,
    ResultTooLargeError,
    SerializationError,
)
from tidepool.graph.refs import Ref
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def hold_the_gil(n: int) -> int:
    return sum(range(n))  # one C call: the worker's event loop cannot run, no heartbeats go out


def inc(x: int) -> int:
    return x + 1


def slow_inc(x: int, delay: float) -> int:
    time.sleep(delay)
    return x + 1


def make_lock() -> Any:
    return threading.Lock()  # cannot be pickled


def use(x: Any) -> str:
    return f"got {type(x).__name__}"


def make_poisoned() -> Any:
    def explode() -> None:
        raise RuntimeError("refusing to be unpickled")

    class Poisoned:
        def __reduce__(self) -> Any:
            return (explode, ())

    return Poisoned()


def big_bytes(n: int) -> bytes:
    return b"x" * n


def crash_worker() -> None:
    os._exit(13)


def test_a_task_holding_the_gil_longer_than_the_old_heartbeat_timeout_keeps_its_worker() -> None:
    # heartbeat every 0.1 s: the old time-to-live was max(10 x 0.1 s, 5 s) = 5 s of silence
    with tidepool.LocalCluster(n_workers=1, heartbeat_interval=0.1) as cluster, tidepool.Client(cluster) as client:
        n = 5 * 10**8
        fut = client.submit(hold_the_gil, n)
        assert fut.result(timeout=120) == n * (n - 1) // 2
        info = client.scheduler_info()
        assert info["counters"]["workers_lost"] == 0 and len(info["workers"]) == 1


def test_losing_the_scheduler_fails_every_future_and_call_at_once() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        done = client.submit(inc, 1)
        wait_until(done.done, what="first task done")  # done, but its value was never fetched
        pending = client.submit(slow_inc, 1, 60)
        cluster._loop.run(cluster.scheduler.close())  # the scheduler goes away
        with pytest.raises(ConnectionLostError, match="lost the scheduler"):
            pending.result(timeout=30)
        _every_call_fails(client, done)


def test_closing_the_cluster_before_its_client_fails_every_future_and_call() -> None:
    cluster = tidepool.LocalCluster(n_workers=1)
    try:
        client = tidepool.Client(cluster)
        assert client.submit(inc, 1).result(timeout=30) == 2
        pending = client.submit(slow_inc, 1, 60)
    finally:
        cluster.close()  # stops the loop thread the client runs on, too
    _every_call_fails(client, pending)
    client.close()


def _every_call_fails(client: tidepool.Client, future: Any) -> None:
    """``future``'s result, a new submit and a scheduler query all raise ConnectionLostError."""
    with pytest.raises(ConnectionLostError):
        future.result(timeout=30)
    with pytest.raises(ConnectionLostError):
        client.submit(inc, 2)
    with pytest.raises(ConnectionLostError):
        client.scheduler_info()


def test_a_client_of_a_local_cluster_whose_loop_stops_fails_its_futures() -> None:
    """The client runs on its LocalCluster's loop thread: when that loop stops under it (without
    the scheduler closing its connection first), its futures fail instead of waiting for ever."""
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        assert client.submit(inc, 1).result(timeout=30) == 2
        pending = client.submit(slow_inc, 1, 60)
        cluster._loop.stop()
        with pytest.raises(ConnectionLostError, match="stopped"):
            pending.result(timeout=10)
        with pytest.raises(ConnectionLostError):
            client.submit(inc, 2)


def test_an_unpicklable_result_errs_once_naming_the_task_and_is_not_recomputed() -> None:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        lock = client.submit(make_lock, key="the-lock")
        after = client.submit(use, lock, key="user")
        # the dependent runs where the lock is, or fails because it cannot be moved; either way
        # asking for the lock itself is a clear, final error
        with pytest.raises(SerializationError, match="the-lock") as info:
            lock.result(timeout=30)
        assert "cannot be pickled" in str(info.value) and "lock" in str(info.value)
        try:
            after.result(timeout=30)
        except (SerializationError, DependencyError):
            pass
        with pytest.raises(SerializationError):
            lock.result(timeout=30)  # asked again: the same error, not a retry loop
        # found by a bug hunt: the future still said "finished", exception() None
        wait_until(lambda: lock.status == "error", timeout=30, what="the future turning to 'error'")
        assert isinstance(lock.exception(), SerializationError)
        assert client.scheduler_info()["counters"]["recomputed"] == 0


def test_a_value_that_cannot_be_unpickled_fails_its_reader_instead_of_looping() -> None:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        bad = client.submit(make_poisoned, key="poisoned")
        with pytest.raises(SerializationError, match="cannot be unpickled") as info:
            bad.result(timeout=30)
        assert "refusing to be unpickled" in str(info.value) and "poisoned" in str(info.value)
        # a task on the other worker that needs it fails too, with the reason, and it is not
        # recomputed over and over (old code: ~190 recomputations per second)
        readers = [client.submit(use, bad, key=f"reader-{i}") for i in range(4)]
        outcomes = []
        for r in readers:
            try:
                outcomes.append(r.result(timeout=30))
            except SerializationError as exc:
                assert "refusing to be unpickled" in str(exc)
                outcomes.append("failed")
        assert all(o in ("got Poisoned", "failed") for o in outcomes)
        assert client.scheduler_info()["counters"]["recomputed"] == 0


def test_a_result_over_the_frame_limit_errs_with_its_size_and_the_limit() -> None:
    limit = 8 * 1024 * 1024
    env = {"TIDEPOOL_MAX_FRAME_BYTES": str(limit)}
    with tidepool.LocalCluster(n_workers=1, env=env) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(big_bytes, 3 * limit, key="huge")
        with pytest.raises(ResultTooLargeError, match="huge") as info:
            fut.result(timeout=60)
        text = str(info.value)
        assert f"{limit:,}" in text and "frame limit" in text
        assert client.submit(big_bytes, 10).result(timeout=30) == b"x" * 10  # the worker is fine
        assert client.scheduler_info()["counters"]["recomputed"] == 0


def test_tasks_queued_on_a_crashing_worker_are_not_blamed() -> None:
    # allowed_failures=0: one death is enough to fail every suspect, so an innocent bystander that
    # was merely queued on the dying worker would fail at once under the old rule
    with tidepool.LocalCluster(n_workers=2, allowed_failures=0) as cluster, tidepool.Client(cluster) as client:
        assert client.gather(client.map(inc, range(200)), timeout=60) == list(range(1, 201))  # learn: inc is fast
        crasher = client.submit(crash_worker, key="crasher")
        innocents = client.map(inc, range(300))  # queued deeply behind it on both workers
        with pytest.raises(tidepool.KilledWorkerError, match="crasher"):
            crasher.result(timeout=60)
        if not cluster.workers:
            cluster.add_workers(1)
        assert client.gather(innocents, timeout=60) == list(range(1, 301))


def test_without_autoscaling_a_task_no_worker_can_run_errs_after_the_no_worker_timeout() -> None:
    with tidepool.LocalCluster(n_workers=1, no_worker_timeout=1.0) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(inc, 1, resources={"gpu": 1}, key="needs-gpu")
        with pytest.raises(InfeasibleTaskError, match="needs-gpu") as info:
            fut.result(timeout=30)
        assert "gpu" in str(info.value) and "no_worker_timeout" in str(info.value)
        assert client.submit(inc, 1).result(timeout=30) == 2


def test_cycles_are_refused_at_submit() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(CycleError, match="'k'"):
            client.submit(inc, Ref("k"), key="k")

        @tidepool.task
        def add(a: int, b: int) -> int:
            return a + b

        a = add(1, 2)
        b = add(a, 3)
        a.args = (b, 1)  # hand-built cycle a -> b -> a
        with pytest.raises(CycleError, match="cycle"):
            client.compute(b)
        assert client.submit(inc, 1).result(timeout=30) == 2  # the client still works


def test_a_key_reused_for_a_different_task_is_a_collision() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client, \
            tidepool.Client(cluster) as other:  # fmt: skip
        first = client.submit(inc, 1, key="shared")
        assert first.result(timeout=30) == 2
        same = client.submit(inc, 1, key="shared")  # the same task: shares the result
        assert same.result(timeout=30) == 2
        with pytest.raises(KeyCollisionError, match="shared"):
            client.submit(inc, 41, key="shared")
        theirs = other.submit(inc, 41, key="shared")  # another client: refused too
        with pytest.raises(KeyCollisionError, match="shared"):
            theirs.result(timeout=30)
        assert first.result() == 2
        assert other.submit(inc, 1, key="shared").result(timeout=30) == 2


def test_result_timeout_holds_when_the_holding_worker_stops_answering() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        assert client.submit(inc, 1).result(timeout=30) == 2  # the client now has a connection to it
        # 10 kB: too large to ride inline on the report (comm/inline.py), so result() must read it
        fut = client.submit(operator.mul, b"x", 10_000)
        wait_until(fut.done, what="task done")
        (wid,) = cluster.workers
        pid = cluster.provider.procs[wid].proc.pid
        os.kill(pid, signal.SIGSTOP)  # alive, socket open, silent
        try:
            with pytest.raises(TimeoutError):
                fut.result(timeout=2)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert fut.result(timeout=30) == b"x" * 10_000


def test_a_task_that_kills_its_worker_errs_on_a_fixed_pool_too() -> None:
    # nobody adds workers by hand here: the pool replaces crashed workers itself, so the task runs
    # out of allowed failures instead of leaving an empty pool and a silent wait
    with tidepool.LocalCluster(n_workers=1, allowed_failures=2) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(crash_worker, key="segfaulter")
        with pytest.raises(tidepool.KilledWorkerError, match="segfaulter") as info:
            fut.result(timeout=90)
        assert "3 workers" in str(info.value)
        assert client.submit(inc, 1).result(timeout=30) == 2  # the pool is back to one worker
        wait_until(lambda: len(cluster.workers) == 1, what="one worker")


def test_a_released_value_that_was_never_fetched_fails_instead_of_waiting_forever() -> None:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(inc, 1)
        wait_until(fut.done, what="task done")
        fut.release()
        wait_until(lambda: fut.key not in cluster.scheduler.state.tasks, what="the key forgotten")
        with pytest.raises(tidepool.TaskCancelledError, match="released"):
            fut.result()  # no timeout: it must still answer


def test_a_scheduler_paused_longer_than_the_heartbeat_ttl_keeps_its_workers(tmp_path: Any) -> None:
    import subprocess
    import sys

    # The scheduler tells workers to beat every 1 s (its heartbeat_interval replaces theirs at
    # registration) and may discount a stall up to one 0.5 s tick short, so a TTL of 2 s left under
    # 0.5 s for a loaded machine's jitter; 4 s leaves 2.5 s.  The pause is twice the TTL: without
    # the discount every worker would be lost.
    ttl = 4.0
    token = tmp_path / "token"
    sched = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "scheduler", "--port", "0", "--token-file",
                              str(token), "--heartbeat-timeout", str(ttl)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    workers: list[subprocess.Popen[bytes]] = []
    try:
        address = (sched.stdout.readline() if sched.stdout else "").split(" at ", 1)[1].strip()
        env = {**os.environ, "TIDEPOOL_TOKEN_FILE": str(token)}
        # the workers import this module (slow_inc's) before they register: on a loaded machine that
        # import, done when the first task arrives, held a worker's GIL past the TTL by itself
        workers = [subprocess.Popen([sys.executable, "-m", "tidepool.worker", address, "--slots", "1",
                                     "--preload", slow_inc.__module__], env=env) for _ in range(2)]  # fmt: skip
        with tidepool.Client(address, token=token.read_text()) as client:
            client.wait_for_workers(2, timeout=30)
            futs = client.map(slow_inc, range(6), [0.5] * 6)
            os.kill(sched.pid, signal.SIGSTOP)  # the scheduler hears nothing for twice its TTL
            try:
                time.sleep(2 * ttl)  # the pause itself is the point of the test
            finally:
                os.kill(sched.pid, signal.SIGCONT)
            assert client.gather(futs, timeout=60) == list(range(1, 7))
            info = client.scheduler_info()
            assert info["counters"]["workers_lost"] == 0 and len(info["workers"]) == 2
    finally:
        for p in (*workers, sched):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
