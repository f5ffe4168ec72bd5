"""SSHProvider against a real OpenSSH server (loopback, and one inside a network namespace).

The session fixture starts ``sshd`` on 127.0.0.1 with throw-away ed25519 host and user keys (key
auth only); workers are started over SSH as root and stopped by pid, which is exactly the case
where closing a channel would leave them running.  Needs root and ``/usr/sbin/sshd``
(``.ci/setup-services.sh`` installs openssh-server); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import tidepool
from tidepool.errors import ConfigError, ProviderError
from tidepool.providers.ssh import (
    EXIT_NO_WORKDIR,
    SSHProvider,
    kill_script,
    parse_host,
    remote_script,
)
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.policies import Adaptive

pytestmark = pytest.mark.integration

SSHD = "/usr/sbin/sshd"
NS_HOSTNAME = "tp-netns-host"
sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402


def whereami(i: int, delay: float = 0.3) -> tuple[int, str, int, str]:
    time.sleep(delay)
    return i, socket.gethostname(), os.getpid(), os.environ.get("TIDEPOOL_WORKER_ID", "")


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ssh_loop_threads() -> set[threading.Thread]:
    """The private loop threads SSHProviders started (and have not stopped yet)."""
    return {t for t in threading.enumerate() if t.name == "tidepool-ssh"}


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def worker_pids(tag: str) -> list[int]:
    """Pids of live tidepool worker processes whose command line mentions ``tag``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "tidepool.worker" in cmd and any(tag in a for a in cmd) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out


@dataclass
class Sshd:
    host: str
    port: int
    client_key: str
    known_hosts: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: str

    def provider(self, **kw: object) -> SSHProvider:
        # 30 s to read the worker's pid line: sshd forks a session per launch, which took over 5 s under load
        # (a launch failed as "the shell did not start"); the timeout tests set their own
        opts: dict[str, object] = dict(port=self.port, client_keys=[self.client_key],
                                       known_hosts=self.known_hosts, python=sys.executable,
                                       env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                                       connect_timeout=30.0, term_timeout=3.0)  # fmt: skip
        opts.update(kw)
        return SSHProvider([self.host], **opts)  # type: ignore[arg-type]


def make_keys(d: str) -> tuple[str, str, str]:
    """(host key path, user key path, host public key line)."""
    for name in ("host_ed25519", "user_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tidepool-test", "-f",
                        os.path.join(d, name)], check=True)  # fmt: skip
    shutil.copy(os.path.join(d, "user_ed25519.pub"), os.path.join(d, "authorized_keys"))
    with open(os.path.join(d, "host_ed25519.pub")) as f:
        host_pub = " ".join(f.read().split()[:2])
    return os.path.join(d, "host_ed25519"), os.path.join(d, "user_ed25519"), host_pub


def write_sshd_config(d: str, name: str, listen: str, host_key: str, max_sessions: int = 10) -> str:
    path = os.path.join(d, f"{name}.conf")
    with open(path, "w") as f:
        f.write(f"""ListenAddress {listen}
HostKey {host_key}
PidFile {d}/{name}.pid
AuthorizedKeysFile {d}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
MaxSessions {max_sessions}
LogLevel ERROR
""")
    return path


def start_sshd(argv: list[str], host: str, port: int, log: str) -> subprocess.Popen:  # type: ignore[type-arg]
    with open(log, "ab") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            with open(log) as f:
                raise RuntimeError(f"sshd exited with {proc.returncode}: {f.read()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return proc
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sshd did not listen on {host}:{port} within 10s")
        time.sleep(0.02)


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def require_root_and_sshd() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: starts sshd and logs in as root over loopback")
    if not os.path.exists(SSHD):
        pytest.skip(f"{SSHD} not installed (run .ci/setup-services.sh, or apt-get install openssh-server)")


@dataclass
class Keys:
    dir: str
    host_key: str
    user_key: str
    host_pub: str  # "ssh-ed25519 AAAA..." for known_hosts lines


@pytest.fixture(scope="session")
def keys() -> Iterator[Keys]:
    require_root_and_sshd()
    d = tempfile.mkdtemp(prefix="tidepool-sshd-")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    yield Keys(d, *make_keys(d))
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def sshd(keys: Keys) -> Iterator[Sshd]:
    port = free_port()
    cfg = write_sshd_config(keys.dir, "lo", "127.0.0.1", keys.host_key)
    log = os.path.join(keys.dir, "lo.log")
    proc = start_sshd([SSHD, "-D", "-e", "-f", cfg, "-p", str(port)], "127.0.0.1", port, log)
    kh = os.path.join(keys.dir, "known_hosts_lo")
    with open(kh, "w") as f:
        f.write(f"[127.0.0.1]:{port} {keys.host_pub}\n")
    yield Sshd("127.0.0.1", port, keys.user_key, kh, proc, log)
    stop(proc)


# ---- the shell scripts, run locally (no sshd, no root) ---------------------------------------------
def test_parse_host_forms() -> None:
    assert parse_host("node1", None, 22) == (None, "node1", 22)
    assert parse_host("bob@node1:2222", "alice", 22) == ("bob", "node1", 2222)
    assert parse_host("node1", "alice", 2200) == ("alice", "node1", 2200)
    assert parse_host("[::1]:2022", None, 22) == (None, "::1", 2022)
    with pytest.raises(ConfigError):
        parse_host("node:xx", None, 22)


def test_a_missing_client_key_file_is_named_not_blamed_on_sshd(tmp_path: Path) -> None:
    """Found by a bug hunt: a client_keys path that does not exist was reported as "cannot connect
    ... is sshd running there and is the port right?"."""
    from tidepool.scaling.node_types import NodeType

    missing = str(tmp_path / "no_such_key")
    p = SSHProvider(["127.0.0.1:1"], client_keys=[missing], known_hosts=None)  # the key is read first
    p.bind("tcp://127.0.0.1:1", "t" * 32)
    try:
        with pytest.raises(ProviderError, match=r"client key file .*no_such_key.* does not exist") as info:
            p.launch_now(NodeType("cpu", {"cpu": 1}, max_nodes=1), 1, "r1")
        assert "is sshd running" not in str(info.value)
    finally:
        p.close()


def test_remote_script_takes_env_from_stdin_and_keeps_it_off_the_command_line(tmp_path: Path) -> None:
    code = "import os, sys; print(os.environ['TIDEPOOL_TOKEN'], os.environ['A'], os.getcwd()); sys.exit(3)"
    script = remote_script([sys.executable, "-c", code, "w-1"], "w-1", str(tmp_path))
    assert "s3cret" not in script
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("TIDEPOOL_TOKEN=s3cret\nA=x y\n\n")
    proc.stdin.flush()  # stdin stays open, as the SSH channel does
    first, second = proc.stdout.read().splitlines()[:2]
    assert first.startswith("tidepool-pid ") and second == f"s3cret x y {tmp_path}"
    assert proc.wait(10) == 3
    proc.stdin.close()
    missing = remote_script(["true"], "w-2", str(tmp_path / "nope"))
    r = subprocess.run(["sh", "-c", missing], input="\n", text=True, capture_output=True, timeout=30)
    assert r.returncode == EXIT_NO_WORKDIR and "cannot cd" in r.stderr


def test_remote_script_watchdog_stops_the_worker_when_stdin_closes() -> None:
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(["sh", "-c", remote_script([sys.executable, "-c", code, "w-3"], "w-3", None, 2)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("tidepool-pid ") and proc.stdout.readline() == "up\n"
        proc.stdin.close()  # what the host sees when the connection dies
        assert proc.wait(10) == -15
    finally:
        proc.kill()
        proc.wait()


def test_kill_script_stops_only_the_worker_it_names() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, "w-7"], stdout=subprocess.PIPE, text=True)
    try:  # it ignores TERM: only the KILL after the grace period stops it
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        r = subprocess.run(["sh", "-c", kill_script([(proc.pid, "w-70")], 0.2)], capture_output=True, text=True)
        assert r.returncode == 0 and proc.poll() is None  # another id on that pid: not touched
        r = subprocess.run(["sh", "-c", kill_script([(proc.pid, "w-7")], 0.5)], capture_output=True, text=True)
        assert r.returncode == 0 and "survivor" not in r.stdout
        assert proc.wait(5) == -9  # KILLed after the grace period
    finally:
        proc.kill()
        proc.wait()


def test_the_loop_binding_without_a_server() -> None:
    """No sshd needed: the first loop that launches owns the provider; others are refused."""
    provider = SSHProvider(["127.0.0.1:9"], known_hosts=None)  # never bound: every launch fails
    nt = NodeType("x", {"cpu": 1})

    async def other_loop() -> None:
        await provider.poll_errors_async()

    async def scenario() -> None:
        await provider.launch_async(nt, 1, "r1")
        await asyncio.gather(*provider._tasks)  # the launch ran as a task of this loop
        [failure] = await provider.poll_errors_async()
        assert failure.request_id == "r1" and "bind(" in failure.message
        assert provider._loop is asyncio.get_running_loop() and provider._loop_thread is None
        with pytest.raises(ProviderError, match="bound to another event loop"):
            await asyncio.to_thread(asyncio.run, other_loop())
        provider.close()  # inside its loop: scheduled there, not waited for (that would deadlock)
        await provider.close_async()  # waits for it

    before = ssh_loop_threads()
    asyncio.run(scenario())
    assert provider._loop_thread is None and ssh_loop_threads() <= before
    provider.launch(nt, 1, "r2")  # closed: reported, nothing started
    assert [f.request_id for f in provider.poll_errors()] == ["r2"]


# ---- loopback --------------------------------------------------------------------------------------
def test_adaptive_cluster_starts_workers_over_ssh_and_terminate_stops_them(sshd: Sshd) -> None:
    provider = sshd.provider()
    before = ssh_loop_threads()
    nt = NodeType("ssh", {"cpu": 1}, max_nodes=2, startup_estimate=1.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        # idle=None: no idle retirement, so the workers that ran the tasks are still there to check
        cluster.adapt(node_types=[nt], provider=provider, policy=Adaptive(idle=None))
        results = client.gather(client.map(whereami, range(8)))
        assert [r[0] for r in results] == list(range(8))
        listing = provider.list()
        # the autoscaler awaited the provider in the scheduler's loop: the SSH state lives there
        assert provider._loop_thread is None and ssh_loop_threads() <= before
        assert listing and all(info["host"] == f"127.0.0.1:{sshd.port}" for info in listing.values())
        ran_on = {r[3]: r[2] for r in results}
        assert ran_on and set(ran_on) <= set(listing)
        for wid, pid in ran_on.items():
            assert listing[wid]["pid"] == pid  # the pid echoed by the remote shell is the worker
            ancestors = [p.name() for p in psutil.Process(pid).parents()]
            assert "sshd" in ancestors, f"worker {wid} was not started through sshd: {ancestors}"
        # terminate one worker that is alive: its process is gone afterwards, for sure
        alive = [w for w, info in provider.list().items() if info["alive"]]
        assert alive
        victim = alive[0]
        pid = provider.list()[victim]["pid"]
        provider.terminate([victim])
        assert pid_gone(pid)
        assert provider.list()[victim]["alive"] is False
        provider.terminate([victim, "no-such-worker"])  # idempotent
        pids = [info["pid"] for info in provider.list().values()]
    # the cluster closed the provider: nothing it started is left on the host
    wait_until(lambda: all(pid_gone(p) for p in pids), 10, "every SSH worker to exit")
    assert worker_pids("ssh-r") == []
    assert provider.poll_errors() == []  # stopped on purpose: not failures
    assert provider._loop_thread is None and ssh_loop_threads() <= before


def test_async_use_keeps_the_ssh_state_in_the_callers_loop_and_starts_no_thread(sshd: Sshd) -> None:
    before = ssh_loop_threads()
    nt = NodeType("inloop", {"cpu": 1})
    with tidepool.LocalCluster(n_workers=0) as cluster:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(nt, 2, "r1")

        async def scenario() -> list[int]:
            loop = asyncio.get_running_loop()
            await provider.launch_async(nt, 2, "r1")
            await asyncio.to_thread(cluster.wait_for_workers, ids, timeout=20)  # they registered
            listing = await provider.list_async()
            assert sorted(listing) == sorted(ids) and all(info["alive"] for info in listing.values())
            assert all(info["host"] == f"127.0.0.1:{sshd.port}" for info in listing.values())
            # no private loop: the sessions are watched by tasks of this very loop
            assert provider._loop_thread is None and ssh_loop_threads() <= before
            assert provider._loop is loop
            assert all(w.task is not None and w.task.get_loop() is loop for w in provider._workers.values())
            # the synchronous API from a plain thread is handed to this loop
            assert sorted(await asyncio.to_thread(provider.list)) == sorted(ids)
            # ... but a blocking call inside this loop would deadlock it: a clear error instead
            with pytest.raises(ProviderError, match="inside the event loop that owns it"):
                provider.terminate(ids[:1])
            with pytest.raises(ProviderError, match="inside the event loop that owns it"):
                provider.launch_now(nt, 1, "r2")
            victim = listing[ids[0]]["pid"]
            await provider.terminate_async(ids[:1])
            assert pid_gone(victim) and (await provider.list_async())[ids[0]]["alive"] is False
            assert await provider.poll_errors_async() == []  # stopped on purpose: not a failure
            pids = [info["pid"] for info in listing.values()]
            await provider.close_async()  # in this loop: awaited here
            assert ssh_loop_threads() <= before
            return pids

        pids = asyncio.run(scenario())
        assert all(pid_gone(p) for p in pids)
        assert provider._loop_thread is None and ssh_loop_threads() <= before
        provider.close()  # idempotent, also after its loop ended


def test_a_provider_is_bound_to_the_first_loop_that_uses_it(sshd: Sshd) -> None:
    nt = NodeType("bound", {"cpu": 1})
    with tidepool.LocalCluster(n_workers=0) as cluster:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(nt, 1, "r1")

        async def from_another_loop() -> None:
            await provider.list_async()

        async def launch_from_another_loop() -> None:
            await provider.launch_async(nt, 1, "r9")

        async def scenario() -> None:
            await provider.launch_async(nt, 1, "r1")
            await asyncio.to_thread(cluster.wait_for_workers, ids, timeout=20)
            # a second event loop (in a thread, while this one runs): refused, not hung
            with pytest.raises(ProviderError, match="bound to another event loop"):
                await asyncio.to_thread(asyncio.run, from_another_loop())
            with pytest.raises(ProviderError, match="bound to another event loop"):
                await asyncio.to_thread(asyncio.run, launch_from_another_loop())
            listing = await provider.list_async()  # still fine in its own loop
            assert list(listing) == ids and listing[ids[0]]["alive"]
            # close() from a plain thread closes the connections on this loop, which owns them
            await asyncio.to_thread(provider.close)
            assert pid_gone(listing[ids[0]]["pid"])
            assert all(not c.usable for h in provider._hosts for c in h.conns)

        asyncio.run(scenario())

        # bound to its private loop thread by a synchronous call: an event loop is refused too
        private = sshd.provider()
        private.bind(cluster.address, cluster.token)
        [wid] = private.launch_now(nt, 1, "r2")
        assert private._loop_thread is not None
        with pytest.raises(ProviderError, match="own loop thread"):
            asyncio.run(from_private(private))
        pid = private.list()[wid]["pid"]
        private.close()
        assert pid_gone(pid)


async def from_private(provider: SSHProvider) -> None:
    await provider.terminate_async(list(provider.list()))


def test_close_after_the_owning_loop_ended_still_stops_the_workers(sshd: Sshd) -> None:
    """A loop that ends without ``await close_async()``: ``close`` cannot run anything on it, so it
    shuts the connections down and the workers' watchdogs stop them; other calls raise."""
    nt = NodeType("gone", {"cpu": 1})
    with tidepool.LocalCluster(n_workers=0) as cluster:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(nt, 1, "r1")

        async def scenario() -> int:
            await provider.launch_async(nt, 1, "r1")
            await asyncio.to_thread(cluster.wait_for_workers, ids, timeout=20)
            return int((await provider.list_async())[ids[0]]["pid"])

        pid = asyncio.run(scenario())
        assert not pid_gone(pid)
        with pytest.raises(ProviderError, match="event loop that is closed"):
            provider.terminate(ids)
        assert list(provider.list()) == ids  # reading needs no loop
        provider.close()  # does not raise
        wait_until(lambda: pid_gone(pid), 15, f"worker pid {pid} to be stopped by its watchdog")


def test_launch_is_idempotent_and_close_stops_everything(sshd: Sshd) -> None:
    nt = NodeType("idem", {"cpu": 1}, workers_per_node=2)
    with tidepool.LocalCluster(n_workers=0) as cluster:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(nt, 2, "r77")
        assert ids == [f"idem-r77-{i}" for i in range(1, 5)] and provider.worker_ids(nt, 2, "r77") == ids
        provider.launch(nt, 2, "r77")
        provider.launch(nt, 2, "r77")  # same request id: started once
        cluster.wait_for_workers(ids, timeout=20)
        pids = [info["pid"] for info in provider.list().values()]
        assert len(pids) == 4 and not any(pid_gone(p) for p in pids)
        provider.close()
        assert all(pid_gone(p) for p in pids)
        provider.close()  # idempotent


def test_terminate_works_when_the_workers_fill_their_connection(keys: Keys, tmp_path: Path) -> None:
    """Found by a bug hunt: the kill script ran on any open connection, also one whose sessions the
    workers all took (sessions_per_connection at the host's MaxSessions): sshd refused it ("open
    failed"), terminate raised and the workers kept running.  Short commands take a slot of their own."""
    port = free_port()
    cfg = write_sshd_config(keys.dir, "two", "127.0.0.1", keys.host_key, max_sessions=2)
    proc = start_sshd([SSHD, "-D", "-e", "-f", cfg, "-p", str(port)], "127.0.0.1", port, str(tmp_path / "two.log"))
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{port} {keys.host_pub}\n")
    two = Sshd("127.0.0.1", port, keys.user_key, str(kh), proc, str(tmp_path / "two.log"))
    nt = NodeType("pair", {"cpu": 2}, workers_per_node=2)
    try:
        with tidepool.LocalCluster(n_workers=0) as cluster:
            provider = two.provider(sessions_per_connection=2)
            provider.bind(cluster.address, cluster.token)
            ids = provider.worker_ids(nt, 1, "r1")
            provider.launch(nt, 1, "r1")
            cluster.wait_for_workers(ids, timeout=30)
            pids = [info["pid"] for info in provider.list().values()]
            provider.terminate(ids)  # raised ProviderError (open failed) before
            assert all(pid_gone(p) for p in pids)
            provider.close()
    finally:
        stop(proc)


def test_worker_that_cannot_start_is_reported_by_poll_errors(sshd: Sshd) -> None:
    provider = sshd.provider(python="/nonexistent/python3")
    provider.bind("tcp://127.0.0.1:9", "x" * 32)
    try:
        [wid] = provider.worker_ids(NodeType("bad", {"cpu": 1}), 1, "r1")
        provider.launch(NodeType("bad", {"cpu": 1}), 1, "r1")
        errors: list = []  # type: ignore[type-arg]
        wait_until(lambda: errors.extend(provider.poll_errors()) or errors, 10, "the failure report")
        assert errors[0].request_id == "r1" and errors[0].worker_id == wid
        assert "exited with code 127" in errors[0].message and "python=" in errors[0].message
        assert provider.poll_errors() == []  # reported once
    finally:
        provider.close()


def test_unreachable_host_raises_provider_error_quickly(sshd: Sshd) -> None:
    closed = free_port()  # nothing listens there: connection refused
    provider = sshd.provider(port=closed)
    provider.bind("tcp://127.0.0.1:9", "x" * 32)
    with pytest.raises(ProviderError, match="cannot connect") as info:  # the refusal, not a timeout
        provider.launch_now(NodeType("x", {"cpu": 1}), 1, "r5")
    assert info.value.request_id == "r5"
    provider.launch(NodeType("x", {"cpu": 1}), 1, "r7")  # returns at once; reported once
    errors: list = []  # type: ignore[type-arg]
    wait_until(lambda: errors.extend(provider.poll_errors()) or errors, 10, "the refusal")
    assert errors[0].request_id == "r7" and "cannot connect" in errors[0].message
    assert provider.poll_errors() == []
    provider.close()
    # a port that accepts TCP but never speaks SSH: the connect timeout bounds the launch
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        provider = sshd.provider(port=silent.getsockname()[1], connect_timeout=1.0)
        provider.bind("tcp://127.0.0.1:9", "x" * 32)
        with pytest.raises(ProviderError, match="timed out") as info:  # its connect_timeout ended it
            provider.launch_now(NodeType("x", {"cpu": 1}), 1, "r6")
        assert info.value.request_id == "r6"
        provider.close()


def test_autoscaler_backs_off_an_unreachable_ssh_host(sshd: Sshd) -> None:
    provider = sshd.provider(port=free_port())
    nt = NodeType("down", {"cpu": 1}, max_nodes=1, startup_estimate=1.0)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=provider)
        fut = client.submit(whereami, 1, 0.0)
        journal = cluster.journal
        assert journal is not None
        wait_until(lambda: journal.of_kind("launch-failed") and journal.of_kind("backoff"), 10,
                   "launch-failed and backoff records")  # fmt: skip
        failed = journal.of_kind("launch-failed")[0]
        assert failed["node_type"] == "down" and "cannot connect" in failed["reason"]
        assert not fut.done()


def test_watchdog_stops_workers_when_the_ssh_connection_dies(sshd: Sshd) -> None:
    """If the provider's process dies, the remote workers must not live on (no PTY, no HUP)."""
    with tidepool.LocalCluster(n_workers=0) as cluster:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(NodeType("wd", {"cpu": 1}), 1, "r1")
        provider.launch(NodeType("wd", {"cpu": 1}), 1, "r1")
        cluster.wait_for_workers(ids, timeout=20)
        pid = provider.list()[ids[0]]["pid"]

        async def crash() -> None:  # what the host sees when our process is SIGKILLed
            for h in provider._hosts:
                for c in h.conns:
                    c.conn.abort()

        provider._run(crash())
        wait_until(lambda: pid_gone(pid), 15, f"worker pid {pid} to be stopped by its watchdog")
        provider.close()


# ---- a second host in a network namespace ----------------------------------------------------------
@dataclass
class NetnsHost:
    ns: str
    root_ip: str
    ns_ip: str
    sshd: Sshd


@pytest.fixture(scope="session")
def netns_host(keys: Keys, sshd: Sshd) -> Iterator[NetnsHost]:
    if not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs iproute2 (ip) and util-linux (unshare) for the namespace host")
    why = netns.unavailable()
    if why:
        pytest.skip(f"no namespace host: {why}")
    proc = None
    with netns.hosts("h") as h:
        ns, root_ip, ns_ip = h.ns("h"), h.router_addr("h"), h.addr("h")
        try:
            cfg = write_sshd_config(keys.dir, "ns", ns_ip, keys.host_key)
            # own UTS namespace too, so tasks there see their own hostname
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                   f"hostname {NS_HOSTNAME} && exec {SSHD} -D -e -f {cfg} -p 22"]  # fmt: skip
            proc = start_sshd(cmd, ns_ip, 22, os.path.join(keys.dir, "ns.log"))
            kh = os.path.join(keys.dir, "known_hosts_ns")
            with open(kh, "w") as out:
                out.write(f"{ns_ip} {keys.host_pub}\n")
            yield NetnsHost(ns, root_ip, ns_ip, Sshd(ns_ip, 22, sshd.client_key, kh, proc, ""))
        finally:
            if proc is not None:
                stop(proc)


def test_worker_in_a_network_namespace_host_runs_a_task(netns_host: NetnsHost) -> None:
    provider = netns_host.sshd.provider()
    nt = NodeType("far", {"cpu": 1}, max_nodes=1, startup_estimate=1.0)
    # the namespace only reaches the root end of the veth: the scheduler must listen there
    with tidepool.LocalCluster(n_workers=0, host=netns_host.root_ip) as cluster, \
            tidepool.Client(cluster) as client:  # fmt: skip
        cluster.adapt(node_types=[nt], provider=provider)
        i, hostname, pid, wid = client.submit(whereami, 5, 0.0).result(timeout=60)
        assert i == 5 and hostname == NS_HOSTNAME != socket.gethostname()
        assert provider.list()[wid]["host"] == f"{netns_host.ns_ip}:22"
        ns_pids = subprocess.run(["ip", "netns", "pids", netns_host.ns], capture_output=True,
                                 text=True).stdout.split()  # fmt: skip
        assert str(pid) in ns_pids  # the worker really runs inside the namespace
    wait_until(lambda: pid_gone(pid), 10, "the namespace worker to exit")


def test_workers_spread_over_hosts_and_a_dead_host_is_skipped(sshd: Sshd, netns_host: NetnsHost) -> None:
    dead = f"127.0.0.1:{free_port()}"
    hosts = [dead, f"127.0.0.1:{sshd.port}", f"{netns_host.ns_ip}:22"]
    kh = os.path.join(os.path.dirname(sshd.known_hosts), "known_hosts_both")
    with open(kh, "w") as out:
        for path in (sshd.known_hosts, netns_host.sshd.known_hosts):
            with open(path) as f:
                out.write(f.read())
    provider = SSHProvider(hosts, client_keys=[sshd.client_key], known_hosts=kh, python=sys.executable,
                           env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, connect_timeout=30.0)  # fmt: skip
    with tidepool.LocalCluster(n_workers=0, host=netns_host.root_ip) as cluster:  # both hosts reach it
        provider.bind(cluster.address, cluster.token)
        ids = provider.worker_ids(NodeType("pair", {"cpu": 1}), 2, "r1")
        provider.launch(NodeType("pair", {"cpu": 1}), 2, "r1")
        cluster.wait_for_workers(ids, timeout=30)
        placed = sorted(info["host"] for info in provider.list().values())
        assert placed == sorted(hosts[1:])  # least loaded first: one node on each live host
        status = provider.host_status()
        assert status[dead]["down_for"] > 0 and "cannot connect" in status[dead]["reason"]
        assert status[hosts[1]]["workers"] == status[hosts[2]]["workers"] == 1
        pids = [info["pid"] for info in provider.list().values()]
        provider.close()
        assert all(pid_gone(p) for p in pids)


@pytest.mark.parametrize("ps", ["procps", "busybox"])
def test_kill_script_takes_the_processes_a_workers_tasks_started_along(ps: str, tmp_path: Path) -> None:
    """Found by a bug hunt: a task's child process (``subprocess.run(["sleep", ...])``) stayed on
    the host after its worker was stopped, and held the channel open.  sshd makes the worker a
    session leader; the group is signalled, and a member that ignores TERM gets the KILL.
    ``busybox``: a ``ps`` without ``-p`` (a review: the group was never found)."""
    import psutil

    env = dict(os.environ)
    if ps == "busybox":
        (tmp_path / "ps").write_text("#!/bin/sh\necho 'ps: unrecognized option: p' >&2\nexit 1\n")
        (tmp_path / "ps").chmod(0o755)
        env["PATH"] = f"{tmp_path}:{env['PATH']}"

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, "w-8"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        child = psutil.Process(int(proc.stdout.readline()))
        r = subprocess.run(["sh", "-c", kill_script([(proc.pid, "w-8")], 0.3)], capture_output=True, text=True, env=env)
        assert r.returncode == 0 and "survivor" not in r.stdout, r.stdout
        assert proc.wait(5) == -15
        child.wait(5)  # KILLed with the group after the grace period (it ignores TERM)
        assert not child.is_running()
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(psutil.Error):
            child.kill()


def start_background(marker: str) -> int:
    """A task that leaves a process behind, holding the worker's output open."""
    return subprocess.Popen(["sleep", marker]).pid


def test_a_worker_that_exits_with_a_background_child_is_listed_ended_and_the_child_goes(sshd: Sshd) -> None:
    """Found by a bug hunt: a worker retired after a task left a background process behind stayed
    listed alive for as long as that process lived (it held the channel's output open), each
    terminate or close waited 5 s for it, and the process stayed on the host."""
    nt = NodeType("bg", {"cpu": 1})
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        provider = sshd.provider()
        provider.bind(cluster.address, cluster.token)
        (wid,) = provider.worker_ids(nt, 1, "r5")
        provider.launch(nt, 1, "r5")
        cluster.wait_for_workers([wid], timeout=30)
        child = client.submit(start_background, "3171.5").result(timeout=30)
        assert client.retire_workers([wid]) == {wid: "retired"}  # the worker exits by itself
        wait_until(lambda: provider.list()[wid]["alive"] is False, 30, "the worker listed as ended")
        wait_until(lambda: pid_gone(child), 30, "the task's background process to go")
        provider.close()


def test_a_worker_of_a_partly_failed_launch_that_cannot_be_stopped_stays_known() -> None:
    """Found by a bug hunt: with workers_per_node=2 against an sshd at MaxSessions, one worker
    started, the other's session was refused, and stopping the first failed (no session for the
    kill either): the provider forgot it while it ran on, unlisted, until close.  No sshd needed."""
    import types

    provider = SSHProvider(["127.0.0.1:9"], known_hosts=None)
    nt = NodeType("two", {"cpu": 1}, workers_per_node=2)
    host = types.SimpleNamespace(name="127.0.0.1:9")

    async def pick(nt_: NodeType, rid: str) -> object:
        return host

    async def start(host_: object, nt_: NodeType, rid: str, wid: str) -> object:
        if wid.endswith("-2"):
            raise ProviderError(f"cannot start {wid}: open failed")
        from tidepool.providers.ssh import _SSHWorker

        w = object.__new__(_SSHWorker)  # started: only its id and host are read here
        w.worker_id, w.host = wid, host  # type: ignore[assignment]
        provider._workers[wid] = w
        return w

    async def stop(ws: list[object]) -> None:
        raise ProviderError("could not open a session to run the kill")

    provider._pick_host = pick  # type: ignore[method-assign]
    provider._start = start  # type: ignore[method-assign]
    provider._stop = stop  # type: ignore[method-assign]
    with pytest.raises(ProviderError, match="open failed"):
        asyncio.run(provider._launch_new(nt, 1, "r9"))
    assert list(provider._workers) == ["two-r9-1"]  # still known: close() stops it


def test_host_key_advice_names_the_known_hosts_file_in_use_and_a_changed_key(tmp_path: Path) -> None:
    # found by a bug hunt: with known_hosts=PATH the advice named ~/.ssh/known_hosts and said to pass
    # known_hosts=PATH; a key that differs from the stored one read the same as an unknown one
    from tidepool.providers.ssh import _host_key_advice

    kh = tmp_path / "kh"
    kh.write_text("[other]:22 ssh-ed25519 AAAA\n")
    unknown = _host_key_advice("h", "127.0.0.1", 2222, str(kh), RuntimeError("not trusted"))
    assert f"{kh} has no key for it: add it (ssh-keyscan -p 2222 127.0.0.1 >> {kh})" in unknown
    assert "~/.ssh" not in unknown and "pass known_hosts" not in unknown
    kh.write_text("[127.0.0.1]:2222 ssh-ed25519 AAAAold\n")
    changed = _host_key_advice("h", "127.0.0.1", 2222, str(kh), RuntimeError("not trusted"))
    assert "does not match the one" in changed and "before you replace its line" in changed
    assert "pass known_hosts=PATH" in _host_key_advice("h", "127.0.0.1", 2222, None, RuntimeError("x"))
