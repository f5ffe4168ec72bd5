"""Warm pools: idle workers kept ready (``min_idle``) and a quiet pool scaled to zero.

Pure functions of a :class:`ClusterSnapshot` plus :class:`Quiet`, a small clock-free record of
since when the pool has had no work (the controller owns it and updates it from each
observation).  Place in the data flow: after the policy, the controller adds the launches
``min_idle`` needs (:func:`warm_launches`, before ``max_nodes`` and the cost limits are applied),
keeps retirements from taking a type below ``min_idle`` idle workers (:func:`idle_by_type`), and,
once the pool has been quiet for ``scale_to_zero_after`` seconds, stops keeping workers warm and
retires every idle worker that holds nothing needed (``min_nodes`` still holds: a floor is a
floor).  Counting: a worker is idle when it runs nothing and is not being retired; workers still to
come of launches in flight count as idle (they will be, unless work takes them, which the next step
sees).  ``min_idle`` is counted apart from ``min_nodes``: ``min_nodes`` counts every node, busy or
idle, ``min_idle`` only idle workers, and both hold (``min_nodes=1, min_idle=2``: two idle nodes
satisfy both; once one works, a third is started).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tidepool.scaling.snapshot import ClusterSnapshot


@dataclass
class Quiet:
    """Since when the pool has had no work at all (no demand, nothing running or waiting)."""

    since: float | None = None

    def update(self, now: float, busy: bool) -> None:
        if busy:
            self.since = None
        elif self.since is None:
            self.since = now

    def for_at_least(self, now: float, seconds: float | None) -> bool:
        return seconds is not None and self.since is not None and now - self.since >= seconds


def idle_by_type(snap: ClusterSnapshot, retiring: Collection[str], *, coming: bool) -> dict[str, int]:
    """Idle workers per node type that are not being retired (plus, with ``coming``, the workers
    still to come of launches in flight)."""
    out: dict[str, int] = {}
    for w in snap.workers:
        if w.idle and w.id not in retiring:
            out[w.node_type] = out.get(w.node_type, 0) + 1
    if coming:
        for p in snap.pending:
            nt = snap.node_type(p.node_type)
            wpn = nt.workers_per_node if nt is not None else 1
            out[p.node_type] = out.get(p.node_type, 0) + (len(p.worker_ids) or p.nodes * wpn)
    return out


def warm_launches(snap: ClusterSnapshot, retiring: Collection[str], reasons: list[str]) -> dict[str, int]:
    """Nodes per type to launch so each type has its ``min_idle`` idle workers (a reason each)."""
    idle = idle_by_type(snap, retiring, coming=True)
    out: dict[str, int] = {}
    for nt in snap.node_types:
        short = nt.min_idle - idle.get(nt.name, 0)
        if short > 0 and not snap.blocked(nt.name):
            out[nt.name] = -(-short // nt.workers_per_node)
            reasons.append(f"{nt.name}: {idle.get(nt.name, 0)} idle, below min_idle={nt.min_idle}")
    return out
