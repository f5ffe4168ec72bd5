"""Events into and commands out of :class:`~tidepool.scheduler.state.SchedulerState`.

Events carry everything the state needs, including ``now`` (the state never reads a clock).
Commands are plain records the asyncio shell turns into messages; the shell may read the state
(for payloads and addresses) but never changes it except through events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tidepool.comm.serialize import Serialized
from tidepool.resources import Shape
from tidepool.scheduler.kinds import ReportKind

#: a feasibility rule's verdict on a shape: None (feasible), a reason, or (error type, message)
Infeasible = str | tuple[str, str] | None


class RemoveCause(StrEnum):
    """Why a worker left, as data (the ``reason`` text is for people)."""

    CLOSED = "closed"  # its connection closed: it exited, crashed or was killed
    SETUP_FAILED = "setup-failed"  # a setup hook failed there
    SILENT = "silent"  # alive but silent past the heartbeat time-to-live
    RETIRED = "retired"  # graceful retirement finished
    RESTARTED = "restarted"  # asked to restart (client.restart): the same process comes back
    MEMORY = "memory"  # over its memory limit's terminate level: it restarts itself (not replaced)


@dataclass(slots=True)
class TaskSpec:
    """One task as the client submits it: the function is referenced by ``func_id``."""

    key: str
    func_id: str
    payload: Serialized | None
    deps: tuple[str, ...] = ()
    resources: dict[str, float] = field(default_factory=dict)
    retries: int = 0
    group: str = ""
    priority: int = 0  # higher runs first (Dask's meaning); ties keep submission order
    workers: tuple[str, ...] = ()  # run only on these workers (ids, names or addresses)
    loose: bool = False  # ``allow_other_workers``: the restriction is a preference


# ---- events ------------------------------------------------------------------------------------
@dataclass(slots=True)
class UpdateGraph:
    client: str
    tasks: list[TaskSpec]
    wanted: list[str]
    now: float
    functions: dict[str, Serialized] = field(default_factory=dict)
    #: ``wanted`` is every key the client wants (a reconnecting client's resync): any other key
    #: it wanted here is released (its release may have reached a scheduler that died before storing it)
    exact: bool = False


@dataclass(slots=True)
class ReleaseKeys:
    """``client`` no longer wants ``keys``.

    ``cancel``: the client cancels them instead: its futures of ``keys`` and of every
    unfinished task downstream of them are reported "cancelled" and no longer wanted by it; tasks
    nobody else needs stop.  ``unless_started`` (with ``cancel``; ``concurrent.futures.Future.cancel``
    semantics): a key whose task is executing is kept and reported "running", a finished one is kept.
    """

    client: str
    keys: list[str]
    now: float
    cancel: bool = False
    unless_started: bool = False


@dataclass(slots=True)
class ClientGone:
    client: str
    now: float


@dataclass(slots=True)
class WorkerJoin:
    worker: str
    address: str
    resources: dict[str, float]
    now: float
    node_type: str = "default"
    name: str = ""
    memory_limit: int = 0
    ready: bool = True  # False: setup hooks still running (state "starting")


@dataclass(slots=True)
class WorkerReady:
    worker: str
    now: float


@dataclass(slots=True)
class WorkerPreparing:
    """A running worker was sent setup hooks (``preparing``) or ran all it was sent (not
    ``preparing``): while it prepares it is given no new task (they would wait behind the hooks
    on it while other workers idle)."""

    worker: str
    now: float
    preparing: bool


@dataclass(slots=True)
class SetupsChanged:
    """A setup hook was registered or dropped: workers that join from now on run other setups
    (an earlier failure of one says nothing about them)."""

    now: float


@dataclass(slots=True)
class WorkerRemove:
    worker: str
    now: float
    reason: str = "connection closed"
    graceful: bool = False
    cause: RemoveCause = field(default_factory=lambda: RemoveCause.CLOSED)


@dataclass(slots=True)
class TaskFinished:
    worker: str
    key: str
    nbytes: int
    duration: float
    now: float
    run: int = 0  # the serial of the task record it ran for (0: not said)


@dataclass(slots=True)
class TaskErred:
    worker: str
    key: str
    exception: Serialized | None
    traceback: str
    exc_type: str
    message: str
    duration: float
    now: float
    run: int = 0  # the serial of the task record it ran for (0: not said)


@dataclass(slots=True)
class MissingData:
    """A worker could not fetch ``dep`` (needed by ``key``) from ``holder``."""

    worker: str
    key: str
    dep: str
    holder: str
    now: float
    error: str = ""  # why the fetch failed (connection refused, lost, ...)
    #: the holder went silent (the fetch stalled, nothing was refused or closed): its copy is
    #: suspect and the holder gets no new work until it is heard from again
    silent: bool = False


@dataclass(slots=True)
class Heartbeat:
    worker: str
    now: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Tick:
    """Periodic clock tick.  ``stalled``: seconds the scheduler itself could not run (its loop was
    blocked or the process was paused) since the last tick; silence in that time is not the
    workers' fault and is not counted against their heartbeat time-to-live."""

    now: float
    stalled: float = 0.0


@dataclass(slots=True)
class TasksStarted:
    """``worker`` began executing ``keys`` (they left its queue for a slot): only such tasks are
    suspects if the worker dies."""

    worker: str
    keys: list[str]
    now: float


@dataclass(slots=True)
class ValueUnservable:
    """``worker`` holds ``key`` but cannot send it: serialising failed or it is over the frame limit."""

    worker: str
    key: str
    exc_type: str
    message: str
    now: float


@dataclass(slots=True)
class StealReply:
    """``worker`` gave back ``stolen`` (they were still queued there) and kept ``kept`` (started)."""

    worker: str
    stolen: list[str]
    kept: list[str]
    now: float


@dataclass(slots=True)
class AbandonedRunsEnded:
    """Runs on ``worker`` that nobody wanted any more (cancelled or released while they executed:
    a thread cannot be stopped) have returned; their slots are free again."""

    worker: str
    keys: list[str]
    now: float


@dataclass(slots=True)
class TaskSeceded:
    """A task on ``worker`` left its slot to wait for tasks it submitted (``worker_client``)."""

    worker: str
    key: str
    now: float


@dataclass(slots=True)
class FireAndForget:
    """Keep computing ``keys`` although no client holds them; forget them once finished."""

    keys: list[str]
    now: float


@dataclass(slots=True)
class Broadcast:
    """Copy the values of ``keys`` to every running worker, or (``copies`` > 0) until each is held
    by that many (the least loaded running workers take the copies)."""

    keys: list[str]
    now: float
    copies: int = 0


@dataclass(slots=True)
class Restart:
    """Forget every task (clients' futures fail with ``reason``); workers restart fresh."""

    reason: str
    now: float


@dataclass(slots=True)
class CheckFeasible:
    """What the autoscaler can launch changed (it started, or a node type was disabled).

    ``rule(shape)`` says why no usable node type could ever run a shape (a reason, or ``(error
    type, message)``; None: one could): frozen data (``scaling.feasibility.Feasibility``), kept by
    the state for tasks that become ready later.  Waiting tasks it rules out fail now."""

    now: float
    rule: Callable[[Shape], Infeasible]


@dataclass(slots=True)
class AddReplica:
    """``worker`` now holds ``key`` too (it fetched it as a dependency or received it on retire)."""

    worker: str
    key: str
    nbytes: int
    now: float


@dataclass(slots=True)
class RetireWorkers:
    workers: list[str]
    now: float
    reason: str = "requested"


@dataclass(slots=True)
class WorkerRejoin:
    """``worker`` registered again after losing the scheduler (which may have restarted from its
    state directory): it holds ``held`` (key, nbytes), is executing ``running`` and has ``queued``
    (assigned, not started).  Held values count as finished; its tasks stay where they are."""

    worker: str
    held: list[tuple[str, int]]
    running: list[str]
    queued: list[str]
    now: float


@dataclass(slots=True)
class RestoreErrors:
    """Tasks that had erred before a scheduler restart (key -> the error as reported): they err again
    without running, and their dependents with them."""

    errors: dict[str, dict[str, Any]]
    now: float


@dataclass(slots=True)
class RecoveryReport:
    """A scheduler restart from its state directory reached a milestone (for the journal): ``stage``
    ("loaded" or "resumed") and counts; the state does nothing with it."""

    stage: str
    fields: dict[str, Any]
    now: float


Event = (
    UpdateGraph
    | ReleaseKeys
    | ClientGone
    | WorkerJoin
    | WorkerReady
    | WorkerPreparing
    | SetupsChanged
    | WorkerRemove
    | TaskFinished
    | TaskErred
    | MissingData
    | Heartbeat
    | Tick
    | TasksStarted
    | ValueUnservable
    | CheckFeasible
    | StealReply
    | TaskSeceded
    | AbandonedRunsEnded
    | FireAndForget
    | Broadcast
    | Restart
    | AddReplica
    | RetireWorkers
    | WorkerRejoin
    | RestoreErrors
    | RecoveryReport
)


# ---- commands ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Execute:
    worker: str
    key: str
    ship: str = ""  # a function id the worker has not been sent yet: send it along (even if the
    #                 task is gone by the time the command is carried out)


@dataclass(slots=True)
class Free:
    worker: str
    keys: list[str]


@dataclass(slots=True)
class Report:
    """Tell ``client`` that ``key`` reached ``status`` ("memory", "erred", "lost"; "cancelled" and
    "running" answer a cancel request)."""

    client: str
    key: str
    status: ReportKind
    error: dict[str, Any] | None = None  # an error for this client only (e.g. a key collision)


@dataclass(slots=True)
class Replicate:
    """Ask ``worker`` to fetch ``keys`` from their holders (moving data off a retiring worker)."""

    worker: str
    keys: list[str]


@dataclass(slots=True)
class Steal:
    """Ask ``worker`` to give back ``keys`` if they have not started: an idle worker will run them."""

    worker: str
    keys: list[str]


@dataclass(slots=True)
class CloseWorker:
    worker: str
    reason: str


@dataclass(slots=True)
class RetireRefused:
    worker: str
    reason: str


@dataclass(slots=True)
class TaskFailed:
    """``key`` failed by the scheduler's own verdict, not on a worker (KilledWorkerError, infeasible,
    a value lost too often or that cannot be sent, a failed setup): nothing is sent; the journal
    and the dashboard count it, as they count a task that raised (it was missing from both)."""

    key: str
    exc_type: str
    message: str


Command = Execute | Free | Report | Replicate | Steal | CloseWorker | RetireRefused | TaskFailed
