"""A LocalCluster's scheduler serves its own workers and its in-process client on a private Unix
socket (comm/unix.py); everybody else, and every TLS cluster, stays on TCP (real processes)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

import tidepool
from tidepool.comm import connect, listen, unix
from tidepool.comm.tls import make_certs
from tidepool.errors import AuthenticationError, ConfigError
from tidepool.worker.peers import listen_host

pytestmark = pytest.mark.integration

TOKEN = "unix-socket-test-token"


def add(a: int, b: int) -> int:
    return a + b


def test_a_local_clusters_workers_and_in_process_client_connect_through_a_private_unix_socket() -> None:
    with tidepool.LocalCluster(n_workers=2, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        local = cluster.scheduler.local_address
        assert local is not None and local.startswith("unix://")
        path = local.removeprefix("unix://")
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # only this user gets in
        assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert cluster.address.startswith("tcp://") and client.address == cluster.address  # what users see
        conns = cluster.scheduler.worker_conns.values()
        assert len(conns) == 2 and all(c.peer.startswith("unix://") for c in conns)
        assert client._connection._conn.peer == local
        # a value moves worker to worker (over their TCP data servers) and comes back to the client
        w0, w1 = cluster.workers[0], cluster.workers[1]
        a = client.submit(add, 1, 2, workers=[w0])
        b = client.submit(add, 3, 4, workers=[w1])
        assert client.submit(add, a, b, workers=[w0]).result(timeout=30) == 10
        assert all(w["address"].startswith("tcp://127.0.0.1:") for w in client.scheduler_info()["workers"])
        # a client that connects by the cluster's address (its own loop) still comes over TCP
        with tidepool.Client(cluster.address, token=cluster.token) as other:
            assert other._connection._conn.peer.startswith("tcp://")
            assert other.submit(add, 5, 6).result(timeout=30) == 11
    assert not os.path.exists(os.path.dirname(path))  # closing the cluster removes socket and directory


def test_a_temporary_directory_too_long_for_a_socket_path_leaves_the_cluster_on_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert unix.private_socket_path() is None and list(deep.iterdir()) == []  # nothing left behind
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        assert cluster.scheduler.local_address is None
        assert all(c.peer.startswith("tcp://") for c in cluster.scheduler.worker_conns.values())
        assert client.submit(add, 1, 1).result(timeout=30) == 2


def _closed_on(sock: socket.socket) -> bool:
    """The listener closed ``sock`` (EOF, or a reset: it closed with our bytes unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_a_unix_listener_authenticates_refuses_strangers_and_removes_its_socket() -> None:
    async def main() -> None:
        async def echo(conn: tidepool.comm.Connection) -> None:
            while True:
                await conn.send(await conn.recv())

        path = unix.private_socket_path()
        assert path is not None
        lst = await listen(f"unix://{path}", echo, TOKEN)
        try:
            with pytest.raises(AuthenticationError):
                await connect(lst.address, "wrong-token", timeout=5)
            stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not a tidepool peer
            stranger.connect(path)
            stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
            stranger.settimeout(5)
            assert await asyncio.to_thread(_closed_on, stranger)
            stranger.close()
            assert lst.refused >= 1
            conn = await connect(lst.address, TOKEN, timeout=5)  # the listener still serves
            await conn.send({"op": "ping", "n": 1})
            assert await asyncio.wait_for(conn.recv(), 5) == {"op": "ping", "n": 1}
            conn.close()
        finally:
            await lst.close()
        assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_unix_addresses_are_plain_and_need_a_short_path(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)

    async def main() -> None:
        with pytest.raises(ConfigError, match="plain"):
            await listen("unix:///tmp/x.sock", lambda c: asyncio.sleep(0), TOKEN, tls=certs)
        with pytest.raises(ConfigError, match="longer"):
            await listen("unix:///tmp/" + "x" * 200, lambda c: asyncio.sleep(0), TOKEN)

    asyncio.run(main())
    # a worker of a scheduler on a Unix socket is on this machine: its data server stays on loopback
    assert listen_host("unix:///tmp/tidepool-x/scheduler.sock") == "127.0.0.1"
