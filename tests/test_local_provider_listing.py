"""The local provider lists every worker a launch named, also while the launch is still spawning
processes (the autoscaler may list from another thread meanwhile)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest

import tidepool.providers.local as local
from tidepool.providers.local import LocalProvider
from tidepool.scaling.node_types import NodeType


def test_workers_not_spawned_yet_are_listed_as_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old listing missed them, and the controller gave them up as "not listed by the provider
    any more" 7 ms after the launch, then launched replacements: 5 workers on a maximum of 4."""
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)  # the spawning path
    nt = NodeType("cpu-big", {"cpu": 1})
    ids = provider.worker_ids(nt, 3, "a1")
    seen: list[dict[str, Any]] = []
    real = subprocess.Popen

    def popen_seeing_the_listing(cmd: Any, **kw: Any) -> Any:
        seen.append(provider.list())  # what a concurrent list() sees while this one spawns
        return real(["true"], **kw)

    monkeypatch.setattr(local.subprocess, "Popen", popen_seeing_the_listing)
    provider.launch(nt, 3, "a1")
    try:
        assert len(seen) == 3
        for listing in seen:
            assert set(ids) <= set(listing) and all(listing[w]["alive"] for w in ids if w not in provider.procs)
        assert seen[0][ids[2]] == {"node_type": "cpu-big", "request_id": "a1", "alive": True,
                                   "returncode": None, "state": "starting"}  # fmt: skip
    finally:
        provider.close()


def test_a_new_provider_re_finds_the_processes_an_earlier_one_started(tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """After a scheduler restart its (new) local provider lists and terminates the worker
    processes the old one started, found by their files in the remembered directory; a file
    whose process ended is dropped."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr(local, "worker_command", lambda *a, **k: list(sleeper))
    registry = str(tmp_path / "local-workers")
    old = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)
    old.remember_in(registry)
    nt = NodeType("cpu-big", {"cpu": 1})
    ids = old.worker_ids(nt, 2, "a1")
    old.launch(nt, 2, "a1")
    new = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)
    try:
        old.procs[ids[1]].proc.kill()
        old.procs[ids[1]].proc.wait()  # (reaped: its pid is gone)
        new.remember_in(registry)
        listing = new.list()
        assert set(listing) == {ids[0]}
        assert listing[ids[0]] == {"node_type": "cpu-big", "request_id": "a1", "alive": True, "returncode": None}
        assert sorted(os.listdir(registry)) == [f"{ids[0]}.json"]
        new.terminate([ids[0]])
        assert old.procs[ids[0]].proc.wait(timeout=30) == -signal.SIGTERM
        assert new.procs[ids[0]].proc.wait(timeout=30) == 0  # not its child: the code is unknown
        assert new.list()[ids[0]]["alive"] is False and os.listdir(registry) == []
    finally:
        new.close()
        old.close()


def test_a_launch_still_running_when_the_provider_closes_leaves_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a bug hunt: ``cluster.close()`` while the autoscaler's launch ran in its thread: the
    launch went on after close (a fork server replaced, workers started) and they outlived the
    cluster, retrying the dead scheduler."""
    import threading

    import psutil

    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)
    started: list[Any] = []
    gate, inside = threading.Event(), threading.Event()
    real = subprocess.Popen

    def slow_popen(cmd: Any, **kw: Any) -> Any:
        inside.set()
        gate.wait(10)  # close() runs meanwhile
        proc = real(["sleep", "60"], **kw)
        started.append(proc)
        return proc

    monkeypatch.setattr(local.subprocess, "Popen", slow_popen)
    launch = threading.Thread(target=provider.launch, args=(NodeType("cpu", {"cpu": 1}), 3, "a1"))
    launch.start()
    assert inside.wait(10)
    provider.close()
    gate.set()
    launch.join(20)
    assert len(started) == 1  # the one being spawned: the other two never start
    assert not provider.procs and started[0].poll() is not None  # killed at once
    assert not [p for p in psutil.Process().children() if p.pid == started[0].pid and p.status() != "zombie"]


@pytest.mark.parametrize("fork_server", [False, True])
def test_a_worker_that_refuses_to_start_gives_the_provider_its_reason(fork_server: bool) -> None:
    """Found by a bug hunt: a node type with too little memory per worker failed every launch
    with "exited with code 2" (and "fix the provider or the setup"); the reason was only on the
    worker's stderr.  The worker writes it where the provider reads it."""
    import time

    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=fork_server)
    nt = NodeType("tiny", {"cpu": 1, "memory": "5MB"})
    (wid,) = provider.worker_ids(nt, 1, "a1")
    provider.launch(nt, 1, "a1")
    try:
        errors: list[Any] = []
        deadline = time.monotonic() + 60
        while not errors and time.monotonic() < deadline:
            errors = provider.poll_errors()
            time.sleep(0.05)
        (err,) = errors
        assert err.worker_id == wid and "exited with code 2: memory limit 5 MiB is below what this worker uses" in err.message
        assert provider._exit_dir is not None and not os.listdir(provider._exit_dir)  # read once, then gone
    finally:
        provider.close()
    assert not os.path.exists(provider._exit_dir)


def test_a_worker_that_does_not_exit_on_sigterm_is_killed(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Found by a bug hunt: a called-off worker busy importing a slow preload module (its SIGTERM
    handler cannot run meanwhile) lived on while the autoscaler counted it gone."""
    from tidepool.testing import wait_until

    up = tmp_path / "up"
    deaf = [sys.executable, "-c", "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)", str(up)]  # fmt: skip
    monkeypatch.setattr(local, "worker_command", lambda *a, **k: list(deaf))
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)
    provider.KILL_AFTER = 1.0
    nt = NodeType("cpu", {"cpu": 1})
    (wid,) = provider.worker_ids(nt, 1, "a1")
    provider.launch(nt, 1, "a1")
    try:
        proc = provider.procs[wid].proc
        wait_until(up.exists, 60, what="the worker to ignore SIGTERM")
        provider.terminate([wid])
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        provider.close()


def test_only_a_worker_command_writes_the_exit_file_and_stale_exit_dirs_are_swept(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # a review: a task's own `tidepool report ...` in a worker wrote its error into the worker's exit
    # file (the variable was inherited), blaming the wrong cause when the worker later died; and a
    # provider killed with SIGKILL left its exit directory behind
    import tempfile

    from tidepool.cli import main
    from tidepool.providers.base import EXIT_FILE_ENV

    path = tmp_path / "exit"
    monkeypatch.setenv(EXIT_FILE_ENV, str(path))
    assert main(["report", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "t.png")]) == 2
    assert not path.exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"tidepool-exits-{dead.pid}-")
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)
    try:
        provider._exit_file("w")
        assert not os.path.exists(stale) and provider._exit_dir is not None and os.path.isdir(provider._exit_dir)
    finally:
        provider.close()
