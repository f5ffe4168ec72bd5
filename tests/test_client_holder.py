"""A task-done report carries where the value lives (issue 25), so ``result()`` reads it from that
worker without asking the scheduler who holds it; when that read fails, it asks who-has."""

from __future__ import annotations

from typing import Any

import pytest

import tidepool
from tidepool.comm import Connection, listen, serialize
from tidepool.loop import LoopThread


def inc(x: int) -> int:
    return x + 1


class FakeCluster:
    """A scheduler and two data servers on real TCP.  The scheduler reports every wanted key done
    and names ``reported`` (``"first"``, ``"gone"``: an address nobody listens on, or ``None``:
    no address) as its holder; who-has names the second data server.  Both serve ``value``."""

    def __init__(self, reported: str | None, value: Any) -> None:
        self.loop = LoopThread("fake-cluster")
        self.token = "holder-test-token"
        self.value = value
        self.who_has_asked = 0
        self.reads: dict[str, int] = {}
        self.scheduler = self.loop.run(listen("tcp://127.0.0.1:0", self.handler, self.token))
        self.first = self.loop.run(listen("tcp://127.0.0.1:0", self.serve("first"), self.token))
        self.second = self.loop.run(listen("tcp://127.0.0.1:0", self.serve("second"), self.token))
        self.reported = {"first": self.first.address, "gone": "tcp://127.0.0.1:9", None: None}[reported]
        self.address = self.scheduler.address

    async def handler(self, conn: Connection) -> None:
        await conn.send({"op": "welcome", "client": "client-1"})
        while True:
            msg = await conn.recv()
            if msg.get("op") == "update-graph":
                tail = [self.reported] if self.reported else []
                await conn.send({"op": "report", "items": [[k, "memory", *tail] for k in msg["wanted"]]})
            elif msg.get("op") == "who-has":
                self.who_has_asked += 1
                result = {k: [self.second.address] for k in msg["keys"]}
                await conn.send({"op": "reply", "id": msg["id"], "result": result})

    def serve(self, name: str) -> Any:
        async def data_server(conn: Connection) -> None:
            while True:
                msg = await conn.recv()
                self.reads[name] = self.reads.get(name, 0) + 1
                data = {k: serialize(self.value) for k in msg["keys"]}
                await conn.send({"op": "data", "data": data, "missing": [], "failed": {}, "deferred": []})

        return data_server

    def close(self) -> None:
        for listener in (self.scheduler, self.first, self.second):
            self.loop.run(listener.close())
        self.loop.stop()


@pytest.mark.parametrize("reported", ["first", "gone", None])
def test_result_reads_from_the_reported_holder_and_asks_who_has_only_without_one(reported: str | None) -> None:
    fake = FakeCluster(reported, value=42)
    try:
        with tidepool.Client(fake.address, token=fake.token, timeout=30) as client:
            futs = client.map(inc, range(3))
            assert client.gather(futs, timeout=60) == [42, 42, 42]
            assert client.submit(inc, 5).result(timeout=60) == 42
        if reported == "first":
            assert fake.who_has_asked == 0  # the report said where: no who-has round trip
            assert fake.reads == {"first": 2}  # one read per holder per call
        else:  # no address, or one that refuses: ask the scheduler, read from the holder it names
            assert fake.who_has_asked == 2
            assert fake.reads == {"second": 2}
    finally:
        fake.close()


def test_the_scheduler_reports_the_address_of_a_worker_holding_the_value() -> None:
    with tidepool.LocalCluster(n_workers=2, slots=1) as cluster, tidepool.Client(cluster) as client:
        futs = client.map(inc, range(6))
        assert client.gather(futs, timeout=60) == [1, 2, 3, 4, 5, 6]
        reported = client._connection.core.holders  # what the reports said, kept for later fetches
        held = client.who_has(futs)
        workers = {w["address"] for w in client.scheduler_info()["workers"]}
        for f in futs:
            assert reported[f.key] in workers and reported[f.key] in held[f.key]
