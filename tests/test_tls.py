"""TLS on every connection (tls://): real certificates made in the test, real processes and sockets.
A peer with a certificate from another CA, a plain-TCP peer, or one without a certificate is refused,
and the token is still required inside TLS."""

from __future__ import annotations

import asyncio
import ssl
import stat
import sys
from pathlib import Path

import pytest

import tidepool
from tidepool.comm import connect, listen
from tidepool.comm.tls import TLSConfig, make_certs
from tidepool.errors import AuthenticationError, ConfigError, ConnectionLostError

sys.path.insert(0, str(Path(__file__).parent))
import re  # noqa: E402

from test_cli import Proc, free_port, running, tidepool_cmd  # noqa: E402

TLS_LINE = re.compile(r"tidepool scheduler at (tls://\S+)")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    return make_certs(tmp_path_factory.mktemp("other"))


def add(a: int, b: int) -> int:
    return a + b


def test_make_certs_writes_a_ca_a_certificate_and_a_private_key_only_we_can_read(certs: TLSConfig) -> None:
    assert stat.S_IMODE(Path(certs.key).stat().st_mode) == 0o600
    assert "BEGIN CERTIFICATE" in Path(certs.ca).read_text() and "PRIVATE KEY" in Path(certs.key).read_text()
    with pytest.raises(ConfigError, match="tidepool certs"):
        TLSConfig(certs.ca, certs.cert, "/nonexistent/key.pem")


def test_a_client_certificate_the_scheduler_does_not_trust_is_named_as_the_likely_cause(
        certs: TLSConfig, other_ca: TLSConfig) -> None:  # fmt: skip
    """Found by a bug hunt: we trust the scheduler, it does not trust our certificate (another CA);
    the client only heard "connection ... closed" (TLS 1.3 checks it after our side's handshake)."""
    with tidepool.LocalCluster(n_workers=0, tls=certs) as cluster:
        ours = TLSConfig(certs.ca, other_ca.cert, other_ca.key)
        with pytest.raises(ConnectionLostError, match="refuses a certificate it does not trust|TLS with .* failed"):
            tidepool.Client(cluster.address, token=cluster.token, tls=ours, timeout=10)


def test_a_ca_file_that_holds_no_certificate_is_a_config_error_naming_it(certs: TLSConfig, tmp_path: Path) -> None:
    """Found by a bug hunt: a garbage CA file raised a bare ssl.SSLError (NO_CERTIFICATE_OR_CRL_FOUND)."""
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    cfg = TLSConfig(str(garbage), certs.cert, certs.key)
    with pytest.raises(ConfigError, match="cannot load the TLS CA file .*ca.pem"):
        cfg.client_context()


def test_a_whole_cluster_over_tls(certs: TLSConfig) -> None:
    with tidepool.LocalCluster(n_workers=2, tls=certs) as cluster, tidepool.Client(cluster) as client:
        assert cluster.address.startswith("tls://")
        assert all(w["address"].startswith("tls://") for w in client.scheduler_info()["workers"])
        # no plain Unix socket beside it: the cluster's own workers and client come over TLS too
        assert cluster.scheduler.local_address is None
        assert all(c.peer.startswith("tcp://") for c in cluster.scheduler.worker_conns.values())  # (TLS inside)
        assert client._connection._conn.peer.startswith("tls://")
        a = client.submit(add, 1, 2, workers=[cluster.workers[0]])
        b = client.submit(add, 3, 4, workers=[cluster.workers[1]])
        c = client.submit(add, a, b, workers=[cluster.workers[0]])  # b travels worker to worker over TLS
        assert c.result(timeout=30) == 10 and b.result() == 7  # and results to the client


def test_wrong_ca_plain_tcp_and_missing_token_are_refused(certs: TLSConfig, other_ca: TLSConfig) -> None:
    with tidepool.LocalCluster(n_workers=0, tls=certs) as cluster:
        # "TLS with ... failed" is the at-once refusal; running out of time says "within 10s"
        with pytest.raises(ConnectionLostError, match="TLS with .* failed"):
            tidepool.Client(cluster.address, token=cluster.token, tls=other_ca, timeout=10)
        plain = cluster.address.replace("tls://", "tcp://")
        # told at once, by the listener itself (a timeout would say "no handshake answer ... within")
        with pytest.raises(ConnectionLostError, match=r"refused the connection: .* speaks TLS: connect to it as tls://"):
            tidepool.Client(plain, token=cluster.token, timeout=10)
        with pytest.raises(ConfigError, match="no TLS configuration"):
            tidepool.Client(cluster.address, token=cluster.token, timeout=2)
        with pytest.raises(AuthenticationError):
            tidepool.Client(cluster.address, token="0" * 64, tls=certs, timeout=5)  # TLS alone is not enough


def test_a_peer_without_a_client_certificate_is_refused(certs: TLSConfig) -> None:
    async def main() -> None:
        async def handler(conn: object) -> None:
            raise AssertionError("no connection may get through")

        listener = await listen("tls://127.0.0.1:0", handler, "0" * 64, tls=certs)  # type: ignore[arg-type]
        host, port = listener.address.removeprefix("tls://").rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=certs.ca)  # trusts the server, has no certificate
        ctx.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
            writer.write(b"x" * 100)
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(1), 5)
        # and a TLS client meeting a plain-TCP server fails at once
        plain = await listen("tcp://127.0.0.1:0", handler, "0" * 64)  # type: ignore[arg-type]
        with pytest.raises(ConnectionLostError, match="TLS with"):  # not "could not connect ... within 8.0s"
            await connect(plain.address.replace("tcp://", "tls://"), "0" * 64, timeout=8, tls=certs)
        await listener.close()
        await plain.close()

    asyncio.run(main())


def test_a_wrong_token_over_tls_leaves_the_listener_serving_everyone_after(certs: TLSConfig) -> None:
    """Found by a bug hunt: the refused TLS connection's socket was closed under its transport,
    which still had the descriptor registered with the loop; every later connection accepted on
    that descriptor number failed ("File descriptor N is used by transport"), for good."""
    async def main() -> None:
        served: list[object] = []

        async def handler(conn: object) -> None:
            served.append(conn)

        token = "0" * 64
        listener = await listen("tls://127.0.0.1:0", handler, token, tls=certs)  # type: ignore[arg-type]
        try:
            for _ in range(2):
                with pytest.raises(AuthenticationError):
                    await connect(listener.address, "1" * 64, timeout=8, tls=certs)
            for _ in range(6):  # before the fix every other one of these failed
                conn = await connect(listener.address, token, timeout=8, tls=certs)
                conn.close()
            assert len(served) == 6
        finally:
            await listener.close()

    asyncio.run(main())


def test_a_refused_tls_peer_that_stays_silent_is_cut_off_at_once(certs: TLSConfig) -> None:
    """Found by review: after a wrong token the server's TLS goodbye waited (up to 30 s) for the
    peer's, outside every admission limit, so silent peers could hold sockets and TLS buffers."""
    import socket as socketlib

    import psutil

    from tidepool.comm.frames import encode

    async def main() -> None:
        async def handler(conn: object) -> None:
            raise AssertionError("no connection may get through")

        listener = await listen("tls://127.0.0.1:0", handler, "0" * 64, tls=certs)  # type: ignore[arg-type]
        port = int(listener.address.rsplit(":", 1)[1])
        ctx = TLSConfig(certs.ca, certs.cert, certs.key).client_context()

        def bad_peer() -> ssl.SSLSocket:
            raw = socketlib.create_connection(("127.0.0.1", port), timeout=10)
            tls = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            tls.recv(65536)  # the challenge
            tls.sendall(b"".join(bytes(p) for p in encode({"op": "auth", "mac": b"x" * 32, "nonce": b"y" * 32},
                                                          allow_pickles=False)))  # fmt: skip
            return tls  # then silent: never answers the server's goodbye, never closes

        def server_side() -> list[object]:
            return [c for c in psutil.Process().net_connections("tcp")
                    if c.laddr and c.laddr.port == port and c.raddr and c.status == psutil.CONN_ESTABLISHED]  # fmt: skip

        peers = [await asyncio.to_thread(bad_peer) for _ in range(3)]
        try:
            deadline = asyncio.get_running_loop().time() + 10  # a bound; the goodbye waited 30 s
            while server_side() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert not server_side(), server_side()
        finally:
            for p in peers:
                p.close()
            await listener.close()

    asyncio.run(main())


def test_cli_scheduler_and_worker_with_tls_flags(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    r = Proc(tidepool_cmd("certs", str(out)), tmp_path / "certs.err")
    with running(r):
        assert r.popen.wait(30) == 0, r.stderr()
    flags = ["--tls-ca-file", str(out / "ca.pem"), "--tls-cert", str(out / "cert.pem"), "--tls-key", str(out / "key.pem")]
    token_file = tmp_path / "token"
    sched = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file), *flags),
                 tmp_path / "s.err")  # fmt: skip
    with running(sched):
        address = sched.wait_for_line(TLS_LINE).group(1)
        worker = Proc(tidepool_cmd("worker", address, "--token-file", str(token_file), *flags), tmp_path / "w.err")
        with running(worker):
            cfg = TLSConfig(str(out / "ca.pem"), str(out / "cert.pem"), str(out / "key.pem"))
            with tidepool.Client(address, token=token_file.read_text().strip(), tls=cfg) as client:
                assert client.submit(add, 20, 22).result(timeout=30) == 42


def test_a_cluster_file_passes_tls_to_the_providers_workers(certs: TLSConfig, tmp_path: Path) -> None:
    from tidepool.config import load

    toml = tmp_path / "c.toml"
    toml.write_text(f'[scheduler]\ntls_ca_file = "{certs.ca}"\ntls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n'
                    '[provider]\nkind = "local"\n[[node_types]]\nname = "cpu"\nresources = { cpu = 1 }\n')
    cfg = load(str(toml))
    assert cfg.scheduler["tls_ca_file"] == certs.ca
    prov = cfg.make_provider("tls://127.0.0.1:1", "0" * 64, certs)
    assert prov.env["TIDEPOOL_TLS_CA"] == str(Path(certs.ca).resolve())
    assert prov.env["TIDEPOOL_TLS_KEY"] == str(Path(certs.key).resolve())


def test_ssh_and_slurm_providers_hand_the_certificates_to_their_workers(certs: TLSConfig) -> None:
    from tidepool.providers.slurm import SlurmProvider
    from tidepool.scaling.node_types import NodeType

    slurm = SlurmProvider(tls=certs)
    slurm.bind("tls://10.0.0.1:8786", "0" * 64)
    script = slurm.job_script(NodeType("cpu", {"cpu": 1}), "r1", ["w-1"])
    assert f"export TIDEPOOL_TLS_CERT={Path(certs.cert).resolve()}" in script
    assert "tls://10.0.0.1:8786" in script
    pytest.importorskip("asyncssh")
    from tidepool.providers.ssh import SSHProvider

    ssh = SSHProvider(["127.0.0.1"], tls=certs)
    assert ssh.env["TIDEPOOL_TLS_CA"] == str(Path(certs.ca).resolve())  # exported on the remote side


def test_idle_sockets_on_a_tls_port_cost_kilobytes_like_plain_tcp(certs: TLSConfig) -> None:
    """Issue 29: an idle socket on a tls:// port held asyncio's TLS buffers (~261 KiB each: 2,000
    of them grew the scheduler from 33 to 764 MiB).  Now TLS starts only when a ClientHello arrives."""
    import gc
    import socket
    import tracemalloc

    async def main() -> float:
        async def handler(conn: object) -> None:
            raise AssertionError("nobody authenticates here")

        lst = await listen("tls://127.0.0.1:0", handler, "0" * 64, tls=certs)  # type: ignore[arg-type]
        host, port = lst.address.removeprefix("tls://").rsplit(":", 1)
        loop = asyncio.get_running_loop()
        socks = []
        try:
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(200):
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, (host, int(port)))
                socks.append(s)
            for _ in range(500):
                if lst.handshaking == 200:
                    break
                await asyncio.sleep(0.01)
            assert lst.handshaking == 200
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            return held / 200
        finally:
            for s in socks:
                s.close()
            await lst.close()

    per_conn = asyncio.run(main())
    assert per_conn < 48 * 1024, f"{per_conn / 1024:.0f} KiB per idle TLS connection"


def test_certs_refuses_to_replace_a_ca_other_machines_may_use(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a second `tidepool certs DIR` silently made a new CA in place, and every machine
    given the old files could no longer connect."""
    from tidepool.cli import main

    out = tmp_path / "certs"
    assert main(["certs", str(out)]) == 0
    ca = (out / "ca.pem").read_bytes()
    capsys.readouterr()
    assert main(["certs", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds ca.pem" in err and "--force" in err
    assert (out / "ca.pem").read_bytes() == ca
    assert main(["certs", str(out), "--force"]) == 0
    assert (out / "ca.pem").read_bytes() != ca
