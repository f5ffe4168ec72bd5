"""A worker's result store: in memory up to a target, least recently used values spilled to disk.

State: a ``zict.Buffer`` (Dask's spill buffer: an LRU dict in memory over a pickled-file mapping on
local disk), each key's estimated size, and which keys are on disk with how many bytes.  Data
flow: the worker puts every result and fetched replica here and reads task inputs and values to
serve from here; a read of a spilled value loads it back into memory (it was just used) if it fits
under the target without spilling others, else it is read from disk and stays there (no churn).  Writes
that push the in-memory total over ``target`` spill the least recently used values; the memory
monitor asks for more (:meth:`evict`) when the process as a whole is over its spill level.  A value
larger than the target goes straight to disk.  Spilled values still count as held data: the
scheduler sees every key, wherever it is kept.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from tidepool.comm.serialize import Serialized, deserialize, serialize
from tidepool.worker.sizeof import sizeof

_HEADER = struct.Struct("!I")  # number of frames, then one length per frame


def _dump(value: Any) -> list[bytes | memoryview]:
    ser = serialize(value)
    frames: list[bytes | memoryview] = [ser.data if isinstance(ser.data, bytes) else bytes(ser.data), *ser.buffers]
    lengths = struct.pack(f"!{len(frames)}Q", *(memoryview(f).nbytes for f in frames))
    return [_HEADER.pack(len(frames)), lengths, *frames]


def _load(blob: bytes | bytearray | memoryview) -> Any:
    view = memoryview(blob)
    (n,) = _HEADER.unpack_from(view)
    lengths = struct.unpack_from(f"!{n}Q", view, _HEADER.size)
    pos = _HEADER.size + 8 * n
    frames = []
    for length in lengths:
        frames.append(view[pos:pos + length])
        pos += length
    return deserialize(Serialized(bytes(frames[0]), frames[1:]))


class SpillStore(MutableMapping[str, Any]):
    """``store[key] = value`` keeps values in memory up to ``target`` bytes, the rest on disk in
    ``directory`` (removed by :meth:`close`)."""

    def __init__(self, directory: str | Path, target: float) -> None:
        import zict

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sizes: dict[str, int] = {}
        self.on_disk: dict[str, int] = {}
        self._total = 0  # sum of sizes
        self._disk = 0  # sum of on_disk
        self.spilled_total = 0  # bytes ever written to disk (for reports)
        slow = zict.Func(_dump, _load, zict.File(str(self.directory)))  # type: ignore[arg-type]
        self._buf: Any = zict.Buffer({}, slow, n=target, weight=self._weight,
                                     fast_to_slow_callbacks=[self._spilled],
                                     slow_to_fast_callbacks=[self._unspilled])  # fmt: skip

    def _weight(self, key: str, value: Any) -> int:
        return self.sizes.get(key) or sizeof(value)

    def _spilled(self, key: str, value: Any) -> None:
        nb = self.sizes.get(key, 0)
        self._disk += nb - self.on_disk.get(key, 0)
        self.on_disk[key] = nb
        self.spilled_total += nb

    def _unspilled(self, key: str, value: Any) -> None:
        self._disk -= self.on_disk.pop(key, 0)

    @property
    def target(self) -> float:
        return float(self._buf.n)

    @property
    def memory_bytes(self) -> int:
        """Estimated bytes of the values held in memory."""
        return self._total - self._disk

    @property
    def spilled_bytes(self) -> int:
        return self._disk

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value, sizeof(value))

    def put(self, key: str, value: Any, nbytes: int) -> None:
        """Store ``value`` whose size the caller has already estimated (``sizeof`` once)."""
        if key in self.sizes:
            del self[key]
        nb = self.sizes[key] = nbytes
        self._total += nb
        self._buf[key] = value

    def __getitem__(self, key: str) -> Any:
        if key in self.on_disk and self.memory_bytes + self.on_disk[key] > self.target:
            # reading it back would only spill others (and write it again later): read it from disk
            # and leave it there; the caller's copy lives as long as the caller needs it
            return self._buf.slow[key]
        return self._buf[key]

    def __delitem__(self, key: str) -> None:
        del self._buf[key]
        self._total -= self.sizes.pop(key, 0)
        self._disk -= self.on_disk.pop(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.sizes))

    def __len__(self) -> int:
        return len(self.sizes)

    def evict(self, nbytes: int) -> int:
        """Spill least recently used in-memory values until about ``nbytes`` are written (or none
        are left in memory); returns the bytes spilled."""
        done = 0
        fast = self._buf.fast
        while done < nbytes and len(fast):
            try:
                _, _, weight = fast.evict()
            except Exception:  # noqa: BLE001 - the disk refused (full?): keep the rest in memory
                break
            done += int(weight)
        return done

    def close(self) -> None:
        self._buf.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["SpillStore"]
