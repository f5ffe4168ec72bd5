"""The forecast of a graph too large to simulate for every candidate pool (``scaling/forecast.py``).

It was ``max(critical path, work / slots)``: on a graph with barriers (a wide phase, a reduce, the
next phase) that counts only the larger part, so past a few hundred nodes every extra node looked
useless and the default launched 609 of the 2,000 nodes a 4,000-task phase could use (bursty graph,
``cloud:2000``: 691 s, now 569 s).  Now it plays the graph depth by depth (:func:`layered_time`),
within the greedy schedule's own bounds.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.scaling.forecast import (
    RemainingWork,
    critical_path,
    fill_time,
    forecast,
    layered_time,
    levels,
    list_schedule,
)


def barrier_graph(width: int, work: float = 30.0, reduce: float = 240.0, final: float = 10.0) -> RemainingWork:
    """``width`` tasks, a reduce over them, ``width`` tasks on the reduce, a final reduce."""
    durations = [work] * width + [reduce] + [work] * width + [final]
    deps: list[tuple[int, ...]] = [()] * width + [tuple(range(width))]
    deps += [(width,)] * width + [tuple(range(width + 1, 2 * width + 1))]
    return RemainingWork(tuple(durations), tuple(deps), ())


def test_levels_are_work_and_longest_task_per_depth() -> None:
    assert levels(barrier_graph(4)) == ((120.0, 30.0), (240.0, 240.0), (120.0, 30.0), (10.0, 10.0))
    chain = RemainingWork((1.0, 2.0, 3.0), ((), (0,), (1,)), ())
    assert levels(chain) == ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0))
    assert levels(RemainingWork((), (), ())) == ()


def test_layered_time_counts_each_phase_and_the_wait_for_arriving_slots() -> None:
    layers = levels(barrier_graph(4))
    assert layered_time(layers, 2) == 60 + 240 + 60 + 10
    assert layered_time(layers, 8) == 30 + 240 + 30 + 10  # no faster than a phase's longest task
    assert layered_time(layers, 0, (90.0, 90.0)) == 90 + 60 + 240 + 60 + 10
    assert layered_time(layers, 0) == float("inf")
    # one slot now, one arriving during the first phase: 120 s of work, 1 slot for 10 s, then 2
    assert layered_time(((120.0, 30.0),), 1, (10.0,)) == 10 + 110 / 2


def test_without_simulation_more_nodes_still_shorten_a_graph_with_barriers() -> None:
    work = barrier_graph(4000)
    bounds = (critical_path(work), work.total)
    etas = [forecast(work, 0, (90.0,) * k, bounds, simulate=False) for k in (600, 900, 1400, 2000)]
    assert etas == sorted(etas, reverse=True) and len(set(etas)) == 4, etas
    assert etas[-1] == 90 + 60 + 240 + 60 + 10  # two rounds of each phase on 2,000 slots
    # the old estimate, max(critical path, fill time), was the critical path for both larger pools
    assert {max(bounds[0] + 90, fill_time(work.total, 0, (90.0,) * k)) for k in (1400, 2000)} == {90 + bounds[0]}


def test_on_a_graph_with_barriers_it_is_close_to_what_the_simulation_gives() -> None:
    work = barrier_graph(300)
    for slots in (7, 50, 300):  # within a part of a task per phase: the estimate divides the work
        assert abs(forecast(work, slots, simulate=False) - list_schedule(work, slots)) <= 2 * 30


@st.composite
def dags(draw: st.DrawFn) -> RemainingWork:
    n = draw(st.integers(1, 40))
    rng = random.Random(draw(st.integers(0, 10**6)))
    durations = tuple(rng.choice([0.5, 1.0, 3.0, 10.0]) for _ in range(n))
    deps = tuple(tuple(sorted(rng.sample(range(i), rng.randint(0, min(i, 3))))) if i else () for i in range(n))
    return RemainingWork(durations, deps, ())


@settings(max_examples=200, deadline=None)
@given(dags(), st.integers(0, 6), st.lists(st.floats(0.0, 20.0), max_size=4))
def test_the_estimate_stays_between_the_lower_bounds_and_the_greedy_schedules_bound(
        work: RemainingWork, slots: int, arrivals: list[float]) -> None:  # fmt: skip
    arr = tuple(arrivals)
    if slots + len(arr) == 0:
        return
    cp = critical_path(work) + (min(arr) if slots == 0 else 0.0)
    filled = fill_time(work.total, slots, arr)
    eta = forecast(work, slots, arr, simulate=False)
    assert max(cp, filled) - 1e-9 <= eta <= max(cp, filled + cp) + 1e-9


def test_the_default_policy_buys_the_whole_second_phase_of_a_graph_too_large_to_simulate(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The simulator's bursty graph on 100 cloud nodes (two 200-task phases of 30 s around a 240 s
    reduce), its forecasts made as for a graph too large to simulate: the second phase got 36 of
    the 100 nodes it could use (670.8 s), now all of them (567.9 s)."""
    from tidepool.scaling import forecast as fc
    from tidepool.sim import load_workload, make_policy, preset_cluster, simulate

    monkeypatch.setattr(fc, "SIMULATE_BUDGET", 100)
    cluster = preset_cluster("cloud:100")
    cluster.interval = 1.0
    wl = load_workload("bursty", seed=0, params={"n": 200, "work": 30, "reduce": 240})
    r = simulate(wl, cluster, make_policy("default"), seed=0, policy_name="default", task_records=False)
    assert r.makespan is not None and r.makespan < 600, r.makespan
    assert r.launched_nodes >= 190, r.launched_nodes  # both phases on (nearly) the whole pool


def test_a_graph_whose_indices_are_not_in_topological_order_is_ordered_first() -> None:
    """A replayed journal lists a task before its input: ``levels`` indexed past its list (the
    journal-replay test of ``tidepool simulate`` crashed with an IndexError)."""
    work = RemainingWork((1.0, 2.0, 5.0), ((1,), (), (0,)), ())  # 1 -> 0 -> 2
    assert levels(work) == ((2.0, 2.0), (1.0, 1.0), (5.0, 5.0))
    assert critical_path(work) == 8.0  # it read the input's finish before computing it: 6
    assert forecast(work, 1, simulate=False) == list_schedule(work, 1) == 8.0
