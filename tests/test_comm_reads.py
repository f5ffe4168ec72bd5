"""Reads on a connection (comm/core.py) that end while their reader goes away: real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import tidepool.comm.core as core
from tidepool.comm import Connection, listen

TOKEN = "reads-test-token"


async def silent(conn: Connection) -> None:
    await asyncio.sleep(30)  # accepts, never sends


def test_a_silent_read_cancelled_as_its_connection_closes_leaves_no_unretrieved_error() -> None:
    # found by a churn hunt: "Task exception was never retrieved ... ConnectionLostError" at many
    # cluster shutdowns (a fetch's read ended with the connection's error in the turn its reader
    # was cancelled, and nobody read that error)
    said: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: said.append(str(ctx.get("message"))))
        lst = await listen("tcp://127.0.0.1:0", silent, TOKEN)
        try:
            for _ in range(5):
                conn = await core.connect(lst.address, TOKEN, timeout=10)
                reader = asyncio.ensure_future(conn.recv_unless_silent(30.0))
                await asyncio.sleep(0.05)  # the read waits
                conn.close()  # its read ends with ConnectionLostError next turn ...
                await asyncio.sleep(0)
                reader.cancel()  # ... the turn its reader is cancelled
                with contextlib.suppress(BaseException):
                    await reader
                await asyncio.sleep(0.01)
                gc.collect()
        finally:
            await lst.close()

    asyncio.run(main())
    gc.collect()
    assert not [m for m in said if "never retrieved" in m], said
