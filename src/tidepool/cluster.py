"""LocalCluster: a scheduler on a private event-loop thread plus worker processes on this machine.

State: the :class:`Scheduler` (running on ``self._loop``), the :class:`LocalProvider` that owns the
worker processes, and a condition the scheduler observer signals whenever workers join or leave, so
``wait_for_workers`` blocks on events instead of polling.  ``close()`` stops the scheduler (which
tells workers to exit) and then makes sure no process is left behind.

A fixed pool stays the size it was asked to be: a worker process of the cluster's own that dies by
itself (a crash, ``os._exit``, the OOM killer, a missed heartbeat) is replaced, as Dask's nanny
does, unless an autoscaler manages the pool, the death was asked for (``kill_worker``), or
replacements keep dying (at most ``MAX_RESTARTS`` in ``RESTART_WINDOW`` seconds).  So a task that
crashes every worker it touches ends in ``KilledWorkerError`` after its allowed failures instead
of leaving an empty pool behind.  A worker that left to restart over its memory limit re-executes
itself under the same id; if its process exits instead, or it is not back within
``MEMORY_RESTART_GRACE`` seconds, it is replaced like a crashed one (``_memory_restarts``, checked
on every scheduler tick).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tidepool.comm.tls import TLSConfig
from tidepool.config import ClusterConfig
from tidepool.config import load as config_load
from tidepool.errors import ConfigError
from tidepool.keywords import check_keywords
from tidepool.loop import ClosesOnExit, LoopThread
from tidepool.providers.base import NeedsAddress
from tidepool.providers.local import LocalProvider
from tidepool.scaling.autoscaler import AutoScaler
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scheduler import events as ev
from tidepool.scheduler.server import Scheduler
from tidepool.telemetry.journal import Journal
from tidepool.worker.peers import listen_host

log = logging.getLogger("tidepool.cluster")


class LocalCluster(ClosesOnExit):
    """``LocalCluster(n_workers=2)``: real worker processes on this machine.

    Each worker runs ``slots`` tasks at once (1 by default) and advertises ``resources`` (default
    ``{"cpu": slots}``; a ``cpu`` given there is the number of slots, and must agree with ``slots``).
    ``restart_crashed=False`` leaves dead workers dead (see the module docstring).
    The live dashboard and ``/metrics`` are served by default on this host at 8787 or the next free
    port (``cluster.dashboard_link``; token-protected off localhost; HTTPS with ``tls``);
    ``dashboard=False`` turns it off, ``"host:port"`` chooses where, ``True`` also prints the link;
    docs/dashboard.md.
    ``memory_limit`` (e.g. ``"1GB"``, ``"none"``) caps each worker: results spill to disk, tasks pause
    and the worker restarts at the levels in docs/memory.md (default: the node type's memory, else
    this machine's memory divided by its cores).
    ``fork_server`` (default on where the platform forks; ``TIDEPOOL_FORK_SERVER=0`` turns the
    default off): workers are forked from a pre-imported process and register in about 0.1 s
    instead of starting a new interpreter (:mod:`tidepool.providers.forkserver`).
    ``spill_limit`` (e.g. ``"20GB"``, ``"25%"`` of
    the free disk, ``"none"``) caps the disk each may spill to (default: half the free space).
    """

    MAX_RESTARTS = 20
    RESTART_WINDOW = 60.0

    def __new__(cls, *args: Any, state_dir: str | None = None, **kwargs: Any) -> Any:
        """``state_dir=``: a durable scheduler in a process of its own that may be killed and
        restarted (:class:`~tidepool.cluster_durable.DurableLocalCluster`, docs/recovery.md)."""
        if state_dir is not None:
            from tidepool.cluster_durable import DurableLocalCluster

            return DurableLocalCluster(*args, state_dir=state_dir, **kwargs)
        return super().__new__(cls)

    #: seconds a worker restarting over its memory limit may take to register again
    MEMORY_RESTART_GRACE = 60.0

    async def __aenter__(self) -> LocalCluster:
        """``async with LocalCluster() as cluster:`` (started already, as the constructor returns)."""
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __init__(self, n_workers: int | None = None, *, slots: int | None = None,
                 resources: dict[str, Any] | None = None, node_type: str = "default",
                 host: str = "127.0.0.1", port: int = 0, heartbeat_interval: float = 1.0,
                 timeout: float = 30.0, env: dict[str, str] | None = None,
                 preload: list[str] | None = None, workdir: str | None = None,
                 restart_crashed: bool = True, memory_limit: int | str | None = None,
                 spill_limit: int | str | None = None, tls: TLSConfig | None = None,
                 dashboard: bool | str | None = None, fork_server: bool | None = None,
                 **scheduler_kwargs: Any) -> None:  # fmt: skip
        if scheduler_kwargs:  # a typo names LocalCluster and the close name, not an internal class
            from tidepool.scheduler.state import SchedulerState

            check_keywords("LocalCluster", scheduler_kwargs, LocalCluster.__init__, Scheduler.__init__,
                           SchedulerState.__init__)  # fmt: skip
        if n_workers is None:
            n_workers = os.cpu_count() or 1
        if not _whole(n_workers):
            raise ConfigError(f"n_workers must be a whole number >= 0, got {n_workers!r}")
        default_resources = local_resources(slots, resources)
        worker_args = worker_memory_args(memory_limit, spill_limit)
        self._loop = LoopThread("tidepool-cluster")
        self._cond = threading.Condition()
        self._preload = list(preload or [])  # named when a worker refuses to start (a preload that fails)
        self.timeout = timeout
        self._req = itertools.count(1)
        self._joined: set[str] = set()  # every worker that ever registered
        self._own: dict[str, NodeType] = {}  # workers this cluster started, with their node type
        self._killed: set[str] = set()  # deaths that were asked for: not replaced
        self._restarts: collections.deque[float] = collections.deque()
        self._memory_restarts: dict[str, float] = {}  # worker -> when it left to restart (memory)
        self.restart_crashed = restart_crashed
        #: with ``tls``, every connection (scheduler, workers, clients, worker to worker) is TLS
        self.tls = tls
        self.scheduler = Scheduler(f"{'tls' if tls else 'tcp'}://{host}:{port}", heartbeat_interval=heartbeat_interval,
                                   tls=tls, local_socket=True, **scheduler_kwargs)  # fmt: skip
        self.scheduler.subscribe(self._observe)
        self._loop.run(self.scheduler.start())
        self.address = self.scheduler.address
        self.token = self.scheduler.token
        #: the live dashboard (on unless ``dashboard=False``); its link is kept (and printed if asked)
        self.dashboard: Any = None
        self.autoscaler: AutoScaler | None = None  # before the dashboard, which asks for it
        self.dashboard_link = ""
        if dashboard is None:
            from tidepool.dashboard.server import available

            if not available():  # on by default, but never the reason a cluster cannot start
                log.warning("no dashboard: aiohttp or prometheus_client is not installed")
                dashboard = False
        if dashboard is not False:
            from tidepool.dashboard import start_dashboard

            where = dashboard if isinstance(dashboard, str) else f"{host}:"
            try:
                self.dashboard = self._loop.run(start_dashboard(self.scheduler, where, lambda: self.autoscaler))
            except BaseException:  # e.g. the extra is not installed: leave no scheduler running
                self._abandon_start()
                raise
            self.dashboard_link = self.dashboard.link
            if dashboard is not None:  # asked for by name: say where it is (not the token: logs keep stderr)
                tail = "  (with its token: cluster.dashboard_link)" if self.dashboard.require_token else ""
                print(f"tidepool dashboard at {self.dashboard.address}{tail}", file=sys.stderr, flush=True)
        if tls is not None:
            env = {**(env or {}), **tls.env()}
        # its own workers connect through the scheduler's Unix socket when it has one (comm/unix.py),
        # its data server where it always listened (the cluster's host), whichever way it registers
        worker_args += ["--listen-host", listen_host(self.address)]
        try:
            self.provider = LocalProvider(self.scheduler.local_address or self.address, self.token, env=env,
                                          cwd=workdir, heartbeat_interval=heartbeat_interval, preload=preload,
                                          extra_args=worker_args, fork_server=fork_server)  # fmt: skip
            self.provider.start_fork_server()  # imports the worker code while the cluster is set up
        except BaseException:
            self._abandon_start()
            raise
        self.default_type = NodeType(node_type, default_resources, max_nodes=10_000)
        self.closed = False
        self._extra_provider: Any = None
        self._close_at_exit()
        if n_workers:
            try:
                self.add_workers(n_workers, wait=True)
            except BaseException:  # no scheduler thread, fork server or worker left behind
                self.close()
                raise

    def _abandon_start(self) -> None:
        """A start that failed before the workers' provider was made: stop what runs so far (the
        dashboard, the scheduler and its sockets, the loop thread), so nothing is left behind."""
        if self.dashboard is not None:
            self._loop.run(self.dashboard.stop(), timeout=10)
        self._loop.run(self.scheduler.close(), timeout=10)
        self._loop.stop()

    def _observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        self._joined.update(e.worker for e in events if isinstance(e, ev.WorkerJoin))
        for e in events:
            if (isinstance(e, ev.WorkerRemove) and not e.graceful and e.worker in self._own
                    and e.cause is not ev.RemoveCause.MEMORY  # it restarts itself
                    and e.cause is not ev.RemoveCause.SETUP_FAILED  # a new one would fail the same setup
                    and e.worker not in self._killed and self.restart_crashed and self.autoscaler is None
                    and not self.closed):  # fmt: skip
                asyncio.get_running_loop().call_soon(self._replace, e.worker, e.reason)
            elif (isinstance(e, ev.WorkerRemove) and e.cause is ev.RemoveCause.MEMORY and e.worker in self._own
                    and self.restart_crashed and self.autoscaler is None and not self.closed):  # fmt: skip
                self._memory_restarts[e.worker] = time.monotonic()
            elif isinstance(e, ev.WorkerJoin):
                self._memory_restarts.pop(e.worker, None)
            elif isinstance(e, ev.Tick) and self._memory_restarts:
                self._check_memory_restarts()
        if any(isinstance(e, (ev.WorkerJoin, ev.WorkerRemove, ev.Tick)) for e in events):
            with self._cond:
                self._cond.notify_all()

    def _check_memory_restarts(self) -> None:
        """Replace workers that left to restart over their memory limit and did not come back."""
        now = time.monotonic()
        for wid, left in list(self._memory_restarts.items()):
            p = self.provider.procs.get(wid)
            exited = p is None or p.proc.poll() is not None
            if exited or now - left > self.MEMORY_RESTART_GRACE or self.closed:
                del self._memory_restarts[wid]
                if not self.closed and wid in self._own:
                    why = "its process exited" if exited else f"not back after {self.MEMORY_RESTART_GRACE:g}s"
                    asyncio.get_running_loop().call_soon(self._replace, wid, f"memory restart failed: {why}")

    def _replace(self, wid: str, reason: str) -> None:
        if self.closed:
            return
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.RESTART_WINDOW:
            self._restarts.popleft()
        if len(self._restarts) >= self.MAX_RESTARTS:
            log.warning("not replacing worker %s (%s): %d workers already replaced in the last %gs; "
                        "something kills every worker (see the tasks' errors)", wid, reason,
                        len(self._restarts), self.RESTART_WINDOW)  # fmt: skip
            return
        self._restarts.append(now)
        nt = self._own.pop(wid)
        self.provider.terminate([wid])  # a hung one (missed heartbeats) must not linger
        rid = f"r{next(self._req)}"
        for new in self.provider.worker_ids(nt, 1, rid):
            self._own[new] = nt
            self.scheduler.expect_workers([new], nt)
        self.provider.launch(nt, 1, rid)
        log.info("worker %s died (%s); started a replacement", wid, reason)

    @property
    def workers(self) -> list[str]:
        """Ids of the workers registered with the scheduler now."""
        return list(self.scheduler.state.workers)

    def add_workers(self, n: int = 1, *, node_type: NodeType | None = None, wait: bool = True) -> list[str]:
        """Start ``n`` worker processes (of ``node_type``); wait for them to register."""
        nt = node_type or self.default_type
        rid = f"r{next(self._req)}"
        ids = self.provider.worker_ids(nt, n, rid)
        self.scheduler.expect_workers(list(ids), nt)
        for wid in ids:
            self._own[wid] = nt
            if self.autoscaler is not None:
                self.autoscaler.adopt(wid)
        self.provider.launch(nt, n, rid)
        if wait:
            self.wait_for_workers(ids)
        return ids

    def scale(self, n: int) -> list[str]:
        """Dask's ``cluster.scale(n)``: a fixed pool of ``n`` workers.  Starts the missing ones (and
        waits for them to register), or retires the newest beyond ``n``, whose values move to the
        survivors first.  Returns the ids started or retired.  A cluster that adapts (after
        :meth:`adapt`) sizes itself: set ``adapt(minimum=, maximum=)`` instead."""
        if not _whole(n):
            raise ConfigError(f"scale() takes a whole number of workers >= 0, got {n!r}")
        if self.autoscaler is not None:
            raise ConfigError("scale() sets a fixed number of workers, but this cluster adapts (adapt() was "
                              "called): its autoscaler sizes the pool within adapt(minimum=, maximum=)")  # fmt: skip

        def pool(s: Scheduler) -> tuple[list[Any], list[str]]:  # on the scheduler's loop, which changes them
            workers = s.state.workers
            now = sorted((w for w in workers.values() if w.state == "running"), key=lambda w: w.seq)
            # this cluster's own workers on their way (a crash replacement, a memory restart) count too
            coming = [wid for wid, p in list(self.provider.procs.items())
                      if wid not in workers and p.proc.poll() is None]  # fmt: skip
            return now, coming

        now, coming = self.run(pool)
        if n > len(now) + len(coming):
            return self.add_workers(n - len(now) - len(coming))
        extra = [w.id for w in now[max(0, n - len(coming)):]]
        if not extra:
            return []
        answers = self.retire_workers(extra)
        retired = [wid for wid in extra if answers.get(wid) == "retired"]
        for wid in retired:
            self.wait_for_removal(wid)
        refused = {wid: answers.get(wid) for wid in extra if wid not in retired}
        if refused:
            log.warning("scale(%d): not retired: %s", n, refused)
        return retired

    def wait_for_workers(self, ids: int | list[str], timeout: float | None = None) -> None:
        """Block until the given worker ids (or at least ``ids`` workers) are registered."""
        deadline = time.monotonic() + (timeout or self.timeout)

        def ok() -> bool:
            present = self.scheduler.state.workers
            if isinstance(ids, int):
                return len(present) >= ids
            return all(w in self._joined for w in ids)  # joined (it may have left again since)

        with self._cond:
            while not ok():
                left = deadline - time.monotonic()
                errors = self.provider.poll_errors()
                if errors:
                    hint = ""
                    if self._preload and any("exited with code 2" in e.message for e in errors):
                        hint = (f" (code 2: a worker refused to start; a preload module that fails to import, "
                                f"one of {self._preload}, does that: its error is in the worker's output above)")
                    raise ConfigError("workers failed to start: " + "; ".join(e.message for e in errors) + hint)
                if left <= 0:
                    raise TimeoutError(f"workers {ids} did not register within {timeout or self.timeout}s")
                self._cond.wait(min(left, 0.5))

    def wait_for_removal(self, wid: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._cond:
            while wid in self.scheduler.state.workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"worker {wid} still registered after {timeout or self.timeout}s")
                self._cond.wait(min(left, 0.5))

    def kill_worker(self, wid: str) -> None:
        """SIGKILL a worker process (failure testing); it is not replaced."""
        self._killed.add(wid)
        self.provider.kill(wid)

    def stop_worker(self, wid: str) -> None:
        """SIGTERM a worker process."""
        self.provider.terminate([wid])

    def retire_workers(self, ids: str | Iterable[str]) -> dict[str, str]:
        """Gracefully retire workers (ids, or one id): their needed data moves to survivors first;
        returns worker id -> ``"retired"`` or ``"refused: <reason>"``."""
        if isinstance(ids, str):  # one worker (a string is not a list of one-letter ids)
            ids = [ids]
        return self._loop.run(self.scheduler.retire_workers(list(ids)))

    def run(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(scheduler, *args)`` on the scheduler's loop thread (for introspection)."""

        async def call() -> Any:
            r = fn(self.scheduler, *args)
            if asyncio.iscoroutine(r):
                r = await r
            return r

        return self._loop.run(call())

    def adapt(self, *, minimum: int = 0, maximum: int | None = None,
              node_types: list[NodeType] | None = None, policy: Any = None, interval: float = 0.05,
              journal: str | Journal | None = None, provider: Any = None,
              config: str | ClusterConfig | None = None, objective: str = "balanced",
              deadline: float | None = None, budget: float | None = None,
              guess_budget: float | None = None, **controller_kwargs: Any) -> AutoScaler:  # fmt: skip
        """Let the scheduler grow and shrink the pool by itself.

        Without ``node_types``, workers are of this cluster's default type with ``minimum`` ..
        ``maximum`` nodes.  ``policy`` is any callable ``snapshot -> ScaleDecision`` (default:
        :class:`~tidepool.scaling.planned.Planned`, for ``objective`` "balanced", "fastest" or
        "cheapest", or to finish ``deadline`` seconds after work first appears at least cost, or to
        spend at most ``budget`` (node type ``cost`` x node-hours) as fast as possible; see
        docs/scaling.md).  ``guess_budget``: the default policy's bet on durations longer than the
        scheduler's guess before any task has finished, in node-hours of start-ups per node type
        (default 1.25; 0: launch only for the runnable tasks and what the forecast justifies).  Returns the running :class:`AutoScaler`;
        its ``journal`` records every decision with its reason.  ``provider`` replaces the
        local-process provider (e.g. a :class:`~tidepool.providers.callback.CallbackProvider`).

        Arguments are checked before anything starts (a ConfigError leaves the cluster as it was):
        ``minimum``/``maximum`` are whole numbers that size the default node type only, so they do
        not combine with ``node_types`` or ``config``; an autoscaler that could never start a worker
        (``maximum=0``, ``max_workers=0``, every node type at ``max_nodes=0``) is refused.
        """
        check_keywords("adapt", controller_kwargs, LocalCluster.adapt, ScalingController.__init__)
        _check_adapt_arguments(minimum, maximum, node_types, config, interval)
        if self.autoscaler is not None:
            raise ConfigError("adapt() was already called on this cluster, and its autoscaler keeps the settings it "
                              "was started with; to scale differently, start a new LocalCluster")  # fmt: skip
        from tidepool.scaling.planned import check_objective, default_policy

        check_objective(objective, deadline, budget)
        options = {} if guess_budget is None else {"guess_budget": guess_budget}
        if options and (budget is not None or (objective != "balanced" and deadline is None)):
            raise ConfigError(f"adapt(): guess_budget limits the bet on guessed durations of the balanced objective "
                              f"and of a deadline; {'budget=' if budget is not None else repr(objective)} "
                              f"{'does not bet' if budget is not None or objective == 'cheapest' else 'bets without a limit'}"
                              f" (leave guess_budget out)")  # fmt: skip
        # what makes the default policy the one to run (a budget also chooses it, and is a hard
        # limit that holds for any policy besides)
        shapes_default = objective != "balanced" or deadline is not None or bool(options)
        chosen = shapes_default or budget is not None
        if shapes_default and policy is not None:
            raise ConfigError("adapt(): objective, deadline and guess_budget set the default policy; a policy= of "
                              "your own decides by itself (pass one or the other)")  # fmt: skip
        if policy is None and (config is None or chosen):
            policy = default_policy(objective, deadline, budget, **options)
        file_limits: dict[str, Any] = {}
        if config is not None:  # a cluster file: its node types, policy, provider and limits
            cfg = config_load(config) if isinstance(config, str) else config
            if cfg.policy and shapes_default:
                raise ConfigError(f"adapt(): objective, deadline and guess_budget set the default policy, and "
                                  f"{cfg.source or 'the cluster file'} has a [policy] of its own; pass one or the "
                                  f"other")  # fmt: skip
            file_limits = dict(cfg.autoscaler)
            node_types = node_types or cfg.node_types
            policy = policy or cfg.make_policy()
            if provider is None and cfg.provider.get("kind", "local") != "local":
                provider = cfg.make_provider(self.address, self.token)
        if node_types is None:
            top = maximum if maximum is not None else max(minimum, os.cpu_count() or 1)
            node_types = [dataclasses.replace(self.default_type, min_nodes=minimum, max_nodes=top,
                                              startup_estimate=0.5)]  # fmt: skip
        _check_can_launch(node_types, controller_kwargs.get("max_workers"))
        if journal is not None and not isinstance(journal, (Journal, str, os.PathLike)):
            raise ConfigError(f"adapt(journal=...) takes a file path or a Journal, got {journal!r}")
        if isinstance(journal, (str, os.PathLike)):
            from tidepool.telemetry.report import check_output

            check_output(os.fspath(journal), "adapt(journal=...)")
        j = journal if isinstance(journal, Journal) else Journal(None if journal is None else os.fspath(journal))
        for key, value in file_limits.items():  # the file's [autoscaler] keys, unless given here
            controller_kwargs.setdefault(key, value)
        if budget is not None:  # the hard limit (the default policy also plans within it)
            controller_kwargs["budget"] = budget
        controller = ScalingController(node_types, policy, **controller_kwargs)
        prov = provider if provider is not None else self.provider
        if isinstance(prov, NeedsAddress):
            prov.bind(self.address, self.token)
        self._extra_provider = prov if provider is not None else None

        async def start() -> AutoScaler:
            scaler = AutoScaler(self.scheduler, prov, controller, interval, journal=j)
            for wid in self._own:  # the cluster's own workers are the autoscaler's to retire too
                scaler.adopt(wid)
            return await scaler.start()

        self.autoscaler = self._loop.run(start())
        return self.autoscaler

    @property
    def journal(self) -> Journal | None:
        return self.autoscaler.journal if self.autoscaler is not None else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.autoscaler is not None:
            try:
                self._loop.run(self.autoscaler.close(), timeout=10)
            except Exception:
                pass
        if self.dashboard is not None:
            try:
                self._loop.run(self.dashboard.stop(), timeout=10)
            except Exception:
                pass
        try:
            self._loop.run(self.scheduler.close(), timeout=10)
        except Exception:
            pass
        self.provider.close()
        if self._extra_provider is not None:
            self._extra_provider.close()
        self._loop.stop()

    def workers_by_type(self) -> dict[str, int]:
        """Registered workers per node type."""
        out: dict[str, int] = {}
        for w in list(self.scheduler.state.workers.values()):
            out[w.node_type] = out.get(w.node_type, 0) + 1
        return out

    def __repr__(self) -> str:
        from tidepool.dashboard.links import describe

        return describe("LocalCluster", self.address, self.workers_by_type(), self.dashboard_link, self.closed)

    def _repr_html_(self) -> str:
        from tidepool.dashboard.links import describe_html

        return describe_html("LocalCluster", self.address, self.workers_by_type(), self.dashboard_link,
                             self.closed)  # fmt: skip



def worker_memory_args(memory_limit: int | str | None, spill_limit: int | str | None) -> list[str]:
    """The local workers' memory options (checked here, so a typo fails once, not in every worker):
    each worker's limit is ``memory_limit``, else its node type's memory, else this machine's memory
    shared by as many workers as it has cores (docs/memory.md).  ``LocalCluster`` with or without a
    state directory."""
    args = ["--memory-share", str(os.cpu_count() or 1)]
    if memory_limit is not None:
        from tidepool.worker.memory import MIN_MEMORY_LIMIT, mib, resolve_limit

        limit = resolve_limit(memory_limit, {})
        if 0 < limit < MIN_MEMORY_LIMIT:
            raise ConfigError(f"memory_limit={memory_limit!r} ({mib(limit)}) is less than a worker process uses "
                              f"before any task; give each worker at least {mib(MIN_MEMORY_LIMIT)} "
                              "(or 'none' for no limit)")  # fmt: skip
        args += ["--memory-limit", str(memory_limit)]
    if spill_limit is not None:
        from tidepool.worker.spill import resolve_spill_limit

        resolve_spill_limit(spill_limit, ".")
        args += ["--spill-limit", str(spill_limit)]
    return args

def check_slots(slots: Any) -> None:
    """Refuse a number of task slots per worker that is not a whole number >= 1 (with 0, every task
    would wait on workers that can run none, as ``tidepool worker --slots 0`` is refused too)."""
    if not _whole(slots) or slots < 1:
        raise ConfigError(f"slots must be a whole number >= 1 (tasks a worker runs at once), got {slots!r}")


def local_resources(slots: int | None, resources: Mapping[str, Any] | None) -> dict[str, Any]:
    """A local cluster's worker resources: ``cpu`` is ``slots`` (1 if neither says), the number of
    default tasks a worker runs at once.  Both given and different, or a ``cpu`` under 1 (its
    workers could run no default task, each of which needs cpu=1), is refused: a bug hunt's
    ``slots=3, resources={"cpu": 1}`` ran one task at a time without a word."""
    if slots is not None:
        check_slots(slots)
    res = dict(resources or {})
    if "cpu" not in res:
        res["cpu"] = slots if slots is not None else 1
        return res
    cpu = res["cpu"]
    if isinstance(cpu, bool) or not isinstance(cpu, numbers.Real) or not float(cpu) >= 0:
        raise ConfigError(f"resources={{'cpu': {cpu!r}}}: cpu must be a number >= 0 (the default tasks a "
                          "worker runs at once); leave cpu out and set slots=")  # fmt: skip
    if float(cpu) < 1 and len(res) == 1:  # then nothing but tasks asking for less than 1 cpu could run
        raise ConfigError(f"resources={{'cpu': {cpu!r}}}: a worker with less than 1 cpu and nothing else runs "
                          "no default task (each takes cpu=1); leave cpu out and set slots=")  # fmt: skip
    if slots is not None and cpu != slots:
        raise ConfigError(f"slots={slots} and resources={{'cpu': {cpu!r}}} disagree: a worker runs as many "
                          "default tasks at once as its cpu; give one of them")  # fmt: skip
    return res


def _whole(value: Any) -> bool:
    """A whole number >= 0 (numpy integers too; bools and floats such as 2.0 are not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _check_adapt_arguments(minimum: Any, maximum: Any, node_types: Any, config: Any, interval: Any) -> None:
    """``adapt``'s own arguments: whole-number bounds, one way to say what to launch, a real interval."""
    if not _whole(minimum):
        raise ConfigError(f"adapt(minimum=...) must be a whole number >= 0, got {minimum!r}")
    if maximum is not None and not _whole(maximum):
        raise ConfigError(f"adapt(maximum=...) must be a whole number >= 0 (or None for the CPU count), "
                          f"got {maximum!r}")  # fmt: skip
    if maximum is not None and minimum > maximum:
        raise ConfigError(f"adapt(minimum={minimum}, maximum={maximum}): minimum must not exceed maximum")
    if maximum == 0 and node_types is None and config is None:
        raise ConfigError("adapt(maximum=0) can never start a worker, so every task would wait forever; "
                          "pass maximum >= 1, or skip adapt() and size the pool with add_workers()")  # fmt: skip
    if (node_types is not None or config is not None) and (minimum != 0 or maximum is not None):
        raise ConfigError("adapt(minimum=/maximum=) size the cluster's default node type only; with "
                          "node_types or a config, set min_nodes/max_nodes on each node type instead")  # fmt: skip
    if node_types is not None:
        if not isinstance(node_types, (list, tuple)):
            raise ConfigError(f"adapt(node_types=...) must be a list of NodeType, got {node_types!r}")
        for nt in node_types:
            if not isinstance(nt, NodeType):
                raise ConfigError(f"adapt(node_types=...) must hold NodeType objects, got {nt!r}; "
                                  "e.g. NodeType('cpu', {'cpu': 2}, max_nodes=4)")  # fmt: skip
    if (isinstance(interval, bool) or not isinstance(interval, numbers.Real) or not math.isfinite(interval)
            or interval <= 0):  # fmt: skip
        raise ConfigError(f"adapt(interval=...) must be a positive number of seconds, got {interval!r}")


def _check_can_launch(node_types: list[NodeType], max_workers: Any) -> None:
    """An autoscaler that can never start a node would leave every task waiting forever: refuse it."""
    if max_workers is not None and (not _whole(max_workers) or max_workers == 0):
        raise ConfigError(f"adapt(max_workers=...) must be a whole number >= 1 (or None), got "
                          f"{max_workers!r}; with 0 the autoscaler could never start a worker")  # fmt: skip
    if node_types and all(nt.max_nodes == 0 for nt in node_types):
        names = ", ".join(repr(nt.name) for nt in node_types)
        raise ConfigError(f"adapt() can never start a worker: max_nodes is 0 for every node type ({names}); "
                          "give at least one node type max_nodes >= 1 (e.g. adapt(maximum=4))")
