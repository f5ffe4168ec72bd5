"""LocalProvider: worker processes on this machine.

State: the ``subprocess.Popen`` of every worker it started, keyed by worker id, with the request id
and node type it was launched for.  Any node type is "simulated" by starting the worker with that
type's resource labels (a ``gpu`` node here is a process that advertises ``gpu: 2``).  Launch and
terminate are idempotent: a request id launched twice starts its workers once; terminating an
unknown or dead worker is a no-op.  ``close()`` kills whatever is left, so nothing leaks.

Nothing on disk leaks either: a worker keeps a ``tidepool-<worker id>-XXXXXXXX`` directory in its
temp folder and removes it only when it closes cleanly, so whenever this provider sees one of its
processes has exited (``poll_errors``, ``list``, ``terminate``, ``close``) it removes that worker's
directory.  Matching by the id is safe because ids are unique on the machine: they carry this
process's pid and a per-process sequence number (``cpu-a3-7-p4242``), so two clusters here never
name a worker alike, and a directory is only removed once the one process that could use it is gone.

Surviving a scheduler restart (:meth:`LocalProvider.remember_in`, which a durable scheduler calls
with a directory in its state directory): a small JSON file per worker process (pid, the kernel's
start time of that pid, node type, request id) lets the provider of a restarted scheduler find the
processes the last one started, list them and terminate them (:class:`AdoptedProcess`: not a child,
so its exit code is unknown, reported as 0).  The start time guards against a reused pid.

Preemption (for tests and demonstrations of spot capacity): :meth:`LocalProvider.preempt` gives
a worker a notice as a cloud does (``SIGUSR1``, which the worker logs and ignores, and
:meth:`LocalProvider.preemptions` lists it with its deadline for the autoscaler), then SIGKILLs it
when the notice runs out unless it exited first (retired gracefully).

Fork server (``fork_server``, on by default where :func:`tidepool.providers.forkserver.supported`):
a worker is forked from a pre-imported process (:mod:`tidepool.providers.forkserver`, which says
why that is fork-safe) instead of spawned, so it registers in about a tenth of a second.  Its
handle behaves like the ``Popen`` of a spawned worker, so listing, signals, temp directories and
kill on close are the same.  A fork server that dies or refuses is replaced (at most
``FORK_SERVER_RESTARTS`` times; one that refused because of the preload modules is replaced by one
without them), after which the provider spawns; either way the worker at hand is spawned, and the
reason is reported through :meth:`LocalProvider.drain_events`, which the autoscaler writes into
the run's journal (``fork-server`` records), with one ``worker-launch`` record per worker saying how
it was started.  ``fork_server=False`` or ``TIDEPOOL_FORK_SERVER=0`` turns it off.  Constructing
the provider starts nothing: :meth:`LocalProvider.start_fork_server` (``LocalCluster`` calls it)
or the first launch starts the server.  A launch waits at most ``FORK_SERVER_READY_WAIT`` for a
server still importing, then spawns its worker (a ``not-ready`` record) and keeps the server.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidepool.providers import forkserver
from tidepool.providers.base import EXIT_FILE_ENV, IdNames, ProviderFailure, worker_command
from tidepool.scaling.node_types import NodeType

log = logging.getLogger("tidepool.providers")

WorkerListing = dict[str, dict[str, Any]]
#: worker numbers, shared by every LocalProvider in this process (ids must not repeat on the machine)
_SEQ = itertools.count(1)
#: the environment variables ``tempfile.gettempdir()`` reads, in its order
_TMP_VARS = ("TMPDIR", "TEMP", "TMP")


def _sweep_exit_dirs() -> None:
    """Remove ``tidepool-exits-<pid>-*`` directories of providers whose process is gone (a
    scheduler killed with SIGKILL could not remove its own)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"tidepool-exits-(\d+)-[a-z0-9_]{8}", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its provider's process lives
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            continue  # (another user's: not ours to remove)


@dataclass
class LocalWorkerProcess:
    worker_id: str
    node_type: str
    request_id: str
    proc: subprocess.Popen[bytes] | forkserver.ForkedWorker | AdoptedProcess
    started: float = field(default_factory=time.monotonic)


def _start_time(pid: int) -> int | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot), ``None`` if it is gone
    or a zombie (or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[19])


class AdoptedProcess:
    """A worker process started by an earlier provider (another scheduler process): the calls
    the provider makes on a ``Popen``.  Not our child, so its exit code is unknown (0)."""

    def __init__(self, pid: int, start: int) -> None:
        self.pid = pid
        self.start = start
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and _start_time(self.pid) != self.start:
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return rc


#: glibc returns freed heap memory to the system at once instead of keeping it (large results
#: freed after spilling would otherwise hold a worker's RSS up); the user's environment wins
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536"}
#: ``TIDEPOOL_FORK_SERVER=0`` (or off/false/no) turns fork servers off where the argument is not given
FORK_SERVER_ENV = "TIDEPOOL_FORK_SERVER"


def fork_server_default() -> bool:
    """On where the platform supports it, unless ``TIDEPOOL_FORK_SERVER`` says off."""
    if os.environ.get(FORK_SERVER_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return forkserver.supported()


class LocalProvider:
    """Starts ``python -m tidepool.worker`` processes for a scheduler on this machine."""

    def __init__(self, scheduler: str, token: str, *, env: dict[str, str] | None = None,
                 cwd: str | None = None, extra_args: list[str] | None = None,
                 heartbeat_interval: float = 1.0, preload: list[str] | None = None,
                 fork_server: bool | None = None) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.token = token
        self.env = env or {}
        self.cwd = cwd
        self.extra_args = list(extra_args or [])
        for mod in preload or []:
            self.extra_args += ["--preload", mod]
        self.heartbeat_interval = heartbeat_interval
        self.procs: dict[str, LocalWorkerProcess] = {}
        self._requests: dict[str, list[str]] = {}
        self._names = IdNames(f"-p{os.getpid()}", _SEQ)
        self._errors: list[ProviderFailure] = []
        self._stopped: set[str] = set()
        self._spawning: dict[str, tuple[str, str]] = {}  # named by a launch, not spawned yet: (type, request)
        self._cleaned: set[str] = set()  # workers whose temp directory is gone
        #: where a worker that fails to start writes why (``EXIT_FILE_ENV``), read when it exits
        self._exit_dir: str | None = None
        self._exit_lock = threading.Lock()
        self.preload = list(preload or [])
        #: journal records for the autoscaler (``drain_events``); bounded, for clusters that never drain
        self._events: deque[dict[str, Any]] = deque(maxlen=10_000)
        self._fork: forkserver.ForkServer | None = None
        self._fork_restarts = 0
        self._fork_lock = threading.Lock()
        self._fork_preload = list(self.preload)
        self.fork_server = fork_server_default() if fork_server is None else bool(fork_server)
        if fork_server and not forkserver.supported():
            self._event("fork-server", event="fallback", reason=f"fork servers are not supported on {sys.platform}")
            self.fork_server = False
        self._fork_started = False  # constructing starts nothing (cluster files are checked by building one)
        #: preemption notices given (:meth:`preempt`): worker -> when it is killed (epoch seconds)
        self._notices: dict[str, float] = {}
        self._timers: list[threading.Timer] = []
        #: set by close(): a launch still running in another thread (the autoscaler's, cancelled
        #: there) starts nothing more, kills what it just started, and starts no fork server
        self._closed = False
        self._registry: str | None = None  # remember_in(): one file per worker process

    # ---- across scheduler restarts -----------------------------------------------------------------
    def remember_in(self, directory: str) -> None:
        """Keep a file per worker process in ``directory`` and take over the live processes its
        files name (started by the provider of an earlier scheduler process): they are listed,
        terminated and closed like this provider's own (see the module docstring)."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._registry = directory
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            try:
                with open(path) as f:
                    rec = json.load(f)
                wid, pid, start = str(rec["worker"]), int(rec["pid"]), int(rec["start"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if wid in self.procs:
                continue
            if _start_time(pid) != start:  # it ended (or the pid is another process's now)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            rid = str(rec.get("request_id") or "")
            self.procs[wid] = LocalWorkerProcess(wid, str(rec.get("node_type") or ""), rid, AdoptedProcess(pid, start))
            self._requests.setdefault(rid, []).append(wid)
            self._event("worker-adopt", worker=wid, pid=pid, request=rid)

    def _remember(self, p: LocalWorkerProcess) -> None:
        if self._registry is None:
            return
        start = _start_time(p.proc.pid)
        if start is None:
            return
        path = os.path.join(self._registry, f"{p.worker_id}.json")
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                json.dump({"worker": p.worker_id, "pid": p.proc.pid, "start": start, "node_type": p.node_type,
                           "request_id": p.request_id}, f)  # fmt: skip
            os.replace(path + ".tmp", path)

    def _forget(self, wid: str) -> None:
        if self._registry is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._registry, f"{wid}.json"))

    # ---- the fork server ------------------------------------------------------------------------
    FORK_SERVER_RESTARTS = 3
    #: seconds a launch waits for a fork server that is still importing before spawning instead
    #: (a launch must return promptly; the server stays and serves the launches after)
    FORK_SERVER_READY_WAIT = 10.0

    def start_fork_server(self) -> None:
        """Start the fork server now (it imports the worker code in the background), so that the
        first launch forks at once; otherwise the first launch starts it.  No-op when it is off or
        already started.  ``LocalCluster`` calls this when it is created."""
        with self._fork_lock:
            if self.fork_server and not self._fork_started:
                self._fork_started = True
                self._start_fork_server("started")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the fork server has imported the worker code, so the next launch forks at
        once (starting it if need be); ``False`` if there is no fork server (or it failed:
        launches then spawn)."""
        self.start_fork_server()
        server = self._fork
        if server is None:
            return False
        try:
            server.wait_ready(timeout)
        except forkserver.ForkServerError:
            return False
        return True

    def _base_env(self) -> dict[str, str]:
        return {**MALLOC_ENV, **os.environ, **self.env, "TIDEPOOL_TOKEN": self.token}

    def _event(self, kind: str, **fields: Any) -> None:
        self._events.append({"kind": kind, **fields})

    def drain_events(self) -> builtins.list[dict[str, Any]]:
        """Records for the run's journal since the last call (``kind`` plus fields; the caller adds
        the time): ``fork-server`` (started, died, replaced, fallback, with the reason) and one
        ``worker-launch`` per worker (``how``: fork-server or spawn; ``seconds`` the call took)."""
        out = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:  # (deque operations are atomic: safe against a launch thread appending)
                return out

    def _start_fork_server(self, event: str, reason: str = "") -> None:
        if self._closed:
            self._fork = None
            return
        try:
            self._fork = forkserver.ForkServer(self._base_env(), self.cwd, self._fork_preload)
        except OSError as exc:
            self._fork = None
            self.fork_server = False
            self._event("fork-server", event="fallback", reason=f"could not start a fork server: {exc}; "
                                                                "spawning workers instead")  # fmt: skip
            return
        fields: dict[str, Any] = {"pid": self._fork.proc.pid, "preload": list(self._fork_preload)}
        if reason:
            fields["reason"] = reason
        self._event("fork-server", event=event, **fields)

    def _fork_worker(self, wid: str, cmd: builtins.list[str], env: dict[str, str],
                     ready_timeout: float) -> forkserver.ForkedWorker | None:  # fmt: skip
        """Fork ``wid`` from the fork server; ``None`` (spawn it) if the server cannot, after
        replacing the server or giving up on it with the reason in the journal.  A server still
        importing is waited for at most ``ready_timeout`` seconds."""
        self.start_fork_server()
        with self._fork_lock:  # launches may run in several threads at once
            return self._fork_worker_locked(wid, cmd, env, ready_timeout)

    def _fork_worker_locked(self, wid: str, cmd: builtins.list[str], env: dict[str, str],
                            ready_timeout: float) -> forkserver.ForkedWorker | None:  # fmt: skip
        server = self._fork
        if server is None:
            return None
        try:  # cmd = [python, -m, tidepool.worker, ...]
            return server.fork(wid, cmd[3:], env, self.cwd, ready_timeout=ready_timeout)
        except forkserver.ForkServerError as exc:
            reason = str(exc)
        if server.starting:  # slow imports (a loaded machine): spawn this one, keep the server
            self._event("fork-server", event="not-ready", pid=server.proc.pid, reason=reason, worker=wid)
            return None
        server.close(timeout=1.0)
        self._event("fork-server", event="died", pid=server.proc.pid, reason=reason, worker=wid)
        if "refused" in reason and self._fork_preload:
            self._fork_preload = []  # the preload modules made forking unsafe: a server without them
            self._start_fork_server("replaced", f"{reason}; the new fork server does not import the preload "
                                                "modules (each worker still imports them)")  # fmt: skip
        elif self._fork_restarts < self.FORK_SERVER_RESTARTS:
            self._fork_restarts += 1
            self._start_fork_server("replaced", f"{reason} (replacement {self._fork_restarts} of "
                                                f"{self.FORK_SERVER_RESTARTS})")  # fmt: skip
        else:
            self._fork = None
            self.fork_server = False
            self._event("fork-server", event="fallback", reason=f"{reason}; {self.FORK_SERVER_RESTARTS} "
                                                                "replacements used up, spawning workers from now on")  # fmt: skip
        return None

    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        return self._names(node_type, count, request_id)

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Spawn the processes (a fork each: no waiting); a spawn that fails is reported through
        ``poll_errors``."""
        if request_id in self._requests:
            return
        ids = self.worker_ids(node_type, count, request_id)
        self._requests[request_id] = ids
        self._spawning.update({w: (node_type.name, request_id) for w in ids})  # listed as starting until
        # spawned: the autoscaler may call launch in a thread while it lists
        # one wait for a fork server still importing per launch, not per worker: the rest spawn
        ready_by = time.monotonic() + self.FORK_SERVER_READY_WAIT
        for wid in ids:
            if self._closed:
                self._spawning.pop(wid, None)
                continue
            cmd = worker_command(self.scheduler, wid, node_type, sys.executable, self.heartbeat_interval,
                                 self.extra_args)  # fmt: skip
            env = {**self._base_env(), "TIDEPOOL_WORKER_ID": wid, EXIT_FILE_ENV: self._exit_file(wid)}
            t0 = time.monotonic()
            proc: subprocess.Popen[bytes] | forkserver.ForkedWorker | None = self._fork_worker(
                wid, cmd, env, max(0.0, ready_by - t0))
            how = "fork-server" if proc is not None else "spawn"
            if proc is None:
                try:
                    proc = subprocess.Popen(cmd, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL)
                except OSError as exc:
                    self._errors.append(ProviderFailure(request_id, wid, f"could not start worker {wid}: {exc}"))
                    self._spawning.pop(wid, None)
                    continue
            self._event("worker-launch", worker=wid, request=request_id, node_type=node_type.name, how=how,
                        seconds=round(time.monotonic() - t0, 6))  # fmt: skip
            self.procs[wid] = LocalWorkerProcess(wid, node_type.name, request_id, proc)
            self._remember(self.procs[wid])
            self._spawning.pop(wid, None)
            if self._closed:  # closed while it was being started: close() may have missed it
                self._stop_late(wid)

    #: seconds after a SIGTERM that a worker still running is killed: one busy importing its preload
    #: modules cannot run its handler (a called-off worker lived on for the 40 s of its import while
    #: the autoscaler counted it gone: a bug hunt); terminate stops them for sure
    KILL_AFTER = 20.0

    def terminate(self, worker_ids: builtins.list[str], sig: int = signal.SIGTERM) -> None:
        signalled = []
        for wid in worker_ids:
            self._stopped.add(wid)
            p = self.procs.get(wid)
            if p is None:
                continue
            if p.proc.poll() is None:
                try:
                    p.proc.send_signal(sig)
                    signalled.append(wid)
                except ProcessLookupError:
                    pass
            else:
                self._remove_temp_dir(wid)
        if signalled and sig != signal.SIGKILL and not self._closed:
            self._later(self.KILL_AFTER, self._kill_if_alive, signalled)

    def _later(self, seconds: float, fn: Any, *args: Any) -> None:
        """``fn(*args)`` in ``seconds`` on a timer thread (cancelled by close; ended ones dropped)."""
        self._timers = [t for t in self._timers if t.is_alive()]
        timer = threading.Timer(seconds, fn, args=args)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _kill_if_alive(self, worker_ids: builtins.list[str]) -> None:
        for wid in worker_ids:
            p = self.procs.get(wid)
            if p is not None and p.proc.poll() is None:
                log.warning("worker %s did not exit %gs after SIGTERM: killing it", wid, self.KILL_AFTER)
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGKILL)

    def stopped_on_purpose(self, worker_id: str) -> bool:
        """Was ``worker_id`` terminated or killed through this provider (not a crash)?"""
        return worker_id in self._stopped

    def kill(self, worker_id: str) -> None:
        """SIGKILL one worker (for failure tests)."""
        self.terminate([worker_id], signal.SIGKILL)

    def preempt(self, worker_id: str, notice: float, sig: int = signal.SIGUSR1) -> None:
        """Take ``worker_id`` back as a cloud takes a spot node: a notice now (``sig`` to the process,
        which the worker logs and ignores, and :meth:`preemptions` lists it with its deadline), then
        SIGKILL ``notice`` seconds later if it has not exited by then."""
        p = self.procs.get(worker_id)
        if p is None or p.proc.poll() is not None or worker_id in self._notices:
            return
        self._notices[worker_id] = time.time() + notice
        try:
            p.proc.send_signal(sig)
        except ProcessLookupError:
            return
        self._later(notice, self.kill, worker_id)

    def preemptions(self, now_wall: float) -> dict[str, float]:
        """Live workers under a preemption notice -> when they are killed (epoch seconds)."""
        out = {}
        for wid, deadline in list(self._notices.items()):
            p = self.procs.get(wid)
            if p is not None and p.proc.poll() is None:
                out[wid] = deadline
        return out

    def list(self) -> WorkerListing:  # noqa: A003
        """Worker id -> {node_type, request_id, alive, returncode}."""
        out: WorkerListing = {}
        for wid, (nt, rid) in list(self._spawning.items()):  # asked for, process not started yet
            out[wid] = {"node_type": nt, "request_id": rid, "alive": True, "returncode": None, "state": "starting"}
        for wid, p in list(self.procs.items()):
            rc = p.proc.poll()
            out[wid] = {"node_type": p.node_type, "request_id": p.request_id, "alive": rc is None,
                        "returncode": rc}  # fmt: skip
            if rc is not None:
                self._remove_temp_dir(wid)
        return out

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        """Workers that exited on their own with an error code since the last call."""
        for wid, p in list(self.procs.items()):
            rc = p.proc.poll()
            if rc is not None:
                said = self._exit_reason(wid)
                if rc not in (0, -signal.SIGTERM, -signal.SIGKILL) and wid not in self._stopped:
                    # with the worker's own error (a memory limit too small, ...), not only its code
                    why = f": {said}" if said else ""
                    self._errors.append(ProviderFailure(p.request_id, wid, f"worker {wid} exited with code {rc}{why}"))
                self._remove_temp_dir(wid)
                del self.procs[wid]
        errs, self._errors = self._errors, []
        return errs

    def _stop_late(self, wid: str) -> None:
        p = self.procs.pop(wid, None)
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            p.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(5.0)
        self._remove_temp_dir(wid)

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        self.terminate(list(self.procs))
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                try:  # bounded too: a forked worker's exit is heard by a thread that may be gone
                    p.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("worker %s (pid %s) did not exit %gs after SIGKILL; not waiting for it",
                                p.worker_id, getattr(p.proc, "pid", "?"), timeout)  # fmt: skip
        for wid in self.procs:
            self._remove_temp_dir(wid)
        self.procs.clear()
        with self._fork_lock:  # after a fork in progress in a launch thread (it then sees _closed)
            if self._fork is not None:
                self._fork.close()
                self._fork = None
        if self._exit_dir is not None:
            shutil.rmtree(self._exit_dir, ignore_errors=True)

    def _exit_file(self, wid: str) -> str:
        with self._exit_lock:  # launches run in threads: one directory (a review saw two race)
            if self._exit_dir is None:
                _sweep_exit_dirs()
                self._exit_dir = tempfile.mkdtemp(prefix=f"tidepool-exits-{os.getpid()}-")
        return os.path.join(self._exit_dir, wid)

    def _exit_reason(self, wid: str) -> str:
        """What worker ``wid`` wrote before it exited with an error (empty: nothing), read once."""
        if self._exit_dir is None:
            return ""
        path = os.path.join(self._exit_dir, wid)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(2000).strip()
            os.unlink(path)
        except OSError:
            return ""
        return text

    def _temp_roots(self) -> builtins.list[str]:
        """Where this provider's workers make temp directories: ours, or the one their env names."""
        roots = [tempfile.gettempdir()]
        roots += [self.env[v] for v in _TMP_VARS if self.env.get(v)]
        return list(dict.fromkeys(roots))

    def _remove_temp_dir(self, wid: str) -> None:
        """Remove the ``tidepool-<wid>-XXXXXXXX`` directory of an exited worker (once)."""
        if wid in self._cleaned:
            return
        self._cleaned.add(wid)
        self._forget(wid)
        name = re.compile(re.escape(f"tidepool-{wid}-") + r"[a-z0-9_]{8}")  # tempfile.mkdtemp's suffix
        for root in self._temp_roots():
            try:
                with os.scandir(root) as it:
                    found = [e.path for e in it if name.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for path in found:
                shutil.rmtree(path, ignore_errors=True)
