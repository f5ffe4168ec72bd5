"""Node types: the kinds of machines a provider can start.

A :class:`NodeType` says what one node offers (``resources`` for the whole node, split across
``workers_per_node`` worker processes), how many may exist (``min_nodes``..``max_nodes``), what it
costs and how long it takes to start.  Immutable; used by providers (what to launch), the planner
(what demand fits where) and the scheduler (is a task feasible at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.resources import parse_resources


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0})
    min_nodes: int = 0
    max_nodes: int = 10
    workers_per_node: int = 1
    cost: float = 1.0
    startup_estimate: float = 5.0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"node type needs a name, got {self.name!r}")
        res = parse_resources(self.resources)
        res.setdefault("cpu", 1.0)
        object.__setattr__(self, "resources", res)
        if self.min_nodes < 0 or self.max_nodes < self.min_nodes:
            raise ConfigError(
                f"node type {self.name!r}: need 0 <= min_nodes <= max_nodes, got "
                f"{self.min_nodes}..{self.max_nodes}"
            )
        if self.workers_per_node < 1:
            raise ConfigError(f"node type {self.name!r}: workers_per_node must be >= 1")
        if self.cost < 0 or self.startup_estimate < 0:
            raise ConfigError(f"node type {self.name!r}: cost and startup_estimate must be >= 0")

    @property
    def worker_resources(self) -> dict[str, float]:
        """Resources of one worker process on this node type."""
        n = self.workers_per_node
        return {k: v / n for k, v in self.resources.items()}
