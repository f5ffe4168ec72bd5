"""Cost limits: what the pool costs, and the hard ceilings the controller applies after any policy.

State: a :class:`CostMeter` (owned by the controller) holds the cost of everything released so far
and, for every allocation still open, its price per hour and since when it is billed.  It bills
the way a provider does: from the launch (the allocation is asked for) to the release (the worker
left, failed, or the launch failed), at each node type's ``cost`` per node-hour, a worker of a
``workers_per_node`` node paying its share.  Launches in flight and workers being retired are
billed, so the rate never undercounts what the pool is committed to.  Nothing here reads a clock
or does I/O: ``now`` comes in, and the meter learns what ended from the controller's instance
table (:meth:`CostMeter.settle`, with the time of each move).

Place in the data flow: ``ScalingController.step`` asks the policy, clamps its launches to
``min_nodes``/``max_nodes``/``max_workers``, then :func:`cap_launches` cuts them to the
:class:`CostLimits` (``max_cost_per_hour`` for the whole pool, a per-run ``budget``), whatever the
policy asked for: those are the last word, like ``max_nodes``.  Each cut comes back with its
reason, which the controller journals (``cost-limit`` records).

Across a scheduler restart: a durable scheduler stores :meth:`CostMeter.export` each step (the cost
so far and every allocation still billed, with its price per hour), with the wall time.  The
restarted one puts the stored time on its own clock (:func:`on_this_clock`: the scheduler was down
meanwhile) and, once the autoscaler has adopted what the provider still lists,
:meth:`CostMeter.restore` counts the stored cost as spent and bills the adopted allocations on from
the stored step: the budget is not reset by a restart, and the adopted instances are billed for the
time the scheduler was down.  Allocations not adopted ended with the old scheduler (at most one
step of them is not billed).

Budget rule: a launch must leave, after the pool as it will be (the new nodes included) has run
for ``hold`` seconds more (the node type's start-up, at least :data:`MIN_HOLD`: a node is billed
at least that long however soon it is retired), the spent cost within the budget.  Once the budget
is spent, :func:`over_budget` says so and the controller retires idle workers that hold nothing
needed; tasks that run finish (stopping them would lose the work the money bought).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scaling.instances import FINAL, IS, InstanceTable
from tidepool.scaling.node_types import NodeType

#: seconds a new node is billed at the least (clouds bill a minute; a retirement is never instant)
MIN_HOLD = 60.0
HOUR = 3600.0


def _limit(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0 (node type cost units), got {value!r}; "
                          "leave it unset for no limit")  # fmt: skip
    return float(value)


@dataclass(frozen=True)
class CostLimits:
    """``max_cost_per_hour``: the whole pool's price per hour never goes above it (launches in
    flight included); ``budget``: what the run may spend in all.  Both in node type ``cost`` units
    (``cost`` is per node-hour); ``None``: no limit."""

    max_cost_per_hour: float | None = None
    budget: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_cost_per_hour", _limit("max_cost_per_hour", self.max_cost_per_hour))
        object.__setattr__(self, "budget", _limit("budget", self.budget))

    @property
    def any(self) -> bool:
        return self.max_cost_per_hour is not None or self.budget is not None


@dataclass(frozen=True)
class CostView:
    """The meter as of one step: ``spent`` at ``at``, billed at ``rate`` per hour from then on."""

    spent: float = 0.0
    rate: float = 0.0  # cost per hour of what is allocated now
    at: float = 0.0
    limits: CostLimits = CostLimits()

    def spent_at(self, now: float) -> float:
        """The cost so far at ``now`` (later than the step: the rate kept running)."""
        return self.spent + self.rate * max(0.0, now - self.at) / HOUR


class CostMeter:
    """Billed cost per allocation, from launch to release (see the module docstring)."""

    def __init__(self, node_types: Mapping[str, NodeType]) -> None:
        self.node_types = node_types
        self.closed = 0.0  # cost of what was released
        self._open: dict[tuple[str, str], tuple[float, float]] = {}  # (kind, id) -> (per hour, since)
        self._rate = 0.0
        self._weighted = 0.0  # sum of rate x since over the open ones

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _start(self, key: tuple[str, str], per_hour: float, since: float) -> None:
        if key in self._open:
            return
        self._open[key] = (per_hour, since)
        self._rate += per_hour
        self._weighted += per_hour * since

    def _stop(self, key: tuple[str, str], at: float) -> None:
        got = self._open.pop(key, None)
        if got is None:
            return
        per_hour, since = got
        self._rate -= per_hour
        self._weighted -= per_hour * since
        self.closed += per_hour * max(0.0, at - since) / HOUR
        if not self._open:  # no drift from float sums when nothing is open
            self._rate = self._weighted = 0.0

    def price(self, node_type: str) -> float:
        """Cost per node-hour of ``node_type`` (0 for a type it does not know)."""
        nt = self.node_types.get(node_type)
        return nt.cost if nt is not None else 0.0

    def registered_again(self, wid: str, node_type: str, now: float) -> None:
        """Worker ``wid``, given up (called off, timed out) or gone, registered after all: it is
        billed again from now, its node's share (it was billed nothing since it was given up)."""
        nt = self.node_types.get(node_type)
        self._start(("worker", wid), self.price(node_type) / (nt.workers_per_node if nt is not None else 1), now)

    def launched(self, rid: str, node_type: str, nodes: int, now: float) -> None:
        """Launch ``rid`` asked for ``nodes`` nodes: billed from now."""
        self._start(("request", rid), nodes * self.price(node_type), now)

    def settle(self, table: InstanceTable) -> None:
        """Release what ended, at the time it ended: requests the provider named (their workers
        are billed from then on, each its node's share) or that failed, workers gone or failed."""
        for kind, ident in [k for k in self._open]:
            if kind == "request":
                req = table.requests.get(ident)
                if req is None or req.state is IS.REQUESTED:
                    continue
                at = req.history[1][0] if len(req.history) > 1 else req.since
                self._stop(("request", ident), at)
                nt = self.node_types.get(req.node_type)
                share = self.price(req.node_type) / (nt.workers_per_node if nt is not None else 1)
                for wid in req.workers:
                    self._start(("worker", wid), share, at)
                    self._settle_worker(table, wid)
            else:
                self._settle_worker(table, ident)

    def _settle_worker(self, table: InstanceTable, wid: str) -> None:
        inst = table.get(wid)
        if inst is None or inst.state in FINAL:
            at = inst.history[-1][0] if inst is not None else self._open.get(("worker", wid), (0.0, 0.0))[1]
            self._stop(("worker", wid), at)

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def rate(self) -> float:
        """Cost per hour of everything allocated now."""
        return max(0.0, self._rate)

    def spent(self, now: float) -> float:
        """Cost so far: what was released plus what is open, billed up to ``now``."""
        return self.closed + max(0.0, self._rate * now - self._weighted) / HOUR

    def view(self, now: float, limits: CostLimits) -> CostView:
        return CostView(self.spent(now), self.rate, now, limits)

    # ---- across scheduler restarts ---------------------------------------------------------------
    def export(self, now: float) -> dict[str, Any] | None:
        """What a durable scheduler stores: the cost so far at ``now`` and the allocations billed
        now (kind, id, price per hour); ``None`` while nothing was ever billed."""
        billed = [[kind, ident, per_hour] for (kind, ident), (per_hour, _) in self._open.items() if per_hour > 0]
        spent = self.spent(now)
        if not billed and spent <= 0:
            return None
        return {"spent": spent, "open": billed, "at": now}

    def restore(self, stored: Mapping[str, Any], table: InstanceTable, now: float) -> None:
        """Carry on from ``stored`` (an :meth:`export` whose ``at`` is on this meter's clock, see
        :func:`on_this_clock`) once ``table`` holds the adopted instances: the stored cost is spent;
        the allocations still in ``table`` are billed on from ``at``."""
        self.closed += max(0.0, float(stored.get("spent", 0.0)))
        at = min(float(stored.get("at", now)), now)
        for kind, ident, per_hour in stored.get("open", ()):
            if kind == "request":
                present = str(ident) in table.requests
            else:
                inst = table.get(str(ident))
                present = inst is not None and inst.state not in FINAL
            if present:
                self._start((str(kind), str(ident)), float(per_hour), at)


def on_this_clock(stored: Mapping[str, Any] | None, now: float, wall_now: float) -> dict[str, Any] | None:
    """A stored :meth:`CostMeter.export` (with the ``wall`` time it was stored at) with its ``at``
    moved to this process's clock: ``now`` less the wall time that passed since (never negative)."""
    if stored is None:
        return None
    down = max(0.0, wall_now - float(stored.get("wall", wall_now)))
    return {**stored, "at": now - down}


def least_billed_hours(nt: NodeType) -> float:
    """The hours a node of ``nt`` is billed at the least once launched: its start-up, and never less
    than :data:`MIN_HOLD`."""
    return max(MIN_HOLD, nt.startup_estimate) / HOUR


def cap_launches(planned: Mapping[str, int], node_types: Mapping[str, NodeType], limits: CostLimits, *,
                 rate: float, spent: float) -> tuple[dict[str, int], list[tuple[str, int, int, str]]]:  # fmt: skip
    """``planned`` (nodes per type) cut to the limits, in its order; and each cut as
    ``(node type, asked, allowed, why)``.  ``rate``: the pool's cost per hour now (launches in
    flight included); ``spent``: the run's cost so far."""
    out: dict[str, int] = {}
    cuts: list[tuple[str, int, int, str]] = []
    for name, asked in planned.items():
        nt = node_types[name]
        price = nt.cost
        n, why = asked, ""
        if price > 0 and limits.max_cost_per_hour is not None:
            room = limits.max_cost_per_hour - rate
            k = max(0, math.floor(room / price + 1e-9))
            if k < n:
                n, why = k, (f"max_cost_per_hour {limits.max_cost_per_hour:g}: the pool costs {rate:g}/h now "
                             f"and a {name} node {price:g}/h")  # fmt: skip
        if price > 0 and limits.budget is not None and n > 0:
            hold = least_billed_hours(nt)
            room = (limits.budget - spent) / hold - rate
            k = max(0, math.floor(room / price + 1e-9))
            if k < n:
                n, why = k, (f"budget {limits.budget:g}: {spent:.4g} spent, the pool costs {rate:g}/h and a "
                             f"{name} node {price:g}/h for at least {hold * HOUR:g}s")  # fmt: skip
        if n < asked:
            cuts.append((name, asked, n, why))
        if n > 0:
            out[name] = n
            rate += n * price
    return out, cuts


def over_budget(limits: CostLimits, spent: float) -> bool:
    """The run's budget is spent: launch nothing, retire what idles."""
    return limits.budget is not None and spent >= limits.budget
