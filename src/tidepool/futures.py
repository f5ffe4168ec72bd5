"""Client-side futures: ``concurrent.futures.Future`` subclasses whose value stays on a worker.

They keep the standard library's contract (``Future``, ``wait``, ``as_completed``, an
``Executor``'s ``map`` and ``shutdown``) and, for :meth:`Client.cancel`, Dask's.

States
------
The standard library's: PENDING -> RUNNING -> FINISHED, or -> CANCELLED_AND_NOTIFIED (a cancelled
future is always notified at once, so ``wait`` and ``as_completed`` see it as done).  A future
becomes FINISHED when the scheduler reports its key in memory (or erred); the value is fetched from
the worker that holds it on the first ``result()`` call and then cached.

RUNNING is learned on demand, so the common path sends nothing extra per task: :meth:`running` and
:meth:`cancel` ask the scheduler (one round trip, only while the future is pending and not yet
known to run), and the scheduler answers from ``TaskRecord.executing`` (set when the worker reports
that the task left its queue for a slot).  Once RUNNING, a future stays so until it is done, even if
the scheduler runs the task again after its worker died.

Cancelling
----------
``Future.cancel()`` is the standard library's: it cancels only a task that has not started
executing and returns whether the future is cancelled.  ``Client.cancel(futures)`` is Dask's: the
futures are cancelled whatever their state (a finished one drops its value).  Either way the
scheduler also cancels this client's futures of every unfinished task computed from a cancelled one
(it can never get its input), and any task nobody else needs stops: a queued one never runs, an
executing one's result is dropped, and no worker keeps the values.  Cancelling is per client.

Callbacks and lifetime
----------------------
``add_done_callback`` on a done future calls the callback at once, in the calling thread.  Otherwise
the callback runs in the thread that completes the future, except that completions by scheduler
reports hop to the client's callback thread (never its event-loop thread), so a callback may call
``result()``.  An exception from a callback is logged and ignored.  Dropping the last reference to a
future releases its key on the scheduler (the task stops if nothing else needs it), except that a
future with callbacks, or one from ``get_executor()``, is kept alive by its client until it is done,
as a ``ThreadPoolExecutor`` runs work nobody holds.  ``await future`` works from any asyncio loop.

Memory
------
A pending future is small (a million of them fit in well under 1 GiB, issue 25): the standard
library's ``threading.Condition`` (an ``RLock`` and a deque, about 900 bytes) is made on first use
of ``_condition`` (someone waits, adds a callback, cancels), under one module lock; a future
nobody waited on is completed without one (:meth:`Future.set_result`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import types
from collections.abc import Callable

# the standard library's state names (stable since Python 3.2, in its private module)
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING, RUNNING
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger("tidepool.futures")


class _InMemory:
    def __repr__(self) -> str:
        return "<in memory on a worker>"


IN_MEMORY: Any = _InMemory()
_UNSET: Any = object()

#: guards making a future's condition, and completing a future that has none (module docstring)
_CONDITION_LOCK = threading.Lock()


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


def call_logged(fn: Callable[[Any], object], fut: concurrent.futures.Future[Any]) -> None:
    """Run a done-callback; an exception is logged (with its traceback) and ignored."""
    try:
        fn(fut)
    except Exception:
        log.exception("done-callback %r of %r raised; the error was ignored (catch errors inside "
                      "the callback to handle them)", fn, fut)  # fmt: skip


def add_raw_callback(future: concurrent.futures.Future[Any], fn: Callable[[Any], object]) -> None:
    """Call ``fn(future)`` once ``future`` is done, in whatever thread completes it: for a tidepool
    future without the hop to its client's callback thread (``fn`` must be quick and must not
    block), for any other ``concurrent.futures.Future`` as a plain done-callback."""
    if isinstance(future, Future):
        future._add_raw_callback(fn)
    else:
        future.add_done_callback(fn)


#: Set by the Dask graph converter while it pickles a node: (client, keys of the futures met).
_INLINE_FUTURES: contextvars.ContextVar[tuple[Any, list[str]] | None] = contextvars.ContextVar(
    "tidepool_inline_futures", default=None
)


class FutureOwner(Protocol):
    """What a future asks of the client that made it (its connection to the scheduler).

    The whole conversation between a future and its client: a future never reaches into the
    client's state, and anything implementing these calls can own futures (tests use fakes).
    """

    def why_not_done(self, keys: list[str], timeout: float | None) -> str:
        """The text of a ``TimeoutError``: each key's state and why, as the scheduler sees it."""

    def fetch(self, key: str, timeout: float | None) -> Any:
        """``key``'s value, read from a worker that holds it (blocking, bounded by ``timeout``)."""

    async def fetch_async(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        """The values of ``keys`` (as :meth:`fetch`), awaited from any asyncio loop."""

    def ask_running(self, future: Future[Any]) -> bool:
        """Whether ``future``'s task executes now (may mark it RUNNING)."""

    def cancel(self, futures: list[Future[Any]], *, unless_started: bool) -> None:
        """Cancel ``futures`` (``unless_started``: only those whose task has not started)."""

    def release(self, keys: list[str]) -> None:
        """This client no longer needs the values of ``keys``."""

    def pin(self, future: Future[Any]) -> None:
        """Keep ``future`` alive until it is done."""

    def on_loop_thread(self) -> bool:
        """True in the client's event-loop thread (where no user code may run or block)."""

    def run_callback(self, fn: Callable[[Any], object], future: concurrent.futures.Future[Any]) -> None:
        """Run a user's done-callback off the event-loop thread."""


#: ``tidepool.client.default_client``, set by the client package when it is imported (this module
#: sits below the client and does not import it): what ``Future(key)`` without a client uses
default_client_hook: Callable[[], Any] | None = None


class Future(concurrent.futures.Future, Generic[T]):  # type: ignore[type-arg]
    """A task's eventual value.  Also a ``concurrent.futures.Future`` and awaitable.

    ``client`` is the :class:`~tidepool.Client` it belongs to; the future talks to it only through
    ``owner`` (a :class:`FutureOwner`; by default the client itself).  ``Future(key, client)``
    written by a user, as in Dask, re-attaches to ``key``: it is ``client.futures_of([key])[0]``
    (the client's one future of that key; a key the scheduler does not know fails with
    ``TaskCancelledError``).
    """

    def __new__(cls, key: Any, client: Any = None, owner: FutureOwner | None = None) -> Future[Any]:
        if owner is None and client is None:  # Dask's Future(key): the default client's
            from tidepool.errors import ConfigError

            try:
                if default_client_hook is None:
                    raise ConfigError("no client module loaded")
                client = default_client_hook()
            except ConfigError as exc:
                raise ConfigError(f"Future({key!r}) needs a client: pass one, Future(key, client), or create a "
                                  "tidepool.Client first (it becomes the default)") from exc  # fmt: skip
        if owner is None and callable(getattr(client, "futures_of", None)):
            fut: Future[Any] = client.futures_of([key])[0]  # registered with its client: it completes
            return fut
        return super().__new__(cls)

    def __init__(self, key: str, client: Any = None, owner: FutureOwner | None = None) -> None:
        if owner is None and getattr(self, "_owner", None) is not None:
            return  # the client's own future of ``key``, returned by __new__: already set up
        # concurrent.futures.Future.__init__'s fields but its Condition (made on first use)
        self._cond: threading.Condition | None = None
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callable[[Any], object]] = []
        self.key = key
        self.client = client
        self._owner: FutureOwner = owner if owner is not None else client
        self._value: Any = _UNSET
        self._pinned = False
        self.__weakref__: Any

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """The standard library's condition, made when first needed (see Memory above)."""
        cond = self._cond
        if cond is None:
            with _CONDITION_LOCK:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition()
        return cond

    def _complete_quietly(self, result: Any, exc: BaseException | None) -> bool:
        """Finish a future nobody has waited on (no condition: no waiters, no callbacks) without
        making a condition; False if it has one (the standard path must notify)."""
        if self._cond is not None:
            return False
        with _CONDITION_LOCK:
            if self._cond is not None:
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED):
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception, self._state = result, exc, FINISHED
        return True

    def set_result(self, result: Any) -> None:
        if not self._complete_quietly(result, None):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._complete_quietly(None, exception):
            super().set_exception(exception)

    @property
    def status(self) -> str:
        """Dask's status names: "pending", "cancelled", "error" or "finished"."""
        if self.cancelled():
            return "cancelled"
        if not self.done():
            return "pending"
        return "error" if super().exception(0) is not None else "finished"

    def result(self, timeout: float | None = None) -> T:
        try:
            v = super().result(timeout)
        except TimeoutError:
            if self.done():  # the task itself raised a TimeoutError
                self = None  # type: ignore[assignment]  # see below
                raise
            raise TimeoutError(self._owner.why_not_done([self.key], timeout)) from None
        except BaseException:
            # the task's exception is kept in this future and its traceback holds this frame: were
            # the frame to hold the future, a dropped failed future would live until the cyclic
            # collector runs, and its explicit key could not be given to another task (as the
            # standard library's result() does)
            self = None  # type: ignore[assignment]
            raise
        if v is not IN_MEMORY:
            return v  # type: ignore[no-any-return]
        if self._value is _UNSET:
            self._value = self._owner.fetch(self.key, timeout)
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The task's exception (None if it succeeded); a timeout says what the task is waiting
        for, as :meth:`result`'s does."""
        try:
            return super().exception(timeout)
        except TimeoutError:
            if self.done():
                raise
            raise TimeoutError(self._owner.why_not_done([self.key], timeout)) from None

    def traceback(self, timeout: float | None = None) -> types.TracebackType | None:
        """The traceback of the task's exception, as traceback objects (None if it succeeded), as
        in Dask: ``traceback.print_tb(future.traceback())``.  Rebuilt from the worker's formatted
        traceback: each entry points at the remote file, line and function (no remote locals).
        Waits as :meth:`exception` does."""
        exc = self.exception(timeout)
        if exc is None:
            return None
        from tidepool.tracebacks import of_exception

        return of_exception(exc)

    def running(self) -> bool:
        """True while the task executes on a worker (it can no longer be cancelled).

        While the future is pending and not yet known to run, this asks the scheduler (one round
        trip); once it runs, the answer is local.
        """
        state = self._state
        if state == RUNNING:
            return True
        if state != PENDING:
            return False
        return self._owner.ask_running(self)

    def cancel(self) -> bool:
        """``concurrent.futures.Future.cancel``: cancel the task unless it is executing or done.

        Returns True if the future is cancelled (now or before): its task will not run for this
        client, and this client's futures of tasks that depend on it are cancelled too.  Returns
        False if it is executing (the future is RUNNING from then on) or done.  Asks the scheduler,
        which knows what executes (one round trip).  :meth:`Client.cancel` cancels whatever the
        state, as Dask does.
        """
        state = self._state
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            return True
        if state != PENDING:
            return False
        self._owner.cancel([self], unless_started=True)
        return self.cancelled()

    # ---- state changes made by the client ------------------------------------------------------
    def _mark_running(self) -> None:
        """The scheduler says the task executes (from a ``running()`` or ``cancel()`` answer)."""
        with self._condition:
            if self._state == PENDING:
                self._state = RUNNING

    def _mark_cancelled(self) -> bool:
        """Cancelled by the scheduler's word or by :meth:`Client.cancel`, whatever the state.

        Waiters (``wait``, ``as_completed``) are notified and callbacks run, as for a standard
        cancel followed by ``set_running_or_notify_cancel``; a finished future drops its outcome
        (its callbacks ran when it finished).  Returns False if it was cancelled already.
        """
        with self._condition:
            state = self._state
            if state == CANCELLED_AND_NOTIFIED:
                return False
            if state != FINISHED:  # waiters of a finished future already counted it as done
                for waiter in self._waiters:
                    waiter.add_cancelled(self)
            self._state = CANCELLED_AND_NOTIFIED
            self._result = None
            self._exception = None
            self._condition.notify_all()
        self._value = _UNSET
        if state in (PENDING, RUNNING):
            self._invoke_callbacks()  # type: ignore[attr-defined]
        return True

    def _mark_failed(self, exc: BaseException) -> bool:
        """The value of this finished future, held only by workers, is gone for good (a
        ``client.restart()``, a value that cannot be sent): it fails with ``exc`` from now on, so
        ``status``, ``exception()`` and ``result()`` agree.  A value already here (fetched, or
        inline) stays.  Its waiters and callbacks counted it as done already.  Returns whether it
        changed."""
        with self._condition:
            if self._state != FINISHED or self._result is not IN_MEMORY or self._value is not _UNSET:
                return False
            self._result = None
            self._exception = exc
            self._condition.notify_all()
        return True

    # ---- callbacks --------------------------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:  # type: ignore[override]
        """Call ``fn(future)`` once it is done; at once, in this thread, if it is done already.

        Completed by a scheduler report, ``fn`` runs on the client's callback thread (so it may call
        ``result()``); completed by a call in some thread (``cancel()``), in that thread.  An
        exception from ``fn`` is logged and ignored.  The client keeps this future alive until it
        is done, so the callback fires even if nobody else holds the future.
        """
        owner = self._owner
        if self._state in (PENDING, RUNNING):
            owner.pin(self)

        def run(f: concurrent.futures.Future[Any]) -> None:
            if owner.on_loop_thread():  # never block or run user code there
                owner.run_callback(fn, f)
            else:
                call_logged(fn, f)

        super().add_done_callback(run)

    def _add_raw_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        """A callback run in whatever thread completes the future (the client's loop thread for
        reports): it must be quick and must not block."""
        super().add_done_callback(fn)

    def _remove_raw_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        """Forget a callback added by :meth:`_add_raw_callback` while the future is not done (once
        it is, nothing is removed: the callbacks run from the list as it was, and a callback that
        only wakes an awaiter that gave up is harmless)."""
        with self._condition:  # the lock every change to the callbacks is made under
            if self._state not in (PENDING, RUNNING):
                return  # done: its callbacks run (or ran) from the list as it is, outside the lock
            # a new list, never the old one changed in place: a list being walked is never touched
            # (a review: removing in place made the thread running the callbacks skip the next one)
            self._done_callbacks = [c for c in self._done_callbacks if c is not fn]

    # ---- asyncio ----------------------------------------------------------------------------------
    def __await__(self) -> Any:
        return self._aresult().__await__()

    async def _aresult(self) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake(_: Any) -> None:
            _wake_loop(loop, done)

        self._add_raw_callback(wake)
        try:
            await done
        except BaseException:
            # an await given up (a timeout, a cancel) takes its callback along: a server polling a
            # long task with wait_for left one per poll (a bug hunt: 2,000 callbacks); and the
            # CancelledError a caller may keep holds this frame: not the future (its key stayed held)
            self._remove_raw_callback(wake)
            self = None  # type: ignore[assignment]
            raise
        self._remove_raw_callback(wake)
        try:
            v = super().result(0)
        except BaseException:
            self = None  # type: ignore[assignment]  # its traceback holds this frame (see result)
            raise
        if v is not IN_MEMORY:
            return v  # type: ignore[no-any-return]
        if self._value is _UNSET:
            self._value = (await self._owner.fetch_async([self.key], None))[self.key]
        return self._value  # type: ignore[no-any-return]

    def release(self) -> None:
        """Tell the scheduler this client no longer needs the value.

        A future not done yet is cancelled by this (no result would ever reach it); unlike
        :meth:`cancel`, tasks that depend on it still run.
        """
        self._owner.release([self.key])
        if not self.done():
            self._mark_cancelled()

    def __repr__(self) -> str:
        return f"<tidepool.Future {self.key} {self.status}>"

    def __dask_tokenize__(self) -> tuple[str, str]:
        """Dask names graphs by content: a future is named by its key (never pickled for it)."""
        return ("tidepool.Future", self.key)

    def __reduce__(self) -> Any:
        from tidepool.errors import ConfigError

        held = _INLINE_FUTURES.get()
        if held is not None:  # pickled inside a Dask node: the worker gets its value (tidepool.dask)
            if self.client is not held[0]:
                raise ConfigError(f"future {self.key} belongs to another client")
            held[1].append(self.key)
            from tidepool.dask.run import inline_value

            return (inline_value, (self.key,))
        raise ConfigError(
            "a tidepool Future cannot be pickled; pass it directly as a task argument (it becomes a "
            "dependency) instead of inside an object that gets pickled"
        )

