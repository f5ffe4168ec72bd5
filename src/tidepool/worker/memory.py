"""A worker's memory limit and what happens as its process nears it.

State: :class:`MemoryThresholds` (fractions of the limit, documented in docs/memory.md) and the
:class:`MemoryMonitor` thread's last and peak RSS.  Data flow: the monitor samples the process's
resident memory every ``interval`` seconds in its own thread (so a busy event loop or a task
holding the loop cannot hide growth), asks the pure :func:`memory_action` what to do, and hands
that to the worker's event loop: spill least recently used results, pause (start no new task),
resume, or terminate (the worker tells the scheduler why and restarts).

The limit comes from ``memory_limit`` (``--memory-limit``), else the worker's ``memory`` resource
(a node type's memory), else the machine's memory divided by ``share``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import psutil

from tidepool.errors import ConfigError
from tidepool.resources import parse_bytes


@dataclass(frozen=True)
class MemoryThresholds:
    """Fractions of the memory limit: results are spilled to disk once the values held in memory
    pass ``target``, or the whole process passes ``spill``; no new task starts above ``pause``; the
    worker restarts above ``terminate``."""

    target: float = 0.6
    spill: float = 0.7
    pause: float = 0.8
    terminate: float = 0.95

    def __post_init__(self) -> None:
        values = (self.target, self.spill, self.pause, self.terminate)
        if not all(0 < v <= 1 for v in values) or list(values) != sorted(values):
            raise ConfigError(f"memory thresholds must rise within (0, 1]: target <= spill <= pause <= terminate, "
                              f"got {values}")  # fmt: skip


class Action(Enum):
    NOTHING = "nothing"
    SPILL = "spill"
    PAUSE = "pause"
    RESUME = "resume"
    TERMINATE = "terminate"


def memory_action(rss: int, limit: int, t: MemoryThresholds, paused: bool) -> Action:
    """What a worker at ``rss`` bytes of ``limit`` does now (pure)."""
    if limit <= 0:
        return Action.NOTHING
    frac = rss / limit
    if frac > t.terminate:
        return Action.TERMINATE
    if frac > t.pause:
        return Action.SPILL if paused else Action.PAUSE
    if paused:
        return Action.RESUME
    if frac > t.spill:
        return Action.SPILL
    return Action.NOTHING


#: the least memory limit a LocalCluster accepts: a worker process (Python, tidepool, its
#: connections) uses tens of MiB before it runs a task, and would restart itself for ever under less
MIN_MEMORY_LIMIT = 64 * 2**20


def resolve_limit(memory_limit: int | str | None, resources: Mapping[str, float], share: int = 1) -> int:
    """Bytes a worker may use: explicit, else its ``memory`` resource, else the machine's / share;
    ``0`` or ``"none"`` means no limit."""
    if isinstance(memory_limit, str) and memory_limit.strip().lower() in ("none", "0"):
        return 0
    if memory_limit not in (None, "auto"):
        return parse_bytes(memory_limit)  # type: ignore[arg-type]
    if resources.get("memory"):
        return int(resources["memory"])
    return int(psutil.virtual_memory().total // max(1, share))


def mib(n: int | float) -> str:
    """``n`` bytes as whole MiB, for messages."""
    return f"{n / 2**20:,.0f} MiB"


def high_water_mark() -> int:
    """The process's peak RSS as the kernel counted it (Linux ``VmHWM``; 0 elsewhere): samples
    can miss a short peak, this cannot."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim_memory() -> None:
    """Give freed memory back to the system: collect cycles, then ask glibc to return free heap
    pages (large values freed from the heap otherwise keep the RSS up, and a paused worker would
    stay paused)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class MemoryMonitor:
    """Samples this process's RSS in a daemon thread and posts actions to ``loop``."""

    def __init__(self, limit: int, thresholds: MemoryThresholds, loop: asyncio.AbstractEventLoop,
                 act: Callable[[Action, int], Any], interval: float = 0.05) -> None:  # fmt: skip
        self.limit = limit
        self.thresholds = thresholds
        self.loop = loop
        self.act = act
        self.interval = interval
        self.paused = False
        self.rss = 0
        self.peak_rss = 0
        self._pending = False  # an action is posted and not handled yet: do not queue more
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, name="tidepool-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> int:
        try:
            rss = int(self._proc.memory_info().rss)
        except psutil.Error:
            return self.rss
        self.rss = rss
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def peak(self) -> int:
        """The highest RSS: sampled, or the kernel's high-water mark (read here, when reported)."""
        return max(self.peak_rss, high_water_mark())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self.sample()
            action = memory_action(rss, self.limit, self.thresholds, self.paused)
            if action is Action.NOTHING or self._pending:
                continue
            if action in (Action.PAUSE, Action.TERMINATE):  # a terminate spilling undoes pauses
                self.paused = True
            elif action is Action.RESUME:
                self.paused = False
            self._pending = True
            try:
                self.loop.call_soon_threadsafe(self._handle, action, rss)
            except RuntimeError:  # the loop is closed: the worker is gone
                return

    def _handle(self, action: Action, rss: int) -> None:
        self._pending = False
        if action is Action.TERMINATE:
            # measured in this thread while the loop may have been spilling (a value just written
            # to disk is freed only when the spill returns): measure again before a restart
            rss = self.sample()
            action = memory_action(rss, self.limit, self.thresholds, self.paused)
            if action is Action.PAUSE:
                self.paused = True
            elif action is Action.RESUME:
                self.paused = False
            if action is Action.NOTHING:
                return
        self.act(action, rss)


__all__ = ["Action", "MemoryMonitor", "MemoryThresholds", "memory_action", "resolve_limit", "trim_memory"]
