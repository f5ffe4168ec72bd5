"""Replaying a real run's journal: its graph's shape and its own start-up times.

:func:`graph_from_journal` turns the ``task`` records of a journal written by this version
(``submitted``, ``deps``, ``nbytes``, ``resources``; see :mod:`tidepool.telemetry.journal`) into a
:class:`~tidepool.sim.workload.Workload` with the real graph: every task keeps its inputs and is
submitted at its recorded graph update (time zero is the first), so a replay keeps the chains and
the barriers of the run instead of pinning tasks to their recorded start times.  Keys whose task
record is missing (computed before the journal began) are dropped from their dependents' inputs,
and said so in the notes.  A key that ran twice (recomputed after a lost worker, or a retry) is
replayed once more under ``<key>-again-<n>`` with the same inputs.

:func:`calibrate_startup` replaces the start-up model of each node type of a simulated cluster by
the start-ups measured in the run (``worker-startup`` records: request -> ready; older journals:
``launch`` -> ``worker-join``), sampled uniformly from the measured values (``choice(...)``), so a
replay on a loaded machine sees that machine's start-up, not the preset's.

:func:`calibrate_latency` sets the simulated message delay from the run's dispatch gaps: on each
worker, the time from one task's end to the start of the next when that next task was already
runnable (submitted, inputs done) -- a report to the scheduler and a run message back, so half the
mean gap is one message.  The mean, not the median: on a loaded machine a few long stalls (the
scheduler's process not scheduled) are most of the lost time.  :func:`calibrate` does both.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tidepool.errors import ConfigError
from tidepool.sim.dists import Dist
from tidepool.sim.provider import ZERO
from tidepool.sim.workload import SimTask, Stage, Workload, sinks
from tidepool.telemetry.startup import startup_delays


def has_graph(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the journal's task records carry their inputs (written by this version)."""
    return any(r.get("kind") == "task" and "deps" in r for r in records)


def graph_from_journal(records: Sequence[Mapping[str, Any]], *, name: str = "journal") -> Workload:
    """The recorded graph (see the module docstring)."""
    tasks = [r for r in records if r.get("kind") == "task"]
    if not tasks:
        raise ConfigError("the journal has no 'task' records: record one with tidepool scheduler --journal "
                          "or cluster.adapt(journal=...) (task records are on by default)")  # fmt: skip

    def start(r: Mapping[str, Any]) -> float:
        return float(r.get("start", float(r["t"]) - float(r.get("duration", 0.0))))

    subs = [float(r["submitted"]) for r in tasks if r.get("submitted") is not None]
    t0 = min(subs) if subs else min(start(r) for r in tasks)
    order = sorted(tasks, key=lambda r: (float(r.get("submitted", t0)), start(r), str(r.get("key"))))
    known = {str(r.get("key")) for r in tasks}
    by_time: dict[float, list[SimTask]] = {}
    seen: set[str] = set()
    dropped: set[str] = set()
    again = 0
    for n, r in enumerate(order):
        key = str(r.get("key", f"task-{n}"))
        deps = []
        for d in r.get("deps") or []:
            if d in known:
                deps.append(str(d))
            else:
                dropped.add(str(d))
        if key in seen:
            again += 1
            key = f"{key}-again-{n}"
        seen.add(key)
        at = round(max(0.0, float(r.get("submitted", t0)) - t0), 6)
        res = r.get("resources") or None
        by_time.setdefault(at, []).append(SimTask(key, float(r.get("duration", 0.0)), deps, str(r.get("group") or ""),
                                                   res, nbytes=int(r.get("nbytes", 8) or 8)))  # fmt: skip
    stages = []
    for at, ts in sorted(by_time.items()):
        stages.append(Stage(ts, sinks(ts), at))
    edges = sum(len(t.deps) for ts in by_time.values() for t in ts)
    note = (f"replayed from a journal with its graph: {len(tasks)} task records, {edges} dependencies, "
            f"{len(stages)} graph update(s) at their recorded times")  # fmt: skip
    notes = [note]
    if again:
        notes.append(f"{again} task executions repeated a key (recomputed or retried): replayed as extra tasks")
    if dropped:
        notes.append(f"{len(dropped)} inputs have no task record (computed before the journal began): "
                     "dropped from their dependents")  # fmt: skip
    return Workload(name, stages, notes=notes)


def calibrate_startup(cluster: Any, records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Give every node type of ``cluster`` (a :class:`~tidepool.sim.cluster.SimCluster`, changed in
    place) the start-up measured in the journal; node types the run did not launch get all the
    run's measurements.  Returns notes on what was used (none if the journal measured nothing)."""
    delays = startup_delays(records, until="to_ready")
    if not any(delays.values()):
        delays = startup_delays(records)
    pooled = [d for ds in delays.values() for d in ds]
    if not pooled:
        return []
    notes = []
    for nt in cluster.node_types:
        own = delays.get(nt.name) or pooled
        values = tuple(round(max(0.0, d), 6) for d in own[:10_000])
        old = cluster.models[nt.name]
        cluster.models[nt.name] = replace(old, boot=Dist("choice", values), queue=ZERO)
        notes.append(f"start-up of {nt.name!r} from the journal: {len(values)} measured workers, median "
                     f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f} s), instead of "
                     f"{old.describe()}")  # fmt: skip
    return notes


def dispatch_gaps(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds between a task's end and the next start on its worker, when the next was runnable."""
    tasks = [r for r in records if r.get("kind") == "task"]
    ends: dict[str, float] = {}
    by_worker: dict[str, list[Mapping[str, Any]]] = {}
    for r in tasks:
        start = float(r.get("start", float(r["t"]) - float(r.get("duration", 0.0))))
        ends.setdefault(str(r.get("key")), start + float(r.get("duration", 0.0)))
        by_worker.setdefault(str(r.get("worker")), []).append(r)
    gaps = []
    for runs in by_worker.values():
        runs.sort(key=lambda r: float(r.get("start", 0.0)))
        for a, b in zip(runs, runs[1:], strict=False):
            if "submitted" not in b:
                continue
            a_end = float(a["start"]) + float(a.get("duration", 0.0))
            ready = max([float(b["submitted"])] + [ends.get(str(d), 0.0) for d in b.get("deps") or []])
            if ready <= a_end:
                gaps.append(max(0.0, float(b["start"]) - a_end))
    return gaps


def calibrate_latency(cluster: Any, records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Set ``cluster.latency`` (one message, s) from the run's dispatch gaps (never below what it
    was); notes on what was used (none for a journal without runnable follow-up tasks)."""
    gaps = dispatch_gaps(records)
    if not gaps:
        return []
    latency = max(cluster.latency, statistics.mean(gaps) / 2)
    old, cluster.latency = cluster.latency, latency
    return [f"message delay from the journal: {latency * 1000:.1f} ms (half the mean gap between a task's end and "
            f"the next runnable task's start on its worker, over {len(gaps)} gaps), instead of {old * 1000:.1f} ms"]


def calibrate(cluster: Any, records: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`calibrate_startup` and :func:`calibrate_latency`: the run's own machine, in the replay."""
    return calibrate_startup(cluster, records) + calibrate_latency(cluster, records)
