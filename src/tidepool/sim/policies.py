"""Policies to compare tidepool's with, written as tidepool policies (``snapshot -> ScaleDecision``),
and the names the simulator knows policies by.

- :class:`DaskLike`: Dask distributed's ``Adaptive``.  Every ``interval`` (1 s) it computes
  ``adaptive_target``: the estimated seconds of queued and processing work over
  ``target_duration`` (5 s), rounded up, never more than the tasks that could run, at least 1 while
  tasks wait and no worker exists.  Above the current pool (workers plus launches in flight) it
  launches the difference; below it, idle workers holding the fewest bytes are proposed for removal,
  and a worker is retired once proposed on ``wait_count`` (3) consecutive evaluations.  A task
  kind never timed counts ``default_duration`` (0.5 s, Dask's default) -- tidepool's own estimate is
  used once one exists.  Dask scales copies of one worker; here launches go to the node type the
  waiting work prefers (the planner's first choice).
- :class:`HyperQueueLike`: HyperQueue's automatic allocation.  While tasks wait for a slot it keeps
  ``backlog`` allocations (of ``workers_per_alloc`` nodes) queued, submitting more as queued ones
  start; a worker that ran nothing for ``idle_timeout`` (5 min) stops.

Both keep a little memory between calls (the last evaluation, removal counts), like
:class:`~tidepool.scaling.policies.Backlog`; given the same snapshots they decide the same things.

Names (:func:`make_policy`): ``default`` (tidepool's :class:`~tidepool.scaling.planned.Planned`;
options ``objective``, ``deadline``, ``budget``: ``default(objective='cheapest')``), ``adaptive``
(the earlier default, :class:`~tidepool.scaling.policies.Adaptive`), ``backlog`` and ``completion`` (as ``[policy] kind`` in a cluster file), ``dask``, ``hyperqueue``,
``cluster`` (the cluster file's ``[policy]``), or ``module:function`` / ``module:Class``.
Options follow the name: ``dask(target_duration=10)``, ``hyperqueue(backlog=4)``,
``backlog(idle_timeout=5)``.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scaling.planner import rank_types
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision, Shape

DASK_DEFAULT_DURATION = 0.5


def _preferred_type(snap: ClusterSnapshot) -> str | None:
    """The node type the most common waiting work prefers (first unblocked in the planner's order)."""
    shapes: dict[Shape, int] = {}
    for d in snap.demand:
        shapes[d.shape] = shapes.get(d.shape, 0) + d.count
    order = sorted(shapes, key=lambda s: (-shapes[s], s)) or [(("cpu", 1.0),)]
    for shape in order:
        for nt in rank_types(shape, snap.node_types):
            if not snap.blocked(nt.name):
                return nt.name
    return None


def _pool(snap: ClusterSnapshot) -> int:
    """Workers now (not retiring) plus workers of launches in flight."""
    live = sum(1 for w in snap.workers if w.state != "retiring")
    return live + sum(_not_arrived(snap, _ids(snap)).values())


def _ids(snap: ClusterSnapshot) -> set[str]:
    return {w.id for w in snap.workers}


def _not_arrived(snap: ClusterSnapshot, ids: set[str]) -> dict[str, int]:
    """Per launch request, workers asked for that have not registered yet."""
    out: dict[str, int] = {}
    for p in snap.pending:
        nt = snap.node_type(p.node_type)
        out[p.request_id] = max(0, p.nodes * (nt.workers_per_node if nt else 1)
                                - sum(1 for w in p.worker_ids if w in ids))  # fmt: skip
    return out


def _number(policy: str, name: str, v: Any, what: str, *, least: float = 0.0, above: float | None = None,
            whole: bool = False, finite: bool = True) -> None:
    """A baseline policy's option: a number (``whole``: an int) >= ``least`` (or > ``above``),
    finite unless not ``finite`` (NaN never); else a ConfigError saying ``what`` it must be."""
    from tidepool.errors import ConfigError

    ok = not isinstance(v, bool) and isinstance(v, int if whole else (int, float)) and not math.isnan(v) \
        and (math.isfinite(v) or not finite) and (v > above if above is not None else v >= least)  # fmt: skip
    if not ok:
        raise ConfigError(f"{policy}({name}=...) must be {what}, got {v!r}")


@dataclass
class DaskLike:
    target_duration: float = 5.0
    interval: float = 1.0
    wait_count: int = 3
    default_duration: float = DASK_DEFAULT_DURATION
    minimum: int = 0
    maximum: int | None = None
    _last: float | None = field(default=None, init=False)
    _close_counts: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        from tidepool.errors import ConfigError

        _number("dask", "target_duration", self.target_duration, "a number of seconds > 0", above=0.0)
        _number("dask", "interval", self.interval, "a number of seconds >= 0")  # 0: every round
        _number("dask", "default_duration", self.default_duration, "a number of seconds >= 0")
        _number("dask", "wait_count", self.wait_count, "a whole number >= 1", least=1, whole=True)
        for name, count in (("minimum", self.minimum), ("maximum", self.maximum)):
            if count is not None:
                _number("dask", name, count, "a number of workers >= 0 (maximum may be inf)", finite=False)
        if self.maximum is not None and self.minimum > self.maximum:
            raise ConfigError(f"dask(minimum={self.minimum}, maximum={self.maximum}): minimum must be <= maximum")

    def target(self, snap: ClusterSnapshot) -> int:
        """Dask's ``adaptive_target``: workers wanted for the work queued and processing now."""
        queued = sum(d.count * (d.est_seconds if d.est_seconds > 0 else self.default_duration) for d in snap.demand)
        processing = sum(w.queued_seconds for w in snap.workers)
        ready = snap.demand_tasks + sum(w.running for w in snap.workers)
        cpu = math.ceil((processing + queued) / self.target_duration) if processing + queued > 0 else 0
        cpu = min(ready, cpu)
        if snap.demand and not snap.workers:
            cpu = max(1, cpu)
        target = max(self.minimum, cpu)
        if self.maximum is not None:
            target = min(self.maximum, target)
        return target

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        if self._last is not None and snap.now - self._last < self.interval:
            return ScaleDecision()
        self._last = snap.now
        target = self.target(snap)
        current = _pool(snap)
        if target >= current:
            self._close_counts.clear()
            if target == current:
                return ScaleDecision()
            name = _preferred_type(snap)
            if name is None:
                return ScaleDecision(reasons=("dask-like: no usable node type",))
            nt = snap.node_type(name)
            per = nt.workers_per_node if nt else 1
            n = -(-(target - current) // per)
            return ScaleDecision(launch={name: n}, reasons=(
                f"dask-like: adaptive target {target} workers > {current} (queued + processing work "
                f"/ {self.target_duration:g}s) -> launch {n}",))  # fmt: skip
        # target < current: idle workers holding the least data first, then busy ones
        cands = sorted((w for w in snap.workers if w.state == "running"),
                       key=lambda w: (w.running > 0, w.held_bytes, w.id))  # fmt: skip
        to_close = [w.id for w in cands[: current - target] if w.running == 0]
        firm: list[str] = []
        for wid in to_close:
            self._close_counts[wid] = self._close_counts.get(wid, 0) + 1
            if self._close_counts[wid] >= self.wait_count:
                firm.append(wid)
        for wid in list(self._close_counts):
            if wid in firm or wid not in to_close:
                del self._close_counts[wid]
        if not firm:
            return ScaleDecision()
        why = f"dask-like: adaptive target {target} < {current}; proposed {self.wait_count} times in a row"
        return ScaleDecision(retire=tuple(firm), reasons=(why,), why=tuple((w, why) for w in firm))


@dataclass
class HyperQueueLike:
    backlog: int = 1
    workers_per_alloc: int = 1
    idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name, v in (("backlog", self.backlog), ("workers_per_alloc", self.workers_per_alloc)):
            # 0 launched nothing, for ever
            _number("hyperqueue", name, v, "a whole number >= 1", least=1, whole=True)
        _number("hyperqueue", "idle_timeout", self.idle_timeout, "a number of seconds >= 0", finite=False)

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        launch: dict[str, int] = {}
        reasons: list[str] = []
        if snap.demand:
            waiting = _not_arrived(snap, _ids(snap))
            nodes = 0  # nodes asked for whose workers have not all registered
            for p in snap.pending:
                nt = snap.node_type(p.node_type)
                nodes += -(-waiting.get(p.request_id, 0) // (nt.workers_per_node if nt else 1))
            allocs = -(-nodes // max(1, self.workers_per_alloc))
            need = self.backlog - allocs
            name = _preferred_type(snap)
            if need > 0 and name is not None:
                launch[name] = need * self.workers_per_alloc
                reasons.append(f"hyperqueue-like: {snap.demand_tasks} tasks wait, {allocs} allocations queued "
                               f"< backlog {self.backlog} -> submit {need}")  # fmt: skip
        retire: list[str] = []
        why: list[tuple[str, str]] = []
        for w in snap.workers:
            if w.state == "running" and w.running == 0 and w.idle_since is not None \
                    and snap.now - w.idle_since >= self.idle_timeout:  # fmt: skip
                retire.append(w.id)
                why.append((w.id, f"hyperqueue-like: idle {snap.now - w.idle_since:.0f}s >= {self.idle_timeout:g}s"))
        return ScaleDecision(launch=launch, retire=tuple(retire), reasons=tuple(reasons), why=tuple(why))


_NAMED = re.compile(r"^([A-Za-z_][\w.\-]*(?::[A-Za-z_]\w*)?)\s*(?:\((.*)\))?\s*$", re.S)
NAMES = ("default", "adaptive", "backlog", "completion", "dask", "hyperqueue", "cluster")


def _kwargs(text: str, where: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as exc:
        raise ConfigError(f"policy {where!r}: cannot read its options {text!r}: {exc.msg}") from exc
    assert isinstance(call, ast.Call)
    if call.args:
        raise ConfigError(f"policy {where!r}: options are key=value, e.g. dask(target_duration=10)")
    out: dict[str, Any] = {}
    for kw in call.keywords:
        try:
            out[str(kw.arg)] = ast.literal_eval(kw.value)
        except ValueError as exc:
            raise ConfigError(f"policy {where!r}: option {kw.arg} must be a literal value") from exc
    return out


def make_policy(spec: str, cluster_policy: Any = None) -> Any:
    """A fresh policy object for ``spec`` (see the module docstring for the names)."""
    from tidepool.config import ClusterConfig
    from tidepool.scaling.node_types import NodeType

    m = _NAMED.match(spec)
    if m is None:
        raise ConfigError(f"policy {spec!r}: expected a name ({', '.join(NAMES)}) or module:function, with "
                          "options in parentheses, e.g. dask(target_duration=10)")  # fmt: skip
    name, opts = m.group(1), _kwargs(m.group(2) or "", spec)
    if name == "dask":
        return _build(DaskLike, opts, spec)
    if name == "hyperqueue":
        return _build(HyperQueueLike, opts, spec)
    if name == "cluster":
        if cluster_policy is None:
            raise ConfigError("policy 'cluster': the cluster has no [policy] table (pass a cluster file)")
        return cluster_policy
    if name == "default":
        from tidepool.scaling.planned import default_policy

        return _build(default_policy, opts, spec)
    if name in ("adaptive", "backlog", "completion") or ":" in name:
        cfg = ClusterConfig([NodeType("x")], policy={"kind": name, **opts}, source=f"policy {spec!r}")
        return cfg.make_policy()
    raise ConfigError(f"unknown policy {name!r}; use one of {', '.join(NAMES)} or module:function")


def _build(cls: Any, opts: dict[str, Any], spec: str) -> Any:
    try:
        return cls(**opts)
    except TypeError as exc:
        raise ConfigError(f"policy {spec!r}: {exc}") from exc
