"""The scheduler's outgoing messages of a loop turn: merged per peer where they meet, order kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from tidepool.comm.messages import ComputeTask, ReportItem
from tidepool.scheduler.outgoing import Outgoing


class Recorder:
    """A connection that takes every message at once (``send_nowait``) unless ``busy``."""

    def __init__(self, busy: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.busy = busy
        self.closed = False

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        if self.busy:
            return False
        self.sent.append(msg)
        return True

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


class Stuck(Recorder):
    """A peer that stopped reading: its connection takes nothing until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__(busy=True)
        self.gate = asyncio.Event()

    async def send(self, msg: dict[str, Any]) -> None:
        await self.gate.wait()
        self.sent.append(msg)


async def flushed(out: Outgoing) -> None:
    await out.flush()
    await out.idle()


def _task(key: str) -> ComputeTask:
    return ComputeTask(key, "f", b"", None, None)


def test_one_message_per_peer_and_kind_in_order() -> None:
    w, c = Recorder(), Recorder()
    out = Outgoing(cast(Any, {"w": w}), cast(Any, {"c": c}))
    out.compute("w", [_task("a")], {"f": b"pickle"})
    out.compute("w", [_task("b")], None)  # meets the one before: merged
    out.report("c", [ReportItem("x", "memory", "tcp://w")])
    out.free("w", ["x"])
    out.free("w", ["y"])  # merged too
    out.compute("w", [_task("c")], None)  # after a free: a new message, so the order holds
    out.report("c", [ReportItem("y", "memory")])
    asyncio.run(flushed(out))
    assert [m["op"] for m in w.sent] == ["compute", "free", "compute"]
    assert [t["key"] for t in w.sent[0]["tasks"]] == ["a", "b"] and w.sent[0]["functions"] == {"f": b"pickle"}
    assert w.sent[1]["keys"] == ["x", "y"]
    assert [t["key"] for t in w.sent[2]["tasks"]] == ["c"] and "functions" not in w.sent[2]
    assert [m["op"] for m in c.sent] == ["report"] and [i[0] for i in c.sent[0]["items"]] == ["x", "y"]
    assert not out and out.messages == 4


def _sent_per_step(w: Recorder, steps: Callable[[], list[int]]) -> list[int]:
    """Run ``steps`` (which appends ``len(w.sent)`` where it looks) in one loop turn, then let the
    loop run a few turns and look once more."""

    async def main() -> list[int]:
        seen = steps()
        for _ in range(3):
            await asyncio.sleep(0)
        return [*seen, len(w.sent)]

    return asyncio.run(main())


def test_soon_sends_at_the_end_of_the_turn_once() -> None:
    w = Recorder()
    out = Outgoing(cast(Any, {"w": w}), {})

    def steps() -> list[int]:
        out.free("w", ["a"])
        out.soon()
        out.free("w", ["b"])  # later in the same turn: in the same message
        out.soon()
        return [len(w.sent)]

    assert _sent_per_step(w, steps) == [0, 1]
    assert w.sent == [{"op": "free", "keys": ["a", "b"]}]


def test_a_gone_peer_is_skipped() -> None:
    out = Outgoing({}, {})
    out.free("w", ["a"])
    out.report("c", [ReportItem("a", "lost")])
    asyncio.run(flushed(out))
    assert not out and out.messages == 0


def test_a_reader_takes_only_buffered_messages_of_the_asked_op() -> None:
    from tidepool.comm.core import MemoryConnection

    conn = MemoryConnection()
    for m in ({"op": "task-batch", "n": 1}, {"op": "task-batch", "n": 2}, {"op": "heartbeat"}):
        conn._on_frame(m)
    assert conn.recv_buffered("task-batch") == {"op": "task-batch", "n": 1}
    assert conn.recv_buffered("task-batch") == {"op": "task-batch", "n": 2}
    assert conn.recv_buffered("task-batch") is None  # a heartbeat is next: left for recv()
    assert asyncio.run(conn.recv()) == {"op": "heartbeat"}
    assert conn.recv_buffered("task-batch") is None


def test_a_direct_message_goes_after_what_is_pending_for_that_worker() -> None:
    """A ``restart`` or ``close`` sent directly (the scheduler's setup/run/restart/close path) never
    overtakes the compute/free messages made for that worker earlier in the loop turn; another
    worker's pending messages stay for the end of the turn."""
    w, v = Recorder(), Recorder()
    out = Outgoing(cast(Any, {"w": w, "v": v}), {})
    out.compute("w", [_task("a")], {"f": b"pickle"})
    out.free("w", ["x"])
    out.free("v", ["y"])
    asyncio.run(out.send_worker("w", {"op": "restart"}))
    assert [m["op"] for m in w.sent] == ["compute", "free", "restart"]  # before the fix: restart alone
    assert [t["key"] for t in w.sent[0]["tasks"]] == ["a"] and w.sent[1]["keys"] == ["x"]
    assert v.sent == [] and out.workers == {"v": [{"op": "free", "keys": ["y"]}]}
    assert out.messages == 3
    asyncio.run(flushed(out))
    assert v.sent == [{"op": "free", "keys": ["y"]}] and len(w.sent) == 3 and not out


def test_a_direct_message_waits_for_a_flush_still_sending_to_that_worker() -> None:
    """A flush that took the worker's messages and waits on its slow connection is not overtaken."""

    async def main() -> list[str]:
        w = Stuck()
        out = Outgoing(cast(Any, {"w": w}), {})
        out.compute("w", [_task("a")], None)
        flushing = asyncio.create_task(out.flush())
        await asyncio.sleep(0)  # the flush has taken the compute and waits on the connection
        direct = asyncio.create_task(out.send_worker("w", {"op": "close"}))
        await asyncio.sleep(0)
        w.gate.set()
        await asyncio.gather(flushing, direct)
        return [m["op"] for m in w.sent]

    assert asyncio.run(main()) == ["compute", "close"]


def test_a_peer_that_stops_reading_holds_only_its_own_messages() -> None:
    """A worker whose connection takes nothing (it stopped reading) keeps its messages in its own
    line; the other worker's compute, a client's report and a reply to that client are written at
    once, and a later flush does not wait for it either.  Before, one flush wrote to every peer in
    turn under one lock: everything after the stuck peer waited, and so did every later flush."""

    async def main() -> None:
        stuck, w, c = Stuck(), Recorder(), Recorder()
        out = Outgoing(cast(Any, {"stuck": stuck, "w": w}), cast(Any, {"c": c}))
        out.compute("stuck", [_task("a")], None)
        out.compute("w", [_task("b")], None)
        out.report("c", [ReportItem("b", "memory", "tcp://w")])
        await asyncio.wait_for(out.flush(), 1)
        assert [m["op"] for m in w.sent] == ["compute"] and [m["op"] for m in c.sent] == ["report"]
        out.compute("stuck", [_task("c")], None)
        out.compute("w", [_task("d")], None)
        await asyncio.wait_for(out.flush(), 1)
        await asyncio.wait_for(out.send_client("c", {"op": "reply", "id": 1}), 1)
        assert [t["key"] for m in w.sent for t in m["tasks"]] == ["b", "d"] and c.sent[-1]["op"] == "reply"
        assert stuck.sent == []
        stuck.gate.set()  # it reads again: its messages go, in order
        await asyncio.wait_for(out.idle(), 1)
        assert [t["key"] for m in stuck.sent for t in m["tasks"]] == ["a", "c"]

    asyncio.run(main())


def test_a_close_to_a_peer_that_stops_reading_closes_its_connection_anyway(monkeypatch: Any) -> None:
    """The close of a worker (removed at its heartbeat time-to-live) cannot be written to a peer
    that stopped reading; its connection is closed a moment later all the same."""
    import tidepool.scheduler.outgoing as outgoing

    monkeypatch.setattr(outgoing, "CLOSE_AFTER", 0.01)

    async def main() -> None:
        stuck = Stuck()
        conns: dict[str, Any] = {"stuck": stuck}
        out = Outgoing(conns, {})
        out.compute("stuck", [_task("a")], None)
        await out.flush()
        out.to_worker("stuck", {"op": "close", "reason": "missed heartbeats"})
        await out.flush()
        assert "stuck" not in conns  # no further message is made for it
        await asyncio.sleep(0.05)
        assert stuck.closed and stuck.sent == []

    asyncio.run(main())


def test_a_peer_that_came_back_gets_its_messages_on_its_new_connection() -> None:
    """A worker that reconnects under the same id while its old line still holds messages: the
    old connection is closed and what is made from then on goes to the new one."""

    async def main() -> None:
        old, new = Stuck(), Recorder()
        conns: dict[str, Any] = {"w": old}
        out = Outgoing(conns, {})
        out.compute("w", [_task("a")], None)
        await out.flush()
        conns["w"] = new
        out.compute("w", [_task("b")], None)
        await out.flush()
        assert old.closed and [t["key"] for m in new.sent for t in m["tasks"]] == ["b"]

    asyncio.run(main())


def test_turn_end_hands_over_at_once_when_nothing_else_is_ready_else_at_the_end_of_the_turn() -> None:
    w = Recorder()
    out = Outgoing(cast(Any, {"w": w}), {})

    def steps() -> list[int]:
        out.free("w", ["a"])
        out.turn_end()  # nothing else ready in this turn: the turn ends here
        seen = [len(w.sent)]
        asyncio.get_running_loop().call_soon(out.free, "w", ["c"])  # another reader's batch, later in this turn
        out.free("w", ["b"])
        out.turn_end()
        return [*seen, len(w.sent)]

    assert _sent_per_step(w, steps) == [1, 1, 2]
    assert w.sent == [{"op": "free", "keys": ["a"]}, {"op": "free", "keys": ["b", "c"]}]


def test_graph_updates_read_in_one_go_share_one_report_per_client() -> None:
    """A client's messages that arrive together are handled in one step of the scheduler's reader
    (``Connection.recv`` does not yield while its inbox holds one): their reports must still go out
    as one message, as :meth:`Outgoing.turn_end` promises.  Before the fix the first update handed
    over at once (nothing else was ready in the loop turn), so each update made a report of its own."""
    from tidepool.comm import connect
    from tidepool.comm.messages import KeyQuery, UpdateGraph
    from tidepool.scheduler.server import Scheduler

    async def main() -> list[dict[str, Any]]:
        sched = await Scheduler().start()
        try:
            conn = await connect(sched.address, sched.token, hello={"role": "client"})
            assert (await conn.recv())["op"] == "welcome"
            # three updates naming keys the scheduler does not know (each is reported "lost"), written
            # in one step: they reach the scheduler's socket together and are read in one go
            for k in ("a", "b", "c"):
                assert conn.send_nowait(UpdateGraph([], [k]).encode())
            got = [await conn.recv()]
            await conn.send(KeyQuery("who-has", ["a"], id=1).encode())  # answered after every report
            while got[-1].get("op") != "reply":
                got.append(await conn.recv())
            conn.close()
            return got[:-1]
        finally:
            await sched.close()

    reports = asyncio.run(main())
    assert [m["op"] for m in reports] == ["report"], reports
