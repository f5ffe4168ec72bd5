"""A restarted scheduler's autoscaler adopts the instances its provider still lists (issue 27):
the stored instance rows seed the controller's table, reconciled against the provider's listing.
Pure: the public FakeProvider, a fake clock and the shared round; the rows go through a dict as
the durable scheduler's store would keep them."""

from __future__ import annotations

from typing import Any

from tidepool.scaling.controller import Actions, ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.shell.round import Round, sync_round
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision
from tidepool.telemetry.journal import Journal
from tidepool.testing import FakeClock, FakeProvider, StateDriver

CPU = NodeType("cpu", {"cpu": 1}, max_nodes=6, startup_estimate=1.0)


def want_three(snap: ClusterSnapshot) -> ScaleDecision:
    missing = 3 - snap.nodes_of("cpu")
    return ScaleDecision(launch={"cpu": missing}) if missing > 0 else ScaleDecision()


class Shell:
    """One scheduler process's autoscaler: its state, its round, and the store rows it writes."""

    def __init__(self, clock: FakeClock, p: FakeProvider, store: dict[str, dict[str, Any]],
                 restored: dict[str, dict[str, Any]] | None) -> None:  # fmt: skip
        self.clock, self.p, self.store = clock, p, store
        self.d = StateDriver(clock=clock)
        self.c = ScalingController((CPU,), want_three, launch_timeout=600.0, forecast_interval=0.25,
                                   restored=restored)  # fmt: skip
        self.rnd = Round(self.c, Journal())
        self.d.observers.append(lambda events, cmds: self.rnd.scheduler_events(events, bool(self.d.state.pending)))
        self.launched: list[str] = []

    def round(self) -> Actions:
        actions, _ = sync_round(self.rnd, self.d.state, self.p, self.clock(), apply=self.d.send)
        self.launched += [rid for rid, _, _ in actions.launch]
        for wid, row in actions.instances.items():  # what the durable scheduler stores per tick
            if row is None:
                self.store.pop(wid, None)
            else:
                self.store[wid] = dict(row)
        self.c.instances.validate()
        return actions

    def join(self, wids: list[str]) -> None:
        for w in wids:
            self.d.add_worker(w, {"cpu": 1}, node_type="cpu")

    def adopt_records(self) -> dict[str, str]:
        return {r["worker"]: r["outcome"] for r in self.rnd.journal.records if r["kind"] == "adopt"}


def run_first_scheduler(clock: FakeClock, p: FakeProvider, store: dict[str, dict[str, Any]]) -> list[str]:
    """Three workers launched, registered and stored; returns their ids."""
    first = Shell(clock, p, store, None)
    first.round()
    clock.advance(1.5)
    first.join([w for w, _ in p.ready()])
    for _ in range(3):
        clock.advance(0.5)
        first.round()
    assert first.launched == ["a1"]
    return sorted(store)


def test_a_restart_adopts_the_listed_instances_and_launches_no_duplicates() -> None:
    clock = FakeClock()
    p = FakeProvider(clock, startup=1.0)
    store: dict[str, dict[str, Any]] = {}
    w0, w1, w2 = run_first_scheduler(clock, p, store)
    assert {r["state"] for r in store.values()} == {"ready"} and {r["request"] for r in store.values()} == {"a1"}
    # the scheduler dies; meanwhile w2's process ends, and a launch submitted in its last tick
    # (never stored) starts a process
    p.crash(w2)
    p.launch(CPU, 1, "a2")
    calls = p.launch_calls

    second = Shell(clock, p, store, restored=dict(store))
    assert second.round().launch == []  # the listing came first: nothing missing to launch
    (late,) = p.requests["a2"]
    assert second.adopt_records() == {w0: "adopted", w1: "adopted", w2: "gone", late: "adopted"}
    table = second.c.instances.instances
    assert {w: (i.state, i.request) for w, i in table.items()} == {w0: ("named", "a1"), w1: ("named", "a1"),
                                                                   late: ("named", "a2")}  # fmt: skip
    assert w2 not in store and set(store) == {w0, w1, late}  # the gone row left the store
    assert sorted(second.rnd.named) == sorted([w0, w1, late])  # terminated when the autoscaler closes
    # the survivors re-register, the late one starts up: still no launch, all live
    second.join([w0, w1])
    clock.advance(1.5)
    second.join([w for w, _ in p.ready() if w == late])
    for _ in range(4):
        clock.advance(0.5)
        assert second.round().launch == []
    assert p.launch_calls == calls
    assert {w: i.state for w, i in table.items()} == {w0: "ready", w1: "ready", late: "ready"}
    assert {r["state"] for r in store.values()} == {"ready"}
    # a later launch takes a request id no stored launch had
    second.d.remove_worker(w0)
    clock.advance(0.5)
    second.round()
    assert second.launched and second.launched[0] not in ("a1", "a2")


def test_without_the_stored_rows_the_restart_launches_duplicates() -> None:
    """The control: the same restart with no rows launches while the old workers are still
    coming back (what the adoption prevents)."""
    clock = FakeClock()
    p = FakeProvider(clock, startup=1.0)
    store: dict[str, dict[str, Any]] = {}
    run_first_scheduler(clock, p, store)
    plain = Shell(clock, p, store, restored=None)
    assert plain.round().launch != []


def test_restored_rows_wait_for_a_listing_before_any_launch() -> None:
    """A round without a listing (the provider's list failed) adopts nothing and launches nothing;
    the next listing adopts."""
    clock = FakeClock()
    p = FakeProvider(clock, startup=1.0)
    store: dict[str, dict[str, Any]] = {}
    w0, w1, w2 = run_first_scheduler(clock, p, store)
    c = ScalingController((CPU,), want_three, launch_timeout=600.0, forecast_interval=0.25, restored=dict(store))
    d = StateDriver(clock=clock)
    rnd = Round(c, Journal())
    assert rnd.view.restoring and rnd.listing_due(clock())
    actions, _ = rnd.step(d.state, clock(), listing=None)
    assert actions.launch == [] and not c.instances.instances and actions.view.restoring
    clock.advance(2.5)
    actions, _ = rnd.step(d.state, clock(), listing=p.list())
    assert actions.launch == [] and set(c.instances.instances) == {w0, w1, w2}
    assert not actions.view.restoring
