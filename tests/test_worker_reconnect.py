"""A worker that lost its scheduler (worker/reconnect.py, issue 27): what it tells the scheduler it
registers with again, and that its reports wait in the outbox while the connection is closed
instead of being dropped.  Pure: a real WorkerState and Outbox, a closed fake connection; the real
kill-and-restart is tests/test_scheduler_restart_e2e.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from tidepool.comm.messages import TaskBatch
from tidepool.worker import reconnect
from tidepool.worker import state as ws
from tidepool.worker.jobs import SetupRuns
from tidepool.worker.outbox import Outbox

ONE_CPU = (("cpu", 1.0),)


class ClosedConn:
    closed = True
    max_frame = 1 << 20

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        raise AssertionError("nothing is sent on a closed connection")


def _worker(window: float | None) -> Any:
    return SimpleNamespace(state=ws.WorkerState({"cpu": 1.0}), outbox=Outbox(), heartbeat_interval=1.0,
                           reconnect_window_setting=window, reconnect_window=0.0, setup_runs=SetupRuns())  # fmt: skip


def _busy_worker() -> Any:
    """One value held (a), one task running (b), one queued (c), one that erred (e, report unsent)."""
    w = _worker(None)
    st = w.state
    for c in st.handle(ws.Compute((ws.TaskIn("a", resources=ONE_CPU),))):
        if isinstance(c, ws.Report):
            w.outbox.add(c.kind, c.item)
    st.handle(ws.TaskDone("a", True, nbytes=40))
    st.handle(ws.Compute((ws.TaskIn("e", resources=ONE_CPU),)))
    for c in st.handle(ws.TaskDone("e", False, error={"type": "ValueError", "message": "no"})):
        if isinstance(c, ws.Report):
            w.outbox.add(c.kind, c.item)
    st.handle(ws.Compute((ws.TaskIn("b", resources=ONE_CPU), ws.TaskIn("c", resources=ONE_CPU))))
    return w


def test_the_rejoin_message_names_held_running_erring_and_queued_tasks() -> None:
    w = _busy_worker()
    assert set(w.state.running) == {"b"}
    msg = reconnect.rejoin_message(cast(reconnect.Worker, w))
    assert msg["held"] == [["a", 40]]
    assert msg["running"] == ["b", "e"]  # e: its error is still to be sent, so it must be accepted
    assert msg["queued"] == ["c"]
    assert msg["setups"] == {}  # none ran here: a scheduler with setups sends them all


def test_a_cancelled_run_is_not_offered_as_running_on_a_rejoin() -> None:
    """Found by review: a run cancelled while the worker was away was adopted as running by the
    scheduler it rejoined; its result was then dropped and the task stayed running for ever."""
    w = _busy_worker()
    w.state.handle(ws.FreeKeys(("b",)))  # b was cancelled; its call still runs
    assert w.state.cancelled == {"b"}
    msg = reconnect.rejoin_message(cast(reconnect.Worker, w))
    assert "b" not in msg["running"] and msg["running"] == ["e"]


def test_the_scheduler_announces_the_window_unless_the_worker_sets_its_own() -> None:
    announced = _worker(None)
    reconnect.registered(cast(reconnect.Worker, announced), {"heartbeat_interval": 0.5, "reconnect_window": 300})
    assert (announced.reconnect_window, announced.heartbeat_interval, announced.outbox.hold) == (300.0, 0.5, True)
    plain = _worker(None)
    reconnect.registered(cast(reconnect.Worker, plain), {"heartbeat_interval": 1.0})
    assert (plain.reconnect_window, plain.outbox.hold) == (0.0, False)
    own = _worker(0.0)
    reconnect.registered(cast(reconnect.Worker, own), {"reconnect_window": 300})
    assert (own.reconnect_window, own.outbox.hold) == (0.0, False)


def test_reports_wait_in_a_holding_outbox_while_the_connection_is_closed() -> None:
    async def main() -> tuple[TaskBatch, TaskBatch]:
        held, dropped = Outbox(), Outbox()
        held.hold = True
        for box in (held, dropped):
            box.conn = cast(Any, ClosedConn())
            box.add("finished", ["a", 40, 0.1])
            box.add("erred", {"key": "e"})
            box.flush()
        return held.batch, dropped.batch

    held, dropped = asyncio.run(main())
    assert held.encode() == {"op": "task-batch", "finished": [["a", 40, 0.1]], "erred": [{"key": "e"}]}
    assert not dropped


def test_a_close_that_arrived_before_the_line_went_down_stops_the_worker_quietly(
        caplog: Any, monkeypatch: Any) -> None:  # fmt: skip
    """Found by a bug hunt: a ``LocalCluster`` closing while its worker was sending warned "worker
    ... lost the scheduler ... and exits" (and a worker with a reconnect window tried to rejoin),
    though the scheduler's ``close`` had arrived: the failed send was seen before the message."""
    import logging

    from tidepool.comm.core import Connection
    from tidepool.errors import ConnectionLostError
    from tidepool.worker.server import Worker

    conn = Connection()
    conn._on_frame({"op": "close", "reason": "scheduler closing"})  # arrived, not read yet
    conn._fail(ConnectionLostError("gone"))
    assert conn.unread("close") == {"op": "close", "reason": "scheduler closing"} and conn.unread("x") is None
    closed: list[str] = []
    rejoined: list[Any] = []

    async def serve() -> None:
        raise ConnectionLostError("connection to the scheduler closed")

    async def close(why: str) -> None:
        closed.append(why)

    async def rejoin(worker: Any, exc: Exception) -> bool:
        rejoined.append(exc)
        return False

    fake = SimpleNamespace(conn=conn, _serve_scheduler=serve, close=close)
    monkeypatch.setattr(reconnect, "rejoin", rejoin)
    with caplog.at_level(logging.WARNING, logger="tidepool.worker"):
        asyncio.run(Worker._scheduler_loop(cast(Any, fake)))
    assert closed == ["scheduler closing"] and not rejoined
    assert not [r for r in caplog.records if "lost the scheduler" in r.getMessage()]
