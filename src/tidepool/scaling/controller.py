"""The scaling controller's core: ``step(observation) -> Actions``, its only entry point.

State: ``instances`` (``instances.py``: every launch request and every worker launched or adopted,
each with its lifecycle state and a reason per move), ``failures`` and ``backoff_until`` per node
type, ``unusable`` types (too many failures in a row), ``backlog_since`` (since when runnable
demand has existed without a break), learned startup times per type, and ``journal``: an
in-memory list of every decision with its reason (no file: each step's new records go out in
``Actions.records`` and the shell writes them where it likes).  No I/O, no clock.

Each :meth:`ScalingController.step` observes first, then acts:

1. observe (:meth:`_observe`): the reports since the last step (named, joined, ready, failed
   launches and workers, retirement outcomes, adopted workers: ``observation.py``), in order; the
   provider's listing (a worker that vanished or ended before it registered fails now, not at the
   launch timeout); workers that left; workers whose allocation ends soon; launches past their
   timeout; the backlog clock;
2. decide (:meth:`_decide`): build a :class:`ClusterSnapshot`, ask the policy (a policy that
   raises is logged once, then at most once a minute, journaled as ``policy-error`` and replaced
   for that step by the default policy, so the pool keeps serving waiting tasks);
3. act: clamp launches to ``min_nodes``/``max_nodes`` per type and ``max_workers`` overall
   (:func:`wanted_launches`, :func:`clamp_launches`), then to the cost limits
   (``max_cost_per_hour``, ``budget``: ``limits.py``, journaled as ``cost-limit``; the
   ``CostMeter`` in ``self.cost`` bills from launch to release; replacements for workers with a
   known end are added just before: ``replacement.py``), filter retirements
   (:meth:`_retirements`: ours, running, not refused lately, not below ``min_nodes``, never a type
   launched this step).

``Actions`` carries what the shell must do (launch, retire, terminate), the journal records, a new
:class:`~tidepool.scaling.feasibility.Feasibility` when a node type got disabled (the shell sends it
to the scheduler state in a ``CheckFeasible`` event) and a read-only :class:`ControllerView`
(backlog, launches in flight, failures, learned start-up, when the next forecast is due): the
shells read that, never the controller's fields.

Whose workers: the controller retires only workers it launched or was told about with an
``Adopted`` report (a LocalCluster's own workers); a worker started by hand belongs to the user and
is left alone (journaled once as ``not-managed``) unless ``manage_foreign=True``.  Launch request
ids are ``a1``, ``a2``, ... so they never collide with ids the user's cluster gave its own workers.
The shared round (``scaling/shell/round.py``) runs it for the asyncio shell, the simulator and the
tests.

After a scheduler restart (``restored=``: the instance rows a durable scheduler stored; each step's
changed rows go out in ``Actions.instances``) the controller launches nothing until an observation
carries the provider's listing, then adopts the listed instances (``adoption.py``) and carries the
stored cost meter on (``restored_cost=``, ``limits.py``; each step's meter goes out in
``Actions.cost``), so a restart neither resets the budget nor bills adopted instances from zero.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tidepool.errors import ConfigError
from tidepool.scaling.adoption import adopt, instance_rows, row_changes
from tidepool.scaling.controller_checks import check_affordable, check_settings, never_launched
from tidepool.scaling.feasibility import Feasibility, largest_offers
from tidepool.scaling.forecast import type_forecasts
from tidepool.scaling.instances import FINAL, IS, InstanceTable, Request
from tidepool.scaling.limits import (
    CostLimits,
    CostMeter,
    CostView,
    cap_launches,
    over_budget,
)
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import (
    Adopted,
    Joined,
    LaunchFailed,
    Named,
    Ready,
    Retired,
    WorkerFailed,
)
from tidepool.scaling.planned import default_policy
from tidepool.scaling.policies import as_decision, check_decision
from tidepool.scaling.preemption import FallbackTracker
from tidepool.scaling.replacement import Replacing
from tidepool.scaling.shrink import ShrinkSignature, pool_summary, shrink_signature
from tidepool.scaling.snapshot import (
    ClusterSnapshot,
    PendingLaunch,
    ScaleDecision,
    TypeForecast,
    WorkerView,
)
from tidepool.scaling.warm import Quiet, idle_by_type, warm_launches
from tidepool.scheduler.records import ORDINARY
from tidepool.telemetry.journal import Journal

if TYPE_CHECKING:
    from tidepool.scaling.observation import GraphView, Observation

__all__ = ["Actions", "ControllerView", "ForecastDue", "ScalingController", "largest_offers"]

#: the forecast's cost grows with the graph: one more second between forecasts per this many tasks
FORECAST_TASKS_PER_SECOND = 40_000.0
#: seconds between forecasts of a small graph (changes in the pool refresh it at once)
FORECAST_MIN_INTERVAL = 0.25
#: ... and at most this many for the largest graphs (1,000,000 tasks: every 25 s)
FORECAST_MAX_INTERVAL = 30.0
#: forecasts per start-up time of the quickest node type (VMs that boot in 90 s: every 4.5 s)
FORECAST_PER_STARTUP = 20.0
#: seconds between asks to retire a worker whose allocation ends soon
EXPIRY_RETRY = 5.0
#: seconds a worker that joined to take a leaving worker's data is kept from idle retirement
TAKER_HOLD = 60.0


@dataclass(frozen=True)
class ForecastDue:
    """When the next observation should carry the unfinished graph (a fresh forecast).

    On a small graph, a worker or a launch more or less changes every answer: at once.  Otherwise
    at most every ``every`` seconds while things change, which grows with the graph (one second
    per ``FORECAST_TASKS_PER_SECOND`` tasks: the forecast costs a pass over the graph) and with
    the node types' start-up (a decision about nodes that take 90 s to start needs no forecast
    every 0.25 s).  A forecast older than a launch never launches that type again (``step`` waits
    for a fresh one), so a stale forecast cannot launch twice for the same work.
    """

    at: float = -1e9  # when the last forecast was made
    every: float = FORECAST_MIN_INTERVAL
    key: tuple[Any, ...] = ()  # (workers, launches in flight, tasks, finished changed) then
    finished: int = -1  # tasks finished at the last forecast
    in_flight: int = 0  # launch requests open after the last step

    def due(self, workers: int, tasks: int, finished: int, now: float) -> bool:
        since = now - self.at
        if self.every > FORECAST_MIN_INTERVAL:  # a big graph: the forecast is a cost to bound
            return since >= self.every
        structural = (workers, self.in_flight)
        changed = (*structural, tasks, finished != self.finished)
        if structural == self.key[:2]:
            if since < self.every and changed == self.key:
                return False
            if since < 0.05:
                return False
        return True


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class ControllerView:
    """What the shells may know of the controller after a step (read-only copies)."""

    backlog_since: float | None = None
    #: launches in flight: what is still to come of each (workers that registered are live)
    pending: tuple[PendingLaunch, ...] = ()
    failures: Mapping[str, int] = field(default_factory=lambda: _frozen({}))  # launches failed in a row
    unusable: Mapping[str, str] = field(default_factory=lambda: _frozen({}))  # disabled type -> why
    startup: Mapping[str, float] = field(default_factory=lambda: _frozen({}))  # measured start-up, s
    forecast: ForecastDue = ForecastDue()
    #: the node types and the disabled ones: the rule the scheduler state gets (``CheckFeasible``)
    feasibility: Feasibility = Feasibility(())
    #: the pool's cost as of the step: spent so far, rate now, the limits (``limits.py``)
    cost: CostView = CostView()
    #: restored instances wait for a provider listing (``adoption.py``): list the provider now
    restoring: bool = False
    #: steps whose policy raised (the default policy decided them), and the first error
    policy_errors: int = 0
    policy_error: str = ""


@dataclass
class Actions:
    launch: list[tuple[str, NodeType, int]] = field(default_factory=list)  # (request id, type, nodes)
    retire: list[str] = field(default_factory=list)
    terminate: list[str] = field(default_factory=list)
    snapshot: ClusterSnapshot | None = None
    #: journal records made in this step (its reports' and its decisions')
    records: list[dict[str, Any]] = field(default_factory=list)
    #: seconds each launch of this step may take before it is given up (request id -> seconds)
    launch_timeouts: dict[str, float] = field(default_factory=dict)
    #: set when a node type was disabled: the shell sends it to the scheduler (``CheckFeasible``)
    feasibility: Feasibility | None = None
    view: ControllerView = ControllerView()
    #: instance rows changed in this step, for a durable scheduler's store (worker -> row, None: ended)
    instances: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    #: the cost meter's state (``CostMeter.export``) for a durable scheduler's store; None: nothing billed
    cost: dict[str, Any] | None = None


# ---- pure pieces of the decision ---------------------------------------------------------------
def standing(snap: ClusterSnapshot, name: str, retiring: Mapping[str, int]) -> int:
    """Nodes of type ``name`` that stay: live workers not being retired, plus launches in flight
    (``retiring``: workers of each type being retired now)."""
    nt = snap.node_type(name)
    per = nt.workers_per_node if nt is not None else 1
    live = sum(1 for w in snap.workers if w.node_type == name) - retiring.get(name, 0)
    return -(-max(0, live) // per) + sum(p.nodes for p in snap.pending if p.node_type == name)


def wanted_launches(decision: ScaleDecision, snap: ClusterSnapshot, reasons: list[str],
                    retiring: Mapping[str, int]) -> dict[str, int]:  # fmt: skip
    """The policy's launches, raised to what ``min_nodes`` needs (a reason appended for each):
    a node being retired does not count towards ``min_nodes``."""
    wanted = dict(decision.launch)
    for nt in snap.node_types:  # min_nodes always holds
        deficit = nt.min_nodes - standing(snap, nt.name, retiring)
        if deficit > 0 and not snap.blocked(nt.name) and wanted.get(nt.name, 0) < deficit:
            wanted[nt.name] = deficit
            reasons.append(f"{nt.name}: below min_nodes={nt.min_nodes}")
    return wanted


def clamp_launches(wanted: Mapping[str, int], snap: ClusterSnapshot, node_types: Mapping[str, NodeType], *,
                   unusable: Mapping[str, str], stale: set[str], max_workers: int | None, workers: int,
                   reasons: list[str], retiring: Mapping[str, int]) -> dict[str, int]:  # fmt: skip
    """Nodes to launch per type within the limits: known types only, none blocked (backoff or
    disabled), none of a type a stale forecast planned (beyond ``min_nodes``), at most
    ``max_nodes`` per type and ``max_workers`` in all (``workers``: live and coming now)."""
    planned: dict[str, int] = {}
    for name, n in wanted.items():
        known = node_types.get(name)
        if known is None:
            reasons.append(f"policy asked for unknown node type {name!r}: ignored")
            continue
        if snap.blocked(name):
            reasons.append(f"{name}: not launched ({unusable.get(name) or 'in backoff'})")
            continue
        if name in stale:  # only what min_nodes needs until a forecast sees the last launch
            deficit = known.min_nodes - standing(snap, name, retiring)
            if n > deficit:
                reasons.append(f"{name}: not launched again until a forecast sees the last launch")
                n = deficit
        room = known.max_nodes - snap.nodes_of(name)
        if n > room:
            reasons.append(f"{name}: {n} node(s) asked, {max(0, room)} launched: max_nodes is {known.max_nodes} "
                           f"({snap.nodes_of(name)} held or coming)")  # fmt: skip
            n = room
        if max_workers is not None and n > (max_workers - workers) // known.workers_per_node:
            cut = max(0, (max_workers - workers) // known.workers_per_node)
            reasons.append(f"{name}: {n} node(s) asked, {cut} launched: max_workers is {max_workers} "
                           f"({workers} workers held or coming)")  # fmt: skip
            n = cut
        if n > 0:
            planned[name] = n
            workers += n * known.workers_per_node
    return planned


def quiet_decision(text: str) -> str:
    """A decision's reason with its numbers blurred: idle 0.1s / 0.2s ... is the same decision."""
    return re.sub(r"[0-9.]+", "#", text)


class ScalingController(Replacing):
    def __init__(self, node_types: list[NodeType] | tuple[NodeType, ...],
                 policy: Callable[[ClusterSnapshot], Any] | None = None, *,
                 launch_timeout: float | None = None, backoff_base: float = 2.0,
                 backoff_max: float = 120.0, max_type_failures: int = 3,
                 max_workers: int | None = None,
                 forecast_interval: float | None = None, manage_foreign: bool = False,
                 max_cost_per_hour: float | None = None, budget: float | None = None,
                 scale_to_zero_after: float | None = None,
                 restored: Mapping[str, Mapping[str, Any]] | None = None,
                 restored_cost: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if not node_types:
            raise ConfigError("the scaling controller needs at least one node type")
        names = [nt.name for nt in node_types]
        if len(set(names)) != len(names):
            raise ConfigError(f"node type names must be unique, got {names}")
        for nt in node_types:
            if nt.fallback is not None and nt.fallback not in names:
                raise ConfigError(f"node type {nt.name!r}: fallback {nt.fallback!r} is not one of the node types "
                                  f"{names}; add it or fix the name")  # fmt: skip
            if nt.fallback is not None:
                fb = next(t for t in node_types if t.name == nt.fallback)
                lacks = sorted(r for r, v in nt.worker_resources.items()
                               if r not in ORDINARY and v > 0 and fb.worker_resources.get(r, 0.0) < v)  # fmt: skip
                if lacks:  # its launches would bring nodes the tasks waiting for it cannot use
                    raise ConfigError(f"node type {nt.name!r}: fallback {nt.fallback!r} offers less "
                                      f"{', '.join(lacks)} per worker than {nt.name!r} does, so the tasks that need "
                                      f"{nt.name!r} could not run on it; give a fallback with the same resources")  # fmt: skip
        check_settings(policy, launch_timeout, backoff_base, backoff_max, max_type_failures, forecast_interval,
                        manage_foreign)  # fmt: skip
        check_affordable(node_types, CostLimits(max_cost_per_hour, budget))
        self.node_types = {nt.name: nt for nt in node_types}
        self.policy = policy if policy is not None else default_policy()
        self.launch_timeout = launch_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_type_failures = max_type_failures
        self.max_workers = max_workers
        #: retire workers the autoscaler did not launch (started by hand, or by another tool)?
        self.manage_foreign = manage_foreign
        self.journal = Journal()  # in memory only: the controller writes no file
        #: hard cost ceilings applied after any policy, and the meter they are checked against
        self.limits = CostLimits(max_cost_per_hour, budget)
        self.cost = CostMeter(self.node_types)
        self._cost_said: dict[str, tuple[str, float]] = {}  # node type -> (last cut said, when)
        #: preemptible types whose launches go to their fallback now (``preemption.py``)
        self.fallbacks = FallbackTracker(self.node_types)
        if scale_to_zero_after is not None and (isinstance(scale_to_zero_after, bool) or not isinstance(
                scale_to_zero_after, (int, float)) or not scale_to_zero_after > 0 or scale_to_zero_after == float("inf")):
            raise ConfigError(f"scale_to_zero_after must be a finite number of seconds > 0, got {scale_to_zero_after!r}")
        #: a pool with no work for this long keeps no warm workers and retires its idle ones (warm.py)
        self.scale_to_zero_after = scale_to_zero_after
        self._quiet = Quiet()
        self._noticed: dict[str, float] = {}  # worker -> its preemption deadline
        self._abandoned: set[str] = set()  # noticed workers ended at once (their work could not finish)
        #: workers a replacement was launched for (known end: preemption notice, walltime)
        self._replaced: set[str] = set()
        #: worker being replaced -> when its replacement was first wanted (see _takers)
        self._replaced_at: dict[str, float] = {}
        self._replace: list[tuple[str, str, str]] = []  # (worker, node type, why) to replace this step
        self._drained = 0
        self.instances = InstanceTable()
        self.failures: dict[str, int] = {}
        self.backoff_until: dict[str, float] = {}
        self.unusable: dict[str, str] = {}
        #: per disabled type, the error class its waiting tasks fail with (ProviderError/WorkerSetupError)
        self.unusable_error: dict[str, str] = {}
        self._failed_requests: set[str] = set()  # each failed launch is counted once
        self.startup: dict[str, float] = {}
        self.backlog_since: float | None = None
        #: refused retirements: worker -> what the pool looked like then (:func:`shrink_signature`);
        #: asked again only once that changes (a worker joined, data was released), never on a timer
        self.refused: dict[str, ShrinkSignature] = {}
        self._asked: dict[str, ShrinkSignature] = {}
        self._foreign_noted: set[str] = set()
        self._expiry_tried: dict[str, float] = {}  # worker -> when its walltime retirement was asked
        self._expiry_seen: dict[str, float] = {}  # worker -> first listed as expiring (replace_before waits)
        #: what serves a round whose policy raised or returned nonsense: the default policy, as the
        #: journal and the docs say (it was ``Adaptive``, the earlier default)
        self._fallback = default_policy()
        self._policy_error_t = -1e9
        self._policy_error = ""
        self._policy_errors = 0  # steps whose policy raised, and the first error (the view says so)
        self._policy_error_first = ""
        #: a restarted scheduler's stored instance rows, adopted at the first listing (``adoption.py``)
        self._restoring = {w: dict(r) for w, r in restored.items()} if restored is not None else None
        self._rows: dict[str, dict[str, Any]] = dict(self._restoring or {})
        #: the stored cost meter (``limits.on_this_clock``), carried on once the instances are adopted
        self._restored_cost = dict(restored_cost) if restored_cost is not None else None
        if self._restored_cost is not None and self._restoring is None:
            self._restoring = {}
        self._ids = itertools.count(1)
        self._last_reason = ""
        self._last_reason_t = -1e9
        self._forecasts: tuple[TypeForecast, ...] = ()
        self._eta: float | None = None
        self._next_demand: float | None = None
        self._fc = ForecastDue(every=forecast_interval or FORECAST_MIN_INTERVAL)
        self._fc_fixed = forecast_interval is not None
        #: node types launched since the last forecast: no new launch of them until a fresh one
        self._stale_types: set[str] = set()
        #: workers to terminate at the next step (given up before they registered)
        self._terminate: list[str] = []
        self._feasibility = Feasibility(tuple(self.node_types.values()),
                                        never=never_launched(node_types, self.limits))
        #: what the shells may read, as of the last step
        self.view = ControllerView(forecast=self._fc, feasibility=self._feasibility,
                                   restoring=self._restoring is not None)  # fmt: skip
        self._on: dict[type, Callable[[Any], None]] = {
            Named: self._named, Joined: self._joined, Ready: self._ready, LaunchFailed: self._launch_failed,
            WorkerFailed: self._worker_failed, Retired: self._retired, Adopted: self._adopted,
        }  # fmt: skip

    def _manages(self, wid: str) -> bool:
        """Is ``wid`` this controller's to retire (launched here, adopted, or manage_foreign)?"""
        inst = self.instances.get(wid)
        return self.manage_foreign or (inst is not None and inst.origin != "foreign")

    # ---- the step ---------------------------------------------------------------------------------
    def step(self, obs: Observation) -> Actions:
        """One round on one observation: first what happened (reports, the provider's listing,
        workers that left or end soon, timeouts), then the decision.

        ``obs.expiring``: workers the provider says end soon (a walltime): retired gracefully now,
        asked again every 5 s while refused.  ``obs.listing``: the provider's ``list()`` (worker id
        -> at least ``alive``), when the shell fetched one.  ``obs.graph``: the unfinished graph,
        when the last view's ``forecast.due`` asked for it.
        """
        actions = Actions()
        by_id = {w.id: w for w in obs.workers}
        self._observe(obs, by_id, actions)
        self.cost.settle(self.instances)
        types = self._types_now()
        if obs.graph is not None:
            self._refresh_forecast(obs, obs.graph, types)
        pending = tuple(self._pending(r) for r in self.instances.open.values())
        snap = self._snapshot(obs, types, pending)
        actions.snapshot = snap
        decision = self._decide(snap)
        reasons = list(decision.reasons)
        retiring = self._retiring_by_type()
        zero = self._quiet.for_at_least(obs.now, self.scale_to_zero_after)
        wanted = wanted_launches(decision, snap, reasons, retiring)
        if not zero:  # min_idle: idle workers kept ready, apart from min_nodes
            for name, n in warm_launches(snap, self.instances.retiring, reasons).items():
                floor_idle = max(0, wanted.get(name, 0) - decision.launch.get(name, 0))  # min_nodes' come idle
                wanted[name] = wanted.get(name, 0) + max(0, n - floor_idle)
        wanted = self._routed(wanted, reasons)
        workers = len(obs.workers) + sum(len(p.worker_ids) or p.nodes for p in pending)
        planned = clamp_launches(wanted, snap, self.node_types, unusable=self.unusable, stale=self._stale_types,
                                 max_workers=self.max_workers, workers=workers, reasons=reasons,
                                 retiring=retiring)  # fmt: skip
        planned = self._cost_cap(self._with_replacements(planned, snap, reasons), obs.now)
        if self._restoring is not None:  # no launch before the instances still running are adopted
            planned = {}
        self._launch(planned, "; ".join(reasons), obs.now, actions)
        self._retirements(decision, snap, by_id, planned, retiring, actions, keep_idle=not zero)
        if self._cancellations(decision, snap, planned, retiring, actions):
            self.cost.settle(self.instances)  # the called-off nodes are billed no more
        self._budget_spent(snap, by_id, planned, actions)
        self._over_max(snap, by_id, actions)
        if zero:
            self._to_zero(snap, by_id, planned, actions)
        if not actions.launch and not actions.retire and reasons:  # the limits' cuts too (to 0 at max_nodes)
            self._note_decision("; ".join(reasons)[:2000], obs.now)
        return self._finish(actions)

    # ---- 1. observe -------------------------------------------------------------------------------
    def _observe(self, obs: Observation, by_id: Mapping[str, WorkerView], actions: Actions) -> None:
        for report in obs.reports:
            self._on[type(report)](report)
        if obs.listing is not None and self._restoring is not None:
            for rec in adopt(self.instances, self._restoring, obs.listing, obs.now, self._launch_timeout):
                self.journal.record("adopt", obs.now, **rec)
            self._restoring = None
            if self._restored_cost is not None:  # the budget goes on; adopted instances billed on
                self.cost.restore(self._restored_cost, self.instances, obs.now)
                self._restored_cost = None
            numbers = [int(m.group(1)) for rid in self.instances.requests if (m := re.fullmatch(r"a(\d+)", rid))]
            self._ids = itertools.count(max(numbers, default=0) + 1)  # never an adopted launch's id again
        if obs.listing is not None:
            self._reconcile(obs.listing, obs.now)
        self._sync_live(by_id, obs.now)
        self._notices(obs, by_id, actions)
        self._expiring([(w, "provider: walltime ends soon") for w in obs.expiring]
                       + [(w, f"preemption notice: the provider takes it back in {d - obs.now:.1f}s")
                          for w, d in self._noticed.items()],
                       by_id, obs.now, actions)  # fmt: skip
        self._replace_before(obs, by_id)
        for rec in self.fallbacks.recover(obs.now):
            self.journal.record(rec.pop("kind"), rec.pop("t"), **rec)
        self._timeouts(obs.now, actions)
        if obs.demand:
            if self.backlog_since is None:
                self.backlog_since = obs.now
        else:
            self.backlog_since = None
        self._quiet.update(obs.now, bool(obs.demand or obs.running or obs.waiting or self.instances.open))

    def _named(self, r: Named) -> None:
        table = self.instances
        req = table.requests.get(r.request)
        if req is not None and req.state is IS.FAILED and not req.workers:
            # given up before the provider named its workers: stop them, or they join uncounted
            for w in r.workers:
                if table.get(w) is None:
                    inst = table.add(w, req.node_type, req.id, IS.NAMED, r.at, f"named for launch {req.id}")
                    table.move(inst, IS.FAILED, r.at, f"launch {req.id} was given up before it was named")
                    self._terminate.append(w)
            return
        if req is None or req.state is not IS.REQUESTED:
            return  # not ours, or named already
        table.move_request(req, IS.NAMED, r.at, f"the provider named {len(r.workers)} workers")
        for w in r.workers:
            if table.get(w) is None:
                table.add(w, req.node_type, req.id, IS.NAMED, r.at, f"named by the provider for launch {req.id}")
                table.enlist(req, w)

    def _joined(self, r: Joined) -> None:
        inst = self.instances.get(r.worker)
        if inst is None:
            return  # not ours (started by hand): nothing to track
        if inst.state is IS.NAMED:
            self.instances.move(inst, IS.JOINED, r.at, "registered with the scheduler")
            req = self.instances.requests.get(inst.request) if inst.request is not None else None
            if req is not None and req.open:
                req.delays.append(max(0.0, r.at - req.since))  # (adopted ones joined before)
                self._maybe_arrived(req, r.at)
        elif inst.state in FINAL:
            self.instances.move(inst, IS.JOINED, r.at, "registered again")
            if inst.request is not None:  # ours: it costs again (a call-off whose terminate missed it)
                self.cost.registered_again(r.worker, inst.node_type, r.at)
        if r.ready:
            self._ready(Ready(r.worker, r.at))

    def _ready(self, r: Ready) -> None:
        inst = self.instances.get(r.worker)
        if inst is None:
            return
        if inst.state is IS.JOINED:
            self.instances.move(inst, IS.READY, r.at, "its setup finished")
        nt = inst.node_type if inst.request is not None else None
        if nt is not None and nt not in self.unusable:
            self.failures[nt] = 0  # its node type works

    def _launch_failed(self, r: LaunchFailed) -> None:
        """The whole request failed: its workers that did not register are given up (and
        terminated, so a queued job that starts later cannot join uncounted)."""
        if r.request in self._failed_requests:
            return  # already counted (a provider may both raise and report the same failure)
        if not r.reason:
            r = LaunchFailed(r.request, "the provider reported a failure without a message", r.at)
        self._failed_requests.add(r.request)
        req = self.instances.requests.get(r.request)
        if req is not None and req.open:
            self._terminate.extend(self._give_up(req, r.reason, r.at))
        nt = req.node_type if req is not None else None
        self.journal.record("launch-failed", r.at, request=r.request, node_type=nt, reason=r.reason)
        if nt:
            self._type_failed(nt, r.reason, r.at)

    def _give_up(self, req: Request, why: str, now: float) -> list[str]:
        """Fail an open request and its workers still to come; returns those workers."""
        missing = self.instances.missing(req)
        for w in missing:
            self.instances.move(self.instances.instances[w], IS.FAILED, now, why)
        self.instances.move_request(req, IS.FAILED, now, why)
        return missing

    def _worker_failed(self, r: WorkerFailed) -> None:
        """A worker this controller launched died before joining (or its setup failed)."""
        inst = self.instances.get(r.worker)
        if inst is None or inst.request is None:
            return
        if inst.state is IS.NAMED:
            self._start_failed(inst.request, r.worker, f"worker {r.worker}: {r.reason}", r.at)
        elif r.setup:
            if inst.state is IS.JOINED:
                self.instances.move(inst, IS.FAILED, r.at, f"setup failed: {r.reason}")
            self._type_failed(inst.node_type, r.reason, r.at, "WorkerSetupError")

    def _start_failed(self, rid: str, wid: str, message: str, now: float) -> None:
        """One worker of request ``rid`` ended before it registered.  The request fails only when
        none of its workers is left to come (2% of a 500-node job array failing is not a broken
        node type); otherwise the worker leaves the request, which stays pending for the rest."""
        table = self.instances
        req = table.requests[rid]
        others = [w for w in table.missing(req) if w != wid]
        if len(req.workers) <= 1 or not others:
            self._launch_failed(LaunchFailed(rid, message, now))
            return
        table.move(table.instances[wid], IS.FAILED, now, message)
        table.delist(req, wid)
        rec = self.fallbacks.trouble(req.node_type, now, f"capacity error: {message}")
        if rec is not None:
            self.journal.record(rec.pop("kind"), rec.pop("t"), **rec)
        nt = self.node_types.get(req.node_type)
        wpn = nt.workers_per_node if nt is not None else 1
        req.nodes = max(1, -(-len(req.workers) // max(1, wpn)))
        self._terminate.append(wid)  # idempotent clean-up of whatever is left of it
        self.journal.record("worker-failed", now, request=rid, node_type=req.node_type, worker=wid,
                            reason=f"{message}; the other {len(req.workers)} of the request stay pending")  # fmt: skip
        self._maybe_arrived(req, now)

    def _retired(self, r: Retired) -> None:
        inst = self.instances.get(r.worker)
        if inst is not None and inst.state is IS.RETIRING:
            if r.outcome == "retired":
                self.instances.move(inst, IS.GONE, r.at, "retired")
            else:
                self.instances.move(inst, IS.READY, r.at, r.outcome or "refused")
        sig = self._asked.pop(r.worker, None)
        if r.outcome != "retired" and sig is not None:
            self.refused[r.worker] = sig  # not again until the pool changes (see _retirements)
        self.journal.record("retire-done", r.at, worker=r.worker, outcome=r.outcome)

    def _adopted(self, r: Adopted) -> None:
        if self.instances.get(r.worker) is None:
            self.instances.add(r.worker, "", None, IS.NAMED, r.at, "adopted: the cluster's own worker",
                               origin="adopted")  # fmt: skip

    def _maybe_arrived(self, req: Request, now: float) -> None:
        """Every worker still coming of ``req`` registered: learn the start-up of its type."""
        if not self.instances.all_arrived(req):
            return
        # the typical start-up of its nodes: the median, not the last straggler (the slowest
        # of 500 queue waits says little about the next launch of a few nodes)
        took: float | None = statistics.median(req.delays) if req.delays else now - req.since
        if req.censored:  # the median of arrivals plus call-offs, all of which came later: known
            # only if more than half arrived (a review: 2 of 10 arriving after 8 were called off at
            # 5 s taught 5 s, for nodes that took 200 s)
            n, ranked = len(req.delays) + req.censored, sorted(req.delays)
            took = ranked[(n - 1) // 2] if len(ranked) > (n - 1) // 2 else None
        old = self.startup.get(req.node_type)
        if took is not None:
            self.startup[req.node_type] = took if old is None else 0.7 * old + 0.3 * took
        self.instances.move_request(req, IS.JOINED, now, "every worker still coming registered")
        self.journal.record("launch-arrived", now, request=req.id, node_type=req.node_type,
                            seconds=round(took, 3) if took is not None else None)  # fmt: skip

    def _reconcile(self, listing: Mapping[str, Mapping[str, Any]], now: float) -> None:
        """Workers not registered yet that the provider no longer lists, or lists as ended."""
        table = self.instances
        for req in list(table.open.values()):
            for wid in table.missing(req):
                if not req.open:
                    break  # the request failed as a whole
                info = listing.get(wid)
                if info is None:
                    why = f"worker {wid} is not listed by the provider any more"
                elif not info.get("alive", True):
                    rc = info.get("returncode")
                    why = f"worker {wid} ended before it registered" + (f" (exit code {rc})" if rc is not None else "")
                else:
                    continue
                self.journal.record("reconcile", now, request=req.id, worker=wid, reason=why)
                self._start_failed(req.id, wid, why, now)

    def _sync_live(self, by_id: Mapping[str, WorkerView], now: float) -> None:
        """The scheduler's workers against the table: instances that left are gone; a named one
        already registered (an adopted worker that joined before it was adopted) has joined."""
        table = self.instances
        for inst in [i for i in table.live.values() if i.worker not in by_id]:
            table.move(inst, IS.GONE, now, "it left the scheduler")
        for gone in [w for w in self.refused if w not in by_id]:
            del self.refused[gone]
        if len(by_id) != len(table.live):
            for wid, ws in by_id.items():
                named = table.get(wid)
                if named is not None and named.state is IS.NAMED:
                    self._joined(Joined(wid, ws.joined, ready=ws.state == "running"))

    def _expiring(self, expiring: list[tuple[str, str]], by_id: Mapping[str, WorkerView], now: float,
                  actions: Actions) -> None:  # fmt: skip
        """Workers whose end is known (walltime, preemption notice): retired gracefully now (their
        needed data moves to survivors), asked again every ``EXPIRY_RETRY`` s while refused.  A
        refused one gets a replacement launched (even without ``replace_before``): with no survivor
        to take its data, it would be lost at the end and its tasks recomputed, for ever if a chain
        of them outlasts one walltime."""
        for wid, why in expiring:
            ws = by_id.get(wid)
            if ws is None or ws.state != "running" or self._is_retiring(wid) or wid in self._abandoned:
                continue
            tried = self._expiry_tried.get(wid, -1e9)
            fresh = any(w.node_type == ws.node_type and w.state == "running" and w.joined > tried and w.id != wid
                        for w in by_id.values())  # fmt: skip
            if now - tried <= EXPIRY_RETRY and not fresh:  # asked again at once when a worker that
                continue  # could take its data (its replacement) has joined since
            nt = self.node_types.get(ws.node_type)
            if nt is not None and nt.replace_before and wid not in self._noticed and self._awaits_replacement(ws, now):
                continue
            refused_before = wid in self._expiry_tried  # asked already, and still running: refused
            self._expiry_tried[wid] = now
            self._begin_retire(ws, now, why, actions)
            if nt is not None and nt.replace_before:
                self._want_replacement(ws, why)
            elif refused_before and ws.unique_keys:  # its data still has nowhere to go: a new worker takes it
                self._want_replacement(ws, f"{why}; its retirement was refused (no other worker can take its data)")

    def _timeouts(self, now: float, actions: Actions) -> None:
        """Launches that never arrived: given up, their workers terminated, their type backs off."""
        for req in [r for r in self.instances.open.values() if now >= r.deadline]:
            msg = f"{len(self.instances.missing(req))} workers of launch {req.id} did not register within {req.deadline - req.since:.0f}s"
            actions.terminate.extend(self._give_up(req, msg, now))
            self._failed_requests.add(req.id)
            self.journal.record("cancel-launch", now, request=req.id, node_type=req.node_type, reason=msg)
            self._type_failed(req.node_type, msg, now)

    def _type_failed(self, nt: str, message: str, now: float, error: str = "ProviderError") -> None:
        n = self.failures.get(nt, 0) + 1
        self.failures[nt] = n
        wait = min(self.backoff_max, self.backoff_base * 2 ** (n - 1))
        self.backoff_until[nt] = now + wait
        self.journal.record("backoff", now, node_type=nt, seconds=wait, failures=n, reason=message)
        rec = self.fallbacks.trouble(nt, now, f"capacity error: {message}")
        if rec is not None:
            self.journal.record(rec.pop("kind"), rec.pop("t"), **rec)
        if n >= self.max_type_failures and nt not in self.unusable:
            why = f"{n} launches of {nt!r} failed in a row (last: {message}); not launching it again"
            self.unusable[nt] = why
            self.unusable_error[nt] = error
            self.journal.record("node-type-disabled", now, node_type=nt, reason=why)

    # ---- 2. decide --------------------------------------------------------------------------------
    def _types_now(self) -> tuple[NodeType, ...]:
        """Node types with startup estimates replaced by what was measured here."""
        out = []
        for nt in self.node_types.values():
            if nt.name in self.startup:
                nt = dataclasses.replace(nt, startup_estimate=self.startup[nt.name])
            out.append(nt)
        return tuple(out)

    def _snapshot(self, obs: Observation, types: tuple[NodeType, ...],
                  pending: tuple[PendingLaunch, ...]) -> ClusterSnapshot:  # fmt: skip
        return ClusterSnapshot(
            now=obs.now, node_types=types, demand=obs.demand, workers=obs.workers, pending=pending,
            last_progress=obs.last_progress, finished=obs.finished, waiting=obs.waiting,
            running=obs.running, backlog_since=self.backlog_since,
            backoff=tuple(sorted({**self.backoff_until, **self.fallbacks.blocked_until(obs.now)}.items())),
            unusable=tuple(sorted(self.unusable)),
            forecasts=self._forecasts, eta=self._eta, next_demand_in=self._next_demand,
            spent=self.cost.spent(obs.now),
        )  # fmt: skip

    def _decide(self, snap: ClusterSnapshot) -> ScaleDecision:
        try:
            decision = as_decision(self.policy(snap))
            check_decision(decision, snap)
        except Exception as exc:  # noqa: BLE001 - a user policy must not stop the pool from serving
            decision = self._policy_failed(exc, snap, snap.now)
        for shape_desc in decision.infeasible:
            self.journal.record("infeasible", snap.now, demand=shape_desc)
        return decision

    def _policy_failed(self, exc: Exception, snap: ClusterSnapshot, now: float) -> ScaleDecision:
        import logging
        import traceback

        text = f"{type(exc).__name__}: {exc}"
        self._policy_errors += 1
        self._policy_error_first = self._policy_error_first or text
        if text != self._policy_error or now - self._policy_error_t > 60.0:
            logging.getLogger("tidepool.scaling").error(
                "the scaling policy raised (using the default policy until it works again):\n%s",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))  # fmt: skip
            self.journal.record("policy-error", now, reason=f"policy raised {text}; used the default policy")
            self._policy_error, self._policy_error_t = text, now
        return as_decision(self._fallback(snap))

    def _refresh_forecast(self, obs: Observation, graph: GraphView, types: tuple[NodeType, ...]) -> None:
        now = obs.now
        blocked = {nt.name for nt in types if nt.name in self.unusable or self.backoff_until.get(nt.name, 0) > now}
        open_ = list(self.instances.open.values())
        nodes = {}
        for nt in types:
            live = sum(1 for w in obs.workers if w.node_type == nt.name)
            nodes[nt.name] = -(-live // nt.workers_per_node) + sum(
                self._pending(r).nodes for r in open_ if r.node_type == nt.name)
        pending = tuple((r.node_type, self._pending(r).nodes, r.since) for r in open_)
        self._forecasts, self._eta, self._next_demand = type_forecasts(graph, obs.workers, types, nodes, pending,
                                                                       now, blocked)  # fmt: skip
        every = self._fc.every
        if not self._fc_fixed:  # big graphs are re-forecast less often (by size: no clock here)
            quickest = min(nt.startup_estimate for nt in types)  # decisions need no finer grain than this
            every = min(FORECAST_MAX_INTERVAL, max(FORECAST_MIN_INTERVAL, obs.tasks / FORECAST_TASKS_PER_SECOND,
                                                   quickest / FORECAST_PER_STARTUP))  # fmt: skip
        self._stale_types.clear()
        key = (len(obs.workers), len(open_), obs.tasks, obs.finished != self._fc.finished)
        self._fc = ForecastDue(at=now, every=every, key=key, finished=obs.finished)

    def _pending(self, req: Request) -> PendingLaunch:
        """What is still to come of a launch: its workers that have not registered (those that did
        are counted as live workers already; counting the whole request too would block launches
        while a few nodes of a big request wait in a queue)."""
        if not req.workers:
            return PendingLaunch(req.id, req.node_type, req.nodes, (), req.since, req.nodes)
        missing = tuple(self.instances.missing(req))
        nt = self.node_types.get(req.node_type)
        wpn = max(1, nt.workers_per_node if nt is not None else 1)
        return PendingLaunch(req.id, req.node_type, -(-len(missing) // wpn), missing, req.since, req.nodes)

    # ---- 3. act -----------------------------------------------------------------------------------
    def _launch(self, planned: Mapping[str, int], reason: str, now: float, actions: Actions) -> None:
        for name, n in planned.items():
            nt = self.node_types[name]
            rid = f"a{next(self._ids)}"
            timeout = self._launch_timeout(name)
            why = reason or "the policy asked (no reason given)"
            self.instances.request(rid, name, n, now, now + timeout, why)
            actions.launch.append((rid, nt, n))
            actions.launch_timeouts[rid] = timeout
            self._stale_types.add(name)
            self.cost.launched(rid, name, n, now)
            self.journal.record("launch", now, request=rid, node_type=name, nodes=n, reason=why)

    def _launch_timeout(self, node_type: str) -> float:
        nt = self.node_types.get(node_type)
        return self.launch_timeout or max(30.0, 5 * (nt.startup_estimate if nt is not None else 0.0))

    def _cost_cap(self, planned: dict[str, int], now: float) -> dict[str, int]:
        """The launches cut to ``max_cost_per_hour`` and ``budget``; each cut journaled
        (``cost-limit``), once per node type until its answer changes or 10 s passed."""
        if not self.limits.any or not planned:
            return planned
        types = {nt.name: nt for nt in self._types_now()}  # measured start-up: the least a node is held
        out, cuts = cap_launches(planned, types, self.limits, rate=self.cost.rate, spent=self.cost.spent(now))
        for name, asked, allowed, why in cuts:
            text = f"{name}: asked for {asked} nodes, launching {allowed}: {why}"
            said = self._cost_said.get(name)
            if said is None or said[0] != quiet_decision(text) or now - said[1] > 10.0:
                self._cost_said[name] = (quiet_decision(text), now)
                self.journal.record("cost-limit", now, node_type=name, asked=asked, allowed=allowed, reason=text)
        return out

    def _to_zero(self, snap: ClusterSnapshot, by_id: Mapping[str, WorkerView], planned: Mapping[str, int],
                 actions: Actions) -> None:  # fmt: skip
        """A pool quiet for ``scale_to_zero_after`` s: retire every idle worker that holds nothing
        needed (``min_nodes`` still holds), so a quiet cluster holds no allocation."""
        left = {nt.name: standing(snap, nt.name, self._retiring_by_type()) for nt in snap.node_types}
        assert self._quiet.since is not None
        why = f"the pool has had no work for {snap.now - self._quiet.since:.0f}s (scale_to_zero_after={self.scale_to_zero_after:g}s)"
        for ws in by_id.values():
            nt = self.node_types.get(ws.node_type)
            if (not ws.idle or ws.unique_keys or self._is_retiring(ws.id) or not self._manages(ws.id)
                    or planned.get(ws.node_type) or ws.id in self.refused):  # fmt: skip
                continue
            if nt is not None and left.get(nt.name, 0) - 1 < nt.min_nodes:
                continue
            left[ws.node_type] = left.get(ws.node_type, 0) - 1
            self._begin_retire(ws, snap.now, why, actions)

    def _budget_spent(self, snap: ClusterSnapshot, by_id: Mapping[str, WorkerView], planned: Mapping[str, int],
                      actions: Actions) -> None:  # fmt: skip
        """The budget is spent: retire idle workers that hold nothing needed (min_nodes too)."""
        if not over_budget(self.limits, self.cost.spent(snap.now)):
            return
        for ws in by_id.values():
            if (ws.idle and ws.unique_keys == 0 and not self._is_retiring(ws.id) and self._manages(ws.id)
                    and not planned.get(ws.node_type)):  # fmt: skip
                self._begin_retire(ws, snap.now, f"budget {self.limits.budget:g} spent: an idle worker costs", actions)

    def _over_max(self, snap: ClusterSnapshot, by_id: Mapping[str, WorkerView], actions: Actions) -> None:
        """Nodes of a type beyond its ``max_nodes`` (workers the autoscaler adopted, such as a
        LocalCluster's own, or a limit lowered by a new ``adapt()``): the idle ones retire, the busy
        ones once idle (a limit is not a reason to lose running work)."""
        for nt in snap.node_types:
            if nt.max_nodes == 0:
                continue  # a type kept in reserve for workers started by hand: theirs, not ours
            per = nt.workers_per_node
            staying = [w for w in by_id.values() if w.node_type == nt.name and not self._is_retiring(w.id)]
            if any(w.id in self._replaced for w in staying):
                continue  # a replacement may go above max_nodes while the worker it replaces leaves
            pending = [p for p in snap.pending if p.node_type == nt.name]
            coming = sum(p.nodes for p in pending)
            # a node partly joined: only its workers still missing are to come
            over = len(staying) + sum(len(p.worker_ids) or p.nodes * per for p in pending) - nt.max_nodes * per
            if over <= 0:
                continue
            idle = [w for w in staying if w.idle and w.state == "running" and self._manages(w.id)
                    and w.id not in self.refused]  # fmt: skip
            for ws in sorted(idle, key=lambda w: (w.unique_keys, w.id))[:over]:
                self._begin_retire(ws, snap.now, f"{nt.name}: {len(staying)} worker(s) and {coming} node(s) "
                                   f"coming, over its max_nodes {nt.max_nodes}", actions)  # fmt: skip

    def _retirements(self, decision: ScaleDecision, snap: ClusterSnapshot, by_id: Mapping[str, WorkerView],
                     planned: Mapping[str, int], retiring: Mapping[str, int], actions: Actions, *,
                     keep_idle: bool = True) -> None:  # fmt: skip
        """Retire what the policy asked, if known, running, ours, not refused with the pool unchanged since, not below
        ``min_nodes`` (nodes being retired already do not count), not below ``min_idle`` idle
        workers (with ``keep_idle``) and not of a type launched this step (anti-flap)."""
        now = snap.now
        left = {nt.name: standing(snap, nt.name, retiring) for nt in snap.node_types}
        idle = idle_by_type(snap, self.instances.retiring, coming=False)
        why = dict(decision.why)
        pool = pool_summary(by_id.values()) if decision.retire else None
        # a worker that must leave (walltime, preemption) waits for its replacement to take its data:
        # that one is not retired as idle meanwhile (a Slurm chain longer than a walltime started over)
        takers = self._takers(by_id, now)
        for wid in decision.retire:
            ws = by_id.get(wid)
            if ws is None or ws.state != "running" or self._is_retiring(wid) or not self._ours(ws, now):
                continue
            if wid in takers:
                continue
            if planned.get(ws.node_type):
                continue
            assert pool is not None
            sig = shrink_signature(pool, ws, wid)
            if wid in self.refused:
                if not self.refused[wid].changed(sig):
                    continue  # the same refusal again: said once already
                del self.refused[wid]
            wt = self.node_types.get(ws.node_type)
            if wt is not None and left.get(wt.name, 0) - 1 < wt.min_nodes:
                continue
            if keep_idle and wt is not None and ws.idle and idle.get(wt.name, 0) - 1 < wt.min_idle:
                continue
            if ws.idle:
                idle[ws.node_type] = idle.get(ws.node_type, 0) - 1
            left[ws.node_type] = left.get(ws.node_type, 0) - 1
            self._asked[wid] = sig
            self._begin_retire(ws, now, why.get(wid, "the policy asked (no reason given)"), actions)

    def _cancellations(self, decision: ScaleDecision, snap: ClusterSnapshot, planned: Mapping[str, int],
                       retiring: Mapping[str, int], actions: Actions) -> bool:  # fmt: skip
        """Call off what the policy asked (``decision.cancel``) of the launches in flight: their
        workers not registered yet are given up and terminated (the provider cancels a queued job,
        releases a booting node), the newest launch first.  Not of a type launched in this step,
        not below ``min_nodes``, not while a worker of that type waits for a replacement, and only
        whole nodes whose workers have all still to come.  True if any was called off."""
        now = snap.now
        done = False
        # the default policy's call-off reasons, or else all of a (user) policy's: a bug hunt saw a
        # user policy's own reason replaced by "no reason given"
        why = "; ".join(r for r in decision.reasons if "call off" in r) or "; ".join(decision.reasons) \
            or "the policy asked (no reason given)"  # fmt: skip
        retiring = self._retiring_by_type()  # with this step's retirements (a review: both counted them)
        for name, n in sorted(decision.cancel.items()):
            nt = self.node_types.get(name)
            if n <= 0 or nt is None or planned.get(name):
                continue
            if any(self.fallbacks.route(w.node_type) == name for w in snap.workers if w.id in self._replaced):
                continue
            n = min(n, standing(snap, name, retiring) - nt.min_nodes)
            per = max(1, nt.workers_per_node)
            for req in reversed(list(self.instances.open.values())):
                if n <= 0:
                    break
                if req.node_type != name or not req.workers:
                    continue  # not named yet: nothing to terminate
                missing = self.instances.missing(req)
                if per > 1 and len(missing) < len(req.workers):
                    continue  # part of it joined: which workers share a node is the provider's
                take = missing[len(missing) - min(len(missing), n * per):]
                take = take[len(take) % per:]  # whole nodes only
                if not take:
                    continue
                nodes = len(take) // per
                for w in take:
                    self.instances.move(self.instances.instances[w], IS.FAILED, now, f"called off: {why}")
                    self.instances.delist(req, w)
                if not req.workers:  # nothing of it came: it ends here, no failure of its type
                    self.instances.move_request(req, IS.FAILED, now, f"called off: {why}")
                else:
                    req.nodes = max(1, -(-len(req.workers) // per))
                    # the called-off ones would have come after every arrival (censored): the
                    # median start-up is known only while the arrivals are the larger part
                    req.censored += len(take)
                    self._maybe_arrived(req, now)  # the rest of it came already
                n -= nodes
                actions.terminate.extend(w for w in take if w not in actions.terminate)
                self.journal.record("cancel-launch", now, request=req.id, node_type=name, nodes=nodes,
                                    workers=list(take), called_off=True, reason=f"called off: {why}")  # fmt: skip
                done = True
        return done

    def _takers(self, by_id: Mapping[str, WorkerView], now: float) -> set[str]:
        """For each worker being replaced, the first worker of its type (or fallback) that joined
        since, for :data:`TAKER_HOLD` s after it joined: kept from idle retirement, its data goes there."""
        for gone in [w for w in self._replaced_at if w not in self._replaced]:
            del self._replaced_at[gone]
        out: set[str] = set()
        for wid in sorted(self._replaced):
            ws = by_id.get(wid)
            if ws is None:
                continue
            since = self._replaced_at.setdefault(wid, now)
            kinds = {ws.node_type, self.fallbacks.route(ws.node_type)}
            fresh = [w for w in by_id.values() if w.node_type in kinds and w.id not in self._replaced
                     and w.id not in out and w.joined >= since and now - w.joined < TAKER_HOLD]  # fmt: skip
            if fresh:
                out.add(min(fresh, key=lambda w: (w.joined, w.id)).id)
        return out

    def _ours(self, ws: WorkerView, now: float) -> bool:
        if self._manages(ws.id):
            return True
        if ws.id not in self._foreign_noted:
            self._foreign_noted.add(ws.id)
            self.journal.record("not-managed", now, worker=ws.id, node_type=ws.node_type, reason=(
                "not retired: the autoscaler did not launch it (started by hand?); "
                "adapt(manage_foreign=True) lets it retire such workers"))  # fmt: skip
        return False

    def _retiring_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for inst in self.instances.retiring.values():
            out[inst.node_type] = out.get(inst.node_type, 0) + 1
        return out

    def _is_retiring(self, wid: str) -> bool:
        inst = self.instances.get(wid)
        return inst is not None and inst.state is IS.RETIRING

    def _begin_retire(self, ws: WorkerView, now: float, why: str, actions: Actions) -> None:
        table = self.instances
        inst = table.get(ws.id)
        if inst is None:  # a foreign worker (manage_foreign) or one the provider says expires
            inst = table.add(ws.id, ws.node_type, None, IS.READY, now, "a worker started elsewhere",
                             origin="foreign")  # fmt: skip
        elif inst.state is IS.NAMED:
            self._joined(Joined(ws.id, ws.joined, ready=True))
        elif inst.state in FINAL:
            table.move(inst, IS.JOINED, now, "registered again")
        inst.node_type = inst.node_type or ws.node_type  # an adopted worker's type is known once it joined
        table.move(inst, IS.RETIRING, now, why)
        actions.retire.append(ws.id)
        self.journal.record("retire", now, worker=ws.id, node_type=ws.node_type, reason=why)

    def _note_decision(self, text: str, now: float) -> None:
        shape = quiet_decision(text)
        if shape != self._last_reason or now - self._last_reason_t > 10.0:
            self.journal.record("decision", now, reason=text)
            self._last_reason, self._last_reason_t = shape, now

    def _finish(self, actions: Actions) -> Actions:
        if self._terminate:
            actions.terminate.extend(w for w in self._terminate if w not in actions.terminate)
            self._terminate.clear()
        never = self._feasibility.never
        if self.limits.budget is not None and actions.snapshot is not None:
            # what is left of the budget no longer pays one node of a type: its tasks fail after
            # no_worker_timeout (they waited for ever, the policy asking and the limit refusing)
            now = actions.snapshot.now
            before = dict(self._feasibility.never)
            now_never = never_launched(tuple(self.node_types.values()), self.limits, self.cost.spent(now))
            new = [(name, why) for name, why in now_never if name not in before]
            for name, why in new:
                self.journal.record("cost-limit", now, node_type=name, asked=0, allowed=0,
                                    reason=f"{name}: no more launches: {why}")  # fmt: skip
            never = (*self._feasibility.never, *new)  # a type ruled out stays out (spending only grows)
        if len(self.unusable) != len(self._feasibility.disabled) or never != self._feasibility.never:
            # a node type was disabled, or the budget left rules one out
            disabled = tuple((n, self.unusable_error.get(n, "ProviderError"), why) for n, why in self.unusable.items())
            self._feasibility = Feasibility(self._feasibility.node_types, disabled, never)
            actions.feasibility = self._feasibility
        recs = self.journal.since(self._drained)
        self._drained = self.journal.end
        actions.records = recs
        snap = actions.snapshot
        self._fc = dataclasses.replace(self._fc, in_flight=len(self.instances.open))
        # the snapshot's launches in flight plus this step's (nothing else changed them since)
        requests = self.instances.requests
        pending = (snap.pending if snap is not None else ()) + tuple(
            self._pending(requests[rid]) for rid, _, _ in actions.launch)
        self.view = ControllerView(
            backlog_since=self.backlog_since, pending=pending, failures=_frozen(self.failures),
            unusable=_frozen(self.unusable), startup=_frozen(self.startup), forecast=self._fc,
            feasibility=self._feasibility,
            cost=self.cost.view(snap.now, self.limits) if snap is not None else self.view.cost,
            restoring=self._restoring is not None, policy_errors=self._policy_errors,
            policy_error=self._policy_error_first,
        )  # fmt: skip
        actions.view = self.view
        rows = instance_rows(self.instances) if self._restoring is None else self._rows
        actions.instances = row_changes(self._rows, rows)
        self._rows = rows
        if snap is not None and self._restoring is None:  # not before the stored meter is carried on
            actions.cost = self.cost.export(snap.now)
        return actions

