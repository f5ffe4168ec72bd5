"""Remaining-time forecasts: how long the loaded graph still needs with a given pool.

Pure functions over frozen data: :func:`~tidepool.scaling.observation.remaining_work` (the shell's
side) copies what is left of the graph out of the scheduler state into a :class:`RemainingWork`
(estimated duration of every unfinished task, its unfinished inputs, and for running tasks the time
still expected); :func:`list_schedule` plays it forward on ``slots`` task slots plus slots that
arrive later (new nodes after their startup time), greedily by priority, like the scheduler does;
:func:`forecast` is ``max(critical path, work / capacity)`` refined by that simulation, or, for
a graph too large to simulate for every candidate pool, by playing it depth by depth
(:func:`levels`, :func:`layered_time`: a wide phase, then its reduce, then the next phase).

Estimates: a group's duration is its measured mean; a group never seen uses the adaptive prior; a
task running longer than that is evidence, so the estimate is at least the longest elapsed time of
its running tasks, and a running task is expected to need ``max(est - elapsed, elapsed / 4)`` more.
Two views of the same work (``RemainingWork.for_launch``, ``for_hold``): a launch sees a task of a
kind that never finished at the scheduler's prior, or at the longest elapsed time of its running
tasks when that is longer, never at the mean of the other kinds (buy nodes on evidence only), holding
an idle node sees a running task of such a kind needing at least as long again as it ran (hold
nodes on evidence only); :func:`type_forecasts` gives the launch view as ``TypeForecast.evidence``
and builds the width profile on the holding view.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidepool.resources import Shape, task_slots
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.snapshot import TypeForecast, WorkerView
from tidepool.scheduler.records import ORDINARY

if TYPE_CHECKING:
    from tidepool.scaling.observation import GraphView


#: Above this many unfinished tasks the simulation is replaced by the analytic bound.
SIMULATE_MAX_TASKS = 20_000
#: ... and above this many task placements per forecast (tasks x candidate pools): a forecast must
#: stay a small cost of the scheduler's loop (about 0.1 s here)
SIMULATE_BUDGET = 60_000


@dataclass(frozen=True)
class RemainingWork:
    durations: tuple[float, ...]  # per unfinished task (running: remaining time)
    deps: tuple[tuple[int, ...], ...]  # unfinished inputs, as indices
    running: tuple[int, ...]  # indices already running (they hold a slot from t=0)
    keys: tuple[str, ...] = ()
    unknown: frozenset[int] = frozenset()  # running tasks of groups with no finished sample yet
    #: the same durations as a launch should see them: a task of a kind that never finished at the
    #: scheduler's prior raised to the longest elapsed time of its running tasks, not the mean of the
    #: other kinds (None: the same as ``durations``)
    for_launch: tuple[float, ...] | None = None
    #: ... and as holding an idle node should see them: a running task of a kind that never finished
    #: has at least as long to go as it ran (None: the same as ``durations``)
    for_hold: tuple[float, ...] | None = None

    def variant(self, durations: tuple[float, ...] | None) -> RemainingWork:
        """This work with other durations (``None``: itself)."""
        if durations is None or durations == self.durations:
            return self
        return RemainingWork(durations, self.deps, self.running, self.keys, self.unknown)

    @property
    def total(self) -> float:
        return sum(self.durations)

    def __len__(self) -> int:
        return len(self.durations)


def critical_path(work: RemainingWork) -> float:
    """Longest chain of estimated durations (indices usually in topological order; a graph whose
    are not, such as a replayed journal's, is ordered first)."""
    finish = [0.0] * len(work)
    deps = work.deps
    durations = work.durations
    order: Iterable[int] = range(len(durations))
    for _ in range(2):
        for i in order:  # a million tasks a forecast step: no generator per task
            d = durations[i]
            ds = deps[i]
            if not ds:
                finish[i] = d
            elif len(ds) == 1:
                j = ds[0]
                if j >= i and isinstance(order, range):
                    break  # an input listed after its task: order the graph first
                finish[i] = finish[j] + d
            else:
                if isinstance(order, range) and max(ds) >= i:
                    break
                finish[i] = max([finish[j] for j in ds]) + d
        else:
            return max(0.0, max(finish, default=0.0))
        order = _topological(deps)
    return max(0.0, max(finish, default=0.0))


def list_schedule(work: RemainingWork, slots: int, arrivals: tuple[float, ...] = ()) -> float:
    """Makespan of greedy list scheduling on ``slots`` slots now plus slots arriving at ``arrivals``
    (:func:`schedule_detail`'s makespan: one scheduler serves both)."""
    return schedule_detail(work, slots, arrivals)[0]


def schedule_detail(work: RemainingWork, slots: int, arrivals: tuple[float, ...] = ()
                    ) -> tuple[float, list[float], list[tuple[float, float]], list[float]]:  # fmt: skip
    """:func:`list_schedule` that also says who worked when: ``(makespan, busy seconds per slot,
    (start, finish) of every task, first start per slot (inf: never))``.  Slots are numbered ``0 .. slots-1`` (there now), then one per
    entry of ``arrivals`` in its order; running tasks hold the first slots from t=0."""
    n = len(work)
    total = slots + len(arrivals)
    busy = [0.0] * total
    first = [float("inf")] * total
    spans: list[tuple[float, float]] = []
    if n == 0:
        return 0.0, busy, spans, first
    if total == 0:
        return float("inf"), busy, spans, first
    free: list[tuple[float, int]] = [(0.0, i) for i in range(slots)]
    free += [(a, slots + j) for j, a in enumerate(arrivals)]
    heapq.heapify(free)
    indeg = [len(d) for d in work.deps]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(work.deps):
        for j in ds:
            dependents[j].append(i)
    ready_at = [0.0] * n
    finish = [0.0] * n
    pending: list[tuple[float, int]] = []
    available: list[int] = []
    running = sorted(set(work.running), key=lambda i: work.durations[i])
    makespan = 0.0
    held: list[tuple[float, int]] = []
    for i in running:
        if free:
            _, sid = heapq.heappop(free)
        else:  # a running task holds a slot the pool no longer lists (as list_schedule counts it)
            sid = len(busy)
            busy.append(0.0)
            first.append(float("inf"))
        first[sid] = 0.0
        finish[i] = work.durations[i]
        busy[sid] += finish[i]
        spans.append((0.0, finish[i]))
        held.append((finish[i], sid))
        makespan = max(makespan, finish[i])
    for item in held:
        heapq.heappush(free, item)
    run_set = set(work.running)

    def release(i: int) -> None:
        for k in dependents[i]:
            indeg[k] -= 1
            ready_at[k] = max(ready_at[k], finish[i])
            if indeg[k] == 0:
                heapq.heappush(pending, (ready_at[k], k))

    for i in range(n):
        if indeg[i] == 0 and i not in run_set:
            heapq.heappush(pending, (0.0, i))
    for i in run_set:
        release(i)
    while pending or available:
        t, sid = heapq.heappop(free)
        while pending and pending[0][0] <= t:
            heapq.heappush(available, heapq.heappop(pending)[1])
        if not available:
            t = max(t, pending[0][0])
            while pending and pending[0][0] <= t:
                heapq.heappush(available, heapq.heappop(pending)[1])
        i = heapq.heappop(available)
        start = max(t, ready_at[i])
        finish[i] = start + work.durations[i]
        busy[sid] += work.durations[i]
        first[sid] = min(first[sid], start)
        spans.append((start, finish[i]))
        makespan = max(makespan, finish[i])
        heapq.heappush(free, (finish[i], sid))
        release(i)
    return makespan, busy, spans, first


def in_use_profile(spans: list[tuple[float, float]], limit: int = 4000) -> tuple[tuple[float, int], ...]:
    """Step function ``(time, slots in use from then on)`` of a schedule's task spans (at most
    ``limit`` steps: later ones are merged into the last, which keeps the peak)."""
    events: dict[float, int] = {}
    for a, b in spans:
        if b <= a:
            continue
        events[a] = events.get(a, 0) + 1
        events[b] = events.get(b, 0) - 1
    out: list[tuple[float, int]] = []
    level = 0
    for t in sorted(events):
        level += events[t]
        if len(out) < limit:
            out.append((t, level))
        elif level > out[-1][1]:
            out[-1] = (out[-1][0], level)
    return tuple(out)


def peak_in_use(profile: tuple[tuple[float, int], ...], until: float) -> int:
    """The most slots a profile uses at once in ``[0, until]``."""
    peak = 0
    for t, level in profile:
        if t > until:
            break
        peak = max(peak, level)
    return peak


def fill_time(total: float, slots: int, arrivals: tuple[float, ...] = ()) -> float:
    """When ``total`` seconds of perfectly divisible work end on ``slots`` slots now plus one slot
    arriving at each time in ``arrivals`` (the work bound, with start-up delays counted)."""
    t = done = 0.0
    rate = slots
    for a in sorted(arrivals):
        if rate and done + rate * (a - t) >= total:
            break
        done += rate * (a - t)
        t, rate = a, rate + 1
    return t + (total - done) / rate if rate else float("inf")


def levels(work: RemainingWork) -> tuple[tuple[float, float], ...]:
    """``(total work, longest task)`` per depth of the graph, shallowest first: a task's depth is one
    more than its deepest unfinished input's (0 without one).  Indices are usually in topological
    order (the scheduler's); a graph whose are not (a replayed journal) is ordered first."""
    deps = work.deps
    durations = work.durations
    order: Iterable[int] = range(len(durations))
    for _ in range(2):
        depth = [0] * len(durations)
        sums: list[float] = []
        longest: list[float] = []
        for i in order:
            ds = deps[i]
            if ds and isinstance(order, range) and max(ds) >= i:
                break  # an input listed after its task: order the graph first
            k = 0 if not ds else (depth[ds[0]] + 1 if len(ds) == 1 else max([depth[j] for j in ds]) + 1)
            depth[i] = k
            while len(sums) <= k:
                sums.append(0.0)
                longest.append(0.0)
            d = durations[i]
            sums[k] += d
            if d > longest[k]:
                longest[k] = d
        else:
            return tuple(zip(sums, longest, strict=True))
        order = _topological(deps)
    raise AssertionError("unreachable: a topological order never breaks")


def _topological(deps: tuple[tuple[int, ...], ...]) -> list[int]:
    """Indices in an order where every input comes before its dependents (Kahn's algorithm; tasks on
    a cycle, which a graph never has, go last)."""
    n = len(deps)
    indeg = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for j in ds:
            dependents[j].append(i)
    order = [i for i in range(n) if indeg[i] == 0]
    for i in order:  # grows while it is walked
        for k in dependents[i]:
            indeg[k] -= 1
            if indeg[k] == 0:
                order.append(k)
    if len(order) < n:
        order += [i for i in range(n) if indeg[i] > 0]
    return order


def layered_time(layers: tuple[tuple[float, float], ...], slots: int, arrivals: tuple[float, ...] = ()) -> float:
    """When ``layers`` (from :func:`levels`) end if each depth starts once the one before has ended
    and its work divides over the slots there then (plus those arriving meanwhile), no faster than
    its longest task.  Where the graph has barriers (a wide phase, a reduce, the next phase) this is
    about what greedy scheduling gives, while ``max(critical path, work / slots)`` counts only the
    larger of the two."""
    arr = sorted(arrivals)
    n = len(arr)
    i = 0
    t = 0.0
    rate = slots
    for total, longest in layers:
        while i < n and arr[i] <= t:
            rate += 1
            i += 1
        if rate == 0 and i >= n:
            return float("inf")
        start = t if rate else arr[i]
        # divisible work from t on: ``rate`` slots now, one more at each later arrival
        now, done, r, j = t, 0.0, rate, i
        while j < n and (r == 0 or done + r * (arr[j] - now) < total):
            done += r * (arr[j] - now)
            now, r, j = arr[j], r + 1, j + 1
        filled = now + (total - done) / r
        t = max(start + longest, filled)
    return t


def forecast(work: RemainingWork, slots: int, arrivals: tuple[float, ...] = (),
             bounds: tuple[float, float] | None = None, simulate: bool = True,
             layers: tuple[tuple[float, float], ...] | None = None) -> float:  # fmt: skip
    """Remaining seconds: the list-scheduling estimate, never below the two lower bounds.

    ``bounds``: ``(critical path, total work)`` of ``work`` when the caller already has them (they
    cost a pass over the graph; a forecast with many candidate pools computes them once), and
    ``layers`` its :func:`levels` alike.  ``simulate=False``: no list schedule, for forecasts over
    many pools: then the depth-by-depth estimate (:func:`layered_time`), at most the greedy
    schedule's own bound (the work's fill time plus the critical path) and at least the lower bounds.
    """
    if len(work) == 0:
        return 0.0
    total_slots = slots + len(arrivals)
    if total_slots == 0:
        return float("inf")
    cp, filled = _lower_bounds(slots, arrivals, bounds if bounds is not None else (critical_path(work), work.total))
    bound = max(cp, filled)
    if len(work) > SIMULATE_MAX_TASKS or not simulate:
        layered = layered_time(levels(work) if layers is None else layers, slots, arrivals)
        return max(bound, min(layered, filled + cp))
    return max(bound, list_schedule(work, slots, arrivals))


def _lower_bounds(slots: int, arrivals: tuple[float, ...], bounds: tuple[float, float]) -> tuple[float, float]:
    """The two lower bounds of a non-empty graph on at least one slot, from its ``(critical path,
    total work)``: the critical path (begun when the first slot arrives, if none is there now) and
    the time the work would take if it divided perfectly (:func:`fill_time`)."""
    cp, total = bounds
    return (cp + min(arrivals) if slots == 0 else cp), fill_time(total, slots, arrivals)


def next_demand_in(work: RemainingWork) -> float | None:
    """Seconds until a task that waits on inputs could become runnable (None: nothing waits).

    Waiting behind a running task whose kind has never finished gives ``inf``: its duration is a
    guess, too weak to launch ahead of time or to keep idle workers for.
    """
    waiting = [i for i, d in enumerate(work.deps) if d]
    if not waiting:
        return None
    running = set(work.running)
    if not running:
        return 0.0  # nothing waits on a running task only: something waits on a waiting one
    best: float | None = None
    for i in waiting:
        if work.deps[i][0] in running and all(j in running for j in work.deps[i]):
            if any(j in work.unknown for j in work.deps[i]):
                t = float("inf")
            else:
                t = max(work.durations[j] for j in work.deps[i])
            best = t if best is None else min(best, t)
    return best if best is not None else 0.0


def candidates(room: int, useful: int | None = None) -> tuple[int, ...]:
    """Extra-node counts worth forecasting: every count up to 6, then about 1.5x apart, up to
    ``room`` itself (no cap: a 10,000-node type is asked about 10,000).  ``useful``: more nodes
    than this cannot help (each would get no task), so the counts stop there."""
    top = room if useful is None else min(room, max(1, useful))
    out = [k for k in range(7) if k <= top]
    k = 8
    while k < top:
        out.append(k)
        k = k * 3 // 2 if k >= 16 else k + (2 if k < 12 else 4)
    if top > 0 and top not in out:
        out.append(top)
    return tuple(out)


def restrict(work: RemainingWork, keep: list[int]) -> RemainingWork:
    """The part of ``work`` made of the tasks at indices ``keep`` (ascending), re-indexed."""
    pos = {old: new for new, old in enumerate(keep)}
    return RemainingWork(
        tuple(work.durations[i] for i in keep),
        tuple(tuple(pos[j] for j in work.deps[i] if j in pos) for i in keep),
        tuple(pos[i] for i in work.running if i in pos),
        tuple(work.keys[i] for i in keep),
        frozenset(pos[i] for i in work.unknown if i in pos),
        None if work.for_launch is None else tuple(work.for_launch[i] for i in keep),
        None if work.for_hold is None else tuple(work.for_hold[i] for i in keep),
    )


def type_forecasts(
    graph: GraphView,
    workers: tuple[WorkerView, ...],
    node_types: tuple[NodeType, ...],
    nodes_of: dict[str, int],
    pending: tuple[tuple[str, int, float], ...],
    now: float,
    blocked: set[str],
) -> tuple[tuple[TypeForecast, ...], float | None, float | None]:
    """Per node type: forecast remaining time of the work that prefers it, with 0..room extra nodes.

    Pure: ``graph`` and ``workers`` are frozen views.  ``pending`` holds launches in flight as
    (type, nodes, launched at).  Returns the forecasts, the overall ETA with the pool as it is, and
    when waiting work next becomes runnable.
    """
    from tidepool.scaling.planner import rank_types

    shapes: dict[Shape, int] = {}
    for shape in graph.shapes:
        shapes[shape] = shapes.get(shape, 0) + 1
    if not shapes:
        return (), 0.0, None
    classes: dict[str, dict[Shape, int]] = {}
    for shape, n in shapes.items():
        ranked = rank_types(shape, node_types)
        usable = [nt for nt in ranked if nt.name not in blocked] or ranked
        if usable:
            classes.setdefault(usable[0].name, {})[shape] = n
    by_name = {nt.name: nt for nt in node_types}
    # placement keeps a worker's scarce resources (gpu, ...) for the tasks that need them: while
    # such tasks exist, that worker is no capacity for work that does not need them
    demanded = {name for shape in shapes for name, _ in shape if name not in ORDINARY}

    def counts_for(w: WorkerView, dom: Shape) -> bool:
        extra = {k for k, v in w.resources.items() if v > 0 and k not in ORDINARY}.difference(n for n, _ in dom)
        return not (extra & demanded)

    out: list[TypeForecast] = []
    eta: float | None = None
    nxt: float | None = None
    for name, cls in sorted(classes.items()):
        nt = by_name[name]
        whole = graph.work if len(classes) == 1 else restrict(
            graph.work, [i for i, sh in enumerate(graph.shapes) if sh in cls])  # fmt: skip
        hold = whole.variant(whole.for_hold)
        dom = max(cls, key=lambda s: (cls[s], s))
        # a node runs no more tasks at once than it has slots, nor than there are tasks: counting
        # more only grows the forecast's per-slot lists (a 10**12-cpu type: a MemoryError per step)
        spn = min(max(1, task_slots(dict(nt.worker_resources), dom)) * nt.workers_per_node, max(1, len(whole)))
        room = 0 if name in blocked else max(0, nt.max_nodes - nodes_of.get(name, 0))
        slots = sum(task_slots(w.resources, dom) for w in workers
                    if w.state in ("running", "starting") and counts_for(w, dom))  # fmt: skip
        slots = min(slots, 100_000)
        arrivals: list[float] = []
        for ptype, nodes, since in pending:
            if ptype == name:
                arrivals.extend([max(0.0, since + nt.startup_estimate - now)] * (nodes * spn))
        base = tuple(arrivals)
        # the pool as it is, played forward on the durations holding sees (RemainingWork.for_hold)
        profile: tuple[tuple[float, int], ...] = ()
        profile_now: tuple[tuple[float, int], ...] = ()
        if len(hold) <= SIMULATE_MAX_TASKS and len(hold) * len(candidates(room, -(-len(hold) // spn))) <= SIMULATE_BUDGET:
            profile = in_use_profile(schedule_detail(hold, slots, base)[2])
            if base and nt.billed_startup is not None and nt.billed_startup < nt.startup_estimate:
                # a queued job may start any time: the width with every one of them here now
                profile_now = in_use_profile(schedule_detail(hold, slots + len(base))[2])
        mean = _with_extra(name, nt.startup_estimate, spn, whole, slots, base, room, profile)
        evidence = None
        if whole.for_launch is not None:  # launches by evidence see unseen kinds at the prior
            evidence = _with_extra(name, nt.startup_estimate, spn, whole.variant(whole.for_launch), slots, base,
                                   room, profile)  # fmt: skip
        out.append(TypeForecast(name, nt.startup_estimate, spn, mean.extra, mean.etas, len(whole), mean.new_busy,
                                profile, slots + len(base), mean.new_start, evidence, profile_now))  # fmt: skip
        etas = mean.etas
        eta = etas[0] if eta is None else max(eta, etas[0])
        soon = next_demand_in(hold)
        if soon is not None:
            nxt = soon if nxt is None else min(nxt, soon)
    return tuple(out), eta, nxt


def _with_extra(name: str, startup: float, spn: int, work: RemainingWork, slots: int, base: tuple[float, ...],
                room: int, profile: tuple[tuple[float, int], ...]) -> TypeForecast:  # fmt: skip
    """``work``'s forecast on ``slots`` slots (plus ``base`` arriving) with 0 .. ``room`` extra nodes."""
    bounds = (critical_path(work), work.total)
    ks = candidates(room, -(-len(work) // spn))
    sim = len(work) * len(ks) <= SIMULATE_BUDGET  # one kind of estimate for every candidate
    layers = None if sim and len(work) <= SIMULATE_MAX_TASKS else levels(work)
    etas_l: list[float] = []
    busy_l: list[float] = []
    start_l: list[float] = []
    for k in ks:
        arrivals = base + (startup,) * (k * spn)
        if layers is not None:  # too large to simulate for every candidate: the depth-by-depth estimate
            eta = forecast(work, slots, arrivals, bounds, simulate=False, layers=layers)
            etas_l.append(eta)  # divisible work: new slots work from their arrival to the end
            busy_l.append(max(0.0, eta - startup) if k else 0.0)
            start_l.append(startup if k and eta > startup else float("inf"))
            continue
        ms, busy, _, first = schedule_detail(work, slots, arrivals)
        # the list schedule, never below the lower bounds (as :func:`forecast` gives it)
        etas_l.append(max(*_lower_bounds(slots, arrivals, bounds), ms) if slots or arrivals else float("inf"))
        first_new = slots + len(base)
        busy_l.append(sum(busy[first_new:]) / (k * spn) if k else 0.0)
        start_l.append(max(first[first_new:]) if k else float("inf"))
    return TypeForecast(name, startup, spn, ks, tuple(etas_l), len(work), tuple(busy_l), profile,
                        slots + len(base), tuple(start_l))
