"""Connections: one interface, three transports (TCP, Unix sockets, in-memory), authenticated on open.

A :class:`Connection` sends and receives whole messages (``dict``s, see ``frames.py``).  ``send`` is a
coroutine that writes small frames immediately and large ones in chunks, awaiting the transport's
flow control, so a huge buffer is never duplicated into the transport's write buffer.  ``recv``
returns the next message or raises :class:`ConnectionLostError` once the peer is gone; a malformed
frame raises :class:`ProtocolError` there and closes this connection only.

Addresses are ``tcp://host:port``, ``tls://host:port`` (TCP inside TLS, see ``tls.py``; the token
handshake still runs inside it), ``unix:///path`` (a Unix socket on this machine, see ``unix.py``:
the same stream code as TCP, plain only) or ``memory://name`` (in-process: tests, and the client of an
in-process ``LocalCluster``; messages still go through the frame encoder/decoder, so the bytes and
limits are those of the sockets).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import itertools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from tidepool.comm import accept_errors, unix
from tidepool.comm.admission import PLAIN_PREAMBLE, TLS_HANDSHAKE_RECORD, PendingTable
from tidepool.comm.auth import HANDSHAKE_TIMEOUT, client_handshake, server_handshake
from tidepool.comm.frames import (
    DEFAULT_MAX_FRAME,
    PREAUTH_MAX_FRAME,
    FrameDecoder,
    encode,
    frame_size,
)
from tidepool.comm.tls import TLSConfig
from tidepool.comm.tls import resolve as resolve_tls
from tidepool.errors import (
    CommError,
    ConfigError,
    ConnectionLostError,
    FrameTooLargeError,
    PeerSilentError,
    ProtocolError,
)

log = logging.getLogger("tidepool.comm")

WRITE_CHUNK = 4 * 1024 * 1024
TLS_HANDSHAKE_TIMEOUT = 10.0
SMALL_FRAME = 256 * 1024
#: messages a client or peer may have waiting unread on a scheduler's or worker's connection before
#: its socket is no longer read (:meth:`Connection.limit_inbox`): its own writes back up instead
PEER_INBOX = 1024
#: ... or this many bytes of them
PEER_INBOX_BYTES = 64 * 1024 * 1024


def parse_address(address: str) -> tuple[str, str, int]:
    """Split ``tcp://host:port`` -> ("tcp", host, port) (``tls://`` alike); ``memory://name`` ->
    ("memory", name, 0); ``unix:///path`` -> ("unix", "/path", 0)."""
    if "://" not in address:
        address = "tcp://" + address
    scheme, rest = address.split("://", 1)
    if scheme == "memory":
        return scheme, rest, 0
    if scheme == "unix":
        if not rest:
            raise ConfigError(f"address {address!r} needs a socket path, e.g. unix:///tmp/tidepool.sock")
        return scheme, rest, 0
    if scheme not in ("tcp", "tls"):
        raise ConfigError(f"unsupported address scheme {scheme!r} in {address!r}; use tcp://host:port, "
                          "tls://host:port or unix:///path")  # fmt: skip
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address {address!r} needs a port, e.g. tcp://127.0.0.1:8786")
    if int(port) > 65535:
        raise ConfigError(f"port {int(port)} in {address!r} is out of range: a port is 0-65535 (0: any free one)")
    return scheme, host.strip("[]") or "0.0.0.0", int(port)


class Connection:
    """A message connection.  Subclasses provide the transport."""

    peer: str = "?"

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._max_frame_after_auth = max_frame
        self._decoder = FrameDecoder(self._on_frame, PREAUTH_MAX_FRAME, one_frame_before_auth=True)
        self._inbox: collections.deque[Any] = collections.deque()
        self._waiters: set[asyncio.Future[None]] = set()
        self._error: BaseException | None = None
        self._closed = False
        self.authenticated = False
        self.info: dict[str, Any] = {}
        self.last_received = 0.0  # loop time when bytes last arrived (TCP); 0 = never
        self._inbox_high = 0  # read no more from the socket while this many messages wait (0: no limit)
        self._inbox_sizes: collections.deque[int] = collections.deque()  # (with a limit) bytes of each
        self._inbox_bytes = 0
        self._reading_paused = False

    # -- receiving --------------------------------------------------------------------------------
    def limit_inbox(self, high: int, high_bytes: int = PEER_INBOX_BYTES) -> None:
        """Stop reading from the socket while ``high`` messages, or ``high_bytes`` of them, wait
        unread, and read again once a quarter of each is left: a peer that sends faster than this
        side handles (and never reads what it is sent) fills its own socket, not this process's
        memory (a review padded its requests: 1,024 messages of 256 KiB held 256 MiB)."""
        self._inbox_high = high
        self._inbox_high_bytes = high_bytes
        self._inbox_sizes = collections.deque(0 for _ in self._inbox)
        self._inbox_bytes = 0

    def _on_frame(self, msg: Any) -> None:
        self._inbox.append(msg)
        if self._inbox_high:
            size = self._decoder.last_size
            self._inbox_sizes.append(size)
            self._inbox_bytes += size
            if not self._reading_paused and (len(self._inbox) >= self._inbox_high
                                             or self._inbox_bytes >= self._inbox_high_bytes):  # fmt: skip
                self._reading_paused = self._pause_reading()
        self._wake()

    def _took(self) -> None:
        """One message was taken from the inbox (with a limit set)."""
        self._inbox_bytes -= self._inbox_sizes.popleft()
        if self._reading_paused and len(self._inbox) <= self._inbox_high // 4 \
                and self._inbox_bytes <= self._inbox_high_bytes // 4:  # fmt: skip
            self._reading_paused = False
            self._resume_reading()

    def _pause_reading(self) -> bool:
        """Stop reading from the transport; whether it could (an in-memory peer cannot be paused)."""
        return False

    def _resume_reading(self) -> None:
        pass

    def _wake(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._closed = True
        self._wake()

    async def recv(self) -> Any:
        if not self._inbox and self._decoder.holding and not self._closed:
            self._resume()
        while not self._inbox:
            if self._error is not None or self._closed:
                err = self._error
                if isinstance(err, ProtocolError):
                    raise err
                raise ConnectionLostError(f"connection to {self.peer} closed") from err
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.add(w)
            try:
                await w
            finally:
                self._waiters.discard(w)
        msg = self._inbox.popleft()
        if self._inbox_high:
            self._took()
        return msg

    def buffered(self) -> bool:
        """Whether a message has already arrived and waits to be read (:meth:`recv` returns it
        without yielding to the event loop)."""
        return bool(self._inbox)

    def unread(self, op: str) -> dict[str, Any] | None:
        """The first ``op`` message that has arrived and was not read yet, or None: after a failed
        send, tells whether the peer had said goodbye (a ``close``) before the line went down."""
        for msg in self._inbox:
            if isinstance(msg, dict) and msg.get("op") == op:
                return msg
        return None

    def recv_buffered(self, op: str) -> Any:
        """The next message if it has already arrived and is an ``op`` message, else None (nothing
        taken): lets a reader handle a run of like messages read in one go as one batch."""
        inbox = self._inbox
        if inbox and isinstance(inbox[0], dict) and inbox[0].get("op") == op:
            msg = inbox.popleft()
            if self._inbox_high:
                self._took()
            return msg
        return None

    async def recv_unless_silent(self, idle: float) -> Any:
        """:meth:`recv`, but give up (closing this connection) once the peer has sent nothing at
        all for ``idle`` seconds: a frozen or partitioned peer never closes its socket, so without
        this a reader waits for as long as the peer is gone.  A slow peer that keeps sending bytes
        (a large value in transit) is not silent."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = loop.create_task(self.recv())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=idle)
                if done:
                    return task.result()
                if loop.time() - max(self.last_received, started) >= idle:
                    self.close()
                    raise PeerSilentError(f"{self.peer} sent nothing for {idle:g}s (frozen, or cut off "
                                          "from us by the network)")  # fmt: skip
        finally:
            # this reader may be cancelled in the turn its read ended with an error (the connection
            # closed): that error is read here, or asyncio logs "Task exception was never retrieved"
            task.add_done_callback(_retrieve)
            if not task.done():
                task.cancel()

    def set_authenticated(self) -> None:
        self.authenticated = True
        self._decoder.allow_pickles = True
        self._decoder.max_frame = self._max_frame_after_auth
        self._resume()

    def _resume(self) -> None:
        try:
            self._decoder.resume()
        except ProtocolError as exc:
            log.warning("closing connection to %s: %s", self.peer, exc)
            self._fail(exc)
            self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_frame(self) -> int:
        """The largest frame this side accepts once authenticated (peers use the same default)."""
        return self._max_frame_after_auth

    # -- sending (transport specific) ---------------------------------------------------------------
    async def send(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        """Write ``msg`` now, before returning, if it is small and nothing is queued; else False
        (and nothing was written: use :meth:`send`)."""
        return False

    def close(self) -> None:
        raise NotImplementedError

    def _encode(self, msg: dict[str, Any]) -> list[bytes | memoryview]:
        if self._closed:
            raise ConnectionLostError(f"connection to {self.peer} is closed")
        parts = encode(msg, allow_pickles=self.authenticated)
        if self.authenticated:
            size = frame_size(parts)
            if size > self._max_frame_after_auth:  # the peer would refuse it and drop the connection
                raise FrameTooLargeError(
                    f"a {msg.get('op', '?')!r} message of {size:,} bytes is over the {self._max_frame_after_auth:,}"
                    "-byte frame limit; it was not sent and the connection stays open. Send less at once, "
                    "or raise TIDEPOOL_MAX_FRAME_BYTES (the same on every process)"
                )
        return parts


class _TCPProtocol(asyncio.BufferedProtocol):
    def __init__(self, conn: TCPConnection) -> None:
        self.conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn._made(transport)  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.conn.last_received = asyncio.get_running_loop().time()
        try:
            self.conn._decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            log.warning("closing connection to %s: %s", self.conn.peer, exc)
            self.conn._fail(exc)
            self.conn.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._fail(ConnectionLostError(f"connection to {self.conn.peer} lost: {exc}"))
        self.conn._resume_writing()

    def pause_writing(self) -> None:
        self.conn._paused = True

    def resume_writing(self) -> None:
        self.conn._resume_writing()


class TCPConnection(Connection):
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(max_frame)
        self.transport: asyncio.Transport | None = None
        self.local_host = ""
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._send_lock = asyncio.Lock()
        self._made_event = asyncio.Event()

    async def wait_made(self, timeout: float) -> bool:
        """Wait until the transport is up (after the TLS handshake on tls://); False if it never is."""
        if self.transport is not None:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._made_event.wait()
        except TimeoutError:
            return False
        return self.transport is not None

    def _made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._made_event.set()
        transport.set_write_buffer_limits(high=8 * 1024 * 1024)
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple) and local:  # (a Unix socket's name is a path, or empty)
            self.local_host = str(local[0])
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if isinstance(peer, tuple) and peer:
            self.peer = f"tcp://{peer[0]}:{peer[1]}"
        elif isinstance(peer, str | bytes):  # a Unix socket: its name, and the process at the other end
            name = peer or local
            name = name.decode(errors="replace") if isinstance(name, bytes) else name
            pid = unix.peer_pid(sock)
            self.peer = f"unix://{name.replace(chr(0), '@')}" + (f" (pid {pid})" if pid else "")
        if sock is not None:
            import socket

            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _pause_reading(self) -> bool:
        if self.transport is None or self._closed:
            return False
        with contextlib.suppress(RuntimeError, AttributeError):  # closing, or a transport without it
            self.transport.pause_reading()
            return True
        return False

    def _resume_reading(self) -> None:
        if self.transport is not None and not self._closed:
            with contextlib.suppress(RuntimeError, AttributeError):
                self.transport.resume_reading()

    def _resume_writing(self) -> None:
        self._paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    async def _wait_drain(self) -> None:
        while self._paused and not self._closed:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain
        if self._closed:
            raise ConnectionLostError(f"connection to {self.peer} closed while sending")

    def _check_transport(self) -> None:
        # a transport that failed a write is closing before connection_lost runs: writing more
        # would only make asyncio log "socket.send() raised exception." for every message
        if self.transport is None or self.transport.is_closing():
            self._closed = True
            raise ConnectionLostError(f"connection to {self.peer} is closing")

    async def send(self, msg: dict[str, Any]) -> None:
        parts = self._encode(msg)
        self._check_transport()
        assert self.transport is not None
        if len(parts) == 1 and len(parts[0]) <= SMALL_FRAME and not self._paused and not self._send_lock.locked():
            self.transport.write(parts[0])
            return
        async with self._send_lock:
            for part in parts:
                view = memoryview(part).cast("B")
                for off in range(0, view.nbytes, WRITE_CHUNK):
                    await self._wait_drain()
                    self._check_transport()
                    self.transport.write(view[off : off + WRITE_CHUNK])
            await self._wait_drain()
            if self.transport.is_closing():
                raise ConnectionLostError(f"connection to {self.peer} closed while sending")

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        if self._paused or self._send_lock.locked() or self.transport is None:
            return False
        parts = self._encode(msg)
        self._check_transport()
        if len(parts) != 1 or len(parts[0]) > SMALL_FRAME:
            return False
        self.transport.write(parts[0])
        return True

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            if self._paused:  # the peer stopped reading: a graceful close would wait for it for ever
                self.transport.abort()
            else:
                self.transport.close()
        self._made_event.set()
        self._wake()
        self._resume_writing()


class MemoryConnection(Connection):
    """In-process connection; frames are encoded and decoded like on TCP."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(max_frame)
        self.other: MemoryConnection | None = None

    async def send(self, msg: dict[str, Any]) -> None:
        self.send_nowait(msg)
        await asyncio.sleep(0)

    def send_nowait(self, msg: dict[str, Any]) -> bool:
        parts = self._encode(msg)
        other = self.other
        if other is None or other._closed:
            raise ConnectionLostError(f"connection to {self.peer} closed")
        try:
            for part in parts:
                other._decoder.feed(part)
        except ProtocolError as exc:
            other._fail(exc)
            other.close()
        return True

    def close(self) -> None:
        if self._closed and (self.other is None or self.other._closed):
            return
        self._closed = True
        self._wake()
        if self.other is not None and not self.other._closed:
            self.other._fail(ConnectionLostError("peer closed"))


Handler = Callable[[Connection], Awaitable[None]]


#: connections allowed to be pending (not yet authenticated) at once, and from one source address;
#: past either limit the oldest pending connection gives way (see ``admission.py``)
MAX_PENDING_HANDSHAKES = 1024
MAX_PENDING_PER_SOURCE = 256
#: connections allowed to be inside a TLS handshake at once (each costs asyncio ~256 KiB of buffers)
MAX_PENDING_TLS = 64
#: ... and from one source address, so one source's ClientHellos cannot push out everyone else's
MAX_PENDING_TLS_PER_SOURCE = 16
#: seconds a pending connection may take once the table is half full (else the handshake timeout)
PRESSURE_DEADLINE = 2.0
#: refused connections logged one by one per minute; the rest are counted in one line
REJECT_LOG_BURST = 10


class Listener:
    """An accepting endpoint; each authenticated connection is handed to ``handler``.

    TCP and TLS share one accept loop: an accepted socket costs a file descriptor and a small task
    until it has sent its first bytes (nothing is allocated for an idle one, TLS included), then a
    TLS ClientHello gets a TLS transport, tidepool's plain preamble a plain one, and a plain peer
    on a TLS port is told so at once instead of waiting for a timeout.
    """

    def __init__(self, address: str, handler: Handler, token: str, max_frame: int,
                 tls: TLSConfig | None = None) -> None:  # fmt: skip
        self.requested = address
        self.tls = tls
        self.handler = handler
        self.token = token
        self.max_frame = max_frame
        self.address = ""
        self._lsock: socket.socket | None = None
        self._ctx: ssl.SSLContext | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # a memory listener's (its peers must share it)
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[Connection] = set()
        self._keys = itertools.count()
        self._pending = PendingTable(MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_SOURCE,
                                     HANDSHAKE_TIMEOUT, PRESSURE_DEADLINE)  # fmt: skip
        self._pending_tls = PendingTable(MAX_PENDING_TLS, MAX_PENDING_TLS_PER_SOURCE, HANDSHAKE_TIMEOUT,
                                         PRESSURE_DEADLINE)  # fmt: skip
        self._refused_other = 0  # refused for what they sent, or because nothing may be pending
        self._reject_window = -1e9
        self._reject_logged = 0
        self._reject_quiet = 0

    @property
    def refused(self) -> int:
        """Connections closed before authenticating: evicted (oldest first), or refused for what
        they sent."""
        return self._pending.evicted + self._refused_other

    @property
    def handshaking(self) -> int:
        """Connections that have not authenticated yet."""
        return len(self._pending)

    async def start(self) -> Listener:
        scheme, host, port = parse_address(self.requested)
        if scheme == "memory":
            name = host or f"anon-{next(_memory_ids)}"
            if name in _memory_listeners:
                raise ConfigError(f"memory://{name} is already listening")
            _memory_listeners[name] = self
            self._loop = asyncio.get_running_loop()
            self.address = f"memory://{name}"
            return self
        if scheme == "unix":
            if self.tls is not None:
                raise ConfigError(f"{self.requested}: Unix sockets are plain; listen on a tls:// address for TLS")
            lsock = self._lsock = unix.bind(host)
            self.address = f"unix://{host}"
            self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(lsock))
            return self
        self._ctx = resolve_tls(self.tls, self.requested).server_context() if scheme == "tls" else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.create_server((host, port), family=family, backlog=1024)
        lsock.setblocking(False)
        self._lsock = lsock
        sockname = lsock.getsockname()
        shown = host if host not in ("0.0.0.0", "") else sockname[0]
        if ":" in shown:
            shown = f"[{shown}]"
        self.address = f"{scheme}://{shown}:{sockname[1]}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(lsock))
        return self

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                if lsock.fileno() < 0:
                    return
                # out of file descriptors: one line per interval with counts, shared with asyncio's
                # own accept paths (comm/accept_errors.py); give closes a chance before trying again
                accept_errors.install(loop).note(exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            source = str(addr[0]) if isinstance(addr, tuple) else str(addr or "unix")
            self._spawn_tcp(sock, source)

    def _spawn_tcp(self, sock: socket.socket, source: str) -> None:
        key = next(self._keys)
        task = asyncio.get_running_loop().create_task(self._admit(key, sock, source))
        # a task cancelled before its first step never runs its body: close the socket here too
        task.add_done_callback(functools.partial(_close_if_cancelled, sock))
        if not self._pending.add(key, source, task.cancel, functools.partial(_has_bytes, sock)):
            self._refused_other += 1
            self._note_rejected(source, f"no connection may be pending (limit {self._pending.limit})")
            task.cancel()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _admit(self, key: int, sock: socket.socket, source: str) -> None:
        """Sniff, secure and authenticate one accepted socket; then serve it."""
        conn: TCPConnection | None = None
        try:
            async with asyncio.timeout(self._pending.deadline()):
                conn = await self._secure(key, sock, source)
                if conn is None:
                    return
                self._conns.add(conn)
                conn.info = await server_handshake(conn, self.token)
        except asyncio.CancelledError:  # evicted, or the listener closes
            self._close(conn, sock)
            raise
        except TimeoutError:
            self._note_rejected(source, "no handshake in time")
            self._close(conn, sock)
            return
        except ConnectionLostError as exc:
            log.info("connection from %s closed during the handshake: %s", source, exc)
            self._close(conn, sock)
            return
        except (CommError, OSError, ssl.SSLError) as exc:
            self._note_rejected(source, exc)
            self._close(conn, sock)
            return
        except Exception as exc:  # noqa: BLE001 - one bad peer must not leave its socket unanswered
            log.warning("connection from %s failed before it was served: %r", source, exc)
            self._close(conn, sock)
            return
        finally:
            self._pending.remove(key)
        await self._run_handler(conn)

    async def _run_handler(self, conn: Connection) -> None:
        """Hand an authenticated connection to the handler; close it when the handler is done."""
        try:
            await self.handler(conn)
        except ConnectionLostError:
            pass
        except Exception:
            log.exception("handler for %s failed", conn.peer)
        finally:
            conn.close()
            self._conns.discard(conn)

    def _close(self, conn: TCPConnection | None, sock: socket.socket) -> None:
        """Drop a connection that was never served, at once.  If a transport owns the socket it is
        aborted, which unregisters the descriptor from the loop before closing it: closing the
        socket under the transport left the descriptor registered, and every later socket accepted
        on the same number failed ("File descriptor N is used by transport").  Aborted first, even
        if the handshake closed it already: a TLS close is a goodbye that waits (up to 30 s) for the
        peer's, and a second close leaves nothing for ``abort`` to cut."""
        transport = conn.transport if conn is not None else None
        if transport is not None:
            transport.abort()
        if conn is not None:
            conn.close()
            self._conns.discard(conn)
        if transport is None:
            with contextlib.suppress(OSError):
                sock.close()

    async def _secure(self, key: int, sock: socket.socket, source: str) -> TCPConnection | None:
        """The connection's transport, by its first bytes; None when it was closed instead."""
        loop = asyncio.get_running_loop()
        first = await _peek_first(loop, sock, len(PLAIN_PREAMBLE))
        if not first:
            with contextlib.suppress(OSError):
                sock.close()
            return None
        conn = TCPConnection(self.max_frame)
        self._pending.promote(key)  # it talks: idle sockets give way before it
        if first[0] == TLS_HANDSHAKE_RECORD:
            if self._ctx is None:  # a TLS client on a plain port: its handshake fails at once
                self._refuse(sock, source, "a TLS ClientHello on a plain tcp:// port")
                return None
            tls_key = next(self._keys)
            self._pending_tls.add(tls_key, source, functools.partial(_cancel_current, asyncio.current_task()))
            try:
                await loop.connect_accepted_socket(
                    lambda: _TCPProtocol(conn), sock, ssl=self._ctx, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT
                )
            finally:
                self._pending_tls.remove(tls_key)
            return conn
        if not first.startswith(PLAIN_PREAMBLE):
            self._refuse(sock, source, f"it is not a tidepool peer (first bytes {first!r})")
            return None
        sock.recv(len(PLAIN_PREAMBLE))  # consume the preamble: the frames follow
        await loop.connect_accepted_socket(lambda: _TCPProtocol(conn), sock)
        if self._ctx is not None:  # a plain tidepool peer on a TLS port: say so, then close
            with contextlib.suppress(CommError, OSError):
                await conn.send({"op": "refused", "reason": (
                    f"{self.address} speaks TLS: connect to it as {self.address} with the cluster's "
                    "certificates (tidepool --tls-ca-file/--tls-cert/--tls-key or TLSConfig)")})  # fmt: skip
            self._refused_other += 1
            conn.close()
            return None
        return conn

    def _refuse(self, sock: socket.socket, source: str, why: str) -> None:
        self._refused_other += 1
        self._note_rejected(source, why)
        with contextlib.suppress(OSError):
            sock.close()

    def _note_rejected(self, peer: str, why: object) -> None:
        """Log refused connections without letting a flood of them flood the log: the first
        ``REJECT_LOG_BURST`` per minute one by one, then one count per minute."""
        now = asyncio.get_running_loop().time()
        if now - self._reject_window > 60.0:
            if self._reject_quiet:
                log.warning("%d more connections were refused in the last minute (not logged one by one)",
                            self._reject_quiet)  # fmt: skip
            self._reject_window, self._reject_logged, self._reject_quiet = now, 0, 0
        if self._reject_logged < REJECT_LOG_BURST:
            self._reject_logged += 1
            if isinstance(why, BaseException) and not str(why):  # e.g. a TLS handshake the peer aborted
                why = f"{type(why).__name__} (no message: the peer broke off, e.g. a TLS handshake with another CA)"
            log.warning("rejected connection from %s: %s", peer, why)
        else:
            self._reject_quiet += 1

    def _spawn(self, conn: Connection) -> None:
        """Serve an in-memory connection (TCP ones come through the accept loop)."""
        task = asyncio.get_running_loop().create_task(self._serve_memory(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_memory(self, conn: Connection) -> None:
        self._conns.add(conn)
        try:
            await asyncio.sleep(0)  # let the in-memory peer finish connecting
            try:
                conn.info = await server_handshake(conn, self.token)
            except ConnectionLostError as exc:
                log.info("connection from %s closed during the handshake: %s", conn.peer, exc)
                return
            except (CommError, OSError) as exc:
                self._note_rejected(conn.peer, exc)
                return
            await self._run_handler(conn)
        finally:
            self._conns.discard(conn)
            conn.close()

    async def close(self) -> None:
        _memory_listeners.pop(self.address.removeprefix("memory://"), None)
        if self._accept_task is not None:
            self._accept_task.cancel()
        if self._lsock is not None:
            self._lsock.close()
            if self.address.startswith("unix://"):
                unix.remove(self.address.removeprefix("unix://"))
        for conn in list(self._conns):  # handshaking or serving: close them all first
            conn.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(list(self._tasks), timeout=2)


def _close_if_cancelled(sock: socket.socket, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        with contextlib.suppress(OSError):
            sock.close()


def _has_bytes(sock: socket.socket) -> bool:
    """Has the peer sent anything we have not read yet (without reading it)?"""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _cancel_current(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()


async def _peek_first(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """The first up to ``n`` bytes the peer sent, left in the socket; b"" once it closed.  Waits
    while what arrived is a strict prefix of the plain preamble (it may come in two pieces): the
    peeked bytes keep the socket readable, so it is looked at again after a growing pause (a peer
    that sends one byte and stops would otherwise cost a wake-up every few milliseconds until the
    handshake deadline; a bug hunt held 250 such sockets for half a core)."""
    pause = 0.005
    while True:
        fut: asyncio.Future[None] = loop.create_future()
        fd = sock.fileno()
        loop.add_reader(fd, _set_once, fut)
        try:
            await fut
        finally:
            loop.remove_reader(fd)
        try:
            data = sock.recv(n, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            return b""
        if not data or len(data) >= n or not PLAIN_PREAMBLE.startswith(data):
            return data
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.5)


_memory_listeners: dict[str, Listener] = {}
_memory_ids = itertools.count()


async def listen(
    address: str, handler: Handler, token: str, max_frame: int = DEFAULT_MAX_FRAME,
    tls: TLSConfig | None = None,
) -> Listener:
    """Listen on ``address`` (``tcp://host:0`` picks a free port; ``tls://`` needs ``tls`` or the
    TLS environment); returns the started listener."""
    return await Listener(address, handler, token, max_frame, tls).start()


async def connect(
    address: str,
    token: str,
    timeout: float = 10.0,
    hello: dict[str, Any] | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    retry: bool = True,
    tls: TLSConfig | None = None,
) -> Connection:
    """Open an authenticated connection, retrying refused connections until ``timeout``.

    ``retry=False`` fails at the first refusal: for peers that were up a moment ago (a worker's
    data server), a refused connection means the process is gone and waiting is pointless.
    """
    scheme, host, port = parse_address(address)
    ctx = resolve_tls(tls, address).client_context() if scheme == "tls" else None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.01
    while True:
        try:
            conn: Connection
            if scheme == "memory":
                conn = _memory_connect(host, max_frame)
            else:
                tcp = TCPConnection(max_frame)
                protocol = functools.partial(_TCPProtocol, tcp)
                opening = (_open_unix(loop, protocol, host) if scheme == "unix" else
                           loop.create_connection(protocol, host, port, ssl=ctx,
                                                  server_hostname=host if ctx is not None else None))  # fmt: skip
                await asyncio.wait_for(opening, max(0.1, deadline - loop.time()))
                tcp.peer = address if scheme == "unix" else f"{scheme}://{host}:{port}"
                if ctx is None and tcp.transport is not None:
                    if tcp.transport.is_closing():  # closed at once: what it sent said why, or the peer left
                        if isinstance(tcp._error, ProtocolError):  # e.g. an HTTP answer: not tidepool
                            raise tcp._error
                        raise ConnectionLostError(f"{address} closed the connection as it opened")
                    tcp.transport.write(PLAIN_PREAMBLE)  # tells the listener this is a plain tidepool peer
                conn = tcp
            break
        except ssl.SSLError as exc:  # a certificate problem does not go away by retrying
            raise ConnectionLostError(f"TLS with {address} failed: {exc}; do both sides use certificates "
                                      "from the same CA (and is the other side a tls:// address)?") from exc
        except ProtocolError:  # it answered, but not in tidepool's protocol: retrying cannot help
            raise
        except (TimeoutError, OSError, ConnectionLostError) as exc:
            if ctx is not None and not isinstance(exc, (ConnectionRefusedError, TimeoutError)):
                # connected, then cut off during the TLS handshake: the other side speaks plain TCP
                # or refused our certificate; retrying cannot help
                raise ConnectionLostError(f"TLS with {address} failed: {exc!r}; is it a tls:// address, and "
                                          "does it accept certificates from our CA?") from exc
            if not retry:
                raise ConnectionLostError(f"could not connect to {address}: {exc}") from exc
            if loop.time() + delay > deadline:
                raise ConnectionLostError(
                    f"could not connect to {address} within {timeout:.1f}s ({exc}); is the scheduler "
                    "running and reachable?"
                ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    try:
        await client_handshake(conn, token, hello, tls=ctx is not None)
    except BaseException:
        conn.close()
        raise
    return conn


async def _open_unix(loop: asyncio.AbstractEventLoop, protocol: Callable[[], asyncio.BaseProtocol],
                     path: str) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:  # fmt: skip
    """Connect a Unix socket made here, then hand it to the loop: uvloop's own connect refuses an
    abstract name (``@name``, EINVAL), the standard loop's does not; both take a connected socket.
    A Unix connect never waits: it succeeds, is refused, or finds the listener's accept backlog full
    (EAGAIN), which is retried like a refusal (the loops' ``sock_connect`` took it for "in progress"
    and handed back a socket that was not connected)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        try:
            sock.connect(unix.kernel_name(path))
        except BlockingIOError as exc:
            raise ConnectionRefusedError(errno.EAGAIN, f"{path}: its accept backlog is full") from exc
        return await loop.create_unix_connection(protocol, sock=sock)
    except BaseException:
        sock.close()
        raise


def _memory_connect(name: str, max_frame: int) -> MemoryConnection:
    listener = _memory_listeners.get(name)
    if listener is None:
        raise ConnectionRefusedError(f"nothing listens on memory://{name}")
    if listener._loop is not asyncio.get_running_loop():  # its wake-ups are not thread-safe
        raise ConfigError(f"memory://{name} serves only connections from its own event loop; connect to "
                          "the scheduler's tcp:// (or unix://) address instead")
    a = MemoryConnection(max_frame)
    b = MemoryConnection(listener.max_frame)
    a.other, b.other = b, a
    a.peer, b.peer = f"memory://{name}", f"memory://{name}-client"
    listener._spawn(b)
    return a


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a finished task's outcome that nobody awaits any more (no "never retrieved" log)."""
    if not task.cancelled():
        task.exception()
