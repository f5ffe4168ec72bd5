"""SlurmProvider: unit tests (walltimes, job scripts, expiring) and a real single-node Slurm.

The session fixture brings Slurm up from scratch in a private directory: its own munged on its own
socket, a slurm.conf generated from ``slurmd -C`` with free ports, ``slurmctld -D`` and
``slurmd -D``; ``SLURM_CONF`` points every Slurm command of this process at it, so a Slurm already
on the machine is not touched.  Needs root and the slurm-wlm + munge packages
(``.ci/setup-services.sh`` installs them); those tests are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import tidepool
from tidepool.errors import ConfigError, ProviderError
from tidepool.providers.local import LocalProvider
from tidepool.providers.slurm import (
    SlurmProvider,
    _Job,
    cluster_tag,
    default_margin,
    format_walltime,
    parse_tagged,
    parse_walltime,
    tag_comment,
)
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.policies import Adaptive, IdleRetire
from tidepool.testing import journal_records

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")


def whereami(i: int, delay: float = 0.3) -> tuple[int, str, str]:
    time.sleep(delay)
    return i, os.environ.get("SLURM_JOB_ID", ""), os.environ.get("TIDEPOOL_WORKER_ID", "")


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- unit tests: no Slurm needed -----------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("1", 60), ("05:30", 330), ("01:00:00", 3600), ("2-00:00:00", 172800),
    ("1-12", 129600), ("1-01:30", 91800), (90, 5400), ("UNLIMITED", None), (None, None),
])  # fmt: skip
def test_parse_walltime_accepts_slurm_forms(text: Any, seconds: float | None) -> None:
    assert parse_walltime(text) == seconds


@pytest.mark.parametrize("bad", ["", "1:2:3:4", "abc", "-5", "0", 0, True])
def test_parse_walltime_rejects_garbage(bad: Any) -> None:
    with pytest.raises(ConfigError, match="walltime"):
        parse_walltime(bad)


def test_format_walltime_and_default_margin() -> None:
    assert format_walltime(3600) == "01:00:00" and format_walltime(90061) == "1-01:01:01"
    assert default_margin(3600.0) == 360.0  # 10 % of an hour
    assert default_margin(300.0) == 60.0  # at least a minute...
    assert default_margin(60.0) == 30.0  # ...but never more than half the walltime
    assert default_margin(None) == 60.0


def test_job_script_exports_the_token_and_starts_one_worker_per_id() -> None:
    p = SlurmProvider("debug", "proj", walltime="1-00:00:00", job_extra=["--qos=short"], env={"A": "b c"},
                      python="/opt/py/bin/python", workdir="/scratch/x", log_dir="/logs")  # fmt: skip
    p.bind("tcp://10.0.0.1:8786", "s3cret")
    nt = NodeType("big", {"cpu": 8, "memory": "16GiB"}, workers_per_node=2)
    script = p.job_script(nt, "r4", ["big-r4-1", "big-r4-2"])
    for line in ["#SBATCH --partition=debug", "#SBATCH --account=proj", "#SBATCH --time=1-00:00:00",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=16384M", "#SBATCH --qos=short",
                 "#SBATCH --chdir=/scratch/x", "#SBATCH --output=/logs/tidepool-%j.out",
                 "export TIDEPOOL_TOKEN=s3cret", "export A='b c'"]:  # fmt: skip
        assert line in script.splitlines(), line
    workers = [ln for ln in script.splitlines() if "-m tidepool.worker" in ln]
    assert len(workers) == 2 and all("s3cret" not in ln for ln in workers)  # never on a command line
    assert "--id big-r4-1" in workers[0] and '{"cpu": 4.0, "memory": 8589934592.0}' in workers[0]
    assert "<redacted>" in p.job_script(nt, "r4", ["big-r4-1"], redact=True)
    spaced = SlurmProvider(log_dir="/shared/my logs", workdir="/scratch/a b")
    spaced.bind("tcp://10.0.0.1:8786", "s3cret")
    lines = spaced.job_script(nt, "r5", ["big-r5-1"]).splitlines()
    assert '#SBATCH --output="/shared/my logs/tidepool-%j.out"' in lines and '#SBATCH --chdir="/scratch/a b"' in lines
    with pytest.raises(ConfigError, match="double quote"):
        SlurmProvider(log_dir='/logs/"x"')
    with_file = SlurmProvider(token_file="/shared/tok")
    with_file.scheduler = "tcp://h:1"
    assert "export TIDEPOOL_TOKEN_FILE=/shared/tok" in with_file.job_script(nt, "r1", ["a", "b"])


def _slow_sbatch(tmp_path: Path) -> tuple[SlurmProvider, Path, Path]:
    """A provider whose sbatch waits for a gate file, then prints a job id; scancel logs its
    arguments; squeue knows no job."""
    gate, cancels = tmp_path / "gate", tmp_path / "cancels"
    sbatch = tmp_path / "sbatch"
    count = tmp_path / "count"
    sbatch.write_text(f"#!/bin/sh\ncat >/dev/null\nwhile [ ! -e {gate} ]; do sleep 0.02; done\n"
                      f"n=$(( $(cat {count} 2>/dev/null || echo 100) + 1 )); echo $n > {count}; echo $n\n")  # fmt: skip
    scancel = tmp_path / "scancel"
    scancel.write_text(f"#!/bin/sh\necho \"$@\" >> {cancels}\n")
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\nexit 0\n")
    for f in (sbatch, scancel, squeue):
        f.chmod(0o755)
    p = SlurmProvider(submit_command=str(sbatch), cancel_command=str(scancel), squeue_command=str(squeue),
                      scontrol_command=str(squeue), command_timeout=30)  # fmt: skip
    p.bind("tcp://127.0.0.1:1", "t")
    return p, gate, cancels


def test_list_terminate_and_close_answer_at_once_while_sbatch_runs(tmp_path: Path) -> None:
    """Found by a bug hunt: ``submit_now`` held the provider's lock across every sbatch, so
    ``list()`` (and terminate, expiring, close: every call the autoscaler makes) waited for the
    whole submission, and the SUBMITTING state it lists could never be seen."""
    p, gate, cancels = _slow_sbatch(tmp_path)
    p.launch(NodeType("cpu"), 2, "r1")
    listed = p.list()  # sbatch is waiting for the gate: this answers now
    assert {w["state"] for w in listed.values()} == {"SUBMITTING"} and len(listed) == 2
    p.terminate(list(listed))  # terminated while being submitted: cancelled once recorded
    gate.touch()
    wait_until(lambda: cancels.exists(), 10, "the terminated launch's jobs to be cancelled")
    assert len(cancels.read_text().split()) == 2
    assert all(j.cancelled for j in p._jobs.values()) and len(p._jobs) == 2


def test_a_close_during_sbatch_cancels_what_was_submitted(tmp_path: Path) -> None:
    """Review: close() returned while sbatch ran; a program exiting right after it (a ``with``
    block's end) killed the submitting thread, and the job ran to its walltime.  close() now waits
    for the submission (bounded) and the job is cancelled by the time it returns."""
    import threading

    p, gate, cancels = _slow_sbatch(tmp_path)
    p.launch(NodeType("cpu"), 1, "r1")
    wait_until(lambda: p.list(), 10, "the launch to be listed")
    threading.Timer(0.5, gate.touch).start()  # sbatch returns while close() waits for it
    p.close()
    assert cancels.exists() and cancels.read_text().split()  # cancelled before close() returned
    errors: list[Any] = []
    wait_until(lambda: errors.extend(p.poll_errors()) or errors, 10, "the launch's failure")
    assert "closed while launch r1" in errors[0].message and not p._jobs


def test_a_never_starts_reason_counts_once_it_settles_so_the_advice_is_the_right_one() -> None:
    """Found by a bug hunt: a walltime above the partition's limit was reported as "asks for more
    than any node has: lower cores=/memory=": Slurm shows PartitionConfig for about a second after
    submission, then settles on PartitionTimeLimit, and the first reason seen was taken."""
    from tidepool.providers.slurm import NEVER_STARTS_SETTLE

    p = SlurmProvider(walltime="00:10:00")
    job = _Job("7", "r1", "cpu", ["cpu-r1-1"])
    p._update(job, "PENDING", "PartitionConfig", "", "", "", now=100.0)
    p._update(job, "PENDING", "PartitionTimeLimit", "", "", "", now=101.0)
    p._update(job, "PENDING", "PartitionTimeLimit", "", "", "", now=101.0 + NEVER_STARTS_SETTLE / 2)
    assert not job.doomed  # not settled yet
    p._update(job, "PENDING", "PartitionTimeLimit", "", "", "", now=101.0 + NEVER_STARTS_SETTLE)
    assert job.doomed == "PartitionTimeLimit" and "lower walltime=" in p._describe(job)
    queued = _Job("8", "r2", "cpu", ["cpu-r2-1"])  # an ordinary wait never dooms a job
    for t in range(0, 100, 10):
        p._update(queued, "PENDING", "Priority" if t % 20 else "PartitionConfig", "", "", "", now=float(t))
    assert not queued.doomed


def test_tagged_jobs_are_parsed_from_squeue_and_other_jobs_skipped() -> None:
    tag = cluster_tag("s3cret")
    assert tag == cluster_tag("s3cret") and tag != cluster_tag("other") and "s3cret" not in tag
    out = "\n".join([
        f"12|RUNNING|{tag_comment(tag, 'big', 'r4', ['big-r4-1', 'big-r4-2'])}",
        f"13|PENDING|{tag_comment(tag, 'small', 'r5', ['small-r5-3'])}",
        f"14|RUNNING|{tag_comment(cluster_tag('other'), 'big', 'r4', ['big-r4-1'])}",  # another cluster
        "15|RUNNING|(null)", "16|RUNNING|somebody's comment", "garbage", f"x|RUNNING|tidepool:{tag}:a:b:c",
        f"17|RUNNING|tidepool:{tag}:big:r6:",  # no workers: not ours to manage
    ])  # fmt: skip
    jobs = parse_tagged(out, tag)
    assert [(j.job_id, j.state, j.node_type, j.request_id, j.worker_ids) for j in jobs] == [
        ("12", "RUNNING", "big", "r4", ["big-r4-1", "big-r4-2"]), ("13", "PENDING", "small", "r5", ["small-r5-3"])]
    p = SlurmProvider()
    p.bind("tcp://h:1", "t")
    p.tag = tag
    script = p.job_script(NodeType("big"), "r4", ["big-r4-1"]).splitlines()
    assert f"#SBATCH --job-name=tidepool-{tag}-big-r4" in script
    assert f"#SBATCH --comment=tidepool:{tag}:big:r4:big-r4-1" in script
    with pytest.raises(ConfigError, match="tag"):
        p.tag_with("a b")


def test_missing_sbatch_is_a_provider_error_that_says_what_to_do() -> None:
    p = SlurmProvider(submit_command="/nonexistent/sbatch")
    p.bind("tcp://127.0.0.1:1", "t")
    with pytest.raises(ProviderError, match="not found") as info:
        p.submit_now(NodeType("x"), 1, "r9")
    assert info.value.request_id == "r9"
    p.launch(NodeType("x"), 1, "r10")  # never raises, never blocks: the failure comes back once
    errors: list[Any] = []
    wait_until(lambda: errors.extend(p.poll_errors()) or errors, 10, "the failed submission")
    assert errors[0].request_id == "r10" and "not found" in errors[0].message and not p.poll_errors()


def test_listing_runs_squeue_at_most_every_poll_interval(tmp_path: Path) -> None:
    """Found by a Slurm hunt: list() forced a squeue every time, and the autoscaler lists every
    2 s while a launch waits: 15 squeue calls in 30 s with poll_interval=10 (a job may queue for hours)."""
    calls = tmp_path / "calls"
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\necho x >> {calls}\necho '7|PENDING|Priority||N/A|N/A'\n")
    squeue.chmod(0o755)
    p = SlurmProvider(squeue_command=str(squeue), scontrol_command=str(squeue), poll_interval=10.0)
    p._jobs = {"7": _Job("7", "r1", "cpu", ["cpu-r1-1"], state="PENDING")}
    for _ in range(5):
        assert p.list()["cpu-r1-1"]["state"] == "PENDING"
    assert len(calls.read_text().split()) == 1


def test_expiring_lists_workers_of_jobs_that_end_within_the_margin() -> None:
    p = SlurmProvider(walltime="01:00:00", retire_margin=120, poll_interval=1e9)
    p._last_refresh = time.monotonic()  # no squeue here: use the job records as they are
    t = 1_000_000.0
    p._jobs = {
        "1": _Job("1", "r1", "cpu", ["cpu-r1-1", "cpu-r1-2"], state="RUNNING", start=t - 3500, end=t + 100),
        "2": _Job("2", "r1", "cpu", ["cpu-r1-3"], state="RUNNING", start=t - 100, end=t + 3500),
        "3": _Job("3", "r2", "cpu", ["cpu-r2-4"], state="PENDING"),
        "4": _Job("4", "r3", "cpu", ["cpu-r3-5"], state="RUNNING", end=t + 10, cancelled=True),
    }
    p._stopping = {"cpu-r1-2"}
    assert p.expiring(t) == ["cpu-r1-1"]
    assert p.expiring(t - 1000) == []
    assert sorted(p.expiring(t + 3400)) == ["cpu-r1-1", "cpu-r1-3"]


def retired_gracefully(records: list[dict[str, Any]], wid: str | None) -> bool:
    """The scheduler closed ``wid`` after a successful graceful retirement (no failure, no loss)."""
    done = any(r["kind"] == "retire-done" and r["worker"] == wid and r["outcome"] == "retired" for r in records)
    lost = any(r["kind"] == "worker-leave" and r["worker"] == wid and not r.get("graceful") for r in records)
    return done and not lost


class ExpiringLocal(LocalProvider):
    """Local workers; once ``armed``, the first one launched 'reaches its walltime'."""

    def __init__(self) -> None:
        super().__init__("", "")
        self.asked: list[float] = []
        self.first: str | None = None
        self.armed = False

    def bind(self, scheduler: str, token: str) -> None:
        self.scheduler, self.token = scheduler, token

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        super().launch(node_type, count, request_id)
        self.first = self.first or self.worker_ids(node_type, count, request_id)[0]

    def expiring(self, now_wall: float) -> list[str]:
        self.asked.append(now_wall)
        p = self.procs.get(self.first or "")
        return [p.worker_id] if self.armed and p is not None and p.proc.poll() is None else []


def test_autoscaler_retires_expiring_workers_gracefully() -> None:
    provider = ExpiringLocal()
    nt = NodeType("w", {"cpu": 1}, min_nodes=2, max_nodes=2, startup_estimate=0.5)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider)
        futs = client.map(whereami, range(10), [0.1] * 10)
        assert [r[0] for r in client.gather(futs, timeout=60)] == list(range(10))
        journal = cluster.journal
        assert journal is not None
        first = provider.first
        provider.armed = True  # its results are still wanted: they must move to the other worker
        wait_until(lambda: retired_gracefully(journal.records, first), 20, f"{first} to be retired")
        retired = [r for r in journal.of_kind("retire") if r["worker"] == first]
        assert retired and "walltime" in retired[0]["reason"]
        assert [r[0] for r in client.gather(futs, timeout=30)] == list(range(10))  # nothing was lost
        assert provider.asked and abs(provider.asked[-1] - time.time()) < 60  # wall-clock time


# ---- a real single-node Slurm ----------------------------------------------------------------------
@dataclass
class Slurm:
    dir: str
    conf: str
    procs: dict[str, subprocess.Popen]  # type: ignore[type-arg]

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout

    def active(self, job_ids: list[str]) -> dict[str, str]:
        """Job id -> state for the given jobs that are still pending/running/completing."""
        if not job_ids:
            return {}
        out = self.run("squeue", "-h", "-o", "%i|%T", "-j", ",".join(job_ids))
        return dict(line.split("|", 1) for line in out.split())


def _start(argv: list[str], log: str) -> subprocess.Popen:  # type: ignore[type-arg]
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f)


def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


PROVIDERS_MD = Path(__file__).resolve().parent.parent / "docs" / "providers.md"


def doc_block(marker: str, lang: str = "") -> str:
    """The fenced block (opened by ```lang) of docs/providers.md that contains ``marker``."""
    blocks, current, opened = [], [], None
    for line in PROVIDERS_MD.read_text().splitlines():
        if line.startswith("```"):
            if opened is None:
                opened, current = line[3:].strip(), []
            else:
                blocks.append((opened, "\n".join(current)))
                opened = None
        elif opened is not None:
            current.append(line)
    for kind, text in blocks:
        if kind == lang and marker in text:
            return text
    raise AssertionError(f"docs/providers.md has no ```{lang} block with {marker!r}")


def slurm_conf(d: str, node: str, sock: str) -> str:
    """docs/providers.md's one-machine slurm.conf, as written, with this machine's host name and
    ``slurmd -C`` line, the state/log paths moved into ``d``, plus what only a test needs: free
    ports and a private munge socket (a Slurm already on the machine is not touched)."""
    host = socket.gethostname()
    lines = []
    for line in doc_block("SlurmctldHost=myhost").splitlines():
        if line.startswith("NodeName="):
            line = f"{node} NodeAddr=127.0.0.1 State=UNKNOWN"
        line = line.replace("myhost", host).replace("/var/lib/slurm", d).replace("/var/log/slurm", f"{d}/log")
        line = line.replace("/run/", f"{d}/")
        lines.append(line.replace(f"{d}/slurmctld", f"{d}/ctld").replace(f"{d}/slurmd", f"{d}/d")
                     if line.startswith(("StateSaveLocation", "SlurmdSpoolDir")) else line)  # fmt: skip
    lines += [f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", f"AuthInfo=socket={sock}",
              "KillWait=5"]  # fmt: skip
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def slurm() -> Iterator[Slurm]:
    if os.geteuid() != 0:
        pytest.skip("needs root: runs slurmctld, slurmd and munged")
    missing = [p for p in (*DAEMONS, shutil.which("sbatch") or "sbatch") if not os.path.exists(p)]
    if missing:
        pytest.skip(f"Slurm/munge not installed ({missing}); run .ci/setup-services.sh "
                    "(apt-get install slurm-wlm munge)")  # fmt: skip
    d = tempfile.mkdtemp(prefix="tidepool-slurm-")
    os.chmod(d, 0o755)  # munged insists that every directory above its socket is world-executable
    munge_dir = os.path.join(d, "munge")
    os.makedirs(munge_dir, mode=0o755)
    mu = pwd.getpwnam("munge")
    os.chown(munge_dir, mu.pw_uid, mu.pw_gid)
    sock = os.path.join(munge_dir, "munge.socket")
    procs: dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]
    old_conf = os.environ.get("SLURM_CONF")
    conf = os.path.join(d, "slurm.conf")
    try:
        procs["munged"] = _start(["runuser", "-u", "munge", "--", DAEMONS[2], "-F", f"--socket={sock}",
                                  f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
                                  f"--seed-file={munge_dir}/seed"], os.path.join(d, "munged.out"))  # fmt: skip

        def munge_ok() -> bool:
            if procs["munged"].poll() is not None:
                raise RuntimeError(f"munged exited: {open(os.path.join(d, 'munged.out')).read()[-1500:]}")
            return subprocess.run(["munge", "-n", "-S", sock], capture_output=True).returncode == 0

        wait_until(munge_ok, 15, "munged to answer")
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        for sub in ("ctld", "d", "log"):
            os.makedirs(os.path.join(d, sub))
        with open(conf, "w") as f:
            f.write(slurm_conf(d, node, sock))
        os.environ["SLURM_CONF"] = conf  # every Slurm command from here on (and in the jobs) uses it
        procs["slurmctld"] = _start(["/usr/sbin/slurmctld", "-D", "-f", conf], os.path.join(d, "slurmctld.out"))
        procs["slurmd"] = _start(["/usr/sbin/slurmd", "-D", "-f", conf], os.path.join(d, "slurmd.out"))

        def idle() -> bool:
            for name in ("slurmctld", "slurmd"):
                if procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited: {open(os.path.join(d, name + '.out')).read()[-1500:]}")
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout
            return out.strip() == "idle"

        wait_until(idle, 30, "the Slurm node to be idle")
        yield Slurm(d, conf, procs)
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--user=root"], capture_output=True, timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):
            if name in procs:
                _stop(procs[name])
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        shutil.rmtree(d, ignore_errors=True)


def make_provider(slurm: Slurm, **kw: Any) -> SlurmProvider:
    opts: dict[str, Any] = dict(walltime="00:10:00", python=sys.executable, log_dir=slurm.dir,
                                workdir=slurm.dir, poll_interval=0.3,
                                env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})  # fmt: skip
    opts.update(kw)
    return SlurmProvider(**opts)


def worker_procs(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "tidepool.worker" in cmd and any(tag in a for a in cmd) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


@pytest.mark.integration
def test_adaptive_cluster_runs_tasks_in_slurm_jobs_and_cancels_them(slurm: Slurm) -> None:
    provider = make_provider(slurm)
    nt = NodeType("slurm", {"cpu": 1}, max_nodes=2, startup_estimate=5.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider)
        futs = client.map(whereami, range(8), [0.5] * 8)
        results = client.gather(futs)
        assert [r[0] for r in results] == list(range(8))
        jobs = provider.jobs()
        assert jobs and {r[1] for r in results} <= set(jobs)  # every task ran inside one of our jobs
        assert {r[2] for r in results} <= set(provider.list())
        del futs, results  # nothing needed any more: idle workers retire and their jobs are cancelled
        wait_until(lambda: not slurm.active(list(provider.jobs())), 30, "scale-down to cancel the jobs")
        assert provider.poll_errors() == []  # jobs we ended are not failures
        # new demand: new jobs, then close() cancels them
        assert client.submit(whereami, 99, 0.0).result(timeout=60)[0] == 99
        later = [j for j in provider.jobs() if j not in jobs]
        assert later and slurm.active(later)
    wait_until(lambda: not slurm.active(list(provider.jobs())), 20, "close() to cancel every job")
    wait_until(lambda: not worker_procs("slurm-r"), 20, "the job's workers to exit")


@pytest.mark.integration
def test_the_one_machine_example_in_the_docs_runs_as_written(slurm: Slurm, tmp_path: Path) -> None:
    code = doc_block("SlurmProvider(partition=\"debug\"", "python")
    # its log directory (tempfile.mkdtemp) has a blank in its path: #SBATCH values are quoted (a
    # Slurm hunt: every submission failed with "Invalid directive")
    spaced = tmp_path / "with blank"
    spaced.mkdir()
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "TMPDIR": str(spaced)})  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "6", r.stdout + r.stderr[-3000:]


@pytest.mark.integration
def test_pending_job_cancelled_outside_is_a_failed_launch_and_backs_off(slurm: Slurm) -> None:
    provider = make_provider(slurm, job_extra=["--begin=now+1hour"])  # stays PENDING
    nt = NodeType("later", {"cpu": 1}, max_nodes=1, startup_estimate=30.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider)
        fut = client.submit(whereami, 1, 0.0)
        wait_until(lambda: provider.jobs(), 15, "a job to be submitted")
        [job] = list(provider.jobs())
        assert slurm.active([job]) == {job: "PENDING"}
        subprocess.run(["scancel", job], check=True)
        journal = cluster.journal
        assert journal is not None
        wait_until(lambda: journal.of_kind("launch-failed"), 15, "the cancelled job to be reported")
        failed = journal.of_kind("launch-failed")[0]
        assert f"Slurm job {job}" in failed["reason"] and "CANCELLED before it started" in failed["reason"]
        assert journal.of_kind("backoff")
        assert not fut.done()


@pytest.mark.integration
def test_unsatisfiable_jobs_are_refused_or_reported_and_cancelled(slurm: Slurm) -> None:
    provider = make_provider(slurm, memory="100TB")  # sbatch itself refuses this one
    provider.bind("tcp://127.0.0.1:9", "t" * 32)
    provider.launch(NodeType("huge", {"cpu": 1}), 1, "r3")  # returns at once; sbatch refuses it
    refused: list[Any] = []
    wait_until(lambda: refused.extend(provider.poll_errors()) or refused, 15, "sbatch's refusal")
    assert refused[0].request_id == "r3" and "memory=" in refused[0].message and provider.jobs() == {}
    provider.close()
    provider = make_provider(slurm, cores=512)  # accepted, but pends forever (PartitionConfig)
    provider.bind("tcp://127.0.0.1:9", "t" * 32)
    provider.submit_now(NodeType("huge", {"cpu": 1}), 1, "r4")
    [job] = list(provider.jobs())
    errors: list[Any] = []
    wait_until(lambda: errors.extend(provider.poll_errors()) or errors, 40, "the doomed job to be reported")
    assert errors[0].request_id == "r4" and errors[0].worker_id is None
    assert "can never start" in errors[0].message and "cores=" in errors[0].message
    wait_until(lambda: not slurm.active([job]), 10, "the doomed job to be cancelled")
    provider.close()


@pytest.mark.integration
def test_jobs_near_their_walltime_retire_gracefully_before_slurm_kills_them(slurm: Slurm) -> None:
    # 2-minute walltime, 90 s margin: a worker is retired ~30 s after its job starts (10 s, as it
    # was, is less than a worker took to start and run the first task on a loaded machine, so it
    # was retired before the test could see it work).  Its results (still wanted by the client)
    # must move to a survivor first: a burst of work starts a second job.
    provider = make_provider(slurm, walltime="2", retire_margin=90)
    nt = NodeType("short", {"cpu": 1}, max_nodes=2, startup_estimate=5.0)
    # idle workers are not retired for idleness here (it would come first): only the walltime retires
    keep_idle = Adaptive(idle=IdleRetire(idle_timeout=600.0, cached_idle_timeout=600.0, lookahead=False))
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider, policy=keep_idle)
        journal = cluster.journal
        assert journal is not None
        long = client.submit(whereami, -1, 3.0)
        wait_until(lambda: cluster.workers, 60, "the first job's worker")
        [first] = cluster.workers
        burst = client.map(whereami, range(8), [0.4] * 8)
        assert [r[0] for r in client.gather(burst, timeout=60)] == list(range(8))  # before the walltime
        assert long.result(timeout=30)[2] == first
        wait_until(lambda: retired_gracefully(journal.records, first), 90,
                   "the first worker to be retired for its walltime")  # fmt: skip
        assert client.gather(burst) and long.result()  # its results moved to the survivor
        retire = [r for r in journal.of_kind("retire") if r["worker"] == first]
        assert retire and "walltime" in retire[0]["reason"]
        job = provider.list()[first]["job_id"]
        wait_until(lambda: provider.refresh(force=True) is None
                   and provider.jobs()[job] not in ("RUNNING", "PENDING", "COMPLETING"), 60, "its job to end")  # fmt: skip
        assert provider.jobs()[job] in ("COMPLETED", "CANCELLED")  # not TIMEOUT: we got there first
        assert [f for f in provider.poll_errors() if f.worker_id == first] == []


def test_slurm_provider_rejects_bad_arguments() -> None:
    for kw in ({"cores": 0}, {"workers_per_job": 0}, {"retire_margin": -1}, {"env": {"A B": "x"}},
               {"job_extra": ["--a\n--b"]}, {"walltime": "soon"}):  # fmt: skip
        with pytest.raises(ConfigError):
            SlurmProvider(**kw)  # type: ignore[arg-type]
    assert dataclasses.is_dataclass(_Job)


def workers_over_time(records: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, registered workers from then on) at every join and leave in the journal."""
    live: set[str] = set()
    out = []
    for r in records:
        if r["kind"] == "worker-join":
            live.add(r["worker"])
        elif r["kind"] in ("worker-leave", "worker-close"):
            live.discard(r["worker"])
        else:
            continue
        out.append((r["t"], len(live)))
    return out


@pytest.mark.integration
@pytest.mark.timeout(900)  # a 2-minute walltime, and a loaded machine starts jobs slowly
def test_replace_before_starts_a_replacement_before_the_walltime_and_leaves_no_gap(slurm: Slurm) -> None:
    # A 2-minute walltime, retired 70 s before its end: the worker must be gone 50 s after its job
    # starts.  With replace_before, the replacement job is submitted 1.5 measured start-ups before
    # that, and the walltime retirement waits for it to join (up to another 1.5 start-ups), so the
    # graph always has a worker.  Every wait below is derived from the measured start-up, with a
    # generous floor, so a loaded machine (load 14-20) only makes the test slower.
    provider = make_provider(slurm, walltime="2", retire_margin=70)
    nt = NodeType("short", {"cpu": 1}, min_nodes=1, max_nodes=1, replace_before=True, startup_estimate=5.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider, policy=lambda snapshot: None)  # min_nodes only
        journal = cluster.journal
        assert journal is not None
        wait_until(lambda: journal.of_kind("launch-arrived"), 120, "the first job's worker")
        startup = journal.of_kind("launch-arrived")[0]["seconds"]
        first = journal.of_kind("worker-join")[0]["worker"]  # (its replacement may have joined too)
        patience = max(120.0, 10 * startup)

        def retired() -> bool:
            return any(r["kind"] == "retire-done" and r["worker"] == first for r in journal.records)

        results: list[tuple[int, str, str]] = []  # a stream of work until the first worker is gone, and after
        deadline = time.monotonic() + 120 + patience
        after = 0  # batches run once it was gone: on the replacement
        while after < 2:
            assert time.monotonic() < deadline, "timed out waiting for the first worker to retire for its walltime"
            after += retired()
            batch = client.map(whereami, range(len(results), len(results) + 4), [0.5] * 4)
            results += client.gather(batch, timeout=60 + patience)
        assert [r[0] for r in results] == list(range(len(results)))
        launches = journal.of_kind("launch")
        repl = [r for r in launches if f"replacement for {first}" in r["reason"]]
        assert repl, [r["reason"] for r in launches]
        retire = [r for r in journal.of_kind("retire") if r["worker"] == first]
        assert retire and "walltime" in retire[0]["reason"] and repl[0]["t"] < retire[0]["t"]
        joined = [r for r in journal.of_kind("worker-join") if f"-{repl[0]['request']}-" in r["worker"]]

        def closed_records() -> list[dict[str, Any]]:
            return [r for r in journal.records if r["kind"] in ("worker-close", "worker-leave") and r["worker"] == first]

        # "retire-done" can be journaled a round before the worker's close is (a loaded machine)
        wait_until(lambda: bool(closed_records()), patience, "the retired worker's close in the journal")
        closed = closed_records()
        assert joined and closed and joined[0]["t"] < closed[0]["t"]  # the replacement came first
        start = journal.of_kind("worker-join")[0]["t"]
        counts = [n for t, n in workers_over_time(journal.records) if t >= start]
        assert counts and min(counts) >= 1  # no gap in workers while the graph ran
        assert len({r[1] for r in results}) == 2  # the graph ran in both jobs
        job = provider.list()[first]["job_id"]
        wait_until(lambda: provider.refresh(force=True) is None
                   and provider.jobs()[job] not in ("RUNNING", "PENDING", "COMPLETING"), 60, "its job to end")  # fmt: skip
        assert provider.jobs()[job] in ("COMPLETED", "CANCELLED")  # not TIMEOUT: it left in time


@pytest.mark.integration
def test_a_warm_slurm_pool_scales_to_zero_when_quiet_and_comes_back(slurm: Slurm) -> None:
    provider = make_provider(slurm)
    nt = NodeType("warm", {"cpu": 1}, max_nodes=2, min_idle=1, startup_estimate=5.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider, policy=lambda snapshot: None, scale_to_zero_after=5.0)
        journal = cluster.journal
        assert journal is not None
        wait_until(lambda: cluster.workers, 120, "the warm worker (min_idle=1)")
        wait_until(lambda: any("scale_to_zero_after=5s" in r.get("reason", "") for r in journal.of_kind("retire")),
                   120, "the quiet pool to scale to zero")  # fmt: skip
        wait_until(lambda: not slurm.active(list(provider.jobs())), 60, "its job to be cancelled")
        assert not cluster.workers and provider.poll_errors() == []
        assert client.submit(whereami, 7, 0.0).result(timeout=120)[0] == 7  # work brings it back


@pytest.mark.integration
def test_a_second_provider_with_the_same_tag_refinds_and_cancels_the_jobs(slurm: Slurm) -> None:
    """What a restarted durable scheduler does: a new provider object, tagged alike, lists the
    live jobs of the dead one's provider and can cancel them; another cluster's tag sees none."""
    tag = cluster_tag("restart-test")
    first = make_provider(slurm)
    first.bind("tcp://127.0.0.1:1", "t")  # no scheduler there: the job just runs its (retrying) worker
    first.tag_with(tag)
    ids = first.submit_now(NodeType("re", {"cpu": 1}), 1, "r7")
    job = next(iter(first.jobs()))
    second = make_provider(slurm)
    second.tag_with(tag)
    other = make_provider(slurm)
    other.tag_with(cluster_tag("another-cluster"))
    assert other.list() == {}
    listed = second.list()
    assert set(listed) == set(ids)
    assert listed[ids[0]]["job_id"] == job and listed[ids[0]]["request_id"] == "r7"
    assert listed[ids[0]]["node_type"] == "re" and listed[ids[0]]["alive"]
    second.terminate(ids)

    def ended() -> bool:
        second.refresh(force=True)
        return second.jobs()[job] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")

    wait_until(ended, 60, f"job {job} to be cancelled by the second provider")
    assert not second.list()[ids[0]]["alive"]
    third = make_provider(slurm)
    third.tag_with(tag)
    assert third.list() == {}  # an ended job is not re-found
    first.close()



@pytest.mark.integration
@pytest.mark.timeout(900)  # process and job starts are slow on a loaded machine
def test_a_restarted_durable_scheduler_adopts_its_slurm_job(slurm: Slurm, tmp_path: Path) -> None:
    """kill -9 ``tidepool scheduler --state-dir --cluster`` (Slurm provider): the restarted one
    re-finds the job by its tag, adopts its worker (no new sbatch) and cancels it at close."""
    state = tmp_path / "state"
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    cluster = tidepool.LocalCluster(0, state_dir=str(state), reconnect_window=300.0, recovery_wait=120.0,
                                    timeout=180)  # fmt: skip
    try:
        cluster.use_cluster_file(
            f'[provider]\nkind = "slurm"\nwalltime = "00:10:00"\npython = "{sys.executable}"\n'
            f'log_dir = "{slurm.dir}"\nworkdir = "{slurm.dir}"\npoll_interval = 0.5\n'
            f'env = {{ PYTHONPATH = "{os.environ.get("PYTHONPATH", "")}" }}\n\n'
            '[[node_types]]\nname = "sl"\nresources = { cpu = 1 }\nmin_nodes = 1\nmax_nodes = 1\n'
            "startup_estimate = 120\n",
            journal=str(before),
        )  # fmt: skip
        wait_until(lambda: len(cluster.workers()) == 1, 300, "the Slurm job's worker")
        [worker] = cluster.workers()
        with tidepool.Client(cluster.address, cluster.token, timeout=120) as client:
            _, job, wid = client.submit(whereami, 1, 0.0, pure=False).result(timeout=120)
            assert wid == worker and job and slurm.active([job])
            cluster.kill_scheduler()
            cluster.restart_scheduler(str(after))
            wait_until(lambda: journal_records(after, "adopt"), 120, "the journal's adopt record")
            _, job2, wid2 = client.submit(whereami, 2, 0.0, pure=False).result(timeout=300)
            assert (job2, wid2) == (job, worker)  # the same job's worker serves the graph
        adopted = journal_records(after, "adopt")
        assert [(r["worker"], r["outcome"]) for r in adopted] == [(worker, "adopted")]
        assert journal_records(after, "launch") == []  # no duplicate submitted
    finally:
        cluster.close()
    wait_until(lambda: not slurm.active([job]), 120, "the adopted job to be cancelled at close")
