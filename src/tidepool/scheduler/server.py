"""The scheduler's asyncio shell: connections in, events to the state, commands out as messages.

State here is only I/O state: the connection of each worker and client, pending request replies,
and the listener.  Everything about tasks and workers lives in :class:`SchedulerState`; this module
translates messages into events (stamped with ``clock()``), applies them in batches, and turns
commands into one message per destination per batch (so 1,000 task assignments to a worker are one
frame); the batches of workers' reports and clients' graph updates read in one loop turn share
those messages (``scheduler/outgoing.py``), so a turn sends one per peer and kind.  A periodic tick drives heartbeat timeouts; observers (the scaling controller, the journal)
subscribe with :meth:`Scheduler.subscribe`.

Liveness: a closed connection is the death signal (a killed process closes its socket at once);
heartbeats only catch a worker that is alive but silent, after a generous time-to-live
(``heartbeat_timeout``, default :data:`DEFAULT_HEARTBEAT_TTL`).  The tick loop measures its own lag:
time the scheduler could not run (blocked loop, SIGSTOP, a suspended VM) is passed on as
``Tick.stalled`` so workers are not blamed for our silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tidepool.comm import Connection, Listener, Serialized, listen, unix
from tidepool.comm.auth import new_token
from tidepool.comm.core import PEER_INBOX
from tidepool.comm.inline import INLINE_WANTED
from tidepool.comm.messages import (
    Cancel,
    ComputeTask,
    KeyQuery,
    Release,
    Reply,
    ReportItem,
    TaskBatch,
    UpdateGraph,
)
from tidepool.comm.tls import TLSConfig
from tidepool.errors import CommError, ProtocolError
from tidepool.scaling.node_types import NodeType
from tidepool.scheduler import events as ev
from tidepool.scheduler.explain import explain
from tidepool.scheduler.outgoing import Outgoing
from tidepool.scheduler.recovery import Durability, rejoin_event
from tidepool.scheduler.stalls import StallLog
from tidepool.scheduler.state import SchedulerState
from tidepool.scheduler.worker_reports import batch_events
from tidepool.setup import setup_digest

log = logging.getLogger("tidepool.scheduler")

Observer = Callable[[list[ev.Event], list[ev.Command]], None]

#: inline_keys beyond this many (or twice what the last pruning kept) are pruned to the tasks the
#: state still knows
INLINE_KEYS_PRUNE = 10_000
#: seconds a connected worker may stay silent before it is removed (a task holding the GIL, or
#: a huge result being pickled, blocks its heartbeats; a dead process closes its socket instead)
DEFAULT_HEARTBEAT_TTL = 300.0
#: seconds ``close()`` waits for workers whose connection could not take the close message at once
CLOSE_SEND_WAIT = 2.0


class Scheduler:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:0",
        token: str | None = None,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float | None = None,
        tick_interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        tls: TLSConfig | None = None,
        state_dir: str | None = None,
        reconnect_window: float | None = None,
        recovery_wait: float | None = None,
        local_socket: bool = False,
        **state_kwargs: Any,
    ) -> None:
        #: worker id -> the node type it is being launched as (see expect_workers)
        self.launched_as: dict[str, NodeType] = {}
        self.refused_registrations = 0
        self.requested_address = address
        self.tls = tls
        #: ``local_socket``: also listen on a Unix socket in a private directory (not with TLS, which
        #: every connection then uses), for peers on this machine: a LocalCluster's own workers and
        #: in-process client (comm/unix.py says why); its address, once started, else None
        self.local_socket = local_socket and tls is None
        self.local_address: str | None = None
        self.local_listener: Listener | None = None
        #: with ``local_socket``, also an in-process address (``memory://``) for a client in this very
        #: process (a LocalCluster's): its messages skip the socket, two loop turns less per round trip
        self.memory_address: str | None = None
        self.memory_listener: Listener | None = None
        #: with ``state_dir``: the store, and what a restart from it waits for (scheduler/recovery.py)
        self.durable: Durability | None = None
        if state_dir is not None:
            self.durable = Durability(state_dir, token or None, **_given(reconnect_window=reconnect_window,
                                                                         recovery_wait=recovery_wait))  # fmt: skip
            token = self.durable.token
        self.token = token or new_token()
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self.tick_interval = tick_interval
        timeout = heartbeat_timeout if heartbeat_timeout is not None else DEFAULT_HEARTBEAT_TTL
        self.state = SchedulerState(heartbeat_timeout=timeout, **state_kwargs)
        self.worker_conns: dict[str, Connection] = {}
        self.client_conns: dict[str, Connection] = {}
        #: the commands' messages not sent yet (one per peer per loop turn where batches allow it)
        self.outgoing = Outgoing(self.worker_conns, self.client_conns)
        self._said_bye: set[str] = set()  # clients that closed on purpose (durable: not kept for a reconnection)
        #: inline values (comm/inline.py): keys of small submissions whose small values come back in
        #: the reports, and the pickles of the task-batch being applied (forwarded, then dropped)
        self.inline_keys: set[str] = set()
        self.inline_values: dict[str, Any] = {}
        self._inline_prune_at = INLINE_KEYS_PRUNE
        self.observers: list[Observer] = []
        #: the reports of a restart from the state directory (``RecoveryReport``), for late observers
        self.recovery_reports: list[ev.RecoveryReport] = []
        self.busy_seconds = 0.0  # time spent applying event batches, and how many (for /metrics)
        self.batches = 0
        self.tick_seconds = 0.0  # how long the last tick's batch took
        self.dashboard_link = ""  # set by the dashboard serving this scheduler (clients show it)
        #: extra slots expected to arrive (seconds from now), e.g. launches in flight
        self.eta_hooks: list[Callable[[float], tuple[float, ...]]] = []
        self.retire_waiters: dict[str, list[asyncio.Future[str]]] = {}
        self.setups: dict[str, Any] = {}  # name -> pickled SetupSpec, in registration order
        self.setup_digests: dict[str, str] = {}  # name -> its setup_digest (what workers report)
        #: (worker, setup name) -> the register_setup calls waiting for that worker's answer (two
        #: calls may register the same name at once: each gets the answer)
        self.setup_waiters: dict[tuple[str, str], list[asyncio.Future[str]]] = {}
        #: worker -> setup messages sent after it joined and not answered yet (it prepares meanwhile)
        self.setups_in_flight: dict[str, int] = {}
        self.run_waiters: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._run_ids = 0
        self._restarting: set[str] = set()
        self.watches: dict[int, list[str]] = {}  # progress watch id -> the graph's keys
        self._watch_ids = 0
        self.address = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._client_ids = 0
        self._closed = False

    async def start(self) -> Scheduler:
        from tidepool.comm import accept_errors

        accept_errors.install()  # out of descriptors: one log line per interval, not one per accept
        where = self.requested_address
        if self.durable is not None:  # rebuilt before anybody can connect; the same address as before
            where = self.durable.address(where)
            self._client_ids = self.durable.restore(self.state, self.clock())
            for name, blob in self.durable.setups:  # workers that join from now on run them
                self._keep_setup(name, blob)
            self.subscribe(self.durable.observe)
        self.listener = await listen(where, self._handle_conn, self.token, tls=self.tls)
        self.address = self.listener.address
        if self.local_socket:
            await self._listen_locally()
            self.memory_listener = await listen(f"memory://scheduler-{os.getpid()}-{secrets.token_hex(8)}",
                                                self._handle_conn, self.token)  # fmt: skip
            self.memory_address = self.memory_listener.address
        if self.durable is not None:
            self.durable.store.set_address(self.address)
        self._tasks.append(asyncio.get_running_loop().create_task(self._tick_loop()))
        log.info("scheduler listening at %s", self.address)
        return self

    async def _listen_locally(self) -> None:
        """Open the Unix socket of ``local_socket``; without one (no Unix sockets here, no short
        enough path, an error making it) TCP serves everybody, as it does every other peer."""
        path = None
        try:
            path = unix.private_socket_path() if hasattr(socket, "AF_UNIX") else None
            if path is not None:
                self.local_listener = await listen(f"unix://{path}", self._handle_conn, self.token)
                self.local_address = self.local_listener.address
        except OSError as exc:
            if path is not None:
                unix.remove(path)
            log.info("no Unix socket for local peers (%s); they connect over TCP", exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        bye = {"op": "close", "reason": "scheduler closing"}
        late = []  # connections that could not take the close at once (busy writing, or paused)
        for conn in list(self.worker_conns.values()):
            with contextlib.suppress(CommError):
                if not conn.send_nowait(bye):
                    late.append(asyncio.ensure_future(conn.send(bye)))
        try:
            if late:  # waited for a moment, all at once: not for ever on a worker that stopped reading
                await asyncio.wait(late, timeout=CLOSE_SEND_WAIT)
        finally:  # the rest runs even if this close is cancelled meanwhile (a caller's timeout)
            for t in late:
                t.cancel()
                t.add_done_callback(_retrieve)
            for conn in list(self.worker_conns.values()):
                conn.close()
            for conn in list(self.client_conns.values()):
                conn.close()
            if self.memory_listener is not None:  # first: its name is unregistered at once, whatever follows
                await self.memory_listener.close()
            try:
                await self.listener.close()
            finally:
                if self.local_listener is not None:
                    await self.local_listener.close()
            if self.durable is not None:
                await asyncio.to_thread(self.durable.close)

    def subscribe(self, observer: Observer) -> None:
        """``observer(events, commands)`` is called after every batch is applied.  The reports of a
        restart from the state directory applied before it subscribed ("loaded" comes with the
        first tick, which can run before a journal is attached) are given to it at once."""
        self.observers.append(observer)
        if self.recovery_reports:
            try:
                observer(list(self.recovery_reports), [])
            except Exception:
                log.exception("scheduler observer failed")

    # ---- applying events ----------------------------------------------------------------------
    async def apply(self, events: list[ev.Event], defer: bool = False, more: bool = False) -> list[ev.Command]:
        """Apply ``events`` and send the commands' messages: at once, or with ``defer`` (nothing
        is sent after this that must follow them) at the end of this loop turn, together with the
        messages of every other batch applied in that turn.  ``more``: the caller goes on in this
        step with messages it has already read (its connection's inbox is not empty), so the
        messages wait for the end of the turn even when nothing else is ready in it."""
        began = time.perf_counter()
        cmds = self.state.handle_many(events)
        if self.durable is not None:
            self.recovery_reports += [e for e in events if isinstance(e, ev.RecoveryReport)]
        for obs in self.observers:
            try:
                obs(events, cmds)
            except Exception:
                log.exception("scheduler observer failed")
        self._dispatch(cmds)
        if defer and more:
            self.outgoing.soon()
        elif defer:
            self.outgoing.turn_end()
        elif self.outgoing:
            await self.outgoing.flush()
        took = time.perf_counter() - began  # the loop's time spent on this batch (for /metrics)
        self.busy_seconds += took
        self.batches += 1
        if events and isinstance(events[0], ev.Tick):
            self.tick_seconds = took
        return cmds

    def _dispatch(self, cmds: list[ev.Command]) -> None:
        """The commands' messages, into :attr:`outgoing` (frees, then tasks, then the rest, per
        worker; reports per client)."""
        if not cmds:
            return
        state = self.state
        tasks_by_worker: dict[str, list[ComputeTask]] = {}
        funcs_by_worker: dict[str, dict[str, Any]] = {}
        frees: dict[str, list[str]] = {}
        reports: dict[str, list[ReportItem]] = {}
        other: list[tuple[str, dict[str, Any]]] = []
        workers = state.workers
        for c in cmds:
            if isinstance(c, ev.Execute):
                ts = state.tasks.get(c.key)
                ws = workers.get(c.worker)
                if c.ship and ws is not None:  # the state counts it as sent: send it, task or not
                    funcs_by_worker.setdefault(ws.id, {})[c.ship] = state.functions.get(c.ship)
                if ts is None or ws is None:
                    continue
                deps = {
                    d.key: [[w, workers[w].address] for w in d.who_has if w in workers] for d in ts.deps
                } if ts.deps else None  # fmt: skip
                shape = [list(p) for p in ts.shape] if ts.shape != (("cpu", 1.0),) else None
                tasks_by_worker.setdefault(ws.id, []).append(
                    ComputeTask(ts.key, ts.func_id, ts.spec_payload, deps, shape, ts.key in self.inline_keys,
                                ts.suspicious > 0 or ts.key in state.solo, ts.run))  # fmt: skip
            elif isinstance(c, ev.Free):
                frees.setdefault(c.worker, []).extend(c.keys)
            elif isinstance(c, ev.Report):
                reports.setdefault(c.client, []).append(self._report_item(c))
            elif isinstance(c, ev.Replicate):
                holders = {}
                for k in c.keys:
                    rts = state.tasks.get(k)
                    if rts is not None:
                        holders[k] = [[w, workers[w].address] for w in rts.who_has if w in workers]
                other.append((c.worker, {"op": "replicate", "keys": holders}))
            elif isinstance(c, ev.Steal):
                other.append((c.worker, {"op": "steal", "keys": c.keys}))
            elif isinstance(c, ev.CloseWorker):
                other.append((c.worker, {"op": "close", "reason": c.reason}))
                self._resolve_retire(c.worker, "retired")
            elif isinstance(c, ev.RetireRefused):
                log.info("retirement of %s refused: %s", c.worker, c.reason)
                self._resolve_retire(c.worker, f"refused: {c.reason}")
        out = self.outgoing
        for wid, keys in frees.items():
            out.free(wid, keys)
        for wid in tasks_by_worker.keys() | funcs_by_worker.keys():
            out.compute(wid, tasks_by_worker.get(wid, []), funcs_by_worker.get(wid))
        for wid, msg in other:
            out.to_worker(wid, msg)
        for cid, reps in reports.items():
            out.report(cid, reps)

    def _report_item(self, c: ev.Report) -> ReportItem:
        self.inline_keys.discard(c.key)
        if c.status == "memory":  # with where the value lives: result() reads it without asking who-has
            ts = self.state.tasks.get(c.key)
            workers = self.state.workers
            value = self.inline_values.get(c.key)  # small: the value itself (comm/inline.py)
            for w in ts.who_has if ts is not None else ():
                if w in workers:
                    return ReportItem(c.key, "memory", workers[w].address, value)
            return ReportItem(c.key, "memory", None, value)
        if c.status != "erred":
            return ReportItem(c.key, c.status)
        if c.error is not None:
            return ReportItem(c.key, "erred", c.error)
        ts = self.state.tasks.get(c.key)
        if ts is None:
            return ReportItem(c.key, "lost")
        return ReportItem(c.key, "erred", {
            "exception": ts.exception, "traceback": ts.traceback, "type": ts.exc_type,
            "message": ts.message, "origin": ts.error_origin,
        })  # fmt: skip

    async def _setup_failed(self, wid: str, msg: dict[str, Any]) -> None:
        name, error, tb = msg.get("name", "?"), msg.get("error", ""), msg.get("traceback", "")
        log.warning("worker %s failed setup %s: %s", wid, name, error)
        if not msg.get("initial"):  # (an earlier version's failure as it joined: its waiter hears "worker left")
            self._resolve_setup(wid, name, f"failed: {error}\n{tb}")
        report = {"op": "setup-error", "worker": wid, "name": name, "error": error, "traceback": tb}
        for cid in list(self.client_conns):
            self.outgoing.post_client(cid, report)
        self.outgoing.post_worker(wid, {"op": "close", "reason": f"setup {name!r} failed"})

    def _resolve_setup(self, wid: str, name: str, outcome: str) -> None:
        for fut in self.setup_waiters.pop((wid, name), ()):
            if not fut.done():
                fut.set_result(outcome)

    def _keep_setup(self, name: str, blob: Any) -> None:
        """Keep a setup for the workers that join from now on (a name registered again moves to
        the end), with its digest (computed once, not at every worker's join)."""
        self.setups.pop(name, None)
        self.setups[name] = blob
        self.setup_digests[name] = setup_digest(blob)

    def _send_setups(self, wid: str, setups: list[list[Any]]) -> bool:
        """Send setup hooks to a worker that registered; True if it is (newly) preparing, and
        known to the state (a worker whose join is not applied yet is told after it is)."""
        self.outgoing.post_worker(wid, {"op": "setup", "setups": setups})
        self.setups_in_flight[wid] = self.setups_in_flight.get(wid, 0) + 1
        return self.setups_in_flight[wid] == 1 and wid in self.state.workers

    async def unregister_setup(self, name: str) -> bool:
        """Workers that join from now on do not run this setup (those that ran it keep what it did);
        False if no setup has that name."""
        if self.setups.pop(name, None) is None:
            return False
        self.setup_digests.pop(name, None)
        if self.durable is not None:
            self.durable.forget_setup(name)
        await self.apply([ev.SetupsChanged(self.clock())])  # (a batch may carry due commands: sent)
        return True

    async def register_setup(self, name: str, blob: Any, timeout: float | None = None) -> dict[str, str]:
        """Store a setup for future workers and run it on every current one; worker -> outcome.

        With ``timeout``, a worker still running it after that many seconds is answered
        ``"timeout: ..."`` (it keeps running it, and takes no task until it ends)."""
        if self.durable is not None:  # asked again by a client reconnecting after a restart: the
            # workers of the last run answer too (it answered {} at once, before they were back)
            await self._rejoined(list(self.durable.expected))
        self._keep_setup(name, blob)
        await self.apply([ev.SetupsChanged(self.clock())])
        if self.durable is not None and isinstance(blob, Serialized):
            self.durable.record_setup(name, blob)
        loop = asyncio.get_running_loop()
        futs: dict[str, asyncio.Future[str]] = {}
        preparing: list[ev.Event] = []
        for wid in list(self.worker_conns):
            fut = loop.create_future()
            self.setup_waiters.setdefault((wid, name), []).append(fut)
            futs[wid] = fut
            if self._send_setups(wid, [[name, blob]]):
                preparing.append(ev.WorkerPreparing(wid, self.clock(), True))
        if preparing:
            await self.apply(preparing)
        if futs and timeout is not None:
            await asyncio.wait(list(futs.values()), timeout=timeout)
        result = {}
        for wid, fut in futs.items():
            if fut.done():
                result[wid] = fut.result()
            elif timeout is not None:
                result[wid] = (f"timeout: still running after {timeout:g} s (the worker runs it to its end and "
                               f"takes no task until then)")  # fmt: skip
            else:
                result[wid] = await fut
        return result

    def _resolve_retire(self, wid: str, outcome: str) -> None:
        for fut in self.retire_waiters.pop(wid, []):
            if not fut.done():
                fut.set_result(outcome)

    # ---- who a worker may claim to be ------------------------------------------------------------
    def expect_workers(self, worker_ids: list[str], node_type: NodeType) -> None:
        """These ids are being launched as ``node_type``: when they register, they may claim that
        type and at most its resources per worker (an authenticated process could otherwise
        advertise ``{"cpu": 1e6}`` and draw all the work)."""
        for wid in worker_ids:
            self.launched_as[wid] = node_type
        self.state.offered_resources.update(node_type.resources)

    def _overclaim(self, wid: str, msg: dict[str, Any]) -> str:
        nt = self.launched_as.get(wid)
        if nt is None:
            return ""  # started by hand: whoever holds the token may add workers
        claimed_type = str(msg.get("node_type", "default"))
        if claimed_type != nt.name:
            return f"worker {wid} was launched as node type {nt.name!r} but registers as {claimed_type!r}"
        allowed = nt.worker_resources
        try:
            claimed = {str(k): float(v) for k, v in dict(msg.get("resources") or {}).items()}
        except (TypeError, ValueError):
            return f"worker {wid} advertises unreadable resources {msg.get('resources')!r}"
        over = {k: v for k, v in claimed.items() if v > allowed.get(k, 0.0) * (1 + 1e-9) + 1e-9}
        if over:
            return (f"worker {wid} advertises {over}, more than its node type {nt.name!r} offers per worker "
                    f"({dict(allowed)})")  # fmt: skip
        return ""

    # ---- connections ----------------------------------------------------------------------------
    async def _handle_conn(self, conn: Connection) -> None:
        role = conn.info.get("role")
        if role == "worker":
            await self._handle_worker(conn)
        elif role == "client":
            await self._handle_client(conn)
        else:
            raise ProtocolError(f"unknown role {role!r}")

    async def _handle_worker(self, conn: Connection) -> None:
        msg = await conn.recv()
        if msg.get("op") != "register":
            raise ProtocolError("a worker must register first")
        wid = str(msg["id"])
        if wid in self.worker_conns or wid in self.state.workers:
            await conn.send({"op": "refused", "reason": f"worker id {wid} is already registered"})
            return
        overclaim = self._overclaim(wid, msg)
        if overclaim:
            log.warning("refused worker %s: %s", wid, overclaim)
            self.refused_registrations += 1
            await conn.send({"op": "refused", "reason": overclaim})
            return
        rejoin = msg.get("rejoin")  # it lost us and kept its work: it says which setups it has run
        # a new worker gets every setup now; which it got is remembered for the setups registered
        # while this answer is on its way (sent right after, as a rejoining worker's missing ones)
        has = dict(self.setup_digests) if rejoin is None else rejoin.get("setups")
        setups = [[name, blob] for name, blob in self.setups.items()] if rejoin is None else []
        window = self.durable.reconnect_window if self.durable is not None else 0.0
        now = self.clock()
        gated = self.durable is not None and not self.durable.gate_open
        try:  # checked before it is told it joined: a malformed registration must leave no trace
            joined = _join_events(wid, msg, now, ready=not setups and not gated)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("refused worker %s: malformed registration (%s: %s)", wid, type(exc).__name__, exc)
            await conn.send({"op": "refused", "reason": f"malformed registration ({type(exc).__name__}: {exc})"})
            return
        await conn.send({"op": "registered", "heartbeat_interval": self.heartbeat_interval, "setups": setups,
                         "reconnect_window": window, "address": self.address})  # fmt: skip
        reason = "connection closed"
        cause = ev.RemoveCause.CLOSED
        try:
            self.worker_conns[wid] = conn  # in here: whatever fails from now on, the finally forgets it
            missed = _setups_missed(self.setups, self.setup_digests, has)
            if missed:
                self._send_setups(wid, missed)
            if self.setups_in_flight.get(wid):  # a rejoining worker, or a setup registered meanwhile:
                # in the join's own batch, so no task is placed there before
                joined.append(ev.WorkerPreparing(wid, now, True))
            await self.apply(joined)
            if gated and self.durable is not None:  # the last worker expected back opens the gate
                await self.apply(self.durable.worker_joined(wid, now))
            while True:
                msg = await conn.recv()
                now = self.clock()
                op = msg.get("op")
                if op == "task-batch":
                    batch = TaskBatch.decode(msg)
                    inline = _inline_values(batch.finished, self.state.tasks)
                    events = batch_events(wid, batch, now)
                    while (more := conn.recv_buffered("task-batch")) is not None:  # read in one go: one batch
                        batch = TaskBatch.decode(more)
                        inline.update(_inline_values(batch.finished, self.state.tasks))
                        events += batch_events(wid, batch, now)
                    if inline:  # forwarded by the reports of this batch, then dropped
                        self.inline_values.update(inline)
                    try:
                        await self.apply(events, defer=True, more=conn.buffered())
                    finally:
                        for k in inline:
                            self.inline_values.pop(k, None)
                elif op == "heartbeat":
                    cmds = self.state.handle(ev.Heartbeat(wid, now, msg.get("metrics") or {}))
                    if cmds:  # none today; never dropped if a heartbeat ever causes some
                        self._dispatch(cmds)
                        await self.outgoing.flush()
                elif op == "spill-disabled":  # observed (journal, dashboard), unlike plain heartbeats
                    log.warning("worker %s stopped spilling to disk: %s", wid, msg.get("reason", ""))
                    await self.apply([ev.Heartbeat(wid, now, msg.get("metrics") or {})])
                elif op == "setup-done":
                    # only a reply to a register_setup answers its waiter: the setups a worker ran as
                    # it joined may be an earlier version under the same name (registered again meanwhile)
                    for name in msg.get("names", ()) if not msg.get("initial") else ():
                        self._resolve_setup(wid, name, "ok")
                    if not msg.get("initial") and self.setups_in_flight.get(wid):
                        self.setups_in_flight[wid] -= 1
                        if not self.setups_in_flight[wid]:
                            del self.setups_in_flight[wid]
                            await self.apply([ev.WorkerPreparing(wid, now, False)])
                    if msg.get("initial"):
                        await self.apply([ev.WorkerReady(wid, now)])
                elif op == "run-result":
                    entry = self.run_waiters.pop(int(msg["rid"]), None)
                    if entry is not None and not entry[1].done():
                        entry[1].set_result(msg)
                elif op == "memory-exceeded":  # it closes and restarts; its running tasks are suspects
                    reason = str(msg.get("message") or "over its memory limit")
                    cause = ev.RemoveCause.MEMORY if msg.get("restarting") else ev.RemoveCause.CLOSED
                    log.warning("%s", reason)
                    break
                elif op == "setup-failed":
                    await self._setup_failed(wid, msg)
                    reason = f"setup failed: {msg.get('error', '')}"
                    cause = ev.RemoveCause.SETUP_FAILED
                    break
                else:
                    raise ProtocolError(f"unknown worker op {op!r}")
        except CommError as exc:
            reason = str(exc)
        except (KeyError, TypeError, ValueError) as exc:
            # a malformed message closes that worker's connection only; but it may as well be a bug
            # here, which must not pass for a worker that left: said with its traceback
            reason = f"its message could not be handled ({type(exc).__name__}: {exc})"
            log.error("worker %s dropped: %s", wid, reason, exc_info=True)
        finally:
            for rid in [r for r, (w, _) in self.run_waiters.items() if w == wid]:
                _, fut = self.run_waiters.pop(rid)
                if not fut.done():
                    fut.set_result({"ok": False, "error": f"worker {wid} left before answering ({reason})"})
            self.setups_in_flight.pop(wid, None)
            for (w, name) in [k for k in self.setup_waiters if k[0] == wid]:
                self._resolve_setup(w, name, f"failed: worker left ({reason})")
            if self.worker_conns.get(wid) is conn:
                del self.worker_conns[wid]
            let_go = wid not in self.state.workers  # retired, or closed by us: it does not come back
            if wid in self.state.workers and not self._closed:
                if wid in self._restarting:  # it re-executes itself: not a failure, nothing to replace
                    self._restarting.discard(wid)
                    reason, cause = "restarting (client.restart)", ev.RemoveCause.RESTARTED
                await self.apply([ev.WorkerRemove(wid, self.clock(), reason, graceful=cause is ev.RemoveCause.RESTARTED,
                                                  cause=cause)])  # fmt: skip
            if let_go or cause is ev.RemoveCause.SETUP_FAILED or (cause is ev.RemoveCause.CLOSED and self.durable is None):
                # it does not come back under this id (a restarting worker, or one rejoining a
                # durable scheduler, may: its claim is checked again then); a long-lived
                # scheduler kept one entry per worker ever launched
                self.launched_as.pop(wid, None)

    async def _handle_client(self, conn: Connection) -> None:
        resume = str(conn.info.get("resume") or "")
        if resume and resume not in self.client_conns and self.durable is not None and self.durable.claim_client(resume):
            cid = resume  # a restored client came back: its wanted keys are still its own
        else:
            self._client_ids += 1
            cid = f"client-{self._client_ids}"
        self.client_conns[cid] = conn
        conn.limit_inbox(PEER_INBOX)  # a client that floods us and reads nothing fills its own socket
        window = self.durable.reconnect_window if self.durable is not None else 0.0
        await conn.send({"op": "welcome", "client": cid, "reconnect_window": window})
        try:
            while True:
                msg = await conn.recv()
                await self._client_message(cid, conn, msg, more=conn.buffered())
        except CommError:
            pass
        finally:
            self.client_conns.pop(cid, None)
            if self._closed:
                pass
            elif self.durable is not None and cid not in self._said_bye:
                self.durable.park_client(cid, self.clock())  # it may come back within the window
            else:
                self._said_bye.discard(cid)
                await self.apply([ev.ClientGone(cid, self.clock())])

    async def _client_message(self, cid: str, conn: Connection, msg: dict[str, Any], more: bool = False) -> None:
        """Handle one message of client ``cid``; ``more``: others already read follow in this step."""
        op = msg.get("op")
        now = self.clock()
        if op == "update-graph":
            graph = UpdateGraph.decode(msg)
            specs = [ev.TaskSpec(t.key, t.func_id, t.payload, tuple(t.deps), t.resources, t.retries, t.group,
                                 t.priority, t.workers, t.loose) for t in graph.tasks]  # fmt: skip
            if len(graph.wanted) <= INLINE_WANTED:
                self.inline_keys.update(graph.wanted)
            await self.apply([ev.UpdateGraph(cid, specs, graph.wanted, now, graph.functions, graph.exact)], defer=True,
                             more=more)  # fmt: skip
            if len(self.inline_keys) > self._inline_prune_at:  # keys of clients gone without a release
                self.inline_keys.intersection_update(self.state.tasks)
                self._inline_prune_at = max(INLINE_KEYS_PRUNE, 2 * len(self.inline_keys))
        elif op == "bye":  # closing on purpose: release its keys when the connection ends
            self._said_bye.add(cid)
            await self.outgoing.send_client(cid, Reply(int(msg.get("id") or 0)).encode())
        elif op == "release":
            released = Release.decode(msg).keys
            self.inline_keys.difference_update(released)
            await self.apply([ev.ReleaseKeys(cid, released, now)])
        elif op == "cancel":  # the outcome goes out as reports ("cancelled"/"running") before the reply
            cancel = Cancel.decode(msg)
            await self.apply([ev.ReleaseKeys(cid, cancel.keys, now, cancel=True, unless_started=cancel.unless_started)])
            if cancel.id is not None:
                await self.outgoing.send_client(cid, Reply(cancel.id).encode())
        elif op == "running":  # which of these keys are executing on a worker now
            tasks = self.state.tasks
            q = KeyQuery.decode(msg)
            running = [k for k in q.keys if (t := tasks.get(k)) is not None and t.state == "running" and t.executing]
            await self.outgoing.send_client(cid, Reply(q.id or 0, running).encode())
        elif op == "who-has":  # None: the scheduler does not know the key (released): never wait for it
            tasks = self.state.tasks
            q = KeyQuery.decode(msg)
            await self.outgoing.send_client(cid, Reply(q.id or 0, {k: self.state.who_has(k) if k in tasks else None for k in q.keys}).encode())
        elif op == "ping":  # a client checks that we are there (it heard nothing for a while)
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": "pong"})
        elif op == "info":
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": self.info()})
        elif op == "why":  # a timed-out result(): each key's state and why it is not done
            q = KeyQuery.decode(msg)
            await self.outgoing.send_client(cid, Reply(q.id or 0, {k: explain(self.state, k) for k in q.keys}).encode())
        elif op == "eta":
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": self.eta()})
        elif op == "retire":
            asyncio.get_running_loop().create_task(self._retire_request(cid, msg))
        elif op in ("run", "restart"):
            asyncio.get_running_loop().create_task(self._long_request(cid, msg))
        elif op == "progress":  # how much of a graph is done: keys sent once, then a watch id
            if msg.get("keys") is not None:
                self._watch_ids += 1
                self.watches[self._watch_ids] = list(msg["keys"])
                wid = self._watch_ids
            else:
                wid = int(msg["watch"])
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": {"watch": wid, **self.progress(wid)}})
        elif op == "progress-end":
            self.watches.pop(int(msg["watch"]), None)
        elif op == "has-what":
            st = self.state
            result = {w.address: [ts.key for ts in w.has_what] for w in st.workers.values()}
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": result})
        elif op == "fire-and-forget":
            await self.apply([ev.FireAndForget(list(msg["keys"]), now)])
        elif op == "broadcast":
            await self.apply([ev.Broadcast(list(msg["keys"]), now, int(msg.get("copies") or 0))])
        elif op == "register-setup":
            asyncio.get_running_loop().create_task(self._setup_request(cid, msg))
        elif op == "unregister-setup":
            found = await self.unregister_setup(str(msg["name"]))
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg["id"], "result": found})
        else:
            await self.outgoing.send_client(cid, {"op": "reply", "id": msg.get("id"), "error": f"unknown op {op!r}"})

    async def retire_workers(self, workers: list[str], reason: str = "requested") -> dict[str, str]:
        """Retire gracefully; ``workers`` are ids, names or addresses (as Dask users pass
        ``who_has``'s); returns each as given -> "retired" or "refused: <why>" / "unknown worker"."""
        loop = asyncio.get_running_loop()
        await self._rejoined(workers)
        known = self.state.workers
        aliases = {n: w.id for w in known.values() for n in (w.name, w.address) if n}
        ids = {w: w if w in known else aliases.get(w) for w in workers}
        futs: dict[str, asyncio.Future[str]] = {}
        for wid in dict.fromkeys(i for i in ids.values() if i is not None):
            fut = loop.create_future()
            self.retire_waiters.setdefault(wid, []).append(fut)
            futs[wid] = fut
        await self.apply([ev.RetireWorkers(list(futs), self.clock(), reason)])
        done = {wid: await fut for wid, fut in futs.items()}
        return {w: "unknown worker" if wid is None else done[wid] for w, wid in ids.items()}

    async def _rejoined(self, workers: list[str]) -> None:
        """After a restart from the state directory, wait (at most the recovery wait since the
        start) for the workers of the last run among ``workers`` that have not rejoined yet: a
        request the client asks again as it reconnects often arrives before they do."""
        d = self.durable
        if d is None:
            return
        ids = [d.expected_at.get(w, w) for w in workers]  # an address of the last run names its worker
        missing = [w for w in ids if w in d.expected and w not in d.back and w not in self.state.workers]
        left = d.rejoin_deadline - time.monotonic()
        if not missing or left <= 0:
            return
        back: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def watch(events: list[ev.Event], cmds: list[ev.Command]) -> None:
            if not back.done() and all(w in self.state.workers for w in missing):
                back.set_result(None)

        self.observers.append(watch)
        try:
            await asyncio.wait([back], timeout=left)
        finally:
            self.observers.remove(watch)

    async def _retire_request(self, cid: str, msg: dict[str, Any]) -> None:
        await self._answer(cid, msg, lambda: self.retire_workers(list(msg["workers"]), "requested by a client"))

    async def _answer(self, cid: str, msg: dict[str, Any], work: Callable[[], Awaitable[Any]]) -> None:
        """Reply to request ``msg`` with what ``work`` returns, or with why it failed (a malformed
        request, too: the client would wait for ever for a reply that never comes)."""
        try:
            reply: dict[str, Any] = {"result": await work()}
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, the scheduler stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        await self.outgoing.send_client(cid, {"op": "reply", "id": msg.get("id"), **reply})

    async def _long_request(self, cid: str, msg: dict[str, Any]) -> None:
        if msg["op"] == "run":
            await self._answer(cid, msg, lambda: self.run_on_workers(msg["function"], msg.get("args"),
                                                                      msg.get("workers")))  # fmt: skip
        else:
            await self._answer(cid, msg, lambda: self.restart(float(msg.get("timeout") or 30.0)))

    async def run_on_workers(self, function: Any, args: Any, workers: list[str] | None = None) -> dict[str, Any]:
        """Call ``function(*args, **kwargs)`` on every (or the named) worker: address -> outcome."""
        loop = asyncio.get_running_loop()
        st = self.state
        live = [w for w in st.workers.values() if w.id in self.worker_conns]
        if workers is None:
            targets = live
        else:
            names = {n for w in live for n in (w.id, w.name, w.address)}
            unknown = [n for n in workers if n not in names]
            if unknown:  # said, not run on fewer workers than asked without a word
                raise ValueError(f"no worker is named {', '.join(map(repr, unknown))}: give worker ids, names or "
                                 "addresses as client.scheduler_info()['workers'] lists them")  # fmt: skip
            targets = [w for w in live if w.id in workers or w.name in workers or w.address in workers]
        futs: dict[str, asyncio.Future[dict[str, Any]]] = {}
        for w in targets:
            self._run_ids += 1
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            self.run_waiters[self._run_ids] = (w.id, fut)
            futs[w.address] = fut
            self.outgoing.post_worker(w.id, {"op": "run", "rid": self._run_ids, "function": function, "args": args})
        return {addr: await fut for addr, fut in futs.items()}

    async def restart(self, timeout: float = 30.0) -> dict[str, Any]:
        """Forget every task and restart every worker process; wait for as many to come back."""
        n = len(self.worker_conns)
        since = self.clock()
        await self.apply([ev.Restart("the cluster was restarted (client.restart()); submit the work again",
                                     since)])  # fmt: skip
        for wid in list(self.worker_conns):
            self._restarting.add(wid)
            self.outgoing.post_worker(wid, {"op": "restart"})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        back = 0
        while loop.time() < deadline:  # old connections close, the same processes register again
            back = sum(1 for ws in self.state.workers.values() if ws.joined > since)
            if back >= n:
                break
            await asyncio.sleep(0.05)
        return {"workers": back, "expected": n}

    async def _setup_request(self, cid: str, msg: dict[str, Any]) -> None:
        await self._answer(cid, msg, lambda: self.register_setup(str(msg["name"]), msg["setup"],
                                                                     _setup_timeout(msg.get("timeout"))))

    def eta(self) -> dict[str, Any]:
        """Forecast remaining seconds with the workers present now (and in-flight launches)."""
        from tidepool.scaling.forecast import forecast
        from tidepool.scaling.observation import remaining_work

        now = self.clock()
        st = self.state
        work = remaining_work(st, now)
        slots = sum(w.slots for w in st.workers.values() if w.state in ("running", "starting"))
        arrivals: tuple[float, ...] = ()
        for hook in self.eta_hooks:
            arrivals += hook(now)
        eta = forecast(work, slots, arrivals)
        return {"eta": None if eta == float("inf") else eta, "tasks": len(work), "slots": slots,
                "work_seconds": work.total}  # fmt: skip

    def progress(self, watch: int) -> dict[str, int]:
        """Done (in memory, or finished and already released: ``released`` or forgotten), failed
        and total keys of a graph.  A key of a graph being computed is ``released`` only once it
        ran and its value was let go (one lost with a worker goes back to waiting at once): counted
        done, the count never goes back (it went 10/12 -> 1/12 -> 12/12: a bug hunt)."""
        tasks = self.state.tasks
        keys = self.watches.get(watch, [])
        done = failed = 0
        for k in keys:
            ts = tasks.get(k)
            if ts is None or ts.state in ("memory", "released"):
                done += 1
            elif ts.state == "erred":
                failed += 1
        return {"done": done + failed, "failed": failed, "total": len(keys)}

    def info(self) -> dict[str, Any]:
        st = self.state
        return {"address": self.address, "workers": st.worker_info(), "tasks": st.task_counts(),
                "counters": dict(st.counters), "idle_and_empty": st.idle_and_empty(),
                "dashboard": self.dashboard_link}  # fmt: skip

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        stalls = StallLog(self.state.heartbeat_timeout)
        while True:
            before = loop.time()
            await asyncio.sleep(self.tick_interval)
            # anything beyond the interval (plus slack for ordinary jitter) is time we could not run
            lag = loop.time() - before - self.tick_interval
            stalled = lag if lag > max(0.5, self.tick_interval) else 0.0
            if stalled:
                said = stalls.note(stalled, loop.time())
                if said is not None:
                    log.log(*said)
            try:
                now = self.clock()
                events: list[ev.Event] = [ev.Tick(now, stalled)]
                if self.durable is not None:
                    events += self.durable.on_tick(now)
                await self.apply(events)
            except Exception:
                log.exception("tick failed")


def _retrieve(t: asyncio.Future[Any]) -> None:
    """Mark a send's outcome seen (a failed send to a closing worker is no news)."""
    if not t.cancelled():
        t.exception()


def _given(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _inline_values(finished: list[Any], tasks: Mapping[str, Any]) -> dict[str, Any]:
    """The small values a worker's finished items carry (``comm/inline.py``): [key, nbytes,
    duration, pickle, serial].  Not one of another record's run under the key (its outcome is
    ignored by the state: its pickle must not ride on the new record's report)."""
    out = {}
    for item in finished:
        if len(item) > 3 and item[3] is not None:
            run = item[4] if len(item) > 4 else 0
            ts = tasks.get(item[0])
            if run and ts is not None and ts.run and ts.run != run:
                continue
            out[item[0]] = item[3]
    return out


def _join_events(wid: str, msg: dict[str, Any], now: float, ready: bool) -> list[ev.Event]:
    """A worker's ``register`` message as the events of its joining; raises KeyError, TypeError or
    ValueError on a malformed one (resources must map names to numbers >= 0)."""
    resources = dict(msg["resources"])
    for name, amount in resources.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, int | float) \
                or not 0 <= amount < float("inf"):  # fmt: skip
            raise ValueError(f"resource {name!r}: {amount!r} is not a number >= 0")
    join = ev.WorkerJoin(wid, str(msg["address"]), resources, now, node_type=str(msg.get("node_type", "default")),
                         name=str(msg.get("name", "")), memory_limit=int(msg.get("memory_limit", 0)), ready=ready)  # fmt: skip
    out: list[ev.Event] = [join]
    rejoin = msg.get("rejoin")
    if rejoin is not None:
        out.append(rejoin_event(wid, rejoin, now))
    return out


def _setups_missed(setups: Mapping[str, Any], digests: Mapping[str, str], has: Any) -> list[list[Any]]:
    """The registered ``setups`` (with their ``digests``) a worker lacks: ``has`` is name -> digest
    of each it has run or was sent; anything else (a worker that does not say) lacks them all."""
    if not isinstance(has, dict):
        has = {}
    return [[name, blob] for name, blob in setups.items() if has.get(name) != digests[name]]


def _setup_timeout(value: Any) -> float | None:
    """A register-setup request's ``timeout``: None (wait for every worker) or seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ProtocolError(f"register-setup timeout must be a number of seconds > 0, got {value!r}")
    return float(value)
