"""The pending table's rules (issue 29), pure: who gives way, and how long a newcomer may take."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tidepool.comm.admission import PendingTable


def table(limit: int = 4, per_source: int = 3) -> tuple[PendingTable, list[int]]:
    closed: list[int] = []
    return PendingTable(limit, per_source, 10.0, 2.0), closed


def test_the_oldest_entry_gives_way_when_the_table_is_full() -> None:
    t, closed = table(limit=3, per_source=3)
    for key, src in enumerate(["a", "b", "c", "d"]):
        assert t.add(key, src, lambda key=key: closed.append(key))
    assert closed == [0] and len(t) == 3 and t.evicted == 1


def test_one_source_cannot_push_out_others_only_its_own_oldest() -> None:
    t, closed = table(limit=10, per_source=2)
    t.add(0, "real", lambda: closed.append(0))
    for key in range(1, 6):
        t.add(key, "flood", lambda key=key: closed.append(key))
    assert closed == [1, 2, 3]  # the flood evicted only itself; the real peer stays
    assert len(t) == 3


def test_removed_entries_are_not_evicted_later() -> None:
    t, closed = table(limit=2, per_source=2)
    t.add(0, "a", lambda: closed.append(0))
    t.remove(0)  # authenticated
    t.add(1, "a", lambda: closed.append(1))
    t.add(2, "a", lambda: closed.append(2))
    assert closed == [] and len(t) == 2


def test_the_deadline_shrinks_when_the_table_is_half_full() -> None:
    t, _ = table(limit=4, per_source=4)
    t.add(0, "a", lambda: None)
    assert t.deadline() == 10.0
    t.add(1, "a", lambda: None)
    assert t.deadline() == 2.0


def test_a_table_that_admits_nothing_says_so() -> None:
    t, closed = table(limit=0)
    assert not t.add(0, "a", lambda: closed.append(0))
    assert len(t) == 0 and closed == []


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.sampled_from("abc")), max_size=200),
       st.integers(1, 8), st.integers(1, 8))  # fmt: skip
def test_limits_always_hold(ops: list[tuple[bool, int, str]], limit: int, per_source: int) -> None:
    t = PendingTable(limit, per_source, 10.0, 2.0)
    live: dict[int, str] = {}
    for add, key, src in ops:
        if add and key not in live:
            assert t.add(key, src, lambda key=key: live.pop(key))
            live[key] = src
        elif not add:
            t.remove(key)
            live.pop(key, None)
        assert len(t) == len(live) <= limit
        for s in "abc":
            assert sum(1 for v in live.values() if v == s) <= per_source


def test_idle_entries_give_way_before_entries_that_have_talked() -> None:
    t, closed = table(limit=3, per_source=3)
    t.add(0, "a", lambda: closed.append(0))
    t.promote(0)  # a real peer: sent its preamble, now authenticating
    t.add(1, "a", lambda: closed.append(1))
    t.add(2, "a", lambda: closed.append(2))
    t.add(3, "a", lambda: closed.append(3))  # the oldest idle one goes, not the older real peer
    t.add(4, "a", lambda: closed.append(4))
    assert closed == [1, 2]
    for key in (3, 4):
        t.promote(key)
    t.add(5, "a", lambda: closed.append(5))  # everyone has talked: the oldest of them goes
    assert closed == [1, 2, 0]


def test_an_entry_whose_first_bytes_wait_unread_counts_as_talking() -> None:
    t, closed = table(limit=2, per_source=2)
    t.add(0, "a", lambda: closed.append(0), spoke=lambda: True)  # its preamble arrived, unread
    t.add(1, "a", lambda: closed.append(1), spoke=lambda: False)
    t.add(2, "a", lambda: closed.append(2), spoke=lambda: False)
    assert closed == [1]
