"""Measured worker start-up: requested -> registered -> ready, one journal record per worker.

The autoscaler shell reports three moments of every worker it launched (:meth:`StartupTracker.
launched` when it asks the provider, :meth:`joined` when the worker registers, :meth:`ready` when
its setup hooks have run and it takes tasks) plus, from a provider that says so, how the worker was
started (``fork-server`` or ``spawn``).  When a worker is ready the tracker returns one
``worker-startup`` record::

    {"t": ready, "kind": "worker-startup", "worker": ..., "request": ..., "node_type": ...,
     "how": "fork-server", "requested": t0, "registered": t1, "ready": t2,
     "to_registered": t1 - t0, "to_ready": t2 - t0}

Times are the scheduler's clock (the journal's).  ``tidepool simulate --journal`` calibrates its
start-up model from these records (:func:`startup_delays`), and ``benchmarks/elastic.py`` prints
them.  Pure: no clock, no I/O; workers it was not told about (added by hand) are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class _Pending:
    request: str
    node_type: str
    requested: float
    registered: float | None = None
    how: str | None = None


class StartupTracker:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._how: dict[str, str] = {}  # told before the launch was (a provider may report first)

    def launched(self, worker_ids: Iterable[str], request: str, node_type: str, now: float) -> None:
        for w in worker_ids:
            self._pending[w] = _Pending(request, node_type, now, how=self._how.pop(w, None))

    def started_by(self, worker: str, how: str) -> None:
        p = self._pending.get(worker)
        if p is not None:
            p.how = how
        else:
            self._how[worker] = how

    def joined(self, worker: str, now: float) -> None:
        p = self._pending.get(worker)
        if p is not None and p.registered is None:
            p.registered = now

    def ready(self, worker: str, now: float) -> dict[str, Any] | None:
        """The ``worker-startup`` record of a worker that is now ready (``None`` if not ours)."""
        p = self._pending.pop(worker, None)
        if p is None:
            return None
        registered = p.registered if p.registered is not None else now
        return {"t": round(now, 6), "kind": "worker-startup", "worker": worker, "request": p.request,
                "node_type": p.node_type, "how": p.how, "requested": round(p.requested, 6),
                "registered": round(registered, 6), "ready": round(now, 6),
                "to_registered": round(registered - p.requested, 6), "to_ready": round(now - p.requested, 6)}  # fmt: skip

    def forget(self, worker: str) -> None:
        """A worker that left before it was ready: no record."""
        self._pending.pop(worker, None)
        self._how.pop(worker, None)


def startup_delays(records: Iterable[Mapping[str, Any]], *, until: str = "to_registered") -> dict[str, list[float]]:
    """node type -> the measured start-up of each worker (seconds from request to registered, or
    ``until="to_ready"``), from ``worker-startup`` records; older journals without them: from
    ``launch`` records and the joins of the workers those requests named (``-<request>-`` in the id)."""
    recs = list(records)
    out: dict[str, list[float]] = {}
    startup = [r for r in recs if r.get("kind") == "worker-startup" and r.get(until) is not None]
    if startup:
        for r in startup:
            out.setdefault(str(r.get("node_type", "default")), []).append(float(r[until]))
        return out
    launches = {str(r.get("request")): (float(r["t"]), str(r.get("node_type", "default")))
                for r in recs if r.get("kind") == "launch"}  # fmt: skip
    for r in recs:
        if r.get("kind") != "worker-join":
            continue
        parts = str(r.get("worker", "")).split("-")
        rid = next((q for q in parts if q in launches), None)
        if rid is not None:
            t0, nt = launches[rid]
            out.setdefault(nt, []).append(float(r["t"]) - t0)
    return out
