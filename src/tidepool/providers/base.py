"""The Provider protocol: how the scaling controller gets and gives back workers.

A provider starts workers for a node type (``launch``) and stops them (``terminate``).  It gives
every worker the id it will register with, so the controller can match arrivals to requests.  Calls
are idempotent (launching a request id twice starts it once; terminating a gone worker is a no-op)
and may block (the controller calls them from a thread).  ``poll_errors`` reports launches or
workers that failed since the last call; ``close`` stops everything the provider started.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tidepool.scaling.node_types import NodeType


@dataclass(frozen=True)
class ProviderFailure:
    request_id: str
    worker_id: str | None
    message: str


@dataclass(frozen=True)
class LaunchRequest:
    """Everything needed to start the workers of one launch, for user callbacks."""

    node_type: NodeType
    count: int  # nodes
    request_id: str
    worker_ids: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]  # one argv per worker: run it anywhere that reaches us
    env: dict[str, str] = field(default_factory=dict)  # TIDEPOOL_TOKEN etc.


@runtime_checkable
class Provider(Protocol):
    def launch(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]: ...

    def terminate(self, worker_ids: builtins.list[str]) -> None: ...

    def list(self) -> dict[str, dict[str, Any]]: ...  # noqa: A003

    def poll_errors(self) -> builtins.list[ProviderFailure]: ...

    def close(self) -> None: ...


@runtime_checkable
class NeedsAddress(Protocol):
    """An optional capability: a provider built before the scheduler's address and token were
    known gets them from the cluster (``LocalCluster.adapt``) before its first launch."""

    def bind(self, scheduler: str, token: str) -> None: ...


@runtime_checkable
class ReportsExpiring(Protocol):
    """An optional capability: workers whose allocation ends soon (a batch job's walltime), so the
    autoscaler retires them gracefully first (their data moves to survivors)."""

    def expiring(self, now_wall: float) -> builtins.list[str]: ...


def worker_command(scheduler: str, worker_id: str, node_type: NodeType, python: str = "python3",
                   heartbeat_interval: float = 1.0, extra: builtins.list[str] | None = None) -> builtins.list[str]:  # fmt: skip
    """The argv that starts one worker of ``node_type`` registering as ``worker_id``."""
    import json

    return [python, "-m", "tidepool.worker", scheduler, "--id", worker_id, "--node-type", node_type.name,
            "--resources", json.dumps(node_type.worker_resources), "--heartbeat-interval",
            str(heartbeat_interval), *(extra or [])]  # fmt: skip
