"""A private asyncio event loop on a daemon thread, for the synchronous APIs (Client, LocalCluster).

``run(coro)`` blocks the calling thread until the coroutine finishes on the loop; calling it from
the loop thread itself would deadlock, so that raises a clear error instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tidepool.errors import TidepoolError

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "tidepool-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise TidepoolError(
                "a blocking tidepool call was made from tidepool's own event-loop thread (for example "
                "inside a done-callback); use the async API there or run it in another thread"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class ClosesOnExit:
    """``with`` support and best-effort cleanup at garbage collection for objects with ``close()``."""

    closed: bool

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            try:
                self.close()
            except Exception:
                pass
