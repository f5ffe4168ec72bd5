"""tidepool: a Python task-graph scheduler whose pool of workers grows and shrinks by itself.

Quick start::

    import tidepool

    @tidepool.task
    def inc(x):
        return x + 1

    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        print(client.compute(inc(inc(1))).result())   # 3
"""

from tidepool.client import Client, ClientExecutor, default_client
from tidepool.client_dask import fire_and_forget
from tidepool.cluster import LocalCluster
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
    ProtocolError,
    ProviderError,
    RemoteTaskError,
    RemoteTraceback,
    ResultTooLargeError,
    SchedulerError,
    SerializationError,
    TaskCancelledError,
    TaskError,
    TidepoolError,
    TransferError,
    WorkerSetupError,
)
from tidepool.futures import Future
from tidepool.graph import Delayed, task
from tidepool.scaling.node_types import NodeType
from tidepool.scheduler.server import Scheduler
from tidepool.setup import setup_file
from tidepool.waiting import as_completed, wait
from tidepool.worker import Worker
from tidepool.worker.context import get_client, get_worker, secede, worker_client

__version__ = "0.1.0"


def compute(*values: Delayed, client: Client | None = None) -> tuple:  # type: ignore[type-arg]
    """Compute delayed values on ``client`` (default: the current client); returns their values."""
    c = client or default_client()
    return tuple(c.gather(c.compute(list(values))))


__all__ = [
    "AuthenticationError", "Client", "ClientExecutor", "CommError", "ConfigError",
    "ConnectionLostError", "CycleError", "Delayed", "DependencyError", "FrameTooLargeError", "Future",
    "InfeasibleTaskError", "KeyCollisionError", "KilledWorkerError", "LocalCluster", "NodeType",
    "ProtocolError", "ProviderError", "RemoteTaskError", "RemoteTraceback", "ResultTooLargeError",
    "Scheduler", "SchedulerError", "SerializationError", "TaskCancelledError", "TaskError",
    "TidepoolError", "TransferError", "Worker", "WorkerSetupError", "as_completed", "compute", "fire_and_forget",
    "default_client", "get_client", "get_worker", "secede", "setup_file", "task", "wait", "worker_client",
]  # fmt: skip
