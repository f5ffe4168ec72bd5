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
"""

from __future__ import annotations

import builtins
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tidepool.providers.base import IdNames, ProviderFailure, worker_command
from tidepool.scaling.node_types import NodeType

WorkerListing = dict[str, dict[str, Any]]
#: worker numbers, shared by every LocalProvider in this process (ids must not repeat on the machine)
_SEQ = itertools.count(1)
#: the environment variables ``tempfile.gettempdir()`` reads, in its order
_TMP_VARS = ("TMPDIR", "TEMP", "TMP")


@dataclass
class LocalWorkerProcess:
    worker_id: str
    node_type: str
    request_id: str
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


#: glibc returns freed heap memory to the system at once instead of keeping it (large results
#: freed after spilling would otherwise hold a worker's RSS up); the user's environment wins
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536"}


class LocalProvider:
    """Starts ``python -m tidepool.worker`` processes for a scheduler on this machine."""

    def __init__(self, scheduler: str, token: str, *, env: dict[str, str] | None = None,
                 cwd: str | None = None, extra_args: list[str] | None = None,
                 heartbeat_interval: float = 1.0, preload: list[str] | None = None) -> None:  # fmt: skip
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
        for wid in ids:
            cmd = worker_command(self.scheduler, wid, node_type, sys.executable, self.heartbeat_interval,
                                 self.extra_args)  # fmt: skip
            env = {**MALLOC_ENV, **os.environ, **self.env, "TIDEPOOL_TOKEN": self.token, "TIDEPOOL_WORKER_ID": wid}
            try:
                proc = subprocess.Popen(cmd, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL)
            except OSError as exc:
                self._errors.append(ProviderFailure(request_id, wid, f"could not start worker {wid}: {exc}"))
                self._spawning.pop(wid, None)
                continue
            self.procs[wid] = LocalWorkerProcess(wid, node_type.name, request_id, proc)
            self._spawning.pop(wid, None)

    def terminate(self, worker_ids: builtins.list[str], sig: int = signal.SIGTERM) -> None:
        for wid in worker_ids:
            self._stopped.add(wid)
            p = self.procs.get(wid)
            if p is None:
                continue
            if p.proc.poll() is None:
                try:
                    p.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            else:
                self._remove_temp_dir(wid)

    def kill(self, worker_id: str) -> None:
        """SIGKILL one worker (for failure tests)."""
        self.terminate([worker_id], signal.SIGKILL)

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
                if rc not in (0, -signal.SIGTERM, -signal.SIGKILL) and wid not in self._stopped:
                    self._errors.append(ProviderFailure(p.request_id, wid, f"worker {wid} exited with code {rc}"))
                self._remove_temp_dir(wid)
                del self.procs[wid]
        errs, self._errors = self._errors, []
        return errs

    def close(self, timeout: float = 5.0) -> None:
        self.terminate(list(self.procs))
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        for wid in self.procs:
            self._remove_temp_dir(wid)
        self.procs.clear()

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
        name = re.compile(re.escape(f"tidepool-{wid}-") + r"[a-z0-9_]{8}")  # tempfile.mkdtemp's suffix
        for root in self._temp_roots():
            try:
                with os.scandir(root) as it:
                    found = [e.path for e in it if name.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for path in found:
                shutil.rmtree(path, ignore_errors=True)
