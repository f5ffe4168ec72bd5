"""Read-only views over the scheduler state: consistency checks for tests, rows for the dashboard.

Nothing here changes the state; ``state.py`` calls these from its ``validate`` and
``worker_info`` methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from tidepool.resources import Shape
from tidepool.scheduler.kinds import ACTIVE, PENDING
from tidepool.scheduler.retire import unique_data

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord, WorkerRecord


class StateView(Protocol):
    """What these functions read of the scheduler state (``SchedulerState`` is one)."""

    @property
    def tasks(self) -> Mapping[str, TaskRecord]: ...
    @property
    def workers(self) -> Mapping[str, WorkerRecord]: ...
    @property
    def room(self) -> set[str]: ...
    @property
    def overloaded(self) -> set[str]: ...
    @property
    def counts(self) -> dict[str, int]: ...
    @property
    def group_counts(self) -> dict[str, dict[str, int]]: ...
    @property
    def pending(self) -> dict[tuple[Shape, str], int]: ...


def worker_rows(state: StateView) -> list[dict[str, Any]]:
    """One row per worker: identity, load, held data, memory metrics."""
    return [
        {
            "id": w.id, "name": w.name, "address": w.address, "state": w.state,
            "node_type": w.node_type, "resources": dict(w.resources),
            "running": len(w.processing), "held_keys": len(w.has_what), "held_bytes": w.nbytes,
            "unique_keys": len(unique_data(w)), "idle_since": w.idle_since,
            "joined": w.joined, "executed": w.executed, "memory_limit": w.memory_limit,
            "rss": w.metrics.get("rss", 0), "peak_rss": w.metrics.get("peak_rss", 0),
            "spilled_bytes": w.metrics.get("spilled", 0), "spilled_total": w.metrics.get("spilled_total", 0),
            "paused": bool(w.metrics.get("paused")),
            "spill_disabled": str(w.metrics.get("spill_disabled") or ""),
        }
        for w in state.workers.values()
    ]  # fmt: skip


def validate(state: StateView) -> None:
    """Check cross-references; raises AssertionError on an inconsistency."""
    for wid, wrec in state.workers.items():
        assert wrec.nbytes == sum(ts.nbytes for ts in wrec.has_what), ("held bytes", wid, wrec.nbytes)
        assert (wid in state.overloaded) == (wrec.assigned > wrec.slots), ("overloaded", wid)
        for name in wrec.special:  # the scarce resources its assigned tasks ask for, counted exactly
            asked = sum(dict(ts.shape).get(name, 0.0) for ts in wrec.processing if not ts.seceded)
            asked += sum(dict(shape).get(name, 0.0) for shape in wrec.abandoned_special.values())
            assert abs(wrec.special_used.get(name, 0.0) - asked) < 1e-6, ("special_used", wid, name)
    assert state.overloaded <= set(state.workers), ("overloaded", state.overloaded - set(state.workers))
    for wid in state.room:  # new work goes only to running workers that answer
        assert wid in state.workers and state.workers[wid].state == "running", ("room", wid)
        assert not state.workers[wid].suspect, ("room for a suspect worker", wid)
        assert not state.workers[wid].preparing, ("room for a worker running setup hooks", wid)
    for key, ts in state.tasks.items():
        assert ts.key == key
        for w in ts.who_has:
            assert w in state.workers, (key, w)
            assert ts in state.workers[w].has_what, (key, w)
        if ts.state == "memory":
            assert ts.who_has, f"{key} in memory but nobody holds it"
        if ts.state == "running":
            assert ts.worker is not None and ts.worker in state.workers, key
            assert ts in state.workers[ts.worker].processing, key
        if ts.state == "waiting":
            assert ts.waiting_on, f"{key} waiting on nothing"
            for d in ts.waiting_on:
                assert d.state != "memory", (key, d.key)
        if ts.state in ("ready", "no-worker", "running"):
            assert all(d.state == "memory" for d in ts.deps) or ts.state == "running", key
        if ts.state in ACTIVE:
            for d in ts.deps:
                assert ts in d.waiters, (key, d.key)
        for d in ts.deps:
            assert d.key in state.tasks, (key, d.key)
    pending: dict[tuple[Shape, str], int] = {}
    for ts in state.tasks.values():
        if ts.state in PENDING:
            pending[(ts.shape, ts.group)] = pending.get((ts.shape, ts.group), 0) + 1
    assert pending == state.pending, (pending, state.pending)
    counts: dict[str, int] = {}
    for ts in state.tasks.values():
        counts[ts.state] = counts.get(ts.state, 0) + 1
    assert counts == {str(k): v for k, v in state.counts.items() if v}, (counts, state.counts)
    groups: dict[str, dict[str, int]] = {}
    for ts in state.tasks.values():
        gc = groups.setdefault(ts.group, {})
        gc[ts.state] = gc.get(ts.state, 0) + 1
    kept = {g: {k: n for k, n in c.items() if n} for g, c in state.group_counts.items()}
    assert groups == {g: c for g, c in kept.items() if c}, (groups, state.group_counts)
    for w, ws in state.workers.items():
        for ts in ws.has_what:
            assert w in ts.who_has
        for ts in ws.processing:
            assert ts.worker == w and ts.state == "running", (w, ts)
