"""The controller reconciles its launches with the provider's listing; tested with the public
FakeProvider and a fake clock only, through the shared round the shells run."""

from __future__ import annotations

from typing import Any

from tidepool.providers.base import ProviderFailure
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.shell.round import Round, sync_round
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision
from tidepool.telemetry.journal import Journal
from tidepool.testing import FakeClock, FakeProvider, StateDriver

CPU = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=1.0)


def want_one(snap: ClusterSnapshot) -> ScaleDecision:
    return ScaleDecision(launch={"cpu": 1}) if not snap.nodes_of("cpu") else ScaleDecision()


def shell(c: ScalingController, d: StateDriver) -> Round:
    """The shared round, fed by the driver's scheduler events as a shell's observer is."""
    rnd = Round(c, Journal())
    d.observers.append(lambda events, cmds: rnd.scheduler_events(events, bool(d.state.pending)))
    return rnd


def run_round(rnd: Round, d: StateDriver, p: FakeProvider, clock: FakeClock) -> list[str]:
    """One shell round (the shared ``sync_round``), then the workers the provider started join."""
    launched: list[str] = []
    sync_round(rnd, d.state, p, clock(), apply=d.send, named=lambda ids, nt: launched.extend(ids))
    for wid, info in p.ready():
        d.add_worker(wid, info["resources"], node_type=info["node_type"])
    rnd.controller.instances.validate()
    return launched


def test_a_worker_that_dies_before_registering_fails_its_launch_at_once() -> None:
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = FakeProvider(clock, startup=30.0)
    c = ScalingController((CPU,), want_one, launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    (wid,) = run_round(rnd, d, p, clock)
    clock.advance(1.0)
    p.crash(wid, returncode=3)
    run_round(rnd, d, p, clock)  # long before the 600 s launch timeout
    recs = rnd.journal.records
    assert [r["reason"] for r in recs if r["kind"] == "reconcile"] == [f"worker {wid} ended before it registered (exit code 3)"]
    assert rnd.view.failures["cpu"] == 1
    assert c.instances.instances[wid].state == "failed" and "exit code 3" in c.instances.instances[wid].reason
    assert [r["kind"] for r in recs].count("launch-failed") == 1


def test_a_worker_the_provider_forgot_fails_its_launch_and_counts_once() -> None:
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = FakeProvider(clock, startup=30.0)
    c = ScalingController((CPU,), want_one, launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    (wid,) = run_round(rnd, d, p, clock)
    del p.workers[wid]  # e.g. a job cancelled behind our back
    for _ in range(3):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert rnd.view.failures["cpu"] == 1
    assert any("not listed" in r["reason"] for r in rnd.journal.records if r["kind"] == "launch-failed")


def test_fake_provider_is_idempotent_and_reports_failures_only_through_poll_errors() -> None:
    clock = FakeClock()
    p = FakeProvider(clock, startup={"cpu": 2.0}, queue_wait=1.0, fail={"gpu"})
    a = p.worker_ids(CPU, 2, "a1")
    assert p.launch(CPU, 2, "a1") is None and p.worker_ids(CPU, 2, "a1") == a and len(a) == 2
    p.launch(CPU, 2, "a1")  # idempotent: still two workers
    assert len(p.list()) == 2
    gpu = NodeType("gpu", {"cpu": 1, "gpu": 1})
    p.launch(gpu, 1, "a2")  # does not raise
    (failure,) = p.poll_errors()
    assert failure.request_id == "a2" and not p.poll_errors()
    clock.advance(2.9)
    assert p.ready() == [] and {i["state"] for i in p.list().values()} == {"pending"}
    clock.advance(0.2)
    assert sorted(w for w, _ in p.ready()) == sorted(a) and p.ready() == []


def test_healthy_launches_arrive_and_are_not_reconciled_away() -> None:
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = FakeProvider(clock, startup=2.0)
    c = ScalingController((CPU,), want_one, forecast_interval=0.25)
    rnd = shell(c, d)
    (wid,) = run_round(rnd, d, p, clock)
    for _ in range(5):
        clock.advance(1.0)
        run_round(rnd, d, p, clock)
    assert wid in d.state.workers and not rnd.view.pending and not rnd.view.failures.get("cpu")
    assert c.instances.instances[wid].state == "ready"


def test_a_raising_launch_callback_is_reported_once_through_poll_errors_only() -> None:
    from tidepool.providers.base import NeedsAddress, Provider
    from tidepool.providers.callback import CallbackProvider

    def launch(req: object) -> None:
        raise RuntimeError("quota")

    p = CallbackProvider(launch, lambda ids: None, scheduler="tcp://127.0.0.1:1", token="t" * 32)
    assert isinstance(p, Provider) and isinstance(p, NeedsAddress)
    ids = p.worker_ids(CPU, 1, "a1")
    p.launch(CPU, 1, "a1")  # does not raise
    assert len(ids) == 1
    (failure,) = p.poll_errors()
    assert failure.request_id == "a1" and "quota" in failure.message
    assert p.poll_errors() == []


def want_upto(n: int):  # type: ignore[no-untyped-def]
    """Ask for ``n`` nodes in all (pending launches included), like any sane policy."""

    def policy(snap: ClusterSnapshot) -> ScaleDecision:
        have = snap.nodes_of("cpu")
        return ScaleDecision(launch={"cpu": n - have}) if have < n else ScaleDecision()

    return policy


def test_one_failed_node_of_a_big_request_leaves_the_rest_pending_and_never_exceeds_max_nodes() -> None:
    """A Slurm-like queue where 1 of 8 nodes of a request fails: the request stays pending for the
    other 7 (no backoff, no disabled type), the policy replaces one node, and the pool never holds
    more than max_nodes (the old controller dropped the whole request and its 7 workers joined
    uncounted on top of a relaunch)."""
    clock = FakeClock()
    d = StateDriver(clock=clock)
    big = NodeType("cpu", {"cpu": 1}, max_nodes=8, startup_estimate=1.0)
    p = FakeProvider(clock, startup=100.0)
    c = ScalingController((big,), want_upto(8), launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    first = run_round(rnd, d, p, clock)
    assert len(first) == 8
    clock.advance(10.0)
    p.crash(first[3], returncode=1)  # its allocation failed while the others queue
    p._errors.append(p._failure_cls("a1", first[3], "node failed"))  # also reported as an error: counted once
    peak = 0
    for _ in range(200):
        run_round(rnd, d, p, clock)
        clock.advance(1.0)
        alive = [w for w, i in p.list().items() if i["alive"]]
        peak = max(peak, len(alive))
    assert peak <= 8
    assert len(d.state.workers) == 8  # 7 from the first request + 1 replacement
    assert rnd.view.failures.get("cpu", 0) == 0 and not rnd.view.unusable
    kinds = [r["kind"] for r in rnd.journal.records]
    assert kinds.count("worker-failed") == 1 and "launch-failed" not in kinds and "backoff" not in kinds


def test_a_request_given_up_as_a_whole_terminates_its_workers_that_have_not_registered() -> None:
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = FakeProvider(clock, startup=1000.0)
    c = ScalingController((CPU,), want_upto(1), launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    (wid,) = run_round(rnd, d, p, clock)
    rnd.launch_failed("a1", "the provider gave up on it", clock())  # e.g. a doomed Slurm job
    run_round(rnd, d, p, clock)
    assert p.workers[wid]["alive"] is False  # terminated: a job that starts late cannot join uncounted


def test_workers_of_a_request_that_arrived_are_not_counted_again_as_pending() -> None:
    """7 of 8 nodes arrived, one waits in the queue: the pool is 8 nodes (7 live + 1 coming), not
    15; the old count blocked every launch while a straggler of a big request queued."""
    clock = FakeClock()
    d = StateDriver(clock=clock)
    big = NodeType("cpu", {"cpu": 1}, max_nodes=8, startup_estimate=1.0)
    p = FakeProvider(clock, startup=10.0)
    c = ScalingController((big,), want_upto(8), launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    ids = run_round(rnd, d, p, clock)
    p.workers[ids[-1]]["up_at"] = 500.0  # the straggler
    clock.advance(11.0)
    run_round(rnd, d, p, clock)
    assert len(d.state.workers) == 7
    acts, _ = rnd.step(d.state, clock(), listing=p.list())
    assert acts.snapshot is not None and acts.snapshot.nodes_of("cpu") == 8
    (pend,) = acts.snapshot.pending
    assert pend.worker_ids == (ids[-1],) and pend.nodes == 1


def test_measured_start_up_is_the_typical_node_not_the_last_straggler() -> None:
    """A Slurm-like request of 4 nodes: 3 start after 10 s, one after 500 s in the queue.  The
    start-up the forecasts use next is ~10 s; the old measure (request launch to its last worker)
    said 500 s and made every later launch look 50 times too expensive."""
    clock = FakeClock()
    d = StateDriver(clock=clock)
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=10.0)
    p = FakeProvider(clock, startup=10.0)
    c = ScalingController((nt,), want_upto(4), launch_timeout=900.0, forecast_interval=0.25)
    rnd = shell(c, d)
    ids = run_round(rnd, d, p, clock)
    p.workers[ids[-1]]["up_at"] = 500.0
    for _ in range(60):
        clock.advance(10.0)
        run_round(rnd, d, p, clock)
    assert len(d.state.workers) == 4 and not rnd.view.pending
    assert rnd.view.startup["cpu"] == 10.0


class WatchLagProvider(FakeProvider):
    """A provider whose view moves on while the shell asks it (as a watch event lands between
    two calls): the OOM kill of ``doomed`` becomes visible during ``list``, with its reason."""

    doomed: str | None = None

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        if self.doomed is not None:
            wid, self.doomed = self.doomed, None
            self.crash(wid, returncode=137)
            self._errors.append(ProviderFailure("a1", wid, f"pod of {wid} was OOMKilled (exit code 137)"))
        return super().list()


def test_a_failure_that_lands_during_the_listing_keeps_the_providers_reason() -> None:
    clock = FakeClock()
    d = StateDriver(clock=clock)
    p = WatchLagProvider(clock, startup=30.0)
    c = ScalingController((CPU,), want_one, launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    (wid,) = run_round(rnd, d, p, clock)
    clock.advance(1.0)
    p.doomed = wid
    run_round(rnd, d, p, clock)
    failed = [r for r in rnd.journal.records if r["kind"] == "launch-failed"]
    assert len(failed) == 1 and "OOMKilled" in failed[0]["reason"], failed
    assert "OOMKilled" in c.instances.instances[wid].reason


def test_workers_whose_launch_was_being_submitted_when_the_listing_was_asked_for_are_not_failed() -> None:
    """Found by a bug hunt: the autoscaler lists the provider in a thread while an earlier round's
    launch (named first, then submitted in a thread) is under way; the listing, asked for before
    the submission ended, cannot show its workers, and the launch was journaled as failed ("not
    listed by the provider any more"), backed off and launched again 10-35 ms after a healthy
    launch.  A review: also when the listing was asked for after the naming, during a slow submit."""
    clock = FakeClock(100.0)
    d = StateDriver(clock=clock)
    c = ScalingController((CPU,), want_one, launch_timeout=600.0, forecast_interval=0.25)
    rnd = shell(c, d)
    acts, _ = rnd.step(d.state, clock())
    ((rid, nt, n),) = acts.launch
    wid = f"{nt.name}-{rid}-0"
    rnd.name(rid, [wid], clock(), submitted=False)  # named; the provider's launch() runs in a thread
    clock.advance(0.5)
    asked = clock()  # the next round asks for a listing while launch() still submits
    clock.advance(0.5)
    rnd.submitted([wid], clock())
    rnd.step(d.state, clock(), listing={}, listed_at=asked)
    assert not [r for r in rnd.journal.records if r["kind"] in ("reconcile", "launch-failed")]
    clock.advance(1.0)
    rnd.step(d.state, clock(), listing={}, listed_at=clock())  # asked for after: it really is gone
    assert [r["reason"] for r in rnd.journal.records if r["kind"] == "reconcile"] == \
        [f"worker {wid} is not listed by the provider any more"]
