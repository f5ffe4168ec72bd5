"""The worker process: the asyncio shell around :class:`~tidepool.worker.state.WorkerState`.

State (the shell's own; every decision is the state's): the connection to the scheduler, the
values themselves (``data``: a :class:`SpillStore` when there is a memory limit, moving values to
disk when the state says ``Spill``), shipped functions, the specs of assigned tasks (function and
arguments), values that arrived and wait for the state's ``Store``, the slot threads
(:class:`SlotPool`), peer connections (``worker/peers.py``) and the reports not sent yet.

Data flow: :meth:`Worker._scheduler_loop` (the one connection loop: register, then messages in
order) turns ``compute``, ``free``, ``steal``, ``replicate`` into state events; slot threads,
fetches, the data server and the memory monitor feed events too.  :meth:`Worker._apply` carries
out the commands: run a task in a slot, fetch an input, store, drop or spill values, and report.
An outcome whose handling raises (a bug, a failed store) is logged and its task reported erred; the
other outcomes of that wake-up are handled all the same (:meth:`Worker._on_done`).
Reports go out in one ``task-batch`` message per loop wake-up, except that ``started`` (and steal
replies, and seceded tasks) are sent at once: the scheduler hears a task that is not quick started
before it can crash the process.  "At once" is once per batch of commands: every task the batch
starts is reported in one message, sent before any of them is handed to a slot.  Quick tasks
(their function last ran in under 2 ms, ``worker/state.py``) run in lanes, one slot thread taking
one after another, and are never reported started (their outcome says it; one message per lane
wake-up, not two per task); a lane member not reached yet is taken back out for a ``free``,
``steal`` or cut (:meth:`Worker._unline`), and a timer (:meth:`Worker._watch`, while a lane member
that has not seceded or been reported long runs) tells the state of a member running ``LONG``.  A crash among quick tasks is blamed on the
next run, which the scheduler makes ``solo``.  If the scheduler connection is lost the worker
stops, unless it may retry within a reconnect window (``worker/reconnect.py``: it keeps its work
and registers again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

import psutil

from tidepool.comm import Connection, Serialized, connect, listen
from tidepool.comm.core import PEER_INBOX, parse_address
from tidepool.comm.data import fetch_timeout_from_env
from tidepool.comm.inline import small_pickle
from tidepool.comm.serialize import deserialize
from tidepool.comm.tls import TLSConfig
from tidepool.comm.tls import resolve as resolve_tls
from tidepool.errors import CommError, ConfigError
from tidepool.resources import worker_resources
from tidepool.worker import jobs, reconnect, workspace
from tidepool.worker import state as ws
from tidepool.worker.executor import Outcome, SlotPool, WorkItem
from tidepool.worker.jobs import metrics
from tidepool.worker.memory import (
    Action,
    MemoryMonitor,
    MemoryThresholds,
    mib,
    resolve_limit,
    trim_memory,
)
from tidepool.worker.outbox import Outbox, log_send_error
from tidepool.worker.peers import Peers, data_reply, listen_host
from tidepool.worker.sizeof import sizeof
from tidepool.worker.spill import SpillStore, worker_store

log = logging.getLogger("tidepool.worker")
#: set by a worker restarting itself over its memory limit for the new process: the port to take again
PORT_ENV = "TIDEPOOL_WORKER_PORT"
#: the worker's id when no ``worker_id`` is given: set by the providers, and for the fresh process
#: a CLI worker becomes after a memory restart (the same id: work pinned with ``workers=[id]`` finds it)
ID_ENV = "TIDEPOOL_WORKER_ID"
#: report kinds sent at once rather than with the next batch
_NOW = frozenset({"started", "stolen", "kept", "seceded"})


#: the least a data reply may carry under a memory limit (bytes; a single larger value goes alone)
REPLY_FLOOR = 4 * 2**20


class Worker:
    def __init__(self, scheduler: str, token: str, *, slots: int | None = None, resources: dict[str, Any] | None = None,
                 node_type: str = "default", name: str | None = None, host: str | None = None,
                 worker_id: str | None = None, heartbeat_interval: float = 1.0, memory_limit: int | str | None = None,
                 memory_thresholds: MemoryThresholds | None = None, memory_share: int = 1,
                 spill_dir: str | None = None, spill_limit: int | str | None = None, preload: list[str] | None = None,
                 restartable: bool = False, tls: TLSConfig | None = None,
                 fetch_timeout: float | None = None, reconnect_window: float | None = None) -> None:  # fmt: skip
        self.scheduler_address = scheduler
        #: the address the scheduler gives itself (its TCP one, when we came through its Unix
        #: socket): what a client made in a task connects to and shows (``get_client``)
        self.scheduler_public_address = scheduler
        self.token = token
        self.scheme = parse_address(scheduler)[0]
        # tls:// scheduler: this worker's data server speaks TLS too, with the same certificates
        self.tls = resolve_tls(tls, scheduler) if self.scheme == "tls" else tls
        self.resources = res = worker_resources(resources, slots)
        self.node_type = node_type
        self.id = worker_id or os.environ.get(ID_ENV) or f"w-{uuid.uuid4().hex[:10]}"
        self.name = name or self.id
        self.host = host or listen_host(scheduler)
        self.heartbeat_interval = heartbeat_interval
        #: seconds to keep retrying a lost scheduler (setting None: what it announces; worker/reconnect.py)
        self.reconnect_window_setting, self.reconnect_window = reconnect_window, 0.0
        #: seconds a peer may send nothing while we fetch from it before its copy counts as suspect
        self.fetch_timeout = fetch_timeout if fetch_timeout is not None else fetch_timeout_from_env()
        self.memory_limit = resolve_limit(memory_limit, res, memory_share)
        self.memory_thresholds = memory_thresholds or MemoryThresholds()
        self.state = ws.WorkerState(res, limit=self.memory_limit, thresholds=self.memory_thresholds)
        self.monitor: MemoryMonitor | None = None
        self._trimmed = 0.0
        self._proc = psutil.Process()
        baseline = self._proc.memory_info().rss
        if self.memory_limit and baseline >= self.memory_thresholds.pause * self.memory_limit:
            # it would pause or restart itself before its first task, for ever (a bug hunt saw 49
            # restarts and every task killed under memory_limit="10KB")
            raise ConfigError(f"memory limit {mib(self.memory_limit)} is below what this worker uses before any "
                              f"task ({mib(baseline)}); give it several times that (--memory-limit, "
                              "LocalCluster(memory_limit=...), or 'none' for no limit)")  # fmt: skip
        self.exit_reason = ""  # "memory" when the worker stopped itself over its memory limit
        self._closing = False
        #: ``client.restart()`` re-executes this process (set for worker processes started by the CLI)
        self.restartable = restartable
        self.preload = list(preload or [])
        self.setup_dir = workspace.claim(self.id)  # removed at exit; killed workers' are swept
        self._initial_setups: list[list[Any]] = []
        self.data: MutableMapping[str, Any] = {}
        if self.memory_limit:  # values move to disk when the state says so (target: infinite)
            self.data = worker_store(self.setup_dir, self.id, spill_dir, spill_limit, self._spill_disabled)
        self.functions: dict[str, Any] = {}
        self._function_blobs: dict[str, Any] = {}  # their pickles, to load again after a setup
        self.setup_runs = jobs.SetupRuns()  # which setups ran here (a rejoin says so)
        self._specs: dict[str, tuple[str, Serialized | None, list[str]]] = {}  # key -> (function, args, inputs)
        self._arrived: dict[str, Any] = {}  # values the state has not said to store yet
        self._serve_failures: dict[str, int] = {}  # key -> times serving it ran out of memory
        self._inline_wanted: set[str] = set()  # tasks whose small value goes back in the report
        self._inline: dict[str, Serialized] = {}  # their pickles, until the finished report takes them
        self._returned: dict[str, WorkItem] = {}  # taken back out of a lane (cut): run again later
        self._watching = False  # the lane timer is set
        self.outbox = Outbox()
        self.conn: Connection | None = None
        self.address = ""
        self.closed: asyncio.Event | None = None  # created in start(), inside the loop
        self._tasks: list[asyncio.Task[Any]] = []
        self.setup_failed = False

    # ---- lifecycle -------------------------------------------------------------------------------
    async def _listen(self, scheme: str, port: str) -> Any:
        """The data port: the one this worker had before it restarted itself over its memory limit
        (:data:`PORT_ENV`, set for the new process), so work pinned to its address still finds it;
        any free port if that one is taken."""
        if port.isdigit():
            try:
                return await listen(f"{scheme}://{self.host}:{port}", self._serve_peer, self.token, tls=self.tls)
            except OSError as exc:
                log.warning("worker %s: its old port %s is taken (%s); it listens on another, and tasks pinned "
                            "to its old address (workers=[...]) will not find it", self.id, port, exc)  # fmt: skip
        return await listen(f"{scheme}://{self.host}:0", self._serve_peer, self.token, tls=self.tls)

    async def start(self) -> Worker:
        port = os.environ.pop(PORT_ENV, "")  # before preload: nothing this process starts inherits it
        jobs.preload(self.preload)
        loop = self.loop = asyncio.get_running_loop()
        self.closed = asyncio.Event()
        self.pool = SlotPool(loop, self._on_done)
        self.peers = Peers(self.token, self.tls, self.fetch_timeout)
        scheme = "tls" if self.scheme == "tls" else "tcp"
        self.listener = await self._listen(scheme, port)
        self.address = self.listener.address
        await self._connect(scheme)
        self._tasks = [loop.create_task(self._scheduler_loop()), loop.create_task(self._heartbeat_loop())]
        if self.memory_limit:
            self.monitor = MemoryMonitor(self.memory_limit, self.memory_thresholds, loop, self._memory_action)
            self.monitor.start()
        from tidepool.worker import context

        context.set_worker(self)
        log.info("worker %s at %s registered with %s", self.id, self.address, self.scheduler_address)
        return self

    async def _connect(self, scheme: str) -> None:
        """Connect to the scheduler and register (the one place that does; a reconnect goes here)."""
        self.conn = await connect(self.scheduler_address, self.token, hello={"role": "worker", "name": self.name},
                                  tls=self.tls)  # fmt: skip
        if self.address.startswith(f"{scheme}://0.0.0.0:"):
            # advertise the interface that reaches the scheduler, not the wildcard
            local = getattr(self.conn, "local_host", "") or socket.gethostbyname(socket.gethostname())
            self.address = f"{scheme}://{local}:{self.address.rsplit(':', 1)[1]}"
        self.outbox.conn = self.conn
        await self.conn.send(reconnect.registration(self))
        reply = await self.conn.recv()
        if reply.get("op") != "registered":
            raise CommError(f"scheduler refused registration: {reply.get('reason', reply)}")
        reconnect.registered(self, reply)
        self._initial_setups = list(reply.get("setups") or [])

    async def finished(self) -> None:
        assert self.closed is not None
        await self.closed.wait()

    async def close(self, reason: str = "closed") -> None:
        if self.closed is None or self.closed.is_set():
            return
        if self._closing:  # another close runs: done when it is (a restart must not re-execute before)
            await self.closed.wait()
            return
        self._closing = True  # outcomes arriving from here on are dropped, not handled on a closed store
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
            self.peers.close()
            if self.conn is not None:
                self.conn.close()
            self.closed.set()

    # ---- the scheduler connection ------------------------------------------------------------
    async def _scheduler_loop(self) -> None:
        while True:  # a lost scheduler may come back within the reconnect window
            try:
                return await self._serve_scheduler()
            except CommError as exc:
                bye = self.conn.unread("close") if self.conn is not None else None
                if bye is not None:  # the scheduler said to stop, then the line went down before it was read
                    return await self.close(bye.get("reason", "asked by the scheduler"))
                if not await reconnect.rejoin(self, exc):
                    if self.closed is not None and not self.closed.is_set():  # said, not a silent exit
                        why = (f"its {self.reconnect_window:g}s reconnect window is over" if self.reconnect_window > 0
                               else "it has no reconnect window; see docs/recovery.md")  # fmt: skip
                        log.warning("worker %s lost the scheduler at %s (%s) and exits: %s", self.id,
                                    self.scheduler_address, exc, why)  # fmt: skip
                    return await self.close(f"lost the scheduler: {exc}")

    async def _serve_scheduler(self) -> None:
        assert self.conn is not None
        if self._initial_setups:
            setups, self._initial_setups = self._initial_setups, []
            self.setup_failed = not await jobs.apply_setups(self.conn, setups, self.setup_dir, True, self.setup_runs)
        while True:
            msg = await self.conn.recv()
            op = msg.get("op")
            if op == "setup":  # handled in order: later tasks wait for it
                if not await jobs.apply_setups(self.conn, msg["setups"], self.setup_dir, False, self.setup_runs):
                    self.setup_failed = True
                # functions pickled by reference to a module it may have shipped again resolve
                # afresh (their pickle, and so their id, did not change with the module's code)
                self.functions = dict(self._function_blobs)
            elif op == "compute":
                st = self.state
                released_runs = bool(st.cancelled or st.unlining)  # a key among them may come back
                compute = self._compute(msg)
                self._apply(st.handle(compute))
                self._forget(tuple(t.key for t in compute.tasks))  # held here already: not run
                if released_runs:
                    for t in compute.tasks:  # the same task again while its run goes on: that run stays
                        if t.key in st.running and t.key not in st.superseded:
                            self._specs.pop(t.key, None)
            elif op == "free":
                self._apply(self.state.handle(ws.FreeKeys(tuple(msg["keys"]))))
                self._forget(tuple(msg["keys"]))
            elif op == "steal":
                self._apply(self.state.handle(ws.StealKeys(tuple(msg["keys"]))))
            elif op == "run":
                asyncio.get_running_loop().create_task(jobs.run_function(self.conn, msg))
            elif op == "restart":  # client.restart: a fresh process with the same command line, or just stop
                await self.close("restart requested by a client")
                if self.restartable:
                    jobs.reexec(self.id)
                return
            elif op == "replicate":
                for key, holders in msg["keys"].items():
                    self._apply(self.state.handle(ws.Replicate(key, tuple(tuple(h) for h in holders))))
            elif op == "close":
                await self.close(msg.get("reason", "asked by the scheduler"))
                return
            else:
                log.warning("unknown message from scheduler: %r", op)

    def _compute(self, msg: dict[str, Any]) -> ws.Compute:
        for fid, blob in (msg.get("functions") or {}).items():
            if fid not in self.functions:
                self.functions[fid] = blob  # deserialised lazily, in the loop, once
                self._function_blobs[fid] = blob
        tasks = []
        st = self.state
        for t in msg["tasks"]:
            deps = t.get("deps") or {}
            key = t["key"]  # one assigned again keeps that run, or its work item cut from a lane;
            func, payload = t["func"], t.get("payload")  # a released one's may be another record's
            if (key not in st.running and key not in st.lined and key not in self._returned) or (
                    key in st.cancelled or key in st.unlining):  # fmt: skip
                self._specs[key] = (func, payload, list(deps))
                if t.get("inline"):
                    self._inline_wanted.add(key)
            tasks.append(ws.TaskIn(key, {d: tuple(tuple(h) for h in hs) for d, hs in deps.items()},
                                   tuple(tuple(r) for r in t.get("resources") or ()), 0, func,
                                   bool(t.get("solo")), t.get("run") or None))  # fmt: skip
        return ws.Compute(tuple(tasks))

    # ---- carrying out the state's commands -------------------------------------------------------
    def _apply(self, commands: list[ws.Command], soon: bool = True) -> None:
        """Carry out ``commands``; reports go out with the next loop turn (``soon``), or at once for
        those in ``_NOW``.  ``soon=False``: the caller flushes the outbox itself when done (no
        flush is scheduled: it would be one more loop turn and ``epoll_wait`` per call for nothing)."""
        now = False  # a report to send at once is in the batch
        starts: list[WorkItem] = []  # handed to the slots after the batch is sent
        lanes = False  # a lane was opened
        for c in commands:
            t = type(c)
            if t is ws.Report:
                self.outbox.add(c.kind, self._with_inline(c.kind, c.item))  # type: ignore[union-attr]
                now = now or c.kind in _NOW  # type: ignore[union-attr]
                if c.kind in ("missing", "stolen", "erred"):  # type: ignore[union-attr]
                    item = c.item  # type: ignore[union-attr]
                    self._forget((item[0] if isinstance(item, list) else item["key"] if isinstance(item, dict) else item,))
            elif t is ws.Run:
                work = self._work_item(c.key)  # type: ignore[union-attr]
                if work is not None:
                    starts.append(work)
            elif t is ws.RunBatch:  # nothing to report first: it goes to a slot now (an Unline may follow)
                items = [w for k in c.keys if (w := self._work_item(k)) is not None]  # type: ignore[union-attr]
                if items:
                    self.pool.submit_lane(c.lane, items)  # type: ignore[union-attr]
                    lanes = True
            elif t is ws.Unline:
                self._unline(c)  # type: ignore[arg-type]
            elif t is ws.Fetch:
                self.loop.create_task(self._fetch(c.key, c.holders))  # type: ignore[union-attr]
            elif t is ws.Store:
                self._store(c.key, self._arrived.pop(c.key), c.nbytes)  # type: ignore[union-attr]
            elif t is ws.Drop:
                data = self.data
                for k in c.keys:  # type: ignore[union-attr]
                    if k in data:  # not pop(): that reads the value first (from disk, if spilled)
                        del data[k]
                    self._serve_failures.pop(k, None)
            elif t is ws.Spill:
                self._spill(c.keys)  # type: ignore[union-attr]
            elif t is ws.SendMetrics:
                self._send_metrics()
            elif t is ws.Terminate:
                self.loop.create_task(self._memory_terminate(c.rss))  # type: ignore[union-attr]
        if now:  # the scheduler hears "started" before any of these tasks can crash us
            self.outbox.flush()
        elif soon:
            self.outbox.soon()
        for work in starts:
            self.pool.submit(work)
        if lanes and not self._watching:
            self._watching = True
            self.loop.call_later(ws.LONG / 2, self._watch)

    def _unline(self, c: ws.Unline) -> None:
        """Take tasks out of a lane its slot has not reached; the state hears which ones."""
        removed = self.pool.unline(c.lane, c.keys)
        if c.why == "cut":
            for w in removed:
                self._returned[w.key] = w
        got = tuple(w.key for w in removed)  # in lane order: cut ones go back to the queue so
        out = {w.key for w in removed}
        taken = tuple(k for k in c.keys if k not in out)
        self._apply(self.state.handle(ws.Unlined(c.lane, got, taken, c.why)))
        if c.why != "cut":
            self._forget(got)

    def _watch(self) -> None:
        """Every ``LONG / 2`` s while a lane's slot runs a member the state watches (or has not taken
        its first one yet): outcomes not delivered yet are, and members running ``LONG`` go to the
        state.  A member that seceded or was reported running ``LONG`` is not watched, and its lane
        was cut (nothing follows it): while only such members run, the timer stays off (for a
        task that runs for minutes it woke the loop every 5 ms); the next lane opened sets it."""
        self._watching = False
        if self.closed is None or self.closed.is_set():
            return
        if self.pool.done:  # outcomes of a lane whose next member runs on (it may wait for them)
            self._on_done()
        st = self.state
        for key in self.pool.running_long(ws.LONG):
            if st.watched(key):
                self._apply(st.handle(ws.RunsLong(key)))
        if any(key is None or st.watched(key) for key in self.pool.members()):
            self._watching = True
            self.loop.call_later(ws.LONG / 2, self._watch)

    def _with_inline(self, kind: str, item: Any) -> Any:
        """A finished report of a task whose small value goes back inline, with its pickle."""
        if kind == "finished" and self._inline:
            blob = self._inline.pop(item[0], None)
            if blob is not None:  # [key, nbytes, duration, pickle(, serial)]
                return [*item[:3], blob, *item[4:]]
        return item

    def _forget(self, keys: tuple[str, ...]) -> None:
        """Tasks that left this worker without running (freed, stolen, rescheduled): their arguments go."""
        st = self.state
        for k in keys:
            if k in st.queued or k in st.waiting or k in st.lined or k in st.superseded:
                continue
            if k not in st.running or k in st.cancelled:  # (a running task's own spec went when it started:
                self._specs.pop(k, None)  # one here is of a task that took a released key, dropped too)
                self._returned.pop(k, None)
                self._inline_wanted.discard(k)

    def _work_item(self, key: str) -> WorkItem | None:
        """What a slot runs for ``key`` (its inputs read now), or None if it failed at once."""
        back = self._returned.pop(key, None)
        if back is not None:  # cut from a lane before it ran: as it was (a spec from an assignment
            self._specs.pop(key, None)  # made again while it waited back in the queue is not needed)
            return back
        func_id, payload, deps = self._specs.pop(key)
        func = self.functions.get(func_id)
        try:
            if func is None:
                raise RuntimeError(f"function {func_id} was never shipped to this worker")
            if isinstance(func, Serialized):
                func = self.functions[func_id] = deserialize(func)
        except Exception as exc:  # cannot even load the function: report on the task
            import traceback

            self._apply(self.state.handle(ws.TaskDone(key, False, error=jobs.error_report(exc, traceback.format_exc()))))
            return None
        return WorkItem(key, func, payload, {d: self.data[d] for d in deps})

    def _on_done(self) -> None:
        if self._closing:  # a bug hunt: the next queued task read its inputs from the emptied store
            self.pool.drain()
            return
        for o in self.pool.drain():
            try:
                self._apply(self.state.handle(self._outcome(o)), soon=False)  # flushed below
            except Exception as exc:  # noqa: BLE001 - the other outcomes of this wake-up still go
                self._outcome_failed(o, exc)
            self._arrived.pop(o.key, None)  # not stored: nobody wanted it any more
            self._inline.pop(o.key, None)  # not reported (cancelled meanwhile)
        # the outcomes of one wake-up go out now, not a loop turn later: a waiting result() hears
        # of them one turn sooner, and reports of many tiny tasks stay one message per wake-up
        self.outbox.flush()

    def _outcome_failed(self, o: Outcome, exc: Exception) -> None:
        """Handling the outcome ``o`` raised ``exc`` (a bug, or storing the value failed): logged,
        and the task is reported erred (unless its outcome went into the report batch already), so
        its client gets an error rather than waiting for ever."""
        import traceback

        log.exception("worker %s: handling the outcome of task %s failed", self.id, o.key)
        tb = traceback.format_exc()
        try:
            message = str(exc)[:1000]
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails
            message = "str() failed"
        why = RuntimeError(f"worker {self.name} could not handle the outcome of task {o.key!r}: "
                           f"{type(exc).__name__}: {message}")  # fmt: skip
        error = jobs.error_report(why, tb, o.duration)
        st = self.state
        if o.key in st.running or o.key in st.lined:  # the state did not take the outcome in: it
            try:  # frees the slot and reports (nothing if the task was freed meanwhile)
                self._apply(st.handle(ws.TaskDone(o.key, False, duration=o.duration, error=error)), soon=False)
                return
            except Exception:  # noqa: BLE001 - reported below
                log.exception("worker %s: reporting task %s erred failed too", self.id, o.key)
        batch = self.outbox.batch
        if all(item[0] != o.key for item in batch.finished) and all(e.get("key") != o.key for e in batch.erred):
            self.outbox.add("erred", dict(error, key=o.key))

    def _outcome(self, o: Outcome) -> ws.TaskDone:
        inline = o.key in self._inline_wanted
        self._inline_wanted.discard(o.key)
        if not o.ok:
            return ws.TaskDone(o.key, False, duration=o.duration, error=jobs.error_report(o.value, o.tb, o.duration))
        self._arrived[o.key] = o.value
        nbytes = sizeof(o.value)
        if inline:
            blob = small_pickle(o.value, nbytes)
            if blob is not None:
                self._inline[o.key] = blob
        return ws.TaskDone(o.key, True, nbytes, o.duration)

    def _store(self, key: str, value: Any, nbytes: int) -> None:
        """Keep ``value`` under ``key``, sized once (the spill store would size it again)."""
        if isinstance(self.data, SpillStore):
            self.data.put(key, value, nbytes)
        else:
            self.data[key] = value

    def _spill(self, keys: tuple[str, ...]) -> None:
        store = self.data
        if not isinstance(store, SpillStore):
            return
        stayed = store.spill(keys)
        if stayed or store.disabled:
            self._apply(self.state.handle(ws.SpillFailed(tuple(stayed), store.disabled)))

    async def _fetch(self, key: str, holders: tuple[tuple[str, str], ...]) -> None:
        kind, got = await self.peers.fetch(key, holders)
        if kind == "ok":
            self._arrived[key] = got
            self._apply(self.state.handle(ws.FetchDone(key, sizeof(got))), soon=False)
            self.outbox.flush()  # the scheduler learns of the copy now, not later
            return
        holder = holders[-1][0] if kind == "silent" and holders else holders[0][0] if holders else ""
        self._apply(self.state.handle(ws.FetchFailed(key, kind, got, holder)))

    def secede(self, key: str) -> None:
        """Called from a task's thread: that task leaves its slot (it will wait on other tasks)."""

        def seceded() -> None:
            self._on_done()  # what ran before it in its lane goes out first: it may wait for those
            self._apply(self.state.handle(ws.Secede(key)))

        self.loop.call_soon_threadsafe(seceded)

    # ---- serving peers and clients ---------------------------------------------------------------
    async def _serve_peer(self, conn: Connection) -> None:
        conn.limit_inbox(PEER_INBOX)  # a peer that floods us and reads nothing fills its own socket
        while True:
            msg = await conn.recv()
            if msg.get("op") == "get-data":
                await conn.send(self._data_reply(list(msg["keys"]), conn.max_frame))
            else:
                await conn.send({"op": "error", "message": f"unknown op {msg.get('op')!r}"})

    def _data_reply(self, keys: list[str], limit: int) -> dict[str, Any]:
        # under a memory limit a reply holds at most an eighth of it (values read back from disk
        # included): a client gathering hundreds of spilled values made workers pass their limit
        cap = max(REPLY_FLOOR, self.memory_limit // 8) if self.memory_limit else None
        failed = self._unreadable(keys) if self.memory_limit and self.state.spilled else {}
        reply = data_reply([k for k in keys if k not in failed], limit, self.data, self.state.nbytes,
                           self._serve_failures, self._unservable, cap)  # fmt: skip
        if failed:
            reply["failed"] = {**(reply.get("failed") or {}), **failed}
        return reply

    def _rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _unreadable(self, keys: list[str]) -> dict[str, str]:
        """Spilled values that cannot be read back without passing the terminate level, even once the
        values held in memory are spilled: reading one would restart the worker, losing it, and its
        recompute would be spilled and asked for again, for ever.  They fail (the scheduler errs
        their task) with what to do."""
        spilled = self.state.spilled
        room = self.memory_thresholds.terminate * self.memory_limit - self._rss()
        out: dict[str, str] = {}
        for k in keys:
            size = spilled.get(k)
            if size is not None and size > room and not self.state.spill_off:
                # values in memory go to disk first (a bug hunt: a 100 MiB value failed for good on a
                # worker holding another 100 MiB in memory, far under its 250 MB limit)
                before = self.state.memory_bytes
                self._apply(self.state.handle(ws.MakeRoom(size - room)))
                room += before - self.state.memory_bytes
            if size is not None and size > room:
                message = (f"task {k!r} produced a value of {mib(size)} that cannot be read back from disk on worker "
                           f"{self.name} without passing its {mib(self.memory_limit)} memory limit (it uses "
                           f"{mib(self._rss())} already); give workers more memory (memory_limit=..., or a node type "
                           "with more), or return something smaller")  # fmt: skip
                self._unservable(k, "SerializationError", message)
                out[k] = message
        return out

    def _unservable(self, key: str, typ: str, message: str) -> None:
        self._apply(self.state.handle(ws.Unservable(key, typ, message)))

    # ---- memory ----------------------------------------------------------------------------------
    def _memory_action(self, action: Action, rss: int) -> None:
        """The monitor saw the process over a memory level (``worker/memory.py``): the state decides."""
        if self.closed is None or self.closed.is_set():
            return
        was = self.state.paused
        self._apply(self.state.handle(ws.MemorySample(rss)))
        if action in (Action.SPILL, Action.PAUSE) and time.monotonic() - self._trimmed > 1.0:
            self._trimmed = time.monotonic()  # at most once a second: a full collection is not free
            trim_memory()
        if self.state.paused != was:
            log.log(logging.WARNING if self.state.paused else logging.INFO, "worker %s %s: memory %s of its %s limit",
                    self.id, "paused" if self.state.paused else "resumed", mib(rss), mib(self.memory_limit))  # fmt: skip

    def _spill_disabled(self, reason: str) -> None:
        """The spill store turned spilling off (a write failed, or the spill limit was reached):
        say so in the log (done by the store) and to the scheduler at once (journal, dashboard)."""
        if self.closed is not None and not self.closed.is_set() and self.conn is not None and not self.conn.closed:
            msg = {"op": "spill-disabled", "reason": reason, "metrics": metrics(self.data, self.state, self.monitor, self._proc)}
            self.loop.create_task(self.conn.send(msg)).add_done_callback(log_send_error)

    async def _memory_terminate(self, rss: int) -> None:
        if self.exit_reason == "memory":  # restarting already (the monitor keeps sampling meanwhile)
            return
        limit, pct = self.memory_limit, round(self.memory_thresholds.terminate * 100)
        why = f"worker {self.name} used {mib(rss)} of memory, over {pct}% of its {mib(limit)} limit; it restarts"
        log.error("%s (running: %s)", why, ", ".join(self.state.running) or "nothing")
        self.exit_reason = "memory"
        if self.conn is not None and not self.conn.closed:
            with contextlib.suppress(CommError):
                await self.conn.send({"op": "memory-exceeded", "rss": rss, "limit": limit, "message": why,
                                      "restarting": self.restartable})  # fmt: skip
        await self.close(why)

    def _send_metrics(self) -> None:
        if self.conn is not None and not self.conn.closed:
            t = self.loop.create_task(self.conn.send({"op": "heartbeat", "metrics": metrics(self.data, self.state, self.monitor, self._proc)}))
            t.add_done_callback(log_send_error)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self.conn is None or self.conn.closed:
                return
            with contextlib.suppress(CommError):
                await self.conn.send({"op": "heartbeat", "metrics": metrics(self.data, self.state, self.monitor, self._proc)})


async def run_worker(scheduler: str, token: str, **kwargs: Any) -> None:
    """Start a worker and run until the scheduler closes it or the connection is lost."""
    w = await Worker(scheduler, token, **kwargs).start()
    await w.finished()
