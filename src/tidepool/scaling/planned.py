"""The default scaling policy: launches and retirements planned from the graph, for one objective.

State: what the run has cost so far (``spent``, integrated over the snapshots it saw), when work
first appeared (the deadline's origin), and which notices it already gave (an infeasible deadline
or budget is said once, at once).  Input: a :class:`ClusterSnapshot` whose per-type forecasts play
the unfinished graph forward on the pool (:func:`~tidepool.scaling.forecast.type_forecasts`):
the remaining time with 0, 1, 2, ... extra nodes, how long each new node would work and when it
would start, and the width the graph uses over time on the pool as it is.

One model of holding cost decides both ways.  A node costs its start-up ``S`` plus the time it is
held; of a start-up only ``B`` is billed (the node type's ``billed_startup``: all of ``S`` unless
set; a Slurm job's queue wait is free, its boot is not).  So:

- **launch** ``k`` more nodes when they shorten the forecast, each works at least ``S x
  launch_factor``, and all of them get work within ``S x (1 + slack)`` of the launch (needed on
  arrival, not bought early to wait); the largest such ``k``;
- **retire** an idle node when the forecast's width within ``S + B x slack`` never needs it (a
  node needed within ``S`` is kept: a relaunch would come late): holding it idle that long costs
  more than a relaunch just in time, which bills ``B``.  Where ``B = S`` that is the launch rule's
  own horizon, so the relaunch is not due now and a retirement is not undone by the next launch;
  where ``B < S`` (Slurm) a node may be retired and bought again at once, its queue wait free.
  The width is set against the nodes that have joined and are not being retired, not launches in
  flight (the forecast counts their slots from their expected arrival; a queued job may come much
  later).  A
  node holding values a waiting task needs is first kept a moment (``LOCALITY_HOLD``, at most what a
  relaunch would cost, as below) in case that task runs there; values only a client wants (the
  run's results) keep no node.  With no graph at all (between two computes) an idle node is kept about ``B``
  (what a relaunch would bill; the ski-rental rule), at most ``hold_cap`` seconds;
- before any task has finished every duration is a guess (the scheduler's 0.5 s prior): under
  ``balanced`` and ``fastest`` (and a deadline) launch for every runnable task as well, as Dask's
  and Spark's rules do, and let the forecast take over once durations are measured.  Beyond the
  nodes the forecast justifies, bet on durations longer than the prior: every node the guessed
  graph gives work, under ``balanced`` (and a deadline) only while the nodes launched since the
  graph came take at most ``guess_budget`` node-hours of start-ups (``fastest``: no limit).

Spend on evidence, not on guesses: the objective rules launch on the forecast's ``evidence`` view
(a kind that never finished at the scheduler's prior until its running tasks show it is long), and
retirements read a width in which a running task of such a kind has at least as long to go as it
ran (``RemainingWork.for_launch`` / ``for_hold``); a deadline or budget plans on the mean.

Objectives (``adapt(objective=...)``): ``balanced`` (the default: launch_factor 0.5 on measured
durations, 0 on guesses up to ``guess_budget``, slack 0.5; on real workflows the best makespan needs nearly every node that
shortens the run, and the savings come from retiring by the forecast width), ``fastest`` (slack 1: a longer horizon before retiring),
``cheapest`` (nodes that work at least 3 x S, slack 0.25, no launch on guesses).  ``deadline=``
seconds after work first appears: the cheapest pool whose forecast finishes by then (cost = nodes
x forecast time), and a notice as soon as no pool can; ``budget=`` in the node types' ``cost``
units (cost per node-hour, as the simulator bills), a ceiling: what finishing costs on the nodes
held is reserved first, extra nodes are bought only if their own cost fits with that reserve in
``BUDGET_MARGIN`` of what is left, the pool grows at most ``BUDGET_GROWTH``-fold on joined nodes,
a node is bought only if it would work at least its start-up (``BUDGET_MIN_WORK``), one node while
durations are guesses; over the ceiling nothing is bought and idle nodes retire at
once, and a notice comes as soon as even the cheapest forecast does not fit.  A deadline retires
as ``cheapest`` does; a budget too, but holds no idle node when no work is known.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tidepool.errors import ConfigError
from tidepool.resources import fits
from tidepool.scaling.forecast import peak_in_use
from tidepool.scaling.limits import least_billed_hours
from tidepool.scaling.planner import PLAIN, plan, rank_types
from tidepool.scaling.policies import MemoryPressure, NoProgress, as_decision, keep_young, merge
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision, TypeForecast, WorkerView

log = logging.getLogger("tidepool.scaling")

OBJECTIVES = ("balanced", "fastest", "cheapest")
#: a budget plans on this share of what is left (forecasts are estimates; nodes retire late)
BUDGET_MARGIN = 0.8
#: a budget buys a node only if the forecast gives each of its slots at least this many start-ups of
#: work: a node that would work less pays more for booting than for working, the dearest way to
#: finish a little sooner.  Without it the 22-chromosome 1000genome bought 9 nodes 300 s before its
#: end on a forecast of 165 s more (its last kind, ``frequency``, 134 s, not measured yet) and
#: overran its budget by 2% (4.03 node-hours for 3.936); with it, 3.76 and the same makespan
BUDGET_MIN_WORK = 1.0
#: a budget grows the pool at most this many times the nodes that have joined, per decision
BUDGET_GROWTH = 4
#: while every duration is a guess (nothing finished), idle nodes are held (1 + this) start-ups: none,
#: only the nodes the forecast uses now are kept
GUESS_SLACK = -1.0
#: the longest a node the forecast does not need is kept idle for values a waiting task needs, in
#: case that task runs there (seconds; at most the no-graph hold, so a node starting in under this
#: is kept as long as before).  Not a start-up: the forecast width has already said no node is
#: needed within the horizon, so this covers only a wave's stragglers; their values move to a
#: survivor otherwise.  Up to 30 s on Slurm and 22.5 s on the cloud (S / 4) cost 1000genome-10ch on
#: slurm:50 2.62 node-hours (now 2.52), the 15-degree montage on cloud:50 7.43 (now 7.39), makespans
#: unchanged; 5 s retired nodes the montage's last wave needed (1,058 -> 1,085 s)
LOCALITY_HOLD = 10.0
#: the default ``guess_budget``: 1.25 node-hours of start-ups, 50 cloud nodes of a 90 s boot.  On the
#: montages and 1000genome on 200 cloud nodes an unlimited bet bought every node at t=0 and retired
#: most on arrival (cost 2-4x the bound: 2mass-05d 6.66 node-hours for 165 s, 2.62 for 195 s with
#: this); blast's 300 long tasks behind a 1 s gate run best on about 54 nodes at once (50: 308 s
#: against 302, still ahead of the ramp's 333; 36 made it 21% slower), and the dss montage's bet
#: nodes are retired on arrival (1.5: 7.62 node-hours, dearer than the ramp's 7.41; 1.25: 7.39)
GUESS_BUDGET = 1.25
#: objective -> (launch_factor, slack, guess launches before anything finished)
_RULES = {"balanced": (0.5, 0.5, True), "fastest": (0.0, 1.0, True), "cheapest": (3.0, 0.25, False)}


def check_objective(objective: str, deadline: float | None, budget: float | None) -> None:
    """Refuse an unknown objective or a deadline/budget that is not a positive number."""
    if objective not in OBJECTIVES:
        from difflib import get_close_matches

        close = get_close_matches(str(objective), OBJECTIVES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}{hint}")
    for name, value in (("deadline", deadline), ("budget", budget)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):  # fmt: skip
            unit = "seconds after work first appears" if name == "deadline" else "cost units (node type cost x node-hours)"
            raise ConfigError(f"{name} must be a positive number of {unit}, got {value!r}")
    if deadline is not None and budget is not None:
        raise ConfigError("give a deadline or a budget, not both (a deadline is met at least cost; a budget "
                          "is spent as fast as possible)")  # fmt: skip


@dataclass
class GraphPlan:
    """Launches and retirements from the graph's forecast, for one objective (module docstring)."""

    objective: str = "balanced"
    deadline: float | None = None
    budget: float | None = None
    #: the longest an idle node is kept when no work is known at all (seconds)
    hold_cap: float = 30.0
    #: an idle node is never retired sooner than this (a task may be on its way to it)
    min_idle: float = 0.05
    #: ``balanced`` (and a deadline) while every duration is a guess: the bet on longer durations
    #: launches nodes of a type only while all launched so far take at most this many node-hours of
    #: billed start-ups; nodes the forecast justifies and nodes for the runnable tasks are launched
    #: whatever it says (and count)
    guess_budget: float = GUESS_BUDGET
    spent: float = field(default=0.0, init=False)
    _last: float | None = field(default=None, init=False)
    _start: float | None = field(default=None, init=False)
    _said: set[str] = field(default_factory=set, init=False)
    #: node type -> nodes launched while every duration was a guess (``guess_budget`` limits the bet
    #: to a number of them), counted from the launches that appeared, not from decisions
    _guessed: dict[str, int] = field(default_factory=dict, init=False)
    #: ids of pending launches already counted
    _seen: set[str] = field(default_factory=set, init=False)
    #: a budget whose reserve for the nodes held leaves nothing: retire idle nodes at once
    _tight: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        check_objective(self.objective, self.deadline, self.budget)
        g = self.guess_budget
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0 or g == math.inf:
            raise ConfigError(f"guess_budget must be a number >= 0 (node-hours of start-ups of nodes bought on "
                              f"guessed durations; 0: no bet), got {g!r}")  # fmt: skip

    @property
    def label(self) -> str:
        if self.deadline is not None:
            return f"deadline {self.deadline:g}s"
        if self.budget is not None:
            return f"budget {self.budget:g}"
        return self.objective

    # ---- accounting ---------------------------------------------------------------------------
    def _account(self, snap: ClusterSnapshot) -> None:
        if self._last is not None and snap.now > self._last:
            rate = sum(snap.nodes_of(nt.name) * nt.cost for nt in snap.node_types) / 3600.0
            self.spent += rate * (snap.now - self._last)
        self._last = snap.now
        if self._start is None and (snap.demand or snap.forecasts or snap.running):
            self._start = snap.now

    def _notice(self, key: str, text: str, reasons: list[str]) -> None:
        reasons.append(text)
        if key not in self._said:
            self._said.add(key)
            log.warning("scaling: %s", text)

    # ---- the decision -------------------------------------------------------------------------
    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        self._account(snap)
        reasons: list[str] = []
        launch = self._launch(snap, reasons)
        retire, why = self._retire(snap, launch, reasons)
        cancel = self._call_off(snap, launch, reasons, retire)
        return ScaleDecision(launch=launch, retire=tuple(retire), reasons=tuple(reasons), why=tuple(why),
                             cancel=cancel)  # fmt: skip

    def _launch(self, snap: ClusterSnapshot, reasons: list[str]) -> dict[str, int]:
        factor, slack, guess = _RULES[self.objective]
        launch: dict[str, int] = {}
        left = None if self.budget is None else self.budget - self.spent
        self._charge_bets(snap)
        # durations are guesses until a task finished: launch for the runnable tasks (a deadline is
        # not planned on guesses either)
        runnable: dict[str, int] = {}
        if (guess or self.deadline is not None) and self.budget is None and snap.demand and snap.finished == 0:
            # the plan overflows plain work onto gpu (...) types when the plain ones are full; those
            # are kept for work that needs what they have (their nodes cost more and idle otherwise)
            needed = {name for d in snap.demand for name, _ in d.shape if name not in PLAIN}
            runnable = {k: v for k, v in plan(snap).nodes.items() if v > 0 and not _wasted(snap, k, needed)}
        for f in snap.forecasts:
            if len(f.extra) < 2 or snap.blocked(f.node_type):
                continue
            # bought when needed on arrival: the slack covers the spread of start-ups (a queue wait
            # too), so it is a share of the whole start-up, billed or not
            soon = f.startup * (1.0 + slack)
            guessing = snap.finished == 0  # every duration is the scheduler's prior until a task finished
            if self.deadline is not None:
                # said as soon as the fastest forecast misses it, launches or not (on guesses too:
                # the prior is short, so a deadline missed even then is missed whatever the durations)
                self._deadline_feasible(snap, f, reasons)
            if not snap.demand and (snap.next_demand_in is None or snap.next_demand_in > soon):
                continue  # nothing can run before a new node would arrive: launch when it can
            # n: how many nodes of this type to launch now
            if guessing and self.budget is not None:
                # a budget is not spent on guesses: one node until durations are measured
                n = 1 if snap.nodes_of(f.node_type) == 0 else 0
                text = (f"budget {self.budget:g}: durations are guesses until a task finishes: one node"
                        if n else "")  # fmt: skip
            elif guessing and self.deadline is not None:
                # nor is a deadline planned on them: as balanced until durations are measured
                balanced = f.startup * (1.0 + _RULES["balanced"][1])
                n, text = self._on_guesses(snap, f.for_launch, _RULES["balanced"][0], balanced,
                                           runnable.get(f.node_type, 0))  # fmt: skip
            elif self.deadline is not None:
                i, text = self._for_deadline(snap, f)
                n = f.extra[i]
            elif left is not None:
                i, text = self._for_budget(snap, f, left)
                left -= self._cost(snap, f, i)
                n = f.extra[i]
            elif guessing and guess:
                n, text = self._on_guesses(snap, f.for_launch, factor, soon, runnable.get(f.node_type, 0))
            else:
                i, text = self._for_objective(f.for_launch, factor, soon)
                n = f.extra[i]
            if n == 0 and left is None and f.etas[0] == float("inf") and _stranded(snap, f.node_type):
                # runnable work no node here or coming could run, and this type is the one for it:
                # whatever the objective weighs, one must start (else only the no-progress net,
                # 30 s later, would start it)
                n, text = self._first_node(f)
            if text:
                reasons.append(text)
            if n > 0:
                launch[f.node_type] = n
        if self.deadline is not None and not snap.forecasts and not snap.workers and snap.node_types:
            # no forecast yet (none computed, or no graph): whatever the durations, the first node
            # must start; a deadline shorter than the quickest start-up is missed
            start = self._start if self._start is not None else snap.now
            left = start + self.deadline - snap.now
            quickest = min(nt.startup_estimate for nt in snap.node_types)
            if quickest > left:
                self._notice("deadline", f"deadline {self.deadline:g}s cannot be met: {left:.0f}s left and the "
                             f"quickest node type takes {quickest:.1f}s to start; running as fast as possible",
                             reasons)  # fmt: skip
        extra = {k: v for k, v in runnable.items() if v > launch.get(k, 0)}
        if extra:
            launch.update(extra)
            reasons.append(f"{self.label}: no task has finished yet, so every duration is a guess: launch for "
                           f"the {snap.demand_tasks} runnable tasks ({_counts(extra)})")  # fmt: skip
        return launch

    def _on_guesses(self, snap: ClusterSnapshot, f: TypeForecast, factor: float, soon: float,
                    runnable: int) -> tuple[int, str]:  # fmt: skip
        """How many nodes to launch while every duration is a guess: the larger of those the
        forecast justifies on its own numbers, those the runnable tasks need (``runnable``), and a
        bet on every node the guessed graph gives work (durations are usually longer than the
        prior), the bet limited under ``balanced`` and a deadline to ``guess_budget`` node-hours of
        start-ups, counting every node launched while guessing (those bought for the runnable
        tasks serve the work behind them too; ``fastest``: no limit)."""
        i, text = self._for_objective(f, factor, soon)
        j, bet = self._for_objective(f, 0.0, soon, True)
        base = max(f.extra[i], runnable)
        if f.extra[j] <= base:
            return f.extra[i], text
        if self.objective == "fastest" and self.deadline is None:
            return f.extra[j], bet
        # node-hours of start-up a node lost on the bet costs (not priced: a cheaper type, such as
        # spot, would otherwise bet on more nodes and lose its saving to boots)
        boot = _billed(snap, f.node_type, f.startup) / 3600.0
        allowed: float
        if self.guess_budget <= 0:
            allowed = 0
        else:
            allowed = math.inf if boot <= 0 else math.floor(self.guess_budget / boot + 1e-9)
        used = self._guessed.get(f.node_type, 0)
        n = int(min(f.extra[j], max(0, allowed - used)))
        if n >= f.extra[j]:
            return f.extra[j], bet
        note = (f"{self.label}: a bet on guessed durations of {f.extra[j]} node(s) limited to {n} by "
                f"guess_budget={self.guess_budget:g} node-hours of start-ups ({boot:.3g} each: {allowed:g} "
                f"nodes in all, {used} launched while guessing)")  # fmt: skip
        if n <= base:
            return f.extra[i], "; ".join(t for t in (text, note) if t)
        return n, f"{bet}; {note}"

    def _charge_bets(self, snap: ClusterSnapshot) -> None:
        """Count the nodes launched while every duration is a guess (from the launches that appeared,
        not from decisions: a round's launch may be dropped, by a stale forecast or a limit), and
        start a new count between graphs (no work known, nothing running or waiting)."""
        for p in snap.pending:
            if p.request_id not in self._seen:
                self._seen.add(p.request_id)
                if snap.finished == 0:  # the whole launch: some of its nodes may have joined already
                    self._guessed[p.node_type] = self._guessed.get(p.node_type, 0) + max(p.nodes, p.requested)
        self._seen.intersection_update(p.request_id for p in snap.pending)
        if not snap.demand and not snap.forecasts and not snap.running and not snap.waiting:
            self._guessed.clear()

    def _first_node(self, f: TypeForecast) -> tuple[int, str]:
        """The fewest nodes of ``f``'s type that make the forecast finite (the pool has none)."""
        i = next((j for j in range(1, len(f.extra)) if f.etas[j] < float("inf")), 0)
        if i == 0:
            return 0, ""
        return f.extra[i], (f"{self.label}: {f.tasks} tasks preferring {f.node_type} and no node that runs them: "
                            f"forecast never now, {_fmt(f.etas[i])} with {f.extra[i]} more node(s)")  # fmt: skip

    def _for_objective(self, f: TypeForecast, factor: float, soon: float, guessing: bool = False) -> tuple[int, str]:
        best = 0
        for i in range(1, len(f.extra)):
            # on guessed durations a small gain says nothing: take every node that gets work
            if f.etas[i] >= (f.etas[0] if guessing else f.etas[best] * 0.995):
                continue  # does not shorten the run
            busy = f.new_busy[i] if i < len(f.new_busy) else f.etas[i] - f.startup
            start = f.new_start[i] if i < len(f.new_start) else f.startup
            if busy >= factor * f.startup and start <= soon:
                best = i
        if best == 0:
            return 0, ""
        busy = f.new_busy[best] if best < len(f.new_busy) else 0.0
        return best, (f"{self.label}: {f.tasks} tasks preferring {f.node_type}: forecast {_fmt(f.etas[0])} now, "
                      f"{_fmt(f.etas[best])} with {f.extra[best]} more node(s); each would work {busy:.0f}s "
                      f"for a start-up of {f.startup:.1f}s")  # fmt: skip

    def _cost(self, snap: ClusterSnapshot, f: TypeForecast, i: int) -> float:
        """Forecast cost of the rest of the run with ``extra[i]`` more nodes (all held to the end)."""
        nt = snap.node_type(f.node_type)
        price = nt.cost if nt is not None else 1.0
        eta = f.etas[i]
        if eta == float("inf"):
            return float("inf")
        return (snap.nodes_of(f.node_type) + f.extra[i]) * eta * price / 3600.0

    def _deadline_feasible(self, snap: ClusterSnapshot, f: TypeForecast, reasons: list[str]) -> bool:
        assert self.deadline is not None
        start = self._start if self._start is not None else snap.now
        left = start + self.deadline - snap.now
        i = min(range(len(f.extra)), key=lambda j: (f.etas[j], j))
        if f.etas[i] <= left:
            return True
        self._notice("deadline", f"deadline {self.deadline:g}s cannot be met: {left:.0f}s left and the fastest "
                     f"forecast is {_fmt(f.etas[i])} (with {f.extra[i]} more {f.node_type} node(s), current "
                     "estimates); running as fast as possible", reasons)  # fmt: skip
        return False

    def _for_deadline(self, snap: ClusterSnapshot, f: TypeForecast) -> tuple[int, str]:
        assert self.deadline is not None
        start = self._start if self._start is not None else snap.now
        left = start + self.deadline - snap.now
        meets = [i for i in range(len(f.extra)) if f.etas[i] <= left]
        if meets:
            i = min(meets, key=lambda j: (self._cost(snap, f, j), j))
            if i == 0:
                return 0, ""
            return i, (f"deadline {self.deadline:g}s ({left:.0f}s left): {f.extra[i]} more {f.node_type} node(s) "
                       f"finish in {_fmt(f.etas[i])}, the least cost that meets it")  # fmt: skip
        i = min(range(len(f.extra)), key=lambda j: (f.etas[j], j))
        return i, (f"deadline {self.deadline:g}s infeasible: fastest forecast {_fmt(f.etas[i])} > {left:.0f}s left; "
                   f"{f.extra[i]} more node(s), as fast as possible")  # fmt: skip

    def _for_budget(self, snap: ClusterSnapshot, f: TypeForecast, left: float) -> tuple[int, str]:
        """The budget is a ceiling: first reserve what finishing costs on the nodes already held
        (they are held to the forecast's end, as if no node came), then buy only nodes whose whole
        cost (billed from launch, start-up included, to the end of the run they make) fits with the
        reserve in ``BUDGET_MARGIN`` of what is left.  The margin bounds the total, not each step's
        purchase (a share of the rest at every step would add up to all of it).  When even the
        reserve does not fit, launch nothing and retire idle nodes at once."""
        assert self.budget is not None
        nt = snap.node_type(f.node_type)
        billed = self.budget - snap.spent if snap.spent is not None else left  # the meter's, when known
        if nt is not None and nt.cost > 0 and billed < nt.cost * least_billed_hours(nt):
            # the hard limit refuses it (a node is billed that much at the least): not planned either
            return 0, (f"budget {self.budget:g}: {max(0.0, billed):.4g} left, under the least bill of one "
                       f"{f.node_type} node ({nt.cost * least_billed_hours(nt):.4g}); no more nodes")  # fmt: skip
        rate = (nt.cost if nt is not None else 1.0) / 3600.0
        held = snap.nodes_of(f.node_type)
        eta0 = f.etas[0]
        reserve = held * eta0 * rate if eta0 < float("inf") else 0.0
        spare = BUDGET_MARGIN * left - reserve
        self._tight = held > 0 and reserve > BUDGET_MARGIN * left
        # and it grows the pool at most ``BUDGET_GROWTH``-fold on the nodes that have joined: a
        # node bought on a forecast that proves wrong (kinds not measured yet) is billed all the
        # same, so the pool grows only as fast as the nodes of the last forecast arrive and work
        per = nt.workers_per_node if nt is not None else 1
        live = -(-sum(1 for w in snap.workers if w.node_type == f.node_type) // max(1, per))
        cap = BUDGET_GROWTH * max(1, live)
        paid = [i for i in range(1, len(f.extra))
                if f.etas[i] < eta0 and f.extra[i] * f.etas[i] * rate <= spare and held + f.extra[i] <= cap]  # fmt: skip
        # (with no node held the first is bought whatever it works: the graph must run)
        ok = [i for i in paid if held == 0 or not f.new_busy or f.new_busy[i] >= BUDGET_MIN_WORK * f.startup]
        if paid and not ok:
            i = min(paid, key=lambda j: (f.etas[j], j))
            return 0, (f"budget {self.budget:g}: {f.extra[i]} more {f.node_type} node(s) would fit but work "
                       f"{_fmt(f.new_busy[i])} each, under their start-up of {_fmt(f.startup)}; none bought")  # fmt: skip
        if ok:
            i = min(ok, key=lambda j: (f.etas[j], j))
            return i, (f"budget {self.budget:g} ({left:.3f} left, {reserve:.3f} reserved for the {held} node(s) "
                       f"held): {f.extra[i]} more {f.node_type} node(s) finish in {_fmt(f.etas[i])} for "
                       f"{f.extra[i] * f.etas[i] * rate:.3f} more, the fastest that fits")  # fmt: skip
        costs = [self._cost(snap, f, i) for i in range(len(f.extra))]
        cheapest = min(range(len(f.extra)), key=lambda j: (costs[j], j))
        if costs[cheapest] > left:
            self._notice("budget", f"budget {self.budget:g} cannot cover the rest of the run: {left:.3f} left and "
                         f"the cheapest forecast costs {costs[cheapest]:.3f} (current estimates); running at least "
                         "cost", [])  # fmt: skip
            if held == 0:  # nothing held: the least cost is one node
                return 1, (f"budget {self.budget:g} infeasible: cheapest forecast {costs[cheapest]:.3f} > "
                           f"{left:.3f} left; one node")  # fmt: skip
            return 0, (f"budget {self.budget:g} infeasible: cheapest forecast {costs[cheapest]:.3f} > "
                       f"{left:.3f} left; no more nodes, idle ones retire at once")  # fmt: skip
        if held == 0:  # nothing held and no pool fits the margin: the least cost is one node
            return 1, (f"budget {self.budget:g}: cheapest forecast {costs[cheapest]:.3f} is over "
                       f"{BUDGET_MARGIN:.0%} of {left:.3f} left; one node")  # fmt: skip
        if self._tight:
            return 0, (f"budget {self.budget:g}: finishing on the {held} node(s) held needs {reserve:.3f} of "
                       f"{left:.3f} left; no more nodes, idle ones retire at once")  # fmt: skip
        return 0, ""

    # ---- retirements --------------------------------------------------------------------------
    def _hold_empty(self, startup: float) -> float:
        """How long an idle node is kept when no work is known: what a relaunch would bill
        (``startup``: the billed part of a start-up)."""
        if self.budget is not None:
            return self.min_idle  # a budget does not pay for idle time on speculation
        if self.objective == "cheapest" or self.deadline is not None:
            return min(self.hold_cap, startup / 4)
        if self.objective == "fastest":
            return min(2 * self.hold_cap, startup)
        return min(self.hold_cap, startup if startup <= 10.0 else max(10.0, startup / 4))

    def _retire(self, snap: ClusterSnapshot, launch: dict[str, int],
                reasons: list[str]) -> tuple[list[str], list[tuple[str, str]]]:  # fmt: skip
        slack = self._hold_slack(snap)
        by_type = {f.node_type: f for f in snap.forecasts}
        #: per node type, this round's nodes beyond what the forecast needs within the horizon,
        #: and (nodes it needs, nodes standing) for the reasons
        surplus: dict[str, int] = {}
        pool: dict[str, tuple[int, int]] = {}
        retire: list[str] = []
        why: list[tuple[str, str]] = []
        idle = sorted((w for w in snap.workers if w.idle and w.idle_since is not None),
                      key=lambda w: (w.unique_bytes, w.idle_since, w.id))  # fmt: skip
        for w in idle:
            if launch.get(w.node_type) or any(fits(w.resources, d.shape) for d in snap.demand):
                continue
            assert w.idle_since is not None
            nt = snap.node_type(w.node_type)
            startup = nt.startup_estimate if nt is not None else 5.0
            idle_for = snap.now - w.idle_since
            if idle_for < self.min_idle:
                continue
            f = by_type.get(w.node_type)
            billed = _billed(snap, w.node_type, startup)
            text = self._why_retire(snap, w, f, billed, hold_horizon(startup, billed, slack), idle_for, surplus,
                                    pool)  # fmt: skip
            if text is None:
                continue
            retire.append(w.id)
            why.append((w.id, text))
            reasons.append(text)
        return retire, why

    def _hold_slack(self, snap: ClusterSnapshot) -> float:
        """The slack of the retirement horizon (:func:`hold_horizon`), shared by retiring idle nodes
        and calling off nodes still coming."""
        _, slack, _ = _RULES["cheapest" if self.budget is not None or self.deadline is not None else self.objective]
        if snap.finished == 0:
            slack = min(slack, GUESS_SLACK)  # idle behind a guess: not held for it
        if self.budget is not None and self._tight:
            slack = -1.0  # a horizon of 0: keep only the nodes the forecast uses now
        return slack

    def _call_off(self, snap: ClusterSnapshot, launch: dict[str, int], reasons: list[str],
                  retire: list[str]) -> dict[str, int]:  # fmt: skip
        """Nodes of launches in flight the forecast no longer needs: the retirement rule would
        retire each on arrival (the width within its horizon from the newest launch's expected
        arrival, set against the nodes that joined, leaves no work for it).  Calling one off spares
        its boot and the idle time before that retirement; on Slurm a job still queued costs nothing
        yet and is cancelled.  Not while durations are guesses (nothing finished, or a kind that
        never finished waits: bwa's first short tasks said its long ones were short, and a call-off
        of 41 queued nodes made it 40% slower), not for a type launched now or with runnable tasks
        waiting for it."""
        if snap.finished == 0 or not snap.pending:
            return {}
        slack = self._hold_slack(snap)  # (finished > 0 here: no guess)
        out: dict[str, int] = {}
        for f in snap.forecasts:
            name = f.node_type
            coming = sum(p.nodes for p in snap.pending if p.node_type == name)
            nt = snap.node_type(name)
            if not coming or not f.profile or launch.get(name) or nt is None:
                continue  # (evidence: a kind never measured waits; its tasks may be long)
            if any(fits(nt.worker_resources, d.shape) for d in snap.demand):
                continue
            billed = _billed(snap, name, nt.startup_estimate)
            newest = max(p.since for p in snap.pending if p.node_type == name)
            arrival = max(0.0, newest + nt.startup_estimate - snap.now)
            horizon = arrival + hold_horizon(nt.startup_estimate, billed, slack)
            spn = max(1, f.slots_per_node)
            need = -(-peak_in_use(f.profile, horizon) // spn)
            if billed < nt.startup_estimate:
                # a queue wait is free and its length is a draw (the forecast puts every queued job
                # at the mean): a queued node is called off only if it would get no work even if it
                # started now (bwa's 41 queued nodes called off on the mean made it 40% slower)
                need = max(need, -(-peak_in_use(f.profile_now, math.inf) // spn))
            # the nodes that stay: not those this decision retires (a review: a retirement and a
            # call-off counted the same nodes, leaving 2 for a peak of 4)
            leaving = sum(1 for w in snap.workers if w.id in retire and w.node_type == name)
            live = snap.staying_nodes_of(name) - leaving // max(1, nt.workers_per_node)
            extra = min(coming, live + coming - need)
            if extra <= 0:
                continue
            out[name] = extra
            reasons.append(f"{self.label}: call off {extra} of the {coming} {name} node(s) still coming: the forecast "
                           f"keeps at most {need} node(s) busy within {horizon:.1f}s and {live} have joined")  # fmt: skip
        return out

    def _why_retire(self, snap: ClusterSnapshot, w: WorkerView, f: TypeForecast | None, billed: float,
                    horizon: float, idle_for: float, surplus: dict[str, int],
                    pool: dict[str, tuple[int, int]]) -> str | None:  # fmt: skip
        """Why ``w`` retires now, or None; ``billed``: what a relaunch of its type would bill;
        ``surplus`` and ``pool``: this round's per-type counts (:meth:`_retire`), filled here once per type."""
        label = self.label
        if f is not None and f.profile:
            if w.node_type not in surplus:  # once per type and round (each is a pass over the pool)
                need = -(-peak_in_use(f.profile, horizon) // max(1, f.slots_per_node))
                live = snap.staying_nodes_of(w.node_type)
                # against the nodes that have joined: a launch in flight is no node yet (a Slurm job
                # may queue for minutes), and the forecast that gives ``need`` already counts its
                # slots from their expected arrival on; nor against nodes being retired (the
                # forecast's pool leaves them out: counted, each retired one more idle node)
                surplus[w.node_type] = live - need
                pool[w.node_type] = (need, live)
            need, live = pool[w.node_type]
            if surplus[w.node_type] <= 0:
                return None
            if w.unique_for_tasks and idle_for < min(self._hold_empty(billed), LOCALITY_HOLD):
                # values a waiting task needs would move: not for a node idle only a moment (a task
                # may yet run there); values only a client wants move to a survivor or the client
                # either way, so they buy no holding
                return None
            surplus[w.node_type] -= 1
            return (f"{label}: {w.id} idle {idle_for:.1f}s: the forecast keeps at most "
                    f"{need} of the {live} {w.node_type} node(s) up busy within "
                    f"{horizon:.1f}s (a new one starts in {f.startup:.1f}s), so holding it costs more than a "
                    "relaunch when needed")  # fmt: skip
        known = bool(snap.forecasts or snap.waiting or snap.running)
        if f is not None:  # a graph too big to play forward: only when work next becomes runnable
            if snap.next_demand_in is not None and snap.next_demand_in <= horizon:
                return None
            hold, what = self.min_idle, "no work for it is expected within a start-up"
        elif _special(w):  # gpu (...) nodes are kept for work that needs them, not held on spec
            hold, what = self.min_idle, "no known work needs its " + "/".join(sorted(_special(w)))
        elif known:  # work exists, none of it prefers this node type
            hold, what = min(self.hold_cap, billed / 4), "no remaining work prefers its node type"
        else:  # nothing known at all (between two computes): the ski-rental rule
            hold, what = self._hold_empty(billed), "no work is known"
        if idle_for < max(hold, self.min_idle):
            return None
        held = f" holding {w.unique_keys} needed values (moved to survivors first)" if w.unique_keys else ""
        return f"{label}: {w.id} idle {idle_for:.1f}s{held}: {what} (kept {hold:.1f}s)"


@dataclass
class Planned:
    """The default policy: :class:`GraphPlan` (launches and retirements for one objective), the
    no-progress safety net and memory pressure, and no retirement of workers younger than
    ``min_lifetime``."""

    plan: GraphPlan = field(default_factory=GraphPlan)
    no_progress: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=NoProgress)
    memory: Callable[[ClusterSnapshot], ScaleDecision] | None = field(default_factory=MemoryPressure)
    extra: list[Callable[[ClusterSnapshot], Any]] = field(default_factory=list)
    min_lifetime: float = 1.0

    def __call__(self, snap: ClusterSnapshot) -> ScaleDecision:
        nets = [as_decision(p(snap)) for p in (self.no_progress, self.memory, *self.extra) if p is not None]
        if self.plan.budget is not None and any(snap.nodes_of(nt.name) for nt in snap.node_types):
            # a budget is a ceiling: the safety nets restart an empty pool but do not grow one (on
            # montage-dss, "no progress" behind 11-minute tasks bought 16 nodes the budget had refused)
            nets = [replace(d, launch={}, reasons=tuple(r for r in d.reasons if "-> launch" not in r))
                    if d.launch else d for d in nets]  # fmt: skip
        return keep_young(snap, merge([as_decision(self.plan(snap)), *nets]), self.min_lifetime)


def default_policy(objective: str = "balanced", deadline: float | None = None, budget: float | None = None,
                   **options: Any) -> Planned:  # fmt: skip
    """The default policy for ``objective`` (or a ``deadline``/``budget``); ``options`` go to
    :class:`GraphPlan` (``hold_cap``, ``min_idle``, ``guess_budget``) or :class:`Planned` (``min_lifetime``)."""
    mine = {k: options.pop(k) for k in ("min_lifetime",) if k in options}
    unknown = set(options) - {"hold_cap", "min_idle", "guess_budget"}
    if unknown:
        raise ConfigError(f"unknown options {sorted(unknown)} of the default policy; it takes objective, deadline, "
                          "budget, hold_cap, min_idle, guess_budget, min_lifetime")  # fmt: skip
    return Planned(GraphPlan(objective, deadline, budget, **options), **mine)


def hold_horizon(startup: float, billed: float, slack: float) -> float:
    """How far ahead an idle node is held for the forecast's width: a relaunch needs the whole
    start-up to arrive (``startup``), and beyond that a node is worth holding idle only ``slack`` x
    what a relaunch bills (``billed``: all of the start-up on a cloud, only the boot after a Slurm
    job starts: the queue wait is free).  A negative slack shortens the whole start-up (-1: nothing
    ahead, only what the forecast uses now)."""
    if slack < 0:
        return max(0.0, startup * (1.0 + slack))
    return startup + slack * billed


def _billed(snap: ClusterSnapshot, node_type: str, startup: float) -> float:
    """Seconds of a start-up of ``startup`` s that a node of ``node_type`` is billed for."""
    nt = snap.node_type(node_type)
    if nt is None or nt.billed_startup is None:
        return startup
    return min(nt.billed_startup, startup)


def _stranded(snap: ClusterSnapshot, node_type: str) -> bool:
    """Is some runnable task (in ``snap.demand``) one that no live worker and no launch in flight
    could run, and ``node_type`` the best launchable type for it?"""
    coming = [nt.worker_resources for p in snap.pending if (nt := snap.node_type(p.node_type)) is not None]
    launchable = tuple(nt for nt in snap.node_types if not snap.blocked(nt.name))
    for d in snap.demand:
        staying = (w for w in snap.workers if w.state != "retiring")  # a retiring one takes no new task
        if any(fits(w.resources, d.shape) for w in staying) or any(fits(r, d.shape) for r in coming):
            continue
        best = rank_types(d.shape, launchable)
        if best and best[0].name == node_type:
            return True
    return False


def _wasted(snap: ClusterSnapshot, node_type: str, needed: set[str]) -> bool:
    """Would a node of ``node_type`` bring scarce resources (gpu, ...) no runnable task needs?"""
    nt = snap.node_type(node_type)
    if nt is None:
        return False
    return bool({k for k, v in nt.resources.items() if v > 0 and k not in PLAIN} - needed)


def _special(w: WorkerView) -> set[str]:
    """The worker's resources beyond cpu and memory (gpu, custom labels)."""
    return {k for k, v in w.resources.items() if v > 0 and k not in PLAIN}


def _fmt(seconds: float) -> str:
    return "never (no worker)" if seconds == float("inf") else f"{seconds:.1f}s"


def _counts(launch: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(launch.items()))
