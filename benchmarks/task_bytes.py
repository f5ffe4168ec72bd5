"""Bytes per task held by the scheduler state and by the client, measured with tracemalloc.

- scheduler: ``--n`` task specs as the server builds them from an ``update-graph`` (a pickled
  argument each, a group name, the key) handed to :class:`SchedulerState` with no workers; the
  traced memory still held once the specs list is dropped, per task.
- client: ``client.map(inc, range(N))`` against a scheduler (in a child process, no workers, so the
  tasks stay pending); the traced memory this process still holds afterwards (futures, the
  futures table, anything kept for resending), per task, the list of futures itself excluded.

Run from the repository root::

    .venv/bin/python benchmarks/task_bytes.py [--n 100000]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import tidepool
from tidepool.comm.serialize import serialize
from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState

CLUSTER = """
import sys, tidepool
with tidepool.LocalCluster(n_workers=0, dashboard=False) as c:
    print(c.address, c.token, flush=True)
    sys.stdin.read()
"""


def inc(x: int) -> int:
    return x + 1


def scheduler_bytes(n: int) -> float:
    state = SchedulerState(no_worker_timeout=None)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    specs = [ev.TaskSpec(f"inc-{i:020x}-{i}", "f0123456789abcdef012", serialize(((i,), {})), (), {}, 0, "inc")
             for i in range(n)]  # fmt: skip
    state.handle(ev.UpdateGraph("client-1", specs, [s.key for s in specs], 0.0))
    del specs
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(state.tasks) == n
    return held / n


def client_bytes(n: int) -> float:
    child = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    try:
        address, token = child.stdout.readline().split()
        with tidepool.Client(address, token=token) as client:
            client.map(inc, range(10))  # the function is pickled and shipped once, outside the count
            time.sleep(0.5)
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            futs: list[Any] = client.map(inc, range(n))
            time.sleep(1.0)  # the message has left
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base - sys.getsizeof(futs)
            tracemalloc.stop()
            del futs
    finally:
        child.stdin.close()
        child.wait(60)
    return held / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    a = p.parse_args()
    print(f"scheduler: {scheduler_bytes(a.n):,.0f} bytes per pending task ({a.n:,} tasks)", flush=True)
    print(f"client:    {client_bytes(a.n):,.0f} bytes per pending future ({a.n:,} tasks)", flush=True)


if __name__ == "__main__":
    main()
