"""The client's sans-IO core: what the client knows about its keys, and what it says next.

No sockets, no threads, no clock (in the style of h11): the connection shell
(:mod:`tidepool.client.connection`) feeds every message from the scheduler to :meth:`receive`,
which updates the state and returns :data:`Event` records for the shell to apply to futures and
waiters; the shell sends whatever :meth:`ClientProtocol.next_message` gives, in order.  The shell
holds a lock around every call (user threads post, the loop thread receives and drains).

State
-----
``futures`` (key -> future, weakly held: dropping a future releases its key, through the
table's own weak-reference callback, :class:`FutureTable`, not a finaliser per future), ``errors`` (key ->
the scheduler's error record of a failed task, until released), ``holders`` (key -> the address of
a worker that holds its value, from the report that said it was done: ``result()`` reads from there
without asking who-has first), ``idents`` (explicit key -> what the task under it is, to refuse a
different task under a live key), ``inline`` (key -> the pickle of a small value that came with
its report, ``comm/inline.py``: ``result()`` takes it from here without reading from the holder;
at most :data:`~tidepool.comm.inline.CLIENT_CACHE_BYTES` in all, kept only for keys with a live
future, dropped with the key's release), ``cancelling`` (keys a caller of ``Future.cancel()`` waits on ->
the outcome reported meanwhile), ``sent_funcs`` (function ids the scheduler already has) and the
ordered ``outbox``.

The outbox keeps graph updates, releases and requests in the order they were made: a release of a
future dropped right after submitting its dependent never overtakes that dependent's update.  A
run of releases leaves as one message, without the keys whose future was made again meanwhile.
Releases of dropped futures wait in ``dropped`` (the shell queues them every
``RELEASE_DELAY``, :meth:`ClientProtocol.queue_dropped`), so a loop of ``submit(...).result()``
costs the scheduler and the worker one release per many calls, not one per call: a *fresh* graph
update (every task under a key this client just made) may go ahead of them, since no task of it
can be one of theirs or an input of one; any other message sends them first.

A :class:`Fetch` is the plan of one ``result()``/``gather()``: the values that came inline, which holder to read each key from
(known from reports, else asked with who-has), how often a named holder failed in a row, and when
to give up (``FETCH_ATTEMPTS``) or wait for the next report.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tidepool.comm.inline import CLIENT_CACHE_BYTES
from tidepool.comm.messages import ClientReport, Reply, SetupError, decode_from_scheduler
from tidepool.comm.serialize import Serialized
from tidepool.errors import (
    CommError,
    ConnectionLostError,
    CycleError,
    DependencyError,
    InfeasibleTaskError,
    KeyCollisionError,
    KilledWorkerError,
    ProtocolError,
    ProviderError,
    RemoteTaskError,
    RemoteTraceback,
    ResultTooLargeError,
    SchedulerError,
    SerializationError,
    TaskCancelledError,
    TaskError,
    TransferError,
    WorkerSetupError,
)

#: reads of one value from one holder that may fail in a row (the holder still named by the
#: scheduler each time) before result()/gather() give up with a TransferError
FETCH_ATTEMPTS = 10


class KeyedFuture(Protocol):
    """What the core needs of a future in its table (tidepool's :class:`~tidepool.futures.Future`)."""

    key: str

    def cancelled(self) -> bool: ...

    def done(self) -> bool: ...


# ---- events: what a message from the scheduler means for the futures ------------------------------
@dataclass(frozen=True, slots=True)
class Finished:
    """``key``'s value is in memory on a worker (``holder``: its address, "" if not said)."""

    key: str
    holder: str


@dataclass(frozen=True, slots=True)
class Failed:
    """``key``'s task failed (or the scheduler no longer knows it): fail its future with
    :meth:`error`, the exception built from the scheduler's record ``info``.  Building it may
    unpickle the task's own exception (:attr:`pickled`), which runs code of the user's: the shell
    chooses the thread."""

    key: str
    info: dict[str, Any]

    @property
    def pickled(self) -> bool:
        return self.info.get("exception") is not None

    def error(self) -> BaseException:
        return make_exception(self.key, self.info)


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The scheduler cancelled ``key`` for this client (and nobody waits on a cancel() of it)."""

    key: str


@dataclass(frozen=True, slots=True)
class Running:
    """The scheduler says ``key`` executes now (and nobody waits on a cancel() of it)."""

    key: str


@dataclass(frozen=True, slots=True)
class Settled:
    """A report about ``key`` arrived: fetches waiting for news of it should look again."""

    key: str


@dataclass(frozen=True, slots=True)
class Answered:
    """The reply to request ``id``: ``result``, or ``error`` (the scheduler refused it)."""

    id: int
    result: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class WorkerSetupFailed:
    """A worker failed a setup hook (the message as the scheduler sent it)."""

    report: dict[str, Any]


Event = Finished | Failed | Cancelled | Running | Settled | Answered | WorkerSetupFailed


class KeyCancelled(Exception):  # noqa: N818 - what it says, not an error of the program
    """A key being read was cancelled (raised on the client's loop; the caller's thread raises
    ``concurrent.futures.CancelledError`` for it: a cancellation error raised in a coroutine
    crosses loops as ``asyncio.CancelledError``, a ``BaseException`` that ``except Exception``
    misses, or passes for the loop stopping)."""


class FutureTable(weakref.WeakValueDictionary[str, KeyedFuture]):
    """Key -> live future, weakly held; ``on_drop(key)`` is called when a future in it is collected.

    The table's own weak reference per future does the work a ``weakref.finalize`` per future did
    (about 470 bytes each).  A future replaced under its key (cancelled, then made again) is not
    reported when it goes: the key's newer future is, and a release skips keys with a live future.
    """

    def __init__(self, on_drop: Callable[[str], None] | None = None) -> None:
        super().__init__()
        remove = self._remove  # type: ignore[has-type]

        def dropped(wr: Any, remove: Callable[[Any], None] = remove) -> None:
            remove(wr)
            if on_drop is not None:
                on_drop(wr.key)

        self._remove = dropped


class ClientProtocol:
    """See the module docstring."""

    def __init__(self, on_drop: Callable[[str], None] | None = None) -> None:
        #: ``on_drop(key)``: the last future of ``key`` was dropped (the shell releases the key)
        self.futures: weakref.WeakValueDictionary[str, KeyedFuture] = FutureTable(on_drop)
        self.errors: dict[str, dict[str, Any]] = {}
        self.holders: dict[str, str] = {}
        self.inline: dict[str, Serialized] = {}
        self.inline_bytes = 0
        self.idents: dict[str, tuple[Any, ...]] = {}
        self.cancelling: dict[str, str | None] = {}
        self.sent_funcs: set[str] = set()
        self.outbox: collections.deque[dict[str, Any]] = collections.deque()
        #: keys of dropped futures whose release waits (for the next queue_dropped), in order
        self.dropped: dict[str, None] = {}
        #: explicit keys whose last future was dropped, release not sent yet: the identity of the
        #: task they named last (a different task under the key must not cancel that release)
        self.released_idents: dict[str, tuple[Any, ...]] = {}
        #: keys in ``dropped`` whose release goes out even though a new future of the key exists: a
        #: different task reuses the key; the release message carries them as ``force``
        self.must_release: set[str] = set()
        self._ids = itertools.count(1)
        #: set once the scheduler connection is lost: every later call raises it
        self.lost: ConnectionLostError | None = None

    # ---- outgoing ----------------------------------------------------------------------------------
    def send(self, msg: dict[str, Any], fresh: bool = False) -> bool:
        """Queue ``msg`` behind everything queued before; True if the outbox was empty (the shell
        must start draining).  Waiting releases of dropped futures go first unless ``msg`` is
        ``fresh``: a graph update whose every task has a key this client just made (not given, not
        named by content, no graph of a delayed value or a Dask collection), which no release can
        concern (a given key may be one the scheduler still holds, or an input of one, until the
        release arrives)."""
        if self.dropped and not fresh:
            self.queue_dropped()
        self.outbox.append(msg)
        return len(self.outbox) == 1

    def request(self, msg: dict[str, Any]) -> int:
        """Queue a request; returns its id (the :class:`Answered` event carries it back)."""
        rid = next(self._ids)
        self.send({**msg, "id": rid})
        return rid

    def release_dropped(self, key: str) -> bool:
        """The last future of ``key`` was dropped: its release waits in ``dropped``; True if it is
        the first to wait (the shell arms its ``queue_dropped`` timer)."""
        if self.idents and key not in self.futures:
            ident = self.idents.pop(key, None)
            if ident is not None:
                self.released_idents[key] = ident
        first = not self.dropped
        self.dropped[key] = None
        return first

    def queue_dropped(self) -> bool:
        """Queue the waiting releases of dropped futures as one message at the end of the outbox;
        True if the outbox was empty (the shell must start draining)."""
        if not self.dropped:
            return False
        keys, self.dropped = list(self.dropped), {}
        msg: dict[str, Any] = {"op": "release", "keys": keys, "auto": True}
        if self.must_release:
            msg["force"] = set(keys) & self.must_release
            self.must_release -= msg["force"]
        self.outbox.append(msg)
        return len(self.outbox) == 1

    def next_message(self) -> dict[str, Any] | None:
        """The next message to send (None: the outbox is empty).

        A run of releases becomes one; a key released because its future was dropped is left out
        if a new future of it exists by now (it is wanted again).  Released keys forget their
        error and holder.
        """
        while self.outbox:
            item = self.outbox.popleft()
            if item["op"] != "release":
                return item
            run = [item]
            while self.outbox and self.outbox[0]["op"] == "release":
                run.append(self.outbox.popleft())
            # a key released because its future was dropped is left out if a future of it exists by
            # now (wanted again), unless the release was forced: a different task took the key
            keys = [k for r in run for k in r["keys"]
                    if not (r.get("auto") and k in self.futures and k not in r.get("force", ()))]  # fmt: skip
            if self.released_idents:
                for r in run:
                    if r.get("auto"):
                        for k in r["keys"]:
                            if not self._release_queued(k):  # the last release of ``k`` goes now
                                self.released_idents.pop(k, None)
            if not keys:
                continue
            for k in keys:
                self.errors.pop(k, None)
                self.holders.pop(k, None)
                self._drop_inline(k)
            return {"op": "release", "keys": keys}
        return None

    # ---- incoming ----------------------------------------------------------------------------------
    def receive(self, msg: dict[str, Any]) -> list[Event]:
        """Take in one message from the scheduler; returns what it means for futures and waiters."""
        typed = decode_from_scheduler(msg)
        if isinstance(typed, ClientReport):
            events: list[Event] = []
            for item in typed.items:
                if item.value is not None and item.status == "memory":
                    self._keep_inline(item.key, item.value)
                self._report(item.key, item.status, item.detail, events)
            return events
        if isinstance(typed, Reply):
            err = SchedulerError(typed.error) if typed.error is not None else None
            return [Answered(typed.id, typed.result, err)]
        if isinstance(typed, SetupError):
            return [WorkerSetupFailed(msg)]
        return []

    def _report(self, key: str, status: str, detail: Any, events: list[Event]) -> None:
        if status == "memory":
            self.errors.pop(key, None)
            if detail:
                self.holders[key] = detail
            events.append(Finished(key, detail or ""))
        elif status == "erred":
            self._drop_inline(key)
            if detail.get("type") == "KeyCollisionError":  # the key stays the other task's
                self.idents.pop(key, None)
            self.errors[key] = detail
            events.append(Failed(key, detail))
        elif status in ("cancelled", "running"):  # answers to a cancel request of ours
            if key in self.cancelling:  # a caller of cancel() waits: it applies the outcome
                self.cancelling[key] = status
            else:
                events.append(Cancelled(key) if status == "cancelled" else Running(key))
        elif status == "lost":
            info = {"type": "TaskCancelledError", "message": f"the scheduler does not know {key!r} "
                    "(released earlier?); submit it again", "origin": key}  # fmt: skip
            self.errors[key] = info
            events.append(Failed(key, info))
        events.append(Settled(key))

    # ---- inline values -----------------------------------------------------------------------------
    def _keep_inline(self, key: str, blob: Any) -> None:
        """Keep the small value reported with ``key`` while a future of it lives and the cache has
        room (a report arriving again replaces it; one after the release is ignored)."""
        if key not in self.futures or not isinstance(blob, Serialized):
            return
        self._drop_inline(key)
        if self.inline_bytes + blob.nbytes > CLIENT_CACHE_BYTES:
            return
        self.inline[key] = blob
        self.inline_bytes += blob.nbytes

    def _drop_inline(self, key: str) -> None:
        blob = self.inline.pop(key, None)
        if blob is not None:
            self.inline_bytes -= blob.nbytes

    def inline_blobs(self, keys: list[str]) -> dict[str, Any]:
        """The pickles of the values of ``keys`` that came inline, for a caller that unpickles them
        outside the shell's lock (the user's code: it may take long) and calls
        :meth:`not_loadable` with those that fail."""
        return {k: b for k in keys if (b := self.inline.get(k)) is not None}

    def not_loadable(self, keys: Any) -> None:
        """These inline values do not unpickle here: read them from their holders (which say why)."""
        for k in keys:
            self._drop_inline(k)

    def inline_values(self, keys: list[str]) -> dict[str, Any]:
        """The values of ``keys`` that came inline and unpickle here (the rest are read from their
        holders, which also report why a value cannot be unpickled)."""
        out: dict[str, Any] = {}
        for k in keys:
            blob = self.inline.get(k)
            if blob is None:
                continue
            try:
                out[k] = blob.load()
            except Exception:  # noqa: BLE001 - read from the holder instead, which says why
                self._drop_inline(k)
        return out

    def connection_lost(self, err: ConnectionLostError) -> None:
        self.lost = err

    # ---- the futures table -------------------------------------------------------------------------
    def claim(self, key: str, make: Any) -> tuple[Any, dict[str, Any] | None]:
        """The live future of ``key``, or a new one from ``make(key)`` if there is none (or it was
        cancelled, or an earlier attempt under that key was refused as a collision); with the error
        record to fail it with (``make_exception`` builds the exception: the caller chooses the
        thread) if the key's task failed already and the future is not done."""
        fut = self.futures.get(key)
        collided = self.errors.get(key, {}).get("type") == "KeyCollisionError"
        if collided:  # that attempt was refused; this one is a new request
            del self.errors[key]
        if fut is None or fut.cancelled() or collided:
            fut = make(key)
            self.futures[key] = fut
        err = self.errors.get(key)
        return fut, (err if err is not None and not fut.done() else None)

    def collision(self, key: str, ident: tuple[Any, ...]) -> bool:
        """Explicit keys: True if a different live task holds ``key``; else remember this one."""
        old = self.futures.get(key)
        if old is None or old.cancelled():
            before = self.released_idents.get(key)
            if before is not None and before != ident:  # its release waits: send it, then this task
                self._force_release(key)
            self.idents[key] = ident
            return False
        before = self.idents.get(key)
        return before is not None and before != ident

    def _force_release(self, key: str) -> None:
        """A different task takes ``key`` while the release of its dropped one waits: that release
        goes out whatever futures of ``key`` exist then, and what this client knew of the old task
        (its error, holder, inline value) is forgotten now, before a new future could read it."""
        if key in self.dropped:
            self.must_release.add(key)
        else:
            for msg in reversed(self.outbox):  # the last release of it still to be sent
                if msg.get("op") == "release" and msg.get("auto") and key in msg["keys"]:
                    msg.setdefault("force", set()).add(key)
                    break
        self.errors.pop(key, None)
        self.holders.pop(key, None)
        self._drop_inline(key)

    def _release_queued(self, key: str) -> bool:
        """A release of ``key`` still waits (in ``dropped`` or the outbox)."""
        return key in self.dropped or any(m.get("op") == "release" and key in m["keys"] for m in self.outbox)

    def fetch(self, keys: list[str]) -> Fetch:
        return Fetch(self, keys)


class Fetch:
    """The plan of one fetch of ``keys`` (see the module docstring); the shell does the reading.

    Each round: :meth:`plan` says which keys to read from which holder and which holders to ask
    the scheduler about (``who_has``); the shell asks, calls :meth:`named`, reads, and reports each
    read with :meth:`read`.  Keys not read yet stay in ``remaining``; :meth:`check_waiting` raises
    if one of them can never come, else the shell waits for a report (or a short pause).
    """

    def __init__(self, core: ClientProtocol, keys: list[str]) -> None:
        self.core = core
        self.values: dict[str, Any] = core.inline_values(keys) if core.inline else {}
        self.remaining = [k for k in keys if k not in self.values]
        self.failures: dict[tuple[str, str], int] = {}  # (key, holder) -> failed reads in a row
        self._asked_before = False
        self._next: list[str] = []

    def plan(self) -> tuple[dict[str, list[str]], list[str]]:
        """(holder address -> keys to read there, keys to ask who-has about).

        The first round reads from the holders the reports named; later rounds (a read failed, or
        a value moved) ask the scheduler.
        """
        self._next = []
        by_addr: dict[str, list[str]] = {}
        ask: list[str] = []
        holders = self.core.holders
        for k in self.remaining:
            addr = None if self._asked_before else holders.get(k)
            if addr:
                by_addr.setdefault(addr, []).append(k)
            else:
                ask.append(k)
        self._asked_before = True
        return by_addr, ask

    def named(self, by_addr: dict[str, list[str]], asked: list[str], who: dict[str, Any]) -> None:
        """Add the holders the scheduler named (``who``: the who-has reply for ``asked``) to
        ``by_addr``; raises for a key it no longer knows (released before it was fetched)."""
        absent = []
        for k in asked:
            if k in who and who[k] is None and k not in self.core.errors:
                raise TaskCancelledError(
                    f"the scheduler no longer knows {k!r}: it was released (future.release(), "
                    "client.cancel, or every future of it dropped) before its value was fetched; "
                    "submit it again", k)  # fmt: skip
            addrs = who.get(k) or []
            if addrs:
                by_addr.setdefault(addrs[0], []).append(k)
            else:
                absent.append(k)
        self._next.extend(absent)

    def read(self, addr: str, keys: list[str], res: Any, *, gone: bool = False) -> None:
        """The outcome of reading ``keys`` from ``addr``: ``(values, failed)`` or an exception.

        A lost or refused connection, or a timeout, puts the keys back for the next round (the
        holder may be gone, or the value moved); ``gone`` (the holder refused the connection) is
        not counted as a failed read.  Any other error (a reply that makes no sense included), or
        a value that exists but cannot reach us, is final.
        """
        nxt = self._next
        if isinstance(res, (CommError, OSError, TimeoutError)) and not isinstance(res, ProtocolError):
            nxt.extend(keys)
            for k in keys:
                self.core.holders.pop(k, None)
            if gone:
                return
            for k in keys:
                n = self.failures[k, addr] = self.failures.get((k, addr), 0) + 1
                if n >= FETCH_ATTEMPTS:
                    raise TransferError(
                        f"the value of {k!r} could not be read from {addr}, which the scheduler "
                        f"still names as its holder, {FETCH_ATTEMPTS} times in a row once connected (last: "
                        f"{type(res).__name__}: {res}); can this machine reach the workers' data ports?",
                        k)  # fmt: skip
            return
        if isinstance(res, BaseException):  # anything else is final: never retried forever
            raise TransferError(f"reading {keys[:3]} from {addr} failed: {type(res).__name__}: {res}",
                                keys[0]) from res  # fmt: skip
        got, failed = res
        for k, why in failed.items():
            too_big = "frame limit" in why and "unpickled" not in why
            raise (ResultTooLargeError if too_big else SerializationError)(why, k)
        self.values.update(got)
        missing = [k for k in keys if k not in got]
        for k in missing:
            self.core.holders.pop(k, None)
        nxt.extend(missing)

    def end_round(self) -> None:
        self.remaining = self._next

    def check_waiting(self) -> tuple[str, dict[str, Any]] | None:
        """Whether a key not read yet can never come: raises if it was cancelled (or the scheduler
        is lost); returns a key whose task failed, with its error record (``make_exception``
        builds the exception, which may unpickle it: the caller chooses the thread); else None."""
        core = self.core
        for k in self.remaining:
            err = core.errors.get(k)
            if err is not None:
                return k, err
            f = core.futures.get(k)
            if f is not None and f.cancelled():  # its value is gone for good
                raise KeyCancelled(cancelled_message(k))
        if core.lost is not None:
            raise core.lost
        return None


def cancelled_message(key: str) -> str:
    return f"future {key!r} was cancelled (Future.cancel or Client.cancel); submit the task again to compute it"


#: errors the scheduler makes (not raised by the task itself), by the type name it reports
_SCHEDULER_ERRORS: dict[str, type[Exception]] = {
    c.__name__: c for c in (
        InfeasibleTaskError, SerializationError, ResultTooLargeError, TransferError, KeyCollisionError,
        CycleError, ProviderError, WorkerSetupError,
    )
}  # fmt: skip


def make_exception(key: str, info: dict[str, Any]) -> BaseException:
    """The exception a failed task's future raises, from the scheduler's error record: the task's
    own exception (remote traceback as its cause) when it unpickles, else a tidepool error."""
    blob = info.get("exception")
    tb = info.get("traceback") or ""
    origin = info.get("origin") or key
    if blob is not None:
        try:
            exc = with_setup_hint(blob.load())
            if isinstance(exc, BaseException):
                if tb:
                    exc.__cause__ = RemoteTraceback(tb)
                return exc
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    typ, message = info.get("type", ""), info.get("message", "")
    if typ == "KilledWorkerError":
        return KilledWorkerError(message, origin)
    if typ == "DependencyError":
        return DependencyError(f"task {key!r} cannot run: {message}", key)
    if typ == "TaskCancelledError":
        return TaskCancelledError(message, key)
    if typ in _SCHEDULER_ERRORS:
        cls = _SCHEDULER_ERRORS[typ]
        if issubclass(cls, TaskError):
            return cls(message, key)
        return cls(message)
    return RemoteTaskError(f"task {origin!r} raised {typ}: {message}\n{tb}", key, typ, tb)


def with_setup_hint(exc: Any) -> Any:
    """A task's ``ModuleNotFoundError`` (its function or arguments import a module the workers do
    not have), still a ``ModuleNotFoundError``, with what to do: ship or install the module."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return exc
    top = exc.name.split(".")[0]
    try:
        here = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        here = False
    where = ("it imports here on the client, but not on the workers" if here
             else "it is not installed on the workers")  # fmt: skip
    return ModuleNotFoundError(
        f"{exc} on the worker ({where}); ship it with client.register_setup(modules=[{top!r}]), or "
        f"install it on every worker (client.register_setup(requirements=[...]))", name=exc.name, path=exc.path)
