"""A real run of a 1,000,000-task graph: a map and a pairwise tree on ``LocalCluster(n_workers=2)``.

The cluster (scheduler in its process, two worker processes forked from it, one slot each) runs in
a child process, so the scheduler's memory and the client's (this process) are measured apart:
a thread samples both resident set sizes every 0.2 s (psutil) and the peak is reported.

- ``map``: ``client.map(inc, range(N))``, then the results are gathered in batches and checked.
- ``tree``: ``N / 2`` leaves (``client.map(inc, ...)``), then level after level of
  ``client.map(add, left, right)`` until one future is left (N - 1 tasks in all); each level is
  submitted as soon as the previous one is (futures as inputs), and the client drops a level's
  futures once the next one holds them.  The root is checked against the closed form.

Reported per graph: tasks, submit time (until the last ``map`` call returned), total time (until
the results were checked), and the peak RSS of the scheduler process and of the client process.
Exits 1 if a result is wrong.  ``--write-docs`` writes the table between the ``million`` markers in
docs/benchmarks.md.

Run from the repository root::

    .venv/bin/python benchmarks/million.py [--n 1000000] [--graphs map,tree] [--write-docs]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tidepool  # noqa: E402
from throughput import machine_info, write_section  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
GIB = 2**30

CLUSTER = """
import sys, tidepool
with tidepool.LocalCluster(n_workers=2, slots=1, dashboard=False) as c:
    print(c.address, c.token, flush=True)
    sys.stdin.read()
"""


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


class PeakRSS:
    """Samples the RSS of some processes in a thread; ``peak`` holds each one's highest."""

    def __init__(self, procs: dict[str, psutil.Process], every: float = 0.2) -> None:
        self.procs = procs
        self.peak = dict.fromkeys(procs, 0)
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, p in self.procs.items():
                try:
                    self.peak[name] = max(self.peak[name], p.memory_info().rss)
                except psutil.Error:
                    pass
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Row:
    graph: str
    tasks: int
    submit: float
    total: float
    scheduler_rss: int
    client_rss: int
    ok: bool


def run_map(client: tidepool.Client, n: int, gather_batch: int) -> tuple[int, float, bool]:
    t0 = time.perf_counter()
    futs = client.map(inc, range(n))
    submit = time.perf_counter() - t0
    ok = True
    for i in range(0, n, gather_batch):
        part = futs[i : i + gather_batch]
        values = client.gather(part)
        ok = ok and values == list(range(i + 1, i + 1 + len(part)))
        for j in range(i, i + len(part)):
            futs[j] = None  # type: ignore[call-overload]
    return n, submit, ok


def run_tree(client: tidepool.Client, n: int) -> tuple[int, float, bool]:
    leaves = n // 2 + 1
    t0 = time.perf_counter()
    level: list[Any] = client.map(inc, range(leaves))
    tasks = leaves
    depth = 0
    while len(level) > 1:
        depth += 1
        left, right = level[0::2], level[1::2]
        carry = [left.pop()] if len(left) > len(right) else []
        nxt = client.map(add, left, right, key=f"add-{depth}")
        tasks += len(nxt)
        level = nxt + carry
        del left, right, carry, nxt
    submit = time.perf_counter() - t0
    value = level[0].result()
    return tasks, submit, value == leaves * (leaves + 1) // 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="tasks per graph (about)")
    p.add_argument("--graphs", default="map,tree")
    p.add_argument("--gather-batch", type=int, default=50_000, help="map: results gathered per call")
    p.add_argument("--write-docs", action="store_true")
    a = p.parse_args()
    rows: list[Row] = []
    for graph in a.graphs.split(","):
        child = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
        try:
            assert child.stdout is not None and child.stdin is not None
            address, token = child.stdout.readline().split()
            procs = {"scheduler": psutil.Process(child.pid), "client": psutil.Process()}
            with PeakRSS(procs) as rss, tidepool.Client(address, token=token, timeout=60) as client:
                t0 = time.perf_counter()
                if graph == "map":
                    tasks, submit, ok = run_map(client, a.n, a.gather_batch)
                else:
                    tasks, submit, ok = run_tree(client, a.n)
                total = time.perf_counter() - t0
            row = Row(graph, tasks, submit, total, rss.peak["scheduler"], rss.peak["client"], ok)
        finally:
            if child.stdin is not None:
                child.stdin.close()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
        rows.append(row)
        print(f"{row.graph}: {row.tasks:,} tasks, submit {row.submit:.1f} s, total {row.total:.1f} s, "
              f"peak RSS scheduler {row.scheduler_rss / GIB:.2f} GiB, client {row.client_rss / GIB:.2f} GiB, "
              f"{'results right' if row.ok else 'WRONG RESULT'}", flush=True)  # fmt: skip
    if a.write_docs:
        write_section(DOCS, "million", render(rows, a))
    return 0 if all(r.ok for r in rows) else 1


def render(rows: list[Row], a: argparse.Namespace) -> str:
    info = machine_info()
    lines = [
        "## One million tasks on two workers",
        "",
        f"`benchmarks/million.py --n {a.n}` ({datetime.date.today()}, {info.get('cpu', '?')}, "
        f"{info.get('nproc', '?')} cores, load {info.get('load', '?')}, {info.get('tidepool', '?')}): `LocalCluster(n_workers=2)` "
        "(scheduler in a process of its own, one slot per worker), client in another process; peak "
        "RSS sampled every 0.2 s.",
        "",
        "| graph | tasks | submit (s) | total (s) | scheduler peak RSS (GiB) | client peak RSS (GiB) | result |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r.graph} | {r.tasks:,} | {r.submit:.1f} | {r.total:.1f} | {r.scheduler_rss / GIB:.2f} "
                     f"| {r.client_rss / GIB:.2f} | {'right' if r.ok else 'WRONG'} |")  # fmt: skip
    over = [f"{r.graph} ({side})" for r in rows for side, rss in (("scheduler", r.scheduler_rss), ("client", r.client_rss))
            if rss >= GIB]  # fmt: skip
    lines += ["", "Issue 25's bar, each side under 1 GiB: " + (f"missed by {', '.join(over)}." if over else "met by every graph.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
