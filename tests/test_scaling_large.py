"""The default policy and the forecast at cloud scale (thousands of nodes, minutes of start-up).

Pure: hand-made scheduler states and a controller stepped with explicit times (no clock, no I/O).
"""

from __future__ import annotations

from tidepool.scaling.controller import ScalingController
from tidepool.scaling.forecast import candidates, fill_time
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import step_with_state
from tidepool.scaling.policies import Adaptive
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver

CLOUD = NodeType("vm", {"cpu": 1}, max_nodes=3000, startup_estimate=90.0)


def wide(n: int, seconds: float) -> StateDriver:
    d = StateDriver(SchedulerState())
    d.state.estimates.observe("job", seconds)
    d.submit([(f"job-{i}", []) for i in range(n)], [f"job-{i}" for i in range(n)])
    return d


def launched(acts) -> int:  # type: ignore[no-untyped-def]
    return sum(n for _, _, n in acts.launch)


def test_candidates_reach_the_whole_room_and_stop_where_more_nodes_get_no_task() -> None:
    ks = candidates(10_000)
    assert ks[0] == 0 and ks[-1] == 10_000 and list(ks) == sorted(set(ks))
    assert all(b <= a * 1.6 + 4 for a, b in zip(ks, ks[1:], strict=False))  # no big jumps
    assert candidates(100, useful=3) == (0, 1, 2, 3)
    assert candidates(0) == (0,)


def test_fill_time_counts_slots_that_arrive_late() -> None:
    assert fill_time(100.0, 10) == 10.0
    assert fill_time(100.0, 0, (5.0,) * 10) == 15.0  # nothing runs before they arrive
    assert fill_time(100.0, 10, (5.0,) * 10) == 7.5  # 50 s done by t=5, then 20 slots
    assert fill_time(1.0, 0) == float("inf")


def test_a_wide_cloud_graph_gets_a_pool_sized_to_it_not_a_few_dozen_nodes() -> None:
    # 60,000 one-second tasks, VMs that take 90 s to boot: with 600 nodes
    # the run takes ~190 s, so new nodes work longer than they boot.  The old rule (a step must
    # save more seconds than startup x nodes added) stopped at ~26 nodes (a 40-minute run).
    d = wide(60_000, 1.0)
    c = ScalingController((CLOUD,), Adaptive())
    n = launched(step_with_state(c, d.state, 0.0))
    assert 300 <= n <= 3000, n


def test_a_small_graph_still_gets_no_more_nodes_than_it_can_use() -> None:
    d = wide(8, 1.0)  # 8 s of work: 90 s VMs are not worth more than one
    c = ScalingController((CLOUD,), Adaptive())
    assert launched(step_with_state(c, d.state, 0.0)) == 1


def test_a_stale_forecast_never_launches_the_same_type_twice() -> None:
    # a big graph is re-forecast only every few seconds; the launch made on the last forecast
    # must not be made again on that same forecast before a fresh one sees it
    d = wide(120_000, 1.0)
    c = ScalingController((CLOUD,), Adaptive())
    first = step_with_state(c, d.state, 0.0)
    assert launched(first) > 0
    for t in (0.1, 0.5, 1.0, 2.0):
        again = step_with_state(c, d.state, t)
        assert launched(again) == 0, (t, again.launch)
    later = step_with_state(c, d.state, 30.0)  # a fresh forecast (it knows the launch in flight)
    total = launched(first) + launched(later)
    assert total <= CLOUD.max_nodes
