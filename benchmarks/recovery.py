"""Scheduler recovery from its state directory: restart time, store size and the cost of persisting.

1. ``restart``: a store holding a graph of N tasks (``--sizes``, 10k and 100k: independent pairs
   ``a-i -> b-i``, every ``b-i`` wanted by one client, half the pairs finished) is written by
   driving a real :class:`SchedulerState` with the real persister.  Then ``tidepool scheduler
   --state-dir`` is started on it as a new process and timed from ``Popen`` to its "listening" line
   (the graph is rebuilt before it listens: that is the resumed graph, waiting for its workers),
   plus the in-process part alone (open, check, load, rebuild).
2. ``size``: bytes of the store per million finished tasks that are still held (each row is a
   task's spec, payload and outcome; released tasks leave it).
3. ``cost``: scheduler-bound throughput of the state machine with and without the persister (N
   no-op tasks in batches of 1,000 through submit -> run -> finish -> release on 8 fake workers,
   with a tick after every step, so every task is written three times: new, finished, deleted; the
   writer thread's time counts), i.e. the hot-path cost of ``--state-dir`` per task at its worst.

4. ``--end-to-end N``: the throughput cost of ``--state-dir`` end to end: the map and tree
   workloads of ``benchmarks/throughput.py`` (N no-op tasks; a pairwise tree over N leaves) on
   ``LocalCluster(2, slots=1, state_dir=...)`` (a ``tidepool scheduler --state-dir`` process), next
   to the same scheduler process without ``--state-dir`` and to the in-process ``LocalCluster``,
   alternating, ``--repeat`` times; prints tasks/s (medians) and the ratio durable/plain process.

Usage: ``python benchmarks/recovery.py [--sizes 10000 100000] [--end-to-end 20000 --repeat 3]``
(``--sizes`` with no value skips the restart part).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidepool.comm.serialize import serialize
from tidepool.scheduler import events as ev
from tidepool.scheduler.recovery import Durability, Persister
from tidepool.scheduler.state import SchedulerState
from tidepool.scheduler.store import StateStore

TOKEN = "b" * 32
LAUNCH = "import sys; from tidepool.cli import main; sys.exit(main(sys.argv[1:]))"


def _build(directory: str, n: int) -> None:
    store = StateStore(directory, TOKEN)
    st = SchedulerState(no_worker_timeout=None)
    p = Persister(store, st)
    payload = serialize((1, 2))
    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        st.handle(ev.WorkerJoin(w, f"tcp://127.0.0.1:{1000 + len(w)}", {"cpu": 1.0}, 0.0))
    pairs = n // 2
    specs = [s for i in range(pairs) for s in (ev.TaskSpec(f"a-{i}", "f", payload, (), {}, 0, "a"),
                                               ev.TaskSpec(f"b-{i}", "f", payload, (f"a-{i}",), {}, 0, "b"))]  # fmt: skip
    update = ev.UpdateGraph("client-1", specs, [f"b-{i}" for i in range(pairs)], 0.0, {"f": serialize(len)})
    p.observe([update], st.handle(update))
    # half the pairs finish (their a-i is released once b-i is done)
    for i in range(pairs // 2):
        for key in (f"a-{i}", f"b-{i}"):
            ts = st.tasks[key]
            if ts.state != "running":
                continue
            st.handle(ev.TaskFinished(ts.worker or "", key, 8, 0.001, 0.0))
    p.observe([ev.Tick(1.0)], [])
    store.drain()
    store.compact()
    store.close()


def restart(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        _build(d, n)
        size = sum(f.stat().st_size for f in Path(d).iterdir())
        gc.collect()  # the build's garbage is not the restart's to collect (a restarted process has none)
        t0 = time.perf_counter()
        dur = Durability(d, TOKEN)
        st = SchedulerState(no_worker_timeout=None)
        dur.restore(st, 0.0)
        in_process = time.perf_counter() - t0
        held = len(st.tasks)
        dur.close()
        env = {**os.environ, "TIDEPOOL_TOKEN": TOKEN}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "scheduler", "--state-dir", d, "--port", "0",
                                 "--no-dashboard"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        process = time.perf_counter() - t0
        proc.terminate()
        proc.wait(30)
        assert line.startswith("tidepool scheduler at"), line
        return {"tasks": n, "restored_records": held, "in_process_s": in_process, "process_start_s": process,
                "store_bytes": size}  # fmt: skip


def cost(n: int, persist: bool) -> float:
    """Tasks per second through the state machine (submit, run, finish, release)."""
    with tempfile.TemporaryDirectory() as d:
        st = SchedulerState(no_worker_timeout=None)
        store = StateStore(d, TOKEN) if persist else None
        p = Persister(store, st) if store is not None else None
        payload = serialize((1, 2))
        for i in range(8):
            st.handle(ev.WorkerJoin(f"w{i}", f"tcp://h:{i}", {"cpu": 1.0}, 0.0))
        t0 = time.perf_counter()
        batch = 1000
        clock = [0.0]

        def apply(evs: list[ev.Event]) -> None:
            clock[0] += 0.5  # a tick after every step: every task is written new, finished, then deleted
            evs = [*evs, ev.Tick(clock[0])]
            cmds = st.handle_many(evs)
            if p is not None:
                p.observe(evs, cmds)

        for start in range(0, n, batch):
            keys = [f"t-{i}" for i in range(start, start + batch)]
            apply([ev.UpdateGraph("client-1", [ev.TaskSpec(k, "f", payload, (), {}, 0, "t") for k in keys],
                                  keys, clock[0], {"f": payload} if start == 0 else {})])  # fmt: skip
            while True:
                running = [ts for ts in st.tasks.values() if ts.state == "running"]
                if not running:
                    break
                apply([ev.TaskFinished(ts.worker or "", ts.key, 8, 0.001, clock[0]) for ts in running])
            apply([ev.ReleaseKeys("client-1", keys, clock[0])])
        if store is not None:
            store.drain()
        took = time.perf_counter() - t0
        if store is not None:
            store.close()
        return n / took


def end_to_end(n: int, repeat: int, timeout: float = 600.0) -> dict[str, dict[str, float]]:
    """tasks/s (median of ``repeat``) per workload and setup: in-process, process, process + state dir."""
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    # every setup's workers import ``throughput`` (its task functions) too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    import throughput as tp
    from tidepool import Client, LocalCluster

    class ProcessBackend(tp.TidepoolBackend):
        durable = True

        def __init__(self) -> None:
            self._dir = tempfile.mkdtemp(prefix="tidepool-bench-state-")
            self.cluster = LocalCluster(2, slots=1, state_dir=self._dir, durable=self.durable)
            self.client = Client(self.cluster)

        def close(self) -> None:
            import shutil

            super().close()
            shutil.rmtree(self._dir, ignore_errors=True)

    class PlainProcessBackend(ProcessBackend):
        durable = False

    setups: dict[str, type[tp.TidepoolBackend]] = {"in-process": tp.TidepoolBackend, "process": PlainProcessBackend,
                                                   "process --state-dir": ProcessBackend}  # fmt: skip
    m = tp.Measurements()
    names = list(setups)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            b = setups[name]()
            try:
                for fn in tp.WORKLOADS.values():
                    fn(b, min(tp.WARMUP_TASKS, n), timeout)
                tp.wait_idle(b)
                line = []
                for workload, fn in tp.WORKLOADS.items():
                    seconds, tasks = fn(b, n, timeout)
                    m.add(workload, name, seconds, tasks)
                    line.append(f"{workload} {tasks / seconds:,.0f}/s")
                    tp.wait_idle(b)
                print(f"  rep {rep + 1}/{repeat} {name:20} " + "  ".join(line), flush=True)
            finally:
                b.close()
            time.sleep(0.25)
    return {w: {name: m.rate(w, name) for name in names} for w in tp.WORKLOADS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--cost-tasks", type=int, default=50_000, help="0: skip the state-machine cost")
    ap.add_argument("--end-to-end", type=int, default=0, metavar="N", help="tasks per workload (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")
    print("| graph tasks | records restored | open+load+rebuild | process start to listening | store size |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        r = restart(n)
        print(f"| {n:,} | {r['restored_records']:,} | {r['in_process_s']:.2f} s | {r['process_start_s']:.2f} s | "
              f"{r['store_bytes'] / 1e6:.1f} MB |")  # fmt: skip
    if args.end_to_end:
        rates = end_to_end(args.end_to_end, args.repeat)
        print(f"\nend to end, {args.end_to_end:,} tasks per workload, median of {args.repeat} "
              f"(load {os.getloadavg()[0]:.1f} at the end):")  # fmt: skip
        print("| workload | in-process LocalCluster | scheduler process | scheduler process --state-dir | "
              "ratio (--state-dir / process) |")  # fmt: skip
        print("|---|---|---|---|---|")
        for w, r in rates.items():
            print(f"| {w} | {r['in-process']:,.0f}/s | {r['process']:,.0f}/s | {r['process --state-dir']:,.0f}/s | "
                  f"{r['process --state-dir'] / r['process']:.2f}x |")  # fmt: skip
    if not args.cost_tasks:
        return
    plain = cost(args.cost_tasks, False)
    durable = cost(args.cost_tasks, True)
    print(f"\nstate-machine throughput, {args.cost_tasks:,} no-op tasks: plain {plain:,.0f}/s, "
          f"with the persister {durable:,.0f}/s ({durable / plain:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
