"""The autoscaler shell on the simulator's clock: the shared round (``scaling/shell/round.py``), synchronously.

The round is the asyncio shell's (:class:`~tidepool.scaling.autoscaler.AutoScaler`), written once
in :func:`~tidepool.scaling.shell.round.sync_round`: poll the provider for failures, ask it which
workers expire soon, list it (every ``LIST_EVERY`` seconds while launches are in flight), step the
controller on one observation of the scheduler state and the reports gathered since the last step,
then send a new feasibility rule to the state, launch and terminate.  This module adds what is the
simulator's own: the observer (after every batch the state handled) turns the state's events into
reports and wakes the next step on joins, leaves, submits and new demand; a retirement batch goes
to the state as a ``RetireWorkers`` event and is reported back (``Retired`` reports, then
``terminate`` of the retired workers) once every worker of the batch is closed or refused, as the
asyncio shell does when its futures resolve.

What differs from the asyncio shell: provider calls return at once (no threads, no timeouts); a
step takes simulated time only through ``step_cost`` (see :class:`StepCost`), during which wakes
coalesce, as they do behind a real step that blocks the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidepool.scaling.controller import ControllerView, ScalingController
from tidepool.scaling.shell.round import Round, sync_round
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.telemetry.journal import Journal

if TYPE_CHECKING:
    from tidepool.sim.provider import SimProvider


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
        self.round = Round(controller, journal)
        self._apply = apply
        self._wake = wake
        self._waiters: dict[str, list[_RetireBatch]] = {}
        self.steps = 0
        self.forecasts = 0
        self.step_wall = 0.0  # wall-clock seconds spent in the controller's steps
        self.max_step_wall = 0.0

    @property
    def view(self) -> ControllerView:
        """The controller's read-only view as of its last step."""
        return self.round.view

    def start(self, now: float, **info: Any) -> None:
        self.journal.record("journal-start", now, simulated=True, **info)
        self._apply([ev.CheckFeasible(now, self.round.view.feasibility)])

    # ---- the observer (after every batch the scheduler state handled) --------------------------
    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        wake = self.round.scheduler_events(events, bool(self.state.pending))
        for c in cmds:
            if type(c) is ev.CloseWorker:
                self._resolve(c.worker, "retired", None)
            elif type(c) is ev.RetireRefused:
                self._resolve(c.worker, f"refused: {c.reason}", None)
        if wake:
            self._wake()

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, now: float) -> float:
        """One autoscaler round at ``now``; returns the simulated seconds it keeps the shell busy."""
        state = self.state
        allowed = (self.forecast_budget is None
                   or now - self._forecast_at >= self._forecast_cost / self.forecast_budget)  # fmt: skip
        t0 = time.perf_counter()
        provider = self.provider
        actions, forecast = sync_round(self.round, state, provider, now, apply=self._apply,
                                       expiring=provider.expiring(now), graph_allowed=allowed,
                                       notices=provider.preemptions(now), ends=provider.ends(now))  # fmt: skip
        took = time.perf_counter() - t0
        self.step_wall += took
        self.max_step_wall = max(self.max_step_wall, took)
        self.steps += 1
        self.forecasts += forecast
        cost = self.step_cost
        busy = cost.seconds(len(state.workers), len(state.tasks), forecast)
        if forecast:
            self._forecast_at, self._forecast_cost = now, cost.per_task * len(state.tasks)
        if actions.retire:
            self._retire(list(actions.retire), now)
        return busy

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
        done = self.round.retired(batch.results, now)
        if done:
            self.provider.terminate(done)

    def close(self, now: float) -> None:
        """As ``AutoScaler.close``: terminate every launched worker, journal who was still there."""
        ids = list(dict.fromkeys(self.round.named))
        if ids:
            self.provider.terminate(ids)
        for wid in list(self.state.workers):
            self.journal.record("worker-leave", now, worker=wid, reason="cluster closed", graceful=True)
