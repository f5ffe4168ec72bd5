"""The scheduler's state store: round trips, compaction, and the stores it must refuse."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from tidepool.comm.serialize import serialize
from tidepool.errors import StateStoreError, StoreCorruptError, StoreTokenError, StoreVersionError
from tidepool.scheduler.store import FILE_NAME, Batch, StateStore, StoredTask, pack, unpack

TOKEN = "t" * 32


def _task(key: str, deps: list[str] = (), status: str = "p") -> StoredTask:  # type: ignore[assignment]
    return StoredTask(key, ["fid", list(deps), {}, 0, "g", 0, [], False], serialize((key, 1)), status)


def test_payloads_with_out_of_band_buffers_round_trip() -> None:
    import pickle

    big = pickle.PickleBuffer(bytearray(b"x" * 200_000))  # large enough to travel out of band
    ser = serialize({"a": big, "b": 3})
    assert ser.buffers, "the test needs an out-of-band buffer"
    back = unpack(pack(ser))
    assert back is not None
    value = back.load()
    assert bytes(value["a"]) == b"x" * 200_000 and value["b"] == 3


def test_a_batch_round_trips_and_forgotten_tasks_leave(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    error = {"type": "ValueError", "message": "boom", "traceback": "tb", "origin": "b",
             "exception": serialize(ValueError("boom"))}  # fmt: skip
    s.write(Batch(new_tasks=[_task("a"), _task("b", ["a"]), _task("c", ["b"])], functions={"fid": serialize(len)},
                  wants_added=[("client-1", "c"), ("client-1", "b")], workers_joined=[("w1", "tcp://h:1")]))  # fmt: skip
    s.write(Batch(outcomes={"a": ("m", ["w1"], None), "b": ("e", [], error)}, forgotten=["c"],
                  wants_removed=[("client-1", "c")], instances={"i-1": {"provider_id": "job 7"}}))  # fmt: skip
    s.set_address("tcp://127.0.0.1:4242")
    s.close()
    snap = StateStore(tmp_path, TOKEN).load()
    assert [t.key for t in snap.tasks] == ["a", "b"]
    a, b = snap.tasks
    assert (a.status, a.holders, b.spec[1]) == ("m", ["w1"], ["a"])
    assert a.payload is not None and a.payload.load() == ("a", 1)
    assert b.status == "e" and b.error is not None and b.error["message"] == "boom"
    assert isinstance(b.error["exception"].load(), ValueError)
    assert snap.wants == {"client-1": ["b"]}
    assert snap.workers == {"w1": "tcp://h:1"}
    assert snap.instances == {"i-1": {"provider_id": "job 7"}}
    assert snap.functions["fid"].load() is len
    assert snap.address == "tcp://127.0.0.1:4242"


def test_without_a_token_the_store_s_token_is_used(tmp_path: Path) -> None:
    StateStore(tmp_path, TOKEN).close()
    assert StateStore(tmp_path, None).token == TOKEN
    with pytest.raises(StateStoreError, match="no token was given"):
        StateStore(tmp_path / "new", None)


def test_a_store_of_another_cluster_is_refused(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(new_tasks=[_task("a")]))
    s.close()
    with pytest.raises(StoreTokenError, match="another token"):
        StateStore(tmp_path, "u" * 32)


def test_a_store_of_another_layout_version_is_refused(tmp_path: Path) -> None:
    StateStore(tmp_path, TOKEN).close()
    db = sqlite3.connect(tmp_path / FILE_NAME)
    db.execute("UPDATE meta SET v = '999' WHERE k = 'version'")
    db.commit()
    db.close()
    with pytest.raises(StoreVersionError, match="layout version '999'"):
        StateStore(tmp_path, TOKEN)


def test_a_corrupt_store_is_refused_whole(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(new_tasks=[_task(f"k{i}") for i in range(2000)]))
    s.compact()
    s.close()
    path = tmp_path / FILE_NAME
    raw = bytearray(path.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 4096):  # scribble over pages in the middle
        raw[i] = 0xA5
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match="corrupt"):
        StateStore(tmp_path, TOKEN).load()


def test_an_unreadable_record_refuses_the_whole_store(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(new_tasks=[_task("a"), _task("b")]))
    s.close()
    db = sqlite3.connect(tmp_path / FILE_NAME)
    db.execute("UPDATE tasks SET spec = 'not json' WHERE key = 'b'")
    db.commit()
    db.close()
    with pytest.raises(StoreCorruptError, match="nothing was loaded"):
        StateStore(tmp_path, TOKEN).load()


def test_a_torn_tail_loses_only_the_last_tick(tmp_path: Path) -> None:
    """A copy taken while the scheduler runs (what a kill -9 leaves), its log cut inside the last
    transaction: every earlier tick is there, the torn one is dropped whole."""
    live = tmp_path / "live"
    s = StateStore(live, TOKEN)
    s.write(Batch(new_tasks=[_task(f"first{i}") for i in range(50)]))
    s.write(Batch(outcomes={f"first{i}": ("m", ["w1"], None) for i in range(50)}))
    wal = live / (FILE_NAME + "-wal")
    before_last = wal.stat().st_size
    s.write(Batch(new_tasks=[_task(f"last{i}") for i in range(500)]))
    assert wal.stat().st_size > before_last + 8192, "the last tick should span several log pages"
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for p in live.iterdir():
        shutil.copy(p, crashed / p.name)
    s.close()
    torn = crashed / (FILE_NAME + "-wal")
    data = torn.read_bytes()
    torn.write_bytes(data[: before_last + (len(data) - before_last) // 2])  # killed mid-write
    snap = StateStore(crashed, TOKEN).load()
    keys = [t.key for t in snap.tasks]
    assert keys == [f"first{i}" for i in range(50)]
    assert all(t.status == "m" for t in snap.tasks)


def test_writes_on_the_writer_thread_arrive_in_order(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    for i in range(20):
        s.submit(Batch(new_tasks=[_task(f"k{i}")], forgotten=[f"k{i - 1}"] if i else []))
    s.drain()
    assert [t.key for t in s.load().tasks] == ["k19"]
    assert s.written == 20
    s.close()


def test_setup_hooks_round_trip_in_registration_order(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(setups={"first": serialize("spec-1"), "second": serialize("spec-2")}))
    s.write(Batch(setups={"first": serialize("spec-1b")}))  # registered again: replaced, moved last
    s.close()
    snap = StateStore(tmp_path, TOKEN).load()
    assert [(n, blob.load()) for n, blob in snap.setups] == [("second", "spec-2"), ("first", "spec-1b")]


def test_a_store_written_before_setups_were_kept_opens_without_any(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(new_tasks=[_task("a")]))
    s._db.execute("DROP TABLE setups")  # the layout as the first version wrote it
    s.close()
    snap = StateStore(tmp_path, TOKEN).load()
    assert [t.key for t in snap.tasks] == ["a"] and snap.setups == []


def test_the_cost_meter_round_trips_and_the_last_one_wins(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    assert s.load().cost is None
    s.write(Batch(cost={"spent": 1.5, "open": [["worker", "w1", 2.0]], "at": 10.0, "wall": 100.0}))
    s.write(Batch(cost={"spent": 2.5, "open": [], "at": 40.0, "wall": 130.0}))
    assert Batch(cost={"spent": 0.0, "open": []})  # a batch with only the meter is written
    s.close()
    assert StateStore(tmp_path, TOKEN).load().cost == {"spent": 2.5, "open": [], "at": 40.0, "wall": 130.0}


def test_an_unreadable_cost_meter_refuses_the_store(tmp_path: Path) -> None:
    s = StateStore(tmp_path, TOKEN)
    s.write(Batch(new_tasks=[_task("a")]))
    s._db.execute("INSERT INTO meta VALUES ('cost', '[1, 2]')")
    s.close()
    with pytest.raises(StoreCorruptError, match="corrupt"):
        StateStore(tmp_path, TOKEN).load()


def test_a_second_scheduler_on_the_same_state_directory_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    # found by a bug hunt: a second scheduler on a live --state-dir loaded the store and released the
    # first one's clients as if they had not come back
    from tidepool.errors import StoreInUseError

    first = StateStore(tmp_path / "sd", "tok")
    with pytest.raises(StoreInUseError, match=f"in use by another scheduler \\(pid {os.getpid()}\\)"):
        StateStore(tmp_path / "sd", "tok")
    first.close()
    StateStore(tmp_path / "sd", "tok").close()  # free again


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    # the second review: any flock error said "in use by another scheduler" (NFS without lockd,
    # Lustre mounted noflock), and the scheduler could never start there
    import errno
    import fcntl
    import logging

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, "tidepool.store"):
        StateStore(tmp_path / "sd", "tok").close()
    assert "one scheduler at a time is not enforced" in caplog.text
