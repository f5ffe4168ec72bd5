"""Built-in scaling policies.  Any callable ``snapshot -> ScaleDecision`` is a policy too.

Policies read only the snapshot (``now`` included).  Some keep a little memory between calls (the
ramp step of :class:`Backlog`); given the same sequence of snapshots they decide the same things.

- :class:`Backlog` (Spark's dynamic allocation): demand pending for ``delay`` seconds -> launch;
  while it persists, every ``interval`` launch again, 1, 2, 4, ... nodes, never more than the planner
  says the demand can use.
- :class:`NoProgress`: demand exists, nothing finished for ``seconds`` and nothing is being launched
  -> launch one node that fits (the safety net when other policies hold back).
- :class:`IdleRetire`: retire idle workers that hold nothing anyone needs after ``idle_timeout``
  (default: the node type's ``startup_estimate``, the ski-rental rule: keeping an idle worker longer
  than it takes to start a new one cannot pay off), and idle workers that do hold needed data after
  ``cached_idle_timeout`` (their data moves to survivors first).
- :class:`Adaptive`: the default; combines the above, then applies anti-flap rules (a worker younger
  than ``min_lifetime`` is not retired; no launch and retire of the same node type in one decision).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidepool.errors import ConfigError
from tidepool.scaling.planner import plan
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision
from tidepool.scheduler.placement import fits


class Policy(Protocol):
    def __call__(self, snapshot: ClusterSnapshot) -> ScaleDecision: ...


def as_decision(value: Any) -> ScaleDecision:
    """Accept what a user policy returns: a ScaleDecision, a dict, or None (do nothing)."""
    if value is None:
        return ScaleDecision()
    if isinstance(value, ScaleDecision):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"launch", "retire", "infeasible", "reasons"}
        if unknown:
            raise ConfigError(f"policy returned unknown fields {sorted(unknown)}; use launch/retire")
        return ScaleDecision(dict(value.get("launch", {})), tuple(value.get("retire", ())),
                             tuple(value.get("infeasible", ())), tuple(value.get("reasons", ())))  # fmt: skip
    raise ConfigError(f"a policy must return a ScaleDecision or a dict, got {type(value).__name__}")


def _launch_upto(snapshot: ClusterSnapshot, budget: int) -> tuple[dict[str, int], list[str]]:
    """Up to ``budget`` nodes, in the planner's order of preference."""
    p = plan(snapshot)
    out: dict[str, int] = {}
    for name, n in p.nodes.items():
        take = min(n, budget)
        if take > 0:
            out[name] = take
            budget -= take
    return out, p.reasons


@dataclass
class Backlog:
    delay: float = 0.1
    interval: float = 0.2
    _step: int = field(default=1, init=False)
    _last: float | None = field(default=None, init=False)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        if not snap.demand or snap.backlog_since is None:
            self._step, self._last = 1, None
            return ScaleDecision()
        waited = snap.now - snap.backlog_since
        if waited < self.delay or (self._last is not None and snap.now - self._last < self.interval):
            return ScaleDecision()
        launch, why = _launch_upto(snap, self._step)
        if not launch:
            return ScaleDecision(reasons=tuple(why))
        self._last = snap.now
        n = sum(launch.values())
        reason = (f"backlog: {snap.demand_tasks} runnable tasks waited {waited:.1f}s for a slot; "
                  f"ramp step {self._step} -> launch {n}")  # fmt: skip
        self._step *= 2
        return ScaleDecision(launch=launch, reasons=(reason, *why))


@dataclass
class NoProgress:
    seconds: float = 30.0

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        if not snap.demand or snap.pending:
            return ScaleDecision()
        stalled = snap.now - max(snap.last_progress, snap.backlog_since or 0.0)
        if stalled < self.seconds:
            return ScaleDecision()
        launch, why = _launch_upto(snap, 1)
        if not launch:
            return ScaleDecision(reasons=tuple(why))
        return ScaleDecision(launch=launch, reasons=(
            f"no progress for {stalled:.1f}s with {snap.demand_tasks} runnable tasks -> launch 1",
        ))  # fmt: skip


@dataclass
class IdleRetire:
    idle_timeout: float | None = None
    cached_idle_timeout: float = 60.0
    min_idle_timeout: float = 0.1

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        retire: list[str] = []
        reasons: list[str] = []
        left = {nt.name: snap.nodes_of(nt.name) for nt in snap.node_types}
        for w in snap.workers:
            if not w.idle or w.idle_since is None:
                continue
            if any(fits(w.resources, d.shape) for d in snap.demand):
                continue  # it can take waiting work: not idle for long
            nt = snap.node_type(w.node_type)
            timeout = self.idle_timeout
            if timeout is None:
                timeout = nt.startup_estimate if nt is not None else 5.0
            timeout = max(timeout, self.min_idle_timeout)
            idle = snap.now - w.idle_since
            if nt is not None and left.get(nt.name, 0) - 1 < nt.min_nodes:
                continue
            if w.unique_keys == 0 and idle >= timeout:
                reasons.append(f"{w.id} idle {idle:.1f}s and holds no needed data (timeout {timeout:.1f}s)")
            elif w.unique_keys and idle >= self.cached_idle_timeout:
                reasons.append(f"{w.id} idle {idle:.1f}s holding {w.unique_keys} needed values "
                               f"({w.unique_bytes} bytes): retire, moving them to survivors")  # fmt: skip
            else:
                continue
            retire.append(w.id)
            if nt is not None:
                left[nt.name] -= 1
        return ScaleDecision(retire=tuple(retire), reasons=tuple(reasons))


def merge(decisions: Sequence[ScaleDecision]) -> ScaleDecision:
    launch: dict[str, int] = {}
    retire: list[str] = []
    infeasible: list[str] = []
    reasons: list[str] = []
    for d in decisions:
        for k, v in d.launch.items():
            launch[k] = max(launch.get(k, 0), v)
        retire.extend(r for r in d.retire if r not in retire)
        infeasible.extend(i for i in d.infeasible if i not in infeasible)
        reasons.extend(d.reasons)
    return ScaleDecision({k: v for k, v in launch.items() if v > 0}, tuple(retire), tuple(infeasible), tuple(reasons))


def anti_flap(snap: ClusterSnapshot, d: ScaleDecision, min_lifetime: float) -> ScaleDecision:
    """Drop retirements of young workers and of node types this decision launches."""
    by_id = {w.id: w for w in snap.workers}
    keep: list[str] = []
    reasons = list(d.reasons)
    for wid in d.retire:
        w = by_id.get(wid)
        if w is None:
            continue
        if snap.now - w.joined < min_lifetime:
            reasons.append(f"anti-flap: keep {wid}, younger than {min_lifetime:.1f}s")
        elif d.launch.get(w.node_type):
            reasons.append(f"anti-flap: keep {wid}, its type {w.node_type} is being launched")
        else:
            keep.append(wid)
    return ScaleDecision(d.launch, tuple(keep), d.infeasible, tuple(reasons))


@dataclass
class Adaptive:
    """The default policy: Backlog + NoProgress + IdleRetire, with anti-flap rules."""

    backlog: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=Backlog)
    no_progress: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=NoProgress)
    idle: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=IdleRetire)
    extra: list[Callable[[ClusterSnapshot], Any]] = field(default_factory=list)
    min_lifetime: float = 1.0

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        parts = [p for p in (self.backlog, self.no_progress, self.idle, *self.extra) if p is not None]
        return anti_flap(snap, merge([as_decision(p(snap)) for p in parts]), self.min_lifetime)
