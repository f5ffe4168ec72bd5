"""Workers with a known end: preemption notices, replacements and the fallback's routing.

A mixin of :class:`~tidepool.scaling.controller.ScalingController` (its methods run inside
``step`` and use the controller's state; they live here to keep the controller's file about the
step itself).  State it relies on (set up by the controller): ``_noticed`` (worker -> preemption
deadline), ``_abandoned`` (noticed workers ended at once), ``_replaced`` (workers a replacement was
launched for), ``_replace`` (replacements wanted this step), ``_expiry_seen`` (when a walltime
worker was first listed as expiring) and ``fallbacks`` (``preemption.py``).

Rules: a notice is journaled once, counted against the type (fallback), and the worker is replaced
at once while the pool has work; a worker whose assigned work cannot finish before the kill and
that holds nothing needed is ended at once (its work restarts elsewhere now, not at the kill).  A
``replace_before`` type gets a replacement ``REPLACE_SLACK`` measured start-ups before a known end,
and its walltime retirement waits (at most as long again) for that replacement to join.
Replacements are added after ``max_nodes`` is applied (they may go above it by the workers leaving)
and before the cost limits; launches of a switched type go to its fallback (:meth:`_routed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidepool.scaling.controller import Actions
    from tidepool.scaling.instances import InstanceTable
    from tidepool.scaling.node_types import NodeType
    from tidepool.scaling.observation import Observation
    from tidepool.scaling.preemption import FallbackTracker
    from tidepool.scaling.snapshot import ClusterSnapshot, WorkerView
    from tidepool.telemetry.journal import Journal

#: ``replace_before``: launch this many measured start-ups before a known end (a loaded machine starts slower)
REPLACE_SLACK = 1.5


class Replacing:
    """The known-end part of the controller (see the module docstring)."""

    node_types: dict[str, NodeType]
    instances: InstanceTable
    journal: Journal
    startup: dict[str, float]
    unusable: dict[str, str]
    fallbacks: FallbackTracker
    _noticed: dict[str, float]
    _abandoned: set[str]
    _replaced: set[str]
    _replace: list[tuple[str, str, str]]
    _expiry_seen: dict[str, float]

    def _manages(self, wid: str) -> bool:
        raise NotImplementedError

    def _awaits_replacement(self, ws: WorkerView, now: float) -> bool:
        """A walltime worker of a ``replace_before`` type stays while its replacement is still
        coming, for at most ``REPLACE_SLACK`` of its type's start-up (its margin covers that), so
        the pool has no gap between them."""
        if ws.id not in self._replaced:
            return False
        first = self._expiry_seen.setdefault(ws.id, now)
        to = self.fallbacks.route(ws.node_type)
        nt = self.node_types[to]
        coming = any(r.node_type == to for r in self.instances.open.values())
        if coming and now - first < REPLACE_SLACK * self.startup.get(to, nt.startup_estimate):
            if first == now:
                self.journal.record("decision", now, reason=f"{ws.id}: walltime retirement waits for its replacement "
                                                            "(replace_before) to join")  # fmt: skip
            return True
        return False

    def _notices(self, obs: Observation, by_id: Mapping[str, WorkerView], actions: Actions) -> None:
        """Preemption notices: journaled once, counted against the type (fallback), and the
        worker replaced at once while the pool has work (it is retired like an expiring one)."""
        for gone in [w for w in self._noticed if w not in by_id]:
            del self._noticed[gone]
        self._abandoned.intersection_update(by_id)
        self._replaced.intersection_update(by_id)
        for wid, deadline in obs.notices:
            ws = by_id.get(wid)
            if ws is None or wid in self._noticed:
                continue
            self._noticed[wid] = deadline
            left = deadline - obs.now
            self.journal.record("preemption-notice", obs.now, worker=wid, node_type=ws.node_type,
                                seconds=round(left, 3), reason=f"the provider takes {wid} back in {left:.1f}s")  # fmt: skip
            rec = self.fallbacks.trouble(ws.node_type, obs.now, f"preemption notice for {wid}")
            if rec is not None:
                self.journal.record(rec.pop("kind"), rec.pop("t"), **rec)
            if obs.demand or obs.running or obs.waiting:
                self._want_replacement(ws, f"preemption notice: it ends in {left:.1f}s")
            per_slot = ws.queued_seconds / max(1, ws.slots)
            if ws.running and not ws.unique_keys and per_slot > left and self._manages(wid):
                # its work cannot finish before the kill and it holds nothing needed: end it now,
                # so that work starts again elsewhere at once instead of when the notice runs out
                self._abandoned.add(wid)
                actions.terminate.append(wid)
                self.journal.record("terminate", obs.now, worker=wid, node_type=ws.node_type, reason=(
                    f"preemption notice: its ~{per_slot:.0f}s of work per slot cannot finish in the {left:.0f}s "
                    "notice and it holds nothing needed; ended now so the work restarts elsewhere at once"))  # fmt: skip

    def _replace_before(self, obs: Observation, by_id: Mapping[str, WorkerView]) -> None:
        """``replace_before`` types: a worker whose end is known gets a replacement its type's
        measured start-up (``REPLACE_SLACK`` times) before that end, so it is ready in time."""
        for wid, end in obs.ends:
            ws = by_id.get(wid)
            nt = self.node_types.get(ws.node_type) if ws is not None else None
            if ws is None or nt is None or not nt.replace_before or wid in self._replaced:
                continue
            lead = REPLACE_SLACK * self.startup.get(nt.name, nt.startup_estimate)
            if end - obs.now <= lead:
                self._want_replacement(ws, f"it ends in {end - obs.now:.1f}s and {nt.name} takes ~{lead:.1f}s "
                                           "to start (replace_before)")  # fmt: skip

    def _want_replacement(self, ws: WorkerView, why: str) -> None:
        if ws.id in self._replaced or not self._manages(ws.id):
            return
        self._replaced.add(ws.id)
        self._replace.append((ws.id, ws.node_type, why))

    def _with_replacements(self, planned: dict[str, int], snap: ClusterSnapshot, reasons: list[str]) -> dict[str, int]:
        """Add this step's replacements (routed to a fallback when switched): launches of that type
        made anyway this step (``min_nodes``, the policy) count as replacements; the rest may go
        above ``max_nodes`` by the workers of that type being replaced, which are leaving."""
        if not self._replace:
            return planned
        out = dict(planned)
        leaving: dict[str, int] = {}
        for w in snap.workers:
            if w.id in self._replaced:
                leaving[w.node_type] = leaving.get(w.node_type, 0) + 1
        wanted: dict[str, int] = {}
        for wid, name, why in self._replace:
            to = self.fallbacks.route(name)
            if to not in self.node_types or to in self.unusable:
                reasons.append(f"no replacement for {wid}: {to} cannot be launched")
                continue
            wanted[to] = wanted.get(to, 0) + 1
            reasons.append(f"replacement for {wid} ({why})" + (f" as {to} (fallback of {name})" if to != name else ""))
        for to, k in wanted.items():
            extra = k - out.get(to, 0)
            room = self.node_types[to].max_nodes - snap.nodes_of(to) - out.get(to, 0) + leaving.get(to, 0)
            if min(extra, room) > 0:
                out[to] = out.get(to, 0) + min(extra, room)
            if extra > room:
                reasons.append(f"{extra - max(0, room)} replacements not launched: {to} at max_nodes")
        self._replace.clear()
        return out

    def _routed(self, wanted: dict[str, int], reasons: list[str]) -> dict[str, int]:
        """Launches of a type whose fallback is on go to the fallback."""
        if not self.fallbacks.switched:
            return wanted
        out: dict[str, int] = {}
        for name, n in wanted.items():
            to = self.fallbacks.route(name)
            if to != name and n > 0:
                reasons.append(f"{n} {name} launches go to its fallback {to} ({self.fallbacks.switched[name][1]})")
            out[to] = out.get(to, 0) + n
        return out
