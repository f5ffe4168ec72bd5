"""Client API on real worker processes: submit/map/gather, lazy graphs, locality, errors, releasing.

One LocalCluster per module: an ``alpha`` worker and a ``beta`` worker (2 slots each).  The custom
resources ``alpha``/``beta`` let a test pin a task to one of them, so worker-to-worker transfers and
placement can be checked deterministically.  Scheduler state is read on the cluster's loop thread
with ``cluster.run``; every wait is a bounded wait on a condition.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tidepool
from tidepool.errors import RemoteTaskError, RemoteTraceback
from tidepool.scaling.node_types import NodeType
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration

ALPHA = {"alpha": 1}
BETA = {"beta": 1}






# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=0) as c:
        c.add_workers(1, node_type=NodeType("alpha", {"cpu": 2, "alpha": 1}))
        c.add_workers(1, node_type=NodeType("beta", {"cpu": 2, "beta": 1}))
        yield c


@pytest.fixture(scope="module")
def client(cluster: tidepool.LocalCluster) -> Iterator[tidepool.Client]:
    with tidepool.Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def pids(client: tidepool.Client) -> dict[str, int]:
    """Process id of the alpha and of the beta worker."""
    return {
        "alpha": client.submit(os.getpid, resources=ALPHA).result(timeout=10),
        "beta": client.submit(os.getpid, resources=BETA).result(timeout=10),
    }


def scheduler_keys(cluster: tidepool.LocalCluster) -> set[str]:
    return cluster.run(lambda s: set(s.state.tasks))  # type: ignore[no-any-return]


def who_has(cluster: tidepool.LocalCluster, key: str) -> set[str]:
    return cluster.run(lambda s: set(s.state.tasks[key].who_has) if key in s.state.tasks else set())  # type: ignore[no-any-return]


def wait_all(futs: list[tidepool.Future[Any]]) -> None:
    done, not_done = concurrent.futures.wait(futs, timeout=15)
    assert not not_done


def finished_count(cluster: tidepool.LocalCluster) -> int:
    return cluster.run(lambda s: s.state.counters["finished"])  # type: ignore[no-any-return]


# ---- task functions (module level: imported by reference on the workers) ---------------------------
def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def describe(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": args, "kwargs": kwargs}


def with_pid(value: Any) -> tuple[int, Any]:
    return os.getpid(), value


def big_array(nbytes: int) -> tuple[int, np.ndarray]:
    return os.getpid(), np.full(nbytes // 8, 1.5)


def tiny_array() -> tuple[int, np.ndarray]:
    return os.getpid(), np.arange(4.0)


def combine(big: tuple[int, np.ndarray], tiny: tuple[int, np.ndarray]) -> tuple[int, float]:
    return os.getpid(), float(big[1].sum() + tiny[1].sum())


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


class NeedsTwoArgs(Exception):
    """Pickles fine on the worker, but ``cls(*self.args)`` fails when the client unpickles it."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")


def raise_unloadable(detail: str) -> None:
    raise NeedsTwoArgs(7, detail)


def flaky(counter: str, failures: int) -> int:
    """Fails the first ``failures`` calls (counted in a file), then returns the attempt number."""
    n = int(open(counter).read() or 0) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(n + 1))
    if n < failures:
        raise ValueError(f"flaky attempt {n + 1}")
    return n + 1


def return_none() -> None:
    return None


@tidepool.task
def t_inc(x: int) -> int:
    return x + 1


@tidepool.task
def t_double(x: int) -> int:
    return 2 * x


@tidepool.task
def t_add(a: int, b: int) -> int:
    return a + b


@tidepool.task
def t_sum(xs: list[int]) -> int:
    return sum(xs)


@tidepool.task
def t_fail(msg: str) -> int:
    raise ValueError(msg)


# ---- submit / map / gather -----------------------------------------------------------------------
def test_submit_plain_function_with_args_and_kwargs(client: tidepool.Client) -> None:
    assert client.submit(pow, 2, 10).result(timeout=10) == 1024
    assert client.submit(inc, 41).result(timeout=10) == 42
    out = client.submit(describe, 1, "two", three=3).result(timeout=10)
    assert out == {"args": (1, "two"), "kwargs": {"three": 3}}
    # submit's own options are not passed to the function
    f = client.submit(describe, 5, key="my-explicit-key", retries=1)
    assert f.key == "my-explicit-key"
    assert f.result(timeout=10) == {"args": (5,), "kwargs": {}}


def test_submit_lambdas_and_closures(client: tidepool.Client) -> None:
    assert client.submit(lambda x, y=3: x * y, 7).result(timeout=10) == 21

    def make_adder(n: int) -> Callable[[int], int]:
        offset = 100

        def adder(x: int) -> int:
            return x + n + offset

        return adder

    # distinct closures of the same code must not be confused by the function cache
    futs = [client.submit(make_adder(i), 1) for i in range(5)]
    assert client.gather(futs) == [101, 102, 103, 104, 105]
    captured = {"k": [1, 2, 3]}
    assert client.submit(lambda: sum(captured["k"])).result(timeout=10) == 6


class _Scale:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, x: int) -> int:
        return self.k * x


def test_a_callable_changed_between_submits_runs_as_it_is_now(client: tidepool.Client) -> None:
    """Found by a bug hunt: the function's pickle was cached by id while the callable lived, so a
    callable object whose attribute changed, or a closure whose captured list grew, ran as it was
    at the first submit: silently wrong results (Dask pickles per call)."""
    scale = _Scale(2)
    first = client.submit(scale, 10).result(timeout=10)
    scale.k = 3
    assert (first, client.submit(scale, 10).result(timeout=10)) == (20, 30)
    data = [1]

    def total() -> int:
        return sum(data)

    before = client.submit(total).result(timeout=10)
    data.append(100)
    assert (before, client.submit(total).result(timeout=10)) == (1, 101)
    assert client.gather(client.map(lambda _: sum(data), [0])) == [101]
    # one pickle for a whole map: its tasks share the function id
    scale.k = 4
    assert client.gather(client.map(scale, [1, 2, 3])) == [4, 8, 12]
    assert client.submit(scale, 1, pure=True).key != client.submit(_Scale(5), 1, pure=True).key


def test_changed_versions_of_a_callable_ride_with_their_tasks_not_kept_for_ever(
        client: tidepool.Client, cluster: tidepool.LocalCluster) -> None:  # fmt: skip
    """Found by a review: once every changed version of a callable was pickled again (right), each
    was also kept by the scheduler and every worker for good, one copy per version (a 1 MB global
    reassigned before each of 100 submits: 100 MB held).  The first version is kept; later ones
    travel in their task's arguments."""
    functions = cluster.scheduler.state.functions
    scale = _Scale(1)
    assert client.submit(scale, 1).result(timeout=10) == 1
    before = len(functions)
    results = []
    for k in range(2, 12):
        scale.k = k
        results.append(client.submit(scale, 1).result(timeout=10))
    assert results == list(range(2, 12))
    assert len(functions) <= before + 1  # call_with, once
    # a map (a review: riding with each task, the callable was pickled into every task's arguments)
    # registers the changed version once for all its tasks
    scale.k = 100
    n = len(functions)
    assert client.gather(client.map(scale, range(50))) == [100 * i for i in range(50)]
    assert len(functions) == n + 1
    # a bound method of an object that changes: the same
    holder = _Holder(10)
    assert client.submit(holder.get).result(timeout=10) == 10
    holder.v = 20
    assert client.gather(client.map(lambda _, f=holder.get: f(), range(3))) == [20] * 3
    assert client.submit(holder.get).result(timeout=10) == 20
    assert client.submit(holder.get, pure=True).key == client.submit(holder.get, pure=True).key


class _Holder:
    def __init__(self, v: int) -> None:
        self.v = v

    def get(self) -> int:
        return self.v


def test_a_map_pickles_its_function_once(client: tidepool.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    import tidepool.client.specs as specs

    fn = _Scale(7)
    real = specs.cloudpickle.dumps
    calls: list[Any] = []

    def counting(obj: Any, *a: Any, **kw: Any) -> bytes:
        calls.append(obj)
        return real(obj, *a, **kw)

    monkeypatch.setattr(specs.cloudpickle, "dumps", counting)
    assert client.gather(client.map(fn, range(300))) == [7 * i for i in range(300)]
    assert sum(1 for c in calls if c is fn) == 1


def test_gather_of_a_generator_gives_the_values(client: tidepool.Client) -> None:
    """Found by a bug hunt: a generator of futures came back unchanged, as pending futures."""
    futs = client.map(inc, range(3))
    assert list(client.gather(f for f in futs)) == [1, 2, 3]
    assert list(client.gather(iter(futs), errors="skip")) == [1, 2, 3]
    import asyncio

    assert list(asyncio.run(client.gather_async(f for f in futs))) == [1, 2, 3]


def test_map_over_several_iterables_with_kwargs(client: tidepool.Client) -> None:
    futs = client.map(add, range(10), range(100, 110))
    assert len({f.key for f in futs}) == 10
    assert client.gather(futs) == [i + 100 + i for i in range(10)]
    assert client.gather(client.map(lambda x, scale=1: x * scale, range(5), scale=3)) == [0, 3, 6, 9, 12]
    # shortest iterable wins, like zip
    assert client.gather(client.map(add, [1, 2, 3], [10, 20])) == [11, 22]
    keyed = client.map(inc, [1, 2], key=["map-k-a", "map-k-b"])
    assert [f.key for f in keyed] == ["map-k-a", "map-k-b"]
    assert client.gather(keyed) == [2, 3]


def test_gather_nested_structures(client: tidepool.Client) -> None:
    a, b, c, d = client.map(inc, [0, 10, 20, 30])
    structure = {"list": [a, b, "plain"], "tuple": (c, {"deep": [d]}), "n": 5, "empty": []}
    out = client.gather(structure)
    assert out == {"list": [1, 11, "plain"], "tuple": (21, {"deep": [31]}), "n": 5, "empty": []}
    assert isinstance(out["tuple"], tuple)
    assert client.gather(a) == 1
    assert client.gather((a, b)) == (1, 11)


def test_gather_of_future_whose_value_is_none(client: tidepool.Client) -> None:
    f = client.submit(return_none)
    assert f.result(timeout=10) is None


def test_gather_returns_none_values(client: tidepool.Client) -> None:
    f = client.submit(return_none)
    assert client.gather([f, client.submit(inc, 1)]) == [None, 2]


def test_gather_skip_errors_in_nested_structures(client: tidepool.Client) -> None:
    ok = client.submit(inc, 1)
    bad = client.submit(raise_value_error, "skip me")
    assert client.gather([ok, bad], errors="skip") == [2]  # top level works
    assert client.gather({"ok": ok, "bad": bad}, errors="skip") == {"ok": 2}
    assert client.gather([[ok, bad]], errors="skip") == [[2]]


def test_futures_as_arguments_become_dependencies(client: tidepool.Client) -> None:
    x = client.submit(inc, 1)  # 2
    y = client.submit(inc, 10)  # 11
    assert client.submit(add, x, y).result(timeout=10) == 13
    assert client.submit(sum, [x, y, 100]).result(timeout=10) == 113
    nested = client.submit(describe, {"x": x, "ys": [y, (x,)]}, kw={"deep": [y]})
    assert nested.result(timeout=10) == {
        "args": ({"x": 2, "ys": [11, (2,)]},),
        "kwargs": {"kw": {"deep": [11]}},
    }
    # a dependency submitted after nothing finished yet: the chain resolves in order
    f = client.submit(inc, 0)
    for _ in range(10):
        f = client.submit(inc, f)
    assert f.result(timeout=10) == 11


# ---- lazy graphs -----------------------------------------------------------------------------------
def test_delayed_diamond_runs_shared_node_once(cluster: tidepool.LocalCluster, client: tidepool.Client) -> None:
    before = finished_count(cluster)
    a = t_inc(1)  # 2
    b = t_double(a)  # 4
    c = t_inc(a)  # 3
    d = t_add(b, c)  # 7
    fut = client.compute(d)
    assert isinstance(fut, tidepool.Future)
    assert fut.result(timeout=10) == 7
    assert finished_count(cluster) - before == 4  # a ran once although two tasks need it


def test_delayed_chain_of_fifty_with_delayed_compute(client: tidepool.Client) -> None:
    assert tidepool.default_client() is client
    x: Any = 0
    for _ in range(50):
        x = t_inc(x)
    assert x.compute() == 50
    assert x.compute(client=client) == 50  # already in memory or recomputed: same answer


def test_delayed_tree_reduction_and_tidepool_compute(client: tidepool.Client) -> None:
    leaves = [t_double(i) for i in range(64)]
    level = leaves
    while len(level) > 1:
        level = [t_add(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    total = level[0]
    listed = t_sum(leaves[:8])  # a list of delayed values as one argument
    assert tidepool.compute(total, listed) == (2 * sum(range(64)), 2 * sum(range(8)))


def test_compute_keeps_structure_and_mixes_futures(client: tidepool.Client) -> None:
    fut = client.submit(inc, 4)  # 5
    d1 = t_inc(fut)  # a future inside a lazy graph
    d2 = t_add(d1, 10)
    out = client.compute({"one": d1, "many": [d2, d1]})
    assert set(out) == {"one", "many"}
    assert out["one"] is out["many"][1]  # same delayed -> same future
    assert client.gather(out) == {"one": 6, "many": [16, 6]}


def test_failed_lazy_node_fails_its_dependents(client: tidepool.Client) -> None:
    bad = t_fail("lazy boom")
    after = t_inc(t_inc(bad))
    with pytest.raises(ValueError, match="lazy boom"):
        client.compute(after).result(timeout=10)


def test_task_decorator_options(client: tidepool.Client, pids: dict[str, int]) -> None:
    on_beta = tidepool.task(resources=BETA)(with_pid)
    pid, value = client.compute(on_beta("x")).result(timeout=10)
    assert (pid, value) == (pids["beta"], "x")
    assert on_beta.options(resources=ALPHA)("y").compute() == (pids["alpha"], "y")


# ---- locality and worker-to-worker transfers --------------------------------------------------------
def test_dependent_on_other_worker_fetches_from_peer(cluster: tidepool.LocalCluster,
                                                     client: tidepool.Client,
                                                     pids: dict[str, int]) -> None:  # fmt: skip
    held = client.submit(with_pid, list(range(1000)), resources=ALPHA)
    assert held.result(timeout=10)[0] == pids["alpha"]
    workers = {w["id"]: w["node_type"] for w in client.scheduler_info()["workers"]}
    alpha = next(w for w, t in workers.items() if t == "alpha")
    beta = next(w for w, t in workers.items() if t == "beta")
    assert who_has(cluster, held.key) == {alpha}

    user = client.submit(lambda pv: (os.getpid(), sum(pv[1])), held, resources=BETA)
    pid, total = user.result(timeout=10)
    assert pid == pids["beta"] and total == sum(range(1000))
    # beta fetched the value straight from alpha and kept it as a replica the scheduler knows of
    wait_until(lambda: who_has(cluster, held.key) == {alpha, beta}, what="replica on beta")


@pytest.mark.parametrize("big_on", ["alpha", "beta"])
def test_placement_prefers_worker_with_most_input_bytes(client: tidepool.Client, pids: dict[str, int],
                                                        big_on: str) -> None:  # fmt: skip
    tiny_on = "beta" if big_on == "alpha" else "alpha"
    big = client.submit(big_array, 8_000_000, resources={big_on: 1})
    tiny = client.submit(tiny_array, resources={tiny_on: 1})
    wait_all([big, tiny])
    out = client.submit(combine, big, tiny)  # may run anywhere
    pid, total = out.result(timeout=10)
    assert total == 1.5 * 1_000_000 + 6.0
    assert pid == pids[big_on], f"dependent ran on the worker holding the tiny input ({tiny_on})"


# ---- errors ------------------------------------------------------------------------------------------
def test_remote_exception_reraised_as_itself_with_traceback(client: tidepool.Client) -> None:
    f = client.submit(raise_value_error, "boom-42")
    with pytest.raises(ValueError, match="boom-42") as info:
        f.result(timeout=10)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "raise_value_error" in cause.tb and "ValueError: boom-42" in cause.tb
    assert "raise_value_error" in str(cause)
    assert isinstance(f.exception(timeout=1), ValueError)
    assert f.status == "error"
    with pytest.raises(ValueError, match="boom-42"):
        client.gather([client.submit(inc, 1), f])


def test_exception_that_cannot_be_unpickled_becomes_remote_task_error(client: tidepool.Client) -> None:
    f = client.submit(raise_unloadable, "cannot rebuild")
    with pytest.raises(RemoteTaskError) as info:
        f.result(timeout=10)
    err = info.value
    assert err.remote_type == "NeedsTwoArgs"
    assert "code 7: cannot rebuild" in str(err)
    assert "raise_unloadable" in err.remote_traceback
    assert err.key == f.key


def test_dependents_of_failed_task_fail_with_the_same_error(client: tidepool.Client) -> None:
    root = client.submit(raise_value_error, "root cause")
    child = client.submit(inc, root)
    grandchild = client.submit(add, child, client.submit(inc, 1))
    for f in (root, child, grandchild):
        with pytest.raises(ValueError, match="root cause") as info:
            f.result(timeout=10)
        assert "raise_value_error" in info.value.__cause__.tb  # type: ignore[union-attr]
    # submitted after the failure is known: fails at once with the same error
    late = client.submit(inc, root)
    with pytest.raises(ValueError, match="root cause"):
        late.result(timeout=10)


def test_retries_rerun_a_failing_task(cluster: tidepool.LocalCluster, client: tidepool.Client,
                                      tmp_path: Any) -> None:  # fmt: skip
    retried = cluster.run(lambda s: s.state.counters["retried"])
    counter = str(tmp_path / "ok.count")
    assert client.submit(flaky, counter, 2, retries=2).result(timeout=15) == 3
    assert cluster.run(lambda s: s.state.counters["retried"]) - retried == 2

    counter2 = str(tmp_path / "fail.count")
    f = client.submit(flaky, counter2, 2, retries=1)
    with pytest.raises(ValueError, match="flaky attempt 2"):
        f.result(timeout=15)
    assert open(counter2).read() == "2"

    counter3 = str(tmp_path / "lazy.count")
    lazy = tidepool.task(retries=2)(flaky)
    assert client.compute(lazy(counter3, 2)).result(timeout=15) == 3


# ---- releasing ---------------------------------------------------------------------------------------
def test_dropped_futures_are_forgotten_by_the_scheduler(cluster: tidepool.LocalCluster,
                                                        client: tidepool.Client) -> None:  # fmt: skip
    futs = client.map(with_pid, range(20))
    chain = client.compute(t_inc(t_inc(t_inc(1))))
    assert len(client.gather(futs)) == 20 and chain.result(timeout=10) == 4
    keys = {f.key for f in futs} | {chain.key}
    assert keys <= scheduler_keys(cluster)
    del futs, chain
    gc.collect()
    wait_until(lambda: not keys & scheduler_keys(cluster), what="scheduler to forget released keys")

    def held(s: Any) -> int:
        return sum(1 for w in s.state.workers.values() for t in w.has_what if t.key in keys)

    wait_until(lambda: cluster.run(held) == 0, what="workers to drop the values")


def test_dropping_an_input_future_keeps_it_for_pending_dependents(client: tidepool.Client,
                                                                  tmp_path: Any) -> None:  # fmt: skip
    gate = tmp_path / "gate"
    first = client.submit(wait_for_file, str(gate), 1)
    second = client.submit(inc, first)
    del first
    gc.collect()
    gate.touch()
    assert second.result(timeout=15) == 2


def wait_for_file(path: str, value: Any = None, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return value


# ---- large values -------------------------------------------------------------------------------------
def test_large_numpy_result_is_gathered_intact(client: tidepool.Client) -> None:
    n = 50 * 1024 * 1024 // 8
    f = client.submit(lambda: np.arange(n, dtype=np.float64))
    arr = client.gather(f)
    assert arr.dtype == np.float64 and arr.shape == (n,)
    assert arr[0] == 0.0 and arr[-1] == n - 1
    assert float(arr.sum()) == float(n) * (n - 1) / 2


def test_large_numpy_argument_travels_to_worker(client: tidepool.Client) -> None:
    data = np.random.default_rng(0).random(2_500_000)  # 20 MB sent from the client
    assert client.submit(np.sum, data).result(timeout=20) == pytest.approx(data.sum())


# ---- several clients, own cluster, misuse ---------------------------------------------------------------
def test_two_clients_share_a_key_and_release_independently(cluster: tidepool.LocalCluster,
                                                           client: tidepool.Client) -> None:  # fmt: skip
    lazy = t_double(21)
    mine = client.compute(lazy)
    with tidepool.Client(cluster) as other:
        theirs = other.compute(lazy)
        assert mine.key == theirs.key
        assert mine.result(timeout=10) == theirs.result(timeout=10) == 42
        with pytest.raises(tidepool.ConfigError, match="another client"):
            client.submit(inc, theirs)
        keep = other.submit(inc, 1)
        keep.result(timeout=10)
        del mine
        gc.collect()
        # the other client still wants the value: it stays, and a fresh fetch works
        theirs._value = tidepool.futures._UNSET
        assert theirs.result(timeout=10) == 42
        keep_key = keep.key
    # closing a client releases everything it held
    wait_until(lambda: not {lazy.key, keep_key} & scheduler_keys(cluster), what="closed client's keys")


def test_client_misuse_gives_clear_errors(client: tidepool.Client) -> None:
    with pytest.raises(tidepool.ConfigError, match="callable"):
        client.submit(42)  # type: ignore[arg-type]
    with pytest.raises(tidepool.ConfigError, match="keys"):
        client.map(inc, [1, 2], key=["only-one"])
    with pytest.raises(tidepool.ConfigError, match="no delayed"):
        client.compute([1, 2])
    with pytest.raises(tidepool.ConfigError, match="retries"):
        client.submit(inc, 1, retries=-1)

    class Holder:
        def __init__(self, fut: Any) -> None:
            self.fut = fut

    with pytest.raises(tidepool.ConfigError, match="cannot be pickled"):
        client.submit(describe, Holder(client.submit(inc, 1)))
    assert client.map(inc, []) == [] and client.gather([]) == []


def test_gather_timeout_on_unfinished_futures(client: tidepool.Client, tmp_path: Any) -> None:
    gate = tmp_path / "gate"
    try:
        blocked = client.submit(wait_for_file, str(gate), 1)
        with pytest.raises(TimeoutError):
            client.gather([blocked], timeout=0.2)
        with pytest.raises(TimeoutError):
            blocked.result(timeout=0.2)
    finally:
        gate.touch()
    assert blocked.result(timeout=15) == 1


def test_client_without_address_runs_its_own_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # LocalCluster() default: one worker here
    with tidepool.Client() as c:
        own = c._own_cluster
        assert own is not None and len(own.workers) == 1
        assert c.submit(lambda: "own").result(timeout=10) == "own"
    assert own.closed


def test_pending_future_fails_when_its_client_closes(cluster: tidepool.LocalCluster,
                                                     tmp_path: Any) -> None:  # fmt: skip
    gate = tmp_path / "gate"
    c = tidepool.Client(cluster)
    try:
        pending = c.submit(wait_for_file, str(gate), 1)
        c.close()
        with pytest.raises((tidepool.TidepoolError, concurrent.futures.CancelledError)):
            pending.result(timeout=1)
    finally:
        gate.touch()


def test_result_after_close_raises_a_tidepool_error(cluster: tidepool.LocalCluster) -> None:
    c = tidepool.Client(cluster)
    f = c.submit(inc, 1)
    concurrent.futures.wait([f], timeout=10)  # done, value not fetched yet
    c.close()
    err: BaseException | None = None
    try:
        f.result(timeout=5)
    except BaseException as exc:  # noqa: BLE001
        err = exc
    err_type = type(err)
    with warnings.catch_warnings():  # the bug also leaves an un-awaited coroutine behind
        warnings.simplefilter("ignore", RuntimeWarning)
        err = None
        gc.collect()
    assert issubclass(err_type, tidepool.TidepoolError), err_type


def test_failed_client_construction_leaves_no_unawaited_coroutine(cluster: tidepool.LocalCluster) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(tidepool.AuthenticationError):
            tidepool.Client(cluster.address, token="wrong-token", timeout=5)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
