"""The Provider protocol: how the scaling controller gets and gives back workers (a reconciler).

A provider names the workers of a launch up front (``worker_ids``: pure, no I/O, the same answer
for the same request id), starts them (``launch``) and stops them (``terminate``).  ``launch``
never blocks and returns nothing: it submits the request (a process spawn, an ``sbatch`` in a
background thread, an SSH session in the scheduler's loop) and returns at once; whatever goes wrong
later, or right away, comes back once through ``poll_errors``.  The autoscaler reconciles: it
matches registrations to the names it was given, lists the provider (``list``) every round while
launches are in flight, and gives up a worker that is gone from the listing or ended before it
registered.  A :class:`ProviderFailure` naming a worker fails that worker only: the rest of its
request stays pending (one failed node of a 500-node job array is not a failed launch); one naming
no worker fails the whole request, whose unregistered workers are then terminated.  Calls are idempotent (launching a request id twice starts it once;
terminating a gone worker is a no-op); ``close`` stops everything the provider started.

Optional capabilities are declared protocols, checked with ``isinstance``: :class:`NeedsAddress`
(gets the scheduler's address and token late), :class:`ReportsExpiring` (batch walltimes),
:class:`ReportsEnds` (when they end), :class:`ReportsPreemption` (spot notices) and
:class:`AsyncProvider` (coroutine versions of the calls, awaited in the scheduler's own event
loop instead of a thread: the SSH provider).
"""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tidepool.scaling.node_types import NodeType

#: a file a provider names in a worker's environment: a worker that fails to start writes why there
#: (the provider adds it to its ProviderFailure, so the user sees the reason, not only an exit code)
EXIT_FILE_ENV = "TIDEPOOL_WORKER_EXIT_FILE"


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
    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        """The ids the workers of this request will register with (pure; same answer every call)."""
        ...

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Submit the request and return at once; failures only through ``poll_errors``."""
        ...

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


@runtime_checkable
class ReportsPreemption(Protocol):
    """An optional capability: preemption notices.  Worker id -> when the provider takes it back
    (epoch seconds), for every live worker under notice; the autoscaler retires it gracefully,
    launches a replacement at once and counts the notice against its (preemptible) node type.
    Must be cheap, non-blocking and thread-safe: the autoscaler calls it in the scheduler's event
    loop every round (a provider that learns of notices slowly polls in its own thread)."""

    def preemptions(self, now_wall: float) -> dict[str, float]: ...


@runtime_checkable
class ReportsEnds(Protocol):
    """An optional capability: known ends.  Worker id -> when it will have to be gone (epoch
    seconds: a batch job's walltime minus the margin it is retired at), for ``replace_before``."""

    def ends(self, now_wall: float) -> dict[str, float]: ...


@runtime_checkable
class ReportsEvents(Protocol):
    """An optional capability: records for the run's journal (``kind`` plus fields, no time; the
    autoscaler stamps and writes them), e.g. how each worker was started (``worker-launch``) or
    why a launch mechanism was replaced (``fork-server``).  Must be cheap and thread-safe: the
    autoscaler calls it from the scheduler's event loop."""

    def drain_events(self) -> builtins.list[dict[str, Any]]: ...


@runtime_checkable
class AsyncProvider(Protocol):
    """An optional capability: the calls as coroutines, run in the scheduler's event loop (no
    thread).  The autoscaler prefers these when a provider offers them."""

    async def launch_async(self, node_type: NodeType, count: int, request_id: str) -> None: ...

    async def terminate_async(self, worker_ids: builtins.list[str]) -> None: ...

    async def list_async(self) -> dict[str, dict[str, Any]]: ...

    async def poll_errors_async(self) -> builtins.list[ProviderFailure]: ...


class IdNames:
    """Names workers ``<type>-<request>-<n>`` once per request id (``worker_ids``' memory).

    ``suffix`` makes names unique beyond one process (the local provider adds ``-p<pid>``); ``n``
    comes from ``counter`` (one per namer by default; the local provider shares one per process,
    so two clusters in a process never name a worker alike), so two requests never share a name.
    """

    def __init__(self, suffix: str = "", counter: Iterator[int] | None = None) -> None:
        self.suffix = suffix
        self.by_request: dict[str, builtins.list[str]] = {}
        self._counter = counter if counter is not None else itertools.count(1)

    def __call__(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        ids = self.by_request.get(request_id)
        if ids is None:
            ids = []
            for _ in range(count * node_type.workers_per_node):
                ids.append(f"{node_type.name}-{request_id}-{next(self._counter)}{self.suffix}")
            self.by_request[request_id] = ids
        return list(ids)


def worker_command(scheduler: str, worker_id: str, node_type: NodeType, python: str = "python3",
                   heartbeat_interval: float = 1.0, extra: builtins.list[str] | None = None) -> builtins.list[str]:  # fmt: skip
    """The argv that starts one worker of ``node_type`` registering as ``worker_id``."""
    import json

    return [python, "-m", "tidepool.worker", scheduler, "--id", worker_id, "--node-type", node_type.name,
            "--resources", json.dumps(node_type.worker_resources), "--heartbeat-interval",
            str(heartbeat_interval), *(extra or [])]  # fmt: skip
