"""``TIDEPOOL_LOOP`` picks the event loop tidepool runs on (``tidepool/loop.py``): uvloop when it is
installed (``tidepool[fast]``), the standard loop when asked for or when uvloop is missing."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from typing import Any

import pytest

from tidepool import loop as tploop
from tidepool.errors import TidepoolError
from tidepool.loop import LOOP_ENV, LoopThread, loop_kind, new_event_loop


def kind_of(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def test_asyncio_forces_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOP_ENV, "asyncio")
    assert loop_kind() == "asyncio"
    lt = LoopThread("loop-choice")
    try:
        assert kind_of(lt.loop) == "asyncio"
    finally:
        lt.stop()


def test_unset_picks_uvloop_when_installed_and_the_standard_loop_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOOP_ENV, raising=False)
    installed = importlib.util.find_spec("uvloop") is not None
    loop = new_event_loop()
    try:
        assert kind_of(loop) == ("uvloop" if installed else "asyncio") == loop_kind()
    finally:
        loop.close()
    monkeypatch.setattr(tploop.importlib.util, "find_spec", lambda name: None)  # as if not installed
    assert loop_kind() == "asyncio"
    monkeypatch.setenv(LOOP_ENV, "uvloop")
    with pytest.raises(TidepoolError, match=r"tidepool\[fast\]"):
        loop_kind()


def test_uvloop_asked_for_runs_a_client_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    import tidepool

    monkeypatch.setenv(LOOP_ENV, "uvloop")  # the scheduler's thread and the spawned workers too
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        assert kind_of(client._connection.loop.loop) == "uvloop"
        assert client.submit(abs, -3).result(timeout=60) == 3


def test_an_unknown_loop_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOP_ENV, "trio")
    with pytest.raises(TidepoolError, match="asyncio, uvloop or auto"):
        new_event_loop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix socket names are Linux's")
def test_uvloop_connects_to_an_abstract_unix_socket() -> None:
    """A LocalCluster's scheduler listens on ``unix://@name``; uvloop's own unix connect refused such
    a name (EINVAL), so with ``tidepool[fast]`` no worker of a LocalCluster could register."""
    uvloop = pytest.importorskip("uvloop")
    from tidepool.comm import connect, listen, unix

    async def main() -> tuple[list[Any], Any]:
        got: list[Any] = []

        async def handler(conn: Any) -> None:
            got.append(await conn.recv())
            await conn.send({"op": "pong"})

        path = unix.private_socket_path(abstract=True)
        assert path is not None and path.startswith("@")
        listener = await listen(f"unix://{path}", handler, "secret")
        try:
            conn = await connect(listener.address, "secret", timeout=5)
            await conn.send({"op": "ping"})
            reply = await conn.recv()
            conn.close()
        finally:
            await listener.close()
        return got, reply

    loop = uvloop.new_event_loop()
    try:
        got, reply = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [{"op": "ping"}] and reply == {"op": "pong"}


def test_a_call_interrupted_in_its_thread_stops_its_work_on_the_loop() -> None:
    # found by a concurrency hunt: Ctrl-C during a gather left its read going on the loop (the
    # next gather took three times as long); only a timeout cancelled the loop's side
    import asyncio
    import os
    import signal
    import threading

    from tidepool.loop import LoopThread

    lt = LoopThread("tidepool-test-loop")
    stopped = threading.Event()

    async def long_read() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.set()
            raise

    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # a real Ctrl-C: the wait is woken
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            lt.run(long_read(), interruptible=True)
        assert stopped.wait(10), "the interrupted call's coroutine still runs on the loop"
        # a close is not interruptible: it runs to its end (a review: Ctrl-C left a scheduler half closed)
        ended = threading.Event()

        async def close_like() -> None:
            await asyncio.sleep(0.6)
            ended.set()

        timer2 = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer2.start()
        with pytest.raises(KeyboardInterrupt):
            lt.run(close_like())
        assert ended.wait(10)
    finally:
        timer.cancel()
        lt.stop()
