"""The scheduler's state machine: events in, commands out, no I/O and no clock.

State
-----
``tasks``: every task the scheduler still needs to know about (its value is wanted, it is being
computed, or it is lineage for a value that is).  ``workers``: connected workers.  Per task:
``state`` (see ``TASK_TRANSITIONS``), ``who_has`` (workers holding its value), ``waiters``
(dependents not finished that need its value), ``waiting_on`` (inputs not available yet),
``wanted_by`` (clients holding a future).  Per worker: ``processing`` (tasks assigned, with the
estimated seconds each), ``has_what`` (values it holds), ``occupancy`` and ``idle_since``.

Data flow
---------
The asyncio shell (``server.py``) turns messages into events (``events.py``) stamped with ``now``,
calls :meth:`SchedulerState.handle`, and turns the returned commands into messages.  A value is
needed while a client wants it or an unfinished dependent needs it; when nobody does, it is freed on
the workers, and a task record is forgotten once nothing depends on it (so memory stays flat in long
runs).  Values lost with a worker are recomputed from lineage if still needed.

Ready tasks wait in line by priority (``intake.py``: user priority, then submission order, depth
first across submissions).  Which worker takes which ready task, the ready heaps and work stealing
are ``placement.py``'s (pure rules; this file makes the moves); graceful retirement is decided in
``retire.py`` and applied here; counts per state are kept by ``tally.py``.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tidepool.comm.serialize import Serialized
from tidepool.errors import ConfigError
from tidepool.resources import fits
from tidepool.scheduler import audit, explain, intake, rejoin, retire
from tidepool.scheduler import events as ev
from tidepool.scheduler import placement as pl
from tidepool.scheduler.estimates import DurationEstimates
from tidepool.scheduler.kinds import ACTIVE, TASK_TRANSITIONS, WORKER_TRANSITIONS, InvalidTransition
from tidepool.scheduler.kinds import ReportKind as RK
from tidepool.scheduler.kinds import TaskState as TS
from tidepool.scheduler.kinds import WorkerState as WS
from tidepool.scheduler.records import NOSET, TaskError, TaskRecord, WorkerRecord, small
from tidepool.scheduler.resource_names import typo_reason
from tidepool.scheduler.tally import Tally

#: the pseudo-client that holds fire-and-forget tasks until they finish
FIRE_AND_FORGET = "<fire-and-forget>"
#: a memory restart of a worker whose spilling is off blames the values it holds when they are at
#: least this share of its memory limit (they do not fit; each restart lost them and their recomputes
#: filled it again): past ``allowed_failures`` such losses a value fails instead of looping for ever
HELD_SHARE = 0.5


class SchedulerState:
    """Pure scheduler state machine; see the module docstring."""

    def __init__(
        self,
        *,
        allowed_failures: int = 3,
        heartbeat_timeout: float = 300.0,
        no_worker_timeout: float | None = 60.0,
        max_fetch_failures: int = 5,
        queue_seconds: float = 0.05,
        max_queue_per_slot: int = 200,
        estimates: DurationEstimates | None = None,
    ) -> None:
        if isinstance(allowed_failures, bool) or _whole(allowed_failures) < 0:
            raise ConfigError(f"allowed_failures must be a whole number >= 0 (worker deaths a task may be blamed "
                              f"for before it fails with KilledWorkerError), got {allowed_failures!r}")  # fmt: skip
        self.allowed_failures = _whole(allowed_failures)  # a numpy integer too, kept as a plain int
        #: seconds of silence (beyond the scheduler's own stalls) after which a worker is removed
        self.heartbeat_timeout = heartbeat_timeout
        #: without an autoscaler: seconds a task may wait for a worker with its resources, then errs
        self.no_worker_timeout = no_worker_timeout
        #: a value that could not be fetched this many times (holder alive) fails its dependent
        self.max_fetch_failures = max_fetch_failures
        self.queue_seconds = queue_seconds
        self.max_queue_per_slot = max_queue_per_slot
        self.estimates = estimates or DurationEstimates()
        #: the autoscaler's rule (from its last ``CheckFeasible`` event): why no usable node type
        #: could ever run this shape, as a reason string or ``(error type, message)``; None: no
        #: autoscaler (tasks wait ``no_worker_timeout`` for a worker instead)
        self.infeasible: Callable[[ev.Shape], ev.Infeasible] | None = None
        self.tasks: dict[str, TaskRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.clients: dict[str, set[str]] = {}
        self.functions: dict[str, Serialized] = {}
        #: the ready line (placement.py): a heap per shape, one for tasks restricted to named workers
        self.ready = pl.ReadyHeaps()
        self.no_worker: dict[ev.Shape, set[TaskRecord]] = {}
        #: tasks per state, per group and state (the dashboard), and pending demand per (shape,
        #: group) (what scaling looks at), kept exact by ``_move`` (tally.py)
        self.tally = Tally()
        self.counts, self.group_counts, self.pending = self.tally.counts, self.tally.group_counts, self.tally.pending
        #: every resource name a worker or a known node type ever offered (typos fail at submit)
        self.offered_resources: set[str] = set()
        self.room: set[str] = set()
        #: workers with tasks queued beyond their slots (steal candidates), kept by _load_changed
        self.overloaded: set[str] = set()
        self._fit_any: dict[ev.Shape, bool] = {}
        self.retiring: dict[str, dict[str, retire.Ask]] = {}  # worker -> key -> the ask for its copy
        self.retire_reason: dict[str, str] = {}
        #: tasks that were on a worker that died without having been reported started there: a
        #: quick task's "started" rides with its outcome, so one of them may be what killed it.  They
        #: run "solo" next time (started reported first, never batched): blame is exact then
        self.solo: set[str] = set()
        #: key -> {worker: (nbytes, since)}: values rejoining workers hold of keys not known yet
        #: (a graph sent just before a scheduler restart comes again with its client: rejoin.py)
        self.unclaimed: dict[str, dict[str, tuple[int, float]]] = {}
        self.unclaimed_runs: dict[str, tuple[str, bool, float]] = {}
        #: why the last worker that left did (a failed setup hook), until a worker becomes ready
        self.setup_failed: str | None = None
        #: when this state was restored from a state directory (a "loaded" RecoveryReport)
        self.restored_at: float | None = None
        self._priority = 0
        self._worker_seq = 0
        # task records' serials (TaskRecord.run): from a random base, so that a worker's runs tagged
        # by an earlier scheduler process (restarted from its state directory) never match by chance
        self._runs = itertools.count((int.from_bytes(os.urandom(4), "big") << 32) + 1)
        self.now = 0.0
        self.last_progress = 0.0
        self.counters: dict[str, int] = {
            "finished": 0, "erred": 0, "retried": 0, "recomputed": 0, "workers_lost": 0,
            "workers_joined": 0, "forgotten": 0, "rescued": 0, "refused_outcomes": 0, "refused_reports": 0,
            "suspect_holders": 0, "trusted_again": 0, "stale_outcomes": 0,
        }  # fmt: skip
        self._handlers: dict[type, Callable[[Any, list[ev.Command]], None]] = {
            ev.UpdateGraph: self._update_graph, ev.ReleaseKeys: self._release_keys, ev.ClientGone: self._client_gone,
            ev.WorkerJoin: self._worker_join, ev.WorkerReady: self._worker_ready,
            ev.WorkerPreparing: self._worker_preparing, ev.SetupsChanged: self._setups_changed, ev.WorkerRemove: self._worker_remove,
            ev.TaskFinished: self._task_finished, ev.TaskErred: self._task_erred, ev.AddReplica: self._add_replica,
            ev.MissingData: self._missing_data, ev.Heartbeat: self._heartbeat, ev.Tick: self._tick,
            ev.TasksStarted: self._tasks_started, ev.ValueUnservable: self._value_unservable,
            ev.CheckFeasible: self._check_feasible, ev.StealReply: self._steal_reply,
            ev.FireAndForget: self._fire_and_forget, ev.Broadcast: self._broadcast, ev.Restart: self._restart,
            ev.TaskSeceded: self._task_seceded, ev.AbandonedRunsEnded: self._abandoned_runs_ended,
            ev.RetireWorkers: self._retire_workers, **rejoin.handlers(self),
        }  # fmt: skip

    # ------------------------------------------------------------------------------------------
    def handle(self, event: ev.Event) -> list[ev.Command]:
        """Apply one event; return the commands the shell must carry out, in order."""
        return self.handle_many((event,))

    def _after(self, out: list[ev.Command]) -> list[ev.Command]:
        if self.retiring:
            self._apply_retire(retire.progress_retirements(self), out)
        if self.room and self.ready:
            self._schedule(out)
        if self.room and len(self.workers) > 1:
            self._steal(out)
        return out

    def handle_many(self, events: Iterable[ev.Event]) -> list[ev.Command]:
        out: list[ev.Command] = []
        for event in events:
            self.now = max(self.now, event.now)
            self._handlers[type(event)](event, out)
        return self._after(out)

    # ---- transitions ---------------------------------------------------------------------------
    def _move(self, ts: TaskRecord, new: TS) -> None:
        if (ts.state, new) not in TASK_TRANSITIONS:
            raise InvalidTransition(f"task {ts.key}: {ts.state} -> {new}")
        old = ts.state
        if old == "no-worker":
            s = self.no_worker.get(ts.shape)
            if s is not None:
                s.discard(ts)
                if not s:
                    del self.no_worker[ts.shape]
        self.tally.move(ts, old, new)
        ts.state = new

    def _move_worker(self, ws: WorkerRecord, new: WS) -> None:
        if (ws.state, new) not in WORKER_TRANSITIONS:
            raise InvalidTransition(f"worker {ws.id}: {ws.state} -> {new}")
        ws.state = new

    # ---- clients -------------------------------------------------------------------------------
    def _update_graph(self, e: ev.UpdateGraph, out: list[ev.Command]) -> None:
        self.functions.update(e.functions)
        new, collided, self._priority = intake.records(e.tasks, self.tasks, self._priority)
        for ts in new:
            self.tasks[ts.key] = ts
            self.tally.add(ts)
        claimed = rejoin.claim(self, new) if self.unclaimed or self.unclaimed_runs else []
        keys = self.clients.setdefault(e.client, set())
        for k in e.wanted:
            wts = self.tasks.get(k)
            if k in collided:
                error = {"type": "KeyCollisionError", "origin": k, "message": explain.collision(k, collided[k])}
                out.append(ev.Report(e.client, k, RK.ERRED, error=error))
                continue
            if wts is None:
                out.append(ev.Report(e.client, k, RK.LOST))
                continue
            keys.add(wts.key)  # the record's own key string: one copy per key, not one per set
            wts.add_wanter(e.client)
            if wts.state == "released":
                self._compute(wts, out)
            elif wts.state in (TS.MEMORY, TS.ERRED):
                out.append(ev.Report(e.client, k, RK.MEMORY if wts.state == TS.MEMORY else RK.ERRED))
        for ts in new:  # tasks submitted but not needed by anything: drop
            if ts.state == "released":
                self._check(ts, out)
        for ts in claimed:  # a kept value nothing wants or waits for: freed as any other
            if not ts.needed:
                self._check(ts, out)
        if e.exact:  # a resync: keys the client wanted here and holds no future of any more
            stale = keys.difference(e.wanted)
            if stale:
                self._release_keys(ev.ReleaseKeys(e.client, sorted(stale), e.now), out)

    def _release_keys(self, e: ev.ReleaseKeys, out: list[ev.Command]) -> None:
        if e.cancel:
            self._cancel_keys(e, out)
            return
        keys = self.clients.get(e.client, set())
        for k in e.keys:
            keys.discard(k)
            ts = self.tasks.get(k)
            if ts is not None and e.client in ts.wanted_by:
                ts.drop_wanter(e.client)
                self._check(ts, out)

    # ---- cancelling (client.cancel, Future.cancel, Executor.shutdown(cancel_futures=True)) -------
    def _cancel_keys(self, e: ev.ReleaseKeys, out: list[ev.Command]) -> None:
        """``e.client`` cancels ``e.keys``; cancelling is per client.

        Its futures of those keys and of every task downstream of them that has not finished (a
        finished one no longer needs its inputs) are reported "cancelled" and it stops wanting them.
        Tasks nobody else needs then stop as on any release (``_check``): a queued one is taken off
        its worker's queue and never runs, an executing one's result is dropped by its worker, and
        values are freed on every holder.  Other clients' futures are not touched: their tasks (and
        the inputs those need) go on.  ``unless_started``: keys whose task is executing are kept and
        reported "running", finished ones are kept (their outcome was reported already).
        """
        client = e.client
        wanted = self.clients.get(client, set())
        roots, reports = explain.cancel_roots(self.tasks, client, e.keys, e.unless_started)
        for r in reports:
            out.append(r)
            if r.status == RK.CANCELLED:
                wanted.discard(r.key)
        cancelled = explain.downstream(roots)
        for ts in cancelled:
            if client in ts.wanted_by:
                ts.drop_wanter(client)
                wanted.discard(ts.key)
                out.append(ev.Report(client, ts.key, RK.CANCELLED))
        for ts in reversed(cancelled):  # any order works: _check follows each task to its inputs
            self._check(ts, out)

    def _client_gone(self, e: ev.ClientGone, out: list[ev.Command]) -> None:
        keys = self.clients.pop(e.client, set())
        self._release_keys(ev.ReleaseKeys(e.client, list(keys), e.now), out)

    # ---- computing -----------------------------------------------------------------------------
    def _compute(self, root: TaskRecord, out: list[ev.Command]) -> None:
        """Bring a needed, released task (and released inputs, recursively) back to life."""
        stack = [root]
        while stack:
            ts = stack.pop()
            if ts.state != "released":
                continue
            err = ts.error
            if err is not None and err.exc_type in ("DependencyError", "CycleError") and err.message and not err.exception:
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                continue
            typo = typo_reason((name for name, _ in ts.shape), self.offered_resources) if ts.shape else None
            if typo is not None:
                self._fail(ts, "InfeasibleTaskError", f"task {ts.key!r} can never run: {typo}", out)
                continue
            waiting: list[TaskRecord] = []
            failed: TaskRecord | None = None
            for dep in ts.deps:
                dep.add_waiter(ts)
                if dep.state == "memory":
                    continue
                if dep.state == "erred":
                    failed = dep
                    continue
                waiting.append(dep)
                if dep.state == "released":
                    stack.append(dep)
            if failed is not None:
                self._copy_error(ts, failed)
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                continue
            ts.waiting_on = small(waiting)
            if waiting:
                self._move(ts, TS.WAITING)
            else:
                self._make_ready(ts, out)

    def _make_ready(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        self._move(ts, TS.READY)
        shape = ts.shape
        ok = self._fit_any.get(shape)
        if ok is None:
            ok = self._fit_any[shape] = pl.fits_any(self.workers.values(), shape)
        if not ok:
            why = self._why_infeasible(ts)
            if why is not None:
                self._fail(ts, why[0], why[1], out)
                return
            self._move(ts, TS.NO_WORKER)
            ts.no_worker_since = self.now
            self.no_worker.setdefault(shape, set()).add(ts)
            return
        if ts.restrict is not None and self._restricted_ready(ts):
            return
        self.ready.push(ts)

    def _to_no_worker(self, ts: TaskRecord) -> None:
        self._move(ts, TS.NO_WORKER)
        ts.no_worker_since = self.now
        self.no_worker.setdefault(ts.shape, set()).add(ts)

    def _restricted_ready(self, ts: TaskRecord) -> bool:
        """Queue a ready task restricted to named workers; False: it goes to the shape heap
        instead (a loose restriction none of whose workers is here)."""
        if any(pl.may_wait_for(w, ts) and pl.fits_on(w, ts.shape) for w in self.workers.values()):
            self.ready.push_restricted(ts)
            return True
        if ts.loose:
            return False
        self._to_no_worker(ts)  # waits for one of its workers (no_worker_timeout applies)
        return True

    def _schedule_restricted(self, out: list[ev.Command]) -> None:
        keep: list[TaskRecord] = []
        while self.room:
            ts = self.ready.pop_restricted()
            if ts is None:
                break
            cands = pl.restricted_candidates(ts, self.workers, self.room, self.ready.by_shape)
            if cands:
                self._assign(ts, pl.choose_worker(ts, cands), out)
            elif not any(pl.may_wait_for(w, ts) for w in self.workers.values()):
                if ts.loose:  # its workers left (or went silent): any worker will do
                    self.ready.push(ts)
                else:  # wait for one of them to come back
                    self._to_no_worker(ts)
            else:
                keep.append(ts)  # its workers are busy: wait for them
        self.ready.keep_restricted(keep)

    def _reschedule(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        """Running (or ready) task goes back to waiting/ready; missing inputs are recomputed."""
        waiting = [d for d in ts.deps if d.state != "memory"]
        ts.waiting_on = small(waiting)
        if not waiting:
            if ts.state != "ready":
                self._make_ready(ts, out)
            return
        self._move(ts, TS.WAITING)
        for dep in waiting:
            dep.add_waiter(ts)
            if dep.state == "released":
                self._compute(dep, out)
            elif dep.state == "erred":
                self._copy_error(ts, dep)
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                return

    def _schedule(self, out: list[ev.Command]) -> None:
        """Place ready tasks while some worker has room (placement.py chooses, this moves)."""
        if self.ready.restricted:
            self._schedule_restricted(out)
        deferred: list[TaskRecord] = []
        # over-provisioned stays so while this loop places (each placement uses one ready task and one slot)
        pack = pl.over_provisioned(self.workers, self.room, self.counts.get(TS.READY, 0))
        try:
            while self.room:
                choice = pl.next_shape(self.ready, self.workers, self.room, self._fit_any)
                if choice is None:
                    return
                what, shape, cands = choice
                if what == "park":  # no running worker fits the shape: no-worker demand
                    for ts in self.ready.take(shape):
                        self._to_no_worker(ts)
                    continue
                ts = self.ready.pop(shape)
                target = pl.choose_worker(ts, cands, pack)
                if ts.deps and self._transfer_outweighs(target, ts) and pl.holder_busy(ts, self.workers, self.room):
                    deferred.append(ts)  # its inputs' holder is only full for now: wait for it
                    continue
                self._assign(ts, target, out)
        finally:
            for ts in deferred:  # back in line, in their old places: they wait for their holders
                self.ready.requeue(ts)

    def _has_room(self, ws: WorkerRecord) -> bool:
        return pl.has_room(ws, self.queue_seconds, self.max_queue_per_slot)

    def _room_changed(self, ws: WorkerRecord) -> None:
        if self._has_room(ws):
            self.room.add(ws.id)

    def _take_back(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        """A running ``ts`` is not wanted any more: off its worker, which drops it.  If it executes
        there (and holds a slot), the slot stays counted busy until the worker says the run ended
        (``AbandonedRunsEnded``): otherwise the next task would queue behind it while another
        worker idles."""
        w = ts.worker
        ws = self.workers.get(w) if w is not None else None
        est = ws.processing.get(ts) if ws is not None and ts.executing and not ts.seceded else None
        self._unassign(ts)
        if w is not None:
            out.append(ev.Free(w, [ts.key]))
        if est is not None and ws is not None:
            ws.abandoned[ts.key] = est
            ws.abandoned_run[ts.key] = ts.run
            if ws.special:  # the run holds its gpu until it ends
                pl.hold_abandoned_special(ws, ts.key, ts.shape)
            ws.occupancy += est
            self._load_changed(ws)
            if not self._has_room(ws):
                self.room.discard(ws.id)

    def _transfer_outweighs(self, thief: WorkerRecord, ts: TaskRecord) -> bool:
        return pl.transfer_outweighs(thief, ts, self.estimates.estimate(ts.group))

    def _assign(self, ts: TaskRecord, ws: WorkerRecord, out: list[ev.Command]) -> None:
        if not ts.run:
            ts.run = next(self._runs)
        self._move(ts, TS.RUNNING)
        est = self.estimates.estimate(ts.group)
        ts.worker = ws.id
        ts.executing = False
        if ws.abandoned and ts.key in ws.abandoned and ws.abandoned_run.get(ts.key) == ts.run:
            # the same record wanted again where it may still run: the worker keeps that run (and
            # says "started") or, if it ended meanwhile (its "ended" in flight, then ignored), runs
            # it again; either way it is counted in ``processing`` from now on.  (Another record
            # under the key waits on the worker until the old run ends: that stays abandoned.)
            ws.abandoned_run.pop(ts.key, None)
            ws.occupancy = max(0.0, ws.occupancy - ws.abandoned.pop(ts.key))
            pl.release_abandoned_special(ws, ts.key)  # counted again below, as this record's
        ts.started = self.now
        ws.processing[ts] = est
        if ws.special:
            pl.take_special(ws, ts.shape, 1)
        self._load_changed(ws)
        ws.occupancy += est
        ws.idle_since = None
        if not self._has_room(ws):
            self.room.discard(ws.id)
        ship = ""
        if ts.func_id not in ws.funcs:
            ws.funcs.add(ts.func_id)
            ship = ts.func_id
        out.append(ev.Execute(ws.id, ts.key, ship))

    def _unassign(self, ts: TaskRecord) -> None:
        ws: WorkerRecord | None = self.workers.get(ts.worker) if ts.worker else None
        ts.worker = None
        ts.executing = False
        ts.stealing = False
        seceded, ts.seceded = ts.seceded, False
        if ws is None:
            return
        if seceded and ts in ws.processing:
            ws.seceded -= 1
        est = ws.processing.pop(ts, None)
        self._load_changed(ws)
        if est is None:
            return
        if ws.special and not seceded:  # a seceded task gave them back when it left its slot
            pl.take_special(ws, ts.shape, -1)
        if seceded:
            est = 0.0
        ws.last_done = self.now
        if ws.processing:
            ws.occupancy -= est
        else:
            ws.occupancy = sum(ws.abandoned.values()) if ws.abandoned else 0.0
            ws.idle_since = self.now
        self._room_changed(ws)

    # ---- results -------------------------------------------------------------------------------
    def _task_finished(self, e: ev.TaskFinished, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is None:
            return  # a departed worker's word is not trusted; the value is gone with it
        if ws.abandoned and e.key in ws.abandoned:
            self._abandoned_outcome(ws, e.key, e.run)
        ts = self.tasks.get(e.key)
        if ts is None and self.unclaimed_runs and rejoin.run_ended(self, ws, e.key, e.nbytes, e.now):
            return  # kept for the graph that names it (a client resending after a restart)
        if ts is None or ts.state in ("released", "erred"):
            if ts is not None and ts in ws.processing:
                self._unassign(ts)
            out.append(ev.Free(e.worker, [e.key]))
            return
        if e.run and ts.run and e.run != ts.run:
            # a run of another record under this key (released, then the key reused), its report in
            # flight when the worker got the free: not this task's value.  No free is sent: the
            # worker had one before the new task, in order, and may run this one now
            self.counters["stale_outcomes"] += 1
            return
        if ts.worker != e.worker:
            if e.worker in ts.who_has:
                return  # said twice: it holds the value already
            # only the worker a task was given to may report its outcome: any other worker's
            # "finished" is refused (an authenticated peer could otherwise forge a result, or claim
            # to hold a value it never computed); whatever it has under that key is dropped there
            self.counters["refused_outcomes"] += 1
            out.append(ev.Free(e.worker, [e.key]))
            return
        self._value_arrived(ts, ws, e.nbytes, e.duration, out)

    def _value_arrived(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int, duration: float | None,
                       out: list[ev.Command]) -> None:  # fmt: skip
        """``ws`` holds a value of ``ts``, which was not in memory: it is now.  ``duration`` is
        None when the value is a copy that outlived its original holder (no new execution)."""
        if ts.state == "running" and ts.worker != ws.id:
            other = ts.worker
            self._unassign(ts)
            if other is not None:
                out.append(ev.Free(other, [ts.key]))
        elif ts.worker == ws.id:
            self._unassign(ts)
        self.last_progress = self.now
        ts.avoid = None
        if duration is not None:
            self.estimates.observe(ts.group, duration)
            self.counters["finished"] += 1
            ws.executed += 1
        self._set_nbytes(ts, nbytes)
        ts.suspicious = 0
        if self.solo:
            self.solo.discard(ts.key)
        self._move(ts, TS.MEMORY)
        ts.waiting_on = NOSET
        self._add_holder(ts, ws, nbytes)
        for c in ts.wanted_by:
            out.append(ev.Report(c, ts.key, RK.MEMORY))
        ts.drop_wanter(FIRE_AND_FORGET)  # it ran: nobody needs to keep it
        waiters = ts.waiters  # a set is walked as a copy: a waiter that fails as it turns ready leaves it
        for dt in list(waiters) if type(waiters) is set else waiters:
            if ts in dt.waiting_on:
                dt.drop_waiting_on(ts)
                if not dt.waiting_on and dt.state == "waiting":
                    self._make_ready(dt, out)
        for dep in ts.deps:
            dep.drop_waiter(ts)
            if not dep.waiters and not dep.wanted_by:
                self._check(dep, out)
        if not ts.needed:
            self._check(ts, out)

    def _add_holder(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int) -> None:
        """``ws`` holds ``ts`` too; its held bytes count the task's one size (``nbytes``, what this
        holder measured, sets it only while none is known), so they stay the sum of what it holds."""
        if ws.id not in ts.who_has:
            if not ts.nbytes and nbytes:
                self._set_nbytes(ts, nbytes)
            ts.add_holder(ws.id)
            ws.has_what.add(ts)
            ws.nbytes += ts.nbytes

    def _set_nbytes(self, ts: TaskRecord, nbytes: int) -> None:
        """A new size of ``ts`` (a run ended again): the workers holding it count the new one."""
        delta = nbytes - ts.nbytes
        if delta:
            for w in ts.who_has:
                holder = self.workers.get(w)
                if holder is not None:
                    holder.nbytes += delta
        ts.nbytes = nbytes

    def _add_replica(self, e: ev.AddReplica, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        ts = self.tasks.get(e.key)
        if ws is None:
            return
        if ts is not None and ts.state in (TS.WAITING, TS.READY, TS.NO_WORKER, TS.RUNNING):
            # the original holder died after this worker copied the value: keep the copy rather
            # than recompute it (its dependent may already be queued here, needing it)
            self.counters["rescued"] += 1
            self._value_arrived(ts, ws, e.nbytes, None, out)
            return
        if ts is None or ts.state != "memory":
            out.append(ev.Free(e.worker, [e.key]))
            return
        ts.fetch_failures = 0  # a copy moved fine: earlier failures were about dead holders
        self._add_holder(ts, ws, e.nbytes)

    def _abandoned_outcome(self, ws: WorkerRecord, key: str, run: int) -> None:
        """An outcome of ``key`` from ``ws``, where a run of it was abandoned: if it is that run's
        (it finished before the worker read the free, so no "ended" will come), its slot is free."""
        mine = ws.abandoned_run.get(key, 0)
        if run and mine and mine != run:
            return  # the outcome of another record's run under that key (0: an adopted run, any serial)
        self._abandoned_runs_ended(ev.AbandonedRunsEnded(ws.id, [key], self.now), [])

    def _task_erred(self, e: ev.TaskErred, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is not None and ws.abandoned and e.key in ws.abandoned:
            self._abandoned_outcome(ws, e.key, e.run)
        ts = self.tasks.get(e.key)
        if ts is None and ws is not None and self.unclaimed_runs and rejoin.run_ended(self, ws, e.key, None, e.now):
            out.append(ev.Free(ws.id, [e.key]))  # the resent graph runs it again (its error is not kept)
            return
        if e.run and ts is not None and ts.run and e.run != ts.run:
            self.counters["stale_outcomes"] += 1  # another record's run under this key: see _task_finished
            return
        if ws is None or ts is None or ts.state != "running" or ts.worker != e.worker:
            if ts is not None and ws is not None and ts in ws.processing:
                self._unassign(ts)
            return
        self._unassign(ts)
        self.last_progress = e.now
        if ts.retries_left > 0:
            ts.retries_left -= 1
            self.counters["retried"] += 1
            self._reschedule(ts, out)
            return
        ts.error = TaskError(e.exc_type, e.message, ts.key, e.exception, e.traceback)
        self._move(ts, TS.ERRED)
        self._erred_cascade(ts, out)

    def _copy_error(self, ts: TaskRecord, src: TaskRecord) -> None:
        err = src.error
        if err is not None and err.origin:
            ts.error = err  # never changed: shared
        elif err is not None:
            ts.error = TaskError(err.exc_type, err.message, src.key, err.exception, err.traceback)
        else:
            ts.error = TaskError("", "", src.key)

    def _erred_cascade(self, root: TaskRecord, out: list[ev.Command]) -> None:
        """``root`` just became erred: report it and fail every unfinished dependent."""
        self.counters["erred"] += 1
        stack = [root]
        while stack:
            ts = stack.pop()
            if ts is not root:
                if ts.state not in ACTIVE:
                    continue
                if ts.state == "running":
                    self._take_back(ts, out)
                self._copy_error(ts, root)
                self._move(ts, TS.ERRED)
            for c in ts.wanted_by:
                out.append(ev.Report(c, ts.key, RK.ERRED))
            ts.drop_wanter(FIRE_AND_FORGET)
            for dep in ts.deps:
                dep.drop_waiter(ts)
            stack.extend(ts.waiters)
            ts.waiters = NOSET
            ts.waiting_on = NOSET
            for dep in ts.deps:
                self._check(dep, out)
            self._check(ts, out)

    # ---- releasing and forgetting -------------------------------------------------------------
    def _check(self, root: TaskRecord, out: list[ev.Command]) -> None:
        """Free what nobody needs, cancel what nobody waits for, forget what nothing depends on."""
        stack = [root]
        while stack:
            ts = stack.pop()
            if ts.key not in self.tasks or ts.needed:
                continue
            state = ts.state
            if state == "memory":
                self._drop_value(ts, out)
                self._move(ts, TS.RELEASED)
            elif state in ACTIVE:
                if state == "running":
                    self._take_back(ts, out)
                self._move(ts, TS.RELEASED)
                ts.waiting_on = NOSET
                for dep in ts.deps:
                    dep.drop_waiter(ts)
                    stack.append(dep)
            if ts.state in ("released", "erred") and not ts.dependents:
                del self.tasks[ts.key]
                if self.solo:
                    self.solo.discard(ts.key)
                self.tally.forget(ts)
                self.counters["forgotten"] += 1
                for dep in ts.deps:
                    dep.drop_dependent(ts)
                    dep.drop_waiter(ts)
                    stack.append(dep)

    def _drop_value(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        for w in ts.who_has:
            ws = self.workers.get(w)
            if ws is not None:
                ws.has_what.discard(ts)
                ws.nbytes -= ts.nbytes
                out.append(ev.Free(w, [ts.key]))
        ts.who_has = NOSET

    # ---- workers -------------------------------------------------------------------------------
    def _worker_join(self, e: ev.WorkerJoin, out: list[ev.Command]) -> None:
        if e.worker in self.workers:
            return
        self._worker_seq += 1
        ws = WorkerRecord(e.worker, e.address, dict(e.resources), e.node_type, e.name, e.now,
                          self._worker_seq, e.memory_limit)  # fmt: skip
        ws.state = "running" if e.ready else "starting"
        self.workers[e.worker] = ws
        self.offered_resources.update(e.resources)
        self.counters["workers_joined"] += 1
        if ws.state == "running":
            self._worker_running(ws, out)

    def _worker_ready(self, e: ev.WorkerReady, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is not None and ws.state == "starting":
            self._move_worker(ws, WS.RUNNING)
            self._worker_running(ws, out)

    def _worker_preparing(self, e: ev.WorkerPreparing, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is None or ws.preparing == e.preparing:
            return
        ws.preparing = e.preparing
        if e.preparing:
            self.room.discard(ws.id)
        elif ws.state == WS.RUNNING:
            self._worker_running(ws, out)

    def _setups_changed(self, e: ev.SetupsChanged, out: list[ev.Command]) -> None:
        self.setup_failed = None  # fixed, or dropped: a worker that joins now may well get ready

    def _worker_running(self, ws: WorkerRecord, out: list[ev.Command]) -> None:
        self.setup_failed = None  # a worker ran every setup: a new one may too
        self._fit_any = {s: ok for s, ok in self._fit_any.items() if ok}
        self._room_changed(ws)
        for shape in [s for s in self.no_worker if fits(ws.resources, s)]:
            for ts in sorted(self.no_worker.pop(shape), key=lambda t: t.priority):
                self._make_ready(ts, out)

    def _worker_remove(self, e: ev.WorkerRemove, out: list[ev.Command]) -> None:
        ws = self.workers.pop(e.worker, None)
        if ws is None:
            return
        self._move_worker(ws, WS.GONE)
        self.room.discard(ws.id)
        self._fit_any = {s: ok for s, ok in self._fit_any.items() if not ok}
        # the last worker to leave says whether a setup is what empties the pool
        self.setup_failed = e.reason if e.cause == ev.RemoveCause.SETUP_FAILED else None
        if self.unclaimed_runs:
            rejoin.forget_worker(self, ws.id)
        if not e.graceful:
            self.counters["workers_lost"] += 1
        lost: list[TaskRecord] = []
        for ts in ws.has_what:
            ts.drop_holder(ws.id)
            if ts.state == "memory" and not ts.who_has:
                lost.append(ts)
        ws.has_what.clear()
        running = sorted(ws.processing, key=lambda t: t.priority)
        ws.processing.clear()
        self.overloaded.discard(ws.id)
        # a memory restart of a worker whose spilling is off (spill_limit=0, a full disk) holding
        # values worth HELD_SHARE of its limit in memory: what it held is to blame.  Otherwise a
        # running task is (below), and the values that went with it are recomputed as before
        in_memory = ws.nbytes - int(ws.metrics.get("spilled", 0) or 0)
        memory = (e.cause is ev.RemoveCause.MEMORY and bool(ws.metrics.get("spill_disabled"))
                  and in_memory >= HELD_SHARE * ws.memory_limit)  # fmt: skip
        for ts in sorted(lost, key=lambda t: t.priority):
            if memory and ts.needed:
                # the values held do not fit: with spilling off or failing, each restart lost them
                # and their recomputes filled the worker again, for ever (no task ran at those
                # restarts to blame); past allowed_failures such a value fails instead
                ts.memory_losses += 1
                if ts.memory_losses > self.allowed_failures:
                    self._fail(ts, "KilledWorkerError", explain.lost_to_memory(ts, ws.name, e.reason), out)
                    continue
            self._lose_value(ts, out)
        for ts in running:
            if ts.state != "running" or ts.worker != ws.id:
                continue
            executing = ts.executing
            ts.worker = None
            ts.executing = ts.stealing = ts.seceded = False
            if not e.graceful and executing:
                ts.suspicious += 1
            elif not e.graceful:  # queued, or a quick task whose "started" was still to come
                self.solo.add(ts.key)
            if ts.suspicious > self.allowed_failures:
                self._fail(ts, "KilledWorkerError", explain.killed_workers(ts, ws.name, e.reason), out)
            else:
                self._reschedule(ts, out)
        # ready tasks of shapes nobody can run any more wait as no-worker demand
        for shape in list(self.ready.by_shape):
            if not pl.fits_any(self.workers.values(), shape):
                self._fit_any[shape] = False
                for ts in self.ready.take(shape):
                    self._to_no_worker(ts)

    def _lose_value(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        """``ts``'s only copy is gone: recompute it if needed, else just release it."""
        self._move(ts, TS.RELEASED)
        if not ts.needed:
            self._check(ts, out)
            return
        self.counters["recomputed"] += 1
        ts.recomputes += 1
        for dt in ts.waiters:
            if dt.state in ("waiting", "ready", "no-worker"):
                dt.add_waiting_on(ts)
                if dt.state != "waiting":
                    self._move(dt, TS.WAITING)
        self._compute(ts, out)

    def _missing_data(self, e: ev.MissingData, out: list[ev.Command]) -> None:
        """A worker could not fetch ``e.dep`` from ``e.holder``: drop that copy (recompute if it was
        the last) and reschedule the task that needed it.

        Bound: each time this drops the *last* copy counts once against the value (many fetchers
        failing on one dying holder count once); a successful copy anywhere resets the count.  A
        value lost this way ``max_fetch_failures`` times in a row fails the task that needs it
        with ``TransferError`` instead of recomputing forever.
        """
        dts = self.tasks.get(e.dep)
        holder = self.workers.get(e.holder)
        ts = self.tasks.get(e.key)
        if ts is None or ts.worker != e.worker or dts is None or dts not in ts.deps:
            # only the worker running a task may say it could not fetch that task's input: any other
            # report (an authenticated peer speaking for others, or a stale one) changes nothing
            self.counters["refused_reports"] += 1
            return
        if holder is not None and e.silent:
            dts.avoid = (dts.avoid or frozenset()) | {holder.id}  # recompute it elsewhere
        if holder is not None and e.silent and not holder.suspect:
            # suspect, not dead: no new work until it is heard from; its copies elsewhere still count
            holder.suspect = True
            self.room.discard(holder.id)
            self.counters["suspect_holders"] += 1
        if holder is not None and e.holder in dts.who_has:
            self._drop_copy(ts, dts, holder, e.error, out)
        if holder is not None and e.silent:
            # the task's other inputs held there would each cost the fetcher another timeout, one
            # round at a time (a bug hunt's task of 20 such inputs was not done after 100 s): their
            # copies there are dropped now too, and made elsewhere if it held the only one
            for other in ts.deps:
                if ts.state != TS.RUNNING:
                    break
                if other is not dts and holder.id in other.who_has:
                    other.avoid = (other.avoid or frozenset()) | {holder.id}
                    # not counted as a failed fetch: nobody tried it (a review: a slow holder
                    # would otherwise fail the task with TransferError naming an input never asked)
                    self._drop_copy(ts, other, holder, e.error, out, count=False)
        if ts is not None and ts.state == TS.RUNNING and ts.worker == e.worker:
            self._unassign(ts)
            self._reschedule(ts, out)

    def _drop_copy(self, ts: TaskRecord, dts: TaskRecord, holder: WorkerRecord, error: str,
                   out: list[ev.Command], count: bool = True) -> None:  # fmt: skip
        """``holder``'s copy of ``dts`` (an input of running ``ts``) could not be fetched: forget it
        (recompute the value if it was the last copy; fail ``ts`` with ``TransferError`` once the
        value was lost this way ``max_fetch_failures`` times in a row, counted if ``count``)."""
        dts.drop_holder(holder.id)
        holder.has_what.discard(dts)
        holder.nbytes -= dts.nbytes
        out.append(ev.Free(holder.id, [dts.key]))
        if dts.state == TS.MEMORY and not dts.who_has:
            dts.fetch_failures += 1 if count else 0
            if dts.fetch_failures >= self.max_fetch_failures and ts.state == TS.RUNNING:
                self._unassign(ts)
                self._fail(ts, "TransferError", explain.transfer_failed(ts, dts, holder.name, error), out)
            if dts.state == TS.MEMORY:  # failing the dependent may have released it already
                self._lose_value(dts, out)

    def _heartbeat(self, e: ev.Heartbeat, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is not None:
            ws.last_seen = e.now
            ws.metrics = e.metrics
            if ws.suspect:  # it answers again: trusted again
                ws.suspect = False
                self._room_changed(ws)
                self.counters["trusted_again"] += 1

    def _tick(self, e: ev.Tick, out: list[ev.Command]) -> None:
        if self.unclaimed or self.unclaimed_runs:
            rejoin.expire_unclaimed(self, e.now, out)
        for ws in list(self.workers.values()):
            if e.stalled > 0:  # silence while we ourselves could not listen does not count
                ws.last_seen = min(e.now, ws.last_seen + e.stalled)
            if e.now - ws.last_seen > self.heartbeat_timeout:
                reason = explain.silent(e.now - ws.last_seen, self.heartbeat_timeout)
                out.append(ev.CloseWorker(ws.id, reason))
                self._worker_remove(ev.WorkerRemove(ws.id, e.now, reason, cause=ev.RemoveCause.SILENT), out)
        if self.setup_failed and self.no_worker and not self.workers and self.infeasible is None:
            # every worker left on a failed setup and nothing launches others: any worker started
            # would run the same setup, so the waiting tasks fail now with its error (an autoscaler
            # disables the node type instead, and its tasks fail the same way)
            for tasks in list(self.no_worker.values()):
                for ts in sorted(tasks, key=lambda t: t.priority):
                    if ts.state == TS.NO_WORKER:
                        self._fail(ts, "WorkerSetupError", explain.setup_failed(ts, self.setup_failed), out)
        if self.no_worker_timeout is not None and self.no_worker:
            waiting: Mapping[ev.Shape, set[TaskRecord]] = self.no_worker
            why: dict[ev.Shape, str] = {}
            if self.infeasible is not None:  # an autoscaler: only shapes it never launches for wait
                by_hand = getattr(self.infeasible, "by_hand_only", None)
                for shape in self.no_worker:
                    text = by_hand(shape) if by_hand is not None else None
                    if text:
                        why[shape] = text
                waiting = {s: t for s, t in self.no_worker.items() if s in why}
            for ts, message in explain.late_no_worker(waiting, self.workers, e.now, self.no_worker_timeout):
                if ts.state == "no-worker":  # not failed with an earlier one meanwhile
                    extra = why.get(ts.shape)
                    self._fail(ts, "InfeasibleTaskError", f"{message} ({extra})" if extra else message, out)

    def _tasks_started(self, e: ev.TasksStarted, out: list[ev.Command]) -> None:
        tasks = self.tasks
        for key in e.keys:
            ts = tasks.get(key)
            if ts is not None and ts.state == "running" and ts.worker == e.worker:
                ts.executing = True
            elif ts is None and self.unclaimed_runs:
                ws = self.workers.get(e.worker)
                if ws is not None:
                    rejoin.run_started(self, ws, key)

    def _value_unservable(self, e: ev.ValueUnservable, out: list[ev.Command]) -> None:
        ts = self.tasks.get(e.key)
        if ts is None or ts.state != "memory" or e.worker not in ts.who_has:
            return
        self._drop_value(ts, out)
        self._fail(ts, e.exc_type, e.message, out)

    def _check_feasible(self, e: ev.CheckFeasible, out: list[ev.Command]) -> None:
        self.infeasible = e.rule
        for shape in list(self.no_worker):
            for ts in sorted(self.no_worker.get(shape, ()), key=lambda t: t.priority):
                if ts.state != "no-worker":
                    continue
                why = self._why_infeasible(ts)
                if why is None:
                    break  # the shape is feasible: the rest of its tasks are too
                self._fail(ts, why[0], why[1], out)

    # ---- failing tasks ---------------------------------------------------------------------------
    def _why_infeasible(self, ts: TaskRecord) -> tuple[str, str] | None:
        return explain.infeasible(ts, self.infeasible(ts.shape) if self.infeasible is not None else None)

    def _fail(self, ts: TaskRecord, exc_type: str, message: str, out: list[ev.Command]) -> None:
        """A task not on any worker fails with a scheduler-made error; dependents fail with it."""
        ts.error = TaskError(exc_type, message, ts.key)
        self._move(ts, TS.ERRED)
        out.append(ev.TaskFailed(ts.key, exc_type, message))
        self._erred_cascade(ts, out)

    # ---- retirement (decided in retire.py, applied here) ---------------------------------------
    def _apply_retire(self, intents: list[retire.Intent], out: list[ev.Command]) -> None:
        for it in intents:
            t = type(it)
            if t is retire.Begin:  # ws takes no new tasks; its unique data will be copied to survivors
                ws = self.workers[it.worker]
                self._move_worker(ws, WS.RETIRING)
                self.room.discard(ws.id)
                self.retiring[ws.id] = {}
                self.retire_reason[ws.id] = it.reason  # type: ignore[union-attr]
            elif t is retire.Asked:
                self.retiring[it.worker].update(it.asks)  # type: ignore[union-attr]
            elif t is retire.GiveUp:  # copies kept failing: back to work, the caller hears why
                self.retiring.pop(it.worker, None)
                self.retire_reason.pop(it.worker, None)
                ws = self.workers[it.worker]
                self._move_worker(ws, WS.RUNNING)
                self._room_changed(ws)
                out.append(ev.RetireRefused(it.worker, it.reason))  # type: ignore[union-attr]
            elif t is retire.Forget:
                self.retiring.pop(it.worker, None)
                self.retire_reason.pop(it.worker, None)
            elif t is retire.Finish:  # nothing unique left, nothing running: close, remove gracefully
                reason = f"retired ({self.retire_reason.pop(it.worker, 'retired')})"
                self.retiring.pop(it.worker, None)
                out.append(ev.CloseWorker(it.worker, reason))
                self._worker_remove(ev.WorkerRemove(it.worker, self.now, reason, True, ev.RemoveCause.RETIRED), out)
            else:  # Replicate, RetireRefused: commands for the shell
                out.append(it)  # type: ignore[arg-type]

    # ---- work stealing and seceded tasks -------------------------------------------------------
    def _load_changed(self, ws: WorkerRecord) -> None:
        """Keep ``overloaded`` (workers with tasks queued beyond their slots) exact."""
        if ws.assigned > ws.slots:
            self.overloaded.add(ws.id)
        else:
            self.overloaded.discard(ws.id)

    def _steal(self, out: list[ev.Command]) -> None:
        """Idle slots, nothing ready for them: ask busy workers to give back queued tasks."""
        if not self.overloaded:  # nobody has a queue to give: no pass over every idle worker
            return
        asks = pl.plan_steals(self.workers, self.overloaded, self.room, self.ready.by_shape, self.estimates.estimate)
        for wid, tasks in asks.items():
            for ts in tasks:
                ts.stealing = True
            out.append(ev.Steal(wid, [ts.key for ts in tasks]))

    def _steal_reply(self, e: ev.StealReply, out: list[ev.Command]) -> None:
        for key in e.kept:  # kept: it had started (or finished) there; do not ask again
            ts = self.tasks.get(key)
            if ts is not None and ts.worker == e.worker:
                ts.stealing = False
                ts.executing = True
        for key in e.stolen:
            ts = self.tasks.get(key)
            if ts is None or ts.state != "running" or ts.worker != e.worker:
                continue  # released or moved meanwhile: the worker dropped it, nothing to do
            self._unassign(ts)
            self._reschedule(ts, out)  # ready again (or waiting, if an input was lost meanwhile)

    # ---- Dask-shaped requests: fire and forget, broadcast, restart ----------------------------
    def _fire_and_forget(self, e: ev.FireAndForget, out: list[ev.Command]) -> None:
        for key in e.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state in ("memory", "erred"):
                continue  # done already: nothing left to keep alive
            ts.add_wanter(FIRE_AND_FORGET)
            if ts.state == "released":
                self._compute(ts, out)

    def _broadcast(self, e: ev.Broadcast, out: list[ev.Command]) -> None:
        for wid, keys in pl.copies_everywhere(e.keys, self.tasks, self.workers, e.copies).items():
            out.append(ev.Replicate(wid, keys))

    def _restart(self, e: ev.Restart, out: list[ev.Command]) -> None:
        error = {"type": "TaskCancelledError", "message": e.reason}
        for ts in self.tasks.values():
            for c in ts.wanted_by:
                if c != FIRE_AND_FORGET:
                    out.append(ev.Report(c, ts.key, RK.ERRED, error={**error, "origin": ts.key}))
        self.tasks.clear()
        self.tally.clear()
        self.ready.clear()
        self.no_worker.clear()
        for keys in self.clients.values():
            keys.clear()
        self.overloaded.clear()
        for ws in self.workers.values():
            ws.forget_tasks(e.now)
            self._room_changed(ws)

    def _task_seceded(self, e: ev.TaskSeceded, out: list[ev.Command]) -> None:
        ts = self.tasks.get(e.key)
        ws = self.workers.get(e.worker)
        if ts is None or ws is None or ts.state != "running" or ts.worker != e.worker or ts.seceded:
            return
        ts.seceded = True
        ts.executing = True
        ws.seceded += 1
        if ws.special:  # it left its slot and, on the worker, its resources: a gpu it waits on may go
            pl.take_special(ws, ts.shape, -1)
        self._load_changed(ws)
        est = ws.processing.get(ts, 0.0)
        ws.occupancy = max(0.0, ws.occupancy - est)
        self._room_changed(ws)

    def _abandoned_runs_ended(self, e: ev.AbandonedRunsEnded, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is None or not ws.abandoned:
            return
        for key in e.keys:
            ws.abandoned_run.pop(key, None)
            pl.release_abandoned_special(ws, key)
            est = ws.abandoned.pop(key, None)
            if est is not None:
                ws.occupancy = max(0.0, ws.occupancy - est) if ws.processing or ws.abandoned else 0.0
        self._load_changed(ws)
        self._room_changed(ws)

    def _retire_workers(self, e: ev.RetireWorkers, out: list[ev.Command]) -> None:
        self._apply_retire(retire.start_retire(self, e), out)
        self._apply_retire(retire.progress_retirements(self), out)

    # ---- queries (read-only) -------------------------------------------------------------------
    def who_has(self, key: str) -> list[str]:
        ts = self.tasks.get(key)
        return [self.workers[w].address for w in ts.who_has if w in self.workers] if ts else []

    def unique_data(self, ws: WorkerRecord) -> list[TaskRecord]:
        """Values only ``ws`` holds that somebody still needs."""
        return retire.unique_data(ws)

    def idle_and_empty(self) -> list[str]:
        """Workers that run nothing and hold no value anybody needs: safe to remove now."""
        return [
            w.id for w in self.workers.values()
            if not w.processing and w.state in ("running", "starting") and not self.unique_data(w)
        ]  # fmt: skip

    def worker_info(self) -> list[dict[str, Any]]:
        """One row per worker, for the dashboard and ``client.scheduler_info``."""
        return audit.worker_rows(self)

    def task_counts(self) -> dict[str, int]:
        return {str(k): v for k, v in self.counts.items() if v}

    def validate(self) -> None:
        """Check cross-references (for tests); raises AssertionError on an inconsistency."""
        audit.validate(self)


def _whole(value: object) -> int:
    """``value`` as a plain int if it is an integer (numpy's too), else -1."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return -1
