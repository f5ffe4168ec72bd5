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
