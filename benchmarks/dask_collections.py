"""Dask collections on tidepool against Dask's own schedulers, in the same run, on this machine.

Five workloads, each built fresh with the same Dask code and computed on every backend:

- ``array``: ``(x + x.T).mean(axis=0).sum()`` over a random array of ``--chunks`` x ``--chunks``
  chunks of 50 x 50 (a few thousand chunks; the transpose makes the add read other blocks);
- ``dataframe``: a groupby-aggregation with a tasks-based shuffle (``split_out=8,
  shuffle_method="tasks"``) over ``--partitions`` pandas partitions;
- ``merge``: ``--merge-rows`` x a quarter as many rows joined on a key with a task shuffle of
  both sides (partitions made on the workers with ``from_map``), then summed;
- ``groupby-apply``: a Python function per group over ``--days`` days of ``dask.datasets.timeseries``
  (task shuffle);
- ``bag``: a word count (``str.split().flatten().frequencies()``) over ``--partitions`` partitions.

Backends, fixed pools (2 worker processes, 1 task at a time each, started before timing):
tidepool (``LocalCluster(n_workers=2, slots=1)``, ``scheduler=client.get``), Dask distributed
(``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``), and Dask's threaded
scheduler (``scheduler="threads"``, no cluster).  Elastic, from zero workers with at most 2 (the
timing includes starting them): tidepool's ``adapt(maximum=2)`` against distributed's
``adapt(minimum=0, maximum=2)``.  Every result is compared with Dask's synchronous scheduler; a
different result exits 1.  The schedulers take turns going first; the table reports medians.

Run from the repository root::

    .venv/bin/python benchmarks/dask_collections.py [--repeat K] [--write-docs]
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
import dask.array as da  # noqa: E402
import dask.bag as db  # noqa: E402
import dask.dataframe as dd  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from throughput import machine_info, render_markdown, render_text, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


# ---- the workloads -----------------------------------------------------------------------------------
def array_workload(chunks: int) -> Any:
    x = da.random.RandomState(7).random((50 * chunks, 50 * chunks), chunks=(50, 50))
    return (x + x.T).mean(axis=0).sum()


def frame_workload(partitions: int) -> Any:
    rng = np.random.default_rng(3)
    n = 2_000 * partitions
    pdf = pd.DataFrame({"k": rng.integers(0, 1_000, n), "v": rng.random(n), "w": rng.integers(0, 9, n)})
    ddf = dd.from_pandas(pdf, npartitions=partitions)
    return ddf.groupby("k").agg({"v": "sum", "w": "max"}, split_out=8, shuffle_method="tasks")


def _left_part(i: int, rows: int, keys: int) -> pd.DataFrame:
    rng = np.random.default_rng(100 + i)
    return pd.DataFrame({"k": rng.integers(0, keys, rows), "x": rng.random(rows)})


def _right_part(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(900 + i)
    return pd.DataFrame({"k": np.arange(i * rows, (i + 1) * rows), "y": rng.random(rows)})


def merge_workload(rows: int) -> Any:
    """``rows`` x ``rows // 4`` rows joined on a key with a task shuffle of both sides; the
    partitions are made on the workers (``from_map``), as when read from storage."""
    left_parts, right_parts = 20, 5
    right_rows = rows // 4
    left = dd.from_map(_left_part, range(left_parts), rows=rows // left_parts, keys=right_rows,
                       meta=_left_part(0, 0, 1), divisions=[None] * (left_parts + 1))  # fmt: skip
    right = dd.from_map(_right_part, range(right_parts), rows=right_rows // right_parts,
                        meta=_right_part(0, 0), divisions=[None] * (right_parts + 1))  # fmt: skip
    joined = left.merge(right, on="k", how="inner", shuffle_method="tasks", npartitions=left_parts)
    return joined[["x", "y"]].sum()


def _spread(g: pd.DataFrame) -> pd.Series:
    return pd.Series({"spread": g.x.max() - g.x.min(), "n": float(len(g))})


def groupby_apply_workload(days: int) -> Any:
    """A groupby-apply over Dask's ``timeseries`` demo data (one partition a day, a row a second,
    made on the workers), shuffled by tasks: a Python function per group."""
    import dask.datasets

    ts = dask.datasets.timeseries(start="2000-01-01", end=pd.Timestamp("2000-01-01") + pd.Timedelta(days=days),
                                  freq="1s", partition_freq="1D", seed=5)  # fmt: skip
    return ts.groupby("name").apply(_spread, meta={"spread": "f8", "n": "f8"}, shuffle_method="tasks")


def bag_workload(partitions: int) -> Any:
    words = [f"w{i % 997}" for i in range(40)]
    lines = [" ".join(words[(i + j) % 40] for j in range(12)) for i in range(200 * partitions)]
    return db.from_sequence(lines, npartitions=partitions).str.split().flatten().frequencies()


def normalise(value: Any) -> Any:
    """A comparable form of a workload's result."""
    if isinstance(value, pd.DataFrame):
        return value.sort_index()
    if isinstance(value, pd.Series):
        return value.sort_index().to_frame()
    if isinstance(value, list):
        return sorted(value)
    return float(value)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, pd.DataFrame):
        try:
            pd.testing.assert_frame_equal(a, b, check_exact=False)
            return True
        except AssertionError:
            return False
    if isinstance(a, float):
        return bool(np.isclose(a, b, rtol=1e-9))
    return bool(a == b)


# ---- the backends ------------------------------------------------------------------------------------
@contextlib.contextmanager
def tidepool_backend(elastic: bool) -> Iterator[Callable[[Any], Any]]:
    import tidepool

    with tidepool.LocalCluster(n_workers=0 if elastic else 2, slots=1) as cluster, tidepool.Client(cluster) as client:
        if elastic:
            cluster.adapt(maximum=2)
        else:
            client.wait_for_workers(2, timeout=60)
        yield lambda coll: coll.compute(scheduler=client.get)


@contextlib.contextmanager
def distributed_backend(elastic: bool) -> Iterator[Callable[[Any], Any]]:
    import distributed

    logging.getLogger("distributed").setLevel(logging.ERROR)
    with distributed.LocalCluster(n_workers=0 if elastic else 2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:  # fmt: skip
        if elastic:
            cluster.adapt(minimum=0, maximum=2)
        else:
            client.wait_for_workers(2, timeout=60)
        yield lambda coll: coll.compute(scheduler=client)


@contextlib.contextmanager
def threads_backend(elastic: bool) -> Iterator[Callable[[Any], Any]]:
    yield lambda coll: coll.compute(scheduler="threads")


BACKENDS = {"tidepool": tidepool_backend, "dask distributed": distributed_backend, "dask threads": threads_backend}
ELASTIC = {"tidepool adapt": tidepool_backend, "distributed Adaptive": distributed_backend}


def measure(args: argparse.Namespace) -> tuple[dict[tuple[str, str], list[float]], dict[str, int], bool]:
    builders: dict[str, Callable[[], Any]] = {
        "array": lambda: array_workload(args.chunks),
        "dataframe": lambda: frame_workload(args.partitions),
        "merge": lambda: merge_workload(args.merge_rows),
        "groupby-apply": lambda: groupby_apply_workload(args.days),
        "bag": lambda: bag_workload(args.partitions),
    }
    if args.only:
        builders = {w: b for w, b in builders.items() if w in args.only.split(",")}
    want = {w: normalise(b().compute(scheduler="sync")) for w, b in builders.items()}
    tasks = {w: len(dict(b().__dask_graph__())) for w, b in builders.items()}
    times: dict[tuple[str, str], list[float]] = {}
    all_same = True
    for rep in range(args.repeat):
        for table, elastic in ((BACKENDS, False), (ELASTIC, True))[: 1 if args.fixed_only else 2]:
            order = list(table.items())
            if rep % 2:
                order.reverse()
            for name, backend in order:
                if elastic:  # from zero each time: a fresh cluster per workload
                    for w, build in builders.items():
                        with backend(True) as compute:
                            coll = build()
                            t0 = time.perf_counter()
                            got = normalise(compute(coll))
                            times.setdefault((w, name), []).append(time.perf_counter() - t0)
                        all_same &= _check(w, name, got, want[w])
                    continue
                with backend(False) as compute:
                    compute(da.ones(4, chunks=2).sum())  # warm up
                    for w, build in builders.items():
                        coll = build()
                        t0 = time.perf_counter()
                        got = normalise(compute(coll))
                        times.setdefault((w, name), []).append(time.perf_counter() - t0)
                        all_same &= _check(w, name, got, want[w])
        print(f"repetition {rep + 1}/{args.repeat} done", file=sys.stderr)
    return times, tasks, all_same


def _check(workload: str, backend: str, got: Any, want: Any) -> bool:
    ok = same(got, want)
    if not ok:
        print(f"WRONG RESULT: {workload} on {backend}", file=sys.stderr)
    return ok


def tables(times: dict[tuple[str, str], list[float]], tasks: dict[str, int]) -> tuple[list[list[str]], list[list[str]]]:
    med = {k: statistics.median(v) for k, v in times.items()}
    fixed = [["workload", "tasks", "tidepool (s)", "distributed (s)", "threads (s)", "distributed / tidepool",
              "threads / tidepool"]]  # fmt: skip
    elastic = [["workload (from 0 workers)", "tidepool adapt (s)", "distributed Adaptive (s)",
                "Adaptive / tidepool"]]  # fmt: skip
    for w in tasks:
        t, d, th = med[(w, "tidepool")], med[(w, "dask distributed")], med[(w, "dask threads")]
        fixed.append([w, str(tasks[w]), f"{t:.2f}", f"{d:.2f}", f"{th:.2f}", f"{d / t:.2f}x", f"{th / t:.2f}x"])
        if (w, "tidepool adapt") not in med:
            continue
        ta, ad = med[(w, "tidepool adapt")], med[(w, "distributed Adaptive")]
        elastic.append([w, f"{ta:.2f}", f"{ad:.2f}", f"{ad / ta:.2f}x"])
    return fixed, elastic


def docs_section(fixed: list[list[str]], elastic: list[list[str]], args: argparse.Namespace, command: str) -> str:
    info = machine_info()
    return f"""## Dask collections: tidepool as Dask's scheduler (`benchmarks/dask_collections.py`)

Measured {datetime.date.today().isoformat()} on {info["cpu"]} ({info["nproc"]} cores, load {info["load"]}; the machine
is shared with other engineers' runs, so compare the ratios, measured in the same run, not seconds),
Python {info["python"]}, {info["dask"]}, {info["tidepool"]}; {args.repeat} repetitions, medians;
the same Dask code computed on each backend, every result compared with Dask's synchronous
scheduler (all identical).  Ratios above 1x mean tidepool is faster.

Fixed pools of 2 worker processes running 1 task at a time (started before timing); Dask's
threaded scheduler uses this machine's 2 cores in one process:

{render_markdown(fixed)}

Elastic, from zero workers with at most 2 (timing includes starting the workers; a fresh cluster
per workload):

{render_markdown(elastic)}

Workloads: `array` is `(x + x.T).mean(axis=0).sum()` over {args.chunks}x{args.chunks} chunks of 50x50;
`dataframe` a groupby-aggregation with `split_out=8, shuffle_method="tasks"` over {args.partitions}
`from_pandas` partitions; `merge` joins {args.merge_rows:,} x {args.merge_rows // 4:,} rows (20 and 5
partitions made on the workers) on a key with a task shuffle of both sides; `groupby-apply` runs a
Python function per group (`groupby("name").apply`, task shuffle) over {args.days} days of Dask's
`timeseries` data (a row a second, a partition a day); `bag` a word count over {args.partitions}
partitions.  tidepool runs the graph Dask optimised, one tidepool task per Dask task, through
`compute(scheduler=client.get)`.

Command: `{command}`
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=50, help="array chunks per side (chunks**2 blocks)")
    ap.add_argument("--partitions", type=int, default=100, help="dataframe and bag partitions")
    ap.add_argument("--merge-rows", type=int, default=2_000_000, help="rows of the merge's left side "
                    "(the right side has a quarter as many)")
    ap.add_argument("--days", type=int, default=30, help="timeseries days (partitions) for groupby-apply")
    ap.add_argument("--fixed-only", action="store_true", help="skip the elastic (from zero) runs")
    ap.add_argument("--only", help="comma list of workloads to run (default: all)")
    ap.add_argument("--write-docs", action="store_true", help="rewrite this section of docs/benchmarks.md")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    times, tasks, all_same = measure(args)
    fixed, elastic = tables(times, tasks)
    print(render_text(fixed))
    print(render_text(elastic))
    if not all_same:
        return 1
    if args.write_docs:
        command = "python benchmarks/dask_collections.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
        write_section(DOCS, "dask-collections", docs_section(fixed, elastic, args, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
