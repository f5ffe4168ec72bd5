"""The client's connection shell: the loop thread, the scheduler socket, the workers' data ports.

A thin layer around :class:`~tidepool.client.protocol.ClientProtocol` (the sans-IO core): user
threads post messages to the core's outbox under ``lock`` and the loop thread drains it in order;
the read loop feeds every message to ``core.receive`` and applies the events it returns (completing
futures, answering requests, waking fetches).  Fetches follow the core's :class:`Fetch` plan and
read values straight from the workers that hold them, one request per worker, over connections
kept per worker address.  This class is also every future's :class:`~tidepool.futures.FutureOwner`.
The loop thread is the client's own, or a :class:`~tidepool.cluster.LocalCluster`'s (a client of
one runs on its scheduler's loop: fewer thread hand-offs per message; it never stops that loop,
fails its futures with :class:`ConnectionLostError` if the cluster stops it first, and unpickles the
large values it reads from workers in a thread, not on the scheduler's loop).

Never hanging: once the scheduler connection is lost (and, with a scheduler that announced a
reconnect window, not regained within it: ``client/reconnect.py``), every pending future and
request fails with :class:`ConnectionLostError` and every later call raises it at once.  Fetches are bounded as a
whole by their timeout (asking, connecting, reading).  Any other error in the read loop closes the
connection and fails the futures the same way.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tidepool.client import reconnect
from tidepool.client.protocol import (
    Answered,
    Cancelled,
    ClientProtocol,
    Event,
    Failed,
    Finished,
    KeyCancelled,
    Running,
    Settled,
    WorkerSetupFailed,
    cancelled_message,
    make_exception,
)
from tidepool.comm import Connection, connect
from tidepool.comm.data import fetch_timeout_from_env, load_values, request_data
from tidepool.comm.messages import Cancel, KeyQuery, Release
from tidepool.comm.tls import TLSConfig
from tidepool.errors import (
    CommError,
    ConnectionLostError,
    PeerSilentError,
    SchedulerError,
    TidepoolError,
)
from tidepool.futures import IN_MEMORY, PENDING, RUNNING, Future, call_logged
from tidepool.loop import LoopThread

log = logging.getLogger("tidepool.client")

#: a client gives up a read from a silent holder after this many times ``TIDEPOOL_FETCH_TIMEOUT``
CLIENT_SILENCE_FACTOR = 4
#: seconds a scheduler may send nothing before the client counts it as lost (``Client(silence_timeout=)``)
SILENCE_TIMEOUT = 120.0
#: a scheduler that sent nothing for this long (at most) is pinged, so a quiet but healthy one answers
PING_EVERY = 10.0
T = TypeVar("T")


#: messages up to this many tasks (keys) are written in the loop turn that takes them from the
#: outbox (larger ones are encoded once, by the async drain, instead of tried twice)
SEND_AT_ONCE_TASKS = 64
SEND_AT_ONCE_KEYS = 4096
#: how long the release of a dropped future waits for others to go with it (seconds)
RELEASE_DELAY = 0.02
#: seconds a closing client waits for a durable scheduler to take its goodbye
GOODBYE_TIMEOUT = 5.0
#: values read from workers in one reply of at least this many bytes (pickles and buffers) are
#: unpickled in a thread when the loop is shared with a LocalCluster's scheduler (smaller ones on
#: the loop: the thread hop costs ~70 us, about a tenth of a 4 KiB value's submit().result())
LOAD_IN_THREAD_BYTES = 64 * 1024


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A ping's outcome is not needed (its answer's bytes are what counts); never left unretrieved."""
    if not fut.cancelled():
        fut.exception()


class HolderGone(ConnectionLostError):
    """A holder refused the connection: it is gone, and the scheduler will say so (not counted)."""


#: seconds closing a client waits for task exceptions still being unpickled
BUILD_WAIT = 10.0


async def off_loop(build: Callable[[], BaseException], executor: concurrent.futures.Executor | None) -> BaseException:
    """``build()`` (it unpickles user code) in a thread of ``executor`` (None: the loop's), not on
    this loop; inline when no thread can be had any more (the interpreter is shutting down).
    An exception ``build`` raises is what is returned: the one to give."""
    try:
        fut = asyncio.get_running_loop().run_in_executor(executor, build)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        fut = None
    try:
        return build() if fut is None else await fut
    except Exception as exc:  # noqa: BLE001 - building it failed: that is the error to give
        return exc


class ClientConnection:
    """See the module docstring.  ``setup_errors`` collects workers' setup failures."""

    def __init__(self, address: str, token: str, timeout: float, tls: TLSConfig | None,
                 loop: LoopThread | None = None, via: str | None = None,
                 silence_timeout: float | None = SILENCE_TIMEOUT) -> None:  # fmt: skip
        self.address = address
        #: seconds the scheduler may send nothing (pings unanswered) before it counts as lost; None:
        #: wait for ever (an in-process scheduler is never checked: it cannot be cut off from us)
        self.silence_timeout = silence_timeout if via is None else None
        self._silent: CommError | None = None  # why the watch closed the connection
        #: where the scheduler is reached: ``via`` (an in-process LocalCluster's in-memory address), else
        #: ``address`` (which is what users see)
        self.connect_address = via or address
        self.token = token
        self.timeout = timeout
        self.tls = tls
        self.closed = False
        self.lock = threading.RLock()
        self.core = ClientProtocol(on_drop=self.release_dropped)
        self.setup_errors: list[dict[str, Any]] = []
        self.pinned: set[Future[Any]] = set()
        self._requests: dict[int, asyncio.Future[Any]] = {}
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        self._building: set[asyncio.Task[None]] = set()  # exceptions being unpickled (_fail_off_loop)
        #: one thread, so failures reach their futures in the order the scheduler reported them
        self._builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tidepool-exceptions")
        self._workers: dict[str, tuple[Connection, asyncio.Lock]] = {}
        self._draining = False
        self._callbacks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tidepool-callback")
        #: the loop thread: our own, or (``loop``) one we share and never stop: a LocalCluster's, whose
        #: scheduler then reads and answers our messages in the same thread (no thread hand-off
        #: and GIL switch per message each way)
        self.loop = LoopThread("tidepool-client") if loop is None else loop
        self._own_loop = loop is None
        self.id = "?"
        #: reconnecting to a restarted scheduler (client/reconnect.py)
        self.reconnect_window = 0.0
        self.resuming: asyncio.Event | None = None
        self.resume_task: asyncio.Task[None] | None = None
        self.request_msgs: dict[int, dict[str, Any]] = {}
        self.recent_graphs: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()

    @property
    def lost(self) -> ConnectionLostError | None:
        return self.core.lost

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                self._conn = await connect(self.connect_address, self.token, timeout=self.timeout, tls=self.tls,
                                           hello={"role": "client"})  # fmt: skip
                welcome = await self._conn.recv()
        except TimeoutError:
            raise ConnectionLostError(
                f"could not connect to the scheduler at {self.address} within {self.timeout:g}s; is it "
                "running, is the address reachable from here, and does its scheme match (a TLS scheduler "
                "has a tls:// address)?"
            ) from None
        self.connected(self._conn, welcome)

    def connected(self, conn: Connection, welcome: dict[str, Any]) -> None:
        """Take ``conn`` (welcomed by the scheduler) as the scheduler connection and read from it."""
        self._conn = conn
        self.id = welcome.get("client", self.id)
        self.reconnect_window = float(welcome.get("reconnect_window") or 0.0)
        self._silent = None
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        if self.silence_timeout is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_silence(conn, self.silence_timeout))

    async def _watch_silence(self, conn: Connection, limit: float) -> None:
        """A frozen or partitioned scheduler never closes its socket: ping it when it has been
        quiet, and once it has sent nothing for ``limit`` seconds close the connection, so the
        read loop ends as on any lost scheduler (futures fail, or a durable one is reconnected to)."""
        loop = asyncio.get_running_loop()
        every = min(PING_EVERY, limit / 4)
        started = woke = loop.time()
        while not conn.closed and not self.closed:
            await asyncio.sleep(every)
            now = loop.time()
            if now - woke > 2 * every:  # this process did not run meanwhile (paused, a long GIL
                started = now  # hold): the scheduler's silence counts from now, after a ping
            woke = now
            quiet = now - max(conn.last_received, started)
            if conn.closed or self.closed:
                return
            if quiet >= limit:
                self._silent = PeerSilentError(
                    f"it sent nothing for {quiet:.0f}s, not even an answer to a ping: frozen, or cut off "
                    f"from this client by the network (Client(silence_timeout=...) sets how long to wait)")  # fmt: skip
                log.warning("the scheduler at %s is silent (%s); closing the connection", self.address, self._silent)
                conn.close()
                return
            if quiet >= every or now == started:
                asyncio.ensure_future(self.request({"op": "ping"})).add_done_callback(_retrieved)

    async def _goodbye(self) -> None:
        """Tell a scheduler that keeps lost clients' keys for their reconnection (a durable one)
        that this client leaves on purpose, after everything queued before: it releases our keys
        when the connection ends instead of keeping them for the reconnect window."""
        with contextlib.suppress(TidepoolError, CommError, TimeoutError):
            await asyncio.wait_for(self.request({"op": "bye"}), GOODBYE_TIMEOUT)

    @property
    def max_frame(self) -> int:
        return self._conn.max_frame

    async def aclose(self) -> None:
        if self._building:  # tasks' exceptions being unpickled: their futures get them, not a close error
            await asyncio.wait(list(self._building), timeout=BUILD_WAIT)
        if not hasattr(self, "_conn"):  # asynchronous, never connected
            return
        if self.reconnect_window > 0 and self.resuming is None and not self._conn.closed:
            await self._goodbye()
        self._reader.cancel()
        if self.resume_task is not None:
            self.resume_task.cancel()
        self._conn.close()
        for conn, _ in self._workers.values():
            conn.close()

    def stop(self) -> None:
        """Stop the loop thread (our own only) and the callback thread (after :meth:`aclose`)."""
        self.closed = True
        if self._own_loop:
            self.loop.stop()
        self._callbacks.shutdown(wait=False)
        self._builder.shutdown(wait=False)

    def check_open(self) -> None:
        if self.closed:  # closed by its user: said so, whatever the line did as it closed
            raise SchedulerError("this client is closed; values can no longer be fetched (open a new Client)")
        if self.core.lost is not None:
            raise self.core.lost
        if not hasattr(self, "_conn"):  # an asynchronous client not awaited yet (still connecting)
            raise SchedulerError("this client is still connecting: await it first (client = await "
                                 "Client(..., asynchronous=True), or async with Client(...))")  # fmt: skip

    # ---- the ordered outbox ----------------------------------------------------------------------
    def post(self, msg: dict[str, Any], fresh: bool = False) -> None:
        """Send ``msg`` after everything posted before, from any thread, without waiting (a
        ``fresh`` graph update may go ahead of releases of dropped futures: ``ClientProtocol.send``)."""
        with self.lock:
            self.core.send(msg, fresh)
            if msg.get("op") == "update-graph":
                reconnect.remember_graph(self, msg)
            kick = not self._draining
            self._draining = True
        if kick:
            self.loop.call_soon(self._start_drain)

    def _start_drain(self) -> None:
        """On the loop: send what is queued, in this loop turn, while each message is small and the
        connection takes it at once; the rest (a large graph, a busy connection) goes through the
        async drain.  Either way one drain runs at a time (``_draining``), so order is kept."""
        conn = getattr(self, "_conn", None)
        if conn is None:  # an asynchronous client never awaited (never connected): nothing to send on
            with self.lock:
                self._draining = False
            return
        while True:
            with self.lock:
                msg = self.core.next_message()
                if msg is None:
                    self._draining = False
                    return
            if not conn.closed and len(msg.get("tasks") or ()) <= SEND_AT_ONCE_TASKS and len(msg.get("keys") or ()) <= SEND_AT_ONCE_KEYS:
                try:
                    if conn.send_nowait(msg):
                        continue
                except CommError as exc:
                    log.warning("could not send to the scheduler: %s", exc)
                    self._fail_request(msg, exc)
                    continue
            asyncio.get_running_loop().create_task(self._drain(msg))
            return

    async def _drain(self, first: dict[str, Any] | None = None) -> None:
        msg = first
        while True:
            if msg is None:
                with self.lock:
                    msg = self.core.next_message()
                    if msg is None:
                        self._draining = False
                        return
            while self._conn.closed and self.resuming is not None:  # reconnecting: keep the order
                await self.resuming.wait()
            if self._conn.closed:
                self._fail_request(msg, self.core.lost or ConnectionLostError(
                    f"the connection to the scheduler at {self.address} is closed"))  # fmt: skip
                msg = None
                continue
            try:
                await self._conn.send(msg)
            except CommError as exc:
                log.warning("could not send to the scheduler: %s", exc)
                self._fail_request(msg, exc)
            msg = None

    def _fail_request(self, msg: dict[str, Any], exc: BaseException) -> None:
        fut = self._requests.pop(msg.get("id", -1), None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    async def request(self, msg: dict[str, Any]) -> Any:
        """Ask the scheduler; in order with graph updates and releases."""
        if self.core.lost is not None:
            raise self.core.lost
        fut = asyncio.get_running_loop().create_future()
        with self.lock:
            rid = self.core.request(msg)
            self._requests[rid] = fut
            self.request_msgs[rid] = {**msg, "id": rid}  # asked again after a reconnection
            kick = not self._draining
            self._draining = True
        if kick:
            self._start_drain()
        try:
            return await fut
        finally:
            self.request_msgs.pop(rid, None)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """``LoopThread.run``, except that a loop stopped under the call (a LocalCluster's, closed
        while we wait: it cancels what runs on it) is a lost connection, not a ``CancelledError``
        (which says a future was cancelled)."""
        try:
            return self.loop.run(coro, timeout, interruptible=True)
        except concurrent.futures.CancelledError:
            why = "this client was closed while the call waited" if self._own_loop else "its cluster closed"
            raise self.core.lost or ConnectionLostError(
                f"the event loop of the connection to the scheduler at {self.address} stopped ({why})") from None

    def call(self, msg: dict[str, Any], timeout: float | None = None) -> Any:
        """:meth:`request`, blocking the calling thread."""
        self.check_open()
        return self.run(self.request(msg), timeout=timeout)

    # ---- incoming --------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    msg = await self._conn.recv()
                except CommError as exc:
                    exc = self._silent or exc  # the watch closed it: say why
                    if not reconnect.start_resume(self, exc):
                        self._connection_lost(exc)
                    return
                with self.lock:
                    events = self.core.receive(msg)  # a malformed message is our side's failure
                self._apply(events)
        except asyncio.CancelledError:  # close(), or a shared loop stopping (its cluster closed first)
            if not self.closed:
                self._connection_lost(ConnectionLostError(f"the event loop of the connection to the scheduler "
                                                          f"at {self.address} stopped (its cluster closed)"))  # fmt: skip
            raise
        except Exception as exc:  # a bug or a message we cannot handle: never leave futures waiting
            log.exception("the client could not handle a message from the scheduler at %s; closing "
                          "the connection and failing every pending future", self.address)  # fmt: skip
            self._conn.close()
            self._connection_lost(exc, broken=True)

    def _apply(self, events: list[Event]) -> None:
        futures = self.core.futures
        for e in events:
            if isinstance(e, Settled):
                for w in self._waiting.pop(e.key, ()):
                    if not w.done():
                        w.set_result(None)
                continue
            if isinstance(e, Answered):
                fut = self._requests.pop(e.id, None)
                if fut is not None and not fut.done():
                    if e.error is not None:
                        fut.set_exception(e.error)
                    else:
                        fut.set_result(e.result)
                continue
            if isinstance(e, WorkerSetupFailed):
                self.setup_errors.append(e.report)
                log.warning("worker %s failed setup %r: %s", e.report.get("worker"), e.report.get("name"),
                            e.report.get("error"))  # fmt: skip
                continue
            with self.lock:  # user threads add futures meanwhile
                f: Any = futures.get(e.key)
            if f is None:
                continue
            if isinstance(e, Finished):
                if not f.done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                        f.set_result(IN_MEMORY)
            elif isinstance(e, Failed):
                if not f.done():
                    if e.pickled or self._building:  # unpickled off this loop (or in line behind one that is)
                        self._fail_off_loop(f, e)
                    else:
                        with contextlib.suppress(concurrent.futures.InvalidStateError):
                            f.set_exception(e.error())
                elif e.pickled:  # finished, its value lost and its task failed since (a recompute)
                    self._fail_off_loop(f, e)
                else:  # finished, and its value is lost for good (restart, unsendable)
                    f._mark_failed(e.error())
            elif isinstance(e, Cancelled):  # this future, or one downstream of it
                f._mark_cancelled()
            elif isinstance(e, Running):
                f._mark_running()

    def _fail_off_loop(self, f: Any, e: Failed) -> None:
        """Fail future ``f`` with ``e``'s exception, unpickled in a thread: unpickling runs the
        exception's own code (its ``__reduce__``), which must not hold this loop, perhaps an
        in-process cluster's scheduler's.  Until then ``f`` is pending, as it was before the
        report came (the report's ``Settled`` only wakes fetches, which build their exception off
        this loop too); :meth:`aclose` waits for these builds, so closing the client does not
        replace a task's own exception."""

        async def build() -> None:
            exc = await off_loop(e.error, self._builder)
            if f.done():  # finished before: its value, if only workers held it, is gone
                f._mark_failed(exc)
                return
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled, or lost meanwhile
                f.set_exception(exc)

        task = asyncio.get_running_loop().create_task(build())
        self._building.add(task)
        task.add_done_callback(self._building.discard)

    def _connection_lost(self, exc: BaseException, broken: bool = False) -> None:
        if broken:  # the scheduler may be fine: our side of the connection failed
            err = ConnectionLostError(
                f"the client's connection to the scheduler at {self.address} failed on our side "
                f"({type(exc).__name__}: {exc}) and was closed; results not fetched yet cannot be "
                "fetched through it. Submit again with a new Client (and report this error)"
            )
        else:
            err = ConnectionLostError(
                f"lost the scheduler at {self.address} ({exc}); results not fetched yet are gone with it. "
                "Restart the scheduler and submit again with a new Client"
            )
        with self.lock:
            self.core.connection_lost(err)
            futs = list(self.core.futures.values())
        for fut in list(self._requests.values()):
            if not fut.done():
                fut.set_exception(err)
        self._requests.clear()
        for f in futs:
            if not f.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    f.set_exception(err)  # type: ignore[attr-defined]
        for waits in list(self._waiting.values()):  # fetches waiting for a report: wake them
            for w in waits:
                if not w.done():
                    w.set_result(None)

    # ---- fetching values -------------------------------------------------------------------------
    def run_fetch(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        """Fetch values, the whole of it (asking, connecting, reading) bounded by ``timeout``.
        Values that came inline are unpickled in the calling thread, outside ``lock`` (the loop
        thread, perhaps a LocalCluster's scheduler's, takes it for every report): only the rest
        go through the loop."""
        self.check_open()
        got = self._inline_values(keys)
        if len(got) == len(keys):
            return got
        rest = [k for k in keys if k not in got]
        try:
            return {**got, **self.run(self._fetch_within(rest, timeout))}
        except TimeoutError:
            raise TimeoutError(f"values of {keys[:3]} could not be fetched within {timeout}s") from None
        except KeyCancelled as exc:
            raise concurrent.futures.CancelledError(str(exc)) from None

    def _inline_values(self, keys: list[str]) -> dict[str, Any]:
        """The values of ``keys`` that came inline, unpickled in the calling thread (outside ``lock``)."""
        if not self.core.inline:
            return {}
        with self.lock:
            blobs = self.core.inline_blobs(keys)
        got, bad = load_values(blobs)
        if bad:
            with self.lock:
                self.core.not_loadable(bad)
        return got

    async def _fetch_within(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            return await self.fetch_values(keys, timeout)

    async def fetch_values(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        with self.lock:
            plan = self.core.fetch(keys)
        backoff = 0.05
        while plan.remaining:
            with self.lock:
                by_addr, ask = plan.plan()
            if ask:
                who = await self.request(KeyQuery("who-has", ask).encode())
                with self.lock:
                    plan.named(by_addr, ask, who)
            reads = list(by_addr.items())
            results = await asyncio.gather(*(self._get_from(a, ks) for a, ks in reads), return_exceptions=True)
            with self.lock:
                for (addr, ks), res in zip(reads, results, strict=True):
                    plan.read(addr, ks, res, gone=isinstance(res, HolderGone))
                plan.end_round()
                if not plan.remaining:
                    break
                # lost with a worker (being recomputed) or raced a move: wait for the next report
                erred = plan.check_waiting()
            if erred is not None:  # its task failed: its exception, unpickled off this loop
                raise await off_loop(functools.partial(make_exception, *erred), self._builder)
            waits = []
            for k in plan.remaining:
                w = loop.create_future()
                self._waiting.setdefault(k, []).append(w)
                waits.append(w)
            # a report (recomputed, or failed) wakes us; otherwise ask again soon: the value may
            # sit on a worker we failed to reach this time
            left = None if deadline is None else max(0.0, deadline - loop.time())
            pause = backoff if left is None else min(left, backoff)
            backoff = min(1.0, backoff * 2)
            await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            for k, w in zip(plan.remaining, waits, strict=True):  # forget waiters nobody woke
                lst = self._waiting.get(k)
                if lst is not None and w in lst:
                    lst.remove(w)
                    if not lst:
                        del self._waiting[k]
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"values of {plan.remaining[:3]} not available within {timeout}s")
            if self.core.lost is not None:
                raise self.core.lost
        return plan.values

    async def _get_from(self, address: str, keys: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        entry = self._workers.get(address)
        if entry is None or entry[0].closed:
            # refused: the worker is gone; ask the scheduler again rather than retrying here
            try:
                conn = await connect(address, self.token, timeout=5, hello={"role": "client"}, retry=False,
                                     tls=self.tls)  # fmt: skip
            except ConnectionLostError as exc:
                raise HolderGone(str(exc)) from exc
            entry = self._workers[address] = (conn, asyncio.Lock())
        conn, lock = entry
        # a holder that sends nothing for a while (frozen, cut off) ends this read: the keys are
        # asked for again, and after a few such reads the fetch fails with TransferError (a bug
        # hunt's gather from a frozen worker waited for ever).  Four times a worker's fetch
        # timeout: a holder builds a reply before sending a byte of it, and a value slow to pickle
        # or to read back from disk must not pass for a frozen holder (a review: 3 s of pickling
        # under a 2 s timeout never came)
        idle = CLIENT_SILENCE_FACTOR * fetch_timeout_from_env()
        if self._own_loop:
            return await request_data(conn, lock, keys, idle)
        # a shared loop (its scheduler's): unpickling a large value runs for as long as it takes,
        # which would stop the scheduler meanwhile; do it in a thread (it gets the GIL in turns)
        blobs, failed = await request_data(conn, lock, keys, idle, load=False)
        if sum(b.nbytes for b in blobs.values()) < LOAD_IN_THREAD_BYTES:  # the hop would cost more
            values, bad = load_values(blobs)
        else:
            values, bad = await asyncio.to_thread(load_values, blobs)
        return values, {**failed, **bad}

    # ---- the FutureOwner protocol ----------------------------------------------------------------
    def fetch(self, key: str, timeout: float | None) -> Any:
        return self.run_fetch([key], timeout)[key]

    async def fetch_async(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        """:meth:`run_fetch` awaited from any asyncio loop (the caller's loop is not blocked; the
        reads run on this connection's loop).  A closed client says so (it raised the loop's
        ``RuntimeError`` or a cancellation)."""
        self.check_open()
        got = self._inline_values(keys)
        if len(got) == len(keys):
            return got
        rest = [k for k in keys if k not in got]
        coro = self._fetch_within(rest, timeout)
        try:
            if asyncio.get_running_loop() is self.loop.loop:
                more = await coro
            else:
                more = await asyncio.wrap_future(self.loop.submit(coro))
        except TimeoutError:
            raise TimeoutError(f"values of {keys[:3]} could not be fetched within {timeout}s") from None
        except KeyCancelled as exc:
            raise concurrent.futures.CancelledError(str(exc)) from None
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the caller's own cancellation
                raise
            # this connection's loop stopped under the read (the client was closed): said so, not
            # passed off as a cancellation of the caller
            self.check_open()
            raise ConnectionLostError(f"the connection to the scheduler at {self.address} stopped while "
                                      "values were read") from None  # fmt: skip
        return {**got, **more}

    def why_not_done(self, keys: list[str], timeout: float | None, *, head: bool = True) -> str:
        """The message of a ``TimeoutError``: which keys, their state and why, as the scheduler sees
        them (asked with a short timeout of its own, so a timed-out call returns soon after its
        timeout even when the scheduler does not answer; then only the keys are named)."""
        shown = keys[:3]
        try:
            self.check_open()
            why = self.run(self.request(KeyQuery("why", shown).encode()), timeout=min(2.0, self.timeout))
        except (TidepoolError, TimeoutError) as exc:
            why = _not_asked(shown, exc)
        return _why_text(keys, why, timeout, head)

    async def why_not_done_async(self, keys: list[str], timeout: float | None) -> str:
        """:meth:`why_not_done` awaited from any asyncio loop, holding no thread."""
        shown = keys[:3]
        try:
            self.check_open()
            ask = self.loop.submit(self.request(KeyQuery("why", shown).encode()))
            why = await asyncio.wait_for(asyncio.wrap_future(ask), min(2.0, self.timeout))
        except (TidepoolError, TimeoutError) as exc:
            why = _not_asked(shown, exc)
        return _why_text(keys, why, timeout, False)

    def cancel(self, futures: list[Future[Any]], *, unless_started: bool) -> None:
        """One ``cancel`` request for ``futures``; blocks until the scheduler's reports are applied.

        ``unless_started``: ``Future.cancel`` semantics (futures running or done are left alone);
        otherwise the futures are marked cancelled here at once.  Never raises: with no answer
        (client closed, scheduler lost or too slow) the futures keep whatever state they reached.
        """
        if unless_started:
            futs = [f for f in futures if f._state == PENDING]
        else:
            futs = [f for f in futures if not f.cancelled()]
            for f in futs:
                f._mark_cancelled()
        if not futs or self.closed or self.core.lost is not None:
            return
        keys = list(dict.fromkeys(f.key for f in futs))
        msg = Cancel(keys, unless_started).encode()
        if self.on_loop_thread():
            self.post(msg)  # cannot wait on our own loop: the reports settle the futures later
            return
        if unless_started:
            with self.lock:
                for k in keys:
                    self.core.cancelling.setdefault(k, None)
        try:
            self.run(self.request(msg), timeout=self.timeout)
        except (TidepoolError, TimeoutError) as exc:
            log.warning("cancelling %d futures: the scheduler did not answer (%s); those it has not "
                        "reported on keep their state", len(keys), exc)  # fmt: skip
        finally:
            if unless_started:
                with self.lock:
                    outcome = {k: self.core.cancelling.pop(k, None) for k in keys}
                for f in futs:  # in this thread: their done-callbacks run before cancel() returns
                    if outcome.get(f.key) == "cancelled":
                        f._mark_cancelled()
                    elif outcome.get(f.key) == "running":
                        f._mark_running()

    def ask_running(self, future: Future[Any]) -> bool:
        """Ask the scheduler whether ``future``'s task executes now (``Future.running``)."""
        if self.closed or self.core.lost is not None or self.on_loop_thread():
            return future._state == RUNNING
        try:
            running = self.run(self.request(KeyQuery("running", [future.key]).encode()), timeout=self.timeout)
        except (TidepoolError, TimeoutError):
            return future._state == RUNNING
        if future.key in running:
            future._mark_running()
        return future._state == RUNNING

    def release(self, keys: list[str]) -> None:
        self.post(Release(list(keys)).encode())

    def release_dropped(self, key: str) -> None:
        """Weak-reference callback of a future: its key is released after all posted before, within
        ``RELEASE_DELAY`` (with the releases of other futures dropped meanwhile: one message)."""
        if self.closed:
            return
        with self.lock:
            first = self.core.release_dropped(key)
        if first:
            self.loop.call_soon(self._arm_releases)

    def _arm_releases(self) -> None:
        asyncio.get_running_loop().call_later(RELEASE_DELAY, self._send_releases)

    def _send_releases(self) -> None:
        with self.lock:
            kick = self.core.queue_dropped() and not self._draining
            if kick:
                self._draining = True
        if kick:
            self._start_drain()

    def pin(self, future: Future[Any]) -> None:
        """Keep ``future`` alive until it is done (it has done-callbacks, or came from the executor)."""
        if future._pinned:
            return
        future._pinned = True
        self.pinned.add(future)
        future._add_raw_callback(self.pinned.discard)  # at once if it is done already

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.loop.thread

    def run_callback(self, fn: Callable[[Any], object], future: concurrent.futures.Future[Any]) -> None:
        """Run a user's done-callback off the event-loop thread (it may block, e.g. on result())."""
        try:
            self._callbacks.submit(call_logged, fn, future)
        except RuntimeError:  # the callback pool is shut down (client closed): still run it
            threading.Thread(target=call_logged, args=(fn, future), name="tidepool-callback", daemon=True).start()


__all__ = ["ClientConnection", "HolderGone", "cancelled_message"]


def _why_text(keys: list[str], why: dict[str, Any], timeout: float | None, head: bool) -> str:
    shown = keys[:3]
    parts = [f"{k!r} is {why.get(k, {}).get('state', 'unknown')}: {why.get(k, {}).get('why', '?')}"
             for k in shown]  # fmt: skip
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    lead = f"{keys[0]!r} not done after {timeout}s; " if head and len(keys) == 1 else ""
    return lead + "; ".join(parts) + more


def _not_asked(keys: list[str], exc: BaseException) -> dict[str, Any]:
    return {k: {"state": "unknown", "why": f"the scheduler could not be asked ({exc})"} for k in keys}
