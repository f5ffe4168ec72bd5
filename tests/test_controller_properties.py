"""Properties of the pure scaling controller under random observation sequences (hypothesis).

A small world plays provider and scheduler: it names each launch's workers, lets each of them
join after a random delay, crash, vanish from the listing or never come; retirements end retired
or refused; the provider reports random launch failures and setups fail at random; half the runs
start with a cluster's own worker, adopted.  It honours every ``terminate``.  The policy is random too (launches of any size, any node type, retirements
of any worker, with or without reasons) or the default one.  After every step:

- the workers alive or coming of a type never exceed its ``max_nodes``;
- the nodes that stay (live ones not being retired, plus launches in flight) are never fewer than
  ``min_nodes`` while the type can be launched (not in backoff, not disabled);
- no step launches and retires the same node type;
- every launch has ended (joined or failed, each of its workers too) by its timeout;
- every journal record of a decision carries a reason, and so does every lifecycle move.

With ``max_cost_per_hour``, whatever the policy asks: what is allocated (launches in flight, and
workers until they are gone or failed) never costs more per hour than the ceiling, and the cost
meter's rate agrees with the lifecycle table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.scaling.controller import ScalingController
from tidepool.scaling.instances import IS, InstanceTable, InvalidTransition
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import (
    Adopted,
    Joined,
    LaunchFailed,
    Named,
    Observation,
    Ready,
    Report,
    Retired,
    WorkerFailed,
)
from tidepool.scaling.policies import Adaptive
from tidepool.scaling.snapshot import ClusterSnapshot, Demand, ScaleDecision, WorkerView

#: journal kinds that are decisions (or say why a launch was given up): each needs a reason
DECISIONS = {"launch", "retire", "cancel-launch", "launch-failed", "backoff", "node-type-disabled",
             "worker-failed", "reconcile", "decision", "not-managed", "policy-error"}  # fmt: skip
CPU_SHAPE = (("cpu", 1.0),)
GPU_SHAPE = (("cpu", 1.0), ("gpu", 1.0))


@dataclass
class Coming:
    node_type: str
    fate: str  # join / crash / vanish / never
    at: float  # when it joins, or crashes


@dataclass
class World:
    """The provider and the scheduler, as far as the controller can see them."""

    rng: random.Random
    now: float = 0.0
    coming: dict[str, Coming] = field(default_factory=dict)  # named, not registered
    live: dict[str, WorkerView] = field(default_factory=dict)
    retiring: dict[str, float] = field(default_factory=dict)  # worker -> when its retirement ends
    requests: list[str] = field(default_factory=list)
    inbox: list[Report] = field(default_factory=list)

    def observe(self) -> Observation:
        rng, now = self.rng, self.now
        for wid, c in list(self.coming.items()):
            if c.fate == "join" and c.at <= now:
                del self.coming[wid]
                res = {"cpu": 1.0, "gpu": 1.0} if c.node_type == "gpu" else {"cpu": 1.0}
                self.live[wid] = WorkerView(wid, c.node_type, "running", res, 1, 0, 0.0, 0, 0, 0, c.at, c.at)
                self.inbox.append(Joined(wid, c.at, ready=rng.random() < 0.5))
                if rng.random() < 0.5:
                    self.inbox.append(Ready(wid, c.at))
            elif c.fate == "vanish" and c.at <= now:
                del self.coming[wid]
        if self.live and rng.random() < 0.05:  # a setup fails: the worker leaves
            wid = rng.choice(sorted(self.live))
            self.inbox.append(WorkerFailed(wid, "setup hook raised", now, setup=True))
            del self.live[wid]
        if self.requests and rng.random() < 0.1:  # the provider gives up on a request (its workers may still come)
            self.inbox.append(LaunchFailed(rng.choice(self.requests), rng.choice(["quota", ""]), now))
        for wid, done in list(self.retiring.items()):  # a retirement takes a while (data moves)
            if done <= now:
                del self.retiring[wid]
                if wid in self.live:
                    outcome = "retired" if rng.random() < 0.7 else "refused: it holds data"
                    self.inbox.append(Retired(wid, outcome, now))
                    if outcome == "retired":
                        del self.live[wid]
        listing = None
        if rng.random() < 0.5:
            listing = {w: {"alive": not (c.fate == "crash" and c.at <= now), "returncode": 1}
                       for w, c in self.coming.items() if c.fate != "vanish" or c.at > now}  # fmt: skip
            listing.update({w: {"alive": True} for w in self.live})
        demand = []
        if rng.random() < 0.7:
            demand.append(Demand(CPU_SHAPE, "c", rng.randrange(1, 40), rng.choice([0.5, 5.0, 60.0])))
        if rng.random() < 0.3:
            demand.append(Demand(GPU_SHAPE, "g", rng.randrange(1, 10), 10.0))
        reports, self.inbox = tuple(self.inbox), []
        return Observation(now=now, workers=tuple(sorted(self.live.values(), key=lambda w: w.id)),
                           demand=tuple(demand), listing=listing, reports=reports)  # fmt: skip

    def act(self, launch: list[tuple[str, NodeType, int]], retire: list[str], terminate: list[str]) -> None:
        rng = self.rng
        for wid in terminate:
            self.coming.pop(wid, None)
            self.live.pop(wid, None)
        for rid, nt, n in launch:
            self.requests.append(rid)
            ids = tuple(f"{rid}-{i}" for i in range(n * nt.workers_per_node))
            self.inbox.append(Named(rid, ids, self.now))
            for wid in ids:
                fate = rng.choices(["join", "crash", "vanish", "never"], [0.7, 0.1, 0.1, 0.1])[0]
                self.coming[wid] = Coming(nt.name, fate, self.now + rng.uniform(0.1, 40.0))
        for wid in retire:
            self.retiring[wid] = self.now + rng.choice([0.0, 5.0, 30.0])

    def alive_or_coming(self, node_type: str) -> int:
        coming = sum(1 for c in self.coming.values() if c.node_type == node_type and c.fate != "vanish")
        return coming + sum(1 for w in self.live.values() if w.node_type == node_type)


def chaos(rng: random.Random):  # type: ignore[no-untyped-def]
    """A policy that asks anything: any launch size, any type (unknown ones too), any retirement, any
    call-off of launches in flight."""

    def policy(snap: ClusterSnapshot) -> ScaleDecision:
        launch = {name: rng.randrange(0, 6) for name in rng.sample(["cpu", "gpu", "tpu"], rng.randrange(0, 3))}
        retire = tuple(w.id for w in snap.workers if rng.random() < 0.3)
        why = tuple((w, "idle") for w in retire if rng.random() < 0.5)
        reasons = ("asked",) if rng.random() < 0.5 else ()
        cancel = {name: rng.randrange(1, 6) for name in rng.sample(["cpu", "gpu"], rng.randrange(0, 3))
                  if not launch.get(name)}  # fmt: skip
        return ScaleDecision(launch=launch, retire=retire, reasons=reasons, why=why, cancel=cancel)

    return policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), default_policy=st.booleans(), cpu_min=st.integers(0, 2),
       wpn=st.sampled_from([1, 2]), steps=st.integers(5, 60))  # fmt: skip
def test_random_observation_sequences_keep_the_controller_invariants(
        seed: int, default_policy: bool, cpu_min: int, wpn: int, steps: int) -> None:  # fmt: skip
    rng = random.Random(seed)
    types = (NodeType("cpu", {"cpu": wpn}, workers_per_node=wpn, min_nodes=cpu_min, max_nodes=3, startup_estimate=5.0),
             NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=2, startup_estimate=10.0))  # fmt: skip
    c = ScalingController(types, Adaptive() if default_policy else chaos(random.Random(seed + 1)),
                          launch_timeout=rng.choice([None, 15.0]), backoff_base=rng.choice([0.5, 5.0]),
                          max_type_failures=3, forecast_interval=0.25, manage_foreign=rng.random() < 0.3)  # fmt: skip
    world = World(rng)
    if rng.random() < 0.5:  # a cluster's own worker, present before autoscaling: adopted
        world.live["own-0"] = WorkerView("own-0", "cpu", "running", {"cpu": 1.0}, 1, 0, 0.0, 0, 0, 0, 0.0, 0.0)
        world.inbox.append(Adopted("own-0", 0.0))
    deadlines: dict[str, float] = {}
    for _ in range(steps):
        world.now += rng.choice([0.1, 1.0, 3.0, 10.0])
        acts = c.step(world.observe())
        c.instances.validate()
        snap = acts.snapshot
        assert snap is not None
        # every decision carries a reason
        for rec in acts.records:
            if rec["kind"] in DECISIONS:
                assert rec.get("reason"), rec
        # never launch and retire the same type in one step
        retired_types = {w.node_type for w in snap.workers if w.id in acts.retire}
        assert not retired_types & {nt.name for _, nt, _ in acts.launch}, (acts.launch, acts.retire)
        # ... nor launch and call off launches of the same type; a called-off worker is terminated
        called_off = [r for r in acts.records if r["kind"] == "cancel-launch" and "workers" in r]
        assert not {r["node_type"] for r in called_off} & {nt.name for _, nt, _ in acts.launch}
        assert all(w in acts.terminate for r in called_off for w in r["workers"])
        for rid, _, _ in acts.launch:
            deadlines[rid] = world.now + acts.launch_timeouts[rid]
        world.act(acts.launch, acts.retire, acts.terminate)
        for nt in types:
            # never more than max_nodes (workers alive or coming, launches not named yet included)
            assert world.alive_or_coming(nt.name) <= nt.max_nodes * nt.workers_per_node, nt.name
            # never fewer than min_nodes that stay, while the type can be launched
            if not snap.blocked(nt.name) and nt.name not in acts.view.unusable:
                retiring = sum(1 for i in c.instances.retiring.values() if i.node_type == nt.name)
                live = sum(1 for w in snap.workers if w.node_type == nt.name) - retiring
                coming = sum(p.nodes for p in acts.view.pending if p.node_type == nt.name)
                assert -(-live // nt.workers_per_node) + coming >= nt.min_nodes, (nt.name, live, coming)
        # every launch ends in joined or failed within its timeout
        for rid, due in deadlines.items():
            if world.now >= due:
                req = c.instances.requests[rid]
                assert req.state in (IS.JOINED, IS.FAILED), (rid, req.history)
                assert all(c.instances.instances[w].state not in (IS.REQUESTED, IS.NAMED) for w in req.workers)
                assert rid not in {p.request_id for p in acts.view.pending}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), limit=st.sampled_from([1.0, 1.5, 2.5, 4.0]), wpn=st.sampled_from([1, 2]),
       steps=st.integers(5, 60))  # fmt: skip
def test_random_policies_never_take_the_pool_above_max_cost_per_hour(seed: int, limit: float, wpn: int,
                                                                       steps: int) -> None:  # fmt: skip
    """Whatever a policy asks (and min_nodes), what is allocated never costs more than the ceiling
    per hour, and the meter's rate is what the lifecycle table says is allocated."""
    rng = random.Random(seed)
    types = (NodeType("cpu", {"cpu": wpn}, workers_per_node=wpn, min_nodes=1, max_nodes=3, cost=1.0,
                      startup_estimate=5.0),
             NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=2, cost=2.0, startup_estimate=10.0))  # fmt: skip
    prices = {nt.name: nt.cost for nt in types}
    share = {nt.name: nt.cost / nt.workers_per_node for nt in types}
    c = ScalingController(types, chaos(random.Random(seed + 1)), launch_timeout=15.0, forecast_interval=0.25,
                          max_cost_per_hour=limit)  # fmt: skip
    world = World(rng)
    for _ in range(steps):
        world.now += rng.choice([0.1, 1.0, 3.0, 10.0])
        acts = c.step(world.observe())
        world.act(acts.launch, acts.retire, acts.terminate)
        table = c.instances
        allocated = sum(r.nodes * prices[r.node_type] for r in table.requests.values() if r.state is IS.REQUESTED)
        allocated += sum(share[i.node_type] for i in table.instances.values()
                         if i.request is not None and i.state not in (IS.GONE, IS.FAILED)
                         and table.requests[i.request].state is not IS.REQUESTED)  # fmt: skip
        assert acts.view.cost.rate == pytest.approx(allocated), (acts.view.cost, allocated)
        assert allocated <= limit + 1e-9, (allocated, limit)


def test_illegal_lifecycle_moves_raise_and_each_move_keeps_its_reason() -> None:
    table = InstanceTable()
    req = table.request("a1", "cpu", 1, 0.0, 30.0, "the policy asked")
    with pytest.raises(InvalidTransition, match="requested -> joined"):
        table.move_request(req, IS.JOINED, 1.0, "too early")
    table.move_request(req, IS.NAMED, 0.5, "the provider named 1 workers")
    inst = table.add("w1", "cpu", "a1", IS.NAMED, 0.5, "named")
    with pytest.raises(InvalidTransition, match="named -> retiring"):
        table.move(inst, IS.RETIRING, 1.0, "not registered yet")
    table.move(inst, IS.JOINED, 2.0, "registered")
    table.move(inst, IS.READY, 2.5, "setup done")
    table.move(inst, IS.RETIRING, 9.0, "idle 5s")
    table.move(inst, IS.GONE, 9.5, "retired")
    with pytest.raises(InvalidTransition, match="gone -> ready"):
        table.move(inst, IS.READY, 10.0, "no")
    assert [(s, why) for _, s, why in inst.history] == [
        ("named", "named"), ("joined", "registered"), ("ready", "setup done"), ("retiring", "idle 5s"),
        ("gone", "retired")]  # fmt: skip
    assert not table.live and not table.retiring
    with pytest.raises(InvalidTransition, match="already"):
        table.add("w1", "cpu", "a1", IS.NAMED, 11.0, "again")
    table.validate()


def test_a_request_has_arrived_when_every_worker_still_in_it_registered() -> None:
    """``all_arrived`` (a count kept as instances move, not a scan per join) agrees with the scan:
    a worker that failed and left the request does not count, even when it registers after all."""
    table = InstanceTable()
    req = table.request("a1", "cpu", 3, 0.0, 300.0, "the policy asked")
    table.move_request(req, IS.NAMED, 0.5, "the provider named 3 workers")
    insts = {}
    for w in ("w0", "w1", "w2"):
        insts[w] = table.add(w, "cpu", "a1", IS.NAMED, 0.5, "named")
        table.enlist(req, w)
    table.move(insts["w0"], IS.JOINED, 1.0, "registered")
    assert not table.all_arrived(req)
    table.move(insts["w1"], IS.FAILED, 2.0, "its job ended before it registered")
    table.delist(req, "w1")
    assert not table.all_arrived(req)
    table.move(insts["w1"], IS.JOINED, 3.0, "registered after all")  # no longer one of the request's
    assert not table.all_arrived(req) and len(table.arrived(req)) == 1
    table.move(insts["w2"], IS.JOINED, 4.0, "registered")
    table.move(insts["w2"], IS.FAILED, 5.0, "setup failed")  # counted as not arrived, as the scan does
    assert not table.all_arrived(req)
    table.move(insts["w2"], IS.JOINED, 6.0, "registered again")
    assert table.all_arrived(req) and len(table.arrived(req)) == len(req.workers) == 2
    table.validate()
