"""A client of a LocalCluster shares its scheduler's event-loop thread: nothing the client does
there may hold that thread for a time the user's data decides (real processes and sockets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import tidepool

pytestmark = pytest.mark.integration


def _value_that_says_where_it_was_unpickled() -> Any:
    import threading

    def rebuild(payload: bytes) -> tuple[str, int]:
        import threading

        return threading.current_thread().name, len(payload)

    class Where:  # local: pickled by value (cloudpickle), so the client needs no module of ours
        def __reduce__(self) -> Any:
            return rebuild, (b"x" * 100_000,)  # large: read from the worker, unpickled off the loop

    del threading
    return Where()


def test_a_value_read_from_a_worker_is_not_unpickled_on_the_schedulers_thread() -> None:
    """Unpickling a large value runs the user's code (reconstructors, imports) for as long as it
    takes; on the scheduler's thread that time stops every worker's and client's traffic.  Before the fix it
    ran there: the value said it was rebuilt in ``tidepool-cluster``."""
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        where, n = client.submit(_value_that_says_where_it_was_unpickled).result(timeout=60)
        assert n == 100_000
        assert where != cluster._loop.thread.name, where


def test_a_client_collected_on_the_schedulers_thread_leaves_the_scheduler() -> None:
    """A Client is in reference cycles (its spec builder points back at it), so the cyclic garbage
    collector frees it, in whichever thread it runs: now often the scheduler's, which does most of
    the allocating.  Its close() then ran on its own loop thread, where the blocking close raised
    (and was swallowed): the connection stayed open, so the scheduler kept the client, its tasks and
    their values for ever.  Before the fix the client never left."""
    import gc

    from tidepool.testing import wait_until

    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster:
        client = tidepool.Client(cluster)
        assert client.submit(len, "abc").result(timeout=60) == 3
        assert len(cluster.scheduler.client_conns) == 1
        del client

        async def collect() -> None:
            gc.collect()

        cluster._loop.run(collect())  # the collection (and the client's __del__) on the scheduler's thread
        wait_until(lambda: not cluster.scheduler.client_conns, timeout=30)


def _small_value_that_says_whether_the_client_lock_was_held() -> Any:
    # rebuilt by eval (a builtin: the pickle stays small, so it comes inline with the report)
    check = ("any(c()._connection.lock._is_owned() for c in "
             "__import__('tidepool.client.api', fromlist=['created']).created if c() is not None)")  # fmt: skip

    class Probe:
        def __reduce__(self) -> Any:
            return eval, (check,)

    return Probe()


def test_an_inline_value_is_not_unpickled_under_the_client_lock() -> None:
    """The scheduler's thread takes the client's lock to apply every report of a client of a
    LocalCluster; the user's unpickling code, under that lock in the thread that asked for the
    value, stopped the scheduler whenever a report came meanwhile.  Before the fix the value said
    the lock was held while it was rebuilt."""
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(_small_value_that_says_whether_the_client_lock_was_held)
        fut.exception(timeout=60)
        assert client._connection.core.inline, "the value was meant to come inline"
        assert fut.result(timeout=60) is False


def _value_rebuilt_once_its_cluster_stops() -> Any:
    # rebuilt (in the client) only once the scheduler's loop thread is gone: the fetch is still
    # waiting on the loop when its cluster stops it
    wait = ("[__import__('time').sleep(0.01) for _ in iter(lambda: any(c().cluster._loop.thread.is_alive() "
            "for c in __import__('tidepool.client.api', fromlist=['created']).created if c() is not None), False)]"
            " and None or b'x' * 4096")  # fmt: skip

    class Late:
        def __reduce__(self) -> Any:
            return eval, (wait, {"pad": b"x" * 100_000})  # large: read from the worker, off the loop

    return Late()


def test_a_fetch_cut_by_its_cluster_closing_fails_with_connection_lost() -> None:
    """The cluster stopping its loop cancels what the client's calls wait for there; the caller got
    ``concurrent.futures.CancelledError``, which says the future was cancelled (it was not), instead
    of :class:`ConnectionLostError` as every other call of a client whose cluster closed."""
    import threading

    from tidepool.errors import ConnectionLostError

    cluster = tidepool.LocalCluster(n_workers=1, dashboard=False)
    client = tidepool.Client(cluster)
    try:
        fut = client.submit(_value_rebuilt_once_its_cluster_stops)
        fut.exception(timeout=60)
        out: list[BaseException | bytes] = []

        def fetch() -> None:
            try:
                out.append(fut.result(timeout=60))
            except BaseException as exc:  # noqa: BLE001 - what the caller sees is the point
                out.append(exc)

        t = threading.Thread(target=fetch)
        t.start()
        from tidepool.testing import wait_until

        wait_until(lambda: bool(client._connection._workers), timeout=30)  # reading from the worker
        cluster.close()
        t.join(60)
        assert len(out) == 1 and isinstance(out[0], ConnectionLostError), out
    finally:
        client.close()
        cluster.close()


def _raise_rebuilt_by(rebuild: Callable[[], BaseException]) -> None:
    """Raise an exception whose unpickling, where it is read (the client), is ``rebuild()``: the
    user's code that runs when a task's exception is read."""

    class Rebuilt(Exception):  # local: pickled by value, with ``rebuild``
        def __reduce__(self) -> Any:
            return rebuild, ()

    raise Rebuilt()


def _raise_an_exception_that_says_where_it_was_unpickled() -> None:
    def rebuild() -> RuntimeError:
        import threading

        return RuntimeError(threading.current_thread().name)

    _raise_rebuilt_by(rebuild)


def test_a_tasks_exception_is_not_unpickled_on_the_schedulers_thread() -> None:
    """A task's exception comes back pickled; unpickling it runs the user's code (its
    ``__reduce__``), which on the scheduler's thread would stop every worker's and client's
    traffic for as long as it takes.  Before the fix the exception said it was rebuilt in
    ``tidepool-cluster``."""
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(_raise_an_exception_that_says_where_it_was_unpickled)
        with pytest.raises(RuntimeError) as info:
            fut.result(timeout=60)
        assert str(info.value) and str(info.value) != cluster._loop.thread.name, str(info.value)


def test_a_client_with_its_own_cluster_collected_on_that_clusters_thread_closes_the_cluster() -> None:
    """``Client()`` starts a LocalCluster of its own and closes it with itself.  Collected by the
    garbage collector on that cluster's loop thread, the cluster's close could not wait on its
    own loop there: the scheduler stayed open (its listening socket leaked) until the process
    ended.  Before the fix the scheduler never closed."""
    import gc

    from tidepool.testing import wait_until

    client = tidepool.Client()  # with a LocalCluster of its own
    cluster = client.cluster
    assert isinstance(cluster, tidepool.LocalCluster)
    assert client.submit(len, "abcd").result(timeout=60) == 4
    loop = cluster._loop
    del client

    async def collect() -> None:
        gc.collect()

    loop.run(collect())  # the collection (and the client's __del__) on the cluster's own thread
    wait_until(lambda: cluster.closed and cluster.scheduler._closed, timeout=30)
    wait_until(lambda: not loop.thread.is_alive(), timeout=30)


def test_a_key_failed_while_its_exception_is_being_built_can_be_asked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A report's exception is built off the loop, so for a moment the key has failed and its
    future is still pending; a new future of that key built its exception then, and the build off
    the loop finished first: failing the future again raised ``InvalidStateError`` in
    ``submit``.  Before the fix that error came out of ``futures_of``."""
    from tidepool.client import api

    with tidepool.LocalCluster(n_workers=0, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        conn = client._connection
        fut = client._new_future("k")  # pending: nothing was submitted
        with conn.lock:
            conn.core.errors["k"] = {"type": "ValueError", "message": "boom", "origin": "k", "exception": None,
                                     "traceback": ""}  # fmt: skip
        real = api.make_exception

        def built_off_the_loop_first(key: str, info: dict[str, Any]) -> BaseException:
            fut.set_exception(RuntimeError("built off the loop first"))
            return real(key, info)

        monkeypatch.setattr(api, "make_exception", built_off_the_loop_first)
        again = client._new_future("k")
        assert again is fut and isinstance(fut.exception(timeout=0), RuntimeError)


def test_a_tasks_exception_is_built_inline_when_no_thread_can_be_had() -> None:
    """At interpreter shutdown the default executor refuses new work; the exception is then built
    on the loop rather than failing the whole connection."""
    import asyncio

    from tidepool.client.connection import off_loop

    async def main() -> BaseException:
        loop = asyncio.get_running_loop()

        def refuse(*args: Any) -> Any:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

        loop.run_in_executor = refuse  # type: ignore[method-assign]
        return await off_loop(lambda: ValueError("built inline"), None)

    exc = asyncio.run(main())
    assert isinstance(exc, ValueError) and str(exc) == "built inline"


def _raise_an_exception_that_waits_for_a_gate() -> None:
    def rebuild() -> RuntimeError:
        import builtins

        gate = getattr(builtins, "_tidepool_test_gate", None)
        first = not getattr(builtins, "_tidepool_test_gate_used", False)
        builtins._tidepool_test_gate_used = True  # type: ignore[attr-defined]
        if gate is not None and first:
            gate.wait(30)  # the first one built is held until the test opens it
        return RuntimeError("the task's own error")

    _raise_rebuilt_by(rebuild)


def test_closing_the_client_while_an_exception_is_built_keeps_the_tasks_own_error() -> None:
    """Closing a client fails its pending futures; a failed task whose exception was still being
    unpickled was pending, and lost its own error to "client closed".  Before the fix the future
    ended with ``TaskCancelledError``."""
    import builtins
    import threading

    from tidepool.testing import wait_until

    gate = threading.Event()
    builtins._tidepool_test_gate = gate  # type: ignore[attr-defined]
    try:
        with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster:
            client = tidepool.Client(cluster)
            fut = client.submit(_raise_an_exception_that_waits_for_a_gate)
            wait_until(lambda: fut.key in client._connection.core.errors, timeout=60)  # reported, being built
            closing = threading.Thread(target=client.close)
            closing.start()
            # the gate opens once the close is under way with the build still held (or, before the
            # fix, once the close has failed the future: it did not wait for the build)
            wait_until(lambda: fut.done() or (client.closed and bool(getattr(client._connection, "_building", ()))),
                       timeout=30)  # fmt: skip
            gate.set()
            closing.join(60)
            assert not closing.is_alive()
            err = fut.exception(timeout=0)
            assert isinstance(err, RuntimeError) and str(err) == "the task's own error", repr(err)
    finally:
        gate.set()
        del builtins._tidepool_test_gate  # type: ignore[attr-defined]
        vars(builtins).pop("_tidepool_test_gate_used", None)


def _raise_an_exception_that_notes_its_builds() -> None:
    def rebuild() -> RuntimeError:
        import builtins
        import time

        notes: list[str] = builtins._tidepool_test_builds  # type: ignore[attr-defined]
        me = "downstream" if any(n.endswith("start") for n in notes) else "cause"
        notes.append(f"{me} start")
        if me == "cause":  # a moment for a build of the other one to start beside it, if one can
            until = time.monotonic() + 2.0
            while "downstream start" not in notes and time.monotonic() < until:
                time.sleep(0.01)
        notes.append(f"{me} end")
        return RuntimeError("the task's own error")

    _raise_rebuilt_by(rebuild)


def test_a_failure_and_the_failures_it_causes_reach_their_futures_in_order() -> None:
    """A task's exception is unpickled in a thread; a task downstream of it fails with the same
    exception, reported in the same or a later message.  With builds on any free thread the
    downstream one started beside its cause's and could finish (and fail its future) first.  Now
    they run one after the other, in the order reported.  Before the fix the notes read "cause
    start, downstream start, downstream end, cause end"."""
    import builtins

    from tidepool.testing import wait_until

    notes: list[str] = []
    builtins._tidepool_test_builds = notes  # type: ignore[attr-defined]
    order: list[str] = []
    try:
        with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
            cause = client.submit(_raise_an_exception_that_notes_its_builds)
            downstream = client.submit(len, cause)
            cause.add_done_callback(lambda f: order.append("cause"))
            downstream.add_done_callback(lambda f: order.append("downstream"))
            wait_until(lambda: len(order) == 2, timeout=60)
            assert notes == ["cause start", "cause end", "downstream start", "downstream end"], notes
            assert order == ["cause", "downstream"]
            assert str(downstream.exception(timeout=0)) == "the task's own error"
    finally:
        del builtins._tidepool_test_builds  # type: ignore[attr-defined]
