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


def test_an_idle_unauthenticated_connection_costs_kilobytes_not_a_quarter_mebibyte() -> None:
    """400 connections that never authenticate: under 48 KiB each on the scheduler side (the
    decoder's staging buffer alone was 256 KiB: 2,000 such connections held 500 MiB)."""

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


def test_connections_beyond_the_pending_handshake_limit_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "MAX_PENDING_HANDSHAKES", 5)

    async def main() -> tuple[int, int]:
        lst = await listen("tcp://127.0.0.1:0", nothing, TOKEN)
        try:
            socks = await open_idle(lst.address, 20)
            await settle(lambda: lst.refused == 15, "15 connections to be refused")
            pending = lst.handshaking
            for s in socks:
                s.close()
            return pending, lst.refused
        finally:
            await lst.close()

    pending, refused = asyncio.run(main())
    assert (pending, refused) == (5, 15)


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


