"""Dashboard load: the scheduler's loop lag while pages and pollers watch a large queued graph.

Setup per scheduler: a local cluster with 1 worker, 30,000 tasks queued behind a slow one (so the
graph stays large for the whole run).  A separate load process (aiohttp client, so the load's own
CPU use is one process whatever the number of pages) then runs each scenario for ``--seconds``:

- ``idle``: nothing watches (the baseline);
- ``4 pollers + 100 pages`` (tidepool): four loops fetching ``/api/state`` back to back, and 100
  open live pages (``/api/stream``, server-sent events);
- ``4 /metrics pollers``: four loops fetching ``/metrics`` back to back, on tidepool and on Dask
  distributed (its Prometheus endpoint), the comparison that exists on both.

Loop lag is measured inside each scheduler's own event loop by a probe coroutine that sleeps 10 ms
and records how late it wakes (tidepool: a task on the scheduler's loop; Dask: started with
``client.run_on_scheduler``).  Reported: p50, p99 and max lag per scenario, and requests served.

Run from the repository root::

    .venv/bin/python benchmarks/dashboard_load.py [--write-docs] [--tasks N] [--seconds S]

``--write-docs`` rewrites the ``<!-- dashboard-load:start -->`` section of docs/benchmarks.md.
Also reports the cost the default-on dashboard adds to starting and closing a ``LocalCluster``
(medians of ``--starts`` runs with and without it), the number the test suite pays per cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PROBE = 0.01
TARGET = 0.020  # issue 29: loop lag under 20 ms with 4 pollers and 100 pages

LOAD = r"""
import asyncio, sys, time, aiohttp
base, mode, seconds, pollers, pages = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
served = 0
async def poll(s, path, end):
    global served
    while time.monotonic() < end:
        async with s.get(base + path) as r:
            await r.read()
        served += 1
async def page(s, end):
    async with s.get(base + "api/stream", timeout=aiohttp.ClientTimeout(total=None)) as r:
        while time.monotonic() < end:
            try:
                await asyncio.wait_for(r.content.readany(), max(0.01, end - time.monotonic()))
            except asyncio.TimeoutError:
                pass
async def main():
    end = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        jobs = [poll(s, mode, end) for _ in range(pollers)] + [page(s, end) for _ in range(pages)]
        await asyncio.gather(*jobs)
    print(served)
asyncio.run(main())
"""


def slow(x: int) -> int:
    time.sleep(3600)
    return x


def inc(x: int) -> int:
    return x + 1


async def _probe(samples: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(PROBE)
        samples.append(max(0.0, loop.time() - t - PROBE))


def _load(base: str, path: str, seconds: float, pollers: int, pages: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", LOAD, base, path, str(seconds), str(pollers), str(pages)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples) or [0.0]
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "max": s[-1], "n": len(s)}


def run_tidepool(tasks: int, seconds: float) -> dict[str, dict[str, float]]:
    import tidepool

    out: dict[str, dict[str, float]] = {}
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        futs = client.map(slow, range(tasks))
        while len(cluster.scheduler.state.tasks) < tasks:
            time.sleep(0.1)
        base = cluster.dashboard_link
        for name, path, pollers, pages in (("idle", "", 0, 0), ("4 pollers + 100 pages", "api/state", 4, 100),
                                           ("4 /metrics pollers", "metrics", 4, 0)):  # fmt: skip
            samples: list[float] = []
            stop = asyncio.Event()
            cluster.run(lambda s, samples=samples, stop=stop: asyncio.get_running_loop().create_task(_probe(samples, stop)))
            proc = _load(base, path, seconds, pollers, pages) if pollers or pages else None
            time.sleep(seconds)
            served = int(proc.communicate(timeout=60)[0].strip() or 0) if proc else 0
            cluster.run(lambda s, stop=stop: stop.set())
            out[name] = {**_stats(samples), "served": served}
        client.cancel(futs)
    return out


def run_dask(tasks: int, seconds: float) -> dict[str, dict[str, float]]:
    from distributed import Client, LocalCluster

    out: dict[str, dict[str, float]] = {}
    try:
        _run_dask(tasks, seconds, out, Client, LocalCluster)
    except TimeoutError:  # closing a client with 30,000 queued futures can time out under load
        if len(out) < 2:
            raise
    return out


def _run_dask(tasks: int, seconds: float, out: dict[str, dict[str, float]], Client: Any, LocalCluster: Any) -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:  # fmt: skip
        futs = client.map(slow, range(tasks), pure=False)
        while len(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks))) < tasks:
            time.sleep(0.2)
        base = cluster.dashboard_link.rsplit("/", 1)[0] + "/"
        for name, path, pollers in (("idle", "", 0), ("4 /metrics pollers", "metrics", 4)):

            async def start(dask_scheduler: Any) -> None:
                dask_scheduler._bench_lag, dask_scheduler._bench_stop = [], asyncio.Event()
                asyncio.get_running_loop().create_task(_probe(dask_scheduler._bench_lag, dask_scheduler._bench_stop))

            client.run_on_scheduler(start)
            proc = _load(base, path, seconds, pollers, 0) if pollers else None
            time.sleep(seconds)
            served = int(proc.communicate(timeout=60)[0].strip() or 0) if proc else 0

            def finish(dask_scheduler: Any) -> list[float]:
                dask_scheduler._bench_stop.set()
                return list(dask_scheduler._bench_lag)

            out[name] = {**_stats(client.run_on_scheduler(finish)), "served": served}
        del futs


def start_cost(starts: int) -> dict[str, float]:
    import tidepool

    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(starts * 2):
        mode = "on" if i % 2 == 0 else "off"
        t = time.perf_counter()
        with tidepool.LocalCluster(n_workers=0, dashboard=None if mode == "on" else False):
            pass
        times[mode].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=30_000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    import tidepool  # noqa: F401 - import cost measured separately from cluster starts
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    import aiohttp  # noqa: F401
    import prometheus_client  # noqa: F401

    dash_import = time.perf_counter() - t0
    tp = run_tidepool(args.tasks, args.seconds)
    dk = run_dask(args.tasks, args.seconds)
    cost = start_cost(args.starts)
    load = os.getloadavg()[0]
    ms = 1000.0
    rows = []
    for name, r in tp.items():
        d = dk.get(name)
        ratio = f"{r['p99'] / d['p99']:.2f}x" if d and d["p99"] > 0 else "-"
        dask_cell = f"{d['p50'] * ms:.1f} / {d['p99'] * ms:.1f} / {d['max'] * ms:.0f} ({d['served']:.0f})" if d else "-"
        rows.append(f"| {name} | {r['p50'] * ms:.1f} / {r['p99'] * ms:.1f} / {r['max'] * ms:.0f} ({r['served']:.0f}) "
                    f"| {dask_cell} | {ratio} |")  # fmt: skip
    worst = tp["4 pollers + 100 pages"]["p99"]
    base = tp["idle"]["p99"]
    added = (f"{(worst - base) * ms:.1f} ms" if worst > base else
             "nothing measurable (the idle run's own spikes on this loaded machine were larger)")
    table = "\n".join([
        "| scenario | tidepool lag ms p50 / p99 / max (requests) | Dask lag ms p50 / p99 / max (requests) | p99 ratio |",
        "|---|---|---|---|", *rows,
    ])  # fmt: skip
    text = (f"<!-- dashboard-load:start -->\n## Dashboard load: loop lag with pages and pollers watching "
            f"(`benchmarks/dashboard_load.py`)\n\n"
            f"{args.tasks:,} tasks queued on 1 worker; each scenario {args.seconds:g} s; loop lag from a 10 ms "
            f"probe inside each scheduler's loop.  Measured {datetime.date.today()} on {platform.machine()}, "
            f"{os.cpu_count()} cores, **shared and loaded** (1-min load average {load:.1f} at the end).\n\n"
            f"{table}\n\n"
            f"With 4 `/api/state` pollers and 100 live pages the p99 loop lag is {worst * ms:.1f} ms against "
            f"{base * ms:.1f} ms with nothing watching (the same scheduler on this machine at this load): the "
            f"dashboard adds {added} (target: under {TARGET * ms:.0f} ms in all, "
            f"{'met' if worst < TARGET else 'not met in all at this load'}; added "
            f"{'under' if worst - base < TARGET else 'NOT under'} {TARGET * ms:.0f} ms).  Dask's dashboard has no "
            f"server-sent stream, so the row compared on both is four `/metrics` pollers.\n\n"
            f"Default-on dashboard, cost per `LocalCluster(n_workers=0)` start and close: "
            f"{cost['on'] * ms:.0f} ms with it, {cost['off'] * ms:.0f} ms without "
            f"(+{(cost['on'] - cost['off']) * ms:.0f} ms; medians of {args.starts}); importing aiohttp and "
            f"prometheus_client once per process: {dash_import * ms:.0f} ms (tidepool itself: {import_s * ms:.0f} ms).\n"
            f"<!-- dashboard-load:end -->")  # fmt: skip
    print(text)
    print(json.dumps({"tidepool": tp, "dask": dk, "start_cost": cost}, indent=1))
    if args.write_docs:
        doc = DOCS.read_text()
        a, b = "<!-- dashboard-load:start -->", "<!-- dashboard-load:end -->"
        if a in doc:
            doc = doc[: doc.index(a)] + text + doc[doc.index(b) + len(b):]
        else:
            doc = doc.rstrip("\n") + "\n\n" + text + "\n"
        DOCS.write_text(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
