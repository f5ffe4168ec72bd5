"""The names the scheduler's state machine uses, as enums: task states, worker states, report
kinds; and the transition tables: every legal move of a task or a worker, with its reason
(``state.py`` raises :class:`InvalidTransition` on any other).

They are ``StrEnum`` members, so they travel over msgpack and into the JSON journal as their plain
string values, and compare equal to those strings; inside the state machine every move names a
member (a typo is an ``AttributeError`` at import, not a silent new state).
"""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    RELEASED = "released"  # not needed now (or not yet): no work is planned for it
    WAITING = "waiting"  # needed; some inputs are not in memory yet
    READY = "ready"  # every input in memory; waiting for a worker with room
    NO_WORKER = "no-worker"  # ready, but no running worker has the resources it asks for
    RUNNING = "running"  # assigned to a worker (queued there, or executing)
    MEMORY = "memory"  # finished; the value is on one or more workers
    ERRED = "erred"  # failed (or cannot run); the error is kept while somebody holds it


class WorkerState(StrEnum):
    STARTING = "starting"  # registered; setup hooks still running
    RUNNING = "running"  # takes tasks
    RETIRING = "retiring"  # takes no new tasks; its unique data moves to survivors
    GONE = "gone"  # left


class ReportKind(StrEnum):
    """What a ``Report`` tells a client about one of its keys."""

    MEMORY = "memory"  # the value is ready
    ERRED = "erred"  # the task failed (the report carries the error)
    LOST = "lost"  # the scheduler does not know the key
    CANCELLED = "cancelled"  # cancelled at the client's request
    RUNNING = "running"  # it is executing (answer to a client's question)


class InvalidTransition(RuntimeError):
    """A bug: the state machine tried a move that is not in its transition table."""


_T, _W = TaskState, WorkerState

#: states of a task that is still to be computed
ACTIVE = frozenset({_T.WAITING, _T.READY, _T.NO_WORKER, _T.RUNNING})
#: runnable now, but on no worker yet: demand
PENDING = frozenset({_T.READY, _T.NO_WORKER})

#: Every legal task-state change, with the reason it happens.  Anything else raises.
TASK_TRANSITIONS: dict[tuple[TaskState, TaskState], str] = {
    (_T.RELEASED, _T.WAITING): "needed, and some inputs are not in memory yet",
    (_T.RELEASED, _T.READY): "needed, and every input is in memory",
    (_T.RELEASED, _T.ERRED): "needed, but an input already failed",
    (_T.RELEASED, _T.MEMORY): "a worker that rejoined a restarted scheduler holds its value (rejoin.claim)",
    (_T.WAITING, _T.READY): "the last missing input arrived",
    (_T.WAITING, _T.ERRED): "an input failed",
    (_T.WAITING, _T.RELEASED): "nobody needs it any more (cancelled)",
    (_T.WAITING, _T.MEMORY): "a result from an earlier attempt arrived; keep it",
    (_T.READY, _T.RUNNING): "placed on a worker",
    (_T.READY, _T.NO_WORKER): "no running worker has the resources it asks for",
    (_T.READY, _T.WAITING): "an input was lost with its worker",
    (_T.READY, _T.RELEASED): "cancelled before it was placed",
    (_T.READY, _T.ERRED): "it can never run (infeasible)",
    (_T.READY, _T.MEMORY): "a result from an earlier attempt arrived; keep it",
    (_T.NO_WORKER, _T.READY): "a worker with the resources joined",
    (_T.NO_WORKER, _T.WAITING): "an input was lost with its worker",
    (_T.NO_WORKER, _T.RELEASED): "cancelled while no worker could run it",
    (_T.NO_WORKER, _T.ERRED): "it can never run (infeasible)",
    (_T.NO_WORKER, _T.MEMORY): "a result from an earlier attempt arrived; keep it",
    (_T.RUNNING, _T.MEMORY): "finished; the value stays on the worker",
    (_T.RUNNING, _T.READY): "its worker left, or it failed and has retries left",
    (_T.RUNNING, _T.WAITING): "rescheduled, and an input must be recomputed first",
    (_T.RUNNING, _T.ERRED): "raised with no retries left, or killed too many workers",
    (_T.RUNNING, _T.RELEASED): "cancelled while running",
    (_T.MEMORY, _T.RELEASED): "nobody needs the value (freed), or it was lost with its worker",
    (_T.MEMORY, _T.ERRED): "its holder cannot send the value (unpicklable, or over the frame limit)",
    (_T.ERRED, _T.RELEASED): "nobody holds the error any more",
}

#: Every legal worker-state change.
WORKER_TRANSITIONS: dict[tuple[WorkerState, WorkerState], str] = {
    (_W.STARTING, _W.RUNNING): "setup hooks finished; takes tasks from now on",
    (_W.STARTING, _W.GONE): "left or failed during setup",
    (_W.RUNNING, _W.RETIRING): "graceful retirement started: its data moves to survivors",
    (_W.RETIRING, _W.RUNNING): "retirement refused or cancelled",
    (_W.RETIRING, _W.GONE): "retired, or lost while retiring",
    (_W.RUNNING, _W.GONE): "disconnected, killed or missed heartbeats",
    (_W.STARTING, _W.RETIRING): "retired before it finished setup",
}
