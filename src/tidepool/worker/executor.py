"""Task slots: threads that run task functions and hand results back to the event loop.

State: a queue of entries (each a list of work items: one task, or a batch of quick tasks that
run one after another in one slot) and a list of finished items.  The loop puts work in with
:meth:`SlotPool.submit` / :meth:`SlotPool.submit_batch`; a thread deserialises the arguments,
substitutes dependency values, calls the function, times it and appends the outcome to ``done``.
The first outcome after the loop last drained schedules one ``on_done`` call on the loop (coalesced
wake-ups); inside a batch the loop is woken at its end or every ``WAKE_EVERY`` seconds, so a batch
of tiny tasks costs one wake-up and one report message.  Threads are created on demand up to the
number of entries the worker runs at once (its resources decide that).  A task that secedes hands
the rest of its batch back (:meth:`SlotPool.detach_rest`), so nothing waits behind it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
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
    last: bool = True  # the last outcome of its queue entry (the entry's thread is free again)


#: inside a batch, wake the loop at least this often (seconds) so progress is reported
WAKE_EVERY = 0.005


class SlotPool:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[], None]) -> None:
        self.loop = loop
        self.on_done = on_done
        self.q: queue.SimpleQueue[list[WorkItem] | None] = queue.SimpleQueue()
        self.done: list[Outcome] = []
        self._lock = threading.Lock()
        self._wake_pending = False
        self.threads: list[threading.Thread] = []
        self.busy = 0

    def submit(self, item: WorkItem) -> None:
        self.submit_batch([item])

    def submit_batch(self, items: list[WorkItem]) -> None:
        """Run ``items`` one after another in one slot thread (called in the loop)."""
        self.busy += 1
        if self.busy > len(self.threads):
            t = threading.Thread(target=self._run, name=f"tidepool-slot-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
        self.q.put(items)

    def drain(self) -> list[Outcome]:
        with self._lock:
            out, self.done = self.done, []
            self._wake_pending = False
        self.busy -= sum(1 for o in out if o.last)
        return out

    @staticmethod
    def detach_rest() -> list[WorkItem]:
        """Called in a task's own thread: the tasks queued behind it in its batch, taken out (the
        caller submits them again, so they do not wait for this task)."""
        batch: list[WorkItem] | None = getattr(current, "batch", None)
        if not batch:
            return []
        i = current.index
        rest = batch[i + 1 :]
        del batch[i + 1 :]
        return rest

    def _run(self) -> None:
        while True:
            batch = self.q.get()
            if batch is None:
                return
            current.batch = batch
            woke = time.perf_counter()
            i = 0
            while i < len(batch):
                current.index = i
                outcome = run_item(batch[i])
                i += 1
                outcome.last = i >= len(batch)  # (a seceding task may have cut the batch short)
                with self._lock:
                    self.done.append(outcome)
                    wake = not self._wake_pending and (outcome.last or time.perf_counter() - woke >= WAKE_EVERY)
                    if wake:
                        self._wake_pending = True
                if wake:
                    woke = time.perf_counter()
                    try:
                        self.loop.call_soon_threadsafe(self.on_done)
                    except RuntimeError:  # loop closed during shutdown
                        return
            current.batch = None

    def stop(self) -> None:
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
        return Outcome(item.key, True, value, time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - a task's failure, whatever it is, goes to the client
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Outcome(item.key, False, exc, time.perf_counter() - start, tb)
    finally:
        current.key = None
