"""A client whose scheduler restarts from its state directory reconnects by itself.

State (kept on the :class:`~tidepool.client.connection.ClientConnection`): ``reconnect_window``
(what the scheduler announced in its welcome: its window with a state directory, else 0, so a
client of a scheduler that cannot resume still fails at once with ``ConnectionLostError``),
``resuming`` (an event set when a reconnection attempt is over), ``request_msgs`` (requests not
answered yet, to ask again) and ``recent_graphs`` (graph updates of the last
:data:`RESEND_SECONDS`: the scheduler persists once per tick, so the last ones may not have reached
its store before it died).

Data flow: the connection's read loop calls :func:`start_resume` when the connection fails.  The
outbox drain waits meanwhile (messages keep their order).  :func:`resume` dials the same address
until the window is over, asking for its old client id (a restarted scheduler restored it with its
wanted keys), then sends one graph update: the recent graphs' tasks, and every key this client
holds a future of as wanted, so the scheduler reports again whatever finished while we were away (a
key it does not know any more is reported lost and that future fails).  Unanswered requests are
sent again; then a new read loop starts.  Past the window, every pending future fails as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tidepool.comm import connect
from tidepool.errors import CommError

if TYPE_CHECKING:
    from tidepool.client.connection import ClientConnection

log = logging.getLogger("tidepool.client")

#: graph updates younger than this are sent again after a reconnection (many scheduler ticks)
RESEND_SECONDS = 30.0
MAX_RETRY_DELAY = 1.0


def remember_graph(conn: ClientConnection, msg: dict[str, Any]) -> None:
    """Keep a graph update for :data:`RESEND_SECONDS` (only when the scheduler can resume)."""
    if conn.reconnect_window <= 0:
        return
    now = time.monotonic()
    recent = conn.recent_graphs
    recent.append((now, msg))
    while recent and now - recent[0][0] > RESEND_SECONDS:
        recent.popleft()


def start_resume(conn: ClientConnection, why: BaseException) -> bool:
    """Begin reconnecting (in the client's loop); False when this client does not reconnect."""
    if conn.reconnect_window <= 0 or conn.closed:
        return False
    conn.resuming = asyncio.Event()
    conn.resume_task = asyncio.get_running_loop().create_task(resume(conn, why))
    return True


def _resync(conn: ClientConnection) -> dict[str, Any]:
    now = time.monotonic()
    tasks: list[Any] = []
    functions: dict[str, Any] = {}
    for sent, msg in conn.recent_graphs:
        if now - sent <= RESEND_SECONDS:
            tasks.extend(msg["tasks"])
            functions.update(msg["functions"])
    with conn.lock:
        wanted = list(conn.core.futures.keys())
    # exact: the scheduler releases any other key it has as ours (a release it got just before it
    # died may not have reached its store: the restored wants are a little stale)
    return {"op": "update-graph", "tasks": tasks, "wanted": wanted, "functions": functions, "exact": True}


async def resume(conn: ClientConnection, why: BaseException) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + conn.reconnect_window
    log.warning("lost the scheduler at %s (%s); reconnecting for up to %gs", conn.address, why,
                conn.reconnect_window)  # fmt: skip
    delay = 0.1
    try:
        while loop.time() < deadline and not conn.closed:
            try:
                new = await connect(conn.connect_address, conn.token, timeout=min(5.0, max(0.1, deadline - loop.time())),
                                    hello={"role": "client", "resume": conn.id}, retry=False, tls=conn.tls)  # fmt: skip
                welcome = await new.recv()
                await new.send(_resync(conn))
                for msg in list(conn.request_msgs.values()):
                    await new.send(msg)
            except CommError:
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(MAX_RETRY_DELAY, delay * 2)
                continue
            conn.connected(new, welcome)
            log.warning("reconnected to the scheduler at %s as %s", conn.address, conn.id)
            return
        conn._connection_lost(why)
    finally:
        event, conn.resuming = conn.resuming, None
        if event is not None:
            event.set()
