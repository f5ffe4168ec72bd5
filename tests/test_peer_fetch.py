"""A worker's fetches from a peer (``worker/peers.py``): the keys asked of one peer in a loop turn
go in one request, and each value is handed over as the reply holding it arrives."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidepool.comm import Connection, listen
from tidepool.comm.messages import DataReply
from tidepool.comm.serialize import serialize
from tidepool.worker.peers import Peers

TOKEN = "peer-fetch-test-token"


def test_each_value_of_a_batch_is_handed_over_as_its_reply_arrives() -> None:
    """Found by a bug hunt: the values of every reply of a batch were held until the last reply
    came, so a survivor taking a retiring worker's 150 MiB held them all at once before storing
    (and spilling) any, and passed its memory limit.  Here the peer answers ``a`` at once, defers
    ``b`` and answers it only when told: ``a`` must be had before ``b`` is sent."""

    async def main() -> list[str]:
        release_b = asyncio.Event()
        asked: list[list[str]] = []

        async def peer(conn: Connection) -> None:
            while True:
                keys = (await conn.recv())["keys"]
                asked.append(list(keys))
                if "a" in keys:
                    await conn.send(DataReply({"a": serialize(1)}, deferred=["b"]).encode())
                else:
                    await release_b.wait()
                    await conn.send(DataReply({"b": serialize(2)}).encode())

        listener = await listen("tcp://127.0.0.1:0", peer, TOKEN)
        peers = Peers(TOKEN, None, fetch_timeout=10)
        order: list[str] = []
        try:
            holders = (("w", listener.address),)

            async def one(key: str) -> Any:
                got = await peers.fetch(key, holders)
                order.append(key)
                return got

            ta = asyncio.ensure_future(one("a"))
            tb = asyncio.ensure_future(one("b"))
            assert await asyncio.wait_for(ta, 10) == ("ok", 1)  # before: waited for b's reply too
            assert not tb.done()
            release_b.set()
            assert await asyncio.wait_for(tb, 10) == ("ok", 2)
            assert asked == [["a", "b"], ["b"]]  # one request for the batch, then the deferred key
            return order
        finally:
            peers.close()
            await listener.close()

    assert asyncio.run(main()) == ["a", "b"]


def test_a_key_the_peer_does_not_hold_is_missing_and_a_cancelled_asker_leaves_the_other() -> None:
    async def main() -> tuple[Any, Any]:
        async def peer(conn: Connection) -> None:
            while True:
                await conn.recv()
                await asyncio.sleep(0.2)
                await conn.send(DataReply({"a": serialize(1)}, missing=["z"]).encode())

        listener = await listen("tcp://127.0.0.1:0", peer, TOKEN)
        peers = Peers(TOKEN, None, fetch_timeout=10)
        try:
            holders = (("w", listener.address),)
            first = asyncio.ensure_future(peers.fetch("a", holders))
            second = asyncio.ensure_future(peers.fetch("a", holders))  # the same key, asked twice
            missing = asyncio.ensure_future(peers.fetch("z", holders))
            await asyncio.sleep(0.05)
            first.cancel()  # one asker gives up: the other still gets the value
            return await asyncio.wait_for(second, 10), await asyncio.wait_for(missing, 10)
        finally:
            peers.close()
            await listener.close()

    got, missing = asyncio.run(main())
    assert got == ("ok", 1)
    assert missing[0] == "missing" and "does not hold it" in missing[1]


def test_any_error_of_a_fetch_is_an_outcome_never_a_dead_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found running the demo: connecting to a peer that had just closed raised the transport's
    RuntimeError (not a CommError), which killed the fetch; the task needing the value waited for
    ever and the demo never ended.  Any error is a 'missing' outcome (the scheduler reschedules)."""

    async def broken(self: Peers, address: str, keys: list[str], on_reply: Any = None) -> Any:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    monkeypatch.setattr(Peers, "get", broken)

    async def main() -> Any:
        peers = Peers(TOKEN, None, fetch_timeout=10)
        return await asyncio.wait_for(peers.fetch("a", (("w", "tcp://127.0.0.1:1"),)), 10)

    kind, why = asyncio.run(main())
    assert kind == "missing" and "RuntimeError" in why
