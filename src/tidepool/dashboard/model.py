"""What the dashboard and ``/metrics`` show, gathered from the scheduler (no I/O; time passed in).

State: a bounded task stream (the last ``STREAM`` finished or failed tasks, from the scheduler's
events), per task group the tasks done (first completions only: a recomputed value is not done
twice), failed, compute seconds, output bytes and a duration histogram, a bounded time series of
workers per node type and state, pending launches and the completion forecast, and counters read
incrementally from the autoscaler's journal.

Cost, whatever the graph's size: the scheduler calls :meth:`observe` after every batch of events
(cheap: it appends and adds).  Everything the page shows that is not a stream is computed at most
once per ``interval`` into one shared :meth:`snapshot` (its JSON made once too) that every request,
page and scrape reuses, so four pollers and a hundred pages cost what one does.  Task groups come
from the state's own per-group counts (kept by its transitions, never a scan); the forecast, the
one part that scans the remaining work, is recomputed at most at the rate that keeps it under
``FORECAST_SHARE`` of the loop, and above ``FORECAST_SCAN_LIMIT`` tasks replaced by the work
bound (from the per-group counts).  Decisions and the task stream are sent by cursor (only what is new).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from tidepool.scheduler import events as ev
from tidepool.telemetry.journal import Journal

STREAM = 2_000
SERIES = 1_200
#: journal kinds shown as scaling decisions
DECISIONS = ("launch", "retire", "cancel-launch", "launch-failed", "backoff", "infeasible", "decision",
             "node-type-disabled", "worker-failed", "retire-done", "launch-arrived", "cost-limit",
             "preemption-notice", "fallback", "fallback-end", "terminate")  # fmt: skip
#: task groups tracked by name; later groups are counted together as ``OTHER`` (bounded labels)
MAX_GROUPS = 200
OTHER = "(other groups)"
#: the forecast scans the remaining work: it may use at most this share of the scheduler's loop,
#: and beyond this many tasks (where one scan would stall the loop for tens of ms) the page shows
#: the work bound instead (estimated work of the unfinished tasks / slots; O(task groups))
FORECAST_SHARE = 0.05
FORECAST_SCAN_LIMIT = 2_000
UNFINISHED = ("waiting", "ready", "no-worker", "running")
#: task-duration histogram buckets (seconds), as Prometheus expects them (upper bounds)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
#: worker start-up latency buckets (seconds)
STARTUP_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

ACTIVITIES = ("busy", "held", "idle", "starting", "retiring")


def activity(w: Any) -> str:
    """What a worker does, as the page and ``/metrics`` count it: starting / retiring, else busy
    (tasks on it), held (only data), idle."""
    if w.state in ("starting", "retiring"):
        return str(w.state)
    return "busy" if w.processing else ("held" if w.has_what else "idle")


class GroupStats:
    """One task group's finished work: first completions, failures, compute seconds, output bytes
    and a duration histogram (bucket counts, not cumulative)."""

    __slots__ = ("done", "erred", "seconds", "nbytes", "buckets")

    def __init__(self) -> None:
        self.done = 0
        self.erred = 0
        self.seconds = 0.0
        self.nbytes = 0
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)

    def add(self, duration: float, nbytes: int, first: bool) -> None:
        self.done += first
        self.seconds += duration
        self.nbytes += nbytes
        self.buckets[bisect.bisect_left(DURATION_BUCKETS, duration)] += 1


def _positions_since(journal: Journal, position: int) -> list[tuple[int, dict[str, Any]]]:
    """The journal's non-task records at ``position`` or later, oldest first, with their positions
    (walked from the newest back: only what is new is touched)."""
    out = []
    for pos, rec in reversed(journal.notable):
        if pos < position:
            break
        out.append((pos, rec))
    out.reverse()
    return out


def _notable_since(journal: Journal, position: int) -> list[dict[str, Any]]:
    return [rec for _, rec in _positions_since(journal, position)]


class JournalTally:
    """Counters over an append-only journal, read from a cursor (each record once)."""

    def __init__(self) -> None:
        self.cursor = 0
        self.journal_id = 0
        self.launched = 0
        self.retired = 0
        self.launch_failed = 0
        self.refused = 0
        self.startup: dict[str, list[float]] = {}  # node type -> measured start-up seconds (bounded)

    def read(self, journal: Journal | None) -> None:
        """Count the journal's records since the last read (its non-task ones: no task record counts)."""
        if journal is None:
            return
        if id(journal) != self.journal_id:  # a new journal
            self.__init__()  # type: ignore[misc]
            self.journal_id = id(journal)
        for r in _notable_since(journal, self.cursor):
            k = r.get("kind")
            if k == "launch":
                self.launched += int(r.get("nodes", 1))
            elif k == "retire-done":
                if r.get("outcome") == "retired":
                    self.retired += 1
                else:
                    self.refused += 1
            elif k == "launch-failed":
                self.launch_failed += 1
            elif k == "launch-arrived" and r.get("seconds") is not None:
                seen = self.startup.setdefault(str(r.get("node_type")), [])
                seen.append(float(r["seconds"]))
                del seen[:-1000]
        self.cursor = journal.end


class DashboardModel:
    def __init__(self, scheduler: Any, autoscaler: Callable[[], Any], interval: float = 0.5) -> None:
        self.scheduler = scheduler
        self.autoscaler = autoscaler
        self.interval = interval
        self.stream: collections.deque[dict[str, Any]] = collections.deque(maxlen=STREAM)
        self.stream_seq = 0
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES)
        self.loop_lag = 0.0  # seconds the scheduler's loop woke late, last measurement
        self.loop_lag_max = 0.0  # the largest since the start
        self.batch_seconds = 0.0  # summed time the scheduler spent applying event batches
        self.batches = 0
        self.t0 = scheduler.clock()  # times on the page count from here
        self.group_stats: dict[str, GroupStats] = {}
        self.tally = JournalTally()
        self._snap: dict[str, Any] | None = None
        self._snap_json = ""
        self._snap_t = -1e18
        self._eta: float | None = 0.0
        self._eta_next = -1e18
        self.node_types_seen: set[str] = set()
        self._answers_key: tuple[float, int, int] | None = None
        self._answers: dict[tuple[int, int], tuple[str, int, int]] = {}
        #: ``/metrics`` text, rendered at most once per interval for every scraper: (time, bytes)
        self.metrics_cache: tuple[float, bytes] | None = None

    # ---- fed by the scheduler ----------------------------------------------------------------
    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        for e in events:
            if isinstance(e, ev.TaskFinished):
                self._task(e.key, e.worker, e.now - e.duration, e.duration, e.nbytes, True)
            elif isinstance(e, ev.TaskErred):
                self._task(e.key, e.worker, e.now - e.duration, e.duration, 0, False)
            elif isinstance(e, ev.WorkerJoin):
                self.node_types_seen.add(e.node_type)
        for c in cmds:
            if type(c) is ev.TaskFailed:  # failed by the scheduler itself: its group counts it too
                ts = self.scheduler.state.tasks.get(c.key)
                if ts is not None:
                    self.group_of(ts.group).erred += 1
                else:  # forgotten already (nobody holds it): its group read off its key, as the replay does
                    from tidepool.sim.workload import group_of as key_group

                    self.group_of(key_group(c.key)).erred += 1

    def group_of(self, name: str) -> GroupStats:
        g = self.group_stats.get(name)
        if g is None:
            if len(self.group_stats) >= MAX_GROUPS:
                name = OTHER
                g = self.group_stats.get(name)
            if g is None:
                g = self.group_stats[name] = GroupStats()
        return g

    def _task(self, key: str, worker: str, start: float, duration: float, nbytes: int, ok: bool) -> None:
        ts = self.scheduler.state.tasks.get(key)
        group = ts.group if ts is not None else key
        g = self.group_of(group)
        if ok:
            # a value recomputed after a loss finishes again: it is not one more task done
            g.add(duration, nbytes, ts is None or not ts.recomputes)
        else:
            g.erred += 1
        self.stream_seq += 1
        self.stream.append({"seq": self.stream_seq, "key": key, "group": group, "worker": worker,
                            "start": round(start, 4), "duration": round(duration, 4), "ok": ok})  # fmt: skip

    # ---- read by the server -------------------------------------------------------------------
    def journal(self) -> Journal | None:
        scaler = self.autoscaler()
        return scaler.journal if scaler is not None else None

    def node_types(self) -> list[str]:
        """Every node type known (configured, launched or joined), so a count of 0 reads 0."""
        names = set(self.node_types_seen)
        names.update(w.node_type for w in self.scheduler.state.workers.values())
        scaler = self.autoscaler()
        if scaler is not None:
            names.update(scaler.controller.node_types)
        names.update(nt.name for nt in getattr(self.scheduler, "launched_as", {}).values())
        return sorted(names)

    def _work_bound(self) -> float | None:
        """Seconds left if the estimated work of every unfinished task spread evenly over the slots
        there are: O(task groups), from the state's per-group counts."""
        st = self.scheduler.state
        slots = sum(w.slots for w in st.workers.values() if w.state in ("running", "starting"))
        if not slots:
            return None
        total = 0.0
        for group, counts in st.group_counts.items():
            n = sum(counts.get(s, 0) for s in UNFINISHED)
            if n:
                total += n * st.estimates.estimate(group)
        return round(total / slots, 2)

    def _forecast(self, now: float) -> float | None:
        st = self.scheduler.state
        if not st.tasks:
            return 0.0
        if len(st.tasks) > FORECAST_SCAN_LIMIT:  # a full forecast would stall the loop in one piece
            return self._work_bound()
        if now < self._eta_next:
            return self._eta
        t = time.perf_counter()
        eta = self.scheduler.eta()["eta"]
        cost = time.perf_counter() - t
        self._eta = None if eta is None else round(eta, 2)
        self._eta_next = now + max(self.interval, cost / FORECAST_SHARE)
        return self._eta

    def sample(self, now: float) -> dict[str, Any]:
        """One point of the time series (and keep it)."""
        st = self.scheduler.state
        by_type: dict[str, dict[str, int]] = {nt: dict.fromkeys(ACTIVITIES, 0) for nt in self.node_types()}
        for w in st.workers.values():
            c = by_type.setdefault(w.node_type, dict.fromkeys(ACTIVITIES, 0))
            c[activity(w)] += 1
        pending: dict[str, int] = dict.fromkeys(by_type, 0)
        scaler = self.autoscaler()
        cost = None
        if scaler is not None:
            for p in scaler.view.pending:  # launches in flight: their workers not registered yet
                pending[p.node_type] = pending.get(p.node_type, 0) + len(p.worker_ids)
            meter = scaler.view.cost  # the controller's cost meter as of its last step
            cost = {"spent": round(meter.spent_at(now), 6), "rate": meter.rate,
                    "max_rate": meter.limits.max_cost_per_hour, "budget": meter.limits.budget}  # fmt: skip
        point = {"t": round(now, 3), "workers": by_type, "pending": pending, "eta": self._forecast(now),
                 "tasks": len(st.tasks), "cost": cost}  # fmt: skip
        self.series.append(point)
        return point

    def point(self, now: float) -> dict[str, Any]:
        """The latest point of the time series, sampled anew only when it is an interval old."""
        if self.series and 0 <= now - self.series[-1]["t"] < self.interval:
            return self.series[-1]
        return self.sample(now)

    def groups(self) -> dict[str, dict[str, int]]:
        """Per task group: unfinished task records by state, and done / failed so far."""
        out: dict[str, dict[str, int]] = {}
        for group, counts in self.scheduler.state.group_counts.items():
            if len(out) >= MAX_GROUPS:
                break
            # released records are finished values let go (or not needed): not waiting (a bug hunt
            # saw a finished group shown as waiting 10, done 10)
            row = {str(k): n for k, n in counts.items() if n and k not in ("memory", "erred", "released")}
            if row:
                out[group] = row
        for group, g in self.group_stats.items():
            row = out.setdefault(group, {})
            row["memory"], row["erred"] = g.done, g.erred
        return out

    def workers(self) -> list[dict[str, Any]]:
        st = self.scheduler.state
        now = self.scheduler.clock()
        out = []
        for info in st.worker_info():
            out.append({**info, "idle_for": None if info["idle_since"] is None else round(now - info["idle_since"], 1),
                        "idle_and_empty": not info["running"] and info["state"] in ("running", "starting")
                        and not info["unique_keys"]})  # fmt: skip
        return out

    def snapshot(self, now: float) -> tuple[dict[str, Any], str]:
        """The shared part of every view, and its JSON: computed at most once per ``interval``."""
        if self._snap is None or now - self._snap_t >= self.interval or now < self._snap_t:
            st = self.scheduler.state
            self.tally.read(self.journal())
            snap = {
                "now": round(now, 3), "t0": round(self.t0, 3), "point": self.point(now),
                "counts": st.task_counts(), "counters": dict(st.counters), "groups": self.groups(),
                "workers": self.workers(), "loop_lag": round(self.loop_lag, 4),
            }  # fmt: skip
            self._snap, self._snap_json, self._snap_t = snap, json.dumps(snap, default=str), now
        assert self._snap is not None
        return self._snap, self._snap_json

    def decisions_since(self, after: int) -> tuple[list[dict[str, Any]], int]:
        journal = self.journal()
        if journal is None:
            return [], 0
        after = min(after, journal.end)  # a cursor of an earlier journal
        out = [dict(r, i=i) for i, r in _positions_since(journal, after) if r.get("kind") in DECISIONS]
        return out[-200:], journal.end

    def stream_since(self, after: int) -> list[dict[str, Any]]:
        first = self.stream_seq - len(self.stream) + 1  # seq of the oldest kept
        skip = max(0, after - first + 1, len(self.stream) - 500)
        return list(itertools.islice(self.stream, skip, None))

    def view(self, now: float, stream_after: int = 0, decisions_after: int = 0) -> dict[str, Any]:
        """Everything the page shows; ``*_after`` cursors send only what is new."""
        snap, _ = self.snapshot(now)
        decisions, nxt = self.decisions_since(decisions_after)
        return {**snap, "decisions": decisions, "decisions_next": nxt,
                "stream": self.stream_since(stream_after), "stream_next": self.stream_seq}  # fmt: skip

    def view_json(self, now: float, stream_after: int = 0, decisions_after: int = 0) -> tuple[str, int, int]:
        """:meth:`view` as JSON, the shared part serialised once for every page; and the cursors.
        Answers are cached per pair of cursors until the snapshot, the task stream or the journal
        moves on: pollers, and the pages that follow along (they all hold the same cursors), share
        one answer."""
        _, shared = self.snapshot(now)
        journal = self.journal()
        key = (self._snap_t, self.stream_seq, journal.end if journal is not None else 0)
        if self._answers_key != key:
            self._answers_key, self._answers = key, {}
        hit = self._answers.get((stream_after, decisions_after))
        if hit is not None:
            return hit
        decisions, nxt = self.decisions_since(decisions_after)
        extra = json.dumps({"decisions": decisions, "decisions_next": nxt,
                            "stream": self.stream_since(stream_after), "stream_next": self.stream_seq},
                           default=str)  # fmt: skip
        out = (shared[:-1] + ", " + extra[1:], self.stream_seq, nxt)
        if len(self._answers) < 64:
            self._answers[(stream_after, decisions_after)] = out
        return out

    def history(self) -> list[dict[str, Any]]:
        return list(self.series)


__all__ = ["DashboardModel", "GroupStats", "activity"]
