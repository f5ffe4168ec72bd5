"""What the dashboard and ``/metrics`` show, gathered from the scheduler (no I/O; time passed in).

State: a bounded task stream (the last ``STREAM`` finished or failed tasks, from the scheduler's
events), tasks finished and failed per group, and a bounded time series of workers per node type and state, pending launches and the
completion forecast, one point per :meth:`sample`.  Data flow: the scheduler calls :meth:`observe`
after every batch of events (cheap: it only appends); the web server calls :meth:`sample` and
:meth:`view` at most a few times a second, so thousands of tasks a second cost the page nothing
more than a batch each half second.  Counters are the scheduler's own; scaling decisions come from
the autoscaler's journal.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from tidepool.scheduler import events as ev

STREAM = 2_000
SERIES = 1_200
#: journal kinds shown as scaling decisions
DECISIONS = ("launch", "retire", "cancel-launch", "launch-failed", "backoff", "infeasible", "decision",
             "node-type-disabled", "worker-failed", "retire-done", "launch-arrived")  # fmt: skip
#: per-group progress is computed only up to this many task records (a full scan per sample)
GROUP_SCAN_LIMIT = 200_000
ETA_SCAN_LIMIT = 50_000


ACTIVITIES = ("busy", "held", "idle", "starting", "retiring")


def activity(w: Any) -> str:
    """What a worker does, as the page and ``/metrics`` count it: starting / retiring, else busy
    (tasks on it), held (only data), idle."""
    if w.state in ("starting", "retiring"):
        return str(w.state)
    return "busy" if w.processing else ("held" if w.has_what else "idle")


class DashboardModel:
    def __init__(self, scheduler: Any, autoscaler: Callable[[], Any]) -> None:
        self.scheduler = scheduler
        self.autoscaler = autoscaler
        self.stream: collections.deque[dict[str, Any]] = collections.deque(maxlen=STREAM)
        self.stream_seq = 0
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES)
        self.loop_lag = 0.0  # seconds the scheduler's loop woke late, last measurement
        self.t0 = scheduler.clock()  # times on the page count from here
        #: tasks finished / failed per group so far (records of finished tasks are forgotten)
        self.group_done: dict[str, int] = {}
        self.group_erred: dict[str, int] = {}

    # ---- fed by the scheduler ----------------------------------------------------------------
    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        for e in events:
            if isinstance(e, ev.TaskFinished):
                self._task(e.key, e.worker, e.now - e.duration, e.duration, True)
            elif isinstance(e, ev.TaskErred):
                self._task(e.key, e.worker, e.now, 0.0, False)

    def _task(self, key: str, worker: str, start: float, duration: float, ok: bool) -> None:
        ts = self.scheduler.state.tasks.get(key)
        group = ts.group if ts is not None else key
        done = self.group_done if ok else self.group_erred
        done[group] = done.get(group, 0) + 1
        self.stream_seq += 1
        self.stream.append({"seq": self.stream_seq, "key": key, "group": ts.group if ts is not None else key,
                            "worker": worker, "start": round(start, 4), "duration": round(duration, 4),
                            "ok": ok})  # fmt: skip

    # ---- read by the server -------------------------------------------------------------------
    def journal_records(self) -> list[dict[str, Any]]:
        scaler = self.autoscaler()
        return scaler.journal.records if scaler is not None else []

    def sample(self, now: float) -> dict[str, Any]:
        """One point of the time series (and keep it)."""
        st = self.scheduler.state
        by_type: dict[str, dict[str, int]] = {}
        for w in st.workers.values():
            c = by_type.setdefault(w.node_type, dict.fromkeys(ACTIVITIES, 0))
            c[activity(w)] += 1
        pending: dict[str, int] = {}
        scaler = self.autoscaler()
        if scaler is not None:
            for p in scaler.view.pending:  # launches in flight: their workers not registered yet
                pending[p.node_type] = pending.get(p.node_type, 0) + len(p.worker_ids)
        # the forecast scans the remaining work: skipped (None) on very large graphs
        eta = (self.scheduler.eta()["eta"] if len(st.tasks) <= ETA_SCAN_LIMIT else None) if st.tasks else 0.0
        point = {"t": round(now, 3), "workers": by_type, "pending": pending,
                 "eta": None if eta is None else round(eta, 2), "tasks": len(st.tasks)}  # fmt: skip
        self.series.append(point)
        return point

    def groups(self) -> dict[str, dict[str, int]]:
        """Per task group: unfinished task records by state, and finished / failed so far."""
        st = self.scheduler.state
        out: dict[str, dict[str, int]] = {}
        if len(st.tasks) <= GROUP_SCAN_LIMIT:
            for ts in st.tasks.values():
                if ts.state in ("memory", "erred"):
                    continue
                g = out.setdefault(ts.group, {})
                g[str(ts.state)] = g.get(str(ts.state), 0) + 1
        for group, n in self.group_done.items():
            out.setdefault(group, {})["memory"] = n
        for group, n in self.group_erred.items():
            out.setdefault(group, {})["erred"] = n
        return out

    def workers(self) -> list[dict[str, Any]]:
        st = self.scheduler.state
        idle_empty = set(st.idle_and_empty())
        now = self.scheduler.clock()
        out = []
        for info in st.worker_info():
            out.append({**info, "idle_for": None if info["idle_since"] is None else round(now - info["idle_since"], 1),
                        "idle_and_empty": info["id"] in idle_empty})  # fmt: skip
        return out

    def view(self, now: float, stream_after: int = 0, decisions_after: int = 0) -> dict[str, Any]:
        """Everything the page shows; ``*_after`` cursors send only what is new."""
        fresh = self.series and now - self.series[-1]["t"] < 0.2  # another page sampled just now
        point = self.series[-1] if fresh else self.sample(now)
        records = self.journal_records()
        decisions = [dict(r, i=i) for i, r in enumerate(records) if i >= decisions_after and r.get("kind") in DECISIONS]
        return {
            "now": point["t"], "t0": round(self.t0, 3), "point": point, "counts": self.scheduler.state.task_counts(),
            "counters": dict(self.scheduler.state.counters), "groups": self.groups(),
            "workers": self.workers(), "decisions": decisions[-200:], "decisions_next": len(records),
            "stream": [s for s in self.stream if s["seq"] > stream_after][-500:], "stream_next": self.stream_seq,
            "loop_lag": round(self.loop_lag, 4),
        }  # fmt: skip

    def history(self) -> list[dict[str, Any]]:
        return list(self.series)


__all__ = ["DashboardModel"]
