"""The synchronous round trip (issue 25): ``client.submit(inc, i).result()`` one at a time.

Runs N sequential submit->result calls on a two-worker local cluster of tidepool and, in the same
run, of Dask distributed (when installed), and prints each one's median and p90 in microseconds
and the ratio tidepool / Dask.  The first ``--warmup`` calls of each are not counted (connections,
function shipping).  Numbers are wall-clock on whatever else the machine runs: compare within one
run, not across runs.

    python benchmarks/roundtrip.py [-n 500] [--warmup 50] [--no-dask]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def inc(x: int) -> int:
    return x + 1


def measure(submit: Callable[..., Any], n: int, warmup: int) -> list[float]:
    """Microseconds of each of ``n`` sequential ``submit(inc, i).result()`` after ``warmup`` ones."""
    for i in range(warmup):
        assert submit(inc, -i - 1).result() == -i
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        v = submit(inc, i).result()
        out.append((time.perf_counter() - t0) * 1e6)
        assert v == i + 1
    return out


def summary(us: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(us, n=10)
    return statistics.median(us), qs[8]


def run_tidepool(n: int, warmup: int) -> tuple[float, float]:
    from tidepool import Client, LocalCluster

    with LocalCluster(n_workers=2) as cluster, Client(cluster) as client:
        return summary(measure(client.submit, n, warmup))


def run_dask(n: int, warmup: int) -> tuple[float, float] | None:
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        return None
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:  # fmt: skip
        return summary(measure(lambda f, x: client.submit(f, x, pure=False), n, warmup))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--no-dask", action="store_true")
    a = p.parse_args(argv)
    tp = run_tidepool(a.n, a.warmup)
    from tidepool.loop import loop_kind

    print(f"tidepool: median {tp[0]:7.0f} us   p90 {tp[1]:7.0f} us   (n={a.n}, {loop_kind()} loop)", flush=True)
    dk = None if a.no_dask else run_dask(a.n, a.warmup)
    if dk is not None:
        print(f"dask:     median {dk[0]:7.0f} us   p90 {dk[1]:7.0f} us")
        print(f"ratio tidepool/dask: median {tp[0] / dk[0]:.2f}  p90 {tp[1] / dk[1]:.2f}")


if __name__ == "__main__":
    main()
