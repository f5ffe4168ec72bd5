"""The typed ``task-batch`` message: what goes on the wire and back, and the events it makes."""

from __future__ import annotations

from tidepool.comm.messages import TaskBatch
from tidepool.scheduler import events as ev
from tidepool.scheduler.worker_reports import batch_events


def test_only_kinds_with_entries_go_on_the_wire() -> None:
    b = TaskBatch()
    assert not b
    b.add("finished", ["x", 8, 0.5])
    assert b
    assert b.encode() == {"op": "task-batch", "finished": [["x", 8, 0.5]]}


def test_a_steal_reply_carries_both_lists() -> None:
    b = TaskBatch()
    b.add("kept", "k")
    msg = b.encode()
    assert msg["stolen"] == [] and msg["kept"] == ["k"]
    back = TaskBatch.decode(msg)
    assert back.steal_reply and back.kept == ["k"]
    b.clear("kept")
    assert not b


def test_round_trip_and_events_in_fixed_order() -> None:
    b = TaskBatch()
    b.add("finished", ["a", 8, 0.1])
    b.add("started", "b")
    b.add("erred", {"key": "c", "type": "ValueError", "message": "no"})
    b.add("missing", ["d", "a", "w2"])
    b.add("replicas", ["a", 8])
    b.add("seceded", "e")
    b.add("unservable", ["f", "Lock", "cannot pickle"])
    b.add("ended", "g")
    back = TaskBatch.decode(b.encode())
    assert back == b
    out = batch_events("w1", back, 1.0)
    assert [type(e) for e in out] == [ev.TasksStarted, ev.TaskFinished, ev.TaskErred, ev.MissingData,
                                      ev.AddReplica, ev.TaskSeceded, ev.ValueUnservable,
                                      ev.AbandonedRunsEnded]  # fmt: skip
    assert out[-1] == ev.AbandonedRunsEnded("w1", ["g"], 1.0)
    assert not any(isinstance(e, ev.StealReply) for e in out)


def test_a_kind_the_reader_does_not_know_passes_and_is_ignored() -> None:
    b = TaskBatch()
    b.add("stored", "x")
    assert b and b.encode() == {"op": "task-batch", "stored": ["x"]}
    assert batch_events("w1", TaskBatch.decode(b.encode()), 1.0) == []
