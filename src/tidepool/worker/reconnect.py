"""A worker that lost its scheduler keeps working and registers again when it is back.

State: nothing of its own; it reads and resets the worker's outboxes.  The window (seconds) is the
worker's ``reconnect_window`` if given, else what the scheduler announced at registration: a
scheduler with a state directory announces its window (default 300 s), any other announces 0, so
a worker of a scheduler that cannot resume still exits as soon as it loses it.

Data flow: the worker's scheduler loop calls :func:`rejoin` when its connection fails.  Meanwhile
the worker's slots keep running, results are kept, and outcomes stay in the worker's outboxes
(``_flush`` does not send while the connection is closed).  :func:`rejoin` dials the scheduler's
address again until the window is over, then registers under the same id with ``rejoin``: the
values it holds, the tasks it is executing (and those whose error is still to be sent, so the
scheduler accepts that error), and those queued or fetching inputs.  Outboxes the new scheduler
does not need (finished keys are in ``held``; steals, missing inputs and replicas refer to the old
scheduler's plans) are dropped; errors go out with the next flush.  Past the window the worker
closes (its process exits; a provider's job ends with it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tidepool.comm import connect
from tidepool.errors import CommError

if TYPE_CHECKING:
    from tidepool.worker.core import Worker

log = logging.getLogger("tidepool.worker")

#: seconds between attempts at most (attempts start 0.1 s apart and double)
MAX_RETRY_DELAY = 1.0


def window_of(worker: Worker, reply: dict[str, Any]) -> float:
    """The reconnect window: the worker's own setting, else what the scheduler announced."""
    own = worker.reconnect_window_setting
    return float(own) if own is not None else float(reply.get("reconnect_window") or 0.0)


def rejoin_message(worker: Worker) -> dict[str, Any]:
    """What a worker holds and runs, for the scheduler it registers with again."""
    erring = [e["key"] for e in worker._erred]
    return {
        "held": [[k, n] for k, n in worker.nbytes.items()],
        "running": [*worker.running, *erring],
        "queued": [*(t.key for t in worker.queue), *worker.waiting],
    }


async def rejoin(worker: Worker, why: BaseException) -> bool:
    """Register again within the window; False when the window is over (the worker then closes)."""
    window = worker.reconnect_window
    if window <= 0 or worker.closed is None or worker.closed.is_set():
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window
    log.warning("worker %s lost the scheduler at %s (%s); retrying for %gs, keeping %d values and %d running "
                "tasks", worker.id, worker.scheduler_address, why, window, len(worker.nbytes), len(worker.running))  # fmt: skip
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
            await conn.send({**worker.registration(), "rejoin": rejoin_message(worker)})
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
        worker.conn = conn
        worker.heartbeat_interval = float(reply.get("heartbeat_interval", worker.heartbeat_interval))
        worker.reconnect_window = window_of(worker, reply)
        for box in (worker._finished, worker._missing, worker._replicas, worker._started, worker._stolen,
                    worker._kept):  # fmt: skip
            box.clear()
        worker._tasks.append(loop.create_task(worker._heartbeat_loop()))
        worker._schedule_flush()
        log.info("worker %s registered again with %s", worker.id, worker.scheduler_address)
        return True
    return False
