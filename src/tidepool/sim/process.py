"""A simulated worker process: the real :class:`~tidepool.worker.state.WorkerState` on a fake clock.

Only the machine is simulated here; every decision (queue, slots, fetch, spill, pause, restart,
what to report) is the worker's own, the same code the asyncio worker runs.  The shell turns the
scheduler's commands into the state's events and the state's commands into timed events of the
engine (``sim/engine.py``):

- ``Run``: the task ends after its duration (``TaskDone``).  With ``cores`` set and more tasks
  running than cores, the tasks share them (each runs at ``cores / running`` speed, recomputed
  whenever one starts or ends), as CPU-bound tasks do on an oversubscribed worker;
- ``Fetch``: the value arrives after ``latency + nbytes / bandwidth`` if a holder still has it
  (``FetchDone``), else the fetch fails (``FetchFailed``);
- with ``overhead`` (seconds), the worker's loop spends that long on each task it starts (a
  measured figure: the gap between a task's end and the next queued task's start);
- ``Store``, ``Drop``: nothing to do (there are no values, only their sizes); ``Spill``: with
  ``disk`` set (bytes per second), writing takes the worker's loop ``nbytes / disk`` seconds, and a
  task whose inputs are on disk reads them (in its slot) before it runs, as the real worker's loop
  does;
- reports become scheduler events (``TasksStarted``, ``TaskFinished``, ``MissingData``,
  ``AddReplica``, ``StealReply``); ``SendMetrics`` a heartbeat with the metrics now;
- ``Terminate``: the process ends over its memory limit (``WorkerRemove``, cause ``memory``) and
  comes back under the same id ``restart`` seconds later, empty.

Memory: with a limit (the worker's ``memory`` resource, as real workers take it), the resident
memory is the process's own (``unmanaged``: interpreter and libraries) plus the bytes held in
memory plus what the running tasks use (their ``memory`` resource, e.g. a trace's
``memoryInBytes``; a task that declares none uses its working set: its inputs and its result).  Results past the target spill as they are stored (the state does that); the
rest goes through the monitor: while the memory is over the spill level or the worker is paused,
it is sampled every 50 ms, as the real monitor samples it, and handed to the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidepool.comm.messages import TaskBatch
from tidepool.scheduler import events as ev
from tidepool.scheduler.worker_reports import batch_events
from tidepool.worker import state as ws

#: what the shell needs of the engine: the clock, and a way to run a callback later
Later = Callable[[float, Callable[[], None]], None]


class WorkerProcess:
    """One simulated worker process (see the module docstring)."""

    __slots__ = ("id", "node_type", "resources", "state", "alive", "cores", "disk", "engine",
                 "_fetches", "_work", "_rate", "_since", "_token", "_reports", "_reported", "_busy", "unmanaged",
                 "_sampling", "overhead")  # fmt: skip

    def __init__(self, wid: str, node_type: str, resources: dict[str, float], engine: Any,
                 cores: float | None = None, disk: float | None = None, unmanaged: int = 0,
                 overhead: float = 0.0) -> None:  # fmt: skip
        self.id = wid
        self.node_type = node_type
        self.resources = resources
        self.engine = engine
        self.cores = cores
        self.disk = disk
        self.unmanaged = unmanaged  # the process's own memory (interpreter, libraries)
        self._sampling = False  # a memory sample is due
        self.overhead = overhead  # the loop's own seconds per task started (hand-offs, bookkeeping)
        self._busy = 0.0  # the loop is writing spilled values until then
        self.state = ws.WorkerState(resources, limit=int(resources.get("memory", 0)))
        self.alive = True
        self._fetches: dict[str, tuple[tuple[str, ...], int]] = {}  # key -> (holders, nbytes)
        #: running task -> [work left (s at full speed), duration, its done event's token, start]
        self._work: dict[str, list[Any]] = {}
        self._rate = 1.0
        self._since = 0.0
        self._token = 0
        self._reports = TaskBatch()
        self._reported = False  # something went into _reports since the last flush (cheaper to ask)

    # ---- from the scheduler ----------------------------------------------------------------------
    def compute(self, key: str, shape: ev.Shape, deps: tuple[tuple[str, tuple[str, ...], int], ...]) -> None:
        for d, holders, nbytes in deps:
            if d not in self._fetches:
                self._fetches[d] = (holders, nbytes)
        memory = -1
        for name, amount in shape:
            if name == "memory":
                memory = int(amount)
        if memory < 0:  # not given: its working set, the inputs it reads and the value it makes
            task = self.engine.tasks.get(key)
            memory = sum(nb for _, _, nb in deps) + (task.nbytes if task is not None else 0)
        dmap = {d: tuple((h, h) for h in holders) for d, holders, _ in deps}
        self.handle(ws.Compute((ws.TaskIn(key, dmap, shape, memory),)))

    def replicate(self, key: str, holders: tuple[str, ...], nbytes: int) -> None:
        self._fetches.setdefault(key, (holders, nbytes))
        self.handle(ws.Replicate(key, tuple((h, h) for h in holders)))

    # ---- the state's commands ----------------------------------------------------------------
    def handle(self, event: ws.Event) -> None:
        state = self.state
        self.apply(state.handle(event))
        if state.limit and self.alive and not self._sampling and (self.rss() > state.limit * state.thresholds.spill
                                                                  or state.paused):  # fmt: skip
            self._sampling = True  # the monitor sees it at its next sample
            self.engine.sample_later(self.id)

    def rss(self) -> int:
        st = self.state
        return self.unmanaged + st.memory_bytes + st.task_memory

    def sample(self) -> None:
        """The memory monitor's sample (every ``MONITOR`` seconds while it has something to act on)."""
        self._sampling = False
        if self.alive:
            self.handle(ws.MemorySample(self.rss()))

    def apply(self, commands: list[ws.Command]) -> None:
        eng = self.engine
        for c in commands:
            t = type(c)
            if t is ws.Report:
                self._reports.add(c.kind, c.item)  # type: ignore[union-attr]
                self._reported = True
            elif t is ws.Run:
                self._start(c.key)  # type: ignore[union-attr]
            elif t is ws.Fetch:
                holders, nbytes = self._fetches.get(c.key, ((), 8))  # type: ignore[union-attr]
                eng.fetch_later(self.id, c.key, holders, nbytes)  # type: ignore[union-attr]
            elif t is ws.Spill:
                spilled = self.state.spilled
                keys: tuple[str, ...] = c.keys  # type: ignore[union-attr]
                nbytes = sum(spilled.get(k, 0) for k in keys)
                eng.stats.spilled_bytes += nbytes
                if self.disk:
                    self._busy = max(eng.now, self._busy) + nbytes / self.disk
            elif t is ws.SendMetrics:
                eng.stats.pauses += c.paused  # type: ignore[union-attr]
                self._flush()
                eng.out.append(ev.Heartbeat(self.id, eng.now, self.metrics()))
            elif t is ws.Terminate:
                self._flush()
                eng.memory_exit(self, c.rss)  # type: ignore[union-attr]
                return
        self._flush()

    def _flush(self) -> None:
        """The state's reports, as the events the scheduler would make of one ``task-batch``."""
        if not self._reported:
            return
        self._reported = False
        reports, self._reports = self._reports, TaskBatch()
        self.engine.out.extend(batch_events(self.id, reports, self.engine.now))

    def fetched(self, key: str, ok: bool, holder: str) -> None:
        if ok:
            self.handle(ws.FetchDone(key, self._fetches[key][1]))
        else:
            self.handle(ws.FetchFailed(key, "missing", "simulated: the holder no longer has it", holder))
        self._fetches.pop(key, None)

    def metrics(self) -> dict[str, Any]:
        st = self.state
        return {"rss": self.unmanaged + st.memory_bytes + st.task_memory, "bytes": st.memory_bytes + st.spilled_bytes,
                "spilled": st.spilled_bytes, "memory_limit": st.limit, "paused": st.paused,
                "running": len(st.running), "queued": len(st.queue)}  # fmt: skip

    # ---- slots on a clock ----------------------------------------------------------------------
    def _start(self, key: str) -> None:
        eng = self.engine
        task = eng.tasks.get(key)
        duration = task.duration if task is not None else 0.0
        wait = 0.0  # the loop finishes what it does, reads the task's spilled inputs, hands it over
        if self.disk or self.overhead:
            spilled = self.state.spilled
            read = sum(spilled.get(d, 0) for d in self.state.running[key].deps) / self.disk if self.disk else 0.0
            wait = max(0.0, self._busy - eng.now) + read + self.overhead
            self._busy = eng.now + wait
        if self.cores is None:  # no contention modelled: the task takes its duration
            self._token += 1
            self._work[key] = [duration, duration, self._token, eng.now]
            eng.done_later(eng.now + wait + duration if wait else eng.now + duration, self.id, key, self._token)
            return
        self._advance()
        self._work[key] = [duration + wait, duration, 0, eng.now]
        self._reschedule()

    def lost_work(self, now: float) -> float:
        """Seconds the running tasks have run so far (thrown away if the process dies now)."""
        return sum(now - w[3] for w in self._work.values())

    def done(self, key: str, token: int) -> None:
        w = self._work.get(key)
        if w is None or w[2] != token:
            return  # a stale finish (the speed changed since)
        del self._work[key]
        if self.cores is not None:
            self._advance()
            self._reschedule()
        task = self.engine.tasks.get(key)
        nbytes = task.nbytes if task is not None else 8
        # the time it took, as a real worker measures it (its duration when it had a core to itself)
        took = w[1] if self.cores is None else self.engine.now - w[3]
        self.handle(ws.TaskDone(key, True, nbytes, took))

    def _advance(self) -> None:
        now = self.engine.now
        spent = (now - self._since) * self._rate
        self._since = now
        for w in self._work.values():
            w[0] = max(0.0, w[0] - spent)

    def _reschedule(self) -> None:
        """Every running task shares the cores: new speed, new finish times."""
        eng = self.engine
        demand = sum(cpu for k in self._work for name, cpu in self.state.running[k].resources if name == "cpu") \
            if self._work else 0.0  # fmt: skip
        assert self.cores is not None
        self._rate = min(1.0, self.cores / demand) if demand > 0 else 1.0
        for key, w in self._work.items():
            self._token += 1
            w[2] = self._token
            eng.done_later(eng.now + w[0] / self._rate, self.id, key, self._token)
