"""Unix-domain sockets for peers on the same machine: ``unix:///path/to/socket`` addresses.

A ``LocalCluster``'s scheduler listens on one besides its TCP port, and its
own workers and an in-process client connect through it: a message costs the kernel less than on
loopback TCP (no TCP/IP stack, no Nagle or delayed ACK), about 17 µs less per hop one way on the
machine of docs/benchmarks.md, while everything else (frames, the token handshake, flow control,
batching) is the same code as TCP.  No state here: a socket is made in a directory of its own that
only this user may enter (mode 0700), and removed with that directory when the listener closes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile

from tidepool.errors import ConfigError

#: the longest socket path the kernel takes (``sun_path`` is 108 bytes, with its NUL)
MAX_PATH = 107


def private_socket_path(name: str = "scheduler.sock") -> str | None:
    """A fresh path for a listening socket, in a new directory only this user may enter; None when
    the temporary directory's path is too long for a socket (then stay with TCP)."""
    where = tempfile.mkdtemp(prefix="tidepool-")  # created with mode 0700
    path = os.path.join(where, name)
    if len(os.fsencode(path)) > MAX_PATH:
        shutil.rmtree(where, ignore_errors=True)
        return None
    return path


def bind(path: str) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path`` (which must not exist)."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise ConfigError(f"unix socket path {path!r} is longer than {MAX_PATH} bytes; use a shorter one")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def remove(path: str) -> None:
    """Remove a socket made by :func:`bind`, and its directory when :func:`private_socket_path`
    made that (its name starts with ``tidepool-`` and nothing else is left in it)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    where = os.path.dirname(path)
    if os.path.basename(where).startswith("tidepool-"):
        with contextlib.suppress(OSError):
            os.rmdir(where)
