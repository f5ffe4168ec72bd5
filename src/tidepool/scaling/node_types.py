"""Node types: the kinds of machines a provider can start.

A :class:`NodeType` says what one node offers (``resources`` for the whole node, split across
``workers_per_node`` worker processes), how many may exist (``min_nodes``..``max_nodes``), what it
costs and how long it takes to start.  Immutable; used by providers (what to launch), the planner
(what demand fits where) and the scheduler (is a task feasible at all).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.resources import parse_resources

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class NodeType:
    """One kind of node.  Every field is checked here, so a bad value fails where it is written.

    ``name``: letters, digits, ``_``, ``.``, ``-`` (it becomes part of worker ids and file names);
    ``min_nodes``/``max_nodes``: whole numbers, ``0 <= min_nodes <= max_nodes``;
    ``workers_per_node``: a whole number >= 1; ``cost``/``startup_estimate``: finite numbers >= 0;
    ``resources``: see :func:`~tidepool.resources.parse_resources`; ``options``: a mapping.

    Preemptible (spot) capacity: ``preemptible=True`` says the provider may take its nodes back
    with a notice; ``fallback`` names the type launched instead after ``fallback_after`` (>= 1)
    preemptions or capacity errors within ``fallback_window`` seconds, until the type has had none
    for ``fallback_healthy`` seconds (``scaling/preemption.py``).  Warm pools: ``min_idle`` (a whole
    number <= ``max_nodes``) idle workers are kept ready apart from ``min_nodes``;
    ``replace_before=True`` launches a replacement for a worker whose end is known (walltime,
    preemption notice) the type's measured start-up time before that end.

    Billing: ``billed_startup`` (a finite number >= 0, or None) is how many seconds of a start-up
    are billed.  None (the default) bills all of it, as a cloud VM is billed from its request; a
    Slurm job is billed from when it starts running, so its queue wait is free and only the boot
    after it is billed: set it to that boot time.  The default policy prices holding an idle node
    against what a relaunch would bill (at most the start-up itself).
    """

    name: str
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0})
    min_nodes: int = 0
    max_nodes: int = 10
    workers_per_node: int = 1
    cost: float = 1.0
    startup_estimate: float = 5.0
    options: Mapping[str, Any] = field(default_factory=dict)
    preemptible: bool = False
    fallback: str | None = None
    fallback_after: int = 3
    fallback_window: float = 600.0
    fallback_healthy: float = 900.0
    min_idle: int = 0
    replace_before: bool = False
    billed_startup: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"node type name must be letters, digits, '_', '.' or '-' (it becomes part of worker "
                f"ids and file names), got {self.name!r}; e.g. NodeType('cpu', {{'cpu': 8}})"
            )
        res = parse_resources(self.resources)
        res.setdefault("cpu", 1.0)
        set_ = object.__setattr__  # frozen: normalised values are written once, here
        set_(self, "resources", res)
        set_(self, "min_nodes", _whole(self.name, "min_nodes", self.min_nodes, 0))
        set_(self, "max_nodes", _whole(self.name, "max_nodes", self.max_nodes, 0))
        set_(self, "workers_per_node", _whole(self.name, "workers_per_node", self.workers_per_node, 1))
        if self.max_nodes < self.min_nodes:
            raise ConfigError(
                f"node type {self.name!r}: need 0 <= min_nodes <= max_nodes, got "
                f"{self.min_nodes}..{self.max_nodes}; raise max_nodes or lower min_nodes"
            )
        set_(self, "cost", _finite(self.name, "cost", self.cost))
        set_(self, "startup_estimate", _finite(self.name, "startup_estimate", self.startup_estimate))
        if self.billed_startup is not None:
            set_(self, "billed_startup", _finite(self.name, "billed_startup", self.billed_startup))
        for key in ("preemptible", "replace_before"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"node type {self.name!r}: {key} must be true or false, got {getattr(self, key)!r}")
        if self.fallback is not None and (not isinstance(self.fallback, str) or not _NAME.fullmatch(self.fallback)
                                          or self.fallback == self.name):  # fmt: skip
            raise ConfigError(f"node type {self.name!r}: fallback must name another node type, got {self.fallback!r}")
        set_(self, "fallback_after", _whole(self.name, "fallback_after", self.fallback_after, 1))
        set_(self, "fallback_window", _finite(self.name, "fallback_window", self.fallback_window))
        set_(self, "fallback_healthy", _finite(self.name, "fallback_healthy", self.fallback_healthy))
        set_(self, "min_idle", _whole(self.name, "min_idle", self.min_idle, 0))
        if self.min_idle > self.max_nodes:
            raise ConfigError(f"node type {self.name!r}: min_idle={self.min_idle} is above max_nodes={self.max_nodes}; "
                              "lower min_idle or raise max_nodes")  # fmt: skip
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"node type {self.name!r}: options must be a mapping (a TOML table), "
                              f"got {self.options!r}")  # fmt: skip

    @property
    def worker_resources(self) -> dict[str, float]:
        """Resources of one worker process on this node type."""
        n = self.workers_per_node
        return {k: v / n for k, v in self.resources.items()}


def _whole(node: str, key: str, value: Any, least: int) -> int:
    """``value`` as an int if it is a whole number >= ``least`` (bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ConfigError(f"node type {node!r}: {key} must be a whole number >= {least}, got {value!r}")
    return int(value)


def _finite(node: str, key: str, value: Any) -> float:
    """``value`` as a float if it is a finite number >= 0 (nan, inf and bools are refused)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0):  # fmt: skip
        raise ConfigError(f"node type {node!r}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)
