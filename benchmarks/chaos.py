"""Chaos: a 5,000-task graph while workers are SIGKILLed and replaced, checked exactly.

The graph (same for every run and scheduler; every value is an integer, so the expected answer is
computed locally in plain Python and compared exactly):

- ``leaf(i)`` for ``i < L``: sleeps ``--pause`` (5 ms) then pure arithmetic;
- ``mix(leaf[i], leaf[(i + 1) % L], i)``: pure arithmetic, every 2nd one also sleeps ``--pause``
  (each needs two leaves, so values move between workers);
- a tree of ``total(*xs)`` sums over the ``mix`` results, fan-in ``--fanin`` (4), down to one value.

``L`` is the largest leaf count whose graph has at most ``--tasks`` (5,000) tasks.  The client holds
the futures of every 100th leaf and every 100th mix (and of the final sum); it drops all others right
after submitting, so the scheduler may forget those once their dependents are done.

Each run starts a fresh cluster of ``--workers`` (3) single-slot worker processes (start-up not
timed).  In a chaos run a thread waits a random (seeded) interval of ``--interval`` x U(0.5, 1.5)
(0.75 .. 2.25 s), SIGKILLs a random registered worker and starts a replacement at once, until the
final result is in (it does not kill when fewer than 2 workers are registered, so the pool is never
empty for long).  Then every held future must give back its exact value.

- tidepool: ``tidepool.LocalCluster(n_workers=3, slots=1)``; the chaos thread calls
  ``cluster.kill_worker(wid)`` (SIGKILL) then ``cluster.add_workers(1, wait=False)``.
- dask: ``distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True)``; the chaos
  thread SIGKILLs a worker process by its pid (``cluster.workers[name].pid``) and its nanny starts a
  replacement, Dask's own way of replacing a dead worker.

A calm run (same graph, no kills) per scheduler is the makespan baseline.  Every run has a deadline
(``--timeout``, 120 s) for the final value, awaited with ``result(timeout=...)``.  A run that misses
it has the scheduler's view of the waiting key recorded, the kills stop, and the run gets
``--grace`` (30 s) more to tell a hang (nothing comes) from a late run, too slow under churn (the
value comes once the kills stop).  Held futures get at least ``--grace`` seconds in all.  A watchdog abandons a
run still busy after all that; the cluster is always closed.

Columns: ``wrong`` final values that differ from the expected one; ``errors`` runs whose final
result raised; ``hangs`` runs still not done ``--grace`` s after the kills stopped (stuck: the
failure the never-hang work is about), ``late`` runs that missed the deadline while the kills went
on but finished once they stopped; ``held lost`` held futures that raised, timed out or gave a wrong value;
``recomputed`` tidepool's ``counters["recomputed"]`` (values lost with a worker and computed again),
summed over the runs; ``extra exec`` task executions beyond the graph's task count (every task
appends a line to a log file when it finishes, for both schedulers: lost values recomputed plus
tasks re-run because their worker died under them); ``killed`` workers SIGKILLed and ``kills/min``
their rate; ``makespan`` first submit to the final value in hand, median over the chaos runs that
finished by the deadline, and the calm run's; ``ratio`` their quotient.

Run from the repository root::

    .venv/bin/python benchmarks/chaos.py [--quick] [--runs N] [--systems tidepool,dask] [--write-docs]

Worker processes import tidepool when they start, so the replacements started during a run use
``src/`` as it is at that moment.  While ``src/`` is being edited, measure a commit instead:
``--snapshot HEAD`` extracts that commit's ``src/tidepool`` (``git archive``, read-only) into a temporary
directory and re-runs this script with it first on ``PYTHONPATH`` (inherited by every worker).

``--network`` runs the network mode instead (``chaos_network.py``: links between test hosts cut and
healed while the graph runs; needs root).  ``--quick`` is 2 runs of a 1,500-task graph.  ``--write-docs`` rewrites only the part of
``docs/benchmarks.md`` between the ``<!-- chaos:start -->`` / ``<!-- chaos:end -->`` markers.
Exits 1 if any tidepool run gave a wrong value, raised, hung or lost a held future.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Dask workers inherit the environment: keep the logged tracebacks of connections to killed workers
# (expected here) off the output
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import machine_info, render_markdown, render_text, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
TASK_LOG_ENV = "TIDEPOOL_CHAOS_TASK_LOG"
SYSTEMS = ("tidepool", "dask", "tidepool-durable")
WATCHDOG_GRACE = 15.0
CLOSE_TIMEOUT = 60.0
MIX_PAUSE_EVERY = 2
#: set in the re-executed process by ``--snapshot``: "<short rev> <directory of the snapshot>"
SNAPSHOT_ENV = "TIDEPOOL_CHAOS_SNAPSHOT"


# ---- the task functions (module level; shipped by value to both schedulers' workers) -------------
def leaf_value(i: int) -> int:
    return (i * 7919 + 13) % 10007


def mix_value(a: int, b: int, i: int) -> int:
    return (a * 31 + b * 17 + i) % 1_000_003


def _record() -> None:
    """Append one line per finished execution to the task log (if this run has one)."""
    path = os.environ.get(TASK_LOG_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())  # one short O_APPEND write: never interleaves
    finally:
        os.close(fd)


def leaf(i: int, pause: float) -> int:
    if pause:
        time.sleep(pause)
    v = leaf_value(i)
    _record()
    return v


def mix(a: int, b: int, i: int, pause: float) -> int:
    if pause:
        time.sleep(pause)
    v = mix_value(a, b, i)
    _record()
    return v


def total(*xs: int) -> int:
    v = sum(xs)
    _record()
    return v


# ---- the graph ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphSpec:
    leaves: int
    fanin: int
    pause: float
    hold_every: int

    def tree_sizes(self) -> list[int]:
        sizes, n = [], self.leaves
        while n > 1:
            n = -(-n // self.fanin)
            sizes.append(n)
        return sizes

    @property
    def tasks(self) -> int:
        return 2 * self.leaves + sum(self.tree_sizes())

    def leaf_pause(self, i: int) -> float:
        return self.pause

    def mix_pause(self, i: int) -> float:
        return self.pause if i % MIX_PAUSE_EVERY == 0 else 0.0

    def held(self) -> range:
        return range(0, self.leaves, self.hold_every)


def graph_for(target: int, fanin: int, pause: float, hold_every: int) -> GraphSpec:
    """The graph with the most leaves whose task count is at most ``target``."""
    lo, hi = 1, max(1, target // 2)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if GraphSpec(mid, fanin, pause, hold_every).tasks <= target:
            lo = mid
        else:
            hi = mid - 1
    return GraphSpec(lo, fanin, pause, hold_every)


@dataclass(frozen=True)
class Expected:
    leaves: list[int]
    mixes: list[int]
    final: int


def expected(g: GraphSpec) -> Expected:
    """The graph's values, computed here in plain Python."""
    n = g.leaves
    leaves = [leaf_value(i) for i in range(n)]
    mixes = [mix_value(leaves[i], leaves[(i + 1) % n], i) for i in range(n)]
    level = mixes
    while len(level) > 1:
        level = [sum(level[j : j + g.fanin]) for j in range(0, len(level), g.fanin)]
    return Expected(leaves, mixes, level[0])


# ---- one harness per scheduler --------------------------------------------------------------------
def call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` on a daemon thread; TimeoutError if it is not back within ``timeout`` seconds."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="chaos-call")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} not back after {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Harness:
    system = ""

    def __init__(self, n_workers: int) -> None:
        raise NotImplementedError

    def map(self, fn: Callable[..., Any], *its: Iterable[Any]) -> list[Any]:
        raise NotImplementedError

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def result(self, future: Any, timeout: float) -> Any:
        return future.result(timeout=timeout)

    def victims(self) -> list[str]:
        """Workers that may be killed now (registered / alive)."""
        raise NotImplementedError

    def kill(self, wid: str) -> None:
        """SIGKILL one worker; a replacement starts without waiting for it."""
        raise NotImplementedError

    def counters(self) -> dict[str, int] | None:
        return None

    def diagnose(self, futures: list[Any]) -> str:
        """The scheduler's view of these (stuck) futures' keys, for the report."""
        return ""

    def check_state(self) -> str | None:
        """A consistency problem in the scheduler's state, or None."""
        return None

    def close(self) -> None:
        raise NotImplementedError


class TidepoolHarness(Harness):
    system = "tidepool"

    def __init__(self, n_workers: int) -> None:
        import tidepool

        self.cluster = tidepool.LocalCluster(n_workers=n_workers, slots=1)
        try:
            self.client = tidepool.Client(self.cluster)
        except BaseException:
            self.cluster.close()
            raise

    def map(self, fn: Callable[..., Any], *its: Iterable[Any]) -> list[Any]:
        return self.client.map(fn, *its)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.client.submit(fn, *args)

    def victims(self) -> list[str]:
        for _ in range(10):  # read from another thread than the scheduler's: retry a torn read
            with contextlib.suppress(RuntimeError):
                return list(self.cluster.workers)
        return []

    def kill(self, wid: str) -> None:
        self.cluster.kill_worker(wid)
        self.cluster.add_workers(1, wait=False)

    def counters(self) -> dict[str, int] | None:
        info = call_with_timeout(self.client.scheduler_info, 10)
        return dict(info["counters"])

    def diagnose(self, futures: list[Any]) -> str:
        keys = [f.key for f in futures]

        def look(s: Any) -> str:
            st = s.state
            lines = [f"tasks by state {st.task_counts()}; counters {dict(st.counters)}",
                     "workers " + ", ".join(f"{w.id}({w.state}, running {len(w.processing)}, "
                                            f"holds {len(w.has_what)})" for w in st.workers.values())]  # fmt: skip
            for k in keys[:5]:
                ts = st.tasks.get(k)
                if ts is None:
                    lines.append(f"{k}: unknown to the scheduler")
                    continue
                waiting = ", ".join(f"{d.key}={d.state}" for d in list(ts.waiting_on)[:4])
                lines.append(f"{k}: {ts.state}, worker {ts.worker}, who_has {sorted(ts.who_has)}, "
                             f"waiting_on [{waiting}] ({len(ts.waiting_on)}), suspicious "
                             f"{ts.suspicious}, recomputes {ts.recomputes}, wanted_by "
                             f"{len(ts.wanted_by)}")  # fmt: skip
            return "\n".join(lines)

        try:
            return str(call_with_timeout(lambda: self.cluster.run(look), 10))
        except Exception as exc:
            return f"(could not ask the scheduler: {exc!r})"

    def check_state(self) -> str | None:
        def validate(s: Any) -> None:
            s.state.validate()

        try:
            call_with_timeout(lambda: self.cluster.run(validate), 10)
        except AssertionError as exc:
            return f"state.validate() failed: {exc!r}"
        except Exception as exc:
            return f"state.validate() could not run: {exc!r}"
        return None

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.cluster.close()


class DaskHarness(Harness):
    system = "dask"

    def __init__(self, n_workers: int) -> None:
        import distributed

        self.cluster = distributed.LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None
        )
        try:
            self.client = distributed.Client(self.cluster)
            self.client.wait_for_workers(n_workers, timeout=60)
        except BaseException:
            self.cluster.close()
            raise

    # pure=False: fresh keys, as tidepool gives
    def map(self, fn: Callable[..., Any], *its: Iterable[Any]) -> list[Any]:
        return self.client.map(fn, *its, pure=False)  # type: ignore[arg-type,no-any-return]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.client.submit(fn, *args, pure=False)

    def victims(self) -> list[str]:
        return [name for name, nanny in list(self.cluster.workers.items()) if nanny.is_alive()]

    def kill(self, wid: str) -> None:
        pid = self.cluster.workers[wid].pid
        if pid:
            os.kill(pid, signal.SIGKILL)  # the nanny notices and starts a new worker process

    def diagnose(self, futures: list[Any]) -> str:
        keys = [f.key for f in futures][:5]

        def look(dask_scheduler: Any, keys: list[Any]) -> str:
            out = [f"workers {len(dask_scheduler.workers)}"]
            for k in keys:
                ts = dask_scheduler.tasks.get(k)
                out.append(f"{k}: {ts.state if ts else 'unknown'}")
            return "; ".join(out)

        try:
            return str(call_with_timeout(lambda: self.client.run_on_scheduler(look, keys=keys), 10))
        except Exception as exc:
            return f"(could not ask the scheduler: {exc!r})"

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.cluster.close()


class DurableHarness(TidepoolHarness):
    """tidepool with ``LocalCluster(state_dir=...)`` (its scheduler in a process of its own): every
    ``SCHEDULER_EVERY``-th kill SIGKILLs the scheduler and starts it again on the same state
    directory instead of killing a worker; workers and the client reconnect by themselves.  It
    submits as the plain tidepool harness does; the scheduler's state cannot be read in-process."""

    system = "tidepool-durable"
    SCHEDULER_EVERY = 2

    def __init__(self, n_workers: int) -> None:
        import tempfile

        import tidepool

        self._dir = tempfile.TemporaryDirectory(prefix="tidepool-chaos-state-")
        self.cluster = tidepool.LocalCluster(n_workers=n_workers, slots=1, state_dir=self._dir.name,
                                             reconnect_window=120.0, timeout=120.0)  # fmt: skip
        self.kills = 0
        self.scheduler_kills = 0
        try:
            self.client = tidepool.Client(self.cluster, timeout=60)
        except BaseException:
            self.cluster.close()
            raise

    diagnose = Harness.diagnose  # the scheduler runs in a process of its own
    check_state = Harness.check_state

    def victims(self) -> list[str]:
        info = call_with_timeout(self.client.scheduler_info, 30)
        return [w["id"] for w in info["workers"]]

    def kill(self, wid: str) -> None:
        self.kills += 1
        if self.kills % self.SCHEDULER_EVERY == 0:
            self.scheduler_kills += 1
            self.cluster.kill_scheduler()
            self.cluster.restart_scheduler()
            return
        self.cluster.kill_worker(wid)
        self.cluster.add_workers(1, wait=False)

    def counters(self) -> dict[str, int] | None:
        info = call_with_timeout(self.client.scheduler_info, 30)
        return {**dict(info["counters"]), "scheduler_kills": self.scheduler_kills}

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            try:
                self.cluster.close()
            finally:
                self._dir.cleanup()


HARNESSES: dict[str, type[Harness]] = {"tidepool": TidepoolHarness, "dask": DaskHarness,
                                       "tidepool-durable": DurableHarness}  # fmt: skip


# ---- one run --------------------------------------------------------------------------------------
@dataclass
class Run:
    system: str
    chaos: bool
    index: int
    tasks: int
    wrong: bool = False  # the final value differs from the expected one
    errored: bool = False  # the final result (or the run itself) raised
    hung: bool = False  # the final value (or a held one) was not in by the deadline
    stuck: bool = (
        False  # hung, and the final value was still not in ``grace`` s after the kills stopped
    )
    late: float | None = (
        None  # hung, then the final value came this many seconds after the kills stopped
    )
    makespan: float | None = None
    chaos_seconds: float = 0.0  # first submit to the chaos thread's stop
    held: int = 0
    held_lost: int = 0
    kills: list[float] = field(default_factory=list)
    pool_at_kill: list[int] = field(default_factory=list)
    skipped_kills: int = 0
    counters: dict[str, int] | None = None
    executions: int | None = None
    wall: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.system} {'chaos' if self.chaos else 'calm'} #{self.index + 1}"

    @property
    def outcome(self) -> str:
        bad = [
            n for n, f in (("hang", self.stuck), ("late", self.hung and not self.stuck), ("error", self.errored),
                           ("wrong", self.wrong)) if f
        ]  # fmt: skip
        if self.held_lost:
            bad.append(f"{self.held_lost} held lost")
        return " + ".join(bad) or "ok"


def submit_graph(h: Harness, g: GraphSpec) -> tuple[Any, list[tuple[str, int, Any]]]:
    """Submit the whole graph; return the final future and the held ``(kind, i, future)``."""
    n = g.leaves
    leaves = h.map(leaf, range(n), [g.leaf_pause(i) for i in range(n)])
    mixes = h.map(
        mix, leaves, leaves[1:] + leaves[:1], range(n), [g.mix_pause(i) for i in range(n)]
    )
    level = mixes
    while len(level) > 1:
        level = [h.submit(total, *level[j : j + g.fanin]) for j in range(0, len(level), g.fanin)]
    held = [("leaf", i, leaves[i]) for i in g.held()] + [("mix", i, mixes[i]) for i in g.held()]
    return level[0], held  # every other future is dropped (released) on return


def chaos_loop(h: Harness, rng: random.Random, interval: float, stop: threading.Event,
               t0: float, run: Run) -> None:  # fmt: skip
    while not stop.wait(interval * rng.uniform(0.5, 1.5)):
        try:
            victims = sorted(h.victims())
            if len(victims) < 2:
                run.skipped_kills += 1
                continue
            wid = rng.choice(victims)
            h.kill(wid)
            run.kills.append(time.monotonic() - t0)
            run.pool_at_kill.append(len(victims))
        except Exception as exc:
            run.notes.append(f"chaos thread: {exc!r}")


def _short(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_body(h: Harness, g: GraphSpec, want: Expected, run: Run, chaos: threading.Thread | None,
             stop: threading.Event, t0: float, deadline: float, grace: float) -> None:  # fmt: skip
    """Submit, await the final value, stop the chaos, then check every held future.

    If the final value is not in by ``deadline`` the run is a hang; the kills then stop and it gets
    ``grace`` more seconds, to tell "too slow under churn" (it arrives) from "stuck" (it does not).
    The held futures are checked after the kills stopped, with at least ``grace`` seconds for all.
    """

    def stop_chaos() -> None:
        stop.set()
        if chaos is not None:
            chaos.join()
        run.chaos_seconds = time.monotonic() - t0

    def check_final(value: Any) -> None:
        if value != want.final:
            run.wrong = True
            run.notes.append(f"final result {value!r}, expected {want.final!r}")

    if chaos is not None:
        chaos.start()
    final, held = submit_graph(h, g)
    run.held = len(held)
    try:
        value = h.result(final, timeout=max(0.1, deadline - time.monotonic()))
    except TimeoutError as exc:
        run.hung = True
        run.notes.append(f"final result not in after {time.monotonic() - t0:.1f}s "
                         f"({_short(exc)}); the scheduler then:\n{h.diagnose([final])}")  # fmt: skip
        stop_chaos()
        t_stop = time.monotonic()
        try:
            value = h.result(final, timeout=grace)
        except TimeoutError as exc2:
            run.stuck = True
            run.notes.append(f"still not in {grace:g}s after the kills stopped ({_short(exc2)}); "
                             f"the scheduler then:\n{h.diagnose([final])}")  # fmt: skip
        except Exception as exc2:
            traceback.print_exc()
            run.errored = True
            run.notes.append(f"after the kills stopped, the final result raised {_short(exc2)}")
        else:
            run.late = time.monotonic() - t_stop
            run.notes.append(f"the final value came {run.late:.1f}s after the kills stopped "
                             f"({'correct' if value == want.final else 'WRONG'})")  # fmt: skip
            check_final(value)
    except Exception as exc:
        traceback.print_exc()
        run.errored = True
        run.notes.append(f"final result raised {_short(exc)}")
    else:
        run.makespan = time.monotonic() - t0
        check_final(value)
    if not stop.is_set():
        stop_chaos()
    held_deadline = max(deadline, time.monotonic() + grace)
    stuck = []
    for kind, i, fut in held:
        good = want.leaves[i] if kind == "leaf" else want.mixes[i]
        try:
            v = h.result(fut, timeout=max(0.1, held_deadline - time.monotonic()))
        except TimeoutError as exc:
            run.held_lost += 1
            stuck.append(fut)
            run.notes.append(f"held {kind}[{i}] timed out ({_short(exc, 300)})")
        except Exception as exc:
            run.held_lost += 1
            run.notes.append(f"held {kind}[{i}] raised {_short(exc)}")
        else:
            if v != good:
                run.held_lost += 1
                run.notes.append(f"held {kind}[{i}] gave {v!r}, expected {good!r}")
    if stuck:
        run.hung = True
        run.notes.append(f"{len(stuck)} held futures not back by their deadline; the scheduler "
                         f"then:\n{h.diagnose(stuck)}")  # fmt: skip


def measure(system: str, chaos: bool, index: int, g: GraphSpec, want: Expected,
            args: argparse.Namespace, tmp: Path) -> Run:  # fmt: skip
    run = Run(system, chaos, index, g.tasks)
    log = tmp / f"{system}-{'chaos' if chaos else 'calm'}-{index}.log"
    os.environ[TASK_LOG_ENV] = str(log)  # read by workers started from now on (replacements too)
    w0 = time.monotonic()
    h = HARNESSES[system](args.workers)
    stop = threading.Event()
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    chaos_thread = None
    if chaos:
        rng = random.Random(f"{args.seed}-{index}")
        chaos_thread = threading.Thread(target=chaos_loop, name="chaos", daemon=True,
                                        args=(h, rng, args.interval, stop, t0, run))  # fmt: skip

    def body() -> None:
        try:
            run_body(h, g, want, run, chaos_thread, stop, t0, deadline, args.grace)
        except BaseException as exc:
            traceback.print_exc()
            run.errored = True
            run.notes.append(f"the run raised {_short(exc)}")

    worker = threading.Thread(target=body, name="chaos-run", daemon=True)
    worker.start()
    limit = args.timeout + 2 * args.grace + WATCHDOG_GRACE
    worker.join(limit)
    if worker.is_alive():
        run.hung = run.stuck = True
        run.notes.append(f"watchdog: the run was still busy {limit:.0f}s after its first submit; "
                         f"the scheduler then:\n{h.diagnose([])}")  # fmt: skip
    stop.set()
    if not run.chaos_seconds:
        run.chaos_seconds = time.monotonic() - t0
    if chaos_thread is not None and chaos_thread.is_alive():
        chaos_thread.join(10)
    with contextlib.suppress(Exception):
        run.counters = h.counters()
    problem = h.check_state()
    if problem:
        run.notes.append(problem)
    try:
        call_with_timeout(h.close, CLOSE_TIMEOUT)
    except Exception as exc:
        run.notes.append(f"closing the cluster: {_short(exc)}")
    os.environ.pop(TASK_LOG_ENV, None)
    if log.exists():
        with log.open("rb") as f:
            run.executions = sum(1 for _ in f)
    else:
        run.executions = 0
    run.wall = time.monotonic() - w0
    return run


# ---- reporting ------------------------------------------------------------------------------------
def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def run_line(r: Run) -> str:
    c = r.counters or {}
    parts = [f"{r.label}: {r.outcome}", f"makespan {fmt_s(r.makespan)}"]
    if r.late is not None:
        parts.append(f"final value {r.late:.1f} s after the kills stopped")
    if r.chaos:
        parts.append(f"killed {len(r.kills)} in {r.chaos_seconds:.0f} s at "
                     f"[{', '.join(f'{t:.1f}' for t in r.kills)}] s")  # fmt: skip
        if r.pool_at_kill:
            parts.append(f"workers up at each kill {min(r.pool_at_kill)}..{max(r.pool_at_kill)}")
        if r.skipped_kills:
            parts.append(f"{r.skipped_kills} kills skipped (< 2 workers up)")
    if c:
        parts.append(f"recomputed {c.get('recomputed', 0)}, workers lost {c.get('workers_lost', 0)}, "
                     f"joined {c.get('workers_joined', 0)}")  # fmt: skip
    parts.append(f"executions {r.executions}/{r.tasks}")
    parts.append(f"held {r.held - r.held_lost}/{r.held} ok")
    return ", ".join(parts)


@dataclass
class Summary:
    system: str
    chaos: list[Run]
    calm: list[Run]

    @property
    def all(self) -> list[Run]:
        return self.calm + self.chaos

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.all)

    @property
    def errors(self) -> int:
        return sum(r.errored for r in self.all)

    @property
    def hangs(self) -> int:
        return sum(r.hung for r in self.all)

    @property
    def stuck(self) -> int:
        return sum(r.stuck for r in self.all)

    @property
    def held_lost(self) -> int:
        return sum(r.held_lost for r in self.all)

    @property
    def held(self) -> int:
        return sum(r.held for r in self.all)

    @property
    def recomputed(self) -> int | None:
        vals = [r.counters.get("recomputed", 0) for r in self.chaos if r.counters is not None]
        return sum(vals) if vals else None

    @property
    def extra_exec(self) -> int:
        return sum(max(0, (r.executions or 0) - r.tasks) for r in self.chaos)

    @property
    def killed(self) -> int:
        return sum(len(r.kills) for r in self.chaos)

    @property
    def skipped(self) -> int:
        return sum(r.skipped_kills for r in self.chaos)

    @property
    def kills_per_min(self) -> float | None:
        secs = sum(r.chaos_seconds for r in self.chaos)
        return 60 * self.killed / secs if secs else None

    @staticmethod
    def _median(runs: list[Run]) -> float | None:
        ms = [r.makespan for r in runs if r.makespan is not None]
        return statistics.median(ms) if ms else None

    @property
    def makespan(self) -> float | None:
        return self._median(self.chaos)

    @property
    def finished(self) -> int:
        return sum(r.makespan is not None for r in self.chaos)

    @property
    def calm_makespan(self) -> float | None:
        return self._median(self.calm)

    @property
    def ratio(self) -> float | None:
        m, c = self.makespan, self.calm_makespan
        return m / c if m is not None and c else None

    @property
    def failed(self) -> bool:
        """Wrong, raised, hung (nothing even after the kills stopped) or lost a held future; a
        run that was only late (past the deadline while the kills went on) is not a failure."""
        return any(r.wrong or r.errored or r.stuck or r.held_lost for r in self.all)

    @property
    def late(self) -> int:
        return sum(r.hung and not r.stuck for r in self.all)


HEADER = ["scheduler", "chaos runs", "wrong", "errors", "hangs", "late", "held lost", "recomputed",
          "extra exec", "killed", "kills/min", "makespan chaos (median)", "makespan calm",
          "ratio"]  # fmt: skip


def table(summaries: list[Summary]) -> list[list[str]]:
    rows = [HEADER]
    for s in summaries:
        kpm = s.kills_per_min
        med = fmt_s(s.makespan)
        if s.makespan is not None and s.finished < len(s.chaos):
            med += f" (of {s.finished})"
        rows.append([
            s.system, str(len(s.chaos)), str(s.wrong), str(s.errors), str(s.stuck), str(s.late),
            f"{s.held_lost}/{s.held}", "n/a" if s.recomputed is None else f"{s.recomputed:,}",
            f"{s.extra_exec:,}", str(s.killed), "-" if kpm is None else f"{kpm:.0f}", med,
            fmt_s(s.calm_makespan), "-" if s.ratio is None else f"{s.ratio:.2f}x",
        ])  # fmt: skip
    return rows


def failure_notes(runs: list[Run]) -> list[str]:
    """One block per run that left notes: its outcome, then the notes in order."""
    return [f"{r.label} ({r.outcome}):\n" + "\n".join(r.notes) for r in runs if r.notes]


def verdict(s: Summary) -> str:
    late = [r for r in s.all if r.hung and not r.stuck and r.late is not None]
    late_text = ""
    if late:
        late_text = (f"  {len(late)} run(s) were late, not hung: the kills were still going at the "
                     f"deadline, and the final value came {', '.join(f'{r.late:.1f}' for r in late)} s "
                     "after they stopped (under this churn the recomputation of lost values ate most "
                     "of the progress).")  # fmt: skip
    if not s.failed:
        return (f"**{s.system} passed**: no wrong value, no error, no hang, every held future came "
                "back." + late_text)  # fmt: skip
    bad = [f"{s.wrong} wrong", f"{s.errors} raised", f"{s.stuck} hung", f"{s.held_lost} held futures lost"]
    return f"**{s.system} failed** this time: " + ", ".join(bad) + " (all must be 0)." + late_text


def docs_section(summaries: list[Summary], runs: list[Run], g: GraphSpec, args: argparse.Namespace,
                 info: dict[str, str], command: str, when: str, wall: float) -> str:  # fmt: skip
    rows = table(summaries)
    verdicts = "\n\n".join(verdict(s) for s in summaries)
    by = {s.system: s for s in summaries}
    if "dask" in by:
        dk = by["dask"]
        dask_text = (
            f"Dask distributed ran the same graph under the same chaos (the same seeded intervals): "
            f"`distributed.LocalCluster(n_workers={args.workers}, threads_per_worker=1, "
            "processes=True, dashboard_address=None)`; the chaos thread SIGKILLs a worker process by "
            "its pid (`cluster.workers[name].pid`) and the worker's nanny starts the replacement "
            "(Dask's own replacement path).  Dask has no recomputation counter (`n/a`); `extra "
            "exec` is measured the same way for both.  A Dask replacement takes longer to come "
            f"up, so with the no-kill-below-2 rule Dask's pool skipped {dk.skipped} scheduled kills "
            "and took fewer kills per minute: compare `kills/min` before comparing makespans.  Its "
            "logging is set to `critical` (`DASK_LOGGING__DISTRIBUTED`), which hides the expected "
            "tracebacks of connections to killed workers."
        )
    else:
        dask_text = "Dask distributed was not run this time (`--systems tidepool`)."
    notes = failure_notes(runs)
    failures = (
        "\n\n".join("```text\n" + n.strip() + "\n```" for n in notes)
        if notes
        else "None: no run left a note (no errors, timeouts or state problems)."
    )
    details = "\n".join(f"- {run_line(r)}" for r in runs)
    return f"""## Chaos: correctness under worker churn

A {g.tasks:,}-task graph while a worker is SIGKILLed and replaced about every {args.interval:g} s;
every value checked exactly, every run under a {args.timeout:g} s deadline.

{verdicts}

{render_markdown(rows)}

`wrong`, `errors`, `hangs` and `held lost` must all be 0 (they count the calm runs too).  `hangs`:
runs whose final value (or a held one) was still not in {args.grace:g} s after the kills stopped
(never-hang means bounded time once failures stop); `late`: runs that missed the {args.timeout:g} s
deadline while the kills were still going but finished once they stopped.  `held lost`: held futures
that raised, timed out or gave a wrong value.  `recomputed`: tidepool's `counters["recomputed"]`
(values lost with a killed worker and computed again); `extra exec`: task executions beyond the
graph's {g.tasks:,} tasks (recomputations plus tasks re-run because their worker died under them);
both summed over the chaos runs.  `kills/min`: kills over the time the chaos thread ran.
`makespan chaos`: median over the chaos runs that finished by the deadline; `ratio`: that over the
calm run's.

How it was measured:

- Measured {when} with `{command}` (run from the repository root; {wall:.0f} s in all).
- Machine: {info["nproc"]} CPUs (nproc), {info["cpu"]}; {info["os"]}; load average at start
  {info["load"]}.
- Software: Python {info["python"]}; {info["dask"]}; {info["tidepool"]}.
- Graph: {g.leaves:,} `leaf(i)` tasks (each sleeps {g.pause * 1000:g} ms, then integer
  arithmetic), {g.leaves:,} `mix(leaf[i], leaf[(i + 1) % {g.leaves}], i)` tasks (arithmetic; one in
  {MIX_PAUSE_EVERY} also sleeps {g.pause * 1000:g} ms), and a tree of `total(*xs)` sums with fan-in
  {g.fanin} ({sum(g.tree_sizes()):,} tasks) down to one integer: {g.tasks:,} tasks.  The expected
  values are computed locally in plain Python and compared exactly.  The client holds the futures
  of every {g.hold_every}th leaf and mix ({2 * len(g.held())} held futures) and of the final sum,
  and drops all others right after submitting.
- Pool: {args.workers} single-slot worker processes, a fresh cluster per run (start-up not timed).
  Workers import tidepool when they start, so replacements use the source as it is at that moment;
  `--snapshot REV` measures one commit's `src/` (extracted with `git archive`) instead.
  tidepool: `tidepool.LocalCluster(n_workers={args.workers}, slots=1)`.
- Chaos: {args.runs} runs per scheduler.  A thread waits {args.interval:g} s x U(0.5, 1.5)
  (seeded, `--seed {args.seed}`), SIGKILLs a random worker (tidepool: `cluster.kill_worker(wid)`)
  and starts a replacement at once (`cluster.add_workers(1, wait=False)`), from the first submit
  until the final value is in; it skips a kill while fewer than 2 workers are up.  Then every held
  future's `result()` must give its exact value (with at least {args.grace:g} s for all of them).
  One calm run per scheduler (no kills) is the makespan baseline.
- Deadline: {args.timeout:g} s per run for the final value (`result(timeout=...)`).  A run that
  misses it counts as a hang; its kills stop, it gets {args.grace:g} s more (stuck or just slow?),
  then the held futures are checked and the cluster is closed.  A watchdog abandons a run still
  busy {WATCHDOG_GRACE:g} s after all of that.  On a hang the scheduler's view of the stuck key
  (state, holders, what it waits on) is recorded below.
- {dask_text}

Failures and notes, verbatim:

{failures}

Every run:

{details}
"""


def write_docs(section: str) -> None:
    write_section(DOCS, "chaos", section)


def reexec_on_snapshot(rev: str, argv: list[str]) -> None:
    """Extract ``rev``'s ``src/tidepool`` to a temporary directory and re-run this script on it."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="tidepool-chaos-src-")
    archive = subprocess.run(["git", "archive", short, "src/tidepool"], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (f"{tmp}/src", env.get("PYTHONPATH")) if p)
    env[SNAPSHOT_ENV] = f"{short} {tmp}"
    print(f"measuring commit {short}: its src/tidepool extracted to {tmp}", flush=True)
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def tidepool_source(info: dict[str, str]) -> str:
    """What tidepool this run measures, for the Software line."""
    import tidepool

    where = Path(tidepool.__file__).resolve().parent
    snap = os.environ.get(SNAPSHOT_ENV)
    if snap:
        rev, tmp = snap.split(" ", 1)
        if where.is_relative_to(Path(tmp).resolve()):
            return (f"tidepool {tidepool.__version__}, commit {rev} (`--snapshot`: that commit's "
                    "`src/`, not the working tree)")  # fmt: skip
    if not where.is_relative_to(ROOT / "src"):
        return f"tidepool {tidepool.__version__} imported from {where} (not this checkout)"
    return info["tidepool"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--network" in argv:  # partitions between test hosts instead of process kills
        import chaos_network

        return chaos_network.main([a for a in argv if a != "--network"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, help="chaos runs per scheduler (default 5; --quick 2)")
    ap.add_argument(
        "--tasks", type=int, help="tasks in the graph, at most (default 5000; --quick 1500)"
    )
    ap.add_argument("--workers", type=int, default=3, help="worker processes (1 slot each)")
    ap.add_argument("--interval", type=float, default=1.5, help="mean seconds between kills")
    ap.add_argument("--pause", type=float, default=0.005, help="seconds a sleeping task sleeps")
    ap.add_argument("--fanin", type=int, default=4, help="fan-in of the tree of sums")
    ap.add_argument(
        "--hold-every", type=int, default=100, help="hold every k-th leaf and mix future"
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline per run, seconds")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds a hung run gets once its kills stop, and held futures at least")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="seed of the chaos intervals and victims")
    ap.add_argument("--systems", default="tidepool,dask",
                    help=f"comma-separated subset of {','.join(SYSTEMS)}")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="2 runs of a 1,500-task graph")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"rewrite the chaos section of {DOCS.relative_to(ROOT)}")  # fmt: skip
    ap.add_argument("--snapshot", metavar="REV",
                    help="measure commit REV's src/tidepool (git archive) instead of the working tree")  # fmt: skip
    args = ap.parse_args(argv)
    if args.snapshot and SNAPSHOT_ENV not in os.environ:
        reexec_on_snapshot(args.snapshot, sys.argv[1:] if argv is None else argv)  # no return
    snapshot_dir = os.environ.get(SNAPSHOT_ENV, " ").split(" ", 1)[1] if args.snapshot else ""
    try:
        return run_all(args, ap)
    finally:
        if snapshot_dir:
            shutil.rmtree(snapshot_dir, ignore_errors=True)


def run_all(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    args.runs = args.runs if args.runs is not None else (2 if args.quick else 5)
    args.tasks = args.tasks if args.tasks is not None else (1500 if args.quick else 5000)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"--systems must be a subset of {','.join(SYSTEMS)}")
    args.systems = systems
    if args.runs < 1 or args.tasks < 4 or args.workers < 2 or args.fanin < 2 or args.hold_every < 1:
        ap.error("need --runs >= 1, --tasks >= 4, --workers >= 2, --fanin >= 2, --hold-every >= 1")
    if __name__ != "__main__":
        # imported: ship the task functions by value, workers cannot import this file
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    g = graph_for(args.tasks, args.fanin, args.pause, args.hold_every)
    want = expected(g)
    info = machine_info()
    info["tidepool"] = tidepool_source(info)
    command = shlex.join([".venv/bin/python", "benchmarks/chaos.py", *sys.argv[1:]])
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{info['nproc']} CPUs, Python {info['python']}, {info['dask']}, {info['tidepool']}, "
          f"load average {info['load']}", flush=True)  # fmt: skip
    print(f"graph: {g.tasks} tasks ({g.leaves} leaves, {g.leaves} mixes, tree {g.tree_sizes()}), "
          f"{2 * len(g.held())} held futures; {args.runs} chaos runs + 1 calm run per scheduler; "
          f"{args.workers} workers; a kill every ~{args.interval:g} s", flush=True)  # fmt: skip
    t_start = time.monotonic()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tidepool-chaos-") as tmp:
        plan = [(s, False, 0) for s in systems]
        for i in range(args.runs):  # the schedulers take turns going first
            order = systems if i % 2 == 0 else list(reversed(systems))
            plan += [(s, True, i) for s in order]
        for system, chaos, i in plan:
            r = measure(system, chaos, i, g, want, args, Path(tmp))
            runs.append(r)
            print(f"  {run_line(r)}  ({r.wall:.0f}s)", flush=True)
            for n in r.notes:
                print("    " + n.replace("\n", "\n    "), flush=True)
    wall = time.monotonic() - t_start
    summaries = [Summary(s, [r for r in runs if r.system == s and r.chaos],
                         [r for r in runs if r.system == s and not r.chaos]) for s in systems]  # fmt: skip
    print()
    print(render_text(table(summaries)))
    print(f"\n({wall:.0f}s in all)")
    if args.write_docs:
        write_docs(docs_section(summaries, runs, g, args, info, command, when, wall))
        print(f"wrote the chaos section of {DOCS.relative_to(ROOT)}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    tp = next((s for s in summaries if s.system == "tidepool"), None)
    return 1 if tp is not None and tp.failed else 0


if __name__ == "__main__":
    sys.exit(main())
