"""``tidepool simulate``: run a workload under one or more policies and compare them.

The CLI's only edit is a subparser that calls :func:`add_arguments` and :func:`run`; everything
else lives here.  Output: per policy the makespan, held and busy worker-seconds (one definition,
shared with ``tidepool report``: docs/simulation.md), cost by node type, launches and retirements
done, a makespan-versus-cost plot and the decision journal of every run (``OUT/<policy>.jsonl``,
which ``tidepool report`` draws).  How fast the simulation itself ran is printed with ``-v``.
Input is checked first (``sim/validate.py``): every problem is a ConfigError naming its field.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tidepool.errors import ConfigError
from tidepool.sim import validate


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", nargs="?", default=None,
                   help="a built-in workload (bursty, chain, wide, gpu, scale-down, layers, bag), a JSON graph "
                        "or a WfCommons WfFormat trace (.json), a journal of a real run (.jsonl), or module:function")  # fmt: skip
    p.add_argument("--journal", dest="replay", default=None,
                   help="replay the tasks of this recorded run (JSON lines) instead of GRAPH")
    p.add_argument("--cluster", default="local:4",
                   help="cluster file (TOML; optional [simulate] table) or KIND:NODES[:CPUS] with KIND "
                        "local, ssh, cloud or slurm (default local:4)")  # fmt: skip
    p.add_argument("--policy", action="append", default=None,
                   help="policy to run (repeatable): default, backlog, completion, dask, hyperqueue, cluster, "
                        "module:function; options in parentheses, e.g. 'dask(target_duration=10)' "
                        "(default: the cluster file's policy, or default)")  # fmt: skip
    p.add_argument("--param", action="append", default=[], type=_param, metavar="KEY=VALUE",
                   help="keyword argument of the workload function (repeatable), e.g. --param width=100000")
    p.add_argument("--seed", type=int, default=None, help="random seed (start-up delays, sampled durations)")
    p.add_argument("--arrival", choices=("start", "zero"), default="start",
                   help="journal replay: submit each task at its recorded start (default) or all at once")
    p.add_argument("--startup", choices=("journal", "preset"), default="journal",
                   help="journal replay: worker start-up and message delay as measured in the run "
                        "(default, when the journal has them) or the cluster's preset")  # fmt: skip
    p.add_argument("--out", default="sim-out", help="directory for the journals and the plot (default sim-out)")
    p.add_argument("--plot", default=None, help="makespan-vs-cost plot file (default OUT/makespan-cost.png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument("--task-records", choices=("auto", "on", "off"), default="auto",
                   help="one journal record per task (auto: on up to 100,000 tasks)")
    p.add_argument("--interval", type=float, default=None, help="autoscaler period, s (overrides the cluster's)")
    p.add_argument("--forecast-budget", type=float, default=None, metavar="FRACTION",
                   help="give the controller the graph only while forecasts take at most this fraction of the "
                        "simulated time (default: whenever it asks, as the real autoscaler does)")  # fmt: skip
    p.add_argument("--tail", type=float, default=900.0,
                   help="seconds a run may go on after the results while the policy retires workers (default 900)")
    p.add_argument("--until", type=float, default=30 * 86400.0, help="stop every run at this simulated time")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    p.add_argument("--max-tasks", type=int, default=None,
                   help="refuse graphs of more tasks than this (default 2,000,000; about 1-2 KB of memory each)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("-v", "--verbose", dest="sim_verbose", action="store_true",
                   help="also print how fast each simulation ran (progress, events/s, controller time)")


def run(args: argparse.Namespace) -> int:
    from tidepool.sim.cluster import load_cluster
    from tidepool.sim.engine import Simulation, default_journal_name
    from tidepool.sim.policies import make_policy
    from tidepool.sim.report import perf_lines, plot_cost, render_text, result_json, table_rows
    from tidepool.sim.wfformat import fit_memory
    from tidepool.sim.workload import load_workload

    source = args.replay or args.graph
    if source is None:
        raise ConfigError("tidepool simulate needs a GRAPH (or --journal run.jsonl); e.g. "
                          "tidepool simulate bursty --cluster local:4 --policy default --policy dask")  # fmt: skip
    if args.replay and args.graph:
        raise ConfigError("give either GRAPH or --journal, not both")
    validate.seconds(args.until, "--until", positive=True)
    validate.seconds(args.tail, "--tail")
    from tidepool.telemetry.report import check_output

    if args.plot and not args.no_plot:  # checked now, not after the whole run
        check_output(args.plot, "--plot", plot=True)
    if args.json_out:
        check_output(args.json_out, "--json")
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # (a bare "[Errno 17] File exists": a bug hunt)
        raise ConfigError(f"--out {args.out!r} is a file: give a directory for the journals and the plot "
                          "(created if missing)")  # fmt: skip
    if args.max_tasks is not None and args.max_tasks < 1:
        raise ConfigError(f"--max-tasks must be at least 1, got {args.max_tasks}")
    cluster = load_cluster(args.cluster)
    if args.interval is not None:
        validate.seconds(args.interval, "--interval", positive=True)
        cluster.interval = args.interval
    if args.forecast_budget is not None:
        if not 0 < args.forecast_budget <= 1:  # NaN fails this too
            raise ConfigError(f"--forecast-budget must be a fraction 0 < f <= 1, got {args.forecast_budget}")
        cluster.forecast_budget = args.forecast_budget
    seed = args.seed if args.seed is not None else (cluster.seed if cluster.seed is not None else 0)
    if args.replay and not args.replay.endswith(".jsonl"):
        raise ConfigError(f"--journal expects a JSON-lines journal (.jsonl), got {args.replay!r}")
    workload = load_workload(source, seed=seed, params=dict(args.param), arrival=args.arrival,
                             max_tasks=args.max_tasks)  # fmt: skip
    fit_memory(workload, [nt.resources.get("memory", 0.0) for nt in cluster.node_types])
    longest = max(workload.tasks(), key=lambda t: t.duration, default=None)
    if longest is not None and longest.duration > args.until:
        raise ConfigError(f"task {longest.key!r} lasts {longest.duration:g}s, longer than --until {args.until:g}s: "
                          "the run could never finish; raise --until or fix the duration")  # fmt: skip
    if source.endswith(".jsonl") and args.startup == "journal":  # the run's own start-ups and delays
        from tidepool.sim.replay import calibrate
        from tidepool.telemetry.report import load_records

        workload.notes.extend(calibrate(cluster, load_records(source)))
    names = args.policy or (["cluster"] if cluster.config is not None else ["default"])
    for nt in cluster.node_types:  # as the real scheduler would, launches give up after max(30, 5 x estimate)
        model = cluster.models.get(nt.name)
        if model is not None and max(30.0, 5 * nt.startup_estimate) < model.mean_startup:
            workload.notes.append(
                f"node type {nt.name!r}: startup_estimate {nt.startup_estimate:g}s is far below its start-up "
                f"model's mean {model.mean_startup:.0f}s, so most launches give up after "
                f"{max(30.0, 5 * nt.startup_estimate):.0f}s (as the real scheduler would); set startup_estimate "
                "in the cluster file")  # fmt: skip
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {args.out!r}: {exc.strerror or exc}; give a directory this user may create") from exc
    records = {"on": True, "off": False}.get(args.task_records, workload.n_tasks <= 100_000)
    say = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    # how fast the simulator itself ran is for its developers: only with -v
    verbose = bool(getattr(args, "sim_verbose", False) or getattr(args, "verbose", False)) and not args.quiet
    detail = say if verbose else (lambda s: None)
    say(f"workload {workload.name}: {workload.n_tasks:,} tasks, {workload.total_seconds():,.1f} task-seconds; "
        f"cluster {cluster.describe()}; seed {seed}")  # fmt: skip
    for note in workload.notes:
        say(f"note: {note}")
    results = []
    for name in names:
        policy = make_policy(name, cluster.make_policy() if cluster.config is not None else None)
        path = default_journal_name(args.out, name)
        sim = Simulation(workload, cluster, policy, seed=seed, policy_name=name, journal=path,
                         task_records=records, tail=args.tail, until=args.until, progress=detail)  # fmt: skip
        r = sim.run()
        results.append(r)
        say(f"{name}: done; journal {path}")
        for line in perf_lines(r):
            detail(f"  {line}")
    print(render_text(table_rows(results)))
    for note in workload.notes:
        print(f"note: {note}")
    for r in results:
        for note in r.notes:
            if note not in workload.notes:
                print(f"{r.policy}: {note}")
    if not args.no_plot:
        plot = args.plot or os.path.join(args.out, "makespan-cost.png")
        plot_cost(results, plot)
        print(f"plot written to {plot}")
    print(f"journals in {args.out}/ (draw one with: tidepool report {results[0].journal} -o timeline.png)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([result_json(r) for r in results], f, indent=1)
    broken = [r for r in results if r.policy_errors]
    for r in broken:  # its row is partly the default policy's: not a result for that policy
        print(f"tidepool: error: policy {r.policy!r} raised in {r.policy_errors} rounds (see the note above and "
              f"its journal); fix it before reading its row", file=sys.stderr)  # fmt: skip
    return 0 if all(r.completed and not r.failed_keys and not r.policy_errors for r in results) else 1
