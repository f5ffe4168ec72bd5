"""The client calls Dask users reach for, checked against what Dask documents for each one:
submit/map options (pure, priority, workers, allow_other_workers), scatter (with broadcast),
run, upload_file, restart, who_has/has_what, wait_for_workers, persist and fire_and_forget."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import tidepool
from tidepool.errors import ConfigError, InfeasibleTaskError, TaskCancelledError
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver, wait_until


def inc(x: int) -> int:
    return x + 1


def where(_: object = None) -> str:
    return tidepool.get_worker().id


def pid() -> int:
    return os.getpid()


def fails() -> None:
    raise ValueError("no such device")


def touch(path: str) -> str:
    import time

    time.sleep(0.3)
    Path(path).write_text("done")
    return path


def total(xs: list[int]) -> int:
    return sum(xs)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=2, no_worker_timeout=2.0) as c:
        yield c


@pytest.fixture()
def client(cluster: tidepool.LocalCluster) -> Iterator[tidepool.Client]:
    with tidepool.Client(cluster) as c:
        yield c


# ---- pure rules --------------------------------------------------------------------------------
def test_higher_priority_runs_first() -> None:
    d = StateDriver(SchedulerState(queue_seconds=0.0))
    d.add_worker("w1")
    d.submit([("busy", [])], ["busy"])
    d.send(ev.UpdateGraph("c", [ev.TaskSpec("low", "f", None, priority=0),
                                ev.TaskSpec("high", "f", None, priority=10)], ["low", "high"], d.clock()))  # fmt: skip
    d.finish("w1", "busy")
    assert d.running["w1"] == ["high"]


def test_restricted_tasks_wait_for_their_worker_and_loose_ones_do_not() -> None:
    d = StateDriver()
    d.add_worker("w1")
    d.send(ev.UpdateGraph("c", [ev.TaskSpec("strict", "f", None, workers=("w2",)),
                                ev.TaskSpec("loose", "f", None, workers=("w2",), loose=True)],
                          ["strict", "loose"], d.clock()))  # fmt: skip
    assert d.state.tasks["strict"].state == "no-worker"
    assert d.running["w1"] == ["loose"]
    d.add_worker("w2")
    assert d.running["w2"] == ["strict"]
    d.run_until_idle()
    d.state.validate()


# ---- submit and map options ------------------------------------------------------------------
def test_pure_calls_share_one_key_and_impure_ones_do_not(client: tidepool.Client) -> None:
    a, b = client.submit(inc, 1, pure=True), client.submit(inc, 1, pure=True)
    assert a.key == b.key and a.result(timeout=30) == 2
    assert client.submit(inc, 2, pure=True).key != a.key
    assert client.submit(inc, 1).key != client.submit(inc, 1).key  # tidepool's default: impure
    keys = [f.key for f in client.map(inc, [5, 5, 6], pure=True)]
    assert keys[0] == keys[1] != keys[2]


def test_workers_restricts_where_a_task_runs(client: tidepool.Client, cluster: tidepool.LocalCluster) -> None:
    target = sorted(cluster.workers)[1]
    ran = client.gather(client.map(where, range(8), workers=[target]), timeout=30)
    assert set(ran) == {target}
    assert client.submit(where, workers="nobody", allow_other_workers=True).result(timeout=30) in cluster.workers
    with pytest.raises(InfeasibleTaskError, match="nobody"):  # strict: waits, then no_worker_timeout
        client.submit(where, workers=["nobody"]).result(timeout=30)


def test_dask_options_tidepool_lacks_are_refused_not_passed_to_the_function(client: tidepool.Client) -> None:
    with pytest.raises(ConfigError, match="actor"):
        client.submit(inc, 1, actor=True)
    with pytest.raises(ConfigError, match="fifo_timeout"):
        client.map(inc, [1], fifo_timeout="100ms")
    with pytest.raises(ConfigError, match="priority"):
        client.submit(inc, 1, priority="high")


# ---- data ----------------------------------------------------------------------------------------
def test_scatter_keeps_structure_and_hashes_by_content(client: tidepool.Client) -> None:
    one = client.scatter(41)
    assert client.submit(inc, one).result(timeout=30) == 42
    lst = client.scatter([1, 2, 3])
    assert isinstance(lst, list) and client.submit(total, lst).result(timeout=30) == 6
    dct = client.scatter({"x": 1, "y": 2})
    assert set(dct) == {"x", "y"} and dct["y"].result(timeout=30) == 2
    assert client.scatter(41).key == one.key  # equal data, one key (hash=True)
    assert client.scatter(41, hash=False).key != one.key


def test_scatter_broadcast_puts_a_copy_on_every_worker(client: tidepool.Client, cluster: tidepool.LocalCluster) -> None:
    (big,) = client.scatter([list(range(1000))], broadcast=True)  # a list scatters element-wise
    wait_until(lambda: len(client.who_has(big)[big.key]) == len(cluster.workers), what="copies everywhere")
    has = client.has_what()
    assert all(big.key in keys for keys in has.values()) and len(has) == len(cluster.workers)


def test_replicate_copies_to_n_workers_or_to_all_as_in_dask() -> None:
    """Before: ``client.replicate`` did not exist (AttributeError)."""
    with tidepool.LocalCluster(n_workers=3) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(inc, 1, workers=[cluster.workers[0]])
        assert fut.result(timeout=30) == 2
        client.replicate(fut, n=2)
        wait_until(lambda: len(client.who_has(fut)[fut.key]) == 2, what="two copies")
        client.replicate([fut])
        wait_until(lambda: len(client.who_has(fut)[fut.key]) == 3, what="a copy on every worker")
        with pytest.raises(ConfigError, match="workers="):
            client.replicate(fut, workers=cluster.workers[:1])
        with pytest.raises(ConfigError, match="n="):
            client.replicate(fut, n=0)


def test_fire_and_forget_runs_a_dropped_task_to_the_end(client: tidepool.Client, tmp_path: Path) -> None:
    out = tmp_path / "side-effect"
    fut = client.submit(touch, str(out))
    tidepool.fire_and_forget(fut)
    del fut  # the only future: without fire_and_forget the task would be cancelled
    wait_until(out.exists, timeout=30, what="the forgotten task's side effect")
    wait_until(lambda: client.scheduler_info()["tasks"].get("running", 0) == 0, what="nothing left running")


def test_persist_returns_futures_that_later_tasks_reuse(client: tidepool.Client) -> None:
    @tidepool.task
    def square(x: int) -> int:
        return x * x

    persisted = client.persist([square(i) for i in range(4)])
    assert all(isinstance(f, tidepool.Future) for f in persisted)
    assert client.submit(total, persisted).result(timeout=30) == 14


# ---- workers ----------------------------------------------------------------------------------
def test_run_calls_a_function_on_every_worker(client: tidepool.Client, cluster: tidepool.LocalCluster) -> None:
    pids = client.run(pid)
    assert len(pids) == len(cluster.workers) and os.getpid() not in pids.values()
    with pytest.raises(ValueError, match="no such device"):
        client.run(fails)
    errors = client.run(fails, on_error="return")
    assert all(isinstance(e, ValueError) for e in errors.values())
    some = sorted(cluster.workers)[0]
    assert len(client.run(pid, workers=[some])) == 1
    # found by a bug hunt: one name as a string ran on no worker (its letters were taken as names),
    # and so did an unknown name, both without a word
    assert len(client.run(pid, workers=some)) == 1
    with pytest.raises(tidepool.SchedulerError, match="no worker is named 'no-such-worker'"):
        client.run(pid, workers=["no-such-worker"])


def test_upload_file_makes_a_module_importable_on_every_worker(client: tidepool.Client, tmp_path: Path) -> None:
    mod = tmp_path / "tp_uploaded_helper.py"
    mod.write_text("def triple(x):\n    return 3 * x\n")
    client.upload_file(str(mod))

    def use(x: int) -> int:
        import tp_uploaded_helper  # type: ignore[import-not-found]

        return int(tp_uploaded_helper.triple(x))

    assert client.gather(client.map(use, range(4)), timeout=30) == [0, 3, 6, 9]


def test_who_has_and_has_what_agree(client: tidepool.Client) -> None:
    futs = client.map(inc, range(6))
    client.gather(futs, timeout=30)
    who = client.who_has(futs)
    has = client.has_what()
    for f in futs:
        (addr,) = who[f.key][:1]
        assert f.key in has[addr]


def test_who_has_replicate_cancel_and_fire_and_forget_take_a_persisted_collection(client: tidepool.Client) -> None:
    # found by a bug hunt: who_has(x) was {}, replicate(x) copied nothing, fire_and_forget(x) did
    # nothing, and cancel(x) iterated the array's rows ("takes futures, got dask.array<getitem ...>")
    da = pytest.importorskip("dask.array")
    x = client.persist(da.arange(20, chunks=5) * 3)
    tidepool.wait(x, timeout=30)
    futs = tidepool.futures_of(x)  # Dask's futures_of
    keys = {f.key for f in futs}
    assert futs and all(isinstance(f, tidepool.Future) for f in futs)
    assert len(keys) == 4
    assert set(client.who_has(x)) == keys
    client.replicate(x)
    wait_until(lambda: all(len(v) == 2 for v in client.who_has(x).values()), 30, "two copies of every chunk")
    client.fire_and_forget(x)
    tidepool.fire_and_forget(x)
    assert set(client.who_has([x])) == keys  # a list of collections too, as Dask's futures_of takes it
    client.cancel([x])
    assert all(f.cancelled() for f in futs)
    with pytest.raises(ConfigError, match="not persisted"):
        client.who_has(da.arange(4, chunks=2))


def test_wait_for_workers_blocks_until_they_join() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(TimeoutError):
            client.wait_for_workers(1, timeout=0.3)
        cluster.add_workers(2, wait=False)
        client.wait_for_workers(2, timeout=60)
        assert len(client.scheduler_info()["workers"]) >= 2


def slow(x: int) -> int:
    import time

    time.sleep(60)
    return x


def big(n: int) -> bytes:
    return b"x" * n


def test_restart_cancels_futures_and_brings_fresh_worker_processes_back() -> None:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        before = set(client.run(pid).values())
        pending = client.submit(slow, 1)
        wait_until(lambda: client.scheduler_info()["tasks"].get("running", 0) == 1, what="slow task running")
        done = client.submit(big, 10_000)  # finished, its value on a worker only (not inline, not fetched)
        tidepool.wait([done], timeout=30)
        assert client.restart(timeout=60) == 2
        with pytest.raises(TaskCancelledError, match="restarted"):
            pending.result(timeout=30)
        # found by a bug hunt: a finished future said "finished" (exception() None) while result()
        # raised; its value is gone, so it is an error now, and every accessor agrees
        assert done.status == "error" and isinstance(done.exception(), TaskCancelledError)
        with pytest.raises(TaskCancelledError, match="restarted"):
            done.result(timeout=30)
        assert client.submit(inc, 2).result(timeout=30) == 3
        assert len(client.scheduler_info()["workers"]) == 2
        assert set(client.run(pid).values()) == before  # the same processes, re-executed fresh
        assert cluster.workers  # the cluster still knows its workers


def test_data_scattered_to_a_worker_that_dies_is_restored_on_another() -> None:
    """Found by a churn hunt: scatter(workers=[w]) restored its value only on w: after w died its
    dependents waited no_worker_timeout, then failed telling the user to start a dead worker."""
    import signal

    with tidepool.LocalCluster(n_workers=2, no_worker_timeout=30.0) as cluster, tidepool.Client(cluster) as client:
        first, other = cluster.workers
        data = client.scatter([5, 6], workers=[first])
        assert client.submit(where, data[0]).result(timeout=30) == first  # it is there
        (p,) = client.run(pid, workers=[first]).values()
        os.kill(p, signal.SIGKILL)
        wait_until(lambda: first not in cluster.workers, timeout=30, what="the worker to be gone")
        assert client.submit(total, data).result(timeout=20) == 11  # restored from the scheduler's copy
