"""User payloads: pickle protocol 5 with out-of-band buffers; cloudpickle when pickle cannot.

A :class:`Serialized` holds the pickle stream (small: it references the buffers) and the list of
out-of-band buffers (large: numpy arrays, bytes-likes) exactly as pickle handed them out, so a
200 MB array travels as one memoryview of its own memory and is never joined into a bigger bytes
object.  Whoever only forwards a payload (the scheduler forwarding a task's arguments) never
unpickles it: user modules need not be importable there, and nothing runs on deserialisation
outside the worker/client that needs the value.

:func:`dumps` tries the standard (C) pickler first: it is 3-5x faster than cloudpickle on pandas
frames and the dicts of frames a shuffle moves.  cloudpickle is used when pickle refuses (lambdas,
local functions), when the stream names ``__main__`` (defined in the client's script, which a
worker cannot import), and whenever modules are registered with
``cloudpickle.register_pickle_by_value``; the streams load alike with ``pickle.loads``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle


class Serialized:
    """An opaque pickled object: ``data`` (the pickle stream) plus out-of-band ``buffers``."""

    __slots__ = ("data", "buffers")

    def __init__(self, data: bytes | memoryview, buffers: Sequence[memoryview] | None = None) -> None:
        self.data = data
        self.buffers: Sequence[memoryview] = buffers or ()  # one shared empty tuple, not a list each

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(b.nbytes for b in self.buffers)

    def load(self) -> Any:
        return deserialize(self)

    def __repr__(self) -> str:
        return f"<Serialized {self.nbytes} bytes, {len(self.buffers)} buffers>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Serialized):
            return NotImplemented
        return bytes(self.data) == bytes(other.data) and [bytes(b) for b in self.buffers] == [
            bytes(b) for b in other.buffers
        ]

    __hash__ = None  # type: ignore[assignment]


#: Buffers smaller than this are kept inside the pickle stream (cheaper than a separate frame part).
OOB_THRESHOLD = 64 * 1024


def serialize(obj: Any) -> Serialized:
    """Pickle ``obj`` (see :func:`dumps`); large contiguous buffers stay out of band (no copy)."""
    buffers: list[memoryview] = []

    def callback(buf: pickle.PickleBuffer) -> bool:
        try:
            view = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if view.nbytes < OOB_THRESHOLD:
            return True  # serialise in-band
        buffers.append(view)
        return False

    data = dumps(obj, callback, buffers.clear)
    return Serialized(data, buffers)


def dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None,
          discard: Callable[[], None] | None = None) -> bytes:  # fmt: skip
    """``obj`` pickled with protocol 5: by the standard pickler, or by cloudpickle where that is
    needed (see the module docstring).  ``discard`` is called before cloudpickle starts again, to
    drop the buffers ``buffer_callback`` kept from the abandoned attempt."""
    if not cloudpickle.list_registry_pickle_by_value():
        try:
            data = pickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)
        except Exception:  # noqa: BLE001 - pickle refuses what cloudpickle can do (lambdas, ...)
            data = None
        if data is not None and b"__main__" not in data:
            return data
        if discard is not None:
            discard()
    return cloudpickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)


def deserialize(ser: Serialized) -> Any:
    """Re-create the object; out-of-band buffers are used in place (numpy arrays wrap them)."""
    return pickle.loads(ser.data, buffers=ser.buffers)
