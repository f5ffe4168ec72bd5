"""Graceful retirement: move a worker's unique data to survivors, then close it.

A retiring worker takes no new tasks and finishes the ones it runs.  Every value that only it
holds and that somebody still needs is copied (``Replicate``) to the survivor with the fewest held
bytes that has memory room; once nothing unique is left and nothing runs, the worker is closed and
removed gracefully (no recomputation, no failure counted).  If no survivor can take the data, the
retirement is refused with the reason and the worker goes back to ``running``.

State lives on :class:`SchedulerState` (``retiring``: worker id -> keys already asked for); these
functions decide, and change the state only through its public ``begin_retirement`` and
``finish_retirement``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidepool.scheduler import events as ev

if TYPE_CHECKING:
    from tidepool.scheduler.records import WorkerRecord
    from tidepool.scheduler.state import SchedulerState

MEMORY_FRACTION = 0.8


def start_retire(state: SchedulerState, e: ev.RetireWorkers, out: list[ev.Command]) -> None:
    names: set[str] = set()  # accepted for retirement in this batch
    for wid in e.workers:
        ws = state.workers.get(wid)
        if ws is None or ws.state == "retiring":
            continue
        survivors = [
            w for w in state.workers.values()
            if w.state == "running" and w.id != wid and w.id not in names and w.id not in state.retiring
        ]  # fmt: skip
        unique = state.unique_data(ws)
        need = sum(ts.nbytes for ts in unique)
        if unique and not survivors:
            out.append(ev.RetireRefused(wid, f"it holds {len(unique)} needed values ({need} bytes) "
                                              "and no other running worker can take them"))  # fmt: skip
            continue
        room = sum(_room(w) for w in survivors)
        if need > room:
            out.append(ev.RetireRefused(wid, f"its {need} bytes of needed data do not fit in the "
                                              f"{room} bytes the survivors have free"))  # fmt: skip
            continue
        names.add(wid)
        state.begin_retirement(ws, e.reason)
    progress_retirements(state, out)


def _room(w: WorkerRecord) -> float:
    if w.memory_limit <= 0:
        return float("inf")
    return max(0.0, w.memory_limit * MEMORY_FRACTION - w.nbytes)


def progress_retirements(state: SchedulerState, out: list[ev.Command]) -> None:
    """Ask survivors for copies of unique data; close retiring workers that are done."""
    for wid in list(state.retiring):
        ws = state.workers.get(wid)
        if ws is None:
            state.retiring.pop(wid, None)
            state.retire_reason.pop(wid, None)
            continue
        asked = state.retiring[wid]
        unique = [ts for ts in state.unique_data(ws)]
        if not unique and not ws.processing:
            state.finish_retirement(wid, out)
            continue
        todo = [ts for ts in unique if ts.key not in asked]
        if not todo:
            continue
        survivors = sorted(
            (w for w in state.workers.values() if w.state == "running"),
            key=lambda w: (w.nbytes, w.seq),
        )
        if not survivors:
            continue  # wait: data stays put until a survivor appears or the worker is lost
        plan: dict[str, list[str]] = {}
        load = {w.id: float(w.nbytes) for w in survivors}
        for ts in sorted(todo, key=lambda t: (-t.nbytes, t.priority, str(t.key))):  # deterministic order
            target = min(survivors, key=lambda w: (load[w.id], w.seq))
            load[target.id] += ts.nbytes
            plan.setdefault(target.id, []).append(ts.key)
            asked.add(ts.key)
        for target_id, keys in plan.items():
            out.append(ev.Replicate(target_id, keys))
