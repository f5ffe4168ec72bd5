"""Frame format: a msgpack header plus raw buffers, and the incremental decoder.

Wire layout of one frame (all integers big-endian)::

    u32 header_len | u32 n_buffers | n_buffers x u64 buffer_len | header | buffer 0 | buffer 1 ...

The header is a msgpack map.  A :class:`~tidepool.comm.serialize.Serialized` value anywhere in the
message becomes msgpack ext type 1 that points at frame buffers: its pickle stream (when larger than
``INLINE_PICKLE``) and its out-of-band buffers.  Ext types are refused before authentication, so an
unauthenticated peer can never make us unpickle anything.

:class:`FrameDecoder` is fed by the transport (``get_buffer``/``buffer_updated``, the
``asyncio.BufferedProtocol`` contract): small parts are parsed out of a staging buffer, and each large
part is read by the kernel straight into its own ``bytearray``, so a 200 MB array is written to
memory once on receipt and then wrapped, not copied, by pickle.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from tidepool.comm.serialize import Serialized
from tidepool.errors import FrameTooLargeError, ProtocolError

_PREFIX = struct.Struct("!II")
_LEN = struct.Struct("!Q")
_EXT = struct.Struct("!iII")  # (pickle-stream buffer index or -1 if inline, first oob index, n oob)
EXT_SERIALIZED = 1
INLINE_PICKLE = 16 * 1024
LARGE_PART = 64 * 1024
#: a large part's buffer starts at this size and doubles as bytes arrive (up to its announced
#: length): a peer that announces 2 GiB and sends nothing costs 4 MiB, not 2 GiB
GROW_FIRST = 4 * 1024 * 1024
#: the staging buffer for small parts starts this small: an unauthenticated connection costs
#: little (it was 256 KiB: 2,000 idle connections held 500 MiB)
STAGING_FIRST = 16 * 1024

#: Limits before authentication: a handshake frame is tiny and carries no buffers.
PREAUTH_MAX_FRAME = 64 * 1024
#: Largest frame accepted after authentication: 4 GiB, or ``$TIDEPOOL_MAX_FRAME_BYTES`` (set it the
#: same for the scheduler, workers and clients); a value over it is refused with its size named.
DEFAULT_MAX_FRAME = int(os.environ.get("TIDEPOOL_MAX_FRAME_BYTES", 4 * 1024**3))
MAX_BUFFERS = 1_000_000


class _Encoder:
    """A kept msgpack ``Packer`` (one per thread: see :func:`encode`).  ``msgpack.packb`` makes a new
    one per call, and its 256 KiB buffer can then be an ``mmap``/``munmap`` pair or a heap trim per
    message wherever ``MALLOC_TRIM_THRESHOLD_`` is set (it fixes glibc's mmap threshold at 128 KiB;
    worker processes set it)."""

    __slots__ = ("packer", "buffers", "allow_pickles", "busy")

    def __init__(self) -> None:
        self.packer = self.new_packer()
        self.buffers: list[bytes | memoryview] = []
        self.allow_pickles = True
        self.busy = False

    def new_packer(self) -> msgpack.Packer:
        return msgpack.Packer(default=self.default, use_bin_type=True)

    def default(self, obj: Any) -> Any:
        if isinstance(obj, Serialized):
            if not self.allow_pickles:
                raise ProtocolError("pickled payloads may only be sent after authentication")
            buffers = self.buffers
            data = obj.data
            if len(data) > INLINE_PICKLE:
                index = len(buffers)
                buffers.append(data)
                inline = b""
            else:
                index = -1
                inline = bytes(data)
            first = len(buffers)
            buffers.extend(obj.buffers)
            return msgpack.ExtType(EXT_SERIALIZED, _EXT.pack(index, first, len(obj.buffers)) + inline)
        if isinstance(obj, (set, frozenset)):
            return list(obj)
        raise TypeError(f"cannot encode {type(obj).__name__} in a control frame; wrap it in serialize()")


#: this thread's encoder (a plain object: attributes of a ``threading.local`` are slow to read,
#: and ``default`` reads them once per pickled value)
_local = threading.local()
#: a header larger than this leaves its packer's grown buffer behind (the thread gets a new packer)
_KEEP_PACKER = 1024 * 1024


def encode(msg: dict[str, Any], allow_pickles: bool = True) -> list[bytes | memoryview]:
    """Encode ``msg`` into frame parts; the first part holds prefix+lengths+header."""
    enc: _Encoder | None = getattr(_local, "encoder", None)
    if enc is None:
        enc = _local.encoder = _Encoder()
    elif enc.busy:  # entered again from within a pack (a finalizer that sends): a packer of its own
        enc = _Encoder()
    enc.busy = True
    buffers: list[bytes | memoryview] = []
    enc.buffers = buffers
    enc.allow_pickles = allow_pickles
    try:
        header = enc.packer.pack(msg)  # resets itself after an error too
    finally:
        enc.buffers = []
        enc.busy = False
    if len(header) > _KEEP_PACKER:
        enc.packer = enc.new_packer()
    head = bytearray(_PREFIX.pack(len(header), len(buffers)))
    for b in buffers:
        head += _LEN.pack(memoryview(b).nbytes)
    head += header
    return [bytes(head), *buffers]


def frame_size(parts: list[bytes | memoryview]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


class FrameDecoder:
    """Incremental frame parser.  ``on_frame(msg)`` is called for each complete frame."""

    def __init__(self, on_frame: Callable[[Any], None], max_frame: int = PREAUTH_MAX_FRAME,
                 one_frame_before_auth: bool = False) -> None:  # fmt: skip
        self.on_frame = on_frame
        self.last_size = 0  # bytes of the frame just decoded (header and buffers), read by on_frame
        self.max_frame = max_frame
        #: connections set this: before authentication, deliver one frame per ``resume()``
        self.one_frame_before_auth = one_frame_before_auth
        self.allow_pickles = False
        self._staging = bytearray(STAGING_FIRST)  # grows (doubling) when a burst needs more
        self._start = 0
        self._end = 0
        # the part being read directly by the kernel, if any
        self._target: bytearray | None = None
        self._target_filled = 0
        self._target_need = 0  # the part's announced length (the buffer grows up to it)
        self._hold = False
        self._reset()

    def _reset(self) -> None:
        self._stage = 0  # 0 prefix, 1 lengths, 2 header, 3 buffers
        self._header_len = 0
        self._nbuf = 0
        self._lengths: list[int] = []
        self._header: bytes | bytearray = b""
        self._buffers: list[memoryview] = []

    # -- BufferedProtocol side -------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._target is not None:
            if self._target_filled == len(self._target):
                self._target = self._grow(self._target)
            return memoryview(self._target)[self._target_filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end >= len(self._staging) - 4096:
            # compact: move unparsed bytes to the front (small: at most one small part)
            n = self._end - self._start
            self._staging[:n] = self._staging[self._start : self._end]  # same size: no resize
            self._start, self._end = 0, n
            if self._end >= len(self._staging) - 4096:
                try:
                    self._staging.extend(bytes(len(self._staging)))
                except BufferError:  # still exported (see _grow): never resize it, use a new one
                    fresh = bytearray(2 * len(self._staging))
                    fresh[:n] = self._staging[:n]
                    self._staging = fresh
        return memoryview(self._staging)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._target_filled += nbytes
            if self._target_filled == self._target_need:
                part = self._target
                self._target = None
                self._part_done(part)
            else:
                return
        else:
            self._end += nbytes
            if self._hold and self._end - self._start > 2 * PREAUTH_MAX_FRAME:
                raise ProtocolError("too much data before authentication finished")
        self._parse()

    def feed(self, data: bytes | memoryview) -> None:
        """Feed raw bytes (used by tests and the in-memory transport)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            buf = self.get_buffer()
            n = min(buf.nbytes, view.nbytes)
            buf[:n] = view[:n]
            view = view[n:]
            del buf  # released before the next get_buffer, which may grow the part
            self.buffer_updated(n)

    # -- parsing ---------------------------------------------------------------------------------
    def _need(self) -> int:
        if self._stage == 0:
            return _PREFIX.size
        if self._stage == 1:
            return _LEN.size * self._nbuf
        if self._stage == 2:
            return self._header_len
        return self._lengths[len(self._buffers)]

    def resume(self) -> None:
        """Parse held-back bytes: all of them once authenticated, else the next frame only."""
        self._hold = False
        self._parse()

    @property
    def holding(self) -> bool:
        return self._hold

    def _parse(self) -> None:
        while self._target is None and not self._hold:
            need = self._need()
            avail = self._end - self._start
            if need >= LARGE_PART:
                n = min(avail, need)
                part = bytearray(max(n, min(need, GROW_FIRST)))
                part[:n] = self._staging[self._start : self._start + n]
                self._start += n
                if n < need:
                    self._target = part
                    self._target_filled = n
                    self._target_need = need
                    return
                self._part_done(part)
                continue
            if avail < need:
                return
            part_b = bytes(self._staging[self._start : self._start + need])
            self._start += need
            self._part_done(part_b)

    def _grow(self, part: bytearray) -> bytearray:
        """``part`` doubled (up to its announced length) once the bytes so far have filled it.

        In place when nothing else holds a view of it, so the kernel keeps reading straight into it
        (a large buffer grows by remapping).  A buffer still exported (a transport, or a traceback
        that outlived its frame, keeps a memoryview of it) is never resized: the filled bytes move
        to a new buffer of the new size instead, and the old one is left to its holder."""
        add = min(self._target_need - len(part), max(len(part), GROW_FIRST))
        # one resize to the exact size (a doubling is a "major upsize" for CPython: no spare room),
        # filled from an anonymous mapping: zero pages, no temporary Python buffer of that size
        with mmap.mmap(-1, add) as zeros:
            try:
                part += zeros
            except BufferError:  # "Existing exports of data: object cannot be re-sized"
                grown = bytearray(len(part) + add)
                grown[: self._target_filled] = memoryview(part)[: self._target_filled]  # no temporary copy
                return grown
        return part

    def _part_done(self, part: bytes | bytearray) -> None:
        if self._stage == 0:
            self._header_len, self._nbuf = _PREFIX.unpack(part)
            if not self.allow_pickles and bytes(part[:5]) == b"HTTP/":  # before authentication only
                raise ProtocolError(
                    f"the peer answered in HTTP ({bytes(part)!r}...), not tidepool's protocol: is this a "
                    "dashboard or other web address?  Connect to the scheduler's address (cluster.address, "
                    "or what `tidepool scheduler` printed), not its dashboard's"
                )
            if self._nbuf > MAX_BUFFERS:
                raise ProtocolError(f"frame announces {self._nbuf} buffers (limit {MAX_BUFFERS})")
            if self._nbuf and not self.allow_pickles:
                raise ProtocolError("frame with buffers before authentication")
            overhead = _PREFIX.size + _LEN.size * self._nbuf
            if self._header_len + overhead > self.max_frame:
                raise FrameTooLargeError(
                    f"frame header of {self._header_len} bytes exceeds the limit of {self.max_frame} "
                    "bytes; raise max_frame_bytes on both sides or send smaller results"
                )
            self._stage = 1 if self._nbuf else 2
        elif self._stage == 1:
            self._lengths = [v[0] for v in _LEN.iter_unpack(part)]
            total = _PREFIX.size + len(part) + self._header_len + sum(self._lengths)
            if total > self.max_frame:
                raise FrameTooLargeError(
                    f"frame of {total} bytes exceeds the limit of {self.max_frame} bytes; raise "
                    "max_frame_bytes on both sides or send smaller results"
                )
            self._stage = 2
        elif self._stage == 2:
            self._header = part
            self._stage = 3
        else:
            self._buffers.append(memoryview(part))
        if self._stage == 3 and len(self._buffers) == self._nbuf:
            msg = self._decode(self._header, self._buffers)
            self.last_size = len(self._header) + sum(b.nbytes for b in self._buffers)
            self._reset()
            if not self.allow_pickles and self.one_frame_before_auth:
                # Before authentication, stop after each frame: the next one may already be
                # sent under the authenticated limits (it waits in the staging buffer, which
                # the pre-auth frame limit keeps small).
                self._hold = True
            self.on_frame(msg)

    def _decode(self, header: bytes | bytearray, buffers: list[memoryview]) -> Any:
        allow = self.allow_pickles

        def ext_hook(code: int, data: bytes) -> Any:
            if code != EXT_SERIALIZED or not allow:
                raise ProtocolError("unexpected ext type (pickles need an authenticated peer)")
            index, first, n = _EXT.unpack_from(data)
            stream: bytes | memoryview = data[_EXT.size :] if index < 0 else buffers[index]
            if first + n > len(buffers) or (index >= len(buffers)):
                raise ProtocolError("ext type points past the frame's buffers")
            return Serialized(stream, list(buffers[first : first + n]))

        try:
            msg = msgpack.unpackb(header, ext_hook=ext_hook, raw=False, strict_map_key=False)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"undecodable frame header: {exc}") from exc
        if not isinstance(msg, dict):
            raise ProtocolError(f"frame header must be a map, got {type(msg).__name__}")
        return msg
