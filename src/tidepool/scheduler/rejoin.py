"""The state machine's part of a scheduler restart: workers that rejoin, errors restored.

State: none of its own; it moves the records of the state machine that calls it (through
:class:`Host`, so this module does not import ``state.py``).  Data flow: ``state.py`` registers
:func:`handlers` for the recovery events.  ``WorkerRejoin`` (a worker registered again with what it
holds and runs, ``scheduler/recovery.py``): held values count as finished again (no new
execution), its running and queued tasks stay its own (no ``Execute`` is sent again), and what it
holds or runs that is no longer wanted is freed.  ``RestoreErrors``: tasks that had erred before
the restart err again with their stored error.  ``RecoveryReport`` is for observers only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from tidepool.scheduler import events as ev
from tidepool.scheduler.kinds import TaskState as TS
from tidepool.scheduler.records import NOSET, TaskError, TaskRecord, WorkerRecord

_PENDING = (TS.WAITING, TS.READY, TS.NO_WORKER)


class Host(Protocol):
    """What these handlers use of :class:`~tidepool.scheduler.state.SchedulerState`."""

    tasks: dict[str, TaskRecord]
    workers: dict[str, WorkerRecord]
    counters: dict[str, int]

    def _move(self, ts: TaskRecord, new: TS) -> None: ...
    def _assign(self, ts: TaskRecord, ws: WorkerRecord, out: list[ev.Command]) -> None: ...
    def _add_holder(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int) -> None: ...
    def _value_arrived(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int, duration: float | None,
                       out: list[ev.Command]) -> None: ...  # fmt: skip
    def _erred_cascade(self, root: TaskRecord, out: list[ev.Command]) -> None: ...


def handlers(st: Host) -> dict[type, Callable[[Any, list[ev.Command]], None]]:
    """The state machine's handlers of the recovery events."""
    return {ev.WorkerRejoin: partial(worker_rejoin, st), ev.RestoreErrors: partial(restore_errors, st),
            ev.RecoveryReport: _for_observers}  # fmt: skip


def _for_observers(e: ev.RecoveryReport, out: list[ev.Command]) -> None:
    """Nothing to change: the journal reads it."""


def _count(st: Host, name: str, n: int = 1) -> None:
    st.counters[name] = st.counters.get(name, 0) + n


def worker_rejoin(st: Host, e: ev.WorkerRejoin, out: list[ev.Command]) -> None:
    ws = st.workers.get(e.worker)
    if ws is None:
        return
    tasks = st.tasks
    free: list[str] = []
    for key, nbytes in e.held:
        ts = tasks.get(key)
        if ts is None or ts.state in (TS.RELEASED, TS.ERRED):
            free.append(key)
        elif ts.state == TS.MEMORY:
            st._add_holder(ts, ws, nbytes)
        else:  # pending, or running elsewhere: this copy is the value (no new execution)
            _count(st, "recovered")
            st._value_arrived(ts, ws, nbytes, None, out)
    executing = set(e.running)
    for key in [*e.running, *e.queued]:
        ts = tasks.get(key)
        if ts is not None and ts.state == TS.RUNNING and ts.worker == ws.id:
            continue
        if ts is None or ts.state not in _PENDING:
            free.append(key)  # finished, erred or released meanwhile, or running elsewhere
            continue
        ts.waiting_on = NOSET
        if ts.state != TS.READY:  # it is running on ws whatever it waited for: ready, then placed
            st._move(ts, TS.READY)
        st._assign(ts, ws, out)
        ts.run = 0  # the worker's copy carries another scheduler's serial: any is taken for this run
        last = out[-1]
        if isinstance(last, ev.Execute) and last.key == key:
            out.pop()  # it is there already: sending it again would queue it twice
        if key in executing:
            ts.executing = True
        _count(st, "adopted_running")
    if free:
        out.append(ev.Free(ws.id, free))


def restore_errors(st: Host, e: ev.RestoreErrors, out: list[ev.Command]) -> None:
    for key, err in e.errors.items():
        ts = st.tasks.get(key)
        if ts is None or ts.state not in _PENDING:
            continue
        ts.error = TaskError(str(err.get("type") or ""), str(err.get("message") or ""), str(err.get("origin") or key),
                             err.get("exception"), str(err.get("traceback") or ""))  # fmt: skip
        st._move(ts, TS.ERRED)
        st._erred_cascade(ts, out)
