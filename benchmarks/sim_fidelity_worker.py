"""Fidelity of the simulated worker (issue 26): workloads where what happens *inside* a worker
decides the makespan, run for real and simulated.

- ``oversubscribed``: one worker with 4 slots on what is, for these tasks, one core: 8 pure-Python
  loops (they hold the GIL, so a worker process runs one at a time however many slots it has).
  Real: ``LocalCluster(n_workers=1, slots=4)``.  Simulated: a 4-cpu worker with ``cores = 1``;
  each task's duration is the loop's time alone on a worker, measured first in the real run.
- ``memory``: ``benchmarks/memory.py``'s graph, small: ``--results`` tasks each return ``--mb``
  MiB, then one task per result reads it back; 2 workers, 1 slot each, a ``memory_limit`` under
  which most results spill.  Simulated: workers with that memory and the real workers' own
  resident memory (``unmanaged``, from their first heartbeat), results of that size, each task's
  duration as its worker measured it in the real run, the worker's own time per task (``overhead``:
  the mean gap between a task's end and the next runnable task's start on a worker in that run,
  as ``sim/replay.py`` measures gaps; the loop's spill writes and reads are inside it, so the
  simulated disk is left free, not counted twice).

Both sides start measuring at the first submit, with every worker ready (the simulated stage is
submitted at t = 3 s, after the workers joined).  Held worker-seconds: workers x makespan.
Medians of ``--repeat`` real runs and simulated seeds.

Run from the repository root::

    .venv/bin/python benchmarks/sim_fidelity_worker.py [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

MB = 2**20
DOCS = Path(__file__).resolve().parent.parent / "docs" / "simulation.md"
SUBMIT_AT = 3.0


def spin(n: int) -> int:
    s = 0
    for i in range(n):
        s += i
    return s


def make(i: int, mb: int) -> Any:
    return np.full(mb * MB, i % 251, dtype=np.uint8)


def check(a: Any, i: int, mb: int) -> bool:
    return bool(a.size == mb * MB and (a == i % 251).all())


def timed_spin(n: int) -> float:
    t0 = time.perf_counter()
    spin(n)
    return time.perf_counter() - t0


def timed_make(i: int, mb: int) -> float:
    t0 = time.perf_counter()
    make(i, mb)
    return time.perf_counter() - t0


def real_oversubscribed(n: int, loops: int) -> dict[str, Any]:
    import tidepool

    with tidepool.LocalCluster(n_workers=1, slots=4, dashboard=False) as cluster, tidepool.Client(cluster) as c:
        del cluster
        c.submit(spin, 10, key="warm").result(timeout=120)
        solo = statistics.median(c.submit(timed_spin, loops, key=f"alone-{i}").result(timeout=120) for i in range(3))
        t0 = time.perf_counter()
        futs = [c.submit(spin, loops, key=f"spin-{i}") for i in range(n)]
        c.gather(futs, timeout=600)
        makespan = time.perf_counter() - t0
    return {"makespan": makespan, "held": makespan, "solo": solo}


def sim_oversubscribed(n: int, solo: float, seeds: int) -> dict[str, float]:
    from tidepool.sim.workload import SimTask, Stage, Workload

    tasks = [SimTask(f"spin-{i}", solo) for i in range(n)]
    wl = Workload("oversubscribed", [Stage(tasks, [t.key for t in tasks], at=SUBMIT_AT)])
    return _simulate(wl, {"cpu": 4}, 1, seeds, cores=1.0)


def real_memory(n: int, mb: int, limit: str) -> dict[str, Any]:
    import tidepool
    from tidepool.sim.replay import dispatch_gaps
    from tidepool.telemetry.journal import Journal

    with tidepool.LocalCluster(n_workers=2, slots=1, memory_limit=limit, dashboard=False) as cluster, \
            tidepool.Client(cluster) as c:  # fmt: skip
        c.gather([c.submit(timed_make, i, mb, key=f"wmake-{i}") for i in range(2)])  # imports numpy
        journal = Journal(keep=None)  # every task record
        cluster.scheduler.subscribe(journal.observe)
        state = cluster.scheduler.state
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(w.metrics.get("rss") for w in state.workers.values()):
            time.sleep(0.1)  # a heartbeat from each: their memory before the graph
        unmanaged = statistics.median(int(w.metrics.get("rss", 0)) for w in state.workers.values())
        t0 = time.perf_counter()
        made = [c.submit(make, i, mb, key=f"make-{i}") for i in range(n)]
        oks = c.gather([c.submit(check, f, i, mb, key=f"check-{i}") for i, f in enumerate(made)], timeout=600)
        makespan = time.perf_counter() - t0
        assert all(oks)
        # the tasks' own durations in this run, as the workers measured them (two worker processes,
        # the scheduler and the client share this machine's cores: they are longer than alone)
        durations = {r["key"]: float(r["duration"]) for r in journal.records if r["kind"] == "task"}
        # and the gaps between a task's end and the next runnable one's start on a worker (the
        # worker's own time per task: reports, stores, spills, hand-offs; sim/replay.py measures them)
        gaps = dispatch_gaps(journal.records)
        overhead = statistics.mean(gaps) if gaps else 0.0
        info = c.scheduler_info().get("workers") or []
        rows = info.values() if isinstance(info, dict) else info
        spilled = sum(int(w.get("spilled_total", 0)) for w in rows)
    return {"makespan": makespan, "held": 2 * makespan, "spilled": spilled, "durations": durations,
            "overhead": overhead, "unmanaged": unmanaged}


def sim_memory(n: int, mb: int, limit: int, run: dict[str, Any], seeds: int) -> dict[str, float]:
    """The simulated run of one real ``run`` (its durations, workers' own memory and time per task)."""
    d = run["durations"]
    from tidepool.sim.workload import SimTask, Stage, Workload

    tasks = [SimTask(f"make-{i}", d[f"make-{i}"], nbytes=mb * MB) for i in range(n)]
    tasks += [SimTask(f"check-{i}", d[f"check-{i}"], deps=[f"make-{i}"]) for i in range(n)]
    wl = Workload("memory", [Stage(tasks, [f"check-{i}" for i in range(n)], at=SUBMIT_AT)])
    return _simulate(wl, {"cpu": 1, "memory": float(limit)}, 2, seeds, overhead=run["overhead"],
                     unmanaged=run["unmanaged"])  # fmt: skip


def _simulate(wl: Any, resources: dict[str, float], workers: int, seeds: int, **kw: Any) -> dict[str, float]:
    from tidepool.scaling.node_types import NodeType
    from tidepool.sim import simulate
    from tidepool.sim.cluster import SimCluster
    from tidepool.sim.provider import PRESETS

    makespans, helds = [], []
    for seed in range(seeds):
        nt = NodeType("default", resources, min_nodes=workers, max_nodes=workers, startup_estimate=0.5)
        cores = kw.pop("cores", None)
        cluster = SimCluster([nt], {"default": PRESETS["local"]}, interval=0.05,
                             cores={"default": cores} if cores else {}, **kw)  # fmt: skip
        if cores:
            kw["cores"] = cores
        r = simulate(wl, cluster, seed=seed, tail=0.0)
        assert r.makespan is not None, r.notes
        makespans.append(r.makespan)
        helds.append(r.held_worker_seconds)
    return {"makespan": statistics.median(makespans), "held": statistics.median(helds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workloads", default="oversubscribed,memory")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--loops", type=int, default=3_000_000, help="iterations of one spin task")
    ap.add_argument("--results", type=int, default=40)
    ap.add_argument("--mb", type=int, default=20)
    ap.add_argument("--limit", default="500MB")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true", help="write the worker rows of docs/simulation.md")
    args = ap.parse_args(argv)
    from tidepool.resources import parse_bytes

    out: dict[str, Any] = {}
    for wl in args.workloads.split(","):
        runs, sims = [], []
        for _ in range(args.repeat):
            if wl == "oversubscribed":
                r = real_oversubscribed(args.tasks, args.loops)
                s = sim_oversubscribed(args.tasks, r["solo"], 1)
            else:
                r = real_memory(args.results, args.mb, args.limit)
                s = sim_memory(args.results, args.mb, parse_bytes(args.limit), r, 1)
            shown = {k: v for k, v in r.items() if k != "durations"}
            print(f"  real {wl}: {shown}\n  sim  {wl}: {s}", flush=True)
            runs.append(r)
            sims.append(s)
        real = {k: statistics.median(r[k] for r in runs) for k in ("makespan", "held")}
        sim = {k: statistics.median(s[k] for s in sims) for k in ("makespan", "held")}
        print(f"{wl}: real {real}  sim {sim}", flush=True)
        out[wl] = {"real": real, "sim": sim, "runs": runs, "sims": sims}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    rows = [["workload", "real makespan s", "sim makespan s", "diff", "real held w-s", "sim held w-s", "diff",
             "per run: sim vs real makespan"]]  # fmt: skip
    for wl, x in out.items():
        r, s_ = x["real"], x["sim"]
        per = ", ".join(pct(b["makespan"], a["makespan"]) for a, b in zip(x["runs"], x["sims"], strict=True))
        rows.append([wl, f"{r['makespan']:.2f}", f"{s_['makespan']:.2f}", pct(s_["makespan"], r["makespan"]),
                     f"{r['held']:.2f}", f"{s_['held']:.2f}", pct(s_["held"], r["held"]), per])  # fmt: skip
    from throughput import machine_info, render_markdown, render_text, write_section

    print(render_text(rows))
    if args.write_docs:
        import datetime
        import shlex

        info = machine_info()
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = shlex.join([".venv/bin/python", "benchmarks/sim_fidelity_worker.py", *(argv or sys.argv[1:])])
        section = f"""{render_markdown(rows)}

Workloads decided inside the worker (`benchmarks/sim_fidelity_worker.py`, issue 26): `oversubscribed`
({args.tasks} pure-Python loops on one worker with 4 slots: they hold the GIL, so the simulated
worker has `cores = 1`; each loop's time alone is measured first) and `memory` (`benchmarks/memory.py`'s
graph, small: {args.results} results of {args.mb} MiB read back, 2 workers of 1 slot with
`memory_limit={args.limit}`; simulated with each real run's task durations, the
workers' own memory and the worker's own time per task, all measured in that run).  Medians of {args.repeat} real runs, each
simulated with its own measurements.  Measured {when} with `{command}` on {info["nproc"]} CPUs
({info["cpu"]}), load average at start {info["load"]} (a shared machine)."""
        write_section(DOCS, "fidelity-worker", section, header="# Simulation\n")
        print(f"wrote the worker rows of {DOCS}")
    return 0


def pct(a: float, b: float) -> str:
    return f"{(a - b) / b * 100:+.1f}%" if b else "-"


if __name__ == "__main__":
    sys.exit(main())
