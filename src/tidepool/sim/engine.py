"""The discrete-event loop: the real scheduler state, controller and policy on a fake clock.

Time is a heap of timed events ``(t, seq, kind, a, b)``; ``seq`` breaks ties in the order events
were made, so a run replays exactly.  At each instant the loop takes every event due, lets the
simulated workers, provider and client act, then hands everything the scheduler received at that
instant to :meth:`SchedulerState.handle_many` in one batch (as the server does per message), and
turns the commands into messages that arrive ``latency`` seconds later.  The autoscaler shell
(:mod:`tidepool.sim.shell`) steps after the batch, every ``interval`` seconds and on wake-ups.

Simulated workers run the real worker's decisions: each is a :class:`~tidepool.sim.process.WorkerProcess`
around the same :class:`~tidepool.worker.state.WorkerState` the asyncio worker drives (queue,
slots, fetching inputs at ``latency + nbytes / bandwidth``, memory limits with spilling, pausing
and restarts, steal replies); only time is simulated: durations from the workload, shared cores
when a worker runs more than it has (``cores``), setup hooks that take ``setup`` seconds before a
worker takes tasks.  ``CloseWorker`` ends the process.  A worker whose process ends otherwise
(terminated, walltime) is reported with ``WorkerRemove`` (connection closed).
Heartbeats arrive every ``heartbeat`` seconds; ``Tick`` every ``tick`` seconds.

The client submits each stage of the workload (``UpdateGraph``), waits for the reports of the keys
it holds, keeps the results ``hold`` seconds, gathers them (their bytes over one link), and
releases them; the run then goes on until the policy has retired every worker or ``tail``
seconds passed, and the shell closes (terminating what is left), as a real cluster would.

Measured as it goes (:class:`SimStats`): events handed to the state and the wall time spent in
``handle_many`` (the state machine's own events per second), controller steps and their wall time,
and the memory per task of the state (resident-memory growth when the graph arrives, per task).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidepool.scaling.controller import ScalingController
from tidepool.scheduler import events as ev
from tidepool.scheduler.kinds import ReportKind
from tidepool.scheduler.state import SchedulerState
from tidepool.sim.cluster import SimCluster
from tidepool.sim.process import WorkerProcess
from tidepool.sim.provider import SimProvider
from tidepool.sim.shell import SimAutoScaler, StepCost
from tidepool.sim.workload import SimTask, Workload
from tidepool.telemetry.journal import Journal
from tidepool.telemetry.report import count_retirements
from tidepool.worker import state as ws

CLIENT = "sim-client"

# event kinds
_TO_SCHED, _TO_WORKER, _DONE, _FETCHED, _UP, _END, _STEP, _TICK, _BEAT, _SUBMIT, _TO_CLIENT, _HELD, \
    _GATHERED, _READY, _RESTART, _SAMPLE, _PREEMPT = range(17)  # fmt: skip
#: seconds between two samples of a worker's memory monitor (worker/memory.py's interval)
MONITOR = 0.05
# worker message items
_X, _F, _S, _R, _C = range(5)

_Execute, _Free, _Report, _Replicate, _Steal, _Close, _Refused = (
    ev.Execute, ev.Free, ev.Report, ev.Replicate, ev.Steal, ev.CloseWorker, ev.RetireRefused)  # fmt: skip


@dataclass
class SimStats:
    wall: float = 0.0  # seconds the whole run took
    events: int = 0  # events handed to the scheduler state
    commands: int = 0
    batches: int = 0  # handle_many calls
    state_seconds: float = 0.0  # wall seconds inside handle_many
    loop_events: int = 0  # timed events the loop processed (messages, task ends, timers)
    steps: int = 0
    forecasts: int = 0
    step_seconds: float = 0.0  # wall seconds inside controller steps
    max_step_seconds: float = 0.0
    peak_tasks: int = 0
    bytes_per_task: float | None = None  # resident-memory growth per task when the graph arrived
    peak_rss: int = 0
    # what the simulated workers' memory rules did (worker/state.py)
    spilled_bytes: int = 0  # bytes moved to disk
    pauses: int = 0  # times a worker paused over its pause level
    memory_restarts: int = 0  # workers that passed their terminate level and restarted

    @property
    def state_events_per_second(self) -> float:
        return self.events / self.state_seconds if self.state_seconds > 0 else 0.0


@dataclass
class SimResult:
    policy: str
    workload: str
    seed: int
    completed: bool
    makespan: float | None  # first submit -> results gathered
    # one definition everywhere, as ``tidepool report`` reads the journal (telemetry/report.py):
    # held = a worker registered (join to close or leave); busy = a worker running at least one
    # task (counted once however many of its slots run); task-seconds = the sum of task durations
    held_worker_seconds: float  # held worker time within the makespan (first submit to results)
    held_worker_seconds_total: float  # ... over the whole run (the tail after the results too)
    busy_worker_seconds: float  # busy worker time over the whole run (<= held)
    cost: dict[str, float]  # node type -> cost (billed node-hours x NodeType.cost)
    node_seconds: dict[str, float]  # node type -> billed node-seconds
    launches: int
    launched_nodes: int
    retirements: int
    launch_failures: int
    workers: int  # workers that ever registered
    peak_workers: int
    tasks: int
    executions: int
    recomputed: int
    end: float  # simulated seconds when the run (tail included) ended
    stats: SimStats = field(default_factory=SimStats)
    notes: list[str] = field(default_factory=list)
    journal: str | None = None
    task_seconds: float = 0.0  # sum of the durations of the task executions
    retire_refused: int = 0  # retirements asked for and refused (``retirements`` counts done ones)
    lost_seconds: float = 0.0  # task execution time thrown away: tasks running on a worker that was killed
    preempted: int = 0  # workers killed by a preemption (spot) before they left
    failed_keys: int = 0  # wanted keys whose tasks failed (the run ended, but not with every result)
    policy_errors: int = 0  # rounds whose policy raised (the default policy decided them)

    @property
    def total_cost(self) -> float:
        return sum(self.cost.values())

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "makespan": self.makespan, "held_w_s": self.held_worker_seconds,
            "held_w_s_total": self.held_worker_seconds_total, "busy_w_s": self.busy_worker_seconds,
            "task_s": self.task_seconds, "retire_refused": self.retire_refused,
            "cost": self.total_cost, "cost_by_type": dict(self.cost), "launches": self.launches,
            "launched_nodes": self.launched_nodes, "retirements": self.retirements,
            "launch_failures": self.launch_failures, "workers": self.workers, "peak_workers": self.peak_workers,
            "recomputed": self.recomputed, "completed": self.completed,
            # wanted results whose tasks failed: the run ended, but without them (a bug hunt read
            # "completed": true for a run whose results had failed)
            "failed_keys": self.failed_keys,
        }  # fmt: skip


def _add_interval(ivs: list[tuple[float, float]], a: float, b: float) -> None:
    """Add [a, b] to the sorted disjoint intervals ``ivs``, merging; finishes come in time order,
    so it usually touches only the last ones."""
    i = len(ivs)
    while i and ivs[i - 1][1] >= a:
        i -= 1
    j = i
    while j < len(ivs) and ivs[j][0] <= b:
        a, b = min(a, ivs[j][0]), max(b, ivs[j][1])
        j += 1
    ivs[i:j] = [(a, b)]


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - a platform without psutil support: no memory numbers
        return 0


class Simulation:
    """One run of ``workload`` on ``cluster`` under ``policy``; :meth:`run` returns a :class:`SimResult`.

    ``journal``: a path (JSON lines, what ``tidepool report`` reads) or a :class:`Journal`;
    ``task_records``: write a ``task`` record per finished task (off for huge runs);
    ``tail``: seconds the run may go on after the results, while the policy retires workers;
    ``until``: simulated seconds after which the run stops whatever happens; ``stall``: stop when
    nothing happened for that long with work left (a graph that cannot finish);
    ``step_cost``: simulated time a controller step takes (:class:`~tidepool.sim.shell.StepCost`);
    ``forecast_budget``: hand the controller the graph only while forecasts take at most this
    fraction of the time (None: whenever it asks, as the real shell; default from the cluster);
    ``progress``: called with a one-line status every ``progress_every`` wall seconds.
    """

    def __init__(self, workload: Workload, cluster: SimCluster, policy: Any, *, seed: int = 0,
                 policy_name: str = "policy", journal: str | Journal | None = None, task_records: bool = True,
                 tail: float = 900.0, until: float = 30 * 86400.0, stall: float = 7200.0,
                 step_cost: StepCost | None = None, forecast_budget: float | None = None,
                 state_kwargs: dict[str, Any] | None = None,
                 controller_kwargs: dict[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None, progress_every: float = 10.0) -> None:  # fmt: skip
        self.workload = workload
        self.cluster = cluster
        self.seed = seed
        self.policy_name = policy_name
        self.tail = tail
        self.until = until
        self.stall = stall
        self.step_cost = step_cost if step_cost is not None else StepCost()
        self.progress = progress
        self.progress_every = progress_every
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = itertools.count()
        self.state = SchedulerState(**(state_kwargs or {}))
        self.workers: dict[str, WorkerProcess] = {}
        self.inbox: list[ev.Event] = []
        self.out: list[ev.Event] = []
        self.tasks: dict[str, SimTask] = {t.key: t for t in workload.tasks()}
        self.latency = cluster.latency
        self.bandwidth = cluster.bandwidth
        self.node_types = {nt.name: nt for nt in cluster.node_types}
        if isinstance(journal, Journal):
            self.journal = journal
        else:
            self.journal = Journal(journal, tasks=task_records, keep=None)  # the run's figures read them all
        self.journal_path = journal if isinstance(journal, str) else None
        self.provider = SimProvider(cluster.models, seed, self._clock, up=self._provider_up, kill=self._provider_kill)
        if cluster.config is not None:  # the cluster file's [autoscaler] limits, under any given here
            controller_kwargs = dict(controller_kwargs or {})
            for key, value in cluster.config.autoscaler.items():
                # cost ceilings are the site's, for every policy compared; scale-to-zero is tidepool's
                # own behaviour, not the baselines' (HyperQueue's idle timeout is its own)
                if key != "scale_to_zero_after" or not policy_name.startswith(("dask", "hyperqueue")):
                    controller_kwargs.setdefault(key, value)
        self.controller = ScalingController(cluster.node_types, policy, **(controller_kwargs or {}))
        fb = forecast_budget if forecast_budget is not None else cluster.forecast_budget
        self.shell = SimAutoScaler(self.controller, self.provider, self.state, self.journal, apply=self.apply,
                                   wake=self._wake, step_cost=self.step_cost, forecast_budget=fb)  # fmt: skip
        self.stats = SimStats()
        # autoscaler timing
        self._step_id = 0
        self._step_at = float("inf")
        self._busy_until = 0.0
        self._step_due = False
        self._stepping = False
        self._woken = False
        # client
        self._wanted_left: set[str] = set()
        self._stages_left = len(workload.stages)
        self._wanted_all: list[str] = []
        self._first_submit: float | None = None
        self._results_at: float | None = None
        self._gathered_at: float | None = None
        self._released = False
        self._erred = 0
        self._first_failure = ""  # why the first wanted key failed, for the note
        # accounting
        self._joined: dict[str, float] = {}
        self._spans: list[tuple[float, float]] = []
        self._live = 0
        self._peak = 0
        self._busy: dict[str, list[tuple[float, float]]] = {}  # worker -> disjoint busy intervals, in order
        self._task_seconds = 0.0
        self._executions = 0
        self._lost = 0.0
        self._preempted = 0
        self._last_event = 0.0
        self._stopped = ""

    # ---- plumbing --------------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    def _wake(self) -> None:
        """The shell is asked to step: as soon as it is free (wakes during a step coalesce)."""
        if self._stepping:
            self._woken = True
            return
        at = max(self.now, self._busy_until)
        if at < self._step_at:
            self._schedule_step(at)

    def _schedule_step(self, at: float) -> None:
        self._step_id += 1
        self._step_at = at
        self._push(at, _STEP, self._step_id)

    def apply(self, events: list[ev.Event]) -> list[ev.Command]:
        """Hand ``events`` to the scheduler state now; dispatch its commands."""
        state = self.state
        t0 = time.perf_counter()
        cmds = state.handle_many(events)
        self.stats.state_seconds += time.perf_counter() - t0
        self.stats.events += len(events)
        self.stats.commands += len(cmds)
        self.stats.batches += 1
        self._account(events)
        closed = [c.worker for c in cmds if type(c) is ev.CloseWorker]  # type: ignore[attr-defined]
        if closed:  # held ends when the worker is told to close, as the report reads the journal
            at = max((e.now for e in events), default=self.now)
            for w in closed:
                self._held_end(w, at)
        self.journal.observe(events, cmds)
        self.shell.observe(events, cmds)
        if cmds:
            self._dispatch(cmds)
        return cmds

    def _account(self, events: list[ev.Event]) -> None:
        # times as the journal stamps them (the event's own), so `tidepool report` agrees
        for e in events:
            t = type(e)
            if t is ev.TaskFinished:
                d = e.duration  # type: ignore[union-attr]
                self._task_seconds += d
                self._executions += 1
                _add_interval(self._busy.setdefault(e.worker, []), e.now - d, e.now)  # type: ignore[union-attr]
            elif t is ev.WorkerJoin:
                self._last_event = self.now
                self._joined[e.worker] = e.now  # type: ignore[union-attr]
                self._live += 1
                self._peak = max(self._peak, self._live)
            elif t is ev.WorkerRemove:
                self._held_end(e.worker, e.now)  # type: ignore[union-attr]

    def _held_end(self, worker: str, t: float) -> None:
        t0 = self._joined.pop(worker, None)
        if t0 is not None:
            self._spans.append((t0, t))
            self._live -= 1

    def _dispatch(self, cmds: list[ev.Command]) -> None:
        tasks = self.state.tasks
        per: dict[str, list[tuple[Any, ...]]] = {}
        reports: list[ev.Report] = []
        for c in cmds:
            t = type(c)
            if t is _Execute:
                ts = tasks.get(c.key)  # type: ignore[union-attr]
                if ts is None:
                    continue
                deps = tuple((d.key, tuple(sorted(d.who_has)), d.nbytes) for d in ts.deps) if ts.deps else ()
                item: tuple[Any, ...] = (_X, c.key, ts.shape, deps)  # type: ignore[union-attr]
            elif t is _Free:
                item = (_F, c.keys)  # type: ignore[union-attr]
            elif t is _Report:
                reports.append(c)  # type: ignore[arg-type]
                continue
            elif t is _Steal:
                item = (_S, c.keys)  # type: ignore[union-attr]
            elif t is _Replicate:
                wanted = []
                for k in c.keys:  # type: ignore[union-attr]
                    rts = tasks.get(k)
                    if rts is not None:
                        wanted.append((k, tuple(sorted(rts.who_has)), rts.nbytes))
                item = (_R, wanted)
            elif t is _Close:
                item = (_C, c.reason)  # type: ignore[union-attr]
            else:
                continue  # RetireRefused: the shell's observer took it
            lst = per.get(c.worker)  # type: ignore[union-attr]
            if lst is None:
                per[c.worker] = [item]  # type: ignore[union-attr]
            else:
                lst.append(item)
        at = self.now + self.latency
        for wid, items in per.items():
            self._push(at, _TO_WORKER, wid, items)
        if reports:
            self._push(at, _TO_CLIENT, reports)

    # ---- the provider's hooks ----------------------------------------------------------------------
    def _provider_up(self, t: float, wid: str) -> None:
        self._push(t, _UP, wid)

    def _provider_kill(self, wid: str, reason: str) -> None:
        w = self.workers.get(wid)
        if w is not None and w.alive:
            self._worker_gone(w, reason)

    def _worker_gone(self, w: WorkerProcess, reason: str) -> None:
        """``w``'s process ended without the scheduler closing it: the connection closes."""
        self._lost += w.lost_work(self.now)  # what its running tasks had done is lost
        w.alive = False
        del self.workers[w.id]
        self.out.append(ev.WorkerRemove(w.id, self.now, reason, graceful=False, cause=ev.RemoveCause.CLOSED))

    # ---- workers -------------------------------------------------------------------------------------
    def _worker_message(self, wid: str, items: list[tuple[Any, ...]]) -> None:
        w = self.workers.get(wid)
        if w is None:
            return  # gone: the scheduler's message goes nowhere
        for item in items:
            code = item[0]
            if code == _X:
                w.compute(item[1], item[2], item[3])
            elif code == _F:
                w.handle(ws.FreeKeys(tuple(item[1])))
            elif code == _S:
                w.handle(ws.StealKeys(tuple(item[1])))
            elif code == _R:
                for key, holders, nbytes in item[1]:
                    w.replicate(key, holders, nbytes)
            elif code == _C:
                w.alive = False
                del self.workers[wid]
                self.provider.exited(wid, f"closed by the scheduler: {item[1]}")
                # its connection closes as the process exits (as in a real run: the state has
                # removed it already, the journal and the held-time accounting see it leave now)
                self.out.append(ev.WorkerRemove(wid, self.now, item[1], graceful=True, cause=ev.RemoveCause.CLOSED))
                return

    # the worker processes' hooks (sim/process.py)
    def fetch_later(self, wid: str, key: str, holders: tuple[str, ...], nbytes: int) -> None:
        self._push(self.now + self.latency + nbytes / self.bandwidth, _FETCHED, wid, (key, holders))

    def sample_later(self, wid: str) -> None:
        self._push(self.now + MONITOR, _SAMPLE, wid)

    def done_later(self, t: float, wid: str, key: str, token: int) -> None:
        self._push(t, _DONE, wid, (key, token))

    def memory_exit(self, w: WorkerProcess, rss: int) -> None:
        """``w`` ended over its memory limit; it comes back, empty, ``restart`` seconds later."""
        w.alive = False
        del self.workers[w.id]
        self.stats.memory_restarts += 1
        why = (f"worker {w.id} used {rss} bytes of memory, over {round(w.state.thresholds.terminate * 100)}% "
               f"of its {w.state.limit}-byte limit; it restarts")  # fmt: skip
        self.out.append(ev.WorkerRemove(w.id, self.now, why, graceful=False, cause=ev.RemoveCause.MEMORY))
        self._push(self.now + self.cluster.restart, _RESTART, w.id)

    def _fetched(self, wid: str, key: str, holders: tuple[str, ...]) -> None:
        w = self.workers.get(wid)
        if w is None:
            return
        ok = False
        for h in holders:
            hw = self.workers.get(h)
            if hw is not None and key in hw.state:
                ok = True
                break
        w.fetched(key, ok, holders[0] if holders else "")

    def _done(self, wid: str, key: str, token: int) -> None:
        w = self.workers.get(wid)
        if w is not None:
            w.done(key, token)

    def _up(self, wid: str) -> None:
        provider = self.provider
        if not provider.is_live(wid):
            return  # terminated while it was starting
        self._join(wid, provider.worker_node[wid].node_type)
        provider.registered_worker(wid)
        end = provider.walltime_end(wid)
        if end is not None:
            self._push(max(end, self.now), _END, wid)
        taken = provider.preempted_at(wid)
        if taken is not None and (end is None or taken < end):
            self._push(max(taken, self.now), _PREEMPT, wid)

    def _preempt(self, wid: str) -> None:
        w = self.workers.get(wid)
        self.provider.exited(wid, "simulated: preempted (spot capacity taken back)")
        if w is not None and w.alive:
            self._preempted += 1
            self._worker_gone(w, "preempted: the provider took the node back")

    def _join(self, wid: str, node_type: str) -> None:
        """A worker process registers; with setup hooks, it takes tasks ``setup`` seconds later."""
        res = dict(self.node_types[node_type].worker_resources)
        self.workers[wid] = WorkerProcess(wid, node_type, res, self, self.cluster.cores.get(node_type),
                                          self.cluster.disk, int(self.cluster.unmanaged), self.cluster.overhead)  # fmt: skip
        setup = self.cluster.setup
        self.out.append(ev.WorkerJoin(wid, f"sim://{wid}", dict(res), self.now, node_type=node_type, name=wid,
                                      memory_limit=self.workers[wid].state.limit, ready=setup <= 0))  # fmt: skip
        if setup > 0:
            self._push(self.now + setup, _READY, wid)

    def _restarted(self, wid: str, node_type: str) -> None:
        if self.provider.is_live(wid) and wid not in self.workers:
            self._join(wid, node_type)

    def _walltime(self, wid: str) -> None:
        w = self.workers.get(wid)
        self.provider.exited(wid, "simulated: the allocation reached its walltime (TIMEOUT)", failure=True)
        if w is not None and w.alive:
            self._worker_gone(w, "the allocation reached its walltime")

    # ---- the client ----------------------------------------------------------------------------------
    def _submit(self, i: int) -> None:
        stage = self.workload.stages[i]
        if self._first_submit is None:
            self._first_submit = self.now
        self._stages_left -= 1
        self._wanted_left.update(stage.wanted)
        self._wanted_all.extend(stage.wanted)
        specs = [t.spec() for t in stage.tasks]
        before = len(self.state.tasks)
        rss0 = _rss() if len(specs) >= 10_000 and self.stats.bytes_per_task is None else 0
        big = len(specs) >= 10_000 and gc.isenabled()
        if big:  # millions of new objects: generation-2 collections would rescan them all, again and again
            gc.disable()
        try:
            self.apply([ev.UpdateGraph(CLIENT, specs, list(stage.wanted), self.now)])
        finally:
            if big:
                gc.freeze()  # the graph's records leave the collector's view; later objects are scanned
                gc.enable()
        if rss0:
            added = len(self.state.tasks) - before
            if added > 0:
                self.stats.bytes_per_task = (_rss() - rss0) / added
        self.stats.peak_tasks = max(self.stats.peak_tasks, len(self.state.tasks))
        self._maybe_results()

    def _reports(self, reports: list[ev.Report]) -> None:
        left = self._wanted_left
        for r in reports:
            if r.client != CLIENT or r.key not in left:
                continue
            if r.status in (ReportKind.MEMORY, ReportKind.ERRED, ReportKind.LOST, ReportKind.CANCELLED):
                left.discard(r.key)
                if r.status != ReportKind.MEMORY:
                    self._erred += 1
                    if not self._first_failure:
                        err = r.error or {}
                        typ, message = err.get("type", ""), err.get("message", "")
                        ts = self.state.tasks.get(r.key)
                        if not message and ts is not None and ts.error is not None:
                            typ, message = ts.error.exc_type, ts.error.message
                        why = f"{typ}: {message}".strip(": ")
                        self._first_failure = f"{r.key} {r.status}" + (f" ({why})" if why else "")
        self._maybe_results()

    def _maybe_results(self) -> None:
        if self._results_at is not None or self._stages_left or self._wanted_left:
            return
        self._results_at = self.now
        if self.workload.hold > 0:
            self._push(self.now + self.workload.hold, _HELD)
        else:
            self._gather()

    def _gather(self) -> None:
        nbytes = 0
        if self.workload.gather:
            nbytes = sum(self.tasks[k].nbytes for k in self._wanted_all if k in self.tasks)
        self._push(self.now + 2 * self.latency + nbytes / self.bandwidth, _GATHERED)

    def _gathered(self) -> None:
        self._gathered_at = self.now
        if self._wanted_all:
            self.inbox.append(ev.ReleaseKeys(CLIENT, list(self._wanted_all), self.now))
        self._released = True

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        self.shell.start(0.0, seed=self.seed, policy=self.policy_name, workload=self.workload.name,
                         cluster=self.cluster.source)  # fmt: skip
        for i, stage in enumerate(self.workload.stages):
            self._push(stage.at, _SUBMIT, i)
        if not self.workload.stages:  # a graph of no tasks: done at once (the stall check waits for a submit)
            self._maybe_results()
        self._push(self.cluster.tick, _TICK)
        self._push(self.cluster.heartbeat, _BEAT)
        self._schedule_step(0.0)
        heap = self._heap
        pop = heapq.heappop
        next_progress = t_wall + self.progress_every
        loop_events = 0
        while heap:
            t = heap[0][0]
            if t > self.until:
                self._stopped = f"reached until={self.until:g}s"
                break
            self.now = t
            while heap and heap[0][0] == t:
                _, _, kind, a, b = pop(heap)
                loop_events += 1
                if kind == _TO_SCHED:
                    self.inbox.extend(a)
                elif kind == _DONE:
                    self._done(a, b[0], b[1])
                elif kind == _TO_WORKER:
                    self._worker_message(a, b)
                elif kind == _FETCHED:
                    self._fetched(a, b[0], b[1])
                elif kind == _STEP:
                    if a == self._step_id:
                        self._step_due = True
                elif kind == _TO_CLIENT:
                    self._reports(a)
                elif kind == _UP:
                    self._up(a)
                elif kind == _TICK:
                    self.inbox.append(ev.Tick(t))
                    self._push(t + self.cluster.tick, _TICK)
                elif kind == _BEAT:
                    self.inbox.extend(ev.Heartbeat(w, t) for w in self.workers)
                    self._push(t + self.cluster.heartbeat, _BEAT)
                elif kind == _SUBMIT:
                    self._submit(a)
                elif kind == _END:
                    self._walltime(a)
                elif kind == _PREEMPT:
                    self._preempt(a)
                elif kind == _HELD:
                    self._gather()
                elif kind == _GATHERED:
                    self._gathered()
                elif kind == _SAMPLE:
                    w = self.workers.get(a)
                    if w is not None:
                        w.sample()
                elif kind == _READY:
                    if a in self.workers:
                        self.inbox.append(ev.WorkerReady(a, t))
                elif kind == _RESTART:
                    self._restarted(a, self.provider.worker_node[a].node_type)
            if self.inbox:
                events, self.inbox = self.inbox, []
                self.apply(events)
            if self._step_due:  # as AutoScaler._run: step, then wait `interval` unless woken meanwhile
                self._step_due = False
                self._step_at = float("inf")
                self._stepping, self._woken = True, False
                busy = self.shell.step(t)
                self._stepping = False
                self._busy_until = t + busy
                self._schedule_step(t + (max(busy, 1e-4) if self._woken else busy + self.cluster.interval))
            if self.out:
                out, self.out = self.out, []
                self._push(t + self.latency, _TO_SCHED, out)
            if self._finished():
                break
            if self.progress is not None and loop_events % 4096 == 0:
                wall = time.perf_counter()
                if wall >= next_progress:
                    next_progress = wall + self.progress_every
                    self.progress(self._status(wall - t_wall))
        self.stats.loop_events = loop_events
        return self._finish(time.perf_counter() - t_wall)

    def _finished(self) -> bool:
        now = self.now
        if self._released:
            if now >= self._gathered_at + self.tail:  # type: ignore[operator]
                self._stopped = f"the tail of {self.tail:g}s after the results ended"
                return True
            return not self.workers and not self.shell.view.pending and not self.inbox and not self.out
        if self._first_submit is not None and now - max(self.state.last_progress, self._last_event) > self.stall:
            self._stopped = f"nothing finished and no worker joined for {self.stall:g}s with work left (stalled)"
            return True
        return False

    def _status(self, wall: float) -> str:
        st = self.state
        s = self.stats
        return (f"[{self.policy_name}] sim {self.now:8.1f}s  wall {wall:6.1f}s  finished {st.counters['finished']:>9,}  "
                f"tasks {len(st.tasks):>9,}  workers {len(st.workers):>6,}  state {s.state_events_per_second:,.0f} ev/s  "
                f"steps {self.shell.steps:,} ({self.shell.step_wall:.1f}s)  rss {_rss() / 2**20:,.0f} MiB")  # fmt: skip

    def _finish(self, wall: float) -> SimResult:
        end = self.now
        self.shell.close(end)
        # processes the provider just terminated leave the scheduler
        if self.out:
            out, self.out = self.out, []
            self.apply(out)
        self.journal.close()
        gc.unfreeze()
        for t0 in list(self._joined.values()):
            self._spans.append((t0, end))
        self._joined.clear()
        stop = self._gathered_at if self._gathered_at is not None else end
        start = self._first_submit or 0.0
        held_in = sum(max(0.0, min(b, stop) - max(a, start)) for a, b in self._spans)
        held_all = sum(b - a for a, b in self._spans)
        busy = sum(b - a for ivs in self._busy.values() for a, b in ivs)
        node_s = self.provider.billed_node_seconds(end)
        cost = {name: node_s.get(name, 0.0) / 3600.0 * nt.cost for name, nt in self.node_types.items()
                if name in node_s}  # fmt: skip
        recs = self.journal.records
        launches = [r for r in recs if r["kind"] == "launch"]
        retirements, retire_refused = count_retirements(recs)
        st = self.stats
        st.wall = wall
        st.steps = self.shell.steps
        st.forecasts = self.shell.forecasts
        st.step_seconds = self.shell.step_wall
        st.max_step_seconds = self.shell.max_step_wall
        try:
            import resource

            st.peak_rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:  # noqa: BLE001 - no resource module: no peak figure
            st.peak_rss = _rss()
        notes = list(self.workload.notes)
        if self._stopped and self._gathered_at is None:
            notes.append(f"stopped before the results: {self._stopped}")
        if self._erred:
            notes.append(f"{self._erred} wanted keys failed; the first: {self._first_failure}")
        view = self.shell.round.view
        if view.policy_errors:  # the numbers are the default policy's for those rounds: say so
            notes.append(f"the policy raised in {view.policy_errors} of {self.shell.steps} rounds (first: "
                         f"{view.policy_error}); the default policy decided those rounds")  # fmt: skip
        completed = self._gathered_at is not None
        return SimResult(
            policy=self.policy_name, workload=self.workload.name, seed=self.seed, completed=completed,
            makespan=(self._gathered_at - start) if completed else None,  # type: ignore[operator]
            held_worker_seconds=held_in, held_worker_seconds_total=held_all, busy_worker_seconds=busy,
            task_seconds=self._task_seconds, retire_refused=retire_refused,
            cost=cost, node_seconds=node_s, launches=len(launches),
            launched_nodes=sum(int(r.get("nodes", 1)) for r in launches),
            retirements=retirements,
            launch_failures=sum(1 for r in recs if r["kind"] in ("launch-failed", "cancel-launch")),
            workers=self.state.counters["workers_joined"], peak_workers=self._peak, tasks=len(self.tasks),
            executions=self._executions, recomputed=self.state.counters["recomputed"], end=end, stats=st,
            notes=notes, journal=self.journal_path, policy_errors=view.policy_errors, lost_seconds=self._lost, preempted=self._preempted,
            failed_keys=self._erred,
        )  # fmt: skip


def simulate(workload: Workload, cluster: SimCluster, policy: Any = None, **kwargs: Any) -> SimResult:
    """Run one simulation (``policy``: a policy object, or None for the cluster's); see :class:`Simulation`."""
    if policy is None:
        policy = cluster.make_policy()
    seed = kwargs.pop("seed", cluster.seed if cluster.seed is not None else 0)
    return Simulation(workload, cluster, policy, seed=seed, **kwargs).run()


def default_journal_name(directory: str, policy: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in policy)
    return os.path.join(directory, f"{safe}.jsonl")
