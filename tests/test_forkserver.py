"""The fork server of local workers (issue 34): forked workers behave like spawned ones, run setup
hooks registered after the server started, and a fork server that dies or refuses is replaced or
given up on, with the reason in the journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

import tidepool
from tidepool.providers import forkserver
from tidepool.providers.local import LocalProvider
from tidepool.scaling.node_types import NodeType
from tidepool.testing import wait_until

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="no fork server on this platform")

NT = NodeType("default", {"cpu": 1})


def whoami() -> tuple[int, str, str]:
    return os.getpid(), os.environ.get("LATE_HOOK", ""), Path(os.environ["LATE_HOOK_FILE"]).read_text()


def test_a_forked_worker_runs_setup_hooks_registered_after_the_server_started(tmp_path: Path) -> None:
    marker = tmp_path / "hook-ran"
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        server = cluster.provider._fork
        assert server is not None
        server.wait_ready()  # the server has imported the worker code: hooks come after it

        def hook() -> None:
            Path(os.environ["LATE_HOOK_FILE"]).write_text(f"hook in {os.getpid()}")

        client.register_setup(hook, env={"LATE_HOOK": "late", "LATE_HOOK_FILE": str(marker)})
        [wid] = cluster.add_workers(1)
        proc = cluster.provider.procs[wid].proc
        assert isinstance(proc, forkserver.ForkedWorker)  # forked, not spawned
        pid, env, text = client.submit(whoami).result(timeout=60)
        assert pid == proc.pid and env == "late" and text == f"hook in {pid}"
    assert proc.wait(10) is not None  # closed with the cluster


def test_a_dead_fork_server_is_replaced_and_the_reason_is_journaled(tmp_path: Path) -> None:
    journal = tmp_path / "run.jsonl"
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(maximum=1, journal=str(journal))
        old = cluster.provider._fork
        assert old is not None
        old.wait_ready()
        os.kill(old.proc.pid, signal.SIGKILL)
        wait_until(lambda: old.dead is not None, what="the provider sees its fork server died")
        assert client.submit(whoami_pid).result(timeout=60) > 0  # a worker came anyway (spawned)
        new = cluster.provider._fork
        assert new is not None and new is not old and new.proc.pid != old.proc.pid
        new.wait_ready()
        [wid] = cluster.add_workers(1)  # the replacement forks again
        assert isinstance(cluster.provider.procs[wid].proc, forkserver.ForkedWorker)
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    events = [r for r in recs if r["kind"] == "fork-server"]
    died = next(r for r in events if r["event"] == "died")
    assert died["pid"] == old.proc.pid and "exited with code -9" in died["reason"]
    replaced = next(r for r in events if r["event"] == "replaced")
    assert replaced["pid"] == new.proc.pid and "exited with code -9" in replaced["reason"]
    launches = [r for r in recs if r["kind"] == "worker-launch"]
    assert launches[0]["how"] == "spawn"  # the worker at hand was spawned
    startup = [r for r in recs if r["kind"] == "worker-startup"]
    assert startup and startup[0]["how"] == "spawn"
    assert startup[0]["requested"] <= startup[0]["registered"] <= startup[0]["ready"]


def whoami_pid() -> int:
    return os.getpid()


def test_once_replacements_are_used_up_the_provider_spawns_and_says_why() -> None:
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=True)
    provider.FORK_SERVER_RESTARTS = 0
    try:
        provider.start_fork_server()
        server = provider._fork
        assert server is not None
        server.wait_ready()
        server.proc.kill()
        provider.launch(NT, 1, "r1")
        [wid] = provider.procs
        assert isinstance(provider.procs[wid].proc, subprocess.Popen)
        events = provider.drain_events()
        kinds = [(e["kind"], e.get("event") or e.get("how")) for e in events]
        assert kinds == [("fork-server", "started"), ("fork-server", "died"), ("fork-server", "fallback"),
                         ("worker-launch", "spawn")]  # fmt: skip
        assert "replacements used up" in events[2]["reason"] and "exited with code -9" in events[2]["reason"]
        assert provider._fork is None and not provider.fork_server
    finally:
        provider.close()


def test_a_preload_module_that_starts_a_thread_makes_the_server_refuse(tmp_path: Path) -> None:
    """Forking with a second thread is not safe: the server checks and refuses; the provider starts
    one without the preload modules (each worker still imports them itself)."""
    (tmp_path / "threadymod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, env=env, preload=["threadymod"], fork_server=True)
    try:
        provider.start_fork_server()
        server = provider._fork
        assert server is not None
        with pytest.raises(forkserver.ForkServerError, match="refused to fork: 2 threads"):
            server.wait_ready()
        provider.launch(NT, 1, "r1")
        events = provider.drain_events()
        replaced = next(e for e in events if e.get("event") == "replaced")
        assert replaced["preload"] == [] and "each worker still imports them" in replaced["reason"]
        new = provider._fork
        assert new is not None and new is not server
        new.wait_ready()  # without the module the server is single-threaded again
        provider.launch(NT, 1, "r2")
        assert [e["how"] for e in provider.drain_events() if e["kind"] == "worker-launch"] == ["fork-server"]
    finally:
        provider.close()


def test_fork_server_off_by_setting_spawns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_FORK_SERVER", "0")
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32)
    try:
        provider.launch(NT, 1, "r1")
        assert provider._fork is None
        assert all(isinstance(p.proc, subprocess.Popen) for p in provider.procs.values())
    finally:
        provider.close()


def test_a_forked_worker_is_killed_and_its_exit_code_seen_like_a_spawned_one() -> None:
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=True)
    try:
        provider.launch(NT, 1, "r1")
        [wid] = provider.procs
        proc = provider.procs[wid].proc
        assert isinstance(proc, forkserver.ForkedWorker) and proc.poll() is None
        provider.kill(wid)
        assert proc.wait(10) == -signal.SIGKILL
        assert provider.list()[wid]["alive"] is False
    finally:
        provider.close()


def test_constructing_a_provider_starts_no_process() -> None:
    """Cluster files are checked by building their provider: that must start nothing; the first
    launch starts the fork server (and forks from it)."""
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=True)
    try:
        assert provider._fork is None
        provider.launch(NT, 1, "r1")
        assert provider._fork is not None
        assert [e["how"] for e in provider.drain_events() if e["kind"] == "worker-launch"] == ["fork-server"]
    finally:
        provider.close()


def slow_server_provider(tmp_path: Path, imports_for: float, wait: float) -> LocalProvider:
    """A provider whose fork server spends ``imports_for`` s importing a preload module, and whose
    launches wait ``wait`` s for it."""
    (tmp_path / "slowmod.py").write_text(f"import time\ntime.sleep({imports_for})\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, env=env, preload=["slowmod"], fork_server=True)
    provider.FORK_SERVER_READY_WAIT = wait
    return provider


def test_a_launch_of_several_workers_waits_for_a_starting_server_once_not_once_per_worker(tmp_path: Path) -> None:
    """The wait for a fork server still importing is one per launch: the first worker waits, the
    others spawn at once (before, each waited the whole wait again: n workers, n waits)."""
    provider = slow_server_provider(tmp_path, imports_for=30, wait=0.5)
    try:
        provider.launch(NT, 3, "r1")
        waits = [e["reason"] for e in provider.drain_events() if e.get("event") == "not-ready"]
        assert len(waits) == 3 and sum("not ready after 0.5 s" in w for w in waits) == 1, waits
        assert all(isinstance(p.proc, subprocess.Popen) for p in provider.procs.values())
    finally:
        provider.close()


def test_a_launch_does_not_wait_long_for_a_server_still_importing(tmp_path: Path) -> None:
    """A launch must return promptly: past the wait it spawns, and the server stays for later."""
    provider = slow_server_provider(tmp_path, imports_for=3, wait=0.2)
    try:
        provider.launch(NT, 1, "r1")
        [wid] = provider.procs
        assert isinstance(provider.procs[wid].proc, subprocess.Popen)
        events = provider.drain_events()
        assert [(e["kind"], e.get("event") or e.get("how")) for e in events] == [
            ("fork-server", "started"), ("fork-server", "not-ready"), ("worker-launch", "spawn")]  # fmt: skip
        assert "was not ready after 0.2 s" in events[1]["reason"]
        assert provider._fork is not None and provider._fork.starting  # kept: it serves later launches
    finally:
        provider.close()


def test_a_local_cluster_that_fails_to_start_leaves_no_fork_server_or_thread_behind() -> None:
    import threading

    import psutil

    import tidepool

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises((TimeoutError, tidepool.TidepoolError)):
        tidepool.LocalCluster(n_workers=1, workdir="/nonexistent/dir", fork_server=True, dashboard=False)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert not left, [p.cmdline() for p in left]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tidepool-")]


def stdin_target() -> str:
    return os.readlink("/proc/self/fd/0")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_forked_worker_has_dev_null_as_stdin() -> None:
    """Closing the server's stdin frees fd 0, so /dev/null opens as fd 0 itself: it must stay open
    (it was closed again, and a socket later took fd 0; uvloop aborts the worker when closing it)."""
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        assert client.submit(stdin_target).result(timeout=60) == os.devnull


def read_env_var(name: str) -> str | None:
    return os.environ.get(name)


def test_what_a_preload_module_sets_in_the_environment_reaches_forked_workers(tmp_path: Path) -> None:
    """Found by a bug hunt: the fork server imports the preload modules once, then each forked
    worker's environment was set from scratch, dropping what the preload had set (spawned workers
    kept it: "treated exactly like spawned ones")."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "envpreload_tp.py").write_text("import os\nos.environ['TP_SET_BY_PRELOAD'] = 'yes'\n")
    path = os.pathsep.join([str(mods), str(Path(__file__).parent)])  # (this file too: read_env_var)
    with tidepool.LocalCluster(n_workers=1, preload=["envpreload_tp"], fork_server=True,
                               env={"PYTHONPATH": path}) as cluster, tidepool.Client(cluster) as client:  # fmt: skip
        launches = [e for e in cluster.provider.drain_events() if e["kind"] == "worker-launch"]
        assert launches and launches[0]["how"] == "fork-server"  # it was forked, not spawned
        assert list(client.run(read_env_var, "TP_SET_BY_PRELOAD").values()) == ["yes"]
