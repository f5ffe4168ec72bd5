"""Export an event journal as a Chrome trace (the JSON that Perfetto and chrome://tracing open).

Place in the data flow: journal records (see :mod:`tidepool.telemetry.journal`) in, one JSON
document out; ``tidepool report JOURNAL --trace trace.json`` writes it.  Pure: no cluster, no clock.

Layout of the trace (times in microseconds from the journal's first record, the same origin as the
timeline plot):

- one process (pid 1, "tidepool cluster"); thread 0 is the autoscaler, threads 1.. are the workers
  in the order they were first held, named ``<worker> (<node type>)`` by ``thread_name`` metadata;
- a complete event (``"ph": "X"``) per task record on its worker's thread, ``cat`` ``task`` or
  ``task,failed`` (failed ones coloured ``terrible``), with key and outcome in ``args``;
- instant events (``"ph": "i"``) for the autoscaler's launch/retire decisions and its failures
  (process scope, ``reason`` and the other record fields in ``args``), and thread-scoped instants
  for each worker's join/leave/close;
- counter events (``"ph": "C"``): ``workers`` (held, one series per node type) and ``busy workers``.

The controller's ``decision`` records (reasons for doing nothing, written on most steps) are left
out: they would bury the decisions that did something.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tidepool.telemetry.report import (
    Record,
    busy_intervals,
    end_time,
    origin,
    tasks_of,
    worker_spans,
)

PID = 1
AUTOSCALER_TID = 0
#: Autoscaler records exported as process-wide instants.
AUTOSCALER_KINDS = ("launch", "retire", "launch-failed", "cancel-launch", "backoff", "node-type-disabled",
                    "infeasible")  # fmt: skip
WORKER_KINDS = ("worker-join", "worker-leave", "worker-close")


def to_chrome_trace(records: Iterable[Record]) -> dict[str, Any]:
    """The records as ``{"traceEvents": [...], ...}`` (Chrome trace event format, JSON object form)."""
    recs = sorted(records, key=lambda r: float(r["t"]))
    t0, t_end = origin(recs), end_time(recs)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    spans = worker_spans(recs)
    workers = list(dict.fromkeys(s.worker for s in spans))
    tid = {w: i for i, w in enumerate(workers, 1)}
    node_type = {s.worker: s.node_type for s in spans}
    meta: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "tid": AUTOSCALER_TID, "name": "process_name", "args": {"name": "tidepool cluster"}},
        {"ph": "M", "pid": PID, "tid": AUTOSCALER_TID, "name": "thread_name", "args": {"name": "autoscaler"}},
        {"ph": "M", "pid": PID, "tid": AUTOSCALER_TID, "name": "thread_sort_index", "args": {"sort_index": 0}},
    ]
    for w in workers:
        meta.append({"ph": "M", "pid": PID, "tid": tid[w], "name": "thread_name",
                     "args": {"name": f"{w} ({node_type[w]})"}})  # fmt: skip
        meta.append({"ph": "M", "pid": PID, "tid": tid[w], "name": "thread_sort_index",
                     "args": {"sort_index": tid[w]}})  # fmt: skip

    events: list[dict[str, Any]] = []
    for r in tasks_of(recs):
        ok = bool(r.get("ok", True))
        duration = float(r.get("duration", 0.0))
        start = float(r.get("start", float(r["t"]) - duration))
        e: dict[str, Any] = {"ph": "X", "pid": PID, "tid": tid[str(r["worker"])], "name": str(r["key"]),
                             "cat": "task" if ok else "task,failed", "ts": us(start),
                             "dur": round(duration * 1e6, 3), "args": {"key": r["key"], "ok": ok}}  # fmt: skip
        if not ok:
            e["cname"] = "terrible"
        events.append(e)
    for r in recs:
        kind = r["kind"]
        args = {k: v for k, v in r.items() if k not in ("t", "kind")}
        if kind in AUTOSCALER_KINDS:
            events.append({"ph": "i", "s": "p", "pid": PID, "tid": AUTOSCALER_TID, "name": kind,
                           "cat": "autoscaler", "ts": us(float(r["t"])), "args": args})  # fmt: skip
        elif kind in WORKER_KINDS and str(r.get("worker")) in tid:
            events.append({"ph": "i", "s": "t", "pid": PID, "tid": tid[str(r["worker"])], "name": kind,
                           "cat": "worker", "ts": us(float(r["t"])), "args": args})  # fmt: skip

    # counters: held workers per node type (every series in every event, so none is left dangling)
    types = sorted(set(node_type.values()))
    changes = sorted([(s.start, 1, s.node_type) for s in spans] + [(s.end, -1, s.node_type) for s in spans])
    level = dict.fromkeys(types, 0)
    counters: list[dict[str, Any]] = []
    for i, (t, delta, nt) in enumerate(changes):
        level[nt] += delta
        if i + 1 < len(changes) and changes[i + 1][0] == t:
            continue  # one event per instant, after all its changes
        counters.append({"ph": "C", "pid": PID, "name": "workers", "ts": us(t), "args": dict(level)})
    busy = busy_intervals(recs, spans)
    bchanges = sorted((t, d) for ivs in busy.values() for a, b in ivs for t, d in ((a, 1), (b, -1)))
    n = 0
    for i, (t, d) in enumerate(bchanges):
        n += d
        if i + 1 < len(bchanges) and bchanges[i + 1][0] == t:
            continue
        counters.append({"ph": "C", "pid": PID, "name": "busy workers", "ts": us(t), "args": {"busy": n}})

    events.extend(counters)
    events.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "tidepool journal", "origin_seconds": t0, "end_seconds": t_end},
    }


def write_chrome_trace(records: Iterable[Record], path: str) -> None:
    """Write :func:`to_chrome_trace` of ``records`` to ``path`` (open it in https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(records), f, default=str)
