"""What a scaling policy sees (``ClusterSnapshot``) and what it answers (``ScaleDecision``).

Both are frozen: a policy is a function from one snapshot to one decision, with ``now`` and every
id inside the snapshot, so policies are tested with hand-made snapshots and replayed exactly in the
simulator.  The controller builds the snapshot from one :class:`~tidepool.scaling.observation.Observation`
plus its own launch bookkeeping; nothing here reads a clock or the scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidepool.resources import Shape
from tidepool.scaling.node_types import NodeType


@dataclass(frozen=True)
class Demand:
    """``count`` runnable tasks of one resource ``shape`` and ``group``, none on a worker yet."""

    shape: Shape
    group: str
    count: int
    est_seconds: float  # estimated duration of one task

    @property
    def resources(self) -> dict[str, float]:
        return dict(self.shape)


@dataclass(frozen=True)
class WorkerView:
    id: str
    node_type: str
    state: str  # starting / running / retiring
    resources: dict[str, float]
    slots: int
    running: int  # tasks assigned (running or queued on it)
    queued_seconds: float  # estimated work assigned to it
    held_bytes: int
    unique_keys: int  # values only it holds that somebody needs
    unique_bytes: int
    idle_since: float | None
    joined: float
    memory_limit: int = 0  # bytes it may use (0: no limit known); held bytes include spilled ones
    #: of ``unique_keys``, the values an unfinished task still needs (the rest only a client wants)
    unique_for_tasks: int = 0
    #: running setup hooks sent after it joined (``register_setup``): no task meanwhile, not idle
    preparing: bool = False

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.state == "running" and not self.preparing


@dataclass(frozen=True)
class PendingLaunch:
    request_id: str
    node_type: str
    nodes: int  # still to come (those that registered are live workers already)
    worker_ids: tuple[str, ...]
    since: float
    requested: int = 0  # nodes the launch asked for in all (0: unknown, take ``nodes``)


@dataclass(frozen=True)
class TypeForecast:
    """Forecast remaining seconds of the work that prefers ``node_type`` with extra nodes.

    ``etas[i]`` is the forecast with ``extra[i]`` more nodes (``extra[0] == 0``: the pool as it is,
    launches in flight included); new nodes count from ``startup`` seconds on.
    """

    node_type: str
    startup: float
    slots_per_node: int
    extra: tuple[int, ...]
    etas: tuple[float, ...]
    tasks: int = 0
    #: per ``extra[i]``: seconds of work each new slot would do (mean over the new slots; the
    #: divisible-work estimate ``eta - startup`` when the graph is too big to play forward)
    new_busy: tuple[float, ...] = ()
    #: the pool as it is, played forward: ``(seconds from now, slots in use from then on)`` steps
    #: (empty when not played forward); the width the graph can use over time
    profile: tuple[tuple[float, int], ...] = ()
    #: task slots of the pool as it is (launches in flight included) that this work can use
    slots: int = 0
    #: per ``extra[i]``: when the last of the new slots would start its first task (inf: one never does)
    new_start: tuple[float, ...] = ()
    #: the same forecast with kinds that never finished at the scheduler's prior instead of the mean
    #: of the other kinds (None: no such kind waits; see ``RemainingWork.for_launch``): what the
    #: default's objective rules launch on, while a deadline or budget plans on the mean
    evidence: TypeForecast | None = None
    #: ``profile`` with every launch in flight arriving now (set only for types whose queue wait is
    #: not billed and with launches in flight): the most a queued node could be used, whenever it starts
    profile_now: tuple[tuple[float, int], ...] = ()

    @property
    def for_launch(self) -> TypeForecast:
        """The forecast a launch by evidence reads (:attr:`evidence`, or this one)."""
        return self.evidence if self.evidence is not None else self


@dataclass(frozen=True)
class ClusterSnapshot:
    now: float
    node_types: tuple[NodeType, ...]
    demand: tuple[Demand, ...]
    workers: tuple[WorkerView, ...]
    pending: tuple[PendingLaunch, ...] = ()
    last_progress: float = 0.0  # when a task last finished (or failed)
    finished: int = 0  # tasks finished so far
    waiting: int = 0  # tasks waiting on inputs (future demand)
    running: int = 0  # tasks on workers
    backlog_since: float | None = None  # since when demand has been non-zero without pause
    backoff: tuple[tuple[str, float], ...] = ()  # node type -> launches blocked until
    unusable: tuple[str, ...] = ()  # node types disabled (repeated failures)
    forecasts: tuple[TypeForecast, ...] = ()
    eta: float | None = None  # forecast remaining seconds with the pool as it is (None: unknown)
    next_demand_in: float | None = None  # seconds until waiting work becomes runnable (None: none waits)
    spent: float | None = None  # the run's cost so far, as the controller's meter bills it (None: not known)

    def node_type(self, name: str) -> NodeType | None:
        for nt in self.node_types:
            if nt.name == name:
                return nt
        return None

    @property
    def demand_tasks(self) -> int:
        return sum(d.count for d in self.demand)

    def nodes_of(self, name: str) -> int:
        """Live plus pending nodes of a type (workers / workers_per_node, rounded up)."""
        return self.live_nodes_of(name) + sum(p.nodes for p in self.pending if p.node_type == name)

    def live_nodes_of(self, name: str) -> int:
        """Nodes of a type whose workers have joined (workers / workers_per_node, rounded up)."""
        nt = self.node_type(name)
        per = nt.workers_per_node if nt else 1
        return -(-sum(1 for w in self.workers if w.node_type == name) // per)

    def staying_nodes_of(self, name: str) -> int:
        """Joined nodes of a type not being retired (as the controller's ``standing`` counts them,
        and as the forecast's pool does: a retiring worker's slots take no new task)."""
        nt = self.node_type(name)
        per = nt.workers_per_node if nt else 1
        return -(-sum(1 for w in self.workers if w.node_type == name and w.state != "retiring") // per)

    def blocked(self, name: str) -> bool:
        if name in self.unusable:
            return True
        return any(n == name and until > self.now for n, until in self.backoff)


@dataclass(frozen=True)
class ScaleDecision:
    """Launch ``launch[type]`` more nodes; retire ``retire`` workers; call off ``cancel[type]``
    nodes of launches in flight (not registered yet: a queued Slurm job, a booting VM); report
    ``infeasible`` shapes."""

    launch: dict[str, int] = field(default_factory=dict)
    retire: tuple[str, ...] = ()
    infeasible: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    #: (worker id, why) for retirements: the journal gives each retirement its own reason
    why: tuple[tuple[str, str], ...] = ()
    #: node type -> nodes of its launches in flight no longer wanted (the newest go first)
    cancel: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not any(self.launch.values()) and not self.retire and not any(self.cancel.values())
