"""Chaos of the network: a graph on test hosts whose links are cut and healed while it runs.

The scheduler runs on host ``s`` and one worker on each of ``a``, ``b`` and ``c``: four Linux network
namespaces on this machine, routed by the root namespace (``tests/netns.py``; needs root).  A cut is
an ``ip rule ... blackhole`` in the router, so packets between two hosts vanish in both directions
with no RST and no FIN: what a real partition looks like to TCP.

The graph: ``--tasks`` leaves ``square(i)`` (each sleeps ``--pause``), pairwise ``mix`` of
neighbouring leaves (values move between hosts), and a tree of sums down to one value; the client
holds every 50th leaf and mix.  The expected answer is computed locally in plain Python.

A calm run is the makespan baseline.  In a chaos run a thread, every ``--interval`` x U(0.5, 1.5)
seconds, cuts one random pair (a worker from the scheduler, or two workers from each other) for
U(2, 8) s and heals it, until the final value is in.  Workers the scheduler removed after their
silence exit when they find their connection gone; the run tops the pool up to three workers
(a new worker process on the host that lost its own).

Columns: ``wrong`` final values that differ; ``hangs`` runs with no final value within
``--timeout``; ``held lost`` held futures that raised or gave a wrong value; ``cuts`` partitions
made; ``makespan`` first submit to final value (median of the chaos runs) and its ``ratio`` to the
calm run.  Delay and loss (``tc netem``) are used when the kernel has the netem qdisc; this
machine's has not, so the network mode cuts links only (said in the output).

Run from the repository root, as root::

    .venv/bin/python benchmarks/chaos.py --network [--runs 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402
import tidepool  # noqa: E402
from test_cli import Proc, clean_env, tidepool_cmd  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ADDRESS = re.compile(r"tidepool scheduler at (tcp://\S+)")
WORKERS = ("a", "b", "c")


def square(i: int, pause: float) -> int:
    time.sleep(pause)
    return i * i


def mix(x: int, y: int, i: int) -> int:
    return (x * 31 + y * 17 + i) % 1_000_003


def total(*xs: int) -> int:
    return sum(xs)


def expected(n: int) -> tuple[int, list[int], list[int]]:
    leaves = [i * i for i in range(n)]
    mixes = [mix(leaves[i], leaves[(i + 1) % n], i) for i in range(n)]
    level = mixes
    while len(level) > 1:
        level = [sum(level[i : i + 4]) for i in range(0, len(level), 4)]
    return level[0], leaves, mixes


@contextmanager
def cluster(h: netns.Hosts, tmp: Path) -> Iterator[tuple[tidepool.Client, dict[str, Proc], str, Path]]:
    token = tmp / "token"
    env = {**clean_env(), "TIDEPOOL_FETCH_TIMEOUT": "3"}
    sched = Proc(h.run("s", tidepool_cmd("scheduler", "--host", h.addr("s"), "--port", "8786", "--token-file",
                                         str(token), "--heartbeat-timeout", "4")), tmp / "s.err", env)  # fmt: skip
    workers: dict[str, Proc] = {}
    try:
        address = sched.wait_for_line(ADDRESS).group(1)
        for name in WORKERS:
            workers[name] = start_worker(h, name, address, token, tmp, env)
        with tidepool.Client(address, token=token.read_text().strip(), timeout=30) as client:
            client.wait_for_workers(len(WORKERS), timeout=60)
            yield client, workers, address, token
    finally:
        for p in [*workers.values(), sched]:
            p.reap()


def start_worker(h: netns.Hosts, name: str, address: str, token: Path, tmp: Path, env: dict[str, str]) -> Proc:
    return Proc(h.run(name, tidepool_cmd("worker", address, "--token-file", str(token), "--name", name,
                                         "--slots", "1", "--heartbeat-interval", "0.5")),
                tmp / f"{name}-{time.monotonic_ns()}.err", env)  # fmt: skip


def one_run(h: netns.Hosts, args: argparse.Namespace, tmp: Path, chaos: bool, seed: int) -> dict[str, float]:
    want, leaves, mixes = expected(args.tasks)
    rng = random.Random(seed)
    with cluster(h, tmp) as (client, workers, address, token):
        t0 = time.monotonic()
        lf = [client.submit(square, i, args.pause, pure=False) for i in range(args.tasks)]
        mx = [client.submit(mix, lf[i], lf[(i + 1) % args.tasks], i) for i in range(args.tasks)]
        level = mx
        while len(level) > 1:
            level = [client.submit(total, *level[i : i + 4]) for i in range(0, len(level), 4)]
        held = [(f, leaves[i]) for i, f in enumerate(lf) if i % 50 == 0]
        held += [(f, mixes[i]) for i, f in enumerate(mx) if i % 50 == 0]
        del lf, mx
        done = threading.Event()
        cuts = 0

        def chaos_thread() -> None:
            nonlocal cuts
            env = {**clean_env(), "TIDEPOOL_FETCH_TIMEOUT": "3"}
            while not done.wait(args.interval * rng.uniform(0.5, 1.5)):
                a = rng.choice(WORKERS)
                b = rng.choice([x for x in (*WORKERS, "s") if x != a])
                h.cut(a, b)
                cuts += 1
                done.wait(rng.uniform(2, 8))
                h.heal(a, b)
                alive = {w["name"] for w in client.scheduler_info()["workers"]}
                for name in WORKERS:  # a worker the scheduler dropped exits; start a new one there
                    if name not in alive and workers[name].popen.poll() is not None:
                        workers[name] = start_worker(h, name, address, token, tmp, env)

        t = threading.Thread(target=chaos_thread, daemon=True)
        if chaos:
            t.start()
        result: dict[str, float] = {"wrong": 0, "hang": 0, "held_lost": 0}
        try:
            got = level[0].result(timeout=args.timeout)
            result["wrong"] = float(got != want)
        except TimeoutError:
            result["hang"] = 1
        except Exception as exc:  # noqa: BLE001 - an error is a result too; counted as wrong
            print(f"  final value raised {type(exc).__name__}: {exc}")
            result["wrong"] = 1
        result["makespan"] = time.monotonic() - t0
        done.set()
        if chaos:
            t.join(30)
        for f, v in held:
            try:
                result["held_lost"] += f.result(timeout=60) != v
            except Exception:  # noqa: BLE001
                result["held_lost"] += 1
        result["cuts"] = cuts
        return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="chaos runs (one calm run besides)")
    ap.add_argument("--tasks", type=int, default=2000, help="leaves (the graph has ~2.3x as many tasks)")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds each leaf sleeps")
    ap.add_argument("--interval", type=float, default=3.0, help="mean seconds between cuts")
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline per run, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true", help="rewrite the network-chaos part of docs/benchmarks.md")
    args = ap.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"network chaos needs test hosts: {why}")
        return 2
    netem = netns.netem_unavailable()
    import tempfile

    with netns.hosts("s", *WORKERS) as h, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        calm = one_run(h, args, tmp, chaos=False, seed=args.seed)
        print(f"calm: makespan {calm['makespan']:.1f} s, wrong {calm['wrong']:.0f}, hang {calm['hang']:.0f}")
        runs = []
        for r in range(args.runs):
            res = one_run(h, args, tmp, chaos=True, seed=args.seed + r + 1)
            runs.append(res)
            print(f"chaos run {r + 1}: makespan {res['makespan']:.1f} s, cuts {res['cuts']:.0f}, wrong "
                  f"{res['wrong']:.0f}, hang {res['hang']:.0f}, held lost {res['held_lost']:.0f}")  # fmt: skip
    ok = [r["makespan"] for r in runs if not r["hang"]]
    med = statistics.median(ok) if ok else float("nan")
    row = (f"| tidepool | {len(runs)} | {sum(r['cuts'] for r in runs):.0f} | {sum(r['wrong'] for r in runs):.0f} | "
           f"{sum(r['hang'] for r in runs):.0f} | {sum(r['held_lost'] for r in runs):.0f} | {med:.1f} s | "
           f"{calm['makespan']:.1f} s | {med / calm['makespan']:.2f} |")  # fmt: skip
    header = ("| scheduler | runs | cuts | wrong | hangs | held lost | makespan (chaos) | calm | ratio |\n"
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    print(header)
    print(row)
    note = (f"Graph: {args.tasks} leaves, ~{int(args.tasks * 2.33)} tasks; 3 one-slot workers on hosts a, b, c; "
            f"a cut every {args.interval:g} s x U(0.5, 1.5) lasting U(2, 8) s; fetch timeout 3 s, heartbeat "
            f"time-to-live 4 s. Delay/loss: {'not measured: ' + netem if netem else 'netem available'}.")  # fmt: skip
    print(note)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        text = path.read_text()
        section = f"<!-- chaos-network:start -->\n{header}\n{row}\n\n{note}\n<!-- chaos-network:end -->"
        if "<!-- chaos-network:start -->" in text:
            text = re.sub(r"<!-- chaos-network:start -->.*<!-- chaos-network:end -->", lambda _: section, text,
                          flags=re.S)  # fmt: skip
        else:
            text += "\n\n## Chaos of the network (partitions between test hosts)\n\n" + section + "\n"
        path.write_text(text)
    bad = any(r["wrong"] or r["hang"] or r["held_lost"] for r in [calm, *runs])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
