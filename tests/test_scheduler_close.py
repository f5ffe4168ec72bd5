"""Scheduler.close() tells every worker to close, even one whose connection is busy writing at that
moment (asyncio sockets; the workers are fakes that record what they were sent)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest

from tidepool.errors import ConnectionLostError
from tidepool.scheduler import server
from tidepool.scheduler.server import Scheduler


class FakeConn:
    """A worker's connection: ``busy`` ones cannot take a message at once (a large send under
    way); ``stuck`` ones never take it (a worker that stopped reading); ``gone`` ones fail."""

    def __init__(self, busy: bool = False, stuck: bool = False, gone: bool = False) -> None:
        self.busy, self.stuck, self.gone = busy, stuck, gone
        self.sent: list[dict[str, Any]] = []
        self.closed = False

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        if self.gone:
            raise ConnectionLostError("gone")
        if self.busy or self.stuck:
            return False
        self.sent.append(msg)
        return True

    async def send(self, msg: dict[str, Any]) -> None:
        if self.stuck:
            await asyncio.Event().wait()  # never drains
        await asyncio.sleep(0)  # the send under way finishes first
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


def test_close_reaches_busy_workers_and_does_not_wait_for_stuck_ones(monkeypatch: Any) -> None:
    """Before the fix the close went only where the socket took it at once: a worker whose
    connection was busy writing never heard it."""
    monkeypatch.setattr(server, "CLOSE_SEND_WAIT", 0.2)

    async def main() -> dict[str, FakeConn]:
        s = await Scheduler().start()
        conns = {"idle": FakeConn(), "busy": FakeConn(busy=True), "stuck": FakeConn(stuck=True),
                 "gone": FakeConn(gone=True)}  # fmt: skip
        s.worker_conns.update(conns)  # type: ignore[arg-type]
        await asyncio.wait_for(s.close(), 10)  # bounded: the stuck worker is not waited for
        return conns

    conns = asyncio.run(main())
    bye = {"op": "close", "reason": "scheduler closing"}
    assert conns["idle"].sent == [bye] and conns["busy"].sent == [bye]
    assert conns["stuck"].sent == [] and conns["gone"].sent == []
    assert all(c.closed for c in conns.values())


def test_a_close_cancelled_while_it_waits_still_closes_everything(monkeypatch: Any) -> None:
    """A caller's timeout may cancel close() while it waits for a stuck worker: the connections
    and the listener are closed all the same (a second close() would do nothing)."""
    monkeypatch.setattr(server, "CLOSE_SEND_WAIT", 30.0)

    async def main() -> tuple[FakeConn, str]:
        s = await Scheduler().start()
        stuck = FakeConn(stuck=True)
        s.worker_conns["stuck"] = stuck  # type: ignore[assignment]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(s.close(), 0.1)
        return stuck, s.address

    stuck, address = asyncio.run(main())
    assert stuck.closed
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass
