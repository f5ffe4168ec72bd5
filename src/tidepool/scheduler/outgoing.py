"""The scheduler's outgoing messages of one loop turn, one message per peer and kind where they meet.

State: per worker, the messages not sent yet, in order (a ``compute`` or ``free`` right after another
of its kind is merged into it), and per client the report items not sent yet.  Data flow: the
shell's ``_dispatch`` turns the state's commands into entries here; a batch that asks for
nothing back (a worker's ``task-batch``, a client's ``update-graph``) leaves them for the end of the
loop turn (:meth:`Outgoing.soon`), so the commands of every message read in that turn go out
together; anything else (a request that gets a reply, a tick, a registration) sends them at once
(:meth:`Outgoing.flush`) before its own reply, so no reply overtakes the reports it answers for.
Messages to one peer keep their order: one flush at a time (a lock), so a later flush never
overtakes an earlier one that is waiting on a slow connection, and a message sent to a worker
directly (:meth:`Outgoing.send_worker`) goes, under the same lock, after what is pending for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from tidepool.comm import Connection
from tidepool.comm.messages import ClientReport, Compute, ComputeTask, ReportItem
from tidepool.errors import CommError

log = logging.getLogger("tidepool.scheduler")


@dataclass(slots=True)
class _ComputeOut:
    tasks: list[ComputeTask] = field(default_factory=list)
    functions: dict[str, Any] = field(default_factory=dict)


class Outgoing:
    def __init__(self, worker_conns: dict[str, Connection], client_conns: dict[str, Connection]) -> None:
        self.worker_conns = worker_conns
        self.client_conns = client_conns
        self.workers: dict[str, list[_ComputeOut | dict[str, Any]]] = {}
        self.clients: dict[str, list[ReportItem]] = {}
        self.messages = 0  # messages sent (for /metrics and the benchmarks)
        self._scheduled = False
        self._lock = asyncio.Lock()

    def __bool__(self) -> bool:
        return bool(self.workers or self.clients)

    # ---- adding -------------------------------------------------------------------------------
    def _compute(self, wid: str) -> _ComputeOut:
        q = self.workers.setdefault(wid, [])
        if q and isinstance(q[-1], _ComputeOut):
            return q[-1]
        out = _ComputeOut()
        q.append(out)
        return out

    def compute(self, wid: str, tasks: list[ComputeTask], functions: dict[str, Any] | None) -> None:
        c = self._compute(wid)
        c.tasks.extend(tasks)
        if functions:
            c.functions.update(functions)

    def free(self, wid: str, keys: list[str]) -> None:
        q = self.workers.setdefault(wid, [])
        last = q[-1] if q else None
        if isinstance(last, dict) and last.get("op") == "free":
            last["keys"].extend(keys)
        else:
            q.append({"op": "free", "keys": list(keys)})

    def to_worker(self, wid: str, msg: dict[str, Any]) -> None:
        self.workers.setdefault(wid, []).append(msg)

    def report(self, cid: str, items: list[ReportItem]) -> None:
        self.clients.setdefault(cid, []).extend(items)

    # ---- sending ------------------------------------------------------------------------------
    def soon(self) -> None:
        """Send at the end of this loop turn (after every message already read is handled)."""
        if not self._scheduled and self:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._at_turn_end)

    def _at_turn_end(self) -> None:
        self._scheduled = False
        if self:
            t = asyncio.get_running_loop().create_task(self.flush())
            t.add_done_callback(_log_error)

    async def flush(self) -> None:
        """Send everything collected so far, in order, one message per peer and kind where they meet."""
        async with self._lock:
            workers, self.workers = self.workers, {}
            clients, self.clients = self.clients, {}
            for wid, msgs in workers.items():
                await self._send_queue(wid, msgs)
            for cid, items in clients.items():
                conn = self.client_conns.get(cid)
                if conn is not None:
                    self.messages += 1
                    with contextlib.suppress(CommError):
                        await conn.send(ClientReport(items).encode())

    async def send_worker(self, wid: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to worker ``wid`` now, after what is pending for it (the scheduler's path for
        messages outside the batches: setup, run, restart, close), so it never overtakes a compute
        or free made earlier; waits for a flush under way (it may hold that worker's messages).
        Nothing if the worker has no connection; a failed send closes that connection."""
        async with self._lock:
            await self._send_queue(wid, self.workers.pop(wid, []))
            await self._send(wid, msg)

    async def _send_queue(self, wid: str, msgs: list[_ComputeOut | dict[str, Any]]) -> None:
        for m in msgs:
            if isinstance(m, _ComputeOut):
                await self._send(wid, Compute(m.tasks, m.functions or None).encode())
                continue
            await self._send(wid, m)
            if m["op"] == "close":
                conn = self.worker_conns.pop(wid, None)
                if conn is not None:
                    asyncio.get_running_loop().call_later(5.0, conn.close)

    async def _send(self, wid: str, msg: dict[str, Any]) -> None:
        conn = self.worker_conns.get(wid)
        if conn is None:
            return
        self.messages += 1
        try:
            await conn.send(msg)
        except CommError as exc:
            log.info("send to worker %s failed: %s", wid, exc)
            conn.close()


def _log_error(t: asyncio.Task[Any]) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("sending the scheduler's messages failed", exc_info=t.exception())
