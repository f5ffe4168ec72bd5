"""The command line on real processes: ``tidepool scheduler``, ``tidepool worker``, ``tidepool demo``.

Every process is started with ``subprocess`` and always reaped (terminate, then kill after a bounded
wait).  Output is read by a thread into a queue so waiting for the scheduler's address line is a
bounded wait on an event, not a sleep.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

import tidepool
from tidepool.errors import AuthenticationError, KilledWorkerError
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "tidepool")
ADDRESS_LINE = re.compile(r"tidepool scheduler at (tcp://\S+)")


def tidepool_cmd(*args: str, module: bool = False) -> list[str]:
    """The installed console script, or ``python -m tidepool.cli`` (both are exercised)."""
    if module or not os.path.exists(_SCRIPT):
        return [sys.executable, "-m", "tidepool.cli", *args]
    return [_SCRIPT, *args]


def clean_env() -> dict[str, str]:
    """This environment without any tidepool token, so only the files under test supply one."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])




class Proc:
    """A child process whose stdout lines land in a queue (read by a daemon thread)."""

    def __init__(self, cmd: list[str], stderr_path: Path, env: dict[str, str] | None = None) -> None:
        self.stderr_path = stderr_path
        self._err: IO[bytes] = open(stderr_path, "wb")
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL,
                                      env=env if env is not None else clean_env(), text=True)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern.pattern!r} within {timeout}s: {self.output}"
                                     f"\nstderr: {self.stderr()}")  # fmt: skip
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.popen.poll() is not None and self.lines.empty():
                    raise AssertionError(f"process exited ({self.popen.returncode}) before printing "
                                         f"{pattern.pattern!r}: {self.output}\nstderr: {self.stderr()}") from None  # fmt: skip
                continue
            self.output.append(line)
            m = pattern.search(line)
            if m:
                return m

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the process and wait (bounded) for it to exit; returns its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        return self.popen.wait(timeout)

    def reap(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self._err.close()


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.reap()


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[Proc, str, Path]]:
    """A ``tidepool scheduler`` on a free port with a token file: (process, address, token file)."""
    port = free_port()
    token_file = tmp_path / "token.txt"
    proc = Proc(tidepool_cmd("scheduler", "--port", str(port), "--token-file", str(token_file)),
                tmp_path / "scheduler.err")  # fmt: skip
    with running(proc):
        address = proc.wait_for_line(ADDRESS_LINE).group(1)
        assert address == f"tcp://127.0.0.1:{port}"
        yield proc, address, token_file


def start_worker(address: str, token_file: Path, tmp_path: Path, name: str, *extra: str,
                 module: bool = False) -> Proc:  # fmt: skip
    return Proc(tidepool_cmd("worker", address, "--token-file", str(token_file), "--name", name, *extra,
                             module=module), tmp_path / f"{name}.err")  # fmt: skip


# ---- tests ---------------------------------------------------------------------------------------------
def test_scheduler_workers_and_client_end_to_end(scheduler: tuple[Proc, str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    sched, address, token_file = scheduler
    assert token_file.exists() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in "".join(sched.output)  # never printed

    w1 = start_worker(address, token_file, tmp_path, "cli-w1", "--slots", "2", "--resources", '{"gpu": 1}')
    w2 = start_worker(address, token_file, tmp_path, "cli-w2", "--slots", "1", module=True)
    with running(w1, w2):
        with tidepool.Client(address, token=token) as client:

            def workers() -> dict[str, dict[str, Any]]:
                return {w["name"]: w for w in client.scheduler_info()["workers"]}

            wait_until(lambda: set(workers()) == {"cli-w1", "cli-w2"}, what="both CLI workers to register")
            info = workers()
            assert info["cli-w1"]["resources"] == {"gpu": 1.0, "cpu": 2.0}
            assert info["cli-w2"]["resources"]["cpu"] == 1.0

            # a task pinned by resources runs in the first worker process
            assert client.submit(os.getpid, resources={"gpu": 1}).result(timeout=15) == w1.popen.pid
            squares = client.gather(client.map(lambda x: x * x, range(20)))
            assert squares == [x * x for x in range(20)]

            # a second client finds the token through $TIDEPOOL_TOKEN_FILE
            monkeypatch.setenv("TIDEPOOL_TOKEN_FILE", str(token_file))
            monkeypatch.delenv("TIDEPOOL_TOKEN", raising=False)
            with tidepool.Client(address) as other:
                assert other.submit(pow, 3, 4).result(timeout=15) == 81

            # SIGTERM on a worker: it exits cleanly and the scheduler drops it
            assert w2.stop() == 0, w2.stderr()
            wait_until(lambda: set(workers()) == {"cli-w1"}, what="the scheduler to drop the stopped worker")
            assert client.submit(lambda: "still works").result(timeout=15) == "still works"

        # SIGTERM on the scheduler: it exits cleanly and tells its worker to stop
        assert sched.stop() == 0, sched.stderr()
        assert w1.popen.wait(15) == 0, w1.stderr()
    assert "Traceback" not in sched.stderr() and "Traceback" not in w1.stderr()


def test_a_worker_whose_scheduler_dies_says_so_as_it_exits(scheduler: tuple[Proc, str, Path], tmp_path: Path) -> None:
    """Found by a bug hunt: a worker without a reconnect window exited without a word when its
    scheduler was killed."""
    sched, address, token_file = scheduler
    w = start_worker(address, token_file, tmp_path, "orphan")
    with running(w):
        with tidepool.Client(address, token=token_file.read_text().strip()) as client:
            client.wait_for_workers(1, timeout=30)
        sched.popen.kill()
        w.popen.wait(60)
    err = w.stderr()
    assert "lost the scheduler at" in err and "no reconnect window" in err, err


def test_client_with_wrong_token_is_rejected(scheduler: tuple[Proc, str, Path]) -> None:
    _, address, _ = scheduler
    # the handshake's own answer, not the connect timeout running out (that would be a TimeoutError)
    with pytest.raises(AuthenticationError, match="token"):
        tidepool.Client(address, token="not-the-token", timeout=10)


def test_worker_with_wrong_token_exits_with_an_error(scheduler: tuple[Proc, str, Path],
                                                     tmp_path: Path) -> None:  # fmt: skip
    _, address, _ = scheduler
    bad = tmp_path / "bad-token.txt"
    bad.write_text("0" * 64)
    w = start_worker(address, bad, tmp_path, "bad-worker")
    with running(w):
        try:
            rc = w.popen.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("worker with a wrong token hangs instead of exiting")
        assert rc != 0, f"exit code {rc}, stderr: {w.stderr()!r}"
        assert "token" in w.stderr().lower()


def test_scheduler_on_a_busy_port_exits_with_an_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = Proc(tidepool_cmd("scheduler", "--port", str(port)), tmp_path / "busy.err")
        with running(p):
            rc = p.popen.wait(20)
            assert rc != 0, f"exit code {rc}, stderr: {p.stderr()!r}"
            assert str(port) in p.stderr() or "address" in p.stderr().lower()


@pytest.mark.parametrize(("args", "message"), [
    (["--token-file", "/nonexistent/token.txt"], "cannot read token file"),
    ([], "no token"),
])  # fmt: skip
def test_worker_without_a_usable_token_fails_fast(tmp_path: Path, args: list[str], message: str) -> None:
    w = Proc(tidepool_cmd("worker", f"tcp://127.0.0.1:{free_port()}", *args), tmp_path / "w.err")
    with running(w):
        assert w.popen.wait(20) == 2
        assert message in w.stderr()


def test_demo_runs_and_reports_ok(tmp_path: Path) -> None:
    p = Proc(tidepool_cmd("demo"), tmp_path / "demo.err")
    with running(p):
        m = p.wait_for_line(re.compile(r"result (\d+) \(serial answer (\d+)\): (OK|MISMATCH)"), timeout=40)
        assert m.group(3) == "OK" and m.group(1) == m.group(2)
        assert p.popen.wait(30) == 0, p.stderr()


@pytest.mark.parametrize(("toml", "message"), [
    ("[scheduler]\nprot = 8786\n", "unknown key 'prot' (did you mean 'port'?) in [scheduler]"),
    ("[provider]\nenvv = { A = '1' }\n", "unknown key 'envv' (did you mean 'env'?) in [provider]"),
    ("[policy]\nkind = 'fastest'\n", "[policy] kind must be one of"),
])  # fmt: skip
def test_scheduler_with_a_bad_cluster_file_exits_with_the_config_error(tmp_path: Path, toml: str,
                                                                       message: str) -> None:  # fmt: skip
    path = tmp_path / "bad.toml"
    path.write_text(toml + "\n[[node_types]]\nname = 'cpu'\nmax_nodes = 2\n")
    p = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--cluster", str(path)), tmp_path / "s.err")
    with running(p):
        try:
            rc = p.popen.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"scheduler with a bad cluster file kept running; stderr: {p.stderr()!r}")
        err = p.stderr()
        assert rc == 2, f"exit code {rc}, stderr: {err!r}"
        assert err.startswith(f"tidepool: error: {path}: ") and message in err, err
        assert "Traceback" not in err, err


def hog_memory(step_mb: int = 20, upto_mb: int = 3_000) -> int:
    held = []
    for _ in range(upto_mb // step_mb):
        held.append(bytearray(step_mb << 20))
        time.sleep(0.005)
    return len(held)


def test_a_cli_worker_restarted_over_its_memory_limit_comes_back_under_its_id(
        scheduler: tuple[Proc, str, Path], tmp_path: Path) -> None:  # fmt: skip
    # found by a bug hunt: docs/memory.md says a worker restarts "as a fresh process with the same
    # id", but a CLI worker started without --id came back under a new random one, and a task
    # pinned with workers=[its id] then waited as no-worker
    _, address, token_file = scheduler
    w = start_worker(address, token_file, tmp_path, "cli-mem", "--memory-limit", "400MB")
    with running(w), tidepool.Client(address, token=token_file.read_text().strip()) as client:
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 1, what="the worker to register")
        (before,) = [x["id"] for x in client.scheduler_info()["workers"]]
        with pytest.raises(KilledWorkerError):
            client.submit(hog_memory, retries=0).result(timeout=120)
        wait_until(lambda: [x["id"] for x in client.scheduler_info()["workers"]] == [before], 60,
                   what="the worker back under its id")  # fmt: skip
        assert client.submit(abs, -3, workers=[before]).result(timeout=30) == 3


def test_worker_bad_memory_limit_is_refused_with_the_units_to_use(tmp_path: Path) -> None:
    env = {**clean_env(), "TIDEPOOL_TOKEN": "0" * 64}
    w = Proc(tidepool_cmd("worker", f"tcp://127.0.0.1:{free_port()}", "--memory-limit", "lots"),
             tmp_path / "w.err", env=env)  # fmt: skip
    with running(w):
        assert w.popen.wait(20) == 2, w.stderr()
        err = w.stderr()
        assert "cannot read 'lots' as a byte amount; use e.g. 512MiB or 4GB" in err, err
        assert "Traceback" not in err, err


@pytest.mark.parametrize(("args", "message"), [
    (["--resources", "{cpu: 8}"], "--resources must be a JSON object"),
    (["--resources", "[1, 2]"], "resources must be a mapping"),
    (["--heartbeat-interval", "0"], "--heartbeat-interval must be a positive number of seconds"),
    (["--slots", "0"], "slots must be at least 1"),
])  # fmt: skip
def test_worker_with_bad_arguments_fails_fast_without_a_traceback(tmp_path: Path, args: list[str],
                                                                   message: str) -> None:  # fmt: skip
    env = {**clean_env(), "TIDEPOOL_TOKEN": "0" * 64}
    w = Proc(tidepool_cmd("worker", f"tcp://127.0.0.1:{free_port()}", *args), tmp_path / "w.err", env=env)
    with running(w):
        assert w.popen.wait(20) == 2, w.stderr()
        assert message in w.stderr() and "Traceback" not in w.stderr(), w.stderr()


def die() -> None:
    os._exit(3)


def test_the_scheduler_takes_allowed_failures_and_refuses_a_negative_one(tmp_path: Path) -> None:
    """KilledWorkerError says "raise allowed_failures"; the CLI had no way to set it (a bug hunt)."""
    bad = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--allowed-failures", "-1"), tmp_path / "b.err")
    with running(bad):
        assert bad.popen.wait(20) == 2, bad.stderr()
        assert "--allowed-failures: must be a whole number >= 0" in bad.stderr() and "Traceback" not in bad.stderr()
    port = free_port()
    token_file = tmp_path / "token.txt"
    sched = Proc(tidepool_cmd("scheduler", "--port", str(port), "--token-file", str(token_file), "--no-dashboard",
                              "--allowed-failures", "0"), tmp_path / "s.err")  # fmt: skip
    with running(sched):
        address = sched.wait_for_line(ADDRESS_LINE).group(1)
        w = start_worker(address, token_file, tmp_path, "doomed")
        with running(w), tidepool.Client(address, token=token_file.read_text().strip()) as client:
            client.wait_for_workers(1, timeout=30)
            # with the default (3) the task would wait for another worker; with 0 one death fails it
            with pytest.raises(KilledWorkerError, match="executing on 1 worker that died"):
                client.submit(die).result(timeout=60)


@pytest.mark.parametrize(("argv", "message"), [
    (["worker", "tcp://127.0.0.1:1", "--memory-share", "0"], "--memory-share: must be a whole number >= 1"),
    (["worker", "tcp://127.0.0.1:1", "--memory-share", "-2"], "--memory-share: must be a whole number >= 1"),
    (["worker", "tcp://127.0.0.1:1", "--reconnect-window", "-5"], "--reconnect-window: must be a number of seconds >= 0"),
    (["demo", "--tasks", "-3"], "--tasks: must be a whole number >= 0"),
    # a bug hunt: -1 said the address "needs a port"; demo --workers 0 blamed adapt(maximum=0);
    # nan meant "wait forever", silently
    (["scheduler", "--port", "-1"], "--port: must be a port 0..65535"),
    (["demo", "--workers", "0"], "--workers: must be a whole number >= 1"),
    (["scheduler", "--no-worker-timeout", "nan"], "--no-worker-timeout: must be a finite number of seconds"),
    (["scheduler", "--allowed-failures", "-1"], "--allowed-failures: must be a whole number >= 0"),
])  # fmt: skip
def test_bad_counts_and_seconds_are_refused_not_taken_as_something_else(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Found by a bug hunt: --memory-share 0 or -2 was taken as 1, a negative reconnect window
    accepted, and ``demo --tasks -3`` "submitted -4 tasks"."""
    from tidepool.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_journal_that_cannot_be_written_fails_before_the_address_line(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    from tidepool.cli import main

    rc = main(["scheduler", "--port", "0", "--no-dashboard", "--journal", str(tmp_path / "no" / "run.jsonl")])
    out, err = capsys.readouterr()
    assert rc == 2 and "does not exist" in err and "tidepool scheduler at" not in out, (out, err)


def test_ctrl_c_in_a_command_ends_with_130_and_no_traceback(tmp_path: Path) -> None:
    """Found by a bug hunt: Ctrl-C during ``tidepool simulate`` printed a KeyboardInterrupt traceback."""
    cmd = tidepool_cmd("simulate", "wide", "--param", "n=200000", "--out", str(tmp_path), "--no-plot")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("workload")  # it runs
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err


def test_a_busy_dashboard_port_says_how_to_change_it_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a bug hunt: the CLI's message told the user to pass dashboard='host:port' (Python)."""
    from tidepool.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        rc = main(["scheduler", "--port", "0", "--dashboard", f"127.0.0.1:{port}"])
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert rc == 2 and "--dashboard HOST:PORT" in err and "--no-dashboard" in err, err


def test_exit_with_parent_refuses_a_pid_that_is_not_the_parent(capsys: pytest.CaptureFixture[str]) -> None:
    """Review: with another pid (a shell wrapper's child) the scheduler stopped within a second,
    saying its parent had exited."""
    from tidepool.cli import main

    assert main(["scheduler", "--port", "0", "--no-dashboard", "--exit-with-parent", str(os.getpid())]) == 2
    assert "is not this process's parent" in capsys.readouterr().err


def test_port_and_host_flags_win_over_the_cluster_file_and_a_given_token_is_not_printed(tmp_path: Path) -> None:
    # found by a bug hunt: the file's port silently replaced --port (workers started against the
    # port typed could not connect), and a token from TIDEPOOL_TOKEN_FILE was printed on stdout
    file_port, flag_port = free_port(), free_port()
    cluster = tmp_path / "c.toml"
    cluster.write_text(f"[scheduler]\nport = {file_port}\n\n[[node_types]]\nname = 'cpu'\nmax_nodes = 1\n")
    secret = tmp_path / "secret.tok"
    secret.write_text("secret-931677453\n")
    secret.chmod(0o600)
    env = {**clean_env(), "TIDEPOOL_TOKEN_FILE": str(secret)}
    p = Proc(tidepool_cmd("scheduler", "--cluster", str(cluster), "--port", str(flag_port), "--dashboard",
                          "0.0.0.0:0"), tmp_path / "s.err", env=env)  # fmt: skip
    with running(p):
        assert p.wait_for_line(ADDRESS_LINE).group(1) == f"tcp://127.0.0.1:{flag_port}"
        said = p.wait_for_line(re.compile(r"^token: (.*)$")).group(1)
        assert "secret-931677453" not in said and "not shown" in said
        # nor in the dashboard's link (a bug hunt: the line after "not shown" had ?token=<it>)
        link = p.wait_for_line(re.compile(r"^tidepool dashboard at (.*)$")).group(1)
        assert "secret-931677453" not in link and "add ?token=<the token>" in link
        assert p.stop() == 0, p.stderr()


def test_a_token_file_that_holds_a_token_is_read_not_overwritten(tmp_path: Path) -> None:
    # found by a docs review: `--token-file F` replaced a token the user had put in F, so workers
    # given a copy of it (or a scheduler restarted on it) were refused
    token_file = tmp_path / "token.txt"
    token_file.write_text("my-shared-secret\n")
    token_file.chmod(0o600)
    sched = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file),
                              "--no-dashboard"), tmp_path / "s.err")  # fmt: skip
    with running(sched):
        address = sched.wait_for_line(ADDRESS_LINE).group(1)
        with tidepool.Client(address, token="my-shared-secret") as client:
            assert client.scheduler_info()["workers"] == []
        assert token_file.read_text() == "my-shared-secret\n"
    # found by a bug hunt: with a token in the environment too, the file was overwritten with it
    env = {**clean_env(), "TIDEPOOL_TOKEN": "another-secret"}
    clash = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file),
                              "--no-dashboard"), tmp_path / "c.err", env=env)  # fmt: skip
    with running(clash):
        assert clash.popen.wait(30) == 2, clash.stderr()
        assert "differs from the one in TIDEPOOL_TOKEN" in clash.stderr() and "Traceback" not in clash.stderr()
    assert token_file.read_text() == "my-shared-secret\n"
    same = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file),
                             "--no-dashboard"), tmp_path / "e.err", env={**env, "TIDEPOOL_TOKEN": "my-shared-secret"})  # fmt: skip
    with running(same):
        same.wait_for_line(ADDRESS_LINE)
        assert token_file.read_text() == "my-shared-secret\n"
    token_file.chmod(0o644)  # one others may read is refused, as a worker refuses it
    bad = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file),
                            "--no-dashboard"), tmp_path / "b.err")  # fmt: skip
    with running(bad):
        assert bad.popen.wait(30) == 2, bad.stderr()
        assert "chmod 600" in bad.stderr() and "Traceback" not in bad.stderr()


async def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # blocks the client's event loop, as a paused process would


def test_a_client_of_a_frozen_scheduler_fails_its_calls_and_futures_instead_of_waiting_for_ever(
        tmp_path: Path) -> None:  # fmt: skip
    # found by a network-fault hunt: a scheduler frozen (SIGSTOP) or cut off without its socket
    # closing left scheduler_info() and result() blocked for ever (the client read nothing, and
    # nothing told it the scheduler was gone)
    import concurrent.futures

    token_file = tmp_path / "token.txt"
    sched = Proc(tidepool_cmd("scheduler", "--port", str(free_port()), "--token-file", str(token_file),
                              "--no-dashboard"), tmp_path / "s.err")  # fmt: skip
    with running(sched):
        address = sched.wait_for_line(ADDRESS_LINE).group(1)
        token = token_file.read_text().strip()
        with tidepool.Client(address, token=token, silence_timeout=1.0) as quiet:
            time.sleep(2.5)  # longer than its silence_timeout with nothing to do: the pings keep it
            assert quiet.scheduler_info()["workers"] == []
            # a review: a client whose own loop did not run for a while (paused, a long GIL hold)
            # dropped a healthy scheduler on waking, without a ping
            quiet._connection.loop.run(_hold_the_loop(3.0))
            assert quiet.scheduler_info()["workers"] == []
            client = tidepool.Client(address, token=token, silence_timeout=2.0)
            pending = client.submit(sum, [1, 2])  # no worker: it waits
            sched.popen.send_signal(signal.SIGSTOP)
            try:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    call = pool.submit(client.scheduler_info)
                    with pytest.raises(tidepool.ConnectionLostError, match="sent nothing for"):
                        call.result(timeout=60)
                with pytest.raises(tidepool.ConnectionLostError, match="sent nothing for"):
                    pending.result(timeout=60)
                with pytest.raises(tidepool.ConnectionLostError):
                    client.submit(sum, [3])
            finally:
                sched.popen.send_signal(signal.SIGCONT)
            client.close()


def test_report_of_an_empty_journal_and_simulate_into_a_file_say_what_is_wrong(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:  # fmt: skip
    # found by a bug hunt: report printed zeros and drew an empty plot (exit 0); simulate --out FILE
    # failed with a bare "[Errno 17] File exists" after loading the workload
    from tidepool.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["report", str(empty), "-o", str(tmp_path / "t.png")]) == 2
    assert "no timed records" in capsys.readouterr().err and not (tmp_path / "t.png").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["simulate", "chain", "--out", str(afile), "--no-plot", "--quiet"]) == 2
    assert "--out" in capsys.readouterr().err


def test_demo_hold_takes_seconds_only(capsys: pytest.CaptureFixture[str]) -> None:
    # a review: `demo --hold -1` started a cluster, then failed with a ValueError traceback
    from tidepool.cli import main

    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as info:
            main(["demo", "--hold", bad])
        assert info.value.code == 2 and "--hold: must be a number of seconds >= 0" in capsys.readouterr().err
