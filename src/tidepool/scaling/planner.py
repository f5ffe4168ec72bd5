"""Demand planning: which node types, and how many nodes, would run the pending demand.

Pure functions over a :class:`ClusterSnapshot`.  Demand (runnable tasks not on a worker yet) is
first packed onto the free capacity of live workers and of launches still pending, then onto new
nodes, whose spare room serves only demand that prefers their type (CPU work does not ride on GPU
nodes launched for GPU work).  For every demand shape, node types are ranked so that GPU demand only goes to types that
have GPUs, and CPU demand avoids a type with special resources (``gpu``, custom labels) whenever a
plain type fits: ``(special resources the demand does not use, cost, name)``.  Types in backoff,
disabled, or at ``max_nodes`` are skipped; a shape no type fits at all is reported as infeasible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidepool.resources import Shape, capacity, fits, task_slots
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.snapshot import ClusterSnapshot, Demand

PLAIN = frozenset({"cpu", "memory"})



def rank_types(shape: Shape, types: tuple[NodeType, ...]) -> list[NodeType]:
    """Node types whose workers fit ``shape``, best first (least special, cheapest, by name)."""
    wanted = {name for name, amount in shape if amount > 0}
    ok = [nt for nt in types if fits(nt.worker_resources, shape)]

    def score(nt: NodeType) -> tuple[int, float, str]:
        extra = [r for r in nt.resources if r not in PLAIN and r not in wanted]
        return (len(extra), nt.cost, nt.name)

    return sorted(ok, key=score)


def _fill(bins: list[dict[str, float]], shape: Shape, n: int) -> int:
    """Pack up to ``n`` tasks of ``shape`` into ``bins`` (first fit); returns how many are left."""
    for b in bins:
        if n <= 0:
            break
        k = min(n, capacity(b, shape))
        if k > 0:
            for name, amount in shape:
                b[name] = b.get(name, 0.0) - amount * k
            n -= k
    return n


def describe_types(types: tuple[NodeType, ...]) -> str:
    from tidepool.resources import format_resources

    return "; ".join(f"{nt.name} ({format_resources(nt.worker_resources)} per worker)" for nt in types) or "none"


@dataclass
class Plan:
    nodes: dict[str, int] = field(default_factory=dict)  # new nodes needed per type
    unplaced: dict[Shape, int] = field(default_factory=dict)  # demand nothing can take (limits)
    infeasible: list[Shape] = field(default_factory=list)  # demand no type could ever take
    reasons: list[str] = field(default_factory=list)


def plan(snapshot: ClusterSnapshot, demand: tuple[Demand, ...] | None = None) -> Plan:
    """New nodes per type needed to start every pending task at once (an upper bound)."""
    demand = snapshot.demand if demand is None else demand
    result = Plan()
    bins: list[dict[str, float]] = []
    for w in snapshot.workers:
        if w.state == "retiring":
            continue
        free = dict(w.resources)
        free["cpu"] = max(0.0, free.get("cpu", 0.0) - w.running)
        bins.append(free)
    for p in snapshot.pending:
        nt = snapshot.node_type(p.node_type)
        if nt is not None:
            bins.extend(dict(nt.worker_resources) for _ in range(p.nodes * nt.workers_per_node))
    count: dict[str, int] = {nt.name: snapshot.nodes_of(nt.name) for nt in snapshot.node_types}
    by_shape: dict[Shape, int] = {}
    for d in demand:
        by_shape[d.shape] = by_shape.get(d.shape, 0) + d.count
    # special shapes first so plain demand does not eat the special nodes' capacity
    order = sorted(by_shape, key=lambda s: (-sum(1 for n, _ in s if n not in PLAIN), s))
    planned_bins: dict[str, list[dict[str, float]]] = {}  # spare room on nodes this plan adds
    for shape in order:
        ranked = rank_types(shape, snapshot.node_types)
        n = _fill(bins, shape, by_shape[shape])
        usable = [nt for nt in ranked if not snapshot.blocked(nt.name)]
        if n > 0 and usable:  # spare room of planned nodes, only of the type this shape prefers
            n = _fill(planned_bins.get(usable[0].name, []), shape, n)
        if n <= 0:
            continue
        if not ranked:
            result.infeasible.append(shape)
            result.reasons.append(
                f"no node type fits {dict(shape)}; node types: {describe_types(snapshot.node_types)}"
            )
            continue
        for nt in ranked:
            if n <= 0:
                break
            if snapshot.blocked(nt.name):
                continue
            per_node = task_slots(dict(nt.worker_resources), shape) * nt.workers_per_node
            room = nt.max_nodes - count[nt.name]
            if per_node <= 0 or room <= 0:
                continue
            k = min(room, -(-n // per_node))
            count[nt.name] += k
            result.nodes[nt.name] = result.nodes.get(nt.name, 0) + k
            new_bins = [dict(nt.worker_resources) for _ in range(k * nt.workers_per_node)]
            n = _fill(new_bins, shape, n)
            planned_bins.setdefault(nt.name, []).extend(new_bins)
        if n > 0:
            result.unplaced[shape] = n
            names = ", ".join(nt.name for nt in ranked)
            result.reasons.append(f"{n} tasks needing {dict(shape)} wait: {names} at max_nodes or in backoff")
    return result
