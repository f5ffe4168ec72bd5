"""Real workflows run for real: WfCommons traces with every task sleeping its runtime / scale.

For each trace of ``<repo>/../shared/workloads/wfinstances`` named by ``--traces`` (with its
scale: ``montage-chameleon-2mass-01d:4`` sleeps each task a quarter of its recorded runtime), this
submits the trace's graph -- every task ``sleep(runtimeInSeconds / scale)`` and takes its parents'
results as arguments -- to

- tidepool: ``LocalCluster(n_workers=0, slots=1)`` + ``adapt(maximum=4)`` (the default policy);
- Dask: ``distributed.LocalCluster(n_workers=0, threads_per_worker=1)`` + ``adapt(minimum=0,
  maximum=4)`` (Dask's ``Adaptive``),

one after the other in the same run (the harnesses of ``benchmarks/elastic.py``), and prints per
system: makespan (first submit -> every sink's result gathered), held worker-seconds (registered
workers, from tidepool's journal and Dask's scheduler events, within the makespan), time to first
worker, and what ``tidepool simulate`` predicts for the same tidepool run (the same graph, the
``local:4`` cluster with the autoscaler period ``adapt`` uses, and once more with the start-up
measured in this run's launch-to-join delays instead of the preset's).  Results are small ints:
the traces' file sizes are not moved (the simulator is given the same 28-byte results).

Run from the repository root::

    .venv/bin/python benchmarks/workflows.py [--traces montage-chameleon-2mass-01d:4,...] [--write-docs]

``--write-docs`` rewrites ``docs/benchmarks.md`` between ``<!-- workflows:start -->`` and
``<!-- workflows:end -->``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
DEFAULT_TRACES = ("montage-chameleon-2mass-01d-001:4,blast-chameleon-medium-001:300,"
                  "1000genome-chameleon-10ch-250k-001:250")  # fmt: skip
INTERVAL = 0.05  # LocalCluster.adapt's autoscaler period
RESULT_BYTES = 28  # sys.getsizeof(1)


def sleep_task(seconds: float, *inputs: Any) -> int:
    time.sleep(seconds)
    return 1


def load(name: str, scale: float) -> Any:
    from sim_workflows import TRACES
    from tidepool.sim import load_workload
    from tidepool.sim.wfformat import fit_memory

    wl = load_workload(str(TRACES / f"{name}.json"), params={"scale": scale})
    fit_memory(wl, [0.0])
    for t in wl.tasks():
        t.nbytes = RESULT_BYTES
        t.resources = None
    return wl


def run_real(system: str, wl: Any, timeout: float) -> dict[str, Any]:
    import elastic

    h: Any = elastic.TidepoolHarness("adaptive", False) if system == "tidepool" else elastic.DaskHarness("adaptive", False)
    try:
        sampler = elastic.Sampler(h.n_workers)
        sampler.start()
        while len(sampler.samples) < 2:
            time.sleep(0.01)
        t0, t0_wall = time.monotonic(), time.time()
        futs: dict[str, Any] = {}
        for t in wl.tasks():
            futs[t.key] = h.submit(sleep_task, t.duration, *[futs[d] for d in t.deps], key=t.key)
        sinks = [futs[k] for s in wl.stages for k in s.wanted]
        got = h.gather(sinks, timeout)
        t1 = time.monotonic()
        if got != [1] * len(sinks):
            raise RuntimeError(f"{system}: wrong results")
        time.sleep(0.1)
        sampler.stop()
        delays: list[float] = []
        if system == "tidepool":
            records = h.records()
            iv = elastic._tidepool_intervals(records, h, t0, t1)
            launches = {x["request"]: x["t"] for x in records if x["kind"] == "launch"}
            for x in records:
                if x["kind"] == "worker-join":
                    rid = next((q for q in launches if f"-{q}-" in str(x["worker"])), None)
                    if rid is not None:
                        delays.append(x["t"] - launches[rid])
        else:
            iv = elastic._dask_intervals(h.events(), t0, t0_wall, t1)
        held, first, peak = elastic.intervals_held(iv, t0, t1)
        return {"makespan": t1 - t0, "held": held, "first": first, "peak": peak, "delays": delays}
    finally:
        h.close()
        elastic.wait_children_gone()


def predict(wl: Any, startup: Any = None) -> Any:
    from tidepool.scaling.node_types import NodeType
    from tidepool.sim import make_policy, simulate
    from tidepool.sim.cluster import SimCluster
    from tidepool.sim.provider import PRESETS

    nt = NodeType("default", {"cpu": 1}, max_nodes=4, startup_estimate=0.5)
    cluster = SimCluster([nt], {"default": startup or PRESETS["local"]}, interval=INTERVAL, source="local:4")
    return simulate(wl, cluster, make_policy("default"), seed=0, task_records=False)


def pct(a: float, b: float) -> str:
    return f"{(a - b) / b * 100:+.1f}%" if b else "-"


def main(argv: list[str] | None = None) -> int:
    import cloudpickle

    import elastic
    from throughput import machine_info, render_markdown, render_text, write_section
    from tidepool.sim.dists import Dist
    from tidepool.sim.provider import StartupModel

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--traces", default=DEFAULT_TRACES, help="NAME:SCALE,... (trace file names without .json)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    info = machine_info()
    rows = [["trace", "scale", "tasks", "system", "makespan s", "held w-s", "first worker s", "peak",
             "makespan / dask", "held / dask", "sim makespan s", "diff", "sim held w-s", "diff",
             "sim makespan s (measured start-up)", "diff", "sim held w-s (measured start-up)", "diff"]]  # fmt: skip
    worst = 0.0
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tidepool-workflows-"):
        for item in [x for x in args.traces.split(",") if x]:
            name, _, scale_text = item.partition(":")
            scale = float(scale_text or 100)
            wl = load(name, scale)
            res = {s: run_real(s, wl, args.timeout) for s in ("tidepool", "dask")}
            sim = predict(wl)
            delays = res["tidepool"]["delays"]
            mean = statistics.mean(delays) if delays else 0.3
            sd = statistics.pstdev(delays) if len(delays) > 1 else 0.0
            measured = predict(wl, StartupModel(boot=Dist("normal", (mean, sd))))
            short = name.replace("-chameleon", "").replace("-001", "")
            for system, r in res.items():
                d = res["dask"]
                row = [short, f"{scale:g}", f"{wl.n_tasks:,}", system, f"{r['makespan']:.2f}", f"{r['held']:.1f}",
                       f"{r['first']:.2f}" if r["first"] is not None else "-", str(r["peak"]),
                       f"{r['makespan'] / d['makespan']:.2f}x", f"{r['held'] / d['held']:.2f}x" if d["held"] else "-"]  # fmt: skip
                if system == "tidepool":
                    assert sim.makespan is not None and measured.makespan is not None
                    row += [f"{sim.makespan:.2f}", pct(sim.makespan, r["makespan"]), f"{sim.held_worker_seconds:.1f}",
                            pct(sim.held_worker_seconds, r["held"]), f"{measured.makespan:.2f}",
                            pct(measured.makespan, r["makespan"]), f"{measured.held_worker_seconds:.1f}",
                            pct(measured.held_worker_seconds, r["held"])]  # fmt: skip
                    worst = max(worst, abs(measured.makespan - r["makespan"]) / r["makespan"])
                else:
                    row += [""] * 8
                rows.append(row)
                print(" | ".join(row), flush=True)
            print(f"  tidepool launch-to-join: mean {mean:.2f}s sd {sd:.2f}s over {len(delays)} workers", flush=True)
    print(render_text(rows))
    total = time.perf_counter() - t_all
    print(f"largest makespan difference, simulator (measured start-up) vs real: {worst:.1%}; {total:.0f}s in all")
    _ = elastic  # the harnesses live there
    if args.write_docs:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = f"""{render_markdown(rows)}

Measured {when} with `.venv/bin/python benchmarks/workflows.py --traces {args.traces} --write-docs` on
{info["nproc"]} CPUs ({info["cpu"]}), load average at start {info["load"]}: **the machine was shared
with other engineers' test runs**, one run per system.  Largest makespan difference between the
simulator (start-up measured in the same run) and the real tidepool run: **{worst:.1%}**."""
        write_section(DOCS, "workflows", section)
        print(f"wrote the workflows section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
