"""``tidepool demo``: an elastic run on this machine, printed as it happens.

A local cluster starts with **no** workers and lets the scheduler scale itself (up to
``max_workers``): a wide phase of tasks, a long reduction, a second wide phase and a final
reduction.  The demo prints each scaling decision with its reason, a timeline of how many workers
were held versus busy, and checks the result against the serial answer.  Along the way one worker
is killed (SIGKILL) to show lost results being recomputed from lineage.
"""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.table import Table

from tidepool.client import Client
from tidepool.cluster import LocalCluster
from tidepool.telemetry.journal import busy_worker_seconds, held_worker_seconds


def square(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x * x


def total(xs: list[int], seconds: float) -> int:
    time.sleep(seconds)
    return sum(xs)


def shift(base: int, i: int, seconds: float) -> int:
    time.sleep(seconds)
    return base + i


def run_demo(workers: int = 4, tasks: int = 40, task_seconds: float = 0.25, kill: bool = True,
             dashboard: bool = False, hold: float = 0.0) -> int:  # fmt: skip
    con = Console()
    t0 = time.monotonic()

    def say(msg: str) -> None:
        con.print(f"[dim]{time.monotonic() - t0:6.2f}s[/dim] {msg}")

    with LocalCluster(n_workers=0, dashboard=True if dashboard else None) as cluster, Client(cluster) as client:
        scaler = cluster.adapt(maximum=workers)
        if dashboard and hold:
            say(f"open {cluster.dashboard_link} now: the run starts in {hold:g}s")
            time.sleep(hold)
        journal = scaler.journal
        clock = cluster.scheduler.clock
        start = clock()
        say(f"cluster up at {cluster.address} with [bold]0[/bold] workers; autoscaling to at most {workers}")
        phase1 = client.map(square, range(tasks), [task_seconds] * tasks)
        reduce1 = client.submit(total, phase1, 1.5)
        phase2 = [client.submit(shift, reduce1, i, task_seconds) for i in range(tasks)]
        final = client.submit(total, phase2, 0.1)
        say(f"submitted {2 * tasks + 2} tasks: {tasks} wide, a 1.5 s reduce, {tasks} wide, a final reduce")

        seen = 0
        stop = threading.Event()

        def narrate() -> None:
            while not stop.wait(0.05):
                drain()
            drain()

        def drain() -> None:
            nonlocal seen
            recs = journal.since(seen)
            seen = journal.end
            for r in recs:
                if r["kind"] == "launch":
                    say(f"[green]launch {r['nodes']}[/green] ({r['reason'][:110]})")
                elif r["kind"] == "retire":
                    say(f"[yellow]retire {r['worker']}[/yellow] ({r['reason'][:110]})")

        narrator = threading.Thread(target=narrate, daemon=True)
        narrator.start()
        if kill:
            phase1[0].result()
            victims = [w for w in cluster.workers]
            if victims:
                say(f"[red]killing worker {victims[0]} (SIGKILL)[/red]: its results get recomputed")
                cluster.kill_worker(victims[0])
        value = final.result()
        end = clock()
        stop.set()
        narrator.join()
        expected = sum(sum(x * x for x in range(tasks)) + i for i in range(tasks))
        ok = value == expected
        say(f"result {value} (serial answer {expected}): {'[bold green]OK' if ok else '[bold red]MISMATCH'}")
        info = client.scheduler_info()
        recs = journal.records
        held = held_worker_seconds(recs, start, end)
        busy = busy_worker_seconds([r for r in recs if r["kind"] == "task"])
        table = Table(title="elastic run")
        for col in ("makespan", "held w-s", "busy w-s", "busy/held", "launched", "retired", "recomputed"):
            table.add_column(col)
        table.add_row(f"{end - start:.1f}s", f"{held:.1f}", f"{busy:.1f}", f"{busy / held:.0%}" if held else "-",
                      str(sum(r["nodes"] for r in recs if r["kind"] == "launch")),
                      str(sum(1 for r in recs if r["kind"] == "retire")), str(info["counters"]["recomputed"]))  # fmt: skip
        con.print(table)
        if dashboard and hold:
            say(f"the dashboard stays up {hold:g}s more (the pool shrinks meanwhile)")
            time.sleep(hold)
        return 0 if ok else 1
