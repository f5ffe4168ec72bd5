"""Client-side futures: ``concurrent.futures.Future`` subclasses whose value stays on a worker.

A future becomes *done* when the scheduler reports its key in memory (or erred); the value is
fetched from the worker that holds it on the first ``result()`` call and then cached.  Callbacks run
on the client's callback thread (never on its event-loop thread), so a callback may call
``result()``.  ``await future`` works from any asyncio loop.  Dropping the last reference to a future
releases the key on the scheduler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from tidepool.client import Client

T = TypeVar("T")


class _InMemory:
    def __repr__(self) -> str:
        return "<in memory on a worker>"


IN_MEMORY: Any = _InMemory()
_UNSET: Any = object()


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_loop(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    if loop.is_closed():
        return  # the awaiting coroutine gave up (timeout) and its loop is gone
    try:
        loop.call_soon_threadsafe(_set_none, fut)
    except RuntimeError:
        pass


class Future(concurrent.futures.Future, Generic[T]):  # type: ignore[type-arg]
    """A task's eventual value.  Also a ``concurrent.futures.Future`` and awaitable."""

    def __init__(self, key: str, client: Client) -> None:
        super().__init__()
        self.key = key
        self.client = client
        self._value: Any = _UNSET
        self.__weakref__: Any

    @property
    def status(self) -> str:
        if self.cancelled():
            return "cancelled"
        if not self.done():
            return "pending"
        return "error" if super().exception(0) is not None else "finished"

    def result(self, timeout: float | None = None) -> T:
        v = super().result(timeout)
        if v is not IN_MEMORY:
            return v  # type: ignore[no-any-return]
        if self._value is _UNSET:
            self._value = self.client._fetch_one(self, timeout)
        return self._value  # type: ignore[no-any-return]

    def cancel(self) -> bool:
        """Release the key on the scheduler (stopping the task if nothing else needs it)."""
        if self.cancelled():
            return True
        if self.done():
            return False
        self.client.cancel([self])
        return super().cancel()

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:  # type: ignore[override]
        pool = self.client._callbacks

        def run(f: concurrent.futures.Future[Any]) -> None:
            pool.submit(fn, f)  # type: ignore[arg-type]

        super().add_done_callback(run)

    def _add_raw_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        super().add_done_callback(fn)

    def __await__(self) -> Any:
        return self._aresult().__await__()

    async def _aresult(self) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake(_: Any) -> None:
            _wake_loop(loop, done)

        self._add_raw_callback(wake)
        await done
        v = super().result(0)
        if v is not IN_MEMORY:
            return v  # type: ignore[no-any-return]
        if self._value is _UNSET:
            cf = self.client._loop.submit(self.client._fetch([self.key], None))
            values = await asyncio.wrap_future(cf)
            self._value = values[self.key]
        return self._value  # type: ignore[no-any-return]

    def release(self) -> None:
        """Tell the scheduler this client no longer needs the value."""
        self.client._release([self.key])

    def __repr__(self) -> str:
        return f"<tidepool.Future {self.key} {self.status}>"

    def __reduce__(self) -> Any:
        from tidepool.errors import ConfigError

        raise ConfigError(
            "a tidepool Future cannot be pickled; pass it directly as a task argument (it becomes a "
            "dependency) instead of inside an object that gets pickled"
        )
