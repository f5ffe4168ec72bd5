"""Mutable records the scheduler state keeps per task and per worker (slotted for speed)."""

from __future__ import annotations

from typing import Any

from tidepool.comm.serialize import Serialized
from tidepool.resources import Shape
from tidepool.scheduler.kinds import TaskState, WorkerState

#: resources every worker has; any other (gpu, fpga, licence, ...) is scarce and kept for tasks
#: that ask for it
ORDINARY = frozenset({"cpu", "memory"})


class TaskRecord:
    __slots__ = (
        "key", "func_id", "payload", "deps", "dependents", "waiters", "waiting_on", "state",
        "who_has", "nbytes", "worker", "shape", "retries_left", "suspicious", "wanted_by",
        "priority", "group", "exception", "traceback", "exc_type", "message", "error_origin",
        "est", "ready_seq", "started", "duration", "recomputes", "executing", "no_worker_since",
        "fetch_failures", "stealing", "seceded", "restrict", "loose", "avoid",
    )  # fmt: skip

    def __init__(self, key: str, func_id: str, payload: Serialized | None, shape: Shape,
                 retries: int, priority: int, group: str) -> None:  # fmt: skip
        #: workers whose copy of this value went silent: its recompute runs elsewhere if it can
        self.avoid: frozenset[str] | None = None
        self.key = key
        self.func_id = func_id
        self.payload = payload
        self.deps: list[TaskRecord] = []
        self.dependents: set[TaskRecord] = set()
        self.waiters: set[TaskRecord] = set()  # dependents not done yet that need our value
        self.waiting_on: set[TaskRecord] = set()  # our deps whose values are not available
        self.state: str = TaskState.RELEASED
        self.who_has: set[str] = set()
        self.nbytes = 0
        self.worker: str | None = None
        self.shape = shape
        self.retries_left = retries
        self.suspicious = 0
        self.wanted_by: set[str] = set()
        self.priority = priority
        self.group = group
        self.exception: Serialized | None = None
        self.traceback = ""
        self.exc_type = ""
        self.message = ""
        self.error_origin = ""
        self.est = 0.0
        self.ready_seq = 0
        self.started = 0.0
        self.duration = 0.0
        self.recomputes = 0
        self.executing = False  # its worker reported it left the queue for a slot
        self.no_worker_since = 0.0
        self.fetch_failures = 0  # times a worker could not fetch this value from its holder
        self.stealing = False  # asked its worker to give it back (it was queued there)
        self.seceded = False  # left its slot to wait for other tasks (worker_client)
        self.restrict: frozenset[str] | None = None  # worker ids/names/addresses it may run on
        self.loose = False  # the restriction is only a preference (allow_other_workers)

    @property
    def needed(self) -> bool:
        return bool(self.waiters or self.wanted_by)

    def __repr__(self) -> str:
        return f"<Task {self.key} {self.state}>"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


class WorkerRecord:
    __slots__ = (
        "id", "address", "resources", "node_type", "name", "state", "processing", "has_what",
        "nbytes", "occupancy", "slots", "last_seen", "idle_since", "joined", "seq", "metrics",
        "fit_cache", "memory_limit", "funcs", "executed", "last_done", "special", "seceded", "suspect",
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
        self.seceded = 0  # tasks in ``processing`` that left their slot (they do not count as load)
        #: a peer's fetch from it stalled (no FIN, no bytes: frozen, or partitioned from its peers):
        #: it gets no new work until it is heard from again; it is not declared dead for that
        self.suspect = False

    @property
    def assigned(self) -> int:
        """Tasks that count against its slots: those assigned to it (running or queued) but for
        the ones that left their slot (``seceded``)."""
        return len(self.processing) - self.seceded

    def forget_tasks(self, now: float) -> None:
        """The scheduler restarted: nothing assigned, nothing held, idle since ``now``."""
        self.processing.clear()
        self.has_what.clear()
        self.nbytes, self.occupancy, self.seceded = 0, 0.0, 0
        self.idle_since = now

    def __repr__(self) -> str:
        return f"<Worker {self.id} {self.state} processing={len(self.processing)} held={len(self.has_what)}>"
