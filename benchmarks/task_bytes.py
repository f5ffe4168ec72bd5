"""Bytes per task held by the scheduler state and by the client, measured with tracemalloc.

- scheduler, map: ``--n`` task specs as the server builds them from an ``update-graph`` (a pickled
  argument each, a group name, the key) handed to :class:`SchedulerState` with no workers; the
  traced memory still held once the specs list is dropped, per task.
- scheduler, tree: the pairwise tree of ``benchmarks/million.py`` with about ``--n`` tasks, as its
  client sends it: ``n / 2 + 1`` leaves (``client.map(inc, ...)``), then level after level of
  ``client.map(add, left, right, key="add-<depth>")`` (each sum's payload holds two ``Ref``s, its
  specs two dependencies; an odd one out is carried to the next level), one ``update-graph`` per
  level, and the client releasing a level's keys once the next level is submitted (its futures
  are dropped then).  Held memory per task as for the map.
- client: ``client.map(inc, range(N))`` against a scheduler (in a child process, no workers, so the
  tasks stay pending); the traced memory this process still holds afterwards (futures, the
  futures table, anything kept for resending), per task, the list of futures itself excluded; and
  the traced peak during the call (specs, messages and futures at once), per task.

Run from the repository root::

    .venv/bin/python benchmarks/task_bytes.py [--n 100000] [--cases map,tree,client] [--where 12]

``--where K``: also print, per scheduler case, the K source lines holding the most of that memory
(tracemalloc statistics by line) and the sizes of one pending task's record and its collections.
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
from tidepool.graph.refs import Ref
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


FUNC_INC, FUNC_ADD = "f0123456789abcdef012", "f2109876543210fedcba"


def map_events(n: int) -> list[ev.Event]:
    specs = [ev.TaskSpec(f"inc-{i:020x}-{i}", FUNC_INC, serialize(((i,), {})), (), {}, 0, "inc")
             for i in range(n)]  # fmt: skip
    return [ev.UpdateGraph("client-1", specs, [s.key for s in specs], 0.0)]


def tree_events(n: int) -> list[ev.Event]:
    """The tree of ``million.py``: an ``UpdateGraph`` per level, the level before released after it."""
    leaves = n // 2 + 1
    prefix = "inc-0123456789abcdef0123"
    specs = [ev.TaskSpec(f"{prefix}-{i}", FUNC_INC, serialize(((i,), {})), (), {}, 0, "inc") for i in range(leaves)]
    level = [s.key for s in specs]
    out: list[ev.Event] = [ev.UpdateGraph("client-1", specs, list(level), 0.0)]
    depth = 0
    while len(level) > 1:
        depth += 1
        left, right = level[0::2], level[1::2]
        carry = [left.pop()] if len(left) > len(right) else []
        specs = [ev.TaskSpec(f"add-{depth}-{i}", FUNC_ADD, serialize(((Ref(a), Ref(b)), {})), (a, b), {}, 0, "add")
                 for i, (a, b) in enumerate(zip(left, right, strict=True))]  # fmt: skip
        out.append(ev.UpdateGraph("client-1", specs, [s.key for s in specs], 0.0))
        out.append(ev.ReleaseKeys("client-1", left + right, 0.0))
        level = [s.key for s in specs] + carry
    return out


def scheduler_bytes(case: str, n: int, where: int = 0) -> tuple[float, int]:
    """Bytes held per task by the state after the ``case`` graph's events, and the task count."""
    state = SchedulerState(no_worker_timeout=None)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    events = map_events(n) if case == "map" else tree_events(n)
    for e in events:
        state.handle(e)
    del events, e
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    snapshot = tracemalloc.take_snapshot() if where else None
    tracemalloc.stop()
    tasks = len(state.tasks)
    if snapshot is not None:
        show_where(snapshot, state, tasks, where)
    return held / tasks, tasks


def show_where(snapshot: tracemalloc.Snapshot, state: SchedulerState, tasks: int, k: int) -> None:
    """The lines holding the most memory per task, and one record's own sizes."""
    here = tracemalloc.Filter(False, tracemalloc.__file__)
    for stat in snapshot.filter_traces([here]).statistics("lineno")[:k]:
        frame = stat.traceback[0]
        print(f"    {stat.size / tasks:7.1f} B/task  {frame.filename.split('src/')[-1]}:{frame.lineno}")
    for ts in state.tasks.values():
        if ts.deps:  # a task with inputs if there is one (the tree's sums), else any
            break
    sizes = {"record": sys.getsizeof(ts), "key": sys.getsizeof(ts.key), "payload": sys.getsizeof(ts.payload),
             "priority": sys.getsizeof(ts.priority)}  # fmt: skip
    for name in ("deps", "dependents", "waiters", "waiting_on", "who_has", "wanted_by"):
        v = getattr(ts, name)
        if v:
            sizes[f"{name}[{len(v)}]"] = sys.getsizeof(v)
    print(f"    one {ts.state} task: " + ", ".join(f"{name} {size}" for name, size in sizes.items()))


def client_bytes(n: int) -> tuple[float, float]:
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
            current, peak = tracemalloc.get_traced_memory()
            held = current - base - sys.getsizeof(futs)
            tracemalloc.stop()
            del futs
    finally:
        child.stdin.close()
        child.wait(60)
    return held / n, (peak - base) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--cases", default="map,tree,client")
    p.add_argument("--where", type=int, default=0, help="top lines by memory held (scheduler cases)")
    a = p.parse_args()
    for case in a.cases.split(","):
        if case == "client":
            held, peak = client_bytes(a.n)
            print(f"client:         {held:,.0f} bytes per pending future, {peak:,.0f} at the peak of the map "
                  f"call ({a.n:,} tasks)", flush=True)  # fmt: skip
        else:
            per_task, tasks = scheduler_bytes(case, a.n, a.where)
            print(f"scheduler {case + ':':<5} {per_task:,.0f} bytes per pending task ({tasks:,} tasks)", flush=True)


if __name__ == "__main__":
    main()
