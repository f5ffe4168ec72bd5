"""A program that never closes its client or cluster still exits, and leaves no worker behind.

Before: nothing closed them at exit; the close left to ``__del__`` ran at interpreter shutdown,
after the loop threads had stopped.  ``client = tidepool.Client()`` never closed hung for ever
(the provider's wait for a killed forked worker asked a thread that no longer ran); an explicit
``LocalCluster`` + ``Client`` took two 10 s timeouts to exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tidepool.loop import ClosesOnExit, close_all_at_exit
from tidepool.providers.local import LocalProvider, LocalWorkerProcess
from tidepool.testing import wait_until

SCRIPT = """
import tidepool

def inc(x):
    return x + 1

if __name__ == "__main__":
    client = tidepool.Client()  # never closed, as in a first script or a notebook
    print(client.gather(client.map(inc, range(3))), flush=True)
    print(*(p.proc.pid for p in client.cluster.provider.procs.values()), flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.integration
def test_a_script_that_never_closes_its_client_exits_and_leaves_no_worker(tmp_path: Path) -> None:
    script = tmp_path / "noclose.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # a bound, not a deadline: before the fix this never returned
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[1, 2, 3]"
    pids = [int(p) for p in lines[1].split()]
    assert pids
    wait_until(lambda: all(_gone(p) for p in pids), 30, what="the workers gone")
    assert "Traceback" not in out.stderr, out.stderr


class Closable(ClosesOnExit):
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail
        self.closed = False
        self._close_at_exit()

    def close(self) -> None:
        self.log.append(self.name)
        self.closed = True
        if self.fail:
            raise RuntimeError("close failed")


def test_at_exit_everything_still_open_is_closed_newest_first_and_a_failing_close_stops_none() -> None:
    log: list[str] = []
    cluster = Closable("cluster", log)
    client = Closable("client", log, fail=True)
    done = Closable("closed already", log)
    done.close()
    log.clear()
    close_all_at_exit()
    assert log == ["client", "cluster"]  # the client before the cluster it uses; a failure stops nothing
    assert cluster.closed and client.closed


FORK_SCRIPT = """
import os, sys
from tidepool.loop import ClosesOnExit

class Marked(ClosesOnExit):
    def __init__(self):
        self.closed = False
        self._close_at_exit()
    def close(self):
        self.closed = True
        open(f"{sys.argv[1]}/closed-by-{os.getpid()}", "w").close()

owner = Marked()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child exits normally: its atexit hooks run
os.waitpid(pid, 0)
print(pid, os.getpid())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_leaves_its_parents_clients_to_the_parent(tmp_path: Path) -> None:
    """Found by review: a child made by os.fork() inherited the registry and, at its exit, closed
    the parent's client and cluster (stopping the parent's workers)."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent(FORK_SCRIPT))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child, parent = out.stdout.split()
    assert not (tmp_path / f"closed-by-{child}").exists()
    assert (tmp_path / f"closed-by-{parent}").exists()  # the parent still closes its own at exit


class NeverExits:
    """A worker process whose exit is never heard (a forked worker whose reader thread is gone)."""

    pid = 999_999_999

    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.killed = False

    def poll(self) -> int | None:
        return None

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait would hang here for ever")
        raise subprocess.TimeoutExpired(["worker"], timeout)


def test_provider_close_never_waits_unbounded_for_a_worker_that_does_not_exit(caplog: Any) -> None:
    provider = LocalProvider("tcp://127.0.0.1:1", "token", fork_server=False)
    proc = NeverExits()
    provider.procs["w-stuck"] = LocalWorkerProcess("w-stuck", "default", "r1", proc)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="tidepool.providers"):
        provider.close(timeout=0.01)
    assert proc.killed and proc.waits and None not in proc.waits
    assert "did not exit" in caplog.text and "w-stuck" in caplog.text
    assert not provider.procs
