"""``tidepool demo``: an elastic run on this machine, printed as it happens.

A local cluster starts with one worker; a wide map phase and a tree reduction are submitted; while
they run a second worker joins (and gets work at once), then a worker is retired gracefully (its
results move to the survivor first).  The result is checked against the serial answer.
"""

from __future__ import annotations

import time

from rich.console import Console

from tidepool.client import Client
from tidepool.cluster import LocalCluster
from tidepool.graph.delayed import task


@task
def square(x: int) -> int:
    time.sleep(0.01)
    return x * x


@task
def add(a: int, b: int) -> int:
    return a + b


def tree_sum(values: list) -> object:  # type: ignore[type-arg]
    while len(values) > 1:
        values = [add(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]  # fmt: skip
    return values[0]


def run_demo(workers: int = 2, tasks: int = 200) -> int:
    con = Console()
    t0 = time.monotonic()

    def say(msg: str) -> None:
        con.print(f"[dim]{time.monotonic() - t0:6.2f}s[/dim] {msg}")

    with LocalCluster(n_workers=1) as cluster, Client(cluster) as client:
        say(f"cluster up at {cluster.address} with workers {cluster.workers}")
        total = client.compute(tree_sum([square(i) for i in range(tasks)]))
        say(f"submitted {tasks} squares and a tree reduction ({2 * tasks - 1} tasks)")
        new = cluster.add_workers(max(1, workers - 1))
        say(f"workers joined mid-run: {new}")
        value = total.result()
        expected = sum(i * i for i in range(tasks))
        say(f"result {value} (serial answer {expected}): {'OK' if value == expected else 'MISMATCH'}")
        info = client.scheduler_info()
        for w in info["workers"]:
            say(f"  worker {w['id']}: ran {w['executed']} tasks, holds {w['held_keys']} values")
        old = cluster.workers[0]
        outcome = client.retire_workers([old])
        say(f"retired {old}: {outcome[old]}; result still readable: {total.result() == expected}")
        say(f"workers now: {cluster.workers}; counters: {info['counters']}")
        return 0 if value == expected else 1
