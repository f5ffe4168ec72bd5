"""A private asyncio event loop on a daemon thread, for the synchronous APIs (Client, LocalCluster).

``run(coro)`` blocks the calling thread until the coroutine finishes on the loop; calling it from
the loop thread itself would deadlock, so that raises a clear error instead.

Which event loop: :func:`new_event_loop` makes every loop tidepool runs (this thread's, and the
scheduler's and workers' processes' through ``cli.py``).  With the optional ``uvloop`` installed
(``pip install 'tidepool[fast]'``) it is uvloop, whose socket and callback paths are native code:
about a tenth off the synchronous ``submit().result()`` round trip (``benchmarks/roundtrip.py``);
the environment variable ``TIDEPOOL_LOOP=asyncio`` forces the standard loop (``uvloop`` demands
uvloop, failing clearly when it is missing).  A process spawned by tidepool inherits the variable.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import importlib.util
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from tidepool.errors import TidepoolError

T = TypeVar("T")

#: the environment variable that picks the event loop: "asyncio", "uvloop", or "auto"/unset
LOOP_ENV = "TIDEPOOL_LOOP"


def loop_kind() -> str:
    """"uvloop" or "asyncio": what :func:`new_event_loop` makes here (see the module docstring)."""
    asked = os.environ.get(LOOP_ENV, "").strip().lower() or "auto"
    if asked == "asyncio":
        return "asyncio"
    installed = importlib.util.find_spec("uvloop") is not None
    if asked == "uvloop":
        if not installed:
            raise TidepoolError(f"{LOOP_ENV}=uvloop but uvloop is not installed here; "
                                "pip install 'tidepool[fast]', or unset it")  # fmt: skip
        return "uvloop"
    if asked != "auto":
        raise TidepoolError(f"{LOOP_ENV}={asked!r} is not a loop tidepool knows; use asyncio, uvloop or auto")
    return "uvloop" if installed else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind :func:`loop_kind` picks."""
    if loop_kind() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    def __init__(self, name: str = "tidepool-loop") -> None:
        self.loop = new_event_loop()
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

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, *, interruptible: bool = False) -> T:
        """Run ``coro`` on this loop and wait for it; a timeout cancels it there, and so does a
        ``KeyboardInterrupt`` in the waiting thread when ``interruptible`` (a read or a request:
        nobody wants its answer any more; a close is not, it runs to its end)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise TidepoolError(
                "a blocking tidepool call was made from tidepool's own event-loop thread (for example "
                "inside a done-callback); use the async API there or run it in another thread"
            )
        if self.loop.is_closed():  # stopped (a shared loop's owner closed): not a RuntimeError later
            coro.close()
            raise TidepoolError(f"tidepool's event loop ({self.thread.name}) is closed")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise
        except KeyboardInterrupt:
            if interruptible:  # an interrupted gather read on in the background (a concurrency hunt
                fut.cancel()  # saw the next one take 3x as long)
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop, stop it, join the thread and close the loop.

        Tasks are cancelled (and given up to half of ``timeout`` to finish) *before* the loop
        closes, so none is destroyed pending ("Task was destroyed but it is pending!").  Cancelling
        is repeated: a task can swallow one cancellation (Python 3.11's ``asyncio.wait_for`` returns
        the result when its awaitable finished in the same step).  Daemon threads still running a
        blocking call must tolerate a closed loop (``call_soon_threadsafe`` raises RuntimeError).
        From the loop's own thread it can only ask the loop to stop; nothing is joined or closed.
        """
        if self.loop.is_closed():
            return
        if threading.current_thread() is self.thread:
            self.loop.stop()
            return
        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(_cancel_remaining(timeout / 2), timeout)
            with contextlib.suppress(RuntimeError):  # closed meanwhile by another stop()
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


async def _cancel_remaining(timeout: float) -> None:
    """Cancel every other task on this loop until none is left or ``timeout`` seconds have passed."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    deadline = loop.time() + timeout
    while True:
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        left = deadline - loop.time()
        if not tasks or left <= 0:
            break
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=min(left, 0.1))
    await loop.shutdown_asyncgens()


def in_daemon_thread_future(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a daemon thread, as a future of this loop: a call that never returns
    holds neither the loop nor the interpreter's exit (the default executor's threads are joined
    at shutdown).  Its outcome, an exception included (``SystemExit`` too), settles the future."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def run() -> None:
        value: Any
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name=f"tidepool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut


class ClosesOnExit:
    """``with`` support, and cleanup at interpreter exit or garbage collection for objects with
    ``close()`` (a script that never closes its ``Client()`` still exits, and leaves no worker).

    A subclass calls :meth:`_close_at_exit` once it is open: an ``atexit`` hook then closes whatever
    is still open, newest first (a client before the cluster it started).  ``atexit`` runs while
    the loop threads (daemons) still do; a close left to ``__del__`` at interpreter shutdown ran
    after they had stopped, and waited on them until its timeouts.
    """

    closed: bool

    def close(self) -> None:
        raise NotImplementedError

    def _close_at_exit(self) -> None:
        global _exit_hooked
        with _OPEN_LOCK:
            if len(_open) >= 2 * _open_pruned[0] + 16:  # many short-lived clients: drop the dead refs
                _open[:] = [r for r in _open if r() is not None]
                _open_pruned[0] = len(_open)
            _open.append(weakref.ref(self))
            if not _exit_hooked:
                atexit.register(close_all_at_exit)
                if hasattr(os, "register_at_fork"):  # a forked child owns none of its parent's clients
                    os.register_at_fork(after_in_child=_forget_open_in_child)
                _exit_hooked = True

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


#: weak references to every :class:`ClosesOnExit` opened in this process, oldest first
_open: list[weakref.ref[ClosesOnExit]] = []
_open_pruned = [0]
_OPEN_LOCK = threading.Lock()
_exit_hooked = False


def _forget_open_in_child() -> None:
    """After ``os.fork()``, in the child: the parent's clients and clusters are not this process's
    to close at its exit (closing them would stop the parent's workers)."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # another thread may have held it at the fork
    _open.clear()


def close_all_at_exit() -> None:
    """Close every client and cluster still open, newest first (the ``atexit`` hook; see
    :class:`ClosesOnExit`).  A failure of one close does not stop the others."""
    while True:
        with _OPEN_LOCK:
            if not _open:
                return
            obj = _open.pop()()
        if obj is not None and not getattr(obj, "closed", True):
            with contextlib.suppress(Exception):
                obj.close()
