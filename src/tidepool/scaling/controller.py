"""The scaling controller's core: launches in flight, limits, backoff; no I/O, no clock.

State: ``launches`` (request id -> what was asked, when, which worker ids, which arrived),
``failures`` and ``backoff_until`` per node type, ``unusable`` types (too many failures in a row),
``backlog_since`` (since when runnable demand has existed without a break), learned startup times
per type, and ``journal``: an in-memory list of every decision with its reason (no file: the
shell takes new records with :meth:`ScalingController.drain_records`, or from ``Actions.records``,
and writes them where it likes).

Each :meth:`ScalingController.step` observes first (arrivals, timeouts), then acts: it builds a
:class:`ClusterSnapshot`, asks the policy, and clamps the answer to ``min_nodes``/``max_nodes`` per
type and ``max_workers`` overall.  A policy that raises is logged once (then at most once a
minute), journaled as ``policy-error``, and replaced for that step by the default policy, so the
pool keeps serving waiting tasks.

Whose workers: the controller retires only workers it launched or was told to ``adopt`` (a
LocalCluster's own workers); a worker started by hand belongs to the user and is left alone
(journaled once as ``not-managed``) unless ``manage_foreign=True``.  Launch request ids are
``a1``, ``a2``, ... so they never collide with ids the user's cluster gave its own workers.  The asyncio shell (``autoscaler.py``) carries out the returned
:class:`Actions` through a provider and reports back (``launched``, ``launch_failed``,
``retire_done``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidepool.errors import ConfigError
from tidepool.scaling.forecast import type_forecasts
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.planned import default_policy
from tidepool.scaling.planner import describe_types, rank_types
from tidepool.scaling.policies import Adaptive, as_decision
from tidepool.scaling.snapshot import (
    ClusterSnapshot,
    PendingLaunch,
    Shape,
    TypeForecast,
)
from tidepool.telemetry.journal import Journal

if TYPE_CHECKING:
    from tidepool.scaling.observation import GraphView, Observation


#: the forecast's cost grows with the graph: one more second between forecasts per this many tasks
FORECAST_TASKS_PER_SECOND = 40_000.0
#: seconds between forecasts of a small graph (changes in the pool refresh it at once)
FORECAST_MIN_INTERVAL = 0.25
#: ... and at most this many for the largest graphs (1,000,000 tasks: every 25 s)
FORECAST_MAX_INTERVAL = 30.0
#: forecasts per start-up time of the quickest node type (VMs that boot in 90 s: every 4.5 s)
FORECAST_PER_STARTUP = 20.0


@dataclass
class LaunchRecord:
    request_id: str
    node_type: str
    nodes: int
    since: float
    deadline: float
    worker_ids: list[str] = field(default_factory=list)
    arrived: set[str] = field(default_factory=set)
    delays: list[float] = field(default_factory=list)  # launch-to-join seconds of each arrival


@dataclass
class Actions:
    launch: list[tuple[str, NodeType, int]] = field(default_factory=list)  # (request id, type, nodes)
    retire: list[str] = field(default_factory=list)
    terminate: list[str] = field(default_factory=list)
    snapshot: ClusterSnapshot | None = None
    #: journal records made since the last drain (this step's decisions and earlier reports)
    records: list[dict[str, Any]] = field(default_factory=list)


def largest_offers(shape: Shape, types: Iterable[NodeType]) -> str:
    """``" (the most memory any node type offers is 14.9GiB per worker, on 'big')"`` for each
    resource the shape needs more of than every node type has."""
    from tidepool.resources import format_resources

    parts = []
    types = list(types)
    for name, amount in shape:
        offers = [(nt.worker_resources.get(name, 0.0), nt.name) for nt in types]
        best, who = max(offers, default=(0.0, ""))
        if amount > best:
            if best <= 0:
                parts.append(f"no node type has {name}")
            else:
                parts.append(f"the most {name} any node type offers is "
                             f"{format_resources({name: best}).split('=', 1)[1]} per worker, on {who!r}")  # fmt: skip
    return f" ({'; '.join(parts)})" if parts else ""


class ScalingController:
    def __init__(self, node_types: list[NodeType] | tuple[NodeType, ...],
                 policy: Callable[[ClusterSnapshot], Any] | None = None, *,
                 launch_timeout: float | None = None, backoff_base: float = 2.0,
                 backoff_max: float = 120.0, max_type_failures: int = 3,
                 max_workers: int | None = None,
                 forecast_interval: float | None = None, manage_foreign: bool = False) -> None:  # fmt: skip
        if not node_types:
            raise ConfigError("the scaling controller needs at least one node type")
        names = [nt.name for nt in node_types]
        if len(set(names)) != len(names):
            raise ConfigError(f"node type names must be unique, got {names}")
        self.node_types = {nt.name: nt for nt in node_types}
        self.policy = policy if policy is not None else default_policy()
        self.launch_timeout = launch_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_type_failures = max_type_failures
        self.max_workers = max_workers
        self.journal = Journal()  # in memory only: the controller writes no file
        self._drained = 0
        self.launches: dict[str, LaunchRecord] = {}
        self.failures: dict[str, int] = {}
        self.backoff_until: dict[str, float] = {}
        self.unusable: dict[str, str] = {}
        #: per disabled type, the error class its waiting tasks fail with (ProviderError/WorkerSetupError)
        self.unusable_error: dict[str, str] = {}
        self._failed_requests: set[str] = set()  # each failed launch is counted once
        self.startup: dict[str, float] = {}
        self.backlog_since: float | None = None
        self.retiring: set[str] = set()
        self.refused_until: dict[str, float] = {}
        self.joined: set[str] = set()
        self.worker_request: dict[str, str] = {}
        #: retire workers the autoscaler did not launch (started by hand, or by another tool)?
        self.manage_foreign = manage_foreign
        self.adopted: set[str] = set()  # not launched here, but ours to retire (the cluster's own)
        self._foreign_noted: set[str] = set()
        self._expiry_tried: dict[str, float] = {}  # worker -> when its walltime retirement was asked
        self._fallback = Adaptive()
        self._policy_error_t = -1e9
        self._policy_error = ""
        self.request_type: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._last_reason = ""
        self._last_reason_t = -1e9
        self._forecasts: tuple[TypeForecast, ...] = ()
        self._eta: float | None = None
        self._next_demand: float | None = None
        self._fc_time = -1e9
        self._fc_every = forecast_interval or 0.25
        self._fc_fixed = forecast_interval is not None
        self._fc_key: tuple[Any, ...] = ()
        self._fc_finished = -1
        #: node types launched since the last forecast: no new launch of them until a fresh one
        self._stale_types: set[str] = set()
        #: workers to terminate at the next step (given up before they registered)
        self._terminate: list[str] = []

    # ---- feasibility -------------------------------------------------------------------------------
    def infeasible_reason(self, shape: Shape) -> str | tuple[str, str] | None:
        """Why no usable node type could ever run ``shape`` (None if one could).

        A shape only disabled node types fit fails with the error that disabled them
        (``(error type, message)``), so the user sees the provider's own words.
        """
        fitting = rank_types(shape, tuple(self.node_types.values()))
        if not fitting:
            return (f"it needs {dict(shape)} and no node type offers that{largest_offers(shape, self.node_types.values())}; "
                    f"node types: {describe_types(tuple(self.node_types.values()))}")  # fmt: skip
        names = [nt.name for nt in fitting]
        if all(n in self.unusable for n in names):
            why = "; ".join(f"node type {n!r} is disabled: {self.unusable[n]}" for n in names)
            return self.unusable_error.get(names[0], "ProviderError"), (
                f"it needs {dict(shape)}, which only disabled node types offer ({why}). Fix the "
                "provider or the setup, then start a new cluster (or add a worker by hand)")  # fmt: skip
        return None

    # ---- reports from the shell -------------------------------------------------------------------
    def worker_joined(self, wid: str, now: float) -> None:
        self.joined.add(wid)
        rid = self.worker_request.get(wid)
        rec = self.launches.get(rid) if rid else None
        if rec is None:
            return
        if wid not in rec.arrived:
            rec.delays.append(now - rec.since)
        rec.arrived.add(wid)
        if len(rec.arrived) >= len(rec.worker_ids):
            # the typical start-up of its nodes: the median, not the last straggler (the slowest
            # of 500 queue waits says little about the next launch of a few nodes)
            took = statistics.median(rec.delays) if rec.delays else now - rec.since
            old = self.startup.get(rec.node_type)
            self.startup[rec.node_type] = took if old is None else 0.7 * old + 0.3 * took
            del self.launches[rid]  # type: ignore[arg-type]
            self.journal.record("launch-arrived", now, request=rec.request_id, node_type=rec.node_type,
                                seconds=round(took, 3))  # fmt: skip

    def worker_ready(self, wid: str) -> None:
        """A worker finished its setup and takes tasks: its node type works."""
        nt = self.request_type.get(self.worker_request.get(wid, ""))
        if nt is not None and nt not in self.unusable:
            self.failures[nt] = 0

    def launched(self, request_id: str, worker_ids: list[str], now: float) -> None:
        rec = self.launches.get(request_id)
        if rec is None:
            return
        rec.worker_ids = list(worker_ids)
        for w in worker_ids:
            self.worker_request[w] = request_id
            if w in self.joined:
                rec.arrived.add(w)
        if worker_ids and len(rec.arrived) >= len(worker_ids):
            self.worker_joined(worker_ids[-1], now)

    def launch_failed(self, request_id: str, message: str, now: float) -> None:
        """The whole request failed: its workers that did not register are given up (and
        terminated, so a queued job that starts later cannot join uncounted)."""
        if request_id in self._failed_requests:
            return  # already counted (a provider may both raise and report the same failure)
        self._failed_requests.add(request_id)
        rec = self.launches.pop(request_id, None)
        nt = rec.node_type if rec else self._type_of_request(request_id)
        if rec is not None:
            self._terminate.extend(w for w in rec.worker_ids if w not in rec.arrived and w not in self.joined)
        self.journal.record("launch-failed", now, request=request_id, node_type=nt, reason=message)
        if nt:
            self._type_failed(nt, message, now)

    def _start_failed(self, rid: str, wid: str, message: str, now: float) -> None:
        """One worker of request ``rid`` ended before it registered.  The request fails only when
        none of its workers is left to come (2% of a 500-node job array failing is not a broken
        node type); otherwise the worker leaves the request, which stays pending for the rest."""
        rec = self.launches.get(rid)
        if rec is not None and rec.worker_ids and wid not in rec.worker_ids:
            return  # already given up (the listing and the provider's error both tell)
        if rec is None or len(rec.worker_ids) <= 1 or not set(rec.worker_ids) - rec.arrived - {wid}:
            self.launch_failed(rid, message, now)
            return
        rec.worker_ids.remove(wid)
        wpn = self.node_types[rec.node_type].workers_per_node if rec.node_type in self.node_types else 1
        rec.nodes = max(1, -(-len(rec.worker_ids) // max(1, wpn)))
        self._terminate.append(wid)  # idempotent clean-up of whatever is left of it
        self.journal.record("worker-failed", now, request=rid, node_type=rec.node_type, worker=wid,
                            reason=f"{message}; the other {len(rec.worker_ids)} of the request stay pending")  # fmt: skip
        if len(rec.arrived) >= len(rec.worker_ids):
            self.worker_joined(next(iter(rec.arrived)), now)

    def worker_failed(self, wid: str, message: str, now: float, *, setup: bool = False) -> None:
        """A worker this controller launched died before joining (or its setup failed)."""
        rid = self.worker_request.get(wid)
        if rid is not None and wid not in self.joined:
            self._start_failed(rid, wid, f"worker {wid}: {message}", now)
        elif wid in self.joined and rid is not None:
            nt = self._type_of_request(rid)
            if nt and setup:
                self._type_failed(nt, message, now, "WorkerSetupError")

    def retire_done(self, wid: str, outcome: str, now: float) -> None:
        self.retiring.discard(wid)
        if outcome != "retired":
            self.refused_until[wid] = now + 10.0  # do not ask again at every step
        self.journal.record("retire-done", now, worker=wid, outcome=outcome)

    def _type_of_request(self, rid: str) -> str | None:
        return self.request_type.get(rid)

    def _type_failed(self, nt: str, message: str, now: float, error: str = "ProviderError") -> None:
        n = self.failures.get(nt, 0) + 1
        self.failures[nt] = n
        wait = min(self.backoff_max, self.backoff_base * 2 ** (n - 1))
        self.backoff_until[nt] = now + wait
        self.journal.record("backoff", now, node_type=nt, seconds=wait, failures=n, reason=message)
        if n >= self.max_type_failures and nt not in self.unusable:
            why = f"{n} launches of {nt!r} failed in a row (last: {message}); not launching it again"
            self.unusable[nt] = why
            self.unusable_error[nt] = error
            self.journal.record("node-type-disabled", now, node_type=nt, reason=why)

    # ---- the step ---------------------------------------------------------------------------------
    def _types_now(self) -> tuple[NodeType, ...]:
        """Node types with startup estimates replaced by what was measured here."""
        out = []
        for nt in self.node_types.values():
            if nt.name in self.startup:
                nt = dataclasses.replace(nt, startup_estimate=self.startup[nt.name])
            out.append(nt)
        return tuple(out)

    def step(self, obs: Observation) -> Actions:
        """One round on one observation: first what happened (arrivals, timeouts, workers whose
        allocation ends soon, the provider's listing), then the decision.

        ``obs.expiring``: workers the provider says end soon (a walltime): retired gracefully now,
        asked again every 5 s while refused.  ``obs.listing``: the provider's ``list()`` (worker id
        -> at least ``alive``), when the shell fetched one: a launched worker that is not listed, or
        listed as ended, before it registered fails its launch now instead of at the launch timeout.
        ``obs.graph``: the unfinished graph, when :meth:`wants_graph` asked for it.
        """
        now = obs.now
        actions = Actions()
        by_id = {w.id: w for w in obs.workers}
        if obs.listing is not None:
            self._reconcile(obs.listing, now)
        for wid in obs.expiring:
            ws = by_id.get(wid)
            if ws is None or ws.state != "running" or wid in self.retiring:
                continue
            if now - self._expiry_tried.get(wid, -1e9) <= 5.0:
                continue
            self._expiry_tried[wid] = now
            self.retiring.add(wid)
            actions.retire.append(wid)
            self.journal.record("retire", now, worker=wid, node_type=ws.node_type,
                                reason="provider: walltime ends soon")  # fmt: skip
        # observe: launches that never arrived
        for rid, rec in list(self.launches.items()):
            if now >= rec.deadline:
                missing = [w for w in rec.worker_ids if w not in rec.arrived]
                actions.terminate.extend(missing)
                del self.launches[rid]
                self._failed_requests.add(rid)
                msg = f"{len(missing)} workers of launch {rid} did not register within {rec.deadline - rec.since:.0f}s"
                self.journal.record("cancel-launch", now, request=rid, node_type=rec.node_type, reason=msg)
                self._type_failed(rec.node_type, msg, now)
        self.retiring &= set(by_id)
        if obs.demand:
            if self.backlog_since is None:
                self.backlog_since = now
        else:
            self.backlog_since = None
        types = self._types_now()
        if obs.graph is not None:
            self._refresh_forecast(obs, obs.graph, types)
        pending = tuple(self._pending(r) for r in self.launches.values())
        snap = ClusterSnapshot(
            now=now, node_types=types, demand=obs.demand, workers=obs.workers, pending=pending,
            last_progress=obs.last_progress, finished=obs.finished, waiting=obs.waiting,
            running=obs.running, backlog_since=self.backlog_since,
            backoff=tuple(sorted(self.backoff_until.items())), unusable=tuple(sorted(self.unusable)),
            forecasts=self._forecasts, eta=self._eta, next_demand_in=self._next_demand,
        )  # fmt: skip
        actions.snapshot = snap
        try:
            decision = as_decision(self.policy(snap))
        except Exception as exc:  # noqa: BLE001 - a user policy must not stop the pool from serving
            decision = self._policy_failed(exc, snap, now)
        for shape_desc in decision.infeasible:
            self.journal.record("infeasible", now, demand=shape_desc)
        # clamp launches to limits
        planned: dict[str, int] = {}
        total_workers = len(obs.workers) + sum(len(p.worker_ids) or p.nodes for p in pending)
        reasons = list(decision.reasons)
        wanted = dict(decision.launch)
        for nt in types:  # min_nodes always holds
            deficit = nt.min_nodes - snap.nodes_of(nt.name)
            if deficit > 0 and not snap.blocked(nt.name) and wanted.get(nt.name, 0) < deficit:
                wanted[nt.name] = deficit
                reasons.append(f"{nt.name}: below min_nodes={nt.min_nodes}")
        for name, n in wanted.items():
            known = self.node_types.get(name)
            if known is None:
                reasons.append(f"policy asked for unknown node type {name!r}: ignored")
                continue
            if snap.blocked(name):
                reasons.append(f"{name}: not launched ({self.unusable.get(name) or 'in backoff'})")
                continue
            if name in self._stale_types and n > max(0, known.min_nodes - snap.nodes_of(name)):
                reasons.append(f"{name}: not launched again until a forecast sees the last launch")
                continue
            n = min(n, known.max_nodes - snap.nodes_of(name))
            if self.max_workers is not None:
                n = min(n, (self.max_workers - total_workers) // known.workers_per_node)
            if n > 0:
                planned[name] = n
                total_workers += n * known.workers_per_node
        for name, n in planned.items():
            nt = self.node_types[name]
            rid = f"a{next(self._ids)}"
            timeout = self.launch_timeout or max(30.0, 5 * nt.startup_estimate)
            self.launches[rid] = LaunchRecord(rid, name, n, now, now + timeout)
            self.request_type[rid] = name
            actions.launch.append((rid, nt, n))
            self._stale_types.add(name)
            self.journal.record("launch", now, request=rid, node_type=name, nodes=n, reason="; ".join(reasons))
        # retirements: only known, not already retiring, and not below min_nodes
        left = {nt.name: snap.nodes_of(nt.name) for nt in types}
        for wid in decision.retire:
            ws = by_id.get(wid)
            if ws is None or wid in self.retiring or ws.state != "running":
                continue
            if not self.manages(wid):
                if wid not in self._foreign_noted:
                    self._foreign_noted.add(wid)
                    self.journal.record("not-managed", now, worker=wid, node_type=ws.node_type, reason=(
                        "not retired: the autoscaler did not launch it (started by hand?); "
                        "adapt(manage_foreign=True) lets it retire such workers"))  # fmt: skip
                continue
            if self.refused_until.get(wid, -1e9) > now:
                continue
            wt = self.node_types.get(ws.node_type)
            if wt is not None and left.get(wt.name, 0) - 1 < wt.min_nodes:
                continue
            if planned.get(ws.node_type):
                continue  # anti-flap: never launch and retire the same type at once
            left[ws.node_type] = left.get(ws.node_type, 0) - 1
            self.retiring.add(wid)
            actions.retire.append(wid)
            why = dict(decision.why).get(wid, "the policy asked (no reason given)")
            self.journal.record("retire", now, worker=wid, node_type=ws.node_type, reason=why)
        if not actions.launch and not actions.retire and decision.reasons:
            text = "; ".join(decision.reasons)[:2000]
            shape = re.sub(r"[0-9.]+", "#", text)  # idle 0.1s / 0.2s ... is the same decision
            if shape != self._last_reason or now - self._last_reason_t > 10.0:
                self.journal.record("decision", now, reason=text)
                self._last_reason, self._last_reason_t = shape, now
        if self._terminate:
            actions.terminate.extend(w for w in self._terminate if w not in actions.terminate)
            self._terminate.clear()
        actions.records = self.drain_records()
        return actions

    def wants_graph(self, workers: int, tasks: int, finished: int, now: float) -> bool:
        """Should the next observation carry the unfinished graph (a fresh forecast is due)?

        On a small graph, a worker or a launch more or less changes every answer: at once.
        Otherwise at most every ``_fc_every`` seconds while things change, which grows with the
        graph (one second per ``FORECAST_TASKS_PER_SECOND`` tasks: the forecast costs a pass over
        the graph) and with the node types' start-up (a decision about nodes that take 90 s to
        start needs no forecast every 0.25 s).  A forecast older than a launch never launches that type again (``step``
        waits for a fresh one), so a stale forecast cannot launch twice for the same work.
        """
        since = now - self._fc_time
        if self._fc_every > FORECAST_MIN_INTERVAL:  # a big graph: the forecast is a cost to bound
            return since >= self._fc_every
        structural = (workers, len(self.launches))
        changed = (*structural, tasks, finished != self._fc_finished)
        if structural == self._fc_key[:2]:
            if since < self._fc_every and changed == self._fc_key:
                return False
            if since < 0.05:
                return False
        return True

    def _refresh_forecast(self, obs: Observation, graph: GraphView, types: tuple[NodeType, ...]) -> None:
        now = obs.now
        blocked = {nt.name for nt in types if nt.name in self.unusable or self.backoff_until.get(nt.name, 0) > now}
        nodes = {}
        for nt in types:
            live = sum(1 for w in obs.workers if w.node_type == nt.name)
            nodes[nt.name] = -(-live // nt.workers_per_node) + sum(
                self._pending(r).nodes for r in self.launches.values() if r.node_type == nt.name)
        pending = tuple((r.node_type, self._pending(r).nodes, r.since) for r in self.launches.values())
        self._forecasts, self._eta, self._next_demand = type_forecasts(graph, obs.workers, types, nodes, pending,
                                                                       now, blocked)  # fmt: skip
        if not self._fc_fixed:  # big graphs are re-forecast less often (by size: no clock here)
            quickest = min(nt.startup_estimate for nt in types)  # decisions need no finer grain than this
            self._fc_every = min(FORECAST_MAX_INTERVAL, max(FORECAST_MIN_INTERVAL, obs.tasks / FORECAST_TASKS_PER_SECOND,
                                                            quickest / FORECAST_PER_STARTUP))  # fmt: skip
        self._stale_types.clear()
        self._fc_time = now
        self._fc_key = (len(obs.workers), len(self.launches), obs.tasks, obs.finished != self._fc_finished)
        self._fc_finished = obs.finished

    def _pending(self, rec: LaunchRecord) -> PendingLaunch:
        """What is still to come of a launch: its workers that have not registered (those that did
        are counted as live workers already; counting the whole request too would block launches
        while a few nodes of a big request wait in a queue)."""
        if not rec.worker_ids:
            return PendingLaunch(rec.request_id, rec.node_type, rec.nodes, (), rec.since)
        missing = tuple(w for w in rec.worker_ids if w not in rec.arrived)
        nt = self.node_types.get(rec.node_type)
        wpn = max(1, nt.workers_per_node if nt is not None else 1)
        return PendingLaunch(rec.request_id, rec.node_type, -(-len(missing) // wpn), missing, rec.since)

    def _reconcile(self, listing: Mapping[str, Mapping[str, Any]], now: float) -> None:
        for rid, rec in list(self.launches.items()):
            for wid in list(rec.worker_ids):
                if rid not in self.launches:
                    break  # the request failed as a whole
                if wid in rec.arrived or wid in self.joined:
                    continue
                info = listing.get(wid)
                if info is None:
                    why = f"worker {wid} is not listed by the provider any more"
                elif not info.get("alive", True):
                    rc = info.get("returncode")
                    why = f"worker {wid} ended before it registered" + (f" (exit code {rc})" if rc is not None else "")
                else:
                    continue
                self.journal.record("reconcile", now, request=rid, worker=wid, reason=why)
                self._start_failed(rid, wid, why, now)

    def drain_records(self) -> list[dict[str, Any]]:
        """Records made since the last call, for the shell to write to its journal."""
        recs = self.journal.records[self._drained:]
        self._drained = len(self.journal.records)
        return recs

    def adopt(self, wid: str) -> None:
        """Treat ``wid`` as ours to retire although this controller did not launch it."""
        self.adopted.add(wid)

    def manages(self, wid: str) -> bool:
        return self.manage_foreign or wid in self.worker_request or wid in self.adopted

    def _policy_failed(self, exc: Exception, snap: ClusterSnapshot, now: float) -> Any:
        import logging
        import traceback

        text = f"{type(exc).__name__}: {exc}"
        if text != self._policy_error or now - self._policy_error_t > 60.0:
            logging.getLogger("tidepool.scaling").error(
                "the scaling policy raised (using the default policy until it works again):\n%s",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))  # fmt: skip
            self.journal.record("policy-error", now, reason=f"policy raised {text}; used the default policy")
            self._policy_error, self._policy_error_t = text, now
        return as_decision(self._fallback(snap))

    def launched_worker_ids(self) -> list[str]:
        return list(self.worker_request)
