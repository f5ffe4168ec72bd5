"""Which client a call without one uses: ``default_client()``, and inside a task ``get_client()``.

State: one cached client per worker process (of the scheduler that worker serves), for tasks that
submit tasks; the clients created in this process are listed by :mod:`tidepool.client.api`
(weakly held, newest last), which this module sits above.  The worker
side (:mod:`tidepool.worker.context`) knows nothing of clients: this module reads the worker it
records, never the other way round.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from tidepool import futures as _futures
from tidepool.client.api import Client, created
from tidepool.errors import ConfigError
from tidepool.worker import context

_worker_client: Client | None = None
_lock = threading.Lock()


def default_client() -> Client:
    """The most recently created client that is still open; inside a task, the worker's client
    (the one :func:`~tidepool.get_client` returns) unless the task opened another one since."""
    for ref in reversed(created):
        c = ref()
        if c is not None and not c.closed:
            return c
    if context._worker is not None:
        return get_client()
    raise ConfigError("no tidepool Client is running; create one with tidepool.Client(...)")


def get_client() -> Client:
    """Inside a task: a client of the scheduler this worker serves (one per worker process).
    Outside: the most recent open client."""
    global _worker_client
    worker = context._worker
    if worker is None:
        return default_client()
    with _lock:
        if _worker_client is None or _worker_client.closed:
            _worker_client = Client(worker.scheduler_public_address, token=worker.token, name=f"{worker.id}-client")
        return _worker_client


@contextlib.contextmanager
def worker_client() -> Iterator[Any]:
    """``with worker_client() as client:`` inside a task: submit tasks and wait for them without
    holding a slot (the task secedes first)."""
    context.secede()
    yield get_client()


_futures.default_client_hook = default_client  # Future(key) without a client: this one
