"""The worker: one process, N task slots, an in-memory store, a data server for peers.

State
-----
``data`` (key -> value: a :class:`SpillStore` that keeps the least recently used values on disk
once those in memory pass the memory limit's target) and ``nbytes``; ``paused`` (over the memory
pause level: no new task starts; see ``worker/memory.py``); ``functions`` (function id -> callable, shipped once);
``queue`` (assigned tasks whose inputs are local, in arrival order), ``waiting`` (tasks fetching
inputs), ``running`` (in a slot), ``free`` (resources not reserved by running tasks), ``cancelled``
(running tasks whose results nobody wants any more).

Data flow
---------
The scheduler sends ``compute`` batches; inputs held elsewhere are fetched straight from the peer
that holds them (``get-data`` on the peer's data server) and kept as replicas; a task starts when
its resources fit what is free, so slots are never oversubscribed.  Outcomes go back in one
``task-batch`` message per loop wake-up.  Peers and clients read results over the data server;
``free`` messages drop values.  If the scheduler connection is lost the worker stops.

Blame: the keys of tasks about to enter a slot are written to the scheduler (``started``) *before*
the slot runs them, so if a task kills the process the scheduler knows it was executing, and tasks
merely queued here are not suspected.  A value that cannot be served (pickling fails, it is over
the frame limit, or pickling it ran out of memory ``MAX_SERVE_TRIES`` times) is reported once as
``unservable`` and dropped: the scheduler fails that task with
the reason instead of recomputing it forever.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import inspect
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Literal

import psutil

from tidepool.comm import Connection, Serialized, connect, listen, serialize
from tidepool.comm.core import parse_address
from tidepool.comm.serialize import deserialize
from tidepool.comm.tls import TLSConfig
from tidepool.comm.tls import resolve as resolve_tls
from tidepool.errors import (
    CommError,
    ConfigError,
    PeerSilentError,
    SerializationError,
    WorkerSetupError,
)
from tidepool.resources import parse_resources
from tidepool.scheduler.placement import fits
from tidepool.setup import run_setup
from tidepool.worker import reconnect
from tidepool.worker.executor import Outcome, SlotPool, WorkItem
from tidepool.worker.memory import (
    Action,
    MemoryMonitor,
    MemoryThresholds,
    resolve_limit,
    trim_memory,
)
from tidepool.worker.sizeof import sizeof
from tidepool.worker.spill import SpillStore, resolve_spill_limit

log = logging.getLogger("tidepool.worker")

#: times a value may fail to serialise for lack of memory before the futures wanting it fail
MAX_SERVE_TRIES = 3


class _Task:
    __slots__ = ("key", "func_id", "payload", "deps", "resources", "missing")

    def __init__(self, msg: dict[str, Any]) -> None:
        self.key: str = msg["key"]
        self.func_id: str = msg["func"]
        self.payload: Serialized | None = msg.get("payload")
        self.deps: dict[str, list[list[str]]] = msg.get("deps") or {}
        self.resources: list[tuple[str, float]] = [tuple(r) for r in msg.get("resources") or []]  # type: ignore[misc]
        self.missing = 0


class Worker:
    def __init__(
        self,
        scheduler: str,
        token: str,
        *,
        slots: int | None = None,
        resources: dict[str, Any] | None = None,
        node_type: str = "default",
        name: str | None = None,
        host: str | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float = 1.0,
        memory_limit: int | str | None = None,
        memory_thresholds: MemoryThresholds | None = None,
        memory_share: int = 1,
        spill_dir: str | None = None,
        spill_limit: int | str | None = None,
        preload: list[str] | None = None,
        restartable: bool = False,
        tls: TLSConfig | None = None,
        fetch_timeout: float | None = None,
        reconnect_window: float | None = None,
    ) -> None:
        self.scheduler_address = scheduler
        self.token = token
        self.scheme = parse_address(scheduler)[0]
        # tls:// scheduler: this worker's data server speaks TLS too, with the same certificates
        self.tls = resolve_tls(tls, scheduler) if self.scheme == "tls" else tls
        res = parse_resources(resources or {})
        if slots is not None:
            if slots < 1:
                raise ConfigError(f"slots must be at least 1, got {slots}")
            res["cpu"] = float(slots)
        res.setdefault("cpu", float(os.cpu_count() or 1))
        self.resources = res
        self.free = dict(res)
        self.node_type = node_type
        self.id = worker_id or os.environ.get("TIDEPOOL_WORKER_ID") or f"w-{uuid.uuid4().hex[:10]}"
        self.name = name or self.id
        self.host = host or _default_host(scheduler)
        self.heartbeat_interval = heartbeat_interval
        #: seconds to keep retrying a lost scheduler (None: what it announces; worker/reconnect.py)
        self.reconnect_window_setting = reconnect_window
        self.reconnect_window = 0.0
        #: seconds a peer may send nothing while we fetch from it before its copy counts as suspect
        self.fetch_timeout = fetch_timeout if fetch_timeout is not None else fetch_timeout_from_env()
        self.memory_limit = resolve_limit(memory_limit, res, memory_share)
        self.memory_thresholds = memory_thresholds or MemoryThresholds()
        self.monitor: MemoryMonitor | None = None
        self.paused = False
        self._trimmed = 0.0
        self._proc = psutil.Process()
        self.exit_reason = ""  # "memory" when the worker stopped itself over its memory limit
        #: ``client.restart()`` re-executes this process (set for worker processes started by the CLI)
        self.restartable = restartable
        self.preload = list(preload or [])
        self.setup_dir = Path(tempfile.mkdtemp(prefix=f"tidepool-{self.id}-"))
        atexit.register(shutil.rmtree, self.setup_dir, True)  # also on exits that skip close()
        self._initial_setups: list[list[Any]] = []
        self.data: MutableMapping[str, Any] = {}
        if self.memory_limit:
            # inside the worker's own temp directory by default, so whatever removes that (close,
            # exit, the local provider after a SIGKILL) removes spilled values too
            spill = self.setup_dir / ".spill"
            if spill_dir:
                spill = Path(tempfile.mkdtemp(prefix=f"tidepool-{self.id}-", dir=spill_dir))
                atexit.register(shutil.rmtree, spill, True)
            self.data = SpillStore(spill, self.memory_limit * self.memory_thresholds.target,
                                   resolve_spill_limit(spill_limit, spill), on_disable=self._spill_disabled)  # fmt: skip
        self.nbytes: dict[str, int] = {}
        self.functions: dict[str, Any] = {}
        self.queue: deque[_Task] = deque()
        self.waiting: dict[str, _Task] = {}
        self.running: dict[str, _Task] = {}
        self.cancelled: set[str] = set()
        self._fetching: dict[str, asyncio.Future[Fetched]] = {}
        self._peers: dict[str, tuple[Connection, asyncio.Lock]] = {}
        #: keys to ask each peer for in one request, sent on the next loop turn (see _batched_get)
        self._batches: dict[str, tuple[list[str], asyncio.Future[tuple[dict[str, Any], dict[str, str]]]]] = {}
        self._finished: list[list[Any]] = []
        self._erred: list[dict[str, Any]] = []
        self._missing: list[list[str | bool]] = []  # [key, dep, holder, why, holder went silent]
        self._replicas: list[list[Any]] = []
        self._started: list[str] = []
        self._stolen: list[str] = []
        self._kept: list[str] = []
        self._seceded: list[str] = []
        self.seceded: set[str] = set()  # running tasks that gave their slot back (worker_client)
        self._unservable: list[list[str]] = []
        self._serve_failures: dict[str, int] = {}  # key -> times serving it ran out of memory
        self._flush_scheduled = False
        self._sends_in_flight = 0  # batches handed to an async send, not written yet
        self.conn: Connection | None = None
        self.address = ""
        self.closed: asyncio.Event | None = None  # created in start(), inside the loop
        self._tasks: list[asyncio.Task[Any]] = []
        self.executed = 0
        self.setup_failed = False

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> Worker:
        for mod in self.preload:
            try:
                importlib.import_module(mod)
            except Exception as exc:
                raise WorkerSetupError(f"preloading module {mod!r} failed: {type(exc).__name__}: {exc}") from exc
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.closed = asyncio.Event()
        self.pool = SlotPool(loop, self._on_done)
        scheme = "tls" if self.scheme == "tls" else "tcp"
        self.listener = await listen(f"{scheme}://{self.host}:0", self._serve_peer, self.token, tls=self.tls)
        self.address = self.listener.address
        self.conn = await connect(self.scheduler_address, self.token, hello={"role": "worker", "name": self.name},
                                  tls=self.tls)  # fmt: skip
        if self.address.startswith(f"{scheme}://0.0.0.0:"):
            # advertise the interface that reaches the scheduler, not the wildcard
            local = getattr(self.conn, "local_host", "") or socket.gethostbyname(socket.gethostname())
            self.address = f"{scheme}://{local}:{self.address.rsplit(':', 1)[1]}"
        await self.conn.send(self.registration())
        reply = await self.conn.recv()
        if reply.get("op") != "registered":
            raise CommError(f"scheduler refused registration: {reply.get('reason', reply)}")
        self.reconnect_window = reconnect.window_of(self, reply)
        self.heartbeat_interval = float(reply.get("heartbeat_interval", self.heartbeat_interval))
        self._initial_setups = list(reply.get("setups") or [])
        self._tasks = [loop.create_task(self._scheduler_loop()), loop.create_task(self._heartbeat_loop())]
        if self.memory_limit:
            self.monitor = MemoryMonitor(self.memory_limit, self.memory_thresholds, loop, self._memory_action)
            self.monitor.start()
        from tidepool.worker import context

        context.set_worker(self)
        log.info("worker %s at %s registered with %s", self.id, self.address, self.scheduler_address)
        return self

    def registration(self) -> dict[str, Any]:
        return {
            "op": "register", "id": self.id, "address": self.address, "resources": self.resources,
            "node_type": self.node_type, "name": self.name, "pid": os.getpid(),
            "memory_limit": self.memory_limit, "host": socket.gethostname(),
        }  # fmt: skip

    async def finished(self) -> None:
        assert self.closed is not None
        await self.closed.wait()

    async def close(self, reason: str = "closed") -> None:
        if self.closed is None or self.closed.is_set():
            return
        log.info("worker %s closing: %s", self.id, reason)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.pool.stop()
        if self.monitor is not None:
            self.monitor.stop()
        try:
            await self.listener.close()
        finally:
            # the spill store first: its directory may be inside the temp directory removed next
            if isinstance(self.data, SpillStore):
                self.data.close()
            shutil.rmtree(self.setup_dir, ignore_errors=True)
            for conn, _ in self._peers.values():
                conn.close()
            if self.conn is not None:
                self.conn.close()
            self.closed.set()

    # ---- scheduler messages ----------------------------------------------------------------------
    async def _scheduler_loop(self) -> None:
        while True:  # a lost scheduler may come back within the reconnect window
            try:
                await self._serve_scheduler()
                return
            except CommError as exc:
                if not await reconnect.rejoin(self, exc):
                    await self.close(f"lost the scheduler: {exc}")
                    return

    async def _serve_scheduler(self) -> None:
        assert self.conn is not None
        if self._initial_setups:
            setups, self._initial_setups = self._initial_setups, []
            await self._apply_setups(setups, initial=True)
        while True:
            msg = await self.conn.recv()
            op = msg.get("op")
            if op == "setup":  # handled in order: later tasks wait for it
                await self._apply_setups(msg["setups"], initial=False)
            elif op == "compute":
                self._compute(msg)
            elif op == "free":
                self._free(msg["keys"])
            elif op == "steal":
                self._give_back(msg["keys"])
            elif op == "run":
                asyncio.get_running_loop().create_task(self._run_function(msg))
            elif op == "restart":
                await self._restart()
                return
            elif op == "replicate":
                for key, holders in msg["keys"].items():
                    asyncio.get_running_loop().create_task(self._replicate(key, holders))
            elif op == "close":
                await self.close(msg.get("reason", "asked by the scheduler"))
                return
            else:
                log.warning("unknown message from scheduler: %r", op)

    async def _apply_setups(self, items: list[list[Any]], initial: bool) -> None:
        assert self.conn is not None
        done = []
        for name, blob in items:
            try:
                spec = blob.load()
                await asyncio.to_thread(run_setup, spec, self.setup_dir)
            except Exception as exc:  # noqa: BLE001 - report any setup failure, then wait to be closed
                import traceback

                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                log.error("setup %s failed: %s", name, exc)
                await self.conn.send({"op": "setup-failed", "name": name, "error": str(exc),
                                      "traceback": tb, "initial": initial})  # fmt: skip
                self.setup_failed = True
                return
            done.append(name)
        await self.conn.send({"op": "setup-done", "names": done, "initial": initial})

    def _compute(self, msg: dict[str, Any]) -> None:
        for fid, blob in (msg.get("functions") or {}).items():
            if fid not in self.functions:
                self.functions[fid] = blob  # deserialised lazily, in the loop, once
        for tmsg in msg["tasks"]:
            t = _Task(tmsg)
            if t.key in self.running:
                self.cancelled.discard(t.key)  # re-assigned while still running: keep that run
                continue
            if t.key in self.data:
                self._finished.append([t.key, self.nbytes[t.key], 0.0])
                continue
            need = [d for d in t.deps if d not in self.data]
            if not need:
                self.queue.append(t)
                continue
            t.missing = len(need)
            self.waiting[t.key] = t
            for d in need:
                asyncio.get_running_loop().create_task(self._need(t, d, t.deps[d]))
        self._start_ready()
        self._schedule_flush()

    def _free(self, keys: list[str]) -> None:
        """Drop values; a freed task still queued never runs, a running one's result is dropped."""
        for k in keys:
            self.data.pop(k, None)
            self.nbytes.pop(k, None)
            self._serve_failures.pop(k, None)
            if k in self.running:
                self.cancelled.add(k)
            elif k in self.waiting:
                del self.waiting[k]
        if self.queue:
            ks = set(keys)  # one set, not a list scan per queued task (cancelling 10,000 at once)
            if any(t.key in ks for t in self.queue):
                self.queue = deque(t for t in self.queue if t.key not in ks)

    def _give_back(self, keys: list[str]) -> None:
        """The scheduler wants these back for an idle worker: give those not started yet."""
        ks = set(keys)
        stolen = [t.key for t in self.queue if t.key in ks]
        if stolen:
            self.queue = deque(t for t in self.queue if t.key not in ks)
        for k in keys:
            if k in self.waiting:  # still fetching inputs: the fetch finishes for nobody
                del self.waiting[k]
                stolen.append(k)
        got = set(stolen)
        self._stolen.extend(stolen)
        self._kept.extend(k for k in keys if k not in got)
        self._flush()

    async def _run_function(self, msg: dict[str, Any]) -> None:
        """``client.run``: call a function here (in a thread; coroutine functions in the loop)."""
        assert self.conn is not None
        reply: dict[str, Any] = {"op": "run-result", "rid": msg["rid"]}
        try:
            fn = msg["function"].load()
            args, kwargs = msg["args"].load() if msg.get("args") is not None else ((), {})
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args, **kwargs)
            else:
                value = await asyncio.to_thread(fn, *args, **kwargs)
            reply.update(ok=True, value=serialize(value))
        except Exception as exc:  # noqa: BLE001 - the caller gets the exception and traceback
            import traceback

            try:
                blob: Serialized | None = serialize(exc)
            except Exception:  # noqa: BLE001
                blob = None
            reply.update(ok=False, error=f"{type(exc).__name__}: {exc}", exception=blob,
                         traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))  # fmt: skip
        with contextlib.suppress(CommError):
            await self.conn.send(reply)

    async def _restart(self) -> None:
        """``client.restart``: a fresh process with the same command line, or just stop."""
        restartable = self.restartable
        await self.close("restart requested by a client")
        if restartable:
            log.info("worker %s restarting: %s", self.id, sys.orig_argv)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

    def secede(self, key: str) -> None:
        """Called from a task's thread: that task leaves its slot (it will wait on other tasks)."""
        self.loop.call_soon_threadsafe(self._secede, key)

    def _secede(self, key: str) -> None:
        t = self.running.get(key)
        if t is None or key in self.seceded:
            return
        self.seceded.add(key)
        for name, amount in t.resources:
            self.free[name] = self.free.get(name, 0.0) + amount
        self._seceded.append(key)
        self._start_ready()
        self._flush()

    def _start_ready(self) -> None:
        q = self.queue
        if not q or (self.paused and self.running):
            return
        # paused with nothing running: the memory is not ours to spill (unmanaged, or the
        # allocator's); run one task at a time rather than wait forever (the terminate level guards)
        one = self.paused
        skipped: list[_Task] = []
        items: list[WorkItem] = []
        while q:
            t = q.popleft()
            if not fits(self.free, t.resources):
                skipped.append(t)
                if len(skipped) > 64:
                    break
                continue
            func = self.functions.get(t.func_id)
            if func is None:
                self._fail(t, RuntimeError(f"function {t.func_id} was never shipped to this worker"), "")
                continue
            if isinstance(func, Serialized):
                try:
                    func = self.functions[t.func_id] = deserialize(func)
                except Exception as exc:  # cannot even load the function: report on the task
                    import traceback

                    self._fail(t, exc, traceback.format_exc())
                    continue
            gone = [d for d in t.deps if d not in self.data]
            if gone:  # an input was freed here while the task queued: the scheduler reschedules it
                self._missing.append([t.key, gone[0], "", "the input was dropped on this worker before the task started"])
                self._schedule_flush()
                continue
            for name, amount in t.resources:
                self.free[name] = self.free.get(name, 0.0) - amount
            self.running[t.key] = t
            deps = {d: self.data[d] for d in t.deps} if t.deps else {}
            items.append(WorkItem(t.key, func, t.payload, deps))
            if one:
                break
        if skipped:
            q.extendleft(reversed(skipped))
        if items:
            self._started.extend(i.key for i in items)
            self._flush()  # the scheduler hears "started" before any of them can crash us
            for item in items:
                self.pool.submit(item)

    def _on_done(self) -> None:
        for o in self.pool.drain():
            self._outcome(o)
        self._start_ready()
        self._schedule_flush()

    def _outcome(self, o: Outcome) -> None:
        t = self.running.pop(o.key, None)
        if o.key in self.seceded:
            self.seceded.discard(o.key)  # its resources went back when it seceded
        elif t is not None:
            for name, amount in t.resources:
                self.free[name] = self.free.get(name, 0.0) + amount
        if o.key in self.cancelled:
            self.cancelled.discard(o.key)
            return
        self.executed += 1
        if o.ok:
            nb = sizeof(o.value)
            self._store(o.key, o.value, nb)
            self._finished.append([o.key, nb, o.duration])
        elif t is not None:
            self._fail(t, o.value, o.tb, o.duration)

    def _store(self, key: str, value: Any, nbytes: int) -> None:
        """Keep ``value`` under ``key``, sized once (the spill store would size it again)."""
        if isinstance(self.data, SpillStore):
            self.data.put(key, value, nbytes)
        else:
            self.data[key] = value
        self.nbytes[key] = nbytes

    def _fail(self, t: _Task, exc: BaseException, tb: str, duration: float = 0.0) -> None:
        try:
            blob: Serialized | None = serialize(exc)
        except Exception:
            blob = None
        self._erred.append({
            "key": t.key, "exception": blob, "traceback": tb, "type": type(exc).__name__,
            "message": str(exc)[:10_000], "duration": duration,
        })  # fmt: skip

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and (self._finished or self._erred or self._missing or self._replicas
                                          or self._unservable):
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.reconnect_window > 0 and self.conn is not None and self.conn.closed:
            return  # kept until we are registered again (worker/reconnect.py)
        msg: dict[str, Any] = {"op": "task-batch"}
        if self._finished:
            msg["finished"], self._finished = self._finished, []
        if self._erred:
            msg["erred"], self._erred = self._erred, []
        if self._missing:
            msg["missing"], self._missing = self._missing, []
        if self._replicas:
            msg["replicas"], self._replicas = self._replicas, []
        if self._started:
            msg["started"], self._started = self._started, []
        if self._unservable:
            msg["unservable"], self._unservable = self._unservable, []
        if self._stolen or self._kept:
            msg["stolen"], msg["kept"], self._stolen, self._kept = self._stolen, self._kept, [], []
        if self._seceded:
            msg["seceded"], self._seceded = self._seceded, []
        if len(msg) > 1 and self.conn is not None and not self.conn.closed:
            if not self._sends_in_flight:  # never overtake a batch still being sent
                try:
                    if self.conn.send_nowait(msg):
                        return
                except CommError:
                    return
            self._sends_in_flight += 1
            t = asyncio.get_running_loop().create_task(self.conn.send(msg))
            t.add_done_callback(self._sent)

    def _sent(self, t: asyncio.Task[Any]) -> None:
        self._sends_in_flight -= 1
        _log_send_error(t)

    # ---- fetching inputs from peers ------------------------------------------------------------
    async def _need(self, t: _Task, dep: str, holders: list[list[str]]) -> None:
        outcome = await self._fetch(dep, holders)
        if t.key not in self.waiting:
            return  # freed meanwhile
        if outcome is not True:
            del self.waiting[t.key]
            kind, why = outcome
            if kind == "broken":  # the value exists but cannot reach us: fail, do not recompute
                self._fail(t, SerializationError(f"input {dep!r} of task {t.key!r} could not be "
                                                 f"transferred: {why}", t.key), "")  # fmt: skip
            else:  # "missing" or "silent" (a stalled holder: suspect, not dead)
                holder = holders[-1][0] if kind == "silent" and holders else holders[0][0] if holders else ""
                self._missing.append([t.key, dep, holder, why, kind == "silent"])
            self._schedule_flush()
            return
        t.missing -= 1
        if t.missing == 0:
            del self.waiting[t.key]
            self.queue.append(t)
            self._start_ready()

    async def _fetch(self, key: str, holders: list[list[str]]) -> Fetched:
        """Copy ``key`` from one of its holders: True, ("missing", why) or ("broken", why)."""
        if key in self.data:
            return True
        fut = self._fetching.get(key)
        if fut is not None:
            return await fut
        fut = asyncio.get_running_loop().create_future()
        self._fetching[key] = fut
        outcome: Fetched = ("missing", "no holder known")
        try:
            for _wid, addr in holders:
                try:
                    got, failed = await self._batched_get(addr, key)
                except PeerSilentError as exc:
                    log.warning("fetching %s from %s stalled: %s", key, addr, exc)
                    outcome = ("silent", str(exc))
                    continue
                except CommError as exc:
                    log.info("fetching %s from %s failed: %s", key, addr, exc)
                    outcome = ("missing", str(exc))
                    continue
                if key in failed:
                    outcome = ("broken", failed[key])
                    break
                if key in got:
                    self._store(key, got[key], sizeof(got[key]))
                    self._replicas.append([key, self.nbytes[key]])
                    self._schedule_flush()  # the scheduler learns of the copy now, not later
                    outcome = True
                    break
                outcome = ("missing", f"{addr} does not hold it")
            return outcome
        finally:
            del self._fetching[key]
            fut.set_result(outcome)

    async def get_from_peer(self, address: str, keys: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """Values of ``keys`` held at ``address``, and why some could not be had (key -> reason)."""
        entry = self._peers.get(address)
        if entry is None or entry[0].closed:
            # a refused connection means the peer is gone: fail now, the scheduler reschedules
            try:
                conn = await connect(address, self.token, timeout=5, hello={"role": "peer"}, retry=False,
                                     tls=self.tls)  # fmt: skip
            except CommError as exc:
                if isinstance(exc.__cause__, TimeoutError):  # no answer at all, not a refusal: silent
                    raise PeerSilentError(f"{address} did not answer: {exc}") from exc
                raise
            entry = self._peers[address] = (conn, asyncio.Lock())
        conn, lock = entry
        return await request_data(conn, lock, keys, self.fetch_timeout)

    def _batched_get(self, address: str, key: str) -> asyncio.Future[tuple[dict[str, Any], dict[str, str]]]:
        """``get_from_peer(address, [key, ...])`` for every key asked of that peer in this loop
        turn: one request and reply for a task's inputs (a shuffle stage reads dozens of small
        pieces from each peer) instead of a round trip per key."""
        batch = self._batches.get(address)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batches[address] = ([], loop.create_future())
            loop.call_soon(lambda: loop.create_task(self._send_batch(address)))
        batch[0].append(key)
        return batch[1]

    async def _send_batch(self, address: str) -> None:
        keys, fut = self._batches.pop(address)
        try:
            fut.set_result(await self.get_from_peer(address, keys))
        except Exception as exc:  # noqa: BLE001 - every key of the batch sees the peer's failure
            fut.set_exception(exc)
            fut.exception()  # retrieved here too: a batch whose askers left logs nothing
        finally:
            if not fut.done():  # cancelled (the worker is closing): its askers stop too
                fut.cancel()

    async def _replicate(self, key: str, holders: list[list[str]]) -> None:
        # a value that cannot move is reported by its holder; the retirement waits or is refused
        await self._fetch(key, holders)
        self._schedule_flush()

    # ---- serving peers and clients -------------------------------------------------------------
    async def _serve_peer(self, conn: Connection) -> None:
        while True:
            msg = await conn.recv()
            if msg.get("op") == "get-data":
                await conn.send(self._data_reply(list(msg["keys"]), conn.max_frame))
            else:
                await conn.send({"op": "error", "message": f"unknown op {msg.get('op')!r}"})

    def _data_reply(self, keys: list[str], limit: int) -> dict[str, Any]:
        """Serialise what fits in one frame; the rest is ``deferred`` (ask again), values that can
        never be sent are ``failed`` (and reported to the scheduler once, then dropped)."""
        data: dict[str, Serialized] = {}
        missing: list[str] = []
        failed: dict[str, str] = {}
        deferred: list[str] = []
        budget = limit - 64 * 1024  # room for the header
        for k in keys:
            if k not in self.data:
                missing.append(k)
                continue
            if data and self.nbytes.get(k, 0) > budget:
                deferred.append(k)
                continue
            why = ""
            if self.nbytes.get(k, 0) > limit:  # do not even try to pickle it
                why = (f"its value is about {self.nbytes[k]:,} bytes, over the {limit:,}-byte frame "
                       "limit; return something smaller (or a handle to data on shared storage)")  # fmt: skip
                typ = "ResultTooLargeError"
            else:
                try:
                    ser = serialize(self.data[k])
                except MemoryError as exc:
                    tries = self._serve_failures[k] = self._serve_failures.get(k, 0) + 1
                    if tries < MAX_SERVE_TRIES:
                        # maybe short of memory only now: keep the value, and let the connection
                        # close so the asker tries again or elsewhere at once (no timeout)
                        log.warning("out of memory serialising %r for a peer (try %d of %d); closing that "
                                    "connection", k, tries, MAX_SERVE_TRIES)  # fmt: skip
                        raise
                    why = (f"serialising its value ran out of memory {tries} times ({type(exc).__name__}{': ' if str(exc) else ''}{exc}); "
                           "raise the worker's memory (or address-space) limit, or return something smaller")  # fmt: skip
                    typ = "SerializationError"
                except Exception as exc:  # noqa: BLE001 - any pickling failure is the value's
                    why = (f"its value of type {type(self.data[k]).__name__} cannot be pickled: "
                           f"{type(exc).__name__}: {exc}")  # fmt: skip
                    typ = "SerializationError"
                if not why:
                    if ser.nbytes > limit:
                        why = (f"its value pickles to {ser.nbytes:,} bytes, over the {limit:,}-byte frame "
                               "limit; return something smaller (or a handle to data on shared storage)")  # fmt: skip
                        typ = "ResultTooLargeError"
                    elif data and ser.nbytes > budget:
                        deferred.append(k)
                        continue
                    else:
                        data[k] = ser
                        budget -= ser.nbytes
                        continue
            message = f"task {k!r} produced a value that cannot be sent: {why}"
            self._serve_failures.pop(k, None)
            failed[k] = message
            log.warning("%s", message)
            self.data.pop(k, None)
            self.nbytes.pop(k, None)
            self._unservable.append([k, typ, message])
            self._schedule_flush()
        return {"op": "data", "data": data, "missing": missing, "failed": failed, "deferred": deferred}

    # ---- memory ----------------------------------------------------------------------------------
    def _memory_action(self, action: Action, rss: int) -> None:
        """The monitor's verdict, in the loop (see ``worker/memory.py``)."""
        if self.closed is None or self.closed.is_set():
            return
        limit, t = self.memory_limit, self.memory_thresholds
        if action is Action.TERMINATE:
            self.loop.create_task(self._memory_terminate(rss))
            return
        if action in (Action.SPILL, Action.PAUSE):
            if isinstance(self.data, SpillStore):
                self.data.evict(int(rss - t.target * limit))
            now = time.monotonic()
            if now - self._trimmed > 1.0:  # at most once a second: a full collection is not free
                self._trimmed = now
                trim_memory()
        if action is Action.PAUSE and not self.paused:
            self.paused = True
            log.warning("worker %s paused: memory %s of its %s limit (pause level %d%%); no new task starts "
                        "until it falls", self.id, _mb(rss), _mb(limit), round(t.pause * 100))  # fmt: skip
            self._send_metrics()
        elif action is Action.RESUME and self.paused:
            self.paused = False
            log.info("worker %s resumed: memory %s of its %s limit", self.id, _mb(rss), _mb(limit))
            self._send_metrics()
            self._start_ready()

    def _spill_disabled(self, reason: str) -> None:
        """The spill store turned spilling off (a write failed, or the spill limit was reached):
        say so in the log (done by the store) and to the scheduler at once (journal, dashboard)."""
        if self.closed is not None and not self.closed.is_set() and self.conn is not None and not self.conn.closed:
            msg = {"op": "spill-disabled", "reason": reason, "metrics": self._metrics()}
            self.loop.create_task(self.conn.send(msg)).add_done_callback(_log_send_error)

    async def _memory_terminate(self, rss: int) -> None:
        limit = self.memory_limit
        why = (f"worker {self.name} used {_mb(rss)} of memory, over {round(self.memory_thresholds.terminate * 100)}% "
               f"of its {_mb(limit)} limit; it restarts")  # fmt: skip
        log.error("%s (running: %s)", why, ", ".join(self.running) or "nothing")
        self.exit_reason = "memory"
        if self.conn is not None and not self.conn.closed:
            with contextlib.suppress(CommError):
                await self.conn.send({"op": "memory-exceeded", "rss": rss, "limit": limit, "message": why,
                                      "restarting": self.restartable})  # fmt: skip
        await self.close(why)

    def _metrics(self) -> dict[str, Any]:
        store = self.data
        monitor = self.monitor
        rss = monitor.sample() if monitor is not None else _rss(self._proc)
        return {"rss": rss, "keys": len(store), "bytes": sum(self.nbytes.values()),
                "spilled": store.spilled_bytes if isinstance(store, SpillStore) else 0,
                "spilled_total": store.spilled_total if isinstance(store, SpillStore) else 0,
                "spill_disabled": store.disabled if isinstance(store, SpillStore) else "",
                "peak_rss": monitor.peak() if monitor is not None else rss, "memory_limit": self.memory_limit,
                "paused": self.paused, "running": len(self.running), "queued": len(self.queue),
                "time": time.time()}  # fmt: skip

    def _send_metrics(self) -> None:
        if self.conn is not None and not self.conn.closed:
            t = self.loop.create_task(self.conn.send({"op": "heartbeat", "metrics": self._metrics()}))
            t.add_done_callback(_log_send_error)

    # ---- heartbeats ------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self.conn is None or self.conn.closed:
                return
            with contextlib.suppress(CommError):
                await self.conn.send({"op": "heartbeat", "metrics": self._metrics()})


def _rss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_info().rss)
    except psutil.Error:
        return 0


def _mb(n: int | float) -> str:
    return f"{n / 2**20:,.0f} MiB"


#: what fetching a value gives: True, or ("missing" | "broken", reason)
Fetched = Literal[True] | tuple[str, str]


async def request_data(conn: Connection, lock: asyncio.Lock, keys: list[str],
                       idle_timeout: float | None = None) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """Ask a worker's data server for ``keys`` (following ``deferred`` replies); returns the values
    and, for keys that cannot be had, the reason (the holder cannot send them, or they do not
    unpickle here).  Keys the holder does not have are in neither.  With ``idle_timeout``, a holder
    that sends nothing for that long raises :class:`PeerSilentError` (and the connection closes)."""
    values: dict[str, Any] = {}
    failed: dict[str, str] = {}
    todo = list(keys)
    while todo:
        async with lock:
            await conn.send({"op": "get-data", "keys": todo})
            reply = await (conn.recv() if idle_timeout is None else conn.recv_unless_silent(idle_timeout))
        for k, blob in reply["data"].items():
            try:
                values[k] = blob.load()
            except Exception as exc:  # noqa: BLE001 - whatever unpickling raised
                failed[k] = f"the value of {k!r} cannot be unpickled here: {type(exc).__name__}: {exc}"
        failed.update(reply.get("failed") or {})
        todo = list(reply.get("deferred") or ())
    return values, failed


#: how long a peer may send nothing during a fetch before its copy is suspect (issue 29); long
#: enough for a loaded machine, short next to the 300 s heartbeat time-to-live
DEFAULT_FETCH_TIMEOUT = 30.0
FETCH_TIMEOUT_ENV = "TIDEPOOL_FETCH_TIMEOUT"


def fetch_timeout_from_env() -> float:
    """``$TIDEPOOL_FETCH_TIMEOUT`` (seconds), else :data:`DEFAULT_FETCH_TIMEOUT`."""
    raw = os.environ.get(FETCH_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_FETCH_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ConfigError(f"{FETCH_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


def _log_send_error(t: asyncio.Task[Any]) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.debug("send to scheduler failed: %s", t.exception())


def _default_host(scheduler: str) -> str:
    from tidepool.comm.core import parse_address

    _, host, _ = parse_address(scheduler)
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return os.environ.get("TIDEPOOL_WORKER_HOST", "0.0.0.0")


async def run_worker(scheduler: str, token: str, **kwargs: Any) -> None:
    """Start a worker and run until the scheduler closes it or the connection is lost."""
    w = await Worker(scheduler, token, **kwargs).start()
    await w.finished()
