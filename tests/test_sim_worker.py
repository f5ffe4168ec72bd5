"""What simulated workers suffer now that they run the real WorkerState (issue 26): memory limits
(spilling, pausing, restarting), CPU contention on oversubscribed workers, setup hooks that take
time.  One worker, hand-made graphs; every number below follows from the rules."""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.scaling.node_types import NodeType
from tidepool.sim import Simulation
from tidepool.sim.cluster import SimCluster
from tidepool.sim.engine import SimResult
from tidepool.sim.provider import PRESETS
from tidepool.sim.workload import SimTask, single


def cluster(resources: dict[str, float], **kw: Any) -> SimCluster:
    nt = NodeType("default", resources, min_nodes=1, max_nodes=1, startup_estimate=0.5)
    return SimCluster([nt], {"default": PRESETS["local"]}, interval=0.05, latency=0.0, **kw)


def run(tasks: list[SimTask], c: SimCluster, **kw: Any) -> tuple[Simulation, SimResult]:
    sim = Simulation(single("t", tasks), c, c.make_policy(), seed=0, tail=0.0, **kw)
    return sim, sim.run()


def spans(sim: Simulation) -> dict[str, tuple[float, float]]:
    """key -> (start, duration) of each finished task, from the journal."""
    return {r["key"]: (r["start"], r["duration"]) for r in sim.journal.records if r["kind"] == "task"}


def test_more_tasks_than_cores_share_them() -> None:
    tasks = [SimTask(f"t{i}", 1.0) for i in range(4)]
    free = spans(run(tasks, cluster({"cpu": 4}))[0])
    shared = spans(run(tasks, cluster({"cpu": 4}, cores={"default": 2.0}))[0])
    assert [d for _, d in free.values()] == [1.0] * 4
    assert [d for _, d in shared.values()] == pytest.approx([2.0] * 4)  # four tasks on two cores: half speed
    assert len({round(s, 6) for s, _ in shared.values()}) == 1  # started together: slots were free, cores not


def test_contention_ends_when_a_task_leaves() -> None:
    got = spans(run([SimTask("long", 3.0), SimTask("short", 1.0)], cluster({"cpu": 2}, cores={"default": 1.0}))[0])
    assert got["short"][1] == pytest.approx(2.0)  # half speed while both run
    assert got["long"][1] == pytest.approx(4.0)  # 1 s of its work done by then, 2 s more alone


def test_setup_hooks_delay_the_first_task() -> None:
    plain = run([SimTask("a", 1.0)], cluster({"cpu": 1}))[1]
    slow = run([SimTask("a", 1.0)], cluster({"cpu": 1}, setup=5.0))[1]
    assert plain.makespan is not None and slow.makespan is not None
    assert slow.makespan == pytest.approx(plain.makespan + 5.0)


def test_results_past_the_memory_target_spill_and_nothing_spills_without_a_limit() -> None:
    tasks = [SimTask(f"r{i}", 1.0, nbytes=300) for i in range(5)]
    sim, result = run(tasks, cluster({"cpu": 1, "memory": 1000}))
    assert result.completed
    # target 600 bytes, of which the process's own memory (its simulated baseline, far above this
    # toy limit) takes the most it may, three quarters: each result spills the one before
    assert sim.stats.spilled_bytes == 1200
    sim, result = run(tasks, cluster({"cpu": 1}))
    assert result.completed and sim.stats.spilled_bytes == 0 and sim.stats.pauses == 0


def test_a_task_over_the_terminate_level_restarts_its_worker_until_it_is_blamed() -> None:
    tasks = [SimTask("hog", 1.0, resources={"memory": 990})]
    sim, result = run(tasks, cluster({"cpu": 1, "memory": 1000}, restart=1.0), state_kwargs={"allowed_failures": 2})
    leaves = [r for r in sim.journal.records if r["kind"] == "worker-leave"]
    assert sim.stats.memory_restarts == 3  # executing when its worker died, 3 times: > allowed_failures
    assert all("memory" in r["reason"] for r in leaves[:3])
    assert result.completed and result.failed_keys == 1
    assert [n for n in result.notes if n.startswith("1 wanted keys failed; the first: hog erred (KilledWorkerError")]


def test_a_worker_over_the_pause_level_starts_nothing_new() -> None:
    tasks = [SimTask(f"m{i}", 1.0, resources={"memory": 300}) for i in range(4)]
    sim, result = run(tasks, cluster({"cpu": 4, "memory": 1000}))
    got = spans(sim)
    # three start at once (900 bytes > the 800-byte pause level: paused); the fourth waits for room
    starts = sorted(round(s, 6) for s, _ in got.values())
    assert starts[0] == starts[1] == starts[2] < starts[3]
    assert sim.stats.pauses >= 1 and result.completed


def test_the_simulate_table_sets_what_workers_suffer() -> None:
    from tidepool.errors import ConfigError
    from tidepool.sim.cluster import from_dict

    base = {"node_types": [{"name": "cpu", "resources": {"cpu": 4}}, {"name": "gpu", "resources": {"cpu": 8}}]}
    c = from_dict({**base, "simulate": {"cores": {"gpu": 2}, "setup": 5, "disk": "500MB", "unmanaged": "100MB",
                                        "overhead": 0.002, "restart": 3}})  # fmt: skip
    assert (c.cores, c.setup, c.disk, c.unmanaged, c.overhead, c.restart) == ({"gpu": 2.0}, 5.0, 5e8, 1e8, 0.002, 3.0)
    assert from_dict({**base, "simulate": {"cores": 1}}).cores == {"cpu": 1.0, "gpu": 1.0}
    with pytest.raises(ConfigError, match="cores"):
        from_dict({**base, "simulate": {"cores": {"tpu": 1}}})
    with pytest.raises(ConfigError, match="disk"):
        from_dict({**base, "simulate": {"disk": 0}})


def test_the_loops_own_time_per_task_delays_each_start() -> None:
    tasks = [SimTask(f"t{i}", 1.0) for i in range(3)]
    plain = run(tasks, cluster({"cpu": 1}))[1]
    slow = run(tasks, cluster({"cpu": 1}, overhead=0.5))[1]
    assert plain.makespan is not None and slow.makespan is not None
    assert slow.makespan == pytest.approx(plain.makespan + 1.5)  # three starts, 0.5 s each
