"""Unauthenticated connections cost little and are bounded in number (issue 16)."""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc
from typing import Any

import pytest

import tidepool.comm.core as core
from tidepool.comm import Connection, listen

TOKEN = "flood-test-token"


async def nothing(conn: Connection) -> None:  # never reached: nobody authenticates
    await conn.recv()


async def open_idle(address: str, n: int) -> list[socket.socket]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
        socks.append(s)
    return socks


async def settle(cond: Any, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_idle_unauthenticated_connection_costs_kilobytes_not_a_quarter_mebibyte(monkeypatch: pytest.MonkeyPatch) -> None:
    """400 connections that never authenticate: under 48 KiB each on the scheduler side (the
    decoder's staging buffer alone was 256 KiB: 2,000 such connections held 500 MiB)."""
    monkeypatch.setattr(core, "MAX_PENDING_PER_SOURCE", 1024)  # all 400 come from 127.0.0.1

    async def main() -> float:
        lst = await listen("tcp://127.0.0.1:0", nothing, TOKEN)
        try:
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            socks = await open_idle(lst.address, 400)
            await settle(lambda: lst.handshaking == 400, "400 handshakes to start")
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            for s in socks:
                s.close()
            return held / 400
        finally:
            await lst.close()

    per_conn = asyncio.run(main())
    assert per_conn < 48 * 1024, f"{per_conn / 1024:.0f} KiB per idle connection"


def test_past_the_pending_limit_the_oldest_pending_connection_gives_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: the newest connection always gets in; the oldest idle one is closed for it."""
    monkeypatch.setattr(core, "MAX_PENDING_HANDSHAKES", 5)

    async def main() -> tuple[int, int, list[bool]]:
        lst = await listen("tcp://127.0.0.1:0", nothing, TOKEN)
        try:
            socks = []
            for n in range(1, 21):  # one at a time, so "oldest" is well defined
                socks += await open_idle(lst.address, 1)
                await settle(lambda n=n: lst.handshaking + lst.refused == n, "the listener to see it")
            await settle(lambda: lst.refused == 15, "15 evictions")
            loop = asyncio.get_running_loop()
            closed = []
            for s in socks:  # an evicted socket reads EOF at once; a pending one has nothing to read
                try:
                    data = await asyncio.wait_for(loop.sock_recv(s, 1), 0.2)
                    closed.append(data == b"")
                except TimeoutError:
                    closed.append(False)
                except ConnectionError:
                    closed.append(True)
            for s in socks:
                s.close()
            return lst.handshaking, lst.refused, closed
        finally:
            await lst.close()

    pending, refused, closed = asyncio.run(main())
    assert (pending, refused) == (5, 15)
    assert closed == [True] * 15 + [False] * 5


def test_real_peers_get_through_an_idle_flood_that_reopens_its_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: a flood of idle sockets from the same address as the real peers, reopened as soon
    as they are closed, more than the pending table holds.  Every real client still authenticates
    (before, the full table refused every newcomer: 0 of 10 got through)."""
    monkeypatch.setattr(core, "MAX_PENDING_HANDSHAKES", 40)
    monkeypatch.setattr(core, "MAX_PENDING_PER_SOURCE", 40)

    async def main() -> int:
        lst = await listen("tcp://127.0.0.1:0", nothing, TOKEN)
        host, port = lst.address.removeprefix("tcp://").rsplit(":", 1)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        opened = 0

        async def flooder() -> None:  # keeps 50 idle sockets open, replacing each that is closed
            nonlocal opened
            live: list[socket.socket] = []
            try:
                while not stop.is_set():
                    while len(live) < 50:
                        s = socket.socket()
                        s.setblocking(False)
                        await loop.sock_connect(s, (host, int(port)))
                        live.append(s)
                        opened += 1
                    await asyncio.sleep(0.005)
                    for s in list(live):
                        try:
                            if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                                s.close()
                                live.remove(s)
                        except BlockingIOError:
                            pass
                        except OSError:
                            s.close()
                            live.remove(s)
            finally:
                for s in live:
                    s.close()

        flood = loop.create_task(flooder())
        try:
            await settle(lambda: lst.refused > 0, "the flood to fill the table")
            got_through = 0
            for _ in range(10):
                conn = await core.connect(lst.address, TOKEN, timeout=10)
                got_through += conn.authenticated
                conn.close()
            assert opened > 50  # the flood really did reopen sockets
            return got_through
        finally:
            stop.set()
            await flood
            await lst.close()

    assert asyncio.run(main()) == 10


def test_refusals_are_logged_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(core, "MAX_PENDING_HANDSHAKES", 0)

    async def main() -> int:
        lst = await listen("tcp://127.0.0.1:0", nothing, TOKEN)
        try:
            socks = await open_idle(lst.address, 40)
            await settle(lambda: lst.refused == 40, "40 refusals")
            for s in socks:
                s.close()
            return lst.refused
        finally:
            await lst.close()

    with caplog.at_level("WARNING", logger="tidepool.comm"):
        assert asyncio.run(main()) == 40
    lines = [r for r in caplog.records if "rejected connection" in r.getMessage()]
    assert len(lines) == core.REJECT_LOG_BURST



