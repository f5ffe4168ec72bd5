"""Counts the scheduler keeps exact as tasks move, so nobody scans a million records to read them.

State: ``counts`` (task state -> records), ``group_counts`` (task group -> state -> records, what
the dashboard shows) and ``pending`` ((shape, group) -> tasks ready or no-worker: the demand
scaling looks at).  The state machine (``state.py``) calls :meth:`Tally.add` when a record is
made, :meth:`Tally.move` on every state change and :meth:`Tally.forget` when a record goes; each
is O(1).  ``audit.validate`` recounts from the records and compares.  With a state directory,
``dirty`` collects the records that moved or were forgotten since the persister last took it
(``scheduler/recovery.py``; one set insertion on the hot path); None: nobody persists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidepool.resources import Shape
from tidepool.scheduler.kinds import PENDING
from tidepool.scheduler.kinds import TaskState as TS

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord


class Tally:
    __slots__ = ("counts", "dirty", "group_counts", "pending")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {TS.RELEASED: 0}
        self.group_counts: dict[str, dict[str, int]] = {}
        self.pending: dict[tuple[Shape, str], int] = {}
        self.dirty: set[TaskRecord] | None = None

    def add(self, ts: TaskRecord) -> None:
        """A new record (state ``released``)."""
        self.counts[TS.RELEASED] += 1
        g = self.group_counts.setdefault(ts.group, {TS.RELEASED: 0})
        g[TS.RELEASED] = g.get(TS.RELEASED, 0) + 1

    def move(self, ts: TaskRecord, old: str, new: str) -> None:
        if old in PENDING:
            k = (ts.shape, ts.group)
            n = self.pending[k] - 1
            if n:
                self.pending[k] = n
            else:
                del self.pending[k]
        if new in PENDING:
            k = (ts.shape, ts.group)
            self.pending[k] = self.pending.get(k, 0) + 1
        counts = self.counts
        counts[old] -= 1
        counts[new] = counts.get(new, 0) + 1
        g = self.group_counts[ts.group]
        g[old] -= 1
        g[new] = g.get(new, 0) + 1
        if self.dirty is not None:
            self.dirty.add(ts)

    def forget(self, ts: TaskRecord) -> None:
        """``ts``'s record is dropped; a group whose last record goes is forgotten too."""
        self.counts[ts.state] -= 1
        g = self.group_counts[ts.group]
        g[ts.state] -= 1
        if not any(g.values()):
            del self.group_counts[ts.group]
        if self.dirty is not None:
            self.dirty.add(ts)

    def clear(self) -> None:
        self.counts.clear()
        self.counts[TS.RELEASED] = 0
        self.group_counts.clear()
        self.pending.clear()
