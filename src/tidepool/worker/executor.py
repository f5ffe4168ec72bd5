"""Task slots: threads that run task functions and hand results back to the event loop.

State: a queue of lanes (each a deque of work items: one task, or quick tasks that one slot runs
one after another), the open lanes by id, and a list of finished items.  The loop puts work in
with :meth:`SlotPool.submit` / :meth:`SlotPool.submit_lane`; a thread deserialises the arguments,
substitutes dependency values, calls the function (a coroutine function's coroutine is run to its
end on an event loop of the slot's own), times it and appends the outcome to ``done``.
A slot thread takes a lane's next item only when the previous one returned (under the pool's
lock, together with handing in the outcome), so until then the loop can take it back out
(:meth:`SlotPool.unline`: cancelled, stolen, or cut from a lane whose member runs long) and it
never runs here.  The first outcome after the loop last drained schedules one ``on_done`` call on
the loop (coalesced wake-ups) when the lane ends, or every ``WAKE_EVERY`` seconds inside a lane,
so a lane of tiny tasks costs one wake-up and one report message.  :meth:`SlotPool.running_long`
says which lane members have run for a while (the worker reports them started), and
:meth:`SlotPool.members` which ones run now (the worker's lane timer runs while it cares).  Threads are
created on demand up to the number of lanes the worker runs at once (its resources decide that);
:meth:`SlotPool.stop` ends them once their current tasks return (lane members not reached never run).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidepool.comm.serialize import Serialized, deserialize
from tidepool.graph.refs import substitute


@dataclass(slots=True)
class WorkItem:
    key: str
    func: Callable[..., Any]
    payload: Serialized | None
    deps: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    key: str
    ok: bool
    value: Any
    duration: float
    tb: str = ""


class Lane:
    """Work items one slot thread runs in order; ``now``: the one it runs and since when."""

    __slots__ = ("id", "items", "now")

    def __init__(self, lane_id: int | None, items: list[WorkItem]) -> None:
        self.id = lane_id
        self.items = deque(items)
        self.now: tuple[str, float] | None = None


#: inside a lane, wake the loop at least this often (seconds) so progress is reported
WAKE_EVERY = 0.005


class SlotPool:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[], None]) -> None:
        self.loop = loop
        self.on_done = on_done
        self.q: queue.SimpleQueue[Lane | None] = queue.SimpleQueue()
        self.done: list[Outcome] = []
        self.lanes: dict[int, Lane] = {}  # open lanes (not ended by their thread) by id
        self._lock = threading.Lock()
        self._wake_pending = False
        self.threads: list[threading.Thread] = []
        self.busy = 0  # lanes submitted and not ended

    def submit(self, item: WorkItem) -> None:
        self._submit(Lane(None, [item]))

    def submit_lane(self, lane_id: int, items: list[WorkItem]) -> None:
        """Run ``items`` one after another in one slot thread (called in the loop)."""
        lane = Lane(lane_id, items)
        with self._lock:
            self.lanes[lane_id] = lane
        self._submit(lane)

    def _submit(self, lane: Lane) -> None:
        with self._lock:
            self.busy += 1
            more = self.busy > len(self.threads)
        if more:
            t = threading.Thread(target=self._run, name=f"tidepool-slot-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
        self.q.put(lane)

    def unline(self, lane_id: int, keys: tuple[str, ...]) -> list[WorkItem]:
        """Take ``keys`` out of an open lane if its thread has not reached them (called in the loop)."""
        with self._lock:
            lane = self.lanes.get(lane_id)
            if lane is None or not lane.items:
                return []
            ks = set(keys)
            out = [w for w in lane.items if w.key in ks]
            if out:
                lane.items = deque(w for w in lane.items if w.key not in ks)
        return out

    def members(self) -> list[str | None]:
        """The key of the member each open lane's slot runs now (None: it has not taken one yet, or
        is between two)."""
        with self._lock:
            return [cur[0] if (cur := lane.now) is not None else None for lane in self.lanes.values()]

    def running_long(self, seconds: float) -> list[str]:
        """Keys of lane members that have been running for ``seconds`` or more."""
        now = time.perf_counter()
        with self._lock:
            return [cur[0] for lane in self.lanes.values() if (cur := lane.now) is not None and now - cur[1] >= seconds]

    def drain(self) -> list[Outcome]:
        with self._lock:
            out, self.done = self.done, []
            self._wake_pending = False
        return out

    def _run(self) -> None:
        current.key = None
        while True:
            lane = self.q.get()
            if lane is None:
                return
            woke = time.perf_counter()
            with self._lock:
                item = self._next(lane)
            while item is not None:
                lane.now = (item.key, time.perf_counter())
                outcome = run_item(item)
                lane.now = None
                with self._lock:
                    self.done.append(outcome)
                    del outcome  # this thread must not hold the value while it waits for work: once
                    # stored (spilled to disk, even) its memory must go (a 400 MiB result stayed
                    # here, and reading it back passed the worker's limit: restarts for ever)
                    item = self._next(lane)  # taken together with handing the outcome in
                    wake = not self._wake_pending and (item is None or time.perf_counter() - woke >= WAKE_EVERY)
                    if wake:
                        self._wake_pending = True
                if wake:
                    woke = time.perf_counter()
                    try:
                        self.loop.call_soon_threadsafe(self.on_done)
                    except RuntimeError:  # loop closed during shutdown
                        return

    def _next(self, lane: Lane) -> WorkItem | None:
        """The lane's next item, or None and the lane ends (called holding the lock)."""
        if lane.items:
            return lane.items.popleft()
        self.busy -= 1
        if lane.id is not None:
            self.lanes.pop(lane.id, None)
        return None

    def stop(self) -> None:
        """End the slot threads once their current tasks return; lane members not reached never run."""
        with self._lock:
            for lane in self.lanes.values():
                lane.items.clear()
        for _ in self.threads:
            self.q.put(None)


#: the key of the task the current slot thread runs (``tidepool.worker.context`` reads it)
current = threading.local()


def run_item(item: WorkItem) -> Outcome:
    start = time.perf_counter()
    current.key = item.key
    try:
        if item.payload is None:
            args: tuple[Any, ...] = ()
            kwargs: dict[str, Any] = {}
        else:
            args, kwargs = deserialize(item.payload)
            if item.deps:
                args = substitute(args, item.deps)
                kwargs = substitute(kwargs, item.deps)
        value = item.func(*args, **kwargs)
        if type(value) is types.CoroutineType:  # an ``async def`` task: run to its end here, as Dask does
            value = asyncio.run(value)
        return Outcome(item.key, True, value, time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - a task's failure, whatever it is, goes to the client
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Outcome(item.key, False, exc, time.perf_counter() - start, tb)
    finally:
        current.key = None
