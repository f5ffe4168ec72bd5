"""Placement: which ready task goes to which worker, and which queued tasks move to idle workers.

State here is only the ready line (:class:`ReadyHeaps`); everything else is pure functions over
read-only views of the scheduler's records (workers, the set of workers with room, a task's
inputs).  The state machine (``state.py``) asks, then makes the moves itself (assign, park as
no-worker, ask for a steal): nothing here changes a task or a worker record.

Ready line.  Ready tasks wait in one priority heap per resource shape (lower priority value first,
ties by the order they became ready); tasks restricted to named workers (``workers=``) wait in one
heap of their own.  Entries are not removed when a task leaves ``ready``: a head whose task moved
on (its state, or its ``ready_seq``, no longer match) is dropped when met.

Choosing a worker for a ready task, in order:
1. the worker must have every resource the task asks for (``fits``), and room (a free slot, or
   less than ``queue_seconds`` of estimated work queued per slot); a task asking for a scarce
   resource (gpu, ...) also needs that much of it free, counting the tasks assigned there
   (:func:`special_free`): such tasks never queue on a worker, they wait in the ready line for
   the first one that frees or joins;
2. scarce resources stay free: a worker with a resource beyond cpu/memory (a GPU) takes a task that
   does not need it only into a free slot, never into its queue, and not at all while ready tasks
   that need that resource could run on it (:func:`allowed`);
3. prefer the worker that already holds the most bytes of the task's inputs (data locality);
4. then the least loaded (estimated queued seconds per slot), then the fewest queued tasks; but
   when the pool is over-provisioned (more free slots than ready tasks: :func:`over_provisioned`)
   **pack** instead: the worker with a free slot and the fewest free slots left.  Spreading then
   gains nothing (every ready task gets a slot either way) and leaves every node partly used, so
   none is ever idle and none can be retired; packing leaves whole nodes idle for the scaling
   policy to take back (on a one-slot pool both rules are the same);
5. ties break on the worker's join sequence number, so runs replay deterministically.
Workers whose copy of the task went silent (``ts.avoid``) are used only when no other can.

Stealing (:func:`plan_steals`): when a worker has a free slot and nothing ready fits it, tasks
still *queued* (not executing) on workers with more tasks than slots are asked back and placed
again, unless copying their inputs would cost more than twice their estimated run time
(:func:`transfer_outweighs`).  A task that seceded (``worker_client``) stays where it is.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from tidepool.resources import Shape, fits

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord, WorkerRecord

#: bytes per second assumed for copying a stolen task's inputs (Dask's scheduler assumes the same
#: 100 MB/s until it measures): a steal must save more time than the copy costs
STEAL_BANDWIDTH = 100e6

Entry = tuple[int, int, "TaskRecord"]  # (priority, ready sequence number, task)


def _live(entry: Entry) -> bool:
    ts = entry[2]
    return ts.state == "ready" and ts.ready_seq == entry[1]


class ReadyHeaps:
    """The ready line: a heap per shape, and one for tasks restricted to named workers."""

    __slots__ = ("by_shape", "restricted", "seq")

    def __init__(self) -> None:
        self.by_shape: dict[Shape, list[Entry]] = {}
        self.restricted: list[Entry] = []
        self.seq = 0

    def __bool__(self) -> bool:
        return bool(self.by_shape or self.restricted)

    def push(self, ts: TaskRecord) -> None:
        """``ts`` (just ready) joins the line of its shape."""
        self.seq += 1
        ts.ready_seq = self.seq
        heapq.heappush(self.by_shape.setdefault(ts.shape, []), (ts.priority, self.seq, ts))

    def push_restricted(self, ts: TaskRecord) -> None:
        self.seq += 1
        ts.ready_seq = self.seq
        heapq.heappush(self.restricted, (ts.priority, self.seq, ts))

    def pop_restricted(self) -> TaskRecord | None:
        """The first restricted task still ready (taken out of line), or None."""
        heap = self.restricted
        while heap:
            entry = heapq.heappop(heap)
            if _live(entry):
                return entry[2]
        return None

    def keep_restricted(self, tasks: Iterable[TaskRecord]) -> None:
        """Restricted ``tasks`` taken out of line go back to their old places."""
        for ts in tasks:
            heapq.heappush(self.restricted, (ts.priority, ts.ready_seq, ts))

    def requeue(self, ts: TaskRecord) -> None:
        """``ts`` goes back to its old place (it was taken, then deferred)."""
        heapq.heappush(self.by_shape.setdefault(ts.shape, []), (ts.priority, ts.ready_seq, ts))

    def pop(self, shape: Shape) -> TaskRecord:
        return heapq.heappop(self.by_shape[shape])[2]

    def take(self, shape: Shape) -> list[TaskRecord]:
        """Remove the line of ``shape``; the tasks in it still ready."""
        return [e[2] for e in self.by_shape.pop(shape, []) if _live(e)]

    def clear(self) -> None:
        self.by_shape.clear()
        self.restricted.clear()


# ---- rules -------------------------------------------------------------------------------------
def fits_on(ws: WorkerRecord, shape: Shape) -> bool:
    """``fits(ws.resources, shape)``, remembered per worker (resources never change)."""
    ok = ws.fit_cache.get(shape)
    if ok is None:
        ok = ws.fit_cache[shape] = fits(ws.resources, shape)
    return ok


def special_free(ws: WorkerRecord, shape: Shape) -> bool:
    """Is enough of every scarce resource ``shape`` asks for (gpu, ...) free on ``ws``, counting
    the tasks assigned to it (but those that seceded: they gave theirs back) and the runs taken
    back from it that still execute there?  Tasks needing one are never queued behind it: a 4-cpu worker with
    one gpu runs one gpu task at a time, so a second one waits in the ready line for whichever gpu
    worker frees first (or joins)."""
    if not ws.special:
        return True
    used = ws.special_used
    for name, amount in shape:
        if name in ws.special and used.get(name, 0.0) + amount > ws.resources[name] * (1 + 1e-9):
            return False
    return True


def hold_abandoned_special(ws: WorkerRecord, key: str, shape: Shape) -> None:
    """A run of ``key`` taken back from ``ws`` still executes there: the scarce resources its
    ``shape`` asks for stay counted until :func:`release_abandoned_special`."""
    if any(name in ws.special for name, _ in shape):
        take_special(ws, shape, 1)
        ws.abandoned_special[key] = shape


def release_abandoned_special(ws: WorkerRecord, key: str) -> None:
    """The abandoned run of ``key`` on ``ws`` ended (or is this record's again)."""
    held = ws.abandoned_special.pop(key, None)
    if held is not None:
        take_special(ws, held, -1)


def take_special(ws: WorkerRecord, shape: Shape, sign: int) -> None:
    """Count a task of ``shape`` assigned to ``ws`` (``sign`` 1) or leaving it (-1)."""
    used = ws.special_used
    for name, amount in shape:
        if name in ws.special:
            left = used.get(name, 0.0) + sign * amount
            if left > 1e-9:
                used[name] = left
            else:
                used.pop(name, None)


def fits_any(workers: Iterable[WorkerRecord], shape: Shape) -> bool:
    """Does any running worker have the resources for ``shape``?"""
    return any(fits(w.resources, shape) for w in workers if w.state == "running")


def matches(ws: WorkerRecord, ts: TaskRecord) -> bool:
    """Is ``ws`` one of the workers ``ts`` is restricted to (by id, name or address)?"""
    r = ts.restrict
    return r is None or ws.id in r or ws.name in r or ws.address in r


def may_wait_for(ws: WorkerRecord, ts: TaskRecord) -> bool:
    """Is ``ws`` one of ``ts``'s named workers that it should wait for?  A loosely restricted
    task does not wait for a suspect (silent) worker: any worker will do."""
    return ws.state == "running" and matches(ws, ts) and not (ts.loose and ws.suspect)


def allowed(ws: WorkerRecord, shape: Shape, ready: Mapping[Shape, list[Entry]]) -> bool:
    """May ``ws`` take a task of ``shape`` now, given its scarce resources?"""
    if not ws.special:
        return True
    extra = ws.special.difference(name for name, _ in shape)
    if not extra:
        return True
    if ws.assigned >= ws.slots:
        return False  # never queue ordinary work behind a GPU
    for s, heap in ready.items():  # ready work that needs what ws has spare, and could start, comes first
        if heap and any(name in extra for name, _ in s) and fits_on(ws, s) and special_free(ws, s):
            return False
    return True


def has_room(ws: WorkerRecord, queue_seconds: float, max_queue_per_slot: int) -> bool:
    """May ``ws`` be given another task: running, answering, not preparing, a free slot or a short queue?"""
    n = ws.assigned
    if ws.state != "running" or ws.suspect or ws.preparing or n >= ws.slots * max_queue_per_slot:
        return False
    return n < ws.slots or ws.occupancy < queue_seconds * ws.slots


def transfer_outweighs(thief: WorkerRecord, ts: TaskRecord, estimate: float) -> bool:
    """Moving ``ts`` would copy more input than it is worth: its inputs missing on ``thief``
    take longer to send (at ``STEAL_BANDWIDTH``) than twice the task's estimated run time
    ``estimate``.  (A quick task on big inputs stays where its data is; copying it only fills memory.)"""
    missing = sum(d.nbytes for d in ts.deps if thief.id not in d.who_has)
    return missing > 0 and missing / STEAL_BANDWIDTH > 2 * estimate


def holder_busy(ts: TaskRecord, workers: Mapping[str, WorkerRecord], room: Collection[str]) -> bool:
    """A running worker holds an input of ``ts`` and could run it, but has no room now."""
    for d in ts.deps:
        for wid in d.who_has:
            w = workers.get(wid)
            if w is not None and w.state == "running" and wid not in room and fits(w.resources, ts.shape):
                return True
    return False


# ---- choices -----------------------------------------------------------------------------------
def next_shape(ready: ReadyHeaps, workers: Mapping[str, WorkerRecord], room: Collection[str],
               fit_any: dict[Shape, bool]) -> tuple[str, Shape, list[WorkerRecord]] | None:  # fmt: skip
    """The shape whose head task goes next, with the workers that may take it: ``("place",
    shape, candidates)``; ``("park", shape, [])`` when no running worker fits that shape at all
    (its tasks become no-worker demand); None when nothing ready can be placed now.

    ``fit_any`` caches :func:`fits_any` per shape (the state drops it when workers change)."""
    by_shape = ready.by_shape
    best: Shape | None = None
    head: Entry | None = None
    cands: list[WorkerRecord] = []
    for shape in list(by_shape):
        heap = by_shape[shape]
        while heap and not _live(heap[0]):
            heapq.heappop(heap)
        if not heap:
            del by_shape[shape]
            continue
        if head is not None and heap[0][0] >= head[0]:
            continue
        ok = fit_any.get(shape)
        if ok is None:  # cache dropped when workers changed: recompute, never assume
            ok = fit_any[shape] = fits_any(workers.values(), shape)
        if not ok:
            return "park", shape, []
        c = [workers[w] for w in room
             if fits_on(workers[w], shape) and allowed(workers[w], shape, by_shape) and special_free(workers[w], shape)]
        if c:
            best, head, cands = shape, heap[0], c
    return None if best is None else ("place", best, cands)


def restricted_candidates(ts: TaskRecord, workers: Mapping[str, WorkerRecord], room: Collection[str],
                          ready: Mapping[Shape, list[Entry]]) -> list[WorkerRecord]:  # fmt: skip
    """Workers with room that a restricted ``ts`` may go to now."""
    out = []
    for wid in room:
        w = workers[wid]
        if matches(w, ts) and fits_on(w, ts.shape) and allowed(w, ts.shape, ready) and special_free(w, ts.shape):
            out.append(w)
    return out


def over_provisioned(workers: Mapping[str, WorkerRecord], room: Collection[str], ready: int) -> bool:
    """More free slots on the workers with room than ``ready`` tasks: placement packs."""
    free = 0
    for wid in room:
        w = workers[wid]
        free += max(0, w.slots - w.assigned)
        if free > ready:
            return True
    return False


def choose_worker(ts: TaskRecord, candidates: list[WorkerRecord], pack: bool = False) -> WorkerRecord:
    """The best of ``candidates`` (non-empty, all able to run ``ts``) for ``ts``; workers whose copy
    of ``ts`` went silent (``ts.avoid``) only when no other candidate is left.  ``pack``: the pool
    is over-provisioned, so fill partly used workers' free slots first (module docstring)."""
    if ts.avoid:
        elsewhere = [w for w in candidates if w.id not in ts.avoid]
        candidates = elsewhere or candidates
    if pack:
        free = [w for w in candidates if w.assigned < w.slots]
        candidates = free or candidates
        pack = bool(free)
    if len(candidates) == 1:
        return candidates[0]
    local: dict[str, int] = {}
    for dep in ts.deps:
        nb = dep.nbytes
        for wid in dep.who_has:
            local[wid] = local.get(wid, 0) + nb
    needs = frozenset(name for name, _ in ts.shape)
    rank = _pack_rank if pack else _rank
    best = candidates[0]
    best_key = rank(best, local, needs)
    for w in candidates[1:]:
        k = rank(w, local, needs)
        if k < best_key:
            best, best_key = w, k
    return best


def _rank(w: WorkerRecord, local: dict[str, int], needs: frozenset[str]) -> tuple[int, float, float, int, int]:
    waste = len(w.special - needs) if w.special else 0
    return (waste, -local.get(w.id, 0), w.occupancy / w.slots, w.assigned, w.seq)


def _pack_rank(w: WorkerRecord, local: dict[str, int], needs: frozenset[str]) -> tuple[int, float, float, int, int]:
    waste = len(w.special - needs) if w.special else 0
    free = w.slots - w.assigned
    return (waste, -local.get(w.id, 0), free, -len(w.processing), w.seq)


def copies_everywhere(keys: Iterable[str], tasks: Mapping[str, TaskRecord],
                      workers: Mapping[str, WorkerRecord], copies: int = 0) -> dict[str, list[str]]:  # fmt: skip
    """``broadcast``: for each running worker, the values of ``keys`` (in memory) it lacks; with
    ``copies`` > 0 (``replicate(n=)``) only enough of them that each value is held ``copies`` times,
    on the running workers holding the fewest bytes (planned copies counted), join order on ties."""
    asks: dict[str, list[str]] = {}
    running = [ws for ws in workers.values() if ws.state == "running"]
    planned: dict[str, int] = {}  # bytes this plan adds per worker
    for key in keys:
        ts = tasks.get(key)
        if ts is None or ts.state != "memory":
            continue
        lacking = [ws for ws in running if ws.id not in ts.who_has]
        if copies > 0:
            held = sum(1 for ws in running if ws.id in ts.who_has)
            lacking.sort(key=lambda w: (w.nbytes + planned.get(w.id, 0), w.seq))
            lacking = lacking[: max(0, copies - held)]
        for ws in lacking:
            asks.setdefault(ws.id, []).append(key)
            planned[ws.id] = planned.get(ws.id, 0) + ts.nbytes
    return asks


def plan_steals(workers: Mapping[str, WorkerRecord], overloaded: Iterable[str], room: Iterable[str],
                ready: Mapping[Shape, list[Entry]],
                estimate: Callable[[str], float]) -> dict[str, list[TaskRecord]]:  # fmt: skip
    """Idle slots, nothing ready for them: which queued tasks to ask back, per victim worker.
    ``estimate(group)``: a task group's estimated run time."""
    victims = [workers[w] for w in overloaded if w in workers and workers[w].state in ("running", "retiring")]
    if not victims:
        return {}
    idle = [workers[w] for w in sorted(room) if workers[w].assigned < workers[w].slots]
    if not idle:
        return {}
    victims.sort(key=lambda w: (-(w.assigned - w.slots), w.seq))
    asks: dict[str, list[TaskRecord]] = {}
    asked: set[TaskRecord] = set()
    for thief in idle:
        want = thief.slots - thief.assigned
        for victim in victims:
            if victim is thief or want <= 0:
                continue
            queued = victim.assigned - victim.slots
            take = min(want, (queued + 1) // 2)
            for ts in reversed(list(victim.processing)):  # the most recently queued first
                if take <= 0:
                    break
                if ts.executing or ts.stealing or ts.seceded or ts in asked or not fits_on(thief, ts.shape):
                    continue
                if ts.restrict is not None and not matches(thief, ts):
                    continue
                if not allowed(thief, ts.shape, ready) or not special_free(thief, ts.shape):
                    continue
                if transfer_outweighs(thief, ts, estimate(ts.group)):
                    continue
                asked.add(ts)
                asks.setdefault(victim.id, []).append(ts)
                take -= 1
                want -= 1
    return asks
