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
#: seconds a rejoining worker's value of a key this scheduler does not know is kept for the graph
#: that names it: a client resends its last graph updates when it reconnects, which may be after
#: the workers rejoined (a graph submitted just before a kill was not stored yet, and its finished
#: values were freed and computed again: 191-768 extra runs of a 3,000-task map in a bug hunt)
UNCLAIMED_KEEP = 120.0
#: ... for workers that rejoin within this many seconds of a restart (later: a reconnect after a
#: network blip, whose unknown keys were released here and are freed at once)
RESTORED_FOR = 600.0


class Host(Protocol):
    """What these handlers use of :class:`~tidepool.scheduler.state.SchedulerState`."""

    tasks: dict[str, TaskRecord]
    workers: dict[str, WorkerRecord]
    counters: dict[str, int]
    #: key -> {worker: (nbytes, since)}: values rejoining workers hold of keys not known yet
    unclaimed: dict[str, dict[str, tuple[int, float]]]
    #: key -> (worker, executing, since): runs rejoining workers have of keys not known yet
    unclaimed_runs: dict[str, tuple[str, bool, float]]
    #: when this scheduler was restored from its state directory (None: it was not)
    restored_at: float | None

    def _move(self, ts: TaskRecord, new: TS) -> None: ...
    def _assign(self, ts: TaskRecord, ws: WorkerRecord, out: list[ev.Command]) -> None: ...
    def _add_holder(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int) -> None: ...
    def _set_nbytes(self, ts: TaskRecord, nbytes: int) -> None: ...
    def _value_arrived(self, ts: TaskRecord, ws: WorkerRecord, nbytes: int, duration: float | None,
                       out: list[ev.Command]) -> None: ...  # fmt: skip
    def _erred_cascade(self, root: TaskRecord, out: list[ev.Command]) -> None: ...


def handlers(st: Host) -> dict[type, Callable[[Any, list[ev.Command]], None]]:
    """The state machine's handlers of the recovery events."""
    return {ev.WorkerRejoin: partial(worker_rejoin, st), ev.RestoreErrors: partial(restore_errors, st),
            ev.RecoveryReport: partial(_report, st)}  # fmt: skip


def _report(st: Host, e: ev.RecoveryReport, out: list[ev.Command]) -> None:
    """For the journal; "restored" (applied with the restore itself) or "loaded" marks the state as
    restored (for :func:`worker_rejoin`)."""
    if e.stage in ("restored", "loaded") and st.restored_at is None:
        st.restored_at = e.now


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
        if ts is None and st.restored_at is not None and e.now - st.restored_at <= RESTORED_FOR:
            st.unclaimed.setdefault(key, {})[ws.id] = (nbytes, e.now)  # for a graph that names it
        elif ts is None:
            free.append(key)
        elif ts.state in (TS.RELEASED, TS.ERRED):
            free.append(key)
        elif ts.state == TS.MEMORY:
            st._add_holder(ts, ws, nbytes)
        else:  # pending, or running elsewhere: this copy is the value (no new execution)
            _count(st, "recovered")
            st._value_arrived(ts, ws, nbytes, None, out)
    executing = set(e.running)
    recent = st.restored_at is not None and e.now - st.restored_at <= RESTORED_FOR
    for key in [*e.running, *e.queued]:
        ts = tasks.get(key)
        if ts is not None and ts.state == TS.RUNNING and ts.worker == ws.id:
            continue
        parked = st.unclaimed_runs.get(key)
        if ts is None and recent and (parked is None or parked[0] == ws.id):
            # a task of a graph not stored before the kill: its client resends it (the run is taken
            # then, not started again; a bug hunt saw every such task run twice).  The same worker
            # rejoining again keeps it parked (a free would leave a claim waiting on a stopped run)
            st.unclaimed_runs[key] = (ws.id, key in executing, e.now)
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


def claim(st: Host, new: list[TaskRecord]) -> list[TaskRecord]:
    """New tasks whose values rejoining workers kept (:data:`UNCLAIMED_KEEP`) are in memory there
    at once, as held values are at a rejoin (no new execution), and those a rejoining worker runs
    are running there (no new ``Execute``); returns them."""
    claimed = []
    for ts in new:
        run = st.unclaimed_runs.pop(ts.key, None)
        ws = st.workers.get(run[0]) if run is not None else None
        if run is not None and ws is not None and ts.state == TS.RELEASED and ts.key not in st.unclaimed:
            st._move(ts, TS.READY)
            ts.waiting_on = NOSET
            st._assign(ts, ws, [])  # its Execute is dropped: the worker runs it already
            ts.run = 0  # the worker's copy carries another scheduler's serial: any is taken for this run
            ts.executing = run[1]
            _count(st, "adopted_running")
            claimed.append(ts)
            continue
        held = st.unclaimed.pop(ts.key, None)
        for wid, (nbytes, _) in (held or {}).items():
            ws = st.workers.get(wid)
            if ws is None:
                continue
            if ts.state != TS.MEMORY:
                st._set_nbytes(ts, nbytes)
                st._move(ts, TS.MEMORY)
                _count(st, "recovered")
                claimed.append(ts)
            st._add_holder(ts, ws, nbytes)
    return claimed


def run_started(st: Host, ws: WorkerRecord, key: str) -> None:
    """A parked run of ``ws`` left its queue for a slot: a claim takes it as executing."""
    run = st.unclaimed_runs.get(key)
    if run is not None and run[0] == ws.id:
        st.unclaimed_runs[key] = (run[0], True, run[2])


def forget_worker(st: Host, wid: str) -> None:
    """``wid`` left: its parked runs are gone with it (a claim then computes them anew)."""
    for key in [k for k, run in st.unclaimed_runs.items() if run[0] == wid]:
        del st.unclaimed_runs[key]


def run_ended(st: Host, ws: WorkerRecord, key: str, nbytes: int | None, now: float) -> bool:
    """An outcome of a run no graph claimed yet (``nbytes``: it finished; None: it failed): a value
    is kept as a rejoining worker's held one is (for the graph that names it); False if ``key``
    is no such run of ``ws``."""
    run = st.unclaimed_runs.get(key)
    if run is None or run[0] != ws.id:
        return False
    del st.unclaimed_runs[key]
    if nbytes is not None:
        st.unclaimed.setdefault(key, {})[ws.id] = (nbytes, now)
    return True


def expire_unclaimed(st: Host, now: float, out: list[ev.Command]) -> None:
    """Values and runs no graph claimed within :data:`UNCLAIMED_KEEP` are freed on their workers."""
    free: dict[str, list[str]] = {}
    for key, (wid, _, since) in list(st.unclaimed_runs.items()):
        if now - since > UNCLAIMED_KEEP or wid not in st.workers:
            del st.unclaimed_runs[key]
            if wid in st.workers:
                free.setdefault(wid, []).append(key)
    for key, held in list(st.unclaimed.items()):
        for wid, (_, since) in list(held.items()):
            if now - since > UNCLAIMED_KEEP or wid not in st.workers:
                del held[wid]
                if wid in st.workers:
                    free.setdefault(wid, []).append(key)
        if not held:
            del st.unclaimed[key]
    for wid, keys in free.items():
        out.append(ev.Free(wid, keys))
