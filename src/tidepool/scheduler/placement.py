"""Choosing a worker for a ready task.

Pure functions over read-only views of the scheduler's records.  Rules, in order:
1. the worker must have every resource the task asks for (``fits``);
2. prefer a worker with no scarce resource (gpu, ...) the task does not need, so GPUs stay free
   for GPU work (the state also refuses to queue ordinary work behind them);
3. prefer the worker that already holds the most bytes of the task's inputs (data locality);
4. then the least loaded (estimated queued seconds per slot), then the fewest queued tasks;
5. ties break on the worker's join sequence number, so runs replay deterministically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord, WorkerRecord



def choose_worker(ts: TaskRecord, candidates: list[WorkerRecord]) -> WorkerRecord:
    """The best of ``candidates`` (non-empty, all able to run ``ts``) for ``ts``; workers whose copy
    of ``ts`` went silent (``ts.avoid``) only when no other candidate is left."""
    if ts.avoid:
        elsewhere = [w for w in candidates if w.id not in ts.avoid]
        candidates = elsewhere or candidates
    if len(candidates) == 1:
        return candidates[0]
    local: dict[str, int] = {}
    for dep in ts.deps:
        nb = dep.nbytes
        for wid in dep.who_has:
            local[wid] = local.get(wid, 0) + nb
    needs = frozenset(name for name, _ in ts.shape)
    best = candidates[0]
    best_key = _rank(best, local, needs)
    for w in candidates[1:]:
        k = _rank(w, local, needs)
        if k < best_key:
            best, best_key = w, k
    return best


def _rank(w: WorkerRecord, local: dict[str, int], needs: frozenset[str]) -> tuple[int, float, float, int, int]:
    waste = len(w.special - needs) if w.special else 0
    return (waste, -local.get(w.id, 0), w.occupancy / w.slots, len(w.processing) - w.seceded, w.seq)
