"""The scheduler scales its own pool: end-to-end on real worker processes."""

from __future__ import annotations

import subprocess
import time

import pytest

import tidepool
from tidepool.errors import InfeasibleTaskError
from tidepool.providers.base import LaunchRequest
from tidepool.providers.callback import CallbackProvider
from tidepool.scaling.node_types import NodeType
from tidepool.telemetry.journal import worker_intervals
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def work(x: int, d: float = 0.3) -> int:
    time.sleep(d)
    return x


def reduce(xs: list, d: float = 1.0) -> int:  # type: ignore[type-arg]
    time.sleep(d)
    return sum(xs)


def bursty(client: tidepool.Client) -> tidepool.Future:  # type: ignore[type-arg]
    """24 x 0.3 s tasks, one 1 s reduce, 24 x 0.3 s tasks that need it, and a short reduce."""
    a = client.map(work, range(24))
    r = client.submit(reduce, a)
    b = [client.submit(work, r, 0.3, key=f"phase2-{i}") for i in range(24)]
    return client.submit(reduce, b, 0.1)


def max_concurrent(records: list, t0: float, t1: float) -> int:  # type: ignore[type-arg]
    points = []
    for a, b, _ in worker_intervals(records, t1).values():
        points += [(a, 1), (b, -1)]
    n = best = 0
    for _, delta in sorted(points):
        n += delta
        best = max(best, n)
    return best


#: journal records that are scaling decisions: each must say why
DECISIONS = ("launch", "retire", "cancel-launch", "launch-failed", "backoff", "node-type-disabled",
             "infeasible", "decision")  # fmt: skip


def test_bursty_graph_grows_the_pool_and_shrinks_it_back_with_reasons() -> None:
    """Behaviour, not speed: how much worker time autoscaling saves is measured by
    ``benchmarks/elastic.py`` (docs/benchmarks.md), where a loaded machine skews a number
    instead of failing a test."""
    expected = sum(range(24)) * 24
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(maximum=4)
        clock = cluster.scheduler.clock
        t0 = clock()
        assert bursty(client).result(timeout=120) == expected
        # idle workers go; at most the one holding the result (still wanted by our future) stays.
        # A retirement's outcome is journaled when the autoscaler hears it back, which may be a
        # moment after the worker left: wait for both
        def shrunk() -> bool:
            done = [r for r in cluster.journal.records if r["kind"] == "retire-done"]  # type: ignore[union-attr]
            return len(cluster.workers) <= 1 and any(r["outcome"] == "retired" for r in done)

        wait_until(shrunk, timeout=60, what="the pool to shrink back by graceful retirements")
        records = cluster.journal.records  # type: ignore[union-attr]
        peak = max_concurrent(records, t0, clock())
        # a long-running-service hunt: the scheduler kept an entry per worker ever launched
        wait_until(lambda: set(cluster.scheduler.launched_as) <= set(cluster.workers), timeout=30,
                   what="the retired workers' launch entries to go")  # fmt: skip
    assert 1 < peak <= 4  # it grew for the wide phases, within the limit
    launched = sum(r["nodes"] for r in records if r["kind"] == "launch")
    joined = {r["worker"] for r in records if r["kind"] == "worker-join"}
    assert launched >= len(joined) >= peak  # only workers it launched joined
    retired = {r["worker"] for r in records if r["kind"] == "retire-done" and r["outcome"] == "retired"}
    assert retired and retired <= joined  # it shrank by graceful retirement of its own workers
    decisions = [r for r in records if r["kind"] in DECISIONS]
    assert decisions and all(isinstance(r.get("reason"), str) and r["reason"] for r in decisions), decisions


def test_chain_never_holds_more_than_one_worker() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(maximum=4)
        clock = cluster.scheduler.clock

        @tidepool.task
        def step(x: int) -> int:
            time.sleep(0.2)
            return x + 1

        node = step(0)
        for _ in range(19):
            node = step(node)
        t0 = clock()
        assert client.compute(node).result() == 20
        records = cluster.journal.records  # type: ignore[union-attr]
        assert max_concurrent(records, t0, clock()) == 1
        assert sum(r["nodes"] for r in records if r["kind"] == "launch") == 1


def test_gpu_tasks_start_only_gpu_nodes_and_cpu_tasks_only_cpu_nodes() -> None:
    cpu = NodeType("cpu", {"cpu": 2}, max_nodes=2, startup_estimate=0.5)
    gpu = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=0.5, cost=4.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[cpu, gpu])
        futs = client.map(work, range(4), [0.3] * 4, resources={"gpu": 1})
        assert client.gather(futs) == list(range(4))
        launched = [r["node_type"] for r in cluster.journal.records if r["kind"] == "launch"]  # type: ignore[union-attr]
        assert launched and set(launched) == {"gpu"}
        ran_on = {cluster.scheduler.state.workers[w].node_type for w in cluster.workers}
        assert ran_on <= {"gpu"}
        futs = client.map(work, range(6), [0.3] * 6)
        assert client.gather(futs) == list(range(6))
        later = [r["node_type"] for r in cluster.journal.records if r["kind"] == "launch"][len(launched):]  # type: ignore[union-attr]
        assert later and set(later) == {"cpu"}


def test_task_no_node_type_can_run_fails_at_once() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[NodeType("cpu", {"cpu": 1}, max_nodes=1)])
        fut = client.submit(work, 1, resources={"gpu": 1})
        with pytest.raises(InfeasibleTaskError, match="gpu"):
            fut.result(timeout=10)


def test_callback_provider_is_the_user_function_that_adds_workers() -> None:
    procs: dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]
    calls: list[LaunchRequest] = []

    def launch(req: LaunchRequest) -> None:
        calls.append(req)
        import os

        for wid, cmd in zip(req.worker_ids, req.commands, strict=True):
            procs[wid] = subprocess.Popen(cmd, env={**os.environ, **req.env})

    def terminate(ids: list[str]) -> None:
        for w in ids:
            procs[w].terminate()

    provider = CallbackProvider(launch, terminate)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[NodeType("cb", {"cpu": 1}, max_nodes=2, startup_estimate=0.5)],
                      provider=provider)  # fmt: skip
        assert client.gather(client.map(work, range(6), [0.3] * 6)) == list(range(6))
        assert calls and all(c.node_type.name == "cb" for c in calls)
        assert all(w.startswith("cb-") for w in procs)
    for p in procs.values():  # nothing leaks once the cluster is closed
        assert p.wait(10) is not None


def test_launch_that_never_arrives_is_cancelled_and_another_type_is_tried() -> None:
    started: list[str] = []
    terminated: list[str] = []
    real = tidepool.providers.LocalProvider  # the fallback type launches real local workers

    class Flaky(CallbackProvider):
        def __init__(self) -> None:
            super().__init__(lambda req: started.extend(req.worker_ids), terminated.extend)
            self.local: real | None = None  # type: ignore[valid-type]

        def bind(self, scheduler: str, token: str) -> None:
            super().bind(scheduler, token)
            self.local = real(scheduler, token)

        def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> list[str]:
            if node_type.name == "good":
                return self.local.worker_ids(node_type, count, request_id)  # type: ignore[union-attr,no-any-return]
            return super().worker_ids(node_type, count, request_id)

        def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
            if node_type.name == "good":
                self.local.launch(node_type, count, request_id)  # type: ignore[union-attr]
            else:
                super().launch(node_type, count, request_id)

        def close(self) -> None:
            super().close()
            self.local.close()  # type: ignore[union-attr]

    bad = NodeType("bad", {"cpu": 1}, max_nodes=1, cost=0.5, startup_estimate=0.2)
    good = NodeType("good", {"cpu": 1}, max_nodes=1, cost=2.0, startup_estimate=0.5)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[bad, good], provider=Flaky(), launch_timeout=1.0)
        assert client.submit(work, 7, 0.1).result(timeout=30) == 7
        kinds = [(r["kind"], r.get("node_type")) for r in cluster.journal.records]  # type: ignore[union-attr]
    assert ("launch", "bad") in kinds and ("cancel-launch", "bad") in kinds
    assert ("launch", "good") in kinds
    assert started and set(started) <= set(terminated)  # the lost launch was terminated, not leaked


def test_no_worker_process_outlives_the_cluster() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(maximum=3)
        assert client.gather(client.map(work, range(6), [0.2] * 6)) == list(range(6))
        procs = [p.proc for p in cluster.provider.procs.values()]
    assert all(p.wait(10) is not None for p in procs)
