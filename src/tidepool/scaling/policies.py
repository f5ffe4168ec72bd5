"""Built-in scaling policies.  Any callable ``snapshot -> ScaleDecision`` is a policy too.

Policies read only the snapshot (``now`` included).  Some keep a little memory between calls (the
ramp step of :class:`Backlog`); given the same sequence of snapshots they decide the same things.

- :class:`Backlog` (Spark's dynamic allocation): demand pending for ``delay`` seconds -> launch;
  while it persists, every ``interval`` launch again, 1, 2, 4, ... nodes, never more than the planner
  says the demand can use.
- :class:`NoProgress`: demand exists, nothing finished for ``seconds`` and nothing is being launched
  -> launch one node that fits (the safety net when other policies hold back).
- :class:`IdleRetire`: retire idle workers that hold nothing anyone needs after ``idle_timeout``
  (default: a quarter of the node type's measured startup time, at most 30 s: an idle worker is
  cheap to replace when its replacement starts fast, and Slurm-sized startups keep workers longer),
  at once when the forecast says no work can reach them sooner, and idle workers that do hold
  needed data after ``cached_idle_timeout`` (their data moves to survivors first).
- :class:`Adaptive`: combines the above and keeps workers younger than ``min_lifetime`` (a
  preference of this policy); a cluster file's ``kind = "adaptive"``.  The default policy is
  :class:`~tidepool.scaling.planned.Planned` (launches and retirements planned from the graph).

Limits are not a policy's business: ``min_nodes``/``max_nodes``, ``max_workers``, never launching
and retiring one node type in the same round, and leaving workers the autoscaler does not manage
alone are applied in one place, the controller, to whatever a policy answers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidepool.errors import ConfigError
from tidepool.resources import fits
from tidepool.scaling.planner import plan
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision


class Policy(Protocol):
    def __call__(self, snapshot: ClusterSnapshot) -> ScaleDecision: ...


def as_decision(value: Any) -> ScaleDecision:
    """Accept what a user policy returns: a ScaleDecision, a dict, or None (do nothing)."""
    if value is None:
        return ScaleDecision()
    if isinstance(value, ScaleDecision):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"launch", "retire", "infeasible", "reasons", "why", "cancel"}
        if unknown:
            raise ConfigError(f"policy returned unknown fields {sorted(unknown)}; use launch/retire/cancel")
        return ScaleDecision(dict(value.get("launch", {})), tuple(value.get("retire", ())),
                             tuple(value.get("infeasible", ())), tuple(value.get("reasons", ())),
                             tuple(dict(value.get("why", {})).items()), dict(value.get("cancel", {})))  # fmt: skip
    raise ConfigError(f"a policy must return a ScaleDecision or a dict, got {type(value).__name__}")


def check_decision(decision: ScaleDecision, snap: ClusterSnapshot) -> None:
    """Refuse (ConfigError) a decision naming node types the cluster does not have, launching (or
    calling off) a count that is not a whole number >= 0, launching and calling off one type, or
    retiring workers it does not have: a policy's bug,
    journaled as ``policy-error`` (the default policy serves that round) rather than ignored."""
    types = {nt.name for nt in snap.node_types}
    for verb, counts in (("launch", decision.launch), ("call off", decision.cancel)):
        for name, n in counts.items():
            if name not in types:
                raise ConfigError(f"policy asked to {verb} unknown node type {name!r}; the node types are "
                                  f"{sorted(types)}")  # fmt: skip
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ConfigError(f"policy asked to {verb} {n!r} nodes of {name!r}; a count is a whole number >= 0")
    for name, n in decision.cancel.items():
        if n and decision.launch.get(name):
            raise ConfigError(f"policy asked to launch and to call off {name!r} nodes in one decision")
    if decision.retire:
        live = {w.id for w in snap.workers}
        unknown = [w for w in decision.retire if w not in live]
        if unknown:
            raise ConfigError(f"policy asked to retire workers the cluster does not have: {unknown[:5]}")


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


def _check(owner: str, **values: Any) -> None:
    """Policy settings: numbers >= 0 (seconds, fractions; ``inf`` is "never"), ``None`` where the
    field allows it.  NaN, negatives and non-numbers are refused, as a cluster file's ``[policy]``
    table refuses them (a NaN idle timeout silently switched idle retirement off)."""
    for name, v in values.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) or v < 0:
            raise ConfigError(f"{owner}({name}=...) must be a number >= 0, got {v!r}")



@dataclass
class Backlog:
    delay: float = 0.1
    interval: float = 0.2
    _step: int = field(default=1, init=False)
    _last: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _check("Backlog", delay=self.delay, interval=self.interval)

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

    def __post_init__(self) -> None:
        _check("NoProgress", seconds=self.seconds)

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
class CompletionTarget:
    """Add nodes only while the forecast says they shorten the run by more than they cost.

    For every node type with work that prefers it, the controller forecasts the remaining time
    with 0, 1, 2, ... extra nodes (new nodes help only after their startup time).  A step from
    ``a`` to ``b`` extra nodes is taken when the seconds it saves, times the nodes that would hold
    them (the ``P`` nodes of that type already there or coming, plus ``a``), exceed the start-up the
    new nodes cost: ``saved * P > startup * (b - a)``.  On divisible work that is "launch while the
    new nodes would work at least as long as they take to start" (makespan with them at least twice
    the start-up), at any pool size; a chain or a narrow phase adds nothing (nothing is saved) and a
    wide phase adds enough.  Work that waits behind
    running tasks is launched for only once it could start within a node's startup time.  With ``max_eta`` it acts only
    while the forecast is above ``max_eta`` and takes the fewest nodes that bring it below, if any
    do; with ``deadline`` (absolute, scheduler clock) the target is ``deadline - now``.
    """

    max_eta: float | None = None
    deadline: float | None = None
    gain_factor: float = 1.0

    def __post_init__(self) -> None:
        _check("CompletionTarget", max_eta=self.max_eta, deadline=self.deadline, gain_factor=self.gain_factor)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        target = self.max_eta
        if self.deadline is not None:
            target = max(0.0, self.deadline - snap.now)
        launch: dict[str, int] = {}
        reasons: list[str] = []
        for f in snap.forecasts:
            if len(f.extra) < 2 or snap.blocked(f.node_type):
                continue
            base = f.etas[0]
            if target is not None and base <= target:
                continue
            if not snap.demand and (snap.next_demand_in is None or snap.next_demand_in > f.startup):
                continue  # nothing can run before a new node would arrive: launch when it can
            best = 0
            pool = snap.nodes_of(f.node_type)
            for i in range(1, len(f.extra)):
                saved = f.etas[best] - f.etas[i]
                # the seconds saved are worth the whole pool's time: P nodes held `saved` s less
                if saved * max(1, pool + f.extra[best]) > self.gain_factor * f.startup * (f.extra[i] - f.extra[best]):
                    best = i
            if target is not None:
                meets = [i for i in range(1, best + 1) if f.etas[i] <= target]
                if meets:
                    best = meets[0]
            if best == 0:
                continue
            k = f.extra[best]
            launch[f.node_type] = k
            reasons.append(
                f"forecast for {f.tasks} tasks preferring {f.node_type}: {_fmt(base)} now, "
                f"{_fmt(f.etas[best])} with {k} more node(s) (startup {f.startup:.1f}s)"
                + (f"; target {target:.0f}s" if target is not None else "")
            )
        return ScaleDecision(launch=launch, reasons=tuple(reasons))


def scale_to_meet(deadline: float) -> CompletionTarget:
    """A :class:`CompletionTarget` that aims to finish by ``deadline`` (scheduler clock)."""
    return CompletionTarget(deadline=deadline)


def _fmt(seconds: float) -> str:
    return "never (no worker)" if seconds == float("inf") else f"{seconds:.1f}s"


@dataclass
class IdleRetire:
    idle_timeout: float | None = None
    cached_idle_timeout: float = 60.0
    min_idle_timeout: float = 0.05
    #: default idle timeout, as a fraction of the node type's (measured) startup time
    startup_fraction: float = 0.25
    #: retire at once when the forecast says no work can arrive before a new node could start;
    #: None: so when ``idle_timeout`` is left to its default, not when it is given (a user who sets
    #: it keeps idle workers that long, e.g. between the graphs of an interactive session)
    lookahead: bool | None = None

    def __post_init__(self) -> None:
        _check("IdleRetire", idle_timeout=self.idle_timeout, cached_idle_timeout=self.cached_idle_timeout,
               min_idle_timeout=self.min_idle_timeout, startup_fraction=self.startup_fraction)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        retire: list[str] = []
        whys: list[tuple[str, str]] = []
        reasons: list[str] = []
        for w in snap.workers:
            if not w.idle or w.idle_since is None:
                continue
            if any(fits(w.resources, d.shape) for d in snap.demand):
                continue  # it can take waiting work: not idle for long
            nt = snap.node_type(w.node_type)
            timeout = self.idle_timeout
            if timeout is None:
                timeout = min(30.0, (nt.startup_estimate if nt is not None else 5.0) * self.startup_fraction)
            timeout = max(timeout, self.min_idle_timeout)
            idle = snap.now - w.idle_since
            gap = snap.next_demand_in
            ahead = self.lookahead if self.lookahead is not None else self.idle_timeout is None
            lookahead = (ahead and not snap.demand and idle >= self.min_idle_timeout
                         and (gap is None or gap > timeout))  # fmt: skip
            if w.unique_keys == 0 and (idle >= timeout or lookahead):
                why = "no work expected soon" if idle < timeout else f"timeout {timeout:.1f}s"
                reasons.append(f"{w.id} idle {idle:.1f}s and holds no needed data ({why})")
            elif w.unique_keys and (idle >= self.cached_idle_timeout or (lookahead and idle >= timeout)):
                # no work can come before a new node could start: moving its data costs less than
                # holding the node through the gap
                reasons.append(f"{w.id} idle {idle:.1f}s holding {w.unique_keys} needed values "
                               f"({w.unique_bytes} bytes): retire, moving them to survivors")  # fmt: skip
            else:
                continue
            whys.append((w.id, reasons[-1]))
            retire.append(w.id)
        return ScaleDecision(retire=tuple(retire), reasons=tuple(reasons), why=tuple(whys))


@dataclass
class MemoryPressure:
    """Launch a node that adds memory when the data held nears the pool's memory while work remains.

    Held bytes (in memory or spilled) over ``fraction`` of the running workers' memory limits ->
    one node of the launchable type with the most memory per cost (a type's ``memory`` resource;
    types that declare none count as the pool's smallest worker), one launch in flight at a time.
    """

    fraction: float = 0.7

    def __post_init__(self) -> None:
        _check("MemoryPressure", fraction=self.fraction)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        live = [w for w in snap.workers if w.state == "running"]
        pool = sum(w.memory_limit for w in live)
        if not pool or any(w.memory_limit <= 0 for w in live) or snap.pending:
            return ScaleDecision()
        if not (snap.demand or snap.waiting):
            return ScaleDecision()  # no task left to start: a new node would only idle
        held = sum(w.held_bytes for w in live)
        if held <= self.fraction * pool:
            return ScaleDecision()
        smallest = min(w.memory_limit for w in live)
        best: tuple[float, str] | None = None
        for nt in snap.node_types:
            if snap.blocked(nt.name) or snap.nodes_of(nt.name) >= nt.max_nodes:
                continue
            per_node = nt.resources.get("memory") or smallest * nt.workers_per_node
            score = per_node / max(nt.cost, 1e-9)
            if best is None or score > best[0]:
                best = (score, nt.name)
        if best is None:
            return ScaleDecision(reasons=(f"memory: held {_gb(held)} of the pool's {_gb(pool)}, but every "
                                          "node type is at its limit",))  # fmt: skip
        return ScaleDecision(launch={best[1]: 1}, reasons=(
            f"memory: held data {_gb(held)} is {held / pool:.0%} of the pool's {_gb(pool)} (over "
            f"{self.fraction:.0%}) with work left -> launch 1 {best[1]!r} (most memory per cost)",))  # fmt: skip


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def merge(decisions: Sequence[ScaleDecision]) -> ScaleDecision:
    launch: dict[str, int] = {}
    retire: list[str] = []
    infeasible: list[str] = []
    reasons: list[str] = []
    why: dict[str, str] = {}
    cancel: dict[str, int] = {}
    for d in decisions:
        for w, text in d.why:
            why.setdefault(w, text)
        for k, v in d.launch.items():
            launch[k] = max(launch.get(k, 0), v)
        for k, v in d.cancel.items():
            cancel[k] = max(cancel.get(k, 0), v)
        retire.extend(r for r in d.retire if r not in retire)
        infeasible.extend(i for i in d.infeasible if i not in infeasible)
        reasons.extend(d.reasons)
    launch = {k: v for k, v in launch.items() if v > 0}
    # a type one of them launches is not called off by another: the launch wins (never both ways)
    cancel = {k: v for k, v in cancel.items() if v > 0 and k not in launch}
    return ScaleDecision(launch, tuple(retire), tuple(infeasible), tuple(reasons), tuple(why.items()), cancel)


def keep_young(snap: ClusterSnapshot, d: ScaleDecision, min_lifetime: float) -> ScaleDecision:
    """Drop retirements of workers younger than ``min_lifetime`` (they just cost a start-up)."""
    by_id = {w.id: w for w in snap.workers}
    keep: list[str] = []
    reasons = list(d.reasons)
    for wid in d.retire:
        w = by_id.get(wid)
        if w is None:
            continue
        if snap.now - w.joined < min_lifetime:
            reasons.append(f"keep {wid}: younger than {min_lifetime:.1f}s")
        else:
            keep.append(wid)
    return ScaleDecision(d.launch, tuple(keep), d.infeasible, tuple(reasons), d.why, d.cancel)


@dataclass
class Adaptive:
    """CompletionTarget + NoProgress + IdleRetire + MemoryPressure, with anti-flap rules (the default
    before :class:`~tidepool.scaling.planned.Planned`; still a cluster file's ``kind = "adaptive"``).

    ``launcher`` decides launches from the completion forecast; ``backlog`` (off by default) adds
    Spark-style ramping on queued work; ``no_progress`` is the safety net; ``idle`` retires.
    """

    launcher: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=CompletionTarget)
    backlog: Callable[[ClusterSnapshot], ScaleDecision] | None = None
    no_progress: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=NoProgress)
    idle: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=IdleRetire)
    memory: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=MemoryPressure)
    extra: list[Callable[[ClusterSnapshot], Any]] = field(default_factory=list)
    min_lifetime: float = 1.0

    def __post_init__(self) -> None:
        _check("Adaptive", min_lifetime=self.min_lifetime)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        parts = [p for p in (self.launcher, self.backlog, self.no_progress, self.idle, self.memory, *self.extra)
                 if p is not None]  # fmt: skip
        return keep_young(snap, merge([as_decision(p(snap)) for p in parts]), self.min_lifetime)
