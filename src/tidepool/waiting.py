"""Waiting on many futures, with Dask's names: :func:`wait` and :class:`as_completed`.

State: an :class:`as_completed` holds the futures not yet yielded and a queue of those that
finished (filled by done-callbacks, from whatever thread completed them), guarded by one condition
variable.  Both work on any ``concurrent.futures.Future``, tidepool's included, so user code written
for ``distributed`` keeps working unchanged; tidepool futures are watched through
:func:`tidepool.futures.add_raw_callback` (no hop to the client's callback thread).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from tidepool.errors import ConfigError
from tidepool.futures import Future, _wake_loop, add_raw_callback

_WHEN = {
    "ALL_COMPLETED": concurrent.futures.ALL_COMPLETED,
    "FIRST_COMPLETED": concurrent.futures.FIRST_COMPLETED,
    "FIRST_EXCEPTION": concurrent.futures.FIRST_EXCEPTION,
}


class DoneAndNotDone(NamedTuple):
    done: set[Any]
    not_done: set[Any]


def wait(fs: Any, timeout: float | None = None, return_when: str = "ALL_COMPLETED") -> DoneAndNotDone:
    """Block until the futures are done (``return_when`` as in Dask and ``concurrent.futures``).

    Like Dask, and unlike ``concurrent.futures.wait``, it raises :class:`TimeoutError` when
    ``timeout`` passes before the condition holds.  ``fs`` may be one future or an iterable.
    """
    if return_when not in _WHEN:
        raise ConfigError(f"return_when must be one of {sorted(_WHEN)}, got {return_when!r}")
    futs = futures_in(fs, "wait()")
    if _asynchronous(futs):  # ``await wait(futures)``, as with an asynchronous Dask client
        return _wait_async(futs, timeout, return_when)  # type: ignore[return-value]
    done, not_done = concurrent.futures.wait(futs, timeout=_bounded(timeout), return_when=_WHEN[return_when])
    if not _holds(return_when, done, not_done):
        raise _timed_out(return_when, done, not_done, timeout)
    return DoneAndNotDone(set(done), set(not_done))


def _asynchronous(futs: list[concurrent.futures.Future[Any]]) -> bool:
    """Called from a coroutine on futures of an asynchronous client: the caller awaits."""
    if not any(getattr(getattr(f, "client", None), "asynchronous", False) for f in futs):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _wait_async(futs: list[concurrent.futures.Future[Any]], timeout: float | None,
                      return_when: str) -> DoneAndNotDone:  # fmt: skip
    """:func:`wait` on the caller's loop, holding no thread; the same conditions and errors."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def poke(_: Any) -> None:  # in whatever thread completed a future
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(changed.set)

    for f in futs:
        add_raw_callback(f, poke)
    deadline = None if _bounded(timeout) is None else loop.time() + timeout  # type: ignore[operator]
    try:
        while True:
            changed.clear()
            done = {f for f in futs if f.done()}
            not_done = set(futs) - done
            if _holds(return_when, done, not_done):
                return DoneAndNotDone(done, not_done)
            left = None if deadline is None else deadline - loop.time()
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                raise _timed_out(return_when, done, not_done, timeout) from None
    finally:
        for f in futs:
            if isinstance(f, Future):
                f._remove_raw_callback(poke)


def _holds(return_when: str, done: set[Any], not_done: set[Any]) -> bool:
    """Whether ``return_when`` holds for these futures (a wait that returns without it timed out)."""
    if not not_done:
        return True
    if return_when == "FIRST_COMPLETED":
        return bool(done)
    if return_when == "FIRST_EXCEPTION":
        return any(not f.cancelled() and f.exception() is not None for f in done)
    return False


def _timed_out(return_when: str, done: set[Any], not_done: set[Any], timeout: float | None) -> TimeoutError:
    """The error of a wait whose ``timeout`` passed before ``return_when`` held, as Dask raises it."""
    n = len(done) + len(not_done)
    if return_when == "ALL_COMPLETED":
        return TimeoutError(f"{len(not_done)} of {n} futures not done after {timeout}s")
    if not done:
        return TimeoutError(f"none of {n} futures done after {timeout}s")
    # FIRST_EXCEPTION: some are done, none failed (a bug hunt could not tell this timeout from a
    # completed wait)
    return TimeoutError(f"no future failed and {len(not_done)} of {n} not done after {timeout}s")


def futures_in(fs: Any, call: str) -> list[concurrent.futures.Future[Any]]:
    """The futures ``fs`` stands for: one future, an iterable of them (a dict's values), or a
    persisted Dask collection (the futures its graph points at, as Dask's ``wait`` takes it).
    Anything else is refused with what to pass instead, before any waiting."""
    if isinstance(fs, concurrent.futures.Future):
        return [fs]
    graph = getattr(fs, "__dask_graph__", None)
    if callable(graph):  # a Dask collection: persisted, its graph points at futures (and aliases of them)
        values = list(dict(graph()).values())
        futs = [v for v in values if isinstance(v, concurrent.futures.Future)]
        if values and not futs:
            raise ConfigError(f"{call} was given a Dask collection that is not persisted (its graph holds no "
                              "futures): persist it first, x = client.persist(x), or wait on client.compute(x)")  # fmt: skip
        return futs
    if isinstance(fs, dict):
        fs = fs.values()
    if isinstance(fs, (str, bytes)) or not isinstance(fs, Iterable):
        raise ConfigError(f"{call} takes a future, an iterable of futures or a persisted Dask collection, "
                          f"got {type(fs).__name__}")  # fmt: skip
    futs = list(fs)
    for f in futs:
        if not isinstance(f, concurrent.futures.Future):
            raise ConfigError(f"{call} takes futures, got {type(f).__name__} among them ({f!r:.60}): pass the "
                              "futures that submit/map/compute return (or a persisted Dask collection)")  # fmt: skip
    return futs


def _bounded(timeout: float | None) -> float | None:
    """``timeout`` as the standard library's waits take it: beyond what a lock wait can hold
    (``inf``, 1e12) is no timeout (they raise OverflowError for it)."""
    if timeout is not None and timeout >= threading.TIMEOUT_MAX:
        return None
    return timeout


class as_completed:  # noqa: N801 - Dask's name, so ported code reads the same
    """Iterate over futures in the order they finish; more may be :meth:`add`-ed meanwhile.

    ``with_results=True`` yields ``(future, result)``; a failed future then raises its exception
    (``raise_errors=True``, the default) or yields ``(future, exception)``.  ``timeout`` (seconds
    from this call, as in Dask): waiting for the next future past it raises :class:`TimeoutError`.
    """

    def __init__(self, futures: Iterable[concurrent.futures.Future[Any]] = (), *,
                 with_results: bool = False, raise_errors: bool = True, timeout: float | None = None) -> None:  # fmt: skip
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or math.isnan(timeout) or timeout < 0):  # fmt: skip
            raise ConfigError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        self.with_results = with_results
        self.raise_errors = raise_errors
        self.timeout = timeout
        self._deadline = None if _bounded(timeout) is None else time.monotonic() + timeout  # type: ignore[operator]
        self._cond = threading.Condition()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._done: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []  # ``async for``
        self.update(futures)

    def add(self, future: concurrent.futures.Future[Any]) -> None:
        """Also yield ``future`` when it finishes."""
        with self._cond:
            self._pending.add(future)
        add_raw_callback(future, self._finished)  # tidepool futures: no hop to the callback thread

    def update(self, futures: Iterable[concurrent.futures.Future[Any]]) -> None:
        for f in futures:
            self.add(f)

    def _finished(self, future: concurrent.futures.Future[Any]) -> None:
        wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        with self._cond:
            if future in self._pending:
                self._pending.discard(future)
                self._done.append(future)
                self._cond.notify_all()
                wakers, self._wakers = self._wakers, []
        for loop, waiter in wakers:
            _wake_loop(loop, waiter)

    def count(self) -> int:
        """Futures not yielded yet (pending or finished)."""
        with self._cond:
            return len(self._pending) + len(self._done)

    __len__ = count

    def is_empty(self) -> bool:
        return self.count() == 0

    def clear(self) -> None:
        """Forget every future not yielded yet."""
        with self._cond:
            self._pending.clear()
            self._done.clear()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._cond:
            while not self._done:
                if not self._pending:
                    raise StopIteration
                self._wait()
            f = self._done.popleft()
        return self._item(f)

    def __aiter__(self) -> as_completed:
        return self

    async def __anext__(self) -> Any:
        """``async for`` (as with an asynchronous Dask client): waits on the caller's loop, holding
        no thread; a result is awaited, not read with a blocking call."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._done:
                    f = self._done.popleft()
                    break
                if not self._pending:
                    raise StopAsyncIteration
                waiter: asyncio.Future[None] = loop.create_future()
                self._wakers.append((loop, waiter))
            left = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                raise TimeoutError(f"{len(self._pending)} futures still not done {self.timeout}s after "
                                   "as_completed() was called") from None  # fmt: skip
            finally:
                with self._cond:
                    if (loop, waiter) in self._wakers:
                        self._wakers.remove((loop, waiter))
        if not self.with_results or f.cancelled() or f.exception() is not None or not isinstance(f, Future):
            return self._item(f)
        return f, await f

    def next_batch(self, block: bool = True) -> list[Any]:
        """Everything finished so far (at least one if ``block`` and any are pending)."""
        with self._cond:
            while block and not self._done and self._pending:
                self._wait()
            batch, self._done = list(self._done), collections.deque()
        return [self._item(f) for f in batch]

    def _wait(self) -> None:
        """Wait (holding the condition) for a finish, or raise past the deadline."""
        if self._deadline is None:
            self._cond.wait()
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(self._pending)} futures still not done {self.timeout}s after "
                               "as_completed() was called")  # fmt: skip
        self._cond.wait(left)

    def batches(self) -> Iterator[list[Any]]:
        while not self.is_empty():
            yield self.next_batch(block=True)

    def _item(self, f: concurrent.futures.Future[Any]) -> Any:
        if not self.with_results:
            return f
        if f.cancelled():
            exc: BaseException = concurrent.futures.CancelledError()
        else:
            e = f.exception()
            if e is None:
                return f, f.result()
            exc = e
        if self.raise_errors:
            raise exc
        return f, exc

