"""Scaling policies on real workflows, in the simulator: seven WfCommons traces, two cluster presets.

For every trace of ``<repo>/../shared/workloads/wfinstances/`` (Pegasus montage and 1000genome,
Makeflow blast and bwa; WfFormat 1.5, read by ``tidepool.sim.wfformat``) and every cluster
(``cloud:50:4``, ``slurm:50:4`` and ``cloud:200:4`` by default: 50 and 200 nodes of 4 CPUs) this runs the policies ``default`` (tidepool's), ``dask`` (Dask's ``Adaptive``
rule), ``backlog`` (Spark-like ramp) and ``hyperqueue`` (HyperQueue's allocator: a backlog of 4
allocations of ``nodes/40`` nodes), all stepped on the same 1 s autoscaler period, and prints per
policy the makespan and the cost (billed node-hours) with their ratios to lower bounds:

- makespan: the first boot (when the first of ``max_nodes`` nodes launched at once is expected up,
  from the preset's start-up distribution) plus the longer of the critical path and the total work
  over the pool's CPUs;
- cost: the busy node-hours (total work over a node's CPUs) plus one mean start-up per node
  launched by the policy that launched the fewest (a node is billed while it boots).

The check of issue 24 is printed per row: the default's makespan at or below the best of the other
rules, and its cost at or below that of every rule within 5% of the best makespan.

Run from the repository root::

    .venv/bin/python benchmarks/sim_workflows.py [--traces montage,blast] [--write-docs]

``--write-docs`` rewrites ``docs/simulation.md`` between ``<!-- workflows:start -->`` and
``<!-- workflows:end -->``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "simulation.md"


def _traces_dir() -> Path:
    """``<repo>/../shared/workloads/wfinstances`` (a worktree one level deeper also finds it)."""
    env = os.environ.get("TIDEPOOL_WFINSTANCES")
    if env:
        return Path(env)
    for up in (ROOT.parent, ROOT.parent.parent):
        cand = up / "shared" / "workloads" / "wfinstances"
        if cand.is_dir():
            return cand
    return ROOT.parent / "shared" / "workloads" / "wfinstances"


TRACES = _traces_dir()
POLICIES = ("default", "dask", "backlog", "hyperqueue")
CLUSTERS = ("cloud:50:4", "slurm:50:4", "cloud:200:4")
#: a rule "within 5% of the best makespan" must not be cheaper than the default
NEAR = 1.05


def traces(pattern: str = "") -> list[Path]:
    names = [p for p in sorted(TRACES.glob("*.json"))]
    wanted = [w for w in pattern.split(",") if w]
    return [p for p in names if not wanted or any(w in p.name for w in wanted)]


def policy_spec(name: str, nodes: int) -> str:
    if name == "hyperqueue":
        return f"hyperqueue(backlog=4, workers_per_alloc={max(1, nodes // 40)})"
    return name


def first_boot(model: Any, nodes: int, draws: int = 20_000) -> float:
    """When the first of ``nodes`` nodes launched at once is expected up: the ``1 / (nodes + 1)``
    quantile of the start-up model (queue wait + boot), sampled with a fixed seed."""
    import random

    rng = random.Random(0)
    xs = sorted(model.queue.sample(rng) + model.boot.sample(rng) for _ in range(draws))
    return xs[int(draws / (nodes + 1))]


def bounds(workload: Any, cluster: Any) -> tuple[float, float, float]:
    """(makespan bound s, busy node-seconds, start-up s) of ``workload`` on ``cluster``'s one type."""
    from tidepool.scaling.forecast import RemainingWork, critical_path

    nt = cluster.node_types[0]
    tasks = list(workload.tasks())
    index = {t.key: i for i, t in enumerate(tasks)}
    work = RemainingWork(tuple(t.duration for t in tasks), tuple(tuple(index[d] for d in t.deps) for t in tasks), ())
    cpus = nt.resources.get("cpu", 1.0)
    boot = first_boot(cluster.models[nt.name], nt.max_nodes)
    total = work.total
    makespan = boot + max(critical_path(work), total / (cpus * nt.max_nodes))
    return makespan, total / cpus, cluster.models[nt.name].boot.mean  # billed from allocation


def run_one(trace: Path, spec: str, policy: str, seed: int) -> tuple[Any, Any, Any]:
    from tidepool.sim import load_workload, make_policy, preset_cluster, simulate
    from tidepool.sim.wfformat import fit_memory

    cluster = preset_cluster(spec)
    cluster.interval = 1.0
    wl = load_workload(str(trace), seed=seed)
    fit_memory(wl, [nt.resources.get("memory", 0.0) for nt in cluster.node_types])
    nodes = cluster.node_types[0].max_nodes
    r = simulate(wl, cluster, make_policy(policy_spec(policy, nodes)), seed=seed, policy_name=policy,
                 task_records=False, tail=900.0)  # fmt: skip
    return r, wl, cluster


def objectives(trace: Path, spec: str, seed: int) -> list[list[str]]:
    """The deadline and budget objectives on one trace: a deadline of 1.25x the balanced default's
    makespan (feasible: the default finished by then), one of half the makespan bound (infeasible:
    it must say so at once), and a budget of 0.8x the balanced default's cost.  Whether each was
    met, and when an infeasible one was said."""
    import json
    import tempfile

    from tidepool.sim import load_workload, make_policy, preset_cluster, simulate
    from tidepool.sim.wfformat import fit_memory

    cluster = preset_cluster(spec)
    cluster.interval = 1.0
    wl = load_workload(str(trace), seed=seed)
    fit_memory(wl, [0.0])
    ms_bound, _, _ = bounds(wl, cluster)
    base = simulate(wl, cluster, make_policy("default"), seed=seed, task_records=False, tail=900.0)
    assert base.makespan is not None
    short = trace.name.replace("-chameleon", "").replace("-001.json", "")
    out = [[short, spec, "balanced", f"{base.makespan:,.0f}", f"{base.total_cost:.2f}", "", "-"]]
    goals = [("deadline", round(1.25 * base.makespan)), ("deadline", round(0.5 * ms_bound)),
             ("budget", round(0.8 * base.total_cost, 3))]  # fmt: skip
    for kind, value in goals:
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/j.jsonl"
            r = simulate(wl, cluster, make_policy(f"default({kind}={value})"), seed=seed, policy_name=kind,
                         task_records=False, tail=900.0, journal=path)  # fmt: skip
            said = None
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    if "infeasible" in str(rec.get("reason", "")) or "cannot" in str(rec.get("reason", "")):
                        said = rec["t"]
                        break
        ms = r.makespan if r.makespan is not None else float("inf")
        met = ms <= value if kind == "deadline" else r.total_cost <= value
        out.append([short, spec, f"{kind}={value:g}", f"{ms:,.0f}", f"{r.total_cost:.2f}",
                    "met" if met else "missed", "-" if said is None else f"at t={said:.0f}s"])  # fmt: skip
        print(" ".join(out[-1]), flush=True)
    return out


def verdict(results: dict[str, Any]) -> tuple[bool, bool]:
    """(default's makespan <= the best other rule's, default's cost <= every near-best rule's)."""
    done = {p: r for p, r in results.items() if r.makespan is not None}
    if "default" not in done:
        return False, False
    others = [r.makespan for p, r in done.items() if p != "default"]
    fast = not others or done["default"].makespan <= min(others) * 1.0005
    best = min(r.makespan for r in done.values())
    near = [r for p, r in done.items() if p != "default" and r.makespan <= best * NEAR]
    cheap = all(done["default"].total_cost <= r.total_cost * 1.0005 for r in near)
    return fast, cheap


def main(argv: list[str] | None = None) -> int:
    from throughput import render_markdown, render_text, write_section

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--traces", default="", help="comma-separated parts of trace file names (default: all)")
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--objectives", action="store_true",
                    help="also run the deadline and budget objectives on every trace (first cluster)")
    args = ap.parse_args(argv)
    if not TRACES.is_dir():
        print(f"no traces at {TRACES}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = [["trace", "cluster", "policy", "makespan s", "cost node-h", "makespan / bound", "cost / bound",
             "makespan / best other", "peak nodes", "check"]]  # fmt: skip
    summary: list[str] = []
    failures = 0
    for trace in traces(args.traces):
        short = trace.name.replace("-chameleon", "").replace("-001.json", "")
        for spec in [c for c in args.clusters.split(",") if c]:
            results: dict[str, Any] = {}
            wl = cluster = None
            for policy in [p for p in args.policies.split(",") if p]:
                r, wl, cluster = run_one(trace, spec, policy, args.seed)
                results[policy] = r
                print(f"{short:24} {spec:12} {policy:10} makespan {r.makespan or float('nan'):8.1f}s "
                      f"cost {r.total_cost:7.3f} node-h peak {r.peak_workers}", flush=True)  # fmt: skip
            ms_bound, busy, boot = bounds(wl, cluster)
            fewest = min(r.launched_nodes for r in results.values()) or 1
            cost_bound = (busy + boot * fewest) / 3600.0
            fast, cheap = verdict(results)
            if "default" in results:
                failures += (not fast) + (not cheap)
            others = [r.makespan for p, r in results.items() if p != "default" and r.makespan is not None]
            for policy, r in results.items():
                ms = r.makespan
                rows.append([short, spec, policy, "did not finish" if ms is None else f"{ms:,.0f}",
                             f"{r.total_cost:,.2f}", f"{ms / ms_bound:.2f}x" if ms else "-",
                             f"{r.total_cost / cost_bound:.2f}x",
                             f"{ms / min(others):.2f}x" if ms and others and policy == "default" else "",
                             f"{r.peak_workers}",
                             ("ok" if fast and cheap else ("slower" if not fast else "dearer")) if policy == "default"
                             else ""])  # fmt: skip
            d = results.get("default")
            if d is not None and d.makespan:
                summary.append(f"{short} {spec}: default {d.makespan / ms_bound:.2f}x the makespan bound, "
                               f"{d.total_cost / cost_bound:.2f}x the cost bound; "
                               f"{'fastest' if fast else 'NOT fastest'}, {'cheapest of the near-fastest' if cheap else 'NOT cheapest'}")  # fmt: skip
    goals = [["trace", "cluster", "objective", "makespan s", "cost node-h", "goal", "said infeasible"]]
    if args.objectives:
        first = [c for c in args.clusters.split(",") if c][0]
        for trace in traces(args.traces):
            goals += objectives(trace, first, args.seed)
        print(render_text(goals))
    print(render_text(rows))
    print("\n".join(summary))
    total = time.perf_counter() - t0
    print(f"{failures} checks failed; {total:.0f}s in all")
    if args.write_docs:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        section = f"""{render_markdown(rows)}

`check`: **ok** when the default's makespan is at or below the best of the other rules and its cost at
or below that of every rule within 5% of the best makespan; **slower** / **dearer** otherwise.
{failures} of {2 * len(summary)} checks failed.

Measured {when} with `.venv/bin/python benchmarks/sim_workflows.py --clusters {args.clusters}{' --objectives' if args.objectives else ''} --write-docs`
(seed {args.seed}; {total:.0f} s of wall time for all runs; load average at the end {load}, the machine
shared with other engineers: wall time does not change simulated results)."""
        write_section(DOCS, "workflows", section, header="# Simulation\n")
        if args.objectives:
            write_section(DOCS, "workflow-objectives", f"""{render_markdown(goals)}

Deadlines are seconds after the graph is submitted: 1.25x the balanced default's makespan
(feasible: that run finished by then; the deadline run should cost less) and half the makespan
bound (never feasible: the policy must say so at once).  The budget is 0.8x the balanced default's
cost, in node-hours (cost 1 per node-hour): the run must not exceed it.  Measured {when}, seed {args.seed}.""",
                          header="# Simulation\n")  # fmt: skip
        print(f"wrote the workflows section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
