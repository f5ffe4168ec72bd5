"""``client.get_executor()``: a strict ``concurrent.futures.Executor`` over a tidepool client.

No state beyond the futures it made (weakly held) and whether it was shut down.  It submits
through the client's public calls and keeps its futures alive through their owner (the client's
connection, a :class:`~tidepool.futures.FutureOwner`).
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tidepool.errors import ConfigError
from tidepool.futures import Future, FutureOwner
from tidepool.resources import parse_resources

T = TypeVar("T")


class ClientExecutor(concurrent.futures.Executor):
    """A strict ``concurrent.futures.Executor`` on top of a :class:`Client`.

    Every keyword of ``submit`` goes to the function; the executor's ``resources`` and ``retries``
    apply to every task.  Its futures are kept alive until done (as a ``ThreadPoolExecutor`` runs
    work nobody holds), ``map`` yields results in input order without keeping those already
    yielded, and ``shutdown(cancel_futures=True)`` cancels the futures not started yet.
    """

    def __init__(self, client: Any, owner: FutureOwner, resources: dict[str, Any] | None, retries: int) -> None:
        self.client = client
        self._owner = owner
        self.resources = parse_resources(resources) if resources else None
        self.retries = retries
        self._futures: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        self._shutdown = False

    def _check(self) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:  # type: ignore[override]
        self._check()
        fut = self.client._submit(fn, args, kwargs, resources=self.resources, retries=self.retries)
        self._owner.pin(fut)
        self._futures.add(fut)
        return fut

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[T]:  # fmt: skip
        """``concurrent.futures.Executor.map``: results in input order, lazily.

        Every item is one task (``chunksize`` must be a positive integer, as for a
        ``ProcessPoolExecutor``, and is otherwise ignored).  ``timeout`` counts from this call.
        Leaving the iterator early (an error, a timeout, ``close()``) cancels the tasks not
        started yet.
        """
        if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
            raise ConfigError(f"chunksize must be a positive integer, got {chunksize!r} (tidepool runs each "
                              "item as its own task, so any value from 1 up works the same)")  # fmt: skip
        self._check()
        end = None if timeout is None else time.monotonic() + timeout
        futs = self.client.map(fn, *iterables, resources=self.resources, retries=self.retries)
        for f in futs:
            self._owner.pin(f)
        self._futures.update(futs)
        futs.reverse()
        return _results_in_order(self._owner, futs, end)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; ``cancel_futures``: cancel the futures whose tasks have not started
        (running and finished ones are left alone); ``wait``: wait until every future is done."""
        self._shutdown = True
        futs = [f for f in list(self._futures) if not f.done()]
        if cancel_futures:
            self._owner.cancel(futs, unless_started=True)
        if wait:
            concurrent.futures.wait(futs)


def _results_in_order(owner: FutureOwner, futs: list[Future[T]], end: float | None) -> Iterator[T]:
    """Yield the results of ``futs`` (reversed: the next one last), dropping each future as its
    result is yielded; cancel those left when the caller stops early (as the standard library)."""
    try:
        while futs:
            yield _next_result(futs, end)
    finally:
        if futs:
            owner.cancel(futs, unless_started=True)


def _next_result(futs: list[Future[T]], end: float | None) -> T:
    # a result that is ready is returned whatever the deadline (as the standard library's map):
    # the deadline bounds waiting for tasks, not a slow reader fetching values already made
    fut = futs[-1]
    value = fut.result(None if end is None or fut.done() else max(0.0, end - time.monotonic()))
    futs.pop()  # only now: a future that raised is still in ``futs``, so it is cancelled too
    return value
