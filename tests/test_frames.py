"""Frame format: encode/decode round trips, incremental decoding, size limits, hostile input.

Everything here drives :class:`tidepool.comm.frames.FrameDecoder` directly (no sockets), through
the same ``get_buffer``/``buffer_updated`` contract the TCP transport uses.
"""

from __future__ import annotations

import pickle
import random
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.comm.frames import (
    DEFAULT_MAX_FRAME,
    EXT_SERIALIZED,
    INLINE_PICKLE,
    LARGE_PART,
    MAX_BUFFERS,
    PREAUTH_MAX_FRAME,
    FrameDecoder,
    encode,
    frame_size,
)
from tidepool.comm.serialize import OOB_THRESHOLD, Serialized, deserialize, serialize
from tidepool.errors import CommError, FrameTooLargeError, ProtocolError

PREFIX = struct.Struct("!II")
LEN = struct.Struct("!Q")
EXT = struct.Struct("!iII")

# -- helpers -------------------------------------------------------------------------------------


def wire(msg: dict[str, Any], allow_pickles: bool = True) -> bytes:
    return b"".join(bytes(p) for p in encode(msg, allow_pickles=allow_pickles))


def raw_frame(header: bytes, buffers: list[bytes] = (), nbuf: int | None = None) -> bytes:  # type: ignore[assignment]
    """A hand-made frame, for input the encoder would never produce."""
    n = len(buffers) if nbuf is None else nbuf
    out = PREFIX.pack(len(header), n) + b"".join(LEN.pack(len(b)) for b in buffers) + header
    return out + b"".join(buffers)


def make_decoder(
    allow_pickles: bool = True, max_frame: int = DEFAULT_MAX_FRAME
) -> tuple[FrameDecoder, list[Any]]:
    out: list[Any] = []
    dec = FrameDecoder(out.append, max_frame if allow_pickles else PREAUTH_MAX_FRAME)
    dec.allow_pickles = allow_pickles
    return dec, out


def feed_like_kernel(dec: FrameDecoder, data: bytes, sizes: list[int]) -> None:
    """Emulate asyncio's BufferedProtocol loop: the "kernel" writes at most ``sizes[i]`` bytes
    (cycling) into whatever buffer ``get_buffer`` offers, then calls ``buffer_updated``."""
    view = memoryview(data)
    i = 0
    while view.nbytes:
        buf = dec.get_buffer(-1)
        assert buf.nbytes > 0, "get_buffer() must never offer an empty buffer (asyncio rejects it)"
        n = min(buf.nbytes, view.nbytes, sizes[i % len(sizes)])
        i += 1
        buf[:n] = view[:n]
        del buf
        view = view[n:]
        dec.buffer_updated(n)


def decode_stream(data: bytes, sizes: list[int] | None = None, **kw: Any) -> list[Any]:
    dec, out = make_decoder(**kw)
    if sizes is None:
        dec.feed(data)
    else:
        feed_like_kernel(dec, data, sizes)
    return out


def typed(x: Any) -> Any:
    """A type-tagged canonical form, so 1 == 1.0 == True cannot hide a type change."""
    if isinstance(x, dict):
        return ("dict", sorted(((repr(typed(k)), typed(v)) for k, v in x.items())))
    if isinstance(x, list):
        return ("list", [typed(v) for v in x])
    if isinstance(x, Serialized):
        return ("ser", bytes(x.data), [bytes(b) for b in x.buffers])
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(x))
    return (type(x).__name__, x)


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


class _Tripwire:
    fired = False

    def __reduce__(self) -> Any:
        return (_fire, ())


def _fire() -> None:
    _Tripwire.fired = True


# sizes around every threshold the encoder/decoder switch on
INTERESTING_SIZES = [
    0,
    1,
    100,
    INLINE_PICKLE - 1,
    INLINE_PICKLE,
    INLINE_PICKLE + 1,
    LARGE_PART - 1,
    LARGE_PART,
    LARGE_PART + 1,
    300_000,
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
keys = st.text(max_size=10) | st.integers(-1000, 1000) | st.binary(max_size=8)


@st.composite
def serialized_values(draw: st.DrawFn) -> Serialized:
    seed = draw(st.integers(0, 2**16))
    data = pattern(seed, draw(st.sampled_from(INTERESTING_SIZES)))
    nbuf = draw(st.integers(0, 4))
    bufs = [
        memoryview(pattern(seed + i + 1, draw(st.sampled_from(INTERESTING_SIZES))))
        for i in range(nbuf)
    ]
    return Serialized(data, bufs)


def values(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
        max_leaves=20,
    )


plain_messages = st.dictionaries(st.text(max_size=10), values(scalars), max_size=6)
messages_with_pickles = st.dictionaries(
    st.text(max_size=10), values(scalars | serialized_values()), max_size=5
)

FAST = settings(
    database=None, deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow]
)
SLOW = settings(
    database=None,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- round trips ---------------------------------------------------------------------------------


@FAST
@given(plain_messages)
def test_plain_message_round_trip_before_and_after_auth(msg: dict[str, Any]) -> None:
    data = wire(msg, allow_pickles=False)
    for allow in (False, True):
        (got,) = decode_stream(data, allow_pickles=allow)
        assert typed(got) == typed(msg)


@SLOW
@given(messages_with_pickles)
def test_message_with_serialized_payloads_round_trips(msg: dict[str, Any]) -> None:
    parts = encode(msg)
    (got,) = decode_stream(b"".join(bytes(p) for p in parts))
    assert typed(got) == typed(msg)


@SLOW
@given(
    st.lists(messages_with_pickles, min_size=1, max_size=4),
    st.lists(st.integers(1, 200_000), min_size=1, max_size=20),
)
def test_random_chunking_gives_identical_messages(
    msgs: list[dict[str, Any]], sizes: list[int]
) -> None:
    stream = b"".join(wire(m) for m in msgs)
    whole = decode_stream(stream)
    chunked = decode_stream(stream, sizes=sizes)
    assert [typed(m) for m in whole] == [typed(m) for m in msgs]
    assert [typed(m) for m in chunked] == [typed(m) for m in msgs]


@settings(database=None, deadline=None, max_examples=40)
@given(st.lists(plain_messages, min_size=1, max_size=4))
def test_byte_by_byte_feeding_gives_identical_messages(msgs: list[dict[str, Any]]) -> None:
    stream = b"".join(wire(m) for m in msgs)
    dec, out = make_decoder(allow_pickles=False)
    for i in range(len(stream)):
        dec.feed(stream[i : i + 1])
    assert [typed(m) for m in out] == [typed(m) for m in msgs]


def test_byte_by_byte_with_large_parts_and_pickles() -> None:
    # every part kind at once: a pickle stream above INLINE_PICKLE, an OOB buffer above LARGE_PART
    # (read "by the kernel" straight into its own bytearray), an empty buffer and a small one.
    ser = Serialized(
        pattern(1, INLINE_PICKLE + 5),
        [memoryview(pattern(2, LARGE_PART + 3)), memoryview(b""), memoryview(b"tiny")],
    )
    msgs = [{"a": 1}, {"op": "x", "v": ser, "tail": [b"\x00" * 10]}, {"b": [ser, 2]}]
    stream = b"".join(wire(m) for m in msgs)
    dec, out = make_decoder()
    for i in range(len(stream)):
        dec.feed(stream[i : i + 1])
    assert [typed(m) for m in out] == [typed(m) for m in msgs]
    assert [typed(m) for m in decode_stream(stream, sizes=[1])] == [typed(m) for m in msgs]


def test_many_frames_in_one_feed_are_all_delivered_in_order() -> None:
    msgs = [{"i": i, "pad": b"x" * (i * 37 % 500)} for i in range(2000)]
    out = decode_stream(b"".join(wire(m) for m in msgs))
    assert out == msgs


def test_serialized_with_large_pickle_stream_and_several_oob_buffers() -> None:
    arrays = [np.arange(20_000, dtype="f8"), np.full((300, 100), 7, dtype="i4"),
              np.frombuffer(bytearray(pattern(3, 100_000)), dtype="u1")]  # fmt: skip
    small = np.arange(10)  # below OOB_THRESHOLD: pickled in band
    obj = {"names": [f"name-{i}" for i in range(5_000)], "arrays": arrays, "small": small}
    ser = serialize(obj)
    assert len(ser.data) > INLINE_PICKLE  # the pickle stream itself travels as a frame buffer
    assert len(ser.buffers) == 3 and all(b.nbytes >= OOB_THRESHOLD for b in ser.buffers)

    parts = encode({"op": "result", "value": ser})
    assert len(parts) == 1 + 1 + 3  # header part, pickle stream, 3 OOB buffers
    # encoding does not copy the OOB buffers: the parts are views of the arrays' own memory
    for part, arr in zip(parts[2:], arrays, strict=True):
        assert np.frombuffer(part, dtype="u1").ctypes.data == arr.ctypes.data
    assert frame_size(parts) == sum(len(bytes(p)) for p in parts)

    stream = b"".join(bytes(p) for p in parts)
    for sizes in (None, [7], [LARGE_PART - 1, 3, 100_000], [1_000_000]):
        (msg,) = decode_stream(stream, sizes=sizes)
        got = msg["value"]
        assert isinstance(got, Serialized) and got == ser
        assert all(not b.readonly for b in got.buffers)
        loaded = got.load()
        assert loaded["names"] == obj["names"]
        np.testing.assert_array_equal(loaded["small"], small)
        for a, b in zip(loaded["arrays"], arrays, strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.flags.writeable  # wraps the received (writable) buffer
            a.flat[0] = 42  # and really is writable


@pytest.mark.parametrize("size", [INLINE_PICKLE - 1, INLINE_PICKLE, INLINE_PICKLE + 1])
def test_pickle_stream_inline_threshold(size: int) -> None:
    ser = Serialized(pattern(size, size))
    parts = encode({"v": ser})
    assert len(parts) == (1 if size <= INLINE_PICKLE else 2)
    (msg,) = decode_stream(b"".join(bytes(p) for p in parts))
    assert msg["v"] == ser


def test_forwarding_a_received_serialized_re_encodes_identically() -> None:
    # the scheduler forwards payloads it received without unpickling them
    ser = serialize({"x": np.arange(50_000), "s": "y" * 20_000})
    (msg,) = decode_stream(wire({"v": ser}))
    (again,) = decode_stream(wire({"w": msg["v"]}))
    assert again["w"] == ser
    np.testing.assert_array_equal(again["w"].load()["x"], np.arange(50_000))


def test_decoding_never_unpickles() -> None:
    _Tripwire.fired = False
    ser = Serialized(pickle.dumps(_Tripwire()))
    (msg,) = decode_stream(wire({"v": ser}))
    assert not _Tripwire.fired
    assert isinstance(msg["v"], Serialized)
    deserialize(msg["v"])  # only an explicit load runs the pickle
    assert _Tripwire.fired


def test_sets_are_encoded_as_lists_and_other_objects_are_refused() -> None:
    (msg,) = decode_stream(wire({"s": {3}, "f": frozenset()}))
    assert msg == {"s": [3], "f": []}
    with pytest.raises(TypeError, match="serialize"):
        encode({"obj": object()})


def test_encoder_refuses_pickles_before_authentication() -> None:
    with pytest.raises(ProtocolError, match="authentication"):
        encode({"v": Serialized(b"\x80\x05N.")}, allow_pickles=False)


# -- size limits ---------------------------------------------------------------------------------


def _msg_of_frame_size(target: int) -> dict[str, Any]:
    """A buffer-less message whose encoded frame is exactly ``target`` bytes."""
    n0 = target - 100
    overhead = frame_size(encode({"p": b"x" * n0})) - n0
    msg = {"p": b"x" * (target - overhead)}
    assert frame_size(encode(msg)) == target
    return msg


def test_preauth_limit_is_exact() -> None:
    ok = wire(_msg_of_frame_size(PREAUTH_MAX_FRAME))
    too_big = wire(_msg_of_frame_size(PREAUTH_MAX_FRAME + 1))
    assert len(decode_stream(ok, allow_pickles=False)) == 1
    with pytest.raises(FrameTooLargeError, match="exceeds the limit"):
        decode_stream(too_big, allow_pickles=False)


def test_preauth_oversize_is_refused_from_the_prefix_alone() -> None:
    # the 8-byte prefix is enough: nothing of the (announced) 1 GiB body is buffered first
    dec, _ = make_decoder(allow_pickles=False)
    with pytest.raises(FrameTooLargeError):
        dec.feed(PREFIX.pack(2**30, 0))


def test_after_auth_frames_above_preauth_limit_pass() -> None:
    msg = {
        "p": b"y" * (PREAUTH_MAX_FRAME * 4),
        "v": Serialized(b"s" * 100, [memoryview(b"b" * 10**6)]),
    }
    (got,) = decode_stream(wire(msg), allow_pickles=True, max_frame=2 * 1024**2)
    assert typed(got) == typed(msg)


@pytest.mark.parametrize("max_frame", [1000, 1024**2])
def test_after_auth_max_frame_applies_to_headers(max_frame: int) -> None:
    ok = wire(_msg_of_frame_size(max_frame))
    assert len(decode_stream(ok, allow_pickles=True, max_frame=max_frame)) == 1
    dec, _ = make_decoder(allow_pickles=True, max_frame=max_frame)
    big = wire(_msg_of_frame_size(max_frame + 1))
    with pytest.raises(FrameTooLargeError):
        dec.feed(big[: PREFIX.size])  # refused before the header is read


def test_after_auth_max_frame_applies_to_buffers() -> None:
    max_frame = 1024**2
    msg = {
        "v": Serialized(
            b"s", [memoryview(b"a" * (max_frame // 2)), memoryview(b"b" * (max_frame // 2))]
        )
    }
    parts = encode(msg)
    dec, _ = make_decoder(allow_pickles=True, max_frame=max_frame)
    # refused as soon as the length table is known, before any buffer byte arrives
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(bytes(parts[0]))
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, CommError)
    assert "max_frame_bytes" in str(info.value)  # tells what to do


def test_length_table_counts_towards_max_frame() -> None:
    max_frame = 1000
    frame = raw_frame(msgpack.packb({}), [b""] * 200)  # 1611 bytes on the wire
    assert len(frame) > max_frame
    with pytest.raises(FrameTooLargeError):
        decode_stream(frame, allow_pickles=True, max_frame=max_frame)


def test_too_many_buffers_is_a_protocol_error() -> None:
    dec, _ = make_decoder(allow_pickles=True)
    with pytest.raises(ProtocolError, match="buffers"):
        dec.feed(PREFIX.pack(10, MAX_BUFFERS + 1))


# -- pre-authentication refusals -----------------------------------------------------------------


def test_an_http_answer_before_authentication_says_it_is_a_web_address() -> None:
    """A client pointed at a dashboard port: before, "frame announces 791752240 buffers"."""
    dec, out = make_decoder(allow_pickles=False)
    with pytest.raises(ProtocolError, match="answered in HTTP.*dashboard"):
        dec.feed(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    assert out == []



def test_frame_with_buffers_before_auth_is_refused_from_the_prefix() -> None:
    frame = wire({"v": Serialized(pattern(4, INLINE_PICKLE + 1))})  # 1 buffer, no ext needed
    dec, out = make_decoder(allow_pickles=False)
    with pytest.raises(ProtocolError, match="before authentication"):
        dec.feed(frame[: PREFIX.size])
    # a hand-made buffers frame whose header holds no ext at all is refused the same way
    with pytest.raises(ProtocolError):
        decode_stream(raw_frame(msgpack.packb({"op": "auth"}), [b"zz"]), allow_pickles=False)
    assert out == []


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(EXT_SERIALIZED, EXT.pack(-1, 0, 0) + pickle.dumps(_Tripwire())),
        msgpack.ExtType(42, b"whatever"),
    ],
    ids=["serialized", "unknown-ext"],
)
def test_ext_types_before_auth_are_refused_and_never_unpickled(ext: msgpack.ExtType) -> None:
    _Tripwire.fired = False
    frame = raw_frame(msgpack.packb({"op": "auth", "nested": [{"v": ext}]}))
    with pytest.raises(ProtocolError, match="ext type"):
        decode_stream(frame, allow_pickles=False)
    assert not _Tripwire.fired


def test_unknown_ext_type_is_refused_after_auth_too() -> None:
    with pytest.raises(ProtocolError):
        decode_stream(raw_frame(msgpack.packb({"v": msgpack.ExtType(42, b"x" * 12)})))


# -- malformed input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [msgpack.packb([1, 2]), msgpack.packb(5), msgpack.packb("op"), msgpack.packb(None),
     msgpack.packb(b"bytes")],
    ids=["list", "int", "str", "nil", "bin"],
)  # fmt: skip
def test_header_that_is_not_a_map_is_a_protocol_error(header: bytes) -> None:
    for allow in (False, True):
        with pytest.raises(ProtocolError, match="must be a map"):
            decode_stream(raw_frame(header), allow_pickles=allow)


@pytest.mark.parametrize(
    "header",
    [
        b"",  # empty header
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb({"a": 1}) + b"\x00",  # trailing data
        msgpack.packb({"a": 1})[:-1],  # truncated
        b"\x81\xa1a\xa2\xff\xfe",  # invalid UTF-8 in a str
        b"\x81\x90\x01",  # a map key that is a list (unhashable)
        b"\xdf\xff\xff\xff\xff",  # map announcing 4 billion entries
        b"\x91" * 5000 + b"\xc0",  # 5000 nested arrays
    ],
    ids=["empty", "c1", "trailing", "truncated", "utf8", "list-key", "huge-map", "deep"],
)
def test_malformed_header_is_a_protocol_error(header: bytes) -> None:
    frame = raw_frame(header)
    for allow in (False, True):
        with pytest.raises(ProtocolError):
            decode_stream(frame, allow_pickles=allow)


@pytest.mark.parametrize(
    "ext_payload, buffers",
    [
        (EXT.pack(3, 0, 0), [b"a"]),  # pickle stream index past the buffers
        (EXT.pack(-1, 0, 2), [b"a"]),  # OOB buffers past the end
        (EXT.pack(-1, 5, 0), []),  # first OOB index past the end
        (b"\x00\x01", []),  # too short for the ext struct
    ],
    ids=["stream-index", "oob-count", "oob-first", "short"],
)
def test_ext_pointing_outside_the_frame_is_a_protocol_error(
    ext_payload: bytes, buffers: list[bytes]
) -> None:
    header = msgpack.packb({"v": msgpack.ExtType(EXT_SERIALIZED, ext_payload)})
    with pytest.raises(ProtocolError):
        decode_stream(raw_frame(header, buffers), allow_pickles=True)


@settings(database=None, deadline=None, max_examples=300)
@given(st.binary(min_size=1, max_size=3000), st.booleans())
def test_garbage_only_ever_raises_protocol_error(garbage: bytes, authenticated: bool) -> None:
    dec, out = make_decoder(allow_pickles=authenticated, max_frame=1024**2)
    try:
        dec.feed(garbage)
    except ProtocolError:
        pass
    for msg in out:  # whatever did decode is a well-formed message
        assert isinstance(msg, dict)


@settings(database=None, deadline=None, max_examples=100)
@given(plain_messages, st.integers(0, 10_000), st.binary(min_size=1, max_size=8))
def test_corrupted_frame_only_ever_raises_protocol_error(
    msg: dict[str, Any], pos: int, noise: bytes
) -> None:
    frame = bytearray(wire(msg))
    pos %= len(frame)
    frame[pos : pos + len(noise)] = noise
    for allow in (False, True):
        dec, _ = make_decoder(allow_pickles=allow, max_frame=1024**2)
        try:
            dec.feed(bytes(frame))
        except ProtocolError:
            pass


def test_http_request_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_stream(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n", allow_pickles=False)


def test_an_announced_2gib_part_costs_what_arrived_not_what_was_announced() -> None:
    """An authenticated peer announces a 2 GiB buffer and sends 1 MiB of it: the receiver holds a
    few MiB, not 2 GiB (the old decoder allocated the announced size at once).  The buffer grows
    as bytes arrive, and a part that does arrive in full is decoded as before."""
    import tracemalloc

    dec, out = make_decoder(max_frame=4 * 1024**3)
    big = 2 * 1024**3
    head = PREFIX.pack(1, 1) + LEN.pack(big) + b"\xc0"  # header: msgpack nil
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        feed_like_kernel(dec, head + bytes(1024 * 1024), [65536])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert out == [] and peak < 16 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB"
    # growing (doubling) as bytes arrive, from any chunking, still yields the exact bytes
    dec2, out2 = make_decoder()
    payload = bytes(range(256)) * (40 * 1024)  # 10 MiB: three doublings from 4 MiB
    frame = wire({"op": "x", "v": serialize(payload)})
    feed_like_kernel(dec2, frame, [1 << 20, 7, 3 << 20])
    assert len(out2) == 1 and out2[0]["v"].load() == payload


def test_encode_after_a_refused_message_and_from_within_a_pack_is_unaffected() -> None:
    """The encoder's packer is kept between messages: a message refused half-way, or one encoded
    while another is being packed (a finalizer that sends), leaves nothing behind in the next."""
    blob = serialize(b"x" * (INLINE_PICKLE + 10))
    with pytest.raises(TypeError):
        encode({"op": "a", "v": [1, blob, object()]})
    with pytest.raises(ProtocolError):
        encode({"op": "b", "v": blob}, allow_pickles=False)
    inner: list[list[bytes | memoryview]] = []

    class Sends(Serialized):  # encodes a message of its own while the outer one is being packed
        __slots__ = ()

        def __init__(self) -> None:
            self.buffers = ()

        @property  # type: ignore[override]
        def data(self) -> bytes:
            inner.append(encode({"op": "inner", "v": serialize(b"y" * (INLINE_PICKLE + 1))}))
            return pickle.dumps("sent")

    outer = encode({"op": "outer", "v": [Sends(), blob]})
    assert inner, "the inner message was encoded during the outer pack"
    assert len(outer) == 2 and len(inner) == 1 and len(inner[0]) == 2
    (got,) = decode_stream(b"".join(bytes(p) for p in outer))
    assert deserialize(got["v"][0]) == "sent"
    assert got["op"] == "outer" and deserialize(got["v"][1]) == b"x" * (INLINE_PICKLE + 10)
    (got,) = decode_stream(b"".join(bytes(p) for p in inner[0]))
    assert got["op"] == "inner" and deserialize(got["v"]) == b"y" * (INLINE_PICKLE + 1)
    assert [bytes(p) for p in encode({"op": "c", "v": 1})] == [bytes(p) for p in encode({"op": "c", "v": 1})]
