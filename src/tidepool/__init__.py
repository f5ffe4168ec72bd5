"""tidepool: a Python task-graph scheduler whose pool of workers grows and shrinks by itself.

Quick start::

    import tidepool

    @tidepool.task
    def inc(x):
        return x + 1

    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        print(client.compute(inc(inc(1))).result())   # 3

The public names are imported on first use (PEP 562 ``__getattr__``): ``import tidepool`` is cheap,
and a worker process (``python -m tidepool.worker``) never loads the client, the cluster or the Dask
layer it does not use.  ``tidepool.Client`` and ``from tidepool import Client`` work as before.  To
add a public name, add one line to :data:`_LAZY` (name -> module), one import under
``TYPE_CHECKING`` (for type checkers) and the name to ``__all__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "Client": "tidepool.client",
    "ClientExecutor": "tidepool.client",
    "default_client": "tidepool.client",
    "fire_and_forget": "tidepool.client",
    "futures_of": "tidepool.client",
    "LocalCluster": "tidepool.cluster",
    "Future": "tidepool.futures",
    "Delayed": "tidepool.graph",
    "task": "tidepool.graph",
    "NodeType": "tidepool.scaling.node_types",
    "Scheduler": "tidepool.scheduler.server",
    "setup_file": "tidepool.setup",
    "TLSConfig": "tidepool.comm.tls",
    "make_certs": "tidepool.comm.tls",
    "as_completed": "tidepool.waiting",
    "wait": "tidepool.waiting",
    "Worker": "tidepool.worker",
    "get_client": "tidepool.client",
    "get_worker": "tidepool.worker.context",
    "secede": "tidepool.worker.context",
    "worker_client": "tidepool.client",
    **{name: "tidepool.errors" for name in (
        "AuthenticationError", "CommError", "ConfigError", "ConnectionLostError", "CycleError",
        "DependencyError", "FrameTooLargeError", "InfeasibleTaskError", "KeyCollisionError",
        "KilledWorkerError", "PeerSilentError", "ProtocolError", "ProviderError", "RemoteTaskError",
        "RemoteTraceback", "ResultTooLargeError", "SchedulerError", "SerializationError", "StateStoreError", "StoreCorruptError", "StoreInUseError",
        "StoreTokenError", "StoreVersionError", "TaskCancelledError", "TaskError", "TidepoolError",
        "TransferError", "UnpicklableError", "WorkerSetupError",
    )},
}  # fmt: skip

if TYPE_CHECKING:
    from tidepool.client import (
        Client,
        ClientExecutor,
        default_client,
        fire_and_forget,
        futures_of,
        get_client,
        worker_client,
    )
    from tidepool.cluster import LocalCluster
    from tidepool.comm.tls import TLSConfig, make_certs
    from tidepool.errors import (
        AuthenticationError,
        CommError,
        ConfigError,
        ConnectionLostError,
        CycleError,
        DependencyError,
        FrameTooLargeError,
        InfeasibleTaskError,
        KeyCollisionError,
        KilledWorkerError,
        PeerSilentError,
        ProtocolError,
        ProviderError,
        RemoteTaskError,
        RemoteTraceback,
        ResultTooLargeError,
        SchedulerError,
        SerializationError,
        StateStoreError,
        StoreCorruptError,
        StoreInUseError,
        StoreTokenError,
        StoreVersionError,
        TaskCancelledError,
        TaskError,
        TidepoolError,
        TransferError,
        UnpicklableError,
        WorkerSetupError,
    )
    from tidepool.futures import Future
    from tidepool.graph import Delayed, task
    from tidepool.scaling.node_types import NodeType
    from tidepool.scheduler.server import Scheduler
    from tidepool.setup import setup_file
    from tidepool.waiting import as_completed, wait
    from tidepool.worker import Worker
    from tidepool.worker.context import get_worker, secede


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's module when the name is first used, then keep the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidepool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def compute(*values: Delayed, client: Client | None = None) -> tuple:  # type: ignore[type-arg]
    """Compute delayed values on ``client`` (default: the current client); returns their values."""
    from tidepool.client import default_client

    c = client or default_client()
    return tuple(c.gather(c.compute(list(values))))


__all__ = [
    "AuthenticationError", "Client", "ClientExecutor", "CommError", "ConfigError",
    "ConnectionLostError", "CycleError", "Delayed", "DependencyError", "FrameTooLargeError", "Future",
    "InfeasibleTaskError", "KeyCollisionError", "KilledWorkerError", "LocalCluster", "NodeType",
    "PeerSilentError", "ProtocolError", "ProviderError", "RemoteTaskError", "RemoteTraceback", "ResultTooLargeError",
    "Scheduler", "SchedulerError", "SerializationError", "StateStoreError", "StoreCorruptError", "StoreInUseError",
    "StoreTokenError", "StoreVersionError", "TaskCancelledError", "TaskError",
    "TLSConfig", "TidepoolError", "TransferError", "UnpicklableError", "Worker", "WorkerSetupError", "as_completed", "compute", "fire_and_forget", "make_certs",
    "futures_of",
    "default_client", "get_client", "get_worker", "secede", "setup_file", "task", "wait", "worker_client",
]  # fmt: skip
