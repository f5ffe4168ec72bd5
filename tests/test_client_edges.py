"""What a Dask user hit in a day (issue 33): receive buffers, read-loop failures, oversized
arguments, keyword typos, calls after close, timeouts that say why, the stall log, and Dask's names.

Real processes and sockets where the failure lives there (a fake scheduler on real TCP for the
client's read loop, a subprocess with a small frame limit); the pure parts (frame decoder, stall
log) are driven directly.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tidepool
from tidepool.client import FETCH_ATTEMPTS
from tidepool.comm import Connection, listen
from tidepool.comm.frames import DEFAULT_MAX_FRAME, GROW_FIRST, FrameDecoder, encode
from tidepool.comm.serialize import serialize
from tidepool.errors import ConfigError, ConnectionLostError, SchedulerError, TransferError
from tidepool.loop import LoopThread

SRC = str(Path(tidepool.__file__).resolve().parents[1])  # the tidepool under test, for subprocesses


def inc(x: int) -> int:
    return x + 1


# ---- bug 2: a receive buffer still exported is never resized --------------------------------------
def test_a_receive_buffer_still_exported_is_moved_never_resized_and_the_frame_arrives_whole() -> None:
    """Every view get_buffer handed out stays alive (as a transport frame kept by a traceback
    would keep it): growing the large part, or the staging buffer, must not resize them."""
    payload = np.arange(3 * GROW_FIRST, dtype=np.uint8)  # grows twice past GROW_FIRST
    data = b"".join(bytes(p) for p in encode({"op": "x", "v": serialize(payload), "pad": "p" * 40_000}))
    out: list[Any] = []
    dec = FrameDecoder(out.append, DEFAULT_MAX_FRAME)
    dec.allow_pickles = True
    held: list[memoryview] = []
    view = memoryview(data)
    while view.nbytes:
        buf = dec.get_buffer(-1)
        held.append(buf)
        n = min(buf.nbytes, view.nbytes, 1_000_003)  # odd chunks, like a socket's
        buf[:n] = view[:n]
        view = view[n:]
        dec.buffer_updated(n)
    assert len(out) == 1 and out[0]["pad"] == "p" * 40_000
    got = out[0]["v"].load()
    assert got.dtype == np.uint8 and np.array_equal(got, payload)


# ---- bug 2: any error in the client's read loop fails the futures --------------------------------
class FakeScheduler:
    """A scheduler on real TCP.  ``holder=None``: it answers every graph update with a report the
    client cannot handle (an item without its status), the injected read-loop failure.  Otherwise
    it reports every task done and names a fake worker as the holder, whose data server either
    answers nonsense (``"nonsense"``), drops every connection once asked (``"drops"``), or never
    answers at all (``"mute"``: a frozen worker)."""

    def __init__(self, holder: str | None = None) -> None:
        self.loop = LoopThread("fake-scheduler")
        self.token = "edges-test-token"
        self.holder = holder
        self.listener = self.loop.run(listen("tcp://127.0.0.1:0", self.handler, self.token))
        self.worker = self.loop.run(listen("tcp://127.0.0.1:0", self.data_server, self.token))
        self.address = self.listener.address
        self.reads = 0

    async def handler(self, conn: Connection) -> None:
        await conn.send({"op": "welcome", "client": "client-1"})
        while True:
            msg = await conn.recv()
            if msg.get("op") == "update-graph":
                status = [] if self.holder is None else ["memory"]
                await conn.send({"op": "report", "items": [[k, *status] for k in msg["wanted"]]})
            elif msg.get("op") == "who-has":
                result = {k: [self.worker.address] for k in msg["keys"]}
                await conn.send({"op": "reply", "id": msg["id"], "result": result})

    async def data_server(self, conn: Connection) -> None:
        while True:
            await conn.recv()
            self.reads += 1
            if self.holder == "mute":
                continue
            if self.holder == "drops":
                conn.close()
                return
            await conn.send({"op": "nonsense"})

    def close(self) -> None:
        self.loop.run(self.listener.close())
        self.loop.run(self.worker.close())
        self.loop.stop()


def test_an_error_in_the_client_read_loop_fails_pending_futures_and_later_calls() -> None:
    fake = FakeScheduler()
    try:
        client = tidepool.Client(fake.address, token=fake.token, timeout=10)
        try:
            fut = client.submit(inc, 1)
            exc = fut.exception(timeout=30)  # before the fix: TimeoutError (the future waited forever)
            assert isinstance(exc, ConnectionLostError), exc
            assert "IndexError" in str(exc) and "our side" in str(exc)
            with pytest.raises(ConnectionLostError):
                client.submit(inc, 2)
        finally:
            client.close()
    finally:
        fake.close()


@pytest.mark.parametrize("holder", ["nonsense", "drops", "mute"])
def test_a_value_that_cannot_be_read_from_its_holder_fails_result_instead_of_retrying_forever(
        holder: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``mute``, found by a bug hunt: a gather from a frozen worker waited for ever (a client's read
    had no silence bound, unlike a worker's fetch)."""
    monkeypatch.setenv("TIDEPOOL_FETCH_TIMEOUT", "0.1")
    fake = FakeScheduler(holder)
    try:
        with tidepool.Client(fake.address, token=fake.token, timeout=10) as client:
            fut = client.submit(inc, 1)
            with pytest.raises(TransferError, match=fake.worker.address):
                fut.result(timeout=60)  # before the fix: TimeoutError (asked again and again)
            assert fake.reads == (1 if holder == "nonsense" else FETCH_ATTEMPTS)
    finally:
        fake.close()


# ---- bug 3: an oversized argument fails its submit alone ----------------------------------------
OVERSIZED = textwrap.dedent(
    """
    import numpy as np, tidepool
    from tidepool.errors import SerializationError
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        try:
            client.submit(len, np.ones(3 * 2**20, dtype="u1"))
        except SerializationError as exc:
            print("REFUSED", exc)
        print("AFTER", client.submit(len, np.ones(1000, dtype="u1")).result(timeout=60))
    """
)


def test_an_argument_over_the_frame_limit_fails_that_submit_alone_with_size_and_limit() -> None:
    env = {**os.environ, "TIDEPOOL_MAX_FRAME_BYTES": str(2 * 2**20),
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", OVERSIZED], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED")]
    assert refused, proc.stdout + proc.stderr[-3000:]
    assert "are 3,145,8" in refused[0] and "2,097,152-byte frame limit" in refused[0], refused[0]
    assert "AFTER 1000" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---- sharp edges -----------------------------------------------------------------------------------
def test_a_keyword_typo_names_the_public_call_and_the_close_name() -> None:
    with pytest.raises(ConfigError, match=r"LocalCluster\(\) got an unexpected keyword argument 'n_worker' "
                                          r"\(did you mean 'n_workers'\?\)"):  # fmt: skip
        tidepool.LocalCluster(n_worker=1)  # type: ignore[call-arg]
    with tidepool.LocalCluster(n_workers=0) as cluster:
        with pytest.raises(ConfigError, match=r"adapt\(\) got an unexpected keyword argument 'maxium' "
                                              r"\(did you mean 'maximum'\?\)"):  # fmt: skip
            cluster.adapt(maxium=4)
        assert cluster.autoscaler is None  # nothing started


@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=1, no_worker_timeout=None, dashboard=True) as c:
        yield c


def test_calls_after_close_give_a_clean_error_and_no_warning(cluster: tidepool.LocalCluster) -> None:
    client = tidepool.Client(cluster)
    client.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (client.scheduler_info, client.eta, client.nthreads, lambda: client.retire_workers([]),
                     lambda: client.submit(inc, 1), lambda: client.register_setup(modules=[])):  # fmt: skip
            with pytest.raises(SchedulerError, match="this client is closed"):
                call()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_result_timeout_says_which_key_its_state_and_why(cluster: tidepool.LocalCluster) -> None:
    with tidepool.Client(cluster) as client:
        fut = client.submit(inc, 1, resources={"gpu": 1})
        with pytest.raises(TimeoutError) as info:
            fut.result(timeout=0.5)
        msg = str(info.value)
        assert fut.key in msg and "no-worker" in msg and "no worker offers 'gpu'" in msg, msg
        with pytest.raises(TimeoutError, match="no worker offers 'gpu'"):
            client.gather([fut, client.submit(inc, 2)], timeout=0.5)
        fut.cancel()


def test_dask_names_dashboard_link_nthreads(cluster: tidepool.LocalCluster) -> None:
    with tidepool.Client(cluster) as client:
        assert client.dashboard_link == cluster.dashboard_link and client.dashboard_link.startswith("http")
        workers = client.scheduler_info()["workers"]
        assert client.nthreads() == {w["address"]: 1 for w in workers} and len(workers) == 1


def test_an_asynchronous_client_is_awaited_as_in_dask(cluster: tidepool.LocalCluster) -> None:
    async def main() -> tuple[int, list[int], int, bool]:
        async with tidepool.Client(cluster, asynchronous=True) as client:
            fut = client.submit(inc, 1)
            one = await fut
            both = await client.gather([fut, client.submit(inc, 2)])
            info = await client.scheduler_info()
        return one, both, len(info["workers"]), client.closed

    assert asyncio.run(main()) == (2, [2, 3], 1, True)


def clients_in_a_task() -> tuple[bool, str]:
    first = tidepool.default_client()  # before any get_client(): the worker's client
    return first is tidepool.get_client(), first.address


def test_get_client_in_a_task_and_default_client_points_to_it(cluster: tidepool.LocalCluster) -> None:
    with tidepool.Client(cluster) as client:
        same, address = client.submit(clients_in_a_task).result(timeout=60)
    assert same and address == cluster.address


def test_a_module_only_the_client_has_fails_naming_register_setup(cluster: tidepool.LocalCluster,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    (tmp_path / "edges_only_here.py").write_text("def twice(x):\n    return 2 * x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import edges_only_here  # type: ignore[import-not-found]

        with tidepool.Client(cluster) as client:
            with pytest.raises(ModuleNotFoundError, match=r"register_setup\(modules=\['edges_only_here'\]\)"):
                client.submit(edges_only_here.twice, 2).result(timeout=60)
            client.register_setup(modules=["edges_only_here"])  # what the message says works
            assert client.submit(edges_only_here.twice, 2).result(timeout=60) == 4
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("edges_only_here", None)


def test_stalls_are_summed_at_info_once_per_period_and_warned_near_the_heartbeat_timeout() -> None:
    from tidepool.scheduler.stalls import STALL_LOG_PERIOD, StallLog

    log = StallLog(heartbeat_timeout=300.0)
    said = [log.note(1.0, t) for t in (0.0, 10.0, 20.0)]
    assert said[0] is not None and said[0][0] == logging.INFO and said[1:] == [None, None]
    summary = log.note(2.5, STALL_LOG_PERIOD + 1)
    assert summary is not None and summary[0] == logging.INFO
    assert "3 time(s) for 4.5s" in summary[1] and "longest 2.5s" in summary[1]
    warn = log.note(200.0, STALL_LOG_PERIOD + 2)  # 2/3 of the heartbeat timeout: could matter
    assert warn is not None and warn[0] == logging.WARNING and "67% of the heartbeat timeout" in warn[1]


# ---- a map sent in pieces: an error in a later piece means nothing was sent -----------------------
@pytest.mark.parametrize("fault", ["key-taken", "key-twice", "unpicklable"])
def test_a_map_error_in_a_later_chunk_sends_nothing(cluster: tidepool.LocalCluster, fault: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``map`` sends one graph update per ``MAP_CHUNK`` tasks; a fault in the second piece (a key a
    different live task holds, a key given twice in the map to different calls, an argument that
    cannot be pickled) must fail before the first piece is sent, so the caller has no half-submitted
    map whose futures it never got."""
    from tidepool.client import api
    from tidepool.errors import KeyCollisionError
    from tidepool.scheduler import events as ev

    monkeypatch.setattr(api, "MAP_CHUNK", 3)
    seen: list[str] = []  # every task key that reached the scheduler in a graph update

    def observe(events: list[Any], cmds: list[Any]) -> None:
        seen.extend(t.key for e in events if isinstance(e, ev.UpdateGraph) for t in e.tasks)

    cluster.run(lambda s: s.subscribe(observe))
    try:
        with tidepool.Client(cluster) as client:
            keys = [f"{fault}-{i}" for i in range(6)]  # pieces: keys 0-2, then 3-5
            args: list[Any] = list(range(6))
            expected: tuple[type[BaseException], str]
            if fault == "key-taken":
                taken = client.submit(inc, 100, key=keys[4])
                assert taken.result(timeout=60) == 101
                expected = (KeyCollisionError, rf"{keys[4]!r} is already used by a different task.*own key")
            elif fault == "key-twice":
                keys[4] = keys[0]
                expected = (KeyCollisionError, rf"{keys[0]!r} .*different task.*own key")
            else:
                import threading

                args[4] = threading.Lock()
                expected = (tidepool.UnpicklableError, rf"arguments of task {keys[4]!r} cannot be pickled.*lock")
            with pytest.raises(expected[0], match=expected[1]) as caught:
                client.map(inc, args, key=keys)
            assert client.submit(inc, 1).result(timeout=60) == 2  # every earlier message has arrived
            assert not set(seen) & set(keys[:4]), seen  # before the fix: the first piece was sent
            assert not set(keys[:4]) & cluster.run(lambda s: set(s.state.tasks))
            assert "nothing of this map was submitted" in str(caught.value) or fault == "unpicklable"
            assert isinstance(caught.value, TypeError) or fault != "unpicklable"  # what Dask raises here
            futs = client.map(inc, range(6), key=[f"{fault}-ok-{i}" for i in range(6)])  # still usable
            assert client.gather(futs, timeout=60) == [1, 2, 3, 4, 5, 6]
    finally:
        cluster.run(lambda s: s.observers.remove(observe))


def test_an_unpicklable_argument_or_function_fails_the_submit_naming_what_and_what_to_do(
        cluster: tidepool.LocalCluster) -> None:  # fmt: skip
    """Before: the pickler's bare ``TypeError: cannot pickle '_thread.lock' object``, naming neither
    the task nor which part of the call, nor what to do."""
    import threading

    lock = threading.Lock()
    with tidepool.Client(cluster) as client:
        with pytest.raises(tidepool.UnpicklableError, match=r"arguments of task 'arg-1' cannot be pickled "
                           r"\(TypeError: .*lock.*nothing of this call was sent.*inside the task") as arg:
            client.submit(inc, lock, key="arg-1")
        assert isinstance(arg.value, TypeError) and arg.value.key == "arg-1"
        assert isinstance(arg.value.__cause__, TypeError)  # the pickler's own error stays attached

        def holds_lock() -> bool:
            return lock.locked()

        with pytest.raises(tidepool.SerializationError, match=r"function 'holds_lock' of task 'fn-1' cannot"):
            client.submit(holds_lock, key="fn-1")
        with pytest.raises(tidepool.UnpicklableError, match="arguments"):
            inc_later = tidepool.task(inc)
            inc_later({"deep": [lock]}).compute()
        assert client.submit(inc, 1).result(timeout=60) == 2  # nothing half-sent: the client is usable
        assert not {"arg-1", "fn-1"} & cluster.run(lambda s: set(s.state.tasks))
        deep: list[object] = []
        for _ in range(5000):  # nested past the pickler's recursion limit: a different advice
            deep = [deep]
        with pytest.raises(tidepool.UnpicklableError, match="nested too deeply.*flatten"):
            client.submit(len, deep)


def boom(x: int) -> int:
    raise ValueError(x)


@pytest.mark.parametrize("how", ["result", "gather", "gather_async"])
def test_a_dropped_failed_future_frees_its_key_at_once_for_another_task(cluster: tidepool.LocalCluster,
                                                                        how: str) -> None:  # fmt: skip
    """Found by a review: raising a failed future's exception (``result()``, ``gather``) left a
    cycle (future -> exception -> traceback -> frame -> future), so the dropped future lived until
    the cyclic collector ran and its explicit key could not be given to another task
    (KeyCollisionError "still alive")."""
    with tidepool.Client(cluster) as client:
        gc.collect()
        gc.disable()  # what a program between two collections sees
        try:
            for i in range(3):
                old = client.submit(boom, i, key=f"{how}-{i}")
                with pytest.raises(ValueError):
                    if how == "result":
                        old.result(timeout=60)
                    elif how == "gather":
                        client.gather([old], timeout=60)
                    else:
                        asyncio.run(client.gather_async([old]))
                del old
                assert client.submit(inc, i, key=f"{how}-{i}").result(timeout=60) == i + 1
        finally:
            gc.enable()


def test_generated_keys_are_unique_in_a_process_and_differ_in_a_forked_child() -> None:
    from tidepool.graph.delayed import make_key

    keys = [make_key(len) for _ in range(10_000)]
    assert len(set(keys)) == len(keys) and all(k.startswith("len-") and len(k) == 24 for k in keys)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next key: a fork must not replay the parent's
        os.write(w, make_key(len).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 100).decode()
    os.waitpid(pid, 0)
    parent = make_key(len)
    assert child != parent and child[4:16] != parent[4:16], (child, parent)


def test_a_map_key_prefix_is_checked_like_explicit_keys(cluster: tidepool.LocalCluster) -> None:
    """``map(..., key="job")`` names its tasks ``job-0``, ``job-1``, ...: explicit keys.  A second map
    (or a submit) under those keys with other arguments must be refused at the call, as for a list
    of keys; it was sent, and the client handed back the first map's futures (their values, not its
    own) while the scheduler's collision report failed those futures if they were still pending."""
    from tidepool.errors import KeyCollisionError

    with tidepool.Client(cluster) as client:
        first = client.map(inc, [1, 2], key="prefix-job")
        # the message speaks of the prefix the user gave, not of one task's key (a bug hunt was told
        # to "give this task its own key")
        with pytest.raises(KeyCollisionError, match=r"map\(key='prefix-job'\) names its tasks prefix-job-0 to "
                           r"prefix-job-1, and a different task that is still alive holds 'prefix-job-0'.*"
                           "give this map another prefix"):  # fmt: skip
            client.map(inc, [10, 20], key="prefix-job")
        with pytest.raises(KeyCollisionError, match="'prefix-job-1' is already used by a different task"):
            client.submit(inc, 50, key="prefix-job-1")
        again = client.map(inc, [1, 2], key="prefix-job")  # the same tasks: they share the keys
        assert client.gather(first, timeout=60) == client.gather(again, timeout=60) == [2, 3]


def test_an_asynchronous_client_used_before_it_is_awaited_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Found by a bug hunt: ``Client(..., asynchronous=True).submit(...)`` before ``await`` raised
    ``AttributeError: 'ClientConnection' object has no attribute '_conn'``; and then the refused
    submit's future, dropped, logged that AttributeError from the loop (a second hunt)."""
    import socket

    silent = socket.socket()  # takes connections, never answers the handshake: the client stays connecting
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        client = tidepool.Client(f"tcp://127.0.0.1:{silent.getsockname()[1]}", token="0" * 64, asynchronous=True,
                                 timeout=2.0)  # fmt: skip
        with caplog.at_level(logging.ERROR):
            with pytest.raises(SchedulerError, match="still connecting: await it first"):
                client.submit(inc, 1)
            gc.collect()  # the refused submit's future, if one was made, is dropped: its release drains
            for _ in range(50):  # the client's loop runs the drain meanwhile
                time.sleep(0.01)
            client.close()
        assert not [r for r in caplog.records if "AttributeError" in r.getMessage() + str(r.exc_info)], \
            [r.getMessage() for r in caplog.records]  # fmt: skip
    finally:
        silent.close()


class _SlowToPickle:
    """A value whose pickling takes ``seconds`` (a holder builds the whole reply before sending)."""

    def __init__(self, seconds: float, pad: bytes = b"") -> None:
        self.seconds = seconds
        self.pad = pad or b"p" * 100_000  # too large to ride inline: read from the holder

    def __reduce__(self) -> Any:
        import time

        time.sleep(self.seconds)
        return (_SlowToPickle, (0.0, self.pad))


def _make_slow(seconds: float) -> _SlowToPickle:
    return _SlowToPickle(seconds)


def test_a_value_slow_to_pickle_is_not_taken_for_a_silent_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: once the client's read from a holder had a silence bound equal to a
    worker's fetch timeout, a value whose pickling took longer could never be gathered (the read
    was given up and asked again, ten times).  The client waits four fetch timeouts."""
    monkeypatch.setenv("TIDEPOOL_FETCH_TIMEOUT", "1")
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(_make_slow, 2.0)
        got = fut.result(timeout=60)
    assert isinstance(got, _SlowToPickle)


def _plus_one(x: int) -> int:
    return x + 1


def test_a_map_racing_close_in_another_thread_leaves_no_future_waiting_for_ever() -> None:
    # found by a concurrency hunt: close() failed the futures it found, but a map still creating
    # its futures in another thread returned 99,557 of 100,000 that never finished
    import threading

    with tidepool.LocalCluster(n_workers=1) as cluster:
        client = tidepool.Client(cluster)
        box: dict[str, Any] = {}

        def mapper() -> None:
            try:
                box["futs"] = client.map(_plus_one, range(20_000))
            except Exception as exc:  # noqa: BLE001 - refusing is an outcome too
                box["err"] = exc

        th = threading.Thread(target=mapper)
        th.start()
        deadline = time.monotonic() + 30
        while not client._connection.core.futures and time.monotonic() < deadline:
            time.sleep(0.0005)  # map is creating its futures: close now
        client.close()
        th.join(60)
        assert not th.is_alive()
        futs = box.get("futs", [])
        for f in futs:  # every one is done: a value, or cancelled by the close
            assert f.done() or isinstance(f.exception(timeout=10), Exception)


def _big(n: int, i: int) -> bytes:
    return bytes([i]) * n


def _gather_while_another_thread_cancels(read: Any) -> list[Any]:
    """Six rounds: three threads each ``read(client, futures)`` six finished futures while the main
    thread cancels two of them; returns every reader's outcome (what ``read`` returned, or the name
    of what it raised)."""
    import threading

    outcomes: list[Any] = []
    with tidepool.LocalCluster(n_workers=2, slots=2) as cluster, tidepool.Client(cluster) as client:
        for _ in range(6):
            fs = client.map(_big, [2_000_000] * 6, range(6))
            tidepool.wait(fs)

            def reader(futs: list[Any] = fs) -> None:
                try:
                    outcomes.append(read(client, futs))
                except BaseException as exc:  # noqa: BLE001 - what the bugs raised
                    outcomes.append(f"{type(exc).__module__}.{type(exc).__name__}")

            threads = [threading.Thread(target=reader) for _ in range(3)]
            for t in threads:
                t.start()
            client.cancel(fs[2:4])
            for t in threads:
                t.join(60)
            del fs
    return outcomes


def test_gathering_futures_another_thread_cancels_raises_the_executor_cancellation() -> None:
    # found by a concurrency hunt: the cancellation raised on the client's loop crossed into the
    # reader as asyncio.CancelledError, a BaseException that `except Exception` and `except
    # concurrent.futures.CancelledError` both missed (it killed the reader threads)
    import concurrent.futures

    def read(client: tidepool.Client, futs: list[Any]) -> str:
        try:
            client.gather(futs, timeout=30)
            return "values"
        except concurrent.futures.CancelledError:
            return "cancelled"

    outcomes = _gather_while_another_thread_cancels(read)
    assert outcomes and set(outcomes) <= {"values", "cancelled"}, outcomes


def test_gather_skip_leaves_out_futures_another_thread_cancels_during_the_read() -> None:
    # a review: errors="skip" raised CancelledError for the whole batch when another thread
    # cancelled one of its futures while the values were read
    outcomes = _gather_while_another_thread_cancels(
        lambda client, futs: len(client.gather(futs, errors="skip", timeout=30)))
    assert outcomes and set(outcomes) <= {4, 6}, outcomes
