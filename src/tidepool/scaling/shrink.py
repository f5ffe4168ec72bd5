"""When a refused retirement is worth asking again: only once the pool has changed.

A retirement is refused when the worker holds values somebody needs and no survivor can take them
(scheduler/retire.py).  Asking again on a timer only repeats the same refusal in the journal and on
the dashboard.  :func:`shrink_signature` records what the pool looked like when the worker was
asked; :meth:`ShrinkSignature.changed` says whether anything that could turn the answer has
happened since: another worker became available (joined, or finished starting), the worker's own
unique data shrank (values released), or the survivors hold fewer bytes (room freed).  Pure data;
what every signature of a round shares (the running workers, the bytes they hold) is read once per
round (:func:`pool_summary`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShrinkSignature:
    worker: str  # the worker asked to retire
    running: frozenset[str]  # the running workers then (one set shared by every signature of a round)
    unique_bytes: int  # what only the worker holds and somebody needs
    survivors_held: int  # bytes the survivors (the running workers but it) hold (less held: more room)

    @property
    def survivors(self) -> frozenset[str]:
        return self.running - {self.worker}

    def changed(self, now: ShrinkSignature) -> bool:
        """Could the answer differ now?  New survivors, less unique data, or more room."""
        return (any(w != self.worker and w not in self.running for w in now.running)
                or now.unique_bytes < self.unique_bytes or now.survivors_held < self.survivors_held)  # fmt: skip


@dataclass(frozen=True)
class PoolSummary:
    """What every signature of one round shares: the running workers and the bytes they hold."""

    running: frozenset[str]
    held: int


def pool_summary(workers: Iterable[Any]) -> PoolSummary:
    """``workers``: :class:`~tidepool.scaling.snapshot.WorkerView` objects (id, state, held bytes).
    Made once per round: a signature per worker from scratch read the whole pool each time, which
    made a round that retires 10,000 workers take minutes."""
    running = [w for w in workers if w.state == "running"]
    return PoolSummary(frozenset(w.id for w in running), sum(int(w.held_bytes) for w in running))


def shrink_signature(pool: PoolSummary, mine: Any, wid: str) -> ShrinkSignature:
    """The signature of asking ``wid`` (its :class:`WorkerView` ``mine``, or None) to retire now."""
    own = int(mine.held_bytes) if mine is not None and wid in pool.running else 0
    return ShrinkSignature(wid, pool.running, int(mine.unique_bytes) if mine is not None else 0, pool.held - own)


__all__ = ["PoolSummary", "ShrinkSignature", "pool_summary", "shrink_signature"]
