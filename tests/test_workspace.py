"""A worker's directory (worker/workspace.py): killed workers' directories are swept by the next
worker on the host, live ones and foreign ones never are."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from tidepool.testing import wait_until
from tidepool.worker.workspace import OWNER_FILE, claim, sweep_stale

HOLD = "import sys, time; from tidepool.worker.workspace import claim; print(claim('w1', sys.argv[1]), flush=True); time.sleep(300)"


def _claim_in_child(root: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_owners_directory_is_swept_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead, dead_dir = _claim_in_child(tmp_path)
    live, live_dir = _claim_in_child(tmp_path)
    try:
        (dead_dir / ".spill").mkdir()
        (dead_dir / ".spill" / "value").write_bytes(b"x" * 1000)
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        assert dead_dir.is_dir()  # a SIGKILL runs no atexit: the directory stays
        foreign = tmp_path / "tidepool-not-a-worker"
        foreign.mkdir()  # no owner file: not ours to judge
        assert sweep_stale(tmp_path) == [dead_dir]
        assert not dead_dir.exists() and live_dir.is_dir() and foreign.is_dir()
    finally:
        live.kill()
        live.wait(30)


def test_a_reused_pid_does_not_keep_a_directory(tmp_path: Path) -> None:
    stale = tmp_path / "tidepool-w9-abcdefgh"
    stale.mkdir()
    started = psutil.Process().create_time()
    (stale / OWNER_FILE).write_text(f"{os.getpid()} {started - 1000.0!r}\n")  # our pid, another process's start
    mine = claim("w2", tmp_path)
    assert not stale.exists()
    assert mine.is_dir() and (mine / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    assert sweep_stale(tmp_path) == []  # our own directory stays


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_real_worker_killed_with_sigkill_leaves_nothing_once_the_next_worker_starts(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "TIDEPOOL_TOKEN": "x" * 40}
    cmd = [sys.executable, "-m", "tidepool.cli", "worker", f"tcp://127.0.0.1:{_free_port()}"]  # no scheduler: it waits

    def dirs() -> list[Path]:
        return sorted(p for p in tmp_path.iterdir() if p.name.startswith("tidepool-"))

    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = None
    try:
        # its owner file too: it is written just after the directory is made
        wait_until(lambda: len(dirs()) == 1 and (dirs()[0] / OWNER_FILE).exists(), timeout=60,
                   what="the first worker's directory")  # fmt: skip
        (killed,) = dirs()
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        assert killed.is_dir()
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: not killed.exists() and len(dirs()) == 1, timeout=60, what=f"the sweep: {dirs()}")
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
