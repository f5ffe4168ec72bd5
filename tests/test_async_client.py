"""``Client(..., asynchronous=True)`` as asyncio code uses it: awaits that give up leave nothing
behind, waiting holds no thread, and errors are exceptions, never a cancellation of the caller.
Each test here was a bug hunt's finding."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidepool
from tidepool.errors import SchedulerError

pytestmark = pytest.mark.integration


def inc(x: int) -> int:
    return x + 1


def big(n: int) -> bytes:
    return b"x" * n


def gated(path: str) -> str:
    while not Path(path).exists():
        time.sleep(0.01)
    return "opened"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=1, slots=2) as c:
        yield c


def test_gathers_given_up_hold_no_thread_and_the_client_stays_usable(cluster: tidepool.LocalCluster,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    """Before: ``await client.gather`` ran the blocking gather in the loop's default executor, so a
    gather given up by ``wait_for`` kept a thread until the task ended; six of them filled the
    executor and ``nthreads()``, DNS lookups and the client's own close stalled."""
    gate = tmp_path / "gate"

    async def main() -> tuple[Any, int, int]:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            blocked = client.submit(gated, str(gate))
            before = threading.active_count()
            for _ in range(12):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(client.gather([blocked]), 0.05)
            during = threading.active_count()
            n = await asyncio.wait_for(client.nthreads(), 10)
            gate.touch()
            assert await asyncio.wait_for(client.gather([blocked]), 30) == ["opened"]
            return n, before, during

    n, before, during = asyncio.run(main())
    assert sum(n.values()) == 2
    assert during <= before + 1  # no thread per gather given up


def test_gather_of_a_cancelled_future_raises_an_exception_not_a_cancellation(cluster: tidepool.LocalCluster) -> None:
    async def main() -> str:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            f = client.submit(inc, 1)
            await client.cancel([f])
            try:
                await client.gather([f])
            except Exception as exc:  # noqa: BLE001 - what the caller's except clause sees
                assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]
                return type(exc).__name__
            return "no error"

    assert asyncio.run(main()) == "CancelledError"
    assert issubclass(concurrent.futures.CancelledError, Exception)


def test_await_on_a_closed_client_says_it_is_closed(cluster: tidepool.LocalCluster) -> None:
    """Before: ``RuntimeError: Event loop is closed`` (and a coroutine never awaited), or a
    cancellation of the awaiting task."""

    async def main() -> None:
        client = await tidepool.Client(cluster.address, token=cluster.token, asynchronous=True)
        f = client.submit(inc, 1)
        await asyncio.wait_for(client.gather([f]), 30)
        g = client.submit(big, 100_000)  # too large to ride inline: read from its holder
        done, _ = await asyncio.get_running_loop().run_in_executor(None, concurrent.futures.wait, [g], 30)
        assert g in done  # done, its value not read yet
        await client.close()
        with pytest.raises(SchedulerError, match="this client is closed"):
            await g

    asyncio.run(main())


def test_replicate_is_awaitable(cluster: tidepool.LocalCluster) -> None:
    async def main() -> Any:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            f = client.submit(inc, 1)
            await client.gather([f])
            out = client.replicate([f])
            assert asyncio.isfuture(out) or asyncio.iscoroutine(out)
            await out
            return await client.gather([f])

    assert asyncio.run(main()) == [2]


def test_get_of_a_graph_is_awaitable_and_a_gather_of_a_generator_too(cluster: tidepool.LocalCluster) -> None:
    """``await client.get(dsk, keys)`` as in Dask (it raised "'coroutine' object is not iterable"
    and left a coroutine never awaited), and ``await client.gather(generator)``."""
    async def main() -> Any:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            got = await client.get({"a": (inc, 1), "b": (inc, "a")}, ["a", "b"])
            futs = [client.submit(inc, i) for i in range(3)]
            gen = await client.gather(f for f in futs)
            return got, list(gen)

    assert asyncio.run(main()) == ((2, 3), [1, 2, 3])


def test_gather_async_skips_errors_and_times_out_with_the_keys(cluster: tidepool.LocalCluster, tmp_path: Path) -> None:
    def boom() -> None:
        raise ValueError("boom")

    async def main() -> None:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            good, bad = client.submit(inc, 1), client.submit(boom)
            assert await client.gather([good, bad], errors="skip") == [2]
            with pytest.raises(ValueError, match="boom"):
                await client.gather([good, bad])
            blocked = client.submit(gated, str(tmp_path / "never"))
            with pytest.raises(TimeoutError, match="1 of 2 futures not done"):
                await client.gather([good, blocked], timeout=0.2)
            await client.cancel([blocked])

    asyncio.run(main())


def test_awaits_given_up_leave_no_callback_on_the_future(cluster: tidepool.LocalCluster, tmp_path: Path) -> None:
    """Before: each timed-out ``await future`` left its wake-up callback (holding its loop) on the
    future until the task ended: a server polling a long task grew by one per poll."""
    gate = tmp_path / "gate"

    async def main() -> int:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            blocked = client.submit(gated, str(gate))
            for _ in range(200):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(blocked, 0.001)
            left = len(blocked._done_callbacks)  # type: ignore[attr-defined]
            gate.touch()
            assert await asyncio.wait_for(blocked, 30) == "opened"
            return left

    assert asyncio.run(main()) <= 2


async def _async_double(x: int) -> int:
    await asyncio.sleep(0.01)
    return 2 * x


def test_an_async_def_task_is_run_to_its_end(cluster: tidepool.LocalCluster) -> None:
    """Found by a bug hunt: ``submit(async_fn)`` returned the coroutine, which failed to pickle
    ("value of type coroutine cannot be pickled"); Dask runs it.  Also for ``@task``."""
    with tidepool.Client(cluster) as client:
        assert client.submit(_async_double, 21).result(timeout=30) == 42
        assert client.gather(client.map(_async_double, [1, 2])) == [2, 4]
        assert tidepool.task(_async_double)(5).compute() == 10


def test_async_for_over_as_completed_and_await_wait(cluster: tidepool.LocalCluster, tmp_path: Path) -> None:
    """Found by a bug hunt: Dask's ``async for f in as_completed(futs)`` and ``await wait(futs)``
    with an asynchronous client raised TypeError."""
    gate = tmp_path / "gate"

    async def main() -> tuple[list[Any], list[Any]]:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            futs = client.map(inc, range(3))
            done, not_done = await tidepool.wait(futs, timeout=30)
            assert done == set(futs) and not not_done
            got = sorted([await f async for f in tidepool.as_completed(futs)])
            pairs = sorted([v async for _, v in tidepool.as_completed(futs, with_results=True)])
            blocked = client.submit(gated, str(gate))
            with pytest.raises(TimeoutError):
                await tidepool.wait([blocked], timeout=0.1)
            with pytest.raises(TimeoutError):
                async for _ in tidepool.as_completed([blocked], timeout=0.1):
                    pass
            gate.touch()
            assert [f async for f in tidepool.as_completed([blocked])] == [blocked]
            return got, pairs

    got, pairs = asyncio.run(main())
    assert got == pairs == [1, 2, 3]


def test_compute_with_a_progress_bar_on_an_asynchronous_client_is_refused(cluster: tidepool.LocalCluster) -> None:
    """Found by a bug hunt: the bar waited for the graph on the caller's loop (frozen for the whole
    run) and showed no workers or forecast (the client's calls there return awaitables)."""

    async def main() -> None:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            with pytest.raises(tidepool.ConfigError, match="would block this event loop"):
                client.compute(tidepool.task(inc)(1), progress=True)
            assert await client.compute(tidepool.task(inc)(1)) == 2

    asyncio.run(main())


def test_many_awaiters_of_a_future_completed_in_another_thread_all_wake() -> None:
    """Found by a review: an awaiter that woke removed its callback from the list the completing
    thread was still walking, so the next callback was skipped: other awaiters hung for ever and a
    user's done-callback never ran (18 of 20 trials of 300 awaiters)."""
    from tidepool.futures import Future

    class Owner:
        def on_loop_thread(self) -> bool:
            return False

        def pin(self, f: Any) -> None:
            pass

    async def main() -> list[int]:
        lost = []
        for _ in range(10):
            f: Future[int] = Future("k", None, Owner())  # type: ignore[arg-type]
            ran: list[int] = []

            async def waiter(fut: Future[int]) -> int:
                return await fut

            tasks = [asyncio.create_task(waiter(f)) for _ in range(300)]
            await asyncio.sleep(0.01)  # every awaiter has added its callback
            f.add_done_callback(ran.append)
            t = threading.Thread(target=f.set_result, args=(42,))
            t.start()
            done, pending = await asyncio.wait(tasks, timeout=30)
            t.join()
            for p in pending:
                p.cancel()
            lost.append(len(pending) + (0 if ran else 1))
        return lost

    assert asyncio.run(main()) == [0] * 10


def test_dask_async_cluster_habits_work_or_say_what_to_do() -> None:
    """Found by a bug hunt: Dask's ``async with LocalCluster(asynchronous=True)`` failed with a list of
    keywords, and ``async with LocalCluster()`` with a TypeError."""
    with pytest.raises(tidepool.ConfigError, match=r"Client\(cluster, asynchronous=True\)"):
        tidepool.LocalCluster(n_workers=0, asynchronous=True)

    async def main() -> tuple[int, bool]:
        async with tidepool.LocalCluster(n_workers=1) as cluster:
            async with tidepool.Client(cluster, asynchronous=True) as client:
                got = await client.submit(inc, 1)
        return got, cluster.closed

    assert asyncio.run(main()) == (2, True)


def _nap(x: int, d: float) -> int:
    import time

    time.sleep(d)
    return x


def test_a_cancelled_await_kept_by_the_caller_does_not_keep_the_future() -> None:
    # found by a concurrency hunt: the CancelledError of an await held its frame, which held the
    # future: a caller keeping the error (gather(..., return_exceptions=True)) kept the key held
    import gc

    with tidepool.LocalCluster(n_workers=1) as cluster:

        async def main() -> list[str]:
            async with tidepool.Client(cluster.address, token=cluster.token, asynchronous=True) as c:
                f = c.submit(_nap, 1, 0.5)

                async def waits() -> int:
                    return await f  # noqa: F821 - a closure: `del f` below empties its cell

                t = asyncio.ensure_future(waits())
                await asyncio.sleep(0.1)
                t.cancel()
                kept = (await asyncio.gather(t, return_exceptions=True))[0]
                assert isinstance(kept, asyncio.CancelledError)
                del f, t
                g = c.submit(_nap, 2, 0.5)  # the same through gather_async (a review)

                async def gathers() -> list[int]:
                    return await c.gather_async([g])  # type: ignore[no-any-return]  # noqa: F821

                t2 = asyncio.ensure_future(gathers())
                await asyncio.sleep(0.1)
                t2.cancel()
                kept2 = (await asyncio.gather(t2, return_exceptions=True))[0]
                assert isinstance(kept2, asyncio.CancelledError)
                del g, t2
                gc.collect()
                return list(c._connection.core.futures)

        assert asyncio.run(main()) == []
