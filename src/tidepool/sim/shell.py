"""The autoscaler shell on the simulator's clock: ``scaling/autoscaler.py``'s steps, synchronously.

Same order as :class:`~tidepool.scaling.autoscaler.AutoScaler`: on every step it polls the
provider for failures, asks it which workers expire soon, lists it (every ``LIST_EVERY`` seconds
while launches are in flight), steps the controller on one observation of the scheduler state,
writes the controller's records to the journal, re-checks feasibility when a node type got
disabled, then launches, terminates and retires.  Its observer tells the controller about joins,
readiness and setup failures and wakes the next step on joins, leaves, submits and new demand.  A
retirement batch is reported back (``retire_done``, then ``terminate`` of the retired workers)
once every worker of the batch is closed or refused, as the asyncio shell does when its futures
resolve.

Two functions are the only places the simulator touches the controller's interface, so a change
of that interface is adapted here once: :func:`controller_step` (the call) and
:meth:`SimAutoScaler.carry_out` (everything done with the returned ``Actions``).

What differs from the asyncio shell: provider calls return at once (no threads, no timeouts); a
step takes simulated time only through ``step_cost`` (see :class:`StepCost`), during which wakes
coalesce, as they do behind a real step that blocks the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidepool.scaling.autoscaler import LIST_EVERY
from tidepool.scaling.controller import Actions, ScalingController
from tidepool.scaling.observation import observe
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.telemetry.journal import Journal

if TYPE_CHECKING:
    from tidepool.sim.provider import SimProvider


def controller_step(controller: ScalingController, state: SchedulerState, now: float, *,
                    expiring: Sequence[str] = (), listing: Mapping[str, Mapping[str, Any]] | None = None,
                    graph_allowed: bool = True) -> tuple[Actions, bool]:  # fmt: skip
    """The one call of the controller in the simulator: observe ``state`` at ``now`` (with the
    unfinished graph if the controller wants a fresh forecast and ``graph_allowed``), then step.
    Returns the actions and whether the graph was sampled (what the step cost depends on)."""
    want = graph_allowed and controller.wants_graph(len(state.workers), len(state.tasks),
                                                    state.counters["finished"], now)  # fmt: skip
    return controller.step(observe(state, now, graph=want, expiring=expiring, listing=listing)), want


@dataclass(frozen=True)
class StepCost:
    """Simulated seconds one autoscaler step keeps the shell busy: ``base`` plus ``per_worker``
    per registered worker, plus ``per_task`` per task the scheduler knows when the controller
    asked for the graph (a forecast).  The defaults are what ``observe`` + ``step`` cost with
    today's scaling code on a 2-core machine (docs/simulation.md, "The ceiling"), so a
    10,000-worker, 1,000,000-task run steps as rarely as the real shell could: wake-ups during a
    step wait for it.  ``StepCost(0, 0, 0)`` is an infinitely fast shell.  Deterministic by
    design: the wall time a step really took is measured and reported, never used."""

    base: float = 0.0005
    per_worker: float = 2e-5
    per_task: float = 2e-5

    def seconds(self, workers: int, tasks: int, forecast: bool) -> float:
        return self.base + self.per_worker * workers + (self.per_task * tasks if forecast else 0.0)


@dataclass
class _RetireBatch:
    waiting: set[str]
    results: dict[str, str] = field(default_factory=dict)


class SimAutoScaler:
    """Runs the controller against the simulated provider; see the module docstring."""

    def __init__(self, controller: ScalingController, provider: SimProvider, state: SchedulerState,
                 journal: Journal, *, apply: Callable[[list[ev.Event]], list[ev.Command]],
                 wake: Callable[[], None], step_cost: StepCost | None = None,
                 forecast_budget: float | None = None) -> None:  # fmt: skip
        self.controller = controller
        self.step_cost = step_cost if step_cost is not None else StepCost()
        #: None: the graph goes to the controller whenever it asks (as the asyncio shell does).  A
        #: fraction f: only if the last forecast is at least (its modelled cost / f) seconds old
        self.forecast_budget = forecast_budget
        self._forecast_at = float("-inf")
        self._forecast_cost = 0.0
        self.provider = provider
        self.state = state
        self.journal = journal
        self._apply = apply
        self._wake = wake
        self._listed_at = float("-inf")
        self._disabled_seen = 0
        self._waiters: dict[str, list[_RetireBatch]] = {}
        self.steps = 0
        self.forecasts = 0
        self.step_wall = 0.0  # wall-clock seconds spent in controller_step
        self.max_step_wall = 0.0

    def start(self, now: float, **info: Any) -> None:
        self.journal.record("journal-start", now, simulated=True, **info)
        self.state.infeasible = self.controller.infeasible_reason

    # ---- the observer (after every batch the scheduler state handled) --------------------------
    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        controller = self.controller
        wake = False
        for e in events:
            t = type(e)
            if t is ev.WorkerJoin:
                controller.worker_joined(e.worker, e.now)  # type: ignore[union-attr]
                if e.ready:  # type: ignore[union-attr]
                    controller.worker_ready(e.worker)  # type: ignore[union-attr]
                wake = True
            elif t is ev.WorkerReady:
                controller.worker_ready(e.worker)  # type: ignore[union-attr]
            elif t is ev.WorkerRemove:
                if e.cause is ev.RemoveCause.SETUP_FAILED:  # type: ignore[union-attr]
                    controller.worker_failed(e.worker, e.reason, e.now, setup=True)  # type: ignore[union-attr]
                wake = True
            elif t is ev.UpdateGraph:
                wake = True
        self._sync()
        for c in cmds:
            if type(c) is ev.CloseWorker:
                self._resolve(c.worker, "retired", None)
            elif type(c) is ev.RetireRefused:
                self._resolve(c.worker, f"refused: {c.reason}", None)
        if wake or (self.state.pending and controller.backlog_since is None):
            self._wake()

    def _sync(self) -> None:
        for rec in self.controller.drain_records():
            self.journal.add(rec)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, now: float) -> float:
        """One autoscaler round at ``now``; returns the simulated seconds it keeps the shell busy."""
        controller, provider = self.controller, self.provider
        for failure in provider.poll_errors():
            if failure.worker_id:
                controller.worker_failed(failure.worker_id, failure.message, now)
            else:
                controller.launch_failed(failure.request_id, failure.message, now)
        expiring = provider.expiring(now)
        listing = None
        if controller.launches and now - self._listed_at >= LIST_EVERY:
            self._listed_at = now
            listing = provider.list()
        state = self.state
        allowed = (self.forecast_budget is None
                   or now - self._forecast_at >= self._forecast_cost / self.forecast_budget)  # fmt: skip
        t0 = time.perf_counter()
        actions, forecast = controller_step(controller, state, now, expiring=expiring, listing=listing,
                                            graph_allowed=allowed)  # fmt: skip
        took = time.perf_counter() - t0
        self.step_wall += took
        self.max_step_wall = max(self.max_step_wall, took)
        self.steps += 1
        self.forecasts += forecast
        cost = self.step_cost
        busy = cost.seconds(len(state.workers), len(state.tasks), forecast)
        if forecast:
            self._forecast_at, self._forecast_cost = now, cost.per_task * len(state.tasks)
        self.carry_out(actions, now)
        return busy

    def carry_out(self, actions: Actions, now: float) -> None:
        """Everything the simulator does with a step's ``Actions``, in the asyncio shell's order."""
        for rec in actions.records:
            self.journal.add(rec)
        controller = self.controller
        if len(controller.unusable) != self._disabled_seen:
            self._disabled_seen = len(controller.unusable)
            self._apply([ev.CheckFeasible(now)])
        for rid, nt, n in actions.launch:
            controller.launched(rid, self.provider.worker_ids(nt, n, rid), now)
            self.provider.launch(nt, n, rid)
            self._sync()
        if actions.terminate:
            self.provider.terminate(list(actions.terminate))
        if actions.retire:
            self._retire(list(actions.retire), now)

    # ---- retirement, as Scheduler.retire_workers + AutoScaler._retire -----------------------------
    def _retire(self, ids: list[str], now: float) -> None:
        known = [w for w in ids if w in self.state.workers]
        batch = _RetireBatch(set(known), {w: "unknown worker" for w in ids if w not in self.state.workers})
        for w in known:
            self._waiters.setdefault(w, []).append(batch)
        if not known:
            self._finish(batch, now)
            return
        self._apply([ev.RetireWorkers(known, now, "autoscaler")])

    def _resolve(self, wid: str, outcome: str, now: float | None) -> None:
        for batch in self._waiters.pop(wid, []):
            batch.results[wid] = outcome
            batch.waiting.discard(wid)
            if not batch.waiting:
                self._finish(batch, self.state.now if now is None else now)

    def _finish(self, batch: _RetireBatch, now: float) -> None:
        done = []
        for wid, outcome in batch.results.items():
            self.controller.retire_done(wid, outcome, now)
            if outcome == "retired":
                done.append(wid)
        self._sync()
        if done:
            self.provider.terminate(done)

    def close(self, now: float) -> None:
        """As ``AutoScaler.close``: terminate every launched worker, journal who was still there."""
        ids = self.controller.launched_worker_ids()
        if ids:
            self.provider.terminate(ids)
        self._sync()
        for wid in list(self.state.workers):
            self.journal.record("worker-leave", now, worker=wid, reason="cluster closed", graceful=True)
