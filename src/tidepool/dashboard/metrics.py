"""``/metrics``: the dashboard model in Prometheus' text format, through the official client library.

No state of its own: a custom collector reads the model on every scrape (``collect``), so numbers
are never stale and nothing is kept twice.  Families: workers by node type and state, task records
by state, tasks finished/failed/recomputed/retried, launches, retirements and launch failures (from
the autoscaler's journal), pending launch workers, the completion forecast, scheduler loop lag.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tidepool.dashboard.model import DashboardModel, activity


class ModelCollector(Collector):
    def __init__(self, model: DashboardModel) -> None:
        self.model = model

    def collect(self) -> Iterator[Metric]:
        m = self.model
        st = m.scheduler.state
        workers = GaugeMetricFamily("tidepool_workers", "Workers by node type and state", labels=["node_type", "state"])
        counts: dict[tuple[str, str], int] = {}
        for w in st.workers.values():
            state = activity(w)
            counts[(w.node_type, state)] = counts.get((w.node_type, state), 0) + 1
        for (nt, state), n in sorted(counts.items()):
            workers.add_metric([nt, state], n)
        yield workers
        tasks = GaugeMetricFamily("tidepool_tasks", "Task records by state", labels=["state"])
        for state, n in sorted(st.task_counts().items()):
            tasks.add_metric([state], n)
        yield tasks
        c = st.counters
        for name, key, doc in (("tidepool_tasks_finished", "finished", "Tasks finished"),
                               ("tidepool_tasks_failed", "erred", "Tasks that failed"),
                               ("tidepool_tasks_recomputed", "recomputed", "Values recomputed after a loss"),
                               ("tidepool_tasks_retried", "retried", "Task retries"),
                               ("tidepool_workers_lost", "workers_lost", "Workers lost without retiring")):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=c.get(key, 0))
        records = m.journal_records()
        kinds: dict[str, float] = {}
        for r in records:
            k = r.get("kind")
            if k == "launch":
                kinds[k] = kinds.get(k, 0) + r.get("nodes", 1)
            elif k in ("retire", "launch-failed"):
                kinds[k] = kinds.get(k, 0) + 1
        yield CounterMetricFamily("tidepool_launches", "Nodes the autoscaler launched", value=kinds.get("launch", 0))
        yield CounterMetricFamily("tidepool_retirements", "Workers the autoscaler retired", value=kinds.get("retire", 0))
        yield CounterMetricFamily("tidepool_launch_failures", "Launch requests that failed",
                                  value=kinds.get("launch-failed", 0))  # fmt: skip
        point = m.series[-1] if m.series else m.sample(m.scheduler.clock())
        pending = GaugeMetricFamily("tidepool_pending_workers", "Workers launched, not joined yet", labels=["node_type"])
        for nt, n in sorted(point["pending"].items()):
            pending.add_metric([nt], n)
        yield pending
        if point.get("eta") is not None:
            yield GaugeMetricFamily("tidepool_forecast_seconds", "Forecast seconds to finish the work known now",
                                    value=point["eta"])  # fmt: skip
        yield GaugeMetricFamily("tidepool_loop_lag_seconds", "How late the scheduler's event loop woke up",
                                value=m.loop_lag)  # fmt: skip


def registry_for(model: DashboardModel) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ModelCollector(model))
    return reg


def render(registry: Any) -> bytes:
    from prometheus_client import generate_latest

    return bytes(generate_latest(registry))


__all__ = ["ModelCollector", "registry_for", "render"]
