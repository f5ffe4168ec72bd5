"""The scheduler's outgoing messages: collected per loop turn, then written per peer, in order.

State: per worker, the messages of this loop turn not handed over yet, in order (a ``compute`` or
``free`` right after another of its kind is merged into it), and per client the report items not
handed over yet; then per peer the messages handed over and not written yet, with the task writing
them when its connection cannot take them at once.  Data flow: the shell's ``_dispatch`` turns the
state's commands into entries here; a batch that asks for nothing back (a worker's ``task-batch``,
a client's ``update-graph``) leaves them for the end of the loop turn (:meth:`Outgoing.turn_end`:
at once when nothing else is ready to run in that turn and the reader holds no message already read), so the commands of every message read in
that turn go out together; anything else hands them over at once (:meth:`Outgoing.flush`).  A reply or a message outside the batches goes through the same
peer's line (:meth:`Outgoing.send_worker`, :meth:`Outgoing.send_client`, :meth:`Outgoing.post_client`),
after what was made for that peer before it, so nothing overtakes.

Peers never wait for each other: a message is written at once when its connection takes it
(nothing queued, not paused), else a task of that peer's own writes it when the peer reads.  One
peer that stops reading (a frozen VM, a SIGSTOPped process) holds only its own messages; the tick
that removes it at its heartbeat time-to-live, and every other peer's traffic, go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.comm import Connection
from tidepool.comm.messages import ClientReport, Compute, ComputeTask, ReportItem
from tidepool.errors import CommError

log = logging.getLogger("tidepool.scheduler")

#: how long a worker's connection stays open after its ``close`` message was handed over
CLOSE_AFTER = 5.0


@dataclass(slots=True)
class _ComputeOut:
    tasks: list[ComputeTask] = field(default_factory=list)
    functions: dict[str, Any] = field(default_factory=dict)


_Item = _ComputeOut | ClientReport | dict[str, Any] | asyncio.Future[None]


class _Line:
    """One peer's messages handed over and not written yet (a future: resolve once all before it
    are written), and the task writing them while the connection cannot take them at once."""

    __slots__ = ("conn", "items", "writer")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.items: deque[_Item] = deque()
        self.writer: asyncio.Task[None] | None = None


def _settle(items: Iterable[_Item]) -> None:
    """Release the waiters among ``items`` (futures standing for "all before me is written"): what
    was before them is written, or dropped with its connection."""
    for m in items:
        if isinstance(m, asyncio.Future) and not m.done():
            m.set_result(None)


def _encode(m: _Item) -> dict[str, Any]:
    if isinstance(m, _ComputeOut):
        return Compute(m.tasks, m.functions or None).encode()
    if isinstance(m, ClientReport):
        return m.encode()
    assert isinstance(m, dict)
    return m


class Outgoing:
    def __init__(self, worker_conns: dict[str, Connection], client_conns: dict[str, Connection]) -> None:
        self.worker_conns = worker_conns
        self.client_conns = client_conns
        self.workers: dict[str, list[_ComputeOut | dict[str, Any]]] = {}
        self.clients: dict[str, list[ReportItem]] = {}
        self.messages = 0  # messages sent (for /metrics and the benchmarks)
        self._scheduled = False
        self._lines: dict[tuple[bool, str], _Line] = {}  # (a client?, id) -> its line

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

    # ---- handing over -------------------------------------------------------------------------
    def soon(self) -> None:
        """Hand over at the end of this loop turn (after every message already read is handled)."""
        if not self._scheduled and self:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._at_turn_end)

    def turn_end(self) -> None:
        """Like :meth:`soon`, for a caller that adds nothing more in this step: when nothing else is
        ready to run in this loop turn (the standard loop's ready queue is empty), the turn ends
        here, so hand over now; that saves the loop a turn (a poll) per message read.  Otherwise,
        and on loops whose queue is not visible (uvloop), :meth:`soon`."""
        if not self._scheduled and self:
            ready = getattr(asyncio.get_running_loop(), "_ready", None)
            if ready is not None and not ready:
                self._hand_over_all()
                return
        self.soon()

    def _at_turn_end(self) -> None:
        self._scheduled = False
        self._hand_over_all()

    async def flush(self) -> None:
        """Hand over everything collected so far: written now where the connection takes it, else
        by that peer's writer, in order.  Waits for no peer."""
        self._hand_over_all()

    def _hand_over_all(self) -> None:
        workers, self.workers = self.workers, {}
        clients, self.clients = self.clients, {}
        for wid, msgs in workers.items():
            self._hand_over(False, wid, msgs)
        for cid, items in clients.items():
            self._hand_over(True, cid, [ClientReport(items)])

    async def send_worker(self, wid: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to worker ``wid`` after what is pending for it (the scheduler's path for
        messages outside the batches: setup, run, restart, close), so it never overtakes a compute
        or free made earlier; returns once it is written (or dropped: no connection, or the send
        failed and closed it).  Other workers' pending messages stay for the end of the turn."""
        done = asyncio.get_running_loop().create_future()
        self.post_worker(wid, msg, done)
        await done

    def post_worker(self, wid: str, msg: dict[str, Any], done: asyncio.Future[None] | None = None) -> None:
        """Like :meth:`send_worker` without waiting (a message to many workers, one may be slow)."""
        pending: list[_Item] = [*self.workers.pop(wid, []), msg]
        self._hand_over(False, wid, pending if done is None else [*pending, done])

    async def send_client(self, cid: str, msg: dict[str, Any]) -> None:
        """A reply to client ``cid``, after the reports made for it before; returns once written
        (or dropped with its connection)."""
        done = asyncio.get_running_loop().create_future()
        self.post_client(cid, msg, done)
        await done

    def post_client(self, cid: str, msg: dict[str, Any], done: asyncio.Future[None] | None = None) -> None:
        """Like :meth:`send_client` without waiting (a notice to many clients)."""
        items = self.clients.pop(cid, None)
        first: list[_Item] = [ClientReport(items)] if items else []
        self._hand_over(True, cid, [*first, msg] if done is None else [*first, msg, done])

    def _hand_over(self, client: bool, pid: str, msgs: Sequence[_Item]) -> None:
        if not client and any(isinstance(m, dict) and m.get("op") == "close" for m in msgs):
            # the worker goes: its connection closes a moment after, written or not (a peer that
            # stopped reading would otherwise hold it, and the close, for ever)
            conn = self.worker_conns.pop(pid, None)
            if conn is not None:
                asyncio.get_running_loop().call_later(CLOSE_AFTER, conn.close)
                self._lines.setdefault((client, pid), _Line(conn))
        line = self._lines.get((client, pid))
        current = (self.client_conns if client else self.worker_conns).get(pid)
        if line is not None and current is not None and current is not line.conn:
            self._failed(client, pid, line, None)  # an old connection of a peer that came back
            line = None
        if line is None:
            conn = current
            if conn is None:  # gone: nothing to write to
                _settle(msgs)
                return
            line = self._lines[(client, pid)] = _Line(conn)
        line.items.extend(msgs)
        if line.writer is None:
            self._write_now(client, pid, line)

    def _write_now(self, client: bool, pid: str, line: _Line) -> None:
        """Write what the connection takes without waiting; a writer task takes over the rest."""
        items, conn = line.items, line.conn
        try:
            while items:
                m = items[0]
                if isinstance(m, asyncio.Future):
                    _settle((items.popleft(),))
                    continue
                msg = _encode(m)
                if not conn.send_nowait(msg):
                    items[0] = msg  # encoded once: the writer sends this
                    line.writer = asyncio.get_running_loop().create_task(self._write(client, pid, line))
                    return
                items.popleft()
                self.messages += 1
        except CommError as exc:
            self._failed(client, pid, line, exc)
            return
        del self._lines[(client, pid)]

    async def _write(self, client: bool, pid: str, line: _Line) -> None:
        items, conn = line.items, line.conn
        try:
            while items:
                m = items.popleft()
                if isinstance(m, asyncio.Future):
                    _settle((m,))
                    continue
                msg = _encode(m)
                await conn.send(msg)
                self.messages += 1
        except CommError as exc:
            self._failed(client, pid, line, exc)
        except BaseException:
            self._failed(client, pid, line, None)
            raise
        finally:
            line.writer = None
            if self._lines.get((client, pid)) is line and not items:
                del self._lines[(client, pid)]

    def _failed(self, client: bool, pid: str, line: _Line, exc: BaseException | None) -> None:
        """The send failed (the connection closes): what is left for this peer is dropped."""
        if exc is not None:
            log.info("send to %s %s failed: %s", "client" if client else "worker", pid, exc)
        line.conn.close()
        _settle(line.items)
        line.items.clear()
        if self._lines.get((client, pid)) is line:
            del self._lines[(client, pid)]

    async def idle(self) -> None:
        """Wait until every line is written (or dropped with its connection)."""
        while writers := [line.writer for line in self._lines.values() if line.writer is not None]:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*writers, return_exceptions=True)
