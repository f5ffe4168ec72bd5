"""A fork server for local workers: one small process that has imported the worker code and forks a
new worker on request, so a worker registers in about a tenth of a second instead of paying the
interpreter start and its imports (seconds on a loaded machine).

Two halves live here:

- the **server** (:func:`main`, ``--reply-fd N [--preload M ...]``): it
  imports the worker code (:mod:`tidepool.cli` and :mod:`tidepool.worker.server`, which is all
  ``python -m tidepool.worker`` imports) and the preload modules, then serves requests read from
  its stdin, one JSON line each (``{"id", "argv", "env", "cwd"}``), answering on the reply pipe
  ``{"op": "forked", "id", "pid"}``, ``{"op": "exit", "pid", "rc"}`` when it reaps a worker, and
  ``{"op": "refused", "reason"}`` before it exits when forking is not safe.  End of its stdin (the
  provider closed, or died) ends it; its workers live on and are the provider's to stop.
- the **client** :class:`ForkServer` (used by :class:`~tidepool.providers.local.LocalProvider`):
  starts the server, sends requests, and hands back a :class:`ForkedWorker` per worker, which
  looks like the ``subprocess.Popen`` of a spawned one (``pid``, ``poll``, ``wait``,
  ``send_signal``, ``kill``), so the provider treats both alike (temp directories, signals,
  kill on close).

**Fork safety.**  ``fork()`` copies only the calling thread, so a fork taken while another thread
holds a lock (the import lock, a logging or malloc lock, OpenBLAS's pool) leaves the child with a
lock nobody will release.  The server therefore never starts a thread, and it checks this rather
than trusting it: before it answers "ready" and again before every fork it counts the threads of
its process as the kernel sees them (``/proc/self/task``, which includes threads started by C
libraries; ``threading.active_count()`` where there is no ``/proc``).  If there is more than one
(say a preload module started a thread pool at import) it refuses: it reports why and exits, and
the provider starts a server without the preload modules, or spawns workers, journaling the reason.
The server's own loop is single-threaded: it waits with ``select`` on its stdin and on a
``signal.set_wakeup_fd`` pipe that ``SIGCHLD`` writes to, and reaps children with ``waitpid``.  No
asyncio loop, socket or thread exists in it before the fork; the worker creates its own after.

**What the child resets.**  Signal handlers and the wakeup fd (back to a spawned process's
defaults), the server's pipes (closed; stdin is ``/dev/null`` as for a spawned worker), the
environment (replaced by the request's: a worker sees the provider's environment *now*, not when
the server started; ``PYTHONPATH`` entries added since go on ``sys.path``), the working
directory, ``tempfile``'s cached directory, and ``sys.orig_argv``, which becomes the spawn command
line: a worker over its memory limit re-executes itself with it (``os.execv``) and comes back as a
spawned worker under the same pid.  Python reseeds ``random``
in a forked child itself.

**Setup hooks** (``client.register_setup``) are not the server's business: the scheduler sends
every worker all registered hooks when it registers, so a forked worker runs hooks registered
after the server started exactly as a spawned one does.

**Exit codes.**  The server reaps its children and reports their exit codes, which
:meth:`ForkedWorker.poll` returns (negative for a signal, as ``Popen``).  If the server itself has
died, a worker's end is still seen (a pidfd on Linux, else ``kill(pid, 0)``) but its exit code is
lost: :data:`UNKNOWN_EXIT` stands for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from tidepool.errors import ProviderError

#: exit code reported for a forked worker that ended after its fork server died (code unknown)
UNKNOWN_EXIT = 255


class ForkServerError(ProviderError):
    """The fork server cannot fork a worker (it died, refused, or did not answer); the provider
    replaces it or spawns workers instead."""


def supported() -> bool:
    """Whether fork servers are on by default here: POSIX with ``fork``, except macOS (its system
    frameworks are not safe to use in a forked child without ``exec``)."""
    return hasattr(os, "fork") and sys.platform != "darwin" and hasattr(signal, "SIGCHLD")


def thread_count() -> int:
    """Threads of this process as the kernel sees them (C threads too), where ``/proc`` tells."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return threading.active_count()


# ---- the server ---------------------------------------------------------------------------------
def _send(fd: int, msg: dict[str, Any]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _child(req: dict[str, Any], close_fds: list[int]) -> None:
    """In the forked child: become what ``python -m tidepool.worker ARGV`` would be, then run it."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a freshly started interpreter has
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:  # 0 itself when the server's stdin was just closed: closing it would free fd 0
        os.dup2(null, 0)  # for a socket, which libuv (uvloop) refuses to close, aborting the worker
        os.close(null)
    started_with = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(_PRELOAD_ENV)  # after: a spawned worker's preload import would set them over its env
    if os.environ.get("PYTHONPATH", "") != started_with:  # set since the server started: as a spawn would
        new = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = new
    if req.get("cwd"):
        os.chdir(req["cwd"])
    import tempfile

    tempfile.tempdir = None  # re-read TMPDIR from the worker's own environment
    argv = [str(a) for a in req["argv"]]
    sys.argv = ["tidepool.worker", *argv]
    sys.orig_argv = [sys.executable, "-m", "tidepool.worker", *argv]  # what a memory restart execs
    from tidepool.cli import worker_main

    rc = worker_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


#: environment variables the preload modules set (or changed) when the server imported them
_PRELOAD_ENV: dict[str, str] = {}


def serve(reply_fd: int, preload: list[str]) -> int:
    """The server's loop (see the module docstring); returns its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the provider; it closes our stdin
    import importlib

    import tidepool.cli  # noqa: F401 - the worker's code, imported once here
    import tidepool.worker.server  # noqa: F401

    before = dict(os.environ)
    for mod in preload:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - the worker reports a broken preload itself
            _send(reply_fd, {"op": "refused", "reason": f"importing preload module {mod!r} failed: "
                                                        f"{type(exc).__name__}: {exc}"})  # fmt: skip
            return 3
    if (n := thread_count()) > 1:
        _send(reply_fd, {"op": "refused", "reason": f"{n} threads after importing the worker code and the "
                                                    f"preload modules {preload}; forking is only safe with one"})  # fmt: skip
        return 3
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select via the fd
    global _PRELOAD_ENV
    # what the preload modules set in the environment when imported (here, once): each worker gets
    # it as if it had imported them itself (its own environment is set from the request)
    _PRELOAD_ENV = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _send(reply_fd, {"op": "ready", "pid": os.getpid()})
    buf = b""
    stdin = 0
    while True:
        try:
            readable, _, _ = select.select([stdin, wake_r], [], [], 1.0)
        except InterruptedError:
            readable = []
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(reply_fd)
        if stdin not in readable:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return 0  # the provider closed (or died): its workers are its own to stop
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            req = json.loads(line)
            if (n := thread_count()) > 1:
                _send(reply_fd, {"op": "refused", "reason": f"the fork server has {n} threads; forking is "
                                                            "only safe with one"})  # fmt: skip
                return 3
            pid = os.fork()
            if pid == 0:
                try:
                    _child(req, [stdin, reply_fd, wake_r, wake_w])
                except BaseException:  # noqa: BLE001 - the child must never return into the server
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(1)
            _send(reply_fd, {"op": "forked", "id": req["id"], "pid": pid})


def _reap(reply_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(reply_fd, {"op": "exit", "pid": pid, "rc": os.waitstatus_to_exitcode(status)})


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tidepool.providers.forkserver")
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("--preload", action="append", default=[])
    args = p.parse_args(argv)
    try:
        return serve(args.reply_fd, args.preload)
    except BrokenPipeError:  # the provider is gone (its reader closed): nothing left to serve
        return 0


#: the server's command (``-c``, not ``-m``: the package imports this module before ``-m`` would run it)
_SERVER_MAIN = "import sys; from tidepool.providers.forkserver import main; sys.exit(main(sys.argv[1:]))"


# ---- the client ---------------------------------------------------------------------------------
class ForkedWorker:
    """A worker forked by a :class:`ForkServer`: the ``Popen`` calls the provider uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # Linux 5.3+: a handle on this very process
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            rc = self.server.exit_code(self.pid)
            if rc is None and self.server.dead and self._gone():
                rc = self.server.exit_code(self.pid)  # reported just before the server died?
                rc = UNKNOWN_EXIT if rc is None else rc
            if rc is not None:
                self.returncode = rc
                if self._pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(self._pidfd)
                    self._pidfd = None
        return self.returncode

    def _gone(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["tidepool.worker", str(self.pid)], timeout or 0.0)
            self.server.wait_for_change(0.05 if left is None else min(0.05, left))
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self._pidfd is not None and hasattr(signal, "pidfd_send_signal"):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The provider's handle on one fork server process (see the module docstring).

    Thread-safe: a reader thread in the provider's process reads the server's replies; ``fork`` may
    be called from any thread.  ``dead`` is the reason the server can no longer fork (``None``
    while it can).
    """

    #: seconds ``fork`` waits for the server to be ready (it imports the worker code first)
    READY_TIMEOUT = 60.0
    #: seconds ``fork`` waits for the pid of a new worker
    FORK_TIMEOUT = 10.0

    def __init__(self, env: dict[str, str], cwd: str | None = None, preload: list[str] | None = None,
                 python: str = sys.executable) -> None:  # fmt: skip
        self.preload = list(preload or [])
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [python, "-c", _SERVER_MAIN, "--reply-fd", str(w),
                 *[a for m in self.preload for a in ("--preload", m)]],
                stdin=subprocess.PIPE, pass_fds=(w,), env=env, cwd=cwd)  # fmt: skip
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        self._cond = threading.Condition()
        self._ready = False
        self.dead: str | None = None
        self._pids: dict[str, int] = {}
        self._exits: dict[int, int] = {}
        self._write_lock = threading.Lock()
        self.on_death: Callable[[str], None] | None = None
        self._reader = threading.Thread(target=self._read, args=(r,), name="tidepool-forkserver-reader", daemon=True)
        self._reader.start()

    # the reader thread
    def _read(self, fd: int) -> None:
        reason = "it closed its reply pipe"
        with os.fdopen(fd, "rb") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._cond:
                    op = msg.get("op")
                    if op == "ready":
                        self._ready = True
                    elif op == "forked":
                        self._pids[str(msg["id"])] = int(msg["pid"])
                    elif op == "exit":
                        self._exits[int(msg["pid"])] = int(msg["rc"])
                    elif op == "refused":
                        reason = f"it refused to fork: {msg.get('reason')}"
                    self._cond.notify_all()
        rc = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = self.proc.wait(5)
        if "refused" not in reason:
            reason = f"it exited with code {rc}" if rc is not None else reason
        with self._cond:
            self.dead = self.dead or f"the fork server (pid {self.proc.pid}) is gone: {reason}"
            self._cond.notify_all()

    @property
    def ready(self) -> bool:
        return self._ready and self.dead is None

    @property
    def starting(self) -> bool:
        """Still importing: neither ready nor dead."""
        return not self._ready and self.dead is None

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_for_change(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the server answers requests; raise :class:`ForkServerError` if it cannot."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self.dead is not None,
                                self.READY_TIMEOUT if timeout is None else timeout)  # fmt: skip
            if self.dead is not None:
                raise ForkServerError(self.dead)
            if not self._ready:
                raise ForkServerError(f"the fork server (pid {self.proc.pid}) was not ready after "
                                      f"{round(self.READY_TIMEOUT if timeout is None else timeout, 1):g} s")  # fmt: skip

    def fork(self, worker_id: str, argv: list[str], env: dict[str, str], cwd: str | None,
             ready_timeout: float | None = None) -> ForkedWorker:  # fmt: skip
        """Fork one worker running ``python -m tidepool.worker ARGV`` in ``env``; its handle.
        Waits ``ready_timeout`` (default :attr:`READY_TIMEOUT`) for a server still importing."""
        self.wait_ready(ready_timeout)
        req = json.dumps({"id": worker_id, "argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
        try:
            with self._write_lock:
                self._stdin.write(req)
                self._stdin.flush()
        except (OSError, ValueError) as exc:
            with self._cond:
                self.dead = self.dead or f"the fork server (pid {self.proc.pid}) is gone: writing to it failed ({exc})"
            raise ForkServerError(self.dead) from exc
        with self._cond:
            self._cond.wait_for(lambda: worker_id in self._pids or self.dead is not None, self.FORK_TIMEOUT)
            pid = self._pids.pop(worker_id, None)
            if pid is None:
                raise ForkServerError(self.dead or f"the fork server (pid {self.proc.pid}) did not fork "
                                                   f"{worker_id} within {self.FORK_TIMEOUT:g} s")  # fmt: skip
        return ForkedWorker(self, pid)

    def close(self, timeout: float = 5.0) -> None:
        """End the server (its workers are not touched: the provider stops them first)."""
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._cond:
            self.dead = self.dead or "closed"
            self._cond.notify_all()
