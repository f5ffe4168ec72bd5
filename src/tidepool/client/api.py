"""The ``Client`` facade: submit work, hold futures, gather results (Dask's names where they exist).

State: none of its own beyond configuration; what the client knows about its keys is in the core
(:class:`~tidepool.client.protocol.ClientProtocol`) and the sockets and loop thread are in the
shell (:class:`~tidepool.client.connection.ClientConnection`), which is also what every future
talks to.  Task specs are built by :class:`~tidepool.client.specs.SpecBuilder`.

Data flow: ``submit``/``map``/``compute`` pickle tasks in the calling thread (each distinct function
once, by content hash) and post one ``update-graph`` message through the ordered outbox; the
scheduler answers with ``report`` messages that complete futures and say which worker holds each
value, so ``result``/``gather`` read values straight from those workers, one request per worker
(asking who-has only for keys whose holder is not known or moved).  A graph update over the frame
limit is refused by the call that makes it (nothing is sent; the client stays usable).

Never hanging (see the shell): once the scheduler connection is lost, every pending future fails
with :class:`ConnectionLostError`; ``result(timeout=t)`` and ``gather(timeout=t)`` bound the whole
fetch, and their ``TimeoutError`` names the keys, their state and why.

Cancelling (see :mod:`tidepool.futures` for the rules): ``Future.cancel()``, :meth:`Client.cancel`
and ``shutdown(cancel_futures=True)`` send one ``cancel`` request for all their keys through the
ordered outbox; the scheduler answers with ``cancelled``/``running`` reports for every future of
this client it touched, then with the reply, so when the call returns every affected future is in
its final state.  Nothing of this is sent per task.

The Dask collections (``get``, ``persist``/``compute`` of Dask values) are in :mod:`tidepool.dask`,
which uses only this public API; the Dask-named cluster calls (``scatter``, ``run``, ...) are in
:mod:`tidepool.client.cluster_calls`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tidepool.client.cluster_calls import ClusterCalls, check_seconds, futures_of
from tidepool.client.connection import SILENCE_TIMEOUT, ClientConnection
from tidepool.client.executor import ClientExecutor
from tidepool.client.protocol import cancelled_message, make_exception
from tidepool.client.specs import SpecBuilder, check_acyclic, pure_key
from tidepool.comm.auth import token_from_env
from tidepool.comm.frames import encode, frame_size
from tidepool.comm.messages import TaskSpec, UpdateGraph
from tidepool.comm.serialize import Serialized
from tidepool.comm.tls import TLSConfig
from tidepool.errors import ConfigError, KeyCollisionError, SerializationError, TaskCancelledError
from tidepool.futures import _UNSET, Future, _wake_loop
from tidepool.graph.delayed import Delayed, TaskOptions, make_key
from tidepool.graph.keys import key_name
from tidepool.graph.refs import RECURSE, collect, replace
from tidepool.loop import ClosesOnExit, LoopThread

T = TypeVar("T")

#: tasks per ``update-graph`` message from :meth:`Client.map`: a larger map is sent in pieces of this
#: size (each piece's tasks are all wanted, so the scheduler keeps every one), which keeps the
#: scheduler's peak memory to one piece's specs and each message far below the frame limit.  Every
#: piece is built and checked before the first is sent, so a refused map submits nothing.
MAP_CHUNK = 50_000
#: every client created in this process, newest last (``default_client()`` picks the newest open one)
created: list[weakref.ref[Client]] = []
#: closes of clients begun on a shared loop's own thread, not finished yet (see Client.close)
_closing: set[asyncio.Task[None]] = set()


def _shared_loop(cluster: Any) -> LoopThread | None:
    """The loop thread of a running :class:`LocalCluster` (its scheduler runs there, in this
    process): a client of it runs on that loop too, and connects in memory (no socket) when the
    scheduler offers that; else on a loop thread of its own."""
    from tidepool.cluster import LocalCluster

    if not isinstance(cluster, LocalCluster):
        return None
    lt: LoopThread = cluster._loop  # the thread its scheduler runs on, shared on purpose
    if cluster.closed or lt.loop.is_closed() or not lt.thread.is_alive():
        return None
    return lt


class Client(ClosesOnExit, concurrent.futures.Executor, ClusterCalls):
    """Connects to a scheduler.  ``Client()`` alone starts a :class:`LocalCluster`.

    ``address`` may be a ``tcp://host:port`` string or a cluster object (with ``address`` and
    ``token``).  The token defaults to ``$TIDEPOOL_TOKEN`` / ``$TIDEPOOL_TOKEN_FILE``.
    ``timeout`` bounds connecting; ``silence_timeout``: seconds a scheduler may send nothing,
    not even an answer to the pings sent while it is quiet, before it counts as lost (frozen, or
    cut off by the network): pending futures and calls then fail with :class:`ConnectionLostError`
    (a durable scheduler is reconnected to first); ``None`` waits for ever.
    """

    def __init__(self, address: Any = None, token: str | None = None, *, timeout: float = 30.0,
                 name: str = "client", tls: TLSConfig | None = None, asynchronous: bool = False,
                 silence_timeout: float | None = SILENCE_TIMEOUT) -> None:  # fmt: skip
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
        shared = _shared_loop(self.cluster)  # then it has a scheduler in this process
        via = self.cluster.scheduler.memory_address if shared is not None and self.cluster is not None else None
        check_seconds("silence_timeout", silence_timeout)
        self._connection = conn = ClientConnection(address, token, timeout, tls, shared, via, silence_timeout)
        self._loop = conn.loop
        self._specs = SpecBuilder(self, conn.core, conn.lock)
        if "dask" in sys.modules:  # collections built from now on shuffle by tasks, not local disk
            from tidepool.dask.client import prefer_tasks_shuffle

            prefer_tasks_shuffle()
        #: setup failures reported by workers since this client connected (dicts with traceback)
        self.setup_errors: list[dict[str, Any]] = conn.setup_errors
        if asynchronous:  # connects now, in the client's loop; ``await client`` waits for it
            self._starting: concurrent.futures.Future[None] | None = self._loop.submit(conn.start())
            created.append(weakref.ref(self))
            self._close_at_exit()
            return
        self._starting = None
        try:
            self._loop.run(conn.start(), timeout=timeout + 5)
        except BaseException:
            self._failed_start()
            raise
        created.append(weakref.ref(self))
        self._close_at_exit()

    @property
    def id(self) -> str:
        """The scheduler's name for this client (``client-N``)."""
        return self._connection.id

    def _failed_start(self) -> None:
        self.closed = True
        self._connection.stop()

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

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        conn = self._connection
        conn.closed = True
        if conn.on_loop_thread() and not conn._own_loop:
            # on a shared loop's thread (a LocalCluster's: the garbage collector ran __del__ there,
            # or an observer closed us): no waiting there, but the connection must still close, or
            # the scheduler keeps this client, its tasks and their values
            task = self._loop.loop.create_task(self._aclose())
            _closing.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(_closing.discard)
        else:
            try:
                self._loop.run(self._aclose(), timeout=10)
            except Exception:
                pass
        with conn.lock:
            pending = [f for f in conn.core.futures.values() if not f.done()]
        for f in pending:
            try:
                f.set_exception(TaskCancelledError(f"client closed before {f.key!r} finished", f.key))  # type: ignore[attr-defined]
            except concurrent.futures.InvalidStateError:
                pass
        conn.stop()
        if self._own_cluster is not None:
            if conn.on_loop_thread():
                # on that cluster's own loop thread (the garbage collector ran __del__ there): its
                # close waits on that loop, so it runs in a thread of its own (not a daemon: the
                # interpreter waits for it at exit, so the workers are stopped)
                threading.Thread(target=self._own_cluster.close, name="tidepool-cluster-close").start()
            else:
                self._own_cluster.close()

    async def _aclose(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        await self._connection.aclose()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """``concurrent.futures.Executor.shutdown``, then :meth:`close`.

        ``cancel_futures``: cancel this client's futures whose tasks have not started executing;
        ``wait``: first wait until every other future of this client is done.  Unlike a
        ``ThreadPoolExecutor``'s, values not read before are not readable after it (they live on
        the workers, whose connection this closes; reading every held value into the client first
        could be gigabytes): ``gather`` what you need before.
        """
        conn = self._connection
        if not self.closed and conn.lost is None:
            with conn.lock:
                pending: list[Any] = [f for f in conn.core.futures.values() if not f.done()]
            if cancel_futures:
                conn.cancel(pending, unless_started=True)
            if wait:
                concurrent.futures.wait(pending)
        self.close()

    def __repr__(self) -> str:
        from tidepool.dashboard.links import client_repr

        return client_repr(self)

    def _repr_html_(self) -> str:
        from tidepool.dashboard.links import client_repr

        return client_repr(self, html=True)

    # ---- building and sending tasks --------------------------------------------------------------
    def futures_of(self, keys: Iterable[Any]) -> list[Future[Any]]:
        """Futures of tasks by key (a key string, or what ``key=`` was given), e.g. to re-attach to
        the work of a client that died, while the scheduler (with a state directory) keeps those
        keys for it; a key the scheduler does not know fails with ``TaskCancelledError``."""
        conn = self._connection
        conn.check_open()
        names = [k if isinstance(k, str) else key_name(k) for k in keys]
        futs = [self._new_future(k) for k in names]
        conn.post(UpdateGraph([], names).encode())
        return futs

    def _new_future(self, key: str) -> Future[Any]:
        conn = self._connection

        def make(k: str) -> Future[Any]:
            return Future(k, self, conn)  # dropped: the futures table releases its key

        with conn.lock:
            fut, err = conn.core.claim(key, make)
        if err is not None:  # its task failed already: built here, outside the lock the loop takes
            exc = make_exception(key, err)
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # failed meanwhile
                fut.set_exception(exc)
        if self.closed and not fut.done():
            # closed by another thread while this call ran (close() set ``closed`` before it failed
            # the futures it found: this one came after, and would wait for ever; a review: a map
            # returned 99,557 such futures)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(TaskCancelledError(f"client closed before {key!r} finished", key))
        return fut  # type: ignore[no-any-return]

    def _send_graph(self, tasks: list[TaskSpec], wanted: list[str], functions: dict[str, Any],
                    fresh: bool = False) -> None:  # fmt: skip
        self._check_graph(tasks, functions)
        self._post_graph(UpdateGraph(tasks, wanted, functions).encode(), functions, fresh)

    def _check_graph(self, tasks: list[TaskSpec], functions: dict[str, Any]) -> None:
        """Everything that can refuse a graph update, before it is sent: an open client, no cycle,
        the message under the frame limit."""
        self._connection.check_open()
        check_acyclic(tasks)
        self._check_frame_size(tasks, functions)

    def _post_graph(self, msg: dict[str, Any], functions: dict[str, Any], fresh: bool = False) -> None:
        """``fresh``: every task's key was made here just now (see ``ClientProtocol.send``)."""
        conn = self._connection
        conn.post(msg, fresh)
        with conn.lock:
            conn.core.sent_funcs.update(functions)

    def _check_frame_size(self, tasks: list[TaskSpec], functions: dict[str, Any]) -> None:
        """Refuse, before anything is sent, a graph update over the frame limit (the scheduler would
        drop the connection, failing every future of this client): only this call fails."""
        limit = self._connection.max_frame
        sizes = [(t.payload.nbytes if isinstance(t.payload, Serialized) else 0, t.key) for t in tasks]
        estimate = sum(n for n, _ in sizes) + sum(getattr(f, "nbytes", 0) for f in functions.values())
        if estimate + 256 * len(tasks) <= limit // 2:
            return  # far below: no need to encode the message to know
        msg = UpdateGraph(tasks, [t.key for t in tasks], functions).encode()
        size = frame_size(encode(msg))  # buffers are referenced, not copied
        if size <= limit:
            return
        biggest, key = max(sizes, default=(0, "?"))
        raise SerializationError(
            f"the arguments of {key!r} are {biggest:,} bytes ({size:,} bytes for this submission), over "
            f"the {limit:,}-byte frame limit: nothing was sent and the client stays usable. Create "
            "large data on the workers (submit a function that loads or builds it), pass it in smaller "
            "pieces, or raise TIDEPOOL_MAX_FRAME_BYTES (the same on every process)", key)  # fmt: skip

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
        self._connection.check_open()  # before a future exists: refused, nothing is left to release
        opts = opts or TaskOptions(resources, retries)
        explicit = key is not None
        key = key_name(key) if explicit else make_key(fn)
        functions: dict[str, Any] = {}
        extra: list[Delayed[Any]] = []
        spec = self._specs.spec(key, fn, args, kwargs, opts, functions, extra)
        if pure and not explicit:
            key = spec.key = pure_key(spec)
        tasks = self._specs.delayed_specs(extra, functions) + [spec] if extra else [spec]
        if explicit:
            self._specs.check_collisions([spec])
        fut = self._new_future(key)
        self._send_graph(tasks, [key], functions, fresh=not explicit and not pure and not extra)
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
        argsets = list(zip(*iterables, strict=False))
        if isinstance(key, list):
            if len(key) != len(argsets):
                raise ConfigError(f"map got {len(key)} keys for {len(argsets)} tasks")
            names: Iterable[str] = [key_name(k) for k in key]
        else:
            prefix = key_name(key) if key is not None else make_key(fn)
            names = (f"{prefix}-{i}" for i in range(len(argsets)))
        # Every piece is built and checked before the first is sent: an error (a taken key, an
        # argument that does not pickle, a piece over the frame limit) leaves nothing submitted,
        # rather than a part of the map running whose futures the caller never got.
        spec_of = self._specs.spec
        memo: dict[int, tuple[Any, str, bytes]] = {}  # the function is pickled once for the whole map
        names = iter(names)
        mine: list[TaskSpec] = []  # the map's own tasks (not the graphs of delayed arguments)
        pieces: list[tuple[list[TaskSpec], list[str], dict[str, Any]]] = []
        for start in range(0, len(argsets), MAP_CHUNK):  # one message per MAP_CHUNK tasks
            functions: dict[str, Any] = {}
            extra: list[Delayed[Any]] = []
            tasks = []
            for args, k in zip(argsets[start : start + MAP_CHUNK], names, strict=False):
                spec = spec_of(k, fn, args, kwargs, opts, functions, extra, memo)
                if pure and key is None:
                    spec.key = pure_key(spec)
                tasks.append(spec)
            mine.extend(tasks)
            keys = [t.key for t in tasks]
            if extra:
                tasks = self._specs.delayed_specs(extra, functions) + tasks
            pieces.append((tasks, keys, functions))
        if key is not None:  # explicit keys, a list or a prefix's ``<key>-<i>``: refused as submit's are
            try:
                self._specs.check_collisions(mine, batch="this map")
            except KeyCollisionError as exc:
                if isinstance(key, list):
                    raise
                prefix = key_name(key)
                raise KeyCollisionError(
                    f"map(key={prefix!r}) names its tasks {prefix}-0 to {prefix}-{len(argsets) - 1}, and a "
                    f"different task that is still alive holds {exc.key!r} (an earlier map with this prefix?): "
                    "give this map another prefix, or release the earlier futures first; nothing of this map "
                    "was submitted", exc.key) from None  # fmt: skip
        del mine
        # made-up keys only (none given, none by content, no delayed graphs among the arguments)
        fresh = key is None and not pure and all(len(tasks) == len(keys) for tasks, keys, _ in pieces)
        shipped: set[str] = set()  # a function goes in the first piece that needs it (sent in order)
        for i, (tasks, keys, functions) in enumerate(pieces):
            functions = {fid: f for fid, f in functions.items() if fid not in shipped}
            shipped.update(functions)
            pieces[i] = (tasks, keys, functions)
            self._check_graph(tasks, functions)
        # Each piece is encoded only as it goes and let go once posted: the specs of the pieces
        # still to send are all that is held beside the futures.
        futs: list[Future[T]] = []
        pieces.reverse()
        while pieces:
            tasks, keys, functions = pieces.pop()
            futs.extend(self._new_future(k) for k in keys)
            self._post_graph(UpdateGraph(tasks, keys, functions).encode(), functions, fresh)
            del tasks
        return futs

    def compute(self, collection: Any, *, sync: bool = False, progress: bool = False,
                optimize_graph: bool = True, **options: Any) -> Any:  # fmt: skip
        """Submit the graphs behind delayed values; returns futures in the same structure
        (``sync=True``: the values, as :meth:`gather` gives them).

        Dask collections (one, or a list, tuple or dict holding them) are computed too: a future
        per collection, of what its ``.compute()`` returns, other entries given back as they are;
        ``options`` (``resources``, ``retries``, ``priority``, ``workers``, ``allow_other_workers``)
        apply to their tasks.
        """
        if progress and self.asynchronous and _in_foreign_loop(self):
            # the bar waits until the graph is done: it would stop the caller's event loop
            raise ConfigError("compute(progress=True) waits for the whole graph and would block this event loop; "
                              "with an asynchronous client await the futures (watch the dashboard for "
                              "progress), or use a synchronous client")  # fmt: skip
        result = self._compute(collection, progress, optimize_graph, options)
        return self.gather(result) if sync else result

    def _compute(self, collection: Any, progress: bool, optimize_graph: bool, options: dict[str, Any]) -> Any:
        from tidepool.dask.client import compute_collections, dask_call

        call = dask_call(collection, options, "compute()")
        if call is not None:
            items, opts, repack = call
            sent: list[str] = []
            dfuts = compute_collections(self, items, optimize_graph, opts, sent)
            if progress:
                from tidepool.telemetry.progress import show_progress

                show_progress(self, dfuts, graph_keys=sent)
            return repack(dfuts)
        roots: list[Delayed[Any]] = collect(collection, Delayed)
        if not roots:
            raise ConfigError("compute() found no delayed values; build them with @tidepool.task")
        functions: dict[str, Any] = {}
        tasks = self._specs.delayed_specs(roots, functions)
        wanted = list(dict.fromkeys(r.key for r in roots))
        futs = {k: self._new_future(k) for k in wanted}
        self._send_graph(tasks, wanted, functions)
        result = replace(collection, lambda x: futs[x.key] if isinstance(x, Delayed) else RECURSE)
        if progress:
            from tidepool.telemetry.progress import show_progress

            show_progress(self, list(futs.values()), graph_keys=[t.key for t in tasks])
        return result

    def persist(self, collection: Any, optimize_graph: bool = True, **options: Any) -> Any:
        """Start computing the lazy values in ``collection`` and keep their results on the workers.

        Tidepool delayed values: returns the same structure with each replaced by its future
        (tidepool futures are what Dask calls persisted values: pass them to later tasks and
        nothing is recomputed).  Dask collections (one, or a list/tuple of them): returns the same
        collections with graphs that point at the computed chunks, so later computations reuse
        them; ``options`` (``resources``, ``retries``, ``priority``, ...) apply to their tasks.
        """
        from tidepool.dask.client import dask_call, persist_collections

        call = dask_call(collection, options, "persist()")
        if call is not None:
            items, opts, repack = call
            return repack(persist_collections(self, items, optimize_graph, opts))
        return self.compute(collection)

    def get(self, dsk: Any, keys: Any, *, progress: bool = False, **options: Any) -> Any:
        """Dask's scheduler protocol: compute ``keys`` (a key or nested lists of keys) of the Dask
        graph ``dsk`` on the cluster and return their values in the same shape (lists as tuples).
        See :func:`tidepool.dask.client.get`."""
        from tidepool.dask.client import get

        return get(self, dsk, keys, progress=progress, **options)

    def as_dask_scheduler(self) -> Any:
        """``with client.as_dask_scheduler():`` makes this client Dask's scheduler, so plain
        ``x.compute()``, ``x.persist()`` and ``dask.compute(...)`` run here (Dask's own
        ``dask.config.set(scheduler=...)``; without ``with`` it stays set)."""
        from tidepool.dask.convert import require_dask

        dask = require_dask()
        settings: dict[str, Any] = {"scheduler": self.get}
        if dask.config.get("dataframe.shuffle.method", None) is None:  # not "disk": see prefer_tasks_shuffle
            settings["dataframe.shuffle.method"] = "tasks"
        return dask.config.set(settings)

    # ---- executor ----------------------------------------------------------------------------------
    def get_executor(self, *, resources: dict[str, Any] | None = None, retries: int = 0) -> ClientExecutor:
        """A strict ``concurrent.futures.Executor`` (``map`` yields results, kwargs go to ``fn``)."""
        return ClientExecutor(self, self._connection, resources, retries)

    # ---- results -----------------------------------------------------------------------------------
    def gather(self, futures: Any, errors: str = "raise", timeout: float | None = None) -> Any:
        """Values of ``futures`` (a future, or a list/tuple/dict of them, or an iterator of them: an
        iterator of their values), fetched from workers.

        ``errors="raise"``: the first failure (or ``CancelledError`` for a cancelled future) is
        raised; ``"skip"``: failed and cancelled futures are left out.
        """
        if errors not in ("raise", "skip"):
            raise ConfigError("errors must be 'raise' or 'skip'")
        if isinstance(futures, Iterator):  # a generator of futures: an iterator of their values, as Dask
            return iter(self.gather(list(futures), errors=errors, timeout=timeout))
        flat: list[Future[Any]] = collect(futures, Future)
        done, not_done = concurrent.futures.wait(flat, timeout=timeout)
        if not_done:
            keys = [f.key for f in flat if f in not_done]
            raise TimeoutError(f"{len(not_done)} of {len(flat)} futures not done after {timeout}s; "
                               + self._connection.why_not_done(keys, timeout, head=False))  # fmt: skip
        need = []
        for f in flat:
            if f.cancelled():
                if errors == "raise":
                    raise concurrent.futures.CancelledError(cancelled_message(f.key))
                continue
            exc = f.exception()
            if exc is not None:
                if errors == "raise":  # its traceback will hold this frame: not the futures (see Future.result)
                    del futures, flat, f, done, not_done
                    raise exc
                continue
            if f._value is _UNSET:
                need.append(f.key)
        while need:
            try:
                values = self._connection.run_fetch(list(dict.fromkeys(need)), timeout)
                break
            except concurrent.futures.CancelledError:  # one was cancelled by another thread meanwhile
                need = _skip_cancelled(need, flat, errors)
        else:
            values = {}
        if values:
            for f in flat:
                if f.key in values:
                    f._value = values[f.key]
        if errors == "skip":
            return _without_errors(futures)
        return replace(futures, lambda x: x.result() if isinstance(x, Future) else RECURSE)

    async def gather_async(self, futures: Any, timeout: float | None = None, errors: str = "raise") -> Any:
        """``await client.gather_async(futures)`` from any asyncio loop: :meth:`gather` without
        blocking a thread (``await client.gather(...)`` of an asynchronous client is this).  The
        futures are waited for on the caller's loop, then every value still needed is read in one
        batch; a caller that gives up (a timeout, a cancel) leaves nothing behind."""
        if errors not in ("raise", "skip"):
            raise ConfigError("errors must be 'raise' or 'skip'")
        if isinstance(futures, Iterator):  # a generator of futures: an iterator of their values
            return iter(await self.gather_async(list(futures), timeout=timeout, errors=errors))
        flat: list[Future[Any]] = collect(futures, Future)
        loop = asyncio.get_running_loop()
        start = loop.time()
        pending = [f for f in flat if not f.done()]
        if pending:
            all_done: asyncio.Future[None] = loop.create_future()
            count = [len(pending)]
            count_lock = threading.Lock()

            def one_done(_: Any) -> None:  # in whatever thread completed it
                with count_lock:
                    count[0] -= 1
                    last = count[0] == 0
                if last:
                    _wake_loop(loop, all_done)

            for f in pending:
                f._add_raw_callback(one_done)
            try:
                await asyncio.wait_for(asyncio.shield(all_done), _finite(timeout))
            except TimeoutError:
                for f in pending:
                    f._remove_raw_callback(one_done)
                keys = [f.key for f in flat if not f.done()]
                why = await self._connection.why_not_done_async(keys, timeout)
                raise TimeoutError(f"{len(keys)} of {len(flat)} futures not done after {timeout}s; {why}") from None
            except BaseException:  # cancelled: the error a caller may keep holds this frame, not
                for f in pending:  # the futures (their keys stayed held; a review)
                    f._remove_raw_callback(one_done)
                del futures, flat, f, pending
                raise
            for f in pending:
                f._remove_raw_callback(one_done)
        need = []
        for f in flat:
            if f.cancelled():
                if errors == "raise":  # an Exception, never an asyncio cancellation of the caller
                    raise concurrent.futures.CancelledError(cancelled_message(f.key))
                continue
            exc = f.exception()
            if exc is not None:
                if errors == "raise":  # its traceback will hold this frame: not the futures (see Future.result)
                    del futures, flat, f, pending
                    raise exc
                continue
            if f._value is _UNSET:
                need.append(f.key)
        values = {}
        while need:
            bound = _finite(timeout)
            left = None if bound is None else max(0.0, bound - (loop.time() - start))
            try:
                values = await self._connection.fetch_async(list(dict.fromkeys(need)), left)
                break
            except concurrent.futures.CancelledError:  # one was cancelled by another thread meanwhile
                need = _skip_cancelled(need, flat, errors)
        if values:
            for f in flat:
                if f.key in values:
                    f._value = values[f.key]
        if errors == "skip":
            return _without_errors(futures)
        return replace(futures, lambda x: x.result() if isinstance(x, Future) else RECURSE)

    # ---- cancelling --------------------------------------------------------------------------------
    def cancel(self, futures: Future[Any] | Iterable[Future[Any]], force: bool = False) -> None:
        """Cancel these futures whatever their state, as Dask does.

        When this returns, each of them is cancelled (``result()`` raises
        ``concurrent.futures.CancelledError``; a finished one drops its value), and so is every
        future of this client whose task depends on one of them and had not finished.  Tasks that
        nobody else needs stop: a queued one never runs, an executing one's result is dropped, and
        no worker keeps their values.  Other clients' futures are not affected.
        ``Future.cancel()`` is the gentler, standard-library form (only tasks not started yet).
        ``force=True`` (Dask: cancel other clients' futures too) is refused: another client's
        futures are its own.
        """
        if force:
            raise ConfigError("cancel(force=True) is not supported: tidepool never cancels another client's futures "
                              "(a task they need keeps running); cancel them from that client")  # fmt: skip
        futs: list[Any] = []
        for f in [futures] if isinstance(futures, Future) or callable(getattr(futures, "__dask_graph__", None)) \
                else list(futures):  # fmt: skip
            # a persisted collection (alone or in the list) stands for its futures, as in Dask
            futs.extend(futures_of(f, "cancel()") if callable(getattr(f, "__dask_graph__", None)) else [f])
        for f in futs:
            if not isinstance(f, Future) or f.client is not self:
                raise ConfigError(f"cancel() takes futures of this client, got {f!r}")
        self._connection.cancel(futs, unless_started=False)


#: Dask keywords of submit/map that tidepool does not implement: refused rather than passed to fn
_DASK_ONLY = {
    "fifo_timeout": "tidepool schedules by priority and submission order; leave it out",
    "actor": "tidepool has no actors; keep state in a task's result, or in a setup hook",
    "actors": "tidepool has no actors; keep state in a task's result, or in a setup hook",
}


def _refuse_dask_only(kwargs: dict[str, Any], batch: bool = False) -> None:
    for name in kwargs:
        why = _DASK_ONLY.get(name) or ("map sends every task at once; leave it out" if batch and name == "batch_size" else None)
        if why:
            raise ConfigError(f"the Dask option {name}= is not supported by tidepool ({why}); "
                              "a function keyword of that name can be passed through get_executor().submit")  # fmt: skip


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


_Client_close = Client.close  # the blocking close, for __aexit__ and the wrapper below

#: calls that wait: with ``Client(asynchronous=True)`` they return awaitables, as in Dask
_AWAITABLE_WHEN_ASYNCHRONOUS = (
    "gather", "scatter", "scheduler_info", "nthreads", "close", "shutdown", "cancel", "retire_workers",
    "register_setup", "who_has", "has_what", "run", "restart", "upload_file", "wait_for_workers", "eta",
    "replicate", "get",
)  # fmt: skip


def _in_foreign_loop(client: Client) -> bool:
    """Called from a coroutine on a loop other than the client's own."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return loop is not client._loop.loop


def _finite(timeout: float | None) -> float | None:
    return timeout if timeout is not None and math.isfinite(timeout) else None


def _awaitable_when_asynchronous(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "asynchronous", False):
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and loop is not self._loop.loop:
                if fn.__name__ == "gather":  # on the caller's loop: no thread held while it waits
                    return self.gather_async(*args, **kwargs)
                # an asyncio.Future, already running in a thread: nothing is left un-awaited
                return loop.run_in_executor(None, functools.partial(fn, self, *args, **kwargs))
        try:
            return fn(self, *args, **kwargs)
        except BaseException:  # its traceback holds this frame: not the caller's futures (see Future.result)
            del args, kwargs
            raise

    return call


for _name in _AWAITABLE_WHEN_ASYNCHRONOUS:
    if callable(getattr(Client, _name, None)):
        setattr(Client, _name, _awaitable_when_asynchronous(getattr(Client, _name)))

Client.__module__ = "tidepool.client"  # its public home (``from tidepool.client import Client``)


def _skip_cancelled(need: list[str], flat: list[Future[Any]], errors: str) -> list[str]:
    """A read was cut off because one of its futures was cancelled (by another thread): with
    ``errors="skip"`` the keys still to read without the cancelled ones, else the error again."""
    cancelled = {f.key for f in flat if f.cancelled()}
    rest = [k for k in need if k not in cancelled]
    if errors != "skip" or len(rest) == len(need):
        raise  # noqa: PLE0704 - the read's own CancelledError, handled by the caller's except
    return rest
