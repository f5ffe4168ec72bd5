"""Throughput: tidepool against Dask distributed on tiny tasks, in the same run, on this machine.

Three workloads, each run on both schedulers with the same client-side code:

- ``map``: ``client.map(noop, range(N))`` then ``client.gather`` of all N results (N tasks).
- ``tree``: the same N leaves, reduced pairwise with ``client.submit(add, a, b)`` level by level
  until one future remains (the tree reduction from Dask's futures documentation), then its result
  (2N - 1 tasks).
- ``roundtrip``: ``client.submit(inc, i).result()`` one at a time, ``ROUNDTRIPS`` times; each call
  is timed on its own and the median and 90th percentile are reported (µs).

Besides tasks/s, every timed run reports CPU µs per task, split three ways:

- scheduler: the CPU time of the thread that runs the scheduler's event loop (both LocalClusters run
  the scheduler in this process, on a thread of its own); for both that thread also runs the
  client's comm handling (``Client(cluster)`` shares the cluster's loop; tidepool's since
  2026-12-06).
- client: the rest of this process (``time.process_time`` less the scheduler thread).
- workers: psutil ``cpu_times()`` (user + system) of each worker process, summed (tidepool: the
  provider's worker pids; Dask: ``client.run(os.getpid)``; Dask's nanny processes are not counted).

Each is the delta over the timed workload divided by the workload's tasks.

Both clusters have 2 worker processes running 1 task at a time each.  Every repetition starts a
fresh cluster per scheduler (startup is not timed), warms it up with a small map and tree, waits
until the scheduler has forgotten every key, then times the workloads; the schedulers take turns
going first so background load hits both alike.  The table reports medians.  Every result is
checked (the map must give back ``range(N)``, the tree ``sum(range(N))``); a wrong result exits 1.

Run from the repository root::

    .venv/bin/python benchmarks/throughput.py [--write-docs] [--tasks N] [--repeat K]
        [--only map|tree|roundtrip ...]

``--write-docs`` rewrites only the part of ``docs/benchmarks.md`` between the
``<!-- throughput:start -->`` / ``<!-- throughput:end -->`` markers (other benchmarks own other
sections of that file).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
TARGET_RATIO = 5.0
WARMUP_TASKS = 100
ROUNDTRIPS = 500
ROLES = ("client", "scheduler", "workers")
DOCS_HEADER = """# Benchmarks

tidepool measured against Dask distributed in the same run, on the same machine.  Each benchmark
script owns one section of this file, between its own `<!-- name:start -->` / `<!-- name:end -->`
markers, and its `--write-docs` flag rewrites only that section.
"""


# ---- the tasks (module level, so both schedulers ship them the same way) --------------------------
def noop(x: int) -> int:
    return x


def add(a: int, b: int) -> int:
    return a + b


def inc(x: int) -> int:
    return x + 1


class WrongResultError(Exception):
    """A workload gave back a wrong value: the measurement cannot be trusted."""


class Backend(Protocol):
    """What the workloads need from a scheduler's client."""

    name: str

    def map(self, fn: Callable[[int], int], items: range) -> list[Any]: ...
    def submit(self, fn: Callable[..., int], *args: Any) -> Any: ...
    def gather(self, futures: list[Any], timeout: float) -> list[Any]: ...
    def result(self, future: Any, timeout: float) -> Any: ...
    def n_tasks(self) -> int: ...
    def scheduler_thread(self) -> threading.Thread | None: ...
    def worker_pids(self) -> list[int]: ...
    def close(self) -> None: ...


class TidepoolBackend:
    name = "tidepool"
    tls = False
    dashboard = False

    def __init__(self) -> None:
        import tidepool

        cfg = None
        if self.tls:  # every connection TLS (certificates made for the run, like `tidepool certs`)
            import tempfile

            from tidepool.comm.tls import make_certs

            self._certs = tempfile.mkdtemp(prefix="tidepool-bench-certs-")  # removed by close()
            cfg = make_certs(self._certs)
        self.cluster = tidepool.LocalCluster(n_workers=2, slots=1, tls=cfg, dashboard=self.dashboard)
        self._page: threading.Thread | None = None
        if self.dashboard:  # a page open all along: read the live stream as a browser would
            link = self.cluster.dashboard_link
            self._page = threading.Thread(target=_watch_stream, args=(link + "api/stream",), daemon=True)
            self._page.start()
        try:
            self.client = tidepool.Client(self.cluster)
        except BaseException:
            self.cluster.close()
            raise

    def map(self, fn: Callable[[int], int], items: range) -> list[Any]:
        return self.client.map(fn, items)

    def submit(self, fn: Callable[..., int], *args: Any) -> Any:
        return self.client.submit(fn, *args)

    def gather(self, futures: list[Any], timeout: float) -> list[Any]:
        return self.client.gather(futures, timeout=timeout)  # type: ignore[no-any-return]

    def result(self, future: Any, timeout: float) -> Any:
        return future.result(timeout)

    def n_tasks(self) -> int:
        return sum(self.client.scheduler_info()["tasks"].values())

    def executed(self) -> list[int]:
        return [w.get("executed", 0) for w in self.client.scheduler_info()["workers"]]

    def scheduler_thread(self) -> threading.Thread | None:
        return self.cluster._loop.thread

    def sent(self) -> int:
        """Messages the scheduler has sent for its commands (0 where it does not count them)."""
        out = getattr(self.cluster.scheduler, "outgoing", None)
        return int(getattr(out, "messages", 0))

    def worker_pids(self) -> list[int]:
        return [p.proc.pid for p in self.cluster.provider.procs.values()]

    def close(self) -> None:
        self.client.close()
        self.cluster.close()
        if self.tls:
            import shutil

            shutil.rmtree(self._certs, ignore_errors=True)


class DaskBackend:
    name = "dask"

    def __init__(self) -> None:
        import distributed

        self.cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        )
        try:
            self.client = distributed.Client(self.cluster)
        except BaseException:
            self.cluster.close()
            raise

    # pure=False: fresh keys every call, as tidepool does, so nothing is reused between repetitions
    def map(self, fn: Callable[[int], int], items: range) -> list[Any]:
        return self.client.map(fn, items, pure=False)  # type: ignore[no-any-return]

    def submit(self, fn: Callable[..., int], *args: Any) -> Any:
        return self.client.submit(fn, *args, pure=False)

    def gather(self, futures: list[Any], timeout: float) -> list[Any]:
        # distributed's gather has no timeout; wait() does
        import distributed

        distributed.wait(futures, timeout=timeout)
        return self.client.gather(futures)  # type: ignore[no-any-return]

    def result(self, future: Any, timeout: float) -> Any:
        return future.result(timeout=timeout)

    def n_tasks(self) -> int:
        return int(self.client.run_on_scheduler(_dask_scheduler_tasks))

    def scheduler_thread(self) -> threading.Thread | None:
        ident = self.client.run_on_scheduler(threading.get_ident)  # the cluster's loop thread
        return next((t for t in threading.enumerate() if t.ident == ident), None)

    def worker_pids(self) -> list[int]:
        return [int(pid) for pid in self.client.run(os.getpid).values()]

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def _dask_scheduler_tasks(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


# ---- workloads ------------------------------------------------------------------------------------
def run_map(b: Backend, n: int, timeout: float) -> tuple[float, int]:
    """``map(noop, range(n))`` then gather; returns (seconds, tasks)."""
    t0 = time.perf_counter()
    futures = b.map(noop, range(n))
    values = b.gather(futures, timeout)
    elapsed = time.perf_counter() - t0
    if values != list(range(n)):
        bad = next((i for i, v in enumerate(values) if v != i), len(values))
        raise WrongResultError(f"{b.name} map: {len(values)} values, first wrong at index {bad}")
    return elapsed, n


def run_tree(b: Backend, n: int, timeout: float) -> tuple[float, int]:
    """``n`` leaves reduced pairwise with ``add`` until one value is left; returns (seconds, tasks)."""
    t0 = time.perf_counter()
    level = b.map(noop, range(n))
    while len(level) > 1:
        nxt = [b.submit(add, level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    value = b.result(level[0], timeout)
    elapsed = time.perf_counter() - t0
    if value != n * (n - 1) // 2:
        raise WrongResultError(f"{b.name} tree: got {value!r}, expected {n * (n - 1) // 2}")
    return elapsed, 2 * n - 1


#: the latencies (seconds) of the last roundtrip run, per backend name
LATENCIES: dict[str, list[float]] = {}


def run_roundtrip(b: Backend, n: int, timeout: float) -> tuple[float, int]:
    """``submit(inc, i).result()`` one at a time, ``min(n, ROUNDTRIPS)`` times; returns (seconds, tasks).

    Each call's latency is kept in ``LATENCIES[b.name]``."""
    count = min(n, ROUNDTRIPS)
    lat: list[float] = []
    t0 = time.perf_counter()
    for i in range(count):
        t = time.perf_counter()
        value = b.result(b.submit(inc, i), timeout)
        lat.append(time.perf_counter() - t)
        if value != i + 1:
            raise WrongResultError(f"{b.name} roundtrip: inc({i}) gave {value!r}")
    elapsed = time.perf_counter() - t0
    LATENCIES[b.name] = lat
    return elapsed, count


WORKLOADS: dict[str, Callable[[Backend, int, float], tuple[float, int]]] = {
    "map": run_map,
    "tree": run_tree,
    "roundtrip": run_roundtrip,
}


class CpuMeter:
    """CPU seconds so far of the client, the scheduler thread and the worker processes."""

    def __init__(self, b: Backend) -> None:
        import psutil

        thread = b.scheduler_thread()
        self._clock = time.pthread_getcpuclockid(thread.ident) if thread and thread.ident else None
        self._workers = [psutil.Process(pid) for pid in b.worker_pids()]

    def read(self) -> dict[str, float]:
        sched = time.clock_gettime(self._clock) if self._clock is not None else 0.0
        workers = 0.0
        for p in self._workers:
            t = p.cpu_times()
            workers += t.user + t.system
        return {"client": time.process_time() - sched, "scheduler": sched, "workers": workers}


def wait_idle(b: Backend, timeout: float = 15.0) -> None:
    """Drop garbage futures and wait until the scheduler has forgotten every key (untimed)."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while (left := b.n_tasks()) and time.monotonic() < deadline:
        time.sleep(0.02)
    if left:
        print(f"  warning: {b.name} scheduler still holds {left} tasks {timeout:.0f}s after the "
              "client dropped every future", file=sys.stderr)  # fmt: skip


# ---- running --------------------------------------------------------------------------------------
@dataclass
class Measurements:
    tasks: dict[str, int] = field(default_factory=dict)
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (workload, backend)
    #: (workload, backend) -> one dict role -> CPU µs per task for every timed run
    cpu: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)  # backend -> roundtrip seconds

    def add(self, workload: str, backend: str, seconds: float, tasks: int,
            cpu: dict[str, float] | None = None) -> None:  # fmt: skip
        self.tasks[workload] = tasks
        self.seconds.setdefault((workload, backend), []).append(seconds)
        if cpu is not None:
            self.cpu.setdefault((workload, backend), []).append(cpu)

    def rate(self, workload: str, backend: str) -> float:
        return self.tasks[workload] / statistics.median(self.seconds[(workload, backend)])

    def cpu_us(self, workload: str, backend: str, role: str) -> float:
        return statistics.median(c[role] for c in self.cpu[(workload, backend)])

    def latency_us(self, backend: str, q: float) -> float:
        lat = sorted(self.latencies[backend])
        return 1e6 * lat[min(len(lat) - 1, int(q * len(lat)))]

    def workloads(self) -> list[str]:
        return [w for w in WORKLOADS if w in self.tasks]


def _watch_stream(url: str) -> None:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=600) as r:  # noqa: S310 - loopback
            while r.readline():
                pass
    except OSError:
        pass  # the cluster closed


class TidepoolDashboardBackend(TidepoolBackend):
    name = "tidepool-dashboard"
    dashboard = True


class TidepoolTLSBackend(TidepoolBackend):
    name = "tidepool-tls"
    tls = True


FACTORIES: dict[str, Callable[[], Backend]] = {"tidepool": TidepoolBackend, "dask": DaskBackend,
                                               "tidepool-tls": TidepoolTLSBackend,
                                               "tidepool-dashboard": TidepoolDashboardBackend}  # fmt: skip


def measure(n: int, repeat: int, timeout: float, tls: bool = False, dashboard: bool = False,
            only: list[str] | None = None) -> Measurements:  # fmt: skip
    m = Measurements()
    chosen = {w: fn for w, fn in WORKLOADS.items() if not only or w in only}
    names = ["tidepool", "dask"] + (["tidepool-tls"] if tls else []) + (["tidepool-dashboard"] if dashboard else [])
    for rep in range(repeat):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            b = FACTORIES[name]()
            started = time.perf_counter() - t0
            try:
                for fn in chosen.values():  # warm-up: start-up costs, function shipping
                    fn(b, min(WARMUP_TASKS, n), timeout)
                wait_idle(b)
                meter = CpuMeter(b)
                line = [f"rep {rep + 1}/{repeat} {name:8} (startup {started:.1f}s, untimed)"]
                for workload, fn in chosen.items():
                    tp = b if isinstance(b, TidepoolBackend) else None
                    before = tp.executed() if tp is not None else []
                    sent0 = tp.sent() if tp is not None else 0
                    cpu0 = meter.read()
                    seconds, tasks = fn(b, n, timeout)
                    cpu1 = meter.read()
                    cpu = {r: 1e6 * (cpu1[r] - cpu0[r]) / tasks for r in ROLES}
                    m.add(workload, name, seconds, tasks, cpu)
                    line.append(f"{workload} {seconds:.2f}s = {tasks / seconds:,.0f}/s, CPU µs/task "
                                + "/".join(f"{cpu[r]:.0f}" for r in ROLES))  # fmt: skip
                    if workload == "roundtrip":
                        m.latencies.setdefault(name, []).extend(LATENCIES[name])
                        line[-1] += f", median {m.latency_us(name, 0.5):.0f} µs"
                    if tp is not None:
                        split = [a - z for a, z in zip(tp.executed(), before, strict=False)]
                        line[-1] += f" (per worker {split}"
                        if sent := tp.sent() - sent0:
                            line[-1] += f", scheduler messages/task {sent / tasks:.2f}"
                        line[-1] += ")"
                    wait_idle(b)
                print("  " + "  ".join(line), flush=True)
            finally:
                b.close()
            time.sleep(0.25)  # let the closed cluster's processes go before the next one starts
    return m


def table(m: Measurements) -> list[list[str]]:
    tls = any(b == "tidepool-tls" for _, b in m.seconds)
    dash = any(b == "tidepool-dashboard" for _, b in m.seconds)
    rows = [["workload", "tasks", "tidepool tasks/s", "dask tasks/s", "ratio (tidepool/dask)"]]
    rows[0] += [f"{b} CPU µs/task {r}" for b in ("tidepool", "dask") for r in ROLES]
    if tls:
        rows[0] += ["tidepool TLS tasks/s", "TLS / TCP", "ratio (tidepool TLS/dask)"]
    if dash:
        rows[0] += ["with dashboard + page tasks/s", "dashboard / plain"]
    for workload in m.workloads():
        tp, dk = m.rate(workload, "tidepool"), m.rate(workload, "dask")
        rows.append(
            [workload, f"{m.tasks[workload]:,}", f"{tp:,.0f}", f"{dk:,.0f}", f"{tp / dk:.1f}x"]
        )
        rows[-1] += [f"{m.cpu_us(workload, b, r):.0f}" for b in ("tidepool", "dask") for r in ROLES]
        if tls:
            tt = m.rate(workload, "tidepool-tls")
            rows[-1] += [f"{tt:,.0f}", f"{tt / tp:.2f}", f"{tt / dk:.1f}x"]
        if dash:
            td = m.rate(workload, "tidepool-dashboard")
            rows[-1] += [f"{td:,.0f}", f"{td / tp:.2f}"]
    return rows


def latency_table(m: Measurements) -> list[list[str]]:
    """The synchronous round trip: median and 90th percentile µs per backend (all runs pooled)."""
    rows = [["round trip (submit(...).result())", "calls", "median µs", "p90 µs"]]
    for b in sorted(m.latencies, key=lambda n: (n != "tidepool", n)):
        lat = m.latencies[b]
        rows.append([b, f"{len(lat):,}", f"{m.latency_us(b, 0.5):.0f}", f"{m.latency_us(b, 0.9):.0f}"])
    return rows


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[list[str]]) -> str:
    out = [
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join(["---"] + ["--:"] * (len(rows[0]) - 1)) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


# ---- machine info and the docs section ------------------------------------------------------------
def machine_info() -> dict[str, str]:
    import importlib.metadata

    import tidepool

    def version(name: str) -> str:  # Dask may be missing where only tidepool is measured
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": str(nproc),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "dask": f"dask {version('dask')}, distributed {version('distributed')}",
        "tidepool": f"tidepool {tidepool.__version__}, {git_revision()}",
        "load": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    }


def git_revision() -> str:
    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    rev = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = git("status", "--porcelain", "--", "src")
    return f"commit {rev}" + (" + uncommitted changes under src/" if dirty else "")


def docs_section(m: Measurements, rows: list[list[str]], info: dict[str, str], command: str,
                 n: int, repeat: int, when: str, wall: float) -> str:  # fmt: skip
    ratios = {w: m.rate(w, "tidepool") / m.rate(w, "dask") for w in m.workloads()}
    verdict = ", ".join(
        f"{w} {r:.1f}x ({'meets' if r >= TARGET_RATIO else 'misses'} it)" for w, r in ratios.items()
    )
    runs = "\n".join(
        f"- {w} / {b}: " + ", ".join(f"{s:.2f}" for s in secs) + " s"
        for (w, b), secs in sorted(m.seconds.items())
    )
    dash_note = ("; with `--dashboard`, also `LocalCluster(..., dashboard=True)` with a reader of the page's "
                 "live stream (`api/stream`) connected all along" if any(b == "tidepool-dashboard" for _, b in m.seconds)
                 else "")
    tls_note = ("; with `--tls`, also `LocalCluster(..., tls=make_certs(dir))`: TLS 1.2+ on every connection "
                "(client, workers, worker to worker), the token handshake inside it"
                if any(b == "tidepool-tls" for _, b in m.seconds) else "")
    lat_md = f"\n{render_markdown(latency_table(m))}\n" if m.latencies else ""
    busy = (
        " (the machine was already busy: other processes shared its CPUs during the run)"
        if float(info["load"].split()[0]) > 0.5
        else ""
    )
    return f"""## Throughput: {n:,} no-op tasks

The headline is the ratio of tasks per second, tidepool over Dask distributed, measured in the same
run on the same machine; the target is **>= {TARGET_RATIO:.0f}x** on a 2-core machine.  This run:
{verdict}.

{render_markdown(rows)}
{lat_md}
- Measured {when} with `{command}` (run from the repository root;
  {wall:.0f} s in all).
- Machine: {info["nproc"]} CPUs (nproc), {info["cpu"]}; {info["os"]}; load average at start
  {info["load"]}{busy}.
- Software: Python {info["python"]}; {info["dask"]}; {info["tidepool"]}.
- tidepool: `tidepool.LocalCluster(n_workers=2, slots=1)` + `tidepool.Client(cluster)`{tls_note}{dash_note}.
  Dask: `distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
  dashboard_address=None)` + `distributed.Client(cluster)`, default configuration.
- `map`: `client.map(noop, range(N))` then `client.gather(...)`, {n:,} tasks.  `tree`: the same
  {n:,} leaves reduced pairwise with `client.submit(add, a, b)` level by level until one future is
  left, then its `result()`, {2 * n - 1:,} tasks.  Dask calls use `pure=False` so every repetition
  gets fresh keys, as tidepool's do.  The clock covers submitting and getting the results.
- Each of {repeat} repetitions starts a fresh cluster per scheduler (start-up not timed), warms it
  up with a {min(WARMUP_TASKS, n)}-leaf map and tree, waits until the scheduler has forgotten every
  key, then times each workload; the schedulers take turns going first.  Medians are reported.
  Results are checked (the map gives back `range(N)`, the tree `sum(range(N))`).
- `roundtrip`: `client.submit(inc, i).result()` one call at a time, {min(n, ROUNDTRIPS)} calls per
  run; the latency table pools every run's calls.
- CPU µs per task (medians over the runs): scheduler = the thread running the scheduler's event
  loop (in this process for both, and for both it also runs the client's comm handling, which
  shares that loop), client = the rest of this process, workers = user + system CPU of the worker
  processes summed (Dask's nannies not counted); each a delta over the timed workload divided by
  its tasks.

Every timed run, in seconds:

{runs}
"""


def write_section(path: Path, name: str, section: str, header: str = DOCS_HEADER) -> None:
    """Replace this benchmark's section (between its markers) in ``path``, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{section.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else header
    if start in text and end in text and text.index(start) < text.index(end):
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_docs(section: str) -> None:
    write_section(DOCS, "throughput", section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--tasks", type=int, default=10_000, help="tasks per map / leaves per tree")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (median is reported)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per workload run")
    ap.add_argument("--tls", action="store_true", help="also time tidepool with TLS on every connection")
    ap.add_argument("--dashboard", action="store_true",
                    help="also time tidepool with the dashboard on and a page reading its live stream")
    ap.add_argument("--only", action="append", choices=list(WORKLOADS),
                    help="run only this workload (repeatable); default: all")
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help=f"rewrite the throughput section of {DOCS.relative_to(ROOT)}",
    )
    args = ap.parse_args(argv)
    if __name__ != "__main__":  # imported: ship noop/add by value, workers cannot import this file
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if args.tasks < 2 or args.repeat < 1:
        ap.error("--tasks must be >= 2 and --repeat >= 1")

    info = machine_info()
    command = shlex.join([".venv/bin/python", "benchmarks/throughput.py", *sys.argv[1:]])
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{info['nproc']} CPUs, Python {info['python']}, {info['dask']}, {info['tidepool']}, "
          f"load average {info['load']}")  # fmt: skip
    if float(info["load"].split()[0]) > 0.5:
        print("note: the machine was already busy; other processes compete for the same CPUs")

    t0 = time.perf_counter()
    try:
        m = measure(args.tasks, args.repeat, args.timeout, tls=args.tls, dashboard=args.dashboard,
                    only=args.only)
    except WrongResultError as exc:
        print(f"WRONG RESULT: {exc}", file=sys.stderr)
        return 1
    rows = table(m)
    print()
    print(render_text(rows))
    if m.latencies:
        print()
        print(render_text(latency_table(m)))
    wall = time.perf_counter() - t0
    print(f"\n(medians of {args.repeat}; target ratio >= {TARGET_RATIO:.0f}x; {wall:.0f}s in all)")
    if args.write_docs:
        write_docs(docs_section(m, rows, info, command, args.tasks, args.repeat, when, wall))
        print(f"wrote the throughput section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
