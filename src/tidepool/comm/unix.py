"""Unix-domain sockets for peers on the same machine: ``unix:///path/to/socket`` addresses, and on
Linux ``unix://@name`` for a name in the abstract namespace (no file at all).

A ``LocalCluster``'s scheduler listens on one besides its TCP port, and its own workers connect
through it (its in-process client connects in memory): a message costs the kernel less than on loopback TCP (no
TCP/IP stack), about 17 µs less per one-way hop in an asyncio ping-pong on the machine of
docs/benchmarks.md, while everything else (frames, the token handshake, flow control, batching) is
the same code as TCP.  No state here.  On Linux the scheduler's socket is an abstract name: it
leaves nothing behind however the process ends, and, like a loopback TCP port, any local user may
connect to it and must then pass the token handshake.  Elsewhere it is a file in a fresh directory
only this user may enter (mode 0700, the socket 0600), removed when the listener closes or, failing
that, when the process exits.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile

from tidepool.errors import ConfigError

#: the longest socket name the kernel takes (``sun_path`` is 108 bytes)
MAX_PATH = 107
#: directories made by :func:`private_socket_path` in this process (removed with their socket)
_made: set[str] = set()


def private_socket_path(abstract: bool | None = None) -> str | None:
    """A fresh name for a listening socket: ``@tidepool-…`` in the abstract namespace (``abstract``;
    the default on Linux), else a path in a new directory only this user may enter.  None when no
    such path is short enough for a socket (then stay with TCP).  Raises ``OSError`` when the
    directory cannot be made."""
    if abstract is None:
        abstract = sys.platform.startswith("linux")
    if abstract:
        return f"@tidepool-{os.getpid()}-{secrets.token_hex(8)}"
    where = tempfile.mkdtemp(prefix="tidepool-")  # created with mode 0700
    path = os.path.join(where, "scheduler.sock")
    if len(os.fsencode(path)) > MAX_PATH:
        shutil.rmtree(where, ignore_errors=True)
        return None
    _made.add(where)
    atexit.register(shutil.rmtree, where, True)  # the process ends without closing the listener
    return path


def kernel_name(path: str) -> str:
    """What ``bind`` and ``connect`` take for ``path`` (``@name``: a NUL first, the abstract namespace)."""
    return "\0" + path[1:] if path.startswith("@") else path


def bind(path: str) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path`` (``@name``: abstract; a file path must not
    exist yet)."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise ConfigError(f"unix socket path {path!r} is longer than {MAX_PATH} bytes; use a shorter one")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(kernel_name(path))
        if not path.startswith("@"):
            os.chmod(path, 0o600)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def remove(path: str) -> None:
    """Remove a socket file made by :func:`bind` (nothing for an abstract name), and its directory
    when :func:`private_socket_path` made that in this process."""
    if path.startswith("@"):
        return
    try:
        os.unlink(path)
    except OSError:
        pass
    where = os.path.dirname(path)
    if where in _made:
        _made.discard(where)
        shutil.rmtree(where, ignore_errors=True)


def peer_pid(sock: socket.socket | None) -> int | None:
    """The process id at the other end of a connected Unix socket (Linux), else None."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if sock is None or opt is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i")))
    except OSError:
        return None
    return pid or None
