"""Small values that come inline with their report (``comm/inline.py``), in the client's sans-IO
core: kept while a future of the key lives, taken by the fetch plan without a read, dropped with
the release, bounded by the cache size; reordered and duplicated reports leave each key its own
value."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.client import protocol
from tidepool.client.protocol import ClientProtocol, Finished, Settled
from tidepool.comm import serialize
from tidepool.comm.inline import INLINE_BYTES, small_pickle
from tidepool.comm.messages import ClientReport, ComputeTask, ReportItem
from tidepool.comm.serialize import Serialized


class KeyFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key


def table(core: ClientProtocol, keys: list[str]) -> dict[str, KeyFuture]:
    return {k: core.claim(k, KeyFuture)[0] for k in keys}


def report(*items: list[Any]) -> dict[str, Any]:
    return {"op": "report", "items": list(items)}


def test_an_inline_value_is_taken_by_the_fetch_without_a_read() -> None:
    core = ClientProtocol()
    held = table(core, ["a", "b"])
    events = core.receive(report(["a", "memory", "tcp://w1:1", serialize(41)], ["b", "memory", "tcp://w1:1"]))
    assert events == [Finished("a", "tcp://w1:1"), Settled("a"), Finished("b", "tcp://w1:1"), Settled("b")]
    fetch = core.fetch(["a", "b"])
    assert fetch.values == {"a": 41} and fetch.remaining == ["b"]  # only b is read from its holder
    assert fetch.plan() == ({"tcp://w1:1": ["b"]}, [])
    assert core.fetch(["a"]).remaining == []  # kept for a second result()/gather()
    assert len(held) == 2


def test_inline_values_go_with_the_release_and_an_error() -> None:
    core = ClientProtocol()
    held = table(core, ["a", "b"])
    core.receive(report(["a", "memory", "", serialize(1)], ["b", "memory", "", serialize(2)]))
    assert core.inline_bytes > 0
    core.send({"op": "release", "keys": ["a"]})
    assert core.next_message() == {"op": "release", "keys": ["a"]}
    assert set(core.inline) == {"b"}
    err = {"type": "ValueError", "message": "x", "origin": "b", "exception": None, "traceback": ""}
    core.receive(report(["b", "erred", err]))  # recomputed and failed: the old value is not its outcome
    assert core.inline == {} and core.inline_bytes == 0
    assert len(held) == 2


def test_a_report_after_the_future_is_gone_keeps_nothing() -> None:
    core = ClientProtocol()
    core.receive(report(["a", "memory", "tcp://w:1", serialize(1)]))
    assert core.inline == {} and core.inline_bytes == 0


def test_the_cache_is_bounded_and_the_rest_is_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    one = serialize(1).nbytes
    monkeypatch.setattr(protocol, "CLIENT_CACHE_BYTES", 2 * one)
    core = ClientProtocol()
    held = table(core, ["a", "b", "c"])
    core.receive(report(*[[k, "memory", "tcp://w:1", serialize(1)] for k in "abc"]))
    assert set(core.inline) == {"a", "b"} and core.inline_bytes == 2 * one
    assert core.fetch(["a", "b", "c"]).remaining == ["c"]
    assert len(held) == 3


def test_a_value_that_does_not_unpickle_here_is_read_from_the_holder() -> None:
    core = ClientProtocol()
    held = table(core, ["a"])
    core.receive(report(["a", "memory", "tcp://w:1", Serialized(b"not a pickle")]))
    fetch = core.fetch(["a"])
    assert fetch.remaining == ["a"] and fetch.values == {}  # the holder's reply says why it fails
    assert core.inline == {}
    assert len(held) == 1


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(), min_size=1), st.data())
def test_reordered_and_duplicated_reports_leave_each_key_its_own_value(values: dict[str, int],
                                                                        data: st.DataObject) -> None:  # fmt: skip
    core = ClientProtocol()
    held = table(core, list(values))
    items = []
    for k, v in values.items():
        with_value = [k, "memory", "tcp://w:1", serialize(v)]
        items += [with_value] * data.draw(st.integers(1, 3), label=f"copies of {k}")
        if data.draw(st.booleans(), label=f"a plain report of {k} too"):
            items.append([k, "memory", "tcp://w:1"])
    items = data.draw(st.permutations(items), label="order")
    for item in items:
        core.receive(report(item))
    fetch = core.fetch(list(values))
    assert fetch.values == values and fetch.remaining == []
    assert core.inline_bytes == sum(b.nbytes for b in core.inline.values())
    assert len(held) == len(values)


def test_only_small_pickles_without_buffers_ride_inline() -> None:
    assert small_pickle(5, 28) is not None
    assert small_pickle("x" * (INLINE_BYTES + 1), INLINE_BYTES + 50) is None  # pickled, too big
    assert small_pickle(b"x" * 10**6, 10**6) is None  # not even pickled
    assert small_pickle(lambda: 1, 100) is not None  # cloudpickle as for any value
    assert small_pickle(threading_lock(), 100) is None  # does not pickle: fetched, failing as usual


def threading_lock() -> Any:
    import threading

    return threading.Lock()


def test_the_wire_records_carry_the_inline_flag_and_value() -> None:
    t = ComputeTask("k", "f", None, inline=True)
    assert t.encode()["inline"] is True and ComputeTask.decode(t.encode()).inline
    assert "inline" not in ComputeTask("k", "f", None).encode()
    blob = serialize(3)
    assert ClientReport([ReportItem("a", "memory", None, blob)]).encode() == report(["a", "memory", "", blob])
    assert ReportItem("a", "memory", "tcp://w:1").encode() == ["a", "memory", "tcp://w:1"]
