"""The names the scheduler's state machine uses, as enums: task states, worker states, report kinds.

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
