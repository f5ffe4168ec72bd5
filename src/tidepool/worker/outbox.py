"""Reports to the scheduler, batched: one ``task-batch`` message per loop wake-up.

State: the entries not sent yet (a :class:`~tidepool.comm.messages.TaskBatch`), whether a flush is scheduled, and how many
batches are handed to an asynchronous send and not written yet (a later batch never overtakes
them).  Data flow: the worker shell adds what its state reports (:meth:`Outbox.add`) and calls
:meth:`Outbox.flush` at once when the scheduler must hear now (``started`` before a task can crash
the process), else :meth:`Outbox.soon`.  With ``hold`` set (the worker may reconnect within a
window, ``worker/reconnect.py``) entries are kept, not dropped, while the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tidepool.comm import Connection
from tidepool.comm.messages import TaskBatch
from tidepool.errors import CommError

log = logging.getLogger("tidepool.worker")


class Outbox:
    def __init__(self) -> None:
        self.conn: Connection | None = None
        self.batch = TaskBatch()
        self._scheduled = False
        self._in_flight = 0
        #: keep entries while the connection is closed (they go out after a re-registration)
        self.hold = False

    def add(self, kind: str, item: Any) -> None:
        self.batch.add(kind, item)

    def soon(self) -> None:
        """Flush on the next loop turn (many reports of one wake-up go out together)."""
        if not self._scheduled and self.batch:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self.hold and self.conn is not None and self.conn.closed:
            return
        batch, self.batch = self.batch, TaskBatch()
        conn = self.conn
        if batch and conn is not None and not conn.closed:
            msg = batch.encode()
            if not self._in_flight:  # never overtake a batch still being sent
                try:
                    if conn.send_nowait(msg):
                        return
                except CommError:
                    return
            self._in_flight += 1
            t = asyncio.get_running_loop().create_task(conn.send(msg))
            t.add_done_callback(self._sent)

    def _sent(self, t: asyncio.Task[Any]) -> None:
        self._in_flight -= 1
        log_send_error(t)


def log_send_error(t: asyncio.Task[Any]) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.debug("send to scheduler failed: %s", t.exception())
