"""A LocalCluster's scheduler serves its own workers on a Unix socket (comm/unix.py) and its
in-process client in memory; everybody else, and every TLS cluster, stays on TCP (real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

import tidepool
from tidepool.comm import connect, core, listen, unix
from tidepool.comm.core import MemoryConnection
from tidepool.comm.tls import make_certs
from tidepool.errors import AuthenticationError, ConfigError, ConnectionLostError
from tidepool.providers.local import LocalProvider
from tidepool.worker.peers import listen_host

pytestmark = pytest.mark.integration

TOKEN = "unix-socket-test-token"
LINUX = sys.platform.startswith("linux")


def add(a: int, b: int) -> int:
    return a + b


def _ours() -> set[str]:
    """The scheduler socket directories in the temporary directory."""
    return {p.parent.name for p in Path(tempfile.gettempdir()).glob("tidepool-*/scheduler.sock")}


def _cluster_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("tidepool-cluster") and t.is_alive())


def _worker_pids(cluster: tidepool.LocalCluster) -> list[int]:
    return [p.proc.pid for p in cluster.provider.procs.values()]


def test_a_local_clusters_workers_connect_through_a_unix_socket_and_its_in_process_client_in_memory() -> None:
    before = _ours()
    with tidepool.LocalCluster(n_workers=2, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        local = cluster.scheduler.local_address
        assert local is not None and local.startswith("unix://@" if LINUX else "unix:///")
        if LINUX:
            assert _ours() == before  # an abstract name: nothing on disk to leave behind
        assert cluster.address.startswith("tcp://") and client.address == cluster.address  # what users see
        conns = list(cluster.scheduler.worker_conns.values())
        assert len(conns) == 2 and all(c.peer.startswith("unix://") for c in conns)
        if LINUX:  # each names the process at its other end
            assert sorted(int(c.peer.rsplit("pid ", 1)[1].rstrip(")")) for c in conns) == sorted(_worker_pids(cluster))
        # the client in this very process skips sockets: an in-memory connection on the same loop
        memory = cluster.scheduler.memory_address
        assert memory is not None and client._connection._conn.peer == memory
        assert isinstance(client._connection._conn, MemoryConnection)
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

    async def knock(where: str) -> None:
        await connect(where, cluster.token, timeout=0.5)

    for where in (local, memory):
        with pytest.raises(ConnectionLostError):  # closed with the cluster
            asyncio.run(knock(where))
    assert _ours() == before


def test_the_workers_data_servers_listen_on_the_clusters_host_not_on_the_unix_socket() -> None:
    """Registering through the Unix socket does not move a worker's data server to loopback: with
    ``host="0.0.0.0"`` it listens on every interface, so remote clients and workers reach it."""
    with tidepool.LocalCluster(n_workers=1, host="0.0.0.0", dashboard=False) as cluster:
        assert cluster.scheduler.local_address is not None
        (pid,) = _worker_pids(cluster)
        worker_addr = next(iter(cluster.scheduler.state.workers.values())).address
        port = int(worker_addr.rsplit(":", 1)[1])
        listening = [c.laddr for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert (listen_host(cluster.address), port) in [(a.ip, a.port) for a in listening]
        assert listen_host(cluster.address) == "0.0.0.0"


@pytest.mark.parametrize("failure", ["no path", "cannot make it"])
def test_without_a_unix_socket_the_cluster_stays_on_tcp(failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_path(abstract: bool | None = None) -> str | None:
        if failure == "cannot make it":
            raise OSError(28, "No space left on device")
        return None

    monkeypatch.setattr(unix, "private_socket_path", no_path)
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        assert cluster.scheduler.local_address is None
        assert all(c.peer.startswith("tcp://") for c in cluster.scheduler.worker_conns.values())
        assert client.submit(add, 1, 1).result(timeout=30) == 2


def test_a_failed_start_leaves_no_scheduler_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    threads, before = _cluster_threads(), _ours()
    with pytest.raises(ConfigError):
        tidepool.LocalCluster(n_workers=0, dashboard=False, memory_limit="bogus")
    with pytest.raises(ConfigError):
        tidepool.LocalCluster(n_workers=0, dashboard=False, spill_limit="bogus")

    def broken(self: LocalProvider) -> None:
        raise OSError("the fork server could not start")

    monkeypatch.setattr(LocalProvider, "start_fork_server", broken)
    real = unix.private_socket_path
    monkeypatch.setattr(unix, "private_socket_path", lambda abstract=None: real(False))  # a file: must go
    with pytest.raises(OSError, match="fork server"):
        tidepool.LocalCluster(n_workers=0, dashboard=False)
    assert _cluster_threads() == threads and _ours() == before


def test_a_socket_file_lives_in_a_private_directory_removed_with_the_listener() -> None:
    path = unix.private_socket_path(abstract=False)
    assert path is not None and not path.startswith("@")

    async def main() -> None:
        lst = await listen(f"unix://{path}", lambda c: asyncio.sleep(0), TOKEN)
        try:
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # only this user gets in
            assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        finally:
            await lst.close()

    asyncio.run(main())
    assert not os.path.exists(os.path.dirname(path))


def test_a_socket_directory_goes_when_the_process_exits_without_closing_its_listener() -> None:
    code = (
        "import asyncio, sys\n"
        "from tidepool.comm import listen, unix\n"
        "path = unix.private_socket_path(abstract=False)\n"
        "async def main():\n"
        "    await listen('unix://' + path, lambda c: asyncio.sleep(0), 'tok')\n"
        "    print(path, flush=True)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = out.stdout.strip()
    assert path.endswith("scheduler.sock") and not os.path.exists(os.path.dirname(path))


def _closed_on(sock: socket.socket) -> bool:
    """The listener closed ``sock`` (EOF, or a reset: it closed with our bytes unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("abstract", [True, False] if LINUX else [False])
def test_a_unix_listener_authenticates_and_refuses_strangers(abstract: bool) -> None:
    async def main() -> None:
        async def echo(conn: tidepool.comm.Connection) -> None:
            while True:
                await conn.send(await conn.recv())

        path = unix.private_socket_path(abstract)
        assert path is not None
        lst = await listen(f"unix://{path}", echo, TOKEN)
        try:
            with pytest.raises(AuthenticationError):
                await connect(lst.address, "wrong-token", timeout=30)
            stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not a tidepool peer
            stranger.connect(unix.kernel_name(path))
            stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
            stranger.settimeout(30)
            assert await asyncio.to_thread(_closed_on, stranger)
            stranger.close()
            assert lst.refused >= 1
            conn = await connect(lst.address, TOKEN, timeout=30)  # the listener still serves
            await conn.send({"op": "ping", "n": 1})
            assert await asyncio.wait_for(conn.recv(), 30) == {"op": "ping", "n": 1}
            conn.close()
        finally:
            await lst.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_unix_addresses_are_plain_and_need_a_short_path(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)

    async def main() -> None:
        with pytest.raises(ConfigError, match="plain"):
            await listen("unix:///tmp/x.sock", lambda c: asyncio.sleep(0), TOKEN, tls=certs)
        with pytest.raises(ConfigError, match="longer"):
            await listen("unix:///tmp/" + "x" * 200, lambda c: asyncio.sleep(0), TOKEN)

    asyncio.run(main())
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    old = tempfile.tempdir
    tempfile.tempdir = str(deep)
    try:
        assert unix.private_socket_path(abstract=False) is None and list(deep.iterdir()) == []
    finally:
        tempfile.tempdir = old
    # a worker of a scheduler on a Unix socket is on this machine: loopback, unless told otherwise
    assert listen_host("unix:///tmp/tidepool-x/scheduler.sock") == "127.0.0.1"


def test_the_in_memory_address_is_gone_even_if_closing_another_listener_fails() -> None:
    """The memory listener was closed last, after the TCP and Unix ones: when one of those raised
    (or the close was cut short by a timeout) its name stayed registered for the life of the
    process, holding the whole scheduler and still admitting clients."""
    cluster = tidepool.LocalCluster(n_workers=0, dashboard=False)
    sched = cluster.scheduler
    assert sched.memory_address is not None and sched.local_listener is not None
    name = sched.memory_address.removeprefix("memory://")
    close_unix = sched.local_listener.close

    async def failing_close() -> None:
        await close_unix()
        raise RuntimeError("closing the Unix listener failed")

    sched.local_listener.close = failing_close  # type: ignore[method-assign]
    with contextlib.suppress(RuntimeError):
        cluster.close()
    assert name not in core._memory_listeners
