"""One autoscaler round, written once for the asyncio shell, the simulator and the tests.

State (:class:`Round`): the inbox of reports gathered since the last step, when the provider was
last listed, every worker id it named (to terminate them all at close), and the controller's last
read-only view.  It reads the scheduler state only through ``observation.observe`` and the
controller only through ``step`` and the view that step returns.

A round is two phases (observe, then act; see docs/scaling.md):

1. observe: scheduler events become reports (:meth:`Round.scheduler_events`: joins, readiness,
   setup failures), so do the provider's failures (:meth:`Round.provider_failures`); the provider
   is listed while launches are in flight (:meth:`Round.listing_due`); :meth:`Round.step` builds
   one observation (with the unfinished graph when the last view says a forecast is due) holding
   the inbox, steps the controller and returns its :class:`Actions`;
2. act, in this order: send a new ``Feasibility`` to the scheduler (``CheckFeasible``), name and
   submit launches (the names go back as a ``Named`` report), terminate, retire (outcomes go back
   as ``Retired`` reports and the retired workers are terminated).

:func:`sync_round` is the whole round for a synchronous provider (the simulator's, the tests'
``FakeProvider``); the asyncio shell (``autoscaler.py``) runs the same phases with its provider's
calls awaited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tidepool.scaling.controller import Actions, ControllerView, ScalingController
from tidepool.scaling.observation import (
    Adopted,
    Joined,
    LaunchFailed,
    Named,
    Ready,
    Report,
    Retired,
    WorkerFailed,
    observe,
)
from tidepool.scheduler import events as ev

if TYPE_CHECKING:
    from tidepool.providers.base import ProviderFailure
    from tidepool.scaling.node_types import NodeType
    from tidepool.scheduler.state import SchedulerState
    from tidepool.telemetry.journal import Journal

#: seconds between provider listings while launches are in flight (listing may cost a squeue)
LIST_EVERY = 2.0


class Round:
    """The shell's half of the autoscaler, shared by every shell; see the module docstring."""

    def __init__(self, controller: ScalingController, journal: Journal) -> None:
        self.controller = controller
        self.journal = journal
        self.inbox: list[Report] = []
        self.view: ControllerView = controller.view
        self.named: list[str] = []  # every worker id given to a launch (or adopted with one), for close()
        self._named_set: set[str] = set()
        self._listed_at = float("-inf")
        #: workers named whose launch is being submitted (inf) or was, at that time: a listing
        #: asked for before the submission ended cannot show them (:meth:`step`)
        self._submitting: dict[str, float] = {}

    # ---- observe ----------------------------------------------------------------------------------
    def scheduler_events(self, events: Iterable[ev.Event], pending: bool) -> bool:
        """Turn the scheduler's events into reports; True if a step should run soon (a worker
        came or went, a graph was submitted, or demand appeared with no backlog known yet)."""
        wake = False
        inbox = self.inbox
        for e in events:
            t = type(e)
            if t is ev.WorkerJoin:
                inbox.append(Joined(e.worker, e.now, e.ready))  # type: ignore[union-attr]
                wake = True
            elif t is ev.WorkerReady:
                inbox.append(Ready(e.worker, e.now))  # type: ignore[union-attr]
            elif t is ev.WorkerRemove:
                if e.cause is ev.RemoveCause.SETUP_FAILED:  # type: ignore[union-attr]
                    inbox.append(WorkerFailed(e.worker, e.reason, e.now, setup=True))  # type: ignore[union-attr]
                wake = True
            elif t is ev.UpdateGraph:
                wake = True
        return wake or (pending and self.view.backlog_since is None)

    def provider_failures(self, failures: Iterable[ProviderFailure], now: float) -> None:
        for f in failures:
            if f.worker_id:
                self.inbox.append(WorkerFailed(f.worker_id, f.message, now))
            else:
                self.inbox.append(LaunchFailed(f.request_id, f.message, now))

    def listing_due(self, now: float) -> bool:
        """List the provider now?  Only while launches are in flight (or a restarted scheduler's
        instances wait to be adopted), every ``LIST_EVERY`` s."""
        if (self.view.pending or self.view.restoring) and now - self._listed_at >= LIST_EVERY:
            self._listed_at = now
            return True
        return False

    def step(self, state: SchedulerState, now: float, *, expiring: Sequence[str] = (),
             listing: Mapping[str, Mapping[str, Any]] | None = None, graph_allowed: bool = True,
             notices: Mapping[str, float] | None = None, ends: Mapping[str, float] | None = None,
             listed_at: float | None = None) -> tuple[Actions, bool]:  # fmt: skip
        """Observe ``state`` at ``now`` with the inbox, step the controller, journal its records.
        ``listed_at``: when ``listing`` was asked for (default ``now``; a shell that lists while
        launches are being submitted passes the time it asked): workers whose launch was still being
        submitted then are listed as starting, not failed for missing from it.  Returns the actions
        and whether the unfinished graph went into the observation."""
        if listing is not None and self._submitting:
            listing = self._with_submitting(listing, now if listed_at is None else listed_at)
        want = graph_allowed and self.view.forecast.due(len(state.workers), len(state.tasks),
                                                        state.counters["finished"], now)  # fmt: skip
        reports, self.inbox = self.inbox, []
        actions = self.controller.step(observe(state, now, graph=want, expiring=expiring, listing=listing,
                                               reports=reports, notices=notices, ends=ends))  # fmt: skip
        self.view = actions.view
        for wid, row in actions.instances.items():  # adopted after a restart: terminated at close too
            if row is not None and row.get("request") is not None and wid not in self._named_set:
                self._named_set.add(wid)
                self.named.append(wid)
        for rec in actions.records:
            self.journal.add(rec)
        return actions, want

    def _with_submitting(self, listing: Mapping[str, Mapping[str, Any]],
                         listed_at: float) -> Mapping[str, Mapping[str, Any]]:  # fmt: skip
        out = dict(listing)
        for wid, done in list(self._submitting.items()):
            if done > listed_at:
                out.setdefault(wid, {"alive": True, "state": "submitting"})
            else:  # a listing asked for after its submission ended shows it, or it is gone
                del self._submitting[wid]
        return out

    # ---- act: what the shell reports back ---------------------------------------------------------
    def name(self, rid: str, ids: Sequence[str], now: float, submitted: bool = True) -> None:
        """The provider named the workers of launch ``rid``.  ``submitted=False``: the launch is
        submitted after this (in a thread), and :meth:`submitted` says when that ended."""
        if not submitted:
            self._submitting.update(dict.fromkeys(ids, float("inf")))
        self.named.extend(ids)
        self._named_set.update(ids)
        self.inbox.append(Named(rid, tuple(ids), now))

    def submitted(self, ids: Sequence[str], now: float) -> None:
        """The launch of ``ids`` (named with ``submitted=False``) was submitted, or failed, at ``now``."""
        for wid in ids:
            if wid in self._submitting:
                self._submitting[wid] = now

    def launch_failed(self, rid: str, message: str, now: float) -> None:
        self.inbox.append(LaunchFailed(rid, message, now))

    def retired(self, outcomes: Mapping[str, str], now: float) -> list[str]:
        """Retirements ended; returns the workers to terminate (those that did retire)."""
        for wid, outcome in outcomes.items():
            self.inbox.append(Retired(wid, outcome, now))
        return [w for w, outcome in outcomes.items() if outcome == "retired"]

    def adopt(self, wid: str, now: float) -> None:
        """``wid`` is not launched by the autoscaler but is its to retire (the cluster's own)."""
        self.inbox.append(Adopted(wid, now))

    def arrivals(self, now: float) -> tuple[float, ...]:
        """Seconds until each slot of the launches in flight is expected (for the scheduler's ETA)."""
        out: list[float] = []
        types = {nt.name: nt for nt in self.view.feasibility.node_types}
        for p in self.view.pending:
            nt = types[p.node_type]
            slots = max(1, int(nt.worker_resources.get("cpu", 1))) * nt.workers_per_node * p.nodes
            out.extend([max(0.0, p.since + nt.startup_estimate - now)] * slots)
        return tuple(out)


def sync_round(rnd: Round, state: SchedulerState, provider: Any, now: float, *,
               apply: Callable[[list[ev.Event]], Any], expiring: Sequence[str] = (),
               graph_allowed: bool = True,
               named: Callable[[Sequence[str], NodeType], None] | None = None,
               notices: Mapping[str, float] | None = None,
               ends: Mapping[str, float] | None = None) -> tuple[Actions, bool]:  # fmt: skip
    """One whole round with a synchronous provider (``worker_ids``, ``launch``, ``terminate``,
    ``list``, ``poll_errors`` returning at once): observe, step, then feasibility, launches and
    terminations.  Retirements are left to the caller (``actions.retire``): the simulator goes
    through the scheduler's events, a test may simply remove the workers.  ``apply`` hands
    events to the scheduler state; ``named`` is told each launch's worker ids before it starts."""
    # the listing first, the failures second: a provider's view only moves on, so every worker the
    # listing shows as ended has its failure (with the provider's reason) in this round's reports
    listing = provider.list() if rnd.listing_due(now) else None
    rnd.provider_failures(provider.poll_errors(), now)
    actions, forecast = rnd.step(state, now, expiring=expiring, listing=listing, graph_allowed=graph_allowed,
                                 notices=notices, ends=ends)  # fmt: skip
    if actions.feasibility is not None:
        apply([ev.CheckFeasible(now, actions.feasibility)])
    for rid, nt, n in actions.launch:
        ids = list(provider.worker_ids(nt, n, rid))
        rnd.name(rid, ids, now)
        if named is not None:
            named(ids, nt)
        provider.launch(nt, n, rid)
    if actions.terminate:
        provider.terminate(list(actions.terminate))
    return actions, forecast
