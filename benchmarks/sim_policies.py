"""Policy study in the simulator: which scaling rule wins where, at 1,000 and 10,000 workers.

For each pool size and start-up model (``cloud``: VMs that boot in 60-120 s; ``slurm``: a batch
queue with lognormal waits around two minutes, 2% of jobs failing and a one-hour walltime) this
runs the same bursty graph under five policies and reports makespan, held worker-seconds and
cost (billed node-hours), as ratios to tidepool's default:

- ``default``: tidepool's ``Adaptive`` (forecast-driven launches, idle retirement);
- ``backlog``: ``Backlog`` (Spark-like ramp 1, 2, 4, ... while tasks wait) with idle retirement;
- ``completion``: ``CompletionTarget`` launches and idle retirement, without the no-progress
  safety net (a cluster file's ``kind = "completion"``);
- ``dask``: Dask's ``Adaptive`` rule (queued + processing work over a 5 s target, 1 s timer, a
  worker retired after 3 consecutive proposals);
- ``hyperqueue``: HyperQueue's allocator (keep ``backlog`` allocations queued while tasks wait,
  idle timeout 5 min); with ``backlog=4`` allocations of ``size/40`` nodes, as a user running a
  pool of this size would configure it (its defaults, one single-node allocation, take hours to
  fill a pool of thousands).

The graph (``tidepool.sim.workloads.bursty``): ``per_worker x size`` tasks (10 by default) of ``work`` s, one serial
reduce of ``reduce`` s over all of them, ``10 x size`` tasks that need the reduce's result, and a
final reduce; the client holds every result.  ``--section NAME`` writes the table to the docs
section ``NAME`` (``policies`` by default; the 10,000-worker table goes to ``policies-10k``).  Every policy is stepped on the same 1 s autoscaler
period (Dask's own), so no policy gains from deciding more often.

Run from the repository root::

    .venv/bin/python benchmarks/sim_policies.py [--sizes 1000,10000] [--write-docs]

``--write-docs`` rewrites ``docs/simulation.md`` between ``<!-- policies:start -->`` and
``<!-- policies:end -->``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "simulation.md"
POLICIES = ("default", "backlog", "completion", "dask", "hyperqueue")
STARTUPS = ("cloud", "slurm")


def policy_spec(name: str, size: int) -> str:
    if name == "hyperqueue":
        return f"hyperqueue(backlog=4, workers_per_alloc={max(1, size // 40)})"
    return name


def run_one(size: int, startup: str, policy: str, work: float, reduce: float, seed: int, per: int = 10) -> Any:
    from tidepool.sim import load_workload, make_policy, preset_cluster, simulate

    cluster = preset_cluster(f"{startup}:{size}")
    cluster.interval = 1.0
    wl = load_workload("bursty", seed=seed, params={"n": per * size, "work": work, "reduce": reduce})
    return simulate(wl, cluster, make_policy(policy_spec(policy, size)), seed=seed, policy_name=policy,
                    task_records=False, tail=600.0)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from throughput import render_markdown, render_text, write_section

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--startups", default=",".join(STARTUPS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--work", type=float, default=30.0, help="seconds per task of the two wide phases")
    ap.add_argument("--reduce", type=float, default=240.0, help="seconds of the serial reduce between them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-worker", type=int, default=10, help="tasks per worker in each wide phase")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--section", default="policies", help="docs/simulation.md section to write")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    t0 = time.perf_counter()
    rows = [["workers", "start-up", "policy", "makespan s", "held w-s", "cost (node-h)", "makespan / default",
             "held / default", "launches (nodes)", "peak workers", "wall s"]]  # fmt: skip
    wins: list[str] = []
    for size in sizes:
        for startup in [s for s in args.startups.split(",") if s]:
            results: dict[str, Any] = {}
            for policy in [p for p in args.policies.split(",") if p]:
                t = time.perf_counter()
                r = run_one(size, startup, policy, args.work, args.reduce, args.seed, args.per_worker)
                results[policy] = (r, time.perf_counter() - t)
                print(f"{size:>6} {startup:6} {policy:11} makespan {r.makespan or float('nan'):9.1f}s held "
                      f"{r.held_worker_seconds:12,.0f} w-s peak {r.peak_workers:6} ({results[policy][1]:.0f}s wall)",
                      flush=True)  # fmt: skip
            base = results.get("default", next(iter(results.values())))[0]
            for policy, (r, wall) in results.items():
                ms = r.makespan if r.makespan is not None else float("nan")
                rows.append([f"{size:,}", startup, policy, "did not finish" if r.makespan is None else f"{ms:,.0f}",
                             f"{r.held_worker_seconds:,.0f}", f"{r.total_cost:,.1f}",
                             f"{ms / base.makespan:.2f}x" if base.makespan else "-",
                             f"{r.held_worker_seconds / base.held_worker_seconds:.2f}x",
                             f"{r.launches} ({r.launched_nodes:,})", f"{r.peak_workers:,}", f"{wall:.0f}"])  # fmt: skip
            done = {p: rw[0] for p, rw in results.items() if rw[0].makespan is not None}
            if done:
                fastest = min(done, key=lambda p: done[p].makespan)
                cheapest = min(done, key=lambda p: done[p].held_worker_seconds)
                wins.append(f"{size:,} workers, {startup}: fastest **{fastest}**, fewest held worker-seconds "
                            f"**{cheapest}**")  # fmt: skip
    print(render_text(rows))
    print("\n".join(wins))
    total = time.perf_counter() - t0
    print(f"{total:.0f}s in all")
    if args.write_docs:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = f"""{render_markdown(rows)}

{chr(10).join(f"- {w}" for w in wins)}

Measured {when} with `.venv/bin/python benchmarks/sim_policies.py --sizes {args.sizes} --per-worker {args.per_worker} --section {args.section} --write-docs`
(graph: bursty with `{args.per_worker} x workers` tasks of {args.work:g} s per wide phase and a {args.reduce:g} s
reduce between them; seed {args.seed}; {total:.0f} s of wall time for all runs; `wall s` is each run's)."""
        write_section(DOCS, args.section, section, header="# Simulation\n")
        print(f"wrote the policies section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
