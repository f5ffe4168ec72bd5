"""The worker's brain, sans I/O: ``WorkerState.handle(event) -> commands``.

Both shells drive it: the asyncio worker process (``worker/server.py``: sockets, threads, the spill
store on disk) and the simulator (``sim/engine.py``: a fake clock, durations from the workload).
So a fix to how a worker queues, fetches, spills or pauses changes real and simulated runs alike.

State
-----
- slots: ``free`` (resources not taken by running tasks), ``running`` (key -> task in a slot),
  ``seceded`` (running tasks that gave their slot back), ``cancelled`` (running tasks whose result
  nobody wants any more), ``lined`` (quick tasks lined up in a slot's lane, not known to have
  started: see "Quick tasks" below);
- the task queue: ``queue`` (assigned tasks whose inputs are here, in arrival order; its first
  ``blocked`` are known not to fit what is free, so a scan for tasks to start begins after them)
  and ``waiting`` (tasks whose inputs are being fetched: key -> inputs still missing);
- data: ``memory`` (key -> bytes, least recently used first) and ``spilled`` (key -> bytes, on
  disk); ``fetching`` (input key -> tasks waiting for it; None stands for a replica asked for);
  ``pinned`` (values that cannot be spilled) and ``spill_off`` (why spilling stopped for good);
- memory: ``limit``, ``thresholds``, ``paused`` (above the pause level: no new task starts),
  ``unmanaged`` (what the process used beyond its values at the last sample: the interpreter,
  libraries, buffers; the target for values is what the limit leaves after it);
  each running task's ``memory`` (what the task itself uses, when known: the simulator's traces).

Data flow
---------
Events come from the scheduler (:class:`Compute`, :class:`FreeKeys`, :class:`StealKeys`,
:class:`Replicate`, :class:`Secede`), from the shell's own machinery (:class:`TaskDone`,
:class:`FetchDone`, :class:`FetchFailed`, :class:`SpillFailed`, :class:`Unservable`) and from
the memory monitor (:class:`MemorySample`).  Commands tell the shell what to do: start a task in a
slot (:class:`Run`, or :class:`RunBatch` for a lane of quick tasks), take tasks back out of a lane
(:class:`Unline`), fetch an input (:class:`Fetch`), drop or spill values (:class:`Drop`,
:class:`Spill`), tell the scheduler (:class:`Report`: ``started`` always comes before the ``Run``
of the same tasks and the shell sends it at once, so a task that kills the process is blamed, not
its queue), send metrics now (:class:`SendMetrics`), or end the process over its memory limit
(:class:`Terminate`).

Quick tasks: a task whose function last ran in under ``QUICK`` seconds, making a result of at
most ``QUICK_BYTES``, is quick.  A quick task starts a *lane* (:class:`RunBatch`) with the quick tasks queued right behind it that need the same
resources and whose inputs are in memory, not on disk, and small (``QUICK_BYTES`` at most; up to ``BATCH``): one slot runs them one after another, pulling the next one only when
the previous one returned (one thread hand-off, one loop wake-up and one report message for the
lot).  A lane member is only taken when the slot reaches it; until then it is ``lined``: a
``FreeKeys`` or ``StealKeys`` takes it back out (:class:`Unline`, answered by :class:`Unlined`,
which says which ones the slot had already taken) and it never runs there, and it is not reported
started.  A quick task's ``started`` is never sent: its outcome says it.  The lane is cut (the rest
goes back to the front of the queue, to run unbatched if its function is no longer quick) when a
member ran ``QUICK`` or longer or made a result over ``QUICK_BYTES``, when one runs ``LONG`` and still has not returned
(:class:`RunsLong`, from the shell's clock; that one is reported started then), and when one
secedes.  The slot is free again once the lane is empty and its taken members ended.  So a quick
task that kills the process is not blamed by that crash; the scheduler then sends every task that
was on the dead worker ``solo`` (never quick: ``started`` first), so the next crash blames exactly
the task that ran.  A task whose function never ran here is never quick.

Memory rules (levels in ``worker/memory.py``, fractions of ``limit``): values held in memory past
``target`` spill, least recently used first, as they are stored; the monitor's samples go through
the pure :func:`~tidepool.worker.memory.memory_action`: above ``spill`` more values spill, above
``pause`` no new task starts (one at a time if nothing runs; open lanes are cut), below it again
the worker resumes, above ``terminate`` it ends (and restarts when it can).  A value read from
disk stays there.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.resources import Shape, fits
from tidepool.worker.memory import Action, MemoryThresholds, memory_action

Holders = tuple[tuple[str, str], ...]  # ((worker id, address), ...)


# ---- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TaskIn:
    """A task the scheduler assigned: its inputs (key -> who holds them), resources, and the
    memory it uses while it runs (0: unknown; the real process measures instead)."""

    key: str
    deps: Mapping[str, Holders] = field(default_factory=dict)
    resources: Shape = ()
    memory: int = 0
    #: its function's id: tasks of a function that last ran in under ``QUICK`` seconds run in
    #: batches (``""``: never batched, as in the simulator)
    func: str = ""
    #: never in a batch (the scheduler says so after a worker died while it ran: blame stays exact)
    solo: bool = False
    #: the scheduler's serial of the task record (echoed in its outcome report): a key released and
    #: given to another record while its old run still executes here is not that run (None: the
    #: same task whenever the key is, as in the simulator)
    ident: int | None = None


@dataclass(frozen=True, slots=True)
class Compute:
    tasks: tuple[TaskIn, ...]


@dataclass(frozen=True, slots=True)
class FreeKeys:
    """Drop values; a queued task freed never runs, a running one's result is dropped."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StealKeys:
    """The scheduler wants these back (for an idle worker): give those not started yet."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Replicate:
    """Copy ``key`` here from one of ``holders`` (retirement, broadcast)."""

    key: str
    holders: Holders


@dataclass(frozen=True, slots=True)
class Secede:
    """A running task gives its slot back (it waits on other tasks)."""

    key: str


@dataclass(frozen=True, slots=True)
class RunsLong:
    """The slot running lane member ``key`` has been in it for ``LONG`` seconds or more (the
    shell's clock says so): it started, and the rest of its lane should not wait behind it."""

    key: str


@dataclass(frozen=True, slots=True)
class Unlined:
    """The shell's answer to :class:`Unline`: ``removed`` were taken out of lane ``lane`` before
    its slot reached them (they never ran), ``taken`` had been reached already (they run or ran)."""

    lane: int
    removed: tuple[str, ...]
    taken: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class TaskDone:
    """A slot finished ``key``: its value (``nbytes``; the shell keeps it until told to
    :class:`Store` it) or its error (``error``: the report's fields)."""

    key: str
    ok: bool
    nbytes: int = 0
    duration: float = 0.0
    error: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class FetchDone:
    """``key`` arrived from a peer (the shell keeps it until told to :class:`Store` it)."""

    key: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class FetchFailed:
    """``key`` could not be had: ``kind`` is ``missing`` (no holder has it), ``silent`` (a holder
    stalled: suspect, not dead) or ``broken`` (it exists but cannot reach us)."""

    key: str
    kind: str
    why: str
    holder: str = ""


@dataclass(frozen=True, slots=True)
class SpillFailed:
    """``keys`` could not be spilled and stay in memory; ``disabled``: spilling is off for good."""

    keys: tuple[str, ...]
    disabled: str = ""


@dataclass(frozen=True, slots=True)
class Unservable:
    """The data server could never send ``key`` (pickling, frame limit): it was dropped."""

    key: str
    exc_type: str
    message: str


@dataclass(frozen=True, slots=True)
class MemorySample:
    """The process's resident memory now."""

    rss: int


@dataclass(frozen=True, slots=True)
class MakeRoom:
    """About ``nbytes`` more must fit in memory (a spilled value is to be read back): spill values
    held in memory, least recently used first."""

    nbytes: float


Event = Compute | FreeKeys | StealKeys | Replicate | Secede | TaskDone | FetchDone | FetchFailed | SpillFailed \
    | Unservable | MemorySample | RunsLong | Unlined | MakeRoom  # fmt: skip


# ---- commands ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    """Start ``key`` in a slot now (its inputs are held here; its ``started`` was reported)."""

    key: str


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Open lane ``lane`` in a slot: run ``keys`` one after another, taking each only when the
    previous one returned (quick tasks: one hand-off to a thread, one wake-up of the loop for the
    lot).  Answer :class:`Unline` for it until the slot has taken every key."""

    lane: int
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Unline:
    """Take ``keys`` out of lane ``lane`` if its slot has not reached them; answer at once with
    :class:`Unlined` (passing ``why`` back: ``free``, ``steal`` or ``cut``)."""

    lane: int
    keys: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Fetch:
    """Copy ``key`` from one of ``holders``; answer with :class:`FetchDone` or :class:`FetchFailed`."""

    key: str
    holders: Holders


@dataclass(frozen=True, slots=True)
class Store:
    """Keep the value of ``key`` that just arrived (a result, or a copy from a peer)."""

    key: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Drop:
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Spill:
    """Move ``keys`` from memory to disk (answer with :class:`SpillFailed` for those that stay)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Report:
    """Tell the scheduler: ``kind`` is a field of the worker's ``task-batch`` message
    (``started``, ``finished``, ``erred``, ``missing``, ``replicas``, ``unservable``, ``stolen``,
    ``kept``, ``seceded``) and ``item`` one entry of it."""

    kind: str
    item: Any


@dataclass(frozen=True, slots=True)
class SendMetrics:
    """Paused or resumed: the scheduler should hear now, not at the next heartbeat."""

    paused: bool


@dataclass(frozen=True, slots=True)
class Terminate:
    """Over the terminate level: end the process (it restarts when it can)."""

    rss: int


Command = Run | RunBatch | Unline | Fetch | Store | Drop | Spill | Report | SendMetrics | Terminate


class _Lane:
    """A slot running quick tasks one after another: ``lane`` holds the members it has not reached
    (as far as the state knows), ``running`` counts those it took that have not ended (seceded ones
    left it).  Its slot (``resources``) is held until both are empty."""

    __slots__ = ("id", "resources", "lane", "running")

    def __init__(self, lane_id: int, resources: Shape) -> None:
        self.id = lane_id
        self.resources = resources
        self.lane: deque[_Task] = deque()
        self.running = 0


class _Task:
    __slots__ = ("key", "deps", "resources", "memory", "missing", "func", "solo", "batch", "long", "ident")

    def __init__(self, t: TaskIn) -> None:
        self.key = t.key
        self.deps = t.deps
        self.resources = t.resources
        self.memory = t.memory
        self.missing: set[str] = set()
        self.func = t.func
        self.solo = t.solo
        self.batch: _Lane | None = None  # the lane it is lined in or runs in
        self.long = False  # a lane member reported running LONG (started, its lane cut)
        self.ident = t.ident


#: a function whose last run took less than this (seconds) is quick: its queued tasks run in batches
QUICK = 0.002
#: ... and whose last result was at most this big (bytes): a lane's results wait for the loop to
#: store them (and spill them) while the slot runs the next member, so a lane of large results could
#: pass the memory limit between two samples (32 members making 20 MiB each on a 1 GB worker)
QUICK_BYTES = 2**20
#: at most this many tasks in one lane (so a lane holds its slot for about ``BATCH * QUICK`` s)
BATCH = 32
#: a lane member still running after this long (seconds) is reported started and its lane is cut
LONG = 0.01


class WorkerState:
    """One worker's decisions; see the module docstring."""

    def __init__(self, resources: Mapping[str, float], *, limit: int = 0,
                 thresholds: MemoryThresholds | None = None) -> None:  # fmt: skip
        self.resources = dict(resources)
        self.free = dict(resources)
        self.limit = limit
        self.thresholds = thresholds or MemoryThresholds()
        self.queue: deque[_Task] = deque()
        self.queued: set[str] = set()  # keys in ``queue``
        #: the first ``blocked`` queued tasks do not fit in ``free`` (until resources are freed or
        #: the queue's front changes): a scan for tasks to start begins after them
        self.blocked = 0
        self.waiting: dict[str, _Task] = {}
        self.running: dict[str, _Task] = {}
        self.seceded: set[str] = set()
        self.cancelled: set[str] = set()
        #: a key released while its run executes (``cancelled``) or while it is lined and the
        #: shell has not answered the ``Unline`` yet (``unlining``), then assigned again as a
        #: different task (another function or arguments under a reused key): the new task waits
        #: here until the old run is over, so the old run's value is never reported as the new one's
        self.superseded: dict[str, TaskIn] = {}
        self.unlining: set[str] = set()
        self.memory: dict[str, int] = {}  # in memory, least recently used first
        self._memory_bytes = 0  # the sum of ``memory`` (kept as it changes: read on every store)
        self.spilled: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.spill_off = "" if limit else "no memory limit"
        self.fetching: dict[str, list[str | None]] = {}
        self.paused = False
        self.unmanaged = 0  # resident bytes beyond the values held, at the last memory sample
        self.executed = 0
        self.last_run: dict[str, float] = {}  # function id -> seconds its last successful run took
        self.lined: dict[str, _Task] = {}  # quick tasks in a lane, not known to be reached
        self._lane_ids = itertools.count()
        self._handlers: dict[type, Any] = {
            Compute: self._compute, FreeKeys: self._free, StealKeys: self._steal, Replicate: self._replicate,
            Secede: self._secede, TaskDone: self._done, FetchDone: self._fetched, FetchFailed: self._fetch_failed,
            SpillFailed: self._spill_failed, Unservable: self._unservable, MemorySample: self._memory,
            RunsLong: self._runs_long, Unlined: self._unlined, MakeRoom: self._make_room,
        }  # fmt: skip

    # ---- queries ---------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self.memory or key in self.spilled

    def nbytes(self, key: str) -> int:
        return self.memory.get(key, 0) or self.spilled.get(key, 0)

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    @property
    def spilled_bytes(self) -> int:
        return sum(self.spilled.values())

    def watched(self, key: str) -> bool:
        """``key`` is lined, or runs in its lane and was not reported running ``LONG``: a
        :class:`RunsLong` for it would change something (the shell's lane clock watches it)."""
        if key in self.lined:
            return True
        t = self.running.get(key)
        return t is not None and t.batch is not None and not t.long

    @property
    def task_memory(self) -> int:
        """What the running tasks themselves use (as far as their specs say)."""
        return sum(t.memory for t in self.running.values())

    # ---- events ----------------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Command]:
        out: list[Command] = []
        self._handlers[type(event)](event, out)
        return out

    def _compute(self, e: Compute, out: list[Command]) -> None:
        for ti in e.tasks:
            key = ti.key
            if key in self.running:
                if key in self.cancelled:
                    if self.running[key].ident == ti.ident:  # the same task again while still running:
                        self.cancelled.discard(key)  # keep that run, and say it executes (the
                        out.append(Report("started", key))  # scheduler counts on its "started")
                    else:  # another task under the released key: after the old run
                        self.superseded[key] = ti
                continue
            if key in self.unlining:  # freed in its lane, the shell's answer not here yet: whatever
                self.superseded[key] = ti  # ran there is the released task's, this one runs after
                continue
            if key in self.lined:
                continue
            if key in self.waiting or key in self.queued:
                continue  # assigned again while it waits here: it runs once
            if key in self:
                out.append(Report("finished", _finished(key, self.nbytes(key), 0.0, ti.ident)))
                continue
            t = _Task(ti)
            t.missing = {d for d in ti.deps if d not in self}
            if not t.missing:
                self.queue.append(t)
                self.queued.add(key)
                continue
            self.waiting[key] = t
            for d in sorted(t.missing):
                self._need(d, ti.deps[d], key, out)
        self._start_ready(out)

    def _need(self, key: str, holders: Holders, task: str | None, out: list[Command]) -> None:
        waiters = self.fetching.get(key)
        if waiters is not None:
            waiters.append(task)
            return
        self.fetching[key] = [task]
        out.append(Fetch(key, holders))

    def _free(self, e: FreeKeys, out: list[Command]) -> None:
        dropped = []
        superseded = self.superseded
        for k in e.keys:
            if superseded:
                superseded.pop(k, None)
            if k in self:
                self._memory_bytes -= self.memory.pop(k, 0)
                self.spilled.pop(k, None)
                self.pinned.discard(k)
                dropped.append(k)
            if k in self.running:
                self.cancelled.add(k)
            elif k in self.waiting:
                del self.waiting[k]
        if self.lined:
            freed = [k for k in e.keys if k in self.lined]
            self.unlining.update(freed)
            self._unline(freed, "free", out)
        if self.queue:
            ks = set(e.keys)  # one set, not a list scan per queued task (cancelling 10,000 at once)
            if not ks.isdisjoint(self.queued):
                self.queue = deque(t for t in self.queue if t.key not in ks)
                self.queued -= ks
                self.blocked = 0
        if dropped:
            out.append(Drop(tuple(dropped)))
        self._start_ready(out)

    def _steal(self, e: StealKeys, out: list[Command]) -> None:
        ks = set(e.keys)
        stolen = [t.key for t in self.queue if t.key in ks] if not ks.isdisjoint(self.queued) else []
        if stolen:
            self.queue = deque(t for t in self.queue if t.key not in ks)
            self.queued -= ks
            self.blocked = 0
        for k in e.keys:
            if k in self.waiting:  # still fetching inputs: the fetch finishes for nobody
                del self.waiting[k]
                stolen.append(k)
            elif self.superseded.pop(k, None) is not None:  # waits behind a released run: not started
                stolen.append(k)
        lined = [k for k in e.keys if k in self.lined] if self.lined else []
        got = set(stolen).union(lined)  # lined: the shell's Unlined answer says stolen or kept
        out.extend(Report("stolen", k) for k in stolen)
        out.extend(Report("kept", k) for k in e.keys if k not in got)
        self._unline(lined, "steal", out)

    def _replicate(self, e: Replicate, out: list[Command]) -> None:
        if e.key not in self:
            self._need(e.key, e.holders, None, out)

    def _secede(self, e: Secede, out: list[Command]) -> None:
        if e.key in self.lined:  # its slot reached it (it secedes from there)
            self._taken(self.lined[e.key])
        t = self.running.get(e.key)
        if t is None or e.key in self.seceded:
            return
        self.seceded.add(e.key)
        b = t.batch
        if b is None:
            for name, amount in t.resources:
                self.free[name] = self.free.get(name, 0.0) + amount
            self.blocked = 0
        else:  # it leaves its lane, and the lane's rest does not wait for it
            t.batch = None
            b.running -= 1
            self._cut(b, out)
            self._lane_check(b)
        out.append(Report("seceded", e.key))
        self._start_ready(out)

    def _done(self, e: TaskDone, out: list[Command]) -> None:
        t = self.running.pop(e.key, None)
        if t is None and e.key in self.lined:  # its slot reached it and it ended at once
            t = self.lined.pop(e.key)
            b = t.batch
            assert b is not None
            b.lane.remove(t)
            b.running += 1
        if e.key in self.seceded:
            self.seceded.discard(e.key)  # its resources went back when it seceded
        elif t is not None:
            big = e.ok and e.nbytes > QUICK_BYTES
            if e.ok and t.func:
                self.last_run[t.func] = e.duration if not big else float("inf")  # a large result: never quick
            b = t.batch
            if b is None:
                for name, amount in t.resources:
                    self.free[name] = self.free.get(name, 0.0) + amount
                self.blocked = 0
            else:
                t.batch = None
                b.running -= 1
                if e.duration >= QUICK or big:  # not quick after all: the rest is not held behind the next one
                    self._cut(b, out)
                self._lane_check(b)
        if e.key in self.cancelled or e.key in self.unlining:  # freed (a lined one: before the
            self.cancelled.discard(e.key)  # shell's answer): nobody wants the result, it is not kept
            out.append(Report("ended", e.key))  # but the scheduler counts its slot busy until now
            if self.superseded:
                self._resume(e.key, out)
        elif e.ok:
            self.executed += 1
            self._store(e.key, e.nbytes, out)
            out.append(Report("finished", _finished(e.key, e.nbytes, e.duration, t.ident if t is not None else None)))
        elif t is not None:
            self.executed += 1
            err = dict(e.error or {}, key=e.key)
            if t.ident is not None:
                err["run"] = t.ident
            out.append(Report("erred", err))
        self._start_ready(out)

    # ---- lanes of quick tasks --------------------------------------------------------------------
    def _taken(self, t: _Task) -> None:
        """Lined ``t`` was reached by its slot: it runs there."""
        del self.lined[t.key]
        b = t.batch
        assert b is not None
        b.lane.remove(t)
        b.running += 1
        self.running[t.key] = t

    def _unline(self, keys: list[str], why: str, out: list[Command]) -> None:
        by_lane: dict[int, list[str]] = {}
        for k in keys:
            b = self.lined[k].batch
            assert b is not None
            by_lane.setdefault(b.id, []).append(k)
        out.extend(Unline(lane, tuple(ks), why) for lane, ks in by_lane.items())

    def _cut(self, b: _Lane, out: list[Command]) -> None:
        if b.lane:
            out.append(Unline(b.id, tuple(t.key for t in b.lane), "cut"))

    def _lane_check(self, b: _Lane) -> None:
        """The lane's slot is free once nothing is lined in it and nothing it took still runs."""
        if not b.running and not b.lane:
            for name, amount in b.resources:
                self.free[name] = self.free.get(name, 0.0) + amount
            self.blocked = 0
            b.running = -1  # released (never again)

    def _runs_long(self, e: RunsLong, out: list[Command]) -> None:
        t = self.lined.get(e.key)
        if t is not None:
            self._taken(t)
        else:  # taken already (an Unlined answer said so: a cut, a free or a steal): still in its lane
            t = self.running.get(e.key)
            if t is None or t.batch is None or t.long:
                return  # ended, left its lane (seceded) or reported already
        b = t.batch
        assert b is not None
        t.long = True
        out.append(Report("started", e.key))  # the scheduler hears it executes (crash blame, cancel)
        self._cut(b, out)

    def _unlined(self, e: Unlined, out: list[Command]) -> None:
        back: list[_Task] = []
        b: _Lane | None = None
        for k in e.taken:
            t = self.lined.get(k)
            if t is None:
                continue
            b = t.batch
            self._taken(t)
            if e.why == "free":
                self.cancelled.add(k)  # it runs; nobody wants its result
            elif e.why == "steal":
                out.append(Report("kept", k))
        for k in e.removed:
            t = self.lined.pop(k, None)
            if t is None:
                continue
            b = t.batch
            assert b is not None
            b.lane.remove(t)
            t.batch = None
            if e.why == "cut":
                back.append(t)
            elif e.why == "steal":
                out.append(Report("stolen", k))
        if back:  # first in the queue again, in their order
            self.queue.extendleft(reversed(back))
            self.blocked = 0
            self.queued.update(t.key for t in back)
        if b is not None:
            self._lane_check(b)
        if e.why == "free" and self.unlining:
            for k in (*e.taken, *e.removed):
                self.unlining.discard(k)
                if self.superseded:
                    self._resume(k, out)
        self._start_ready(out)

    def _resume(self, key: str, out: list[Command]) -> None:
        """The released run of ``key`` is over: the task that took its key meanwhile may start."""
        if key in self.running or key in self.lined or key in self.unlining:
            return
        ti = self.superseded.pop(key, None)
        if ti is not None:
            self._compute(Compute((ti,)), out)

    def _fetched(self, e: FetchDone, out: list[Command]) -> None:
        waiters = self.fetching.pop(e.key, [])
        self._store(e.key, e.nbytes, out)
        out.append(Report("replicas", [e.key, e.nbytes]))
        for tk in waiters:
            t = self.waiting.get(tk) if tk is not None else None
            if t is None:
                continue  # a replica asked for, or the task was freed or stolen meanwhile
            t.missing.discard(e.key)
            if not t.missing:
                del self.waiting[tk]  # type: ignore[arg-type]
                self.queue.append(t)
                self.queued.add(t.key)
        self._start_ready(out)

    def _fetch_failed(self, e: FetchFailed, out: list[Command]) -> None:
        for tk in self.fetching.pop(e.key, []):
            t = self.waiting.pop(tk, None) if tk is not None else None
            if t is None:
                continue
            if e.kind == "broken":  # the value exists but cannot reach us: fail, do not recompute
                out.append(Report("erred", {
                    "key": t.key, "exception": None, "traceback": "", "type": "SerializationError",
                    "message": f"input {e.key!r} of task {t.key!r} could not be transferred: {e.why}",
                    "duration": 0.0}))  # fmt: skip
            else:  # "missing" or "silent" (a stalled holder: suspect, not dead)
                out.append(Report("missing", [t.key, e.key, e.holder, e.why, e.kind == "silent"]))

    def _unservable(self, e: Unservable, out: list[Command]) -> None:
        if e.key in self:
            self._memory_bytes -= self.memory.pop(e.key, 0)
            self.spilled.pop(e.key, None)
            self.pinned.discard(e.key)
            out.append(Drop((e.key,)))
        out.append(Report("unservable", [e.key, e.exc_type, e.message]))

    # ---- slots -----------------------------------------------------------------------------------
    def _start_ready(self, out: list[Command]) -> None:
        q = self.queue
        i = self.blocked  # tasks before it do not fit: less is free now than when they were looked at
        if len(q) <= i or (self.paused and (self.running or self.lined)):
            return
        # paused with nothing running: the memory is not ours to spill (unmanaged, or the
        # allocator's); run one task at a time rather than wait forever (the terminate level guards)
        one = self.paused
        started: list[_Task] = []
        runs: list[Command] = []
        while i < len(q) and i <= 64:  # tasks that do not fit are skipped, up to 65 of them
            t = q[i]
            if not fits(self.free, t.resources):
                i += 1
                continue
            del q[i]
            self.queued.discard(t.key)
            gone = [d for d in t.deps if d not in self]
            if gone:  # an input was freed here while the task queued: the scheduler reschedules it
                out.append(Report("missing", [t.key, gone[0], "", "the input was dropped on this worker "
                                                                  "before the task started"]))  # fmt: skip
                continue
            for name, amount in t.resources:
                self.free[name] = self.free.get(name, 0.0) - amount
            for d in t.deps:  # just used: most recently used now
                nb = self.memory.pop(d, None)
                if nb is not None:
                    self.memory[d] = nb
            if self._quick(t):  # a lane: nothing is reported started, it is taken as the slot reaches it
                b = _Lane(next(self._lane_ids), t.resources)
                self._line(b, t)
                if not one:
                    self._batch(b, i)
                runs.append(RunBatch(b.id, tuple(m.key for m in b.lane)))
            else:
                self.running[t.key] = t
                started.append(t)
                runs.append(Run(t.key))
            if one:
                break
        self.blocked = i
        if started:
            out.extend(Report("started", t.key) for t in started)  # before any of them can crash us
        out.extend(runs)

    def _quick(self, t: _Task) -> bool:
        last = self.last_run.get(t.func) if t.func and not t.solo else None
        return last is not None and last < QUICK

    def _line(self, b: _Lane, t: _Task) -> None:
        t.batch = b
        b.lane.append(t)
        self.lined[t.key] = t

    def _batch(self, b: _Lane, i: int) -> None:
        """Line up behind the lane's first task the next queued ones while they are quick, need the
        same resources and have their inputs in memory and at most ``QUICK_BYTES`` each: up to ``BATCH`` in all, and no more than this
        lane's share of the queue when other slots are free for the same shape (no slot idles
        while one lane holds the queue's last tasks)."""
        q = self.queue  # its first task was at ``i``: the next ones are there now
        slots = 1 + min((int(self.free.get(name, 0.0) // amount) for name, amount in b.resources if amount > 0),
                        default=0)  # fmt: skip
        most = min(BATCH, -(-(len(q) - i + 1) // slots))
        while i < len(q) and len(b.lane) < most:
            t = q[i]
            # its inputs in memory: the shell reads a lane's inputs as it opens it, so one on disk
            # would come back into memory long before the slot reaches its task
            # and small: the shell holds a lined task's inputs until the slot reaches it, so spilling
            # them would free nothing (32 members reading 10 MiB each held 320 MiB on a 300 MB worker)
            memory = self.memory
            if t.resources != b.resources or not self._quick(t) or \
                    any(memory.get(d, QUICK_BYTES + 1) > QUICK_BYTES for d in t.deps):  # fmt: skip
                break
            del q[i]
            self.queued.discard(t.key)
            for d in t.deps:
                nb = self.memory.pop(d, None)
                if nb is not None:
                    self.memory[d] = nb
            self._line(b, t)

    # ---- memory ----------------------------------------------------------------------------------
    def _store(self, key: str, nbytes: int, out: list[Command]) -> None:
        self.spilled.pop(key, None)
        self._memory_bytes += nbytes - self.memory.pop(key, 0)
        self.memory[key] = nbytes
        out.append(Store(key, nbytes))
        if self.limit and not self.spill_off:
            # the process's own memory counts: values alone up to the target left a survivor taking
            # a retiring worker's data (a bug hunt: 150 MiB into 191) past the terminate level
            # (at most three quarters of the target: one sample taken while a task's temporaries or
            # memory the allocator kept were counted must not make every later store spill everything)
            room = self.limit * self.thresholds.target
            self._spill(self.memory_bytes + min(self.unmanaged, 0.75 * room) - room, out)

    def _spill(self, nbytes: float, out: list[Command]) -> None:
        """Spill least recently used values until about ``nbytes`` left memory."""
        if nbytes <= 0 or self.spill_off:
            return
        keys = []
        for k, nb in self.memory.items():
            if nbytes <= 0:
                break
            if k in self.pinned:
                continue
            keys.append(k)
            nbytes -= nb
        for k in keys:
            nb = self.spilled[k] = self.memory.pop(k)
            self._memory_bytes -= nb
        if keys:
            out.append(Spill(tuple(keys)))

    def _make_room(self, e: MakeRoom, out: list[Command]) -> None:
        self._spill(e.nbytes, out)

    def _spill_failed(self, e: SpillFailed, out: list[Command]) -> None:
        for k in e.keys:
            nb = self.spilled.pop(k, None)
            if nb is not None:
                self.memory[k] = nb
                self._memory_bytes += nb
                if not e.disabled:
                    self.pinned.add(k)  # cannot be pickled: never tried again
        if e.disabled:
            self.spill_off = e.disabled

    def _spilling_saves(self, rss: int) -> bool:
        """Would spilling every value held in memory (but the pinned) bring ``rss`` under the
        terminate level?  (Nothing left to spill, or spilling off: no.)"""
        if self.spill_off:
            return False
        spillable = sum(nb for k, nb in self.memory.items() if k not in self.pinned)
        return spillable > 0 and rss - spillable < self.thresholds.terminate * self.limit

    def _memory(self, e: MemorySample, out: list[Command]) -> None:
        self.unmanaged = max(0, e.rss - self._memory_bytes)
        action = memory_action(e.rss, self.limit, self.thresholds, self.paused)
        if action is Action.TERMINATE:
            if not self._spilling_saves(e.rss):
                out.append(Terminate(e.rss))
                return
            # a jump past the terminate level (a value of half the limit read back from disk while
            # another sits in memory) that spilling what is stored brings back under it: spill and
            # pause; the next sample, after the spill, terminates if that was not enough
            action = Action.SPILL if self.paused else Action.PAUSE
        if action in (Action.SPILL, Action.PAUSE):
            self._spill(e.rss - self.thresholds.target * self.limit, out)
        if action is Action.PAUSE and not self.paused:
            self.paused = True
            out.append(SendMetrics(True))
            # a lane's members its slot has not reached are new tasks too: back to the queue
            for b in {id(t.batch): t.batch for t in self.lined.values() if t.batch is not None}.values():
                self._cut(b, out)
        elif action is Action.RESUME and self.paused:
            self.paused = False
            out.append(SendMetrics(False))
            self._start_ready(out)

    # ---- invariants (tests) ------------------------------------------------------------------
    def validate(self) -> None:
        """Check the bookkeeping; raises AssertionError on an inconsistency."""
        assert not set(self.memory) & set(self.spilled), "a value both in memory and on disk"
        assert self._memory_bytes == sum(self.memory.values()), "memory bytes"
        assert self.pinned <= set(self.memory), "a pinned value not in memory"
        queued = [t.key for t in self.queue]
        assert len(queued) == len(set(queued)) and set(queued) == self.queued, "a task queued twice"
        assert self.blocked <= len(queued) and not any(fits(self.free, t.resources) for t in
                                                      itertools.islice(self.queue, self.blocked)), "blocked fits"
        places = [set(queued), set(self.waiting), set(self.running), set(self.lined)]
        for i, a in enumerate(places):
            for b in places[i + 1:]:
                assert not a & b, ("a task in two places", a & b)
        assert self.seceded <= set(self.running) and self.cancelled <= set(self.running)
        assert set(self.superseded) <= self.cancelled | self.unlining, "a superseding task with nothing before it"
        used: dict[str, float] = {}
        lanes: dict[int, _Lane] = {}
        for k, t in self.lined.items():
            lane = t.batch
            assert lane is not None and t in lane.lane and lane.running >= 0, ("lined outside an open lane", k)
            lanes[lane.id] = lane
        for k, t in self.running.items():
            lane = t.batch
            if lane is not None:
                assert k not in self.seceded and lane.running > 0, ("runs in a closed lane", k)
                lanes[lane.id] = lane
            elif k not in self.seceded:
                for name, amount in t.resources:
                    used[name] = used.get(name, 0.0) + amount
        for lane in lanes.values():  # a lane holds its slot once
            assert sorted(t.key for t in lane.lane) == sorted(k for k, t in self.lined.items() if t.batch is lane), ("lane", lane.id)
            assert lane.running == sum(1 for t in self.running.values() if t.batch is lane), ("lane count", lane.id)
            for name, amount in lane.resources:
                used[name] = used.get(name, 0.0) + amount
        for name, total in self.resources.items():
            assert abs(self.free.get(name, 0.0) + used.get(name, 0.0) - total) < 1e-9, ("slots leak", name)
        for k, t in self.waiting.items():
            assert t.missing and all(d in self.fetching for d in t.missing), ("waits for nothing fetched", k)


def tasks_in(items: Iterable[tuple[str, Mapping[str, Holders], Shape, int]]) -> Compute:
    """A :class:`Compute` from ``(key, deps, resources, memory)`` tuples."""
    return Compute(tuple(TaskIn(k, d, r, m) for k, d, r, m in items))


def _finished(key: str, nbytes: int, duration: float, run: int | None) -> list[Any]:
    """A finished report's item: [key, nbytes, duration], then [inline pickle (the shell fills it
    in), serial of the task record] when the scheduler gave a serial."""
    return [key, nbytes, duration] if run is None else [key, nbytes, duration, None, run]
