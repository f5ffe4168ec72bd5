"""Reading values from a worker's data server: the one ``get-data`` exchange clients and workers share.

No state: each call sends ``get-data`` for some keys on an authenticated connection (one request
at a time per connection, under the caller's lock) and follows ``deferred`` replies (keys the
holder will send in a later reply) until every key is answered.  The worker's data server is the
other side (``worker/peers.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from tidepool.comm.core import Connection
from tidepool.comm.messages import DataReply, GetData
from tidepool.errors import ConfigError

#: how long a holder may send nothing during a fetch (a worker's or a client's) before the read is
#: given up and its copy is suspect (issue 29); long enough for a loaded machine, short next to the
#: 300 s heartbeat time-to-live
DEFAULT_FETCH_TIMEOUT = 30.0
FETCH_TIMEOUT_ENV = "TIDEPOOL_FETCH_TIMEOUT"


def fetch_timeout_from_env() -> float:
    """``$TIDEPOOL_FETCH_TIMEOUT`` (seconds), else :data:`DEFAULT_FETCH_TIMEOUT`."""
    raw = os.environ.get(FETCH_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_FETCH_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ConfigError(f"{FETCH_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


async def request_data(conn: Connection, lock: asyncio.Lock, keys: list[str],
                       idle_timeout: float | None = None, *, load: bool = True,
                       on_reply: Callable[[dict[str, Any], dict[str, str]], None] | None = None,
                       ) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """Ask a worker's data server for ``keys`` (following ``deferred`` replies); returns the values
    and, for keys that cannot be had, the reason (the holder cannot send them, or they do not
    unpickle here).  Keys the holder does not have are in neither.  With ``idle_timeout``, a holder
    that sends nothing for that long raises :class:`~tidepool.errors.PeerSilentError` (and the
    connection closes).  ``load=False``: the values are the pickles, for :func:`load_values` to
    unpickle elsewhere (e.g. off an event loop that others share).  ``on_reply(values, failed)``:
    each reply's part is handed over as it arrives, and not kept here (both returned dicts are then
    empty): a worker stores (and spills) one reply before the next comes, instead of holding every
    value of a large batch at once (a bug hunt's survivor of a retirement went past its limit)."""
    values: dict[str, Any] = {}
    failed: dict[str, str] = {}
    todo = list(keys)
    while todo:
        async with lock:
            await conn.send(GetData(todo).encode())
            raw = await (conn.recv() if idle_timeout is None else conn.recv_unless_silent(idle_timeout))
        reply = DataReply.decode(raw)
        got, bad = load_values(reply.data) if load else (reply.data, {})
        bad.update(reply.failed)
        todo = reply.deferred
        if on_reply is not None:
            on_reply(got, bad)
            del raw, reply, got, bad  # not alive while the next reply arrives
        else:
            values.update(got)
            failed.update(bad)
    return values, failed


def load_values(blobs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Unpickle ``blobs`` (key -> :class:`~tidepool.comm.serialize.Serialized`): the values, and
    for each that does not unpickle here, why."""
    values: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for k, blob in blobs.items():
        try:
            values[k] = blob.load()
        except Exception as exc:  # noqa: BLE001 - whatever unpickling raised
            failed[k] = f"the value of {k!r} cannot be unpickled here: {type(exc).__name__}: {exc}"
    return values, failed


__all__ = ["load_values", "request_data"]
