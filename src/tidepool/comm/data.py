"""Reading values from a worker's data server: the one ``get-data`` exchange clients and workers share.

No state: each call sends ``get-data`` for some keys on an authenticated connection (one request
at a time per connection, under the caller's lock) and follows ``deferred`` replies (keys the
holder will send in a later reply) until every key is answered.  The worker's data server is the
other side (``worker/peers.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tidepool.comm.core import Connection
from tidepool.comm.messages import DataReply, GetData


async def request_data(conn: Connection, lock: asyncio.Lock, keys: list[str],
                       idle_timeout: float | None = None) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """Ask a worker's data server for ``keys`` (following ``deferred`` replies); returns the values
    and, for keys that cannot be had, the reason (the holder cannot send them, or they do not
    unpickle here).  Keys the holder does not have are in neither.  With ``idle_timeout``, a holder
    that sends nothing for that long raises :class:`~tidepool.errors.PeerSilentError` (and the
    connection closes)."""
    values: dict[str, Any] = {}
    failed: dict[str, str] = {}
    todo = list(keys)
    while todo:
        async with lock:
            await conn.send(GetData(todo).encode())
            raw = await (conn.recv() if idle_timeout is None else conn.recv_unless_silent(idle_timeout))
        reply = DataReply.decode(raw)
        for k, blob in reply.data.items():
            try:
                values[k] = blob.load()
            except Exception as exc:  # noqa: BLE001 - whatever unpickling raised
                failed[k] = f"the value of {k!r} cannot be unpickled here: {type(exc).__name__}: {exc}"
        failed.update(reply.failed)
        todo = reply.deferred
    return values, failed


__all__ = ["request_data"]
