"""The event journal: one record per thing that happened, with the reason when there is one.

Records are plain dicts with ``t`` (scheduler time, seconds) and ``kind``: ``worker-join``,
``worker-leave``, ``spill-disabled`` (a worker stopped spilling to disk, and why), ``task-failed``
(a task the scheduler itself failed: KilledWorkerError, infeasible, a value lost too often; its
``error`` type, ``reason`` and ``group``), ``task`` (one per finished or failed task: worker, start, duration, and, for
tasks submitted while the journal listened, ``submitted`` (the time of the graph update), ``deps``
(the keys it needed, so ``tidepool simulate --journal`` replays the graph's shape), ``nbytes`` of
its result and its ``resources`` when it asked for any), ``worker-startup`` (requested ->
registered -> ready of every worker the autoscaler launched, :mod:`tidepool.telemetry.startup`),
the provider's ``worker-launch`` and ``fork-server`` records, and the
scaling controller's ``launch``, ``retire``, ``cancel-launch``, ``launch-failed``, ``backoff``,
``infeasible`` and ``decision`` records carrying ``reason``; ``recovery`` records (stage
``loaded``, then ``resumed`` with the values recovered, recomputed and the running tasks adopted)
after a scheduler restarts from its state directory.  The journal lives in memory and,
given a path, is appended to a JSON-lines file that ``tidepool report`` reads.  In memory it keeps
the last ``keep`` records (:data:`KEEP`; a long-lived scheduler grew by a kilobyte per task it ever
ran): positions in it are absolute (:attr:`Journal.dropped` records were let go from the front;
read new ones with :meth:`Journal.since`), and the file keeps every record.  Records other than
``task`` ones are also kept apart (:attr:`Journal.notable`, the last :data:`KEEP_NOTABLE`), so a
reader of decisions does not walk thousands of task records to find them.  The file is
flushed at least once a second while records arrive and on every scheduler tick (the scheduler
calls :meth:`observe` every ``tick_interval``), so a journal survives a killed scheduler up to its
last second.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from tidepool.scheduler import events as ev

log = logging.getLogger("tidepool.journal")
#: records kept in memory by default (about 50 MB of task records at most); None keeps all
KEEP = 50_000
#: non-task records (launches, retirements, decisions, workers joining and leaving) kept apart
KEEP_NOTABLE = 10_000


class Journal:
    #: seconds between flushes of the file at most
    FLUSH_EVERY = 1.0

    def __init__(self, path: str | None = None, *, tasks: bool = True,
                 clock: Callable[[], float] = time.monotonic, keep: int | None = KEEP) -> None:  # fmt: skip
        self.records: list[dict[str, Any]] = []
        #: records let go from the front of :attr:`records` (``records[0]`` is record number ``dropped``)
        self.dropped = 0
        self.keep = keep
        #: (absolute position, record) of the last :data:`KEEP_NOTABLE` records that are not ``task`` ones
        self.notable: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=KEEP_NOTABLE)
        self.tasks = tasks
        self._clock = clock
        self._flushed = clock()
        # one run per file: reusing a path starts it afresh (worker ids and clock restart per run),
        # and the run before is kept as PATH.1 (a scheduler restarted after a crash with the same
        # command erased the history of the crash)
        if path and os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) > 0:
            try:
                os.replace(path, path + ".1")
            except OSError as exc:  # a writable file in a directory we may not write: start it afresh
                log.warning("journal %s: could not keep the run before as %s.1 (%s); it is replaced",
                            path, path, exc.strerror or exc)  # fmt: skip
        self._file: IO[str] | None = open(path, "w") if path else None  # noqa: SIM115
        self.path = path
        #: key -> (submitted at, deps, resources) of tasks submitted while listening (task records)
        self._graph: dict[str, tuple[float, tuple[str, ...], dict[str, float], str]] = {}
        #: does the scheduler still know this key?  Set by whoever subscribes the journal to a
        #: scheduler (:meth:`follow`); with it, shapes of tasks forgotten unrun are let go
        self.alive: Callable[[str], bool] | None = None
        self._prune_at = 2 * keep if keep is not None else 0

    def record(self, kind: str, t: float, **fields: Any) -> None:
        self.add({"t": round(t, 6), "kind": kind, **fields})

    @property
    def end(self) -> int:
        """The absolute position the next record gets."""
        return self.dropped + len(self.records)

    def since(self, position: int) -> list[dict[str, Any]]:
        """The records from absolute ``position`` on (those still kept)."""
        return self.records[max(0, position - self.dropped):]

    def _keep_bounded(self) -> None:
        if self.keep is not None and len(self.records) > self.keep + self.keep // 4 + 1:
            n = len(self.records) - self.keep
            del self.records[:n]  # now and then, a quarter at a time: amortised O(1) per record
            self.dropped += n

    def _write(self, line: str) -> None:
        try:
            assert self._file is not None
            self._file.write(line)
            self.flush_if_due()
        except OSError as exc:
            self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        """The file cannot be written (a full disk, a removed mount): said once, and the run goes on
        journaling in memory only (a traceback every half second and a failed exit before)."""
        log.error("journal %s cannot be written (%s); journaling to the file stopped, the run goes on",
                  self.path, exc.strerror or exc)  # fmt: skip
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def add(self, rec: dict[str, Any]) -> None:
        """Append a record made elsewhere (e.g. by the scaling controller) as it is."""
        if rec.get("kind") not in ("task", "task-failed"):  # (a task's records never push out decisions)
            self.notable.append((self.end, rec))
        self.records.append(rec)
        self._keep_bounded()
        if self._file is not None:
            self._write(json.dumps(rec, default=str) + "\n")

    def flush_if_due(self) -> None:
        """Flush the file if the last flush was more than :attr:`FLUSH_EVERY` seconds ago."""
        if self._file is not None and self._clock() - self._flushed >= self.FLUSH_EVERY:
            self.flush()

    def follow(self, scheduler: Any) -> None:
        """Listen to ``scheduler`` (a :class:`~tidepool.scheduler.server.Scheduler`): its events
        come to :meth:`observe`, and the shapes of tasks it forgot unrun are let go."""
        self.alive = lambda key: key in scheduler.state.tasks
        scheduler.subscribe(self.observe)

    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        """Scheduler observer: worker joins/leaves and task outcomes."""
        for e in events:
            if self.tasks and isinstance(e, ev.UpdateGraph):
                graph = self._graph
                for spec in e.tasks:
                    graph[spec.key] = (e.now, tuple(spec.deps), dict(spec.resources), spec.group)
                if self.keep is not None and self.alive is not None and len(graph) > self._prune_at:
                    # tasks the scheduler forgot without running them (cancelled, released): a
                    # walk now and then, amortised (a task still pending keeps its shape)
                    for key in [k for k in graph if not self.alive(k)]:
                        del graph[key]
                    self._prune_at = max(2 * self.keep, 2 * len(graph))
            elif isinstance(e, ev.WorkerJoin):
                self.record("worker-join", e.now, worker=e.worker, node_type=e.node_type,
                            resources=e.resources)  # fmt: skip
            elif isinstance(e, ev.WorkerRemove):
                self.record("worker-leave", e.now, worker=e.worker, reason=e.reason, graceful=e.graceful)
            elif isinstance(e, ev.RecoveryReport):  # a restart from the state directory (recovery.py)
                self.record("recovery", e.now, stage=e.stage, **e.fields)
            elif isinstance(e, ev.Heartbeat) and e.metrics.get("spill_disabled"):  # sent once, at the change
                self.record("spill-disabled", e.now, worker=e.worker, reason=str(e.metrics["spill_disabled"]))
            elif self.tasks and isinstance(e, ev.TaskFinished):
                self.record("task", e.now, key=e.key, worker=e.worker, start=round(e.now - e.duration, 6),
                            duration=round(e.duration, 6), ok=True, nbytes=e.nbytes,
                            **self._shape(e.key, done=True))  # fmt: skip
            elif self.tasks and isinstance(e, ev.TaskErred):
                self.record("task", e.now, key=e.key, worker=e.worker, start=round(e.now - e.duration, 6),
                            duration=round(e.duration, 6), ok=False, **self._shape(e.key))  # fmt: skip
        for c in cmds:
            if isinstance(c, ev.CloseWorker):
                self.record("worker-close", max((e.now for e in events), default=0.0), worker=c.worker,
                            reason=c.reason)  # fmt: skip
            elif self.tasks and isinstance(c, ev.TaskFailed):  # (it had no record at all: a bug hunt)
                group = {k: v for k, v in self._shape(c.key).items() if k == "group"}
                self.record("task-failed", max((e.now for e in events), default=0.0), key=c.key, error=c.exc_type,
                            reason=c.message[:2000], **group)  # fmt: skip
        self.flush_if_due()  # ticks arrive even when nothing else happens

    def _shape(self, key: str, done: bool = False) -> dict[str, Any]:
        """A task record's graph fields: when it was submitted, its inputs, its resources (let go
        when it finished while the journal keeps a bounded memory: a value recomputed later is
        recorded without them)."""
        known = self._graph.pop(key, None) if done and self.keep is not None else self._graph.get(key)
        if known is None:
            return {}
        at, deps, resources, group = known
        out: dict[str, Any] = {"submitted": round(at, 6), "deps": list(deps)}
        if resources:
            out["resources"] = resources
        if group and group != key:  # what the client named it (its function, a trace's program)
            out["group"] = group
        return out

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._lost(exc)
            self._flushed = self._clock()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._lost(exc)
            self._file = None

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] in kinds]


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def worker_intervals(records: Iterable[dict[str, Any]], until: float | None = None) -> dict[str, tuple[float, float, str]]:
    """worker -> (joined, left, node_type); workers still present end at ``until`` (or last record)."""
    recs = list(records)
    end = until if until is not None else max((r["t"] for r in recs), default=0.0)
    joined: dict[str, tuple[float, str]] = {}
    out: dict[str, tuple[float, float, str]] = {}
    for r in recs:
        if r["kind"] == "worker-join":
            joined[r["worker"]] = (r["t"], r.get("node_type", "default"))
        elif r["kind"] in ("worker-leave", "worker-close") and r["worker"] in joined:
            t0, nt = joined.pop(r["worker"])
            out[r["worker"]] = (t0, r["t"], nt)
    for w, (t0, nt) in joined.items():
        out[w] = (t0, max(end, t0), nt)
    return out


def held_worker_seconds(records: Iterable[dict[str, Any]], since: float = 0.0, until: float | None = None) -> float:
    """Worker-seconds held (registered) between ``since`` and ``until``."""
    total = 0.0
    for t0, t1, _ in worker_intervals(records, until).values():
        a, b = max(t0, since), t1 if until is None else min(t1, until)
        total += max(0.0, b - a)
    return total


def busy_worker_seconds(records: Iterable[dict[str, Any]]) -> float:
    return sum(r["duration"] for r in records if r["kind"] == "task")
