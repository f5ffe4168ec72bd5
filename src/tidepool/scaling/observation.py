"""One observation of the cluster: the only input of :meth:`ScalingController.step`.

State: none.  :class:`Observation`, :class:`GraphView` and the reports are frozen data;
:func:`observe` is the shell's half (it reads the mutable :class:`SchedulerState` once, in the
scheduler's thread).  The shells run it through the shared round (``scaling/shell/round.py``);
:func:`step_with_state` is the short form for tests: ``observe`` then ``controller.step``.  The
controller itself never sees the state: everything it learns is in the observation, ``now``
included.

Reports (``Observation.reports``) are what happened since the last step, in order, each with the
time it happened: the provider named a request's workers (:class:`Named`), a worker registered
(:class:`Joined`) or finished its setup (:class:`Ready`), a launch or one worker of it failed
(:class:`LaunchFailed`, :class:`WorkerFailed`), a retirement ended (:class:`Retired`), a worker the
controller did not launch is its to retire (:class:`Adopted`).  The shell collects them between
steps (its inbox) and hands them over in the next observation, with the provider's listing.

The unfinished graph (``GraphView``) is the expensive part; the shell builds it only when the
controller says it wants a fresh forecast (:meth:`ScalingController.wants_graph`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidepool.scaling.forecast import RemainingWork
from tidepool.scaling.snapshot import Demand, Shape, WorkerView
from tidepool.scheduler.retire import unique_summary

if TYPE_CHECKING:
    from tidepool.scaling.controller import Actions, ScalingController
    from tidepool.scheduler.records import TaskRecord
    from tidepool.scheduler.state import SchedulerState


@dataclass(frozen=True)
class GraphView:
    """The unfinished tasks (not seceded ones) as forecast input, with each task's shape."""

    work: RemainingWork
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Named:
    """The provider named the workers of launch ``request`` (``provider.worker_ids``)."""

    request: str
    workers: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class Joined:
    """``worker`` registered with the scheduler (``ready``: it has no setup to run first)."""

    worker: str
    at: float
    ready: bool = False


@dataclass(frozen=True)
class Ready:
    """``worker`` finished its setup and takes tasks."""

    worker: str
    at: float


@dataclass(frozen=True)
class LaunchFailed:
    """The whole launch ``request`` failed (the provider raised, refused, or gave up on it)."""

    request: str
    reason: str
    at: float


@dataclass(frozen=True)
class WorkerFailed:
    """``worker`` ended before it registered, or (``setup``) its setup failed after it joined."""

    worker: str
    reason: str
    at: float
    setup: bool = False


@dataclass(frozen=True)
class Retired:
    """The retirement of ``worker`` ended: ``outcome`` is ``"retired"`` or why it did not."""

    worker: str
    outcome: str
    at: float


@dataclass(frozen=True)
class Adopted:
    """``worker`` was not launched by the controller, but is its to retire (a cluster's own)."""

    worker: str
    at: float


Report = Named | Joined | Ready | LaunchFailed | WorkerFailed | Retired | Adopted


@dataclass(frozen=True)
class Observation:
    now: float
    workers: tuple[WorkerView, ...]
    demand: tuple[Demand, ...]
    last_progress: float = 0.0
    finished: int = 0
    waiting: int = 0
    running: int = 0
    tasks: int = 0  # tasks the scheduler knows (sets how often forecasts are worth their cost)
    graph: GraphView | None = None  # None: not sampled this round (the last forecast stands)
    expiring: tuple[str, ...] = ()  # workers whose allocation ends soon (provider: walltime)
    #: preemption notices: (worker, when the provider takes it back, on this observation's clock)
    notices: tuple[tuple[str, float], ...] = ()
    #: known ends: (worker, when it must be gone: walltime minus the retire margin), this clock
    ends: tuple[tuple[str, float], ...] = ()
    listing: Mapping[str, Mapping[str, Any]] | None = None  # the provider's list(), when fetched
    reports: tuple[Report, ...] = ()  # what happened since the last step, in order

    def worker(self, wid: str) -> WorkerView | None:
        for w in self.workers:
            if w.id == wid:
                return w
        return None


def executing(state: SchedulerState) -> dict[str, float]:
    """Keys most likely executing now, with when they most likely started.

    Per worker, its ``slots`` earliest-assigned tasks; the rest wait in its queue, and their time
    since assignment says nothing about their duration.  A queue head started no earlier than the
    moment the task before it left the worker.
    """
    out: dict[str, float] = {}
    for ws in state.workers.values():
        procs = [t for t in ws.processing if not t.seceded] if ws.seceded else ws.processing
        heads = procs if len(procs) <= ws.slots else sorted(procs, key=lambda t: (t.started, t.priority))[: ws.slots]
        for ts in heads:
            queued = len(procs) > ws.slots or ws.slots == 1
            out[ts.key] = max(ts.started, ws.last_done) if queued else ts.started
    return out


def group_estimates(state: SchedulerState, now: float, running: dict[str, float]) -> dict[str, float]:
    """Per-group estimates raised to the longest elapsed time of that group's executing tasks."""
    est = state.estimates
    out: dict[str, float] = {}
    for key, started in running.items():
        ts = state.tasks.get(key)
        if ts is None:
            continue
        g = ts.group
        base = out.get(g)
        if base is None:
            base = est.estimate(g)
        out[g] = max(base, now - started)
    return out


def remaining_work(state: SchedulerState, now: float, shapes: set[Shape] | None = None) -> RemainingWork:
    """The unfinished part of the graph (optionally only tasks of the given resource ``shapes``)."""
    return _remaining(state, now, shapes)[0]


def _remaining(state: SchedulerState, now: float,
               shapes: set[Shape] | None = None) -> tuple[RemainingWork, list[TaskRecord]]:  # fmt: skip
    """:func:`remaining_work` and its tasks in the same order (one pass over a million tasks is
    what a forecast step costs: the per-kind numbers are worked out once per kind, not per task)."""
    est = state.estimates
    running_now = executing(state)
    raised = group_estimates(state, now, running_now)
    # a seceded task (worker_client) holds no slot: its time is the time of the tasks it waits for
    unfinished = ("waiting", "ready", "no-worker", "running")
    tasks = [ts for ts in state.tasks.values() if ts.state in unfinished
             and not ts.seceded and (shapes is None or ts.shape in shapes)]  # fmt: skip
    tasks.sort(key=lambda t: t.priority)
    index = {ts.key: i for i, ts in enumerate(tasks)}
    durations: list[float] = []
    deps: list[tuple[int, ...]] = []
    running: list[int] = []
    unknown: list[int] = []
    # spend on evidence, not on guesses: a launch is bought for a kind never seen only once its
    # running tasks show it is long (its elapsed time raises the prior), and an idle node is held
    # for work behind such a task only once it ran long enough to be nearly done
    launch: list[float] = []
    hold: list[float] = []
    # ... raised to the elapsed time of its running tasks, not to the mean of the other kinds (its
    # estimate until one finishes: on the 15-degree montage one mDiffFit started made a launch see its
    # 1,889 waiting siblings, 0.5 s tasks, as 308 s each, the mProject mean, and buy 173 nodes)
    longest: dict[str, float] = {}
    for key, started in running_now.items():
        rs = state.tasks.get(key)
        if rs is not None:
            longest[rs.group] = max(longest.get(rs.group, 0.0), now - started)
    kinds: dict[str, tuple[float, bool, float]] = {}  # group -> (estimate, seen finish, shown to launches)
    get = index.get
    for i, ts in enumerate(tasks):
        g = ts.group
        kind = kinds.get(g)
        if kind is None:
            r = raised.get(g)
            k_est = est.estimate(g) if r is None else r
            st = est.groups.get(g)
            k_seen = st is not None and st.count > 0
            kind = kinds[g] = (k_est, k_seen,
                               k_est if k_seen else min(k_est, max(est.default_prior, longest.get(g, 0.0))))
        e, seen, shown = kind
        began = running_now.get(ts.key)
        if began is not None:
            elapsed = max(0.0, now - began)
            durations.append(max(e - elapsed, elapsed / 4))
            running.append(i)
            launch.append(max(shown - elapsed, elapsed / 4))
            hold.append(durations[-1] if seen else max(e - elapsed, elapsed))
            if not seen:
                unknown.append(i)
        else:
            durations.append(e)
            launch.append(shown)
            hold.append(e)
        deps.append(tuple([j for d in ts.deps if (j := get(d.key)) is not None]))
    as_tuple = tuple(durations)
    work = RemainingWork(as_tuple, tuple(deps), tuple(running), tuple([t.key for t in tasks]), frozenset(unknown),
                         None if tuple(launch) == as_tuple else tuple(launch),
                         None if tuple(hold) == as_tuple else tuple(hold))  # fmt: skip
    return work, tasks


def worker_views(state: SchedulerState) -> tuple[WorkerView, ...]:
    out = []
    for ws in state.workers.values():
        n, nbytes, for_tasks = unique_summary(ws)
        # a worker running setup hooks sent after it joined takes no task meanwhile: busy, not idle
        # (it was retired as idle mid-setup); still running for everything else (a walltime end)
        out.append(WorkerView(
            ws.id, ws.node_type, ws.state, dict(ws.resources), ws.slots, ws.assigned,
            ws.occupancy, ws.nbytes, n, nbytes, ws.idle_since, ws.joined, ws.memory_limit, for_tasks,
            preparing=ws.preparing,
        ))  # fmt: skip
    return tuple(sorted(out, key=lambda w: w.id))


def demand_of(state: SchedulerState) -> tuple[Demand, ...]:
    est = state.estimates
    return tuple(Demand(shape, group, n, est.estimate(group)) for (shape, group), n in sorted(state.pending.items()))


def graph_view(state: SchedulerState, now: float) -> GraphView:
    work, tasks = _remaining(state, now)
    return GraphView(work, tuple([t.shape for t in tasks]))


def observe(state: SchedulerState, now: float, *, graph: bool = True, expiring: Sequence[str] = (),
            listing: Mapping[str, Mapping[str, Any]] | None = None,
            reports: Sequence[Report] = (), notices: Mapping[str, float] | None = None,
            ends: Mapping[str, float] | None = None) -> Observation:  # fmt: skip
    """Read the scheduler state once into frozen data (the shell's side of the boundary)."""
    workers = worker_views(state)
    return Observation(
        now=now, workers=workers, demand=demand_of(state), last_progress=state.last_progress,
        finished=state.counters["finished"], waiting=state.counts.get("waiting", 0),
        running=sum(w.running for w in workers), tasks=len(state.tasks),
        graph=graph_view(state, now) if graph else None, expiring=tuple(expiring), listing=listing,
        reports=tuple(reports), notices=tuple(sorted((notices or {}).items())),
        ends=tuple(sorted((ends or {}).items())),
    )  # fmt: skip


def step_with_state(controller: ScalingController, state: SchedulerState, now: float, *,
                    expiring: Sequence[str] = (), listing: Mapping[str, Mapping[str, Any]] | None = None,
                    reports: Sequence[Report] = (), notices: Mapping[str, float] | None = None,
                    ends: Mapping[str, float] | None = None) -> Actions:  # fmt: skip
    """Observe ``state`` (with the graph if the controller wants a forecast) with ``reports``,
    then step: one round of ``scaling/shell/round.py`` without its provider, for tests."""
    from tidepool.scaling.shell.round import Round
    from tidepool.telemetry.journal import Journal

    rnd = Round(controller, Journal())
    rnd.inbox.extend(reports)
    return rnd.step(state, now, expiring=expiring, listing=listing, notices=notices, ends=ends)[0]
