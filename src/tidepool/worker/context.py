"""What a running task can know about where it runs, and how it submits more tasks.

State: the process's worker (set when it registers; seen here as a :class:`TaskHost`, so this
module imports nothing of the worker's).  The key of the
task a slot thread runs lives in ``executor.current`` (a thread-local).  The worker never imports
the client: ``tidepool.get_client()`` and ``tidepool.worker_client()`` live in
:mod:`tidepool.client.current`, which reads the worker recorded here.

A task that waits for tasks it submitted must not hold its slot, or a one-slot pool deadlocks
(the inner tasks queue behind it).  :func:`worker_client` (or :func:`secede` then
:func:`get_client`) gives the slot back first: the worker starts the next queued task, the scheduler
stops counting this task as load and stops forecasting it as occupying a slot, and the task keeps
running in its own thread until it returns.  Unlike Dask there is no ``rejoin``: a seceded task
finishes outside the slot count.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol

from tidepool.errors import ConfigError


class TaskHost(Protocol):
    """What a task may ask of the worker it runs on."""

    id: str
    name: str
    node_type: str
    scheduler_address: str
    scheduler_public_address: str
    token: str
    resources: dict[str, float]
    data: MutableMapping[str, Any]

    def secede(self, key: str) -> None: ...


_worker: TaskHost | None = None


def set_worker(worker: TaskHost) -> None:
    global _worker
    _worker = worker


def get_worker() -> TaskHost:
    """The worker this code runs on; raises :class:`ConfigError` outside a worker process."""
    if _worker is None:
        raise ConfigError("get_worker() was called outside a tidepool worker (call it inside a task)")
    return _worker


def current_task() -> str | None:
    """The key of the task running in this thread (None outside a task)."""
    from tidepool.worker.executor import current

    return getattr(current, "key", None)


def secede() -> None:
    """Give this task's slot back to the worker (it keeps running in its thread)."""
    key = current_task()
    if key is None or _worker is None:
        raise ConfigError("secede() must be called inside a running task")
    _worker.secede(key)
