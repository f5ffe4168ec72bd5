"""Public test utilities: a fake clock and an inline driver for :class:`SchedulerState`.

``StateDriver`` plays the part of the asyncio shell and of the workers, with no I/O: it feeds events
to a real ``SchedulerState``, keeps every worker's queue of ``Execute`` commands, and lets a test
finish, fail or lose tasks and workers one step at a time, with time that moves only when the test
moves it.  Commands are recorded in ``log`` so tests can assert on them.
"""

from __future__ import annotations

import builtins
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState


def wait_until(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition",
               interval: float = 0.02) -> None:  # fmt: skip
    """Block until ``cond()`` is true; fail after ``timeout`` seconds naming ``what``.

    For integration tests on real processes: a bounded wait on an observable condition, never a
    blind sleep.
    """
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        tick.wait(interval)


def journal_records(path: str | os.PathLike[str], kind: str | None = None) -> builtins.list[dict[str, Any]]:
    """The records of a scheduler's JSON-lines journal (``--journal``) written so far, or only those
    of one ``kind``; none while the file does not exist yet (the scheduler is still starting)."""
    p = Path(path)
    if not p.exists():
        return []
    records = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


class FakeClock:
    """A clock that only moves when told to (``advance``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class StateDriver:
    def __init__(self, state: SchedulerState | None = None, clock: FakeClock | None = None, *,
                 auto_start: bool = True) -> None:  # fmt: skip
        self.state = state or SchedulerState()
        self.clock = clock or FakeClock()
        #: report every assigned task as executing at once (a worker with unlimited slots);
        #: False: tests call :meth:`start` for the tasks a worker really began
        self.auto_start = auto_start
        self.running: dict[str, list[str]] = {}  # worker -> keys it was told to execute
        self.log: list[ev.Command] = []
        self.reports: list[ev.Report] = []
        #: called with (events, commands) after each batch, as ``Scheduler.subscribe`` callbacks are
        self.observers: list[Callable[[list[ev.Event], list[ev.Command]], None]] = []

    def send(self, *events: ev.Event) -> list[ev.Command]:
        cmds = self.state.handle_many(list(events))
        self.log.extend(cmds)
        for observer in self.observers:
            observer(list(events), cmds)
        for c in cmds:
            if isinstance(c, ev.Execute):
                self.running.setdefault(c.worker, []).append(c.key)
            elif isinstance(c, ev.Free):
                q = self.running.get(c.worker, [])
                for k in c.keys:
                    if k in q:
                        q.remove(k)
            elif isinstance(c, ev.Report):
                self.reports.append(c)
            elif isinstance(c, ev.CloseWorker):
                self.running.pop(c.worker, None)
        if self.auto_start:
            started: dict[str, list[str]] = {}
            for c in cmds:
                if isinstance(c, ev.Execute):
                    started.setdefault(c.worker, []).append(c.key)
            for wid, keys in started.items():
                self.state.handle(ev.TasksStarted(wid, keys, self.clock()))
        return cmds

    def start(self, wid: str, *keys: str) -> list[ev.Command]:
        """``wid`` reports that ``keys`` left its queue for a slot (they are executing)."""
        return self.send(ev.TasksStarted(wid, list(keys), self.clock()))

    # ---- shortcuts ------------------------------------------------------------------------------
    def add_worker(self, wid: str, resources: dict[str, float] | None = None, node_type: str = "default",
                   memory_limit: int = 0) -> list[ev.Command]:  # fmt: skip
        self.running.setdefault(wid, [])
        return self.send(ev.WorkerJoin(wid, f"tcp://{wid}:1", resources or {"cpu": 1.0}, self.clock(),
                                       node_type=node_type, memory_limit=memory_limit))  # fmt: skip

    def remove_worker(self, wid: str, graceful: bool = False) -> list[ev.Command]:
        self.running.pop(wid, None)
        return self.send(ev.WorkerRemove(wid, self.clock(), "test", graceful))

    def submit(self, tasks: Iterable[tuple[Any, ...]], wanted: Iterable[str], client: str = "c") -> list[ev.Command]:
        """``tasks``: (key, deps) or (key, deps, resources) or (key, deps, resources, retries)."""
        specs = []
        for t in tasks:
            key, deps = t[0], tuple(t[1])
            res = t[2] if len(t) > 2 else {}
            retries = t[3] if len(t) > 3 else 0
            specs.append(ev.TaskSpec(key, "f", None, deps, res, retries, key.split("-")[0]))
        return self.send(ev.UpdateGraph(client, specs, list(wanted), self.clock()))

    def release(self, keys: Iterable[str], client: str = "c") -> list[ev.Command]:
        return self.send(ev.ReleaseKeys(client, list(keys), self.clock()))

    def finish(self, wid: str, key: str, nbytes: int = 8, duration: float = 0.01) -> list[ev.Command]:
        q = self.running.get(wid, [])
        if key in q:
            q.remove(key)
        return self.send(ev.TaskFinished(wid, key, nbytes, duration, self.clock()))

    def fail(self, wid: str, key: str, message: str = "boom") -> list[ev.Command]:
        q = self.running.get(wid, [])
        if key in q:
            q.remove(key)
        return self.send(ev.TaskErred(wid, key, None, "Traceback...", "ValueError", message, 0.01, self.clock()))

    def step(self, nbytes: int = 8, duration: float = 0.01) -> int:
        """Finish every task currently assigned to a worker; returns how many finished."""
        n = 0
        for wid in list(self.running):
            for key in list(self.running.get(wid, [])):
                self.finish(wid, key, nbytes, duration)
                n += 1
        return n

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("graph did not settle")

    def status(self, client: str = "c") -> dict[str, str]:
        """Last reported status per key for ``client``."""
        return {r.key: r.status for r in self.reports if r.client == client}


class FakeProvider:
    """A provider for tests and simulations: no processes, time from an injected clock.

    ``launch`` is idempotent by request id and returns nothing (``worker_ids`` names the workers
    ``<type>-<request>-<i>``); a worker is listed as
    ``pending`` for ``queue_wait + startup`` seconds (per node type if a dict), then ``running``
    (the test joins it to the scheduler state when :meth:`ready` hands it out).  ``fail`` (a set of
    node type names, or a predicate on the request) makes launches fail: reported once through
    :meth:`poll_errors`, never raised.  :meth:`crash` ends a worker as if its process died.
    """

    def __init__(self, clock: Callable[[], float], *, startup: float | dict[str, float] = 0.5,
                 queue_wait: float = 0.0, fail: Any = None) -> None:  # fmt: skip
        from tidepool.providers.base import ProviderFailure

        self._failure_cls = ProviderFailure
        self.clock = clock
        self.startup = startup
        self.queue_wait = queue_wait
        self.fail = fail
        self.requests: dict[str, list[str]] = {}
        self.workers: dict[str, dict[str, Any]] = {}
        self._errors: list[Any] = []
        self._handed: set[str] = set()
        self.launch_calls = 0

    def _startup(self, node_type: str) -> float:
        if isinstance(self.startup, dict):
            return float(self.startup.get(node_type, 0.5))
        return float(self.startup)

    def worker_ids(self, node_type: Any, count: int, request_id: str) -> builtins.list[str]:
        return [f"{node_type.name}-{request_id}-{i}" for i in range(count * node_type.workers_per_node)]

    def launch(self, node_type: Any, count: int, request_id: str) -> None:
        self.launch_calls += 1
        if request_id in self.requests:
            return
        failing = (node_type.name in self.fail) if isinstance(self.fail, (set, frozenset, list, tuple)) else \
            bool(self.fail(node_type, count, request_id)) if callable(self.fail) else False  # fmt: skip
        ids = self.worker_ids(node_type, count, request_id)
        self.requests[request_id] = ids
        now = self.clock()
        if failing:
            self._errors.append(self._failure_cls(request_id, None, f"fake launch of {node_type.name!r} failed"))
            return
        for w in ids:
            self.workers[w] = {"node_type": node_type.name, "request_id": request_id, "alive": True,
                               "up_at": now + self.queue_wait + self._startup(node_type.name),
                               "resources": dict(node_type.worker_resources)}  # fmt: skip

    def ready(self) -> builtins.list[tuple[str, dict[str, Any]]]:
        """Workers whose start-up is over and that were not handed out before: (id, info)."""
        now = self.clock()
        out = [(w, info) for w, info in self.workers.items()
               if info["alive"] and info["up_at"] <= now and w not in self._handed]  # fmt: skip
        self._handed.update(w for w, _ in out)
        return out

    def crash(self, wid: str, returncode: int = -9) -> None:
        info = self.workers[wid]
        info["alive"], info["returncode"] = False, returncode

    def terminate(self, worker_ids: builtins.list[str]) -> None:
        for w in worker_ids:
            if w in self.workers:
                self.workers[w]["alive"] = False

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        now = self.clock()
        return {w: {**info, "state": ("running" if info["up_at"] <= now else "pending") if info["alive"] else "gone"}
                for w, info in self.workers.items()}  # fmt: skip

    def poll_errors(self) -> builtins.list[Any]:
        errs, self._errors = self._errors, []
        return errs

    def close(self) -> None:
        self.terminate(list(self.workers))
