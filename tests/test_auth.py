"""HMAC handshake: right/wrong tokens, hostile and silent peers, no pickles before authentication.

Every test runs its own event loop with ``asyncio.run`` and bounds every wait with
``asyncio.wait_for``; servers and clients live in the same process so the tests can check what the
server did (or, for the tripwire pickles, did not do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgpack
import pytest

import tidepool.comm.auth as auth
from tidepool.comm import Connection, connect, listen, serialize, unix
from tidepool.comm.admission import PLAIN_PREAMBLE
from tidepool.comm.core import _memory_connect
from tidepool.comm.frames import EXT_SERIALIZED, FrameDecoder, encode
from tidepool.comm.serialize import Serialized
from tidepool.errors import (
    AuthenticationError,
    CommError,
    ConfigError,
    ConnectionLostError,
    ProtocolError,
)

TOKEN = "s3cret-token-for-tests"
ADDRESSES = ["tcp://127.0.0.1:0", "unix://", "memory://"]  # unix:// alone: a fresh private path (_at)


def _at(address: str) -> str:
    if address != "unix://":
        return address
    path = unix.private_socket_path()
    if path is None:
        pytest.skip("no Unix socket path short enough here")
    return address + path
T = 10.0  # bound for any single wait; nothing here should take more than a fraction of it

PREFIX = struct.Struct("!II")
LEN = struct.Struct("!Q")
EXT = struct.Struct("!iII")



async def open_plain(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TCP connection that introduces itself the way a plain tidepool dialer does."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(PLAIN_PREAMBLE)
    return reader, writer

def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


class EchoServer:
    """A listener whose handler echoes every message and records who got through the handshake."""

    def __init__(self) -> None:
        self.served: list[Connection] = []

    async def handler(self, conn: Connection) -> None:
        self.served.append(conn)
        while True:
            await conn.send({"echo": await conn.recv()})


async def exchange(conn: Connection, payload: Any) -> Any:
    await conn.send({"op": "ping", "payload": payload})
    reply = await asyncio.wait_for(conn.recv(), T)
    return reply["echo"]["payload"]


def tcp_host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


async def read_frame(reader: asyncio.StreamReader, allow_pickles: bool = False) -> dict[str, Any]:
    """Read one frame from a raw stream with the real decoder."""
    got: list[Any] = []
    dec = FrameDecoder(got.append)
    dec.allow_pickles = allow_pickles
    while not got:
        data = await asyncio.wait_for(reader.read(1), T)  # 1 byte at a time: never over-read
        if not data:
            raise ConnectionLostError("EOF while reading a frame")
        dec.feed(data)
    return got[0]


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = T) -> bool:
    """Drain ``reader`` until the peer closes (EOF or reset); False if still open after timeout."""

    async def drain() -> None:
        while await reader.read(65536):
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


# A pickle whose unpickling would create a file: if it is ever loaded we will see the file.
def _tripwire(path: str) -> None:
    Path(path).write_text("unpickled!")


class Tripwire:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (_tripwire, (self.path,))


def armed_pickle(tmp_path: Path, name: str) -> tuple[bytes, Path]:
    target = tmp_path / name
    payload = pickle.dumps(Tripwire(target), protocol=5)
    # sanity check: the payload really is live (loading a copy aimed elsewhere fires it)
    probe = tmp_path / f"{name}.probe"
    pickle.loads(pickle.dumps(Tripwire(probe), protocol=5))
    assert probe.exists()
    return payload, target


# -- the happy path ------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ADDRESSES)
def test_right_token_connects_and_exchanges(address: str) -> None:
    async def main() -> None:
        server = EchoServer()
        lst = await listen(_at(address), server.handler, TOKEN)
        try:
            conn = await connect(
                lst.address, TOKEN, timeout=T, hello={"role": "client", "name": "c1"}
            )
            assert conn.authenticated
            assert await exchange(conn, [1, b"two", {"three": 3.0}]) == [1, b"two", {"three": 3.0}]
            echoed = await exchange(conn, serialize({"fn": len, "data": list(range(10))}))
            assert echoed.load() == {"fn": len, "data": list(range(10))}
            (sconn,) = server.served
            assert sconn.authenticated
            # the hello reaches the server; it cannot override the handshake fields
            assert sconn.info["role"] == "client" and sconn.info["name"] == "c1"
            assert sconn.info["op"] == "auth"
            conn.close()
        finally:
            await lst.close()

    run(main())


@pytest.mark.parametrize("address", ADDRESSES)
def test_hello_cannot_smuggle_handshake_fields(address: str) -> None:
    async def main() -> None:
        server = EchoServer()
        lst = await listen(_at(address), server.handler, TOKEN)
        try:
            conn = await connect(
                lst.address, TOKEN, hello={"op": "x", "mac": b"0" * 32, "nonce": b"n"}
            )
            assert await exchange(conn, 1) == 1
            conn.close()
        finally:
            await lst.close()

    run(main())


# -- wrong tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ADDRESSES)
def test_wrong_token_is_rejected_and_server_keeps_serving(address: str) -> None:
    async def main() -> None:
        server = EchoServer()
        lst = await listen(_at(address), server.handler, TOKEN)
        try:
            good_before = await connect(lst.address, TOKEN)
            for wrong in ("wrong-token", TOKEN + "x", ""):
                with pytest.raises(AuthenticationError) as info:
                    await connect(lst.address, wrong, timeout=T)
                msg = str(info.value)
                assert "token" in msg
                # says what to do about it
                assert "TIDEPOOL_TOKEN" in msg and "--token-file" in msg
            # several bad clients at once do not disturb anything either
            results = await asyncio.gather(
                *(connect(lst.address, f"bad-{i}", timeout=T) for i in range(5)),
                return_exceptions=True,
            )
            assert all(isinstance(r, AuthenticationError) for r in results), results
            assert len(server.served) == 1  # the handler never saw a bad client
            # the connection made before still works, and new good clients get in
            assert await exchange(good_before, "still here") == "still here"
            good_after = await connect(lst.address, TOKEN, timeout=T)
            assert await exchange(good_after, b"after") == b"after"
            assert len(server.served) == 2
            good_before.close()
            good_after.close()
        finally:
            await lst.close()

    run(main())


def test_client_refuses_a_server_that_does_not_know_the_token() -> None:
    """A fake server accepts any answer: the client must notice it cannot prove the token."""

    async def main() -> None:
        seen: list[bytes] = []
        replied = asyncio.Event()

        async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert await reader.readexactly(len(PLAIN_PREAMBLE)) == PLAIN_PREAMBLE
            writer.write(b"".join(encode({"op": "challenge", "nonce": b"n" * 32, "v": 1}, False)))
            msg = await read_frame(reader)
            seen.append(msgpack.packb(msg))
            writer.write(b"".join(encode({"op": "auth-ok", "mac": b"\x00" * 32}, False)))
            replied.set()
            await closed_by_peer(reader)
            writer.close()

        srv = await asyncio.start_server(fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(AuthenticationError, match="does not know our token"):
                await connect(f"tcp://127.0.0.1:{port}", TOKEN, timeout=T)
            assert replied.is_set()
            # the token itself never crossed the wire
            assert TOKEN.encode() not in seen[0]
        finally:
            srv.close()

    run(main())


def test_replayed_answer_from_another_connection_is_rejected() -> None:
    """The MAC is bound to each connection's fresh nonce: a recorded answer is useless elsewhere."""

    async def main() -> None:
        server = EchoServer()
        lst = await listen("tcp://127.0.0.1:0", server.handler, TOKEN)
        host, port = tcp_host_port(lst.address)
        try:
            r1, w1 = await open_plain(host, port)
            r2, w2 = await open_plain(host, port)
            ch1, ch2 = await read_frame(r1), await read_frame(r2)
            assert ch1["op"] == ch2["op"] == "challenge"
            assert len(ch1["nonce"]) == 32 and ch1["nonce"] != ch2["nonce"]
            cnonce = b"c" * 32
            # a correct answer for connection 1 ...
            answer = {
                "op": "auth",
                "nonce": cnonce,
                "mac": auth._mac(TOKEN, b"client", ch1["nonce"], cnonce),
            }
            # ... replayed on connection 2 is refused
            w2.write(b"".join(encode(answer, False)))
            reply = await read_frame(r2)
            assert reply["op"] == "auth-failed" and "token" in reply["reason"]
            assert await closed_by_peer(r2)
            # while on connection 1 it is accepted, and the server proves it knows the token
            w1.write(b"".join(encode(answer, False)))
            ok = await read_frame(r1)
            assert ok["op"] == "auth-ok"
            assert ok["mac"] == auth._mac(TOKEN, b"server", cnonce, ch1["nonce"])
            assert len(server.served) == 1
            w1.close()
            w2.close()
        finally:
            await lst.close()

    run(main())


# -- hostile and silent peers --------------------------------------------------------------------

GARBAGE = {
    "ff-bytes": b"\xff" * 64,  # announces a 4 GiB header
    "http": b"GET / HTTP/1.1\r\nHost: scheduler\r\n\r\n",
    "bad-msgpack": PREFIX.pack(4, 0) + b"\xc1\xc1\xc1\xc1",
    "not-a-map": PREFIX.pack(3, 0) + msgpack.packb([1, 2]),
    "wrong-op": b"".join(encode({"op": "hello"}, False)),
    "short-nonce": b"".join(encode({"op": "auth", "mac": b"m" * 32, "nonce": b"short"}, False)),
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_handshake_closes_only_that_connection(garbage: bytes) -> None:
    async def main() -> None:
        server = EchoServer()
        lst = await listen("tcp://127.0.0.1:0", server.handler, TOKEN)
        host, port = tcp_host_port(lst.address)
        try:
            good = await connect(lst.address, TOKEN, timeout=T)
            reader, writer = await open_plain(host, port)
            writer.write(garbage)
            assert await closed_by_peer(reader), "server kept a garbage-talking peer open"
            writer.close()
            # the good connection on the same listener is unaffected, and new ones get in
            assert await exchange(good, "ok") == "ok"
            good2 = await connect(lst.address, TOKEN, timeout=T)
            assert await exchange(good2, "ok2") == "ok2"
            assert len(server.served) == 2
            good.close()
            good2.close()
        finally:
            await lst.close()

    run(main())


def test_client_talking_to_a_non_tidepool_server_gets_a_protocol_error() -> None:
    async def main() -> None:
        async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            await closed_by_peer(reader)
            writer.close()

        srv = await asyncio.start_server(http, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(ProtocolError):
                await connect(f"tcp://127.0.0.1:{port}", TOKEN, timeout=T)
        finally:
            srv.close()

    run(main())


def test_silent_peers_do_not_block_other_clients() -> None:
    async def main() -> None:
        server = EchoServer()
        lst = await listen("tcp://127.0.0.1:0", server.handler, TOKEN)
        host, port = tcp_host_port(lst.address)
        try:
            silent = [await open_plain(host, port) for _ in range(5)]
            # the listener speaks first; every silent peer got its challenge ...
            for reader, _ in silent:
                assert (await read_frame(reader))["op"] == "challenge"
            # ... and while all of them are still waiting (default 10 s timeout), others get in
            conns = await asyncio.gather(
                *(connect(lst.address, TOKEN, timeout=T) for _ in range(3))
            )
            for i, c in enumerate(conns):
                assert await exchange(c, i) == i
            for reader, _ in silent:  # still open: the others did not wait for them to time out
                assert not reader.at_eof()
            for c in conns:
                c.close()
            for _, writer in silent:
                writer.close()
        finally:
            await lst.close()

    run(main())


def test_server_closes_a_peer_that_never_answers_the_challenge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.2)

    async def main() -> None:
        server = EchoServer()
        lst = await listen("tcp://127.0.0.1:0", server.handler, TOKEN)
        host, port = tcp_host_port(lst.address)
        try:
            reader, writer = await open_plain(host, port)
            assert await closed_by_peer(reader, timeout=T), "no handshake timeout on the server"
            writer.close()
            assert server.served == []
            good = await connect(lst.address, TOKEN, timeout=T)
            assert await exchange(good, "x") == "x"
            good.close()
        finally:
            await lst.close()

    run(main())


def test_client_gives_up_on_a_server_that_never_speaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.2)

    async def main() -> None:
        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await closed_by_peer(reader)
            writer.close()

        srv = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:  # the handshake's own timeout ends it (its message), not the connect timeout T
            with pytest.raises(AuthenticationError, match="no handshake answer"):
                await connect(f"tcp://127.0.0.1:{port}", TOKEN, timeout=T)
        finally:
            srv.close()

    run(main())


# -- no pickles before authentication ------------------------------------------------------------


def _evil_frames(payload: bytes) -> dict[str, bytes]:
    header_ext = msgpack.packb(
        {"op": "auth", "mac": b"m" * 32, "nonce": b"n" * 32,
         "v": msgpack.ExtType(EXT_SERIALIZED, EXT.pack(-1, 0, 0) + payload)}
    )  # fmt: skip
    header_ref = msgpack.packb(
        {"op": "auth", "v": msgpack.ExtType(EXT_SERIALIZED, EXT.pack(0, 1, 0))}
    )
    return {
        # the pickle inline in an ext type of the auth message
        "inline-ext": PREFIX.pack(len(header_ext), 0) + header_ext,
        # the pickle as a frame buffer the ext points at
        "ext+buffer": PREFIX.pack(len(header_ref), 1)
        + LEN.pack(len(payload))
        + header_ref
        + payload,
        # as produced by the real encoder for an authenticated peer
        "encoder": b"".join(encode({"op": "auth", "v": Serialized(payload)}, allow_pickles=True)),
        "encoder-oob": b"".join(
            encode({"op": "auth", "v": Serialized(payload + b"\x00" * 20_000, [memoryview(b"x")])})
        ),
    }


@pytest.mark.parametrize("kind", ["inline-ext", "ext+buffer", "encoder", "encoder-oob"])
@pytest.mark.parametrize("read_challenge_first", [True, False], ids=["after-challenge", "at-once"])
def test_unauthenticated_peer_cannot_get_a_pickle_unpickled(
    tmp_path: Path, kind: str, read_challenge_first: bool
) -> None:
    payload, target = armed_pickle(tmp_path, "pwned")
    frame = _evil_frames(payload)[kind]

    async def main() -> None:
        server = EchoServer()
        lst = await listen("tcp://127.0.0.1:0", server.handler, TOKEN)
        host, port = tcp_host_port(lst.address)
        try:
            good = await connect(lst.address, TOKEN, timeout=T)
            reader, writer = await open_plain(host, port)
            if read_challenge_first:
                assert (await read_frame(reader))["op"] == "challenge"
            writer.write(frame)
            assert await closed_by_peer(reader), "server kept the connection open"
            writer.close()
            assert not target.exists(), "the server unpickled data from an unauthenticated peer"
            assert len(server.served) == 1
            assert await exchange(good, "fine") == "fine"
            good.close()
        finally:
            await lst.close()

    run(main())
    assert not target.exists()


def test_unauthenticated_memory_peer_cannot_get_a_pickle_unpickled(tmp_path: Path) -> None:
    """A malicious in-process peer that skips the handshake and claims to be authenticated."""
    payload, target = armed_pickle(tmp_path, "pwned-mem")

    async def main() -> None:
        server = EchoServer()
        lst = await listen("memory://", server.handler, TOKEN)
        try:
            rogue = _memory_connect(lst.address.removeprefix("memory://"), 2**20)
            rogue.authenticated = True  # lie, so our own encoder lets the pickle out
            with contextlib.suppress(ConnectionLostError):
                await rogue.send({"op": "auth", "v": Serialized(payload)})
            with pytest.raises(CommError):
                while True:  # the challenge may be there; after it, the connection is gone
                    await asyncio.wait_for(rogue.recv(), T)
            assert not target.exists()
            assert server.served == []
        finally:
            await lst.close()

    run(main())


@pytest.mark.parametrize("address", ADDRESSES)
def test_client_cannot_put_pickles_in_its_hello(address: str, tmp_path: Path) -> None:
    _, target = armed_pickle(tmp_path, "hello")

    async def main() -> None:
        server = EchoServer()
        lst = await listen(_at(address), server.handler, TOKEN)
        try:
            with pytest.raises(ProtocolError, match="authentication"):
                await connect(lst.address, TOKEN, hello={"evil": serialize(Tripwire(target))})
            assert not target.exists() and server.served == []
        finally:
            await lst.close()

    run(main())


# -- the switch from pre-auth to authenticated mode ----------------------------------------------


async def _pushing_server_roundtrip(address: str) -> Any:
    async def push_first(conn: Connection) -> None:
        await conn.send({"op": "welcome", "v": serialize({"big": b"z" * 100_000})})
        await conn.recv()

    lst = await listen(_at(address), push_first, TOKEN)
    try:
        conn = await connect(lst.address, TOKEN, timeout=T)
        msg = await asyncio.wait_for(conn.recv(), T)
        conn.close()
        return msg["v"].load()
    finally:
        await lst.close()


@pytest.mark.parametrize("address", ADDRESSES)
def test_server_may_send_a_pickle_right_after_the_handshake(address: str) -> None:
    assert run(_pushing_server_roundtrip(address)) == {"big": b"z" * 100_000}


@pytest.mark.parametrize("address", ADDRESSES)
def test_client_may_send_a_pickle_right_after_connect(address: str) -> None:
    async def main() -> Any:
        got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def handler(conn: Connection) -> None:
            try:
                got.set_result((await conn.recv())["v"].load())
            except CommError as exc:
                got.set_exception(exc)

        lst = await listen(_at(address), handler, TOKEN)
        try:
            conn = await connect(lst.address, TOKEN, timeout=T)
            await conn.send({"op": "update", "v": serialize([1, 2, 3])})
            result = await asyncio.wait_for(got, T)
            conn.close()
            return result
        finally:
            await lst.close()

    assert run(main()) == [1, 2, 3]


# -- tokens --------------------------------------------------------------------------------------


def test_new_token_is_random_hex() -> None:
    a, b = auth.new_token(), auth.new_token()
    assert a != b and len(a) == 64
    int(a, 16)


def test_token_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    assert auth.token_from_env() is None
    f = tmp_path / "token"
    f.write_text("  from-file\n")
    f.chmod(0o600)
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(f))
    assert auth.token_from_env() == "from-file"
    monkeypatch.setenv(auth.TOKEN_ENV, " from-env\n")
    assert auth.token_from_env() == "from-env"  # the variable wins over the file


def test_bad_token_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read token file"):
        auth.read_token_file(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match="empty"):
        auth.read_token_file(str(empty))


@pytest.mark.parametrize("address", ADDRESSES)
def test_tokens_from_files_with_whitespace_work(address: str, tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)

    async def main() -> None:
        lst = await listen(_at(address), EchoServer().handler, TOKEN)
        try:
            conn = await connect(lst.address, auth.read_token_file(str(f)), timeout=T)
            assert await exchange(conn, 5) == 5
            conn.close()
        finally:
            await lst.close()

    run(main())


def test_an_auth_message_whose_mac_is_not_bytes_is_named_as_such(caplog: pytest.LogCaptureFixture) -> None:
    """Found by a bug hunt: it was logged as "expected an auth message ..., got 'auth'"."""

    async def main() -> None:
        server = EchoServer()
        lst = await listen("memory://", server.handler, TOKEN)
        try:
            rogue = _memory_connect(lst.address.removeprefix("memory://"), 2**20)
            await asyncio.wait_for(rogue.recv(), T)  # the challenge
            with contextlib.suppress(ConnectionLostError):
                await rogue.send({"op": "auth", "role": "client", "nonce": b"n" * 32, "mac": "not-bytes"})
            with pytest.raises(CommError):
                while True:
                    await asyncio.wait_for(rogue.recv(), T)
            assert server.served == []
        finally:
            await lst.close()

    with caplog.at_level(logging.WARNING, logger="tidepool.comm"):
        run(main())
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "malformed auth message" in text and "str, not bytes" in text, text
