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

Ready tasks wait in one priority heap per resource shape, ordered by user priority, then submission
order, except that a task submitted while an input of the same user priority *from an earlier
submission* is still being computed takes that input's place in line (depth first across
submissions: ``check(f)`` for each ``f`` of an earlier ``map`` runs soon after ``f``, not after every
other task of that ``map``, which keeps data-heavy work in memory; within one graph the submission
order is kept, which forecasts and scaling assume); a worker takes tasks while it has a free
slot or less than ``queue_seconds`` of estimated work queued per slot (so no-op tasks are batched
deeply and long tasks are not hoarded by one worker).

Placement keeps scarce resources free: a worker with a resource beyond cpu/memory (a GPU) takes a
task that does not need it only into a free slot, never into its queue, and not at all while ready
tasks that need that resource could run on it.  Work stealing: when a worker has a free slot and
nothing ready fits it, tasks still *queued* (not executing) on busier workers are asked back
(``Steal``) and placed again, so an idle worker never waits while another has a queue.  A task that
secedes (``worker_client``) stays on its worker but stops counting as load.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from tidepool.comm.serialize import Serialized
from tidepool.scheduler import events as ev
from tidepool.scheduler.estimates import DurationEstimates
from tidepool.scheduler.kinds import ReportKind as RK
from tidepool.scheduler.kinds import TaskState as TS
from tidepool.scheduler.kinds import WorkerState as WS
from tidepool.scheduler.placement import choose_worker, fits
from tidepool.scheduler.records import TaskRecord, WorkerRecord
from tidepool.scheduler.resource_names import typo_reason

#: Every legal task-state change, with the reason it happens.  Anything else raises.
TASK_TRANSITIONS: dict[tuple[TS, TS], str] = {
    (TS.RELEASED, TS.WAITING): "needed, and some inputs are not in memory yet",
    (TS.RELEASED, TS.READY): "needed, and every input is in memory",
    (TS.RELEASED, TS.ERRED): "needed, but an input already failed",
    (TS.WAITING, TS.READY): "the last missing input arrived",
    (TS.WAITING, TS.ERRED): "an input failed",
    (TS.WAITING, TS.RELEASED): "nobody needs it any more (cancelled)",
    (TS.WAITING, TS.MEMORY): "a result from an earlier attempt arrived; keep it",
    (TS.READY, TS.RUNNING): "placed on a worker",
    (TS.READY, TS.NO_WORKER): "no running worker has the resources it asks for",
    (TS.READY, TS.WAITING): "an input was lost with its worker",
    (TS.READY, TS.RELEASED): "cancelled before it was placed",
    (TS.READY, TS.ERRED): "it can never run (infeasible)",
    (TS.READY, TS.MEMORY): "a result from an earlier attempt arrived; keep it",
    (TS.NO_WORKER, TS.READY): "a worker with the resources joined",
    (TS.NO_WORKER, TS.WAITING): "an input was lost with its worker",
    (TS.NO_WORKER, TS.RELEASED): "cancelled while no worker could run it",
    (TS.NO_WORKER, TS.ERRED): "it can never run (infeasible)",
    (TS.NO_WORKER, TS.MEMORY): "a result from an earlier attempt arrived; keep it",
    (TS.RUNNING, TS.MEMORY): "finished; the value stays on the worker",
    (TS.RUNNING, TS.READY): "its worker left, or it failed and has retries left",
    (TS.RUNNING, TS.WAITING): "rescheduled, and an input must be recomputed first",
    (TS.RUNNING, TS.ERRED): "raised with no retries left, or killed too many workers",
    (TS.RUNNING, TS.RELEASED): "cancelled while running",
    (TS.MEMORY, TS.RELEASED): "nobody needs the value (freed), or it was lost with its worker",
    (TS.MEMORY, TS.ERRED): "its holder cannot send the value (unpicklable, or over the frame limit)",
    (TS.ERRED, TS.RELEASED): "nobody holds the error any more",
}

#: Every legal worker-state change.
WORKER_TRANSITIONS: dict[tuple[WS, WS], str] = {
    (WS.STARTING, WS.RUNNING): "setup hooks finished; takes tasks from now on",
    (WS.STARTING, WS.GONE): "left or failed during setup",
    (WS.RUNNING, WS.RETIRING): "graceful retirement started: its data moves to survivors",
    (WS.RETIRING, WS.RUNNING): "retirement refused or cancelled",
    (WS.RETIRING, WS.GONE): "retired, or lost while retiring",
    (WS.RUNNING, WS.GONE): "disconnected, killed or missed heartbeats",
    (WS.STARTING, WS.RETIRING): "retired before it finished setup",
}

ACTIVE = frozenset({TS.WAITING, TS.READY, TS.NO_WORKER, TS.RUNNING})
#: the pseudo-client that holds fire-and-forget tasks until they finish
FIRE_AND_FORGET = "<fire-and-forget>"
#: bytes per second assumed for copying a stolen task's inputs (Dask's scheduler assumes the same
#: 100 MB/s until it measures): a steal must save more time than the copy costs
STEAL_BANDWIDTH = 100e6
#: one step of user priority outweighs any difference in submission order
#: a task's priority: ``-user_priority * PRIORITY_STEP + line * LINE + seq`` (lower runs first), where
#: ``seq`` is its submission number (unique: runs replay exactly) and ``line`` its place in line: its
#: own ``seq``, or the line of an input of the same user priority from an earlier submission that
#: is still being computed (depth first across submissions)
PRIORITY_STEP = 1 << 80
LINE = 1 << 40
PENDING = frozenset({TS.READY, TS.NO_WORKER})  # runnable now, but on no worker yet: demand
DEFAULT_SHAPE: ev.Shape = (("cpu", 1.0),)


#: what the ``infeasible`` hook returns: None (feasible), a reason, or (error type, message)
Infeasible = str | tuple[str, str] | None


class InvalidTransition(RuntimeError):
    """A bug: the state machine tried a move that is not in its transition table."""


def normalize_resources(resources: dict[str, Any] | None) -> ev.Shape:
    """Resource demand as a canonical, hashable shape; ``cpu`` defaults to 1."""
    from tidepool.resources import parse_resources

    res = parse_resources(resources or {})
    res.setdefault("cpu", 1.0)
    return tuple(sorted((k, v) for k, v in res.items() if v > 0 or k == "cpu"))


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
        self.allowed_failures = allowed_failures
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
        self.infeasible: Callable[[ev.Shape], Infeasible] | None = None
        self.tasks: dict[str, TaskRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.clients: dict[str, set[str]] = {}
        self.functions: dict[str, Serialized] = {}
        #: with a state directory: records whose state changed or that were forgotten since the
        #: persister last looked (``scheduler/recovery.py``); None: nobody persists
        self.dirty: set[TaskRecord] | None = None
        self._ready: dict[ev.Shape, list[tuple[int, int, TaskRecord]]] = {}
        #: ready tasks restricted to named workers (``workers=``), in priority order
        self._restricted: list[tuple[int, int, TaskRecord]] = []
        self.no_worker: dict[ev.Shape, set[TaskRecord]] = {}
        #: tasks per state
        self.counts: dict[str, int] = {TS.RELEASED: 0}
        #: task records by group and state, kept up to date by ``_move`` (what the dashboard shows)
        self.group_counts: dict[str, dict[str, int]] = {}
        #: every resource name a worker or a known node type ever offered (typos fail at submit)
        self.offered_resources: set[str] = set()
        #: (shape, group) -> number of tasks in ready/no-worker: the demand scaling looks at
        self.pending: dict[tuple[ev.Shape, str], int] = {}
        self._room: set[str] = set()
        #: workers with tasks queued beyond their slots (steal candidates), kept by _load_changed
        self._overloaded: set[str] = set()
        self._fit_any: dict[ev.Shape, bool] = {}
        self.retiring: dict[str, set[str]] = {}
        self.retire_reason: dict[str, str] = {}
        self._priority = 0
        self._ready_seq = 0
        self._worker_seq = 0
        self.now = 0.0
        self.last_progress = 0.0
        self.counters: dict[str, int] = {
            "finished": 0, "erred": 0, "retried": 0, "recomputed": 0, "workers_lost": 0,
            "workers_joined": 0, "forgotten": 0, "rescued": 0, "refused_outcomes": 0, "refused_reports": 0,
            "suspect_holders": 0, "trusted_again": 0,
        }  # fmt: skip
        self._handlers: dict[type, Callable[[Any, list[ev.Command]], None]] = {
            ev.UpdateGraph: self._update_graph,
            ev.ReleaseKeys: self._release_keys,
            ev.ClientGone: self._client_gone,
            ev.WorkerJoin: self._worker_join,
            ev.WorkerReady: self._worker_ready,
            ev.WorkerRemove: self._worker_remove,
            ev.TaskFinished: self._task_finished,
            ev.TaskErred: self._task_erred,
            ev.MissingData: self._missing_data,
            ev.Heartbeat: self._heartbeat,
            ev.Tick: self._tick,
            ev.TasksStarted: self._tasks_started,
            ev.ValueUnservable: self._value_unservable,
            ev.CheckFeasible: self._check_feasible,
            ev.StealReply: self._steal_reply,
            ev.FireAndForget: self._fire_and_forget,
            ev.Broadcast: self._broadcast,
            ev.Restart: self._restart,
            ev.TaskSeceded: self._task_seceded,
            ev.AddReplica: self._add_replica,
            ev.RetireWorkers: self._retire_workers,
            ev.WorkerRejoin: self._recovery_event,
            ev.RestoreErrors: self._recovery_event,
            ev.RecoveryReport: self._recovery_event,
        }

    # ------------------------------------------------------------------------------------------
    def handle(self, event: ev.Event) -> list[ev.Command]:
        """Apply one event; return the commands the shell must carry out, in order."""
        out: list[ev.Command] = []
        self.now = max(self.now, event.now)
        self._handlers[type(event)](event, out)
        return self._after(out)

    def _after(self, out: list[ev.Command]) -> list[ev.Command]:
        if self.retiring:
            from tidepool.scheduler.retire import progress_retirements

            progress_retirements(self, out)
        if self._room and (self._ready or self._restricted):
            self._schedule(out)
        if self._room and len(self.workers) > 1:
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
        if old in PENDING:
            k = (ts.shape, ts.group)
            n = self.pending[k] - 1
            if n:
                self.pending[k] = n
            else:
                del self.pending[k]
        if new in PENDING:
            k = (ts.shape, ts.group)
            self.pending[k] = self.pending.get(k, 0) + 1
        counts = self.counts
        counts[old] -= 1
        counts[new] = counts.get(new, 0) + 1
        g = self.group_counts[ts.group]  # per task group, for the dashboard (O(1), never a scan)
        g[old] -= 1
        g[new] = g.get(new, 0) + 1
        ts.state = new
        if self.dirty is not None:
            self.dirty.add(ts)

    def _move_worker(self, ws: WorkerRecord, new: WS) -> None:
        if (ws.state, new) not in WORKER_TRANSITIONS:
            raise InvalidTransition(f"worker {ws.id}: {ws.state} -> {new}")
        ws.state = new

    # ---- clients -------------------------------------------------------------------------------
    def _update_graph(self, e: ev.UpdateGraph, out: list[ev.Command]) -> None:
        self.functions.update(e.functions)
        new: list[TaskRecord] = []
        collided: dict[str, str] = {}
        for spec in e.tasks:
            old = self.tasks.get(spec.key)
            if old is not None:
                why = _differs(old, spec)
                if why:
                    collided[spec.key] = why
                continue
            seq = self._priority
            level = -spec.priority * PRIORITY_STEP
            ts = TaskRecord(spec.key, spec.func_id, spec.payload, normalize_resources(spec.resources),
                            spec.retries, level + seq * LINE + seq, spec.group or spec.key)  # fmt: skip
            if spec.workers:
                ts.restrict, ts.loose = frozenset(spec.workers), spec.loose
            self._priority += 1
            self.tasks[spec.key] = ts
            self.counts["released"] += 1
            g = self.group_counts.setdefault(ts.group, {TS.RELEASED: 0})
            g[TS.RELEASED] = g.get(TS.RELEASED, 0) + 1
            new.append(ts)
            for dk in spec.deps:
                dep = self.tasks.get(dk)
                if dep is ts:
                    ts.message = f"task {dk!r} depends on itself (a cycle); a graph must be acyclic"
                    ts.exc_type = "CycleError"
                    continue
                if dep is None:
                    ts.message = f"input {dk!r} is unknown to the scheduler (was it released?)"
                    ts.exc_type = "DependencyError"
                    continue
                ts.deps.append(dep)
                dep.dependents.add(ts)
                if dep.state in ACTIVE and dep.priority < ts.priority and (
                        dep.priority // PRIORITY_STEP == ts.priority // PRIORITY_STEP):  # fmt: skip
                    # depth first: it takes its unfinished input's place in line (its own seq stays)
                    ts.priority = dep.priority - dep.priority % LINE + seq
        keys = self.clients.setdefault(e.client, set())
        for k in e.wanted:
            wts = self.tasks.get(k)
            if k in collided:
                out.append(ev.Report(e.client, k, RK.ERRED, error={
                    "type": "KeyCollisionError", "origin": k, "message": (
                        f"key {k!r} is already used by another task that is still alive ({collided[k]}); "
                        "give this task another key, or release every future of the first one before "
                        "reusing its key"),
                }))  # fmt: skip
                continue
            if wts is None:
                out.append(ev.Report(e.client, k, RK.LOST))
                continue
            keys.add(k)
            wts.wanted_by.add(e.client)
            if wts.state == "released":
                self._compute(wts, out)
            elif wts.state in (TS.MEMORY, TS.ERRED):
                out.append(ev.Report(e.client, k, RK.MEMORY if wts.state == TS.MEMORY else RK.ERRED))
        for ts in new:  # tasks submitted but not needed by anything: drop
            if ts.state == "released":
                self._check(ts, out)

    def _release_keys(self, e: ev.ReleaseKeys, out: list[ev.Command]) -> None:
        if e.cancel:
            self._cancel_keys(e, out)
            return
        keys = self.clients.get(e.client, set())
        for k in e.keys:
            keys.discard(k)
            ts = self.tasks.get(k)
            if ts is not None and e.client in ts.wanted_by:
                ts.wanted_by.discard(e.client)
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
        roots: list[TaskRecord] = []
        for k in e.keys:
            ts = self.tasks.get(k)
            if ts is None or client not in ts.wanted_by:
                out.append(ev.Report(client, k, RK.CANCELLED))  # nothing of ours to stop
                wanted.discard(k)
                continue
            if e.unless_started:
                if ts.state in ("memory", "erred"):
                    continue
                if ts.state == "running" and ts.executing:
                    out.append(ev.Report(client, k, RK.RUNNING))
                    continue
            roots.append(ts)
        seen = set(roots)
        stack = list(roots)
        while stack:  # downstream: every unfinished task computed from a cancelled one
            ts = stack.pop()
            for dt in ts.dependents:
                if dt not in seen and dt.state in ACTIVE:
                    seen.add(dt)
                    stack.append(dt)
        cancelled = sorted(seen, key=lambda t: t.priority)
        for ts in cancelled:
            if client in ts.wanted_by:
                ts.wanted_by.discard(client)
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
            if ts.exc_type in ("DependencyError", "CycleError") and ts.message and not ts.exception:
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                continue
            typo = typo_reason((name for name, _ in ts.shape), self.offered_resources) if ts.shape else None
            if typo is not None:
                self._fail(ts, "InfeasibleTaskError", f"task {ts.key!r} can never run: {typo}", out)
                continue
            waiting: set[TaskRecord] = set()
            failed: TaskRecord | None = None
            for dep in ts.deps:
                dep.waiters.add(ts)
                if dep.state == "memory":
                    continue
                if dep.state == "erred":
                    failed = dep
                    continue
                waiting.add(dep)
                if dep.state == "released":
                    stack.append(dep)
            if failed is not None:
                self._copy_error(ts, failed)
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                continue
            ts.waiting_on = waiting
            if waiting:
                self._move(ts, TS.WAITING)
            else:
                self._make_ready(ts, out)

    def _make_ready(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        self._move(ts, TS.READY)
        shape = ts.shape
        ok = self._fit_any.get(shape)
        if ok is None:
            ok = self._fit_any[shape] = any(
                fits(w.resources, shape) for w in self.workers.values() if w.state == "running"
            )
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
        self._push_ready(ts)

    def _push_ready(self, ts: TaskRecord) -> None:
        shape = ts.shape
        self._ready_seq += 1
        ts.ready_seq = self._ready_seq
        heap = self._ready.get(shape)
        if heap is None:
            heap = self._ready[shape] = []
        heapq.heappush(heap, (ts.priority, self._ready_seq, ts))

    def _matches(self, ws: WorkerRecord, ts: TaskRecord) -> bool:
        r = ts.restrict
        return r is None or ws.id in r or ws.name in r or ws.address in r

    def _may_wait_for(self, ws: WorkerRecord, ts: TaskRecord) -> bool:
        """Is ``ws`` one of ``ts``'s named workers that it should wait for?  A loosely restricted
        task does not wait for a suspect (silent) worker: any worker will do."""
        return ws.state == "running" and self._matches(ws, ts) and not (ts.loose and ws.suspect)

    def _restricted_ready(self, ts: TaskRecord) -> bool:
        """Queue a ready task restricted to named workers; False: it went to the shape heap
        instead (a loose restriction none of whose workers is here)."""
        if any(self._may_wait_for(w, ts) and self._fits(w, ts.shape) for w in self.workers.values()):
            self._ready_seq += 1
            ts.ready_seq = self._ready_seq
            heapq.heappush(self._restricted, (ts.priority, self._ready_seq, ts))
            return True
        if ts.loose:
            return False
        self._move(ts, TS.NO_WORKER)  # waits for one of its workers (no_worker_timeout applies)
        ts.no_worker_since = self.now
        self.no_worker.setdefault(ts.shape, set()).add(ts)
        return True

    def _schedule_restricted(self, out: list[ev.Command]) -> None:
        heap = self._restricted
        keep: list[tuple[int, int, TaskRecord]] = []
        while heap and self._room:
            item = heapq.heappop(heap)
            _, seq, ts = item
            if ts.state != "ready" or ts.ready_seq != seq:
                continue
            cands = [self.workers[w] for w in self._room if self._matches(self.workers[w], ts)
                     and self._fits(self.workers[w], ts.shape) and self._allowed(self.workers[w], ts.shape)]  # fmt: skip
            if cands:
                self._assign(ts, choose_worker(ts, cands), out)
            elif not any(self._may_wait_for(w, ts) for w in self.workers.values()):
                if ts.loose:  # its workers left (or went silent): any worker will do
                    self._push_ready(ts)
                else:  # wait for one of them to come back
                    self._move(ts, TS.NO_WORKER)
                    ts.no_worker_since = self.now
                    self.no_worker.setdefault(ts.shape, set()).add(ts)
            else:
                keep.append(item)  # its workers are busy: wait for them
        for item in keep:
            heapq.heappush(heap, item)

    def _reschedule(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        """Running (or ready) task goes back to waiting/ready; missing inputs are recomputed."""
        waiting = {d for d in ts.deps if d.state != "memory"}
        ts.waiting_on = waiting
        if not waiting:
            if ts.state != "ready":
                self._make_ready(ts, out)
            return
        self._move(ts, TS.WAITING)
        for dep in waiting:
            dep.waiters.add(ts)
            if dep.state == "released":
                self._compute(dep, out)
            elif dep.state == "erred":
                self._copy_error(ts, dep)
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
                return

    def _schedule(self, out: list[ev.Command]) -> None:
        if self._restricted:
            self._schedule_restricted(out)
        deferred: list[TaskRecord] = []
        try:
            self._schedule_heaps(out, deferred)
        finally:
            for ts in deferred:  # back in line, in their old places: they wait for their holders
                heapq.heappush(self._ready.setdefault(ts.shape, []), (ts.priority, ts.ready_seq, ts))

    def _schedule_heaps(self, out: list[ev.Command], deferred: list[TaskRecord]) -> None:
        ready = self._ready
        workers = self.workers
        while self._room:
            best: ev.Shape | None = None
            head: tuple[int, int, TaskRecord] | None = None
            cands: list[WorkerRecord] = []
            for shape in list(ready):
                heap = ready[shape]
                while heap and (heap[0][2].state != "ready" or heap[0][2].ready_seq != heap[0][1]):
                    heapq.heappop(heap)
                if not heap:
                    del ready[shape]
                    continue
                if head is not None and heap[0][0] >= head[0]:
                    continue
                ok = self._fit_any.get(shape)
                if ok is None:  # cache dropped when workers changed: recompute, never assume
                    ok = self._fit_any[shape] = any(
                        fits(w.resources, shape) for w in workers.values() if w.state == "running"
                    )
                if not ok:
                    self._park_no_worker(shape)
                    continue
                c = [workers[w] for w in self._room if self._fits(workers[w], shape) and self._allowed(workers[w], shape)]
                if c:
                    best, head, cands = shape, heap[0], c
            if best is None:
                return
            _, _, ts = heapq.heappop(ready[best])
            target = choose_worker(ts, cands)
            if ts.deps and self._transfer_outweighs(target, ts) and self._holder_busy(ts):
                deferred.append(ts)  # its inputs' holder is only full for now: wait for it
                continue
            self._assign(ts, target, out)

    def _allowed(self, ws: WorkerRecord, shape: ev.Shape) -> bool:
        """May ``ws`` take a task of ``shape`` now, given its scarce resources?"""
        if not ws.special:
            return True
        extra = ws.special.difference(name for name, _ in shape)
        if not extra:
            return True
        if len(ws.processing) - ws.seceded >= ws.slots:
            return False  # never queue ordinary work behind a GPU
        for s, heap in self._ready.items():  # ready work that needs what ws has spare comes first
            if heap and any(name in extra for name, _ in s) and self._fits(ws, s):
                return False
        return True

    def _fits(self, ws: WorkerRecord, shape: ev.Shape) -> bool:
        ok = ws.fit_cache.get(shape)
        if ok is None:
            ok = ws.fit_cache[shape] = fits(ws.resources, shape)
        return ok

    def _park_no_worker(self, shape: ev.Shape) -> None:
        heap = self._ready.pop(shape, [])
        for _, seq, ts in heap:
            if ts.state == "ready" and ts.ready_seq == seq:
                self._move(ts, TS.NO_WORKER)
                ts.no_worker_since = self.now
                self.no_worker.setdefault(shape, set()).add(ts)

    def _has_room(self, ws: WorkerRecord) -> bool:
        n = len(ws.processing) - ws.seceded
        if ws.state != "running" or ws.suspect or n >= ws.slots * self.max_queue_per_slot:
            return False
        return n < ws.slots or ws.occupancy < self.queue_seconds * ws.slots

    def _assign(self, ts: TaskRecord, ws: WorkerRecord, out: list[ev.Command]) -> None:
        self._move(ts, TS.RUNNING)
        est = self.estimates.estimate(ts.group)
        ts.worker = ws.id
        ts.executing = False
        ts.est = est
        ts.started = self.now
        ws.processing[ts] = est
        self._load_changed(ws)
        ws.occupancy += est
        ws.idle_since = None
        if not self._has_room(ws):
            self._room.discard(ws.id)
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
        if seceded:
            est = 0.0
        ws.last_done = self.now
        if ws.processing:
            ws.occupancy -= est
        else:
            ws.occupancy = 0.0
            ws.idle_since = self.now
        if self._has_room(ws):
            self._room.add(ws.id)

    # ---- results -------------------------------------------------------------------------------
    def _task_finished(self, e: ev.TaskFinished, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is None:
            return  # a departed worker's word is not trusted; the value is gone with it
        ts = self.tasks.get(e.key)
        if ts is None or ts.state in ("released", "erred"):
            if ts is not None and ts in ws.processing:
                self._unassign(ts)
            out.append(ev.Free(e.worker, [e.key]))
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
            ts.duration = duration
        ts.nbytes = nbytes
        ts.suspicious = 0
        self._move(ts, TS.MEMORY)
        ts.waiting_on.clear()
        self._add_holder(ts, ws, nbytes)
        for c in ts.wanted_by:
            out.append(ev.Report(c, ts.key, RK.MEMORY))
        ts.wanted_by.discard(FIRE_AND_FORGET)  # it ran: nobody needs to keep it
        for dt in ts.waiters:
            if ts in dt.waiting_on:
                dt.waiting_on.discard(ts)
                if not dt.waiting_on and dt.state == "waiting":
                    self._make_ready(dt, out)
        for dep in ts.deps:
            dep.waiters.discard(ts)
            if not dep.waiters and not dep.wanted_by:
                self._check(dep, out)
        if not ts.needed:
            self._check(ts, out)

    def _add_holder(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int) -> None:
        if ws.id not in ts.who_has:
            ts.who_has.add(ws.id)
            ws.has_what.add(ts)
            ws.nbytes += nbytes or ts.nbytes

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

    def _task_erred(self, e: ev.TaskErred, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        ts = self.tasks.get(e.key)
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
        ts.exception, ts.traceback, ts.exc_type = e.exception, e.traceback, e.exc_type
        ts.message, ts.error_origin = e.message, ts.key
        self._move(ts, TS.ERRED)
        self._erred_cascade(ts, out)

    def _copy_error(self, ts: TaskRecord, src: TaskRecord) -> None:
        ts.exception, ts.traceback, ts.exc_type = src.exception, src.traceback, src.exc_type
        ts.message, ts.error_origin = src.message, src.error_origin or src.key

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
                    w = ts.worker
                    self._unassign(ts)
                    if w is not None:
                        out.append(ev.Free(w, [ts.key]))
                self._copy_error(ts, root)
                self._move(ts, TS.ERRED)
            for c in ts.wanted_by:
                out.append(ev.Report(c, ts.key, RK.ERRED))
            ts.wanted_by.discard(FIRE_AND_FORGET)
            for dep in ts.deps:
                dep.waiters.discard(ts)
            stack.extend(ts.waiters)
            ts.waiters.clear()
            ts.waiting_on.clear()
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
                    w = ts.worker
                    self._unassign(ts)
                    if w is not None:
                        out.append(ev.Free(w, [ts.key]))
                self._move(ts, TS.RELEASED)
                ts.waiting_on.clear()
                for dep in ts.deps:
                    dep.waiters.discard(ts)
                    stack.append(dep)
            if ts.state in ("released", "erred") and not ts.dependents:
                del self.tasks[ts.key]
                self.counts[ts.state] -= 1
                gc = self.group_counts[ts.group]
                gc[ts.state] -= 1
                if not any(gc.values()):  # the group's last record is gone: forget the group too
                    del self.group_counts[ts.group]
                self.counters["forgotten"] += 1
                if self.dirty is not None:
                    self.dirty.add(ts)
                for dep in ts.deps:
                    dep.dependents.discard(ts)
                    dep.waiters.discard(ts)
                    stack.append(dep)

    def _drop_value(self, ts: TaskRecord, out: list[ev.Command]) -> None:
        for w in ts.who_has:
            ws = self.workers.get(w)
            if ws is not None:
                ws.has_what.discard(ts)
                ws.nbytes -= ts.nbytes
                out.append(ev.Free(w, [ts.key]))
        ts.who_has.clear()

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

    def _worker_running(self, ws: WorkerRecord, out: list[ev.Command]) -> None:
        self._fit_any = {s: ok for s, ok in self._fit_any.items() if ok}
        self._room.add(ws.id)
        for shape in [s for s in self.no_worker if fits(ws.resources, s)]:
            for ts in sorted(self.no_worker.pop(shape), key=lambda t: t.priority):
                self._make_ready(ts, out)

    def _worker_remove(self, e: ev.WorkerRemove, out: list[ev.Command]) -> None:
        ws = self.workers.pop(e.worker, None)
        if ws is None:
            return
        self._move_worker(ws, WS.GONE)
        self._room.discard(ws.id)
        self._fit_any = {s: ok for s, ok in self._fit_any.items() if not ok}
        if not e.graceful:
            self.counters["workers_lost"] += 1
        lost: list[TaskRecord] = []
        for ts in ws.has_what:
            ts.who_has.discard(ws.id)
            if ts.state == "memory" and not ts.who_has:
                lost.append(ts)
        ws.has_what.clear()
        running = sorted(ws.processing, key=lambda t: t.priority)
        ws.processing.clear()
        self._overloaded.discard(ws.id)
        for ts in sorted(lost, key=lambda t: t.priority):
            self._lose_value(ts, out)
        for ts in running:
            if ts.state != "running" or ts.worker != ws.id:
                continue
            executing = ts.executing
            ts.worker = None
            ts.executing = ts.stealing = ts.seceded = False
            if not e.graceful and executing:  # queued tasks were innocent bystanders
                ts.suspicious += 1
            if ts.suspicious > self.allowed_failures:
                ts.exception = None
                ts.exc_type = "KilledWorkerError"
                ts.message = (
                    f"task {ts.key!r} was executing on {ts.suspicious} workers that died "
                    f"(last: {ws.name}, {e.reason}); it is not retried again. Check it for crashes "
                    "or memory blow-ups, or raise allowed_failures"
                )
                ts.traceback, ts.error_origin = "", ts.key
                self._move(ts, TS.ERRED)
                self._erred_cascade(ts, out)
            else:
                self._reschedule(ts, out)
        # ready tasks of shapes nobody can run any more wait as no-worker demand
        for shape in list(self._ready):
            if not any(fits(w.resources, shape) for w in self.workers.values() if w.state == "running"):
                self._fit_any[shape] = False
                self._park_no_worker(shape)

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
                dt.waiting_on.add(ts)
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
            self._room.discard(holder.id)
            self.counters["suspect_holders"] += 1
        if holder is not None and e.holder in dts.who_has:
            dts.who_has.discard(e.holder)
            holder.has_what.discard(dts)
            holder.nbytes -= dts.nbytes
            out.append(ev.Free(e.holder, [dts.key]))
            if dts.state == TS.MEMORY and not dts.who_has:
                dts.fetch_failures += 1
                if dts.fetch_failures >= self.max_fetch_failures and ts is not None and ts.state == TS.RUNNING:
                    self._unassign(ts)
                    self._fail(ts, "TransferError", (
                        f"task {ts.key!r} could not get its input {e.dep!r}: its only copy could not be "
                        f"fetched {dts.fetch_failures} times in a row (last from {holder.name}: "
                        f"{e.error or 'unknown error'}); check that workers can reach each other's data ports"
                    ), out)  # fmt: skip
                if dts.state == TS.MEMORY:  # failing the dependent may have released it already
                    self._lose_value(dts, out)
        if ts is not None and ts.state == TS.RUNNING and ts.worker == e.worker:
            self._unassign(ts)
            self._reschedule(ts, out)

    def _heartbeat(self, e: ev.Heartbeat, out: list[ev.Command]) -> None:
        ws = self.workers.get(e.worker)
        if ws is not None:
            ws.last_seen = e.now
            ws.metrics = e.metrics
            if ws.suspect:  # it answers again: trusted again
                ws.suspect = False
                if self._has_room(ws):
                    self._room.add(ws.id)
                self.counters["trusted_again"] += 1

    def _tick(self, e: ev.Tick, out: list[ev.Command]) -> None:
        for ws in list(self.workers.values()):
            if e.stalled > 0:  # silence while we ourselves could not listen does not count
                ws.last_seen = min(e.now, ws.last_seen + e.stalled)
            if e.now - ws.last_seen > self.heartbeat_timeout:
                reason = (f"no heartbeat for {e.now - ws.last_seen:.1f}s (time-to-live "
                          f"{self.heartbeat_timeout:g}s; raise heartbeat_timeout if tasks block workers longer)")  # fmt: skip
                out.append(ev.CloseWorker(ws.id, reason))
                self._worker_remove(ev.WorkerRemove(ws.id, e.now, reason, cause=ev.RemoveCause.SILENT), out)
        timeout = self.no_worker_timeout
        if timeout is not None and self.infeasible is None and self.no_worker:
            for shape in list(self.no_worker):
                tasks = self.no_worker.get(shape, set())
                late = sorted((t for t in tasks if e.now - t.no_worker_since > timeout), key=lambda t: t.priority)
                for ts in late:
                    if ts.state != "no-worker":
                        continue
                    if ts.restrict is not None:
                        names = sorted(w.name for w in self.workers.values())
                        self._fail(ts, "InfeasibleTaskError", (
                            f"task {ts.key!r} may run only on workers {sorted(ts.restrict)} (workers=...), and "
                            f"none of them that fits {dict(shape)} has been here for {timeout:g}s (connected: "
                            f"{', '.join(names) or 'none'}); start that worker, name others in workers=, pass "
                            "allow_other_workers=True, or raise no_worker_timeout"), out)  # fmt: skip
                        continue
                    have = sorted({f"{k}={v:g}" for w in self.workers.values() for k, v in w.resources.items()})
                    self._fail(ts, "InfeasibleTaskError", (
                        f"task {ts.key!r} needs {dict(shape)} and no worker has offered that for "
                        f"{timeout:g}s ({len(self.workers)} workers; resources seen: {', '.join(have) or 'none'}); "
                        "no autoscaler can launch one. Start a worker with these resources "
                        "(tidepool worker --resources ...), use adapt() with a node type that has them, "
                        "or raise no_worker_timeout"
                    ), out)  # fmt: skip

    def _tasks_started(self, e: ev.TasksStarted, out: list[ev.Command]) -> None:
        tasks = self.tasks
        for key in e.keys:
            ts = tasks.get(key)
            if ts is not None and ts.state == "running" and ts.worker == e.worker:
                ts.executing = True

    def _value_unservable(self, e: ev.ValueUnservable, out: list[ev.Command]) -> None:
        ts = self.tasks.get(e.key)
        if ts is None or ts.state != "memory" or e.worker not in ts.who_has:
            return
        self._drop_value(ts, out)
        ts.exception, ts.traceback, ts.exc_type = None, "", e.exc_type
        ts.message, ts.error_origin = e.message, ts.key
        self._move(ts, TS.ERRED)
        self._erred_cascade(ts, out)

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
        r = self.infeasible(ts.shape) if self.infeasible is not None else None
        if not r:
            return None
        if isinstance(r, tuple):
            return r[0], f"task {ts.key!r} can never run: {r[1]}"
        return "InfeasibleTaskError", f"task {ts.key!r} can never run: {r}"

    def _fail(self, ts: TaskRecord, exc_type: str, message: str, out: list[ev.Command]) -> None:
        """A task not on any worker fails with a scheduler-made error; dependents fail with it."""
        ts.exception, ts.traceback, ts.exc_type = None, "", exc_type
        ts.message, ts.error_origin = message, ts.key
        self._move(ts, TS.ERRED)
        self._erred_cascade(ts, out)

    # ---- retirement (decided in retire.py) ------------------------------------------------------
    def begin_retirement(self, ws: WorkerRecord, reason: str) -> None:
        """``ws`` takes no new tasks; its unique data will be copied to survivors."""
        self._move_worker(ws, WS.RETIRING)
        self._room.discard(ws.id)
        self.retiring[ws.id] = set()
        self.retire_reason[ws.id] = reason

    def finish_retirement(self, wid: str, out: list[ev.Command]) -> None:
        """Nothing unique left and nothing running: close the worker and remove it gracefully."""
        reason = self.retire_reason.pop(wid, "retired")
        self.retiring.pop(wid, None)
        out.append(ev.CloseWorker(wid, f"retired ({reason})"))
        self._worker_remove(ev.WorkerRemove(wid, self.now, f"retired ({reason})", graceful=True,
                                            cause=ev.RemoveCause.RETIRED), out)  # fmt: skip

    # ---- work stealing and seceded tasks -------------------------------------------------------
    def _load_changed(self, ws: WorkerRecord) -> None:
        """Keep ``_overloaded`` (workers with tasks queued beyond their slots) exact."""
        if len(ws.processing) - ws.seceded > ws.slots:
            self._overloaded.add(ws.id)
        else:
            self._overloaded.discard(ws.id)

    def _steal(self, out: list[ev.Command]) -> None:
        """Idle slots, nothing ready for them: ask busy workers to give back queued tasks."""
        if not self._overloaded:  # nobody has a queue to give: no pass over every idle worker
            return
        workers = self.workers
        victims = [workers[w] for w in self._overloaded
                   if w in workers and workers[w].state in ("running", "retiring")]  # fmt: skip
        if not victims:
            return
        idle = [workers[w] for w in sorted(self._room) if len(workers[w].processing) - workers[w].seceded < workers[w].slots]
        if not idle:
            return
        victims.sort(key=lambda w: (-(len(w.processing) - w.seceded - w.slots), w.seq))
        asks: dict[str, list[str]] = {}
        for thief in idle:
            want = thief.slots - (len(thief.processing) - thief.seceded)
            for victim in victims:
                if victim is thief or want <= 0:
                    continue
                queued = len(victim.processing) - victim.seceded - victim.slots
                take = min(want, (queued + 1) // 2)
                for ts in reversed(list(victim.processing)):  # the most recently queued first
                    if take <= 0:
                        break
                    if ts.executing or ts.stealing or ts.seceded or not self._fits(thief, ts.shape):
                        continue
                    if ts.restrict is not None and not self._matches(thief, ts):
                        continue
                    if not self._allowed(thief, ts.shape):
                        continue
                    if self._transfer_outweighs(thief, ts):
                        continue
                    ts.stealing = True
                    asks.setdefault(victim.id, []).append(ts.key)
                    take -= 1
                    want -= 1
        for wid, keys in asks.items():
            out.append(ev.Steal(wid, keys))

    def _transfer_outweighs(self, thief: WorkerRecord, ts: TaskRecord) -> bool:
        """Moving ``ts`` would copy more input than it is worth: its inputs missing on ``thief``
        take longer to send (at ``STEAL_BANDWIDTH``) than twice the task's estimated run time.
        (A quick task on big inputs stays where its data is; copying it only fills memory.)"""
        missing = sum(d.nbytes for d in ts.deps if thief.id not in d.who_has)
        return missing > 0 and missing / STEAL_BANDWIDTH > 2 * self.estimates.estimate(ts.group)

    def _holder_busy(self, ts: TaskRecord) -> bool:
        """A running worker holds an input of ``ts`` and could run it, but has no room now."""
        for d in ts.deps:
            for wid in d.who_has:
                w = self.workers.get(wid)
                if w is not None and w.state == "running" and wid not in self._room and fits(w.resources, ts.shape):
                    return True
        return False

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
            ts.wanted_by.add(FIRE_AND_FORGET)
            if ts.state == "released":
                self._compute(ts, out)

    def _broadcast(self, e: ev.Broadcast, out: list[ev.Command]) -> None:
        asks: dict[str, list[str]] = {}
        for key in e.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            for ws in self.workers.values():
                if ws.state == "running" and ws.id not in ts.who_has:
                    asks.setdefault(ws.id, []).append(key)
        for wid, keys in asks.items():
            out.append(ev.Replicate(wid, keys))

    def _restart(self, e: ev.Restart, out: list[ev.Command]) -> None:
        error = {"type": "TaskCancelledError", "message": e.reason}
        for ts in self.tasks.values():
            for c in ts.wanted_by:
                if c != FIRE_AND_FORGET:
                    out.append(ev.Report(c, ts.key, RK.ERRED, error={**error, "origin": ts.key}))
        self.tasks.clear()
        self.counts = {TS.RELEASED: 0}
        self.group_counts.clear()
        self.pending.clear()
        self._ready.clear()
        self._restricted.clear()
        self.no_worker.clear()
        for keys in self.clients.values():
            keys.clear()
        self._overloaded.clear()
        for ws in self.workers.values():
            ws.processing.clear()
            ws.has_what.clear()
            ws.nbytes, ws.occupancy, ws.seceded = 0, 0.0, 0
            ws.idle_since = e.now
            if self._has_room(ws):
                self._room.add(ws.id)

    def _task_seceded(self, e: ev.TaskSeceded, out: list[ev.Command]) -> None:
        ts = self.tasks.get(e.key)
        ws = self.workers.get(e.worker)
        if ts is None or ws is None or ts.state != "running" or ts.worker != e.worker or ts.seceded:
            return
        ts.seceded = True
        ts.executing = True
        ws.seceded += 1
        self._load_changed(ws)
        est = ws.processing.get(ts, 0.0)
        ws.occupancy = max(0.0, ws.occupancy - est)
        if self._has_room(ws):
            self._room.add(ws.id)

    def _recovery_event(self, e: Any, out: list[ev.Command]) -> None:
        from tidepool.scheduler.recovery import handle_recovery_event

        handle_recovery_event(self, e, out)

    def _retire_workers(self, e: ev.RetireWorkers, out: list[ev.Command]) -> None:
        from tidepool.scheduler.retire import start_retire

        start_retire(self, e, out)

    # ---- queries (read-only) -------------------------------------------------------------------
    def who_has(self, key: str) -> list[str]:
        ts = self.tasks.get(key)
        return [self.workers[w].address for w in ts.who_has if w in self.workers] if ts else []

    def unique_data(self, ws: WorkerRecord) -> list[TaskRecord]:
        """Values only ``ws`` holds that somebody still needs."""
        return [ts for ts in ws.has_what if ts.needed and len(ts.who_has) == 1]

    def idle_and_empty(self) -> list[str]:
        """Workers that run nothing and hold no value anybody needs: safe to remove now."""
        return [
            w.id for w in self.workers.values()
            if not w.processing and w.state in ("running", "starting") and not self.unique_data(w)
        ]  # fmt: skip

    def worker_info(self) -> list[dict[str, Any]]:
        return [
            {
                "id": w.id, "name": w.name, "address": w.address, "state": w.state,
                "node_type": w.node_type, "resources": dict(w.resources),
                "running": len(w.processing), "held_keys": len(w.has_what), "held_bytes": w.nbytes,
                "unique_keys": len(self.unique_data(w)), "idle_since": w.idle_since,
                "joined": w.joined, "executed": w.executed, "memory_limit": w.memory_limit,
                "rss": w.metrics.get("rss", 0), "peak_rss": w.metrics.get("peak_rss", 0),
                "spilled_bytes": w.metrics.get("spilled", 0), "spilled_total": w.metrics.get("spilled_total", 0),
                "paused": bool(w.metrics.get("paused")),
                "spill_disabled": str(w.metrics.get("spill_disabled") or ""),
            }
            for w in self.workers.values()
        ]  # fmt: skip

    def task_counts(self) -> dict[str, int]:
        return {str(k): v for k, v in self.counts.items() if v}

    def validate(self) -> None:
        """Check cross-references (for tests); raises AssertionError on an inconsistency."""
        for wid, wrec in self.workers.items():
            assert (wid in self._overloaded) == (len(wrec.processing) - wrec.seceded > wrec.slots), ("overloaded", wid)
        assert self._overloaded <= set(self.workers), ("overloaded", self._overloaded - set(self.workers))
        for wid in self._room:  # new work goes only to running workers that answer
            assert wid in self.workers and self.workers[wid].state == "running", ("room", wid)
            assert not self.workers[wid].suspect, ("room for a suspect worker", wid)
        for key, ts in self.tasks.items():
            assert ts.key == key
            for w in ts.who_has:
                assert w in self.workers, (key, w)
                assert ts in self.workers[w].has_what, (key, w)
            if ts.state == "memory":
                assert ts.who_has, f"{key} in memory but nobody holds it"
            if ts.state == "running":
                assert ts.worker in self.workers and ts in self.workers[ts.worker].processing, key
            if ts.state == "waiting":
                assert ts.waiting_on, f"{key} waiting on nothing"
                for d in ts.waiting_on:
                    assert d.state != "memory", (key, d.key)
            if ts.state in ("ready", "no-worker", "running"):
                assert all(d.state == "memory" for d in ts.deps) or ts.state == "running", key
            if ts.state in ACTIVE:
                for d in ts.deps:
                    assert ts in d.waiters, (key, d.key)
            for d in ts.deps:
                assert d.key in self.tasks, (key, d.key)
        pending: dict[tuple[ev.Shape, str], int] = {}
        for ts in self.tasks.values():
            if ts.state in PENDING:
                pending[(ts.shape, ts.group)] = pending.get((ts.shape, ts.group), 0) + 1
        assert pending == self.pending, (pending, self.pending)
        counts: dict[str, int] = {}
        for ts in self.tasks.values():
            counts[ts.state] = counts.get(ts.state, 0) + 1
        assert counts == self.task_counts(), (counts, self.counts)
        groups: dict[str, dict[str, int]] = {}
        for ts in self.tasks.values():
            gc = groups.setdefault(ts.group, {})
            gc[ts.state] = gc.get(ts.state, 0) + 1
        kept = {g: {k: n for k, n in c.items() if n} for g, c in self.group_counts.items()}
        assert groups == {g: c for g, c in kept.items() if c}, (groups, self.group_counts)
        for w, ws in self.workers.items():
            for ts in ws.has_what:
                assert w in ts.who_has
            for ts in ws.processing:
                assert ts.worker == w and ts.state == "running", (w, ts)


def _differs(old: TaskRecord, spec: ev.TaskSpec) -> str:
    """Why ``spec`` is not the task already known under its key ("" when it is the same task)."""
    if old.func_id != spec.func_id:
        return "a different function"
    if old.payload != spec.payload:
        return "different arguments"
    if [d.key for d in old.deps] != list(spec.deps):
        return "different inputs"
    return ""
