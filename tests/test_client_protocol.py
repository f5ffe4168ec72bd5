"""The client's sans-IO core (``tidepool.client.protocol``), fed messages by hand: no sockets, no
threads, no scheduler.  Property tests check that reordered and duplicated reports leave every
future with its own outcome, and that the outbox never lets a release overtake what came before."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.client.protocol import (
    FETCH_ATTEMPTS,
    Answered,
    Cancelled,
    ClientProtocol,
    Event,
    Failed,
    Finished,
    KeyCancelled,
    Running,
    Settled,
    WorkerSetupFailed,
    make_exception,
)
from tidepool.comm.messages import ClientReport, ReportItem, TaskSpec, UpdateGraph
from tidepool.errors import (
    ConnectionLostError,
    DependencyError,
    KilledWorkerError,
    ProtocolError,
    RemoteTaskError,
    ResultTooLargeError,
    SchedulerError,
    SerializationError,
    TaskCancelledError,
    TransferError,
)


class KeyFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A stand-in for tidepool's Future: a standard future with a key."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key


def table(core: ClientProtocol, keys: list[str]) -> dict[str, KeyFuture]:
    """Futures of ``keys`` in the core's table (held strongly here: the table holds them weakly)."""
    held = {}
    for k in keys:
        fut, err = core.claim(k, KeyFuture)
        assert err is None
        held[k] = fut
    return held


def apply(events: list[Event], futs: dict[str, KeyFuture]) -> None:
    """What the shell does with events (the first outcome wins, as for a real future)."""
    for e in events:
        if isinstance(e, Finished) and not futs[e.key].done():
            futs[e.key].set_result(("memory", e.holder))
        elif isinstance(e, Failed) and not futs[e.key].done():
            futs[e.key].set_exception(e.error())


def report(*items: list[Any]) -> dict[str, Any]:
    return {"op": "report", "items": list(items)}


def erred(typ: str, message: str = "boom", origin: str | None = None) -> dict[str, Any]:
    return {"type": typ, "message": message, "origin": origin, "exception": None, "traceback": "tb"}


# ---- receiving ---------------------------------------------------------------------------------------
def test_a_memory_report_finishes_the_future_and_records_its_holder() -> None:
    core = ClientProtocol()
    futs = table(core, ["a", "b"])
    events = core.receive(report(["a", "memory", "tcp://w1:1"], ["b", "memory"]))
    assert events == [Finished("a", "tcp://w1:1"), Settled("a"), Finished("b", ""), Settled("b")]
    apply(events, futs)
    assert futs["a"].result(0) == ("memory", "tcp://w1:1")
    assert core.holders == {"a": "tcp://w1:1"}  # "b" came without an address: asked when fetched


def test_an_erred_report_fails_the_future_with_the_error_it_names() -> None:
    core = ClientProtocol()
    futs = table(core, ["a", "b", "c", "d"])
    apply(core.receive(report(["a", "erred", erred("KilledWorkerError", "died 3 times", "x")],
                              ["b", "erred", erred("DependencyError", "x failed")],
                              ["c", "erred", erred("ValueError", "bad value")],
                              ["d", "lost"])), futs)  # fmt: skip
    assert isinstance(futs["a"].exception(0), KilledWorkerError)
    assert isinstance(futs["b"].exception(0), DependencyError) and "x failed" in str(futs["b"].exception(0))
    exc_c = futs["c"].exception(0)
    assert isinstance(exc_c, RemoteTaskError) and "ValueError" in str(exc_c)
    assert isinstance(futs["d"].exception(0), TaskCancelledError)
    assert set(core.errors) == {"a", "b", "c", "d"}


def test_a_future_made_after_its_key_failed_starts_failed() -> None:
    core = ClientProtocol()
    core.receive(report(["a", "erred", erred("KilledWorkerError")]))
    fut, err = core.claim("a", KeyFuture)
    assert err is not None and isinstance(make_exception("a", err), KilledWorkerError)  # the shell builds it
    again, err2 = core.claim("a", KeyFuture)
    assert again is fut and err2 == err  # still pending: the shell fails it


def test_cancel_answers_go_to_the_waiting_caller_or_become_events() -> None:
    core = ClientProtocol()
    table_ = table(core, ["a", "b", "c"])
    core.cancelling["a"] = None
    events = core.receive(report(["a", "cancelled"], ["b", "cancelled"], ["c", "running"]))
    assert core.cancelling == {"a": "cancelled"}  # the caller of Future.cancel() applies it
    assert [e for e in events if not isinstance(e, Settled)] == [Cancelled("b"), Running("c")]
    assert all(not f.done() for f in table_.values())


def test_replies_and_setup_errors_become_events() -> None:
    core = ClientProtocol()
    (ok,) = core.receive({"op": "reply", "id": 3, "result": {"x": 1}})
    assert ok == Answered(3, {"x": 1}, None)
    (refused,) = core.receive({"op": "reply", "id": 4, "error": "unknown op"})
    assert isinstance(refused, Answered) and isinstance(refused.error, SchedulerError)
    msg = {"op": "setup-error", "worker": "w1", "name": "s", "error": "bad", "traceback": ""}
    assert core.receive(msg) == [WorkerSetupFailed(msg)]
    assert core.receive({"op": "something-new"}) == []


def test_a_malformed_report_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="IndexError"):
        ClientProtocol().receive(report(["only-a-key"]))


# ---- the outbox ----------------------------------------------------------------------------------------
def test_releases_merge_and_skip_keys_wanted_again() -> None:
    core = ClientProtocol()
    held = table(core, ["b"])
    assert core.send({"op": "update-graph", "n": 1}) is True  # the outbox was empty: start draining
    core.release_dropped("a")
    core.release_dropped("b")  # a new future of "b" exists: it is wanted again
    core.send({"op": "release", "keys": ["c"]})
    core.holders.update({"a": "tcp://w:1", "c": "tcp://w:2"})
    rid = core.request({"op": "who-has", "keys": ["x"]})
    assert core.next_message() == {"op": "update-graph", "n": 1}
    assert core.next_message() == {"op": "release", "keys": ["a", "c"]}
    assert core.holders == {}  # released keys forget where their values were
    assert core.next_message() == {"op": "who-has", "keys": ["x"], "id": rid}
    assert core.next_message() is None
    assert held["b"].key == "b"


@pytest.mark.parametrize("same_task", [True, False])
def test_a_key_given_again_right_after_its_future_was_dropped(same_task: bool) -> None:
    """Found by a bug hunt: ``submit(f, 1, key="k")``, drop it, ``submit(f, 2, key="k")``: the waiting
    release of "k" was left out because a future of "k" existed again, so the scheduler still held
    the first task and refused the second as a collision.  The same task again is still wanted
    again (no release); a different one sends the release first."""
    core = ClientProtocol()
    assert not core.collision("k", ("f", 1))
    held = table(core, ["k"])
    del held  # the last future of "k": its release waits
    core.release_dropped("k")
    assert not core.collision("k", ("f", 1) if same_task else ("f", 2))
    again = table(core, ["k"])
    core.send({"op": "update-graph", "keys": ["k"]})
    if same_task:
        assert core.next_message() == {"op": "update-graph", "keys": ["k"]}
    else:
        assert core.next_message() == {"op": "release", "keys": ["k"]}
        assert core.next_message() == {"op": "update-graph", "keys": ["k"]}
    assert core.next_message() is None and not core.must_release and not core.released_idents
    assert again["k"].key == "k"


def submit_drop(core: ClientProtocol, key: str, ident: tuple[Any, ...], keep: bool = False) -> Any:
    """As the client does: the collision check, a future, the graph sent; then (unless ``keep``)
    the future dropped, its release waiting."""
    assert not core.collision(key, ident)
    held = table(core, [key])
    core.send({"op": "update-graph", "task": ident})
    if keep:
        return held[key]
    del held
    core.release_dropped(key)
    return None


def drain(core: ClientProtocol) -> list[tuple[str, Any]]:
    out = []
    while (m := core.next_message()) is not None:
        out.append(("release", tuple(m["keys"])) if m["op"] == "release" else ("update", m["task"]))
    return out


@pytest.mark.parametrize(("tasks", "expected"), [
    # a different task after each drop: each release goes first, so no task meets another's key
    ([("f", 1), ("f", 2), ("f", 1)],
     [("update", ("f", 1)), ("release", ("k",)), ("update", ("f", 2)), ("release", ("k",)), ("update", ("f", 1))]),
    # the same task again keeps its value (no release), then a different one releases it first
    ([("f", 1), ("f", 1), ("f", 2)],
     [("update", ("f", 1)), ("update", ("f", 1)), ("release", ("k",)), ("update", ("f", 2))]),
])  # fmt: skip
def test_a_key_dropped_and_given_again_several_times_before_the_outbox_drains(
        tasks: list[tuple[Any, ...]], expected: list[tuple[str, Any]]) -> None:  # fmt: skip
    """Found by review: with two releases of one key waiting, the first one sent cleared what
    marked the second as needed, so a different task met the old one's key (KeyCollisionError),
    or a dropped task stayed on the scheduler."""
    core = ClientProtocol()
    for ident in tasks[:-1]:
        submit_drop(core, "k", ident)
    last = submit_drop(core, "k", tasks[-1], keep=True)
    assert drain(core) == expected
    assert not core.must_release and not core.released_idents and last.key == "k"


def test_a_different_task_under_a_dropped_key_does_not_inherit_the_old_ones_error() -> None:
    """Found by review: the new future read the old task's error record (the release not sent yet)."""
    core = ClientProtocol()
    old = submit_drop(core, "k", ("fail", 1), keep=True)
    core.errors["k"] = {"type": "ValueError", "message": "OLD task error"}  # the old task failed
    core.holders["k"] = "tcp://w:1"
    del old
    core.release_dropped("k")
    assert not core.collision("k", ("ident", 2))
    fut, err = core.claim("k", KeyFuture)
    assert err is None and "k" not in core.errors and "k" not in core.holders
    assert fut.key == "k"


def test_a_loop_of_submit_and_result_sends_one_release_for_many_calls() -> None:
    """submit(...).result() in a loop drops each future right after its result: the releases wait
    for the shell's timer and go as one message, while every fresh graph update (keys made by the
    client) goes at once; an update that is not fresh (a given key, a Dask graph: its keys may be
    the dropped ones or their inputs, still held by the scheduler) sends the releases first."""
    core = ClientProtocol()
    for i in range(5):
        core.send({"op": "update-graph", "tasks": [[f"inc-{i}", "f", None, [], {}, 0, ""]], "wanted": [f"inc-{i}"]},
                  fresh=True)  # fmt: skip
        core.release_dropped(f"inc-{i}")
    assert [m["op"] for m in iter(core.next_message, None)] == ["update-graph"] * 5
    core.send({"op": "update-graph", "tasks": [["x", "f", None, [], {}, 0, ""]], "wanted": ["x"]})
    assert core.next_message() == {"op": "release", "keys": [f"inc-{i}" for i in range(5)]}
    assert core.next_message()["wanted"] == ["x"] and core.next_message() is None
    core.release_dropped("x")
    assert core.queue_dropped() is True  # the outbox was empty: the shell starts a drain
    assert core.next_message() == {"op": "release", "keys": ["x"]}


ops = st.lists(st.one_of(st.tuples(st.just("graph"), st.integers(0, 5)),
                         st.tuples(st.just("want"), st.sampled_from("abcdef")),
                         st.tuples(st.just("release"), st.sampled_from("abcdef")),
                         st.tuples(st.just("drop"), st.sampled_from("abcdef"))), max_size=40)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(ops, st.sets(st.sampled_from("abcdef")))
def test_the_outbox_keeps_the_order_messages_were_made_in(made: list[tuple[str, Any]], alive: set[str]) -> None:
    """Everything goes in the order it was made, except that the releases of dropped futures wait
    (until ``queue_dropped``, the shell's timer) while fresh graph updates go ahead; adjacent
    releases merge, and dropped keys with a live future are left out."""
    core = ClientProtocol()
    held = table(core, sorted(alive))
    for kind, arg in made:
        if kind == "graph":  # fresh: its keys were made by the client just now
            core.send({"op": "update-graph", "n": arg}, fresh=True)
        elif kind == "want":  # not fresh: a given key
            core.send({"op": "update-graph", "tasks": [[arg, "f", None, [], {}, 0, ""]], "wanted": [arg]})
        elif kind == "release":
            core.send({"op": "release", "keys": [arg]})
        else:
            core.release_dropped(arg)
    core.queue_dropped()  # the shell's timer
    sent = []
    while (msg := core.next_message()) is not None:
        sent.append(msg)
    # the model: the outbox as made, then merged as next_message merges it
    outbox: list[tuple[str, Any, bool]] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            outbox.append(("release", list(pending), True))
            pending.clear()

    for kind, arg in made:
        if kind == "drop":
            if arg not in pending:
                pending.append(arg)
        elif kind == "graph":
            outbox.append(("graph", arg, False))
        elif kind == "want":
            flush()
            outbox.append(("want", arg, False))
        else:
            flush()
            outbox.append(("release", [arg], False))
    flush()
    expected: list[dict[str, Any]] = []
    run: list[str] = []
    for kind, arg, auto in outbox + [("graph", -1, False)]:
        if kind == "release":
            run += [k for k in arg if not (auto and k in held)]
            continue
        if run:
            expected.append({"op": "release", "keys": run})
            run = []
        if kind == "want":
            expected.append({"op": "update-graph", "tasks": [[arg, "f", None, [], {}, 0, ""]], "wanted": [arg]})
        elif arg != -1:
            expected.append({"op": "update-graph", "n": arg})
    assert sent == expected


# ---- reordered and duplicated reports ------------------------------------------------------------------
outcomes = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3),
                           st.one_of(st.sampled_from(["tcp://w1:1", "tcp://w2:2"]),
                                     st.sampled_from(["KilledWorkerError", "ValueError"])),
                           min_size=1, max_size=12)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(outcomes, st.data())
def test_reordered_and_duplicated_reports_give_each_future_its_own_outcome(outcome: dict[str, str],
                                                                            data: st.DataObject) -> None:  # fmt: skip
    core = ClientProtocol()
    futs = table(core, list(outcome))
    items = []
    for k, o in outcome.items():
        item = [k, "memory", o] if o.startswith("tcp://") else [k, "erred", erred(o)]
        items += [item] * data.draw(st.integers(1, 3), label=f"copies of {k}")
    items = data.draw(st.permutations(items), label="order")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(items)), max_size=4), label="batches"))
    for lo, hi in zip([0, *cuts], [*cuts, len(items)], strict=True):
        apply(core.receive(report(*items[lo:hi])), futs)
    for k, o in outcome.items():
        f = futs[k]
        assert f.done()
        if o.startswith("tcp://"):
            assert f.result(0) == ("memory", o) and core.holders[k] == o and k not in core.errors
        else:
            assert o in type(f.exception(0)).__name__ or o in str(f.exception(0))
            assert k in core.errors and k not in core.holders


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=10), st.data())
def test_reports_of_keys_without_a_future_are_harmless(keys: list[str], data: st.DataObject) -> None:
    core = ClientProtocol()
    for k in keys:
        status = data.draw(st.sampled_from(["memory", "cancelled", "running", "lost"]))
        events = core.receive(report([k, status] if status != "memory" else [k, status, "tcp://w:1"]))
        assert events[-1] == Settled(k)
    assert len(core.futures) == 0


# ---- the fetch plan ----------------------------------------------------------------------------------
def test_a_fetch_reads_from_the_reported_holder_without_asking_who_has() -> None:
    core = ClientProtocol()
    held = table(core, ["a", "b"])
    core.receive(report(["a", "memory", "tcp://w1:1"], ["b", "memory", "tcp://w1:1"]))
    fetch = core.fetch(["a", "b"])
    by_addr, ask = fetch.plan()
    assert by_addr == {"tcp://w1:1": ["a", "b"]} and ask == []
    fetch.read("tcp://w1:1", ["a", "b"], ({"a": 1, "b": 2}, {}))
    fetch.end_round()
    assert fetch.remaining == [] and fetch.values == {"a": 1, "b": 2}
    assert len(held) == 2


def test_a_failed_read_asks_who_has_next_and_gives_up_after_the_limit() -> None:
    core = ClientProtocol()
    held = table(core, ["a"])
    core.receive(report(["a", "memory", "tcp://w1:1"]))
    fetch = core.fetch(["a"])
    by_addr, ask = fetch.plan()
    fetch.read("tcp://w1:1", ["a"], ConnectionLostError("reset"))
    fetch.end_round()
    assert fetch.remaining == ["a"] and "a" not in core.holders
    for i in range(1, FETCH_ATTEMPTS):
        by_addr, ask = fetch.plan()
        assert ask == ["a"] and by_addr == {}  # the holder is asked of the scheduler from now on
        fetch.named(by_addr, ask, {"a": ["tcp://w1:1"]})
        if i < FETCH_ATTEMPTS - 1:
            fetch.read("tcp://w1:1", ["a"], ConnectionLostError("reset"))
            fetch.end_round()
    with pytest.raises(TransferError, match=f"{FETCH_ATTEMPTS} times in a row"):
        fetch.read("tcp://w1:1", ["a"], ConnectionLostError("reset"))
    assert held["a"].key == "a"


def test_a_holder_that_is_gone_is_not_counted_as_a_failed_read() -> None:
    core = ClientProtocol()
    fetch = core.fetch(["a"])
    for _ in range(FETCH_ATTEMPTS + 2):
        by_addr, ask = fetch.plan()
        fetch.named(by_addr, ask, {"a": ["tcp://w1:1"]})
        fetch.read("tcp://w1:1", ["a"], ConnectionLostError("refused"), gone=True)
        fetch.end_round()
    assert fetch.remaining == ["a"]


def test_fetch_outcomes_that_are_final() -> None:
    core = ClientProtocol()
    fetch = core.fetch(["a", "b"])
    by_addr, ask = fetch.plan()
    with pytest.raises(TaskCancelledError, match="released"):
        fetch.named(by_addr, ask, {"a": None, "b": ["tcp://w:1"]})
    with pytest.raises(ResultTooLargeError):
        fetch.read("tcp://w:1", ["b"], ({}, {"b": "over the frame limit"}))
    with pytest.raises(SerializationError):
        fetch.read("tcp://w:1", ["b"], ({}, {"b": "cannot be unpickled here"}))
    with pytest.raises(TransferError, match="ZeroDivisionError"):
        fetch.read("tcp://w:1", ["b"], ZeroDivisionError("bug"))
    with pytest.raises(TransferError, match="ProtocolError"):  # a reply that makes no sense
        fetch.read("tcp://w:1", ["b"], ProtocolError("expected a data reply"))


def test_waiting_keys_that_can_never_come_raise() -> None:
    core = ClientProtocol()
    held = table(core, ["a", "b"])
    fetch = core.fetch(["a", "b"])
    fetch.plan()
    fetch.read("tcp://w:1", ["a", "b"], ({}, {}))  # the holder no longer has them: recomputing
    fetch.end_round()
    fetch.check_waiting()  # nothing final yet: wait for a report
    held["b"].cancel()
    with pytest.raises(KeyCancelled):  # the caller raises concurrent.futures.CancelledError
        fetch.check_waiting()
    core.receive(report(["a", "erred", erred("KilledWorkerError")]))
    key, info = fetch.check_waiting() or ("", {})  # failed: the caller builds its exception
    assert key == "a" and isinstance(make_exception(key, info), KilledWorkerError)


# ---- the wire records ------------------------------------------------------------------------------------
def test_task_specs_and_reports_round_trip_through_their_wire_form() -> None:
    plain = TaskSpec("k", "f1", None, ["d"], {"cpu": 1.0}, 2, "inc")
    placed = TaskSpec("k2", "f1", None, [], {}, 0, "inc", priority=3, workers=("w1",), loose=True)
    msg = UpdateGraph([plain, placed], ["k", "k2"], {"f1": b"..."}).encode()
    assert len(msg["tasks"][0]) == 7  # defaults of the placement fields are left out
    assert UpdateGraph.decode(msg) == UpdateGraph([plain, placed], ["k", "k2"], {"f1": b"..."})
    rep = ClientReport([ReportItem("a", "memory", "tcp://w:1"), ReportItem("b", "cancelled")])
    assert rep.encode() == report(["a", "memory", "tcp://w:1"], ["b", "cancelled"])
    with pytest.raises(ProtocolError):
        TaskSpec.decode(["k", "f1"])
