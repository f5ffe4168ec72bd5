"""Checks of the scaling controller's settings, run when it is made (``adapt()``, a cluster file):
stateless.  Settings that would fail every step or switch the autoscaler off without a word (a
string interval, a negative launch timeout, cost limits no node type fits under) are refused with a
:class:`~tidepool.errors.ConfigError` before anything starts."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scaling.limits import MIN_HOLD, CostLimits, least_billed_hours
from tidepool.scaling.node_types import NodeType


def check_settings(policy: Any, launch_timeout: Any, backoff_base: Any, backoff_max: Any, max_type_failures: Any,
                    forecast_interval: Any, manage_foreign: Any) -> None:  # fmt: skip
    """Refuse, before anything starts, settings that would fail every step (a string interval) or
    turn the autoscaler off without a word (a negative launch timeout gives up every launch)."""
    if policy is not None and not callable(policy):
        raise ConfigError(f"policy must be a callable taking a ClusterSnapshot (e.g. Adaptive()), got {policy!r}; "
                          "for the default policy's goal use objective='cheapest'|'fastest'|'balanced'")  # fmt: skip
    for name, value, can_be_none in (("launch_timeout", launch_timeout, True), ("backoff_base", backoff_base, False),
                                     ("backoff_max", backoff_max, False),
                                     ("forecast_interval", forecast_interval, True)):  # fmt: skip
        if value is None and can_be_none:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} must be a finite number of seconds > 0{' (or None)' if can_be_none else ''}, "
                              f"got {value!r}")  # fmt: skip
    if isinstance(max_type_failures, bool) or not isinstance(max_type_failures, numbers.Integral) or max_type_failures < 1:
        raise ConfigError(f"max_type_failures must be a whole number >= 1 (failed launches before a node type is "
                          f"disabled), got {max_type_failures!r}")  # fmt: skip
    if not isinstance(manage_foreign, bool):
        raise ConfigError(f"manage_foreign must be True or False, got {manage_foreign!r}")


def check_affordable(node_types: Sequence[NodeType], limits: CostLimits) -> None:
    """Cost limits under which no node type could ever be launched leave every task waiting for ever
    (the limits cut each launch to 0 with only a journal line): refused, as ``max_nodes=0`` is."""
    if not limits.any or any(nt.cost <= 0 for nt in node_types):
        return
    cheapest = min(node_types, key=lambda nt: nt.cost)
    if limits.max_cost_per_hour is not None and cheapest.cost > limits.max_cost_per_hour:
        raise ConfigError(f"max_cost_per_hour {limits.max_cost_per_hour:g} is below the cost of the cheapest node "
                          f"type ({cheapest.name!r}: {cheapest.cost:g} per node-hour): no node could ever be "
                          "launched; raise it or lower the node types' cost")  # fmt: skip
    least = min(nt.cost * least_billed_hours(nt) for nt in node_types)
    if limits.budget is not None and limits.budget < least:
        raise ConfigError(f"budget {limits.budget:g} is below what one node costs at the least ({least:.4g}: "
                          f"a node is billed {MIN_HOLD:g}s at least): no node could ever be launched; raise it")  # fmt: skip


def never_launched(node_types: Sequence[NodeType], limits: CostLimits,
                   spent: float = 0.0) -> tuple[tuple[str, str], ...]:  # fmt: skip
    """(node type, why) for each node type these settings never let launch: ``max_nodes=0``, a cost
    per node-hour over ``max_cost_per_hour``, or one node's least bill over the budget (what is left
    of it after ``spent``: spending only grows, so a type it rules out stays out).  Tasks only
    such types could run wait ``no_worker_timeout`` for a worker started by hand, then fail
    (``InfeasibleTaskError``) instead of waiting for ever (``Feasibility.by_hand_only``)."""
    out = []
    for nt in node_types:
        if nt.max_nodes == 0:
            out.append((nt.name, "its max_nodes is 0"))
        elif limits.max_cost_per_hour is not None and nt.cost > limits.max_cost_per_hour:
            out.append((nt.name, f"its cost {nt.cost:g} per node-hour is over max_cost_per_hour "
                                 f"{limits.max_cost_per_hour:g}"))  # fmt: skip
        elif limits.budget is not None and nt.cost * least_billed_hours(nt) > limits.budget - spent:
            rest = limits.budget - spent
            left = "" if spent <= 0 else f" ({rest:.4g} of it left)" if rest > 0 else " (all of it spent)"
            out.append((nt.name, f"one node costs {nt.cost * least_billed_hours(nt):.4g} at the least, over the "
                                 f"budget {limits.budget:g}{left}"))  # fmt: skip
    return tuple(out)
