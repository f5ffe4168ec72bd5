"""Memory: a data-heavy graph under the same worker memory limits on tidepool and Dask distributed.

The graph: ``--results`` tasks each return ``--mb`` MiB (a numpy array of one repeated byte), far
more than the workers' memory; then one task per result checks every byte of it (so spilled results
are read back) and the client gathers the verdicts.  Both clusters have 2 worker processes running
1 task at a time with ``--limit`` each: tidepool ``LocalCluster(n_workers=2, memory_limit=LIMIT)``,
distributed ``LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=LIMIT)`` (each with its
default spill/pause/terminate levels).  Reported per scheduler, medians of ``--repeat`` runs taken in
turns: makespan, the highest worker peak RSS (the kernel's high-water mark), bytes written to disk
by spilling, failed or wrong results.

Run from the repository root::

    .venv/bin/python benchmarks/memory.py [--results 200] [--mb 20] [--limit 1GB] [--repeat 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402

from throughput import machine_info, render_markdown, render_text, write_section  # noqa: E402
from tidepool.worker.memory import high_water_mark  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MB = 2**20


def make(i: int, mb: int) -> Any:
    return np.full(mb * MB, i % 251, dtype=np.uint8)


def check(a: Any, i: int, mb: int) -> bool:
    return bool(a.size == mb * MB and (a == i % 251).all())


def run_graph(submit_map: Callable[..., list[Any]], gather: Callable[[list[Any]], list[Any]],
              n: int, mb: int) -> tuple[float, int]:  # fmt: skip
    gather(submit_map(check, submit_map(make, range(4), [1] * 4), range(4), [1] * 4))  # warm up (imports)
    t0 = time.perf_counter()
    futs = submit_map(make, range(n), [mb] * n)
    oks = submit_map(check, futs, range(n), [mb] * n)
    verdicts = gather(oks)
    return time.perf_counter() - t0, sum(1 for v in verdicts if v is not True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    logging.getLogger("tidepool").setLevel(logging.ERROR)
    yield


def run_tidepool(n: int, mb: int, limit: str) -> dict[str, float]:
    import tidepool

    with tidepool.LocalCluster(n_workers=2, memory_limit=limit) as cluster, tidepool.Client(cluster) as client:
        try:
            seconds, bad = run_graph(client.map, lambda fs: client.gather(fs, errors="skip"), n, mb)
        except Exception as exc:  # noqa: BLE001 - a failed run is a result too
            print(f"tidepool run failed: {exc!r}", file=sys.stderr)
            seconds, bad = float("nan"), n
        time.sleep(1.5)  # one heartbeat: the workers' last metrics
        workers = client.scheduler_info()["workers"]
        peak = max((w["peak_rss"] for w in workers), default=0)
        disk = sum(w["spilled_total"] for w in workers)
    return {"seconds": seconds, "peak": peak, "disk": disk, "bad": bad}


def run_distributed(n: int, mb: int, limit: str) -> dict[str, float]:
    import distributed

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=limit,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:  # fmt: skip
        try:
            seconds, bad = run_graph(client.map, lambda fs: client.gather(fs, errors="skip"), n, mb)
        except Exception as exc:  # noqa: BLE001
            print(f"distributed run failed: {exc!r}", file=sys.stderr)
            seconds, bad = float("nan"), n
        peaks = client.run(high_water_mark)

        def written(dask_worker: Any) -> int:
            metrics = getattr(dask_worker.data, "cumulative_metrics", {})
            return int(metrics.get(("disk-write", "bytes"), 0))

        disk = sum(client.run(written).values())
    return {"seconds": seconds, "peak": max(peaks.values(), default=0), "disk": disk, "bad": bad}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--results", type=int, default=200)
    ap.add_argument("--mb", type=int, default=20, help="MiB per result")
    ap.add_argument("--limit", default="1GB", help="memory limit per worker")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    runs: dict[str, list[dict[str, float]]] = {"tidepool": [], "dask distributed": []}
    with quiet():
        for rep in range(args.repeat):
            order = [("tidepool", run_tidepool), ("dask distributed", run_distributed)]
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                runs[name].append(fn(args.results, args.mb, args.limit))
            print(f"repetition {rep + 1}/{args.repeat} done", file=sys.stderr)
    rows = [["scheduler", "makespan (s)", "peak worker RSS (MiB)", "written to disk (MiB)", "failed or wrong"]]
    med: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        med[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        m = med[name]
        rows.append([name, f"{m['seconds']:.1f}", f"{m['peak'] / MB:.0f}", f"{m['disk'] / MB:.0f}",
                     str(int(max(r["bad"] for r in rs)))])  # fmt: skip
    print(render_text(rows))
    ratio = med["dask distributed"]["seconds"] / med["tidepool"]["seconds"]
    print(f"distributed / tidepool makespan: {ratio:.2f}x")
    if args.write_docs:
        info = machine_info()
        command = "python benchmarks/memory.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
        section = f"""## Memory: data far larger than the workers' limits (`benchmarks/memory.py`)

Measured {datetime.date.today().isoformat()} on {info["cpu"]} ({info["nproc"]} cores, load {info["load"]}),
Python {info["python"]}, {info["dask"]}, {info["tidepool"]}; {args.repeat} runs each, in turns, medians
(failures: the worst run).

{args.results} tasks each return {args.mb} MiB ({args.results * args.mb / 1024:.1f} GiB in all) on 2 worker
processes (1 task at a time) limited to {args.limit} each; then one task per result reads every byte of
it back and checks it.  Both schedulers run with their default spill, pause and terminate levels.

{render_markdown(rows)}

distributed / tidepool makespan: **{ratio:.2f}x** (above 1x: tidepool is faster).  Peak RSS is the
highest kernel high-water mark of any worker process; "written to disk" counts every byte the
workers spilled during the run.

Command: `{command.strip()}`
"""
        write_section(DOCS, "memory", section)
    return 0 if all(r["bad"] == 0 for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
