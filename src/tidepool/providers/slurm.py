"""SlurmProvider: one batch job per node, submitted with ``sbatch``; workers start inside the job.

Place in the data flow: the scaling controller asks for ``count`` nodes of a node type; this
provider submits ``count`` jobs (``sbatch --parsable``, the job script on stdin) and returns the
worker ids the jobs' workers will register with.  A job that waits in the queue is simply a launch
whose workers have not arrived yet: the controller keeps it as pending until they register (or its
launch timeout passes -- give node types a ``startup_estimate`` that matches your queue).
``terminate`` cancels a job (``scancel``) once all of its workers are to stop; ``close`` cancels
every job it submitted that has not ended.

State (guarded by one lock, because the controller calls from several threads):

- ``_jobs``: job id -> request id, node type, worker ids, last Slurm state, start/end times,
  whether we cancelled it and whether its end was reported.
- ``_requests``: request id -> worker ids (launching a request id twice submits once).
- ``_worker_job``: worker id -> job id.

Across scheduler restarts (``tag_with``, which a durable scheduler calls with a hash of its token):
jobs carry the tag in their name and ``--comment`` (node type, request, worker ids), and a new
provider takes the live jobs of this user with its tag into ``_jobs`` at once, so a restarted
scheduler's autoscaler lists, adopts and cancels the jobs the dead one submitted.

Observation is rate limited: ``squeue --states=all -j ID,...`` runs at most every ``poll_interval``
seconds, however often ``poll_errors``/``expiring`` are called (slurmctld is shared; do not hammer
it).  Jobs that left squeue's memory are looked up with ``scontrol show job``.  ``poll_errors``
reports jobs that ended without us cancelling them -- CANCELLED from outside, FAILED, TIMEOUT,
NODE_FAIL, OUT_OF_MEMORY, ... -- once each; a job that never started is reported as a failed launch
(``worker_id=None``) so the controller backs that node type off.

Walltime: ``expiring(now)`` lists the workers of running jobs that end within ``retire_margin``
seconds (default ``min(max(60, 10% of walltime), walltime / 2)``); the autoscaler retires them
gracefully (their data moves to other workers) before Slurm would kill them.  ``ends(now)`` gives
every running job's workers the time they are retired at (its end minus the margin), so a node type
with ``replace_before=True`` gets its replacement submitted its measured start-up before that.

Token: the job script *exports* ``TIDEPOOL_TOKEN``.  The script goes to ``sbatch`` on stdin, so it
is never written to a file here; Slurm keeps its copy in the controller's state directory, readable
only by the job's owner and the Slurm administrators (the token is never on a command line, so
``ps`` and ``squeue`` do not show it).  With ``token_file=PATH`` (on a file system the compute nodes
share) the token is written there with mode 600 instead and the script exports
``TIDEPOOL_TOKEN_FILE``.
"""

from __future__ import annotations

import builtins
import datetime as _dt
import hashlib
import itertools
import json
import logging
import math
import os
import pwd
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.comm.auth import write_token_file
from tidepool.comm.tls import TLSConfig
from tidepool.errors import ConfigError, ProviderError
from tidepool.providers._address import contact_address
from tidepool.providers.base import ProviderFailure, worker_command
from tidepool.resources import parse_bytes
from tidepool.scaling.node_types import NodeType

log = logging.getLogger("tidepool.providers.slurm")

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                    "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
                    "RESV_DEL_HOLD", "POWER_UP_NODE"})  # fmt: skip
# Ended states that are *not* failures: the workers exited by themselves with code 0
# (retired or told to stop by the scheduler).
CLEAN_END = frozenset({"COMPLETED"})
# Pending reasons that mean the job can never start as submitted: it is cancelled and reported.
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than any node of the partition has: lower cores=/memory=",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its walltime is above the partition's limit: lower walltime=",
    "BadConstraints": "no node matches its constraints: check job_extra=",
    "InvalidAccount": "the account is not valid: check account=",
    "InvalidQOS": "the QOS is not valid: check job_extra=",
    "DependencyNeverSatisfied": "its dependency can never be satisfied",
}
#: a never-starts reason counts once a job has shown it this long (seconds): right after submission
#: Slurm 22.05 shows ``PartitionConfig`` for about a second before the reason it settles on
#: (``PartitionTimeLimit`` for a walltime above the partition's), whose advice differs
NEVER_STARTS_SETTLE = 5.0
_HINTS = {
    "CANCELLED": "it was cancelled outside tidepool (scancel, an administrator, or preemption)",
    "FAILED": "the job script failed: look at the job's output file",
    "TIMEOUT": "it hit its walltime: raise walltime= or retire_margin=",
    "OUT_OF_MEMORY": "it ran out of memory: raise memory= (or the node type's memory)",
    "NODE_FAIL": "its node failed",
    "PREEMPTED": "it was preempted by a higher-priority job",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "it could not run before its deadline",
}


def parse_walltime(value: str | int | float | None) -> float | None:
    """Slurm time limit -> seconds (None for unlimited).

    Accepts every ``sbatch --time`` form: ``"MM"``, ``"MM:SS"``, ``"HH:MM:SS"``, ``"D-HH"``,
    ``"D-HH:MM"``, ``"D-HH:MM:SS"``, ``"UNLIMITED"``/``"INFINITE"``, and a number of minutes.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"walltime must be a Slurm time like '01:00:00', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"walltime must be positive, got {value!r} minutes")
        return float(value) * 60.0
    text = str(value).strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        raise ConfigError(f"cannot read walltime {value!r}: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    days, a, b, c = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + a * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        secs = a * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        secs = a * 60 + int(b)
    else:  # MM
        secs = a * 60
    if secs <= 0:
        raise ConfigError(f"walltime must be positive, got {value!r}")
    return float(secs)


def format_walltime(seconds: float) -> str:
    """Seconds -> ``D-HH:MM:SS`` (what sbatch --time accepts)."""
    s = int(math.ceil(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"


def _slurm_time(text: str) -> float | None:
    """``2026-12-03T00:31:06`` (local time, as squeue prints it) -> epoch seconds."""
    text = text.strip()
    if not text or text in ("N/A", "Unknown", "NONE", "None", "(null)"):
        return None
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def default_margin(walltime: float | None) -> float:
    """How long before its end a job's workers retire: max(60 s, 10%), at most half the walltime."""
    if walltime is None:
        return 60.0
    return min(max(60.0, 0.1 * walltime), walltime / 2)


def cluster_tag(token: str) -> str:
    """A tag naming one cluster's jobs, stable across scheduler restarts (the store keeps the
    token): a hash of the token, which shows nothing of it."""
    return "tp" + hashlib.sha256(b"tidepool-provider-tag:" + token.encode()).hexdigest()[:10]


def tag_comment(tag: str, node_type: str, request_id: str, worker_ids: Sequence[str]) -> str:
    """The ``--comment`` of a tagged job: ``tidepool:TAG:NODE_TYPE:REQUEST:W1,W2``."""
    return f"tidepool:{tag}:{node_type}:{request_id}:{','.join(worker_ids)}"


def _user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def parse_tagged(text: str, tag: str) -> builtins.list[_Job]:
    """Jobs carrying ``tag`` in ``squeue -h -o '%i|%T|%k'`` output (id, state, comment); lines
    of other jobs (another tag, no comment, not tidepool's) are skipped."""
    out: builtins.list[_Job] = []
    prefix = f"tidepool:{tag}:"
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith(prefix):
            continue
        fields = parts[2][len(prefix):].rsplit(":", 2)
        if len(fields) != 3 or not fields[1]:
            continue
        workers = [w for w in fields[2].split(",") if w]
        if not workers:
            continue
        state = parts[1].split()[0] if parts[1].strip() else "UNKNOWN"
        out.append(_Job(parts[0], fields[1], fields[0], workers, state=state))
    return out


@dataclass
class _Job:
    job_id: str
    request_id: str
    node_type: str
    worker_ids: list[str]
    submitted: float = field(default_factory=time.time)
    state: str = "PENDING"
    reason: str = ""
    nodelist: str = ""
    start: float | None = None
    end: float | None = None
    ran: bool = False  # was ever seen on a node
    cancelled: bool = False  # by us
    reported: bool = False
    exit_code: str = ""
    doomed: str = ""  # why it can never start (a NEVER_STARTS reason, shown NEVER_STARTS_SETTLE s)
    suspect: str = ""  # a NEVER_STARTS reason seen, not yet settled
    suspect_since: float = 0.0

    @property
    def ended(self) -> bool:
        return self.state not in ACTIVE


class SlurmProvider:
    """Workers in Slurm batch jobs, one job per node; see the module docstring.

    ``cores``/``memory`` default to the node type's ``cpu``/``memory`` resources (``memory`` takes
    ``"16GB"``-style strings; a bare number means megabytes, as in Slurm).  ``job_extra`` are more
    ``#SBATCH`` directives, e.g. ``["--qos=short", "--constraint=skylake"]``.  ``workers_per_job``
    overrides the node type's ``workers_per_node``.  ``python`` is the interpreter on the compute
    nodes; ``env`` is exported in the job script; ``workdir`` becomes the job's ``--chdir``;
    ``log_dir`` is where job output goes (``tidepool-JOBID.out``; default: Slurm's own default).
    ``submit_command`` etc. may carry a prefix, e.g. ``"ssh login-node sbatch"``.  ``scheduler_host``
    is the address compute nodes dial (default: the scheduler's own, or this machine's name when
    the scheduler listens on ``0.0.0.0``).
    """

    def __init__(self, partition: str | None = None, account: str | None = None, *,
                 walltime: str | int | None = "01:00:00", cores: int | None = None,
                 memory: str | int | None = None, job_extra: Sequence[str] = (),
                 workers_per_job: int | None = None, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, tls: TLSConfig | None = None, workdir: str | None = None,
                 log_dir: str | None = None, job_name: str = "tidepool",
                 submit_command: str = "sbatch", cancel_command: str = "scancel",
                 squeue_command: str = "squeue", scontrol_command: str = "scontrol",
                 poll_interval: float = 10.0, command_timeout: float = 30.0,
                 retire_margin: float | None = None, token_file: str | None = None,
                 heartbeat_interval: float = 1.0, extra_args: Sequence[str] | None = None,
                 scheduler: str = "", token: str = "", scheduler_host: str | None = None) -> None:  # fmt: skip
        self.partition = partition
        self.account = account
        self.walltime = walltime
        self.walltime_seconds = parse_walltime(walltime)
        if cores is not None and (isinstance(cores, bool) or int(cores) < 1):
            raise ConfigError(f"SlurmProvider: cores must be >= 1, got {cores!r}")
        self.cores = cores
        self.memory_mb = self._memory_mb(memory) if memory is not None else None
        if isinstance(job_extra, str):
            job_extra = [job_extra]
        self.job_extra = [str(x) for x in job_extra]
        for x in self.job_extra:
            if "\n" in x:
                raise ConfigError(f"SlurmProvider job_extra entries are single directives, got {x!r}")
        if workers_per_job is not None and workers_per_job < 1:
            raise ConfigError(f"SlurmProvider: workers_per_job must be >= 1, got {workers_per_job}")
        self.workers_per_job = workers_per_job
        self.python = python
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        if tls is not None:  # the workers find their certificates at the same paths
            self.env.update(tls.env())
        for k in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ConfigError(f"SlurmProvider env: {k!r} is not a shell variable name")
        self.workdir = workdir
        self.log_dir = log_dir
        self.job_name = job_name
        self.submit_command = shlex.split(submit_command)
        self.cancel_command = shlex.split(cancel_command)
        self.squeue_command = shlex.split(squeue_command)
        self.scontrol_command = shlex.split(scontrol_command)
        self.poll_interval = float(poll_interval)
        self.command_timeout = float(command_timeout)
        if retire_margin is not None and retire_margin < 0:
            raise ConfigError(f"SlurmProvider: retire_margin must be >= 0, got {retire_margin}")
        self.retire_margin = default_margin(self.walltime_seconds) if retire_margin is None else float(retire_margin)
        self.token_file = token_file
        self.heartbeat_interval = heartbeat_interval
        self.extra_args = list(extra_args or [])
        self.scheduler = scheduler
        self.token = token
        self.scheduler_host = scheduler_host
        self._jobs: dict[str, _Job] = {}
        self._requests: dict[str, list[str]] = {}
        self._worker_job: dict[str, str] = {}
        self._stopping: set[str] = set()
        self._seq = itertools.count(1)
        self._names: dict[str, list[str]] = {}
        self._submitting: set[str] = set()
        self._launch_errors: list[ProviderFailure] = []
        self._lock = threading.RLock()
        self._last_refresh = -math.inf
        self._closed = False
        for what, value in (("job_name", self.job_name), ("workdir", self.workdir), ("log_dir", self.log_dir),
                            ("partition", self.partition), ("account", self.account)):  # fmt: skip
            if value and any(c in str(value) for c in '"\n\r'):
                raise ConfigError(f"SlurmProvider: {what} cannot hold a double quote or a line break "
                                  f"(#SBATCH lines cannot carry them), got {value!r}")  # fmt: skip
        self.tag = ""  # tag_with(): jobs carry it, so a restarted scheduler's provider re-finds them

    @staticmethod
    def _memory_mb(memory: str | int | float) -> int:
        if isinstance(memory, (int, float)) and not isinstance(memory, bool):
            return int(math.ceil(memory))
        return int(math.ceil(parse_bytes(memory) / 2**20))

    def bind(self, scheduler: str, token: str) -> None:
        """Called by the cluster once the scheduler's address and token are known."""
        self.scheduler, self.token = scheduler, token
        if self.token_file and token:
            write_token_file(self.token_file, token)

    # ---- across scheduler restarts -----------------------------------------------------------------
    def tag_with(self, tag: str) -> None:
        """Tag every job submitted from now on with ``tag`` (job name and ``--comment``) and take
        over the live jobs of this user that carry it (submitted by the provider of an earlier
        scheduler process of the same cluster): they are listed, terminated and closed like this
        provider's own.  ``tag`` must be stable across restarts (:func:`cluster_tag`)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
            raise ConfigError(f"SlurmProvider tag must be letters, digits, '.', '_' or '-', got {tag!r}")
        with self._lock:
            self.tag = tag
            res = self._cmd([*self.squeue_command, "-h", "-u", _user(), "-o", "%i|%T|%k"])
            if res.returncode != 0:
                log.warning("squeue failed (%s): jobs of an earlier scheduler process not re-found",
                            res.stderr.strip())  # fmt: skip
                return
            for job in parse_tagged(res.stdout, tag):
                if job.job_id in self._jobs or job.ended:
                    continue
                self._jobs[job.job_id] = job
                for w in job.worker_ids:
                    self._worker_job[w] = job.job_id
                self._requests.setdefault(job.request_id, []).extend(job.worker_ids)
                self._names.setdefault(job.request_id, []).extend(job.worker_ids)
                log.info("re-found Slurm job %s (launch %s, workers %s) by tag %s",
                         job.job_id, job.request_id, job.worker_ids, tag)  # fmt: skip
        self.refresh(force=True)

    # ---- the job script -------------------------------------------------------------------------
    def job_script(self, node_type: NodeType, request_id: str, worker_ids: Sequence[str],
                   redact: bool = False) -> str:  # fmt: skip
        """The batch script for one node: ``#SBATCH`` lines, the token, one worker per id."""
        n = len(worker_ids)
        nt = node_type
        res = {k: v / n for k, v in nt.resources.items()} if n != nt.workers_per_node else None
        cores = self.cores or max(1, math.ceil(nt.resources.get("cpu", 1.0)))
        mem = self.memory_mb
        if mem is None and nt.resources.get("memory"):
            mem = int(math.ceil(nt.resources["memory"] / 2**20))
        name = f"{self.job_name}-{self.tag}-{nt.name}-{request_id}" if self.tag else f"{self.job_name}-{nt.name}-{request_id}"
        d = [_directive("--job-name", name), "--nodes=1", "--ntasks=1", f"--cpus-per-task={cores}"]
        if self.tag:  # what a provider of a restarted scheduler re-finds the job by (tag_with)
            d.append(f"--comment={tag_comment(self.tag, nt.name, request_id, worker_ids)}")
        if mem:
            d.append(f"--mem={mem}M")
        if self.walltime_seconds is not None:
            d.append(f"--time={format_walltime(self.walltime_seconds)}")
        if self.partition:
            d.append(_directive("--partition", self.partition))
        if self.account:
            d.append(_directive("--account", self.account))
        if self.workdir:
            d.append(_directive("--chdir", self.workdir))
        if self.log_dir:
            d.append(_directive("--output", os.path.join(self.log_dir, "tidepool-%j.out")))
        d += self.job_extra
        lines = ["#!/bin/sh", *(f"#SBATCH {x}" for x in d),
                 f"# tidepool: {n} worker(s) of node type {nt.name!r}, launch {request_id}"]  # fmt: skip
        if self.token_file:
            lines.append(f"export TIDEPOOL_TOKEN_FILE={shlex.quote(self.token_file)}")
        else:
            lines.append(f"export TIDEPOOL_TOKEN={'<redacted>' if redact else shlex.quote(self.token)}")
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines.append('tp_pids=""')
        for wid in worker_ids:
            cmd = worker_command(contact_address(self.scheduler, self.scheduler_host), wid, nt, self.python,
                                 self.heartbeat_interval, self.extra_args)  # fmt: skip
            if res is not None:  # workers_per_job differs from the type: split the node's resources
                cmd[cmd.index("--resources") + 1] = json.dumps(res)
            lines.append(f"TIDEPOOL_WORKER_ID={shlex.quote(wid)} "
                         + " ".join(shlex.quote(a) for a in cmd) + " </dev/null &")  # fmt: skip
            lines.append('tp_pids="$tp_pids $!"')
        lines += [
            # scancel / walltime send TERM to the job: pass it on, then wait for a graceful exit
            "tp_stop() { kill -TERM $tp_pids 2>/dev/null; }",
            "trap tp_stop TERM INT USR1",
            "tp_rc=0",
            "for tp_p in $tp_pids; do",
            '  while :; do wait "$tp_p"; tp_s=$?; '
            'if [ $tp_s -gt 128 ] && kill -0 "$tp_p" 2>/dev/null; then continue; fi; break; done',
            "  [ $tp_s -ne 0 ] && tp_rc=$tp_s",
            "done",
            "exit $tp_rc",
        ]
        return "\n".join(lines) + "\n"

    # ---- commands ---------------------------------------------------------------------------------
    def _cmd(self, argv: builtins.list[str], input: str | None = None,
             rid: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        try:
            return subprocess.run(argv, input=input, capture_output=True, text=True,
                                  timeout=self.command_timeout, stdin=None if input is not None else subprocess.DEVNULL)  # fmt: skip
        except FileNotFoundError as exc:
            raise ProviderError(f"{argv[0]!r} not found: install the Slurm client commands on this "
                                f"machine or set the *_command options (now {argv[0]!r})", rid) from exc  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise ProviderError(f"{shlex.join(argv[:3])} ... did not answer within {self.command_timeout:g}s: "
                                "is slurmctld up? (try: scontrol ping)", rid) from exc  # fmt: skip

    def _submit(self, script: str, rid: str) -> str:
        res = self._cmd([*self.submit_command, "--parsable"], input=script, rid=rid)
        out = res.stdout.strip().splitlines()
        job = out[-1].split(";")[0].strip() if out else ""
        if res.returncode != 0 or not job.isdigit():
            err = (res.stderr or res.stdout).strip()
            hint = ""
            if "configuration is not available" in err or "Requested node configuration" in err:
                hint = " (no node can offer these cores/memory/partition: lower cores=/memory= or pick another partition)"
            elif "Invalid account" in err or "partition" in err.lower():
                hint = " (check partition=/account= with: sinfo -s; sacctmgr show assoc user=$USER)"
            raise ProviderError(f"sbatch refused the job for launch {rid}: {err or 'no job id printed'}{hint}", rid)
        return job

    def _cancel(self, job_ids: builtins.list[str]) -> None:
        if not job_ids:
            return
        res = self._cmd([*self.cancel_command, *job_ids])
        if res.returncode != 0 and "Invalid job id" not in res.stderr and "already completing" not in res.stderr:
            raise ProviderError(f"scancel {' '.join(job_ids)} failed: {res.stderr.strip()}; "
                                "cancel them by hand (scancel JOBID)")  # fmt: skip

    # ---- launch / terminate -----------------------------------------------------------------------
    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        """The ids the workers of ``count`` jobs will register with (``workers_per_job`` each)."""
        with self._lock:
            ids = self._names.get(request_id)
            if ids is None:
                per_job = self.workers_per_job or node_type.workers_per_node
                ids = [f"{node_type.name}-{request_id}-{next(self._seq)}" for _ in range(count * per_job)]
                self._names[request_id] = ids
            return list(ids)

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Submit ``count`` jobs (one per node) from a background thread and return at once.

        All or nothing: if one submission fails, the jobs already submitted for this request are
        cancelled and the failure (with sbatch's message) comes back through ``poll_errors``.
        """
        ids = self.worker_ids(node_type, count, request_id)
        with self._lock:
            if request_id in self._requests or request_id in self._submitting:
                return
            self._submitting.add(request_id)
        threading.Thread(target=self._submit_request, args=(node_type, count, request_id, ids),
                         name=f"tidepool-sbatch-{request_id}", daemon=True).start()  # fmt: skip

    def _submit_request(self, node_type: NodeType, count: int, request_id: str, ids: builtins.list[str]) -> None:
        try:
            self.submit_now(node_type, count, request_id, ids)
        except ProviderError as exc:
            with self._lock:
                self._launch_errors.append(ProviderFailure(request_id, None, str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported, never lost in a thread
            with self._lock:
                self._launch_errors.append(ProviderFailure(request_id, None, f"{type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._submitting.discard(request_id)

    def submit_now(self, node_type: NodeType, count: int, request_id: str,
                   ids: builtins.list[str] | None = None) -> builtins.list[str]:  # fmt: skip
        """``launch``'s work, blocking: submit the jobs now and return the worker ids, or raise
        :class:`ProviderError` (with the request id and sbatch's message)."""
        ids = ids if ids is not None else self.worker_ids(node_type, count, request_id)
        with self._lock:
            if request_id in self._requests:
                return list(self._requests[request_id])
            if self._closed:
                raise ProviderError("this SlurmProvider is closed; create a new one", request_id)
            if not self.scheduler or (not self.token and not self.token_file):
                raise ProviderError(f"SlurmProvider cannot launch {request_id}: no scheduler address/token; "
                                    "call bind(address, token) or use cluster.adapt(provider=...)", request_id)  # fmt: skip
        # sbatch runs without the lock (it may take up to command_timeout per job on a busy
        # slurmctld): list() shows the request as SUBMITTING meanwhile, and terminate/close/expiring
        # answer at once; what they did meanwhile is looked at when the jobs are recorded below
        per_job = len(ids) // max(1, count)
        submitted: builtins.list[_Job] = []
        try:
            for n in range(count):
                with self._lock:
                    if self._closed:
                        raise ProviderError(f"this SlurmProvider was closed while launch {request_id} was being "
                                            "submitted; its jobs are cancelled", request_id)  # fmt: skip
                job_ids = ids[n * per_job:(n + 1) * per_job]
                job_id = self._submit(self.job_script(node_type, request_id, job_ids), request_id)
                submitted.append(_Job(job_id, request_id, node_type.name, job_ids))
        except ProviderError:
            self._cancel_partial(request_id, submitted)
            raise
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                for j in submitted:
                    self._jobs[j.job_id] = j
                    for w in j.worker_ids:
                        self._worker_job[w] = j.job_id
                self._requests[request_id] = list(ids)
                log.info("launch %s: submitted Slurm jobs %s for %s", request_id, [j.job_id for j in submitted], ids)
                stopped = [j for j in submitted if set(j.worker_ids) <= self._stopping]  # terminated meanwhile
        if closed:
            self._cancel_partial(request_id, submitted)
            raise ProviderError(f"this SlurmProvider was closed while launch {request_id} was being submitted; "
                                "its jobs are cancelled", request_id)  # fmt: skip
        if stopped:
            with self._lock:
                self._cancel([j.job_id for j in stopped])
                for j in stopped:
                    j.cancelled = True
        return list(ids)

    def _cancel_partial(self, request_id: str, submitted: builtins.list[_Job]) -> None:
        try:
            self._cancel([j.job_id for j in submitted])
        except ProviderError as exc:
            log.warning("could not cancel partial launch %s: %s", request_id, exc)

    def terminate(self, worker_ids: builtins.list[str]) -> None:
        """Mark these workers stopped; ``scancel`` each job once none of its workers is wanted."""
        with self._lock:
            # ids of a launch still being submitted count too: its jobs are cancelled once recorded
            submitting = {w for rid in self._submitting for w in self._names.get(rid, ())}
            self._stopping.update(w for w in worker_ids if w in self._worker_job or w in submitting)
            jobs = {self._worker_job[w] for w in worker_ids if w in self._worker_job}
            todo = [j for j in sorted(jobs, key=int)
                    if not self._jobs[j].cancelled and set(self._jobs[j].worker_ids) <= self._stopping]  # fmt: skip
            self._cancel(todo)  # raises (and leaves them for close() to retry) if scancel fails
            for j in todo:
                self._jobs[j].cancelled = True

    # ---- observation ------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Update job states from squeue (at most every ``poll_interval`` s unless ``force``)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < self.poll_interval:
                return
            self._last_refresh = now
            watch = [j for j in self._jobs.values() if not j.ended]
            if not watch:
                return
            fmt = "%i|%T|%r|%N|%S|%e"
            res = self._cmd([*self.squeue_command, "-h", "--states=all", "-o", fmt,
                             "-j", ",".join(j.job_id for j in watch)])  # fmt: skip
            if res.returncode != 0 and "Invalid job id" not in res.stderr:
                log.warning("squeue failed (%s); job states not updated", res.stderr.strip())
                return
            seen: set[str] = set()
            for line in res.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) != 6 or parts[0] not in self._jobs:
                    continue
                job = self._jobs[parts[0]]
                seen.add(job.job_id)
                self._update(job, parts[1], parts[2], parts[3], parts[4], parts[5])
            for job in watch:
                if job.job_id not in seen:  # gone from squeue's memory: ask scontrol once
                    self._scontrol(job)
                elif job.ended and not job.exit_code:
                    self._scontrol(job)

    def _update(self, job: _Job, state: str, reason: str, nodes: str, start: str, end: str,
                now: float | None = None) -> None:  # fmt: skip
        job.state = state.split()[0] if state else "UNKNOWN"
        job.reason = reason
        if job.state == "PENDING" and reason in NEVER_STARTS:
            now = time.time() if now is None else now
            if job.suspect != reason:
                job.suspect, job.suspect_since = reason, now
            elif now - job.suspect_since >= NEVER_STARTS_SETTLE:
                job.doomed = reason
        else:
            job.suspect = ""
        if nodes and nodes not in ("(null)", "None assigned"):
            job.nodelist = nodes
        if job.state in ("RUNNING", "COMPLETING", "SUSPENDED") or job.nodelist:
            job.ran = True
        if job.state == "RUNNING":
            job.start = _slurm_time(start)
            job.end = _slurm_time(end)
            if job.end is None and job.start is not None and self.walltime_seconds is not None:
                job.end = job.start + self.walltime_seconds

    def _scontrol(self, job: _Job) -> None:
        res = self._cmd([*self.scontrol_command, "show", "job", "-o", job.job_id])
        if res.returncode != 0:
            if job.state in ACTIVE:  # purged: it ended and we missed how
                job.state, job.reason = "UNKNOWN", "no longer known to Slurm"
            return
        kv = dict(re.findall(r"(\w[\w/:]*)=(\S*)", res.stdout))
        self._update(job, kv.get("JobState", "UNKNOWN"), kv.get("Reason", ""), kv.get("NodeList", ""),
                     kv.get("StartTime", ""), kv.get("EndTime", ""))  # fmt: skip
        job.exit_code = kv.get("ExitCode", "")

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        """Worker id -> {node_type, request_id, job_id, state, alive, nodelist, end_time} (squeue, at
        most every ``poll_interval`` s: the autoscaler lists every 2 s while a launch waits, and a
        job may wait in the queue for hours)."""
        with self._lock:
            try:
                self.refresh()
            except ProviderError as exc:
                log.warning("list: %s", exc)
            out = {}
            for job in self._jobs.values():
                for w in job.worker_ids:
                    out[w] = {"node_type": job.node_type, "request_id": job.request_id, "job_id": job.job_id,
                              "state": job.state, "alive": not job.ended, "nodelist": job.nodelist,
                              "end_time": job.end, "stopping": w in self._stopping}  # fmt: skip
            for rid in self._submitting:  # sbatch still running: listed, so not reconciled away
                for w in self._names.get(rid, ()):
                    out.setdefault(w, {"request_id": rid, "state": "SUBMITTING", "alive": True})
            return out

    def jobs(self) -> dict[str, str]:
        """Job id -> last seen Slurm state, for every job this provider submitted."""
        with self._lock:
            return {j.job_id: j.state for j in self._jobs.values()}

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        """Jobs that ended without us cancelling them, each reported once (see module docstring)."""
        with self._lock:
            out: builtins.list[ProviderFailure] = self._launch_errors
            self._launch_errors = []
            try:
                self.refresh()
            except ProviderError as exc:
                log.warning("poll_errors: %s", exc)
                return out
            seen: set[str] = set()
            doomed = [j for j in self._jobs.values() if j.doomed and not j.ended and not j.cancelled]
            if doomed:
                try:
                    self._cancel([j.job_id for j in doomed])
                except ProviderError as exc:
                    log.warning("could not cancel jobs that can never start: %s", exc)
            for job in self._jobs.values():
                if job.doomed and not job.reported:
                    job.reported = job.cancelled = True
                    if job.request_id not in seen:
                        seen.add(job.request_id)
                        out.append(ProviderFailure(job.request_id, None, self._describe(job)))
                    continue
                if not job.ended or job.reported or job.cancelled:
                    continue
                job.reported = True
                if set(job.worker_ids) <= self._stopping:
                    continue  # its workers were already let go
                if job.state in CLEAN_END and job.exit_code in ("", "0:0"):
                    continue  # workers exited by themselves (retired or told to stop)
                if job.request_id in seen:
                    continue  # one report per request per poll: the controller backs off once
                seen.add(job.request_id)
                out.append(ProviderFailure(job.request_id, job.worker_ids[0] if job.ran else None,
                                           self._describe(job)))  # fmt: skip
            return out

    def _describe(self, job: _Job) -> str:
        if job.doomed:
            return (f"Slurm job {job.job_id} (launch {job.request_id}, node type {job.node_type!r}) can never "
                    f"start (pending, reason {job.doomed}): {NEVER_STARTS[job.doomed]}; it was cancelled")  # fmt: skip
        when = "after starting" if job.ran else "before it started"
        hint = _HINTS.get(job.state, "")
        code = f", exit code {job.exit_code}" if job.exit_code and job.exit_code != "0:0" else ""
        where = ""
        if self.log_dir:
            where = f"; output: {os.path.join(self.log_dir, f'tidepool-{job.job_id}.out')}"
        return (f"Slurm job {job.job_id} (launch {job.request_id}, node type {job.node_type!r}) ended "
                f"{job.state} {when} (reason {job.reason or 'none'}{code})"
                f"{': ' + hint if hint else ''}{where}")  # fmt: skip

    def expiring(self, now_wall: float | None = None) -> builtins.list[str]:
        """Workers of running jobs that end within ``retire_margin`` s of ``now_wall`` (epoch s)."""
        with self._lock:
            try:
                self.refresh()
            except ProviderError as exc:
                log.warning("expiring: %s", exc)
            now = time.time() if now_wall is None else now_wall
            out: builtins.list[str] = []
            for job in self._jobs.values():
                if job.state == "RUNNING" and not job.cancelled and job.end is not None \
                        and job.end - self.retire_margin <= now:  # fmt: skip
                    out += [w for w in job.worker_ids if w not in self._stopping]
            return out

    def ends(self, now_wall: float | None = None) -> dict[str, float]:
        """Workers of running jobs -> when they must be gone (epoch s): the job's end minus
        ``retire_margin``, when they are retired (``replace_before`` starts replacements for it)."""
        with self._lock:
            try:
                self.refresh()
            except ProviderError as exc:
                log.warning("ends: %s", exc)
            out: dict[str, float] = {}
            for job in self._jobs.values():
                if job.state == "RUNNING" and not job.cancelled and job.end is not None:
                    for w in job.worker_ids:
                        if w not in self._stopping:
                            out[w] = job.end - self.retire_margin
            return out

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every job this provider submitted that has not ended (idempotent).  Waits (at most
        ``command_timeout`` s) for submissions still running, which cancel their jobs themselves once
        they see the provider closed: a program exiting right after ``close()`` leaves no job."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + self.command_timeout + 1.0
        while True:
            with self._lock:
                if not self._submitting:
                    break
            if time.monotonic() > deadline:
                log.warning("SlurmProvider.close: sbatch still running for %s; their jobs may be left",
                            sorted(self._submitting))  # fmt: skip
                break
            time.sleep(0.05)
        with self._lock:
            todo = [j for j in self._jobs.values() if not j.cancelled and not j.ended]
            for j in todo:
                self._stopping.update(j.worker_ids)
            try:
                self._cancel(sorted((j.job_id for j in todo), key=int))
            except ProviderError as exc:
                log.warning("SlurmProvider.close: %s", exc)
                return
            for j in todo:
                j.cancelled = True

    def __repr__(self) -> str:
        return f"<SlurmProvider partition={self.partition} jobs={len(self._jobs)}>"


def _directive(flag: str, value: str) -> str:
    """``#SBATCH flag=value``, the value in double quotes when it holds blanks (sbatch splits the
    line on them: a log directory with a space made every submission fail)."""
    return f'{flag}="{value}"' if any(c.isspace() for c in value) else f"{flag}={value}"
