"""Mutual HMAC challenge-response over any :class:`~tidepool.comm.core.Connection`.

The listener speaks first with a random nonce; the dialer answers with
``HMAC-SHA256(token, "client" | server_nonce | client_nonce)`` and its own nonce; the listener checks
it in constant time and proves it knows the token too.  Until both checks pass the connection runs
with pre-authentication limits (64 KiB frames, no buffers, no pickles).  The token never crosses
the wire.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import stat
from typing import TYPE_CHECKING

from tidepool.errors import AuthenticationError, ConfigError, ConnectionLostError, ProtocolError

if TYPE_CHECKING:
    from tidepool.comm.core import Connection

HANDSHAKE_TIMEOUT = 10.0
TOKEN_ENV = "TIDEPOOL_TOKEN"
TOKEN_FILE_ENV = "TIDEPOOL_TOKEN_FILE"


def new_token() -> str:
    """A fresh random token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    """The token from ``$TIDEPOOL_TOKEN`` or the file named by ``$TIDEPOOL_TOKEN_FILE``."""
    tok = os.environ.get(TOKEN_ENV)
    if tok:
        return tok.strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    return None


def read_token_file(path: str) -> str:
    """The token in ``path``; refused when others than its owner may read the file (the token is
    all it takes to run code on the cluster)."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            tok = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path!r}: {exc}") from exc
    if not tok:
        raise ConfigError(f"token file {path!r} is empty; pass the scheduler's token file")
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        raise ConfigError(
            f"token file {path!r} can be read by other users (mode {stat.S_IMODE(mode):04o}): anyone who "
            f"read it can run code on the cluster. Run `chmod 600 {path}` (and start the scheduler with "
            "a new token if others may have read it)")  # fmt: skip
    return tok


def write_token_file(path: str, token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only (mode 0600, also when the file existed
    with a wider mode).  A symbolic link is refused, not followed (it could point anywhere the
    process may write), and so is a file another user owns."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(f"token file {path!r} is a symbolic link; tidepool does not follow it. Remove "
                              "the link or pass the real path") from exc  # fmt: skip
        raise ConfigError(f"cannot write token file {path!r}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"token file {path!r} is not a regular file; pass a file path")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise ConfigError(f"token file {path!r} belongs to another user (uid {st.st_uid}); pass a path "
                              "you own")  # fmt: skip
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # before the token is in it
        os.ftruncate(fd, 0)
        os.write(fd, token.encode())
    finally:
        os.close(fd)


def _mac(token: str, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token.encode(), label + a + b, hashlib.sha256).digest()


async def _recv(conn: Connection) -> dict:
    try:
        return await asyncio.wait_for(conn.recv(), HANDSHAKE_TIMEOUT)
    except TimeoutError as exc:
        raise AuthenticationError(
            f"no handshake answer from {conn.peer} within {HANDSHAKE_TIMEOUT:.0f}s; is it a tidepool "
            "process, and does it use TLS (then its address is tls://...)?"
        ) from exc


async def server_handshake(conn: Connection, token: str) -> dict:
    """Run the listener side; returns the dialer's hello (its ``name`` and ``role``)."""
    nonce = secrets.token_bytes(32)
    await conn.send({"op": "challenge", "nonce": nonce, "v": 1})
    msg = await _recv(conn)
    if msg.get("op") != "auth":
        raise ProtocolError(f"expected an auth message from {conn.peer}, got {msg.get('op')!r}")
    if not isinstance(msg.get("mac"), bytes):
        raise ProtocolError(f"malformed auth message from {conn.peer}: its mac is "
                            f"{type(msg.get('mac')).__name__}, not bytes")  # fmt: skip
    cnonce = msg.get("nonce")
    if not isinstance(cnonce, bytes) or len(cnonce) != 32:
        raise ProtocolError("malformed auth nonce")
    if not hmac.compare_digest(msg["mac"], _mac(token, b"client", nonce, cnonce)):
        try:
            await conn.send(
                {"op": "auth-failed", "reason": "wrong token: use the scheduler's token (TIDEPOOL_TOKEN)"}
            )
        finally:
            conn.close()
        raise AuthenticationError(f"peer {conn.peer} failed authentication (wrong token)")
    conn.set_authenticated()  # before auth-ok: the client may send a pickle right after it
    await conn.send({"op": "auth-ok", "mac": _mac(token, b"server", cnonce, nonce)})
    return msg


async def client_handshake(conn: Connection, token: str, hello: dict | None = None, tls: bool = False) -> None:
    """Run the dialer side; raises :class:`AuthenticationError` on a token mismatch.  ``tls``: the
    connection is TLS, where a server that does not trust our certificate closes it before saying
    anything (TLS 1.3 checks the client's certificate after the client's side of the handshake)."""
    try:
        msg = await _recv(conn)
    except ConnectionLostError as exc:
        if not tls:
            raise
        raise ConnectionLostError(f"{exc}: the other side closed the TLS connection before saying anything, which "
                                  "is how it refuses a certificate it does not trust; is ours signed by the CA "
                                  "it trusts (--tls-ca-file)?") from exc  # fmt: skip
    if msg.get("op") == "refused":  # e.g. a plain-TCP dialer on a TLS port: told at once
        conn.close()
        raise ConnectionLostError(f"{conn.peer} refused the connection: {msg.get('reason')}")
    if msg.get("op") != "challenge" or not isinstance(msg.get("nonce"), bytes):
        raise ProtocolError(f"{conn.peer} did not send a tidepool challenge")
    nonce = msg["nonce"]
    cnonce = secrets.token_bytes(32)
    await conn.send({**(hello or {}), "op": "auth", "mac": _mac(token, b"client", nonce, cnonce), "nonce": cnonce})
    reply = await _recv(conn)
    if reply.get("op") == "auth-failed":
        conn.close()
        raise AuthenticationError(
            f"{conn.peer} rejected our token ({reply.get('reason')}); set TIDEPOOL_TOKEN or "
            "--token-file to the scheduler's token"
        )
    if reply.get("op") != "auth-ok" or not isinstance(reply.get("mac"), bytes):
        raise ProtocolError(f"unexpected handshake reply from {conn.peer}")
    if not hmac.compare_digest(reply["mac"], _mac(token, b"server", cnonce, nonce)):
        conn.close()
        raise AuthenticationError(f"{conn.peer} does not know our token; refusing to talk to it")
    conn.set_authenticated()
