"""CallbackProvider: the user's own functions add and remove workers.

``launch(request)`` receives a :class:`LaunchRequest` (node type, node count, the worker ids the new
workers must register with, the exact command line for each, and the environment holding the
token) and starts them however it likes (a cloud API, a job queue, a container).  ``terminate(ids)``
stops workers.  Exceptions from ``launch`` are reported once, through ``poll_errors`` only (the call
itself returns nothing, like every provider's), so the controller backs off that node type,
counting the failure once; a failing ``terminate`` raises :class:`ProviderError`.  The worker ids
come from ``worker_ids`` (``<type>-<request>-<n>``), decided before the callback runs.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import Any

from tidepool.errors import ProviderError
from tidepool.providers.base import IdNames, LaunchRequest, ProviderFailure, worker_command
from tidepool.scaling.node_types import NodeType


class CallbackProvider:
    def __init__(self, launch: Callable[[LaunchRequest], Any], terminate: Callable[[builtins.list[str]], Any],
                 *, scheduler: str = "", token: str = "", python: str = sys.executable,
                 heartbeat_interval: float = 1.0) -> None:  # fmt: skip
        self._launch = launch
        self._terminate = terminate
        self.scheduler = scheduler
        self.token = token
        self.python = python
        self.heartbeat_interval = heartbeat_interval
        self.requests: dict[str, builtins.list[str]] = {}
        self.workers: dict[str, dict[str, Any]] = {}
        self._errors: builtins.list[ProviderFailure] = []
        self._names = IdNames()

    def bind(self, scheduler: str, token: str) -> None:
        """Called by the cluster once the scheduler's address and token are known."""
        self.scheduler, self.token = scheduler, token

    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        return self._names(node_type, count, request_id)

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Call the user's launch function (it must not block: submit and return)."""
        if request_id in self.requests:
            return
        ids = self.worker_ids(node_type, count, request_id)
        cmds = tuple(tuple(worker_command(self.scheduler, w, node_type, self.python, self.heartbeat_interval))
                     for w in ids)  # fmt: skip
        req = LaunchRequest(node_type, count, request_id, tuple(ids), cmds, {"TIDEPOOL_TOKEN": self.token})
        self.requests[request_id] = ids
        for w in ids:  # listed from now on: a launch in flight is not reconciled away
            self.workers[w] = {"node_type": node_type.name, "request_id": request_id, "alive": True}
        try:
            self._launch(req)
        except Exception as exc:  # noqa: BLE001 - reported once, through poll_errors (never raised)
            for w in ids:
                self.workers[w]["alive"] = False
            err = ProviderError(f"launch callback failed for {request_id} ({node_type.name}): {exc}", request_id)
            self._errors.append(ProviderFailure(request_id, None, str(err)))

    def terminate(self, worker_ids: builtins.list[str]) -> None:
        ids = [w for w in worker_ids if self.workers.get(w, {}).get("alive")]
        if not ids:
            return
        try:
            self._terminate(ids)
        except Exception as exc:
            self._errors.append(ProviderFailure("", ids[0], f"terminate callback failed for {ids}: {exc}"))
            raise ProviderError(f"terminate callback failed for {ids}: {exc}") from exc
        for w in ids:
            self.workers[w]["alive"] = False

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        return {w: dict(info) for w, info in self.workers.items()}

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        errs, self._errors = self._errors, []
        return errs

    def close(self) -> None:
        alive = [w for w, info in self.workers.items() if info["alive"]]
        if alive:
            try:
                self.terminate(alive)
            except ProviderError:
                pass
