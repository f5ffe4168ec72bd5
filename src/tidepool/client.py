"""The client: submit work, hold futures, gather results.

State (guarded by ``_lock``, shared by the user's threads and the client's loop thread):
``_futures`` (key -> Future, weakly held: dropping a future releases its key), ``_pinned`` (futures
held until done: those with done-callbacks or from the executor), ``_sent_funcs`` (function ids the
scheduler already has), ``_func_cache`` (id -> weak reference, id and pickle of a submitted callable:
it never keeps a callable alive) and connections to workers for direct gathers.

Data flow: ``submit``/``map``/``compute`` pickle tasks in the calling thread (each distinct function
once, by content hash) and send one ``update-graph`` message; the scheduler answers with
``report`` messages that complete futures; ``result``/``gather`` ask the scheduler who holds the
keys and read the values straight from those workers, in one request per worker.

Never hanging: once the scheduler connection is lost (``_lost``), every pending future fails with
:class:`ConnectionLostError`, a finished future whose value was not fetched yet raises it from
``result()``, and every later call raises it at once.  ``result(timeout=t)`` and
``gather(timeout=t)`` bound the whole fetch (who-has, connecting, reading), not only the wait, and
their ``TimeoutError`` names the keys, their state and why (asked from the scheduler).  Any other
error in the read loop closes the connection and fails the futures the same way; a value that
cannot be read from the holder the scheduler names (an error that is not a lost connection, or
``FETCH_ATTEMPTS`` failed reads in a row) fails with :class:`TransferError`.  A graph update over
the frame limit is refused by the call that makes it (nothing is sent; the client stays usable).

Cancelling (see :mod:`tidepool.futures` for the rules): ``Future.cancel()``, :meth:`Client.cancel`
and ``shutdown(cancel_futures=True)`` send one ``cancel`` request for all their keys through the
ordered outbox; the scheduler answers with ``cancelled``/``running`` reports for every future of
this client it touched, then with the reply, so when the call returns every affected future is in
its final state.  ``running()`` asks the scheduler the same way.  Nothing of this is sent per task.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import cloudpickle

from tidepool import client_reconnect
from tidepool.client_dask import DaskAPI
from tidepool.comm import Connection, connect, serialize
from tidepool.comm.auth import token_from_env
from tidepool.comm.frames import encode, frame_size
from tidepool.comm.serialize import Serialized
from tidepool.comm.tls import TLSConfig
from tidepool.dask.client import DaskCollections
from tidepool.errors import (
    CommError,
    ConfigError,
    ConnectionLostError,
    CycleError,
    DependencyError,
    InfeasibleTaskError,
    KeyCollisionError,
    KilledWorkerError,
    ProviderError,
    RemoteTaskError,
    RemoteTraceback,
    ResultTooLargeError,
    SchedulerError,
    SerializationError,
    TaskCancelledError,
    TaskError,
    TidepoolError,
    TransferError,
    WorkerSetupError,
)
from tidepool.futures import _UNSET, IN_MEMORY, PENDING, RUNNING, Future, call_logged
from tidepool.graph.delayed import Delayed, TaskOptions, func_name, make_key
from tidepool.graph.keys import key_name
from tidepool.graph.refs import RECURSE, Ref, collect, replace
from tidepool.loop import ClosesOnExit, LoopThread
from tidepool.resources import parse_resources

log = logging.getLogger("tidepool.client")
T = TypeVar("T")
_clients: list[weakref.ref[Client]] = []
#: reads of one value from one holder that may fail in a row (the holder still named by the
#: scheduler each time) before result()/gather() give up with a TransferError
FETCH_ATTEMPTS = 10


class _HolderGone(ConnectionLostError):
    """A holder refused the connection: it is gone, and the scheduler will say so (not counted)."""


def default_client() -> Client:
    """The most recently created client that is still open; inside a task, the worker's client
    (the one :func:`~tidepool.get_client` returns) unless the task opened another one since."""
    for ref in reversed(_clients):
        c = ref()
        if c is not None and not c.closed:
            return c
    from tidepool.worker import context

    if context._worker is not None:
        return context.get_client()
    raise ConfigError("no tidepool Client is running; create one with tidepool.Client(...)")


class Client(ClosesOnExit, concurrent.futures.Executor, DaskAPI, DaskCollections):
    """Connects to a scheduler.  ``Client()`` alone starts a :class:`LocalCluster`.

    ``address`` may be a ``tcp://host:port`` string or a cluster object (with ``address`` and
    ``token``).  The token defaults to ``$TIDEPOOL_TOKEN`` / ``$TIDEPOOL_TOKEN_FILE``.
    """

    def __init__(self, address: Any = None, token: str | None = None, *, timeout: float = 30.0,
                 name: str = "client", tls: TLSConfig | None = None, asynchronous: bool = False) -> None:  # fmt: skip
        self._own_cluster = None
        #: Dask's ``asynchronous=True``: ``await Client(..., asynchronous=True)`` (or ``async with``),
        #: and the calls that wait (gather, scheduler_info, close, ...) return awaitables
        self.asynchronous = asynchronous
        if address is None:
            from tidepool.cluster import LocalCluster

            address = self._own_cluster = LocalCluster()
        #: the cluster object this client was given or started (None for an address)
        self.cluster = None if isinstance(address, str) else address
        if not isinstance(address, str):
            token = token or getattr(address, "token", None)
            tls = tls or getattr(address, "tls", None)
            address = address.address
        #: certificates for tls:// addresses (the cluster's, else the TLS environment)
        self.tls = tls
        token = token or token_from_env()
        if not token:
            raise ConfigError("no token: pass token=..., or set TIDEPOOL_TOKEN / TIDEPOOL_TOKEN_FILE")
        self.address: str = address
        self.token: str = token
        self.timeout = timeout
        self.closed = False
        self._lock = threading.RLock()
        self._futures: weakref.WeakValueDictionary[str, Future[Any]] = weakref.WeakValueDictionary()
        self._errors: dict[str, dict[str, Any]] = {}
        self._sent_funcs: set[str] = set()
        self._func_cache: dict[int, tuple[weakref.ref[Any], str, bytes]] = {}
        self._pinned: set[Future[Any]] = set()
        #: keys a caller of Future.cancel() waits on -> the outcome reported meanwhile ("cancelled",
        #: "running"); that caller applies it, so callbacks run in its thread as with the stdlib
        self._cancelling: dict[str, str | None] = {}
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        self._workers: dict[str, tuple[Connection, asyncio.Lock]] = {}
        self._requests: dict[int, asyncio.Future[Any]] = {}
        self._req_ids = itertools.count(1)
        self._outbox: collections.deque[dict[str, Any]] = collections.deque()
        self._draining = False
        self._lost: ConnectionLostError | None = None
        #: reconnecting to a restarted scheduler (tidepool/client_reconnect.py)
        self._reconnect_window = 0.0
        self._resuming: asyncio.Event | None = None
        self._resume_task: asyncio.Task[None] | None = None
        self._request_msgs: dict[int, dict[str, Any]] = {}
        self._recent_graphs: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        #: explicit key -> what the task under it is, to refuse a different task under a live key
        self._idents: dict[str, tuple[Any, ...]] = {}
        self._setups: list[str] = []
        #: setup failures reported by workers since this client connected (dicts with traceback)
        self.setup_errors: list[dict[str, Any]] = []
        self._callbacks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tidepool-callback")
        self._loop = LoopThread("tidepool-client")
        if asynchronous:  # connects now, in the client's loop; ``await client`` waits for it
            self._starting: concurrent.futures.Future[None] | None = self._loop.submit(self._start())
            _clients.append(weakref.ref(self))
            return
        self._starting = None
        try:
            self._loop.run(self._start(), timeout=timeout + 5)
        except BaseException:
            self._failed_start()
            raise
        _clients.append(weakref.ref(self))

    def _failed_start(self) -> None:
        self.closed = True
        self._loop.stop()
        self._callbacks.shutdown(wait=False)

    def __await__(self) -> Any:
        return self._ready().__await__()

    async def _ready(self) -> Client:
        if self._starting is not None:
            try:
                await asyncio.wrap_future(self._starting)
            except BaseException:
                self._failed_start()
                raise
        return self

    async def __aenter__(self) -> Client:
        return await self._ready()

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, _Client_close, self)

    @property
    def dashboard_link(self) -> str:
        """The live dashboard's address, when the cluster this client was given (or started) serves
        one (``LocalCluster(dashboard=True)``); else ``""``."""
        return str(getattr(self.cluster, "dashboard_link", "") or "")

    def nthreads(self) -> dict[str, int]:
        """Dask's ``nthreads()``: each worker's address -> how many tasks it runs at once."""
        return {w["address"]: max(1, int(w["resources"].get("cpu", 1))) for w in self.scheduler_info()["workers"]}

    async def _start(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                self._conn = await connect(self.address, self.token, timeout=self.timeout, tls=self.tls,
                                           hello={"role": "client"})  # fmt: skip
                welcome = await self._conn.recv()
        except TimeoutError:
            raise ConnectionLostError(
                f"could not connect to the scheduler at {self.address} within {self.timeout:g}s; is it "
                "running, is the address reachable from here, and does its scheme match (a TLS scheduler "
                "has a tls:// address)?"
            ) from None
        self.id = welcome.get("client", "?")
        self._reconnect_window = float(welcome.get("reconnect_window") or 0.0)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._loop.run(self._aclose(), timeout=10)
        except Exception:
            pass
        with self._lock:
            pending = [f for f in self._futures.values() if not f.done()]
        for f in pending:
            try:
                f.set_exception(TaskCancelledError(f"client closed before {f.key!r} finished", f.key))
            except concurrent.futures.InvalidStateError:
                pass
        self._loop.stop()
        self._callbacks.shutdown(wait=False)
        if self._own_cluster is not None:
            self._own_cluster.close()

    async def _aclose(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if not hasattr(self, "_conn"):  # asynchronous, never connected
            return
        self._reader.cancel()
        self._conn.close()
        for conn, _ in self._workers.values():
            conn.close()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """``concurrent.futures.Executor.shutdown``, then :meth:`close`.

        ``cancel_futures``: cancel this client's futures whose tasks have not started executing;
        ``wait``: first wait until every other future of this client is done.
        """
        if not self.closed and self._lost is None:
            with self._lock:
                pending = [f for f in self._futures.values() if not f.done()]
            if cancel_futures:
                self._cancel(pending, unless_started=True)
            if wait:
                concurrent.futures.wait(pending)
        self.close()

    def __repr__(self) -> str:
        from tidepool.dashboard.links import client_repr

        return client_repr(self)

    def _repr_html_(self) -> str:
        from tidepool.dashboard.links import client_repr

        return client_repr(self, html=True)

    # ---- building tasks --------------------------------------------------------------------------
    def _function(self, fn: Callable[..., Any]) -> tuple[str, bytes | None]:
        """``fn``'s id (content hash) and its pickle unless the scheduler has it already.

        Pickled once while ``fn`` lives (a ``map`` pickles once): the cache holds ``fn`` weakly, so
        a submitted bound method does not keep its object alive.  A callable that cannot be weakly
        referenced (a builtin) is pickled again per call, which for those is cheap (by name).
        """
        cache = self._func_cache
        ident = id(fn)
        cached = cache.get(ident)
        if cached is None or cached[0]() is not fn:
            blob = cloudpickle.dumps(fn, protocol=5)
            fid = hashlib.sha1(blob).hexdigest()[:20]
            try:
                ref = weakref.ref(fn, _forget_function(cache, ident))
            except TypeError:  # not weakly referenceable
                return (fid, None) if fid in self._sent_funcs else (fid, blob)
            cached = (ref, fid, blob)
            if len(cache) > 10_000:
                cache.clear()
            cache[ident] = cached
        fid = cached[1]
        if fid in self._sent_funcs:
            return fid, None
        return fid, cached[2]

    def _spec(self, key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              opts: TaskOptions, functions: dict[str, Any], extra: list[Delayed[Any]] | None) -> list[Any]:  # fmt: skip
        deps: list[str] = []

        def swap(x: Any) -> Any:
            if isinstance(x, Future):
                if x.client is not self:
                    raise ConfigError(f"future {x.key} belongs to another client")
                deps.append(x.key)
                return Ref(x.key)
            if isinstance(x, Delayed):
                deps.append(x.key)
                if extra is not None:
                    extra.append(x)
                return Ref(x.key)
            if isinstance(x, Ref):
                deps.append(x.key)
                return x
            return RECURSE

        if args or kwargs:
            a2 = replace(args, swap)
            k2 = replace(kwargs, swap)
            payload = serialize((a2, k2))
        else:
            payload = None
        fid, blob = self._function(fn)
        if blob is not None:
            functions[fid] = serialize_bytes(blob)
        spec = [key, fid, payload, list(dict.fromkeys(deps)), opts.resources, opts.retries,
                opts.name or func_name(fn)]  # fmt: skip
        if opts.priority or opts.workers:
            spec += [opts.priority, list(opts.workers), opts.loose]
        return spec

    def _check_collisions(self, specs: list[list[Any]]) -> None:
        """Explicit keys: the same task may share a live key, a different one may not."""
        for spec in specs:
            ident = _identity(spec)
            with self._lock:
                old = self._futures.get(spec[0])
                if old is None or old.cancelled():
                    self._idents[spec[0]] = ident
                    continue
                before = self._idents.get(spec[0])
            if before is not None and before != ident:
                raise KeyCollisionError(
                    f"key {spec[0]!r} is already used by a different task that is still alive (another "
                    "function, arguments or inputs); give this task its own key, or release the first "
                    "future before reusing the key", spec[0])  # fmt: skip

    def _new_future(self, key: str) -> Future[Any]:
        with self._lock:
            fut = self._futures.get(key)
            collided = self._errors.get(key, {}).get("type") == "KeyCollisionError"
            if collided:  # that attempt was refused; this one is a new request
                del self._errors[key]
            if fut is None or fut.cancelled() or collided:
                fut = Future(key, self)
                self._futures[key] = fut
                weakref.finalize(fut, self._release_later, key)
            err = self._errors.get(key)
        if err is not None and not fut.done():
            fut.set_exception(self._make_exception(key, err))
        return fut

    def _check_open(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self.closed:
            raise SchedulerError("this client is closed; values can no longer be fetched (open a new Client)")

    def _send_graph(self, tasks: list[list[Any]], wanted: list[str], functions: dict[str, Any]) -> None:
        self._check_open()
        _check_acyclic(tasks)
        msg = {"op": "update-graph", "tasks": tasks, "wanted": wanted, "functions": functions}
        self._check_frame_size(msg)
        self._post(msg)
        self._sent_funcs.update(functions)
        client_reconnect.remember_graph(self, msg)

    def _check_frame_size(self, msg: dict[str, Any]) -> None:
        """Refuse, before anything is sent, a graph update over the frame limit (the scheduler would
        drop the connection, failing every future of this client): only this call fails."""
        limit = self._conn.max_frame
        tasks, functions = msg["tasks"], msg["functions"]
        sizes = [(t[2].nbytes if isinstance(t[2], Serialized) else 0, t[0]) for t in tasks]
        estimate = sum(n for n, _ in sizes) + sum(getattr(f, "nbytes", 0) for f in functions.values())
        if estimate + 256 * len(tasks) <= limit // 2:
            return  # far below: skip encoding the header twice
        size = frame_size(encode(msg))  # buffers are referenced, not copied
        if size <= limit:
            return
        biggest, key = max(sizes, default=(0, "?"))
        raise SerializationError(
            f"the arguments of {key!r} are {biggest:,} bytes ({size:,} bytes for this submission), over "
            f"the {limit:,}-byte frame limit: nothing was sent and the client stays usable. Create "
            "large data on the workers (submit a function that loads or builds it), pass it in smaller "
            "pieces, or raise TIDEPOOL_MAX_FRAME_BYTES (the same on every process)", key)  # fmt: skip

    # ---- the ordered outbox ------------------------------------------------------------------------
    # Graph updates and releases leave in the order they were made, from any thread, without
    # waiting for the loop: a release of a future dropped right after submitting its dependent
    # must never overtake that dependent's update.
    def _post(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self._outbox.append(msg)
            kick = not self._draining
            self._draining = True
        if kick:
            self._loop.call_soon(self._start_drain)

    def _start_drain(self) -> None:
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    self._draining = False
                    return
                item = self._outbox.popleft()
                msg: dict[str, Any] | None = item
                if item["op"] == "release":  # merge a run of releases
                    run = [item]
                    while self._outbox and self._outbox[0]["op"] == "release":
                        run.append(self._outbox.popleft())
                    # a dropped future's key whose future was re-created meanwhile stays wanted
                    keys = [k for r in run for k in r["keys"] if not (r.get("auto") and k in self._futures)]
                    msg = {"op": "release", "keys": keys} if keys else None
            if msg is None:
                continue
            while self._conn.closed and self._resuming is not None:  # reconnecting: keep the order
                await self._resuming.wait()
            if self._conn.closed:
                self._fail_request(msg, self._lost or ConnectionLostError(
                    f"the connection to the scheduler at {self.address} is closed"))  # fmt: skip
                continue
            if msg["op"] == "release":
                for k in msg["keys"]:
                    self._errors.pop(k, None)
            try:
                await self._conn.send(msg)
            except CommError as exc:
                log.warning("could not send to the scheduler: %s", exc)
                self._fail_request(msg, exc)

    def _fail_request(self, msg: dict[str, Any], exc: BaseException) -> None:
        fut = self._requests.pop(msg.get("id", -1), None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def submit(self, fn: Callable[..., T], *args: Any, key: Any = None,  # type: ignore[override]
               resources: dict[str, Any] | None = None, retries: int | None = 0, priority: int = 0,
               workers: str | Iterable[str] | None = None, allow_other_workers: bool = False,
               pure: bool = False, **kwargs: Any) -> Future[T]:  # fmt: skip
        """Run ``fn(*args, **kwargs)`` on a worker; returns a :class:`Future`.

        Options (not passed to ``fn``; :meth:`get_executor` gives a strict ``Executor`` that
        passes every keyword through), named as in Dask: ``key``; ``resources``; ``retries``;
        ``priority`` (higher runs first); ``workers`` (ids, names or addresses it may run on) with
        ``allow_other_workers`` (then only a preference); ``pure=True`` names the task by its
        function and arguments, so equal calls share one result (the default, ``False``, gives
        every call its own key).
        """
        _refuse_dask_only(kwargs)
        opts = TaskOptions(resources, retries, priority=priority, workers=workers, loose=allow_other_workers)
        return self._submit(fn, args, kwargs, key=key, opts=opts, pure=pure)

    def _submit(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                key: Any = None, resources: dict[str, Any] | None = None, retries: int = 0,
                opts: TaskOptions | None = None, pure: bool = False) -> Future[T]:  # fmt: skip
        if not callable(fn):
            raise ConfigError(f"submit needs a callable, got {fn!r}")
        opts = opts or TaskOptions(resources, retries)
        explicit = key is not None
        key = key_name(key) if explicit else make_key(fn)
        functions: dict[str, Any] = {}
        extra: list[Delayed[Any]] = []
        spec = self._spec(key, fn, args, kwargs, opts, functions, extra)
        if pure and not explicit:
            key = spec[0] = _pure_key(spec)
        tasks = self._delayed_specs(extra, functions) + [spec]
        if explicit:
            self._check_collisions([spec])
        fut = self._new_future(key)
        self._send_graph(tasks, [key], functions)
        return fut

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], key: Any = None,  # type: ignore[override]
            resources: dict[str, Any] | None = None, retries: int | None = 0, priority: int = 0,
            workers: str | Iterable[str] | None = None, allow_other_workers: bool = False,
            pure: bool = False, **kwargs: Any) -> list[Future[T]]:  # fmt: skip
        """``fn`` over the zipped iterables, one task each; returns a list of futures.

        Takes :meth:`submit`'s options; ``pure=True`` names each task by its arguments.
        """
        if not callable(fn):
            raise ConfigError(f"map needs a callable, got {fn!r}")
        _refuse_dask_only(kwargs, batch=True)
        opts = TaskOptions(resources, retries, priority=priority, workers=workers, loose=allow_other_workers)
        functions: dict[str, Any] = {}
        extra: list[Delayed[Any]] = []
        tasks = []
        keys = []
        argsets = list(zip(*iterables, strict=False))
        if isinstance(key, list):
            if len(key) != len(argsets):
                raise ConfigError(f"map got {len(key)} keys for {len(argsets)} tasks")
            names: Iterable[str] = [key_name(k) for k in key]
        else:
            prefix = key_name(key) if key is not None else make_key(fn)
            names = (f"{prefix}-{i}" for i in range(len(argsets)))
        for k, args in zip(names, argsets, strict=False):
            spec = self._spec(k, fn, args, kwargs, opts, functions, extra)
            if pure and key is None:
                spec[0] = _pure_key(spec)
            tasks.append(spec)
            keys.append(spec[0])
        if isinstance(key, list):
            self._check_collisions(tasks)
        tasks = self._delayed_specs(extra, functions) + tasks
        futs = [self._new_future(k) for k in keys]
        self._send_graph(tasks, keys, functions)
        return futs

    def _delayed_specs(self, roots: list[Delayed[Any]], functions: dict[str, Any]) -> list[list[Any]]:
        """Specs for the graphs behind ``roots``, dependencies first (iterative DFS)."""
        specs: list[list[Any]] = []
        seen: dict[str, Delayed[Any]] = {}
        open_: dict[str, Delayed[Any]] = {}  # on the current DFS path: reaching one again is a cycle
        explicit: list[list[Any]] = []
        for root in roots:
            if root.key in seen:
                _same_task(seen[root.key], root)
                continue
            stack: list[tuple[Delayed[Any], bool]] = [(root, False)]
            while stack:
                d, expanded = stack.pop()
                if d.key in seen:
                    _same_task(seen[d.key], d)
                    continue
                if expanded:
                    del open_[d.key]
                    seen[d.key] = d
                    specs.append(self._spec(d.key, d.func, d.args, d.kwargs, d.options, functions, None))
                    if d.explicit:
                        explicit.append(specs[-1])
                    continue
                if d.key in open_:
                    _same_task(open_[d.key], d)
                    continue  # reached twice by different paths before finishing: handled below
                open_[d.key] = d
                stack.append((d, True))
                for dep in reversed(list(d.dependencies())):
                    if dep.key in open_:
                        path = list(open_)
                        cycle = path[path.index(dep.key):] + [dep.key]
                        raise CycleError(f"the task graph has a cycle: {' -> '.join(map(repr, cycle))}; "
                                         "a task cannot depend on its own result")  # fmt: skip
                    if dep.key not in seen:
                        stack.append((dep, False))
        if explicit:
            self._check_collisions(explicit)
        return specs

    def compute(self, collection: Any, *, progress: bool = False, optimize_graph: bool = True,
                **options: Any) -> Any:  # fmt: skip
        """Submit the graphs behind delayed values; returns futures in the same structure.

        Dask collections (one, or a list/tuple of them) are computed too: a future per collection,
        of what its ``.compute()`` returns; ``options`` (``resources``, ``retries``, ``priority``,
        ``workers``, ``allow_other_workers``) apply to their tasks.
        """
        from tidepool.dask.client import dask_call

        call = dask_call(collection, options, "compute()")
        if call is not None:
            items, opts, repack = call
            dfuts = self._dask_compute(items, optimize_graph, opts)
            if progress:
                from tidepool.telemetry.progress import show_progress

                show_progress(self, dfuts)
            return repack(dfuts)
        roots: list[Delayed[Any]] = collect(collection, Delayed)
        if not roots:
            raise ConfigError("compute() found no delayed values; build them with @tidepool.task")
        functions: dict[str, Any] = {}
        tasks = self._delayed_specs(roots, functions)
        wanted = list(dict.fromkeys(r.key for r in roots))
        futs = {k: self._new_future(k) for k in wanted}
        self._send_graph(tasks, wanted, functions)
        result = replace(collection, lambda x: futs[x.key] if isinstance(x, Delayed) else RECURSE)
        if progress:
            from tidepool.telemetry.progress import show_progress

            show_progress(self, list(futs.values()), graph_keys=[t[0] for t in tasks])
        return result

    # ---- executor ----------------------------------------------------------------------------------
    def get_executor(self, *, resources: dict[str, Any] | None = None, retries: int = 0) -> ClientExecutor:
        """A strict ``concurrent.futures.Executor`` (``map`` yields results, kwargs go to ``fn``)."""
        return ClientExecutor(self, resources, retries)

    # ---- results -----------------------------------------------------------------------------------
    def gather(self, futures: Any, errors: str = "raise", timeout: float | None = None) -> Any:
        """Values of ``futures`` (a future, or a list/tuple/dict of them), fetched from workers.

        ``errors="raise"``: the first failure (or ``CancelledError`` for a cancelled future) is
        raised; ``"skip"``: failed and cancelled futures are left out.
        """
        if errors not in ("raise", "skip"):
            raise ConfigError("errors must be 'raise' or 'skip'")
        flat: list[Future[Any]] = collect(futures, Future)
        done, not_done = concurrent.futures.wait(flat, timeout=timeout)
        if not_done:
            keys = [f.key for f in flat if f in not_done]
            raise TimeoutError(f"{len(not_done)} of {len(flat)} futures not done after {timeout}s; "
                               + self._why_not_done(keys, timeout, head=False))  # fmt: skip
        need = []
        for f in flat:
            if f.cancelled():
                if errors == "raise":
                    raise concurrent.futures.CancelledError(_cancelled_message(f.key))
                continue
            if f.exception() is not None:
                if errors == "raise":
                    raise f.exception()  # type: ignore[misc]
                continue
            if f._value is _UNSET:
                need.append(f.key)
        if need:
            self._check_open()
            values = self._run_fetch(list(dict.fromkeys(need)), timeout)
            for f in flat:
                if f.key in values:
                    f._value = values[f.key]
        if errors == "skip":
            return _without_errors(futures)
        return replace(futures, lambda x: x.result() if isinstance(x, Future) else RECURSE)

    async def gather_async(self, futures: Any, timeout: float | None = None) -> Any:
        """``await client.gather_async(futures)`` from any asyncio loop."""
        flat: list[Future[Any]] = collect(futures, Future)
        for f in flat:
            await f
        return replace(futures, lambda x: x.result() if isinstance(x, Future) else RECURSE)

    def _fetch_one(self, fut: Future[Any], timeout: float | None) -> Any:
        self._check_open()
        return self._run_fetch([fut.key], timeout)[fut.key]

    def _run_fetch(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        """Fetch values, the whole of it (asking, connecting, reading) bounded by ``timeout``."""
        try:
            return self._loop.run(self._fetch_within(keys, timeout))
        except TimeoutError:
            raise TimeoutError(f"values of {keys[:3]} could not be fetched within {timeout}s") from None

    async def _fetch_within(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            return await self._fetch(keys, timeout)

    async def _fetch(self, keys: list[str], timeout: float | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        values: dict[str, Any] = {}
        remaining = list(keys)
        backoff = 0.05
        failures: dict[tuple[str, str], int] = {}  # (key, holder) -> failed reads in a row
        while remaining:
            who = await self._request({"op": "who-has", "keys": remaining})
            by_addr: dict[str, list[str]] = {}
            absent: list[str] = []
            for k in remaining:
                if k in who and who[k] is None and k not in self._errors:
                    raise TaskCancelledError(
                        f"the scheduler no longer knows {k!r}: it was released (future.release(), "
                        "client.cancel, or every future of it dropped) before its value was fetched; "
                        "submit it again", k)  # fmt: skip
                addrs = who.get(k) or []
                if addrs:
                    by_addr.setdefault(addrs[0], []).append(k)
                else:
                    absent.append(k)
            results = await asyncio.gather(
                *(self._get_from(a, ks) for a, ks in by_addr.items()), return_exceptions=True
            )
            for (addr, ks), res in zip(by_addr.items(), results, strict=False):
                if isinstance(res, (CommError, OSError, TimeoutError)):  # gone or moved: ask again
                    absent.extend(ks)
                    for k in ks if not isinstance(res, _HolderGone) else ():
                        failures[k, addr] = failures.get((k, addr), 0) + 1
                        if failures[k, addr] >= FETCH_ATTEMPTS:
                            raise TransferError(
                                f"the value of {k!r} could not be read from {addr}, which the scheduler "
                                f"still names as its holder, {FETCH_ATTEMPTS} times in a row once connected (last: "
                                f"{type(res).__name__}: {res}); can this machine reach the workers' data ports?",
                                k)  # fmt: skip
                elif isinstance(res, BaseException):  # anything else is final: never retried forever
                    raise TransferError(f"reading {ks[:3]} from {addr} failed: {type(res).__name__}: {res}",
                                        ks[0]) from res  # fmt: skip
                else:
                    got, failed = res
                    for k, why in failed.items():  # the value exists but cannot reach us: final
                        too_big = "frame limit" in why and "unpickled" not in why
                        raise (ResultTooLargeError if too_big else SerializationError)(why, k)
                    values.update(got)
                    absent.extend(k for k in ks if k not in got)
            remaining = absent
            if remaining:
                # lost with a worker (being recomputed) or raced a move: wait for the next report
                for k in remaining:
                    err = self._errors.get(k)
                    if err is not None:
                        raise self._make_exception(k, err)
                    with self._lock:
                        f = self._futures.get(k)
                    if f is not None and f.cancelled():  # its value is gone for good
                        raise concurrent.futures.CancelledError(_cancelled_message(k))
                waits = []
                for k in remaining:
                    w = loop.create_future()
                    self._waiting.setdefault(k, []).append(w)
                    waits.append(w)
                # a report (recomputed, or failed) wakes us; otherwise ask again soon: the value
                # may sit on a worker we failed to reach this time
                left = None if deadline is None else max(0.0, deadline - loop.time())
                pause = backoff if left is None else min(left, backoff)
                backoff = min(1.0, backoff * 2)
                await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
                for k, w in zip(remaining, waits, strict=True):  # forget waiters nobody woke
                    lst = self._waiting.get(k)
                    if lst is not None and w in lst:
                        lst.remove(w)
                        if not lst:
                            del self._waiting[k]
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(f"values of {remaining[:3]} not available within {timeout}s")
                if self._lost is not None:
                    raise self._lost
        return values

    async def _get_from(self, address: str, keys: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        from tidepool.worker.core import request_data

        entry = self._workers.get(address)
        if entry is None or entry[0].closed:
            # refused: the worker is gone; ask the scheduler again rather than retrying here
            try:
                conn = await connect(address, self.token, timeout=5, hello={"role": "client"}, retry=False,
                                     tls=self.tls)  # fmt: skip
            except ConnectionLostError as exc:
                raise _HolderGone(str(exc)) from exc
            entry = self._workers[address] = (conn, asyncio.Lock())
        conn, lock = entry
        return await request_data(conn, lock, keys)

    def _why_not_done(self, keys: list[str], timeout: float | None, *, head: bool = True) -> str:
        """The message of a ``TimeoutError``: which keys, their state and why, as the scheduler sees
        them (asked with a short timeout of its own, so a timed-out call returns soon after its
        timeout even when the scheduler does not answer; then only the keys are named)."""
        shown = keys[:3]
        try:
            self._check_open()
            why = self._loop.run(self._request({"op": "why", "keys": shown}), timeout=min(2.0, self.timeout))
        except (TidepoolError, TimeoutError) as exc:
            why = {k: {"state": "unknown", "why": f"the scheduler could not be asked ({exc})"} for k in shown}
        parts = [f"{k!r} is {why.get(k, {}).get('state', 'unknown')}: {why.get(k, {}).get('why', '?')}"
                 for k in shown]  # fmt: skip
        more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
        lead = f"{keys[0]!r} not done after {timeout}s; " if head and len(keys) == 1 else ""
        return lead + "; ".join(parts) + more

    # ---- scheduler messages ----------------------------------------------------------------------
    async def _request(self, msg: dict[str, Any]) -> Any:
        if self._lost is not None:
            raise self._lost
        rid = next(self._req_ids)
        fut = asyncio.get_running_loop().create_future()
        self._requests[rid] = fut
        self._request_msgs[rid] = {**msg, "id": rid}  # asked again after a reconnection
        self._post({**msg, "id": rid})  # in order with graph updates and releases
        try:
            return await fut
        finally:
            self._request_msgs.pop(rid, None)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._conn.recv()
                op = msg.get("op")
                if op == "report":
                    self._on_report(msg["items"])
                elif op == "setup-error":
                    self.setup_errors.append(msg)
                    log.warning("worker %s failed setup %r: %s", msg.get("worker"), msg.get("name"), msg.get("error"))
                elif op == "reply":
                    fut = self._requests.pop(msg.get("id"), None)
                    if fut is not None and not fut.done():
                        if "error" in msg:
                            fut.set_exception(SchedulerError(msg["error"]))
                        else:
                            fut.set_result(msg.get("result"))
        except CommError as exc:
            if not client_reconnect.start_resume(self, exc):
                self._connection_lost(exc)
        except asyncio.CancelledError:  # close()
            raise
        except Exception as exc:  # a bug or a message we cannot handle: never leave futures waiting
            log.exception("the client could not handle a message from the scheduler at %s; closing "
                          "the connection and failing every pending future", self.address)  # fmt: skip
            self._conn.close()
            self._connection_lost(exc, broken=True)

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
        self._lost = err
        for fut in list(self._requests.values()):
            if not fut.done():
                fut.set_exception(err)
        self._requests.clear()
        with self._lock:
            futs = list(self._futures.values())
        for f in futs:
            if not f.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    f.set_exception(err)
        for waits in list(self._waiting.values()):  # fetches waiting for a report: wake them
            for w in waits:
                if not w.done():
                    w.set_result(None)

    def _on_report(self, items: list[list[Any]]) -> None:
        for item in items:
            key, status = item[0], item[1]
            with self._lock:
                fut = self._futures.get(key)
            if status == "memory":
                self._errors.pop(key, None)
                if fut is not None and not fut.done():
                    try:
                        fut.set_result(IN_MEMORY)
                    except concurrent.futures.InvalidStateError:  # cancelled meanwhile, by a user thread
                        pass
            elif status == "erred":
                if item[2].get("type") == "KeyCollisionError":  # the key stays the other task's
                    with self._lock:
                        self._idents.pop(key, None)
                self._errors[key] = item[2]
                if fut is not None and not fut.done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        fut.set_exception(self._make_exception(key, item[2]))
            elif status in ("cancelled", "running"):  # answers to a cancel request of ours
                with self._lock:
                    waited = key in self._cancelling
                    if waited:
                        self._cancelling[key] = status
                if fut is not None and not waited:
                    if status == "cancelled":  # this future, or one downstream of it
                        fut._mark_cancelled()
                    else:
                        fut._mark_running()
            elif status == "lost":
                info = {"type": "TaskCancelledError", "message": f"the scheduler does not know {key!r} "
                        "(released earlier?); submit it again", "origin": key}  # fmt: skip
                self._errors[key] = info
                if fut is not None and not fut.done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        fut.set_exception(self._make_exception(key, info))
            for w in self._waiting.pop(key, []):
                if not w.done():
                    w.set_result(None)

    def _make_exception(self, key: str, info: dict[str, Any]) -> BaseException:
        blob = info.get("exception")
        tb = info.get("traceback") or ""
        origin = info.get("origin") or key
        if blob is not None:
            try:
                exc = _with_setup_hint(blob.load())
                if isinstance(exc, BaseException):
                    if tb:
                        exc.__cause__ = RemoteTraceback(tb)
                    return exc
            except Exception:
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

    # ---- releasing ---------------------------------------------------------------------------------
    def _release_later(self, key: str) -> None:
        if self._idents:
            with self._lock:
                if key not in self._futures:
                    self._idents.pop(key, None)
        if self.closed:
            return
        self._post({"op": "release", "keys": [key], "auto": True})  # after all posted before the drop

    def futures_of(self, keys: Iterable[Any]) -> list[Future[Any]]:
        """Futures of tasks by key (a key string, or what ``key=`` was given), e.g. to re-attach to
        the work of a client that died, while the scheduler (with a state directory) keeps those
        keys for it; a key the scheduler does not know fails with ``TaskCancelledError``."""
        self._check_open()
        names = [k if isinstance(k, str) else key_name(k) for k in keys]
        futs = [self._new_future(k) for k in names]
        self._post({"op": "update-graph", "tasks": [], "wanted": names, "functions": {}})
        return futs

    def _release(self, keys: list[str]) -> None:
        self._post({"op": "release", "keys": list(keys)})

    # ---- cancelling, running, callbacks --------------------------------------------------------------
    def cancel(self, futures: Future[Any] | Iterable[Future[Any]]) -> None:
        """Cancel these futures whatever their state, as Dask does.

        When this returns, each of them is cancelled (``result()`` raises
        ``concurrent.futures.CancelledError``; a finished one drops its value), and so is every
        future of this client whose task depends on one of them and had not finished.  Tasks that
        nobody else needs stop: a queued one never runs, an executing one's result is dropped, and
        no worker keeps their values.  Other clients' futures are not affected.
        ``Future.cancel()`` is the gentler, standard-library form (only tasks not started yet).
        """
        futs = [futures] if isinstance(futures, Future) else list(futures)
        for f in futs:
            if not isinstance(f, Future) or f.client is not self:
                raise ConfigError(f"cancel() takes futures of this client, got {f!r}")
        self._cancel(futs, unless_started=False)

    def _cancel(self, futures: Iterable[Future[Any]], *, unless_started: bool) -> None:
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
        if not futs or self.closed or self._lost is not None:
            return
        keys = list(dict.fromkeys(f.key for f in futs))
        msg = {"op": "cancel", "keys": keys, "unless_started": unless_started}
        if threading.current_thread() is self._loop.thread:
            self._post(msg)  # cannot wait on our own loop: the reports settle the futures later
            return
        if unless_started:
            with self._lock:
                for k in keys:
                    self._cancelling.setdefault(k, None)
        try:
            self._loop.run(self._request(msg), timeout=self.timeout)
        except (TidepoolError, TimeoutError) as exc:
            log.warning("cancelling %d futures: the scheduler did not answer (%s); those it has not "
                        "reported on keep their state", len(keys), exc)  # fmt: skip
        finally:
            if unless_started:
                with self._lock:
                    outcome = {k: self._cancelling.pop(k, None) for k in keys}
                for f in futs:  # in this thread: their done-callbacks run before cancel() returns
                    if outcome.get(f.key) == "cancelled":
                        f._mark_cancelled()
                    elif outcome.get(f.key) == "running":
                        f._mark_running()

    def _ask_running(self, fut: Future[Any]) -> bool:
        """Ask the scheduler whether ``fut``'s task executes now (``Future.running``)."""
        if self.closed or self._lost is not None or threading.current_thread() is self._loop.thread:
            return fut._state == RUNNING
        try:
            running = self._loop.run(self._request({"op": "running", "keys": [fut.key]}), timeout=self.timeout)
        except (TidepoolError, TimeoutError):
            return fut._state == RUNNING
        if fut.key in running:
            fut._mark_running()
        return fut._state == RUNNING

    def _pin(self, fut: Future[Any]) -> None:
        """Keep ``fut`` alive until it is done (it has done-callbacks, or came from the executor)."""
        if fut._pinned:
            return
        fut._pinned = True
        self._pinned.add(fut)
        fut._add_raw_callback(self._pinned.discard)  # at once if it is done already

    def _run_callback(self, fn: Callable[[Any], object], fut: concurrent.futures.Future[Any]) -> None:
        """Run a user's done-callback off the event-loop thread (it may block, e.g. on result())."""
        try:
            self._callbacks.submit(call_logged, fn, fut)
        except RuntimeError:  # the callback pool is shut down (client closed): still run it
            threading.Thread(target=call_logged, args=(fn, fut), name="tidepool-callback", daemon=True).start()

    # ---- cluster control and introspection ------------------------------------------------------
    def scheduler_info(self) -> dict[str, Any]:
        """Workers (running tasks, held keys/bytes, idle since), task counts and counters."""
        return self._call({"op": "info"})  # type: ignore[no-any-return]

    def register_setup(self, fn: Callable[[], Any] | None = None, *, modules: Iterable[str] = (),
                       files: Iterable[str] = (), requirements: Iterable[str] = (),
                       env: dict[str, str] | None = None, name: str | None = None,
                       pip_args: Iterable[str] = ()) -> dict[str, str]:  # fmt: skip
        """Prepare every worker, now and joining later, before it runs another task.

        ``modules``: local modules/packages to ship (importable on the workers afterwards);
        ``files``: local files (read them on a worker with ``tidepool.setup_file(name)``);
        ``requirements``: pip requirement strings installed on each worker; ``env``: environment
        variables; ``fn``: a function run last.  A setup with the same ``name`` replaces the
        earlier one for future workers.  Returns worker id -> "ok"; raises
        :class:`WorkerSetupError` (with the remote traceback) if it failed anywhere — such
        workers are closed and take no tasks.
        """
        from tidepool.setup import build_spec

        nm = name or (getattr(fn, "__name__", None) if fn is not None else None) or f"setup-{len(self._setups) + 1}"
        spec = build_spec(nm, fn, modules=modules, files=files, requirements=requirements, env=env,
                          pip_args=pip_args)  # fmt: skip
        return self._register_spec(nm, spec)

    def _register_spec(self, nm: str, spec: Any) -> dict[str, str]:
        self._check_open()
        self._setups.append(nm)
        result = self._call({"op": "register-setup", "name": nm, "setup": serialize(spec)})
        failed = {w: r for w, r in result.items() if r != "ok"}
        if failed:
            details = "\n".join(f"--- worker {w}: {r}" for w, r in failed.items())
            raise WorkerSetupError(f"setup {nm!r} failed on {len(failed)} of {len(result)} workers "
                                   f"(they were closed):\n{details}")  # fmt: skip
        return result  # type: ignore[no-any-return]

    def _graph_progress(self, keys: list[str] | None, watch: int | None) -> dict[str, int]:
        """How many of a graph's tasks are done (for the progress bar): keys once, then the watch id."""
        msg: dict[str, Any] = {"op": "progress", "keys": keys} if keys is not None else {"op": "progress", "watch": watch}
        return self._call(msg)  # type: ignore[no-any-return]

    def _graph_progress_end(self, watch: int) -> None:
        self._post({"op": "progress-end", "watch": watch})

    def eta(self) -> float | None:
        """Forecast seconds until everything submitted so far is done (None: no worker, no launch).

        At least max(remaining critical path, remaining work / slots), refined by simulating the
        scheduler on the workers present and those being launched.
        """
        res = self._call({"op": "eta"})
        return res["eta"]  # type: ignore[no-any-return]

    def retire_workers(self, workers: list[str]) -> dict[str, str]:
        """Gracefully retire workers: their needed data moves to survivors first.

        Returns worker id -> ``"retired"`` or ``"refused: <reason>"``.
        """
        return self._call({"op": "retire", "workers": list(workers)})  # type: ignore[no-any-return]


#: errors the scheduler makes (not raised by the task itself), by the type name it reports
_SCHEDULER_ERRORS: dict[str, type[Exception]] = {
    c.__name__: c for c in (
        InfeasibleTaskError, SerializationError, ResultTooLargeError, TransferError, KeyCollisionError,
        CycleError, ProviderError, WorkerSetupError,
    )
}  # fmt: skip


#: Dask keywords of submit/map that tidepool does not implement: refused rather than passed to fn
_DASK_ONLY = {
    "fifo_timeout": "tidepool schedules by priority and submission order; leave it out",
    "actor": "tidepool has no actors; keep state in a task's result, or in a setup hook",
    "actors": "tidepool has no actors; keep state in a task's result, or in a setup hook",
}


def _with_setup_hint(exc: Any) -> Any:
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


def _refuse_dask_only(kwargs: dict[str, Any], batch: bool = False) -> None:
    for name in kwargs:
        why = _DASK_ONLY.get(name) or ("map sends every task at once; leave it out" if batch and name == "batch_size" else None)
        if why:
            raise ConfigError(f"the Dask option {name}= is not supported by tidepool ({why}); "
                              "a function keyword of that name can be passed through get_executor().submit")  # fmt: skip


def _same_task(a: Delayed[Any], b: Delayed[Any]) -> None:
    """Two lazy values met under one key in one graph must be the same task."""
    if a is not b:
        raise KeyCollisionError(
            f"two different tasks in this graph have the key {a.key!r}; give each call its own key "
            "(.options(key=...) or dask_key_name=)", a.key)  # fmt: skip


def _pure_key(spec: list[Any]) -> str:
    """A key from the task's function, arguments and inputs: equal calls get equal keys."""
    h = hashlib.blake2b(repr(_identity(spec)).encode(), digest_size=12)
    payload = spec[2]
    if payload is not None:
        for b in payload.buffers:
            h.update(b)
    return f"{spec[6]}-{h.hexdigest()}"


def _cancelled_message(key: str) -> str:
    return f"future {key!r} was cancelled (Future.cancel or Client.cancel); submit the task again to compute it"


def _forget_function(cache: dict[int, Any], ident: int) -> Callable[[weakref.ref[Any]], None]:
    """Weak-reference callback: drop a dead callable's cache entry (if it is still that one's)."""

    def forget(ref: weakref.ref[Any]) -> None:
        entry = cache.get(ident)
        if entry is not None and entry[0] is ref:
            cache.pop(ident, None)

    return forget


def _identity(spec: list[Any]) -> tuple[Any, ...]:
    payload = spec[2]
    digest = None
    if payload is not None:
        h = hashlib.blake2b(bytes(payload.data), digest_size=16)
        digest = (h.hexdigest(), tuple(b.nbytes for b in payload.buffers))
    return (spec[1], digest, tuple(spec[3]))


def _check_acyclic(tasks: list[list[Any]]) -> None:
    """Raise :class:`CycleError` if the specs (key, func, payload, deps, ...) depend on themselves.

    Specs arrive dependencies first, so a dependency on a key that comes later in the same batch
    (or on itself) is the only way to close a cycle; such a batch is checked fully to name it.
    """
    pos = {t[0]: i for i, t in enumerate(tasks)}
    if not any(pos.get(d, -1) >= i for i, t in enumerate(tasks) for d in t[3]):
        return
    graph = {t[0]: [d for d in t[3] if d in pos] for t in tasks}
    state: dict[str, int] = {}
    for root in graph:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = []
        while stack:
            k, i = stack.pop()
            if i == 0:
                state[k] = 1
                path.append(k)
            deps = graph[k]
            if i < len(deps):
                stack.append((k, i + 1))
                d = deps[i]
                if state.get(d) == 1:
                    cycle = path[path.index(d):] + [d]
                    raise CycleError(f"the task graph has a cycle: {' -> '.join(map(repr, cycle))}; "
                                     "a task cannot depend on its own result")  # fmt: skip
                if d not in state:
                    stack.append((d, 0))
            else:
                state[k] = 2
                path.pop()


def _without_errors(obj: Any) -> Any:
    """Values of the futures in ``obj``, leaving out failed and cancelled ones (list items, dict
    entries)."""
    _skip = object()

    def walk(x: Any) -> Any:
        if isinstance(x, Future):
            return _skip if x.cancelled() or x.exception() is not None else x.result()
        t = type(x)
        if t is list or t is tuple:
            return t(v for v in (walk(i) for i in x) if v is not _skip)
        if t is dict:
            return {k: v for k, v in ((k, walk(i)) for k, i in x.items()) if v is not _skip}
        return x

    return walk(obj)


def serialize_bytes(blob: bytes) -> Any:
    from tidepool.comm.serialize import Serialized

    return Serialized(blob, [])


class ClientExecutor(concurrent.futures.Executor):
    """A strict ``concurrent.futures.Executor`` on top of a :class:`Client`.

    Every keyword of ``submit`` goes to the function; the executor's ``resources`` and ``retries``
    apply to every task.  Its futures are kept alive until done (as a ``ThreadPoolExecutor`` runs
    work nobody holds), ``map`` yields results in input order without keeping those already
    yielded, and ``shutdown(cancel_futures=True)`` cancels the futures not started yet.
    """

    def __init__(self, client: Client, resources: dict[str, Any] | None, retries: int) -> None:
        self.client = client
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
        self.client._pin(fut)
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
            self.client._pin(f)
        self._futures.update(futs)
        futs.reverse()
        return _results_in_order(self.client, futs, end)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; ``cancel_futures``: cancel the futures whose tasks have not started
        (running and finished ones are left alone); ``wait``: wait until every future is done."""
        self._shutdown = True
        futs = [f for f in list(self._futures) if not f.done()]
        if cancel_futures:
            self.client._cancel(futs, unless_started=True)
        if wait:
            concurrent.futures.wait(futs)


def _results_in_order(client: Client, futs: list[Future[T]], end: float | None) -> Iterator[T]:
    """Yield the results of ``futs`` (reversed: the next one last), dropping each future as its
    result is yielded; cancel those left when the caller stops early (as the standard library)."""
    try:
        while futs:
            yield _next_result(futs, end)
    finally:
        if futs:
            client._cancel(futs, unless_started=True)


def _next_result(futs: list[Future[T]], end: float | None) -> T:
    value = futs[-1].result(None if end is None else max(0.0, end - time.monotonic()))
    futs.pop()  # only now: a future that raised is still in ``futs``, so it is cancelled too
    return value


_Client_close = Client.close  # the blocking close, for __aexit__ and the wrapper below

#: calls that wait: with ``Client(asynchronous=True)`` they return awaitables, as in Dask
_AWAITABLE_WHEN_ASYNCHRONOUS = (
    "gather", "scatter", "scheduler_info", "nthreads", "close", "shutdown", "cancel", "retire_workers",
    "register_setup", "who_has", "has_what", "run", "restart", "upload_file", "wait_for_workers", "eta",
)  # fmt: skip


def _awaitable_when_asynchronous(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "asynchronous", False):
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and loop is not self._loop.loop:
                # an asyncio.Future, already running in a thread: nothing is left un-awaited
                return loop.run_in_executor(None, functools.partial(fn, self, *args, **kwargs))
        return fn(self, *args, **kwargs)

    return call


for _name in _AWAITABLE_WHEN_ASYNCHRONOUS:
    if callable(getattr(Client, _name, None)):
        setattr(Client, _name, _awaitable_when_asynchronous(getattr(Client, _name)))
