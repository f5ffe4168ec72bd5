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

Failures: a write the disk refuses (ENOSPC, EFBIG past ``RLIMIT_FSIZE``, EIO) or one that would pass
``limit`` (the bytes this worker may spill) deletes its partial file and turns spilling off for good
(``disabled`` says why, ``on_disable`` tells the worker once): every value then stays in memory and
the memory monitor's pause and restart levels take over.  A value that cannot be pickled is kept in
memory (``pinned``) and never tried again; neither case ever retries the same key.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

from tidepool.comm.serialize import Serialized, deserialize, serialize
from tidepool.worker import workspace
from tidepool.worker.sizeof import sizeof

log = logging.getLogger("tidepool.worker")

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



class SpillingOff(OSError):
    """A value would be spilled while the spill limit is 0: spilling is off by the user's choice."""

class Unspillable(Exception):
    """``key``'s value cannot be pickled: it stays in memory."""

    def __init__(self, key: str, cause: BaseException) -> None:
        super().__init__(f"{key!r} cannot be pickled for spilling: {type(cause).__name__}: {cause}")
        self.key = key


class Disk(MutableMapping[str, Any]):
    """Pickled values, one file each, in ``directory``; at most ``limit`` bytes in all (0: no
    limit; negative: no spilling at all).  A write that fails or would pass the limit removes its
    partial file and raises ``OSError``; a value that does not pickle raises :class:`Unspillable`."""

    def __init__(self, directory: Path, limit: int = 0) -> None:
        self.directory = directory
        self.limit = limit
        self.files: dict[str, tuple[str, int]] = {}  # key -> (file name, bytes)
        self.used = 0
        self._names = itertools.count()

    def __setitem__(self, key: str, value: Any) -> None:
        self.discard(key)
        try:
            frames = _dump(value)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever pickling raised: the value's own problem
            raise Unspillable(key, exc) from exc
        nbytes = sum(memoryview(f).nbytes for f in frames)
        if self.limit < 0:
            raise SpillingOff(errno.ENOSPC, "the spill limit is 0 (spill_limit=0, --spill-limit 0)")
        if self.limit and self.used + nbytes > self.limit:
            raise OSError(errno.ENOSPC, f"the spill limit of {self.limit:,} bytes would be passed "
                                        f"({self.used:,} used, {nbytes:,} more asked); raise --spill-limit")  # fmt: skip
        path = self.directory / f"{next(self._names)}.spill"
        try:
            with open(path, "wb") as fh:
                fh.writelines(frames)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()  # never leave a partial file behind
            raise
        self.files[key] = (path.name, nbytes)
        self.used += nbytes

    def __getitem__(self, key: str) -> Any:
        name, _ = self.files[key]
        with open(self.directory / name, "rb") as fh:
            buf = bytearray(os.fstat(fh.fileno()).st_size)  # writable: arrays load without a copy
            fh.readinto(buf)
        return _load(buf)

    def __delitem__(self, key: str) -> None:
        name, nbytes = self.files.pop(key)
        self.used -= nbytes
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.directory / name)

    def discard(self, key: str) -> None:
        if key in self.files:
            del self[key]

    def __contains__(self, key: object) -> bool:
        return key in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.files))

    def __len__(self) -> int:
        return len(self.files)


class SpillStore(MutableMapping[str, Any]):
    """``store[key] = value`` keeps values in memory up to ``target`` bytes, the rest on disk in
    ``directory`` (removed by :meth:`close`), at most ``limit`` bytes of it (0: no limit)."""

    def __init__(self, directory: str | Path, target: float, limit: int = 0,
                 on_disable: Callable[[str], Any] | None = None, promote: bool = True) -> None:  # fmt: skip
        import zict

        #: False: a value read from disk stays there (the worker's state decides what is where;
        #: ``target`` is then infinite and values move only through :meth:`spill`)
        self.promote = promote
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sizes: dict[str, int] = {}
        self.on_disk: dict[str, int] = {}
        self._total = 0  # sum of sizes
        self._disk = 0  # sum of on_disk
        self.spilled_total = 0  # bytes ever written to disk (for reports)
        self.disabled = ""  # why spilling is off for good ("" while it is on)
        self.on_disable = on_disable
        #: values that cannot be pickled: kept in memory, never offered to the disk again
        self.pinned: dict[str, Any] = {}
        self.slow = Disk(self.directory, limit)
        self._target = target
        self._buf: Any = zict.Buffer({}, self.slow, n=target, weight=self._weight,
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
        return float(self._target)

    @property
    def memory_bytes(self) -> int:
        """Estimated bytes of the values held in memory."""
        return self._total - self._disk

    @property
    def spilled_bytes(self) -> int:
        return self._disk

    @property
    def limit(self) -> int:
        return self.slow.limit

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value, sizeof(value))

    def put(self, key: str, value: Any, nbytes: int) -> None:
        """Store ``value`` whose size the caller has already estimated (``sizeof`` once)."""
        if key in self.sizes:
            del self[key]
        nb = self.sizes[key] = nbytes
        self._total += nb
        if self.disabled:
            self._buf.fast.set_noevict(key, value)
            return
        try:
            self._buf[key] = value
        except Exception as exc:  # noqa: BLE001 - every key is still held (in memory): see _failed
            self._failed(exc)
            self._spill_to(self._buf.n)

    def _spill_to(self, n: float) -> None:
        """Spill least recently used values until those in memory weigh at most ``n`` (or spilling
        is off); a value that cannot be pickled is pinned in memory, so no key is tried twice."""
        while not self.disabled and self._buf.fast.total_weight > n and len(self._buf.fast):
            try:
                self._buf.fast.evict_until_below_target(n)
                return
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """A spill failed; the key it was for is in memory still (zict guarantees it)."""
        if isinstance(exc, Unspillable):
            value = self._buf.fast.d[exc.key]
            del self._buf[exc.key]
            self.pinned[exc.key] = value
            log.warning("%s; it stays in memory", exc)
        elif isinstance(exc, SpillingOff):  # a setting, not a failed write
            self.disable(exc.strerror or "the spill limit is 0")
        elif isinstance(exc, (OSError, MemoryError)):
            self.disable(f"writing to {self.directory} failed: {exc}")
        else:
            raise exc

    def disable(self, reason: str) -> None:
        """Spill no more (values on disk stay there and are read back as before)."""
        if self.disabled:
            return
        self.disabled = reason
        self._buf.n = math.inf
        log.warning("spilling to disk is off: %s; values stay in memory, and the worker pauses and "
                    "restarts at its memory levels", reason)  # fmt: skip
        if self.on_disable is not None:
            self.on_disable(reason)

    def __getitem__(self, key: str) -> Any:
        if key in self.pinned:
            return self.pinned[key]
        if key in self.on_disk and (not self.promote or self.memory_bytes + self.on_disk[key] > self.target):
            # reading it back would only spill others (and write it again later): read it from disk
            # and leave it there; the caller's copy lives as long as the caller needs it
            return self._buf.slow[key]
        return self._buf[key]

    def __delitem__(self, key: str) -> None:
        if self.pinned.pop(key, _NONE) is _NONE:
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
        while done < nbytes and len(fast) and not self.disabled:
            try:
                _, _, weight = fast.evict()
            except Exception as exc:  # noqa: BLE001 - the disk refused, or the value does not pickle
                self._failed(exc)
                continue
            done += int(weight)
        return done

    def spill(self, keys: Iterable[str]) -> list[str]:
        """Move ``keys`` (held in memory) to disk; returns those that stay in memory (they do not
        pickle, or the disk refused and spilling is off now: see :attr:`disabled`)."""
        stayed = []
        fast = self._buf.fast
        for k in keys:
            if k not in fast.d:
                continue  # on disk already, pinned, or gone
            if self.disabled:
                stayed.append(k)
                continue
            try:
                fast.evict(k)
            except Exception as exc:  # noqa: BLE001 - the disk refused, or the value does not pickle
                self._failed(exc)
                stayed.append(k)
        return stayed

    def close(self) -> None:
        """Forget every value and remove the spill directory (before whatever contains it goes)."""
        import zict

        self.pinned.clear()
        self.sizes.clear()
        self.on_disk.clear()
        self._total = self._disk = 0
        self.disabled = self.disabled or "the store is closed"
        # a late write (a task finishing as the worker closes) lands in memory only
        self._buf = zict.Buffer({}, {}, n=math.inf, weight=self._weight)
        self.slow.files.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


_NONE = object()


__all__ = ["SpillStore", "worker_store"]


def worker_store(setup_dir: Path, worker_id: str, spill_dir: str | None, spill_limit: int | str | None,
                 on_disable: Callable[[str], Any]) -> SpillStore:  # fmt: skip
    """A worker's store: values move to disk only when its state says so (``spill``), and stay
    there when read.  Inside the worker's own temp directory by default, so whatever removes that
    (close, exit, the local provider after a SIGKILL) removes spilled values too."""
    spill = setup_dir / ".spill"
    if spill_dir:
        from tidepool.errors import ConfigError

        try:  # created if missing (it failed with a bare "[Errno 2] ... tidepool-w-..." before: a bug hunt)
            os.makedirs(spill_dir, exist_ok=True)
            spill = workspace.claim(worker_id, spill_dir)
        except OSError as exc:
            raise ConfigError(f"--spill-dir {spill_dir!r} (spill_dir=): {exc.strerror or exc}; give a directory "
                              "this worker may create and write to") from exc  # fmt: skip
    return SpillStore(spill, math.inf, resolve_spill_limit(spill_limit, spill), on_disable=on_disable, promote=False)


#: without ``--spill-limit``, a worker may spill up to this fraction of the space free on its spill
#: directory's disk when it starts (workers sharing a disk each take a part of what is left)
DEFAULT_SPILL_FRACTION = 0.5


def resolve_spill_limit(value: int | str | None, directory: str | Path) -> int:
    """Bytes a worker may spill: ``None``/``"auto"`` -> :data:`DEFAULT_SPILL_FRACTION` of the free
    space, ``"25%"`` -> that share of it, ``"10GB"`` -> that many bytes, ``"none"`` -> 0 (no cap),
    0 (or ``"0"``, ``"0B"``) -> -1: no spilling (it was "no cap", which read as the opposite)."""
    from tidepool.errors import ConfigError
    from tidepool.resources import parse_bytes

    text = value.strip().lower() if isinstance(value, str) else value
    if text == "none":
        return 0
    fraction = DEFAULT_SPILL_FRACTION
    if isinstance(text, str) and text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise ConfigError(f"--spill-limit {value!r}: a share of the free disk must be within (0%, 100%]")
    elif text not in (None, "auto"):
        n = parse_bytes(text)  # type: ignore[arg-type]
        return n if n > 0 else -1
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return max(1, int(shutil.disk_usage(path).free * fraction))
