"""Task slots: threads that run task functions and hand results back to the event loop.

State: a queue of work items and a list of finished items.  The loop puts work in with
:meth:`SlotPool.submit`; a thread deserialises the arguments, substitutes dependency values, calls
the function, times it and appends the outcome to ``done``.  The first outcome after the loop last
drained schedules one ``on_done`` call on the loop (coalesced wake-ups), so 10,000 tiny tasks cost a
handful of loop wake-ups, not 10,000.  Threads are created on demand up to the number of tasks the
worker admits at once (its resources decide that).
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


class SlotPool:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[], None]) -> None:
        self.loop = loop
        self.on_done = on_done
        self.q: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self.done: list[Outcome] = []
        self._lock = threading.Lock()
        self._wake_pending = False
        self.threads: list[threading.Thread] = []
        self.busy = 0

    def submit(self, item: WorkItem) -> None:
        self.busy += 1
        if self.busy > len(self.threads):
            t = threading.Thread(target=self._run, name=f"tidepool-slot-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
        self.q.put(item)

    def drain(self) -> list[Outcome]:
        with self._lock:
            out, self.done = self.done, []
            self._wake_pending = False
        self.busy -= len(out)
        return out

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            outcome = run_item(item)
            with self._lock:
                self.done.append(outcome)
                wake = not self._wake_pending
                self._wake_pending = True
            if wake:
                try:
                    self.loop.call_soon_threadsafe(self.on_done)
                except RuntimeError:  # loop closed during shutdown
                    return

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
