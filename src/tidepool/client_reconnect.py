"""A client whose scheduler restarts from its state directory reconnects by itself.

State: the client's ``_reconnect_window`` (what the scheduler announced in its welcome: its window
with a state directory, else 0, so a client of a scheduler that cannot resume still fails at once
with ``ConnectionLostError``), ``_resuming`` (an event set when a reconnection attempt is over),
``_request_msgs`` (requests not answered yet, to ask again) and ``_recent_graphs`` (graph updates
of the last :data:`RESEND_SECONDS`: the scheduler persists once per tick, so the last ones may not
have reached its store before it died).

Data flow: the client's read loop calls :func:`start_resume` when the connection fails.  The
outbox waits meanwhile (messages keep their order).  :func:`resume` dials the same address until
the window is over, asking for its old client id (a restarted scheduler restored it with its wanted
keys), then sends one graph update: the recent graphs' tasks, and every key this client holds a
future of as wanted, so the scheduler reports again whatever finished while we were away (a key it
does not know any more is reported lost and that future fails).  Unanswered requests are sent
again; then a new read loop starts.  Past the window, every pending future fails as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tidepool.comm import connect
from tidepool.errors import CommError

if TYPE_CHECKING:
    from tidepool.client import Client

log = logging.getLogger("tidepool.client")

#: graph updates younger than this are sent again after a reconnection (many scheduler ticks)
RESEND_SECONDS = 30.0
MAX_RETRY_DELAY = 1.0


def remember_graph(client: Client, msg: dict[str, Any]) -> None:
    """Keep a graph update for :data:`RESEND_SECONDS` (only when the scheduler can resume)."""
    if client._reconnect_window <= 0:
        return
    now = time.monotonic()
    recent = client._recent_graphs
    recent.append((now, msg))
    while recent and now - recent[0][0] > RESEND_SECONDS:
        recent.popleft()


def start_resume(client: Client, why: BaseException) -> bool:
    """Begin reconnecting (in the client's loop); False when this client does not reconnect."""
    if client._reconnect_window <= 0 or client.closed:
        return False
    client._resuming = asyncio.Event()
    client._resume_task = asyncio.get_running_loop().create_task(resume(client, why))
    return True


def _resync(client: Client) -> dict[str, Any]:
    now = time.monotonic()
    tasks: list[Any] = []
    functions: dict[str, Any] = {}
    for sent, msg in client._recent_graphs:
        if now - sent <= RESEND_SECONDS:
            tasks.extend(msg["tasks"])
            functions.update(msg["functions"])
    with client._lock:
        wanted = list(client._futures.keys())
    return {"op": "update-graph", "tasks": tasks, "wanted": wanted, "functions": functions}


async def resume(client: Client, why: BaseException) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + client._reconnect_window
    log.warning("lost the scheduler at %s (%s); reconnecting for up to %gs", client.address, why,
                client._reconnect_window)  # fmt: skip
    delay = 0.1
    try:
        while loop.time() < deadline and not client.closed:
            try:
                conn = await connect(client.address, client.token, timeout=min(5.0, max(0.1, deadline - loop.time())),
                                     hello={"role": "client", "resume": client.id}, retry=False, tls=client.tls)  # fmt: skip
                welcome = await conn.recv()
                await conn.send(_resync(client))
                for msg in list(client._request_msgs.values()):
                    await conn.send(msg)
            except CommError:
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(MAX_RETRY_DELAY, delay * 2)
                continue
            client._conn = conn
            client.id = welcome.get("client", client.id)
            client._reconnect_window = float(welcome.get("reconnect_window") or 0.0)
            client._reader = loop.create_task(client._read_loop())
            log.warning("reconnected to the scheduler at %s as %s", client.address, client.id)
            return
        client._connection_lost(why)
    finally:
        event, client._resuming = client._resuming, None
        if event is not None:
            event.set()
