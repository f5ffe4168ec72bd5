"""Which resource shapes the autoscaler could ever run: frozen data the scheduler keeps.

State: none (frozen).  A :class:`Feasibility` is what the node types offer, which of them are
disabled (too many failed launches, or a failed setup), and which the settings never let launch.  The controller returns a new one in
``Actions.feasibility`` whenever a node type gets disabled; the shell hands it to the scheduler
state machine in a ``CheckFeasible`` event, which fails the waiting tasks it rules out and keeps
it for tasks that become ready later.  So the state machine never reads the controller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tidepool.resources import Shape
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.planner import describe_types, rank_types


def largest_offers(shape: Shape, types: Iterable[NodeType]) -> str:
    """``" (the most memory any node type offers is 14.9GiB per worker, on 'big')"`` for each
    resource the shape needs more of than every node type has."""
    from tidepool.resources import format_resources

    def offered(name: str, value: float) -> str:
        return format_resources({name: value}).split("=", 1)[1]

    parts = []
    types = list(types)
    for name, amount in shape:
        offers = [(nt.worker_resources.get(name, 0.0), nt.name) for nt in types]
        best, who = max(offers, default=(0.0, ""))
        if amount > best:
            if best <= 0:
                parts.append(f"no node type has {name}")
            else:
                parts.append(f"the most {name} any node type offers is {offered(name, best)} per worker, on {who!r}")
    if not parts:  # each amount is offered somewhere: all of them at once nowhere?
        lacks = {nt.name: [f"{name} {offered(name, nt.worker_resources.get(name, 0.0))}" for name, amount in shape
                           if nt.worker_resources.get(name, 0.0) < amount] for nt in types}  # fmt: skip
        if lacks and all(lacks.values()):
            parts.append("each amount is offered by some node type, but none offers all of them at once: "
                         + "; ".join(f"{t!r} has only {', '.join(lack)}" for t, lack in lacks.items()))  # fmt: skip
    return f" ({'; '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class Feasibility:
    """The node types, and ``disabled``: (node type, error class, why) for each one disabled."""

    node_types: tuple[NodeType, ...]
    disabled: tuple[tuple[str, str, str], ...] = ()
    #: (node type, why) for each node type the settings never let launch (``max_nodes=0``, a cost
    #: over ``max_cost_per_hour``, one node's least bill over the budget): only a worker started by
    #: hand can serve a shape only they fit (:meth:`by_hand_only`)
    never: tuple[tuple[str, str], ...] = ()

    def _only_never(self, fitting: list[NodeType]) -> dict[str, str] | None:
        """Why each of ``fitting`` is never launched, when every one of them is (else None)."""
        never = dict(self.never)
        return never if fitting and all(nt.name in never for nt in fitting) else None

    def __call__(self, shape: Shape) -> str | tuple[str, str] | None:
        """Why no usable node type could ever run ``shape`` (None if one could).

        A shape only disabled node types fit fails with the error that disabled them
        (``(error type, message)``), so the user sees the provider's own words.
        """
        types = self.node_types
        fitting = rank_types(shape, types)
        if not fitting:
            return (f"it needs {dict(shape)} and no node type offers that{largest_offers(shape, types)}; "
                    f"node types: {describe_types(types)}")  # fmt: skip
        if self._only_never(fitting) is not None:
            return None  # a worker started by hand may serve it: it waits no_worker_timeout (by_hand_only)
        never = dict(self.never)
        off = {name: (error, why) for name, error, why in self.disabled}
        names = [nt.name for nt in fitting if nt.name not in never]
        if all(n in off for n in names):
            why = "; ".join(f"node type {n!r} is disabled: {off[n][1]}" for n in names)
            return off[names[0]][0], (
                f"it needs {dict(shape)}, which only disabled node types offer ({why}). Fix the "
                "provider or the setup, then start a new cluster (or add a worker by hand)")  # fmt: skip
        return None

    def by_hand_only(self, shape: Shape) -> str | None:
        """Why only a worker started by hand could run ``shape`` (None: a node type can be launched
        for it, or none fits): the node types that fit it are ones the settings never launch
        (``max_nodes=0``, a type "kept in reserve" for workers started by hand, or cost limits).
        Its tasks wait ``no_worker_timeout`` for such a worker, then fail saying this."""
        if not self.never:  # the usual case: asked every tick for every waiting shape
            return None
        fitting = rank_types(shape, self.node_types)
        never = self._only_never(fitting)
        if never is None:
            return None
        return "; ".join(f"node type {nt.name!r} is never launched: {never[nt.name]}" for nt in fitting)
