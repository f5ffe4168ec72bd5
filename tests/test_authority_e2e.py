"""An authenticated worker cannot speak for another: a forged "finished" over a real socket is
refused and the client gets the true value (issue 16)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import tidepool
from tidepool.comm import connect
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def answer(gate: str) -> int:
    import os

    while not os.path.exists(gate):  # runs until the test has forged its report
        time.sleep(0.01)
    return 42


def test_a_forged_result_from_another_worker_is_refused(tmp_path: object) -> None:
    gate = str(tmp_path) + "/gate"  # type: ignore[operator]
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        fut = client.submit(answer, gate, key="answer")
        state = cluster.scheduler.state
        wait_until(lambda: getattr(state.tasks.get("answer"), "state", None) == "running", 30,
                   "the task to run on the real worker")  # fmt: skip
        done = threading.Event()

        async def forge() -> None:
            conn = await connect(cluster.address, cluster.token, hello={"role": "worker", "name": "forger"})
            await conn.send({"op": "register", "id": "forger", "address": "tcp://127.0.0.1:9",
                             "resources": {"gpu": 1.0}, "node_type": "default", "name": "forger", "pid": 1,
                             "memory_limit": 0, "host": "forger"})  # fmt: skip
            assert (await conn.recv())["op"] == "registered"
            await conn.send({"op": "task-batch", "finished": [["answer", 8, 0.01]]})
            await asyncio.get_running_loop().run_in_executor(None, done.wait, 30)
            conn.close()

        t = threading.Thread(target=asyncio.run, args=(forge(),), daemon=True)
        t.start()
        try:
            wait_until(lambda: state.counters.get("refused_outcomes", 0) == 1, 30, "the forged report to be refused")
            assert state.tasks["answer"].state == "running" and "forger" not in state.tasks["answer"].who_has
            open(gate, "w").close()
            assert fut.result(timeout=30) == 42
        finally:
            open(gate, "w").close()
            done.set()
            t.join(10)


def test_a_launched_worker_cannot_claim_more_than_its_node_type() -> None:
    from tidepool.scaling.node_types import NodeType

    with tidepool.LocalCluster(n_workers=0) as cluster:
        cluster.scheduler.expect_workers(["launched-1", "launched-2", "launched-3"], NodeType("small", {"cpu": 2}))

        async def register(wid: str, resources: dict[str, float], node_type: str = "small") -> dict:  # type: ignore[type-arg]
            conn = await connect(cluster.address, cluster.token, hello={"role": "worker", "name": wid})
            await conn.send({"op": "register", "id": wid, "address": "tcp://127.0.0.1:9", "resources": resources,
                             "node_type": node_type, "name": wid, "pid": 1, "memory_limit": 0, "host": "x"})  # fmt: skip
            reply = await conn.recv()
            conn.close()
            return reply  # type: ignore[no-any-return]

        greedy = asyncio.run(register("launched-1", {"cpu": 1e6}))
        assert greedy["op"] == "refused" and "more than its node type 'small'" in greedy["reason"]
        extra = asyncio.run(register("launched-2", {"cpu": 2.0, "gpu": 1.0}))
        assert extra["op"] == "refused" and "gpu" in extra["reason"]
        other = asyncio.run(register("launched-3", {"cpu": 2.0}, node_type="big"))
        assert other["op"] == "refused" and "registers as 'big'" in other["reason"]
        assert cluster.scheduler.refused_registrations == 3 and not cluster.scheduler.state.workers
        fair = asyncio.run(register("launched-1", {"cpu": 2.0}))
        assert fair["op"] == "registered"
        by_hand = asyncio.run(register("manual-1", {"cpu": 64.0}, node_type="whatever"))
        assert by_hand["op"] == "registered"  # not launched by us: the token holder may add workers
