"""Command line: ``tidepool scheduler``, ``tidepool worker ADDRESS``, ``tidepool demo``, ``tidepool simulate``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from tidepool.comm.auth import read_token_file, token_from_env, write_token_file
from tidepool.errors import ConfigError, TidepoolError
from tidepool.loop import new_event_loop


def _token(args: argparse.Namespace) -> str:
    if getattr(args, "token_file", None):
        return read_token_file(args.token_file)
    tok = token_from_env()
    if not tok:
        raise ConfigError("no token: pass --token-file, or set TIDEPOOL_TOKEN / TIDEPOOL_TOKEN_FILE")
    return tok


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: signals a command's loop may handle that must not kill it once it is shutting down (a worker's
#: preemption notice: their default action ends the process); they stay ignored after return
_LATE_NOTICES = (signal.SIGUSR1,)
#: set in a worker process that re-executed itself over its memory limit: how many times it did
RESTARTS_ENV = "TIDEPOOL_WORKER_RESTARTS"


def _ignore_late_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT after ``main`` has ended: the process is already on its way out."""


def _run_until_signal(coro_main: Coroutine[Any, Any, Any]) -> None:
    """Run ``coro_main`` until it ends or SIGTERM/SIGINT arrives (then cancel it and return).

    The loop's signal handlers write to a wakeup socket that ``loop.close()`` closes *before* it
    removes the handlers, so a signal in that gap (say the provider's SIGTERM reaching a worker that
    is already shutting down) printed "Exception ignored when trying to write to the signal wakeup
    fd ... Bad file descriptor".  So the handlers come off while the loop still runs, the wakeup fd
    is cleared even if other handlers stay on the loop (a worker's SIGUSR1), and a late signal
    during the rest of the teardown is ignored; the previous handlers are back on return.
    """
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    replaced: list[signal.Signals] = []

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        installed = []
        for sig in _STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
        try:
            main_task: asyncio.Task[Any] = loop.create_task(coro_main)
            stop_task = loop.create_task(stop.wait())
            await asyncio.wait([main_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
            stop_task.cancel()
            if main_task.done():
                main_task.result()  # re-raise why it ended (wrong token, port in use, ...)
                return
            main_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main_task
        finally:
            for sig in installed:  # also clears the wakeup fd once none is left
                loop.remove_signal_handler(sig)
                signal.signal(sig, _ignore_late_signal)
                replaced.append(sig)
            for sig in _LATE_NOTICES:  # a worker's notice handler: off too, and a late one ignored
                with contextlib.suppress(ValueError, RuntimeError):
                    if loop.remove_signal_handler(sig):
                        signal.signal(sig, _ignore_late_signal)
            if installed:  # any other handler on the loop would keep the wakeup fd set
                with contextlib.suppress(ValueError):
                    signal.set_wakeup_fd(-1)

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as run:
            run.run(runner())
    finally:
        for sig in replaced:
            handler = previous[sig]
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _parsed(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str, rule: str) -> Any:
    """``convert(text)`` if it converts and passes ``ok``; else an argparse error naming the rule."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def _positive(text: str) -> float:
    return float(_parsed(text, float, lambda v: 0 < v < math.inf, "a number of seconds",
                         "a positive number of seconds"))  # fmt: skip


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (0: none)."""
    return float(_parsed(text, float, lambda v: 0 <= v < math.inf, "a number of seconds", "a number of seconds >= 0"))


def _port(text: str) -> int:
    # (-1 said the address "needs a port": a bug hunt)
    return int(_parsed(text, int, lambda v: 0 <= v <= 65535, "a port number", "a port 0..65535 (0: any free port)"))


def _finite(text: str) -> float:
    """A finite number of seconds (nan meant "wait forever", silently: a bug hunt)."""
    return float(_parsed(text, float, math.isfinite, "a number of seconds",
                         "a finite number of seconds (0: wait forever)"))  # fmt: skip


def _at_least(least: int) -> Any:
    """A whole number >= ``least``."""

    def parse(text: str) -> int:
        return int(_parsed(text, int, lambda v: v >= least, "a whole number", f"a whole number >= {least}"))

    return parse


def _tls(args: argparse.Namespace, fallback: dict[str, Any] | None = None) -> Any:
    """A TLSConfig from --tls-ca-file/--tls-cert/--tls-key (else the cluster file's [scheduler]
    tls_* keys, else the TIDEPOOL_TLS_* environment), or None for plain TCP."""
    from tidepool.comm.tls import TLSConfig

    fb = fallback or {}
    ca = args.tls_ca_file or fb.get("tls_ca_file")
    cert = args.tls_cert or fb.get("tls_cert")
    key = args.tls_key or fb.get("tls_key")
    if ca or cert or key:
        if not (ca and cert and key):
            raise ConfigError("TLS needs --tls-ca-file, --tls-cert and --tls-key together")
        return TLSConfig(ca, cert, key)
    return TLSConfig.from_env()


def cmd_certs(args: argparse.Namespace) -> int:
    from tidepool.comm.tls import make_certs

    present = [n for n in ("ca.pem", "cert.pem", "key.pem") if (Path(args.directory) / n).exists()]
    if present and not args.force:  # a new CA would lock out every machine given the old one's files
        raise ConfigError(f"{args.directory} already holds {', '.join(present)}: certificates other machines may "
                          "use; pick another directory, or pass --force to replace them with a new CA")  # fmt: skip
    cfg = make_certs(args.directory, hosts=args.host)
    print(f"CA {cfg.ca}\ncertificate {cfg.cert}\nkey {cfg.key} (mode 600)")
    print(f"use: --tls-ca-file {cfg.ca} --tls-cert {cfg.cert} --tls-key {cfg.key}")
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from tidepool.comm.auth import new_token
    from tidepool.scheduler.server import Scheduler

    cfg = None
    if args.cluster:
        from tidepool.config import load

        cfg = load(args.cluster)
        # a flag given on the command line wins over the file, as for TLS and --state-dir (the
        # file's port silently replaced --port, and workers started against it could not connect)
        args.host = args.host if args.host is not None else cfg.scheduler.get("host")
        args.port = args.port if args.port is not None else cfg.scheduler.get("port")
        args.state_dir = args.state_dir or cfg.scheduler.get("state_dir")
        if args.reconnect_window is None:
            args.reconnect_window = cfg.scheduler.get("reconnect_window")
    args.host = "127.0.0.1" if args.host is None else args.host
    args.port = 8786 if args.port is None else args.port
    if args.exit_with_parent is not None and args.exit_with_parent != os.getppid():
        raise ConfigError(f"--exit-with-parent {args.exit_with_parent}: that is not this process's parent (its "
                          f"parent is {os.getppid()}); give the pid of the process that starts the scheduler")  # fmt: skip
    if args.journal:  # before the address line: a script reading it would think the scheduler is up
        from tidepool.telemetry.report import check_output

        check_output(args.journal, "--journal")
    # with a state directory and no token given, the store's token is used (same cluster again)
    given = token_from_env()
    # a token file that holds a token already is read, never overwritten: workers and clients given
    # a copy of it (or a scheduler restarted on it) keep working
    kept = bool(args.token_file and _holds_text(args.token_file))
    if kept:
        held = read_token_file(args.token_file)
        if given and given != held:  # (it overwrote the file with the environment's: a bug hunt)
            raise ConfigError(f"the token in --token-file {args.token_file} differs from the one in TIDEPOOL_TOKEN / "
                              "TIDEPOOL_TOKEN_FILE; the file is never overwritten: unset the variable, or give "
                              "a --token-file that is empty or does not exist yet")  # fmt: skip
        given = held
    token = given or ("" if args.state_dir else new_token())

    async def main() -> None:
        extra: dict[str, Any] = {}
        if args.no_worker_timeout is not None:  # 0 (or less): wait for a worker forever
            extra["no_worker_timeout"] = args.no_worker_timeout if args.no_worker_timeout > 0 else None
        if args.allowed_failures is not None:
            extra["allowed_failures"] = args.allowed_failures
        tls = _tls(args, cfg.scheduler if cfg is not None else None)
        scheme = "tls" if tls is not None else "tcp"
        if args.state_dir:
            extra.update(state_dir=args.state_dir, reconnect_window=args.reconnect_window,
                         recovery_wait=args.recovery_wait)
        s = await Scheduler(f"{scheme}://{args.host}:{args.port}", token or None,
                            heartbeat_timeout=args.heartbeat_timeout, tls=tls, **extra).start()  # fmt: skip
        tok = s.token
        dash = None
        if args.dashboard and not args.no_dashboard:
            from tidepool.dashboard import start_dashboard

            dash = await start_dashboard(s, args.dashboard, lambda: scaler)
        if args.token_file and not kept:
            write_token_file(args.token_file, tok)
        print(f"tidepool scheduler at {s.address}", flush=True)  # the first line (scripts read it)
        if args.token_file:
            print(f"token {'read from' if kept else 'written to'} {args.token_file} (workers: --token-file "
                  f"{args.token_file})", flush=True)  # fmt: skip
        elif given:  # the user has it: a token is never printed where a log may keep it
            print("token: the one given in TIDEPOOL_TOKEN / TIDEPOOL_TOKEN_FILE (not shown)", flush=True)
        else:
            print(f"token: {tok}  (workers: export TIDEPOOL_TOKEN=...)", flush=True)
        if dash is not None:
            # the link carries the token only where the token itself was just printed (a bug hunt:
            # a token from the environment or a file, "not shown", was in the next line's link)
            shown = not args.token_file and not given
            tail = "" if shown or not dash.require_token else "  (add ?token=<the token>, or send Authorization: Bearer)"
            print(f"tidepool dashboard at {dash.link if shown else dash.address}{tail}", flush=True)
        scaler = None
        plain_journal = None
        if cfg is None and args.journal:  # no autoscaling: still journal workers and tasks
            from tidepool.telemetry.journal import Journal

            plain_journal = Journal(args.journal)
            plain_journal.record("journal-start", s.clock(), address=s.address)
            plain_journal.follow(s)
        if cfg is not None:
            from tidepool.scaling.autoscaler import AutoScaler
            from tidepool.scaling.controller import ScalingController
            from tidepool.telemetry.journal import Journal

            # a durable scheduler adopts the instances its provider still lists (docs/recovery.md)
            restored = s.durable.instances if s.durable is not None else None
            from tidepool.scaling.limits import on_this_clock

            cost = on_this_clock(s.durable.cost, s.clock(), time.time()) if s.durable is not None else None
            controller = ScalingController(cfg.node_types, cfg.make_policy(), **cfg.autoscaler, restored=restored,
                                           restored_cost=cost)  # fmt: skip
            provider = cfg.make_provider(s.address, tok, tls)
            if s.durable is not None and hasattr(provider, "remember_in"):  # the local provider's processes
                provider.remember_in(os.path.join(args.state_dir, "local-workers"))
            if s.durable is not None and hasattr(provider, "tag_with"):  # Slurm jobs, SSH workers: re-found by a tag
                from tidepool.providers.slurm import cluster_tag

                provider.tag_with(cluster_tag(tok))
            scaler = await AutoScaler(s, provider, controller, journal=Journal(args.journal)).start()
            print(f"autoscaling with node types {[nt.name for nt in cfg.node_types]} "
                  f"({cfg.provider.get('kind', 'local')} provider)", flush=True)  # fmt: skip
        try:
            if args.exit_with_parent:  # LocalCluster(state_dir=...): not left running when its program dies
                while os.getppid() == args.exit_with_parent:
                    await asyncio.sleep(1.0)
                print(f"its parent process {args.exit_with_parent} exited: stopping", flush=True)
            else:
                await asyncio.Event().wait()
        finally:
            if scaler is not None:
                await scaler.close()
                aclose = getattr(scaler.provider, "close_async", None)  # closes in this loop (SSH)
                close = getattr(scaler.provider, "close", None)
                if aclose is not None:
                    await aclose()
                elif close is not None:
                    close()
            await s.close()
            if plain_journal is not None:
                plain_journal.close()

    _run_until_signal(main())
    return 0


#: where this worker process tells its provider why it failed to start (``EXIT_FILE_ENV``, taken out
#: of the environment first thing: a task's own ``tidepool`` command must not write there)
_EXIT_FILE: str | None = None


def cmd_worker(args: argparse.Namespace) -> int:
    from tidepool.providers.base import EXIT_FILE_ENV
    from tidepool.worker.server import Worker
    from tidepool.worker.signals import on_preemption_notice

    global _EXIT_FILE
    _EXIT_FILE = os.environ.pop(EXIT_FILE_ENV, None) or _EXIT_FILE

    if not (math.isfinite(args.heartbeat_interval) and args.heartbeat_interval > 0):
        raise ConfigError(f"--heartbeat-interval must be a positive number of seconds, got {args.heartbeat_interval}")
    token = _token(args)
    try:
        resources = json.loads(args.resources) if args.resources else {}
    except ValueError as exc:
        raise ConfigError(f"--resources must be a JSON object like '{{\"cpu\": 8, \"gpu\": 2}}', "
                          f"got {args.resources!r}: {exc}") from exc  # fmt: skip
    for kv in args.env or []:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ConfigError(f"--env takes KEY=VALUE, got {kv!r}")
        os.environ[key] = value
    if args.workdir:
        try:
            os.chdir(args.workdir)
        except OSError as exc:
            raise ConfigError(f"--workdir {args.workdir!r}: {exc}") from exc

    from tidepool.worker.server import ID_ENV, PORT_ENV

    async def main() -> None:
        on_preemption_notice()  # SIGUSR1 is a notice, not a kill
        w = Worker(args.address, token, slots=args.slots, resources=resources, node_type=args.node_type,
                   name=args.name, worker_id=args.id, heartbeat_interval=args.heartbeat_interval, host=args.listen_host,
                   preload=args.preload, restartable=True, memory_limit=args.memory_limit,
                   memory_share=args.memory_share, spill_dir=args.spill_dir, spill_limit=args.spill_limit,
                   tls=_tls(args), reconnect_window=args.reconnect_window)  # fmt: skip
        await w.start()
        try:
            await w.finished()
        finally:
            await w.close("stopped")
        if w.exit_reason == "memory":  # over its memory limit: come back as a fresh process
            # the new process can tell it is a restart (and how many came before it)
            os.environ[RESTARTS_ENV] = str(int(os.environ.get(RESTARTS_ENV) or 0) + 1)
            os.environ[PORT_ENV] = w.address.rsplit(":", 1)[-1]  # the same address again (workers=[...] pins)
            os.environ[ID_ENV] = w.id  # ... and the same id (the Worker reads it; it took a new random one)
            if _EXIT_FILE:
                os.environ[EXIT_FILE_ENV] = _EXIT_FILE  # (the restarted process tells the provider too)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

    _run_until_signal(main())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tidepool.demo import run_demo

    return run_demo(workers=args.workers, tasks=args.tasks, kill=not args.no_kill, dashboard=args.dashboard,
                    hold=args.hold)  # fmt: skip


def cmd_dashboard(args: argparse.Namespace) -> int:
    """``tidepool dashboard run.jsonl``: the post-mortem page of a finished run (no cluster)."""
    from tidepool.dashboard.replay import serve_replay

    async def main() -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        server: asyncio.Future[Any] = asyncio.ensure_future(serve_replay(args.journal, args.address, ready))
        waiter: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(ready))
        await asyncio.wait([server, waiter], return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            server.result()  # raises what stopped it (a bad journal, a busy port)
        print(f"tidepool post-mortem dashboard for {args.journal} at {ready.result()} (Ctrl-C to stop)", flush=True)
        await server

    _run_until_signal(main())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from tidepool.telemetry.report import (
        check_output,
        format_summary,
        load_records,
        plot_timeline,
        summary,
    )
    from tidepool.telemetry.trace import write_chrome_trace

    check_output(args.output, "-o", plot=True)
    if args.trace:
        check_output(args.trace, "--trace")
    records = load_records(args.journal)
    if not any(isinstance(r.get("t"), (int, float)) for r in records):  # (zeros and an empty plot: a bug hunt)
        raise ConfigError(f"{args.journal}: the journal has no timed records: nothing to report (was it written "
                          "by cluster.adapt(journal='run.jsonl') or `tidepool scheduler --journal`?)")  # fmt: skip
    plot_timeline(records, args.output, title=args.title)
    print(f"timeline written to {args.output}")
    if args.trace:
        write_chrome_trace(records, args.trace)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    print(format_summary(summary(records)))
    return 0


# ---- tidepool simulate (the simulator lives in tidepool.sim; this is only its entry point) -----
def cmd_simulate(args: argparse.Namespace) -> int:
    from tidepool.sim.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidepool", description="Elastic task-graph scheduler")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("scheduler", help="run a scheduler")
    s.add_argument("--host", default=None, help="interface to listen on (0.0.0.0 for all; default 127.0.0.1, or "
                   "the cluster file's [scheduler] host)")
    s.add_argument("--port", type=_port, default=None, help="port (default 8786, or the cluster file's [scheduler] port)")
    s.add_argument("--token-file", help="the token's file: read if it holds one, else a new token is written there (mode 600)")
    s.add_argument("--cluster", help="TOML cluster file: node types, provider, policy (autoscaling)")
    s.add_argument("--journal", help="write the event journal (JSON lines) to this file (one kept there before is moved to FILE.1)")
    s.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="stop gracefully once process PID (its parent) exits; LocalCluster(state_dir=...) "
                        "passes its own pid, so a killed program leaves no scheduler behind")  # fmt: skip
    s.add_argument("--dashboard", nargs="?", const="127.0.0.1:", default="127.0.0.1:", metavar="HOST:PORT",
                   help="where to serve the live dashboard and /metrics (on by default: 127.0.0.1, port "
                        "8787 or the next free one; any other host needs the token in the link)")  # fmt: skip
    s.add_argument("--no-dashboard", action="store_true", help="do not serve the dashboard")
    s.add_argument("--heartbeat-timeout", type=_positive, default=None,
                   help="seconds a connected worker may stay silent before it is removed (default 300)")
    s.add_argument("--allowed-failures", type=_at_least(0), default=None,
                   help="worker deaths a task may be blamed for (it was executing there) before it fails "
                        "with KilledWorkerError (default 3)")
    s.add_argument("--no-worker-timeout", type=_finite, default=None,
                   help="without autoscaling: seconds a task may wait for a worker with its resources "
                        "before it fails (default 60; 0 waits forever)")
    s.add_argument("--state-dir", default=None,
                   help="make the scheduler durable: keep the graph, outcomes, token and address here, and "
                        "resume from them when started again (docs/recovery.md)")  # fmt: skip
    s.add_argument("--reconnect-window", type=_positive, default=None,
                   help="with --state-dir: seconds workers and clients keep retrying a restarted scheduler "
                        "(default 300)")  # fmt: skip
    s.add_argument("--recovery-wait", type=_positive, default=None,
                   help="with --state-dir: seconds a restarted scheduler waits for the workers it had before "
                        "recomputing what they held (default 10)")  # fmt: skip
    _tls_flags(s)
    s.set_defaults(fn=cmd_scheduler)

    w = sub.add_parser("worker", help="run a worker that joins a scheduler")
    add_worker_arguments(w)
    w.set_defaults(fn=cmd_worker)

    c = sub.add_parser("certs", help="make a self-signed CA and a certificate for a quick TLS start")
    c.add_argument("directory", help="where to write ca.pem, cert.pem, key.pem")
    c.add_argument("--host", action="append", default=[], help="extra host name or IP for the certificate (repeatable)")
    c.add_argument("--force", action="store_true", help="replace certificates already in the directory (a new CA)")
    c.set_defaults(fn=cmd_certs)

    d = sub.add_parser("demo", help="run a demo graph on a local elastic cluster")
    d.add_argument("--workers", type=_at_least(1), default=4, help="most workers the autoscaler may start")
    d.add_argument("--tasks", type=_at_least(0), default=40, help="tasks per wide phase")
    d.add_argument("--no-kill", action="store_true", help="do not kill a worker mid-run")
    d.add_argument("--dashboard", action="store_true", help="serve the live dashboard (the link is printed)")
    d.add_argument("--hold", type=_seconds, default=0.0,
                   help="with --dashboard: seconds to wait before the run (to open the page) and after it")
    d.set_defaults(fn=cmd_demo)

    db = sub.add_parser("dashboard", help="serve the dashboard of a finished run from its journal (post-mortem)")
    db.add_argument("journal", help="journal file, e.g. from cluster.adapt(journal='run.jsonl')")
    db.add_argument("--address", default="127.0.0.1:", metavar="HOST:PORT",
                    help="where to serve it (default 127.0.0.1, port 8787 or the next free one)")
    db.set_defaults(fn=cmd_dashboard)

    r = sub.add_parser("report", help="plot a scaling journal (JSON lines) and print its summary")
    r.add_argument("journal", help="journal file, e.g. from cluster.adapt(journal='run.jsonl')")
    r.add_argument("-o", "--output", default="timeline.png", help="plot file (.png, .svg, .pdf)")
    r.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace (JSON) here")
    r.add_argument("--title", default=None)
    r.set_defaults(fn=cmd_report)

    from tidepool.sim.command import add_arguments as add_simulate_arguments

    sim = sub.add_parser("simulate", help="simulate a graph or a recorded run under scaling policies")
    add_simulate_arguments(sim)
    sim.set_defaults(fn=cmd_simulate)
    return p


def add_worker_arguments(w: argparse.ArgumentParser) -> None:
    """The options of ``tidepool worker`` (also parsed by ``python -m tidepool.worker``)."""
    w.add_argument("address", help="scheduler address, e.g. tcp://10.0.0.5:8786")
    w.add_argument("--slots", type=int, default=None, help="tasks run at once (default: CPU count)")
    w.add_argument("--resources", default="", help='JSON, e.g. \'{"cpu": 8, "gpu": 2}\'')
    w.add_argument("--node-type", default="default")
    w.add_argument("--listen-host", default=None,
                   help="interface its data server listens on (default: loopback for a scheduler on this "
                        "machine, else $TIDEPOOL_WORKER_HOST or every interface)")  # fmt: skip
    w.add_argument("--name", default=None)
    w.add_argument("--id", default=None, help="worker id (default: random)")
    w.add_argument("--memory-limit", default=None,
                   help="bytes this worker may use, e.g. 4GB (default: its memory resource, else the "
                        "machine's memory; 'none': no limit); results spill to disk above 60%%, no task "
                        "starts above 80%%, the worker restarts above 95%% (docs/memory.md)")  # fmt: skip
    w.add_argument("--spill-dir", default=None, help="directory for spilled results (default: the temp dir)")
    w.add_argument("--spill-limit", default=None,
                   help="most bytes of spilled results on disk, e.g. 20GB or 25%% (of the free space), "
                        "none (no cap) or 0 (no spilling); default 50%% of the free space; past it (or when the disk refuses a write) the "
                        "worker stops spilling and keeps results in memory (docs/memory.md)")  # fmt: skip
    w.add_argument("--memory-share", type=_at_least(1), default=1,
                   help="without a limit or memory resource, use the machine's memory divided by this "
                        "(workers sharing the machine)")  # fmt: skip
    w.add_argument("--heartbeat-interval", type=float, default=1.0)
    w.add_argument("--reconnect-window", type=_seconds, default=None,
                   help="seconds to keep retrying a lost scheduler, keeping results and running tasks "
                        "(default: what the scheduler announces: its window with --state-dir, else 0)")  # fmt: skip
    w.add_argument("--token-file", default=None, help="file with the scheduler's token")
    w.add_argument("--preload", action="append", default=[], help="import this module at start (repeatable)")
    w.add_argument("--env", action="append", default=[], help="set KEY=VALUE in the environment (repeatable)")
    w.add_argument("--workdir", default=None, help="working directory of the worker process")
    _tls_flags(w)


def _tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca-file", default=None, help="CA certificate (PEM): TLS for every connection (tls://)")
    p.add_argument("--tls-cert", default=None, help="this process's certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="this process's private key (PEM)")


def _holds_text(path: str) -> bool:
    """``path`` exists and holds more than whitespace (a token someone put there)."""
    try:
        with open(path, "rb") as f:
            return bool(f.read(4096).strip())
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path!r}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    return _run_command(build_parser().parse_args(argv))


def _run_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:  # Ctrl-C (simulate, demo, report): the shell's code, no traceback
        print("tidepool: interrupted", file=sys.stderr)
        return 130
    except TidepoolError as exc:
        print(f"tidepool: error: {exc}", file=sys.stderr)
        _tell_launcher(str(exc))
        return 2
    except BrokenPipeError:  # the reader of our output left (`| head`): nothing to say to it
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush of the dead pipe at exit
        return 1
    except OSError as exc:
        # the address hint only where an address can be the cause (not, e.g., a missing file)
        import errno
        import socket

        networky = isinstance(exc, (ConnectionError, socket.gaierror, TimeoutError)) or exc.errno in (
            errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENETUNREACH, errno.EHOSTUNREACH)  # fmt: skip
        hint = " (is the address right and the port free?)" if networky else ""
        print(f"tidepool: error: {exc}{hint}", file=sys.stderr)
        return 2


def _tell_launcher(message: str) -> None:
    """A worker started by a provider that failed to start: why, for the provider's error (the
    user saw only "exited with code 2" there; the reason was on the worker's stderr)."""
    path = _EXIT_FILE  # set by a worker command only (a review: a task's `tidepool report` wrote there)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(message[:2000])
    except OSError:
        pass  # best effort: the message is on stderr anyway


def worker_main(argv: list[str] | None = None) -> int:
    """``python -m tidepool.worker ...``: the worker command alone, so a worker imports only what it
    needs (not the scheduler, the simulator or the client that :func:`build_parser` reaches)."""
    p = argparse.ArgumentParser(prog="tidepool worker", description="run a worker that joins a scheduler")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_worker_arguments(p)
    p.set_defaults(fn=cmd_worker)
    return _run_command(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
