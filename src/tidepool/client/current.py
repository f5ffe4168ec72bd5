"""Which client a call without one uses: ``default_client()``, and inside a task ``get_client()``.

State: the clients created in this process (weakly held, newest last) and, in a worker process,
one cached client of the scheduler that worker serves, for tasks that submit tasks.  The worker
side (:mod:`tidepool.worker.context`) knows nothing of clients: this module reads the worker it
records, never the other way round.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tidepool.errors import ConfigError
from tidepool.worker import context

if TYPE_CHECKING:
    from tidepool.client.api import Client

_clients: list[weakref.ref[Any]] = []
_worker_client: Client | None = None
_lock = threading.Lock()


def register(client: Client) -> None:
    """A new client: it becomes the default one."""
    _clients.append(weakref.ref(client))


def default_client() -> Client:
    """The most recently created client that is still open; inside a task, the worker's client
    (the one :func:`~tidepool.get_client` returns) unless the task opened another one since."""
    for ref in reversed(_clients):
        c = ref()
        if c is not None and not c.closed:
            return c  # type: ignore[no-any-return]
    if context._worker is not None:
        return get_client()
    raise ConfigError("no tidepool Client is running; create one with tidepool.Client(...)")


def get_client() -> Client:
    """Inside a task: a client of the scheduler this worker serves (one per worker process).
    Outside: the most recent open client."""
    global _worker_client
    from tidepool.client.api import Client

    worker = context._worker
    if worker is None:
        return default_client()
    with _lock:
        if _worker_client is None or _worker_client.closed:
            _worker_client = Client(worker.scheduler_address, token=worker.token, name=f"{worker.id}-client")
        return _worker_client


@contextlib.contextmanager
def worker_client() -> Iterator[Any]:
    """``with worker_client() as client:`` inside a task: submit tasks and wait for them without
    holding a slot (the task secedes first)."""
    context.secede()
    yield get_client()
