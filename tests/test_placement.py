"""Placement: scarce resources stay free for the tasks that need them, idle workers steal queued
work, and tasks that submit tasks give their slot back.  Pure rules with the state driver, then
the same behaviour on real processes."""

from __future__ import annotations

import time

import pytest

import tidepool
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState
from tidepool.testing import StateDriver

GPU = {"cpu": 2.0, "gpu": 1.0}


def _where(d: StateDriver) -> dict[str, str]:
    return {k: w for w, keys in d.running.items() for k in keys}


def test_ordinary_tasks_never_queue_on_a_gpu_worker() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000))  # deep queues allowed in general
    d.add_worker("gpu1", GPU)
    d.submit([(f"cpu-{i}", []) for i in range(10)], [f"cpu-{i}" for i in range(10)])
    on_gpu = [k for k, w in _where(d).items() if w == "gpu1"]
    assert len(on_gpu) == 2  # its two free slots, nothing queued behind them


def test_gpu_work_that_is_ready_keeps_the_gpu_worker_for_itself() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000))
    d.add_worker("gpu1", GPU)
    d.add_worker("cpu1", {"cpu": 1.0})
    cpu = [(f"cpu-{i}", []) for i in range(10)]  # submitted first: they have priority
    gpu = [(f"gpu-{i}", [], {"gpu": 1}) for i in range(4)]
    d.submit(cpu + gpu, [t[0] for t in cpu + gpu])
    where = _where(d)
    assert where["gpu-0"] == "gpu1"
    assert not [k for k, w in where.items() if w == "gpu1" and k.startswith("cpu")]
    assert all(w == "cpu1" for k, w in where.items() if k.startswith("cpu"))


def test_a_gpu_worker_takes_no_more_gpu_tasks_than_it_has_gpus_so_a_new_one_gets_the_rest() -> None:
    # found by a bug hunt: a {cpu: 4, gpu: 1} worker took four gpu tasks (its cpu slots) and ran
    # them one after the other, while a gpu worker launched for them sat idle (12 s for 6 s of work)
    d = StateDriver(SchedulerState(queue_seconds=1000))
    d.add_worker("g1", {"cpu": 4.0, "gpu": 1.0})
    keys = [f"gpu-{i}" for i in range(4)]
    d.submit([(k, [], {"gpu": 1}) for k in keys], keys)
    assert _where(d) == {"gpu-0": "g1"}  # the other three wait in the ready line
    d.add_worker("g2", {"cpu": 4.0, "gpu": 1.0})
    assert _where(d) == {"gpu-0": "g1", "gpu-1": "g2"}
    d.finish("g1", "gpu-0")
    assert _where(d) == {"gpu-1": "g2", "gpu-2": "g1"}  # a gpu freed: the next one goes there
    d.add_worker("g3", {"cpu": 4.0, "gpu": 2.0})
    assert _where(d)["gpu-3"] == "g3"
    d.run_until_idle()
    assert d.status() == {k: "memory" for k in keys}
    busy = StateDriver(SchedulerState(queue_seconds=1000))  # its gpu busy: its spare cores take cpu work
    busy.add_worker("g1", {"cpu": 4.0, "gpu": 1.0})
    busy.submit([(k, [], {"gpu": 1}) for k in keys], keys)
    busy.submit([(f"cpu-{i}", []) for i in range(5)], [f"cpu-{i}" for i in range(5)])
    assert sorted(_where(busy)) == ["cpu-0", "cpu-1", "cpu-2", "gpu-0"]  # free slots only, no queue
    half = StateDriver(SchedulerState(queue_seconds=1000))  # half a gpu each: two at a time
    half.add_worker("g1", {"cpu": 4.0, "gpu": 1.0})
    half.submit([(k, [], {"gpu": 0.5}) for k in keys], keys)
    assert sorted(_where(half)) == ["gpu-0", "gpu-1"]


def test_a_seceded_gpu_task_gives_its_gpu_back_and_a_released_run_keeps_it_until_it_ends() -> None:
    # a review of the fix above: a gpu task that secedes (worker_client) to wait on a child gpu
    # task kept its gpu counted, so the child could never be placed on the 1-gpu worker: deadlock
    d = StateDriver(SchedulerState(queue_seconds=1000))
    d.add_worker("g1", {"cpu": 4.0, "gpu": 1.0})
    d.submit([("parent-0", [], {"gpu": 1})], ["parent-0"])
    d.send(ev.TaskSeceded("g1", "parent-0", d.clock()))
    d.submit([("child-0", [], {"gpu": 1})], ["child-0"], client="c2")
    assert _where(d) == {"parent-0": "g1", "child-0": "g1"}
    d.finish("g1", "child-0")
    d.finish("g1", "parent-0")
    d.state.validate()
    assert not d.state.workers["g1"].special_used
    # a gpu task released while it executes still holds the gpu there until its run ends
    r = StateDriver(SchedulerState(queue_seconds=1000), auto_start=False)
    r.add_worker("g1", {"cpu": 4.0, "gpu": 1.0})
    r.add_worker("g2", {"cpu": 4.0, "gpu": 1.0})
    r.submit([("long-0", [], {"gpu": 1})], ["long-0"])
    (where,) = [w for w, keys in r.running.items() if keys]
    other = "g2" if where == "g1" else "g1"
    r.start(where, "long-0")
    r.release(["long-0"])
    r.submit([("next-0", [], {"gpu": 1}), ("next-1", [], {"gpu": 1})], ["next-0", "next-1"])
    assert _where(r) == {"next-0": other}  # not queued behind the abandoned run
    r.state.validate()
    r.send(ev.AbandonedRunsEnded(where, ["long-0"], r.clock()))
    assert _where(r) == {"next-0": other, "next-1": where}
    r.state.validate()


def test_ordinary_tasks_prefer_workers_without_scarce_resources() -> None:
    d = StateDriver()
    d.add_worker("gpu1", GPU)
    d.add_worker("cpu1", {"cpu": 2.0})
    d.submit([("a", [])], ["a"])
    assert _where(d)["a"] == "cpu1"


def test_an_idle_worker_steals_tasks_queued_elsewhere() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000), auto_start=False)
    d.add_worker("w1")
    d.submit([("long", [])] + [(f"tiny-{i}", []) for i in range(6)], ["long"] + [f"tiny-{i}" for i in range(6)])
    assert all(w == "w1" for w in _where(d).values())
    d.start("w1", "long")
    cmds = d.add_worker("w2")  # an idle worker appears while w1 has a queue
    steals = [c for c in cmds if isinstance(c, ev.Steal)]
    assert steals and steals[0].worker == "w1" and "long" not in steals[0].keys
    asked = steals[0].keys
    for k in asked:  # w1 gives back what had not started
        d.running["w1"].remove(k)
    cmds = d.send(ev.StealReply("w1", asked, [], d.clock()))
    moved = [c.key for c in cmds if isinstance(c, ev.Execute) and c.worker == "w2"]
    assert moved and set(moved) <= set(asked)
    d.state.validate()


def test_an_idle_worker_does_not_steal_a_quick_task_whose_big_input_is_elsewhere() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000), auto_start=False)
    d.add_worker("w1")
    d.submit([(f"make-{i}", []) for i in range(4)], [f"make-{i}" for i in range(4)])
    for i in range(4):
        d.finish("w1", f"make-{i}", nbytes=20 * 2**20, duration=0.05)
    for _ in range(4):  # the check group is known to be quick: 10 ms
        d.state.estimates.observe("check", 0.01)
    tasks = [("free-0", []), ("free-1", [])] + [(f"check-{i}", [f"make-{i}"]) for i in range(4)]
    d.submit(tasks, [t[0] for t in tasks])
    assert all(w == "w1" for w in _where(d).values())  # locality put the checks on w1
    d.start("w1", "free-0")
    steals = [c for c in d.add_worker("w2", {"cpu": 4.0}) if isinstance(c, ev.Steal)]
    asked = {k for c in steals for k in c.keys}
    assert asked == {"free-1"}  # a check's 20 MB copy would cost 0.2 s for 10 ms of work


def test_a_steal_refused_because_the_task_started_leaves_it_in_place() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000), auto_start=False)
    d.add_worker("w1")
    d.submit([(f"t-{i}", []) for i in range(4)], [f"t-{i}" for i in range(4)])
    d.start("w1", "t-0")
    steals = [c for c in d.add_worker("w2") if isinstance(c, ev.Steal)]
    assert steals
    kept = steals[0].keys
    d.send(ev.StealReply("w1", [], kept, d.clock()))  # they had started meanwhile
    assert all(d.state.tasks[k].worker == "w1" and not d.state.tasks[k].stealing for k in kept)
    d.run_until_idle()
    assert all(s == "memory" for s in d.status().values())


def test_a_seceded_task_stops_counting_as_load() -> None:
    d = StateDriver(SchedulerState(queue_seconds=0.0))
    d.add_worker("w1")
    d.submit([("outer", [])], ["outer"])
    d.submit([("inner", [])], ["inner"])
    assert _where(d) == {"outer": "w1"}  # one slot, taken
    d.send(ev.TaskSeceded("w1", "outer", d.clock()))
    assert _where(d)["inner"] == "w1"  # the slot went to the inner task
    d.run_until_idle()
    assert d.status() == {"outer": "memory", "inner": "memory"}
    d.state.validate()


# ---- real processes ------------------------------------------------------------------------------
def sleep_then(x: int, delay: float) -> int:
    time.sleep(delay)
    return x


def fib(n: int) -> int:
    if n < 2:
        return n
    with tidepool.worker_client() as client:
        a = client.submit(fib, n - 1)
        b = client.submit(fib, n - 2)
        return a.result() + b.result()


def which_worker(_: int) -> tuple[str, float]:
    start = time.time()
    time.sleep(0.2)
    return tidepool.get_worker().id, start


@pytest.mark.integration
def test_tiny_tasks_do_not_wait_behind_a_long_one_while_a_worker_is_idle() -> None:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        # teach the scheduler that sleep_then is quick, so it queues several per worker
        assert client.gather(client.map(sleep_then, range(20), [0.0] * 20), timeout=30) == list(range(20))
        long = client.submit(sleep_then, -1, 8.0)
        tiny = client.map(sleep_then, range(12), [0.0] * 12)
        assert client.gather(tiny, timeout=30) == list(range(12))
        assert not long.done()  # they all finished while the long task was still running
        assert long.result(timeout=30) == -1


@pytest.mark.integration
def test_tasks_that_submit_tasks_do_not_deadlock_on_one_slot_workers() -> None:
    with tidepool.LocalCluster(n_workers=2, slots=1) as cluster, tidepool.Client(cluster) as client:
        assert client.submit(fib, 15).result(timeout=110) == 610


@pytest.mark.integration
def test_gpu_tasks_run_on_the_gpu_worker_and_cpu_work_goes_elsewhere() -> None:
    with tidepool.LocalCluster(n_workers=2, slots=1) as cluster, tidepool.Client(cluster) as client:
        (gpu_worker,) = cluster.add_workers(1, node_type=tidepool.NodeType("gpu", {"cpu": 1, "gpu": 1}))
        cpu = client.map(which_worker, range(10), key="cpu")
        gpu = client.map(which_worker, range(8), key="gpu", resources={"gpu": 1})
        gpu_ran = client.gather(gpu, timeout=60)
        assert {w for w, _ in gpu_ran} == {gpu_worker}
        last_gpu_start = max(t for _, t in gpu_ran)
        cpu_ran = client.gather(cpu, timeout=60)
        # the GPU worker's one slot may have taken a CPU task before the GPU tasks were submitted;
        # after that, no CPU task started there while GPU tasks were still waiting
        on_gpu_early = [t for w, t in cpu_ran if w == gpu_worker and t < last_gpu_start]
        assert len(on_gpu_early) <= 1, (cpu_ran, last_gpu_start)


def test_a_quick_task_waits_for_its_big_inputs_holder_instead_of_copying_them() -> None:
    d = StateDriver(SchedulerState(queue_seconds=0.0))
    d.add_worker("w1")
    d.submit([(f"make-{i}", []) for i in range(4)], [f"make-{i}" for i in range(4)])
    for i in range(4):
        d.finish("w1", f"make-{i}", nbytes=20 * 2**20, duration=0.05)
    for _ in range(4):
        d.state.estimates.observe("check", 0.01)
    d.add_worker("w2")
    tasks = [(f"check-{i}", [f"make-{i}"]) for i in range(4)]
    d.submit(tasks, [t[0] for t in tasks])
    ran: dict[str, str] = {}
    while len(ran) < 4:
        where = _where(d)
        ran.update(where)
        for key, w in where.items():
            d.finish(w, key, duration=0.01)
    assert set(ran.values()) == {"w1"}  # never copied 20 MB to w2 for 10 ms of work
    d.state.validate()


def test_a_dependent_takes_its_unfinished_inputs_place_in_line() -> None:
    d = StateDriver(SchedulerState(queue_seconds=0.0))
    d.add_worker("w1")
    d.submit([(f"make-{i}", []) for i in range(3)], [f"make-{i}" for i in range(3)])
    d.submit([(f"use-{i}", [f"make-{i}"]) for i in range(3)], [f"use-{i}" for i in range(3)])
    order = []
    while len(order) < 6:
        (key,) = d.running["w1"]
        order.append(key)
        d.finish("w1", key)
    assert order == ["make-0", "use-0", "make-1", "use-1", "make-2", "use-2"]  # depth first
    # a later task on an input that is already done keeps its own place (submission order)
    d.submit([("busy", []), ("first", []), ("second", [])], ["busy", "first", "second"])
    d.submit([("late", ["make-0"])], ["late"])
    order = []
    while len(order) < 4:
        (key,) = d.running["w1"]
        order.append(key)
        d.finish("w1", key)
    assert order == ["busy", "first", "second", "late"]


def test_an_over_provisioned_pool_packs_tasks_so_whole_workers_stay_idle() -> None:
    d = StateDriver()
    for i in range(3):
        d.add_worker(f"w{i}", {"cpu": 4.0})  # 12 free slots
    d.submit([(f"t-{i}", []) for i in range(5)], [f"t-{i}" for i in range(5)])
    used = set(_where(d).values())
    assert len(used) == 2  # four on one worker, one on the next; the third stays idle to be retired
    assert sorted(list(_where(d).values()).count(w) for w in used) == [1, 4]


def test_a_pool_with_fewer_free_slots_than_ready_tasks_spreads_by_load() -> None:
    d = StateDriver(SchedulerState(queue_seconds=1000))
    for i in range(2):
        d.add_worker(f"w{i}", {"cpu": 2.0})  # 4 free slots, 6 ready tasks: every slot fills anyway
    d.submit([(f"t-{i}", []) for i in range(6)], [f"t-{i}" for i in range(6)])
    counts = sorted(list(_where(d).values()).count(w) for w in ("w0", "w1"))
    assert counts == [3, 3]  # the queue beyond the slots is shared by load, not piled on one


def test_a_worker_running_setup_hooks_gets_no_new_task_until_they_end() -> None:
    # found by a review: a worker sent a setup (register_setup, or the ones a rejoining worker
    # missed) was given tasks that waited behind the setup on it while another worker idled
    d = StateDriver(SchedulerState(queue_seconds=0))  # no queue beyond a free slot
    d.add_worker("a", {"cpu": 1.0})
    d.add_worker("b", {"cpu": 1.0})
    d.send(ev.WorkerPreparing("a", d.clock(), True))
    keys = [f"t-{i}" for i in range(4)]
    d.submit([(k, []) for k in keys], keys)
    assert set(_where(d).values()) == {"b"}
    d.finish("b", _where(d).popitem()[0])
    assert set(_where(d).values()) == {"b"}  # still none on a
    d.send(ev.WorkerPreparing("a", d.clock(), False))
    assert "a" in set(_where(d).values())
    d.run_until_idle()
    assert d.status() == {k: "memory" for k in keys}


def test_a_worker_running_setup_hooks_is_not_idle_to_the_autoscaler() -> None:
    # from a review: a worker sent a setup after it joined looked idle (no task, state running) and
    # the default policy retired it mid-setup; it is seen as starting until its hooks end
    from tidepool.scaling.node_types import NodeType
    from tidepool.scaling.observation import worker_views
    from tidepool.scaling.planned import default_policy
    from tidepool.scaling.snapshot import ClusterSnapshot

    d = StateDriver(SchedulerState())
    d.add_worker("a", {"cpu": 1.0})
    d.send(ev.WorkerPreparing("a", d.clock(), True))
    d.clock.advance(600.0)
    nt = NodeType("default", max_nodes=2, startup_estimate=1.0)

    def snap() -> ClusterSnapshot:
        return ClusterSnapshot(now=d.clock(), node_types=(nt,), demand=(), workers=worker_views(d.state), finished=1)

    (view,) = snap().workers
    assert view.state == "running" and view.preparing and not view.idle  # (a walltime end still retires it)
    assert default_policy()(snap()).retire == ()
    d.send(ev.WorkerPreparing("a", d.clock(), False))
    d.clock.advance(600.0)
    assert default_policy()(snap()).retire == ("a",)  # once ready and idle, as any worker


def test_a_worker_whose_walltime_ends_is_retired_even_while_it_runs_a_setup_hook() -> None:
    # a review: shown as "starting" while it prepared, the controller's walltime retirement
    # (which takes running workers) skipped it, and its data was lost at the kill
    from tidepool.scaling.controller import ScalingController
    from tidepool.scaling.node_types import NodeType
    from tidepool.scaling.observation import step_with_state

    d = StateDriver()
    d.add_worker("job-1", node_type="cpu")
    d.send(ev.WorkerPreparing("job-1", d.clock(), True))  # client.register_setup(...) mid-run
    cpu = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=0.5)
    c = ScalingController((cpu,), lambda s: None, forecast_interval=0.25)
    acts = step_with_state(c, d.state, 0.0, expiring=["job-1"])
    assert acts.retire == ["job-1"]
