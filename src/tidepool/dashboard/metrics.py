"""``/metrics``: the dashboard model in Prometheus' text format, through the official client library.

No state of its own: a custom collector reads the model on every scrape (``collect``), so numbers
are never stale and nothing is kept twice.  Naming follows Prometheus' rules: base units in the
name (``_seconds``, ``_bytes``), counters end in ``_total`` (the client library adds it), and every
series of a family is present with 0 rather than missing (a node type with no idle worker reads
``tidepool_workers{state="idle"} 0``).  Labels stay bounded: node type, state and task group
(at most ``MAX_GROUPS`` groups, the rest as one ``(other groups)``), never a task key; per-worker
series only while the pool has at most ``worker_label_limit`` workers (default
:data:`WORKER_LABEL_LIMIT`, 64 or ``TIDEPOOL_METRICS_WORKER_LABELS``; 0 turns them off).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from tidepool.dashboard.model import (
    ACTIVITIES,
    DURATION_BUCKETS,
    STARTUP_BUCKETS,
    DashboardModel,
    activity,
)

#: per-worker series are exported only while the pool is at most this large (cardinality bound);
#: ``TIDEPOOL_METRICS_WORKER_LABELS`` changes it (0: never)
WORKER_LABEL_LIMIT = int(os.environ.get("TIDEPOOL_METRICS_WORKER_LABELS", "64"))


def _histogram(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Bucket counts (one per bound plus +Inf) -> Prometheus' cumulative ``(le, count)`` pairs."""
    out, total = [], 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    return out


class ModelCollector(Collector):
    def __init__(self, model: DashboardModel, worker_label_limit: int = WORKER_LABEL_LIMIT) -> None:
        self.model = model
        self.worker_label_limit = worker_label_limit

    def collect(self) -> Iterator[Metric]:  # noqa: C901 - one family after the other
        m = self.model
        sched = m.scheduler
        st = sched.state
        types = m.node_types() or ["default"]  # no worker and no node type yet: hand-started ones' type
        workers = GaugeMetricFamily("tidepool_workers", "Workers by node type and state", labels=["node_type", "state"])
        counts = {(nt, a): 0 for nt in types for a in ACTIVITIES}
        held: dict[str, float] = dict.fromkeys(types, 0.0)
        spilled: dict[str, float] = dict.fromkeys(types, 0.0)
        for w in st.workers.values():
            key = (w.node_type, activity(w))
            counts[key] = counts.get(key, 0) + 1
            spill = float(w.metrics.get("spilled", 0) or 0)
            held[w.node_type] = held.get(w.node_type, 0.0) + max(0.0, w.nbytes - spill)
            spilled[w.node_type] = spilled.get(w.node_type, 0.0) + spill
        for (nt, act), n in sorted(counts.items()):
            workers.add_metric([nt, act], n)
        yield workers
        mem = GaugeMetricFamily("tidepool_worker_held_bytes", "Bytes of task results workers hold in memory, by node type",
                                labels=["node_type"])  # fmt: skip
        for nt, b in sorted(held.items()):
            mem.add_metric([nt], b)
        yield mem
        spill_f = GaugeMetricFamily("tidepool_worker_spilled_bytes", "Bytes of task results spilled to disk, by node type",
                                    labels=["node_type"])  # fmt: skip
        for nt, b in sorted(spilled.items()):
            spill_f.add_metric([nt], b)
        yield spill_f
        tasks = GaugeMetricFamily("tidepool_tasks", "Task records by state", labels=["state"])
        task_counts = st.task_counts()
        for state in sorted({"released", "waiting", "ready", "no-worker", "running", "memory", "erred",
                             *task_counts}):  # fmt: skip
            tasks.add_metric([state], task_counts.get(state, 0))
        yield tasks
        c = st.counters
        for name, counter, doc in (("tidepool_tasks_finished", "finished", "Tasks finished"),
                               ("tidepool_tasks_failed", "erred", "Tasks that failed"),
                               ("tidepool_tasks_recomputed", "recomputed", "Values recomputed after a loss"),
                               ("tidepool_tasks_retried", "retried", "Task retries"),
                               ("tidepool_workers_lost", "workers_lost", "Workers lost without retiring")):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=c.get(counter, 0))
        m.tally.read(m.journal())
        t = m.tally
        yield CounterMetricFamily("tidepool_launches", "Nodes the autoscaler launched", value=t.launched)
        yield CounterMetricFamily("tidepool_retirements", "Workers the autoscaler retired", value=t.retired)
        yield CounterMetricFamily("tidepool_retirements_refused", "Retirements refused (data nobody could take)",
                                  value=t.refused)  # fmt: skip
        yield CounterMetricFamily("tidepool_launch_failures", "Launch requests that failed", value=t.launch_failed)
        startup = HistogramMetricFamily("tidepool_worker_startup_seconds", "Seconds from a launch request to its "
                                        "workers joining, by node type", labels=["node_type"])  # fmt: skip
        for nt in sorted(set(types) | set(t.startup)):
            seen = t.startup.get(nt, [])
            bucket_counts = [0] * (len(STARTUP_BUCKETS) + 1)
            for s in seen:
                bucket_counts[sum(1 for b in STARTUP_BUCKETS if s > b)] += 1
            startup.add_metric([nt], _histogram(STARTUP_BUCKETS, bucket_counts), sum_value=sum(seen))
        yield startup
        pending = GaugeMetricFamily("tidepool_pending_workers", "Workers launched, not joined yet", labels=["node_type"])
        point = m.series[-1] if m.series else m.sample(sched.clock())
        for nt in sorted(set(types) | set(point["pending"])):
            pending.add_metric([nt], point["pending"].get(nt, 0))
        yield pending
        if point.get("cost") is not None:  # the autoscaler's cost meter (scaling/limits.py)
            yield GaugeMetricFamily("tidepool_cost_spent", "Cost so far: node-hours billed from launch to release "
                                    "times each node type's cost", value=point["cost"]["spent"])  # fmt: skip
            yield GaugeMetricFamily("tidepool_cost_per_hour", "What the pool costs per hour now (launches in "
                                    "flight included)", value=point["cost"]["rate"])  # fmt: skip
        if point.get("eta") is not None:
            yield GaugeMetricFamily("tidepool_forecast_seconds", "Forecast seconds to finish the work known now",
                                    value=point["eta"])  # fmt: skip
        # per task group: compute time, output bytes, durations (bounded: MAX_GROUPS groups at most)
        secs = CounterMetricFamily("tidepool_task_compute_seconds", "Seconds tasks computed, by task group",
                                   labels=["group"])  # fmt: skip
        out_bytes = CounterMetricFamily("tidepool_task_output_bytes", "Bytes of task results, by task group",
                                        labels=["group"])  # fmt: skip
        durations = HistogramMetricFamily("tidepool_task_duration_seconds", "Task durations, by task group",
                                          labels=["group"])  # fmt: skip
        for group, g in sorted(m.group_stats.items()):
            secs.add_metric([group], g.seconds)
            out_bytes.add_metric([group], g.nbytes)
            durations.add_metric([group], _histogram(DURATION_BUCKETS, g.buckets), sum_value=g.seconds)
        yield secs
        yield out_bytes
        yield durations
        yield GaugeMetricFamily("tidepool_loop_lag_seconds", "How late the scheduler's event loop woke up",
                                value=m.loop_lag)  # fmt: skip
        yield GaugeMetricFamily("tidepool_loop_lag_max_seconds", "The largest loop lag seen since the start",
                                value=m.loop_lag_max)  # fmt: skip
        yield GaugeMetricFamily("tidepool_tick_duration_seconds", "How long the scheduler's last tick took",
                                value=float(getattr(sched, "tick_seconds", 0.0)))  # fmt: skip
        yield CounterMetricFamily("tidepool_scheduler_busy_seconds", "Seconds the scheduler's loop spent applying "
                                  "events", value=float(getattr(sched, "busy_seconds", 0.0)))  # fmt: skip
        yield CounterMetricFamily("tidepool_scheduler_batches", "Event batches the scheduler applied",
                                  value=float(getattr(sched, "batches", 0)))  # fmt: skip
        if 0 < len(st.workers) <= self.worker_label_limit:
            w_mem = GaugeMetricFamily("tidepool_worker_memory_bytes", "Per worker: resident memory (rss), "
                                      "results held, spilled, and the limit", labels=["worker", "kind"])  # fmt: skip
            w_run = GaugeMetricFamily("tidepool_worker_tasks", "Per worker: tasks assigned", labels=["worker"])
            for w in sorted(st.workers.values(), key=lambda w: w.id):
                for kind, v in (("rss", w.metrics.get("rss", 0)), ("held", w.nbytes),
                                ("spilled", w.metrics.get("spilled", 0)), ("limit", w.memory_limit)):  # fmt: skip
                    w_mem.add_metric([w.id, kind], float(v or 0))
                w_run.add_metric([w.id], len(w.processing))
            yield w_mem
            yield w_run


def registry_for(model: DashboardModel, worker_label_limit: int = WORKER_LABEL_LIMIT) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ModelCollector(model, worker_label_limit))
    return reg


def render(registry: Any) -> bytes:
    from prometheus_client import generate_latest

    return bytes(generate_latest(registry))


__all__ = ["WORKER_LABEL_LIMIT", "ModelCollector", "registry_for", "render"]
