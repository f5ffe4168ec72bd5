"""``LocalCluster(state_dir=...)``: a durable scheduler in a process of its own, plus local workers.

State: the ``tidepool scheduler --state-dir`` process (``scheduler_proc``; its output goes to
``scheduler.log`` in the state directory), its address and token (read from its first line and
its token file), and the :class:`LocalProvider` owning the worker processes.

Data flow: the scheduler process keeps the graph and outcomes in the state directory; workers and
clients reach it over TCP like any other.  :meth:`kill_scheduler` SIGKILLs it (tests and demos);
:meth:`restart_scheduler` starts it again on the same directory, so on the same address and token:
workers and clients reconnect by themselves (docs/recovery.md).  ``close()`` stops the scheduler
(which closes its workers) and then makes sure no worker process is left behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tidepool.cluster import local_resources, worker_memory_args
from tidepool.comm.auth import read_token_file
from tidepool.errors import ConfigError
from tidepool.loop import ClosesOnExit
from tidepool.providers.local import LocalProvider
from tidepool.scaling.node_types import NodeType

_LAUNCH = "import sys; from tidepool.cli import main; sys.exit(main(sys.argv[1:]))"
log = logging.getLogger(__name__)


class DurableLocalCluster(ClosesOnExit):
    """A local cluster whose scheduler survives ``kill -9`` (see the module docstring)."""

    def __init__(self, n_workers: int | None = None, *, state_dir: str, slots: int | None = None,
                 resources: dict[str, Any] | None = None, host: str | None = None, port: int | None = None,
                 timeout: float = 60.0, env: dict[str, str] | None = None, heartbeat_interval: float = 1.0,
                 reconnect_window: float | None = None, recovery_wait: float | None = None,
                 journal: str | None = None, fork_server: bool | None = None,
                 durable: bool = True, memory_limit: int | str | None = None,
                 spill_limit: int | str | None = None, allowed_failures: int | None = None,
                 dashboard: bool | str | None = None, restart_crashed: bool = True,
                 **unknown: Any) -> None:  # fmt: skip
        """``durable=False`` runs the same scheduler process without ``--state-dir`` (the state
        directory then only holds its log and token file): the baseline that measures what
        ``--state-dir`` costs (``benchmarks/recovery.py --end-to-end``).  ``memory_limit``,
        ``spill_limit``, ``allowed_failures`` and ``dashboard`` are ``LocalCluster``'s (the
        dashboard is served by the scheduler process; ``dashboard_link``).  ``restart_crashed``: as
        ``LocalCluster``'s, a worker process that dies (not one stopped by the cluster, retired, or
        done with a lost scheduler) is replaced, at most ``MAX_RESTARTS`` in ``RESTART_WINDOW`` s."""
        if unknown:
            _refuse(unknown)
        default_resources = local_resources(slots, resources)
        self.worker_args = worker_memory_args(memory_limit, spill_limit)
        self.scheduler_args: list[str] = []
        if allowed_failures is not None:
            from tidepool.scheduler.state import SchedulerState

            SchedulerState(allowed_failures=allowed_failures)  # a bad value fails here, with its message
            self.scheduler_args += ["--allowed-failures", str(int(allowed_failures))]
        self.dashboard = "127.0.0.1:0" if dashboard is True else (dashboard or None)
        self.dashboard_link = ""
        self.durable = durable
        self.state_dir = str(state_dir)
        Path(self.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.host, self.port, self.timeout = host, port, timeout
        self.reconnect_window = reconnect_window
        self.recovery_wait = recovery_wait
        self.env = dict(env or {})
        self.closed = False
        self.scheduler_proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.token = ""
        self.tls = None
        self._starts = 0
        self.cluster_file: str | None = None  # adapt(): the scheduler process runs the autoscaler
        self.start_scheduler(journal)
        self.provider = LocalProvider(self.address, self.token, env=self.env, heartbeat_interval=heartbeat_interval,
                                      fork_server=fork_server, extra_args=self.worker_args)  # fmt: skip
        self.default_type = NodeType("default", default_resources, max_nodes=10_000)
        self._req = itertools.count(1)  # next() is atomic: the crash watcher launches too
        #: held while looking at the provider's processes: poll_errors() forgets exited ones, so a
        #: crash is replaced before any poll_errors() of wait_for_workers() can drop it unseen
        self._procs_lock = threading.Lock()
        self._replaced: set[str] = set()
        self._restarts: list[float] = []
        self._stop_watch = threading.Event()
        if restart_crashed:
            threading.Thread(target=self._watch, name="tidepool-durable-workers", daemon=True).start()
        self._close_at_exit()
        if n_workers:
            try:
                self.add_workers(n_workers)
            except BaseException:
                self.close()
                raise

    # ---- the scheduler process ---------------------------------------------------------------------
    def start_scheduler(self, journal: str | None = None) -> None:
        """Start ``tidepool scheduler --state-dir`` (again); returns once it listens."""
        if self.scheduler_proc is not None and self.scheduler_proc.poll() is None:
            raise ConfigError("the scheduler is still running; kill_scheduler() first")
        if self.durable:  # another scheduler on it: StoreInUseError here, as errors.md says (its
            # process would exit with the message only)
            from tidepool.scheduler.store import check_free

            check_free(Path(self.state_dir))
        log_path = Path(self.state_dir) / "scheduler.log"
        token_file = Path(self.state_dir) / "token"
        start_at = log_path.stat().st_size if log_path.exists() else 0
        host, port = self.host, self.port  # None: not given here, so the cluster file's, else loopback:any
        if self.cluster_file and (host is None or port is None):
            from tidepool.config import load

            table = load(self.cluster_file).scheduler
            host = host if host is not None else table.get("host")
            port = port if port is not None else table.get("port")
        host = "127.0.0.1" if host is None else host
        port = 0 if port is None else port
        args = ["scheduler", "--host", str(host), "--port", str(port), "--token-file", str(token_file),
                *(["--dashboard", self.dashboard] if self.dashboard else ["--no-dashboard"]),
                "--exit-with-parent", str(os.getpid()), *self.scheduler_args]  # fmt: skip
        if self.durable:
            args += ["--state-dir", self.state_dir]
        if self.reconnect_window is not None:
            args += ["--reconnect-window", str(self.reconnect_window)]
        if self.recovery_wait is not None:
            args += ["--recovery-wait", str(self.recovery_wait)]
        if journal:
            args += ["--journal", journal]
        if self.cluster_file:
            args += ["--cluster", self.cluster_file]
        env = {k: v for k, v in os.environ.items() if k not in ("TIDEPOOL_TOKEN", "TIDEPOOL_TOKEN_FILE")}
        with open(log_path, "ab") as out:
            self.scheduler_proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *args], stdout=out,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   env={**env, **self.env})  # fmt: skip
        self._starts += 1
        deadline = time.monotonic() + self.timeout
        while True:
            text = log_path.read_bytes()[start_at:].decode(errors="replace")
            lines = text.splitlines()
            links = [ln.split(" at ", 1)[1].strip() for ln in lines if ln.startswith("tidepool dashboard at ")]
            for line in lines:
                if line.startswith("tidepool scheduler at ") and (links or not self.dashboard):
                    self.address = line.split(" at ", 1)[1].strip()
                    self.token = read_token_file(str(token_file))
                    self.dashboard_link = links[0] if links else ""
                    return
            if self.scheduler_proc.poll() is not None:
                raise ConfigError(f"the scheduler exited with code {self.scheduler_proc.returncode}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                self.scheduler_proc.kill()
                raise TimeoutError(f"the scheduler did not start within {self.timeout}s:\n{text[-3000:]}")
            time.sleep(0.05)

    def kill_scheduler(self) -> None:
        """SIGKILL the scheduler process (what a crash or a lost machine does)."""
        if self.scheduler_proc is not None and self.scheduler_proc.poll() is None:
            self.scheduler_proc.send_signal(signal.SIGKILL)
            self.scheduler_proc.wait()

    def restart_scheduler(self, journal: str | None = None) -> float:
        """Start the scheduler again on the same state directory; returns the seconds it took to listen."""
        t0 = time.monotonic()
        self.start_scheduler(journal)
        return time.monotonic() - t0

    def adapt(self, minimum: int = 0, maximum: int | None = None, *, journal: str | None = None) -> None:
        """Autoscale between ``minimum`` and ``maximum`` local workers, with the autoscaler in the
        scheduler process (so it dies and restarts with it, and adopts its workers again: its
        provider remembers them in the state directory).  Call it before submitting work: it
        restarts the scheduler (gracefully, closing the workers it has) with a cluster file in the
        state directory."""
        top = maximum if maximum is not None else max(minimum, os.cpu_count() or 1)
        if minimum < 0 or top < max(1, minimum):
            raise ConfigError(f"adapt(): need 0 <= minimum <= maximum and maximum >= 1, got {minimum}, {maximum}")
        res = ", ".join(f"{k} = {v!r}" for k, v in self.default_type.worker_resources.items())
        self.use_cluster_file('[provider]\nkind = "local"\n\n[[node_types]]\nname = "default"\n'
                              f"resources = {{ {res} }}\nmin_nodes = {minimum}\nmax_nodes = {top}\n"
                              "startup_estimate = 0.5\n", journal=journal)  # fmt: skip

    def use_cluster_file(self, text: str, *, journal: str | None = None) -> None:
        """Run the scheduler with the cluster file ``text`` (any provider; written to
        ``cluster.toml`` in the state directory): the running scheduler stops gracefully, closing
        the workers it has, and a new one starts with ``--cluster``."""
        path = Path(self.state_dir) / "cluster.toml"
        path.write_text(text)
        self.cluster_file = str(path)
        proc = self.scheduler_proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)  # a graceful stop closes the workers: slow on a loaded machine
        self.start_scheduler(journal)

    # ---- workers ----------------------------------------------------------------------------------
    def add_workers(self, n: int = 1, *, wait: bool = True) -> list[str]:
        rid = f"d{self._starts}-{next(self._req)}"
        ids = self.provider.worker_ids(self.default_type, n, rid)
        self.provider.launch(self.default_type, n, rid)
        if wait:
            self.wait_for_workers(ids)
        return ids

    def workers(self) -> list[str]:
        """Ids of the workers registered now (asked of the scheduler)."""
        from tidepool.client import Client

        with Client(self.address, self.token, timeout=self.timeout) as c:
            return [w["id"] for w in c.scheduler_info()["workers"]]

    def wait_for_workers(self, ids: list[str], timeout: float | None = None) -> None:
        from tidepool.client import Client

        deadline = time.monotonic() + (timeout or self.timeout)
        with Client(self.address, self.token, timeout=self.timeout) as c:
            while True:
                present = {w["id"] for w in c.scheduler_info()["workers"]}
                if set(ids) <= present:
                    return
                with self._procs_lock:
                    self._replace_crashed(skip=ids)  # another worker's crash is replaced, not a failed start
                    errors = [e for e in self.provider.poll_errors() if e.worker_id in ids]
                if errors:
                    raise ConfigError("workers failed to start: " + "; ".join(e.message for e in errors))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(set(ids) - present)} did not register within "
                                       f"{timeout or self.timeout}s")  # fmt: skip
                time.sleep(0.1)

    #: most crashed workers replaced within ``RESTART_WINDOW`` seconds (as ``LocalCluster``)
    MAX_RESTARTS = 20
    RESTART_WINDOW = 60.0

    def _watch(self) -> None:
        """Replace worker processes that died (a crashing task, the OOM killer): without it, a task
        that kills its worker left the cluster with none, and it failed as having no worker."""
        while not self._stop_watch.wait(0.5):
            try:
                with self._procs_lock:
                    self._replace_crashed()
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad round
                log.warning("replacing crashed workers failed", exc_info=True)

    def _replace_crashed(self, skip: list[str] | None = None) -> None:
        prov = self.provider
        for wid, p in list(prov.procs.items()):
            rc = p.proc.poll()
            if skip and wid in skip:
                continue  # a worker being waited for: a failed start, reported by wait_for_workers
            if rc in (None, 0) or wid in self._replaced or prov.stopped_on_purpose(wid) or self.closed:
                continue  # running, ended cleanly (retired, lost its scheduler), or stopped on purpose
            self._replaced.add(wid)
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW]
            if len(self._restarts) >= self.MAX_RESTARTS:
                log.warning("not replacing worker %s (exit code %s): %d workers already replaced in the last %gs; "
                            "something kills every worker (see the tasks' errors)", wid, rc, len(self._restarts),
                            self.RESTART_WINDOW)  # fmt: skip
                continue
            self._restarts.append(now)
            log.info("worker %s died (exit code %s); starting a replacement", wid, rc)
            self.add_workers(1, wait=False)

    def kill_worker(self, wid: str) -> None:
        self.provider.kill(wid)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_watch.set()
        proc = self.scheduler_proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # closes its workers, flushes its store
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if hasattr(self, "provider"):
            self.provider.close()


def _refuse(unknown: dict[str, Any]) -> None:
    """Keywords ``LocalCluster(state_dir=...)`` does not take: ``LocalCluster``'s own that a
    scheduler in a process of its own cannot honour yet say so; typos get the close name."""
    from tidepool.cluster import LocalCluster
    from tidepool.keywords import check_keywords

    check_keywords("LocalCluster", unknown, DurableLocalCluster.__init__, LocalCluster.__init__)
    name = next(iter(unknown))
    raise ConfigError(f"LocalCluster(state_dir=...) does not take {name}= (its scheduler runs in a process of its "
                      "own); leave it out, or use LocalCluster without state_dir")  # fmt: skip
