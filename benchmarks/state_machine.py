"""Micro-benchmark of the pure scheduler state machine (``scheduler/state.py``), no I/O.

Feeds :meth:`SchedulerState.handle_many` (the entry point the server and the simulator use) an
``UpdateGraph`` and then the ``TaskFinished`` events of fake workers for three graphs of no-op
tasks: a ``map`` of N independent tasks, a pairwise ``tree`` reduction (N leaves, N - 1 sums) and
a wide ``fan-in`` (N tasks, one task needing all of them).  The fake workers (``--workers``, 4
slots each) answer every ``Execute`` with a ``TaskFinished`` in batches of up to ``--batch`` per
worker per call (as a worker's outbox batches), and every ``Steal`` with "kept".  Reported per
graph: tasks, events handed in, wall seconds in ``handle_many`` (the graph built before the
clock starts), CPU seconds of this process over the same span (steadier than wall time on a
shared machine), events per second and microseconds per task (submit to forgotten), both by CPU.

Run from the repository root::

    .venv/bin/python benchmarks/state_machine.py [--n 100000] [--workers 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from dataclasses import dataclass

from tidepool.scheduler import events as ev
from tidepool.scheduler.state import SchedulerState

CLIENT = "bench-client"


def graph(shape: str, n: int) -> tuple[list[ev.TaskSpec], list[str]]:
    """The specs of one graph (inputs first) and the keys the client wants."""
    if shape == "map":
        specs = [ev.TaskSpec(f"inc-{i}", "f-inc", None, group="inc") for i in range(n)]
        return specs, [s.key for s in specs]
    if shape == "fan-in":
        specs = [ev.TaskSpec(f"part-{i}", "f-part", None, group="part") for i in range(n)]
        specs.append(ev.TaskSpec("total", "f-sum", None, tuple(s.key for s in specs), group="total"))
        return specs, ["total"]
    if shape == "tree":
        specs = [ev.TaskSpec(f"leaf-{i}", "f-leaf", None, group="leaf") for i in range(n)]
        layer = [s.key for s in specs]
        depth = 0
        while len(layer) > 1:
            depth += 1
            nxt = []
            for j in range(0, len(layer), 2):
                pair = tuple(layer[j : j + 2])
                key = f"add-{depth}-{j // 2}"
                specs.append(ev.TaskSpec(key, "f-add", None, pair, group="add"))
                nxt.append(key)
            layer = nxt
        return specs, layer
    raise ValueError(f"unknown graph {shape!r}")


@dataclass
class Result:
    shape: str
    tasks: int
    events: int
    seconds: float
    cpu: float

    @property
    def events_per_second(self) -> float:
        return self.events / self.cpu

    @property
    def us_per_task(self) -> float:
        return self.cpu / self.tasks * 1e6


def run(shape: str, n: int, workers: int, batch: int) -> Result:
    specs, wanted = graph(shape, n)
    state = SchedulerState(no_worker_timeout=None)
    queues: dict[str, deque[str]] = {}
    now = 0.0
    joins: list[ev.Event] = []
    for i in range(workers):
        wid = f"w{i}"
        queues[wid] = deque()
        joins.append(ev.WorkerJoin(wid, f"sim://{wid}", {"cpu": 4.0}, now, name=wid))
    state.handle_many(joins)
    gc.collect()
    events = 0
    done = 0
    t0, c0 = time.perf_counter(), time.process_time()
    pending: list[ev.Event] = [ev.UpdateGraph(CLIENT, specs, wanted, now)]
    while pending:
        cmds = state.handle_many(pending)
        events += len(pending)
        for c in cmds:
            t = type(c)
            if t is ev.Execute:
                queues[c.worker].append(c.key)  # type: ignore[union-attr]
            elif t is ev.Report:
                done += 1
            elif t is ev.Steal:
                w, keys = c.worker, c.keys  # type: ignore[union-attr]
                state_reply = ev.StealReply(w, [], list(keys), now)
                events += 1
                _route(state, state_reply, queues)
        now += 0.001
        pending = []
        for wid, q in queues.items():
            for _ in range(min(batch, len(q))):
                pending.append(ev.TaskFinished(wid, q.popleft(), 8, 0.0001, now))
    state.handle(ev.ReleaseKeys(CLIENT, wanted, now))  # the client takes its results and lets go
    events += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if done != len(wanted) or state.tasks:
        raise SystemExit(f"{shape}: {done} of {len(wanted)} reported, {len(state.tasks)} tasks left")
    return Result(shape, len(specs), events, seconds, cpu)


def _route(state: SchedulerState, reply: ev.Event, queues: dict[str, deque[str]]) -> None:
    for c in state.handle(reply):
        if type(c) is ev.Execute:
            queues[c.worker].append(c.key)  # type: ignore[union-attr]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="tasks per graph (leaves for the tree)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=100, help="TaskFinished per worker per handle_many call")
    p.add_argument("--repeat", type=int, default=3, help="runs per graph (the median is reported)")
    p.add_argument("--graphs", default="map,tree,fan-in")
    a = p.parse_args()
    print(f"{'graph':<8} {'tasks':>9} {'events':>9} {'wall s':>8} {'cpu s':>8} {'events/cpu-s':>12} {'cpu us/task':>11}")
    for shape in a.graphs.split(","):
        runs = [run(shape, a.n, a.workers, a.batch) for _ in range(a.repeat)]
        r = sorted(runs, key=lambda x: x.cpu)[len(runs) // 2]
        spread = statistics.pstdev(x.cpu for x in runs) if len(runs) > 1 else 0.0
        print(f"{r.shape:<8} {r.tasks:>9,} {r.events:>9,} {r.seconds:>8.2f} {r.cpu:>8.2f} {r.events_per_second:>12,.0f} "
              f"{r.us_per_task:>11.1f}  (median of {len(runs)} by cpu, sd {spread:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
