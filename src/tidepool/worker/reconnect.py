"""A worker that lost its scheduler keeps working and registers again when it is back.

State: nothing of its own; it reads the worker's state and outbox.  The window (seconds) is the
worker's ``reconnect_window_setting`` if given, else what the scheduler announced at registration:
a scheduler with a state directory announces its window (default 300 s), any other announces 0, so
a worker of a scheduler that cannot resume still exits as soon as it loses it.

Data flow: the worker's scheduler loop (``worker/server.py``) calls :func:`rejoin` when its
connection fails.  Meanwhile the worker's slots keep running, results are kept, and reports stay in
the outbox (its ``hold`` flag: nothing is sent or dropped while the connection is closed).
:func:`rejoin` dials the scheduler's address again until the window is over, then registers under
the same id with ``rejoin``: the values it holds, the tasks it is executing (and those whose error
is still to be sent, so the scheduler accepts that error), and those queued or fetching inputs.
Reports the new scheduler does not need (finished keys are in ``held``; started tasks are in
``running``; steals, missing inputs and replicas refer to the old scheduler's plans) are dropped;
errors, seceded tasks and unservable values go out with the next flush.  Past the window the
worker closes (its process exits; a provider's job ends with it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Protocol

from tidepool.comm import Connection, connect
from tidepool.comm.tls import TLSConfig
from tidepool.errors import CommError
from tidepool.worker.jobs import SetupRuns
from tidepool.worker.outbox import Outbox
from tidepool.worker.state import WorkerState

log = logging.getLogger("tidepool.worker")


class Worker(Protocol):
    """What this module uses of :class:`~tidepool.worker.server.Worker` (not imported: it imports us)."""

    id: str
    name: str
    address: str
    scheduler_address: str
    scheduler_public_address: str
    token: str
    tls: TLSConfig | None
    resources: dict[str, Any]
    node_type: str
    memory_limit: int
    heartbeat_interval: float
    reconnect_window_setting: float | None
    reconnect_window: float
    conn: Connection | None
    outbox: Outbox
    state: WorkerState
    closed: asyncio.Event | None
    setup_runs: SetupRuns
    _tasks: list[asyncio.Task[Any]]

    async def _heartbeat_loop(self) -> None: ...

#: seconds between attempts at most (attempts start 0.1 s apart and double)
MAX_RETRY_DELAY = 1.0
#: outbox entries that refer to the old scheduler's plans (or are in the ``rejoin`` message)
_STALE = ("finished", "missing", "replicas", "started", "stolen", "kept", "ended")


def registration(worker: Worker) -> dict[str, Any]:
    """The ``register`` message (a first registration and a rejoin send the same)."""
    return {
        "op": "register", "id": worker.id, "address": worker.address, "resources": worker.resources,
        "node_type": worker.node_type, "name": worker.name, "pid": os.getpid(),
        "memory_limit": worker.memory_limit, "host": socket.gethostname(),
    }  # fmt: skip


def registered(worker: Worker, reply: dict[str, Any]) -> None:
    """Take in the scheduler's ``registered`` reply: heartbeat interval, reconnect window, and the
    scheduler's own address (a LocalCluster's workers register through its Unix socket)."""
    worker.heartbeat_interval = float(reply.get("heartbeat_interval", worker.heartbeat_interval))
    if reply.get("address"):  # (a scheduler older than this field: we keep the one we were given)
        worker.scheduler_public_address = str(reply["address"])
    own = worker.reconnect_window_setting
    worker.reconnect_window = float(own) if own is not None else float(reply.get("reconnect_window") or 0.0)
    worker.outbox.hold = worker.reconnect_window > 0


def rejoin_message(worker: Worker) -> dict[str, Any]:
    """What a worker holds and runs, for the scheduler it registers with again."""
    st = worker.state
    erring = [e["key"] for e in worker.outbox.batch.erred if isinstance(e, dict)]
    return {
        "held": [[k, st.nbytes(k)] for k in [*st.memory, *st.spilled]],
        # a cancelled run is nobody's: adopted as running, its dropped result would leave the
        # task running for ever (it only ends with an "ended" report, which adopts nothing)
        "running": [*(k for k in st.running if k not in st.cancelled), *erring],
        "queued": [*(t.key for t in st.queue), *st.lined, *st.waiting, *st.superseded],
        # the setups that ran to their end here: the scheduler sends the others (cut off by the
        # lost connection, or registered while we were away)
        "setups": dict(worker.setup_runs.ran),
    }


async def rejoin(worker: Worker, why: BaseException) -> bool:
    """Register again within the window; False when the window is over (the worker then closes)."""
    window = worker.reconnect_window
    if window <= 0 or worker.closed is None or worker.closed.is_set():
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window
    log.warning("worker %s lost the scheduler at %s (%s); retrying for %gs, keeping %d values and %d running "
                "tasks", worker.id, worker.scheduler_address, why, window,
                len(worker.state.memory) + len(worker.state.spilled), len(worker.state.running))  # fmt: skip
    delay = 0.1
    while loop.time() < deadline:
        left = deadline - loop.time()
        try:
            conn = await connect(worker.scheduler_address, worker.token, timeout=min(5.0, max(0.1, left)),
                                 hello={"role": "worker", "name": worker.name}, retry=False, tls=worker.tls)  # fmt: skip
        except CommError:
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(MAX_RETRY_DELAY, delay * 2)
            continue
        try:
            await conn.send({**registration(worker), "rejoin": rejoin_message(worker)})
            reply = await conn.recv()
        except CommError:
            conn.close()
            continue
        if reply.get("op") != "registered":  # e.g. our old connection is not gone there yet
            log.info("scheduler refused worker %s again: %s", worker.id, reply.get("reason", reply))
            conn.close()
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(MAX_RETRY_DELAY, delay * 2)
            continue
        worker.conn = worker.outbox.conn = conn
        registered(worker, reply)
        for kind in _STALE:
            worker.outbox.batch.clear(kind)
        worker._tasks.append(loop.create_task(worker._heartbeat_loop()))
        worker.outbox.soon()
        log.info("worker %s registered again with %s", worker.id, worker.scheduler_address)
        return True
    return False
