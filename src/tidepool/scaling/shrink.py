"""When a refused retirement is worth asking again: only once the pool has changed.

A retirement is refused when the worker holds values somebody needs and no survivor can take them
(scheduler/retire.py).  Asking again on a timer only repeats the same refusal in the journal and on
the dashboard.  :func:`shrink_signature` records what the pool looked like when the worker was
asked; :meth:`ShrinkSignature.changed` says whether anything that could turn the answer has
happened since: another worker became available (joined, or finished starting), the worker's own
unique data shrank (values released), or the survivors hold fewer bytes (room freed).  Pure data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShrinkSignature:
    survivors: frozenset[str]  # other running workers
    unique_bytes: int  # what only the worker holds and somebody needs
    survivors_held: int  # bytes the survivors hold (less held: more room)

    def changed(self, now: ShrinkSignature) -> bool:
        """Could the answer differ now?  New survivors, less unique data, or more room."""
        return (bool(now.survivors - self.survivors) or now.unique_bytes < self.unique_bytes
                or now.survivors_held < self.survivors_held)  # fmt: skip


def shrink_signature(workers: Iterable[Any], wid: str) -> ShrinkSignature:
    """``workers``: :class:`~tidepool.scaling.snapshot.WorkerView` objects (id, state, held and
    unique bytes)."""
    others = [w for w in workers if w.id != wid and w.state == "running"]
    mine = next((w for w in workers if w.id == wid), None)
    return ShrinkSignature(frozenset(w.id for w in others), int(mine.unique_bytes) if mine is not None else 0,
                           sum(int(w.held_bytes) for w in others))  # fmt: skip


__all__ = ["ShrinkSignature", "shrink_signature"]
