"""How good is the completion forecast?  ``client.eta()`` against what really happened.

Runs four graphs (wide, chain, diamond, bursty) on a fixed local pool, samples the scheduler's
forecast every 0.1 s, and compares it with the real remaining time (known once the run ends).
Writes ``docs/forecast.png`` and a table into ``docs/forecast.md`` (between markers).

    .venv/bin/python benchmarks/forecast_accuracy.py [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import tidepool  # noqa: E402
from throughput import write_section  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")


def sleep_task(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x


def gather_sum(xs: list[int], seconds: float) -> int:
    time.sleep(seconds)
    return sum(xs)


def wide(c: tidepool.Client) -> tidepool.Future:  # type: ignore[type-arg]
    return c.submit(gather_sum, c.map(sleep_task, range(60), [0.15] * 60), 0.05)


def chain(c: tidepool.Client) -> tidepool.Future:  # type: ignore[type-arg]
    f = c.submit(sleep_task, 0, 0.2)
    for _ in range(19):
        f = c.submit(sleep_task, f, 0.2)
    return f


def diamond(c: tidepool.Client) -> tidepool.Future:  # type: ignore[type-arg]
    root = c.submit(sleep_task, 1, 0.5)
    mid = [c.submit(sleep_task, root, 0.3) for _ in range(24)]
    return c.submit(gather_sum, mid, 0.5)


def bursty(c: tidepool.Client) -> tidepool.Future:  # type: ignore[type-arg]
    a = c.map(sleep_task, range(20), [0.3] * 20)
    r = c.submit(gather_sum, a, 1.5)
    b = [c.submit(sleep_task, r, 0.3) for _ in range(20)]
    return c.submit(gather_sum, b, 0.1)


GRAPHS: dict[str, Callable[[tidepool.Client], tidepool.Future]] = {  # type: ignore[type-arg]
    "wide": wide, "chain": chain, "diamond": diamond, "bursty": bursty,
}  # fmt: skip


def run(name: str, workers: int) -> tuple[list[float], list[float], float]:
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    with tidepool.LocalCluster(n_workers=workers, env=env) as cluster, tidepool.Client(cluster) as client:
        samples: list[tuple[float, float | None]] = []
        stop = threading.Event()
        t0 = time.monotonic()
        fut = GRAPHS[name](client)

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, client.eta()))
                stop.wait(0.1)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        fut.result()
        total = time.monotonic() - t0
        stop.set()
        th.join()
    ts = [t for t, e in samples if e is not None and t < total]
    etas = [e for t, e in samples if e is not None and t < total]
    return ts, etas, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    fig, axes = plt.subplots(1, len(GRAPHS), figsize=(4.2 * len(GRAPHS), 3.6), sharey=False)
    rows = []
    for ax, name in zip(axes, GRAPHS, strict=True):
        ts, etas, total = run(name, args.workers)
        actual = [total - t for t in ts]
        ax.plot(ts, actual, "k--", label="real remaining")
        ax.plot(ts, etas, "o-", ms=3, label="forecast (client.eta)")
        ax.set_title(f"{name} ({total:.1f}s on {args.workers} workers)")
        ax.set_xlabel("seconds since submit")
        ax.set_ylim(bottom=0)
        late = [(e, a) for t, e, a in zip(ts, etas, actual, strict=True) if t >= 0.2 * total]
        err = statistics.mean(abs(e - a) / total for e, a in late) if late else float("nan")
        first = etas[0] / total if etas else float("nan")
        rows.append((name, total, first, err))
        print(f"{name:8s} makespan {total:5.2f}s  first forecast {first:5.2f}x real  "
              f"mean |error| after 20%: {err:5.1%} of makespan")  # fmt: skip
    axes[0].set_ylabel("seconds remaining")
    axes[0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    if args.write_docs:
        png = os.path.join(DOCS, "forecast.png")
        fig.savefig(png, dpi=110)
        table = ["| graph | makespan | first forecast / real | mean abs error after 20% (of makespan) |",
                 "|---|--:|--:|--:|"]  # fmt: skip
        table += [f"| {n} | {t:.2f} s | {f:.2f}x | {e:.1%} |" for n, t, f, e in rows]
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = "\n".join([
            f"Measured {stamp} on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
            f"{args.workers} local workers: `.venv/bin/python benchmarks/forecast_accuracy.py --write-docs`.",
            "", *table, "", "![forecast vs reality](forecast.png)"
        ])  # fmt: skip
        write_section(Path(DOCS) / "forecast.md", "forecast", section, header="# The completion forecast\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
