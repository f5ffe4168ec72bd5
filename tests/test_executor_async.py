"""Futures as ``concurrent.futures`` futures, the Client as an Executor, and the asyncio API.

Real worker processes (one module-scoped LocalCluster with two 2-slot workers).  Tasks that must
stay running block on a "gate" file in ``tmp_path``; the test opens the gate, so nothing depends on
timing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tidepool
from tidepool.errors import RemoteTraceback
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration







@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=2, slots=2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: tidepool.LocalCluster) -> Iterator[tidepool.Client]:
    with tidepool.Client(cluster) as c:
        yield c




def task_state(cluster: tidepool.LocalCluster, key: str) -> str | None:
    return cluster.run(lambda s: s.state.tasks[key].state if key in s.state.tasks else None)  # type: ignore[no-any-return]


# ---- task functions --------------------------------------------------------------------------------
def inc(x: int) -> int:
    return x + 1


def describe(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": args, "kwargs": kwargs}


def gated_value(gate: str | None, value: Any, timeout: float = 20.0) -> Any:
    """Return ``value`` once the file ``gate`` exists (at once when ``gate`` is None)."""
    deadline = time.monotonic() + timeout
    while gate is not None and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.01)
    return value


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def return_none() -> None:
    return None


def flaky(counter: str, failures: int) -> int:
    n = int(open(counter).read() or 0) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(n + 1))
    if n < failures:
        raise ValueError(f"flaky attempt {n + 1}")
    return n + 1


@tidepool.task
def t_gated(gate: str, value: int) -> int:
    return gated_value(gate, value)  # type: ignore[no-any-return]


# ---- concurrent.futures compatibility ----------------------------------------------------------------
def test_types_satisfy_concurrent_futures(client: tidepool.Client) -> None:
    f = client.submit(inc, 1)
    assert isinstance(f, cf.Future)
    assert isinstance(client, cf.Executor)
    assert isinstance(client.get_executor(), cf.Executor)
    assert f.result(timeout=10) == 2 and f.done() and not f.cancelled() and f.exception() is None


def test_wait_first_completed_first_exception_and_all(client: tidepool.Client, gate: Any) -> None:
    blocked = client.submit(gated_value, str(gate), "late")
    quick = client.submit(inc, 1)
    done, not_done = cf.wait([blocked, quick], timeout=10, return_when=cf.FIRST_COMPLETED)
    assert quick in done and blocked in not_done

    failing = client.submit(raise_value_error, "first exception")
    done, not_done = cf.wait([blocked, failing], timeout=10, return_when=cf.FIRST_EXCEPTION)
    assert failing in done and blocked in not_done
    assert isinstance(failing.exception(), ValueError)

    gate.touch()
    done, not_done = cf.wait([blocked, quick, failing], timeout=10)
    assert not not_done and blocked.result() == "late"


def test_as_completed_yields_in_completion_order(client: tidepool.Client, gate: Any) -> None:
    blocked = client.submit(gated_value, str(gate), "slow")
    quick = client.map(inc, range(3))
    order = []
    for f in cf.as_completed([blocked, *quick], timeout=15):
        order.append(f)
        if len(order) == 3:
            gate.touch()  # only now can the blocked task finish
    assert set(order[:3]) == set(quick) and order[3] is blocked
    assert [f.result() for f in order] == [f.result() for f in order[:3]] + ["slow"]


def test_as_completed_timeout(client: tidepool.Client, gate: Any) -> None:
    blocked = client.submit(gated_value, str(gate), 0)
    with pytest.raises(TimeoutError):
        for _ in cf.as_completed([blocked], timeout=0.2):
            pass


def test_done_callbacks_may_call_result(client: tidepool.Client, gate: Any) -> None:
    seen: dict[str, Any] = {}
    fired = threading.Event()
    lock = threading.Lock()

    def record(name: str) -> Callable[[cf.Future[Any]], None]:
        def cb(f: cf.Future[Any]) -> None:
            try:
                value: Any = f.result(timeout=10)  # blocking call: fine off the event loop
            except Exception as exc:  # noqa: BLE001
                value = exc
            with lock:
                seen[name] = (value, threading.current_thread().name)
                if len(seen) == 3:
                    fired.set()

        return cb

    pending = client.submit(gated_value, str(gate), {"v": 1})
    pending.add_done_callback(record("pending"))
    finished = client.submit(inc, 9)
    finished.result(timeout=10)
    finished.add_done_callback(record("already-done"))  # runs although it was done before
    failing = client.submit(raise_value_error, "in callback")
    failing.add_done_callback(record("failing"))
    gate.touch()
    assert fired.wait(15), seen
    assert seen["pending"][0] == {"v": 1}
    assert seen["already-done"][0] == 10
    assert isinstance(seen["failing"][0], ValueError)
    assert all(not name.startswith("tidepool-client") for _, name in seen.values())


def test_cancel_a_long_running_task(cluster: tidepool.LocalCluster, client: tidepool.Client,
                                    gate: Any) -> None:  # fmt: skip
    long = client.submit(gated_value, str(gate), "never wanted")
    key = long.key
    wait_until(long.running, what="the long task to start")
    assert long.cancel() is False  # concurrent.futures: executing work cannot be cancelled ...
    client.cancel([long])  # ... but Client.cancel (Dask's) cancels it whatever its state
    assert long.cancelled() and long.done() and long.status == "cancelled"
    with pytest.raises(cf.CancelledError):
        long.result(timeout=1)
    wait_until(lambda: task_state(cluster, key) is None, what="the scheduler to forget the key")
    done = client.submit(inc, 1)
    assert done.result(timeout=10) == 2
    assert done.cancel() is False  # finished futures cannot be cancelled

    def running_on_workers(s: Any) -> int:  # as the workers' heartbeats report it
        return sum(w.metrics.get("running", 0) for w in s.state.workers.values())

    finished = cluster.run(lambda s: s.state.counters["finished"])
    wait_until(lambda: cluster.run(running_on_workers) >= 1, what="a heartbeat showing the abandoned run")
    gate.touch()
    # the abandoned run finishes on its worker, which drops the result without reporting it
    wait_until(lambda: cluster.run(running_on_workers) == 0, what="the abandoned run to end")
    assert task_state(cluster, key) is None
    assert cluster.run(lambda s: s.state.counters["finished"]) == finished


def test_cancel_twice_returns_true(client: tidepool.Client, gate: Any) -> None:
    f = client.submit(gated_value, str(gate), 1)
    client.cancel(f)  # (f.cancel() may find it executing already: then it is False)
    assert f.cancel() is True
    assert f.cancel() is True


def test_compute_again_after_cancel(client: tidepool.Client, gate: Any) -> None:
    lazy = t_gated(str(gate), 5)
    first = client.compute(lazy)
    client.cancel(first)
    assert first.cancelled()
    gate.touch()
    again = client.compute(lazy)
    assert again.result(timeout=10) == 5


# ---- Executor -----------------------------------------------------------------------------------------
def test_executor_submit_passes_every_keyword_to_the_function(client: tidepool.Client) -> None:
    ex = client.get_executor()
    f = ex.submit(describe, 1, key="k", resources={"gpu": 1}, retries=3)
    assert isinstance(f, cf.Future)
    assert f.result(timeout=10) == {"args": (1,), "kwargs": {"key": "k", "resources": {"gpu": 1}, "retries": 3}}
    assert f.key != "k"


def test_executor_options_apply_to_every_task(client: tidepool.Client, tmp_path: Any) -> None:
    ex = client.get_executor(retries=2)
    assert ex.submit(flaky, str(tmp_path / "c1"), 2).result(timeout=15) == 3
    assert list(ex.map(flaky, [str(tmp_path / "c2"), str(tmp_path / "c3")], [1, 2])) == [2, 3]


def test_executor_map_yields_results_in_input_order(cluster: tidepool.LocalCluster,
                                                    client: tidepool.Client, gate: Any) -> None:  # fmt: skip
    def gated_keys(s: Any, state: str | None = None) -> set[str]:
        return {k for k, t in s.state.tasks.items()
                if k.startswith("gated_value-") and (state is None or t.state == state)}  # fmt: skip

    earlier = cluster.run(gated_keys)
    ex = client.get_executor()
    gates = [str(gate), None, None, None]
    results = ex.map(gated_value, gates, ["first", "second", "third", "fourth"])
    assert isinstance(results, Iterator)

    def others_done(s: Any) -> bool:
        return len(gated_keys(s, "memory") - earlier) >= 3

    wait_until(lambda: cluster.run(others_done), what="the ungated tasks to finish")
    gate.touch()  # the first input finishes last, yet comes out first
    assert list(results) == ["first", "second", "third", "fourth"]
    assert list(ex.map(pow, range(6), [2] * 6)) == [0, 1, 4, 9, 16, 25]
    assert list(ex.map(inc, [])) == []


def test_executor_as_context_manager_leaves_client_open(client: tidepool.Client) -> None:
    with client.get_executor() as ex:
        futs = [ex.submit(inc, i) for i in range(5)]
        assert [f.result(timeout=10) for f in futs] == [1, 2, 3, 4, 5]
    assert not client.closed
    assert client.submit(inc, 1).result(timeout=10) == 2


def test_executor_shutdown_waits_for_pending_futures(client: tidepool.Client, gate: Any) -> None:
    ex = client.get_executor()
    f = ex.submit(gated_value, str(gate), 1)
    opener = threading.Timer(0.3, gate.touch)  # opens the gate while shutdown(wait=True) blocks
    opener.start()
    try:
        ex.shutdown(wait=True)
        assert f.done()
    finally:
        opener.cancel()
        gate.touch()


def test_executor_submit_after_shutdown_raises(client: tidepool.Client) -> None:
    with client.get_executor() as ex:
        ex.submit(inc, 1).result(timeout=10)
    with pytest.raises(RuntimeError):
        ex.submit(inc, 2)


def test_client_is_an_executor_and_shutdown_closes_it(cluster: tidepool.LocalCluster) -> None:
    c = tidepool.Client(cluster)
    try:
        assert isinstance(c, cf.Executor)
        assert c.submit(inc, 1).result(timeout=10) == 2
        futs = c.map(inc, range(3))  # Client.map is the future-returning flavour
        assert all(isinstance(f, tidepool.Future) for f in futs)
        assert c.gather(futs) == [1, 2, 3]
    finally:
        c.shutdown()
    assert c.closed
    with pytest.raises(tidepool.SchedulerError):
        c.submit(inc, 1)


def _big(n: int) -> bytes:
    return b"v" * n


def test_a_value_not_read_before_shutdown_says_the_client_is_closed(cluster: tidepool.LocalCluster) -> None:
    """A bug hunt expected a ThreadPoolExecutor's contract (results readable after shutdown); a
    review of a fix that read every held value at shutdown showed it pulling 180 MiB into the client.
    Documented instead: values are read before; after, the error says why."""
    c = tidepool.Client(cluster)
    large = c.submit(_big, 200_000)  # read from its holder, not inline
    cf.wait([large], timeout=30)
    c.shutdown(wait=True)
    with pytest.raises(tidepool.SchedulerError, match="this client is closed"):
        large.result(timeout=10)


# ---- asyncio ------------------------------------------------------------------------------------------
def test_await_futures_and_gather_async(client: tidepool.Client) -> None:
    async def main() -> tuple[Any, ...]:
        f = client.submit(inc, 1)
        first = await f
        again = await f  # awaiting a finished future again
        many = client.map(inc, range(10))
        together = await asyncio.gather(*many)  # awaited concurrently
        nested = await client.gather_async({"a": [client.submit(inc, 10)], "b": (many[0], "plain")})
        return first, again, together, nested

    first, again, together, nested = asyncio.run(main())
    assert first == again == 2
    assert together == list(range(1, 11))
    assert nested == {"a": [11], "b": (1, "plain")}


def test_awaited_failing_future_raises_the_remote_exception(client: tidepool.Client) -> None:
    async def main() -> None:
        f = client.submit(raise_value_error, "async boom")
        with pytest.raises(ValueError, match="async boom") as info:
            await f
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "raise_value_error" in info.value.__cause__.tb
        with pytest.raises(ValueError, match="async boom"):
            await client.gather_async([client.submit(inc, 1), f])
        child = client.submit(inc, f)
        with pytest.raises(ValueError, match="async boom"):
            await child

    asyncio.run(main())


def test_await_does_not_block_the_event_loop(client: tidepool.Client, gate: Any) -> None:
    async def main() -> list[str]:
        events: list[str] = []
        blocked = client.submit(gated_value, str(gate), "gated")

        async def opener() -> None:
            events.append("loop free while awaiting")
            await asyncio.sleep(0)
            gate.touch()

        value, _ = await asyncio.gather(blocked, opener())
        events.append(value)
        return events

    assert asyncio.run(main()) == ["loop free while awaiting", "gated"]


def test_gather_async_returns_none_values(client: tidepool.Client) -> None:
    async def main() -> Any:
        return await client.gather_async([client.submit(return_none), client.submit(inc, 1)])

    assert asyncio.run(main()) == [None, 2]


def test_await_timeout_leaves_no_dangling_callback(client: tidepool.Client, gate: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    blocked = client.submit(gated_value, str(gate), 3)

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(blocked, 0.1)

    asyncio.run(main())
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        gate.touch()
        assert blocked.result(timeout=10) == 3
        # barrier: the client loop has finished the report (and its callbacks) that set the result
        client._loop.run(asyncio.sleep(0), timeout=5)
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()]


def test_released_after_await(cluster: tidepool.LocalCluster, client: tidepool.Client) -> None:
    async def main() -> str:
        f = client.submit(inc, 41)
        assert await f == 42
        return f.key

    key = asyncio.run(main())
    gc.collect()
    wait_until(lambda: task_state(cluster, key) is None, what="the awaited key to be released")


def big(i: int) -> bytes:
    return bytes(2**20) + bytes([i])  # too big to ride inline: fetched from its worker


def test_executor_map_returns_results_already_made_after_its_deadline(client: tidepool.Client) -> None:
    """Found by a bug hunt: a slow reader of ``map(timeout=)`` got ``TimeoutError`` ("could not be
    fetched within 0.0s") for results that had finished in time; the standard library returns them."""
    from tidepool.client.executor import _next_result

    futs = [client.submit(big, i) for i in (2, 1, 0)]  # the map's order, reversed: the next one last
    tidepool.wait(futs, timeout=60)
    past = time.monotonic() - 1.0  # the reader comes back after the map's deadline
    assert [_next_result(futs, past)[-1] for _ in range(3)] == [0, 1, 2]


def test_future_of_a_key_without_a_client_uses_the_default_one(client: tidepool.Client) -> None:
    """Found by a bug hunt: ``Future(key)`` (Dask's signature) made an orphan future whose
    ``result()`` raised AttributeError and whose gather hung."""
    fut = client.submit(inc, 41, key="default-client-key")
    assert tidepool.Future("default-client-key").result(timeout=60) == 42
    del fut


def test_gather_async_honours_its_timeout(client: tidepool.Client) -> None:
    """Found by a bug hunt: ``gather_async(timeout=0.5)`` waited for the whole task (4 s)."""
    never = client.submit(inc, 1, resources={"nowhere": 1})  # no worker offers it: it never runs
    with pytest.raises(TimeoutError, match="1 of 1 futures not done after 0.3s"):
        asyncio.run(client.gather_async([never], timeout=0.3))
    never.cancel()


def own_timeout() -> None:
    raise TimeoutError("the task's own timeout")


def test_gather_async_raises_a_tasks_own_timeout_error_as_itself(client: tidepool.Client) -> None:
    """Review: a task's own TimeoutError, raised while another future was pending, was replaced by
    "1 of 2 futures not done after Nones"."""
    never = client.submit(inc, 1, resources={"nowhere": 1})
    failing = client.submit(own_timeout)
    tidepool.wait([failing], timeout=60)
    with pytest.raises(TimeoutError, match="the task's own timeout"):
        asyncio.run(client.gather_async([failing, never]))
    never.cancel()
