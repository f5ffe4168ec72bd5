"""What a running task can know about where it runs, and how it submits more tasks.

State: the process's :class:`~tidepool.worker.core.Worker` (set when it registers).  The key of the
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

from typing import TYPE_CHECKING

from tidepool.errors import ConfigError

if TYPE_CHECKING:
    from tidepool.worker.core import Worker

_worker: Worker | None = None


def set_worker(worker: Worker) -> None:
    global _worker
    _worker = worker


def get_worker() -> Worker:
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
