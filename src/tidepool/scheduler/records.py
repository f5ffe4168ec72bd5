"""Mutable records the scheduler state keeps per task and per worker (slotted for speed).

Memory per task matters (a million tasks must fit in well under 1 GiB, issue 25): a task record
has no ``__dict__``, and its collections (``dependents``, ``waiters``, ``waiting_on`` of task
records; ``who_has`` of worker ids, ``wanted_by`` of client ids) start as the shared empty
:data:`NOSET` (an empty set costs 216 bytes) and are changed only through its ``add_*``/``drop_*``
methods.  One is a tuple while it holds up to :data:`SMALL` items (a tuple of one costs 48 bytes,
of two 56; in a tree every task has one dependent and a sum two inputs, a value mostly has one
holder and one client) and a set beyond that, and :data:`NOSET` again once empty; an add or a drop
replaces a tuple (a set changes in place), so readers may only iterate them, test membership,
length and truth: never mutate one, compare one with a set or combine one with set operators.  A
task's one waiter is mostly its one dependent: ``add_waiter`` then shares the ``dependents``
tuple.  ``deps`` is a tuple of distinct records (intake drops an input given twice), empty until
intake gives it inputs.  Records hash and compare by identity (object's own, in C).  ``shape``
is shared between equal shapes (intake interns it), ``group`` and ``func_id`` are interned
strings, ``payload`` is kept as the bytes the client sent (:attr:`TaskRecord.spec_payload`
wraps it again when a worker needs it), and a failure is one :class:`TaskError` in one slot
(``error``; the dependents failing with it share it), read field by field through properties.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from tidepool.comm.serialize import Serialized
from tidepool.resources import Shape
from tidepool.scheduler.kinds import TaskState, WorkerState

#: resources every worker has; any other (gpu, fpga, licence, ...) is scarce and kept for tasks
#: that ask for it
ORDINARY = frozenset({"cpu", "memory"})

#: the empty set every task record's sets start as (shared: see the module docstring)
NOSET: Any = frozenset()

#: a task collection of up to this many tasks is a tuple, a larger one a set (module docstring)
SMALL = 8


#: a task collection (module docstring): NOSET, a tuple of up to SMALL distinct tasks, or a set
TaskSet: TypeAlias = "frozenset[TaskRecord] | tuple[TaskRecord, ...] | set[TaskRecord]"
#: the same for worker ids (``who_has``) and client ids (``wanted_by``)
StrSet: TypeAlias = frozenset[str] | tuple[str, ...] | set[str]


class TaskError:
    """Why a task failed: never changed once made, so the dependents failing with it share it.
    ``origin``: the key of the task that failed first ("" for an error intake found: a cycle or an
    unknown input, before the task was computed)."""

    __slots__ = ("exc_type", "message", "origin", "exception", "traceback")

    def __init__(self, exc_type: str, message: str, origin: str = "", exception: Serialized | None = None,
                 traceback: str = "") -> None:  # fmt: skip
        self.exc_type = exc_type
        self.message = message
        self.origin = origin
        self.exception = exception
        self.traceback = traceback

    def __repr__(self) -> str:
        return f"<TaskError {self.exc_type}: {self.message} (from {self.origin or '?'})>"


class TaskRecord:
    __slots__ = (
        "key", "func_id", "payload", "deps", "dependents", "waiters", "waiting_on", "state",
        "who_has", "nbytes", "worker", "shape", "retries_left", "suspicious", "wanted_by",
        "priority", "group", "error", "ready_seq", "started", "recomputes", "executing", "no_worker_since",
        "fetch_failures", "stealing", "seceded", "restrict", "loose", "avoid", "run", "memory_losses",
    )  # fmt: skip

    def __init__(self, key: str, func_id: str, payload: Serialized | bytes | None, shape: Shape,
                 retries: int, priority: int, group: str) -> None:  # fmt: skip
        #: workers whose copy of this value went silent: its recompute runs elsewhere if it can
        self.avoid: frozenset[str] | None = None
        self.key = key
        self.func_id = func_id
        #: the pickled arguments as the client sent them: bytes when they had no out-of-band buffers
        self.payload = payload
        self.deps: tuple[TaskRecord, ...] = ()  # distinct, in the order the client gave them
        # task collections (module docstring): iterate, test membership and truth; never mutate
        self.dependents: TaskSet = NOSET
        self.waiters: TaskSet = NOSET  # dependents not done yet that need our value
        self.waiting_on: TaskSet = NOSET  # our deps whose values are not available
        self.state: str = TaskState.RELEASED
        self.who_has: StrSet = NOSET
        self.nbytes = 0
        self.worker: str | None = None
        self.shape = shape
        self.retries_left = retries
        self.suspicious = 0
        self.wanted_by: StrSet = NOSET
        self.priority = priority
        self.group = group
        #: why it failed (None until it does, or until intake finds it cannot run)
        self.error: TaskError | None = None
        self.ready_seq = 0
        self.started = 0.0
        self.recomputes = 0
        #: times its only copy was lost because its holder restarted over its memory limit
        self.memory_losses = 0
        self.executing = False  # its worker reported it left the queue for a slot
        self.no_worker_since = 0.0
        self.fetch_failures = 0  # times a worker could not fetch this value from its holder
        self.stealing = False  # asked its worker to give it back (it was queued there)
        self.seceded = False  # left its slot to wait for other tasks (worker_client)
        self.restrict: frozenset[str] | None = None  # worker ids/names/addresses it may run on
        self.loose = False  # the restriction is only a preference (allow_other_workers)
        #: this record's serial, given at its first assignment (unique across scheduler restarts:
        #: ``SchedulerState`` starts its count at a random base), sent with each compute and echoed
        #: in the worker's outcome: an outcome of another record under the same key (released, then
        #: the key reused) is not this one's.  0: not assigned yet, or a run adopted from a
        #: rejoining worker, whose serial was another scheduler's: its outcome is taken whatever
        #: serial it carries, and its next assignment gets a serial of its own
        self.run = 0

    # ---- its error, field by field ("" and None without one) ------------------------------------
    @property
    def exception(self) -> Serialized | None:
        return self.error.exception if self.error is not None else None

    @property
    def traceback(self) -> str:
        return self.error.traceback if self.error is not None else ""

    @property
    def exc_type(self) -> str:
        return self.error.exc_type if self.error is not None else ""

    @property
    def message(self) -> str:
        return self.error.message if self.error is not None else ""

    @property
    def error_origin(self) -> str:
        return self.error.origin if self.error is not None else ""

    @property
    def needed(self) -> bool:
        return bool(self.waiters or self.wanted_by)

    @property
    def spec_payload(self) -> Serialized | None:
        """The payload as a worker takes it (a :class:`Serialized`)."""
        p = self.payload
        return Serialized(p) if type(p) is bytes else p  # type: ignore[return-value]

    # ---- the collections start shared and empty (module docstring): add through these ---------
    def add_dependent(self, ts: TaskRecord) -> None:
        self.dependents = _with(self.dependents, ts)

    def add_waiter(self, ts: TaskRecord) -> None:
        s = self.waiters
        if type(s) is set:
            s.add(ts)
        elif s is NOSET:
            d = self.dependents  # mostly the one dependent is the one waiter: share its tuple
            self.waiters = d if type(d) is tuple and len(d) == 1 and d[0] is ts else (ts,)  # type: ignore[assignment]
        else:
            self.waiters = _with(s, ts)

    def add_waiting_on(self, ts: TaskRecord) -> None:
        self.waiting_on = _with(self.waiting_on, ts)

    def add_holder(self, worker: str) -> None:
        self.who_has = _with(self.who_has, worker)

    def add_wanter(self, client: str) -> None:
        self.wanted_by = _with(self.wanted_by, client)

    # ---- ... and remove through these (an emptied one goes back to NOSET, freeing it) -------------
    def drop_dependent(self, ts: TaskRecord) -> None:
        s = self.dependents
        if ts in s:
            self.dependents = _without(s, ts)

    def drop_waiter(self, ts: TaskRecord) -> None:
        s = self.waiters
        if ts in s:
            self.waiters = _without(s, ts)

    def drop_waiting_on(self, ts: TaskRecord) -> None:
        s = self.waiting_on
        if ts in s:
            self.waiting_on = _without(s, ts)

    def drop_holder(self, worker: str) -> None:
        s = self.who_has
        if worker in s:
            self.who_has = _without(s, worker)

    def drop_wanter(self, client: str) -> None:
        s = self.wanted_by
        if client in s:
            self.wanted_by = _without(s, client)

    def __repr__(self) -> str:
        return f"<Task {self.key} {self.state}>"

    # equality and hashing are object identity (object's own, in C: no Python call per set lookup)


def small(items: list[TaskRecord] | tuple[TaskRecord, ...]) -> Any:
    """Distinct ``items`` as a task collection (module docstring): NOSET, a tuple or a set."""
    n = len(items)
    if n == 0:
        return NOSET
    return tuple(items) if n <= SMALL else set(items)


def _with(s: Any, x: Any) -> Any:
    """Collection ``s`` with ``x`` (module docstring): a set grows in place, a tuple is replaced
    (by a set past :data:`SMALL`)."""
    if type(s) is set:
        s.add(x)
        return s
    if x in s:
        return s
    return (*s, x) if len(s) < SMALL else {*s, x}


def _without(s: Any, x: Any) -> Any:
    """Collection ``s`` (holding ``x``) less ``x``: a set shrinks in place, a tuple is replaced;
    empty is NOSET."""
    if type(s) is set:
        s.discard(x)
        return s if s else NOSET
    if len(s) == 1:
        return NOSET
    i = s.index(x)
    return s[:i] + s[i + 1 :]


class WorkerRecord:
    __slots__ = (
        "id", "address", "resources", "node_type", "name", "state", "processing", "has_what",
        "nbytes", "occupancy", "slots", "last_seen", "idle_since", "joined", "seq", "metrics",
        "fit_cache", "memory_limit", "funcs", "executed", "last_done", "special", "seceded", "suspect",
        "abandoned", "abandoned_run", "special_used", "abandoned_special", "preparing",
    )  # fmt: skip

    def __init__(self, wid: str, address: str, resources: dict[str, float], node_type: str,
                 name: str, now: float, seq: int, memory_limit: int) -> None:  # fmt: skip
        self.id = wid
        self.address = address
        self.resources = resources
        self.node_type = node_type
        self.name = name or wid
        self.state: str = WorkerState.RUNNING
        self.processing: dict[TaskRecord, float] = {}
        self.has_what: set[TaskRecord] = set()
        self.nbytes = 0
        self.occupancy = 0.0
        self.slots = max(1, int(resources.get("cpu", 1)))
        self.last_seen = now
        self.idle_since: float | None = now
        self.joined = now
        self.seq = seq
        self.metrics: dict[str, Any] = {}
        self.fit_cache: dict[Shape, bool] = {}
        self.memory_limit = memory_limit
        self.funcs: set[str] = set()  # function ids already shipped to this worker
        self.executed = 0
        self.last_done = now  # when a task last left this worker (its queue head started then)
        #: scarce resources it offers (anything but cpu and memory, e.g. gpu): kept for tasks that need them
        self.special = frozenset(k for k, v in resources.items() if v > 0 and k not in ORDINARY)
        #: how much of each scarce resource the tasks in ``processing`` ask for: a task needing one
        #: goes only where enough of it is free (a 1-gpu worker with 4 cpus runs one gpu task at a
        #: time, so it must not take four while another gpu worker idles)
        self.special_used: dict[str, float] = {}
        #: key -> shape of the abandoned runs that hold scarce resources (counted in ``special_used``)
        self.abandoned_special: dict[str, Shape] = {}
        self.seceded = 0  # tasks in ``processing`` that left their slot (they do not count as load)
        self.preparing = False  # running setup hooks sent after it joined: given no new task meanwhile
        #: a peer's fetch from it stalled (no FIN, no bytes: frozen, or partitioned from its peers):
        #: it gets no new work until it is heard from again; it is not declared dead for that
        self.suspect = False
        #: runs taken back from it while they executed (cancelled, released), key -> the estimate
        #: counted in ``occupancy``: a thread cannot be stopped, so each holds its slot until the
        #: worker says it ended
        self.abandoned: dict[str, float] = {}
        #: key -> the serial (``TaskRecord.run``) of the record each abandoned run was for
        self.abandoned_run: dict[str, int] = {}

    @property
    def assigned(self) -> int:
        """Tasks that count against its slots: those assigned to it (running or queued) but for
        the ones that left their slot (``seceded``), and the runs nobody wants that still execute
        there (``abandoned``)."""
        return len(self.processing) - self.seceded + len(self.abandoned)

    def forget_tasks(self, now: float) -> None:
        """The scheduler restarted: nothing assigned, nothing held, idle since ``now``."""
        self.processing.clear()
        self.special_used.clear()
        self.abandoned_special.clear()
        self.abandoned.clear()
        self.abandoned_run.clear()
        self.has_what.clear()
        self.nbytes, self.occupancy, self.seceded = 0, 0.0, 0
        self.idle_since = now

    def __repr__(self) -> str:
        return f"<Worker {self.id} {self.state} processing={len(self.processing)} held={len(self.has_what)}>"
