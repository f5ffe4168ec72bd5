"""SSHProvider: worker processes on other machines, started over SSH (asyncssh).

Place in the data flow: the scaling controller asks for ``count`` nodes of a node type; this
provider picks hosts (least loaded first, ties in the order given), opens one SSH *session channel*
per worker and runs ``python -m tidepool.worker`` there with the scheduler address it got from
``bind`` and the worker id it returns from ``launch``.  The worker then connects to the scheduler by
itself; the SSH channel only carries the worker's output and its exit status back.

Where the state lives: on exactly one asyncio event loop, the first one that needs it, and the
provider stays bound to it (asyncssh connections, channels, locks and events belong to one loop).

- Used through the coroutine methods (``launch_async``, ``terminate_async``, ``list_async``,
  ``poll_errors_async``, ``close_async``; the :class:`~tidepool.providers.base.AsyncProvider`
  capability the autoscaler awaits in the scheduler's event loop), the connections and sessions live
  in *that* loop: no thread is started.  The synchronous methods called from another thread then
  hand their coroutine to that loop and wait; called inside that loop, the ones that would block
  (``terminate``, ``launch_now``) raise :class:`~tidepool.errors.ProviderError` (await the
  ``_async`` method instead), ``launch``/``list``/``poll_errors`` work there directly, and
  ``close`` schedules the shutdown (``close_async`` awaits it).
- Used first through the synchronous methods by a caller without a loop (a script), the provider
  starts a private loop on a daemon thread (``tidepool-ssh``) and the state lives there.
- Awaiting a coroutine method from any other loop raises :class:`~tidepool.errors.ProviderError`
  saying so (it never hangs); so do ``terminate`` and ``launch_now`` once the owning loop is closed
  or stopped (``launch`` reports it through ``poll_errors``; ``list``/``poll_errors`` just read).
  ``close`` / ``close_async`` close the connections on the loop that owns them; if that loop has
  already ended, ``close`` shuts the TCP connections down so the workers' watchdogs stop them.

The state itself:

- ``_hosts``: one record per host with its open SSH connections (several when one connection's
  session limit is reached; OpenSSH allows 10 sessions per connection) and, after a failed connect,
  when to try it again and why it failed.
- ``_workers``: worker id -> host, remote pid, the process handle, the last lines it printed, and
  whether it exited (with which code) and whether we asked it to stop.
- ``_requests``: request id -> worker ids, so launching a request id twice starts it once.

How a worker is started (one command, nothing secret on any command line)::

    sh -c '<script>'       # the script reads K=V lines from stdin until a blank line and exports
                           # them (TIDEPOOL_TOKEN, TIDEPOOL_WORKER_ID, the user's env), prints
                           # "tidepool-pid $$", starts a watchdog, then ``exec``s the worker

The pid line is how ``terminate`` finds the process: closing a channel without a PTY does not stop
the remote process, and as root sshd refuses channel signals, so ``terminate`` runs a small script
on the host that sends ``TERM`` to the recorded pids (only if that pid's command line still carries
the worker id, so a recycled pid is never hit), waits up to ``term_timeout`` and sends ``KILL`` to
what is left.  The watchdog is the safety net for crashes: it holds the channel's stdin and, when
that reaches end-of-file (the channel or connection closed, e.g. because this process died), sends
the worker ``TERM`` and later ``KILL``.  So nothing is left running even if ``close`` never ran.

Durable mode (``tag_with``, which a durable scheduler calls with its cluster's tag): no watchdog.
The worker runs behind a relay that survives the channel (``ssh_adopt.durable_script``), so a
killed scheduler process leaves it running on its reconnect window, past which it exits by itself;
its command line carries the tag, node type, request and worker id.  The provider of the restarted
scheduler, the first time it lists, terminates or closes, runs ``ps`` on each host, adopts the
processes with its tag (``_workers`` entries marked ``adopted``, watched by a channel that ends
with the process) and from then on lists, terminates (by pid) and closes them like its own.

Errors: a launch that cannot reach any host raises :class:`~tidepool.errors.ProviderError` with the
request id, within ``connect_timeout`` per host (never hangs); an unreachable host is skipped for
``host_retry`` seconds while others work.  ``poll_errors`` reports workers whose remote process
exited with an error (with the tail of its output) or whose connection was lost, each once.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import itertools
import logging
import os
import re
import shlex
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tidepool.comm.tls import TLSConfig
from tidepool.errors import ConfigError, ProviderError
from tidepool.providers._address import contact_address
from tidepool.providers.base import ProviderFailure, worker_command
from tidepool.providers.ssh_adopt import (
    ALIVE_FN,
    MARKER_VAR,
    PID_PREFIX,
    SCAN_COMMAND,
    TaggedProcess,
    durable_script,
    parse_tagged_processes,
    tag_marker,
    watch_script,
)
from tidepool.scaling.node_types import NodeType

if TYPE_CHECKING:
    from tidepool.loop import LoopThread

log = logging.getLogger("tidepool.providers.ssh")

T = TypeVar("T")

_PID_PREFIX = PID_PREFIX
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEFAULT_KNOWN_HOSTS: Any = ()  # asyncssh's own default: ~/.ssh/known_hosts
EXIT_NO_WORKDIR = 97
_ALIVE_FN = ALIVE_FN  # is process $1 still the worker whose id is $2? (ssh_adopt.py)
_SLEEP = "sleep 0.1 2>/dev/null || sleep 1"
#: the process group of pid $1: field 5 of /proc/$1/stat (after the command name, which may hold
#: spaces), else ``ps`` (busybox's has no ``-p``: then nothing, and only the pid is signalled)
_PGID_FN = ('tp_pgid() { if [ -r "/proc/$1/stat" ]; then sed "s/.*) //" "/proc/$1/stat" | cut -d" " -f3; '
            'else ps -o pgid= -p "$1" 2>/dev/null | tr -d " "; fi; }')
#: seconds between looks at whether a worker's process exited while its output stays open
EXIT_POLL = 0.5


def _exit_status(proc: Any) -> int | None:
    """The remote process's exit status once the host sent it (the channel may stay open)."""
    with contextlib.suppress(Exception):
        status = proc.exit_status
        return None if status is None else int(status)
    return None


def _asyncssh() -> Any:
    try:
        import asyncssh
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError("SSHProvider needs asyncssh: pip install 'tidepool[ssh]'") from exc
    return asyncssh


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _log_close_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("SSHProvider.close: %s", task.exception())


def parse_host(spec: str, default_user: str | None, default_port: int) -> tuple[str | None, str, int]:
    """``"user@host:port"`` / ``"host"`` / ``"[::1]:2222"`` -> (user, host, port)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"SSH host must be a non-empty string like 'user@host:22', got {spec!r}")
    user = default_user
    rest = spec.strip()
    if "@" in rest:
        user, rest = rest.rsplit("@", 1)
    port = default_port
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = int(tail[1:])
    elif rest.count(":") == 1:
        host, p = rest.split(":")
        try:
            port = int(p)
        except ValueError:
            raise ConfigError(f"SSH host {spec!r}: port {p!r} is not a number") from None
    else:
        host = rest
    if not host:
        raise ConfigError(f"SSH host {spec!r} has no host name")
    return user, host, port


def remote_script(command: Sequence[str], worker_id: str, workdir: str | None,
                  term_grace: int = 10) -> str:  # fmt: skip
    """The ``sh`` script that runs one worker (see the module docstring); env comes on stdin."""
    wid = shlex.quote(worker_id)
    lines = [
        'while IFS= read -r tp_kv && [ -n "$tp_kv" ]; do export "$tp_kv"; done',
        _ALIVE_FN,
        f'echo "{_PID_PREFIX}$$"',
        "exec 3<&0",
        # watchdog: stdin EOF (channel or connection gone) -> TERM, then KILL after term_grace s, to
        # the worker's process group when it leads one (sshd makes it a session leader): processes
        # its tasks started go with it
        f"( trap '' HUP INT TERM; cat <&3 >/dev/null 2>&1; tp_alive $$ {wid} || exit 0; "
        "kill -s TERM -- -$$ 2>/dev/null || kill -TERM $$; "
        f"n=0; while [ $n -lt {term_grace * 10} ] && tp_alive $$ {wid}; do {_SLEEP}; n=$((n+1)); done; "
        "kill -s KILL -- -$$ 2>/dev/null || kill -KILL $$ ) >/dev/null 2>&1 &",
        "exec 3<&-",
    ]
    if workdir:
        d = shlex.quote(workdir)
        lines.append(f'cd {d} || {{ echo "tidepool: cannot cd to {workdir} on $(hostname)" >&2; '
                     f"exit {EXIT_NO_WORKDIR}; }}")  # fmt: skip
    lines.append("exec " + " ".join(shlex.quote(a) for a in command) + " </dev/null")
    return "\n".join(lines)


def kill_script(targets: Sequence[tuple[int, str]], term_timeout: float) -> str:
    """TERM the (pid, worker id) pairs still alive, wait up to ``term_timeout``, KILL the rest.

    A pid is signalled only while its command line still carries the worker id; when it leads its
    process group (sshd makes it a session leader), the whole group is signalled, so processes its
    tasks started go with it, and the group gets the KILL too.  Prints ``survivor PID`` for
    anything still alive at the end (nothing, normally).
    """
    checks = [(int(pid), shlex.quote(wid)) for pid, wid in targets]
    ticks = max(1, int(term_timeout * 10))
    any_alive = " || ".join(f"tp_alive {p} {w}" for p, w in checks) or "false"
    leads = " ".join(
        f'tp_alive {p} {w} && [ "$(tp_pgid {p})" = {p} ] && tp_groups="$tp_groups {p}";'
        for p, w in checks)  # fmt: skip
    return "\n".join([
        _ALIVE_FN,
        _PGID_FN,
        f"tp_any() {{ {any_alive}; }}",
        f'tp_groups=""; {leads} :',
        "tp_sig() { " + " ".join(f'tp_alive {p} {w} && kill "-$1" {p} 2>/dev/null;' for p, w in checks)
        + ' for g in $tp_groups; do kill -s "$1" -- "-$g" 2>/dev/null; done; :; }',
        "tp_sig TERM",
        f"n=0; while [ $n -lt {ticks} ] && tp_any; do {_SLEEP}; n=$((n+1)); done",
        "tp_sig KILL",
        f"n=0; while [ $n -lt 20 ] && tp_any; do {_SLEEP}; n=$((n+1)); done",
        *(f'tp_alive {p} {w} && echo "survivor {p}"' for p, w in checks),
        "exit 0",
    ])  # fmt: skip


@dataclass
class _Conn:
    conn: Any  # asyncssh.SSHClientConnection
    sessions: int = 0

    @property
    def usable(self) -> bool:
        return not self.conn.is_closed()


@dataclass
class _Host:
    spec: str
    user: str | None
    host: str
    port: int
    index: int
    conns: list[_Conn] = field(default_factory=list)
    down_until: float = 0.0
    down_reason: str = ""
    lock: asyncio.Lock | None = None

    @property
    def name(self) -> str:
        u = f"{self.user}@" if self.user else ""
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{u}{h}:{self.port}"


@dataclass
class _SSHWorker:
    worker_id: str
    node_type: str
    request_id: str
    host: _Host
    conn: _Conn
    proc: Any  # asyncssh.SSHClientProcess
    pid: int
    started: float = field(default_factory=time.time)
    output: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    done: asyncio.Event = field(default_factory=asyncio.Event)
    returncode: int | None = None
    lost: bool = False  # the channel closed without an exit status (connection lost)
    stopping: bool = False
    reported: bool = False
    ended: float | None = None
    task: asyncio.Task[None] | None = None
    adopted: bool = False  # found by its tag after a restart: proc watches it, it is not its child


def _host_key_advice(name: str, host: str, port: int, known_hosts: Any, exc: BaseException) -> str:
    """What to do about a host key that could not be verified, naming the known_hosts file in use,
    and whether that file has a *different* key for the host (a changed key: check it before
    replacing the line; adding the new one blindly is what a man in the middle wants)."""
    path = os.path.expanduser(known_hosts if isinstance(known_hosts, str) else "~/.ssh/known_hosts")
    shown = known_hosts if isinstance(known_hosts, str) else "~/.ssh/known_hosts"
    names = {host, f"[{host}]:{port}"}
    listed = False
    with contextlib.suppress(OSError):
        with open(path, encoding="utf-8", errors="replace") as f:
            listed = any(set(line.split()[0].split(",")) & names for line in f if line.strip() and not line.startswith("#"))
    if listed:
        return (f"SSH to {name}: its host key does not match the one {shown} holds for it ({exc}): the host was "
                f"reinstalled, or something is between you and it; check the key (ssh-keyscan -p {port} {host}) "
                f"before you replace its line in {shown}")  # fmt: skip
    return (f"SSH to {name}: host key not verifiable ({exc}); {shown} has no key for it: add it "
            f"(ssh-keyscan -p {port} {host} >> {shown})" + ("" if isinstance(known_hosts, str) else
                                                          ", or pass known_hosts=PATH"))  # fmt: skip


class SSHProvider:
    """Start workers on ``hosts`` over SSH; see the module docstring for how and why.

    ``hosts`` are ``"host"``, ``"host:port"`` or ``"user@host:port"`` strings.  ``client_keys`` are
    private key paths (default: asyncssh's defaults, i.e. ``~/.ssh/id_*`` and the SSH agent).
    ``known_hosts`` is a known_hosts file path (or list of them); the default checks host keys
    against ``~/.ssh/known_hosts``; ``None`` (or ``False``) turns host key checking *off* — only
    for throw-away test hosts.  ``python`` is the interpreter *on the hosts* that has tidepool
    installed; ``env`` is exported for the workers (never on a command line); ``workdir`` is ``cd``-ed
    into first.  ``scheduler_host`` is the address the hosts dial back (default: the scheduler's
    own, or this machine's name when the scheduler listens on ``0.0.0.0``).
    """

    def __init__(self, hosts: Sequence[str] | str, *, user: str | None = None, port: int = 22,
                 client_keys: Sequence[str] | str | None = None, known_hosts: Any = _DEFAULT_KNOWN_HOSTS,
                 python: str = "python3", env: Mapping[str, str] | None = None, tls: TLSConfig | None = None,
                 workdir: str | None = None, connect_timeout: float = 10.0,
                 term_timeout: float = 5.0, host_retry: float = 30.0,
                 keepalive_interval: float = 15.0, sessions_per_connection: int = 8,
                 heartbeat_interval: float = 1.0, extra_args: Sequence[str] | None = None,
                 scheduler: str = "", token: str = "", scheduler_host: str | None = None,
                 connect_options: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if isinstance(hosts, str):
            hosts = [hosts]
        if not hosts:
            raise ConfigError("SSHProvider needs at least one host, e.g. SSHProvider(['node1', 'node2'])")
        if connect_timeout <= 0 or term_timeout < 0:
            raise ConfigError("SSHProvider: connect_timeout must be > 0 and term_timeout >= 0")
        if sessions_per_connection < 1:
            raise ConfigError("SSHProvider: sessions_per_connection must be >= 1")
        self._hosts = [_Host(h, *parse_host(h, user, port), index=i) for i, h in enumerate(hosts)]
        names = [h.name for h in self._hosts]
        if len(set(names)) != len(names):
            raise ConfigError(f"SSHProvider: duplicate hosts in {list(hosts)}")
        keys = [client_keys] if isinstance(client_keys, str) else client_keys
        self.client_keys = None if keys is None else [os.path.expanduser(k) for k in keys]
        if isinstance(known_hosts, str):
            known_hosts = os.path.expanduser(known_hosts)
        elif isinstance(known_hosts, list) and all(isinstance(k, str) for k in known_hosts):
            known_hosts = [os.path.expanduser(k) for k in known_hosts]
        self.known_hosts = None if known_hosts is False else known_hosts
        self.python = python
        self.env = dict(env or {})
        if tls is not None:  # the workers find their certificates at the same paths
            self.env.update(tls.env())
        for k, v in self.env.items():
            if not _ENV_KEY.match(k) or "\n" in str(v):
                raise ConfigError(f"SSHProvider env: {k!r} must be a shell variable name and its value "
                                  "must not contain a newline")  # fmt: skip
        self.workdir = workdir
        self.connect_timeout = float(connect_timeout)
        self.term_timeout = float(term_timeout)
        self.host_retry = float(host_retry)
        self.keepalive_interval = keepalive_interval
        self.sessions_per_connection = sessions_per_connection
        self.heartbeat_interval = heartbeat_interval
        self.extra_args = list(extra_args or [])
        self.connect_options = dict(connect_options or {})
        self.scheduler = scheduler
        self.token = token
        self.scheduler_host = scheduler_host
        self._workers: dict[str, _SSHWorker] = {}
        self._requests: dict[str, list[str]] = {}
        self._launching: dict[str, asyncio.Future[list[str]]] = {}
        self._seq = itertools.count(1)
        self._names: dict[str, list[str]] = {}
        self._launch_errors: list[ProviderFailure] = []
        self._starting: set[str] = set()  # request ids launched, not yet started or failed
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that owns the SSH state
        self._loop_thread: LoopThread | None = None  # set only when that loop is our private one
        self._loop_lock = threading.Condition()
        self._tasks: set[asyncio.Task[None]] = set()  # launches running on the owning loop
        self._closing: asyncio.Task[None] | None = None  # close() called inside the owning loop
        self._inflight = 0  # calls waiting on the loop; close() lets them finish before stopping it
        self._closed = False
        self.tag = ""  # tag_with(): workers outlive the connection and are re-found by this tag
        self._unscanned: set[int] = set()  # hosts whose tagged processes are not looked for yet
        self._scan_lock: asyncio.Lock | None = None
        _asyncssh()  # fail at construction, not at the first launch, when asyncssh is missing

    # ---- plumbing ---------------------------------------------------------------------------------
    def bind(self, scheduler: str, token: str) -> None:
        """Called by the cluster once the scheduler's address and token are known."""
        self.scheduler, self.token = scheduler, token

    # ---- across scheduler restarts -----------------------------------------------------------------
    def tag_with(self, tag: str) -> None:
        """Durable mode: start every worker from now on so that it outlives the SSH connection (no
        watchdog: a worker whose scheduler is gone exits past its own reconnect window), with
        ``tag`` on its command line; and take over the live workers carrying ``tag`` (started by
        the provider of an earlier scheduler process of the same cluster) on each host, the first
        time the provider lists, terminates or closes: they are then listed, terminated and closed
        like its own.  ``tag`` must be stable across restarts (``cluster_tag``).  Connects to
        nothing here."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
            raise ConfigError(f"SSHProvider tag must be letters, digits, '.', '_' or '-', got {tag!r}")
        with self._loop_lock:
            self.tag = tag
            self._unscanned = {h.index for h in self._hosts}

    async def _adopt_tagged(self) -> None:
        """Look for this provider's tagged workers on every host not looked at yet (once per host;
        a host that cannot be reached is logged and not looked at again: its workers are not
        adopted)."""
        if not self._unscanned:
            return
        if self._scan_lock is None:
            self._scan_lock = asyncio.Lock()
        async with self._scan_lock:
            hosts = [h for h in self._hosts if h.index in self._unscanned]
            results = await asyncio.gather(*(self._scan_host(h) for h in hosts), return_exceptions=True)
            for h, r in zip(hosts, results, strict=True):
                self._unscanned.discard(h.index)
                if isinstance(r, BaseException):
                    log.warning("SSHProvider: could not look for the workers tagged %s on %s (%s); they are "
                                "not adopted and exit past their reconnect window if no scheduler takes "
                                "them", self.tag, h.name, r)  # fmt: skip

    async def _scan_host(self, host: _Host) -> None:
        res = await self._short(host, SCAN_COMMAND, self.connect_timeout + 10)
        # ours already (or being started by this provider right now): not taken twice
        found = [p for p in parse_tagged_processes(str(res.stdout or ""), self.tag)
                 if p.worker_id not in self._workers and p.request_id not in self._launching]  # fmt: skip
        results = await asyncio.gather(*(self._watch_adopted(host, p) for p in found), return_exceptions=True)
        for p, r in zip(found, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("SSHProvider: found worker %s (pid %d) on %s by its tag but cannot watch it (%s); "
                            "it is not adopted", p.worker_id, p.pid, host.name, r)  # fmt: skip

    async def _watch_adopted(self, host: _Host, p: TaggedProcess) -> None:
        """Take over a tagged worker found on ``host``: a channel running :func:`watch_script`
        tells when it ends; it is listed, terminated and closed like a worker started here."""
        conn = await self._session_conn(host)
        try:
            proc = await asyncio.wait_for(
                conn.conn.create_process("sh -c " + shlex.quote(watch_script(p.pid, p.worker_id)),
                                         encoding="utf-8", errors="replace"), self.connect_timeout)  # fmt: skip
        except BaseException:
            conn.sessions -= 1
            raise
        w = _SSHWorker(p.worker_id, p.node_type, p.request_id, host, conn, proc, p.pid, adopted=True)
        self._workers[w.worker_id] = w
        with self._loop_lock:
            self._requests.setdefault(p.request_id, []).append(w.worker_id)
            self._names.setdefault(p.request_id, []).append(w.worker_id)
        w.task = asyncio.get_running_loop().create_task(self._watch(w))
        log.info("re-found SSH worker %s (launch %s, pid %d) on %s by tag %s", p.worker_id, p.request_id, p.pid,
                 host.name, self.tag)  # fmt: skip

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that owns the state; binds the private loop thread, started here, when there is
        none yet (call with ``_loop_lock`` held)."""
        if self._loop is None:
            from tidepool.loop import LoopThread

            self._loop_thread = LoopThread("tidepool-ssh")
            self._loop = self._loop_thread.loop
        return self._loop

    def _bind_running(self, *, bind: bool = True) -> bool:
        """For the coroutine methods: check that the running loop owns this provider (binding it
        when no loop does yet and ``bind``).  True when it owns the state, False when nothing is
        bound; raises :class:`ProviderError` for any other loop instead of hanging on it."""
        loop = asyncio.get_running_loop()
        with self._loop_lock:
            if self._loop is None and bind:
                self._loop = loop
            if self._loop is None:
                return False
            if self._loop is not loop:
                raise ProviderError(self._foreign_loop_message())
            return True

    def _foreign_loop_message(self) -> str:
        owner = ("its own loop thread 'tidepool-ssh', started by a synchronous call such as launch() or "
                 "launch_now()" if self._loop_thread is not None else "the event loop that first awaited it")
        return (f"this SSHProvider is bound to another event loop ({owner}); its SSH connections live on "
                "that loop and cannot be used from this one: use the provider only from that loop (or "
                "its synchronous methods from plain threads), or create one SSHProvider per event loop")

    @staticmethod
    def _blocking_problem(loop: asyncio.AbstractEventLoop) -> str | None:
        """Why a blocking call cannot wait on ``loop`` from this thread (None: it can)."""
        if loop.is_closed():
            return ("this SSHProvider's connections belong to an event loop that is closed; close the "
                    "provider (await close_async()) inside that loop before it ends")
        if _running_loop() is loop:
            return ("a blocking SSHProvider call was made inside the event loop that owns it, which "
                    "would deadlock; await the *_async method (e.g. terminate_async) instead")
        if not loop.is_running():
            return ("this SSHProvider is bound to an event loop that is not running; call it inside "
                    "that loop with the *_async methods")
        return None

    def _wait_on(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
                 timeout: float | None) -> T:  # fmt: skip
        """Run ``coro`` on ``loop`` (running in another thread) and wait for its result."""
        lt = self._loop_thread
        if lt is not None and lt.loop is loop:
            return lt.run(coro, timeout)
        problem = self._blocking_problem(loop)
        if problem is not None:
            coro.close()
            raise ProviderError(problem)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            raise ProviderError("this SSHProvider's event loop closed during the call") from None
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop that owns the state (the private loop thread when none does
        yet) and wait for it: the synchronous methods' way in."""
        with self._loop_lock:
            if self._closed:
                coro.close()
                raise ProviderError("this SSHProvider is closed; create a new one")
            loop = self._ensure_loop()
            self._inflight += 1
        try:
            return self._wait_on(loop, coro, timeout)
        finally:
            with self._loop_lock:
                self._inflight -= 1
                self._loop_lock.notify_all()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start a launch as a task of the running (owning) loop, keeping a reference to it."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    @property
    def hosts(self) -> builtins.list[str]:
        return [h.name for h in self._hosts]

    # ---- connections ------------------------------------------------------------------------------
    async def _connect(self, host: _Host) -> _Conn:
        asyncssh = _asyncssh()
        opts: dict[str, Any] = {
            "port": host.port, "known_hosts": self.known_hosts, "connect_timeout": self.connect_timeout,
            "login_timeout": self.connect_timeout, "keepalive_interval": self.keepalive_interval,
            **self.connect_options,
        }  # fmt: skip
        if host.user:
            opts["username"] = host.user
        if self.client_keys is not None:
            opts["client_keys"] = list(self.client_keys)
        try:
            conn = await asyncio.wait_for(asyncssh.connect(host.host, **opts), self.connect_timeout + 2)
        except TimeoutError:
            raise ProviderError(
                f"SSH to {host.name} timed out after {self.connect_timeout:g}s: is the host up and "
                "reachable from here (firewall, address, port)?") from None  # fmt: skip
        except asyncssh.HostKeyNotVerifiable as exc:
            raise ProviderError(_host_key_advice(host.name, host.host, host.port, self.known_hosts, exc)) from exc
        except asyncssh.PermissionDenied as exc:
            raise ProviderError(
                f"SSH to {host.name}: permission denied ({exc}); check the user and that the key in "
                "client_keys is in the host's authorized_keys") from exc  # fmt: skip
        except FileNotFoundError as exc:
            if exc.filename not in (self.client_keys or ()):
                raise ProviderError(f"cannot connect to {host.name}: {exc}") from exc
            raise ProviderError(
                f"SSH to {host.name}: the client key file {exc.filename!r} does not exist on this machine; "
                "client_keys are paths of private keys here (e.g. '~/.ssh/id_ed25519'), or leave it out "
                "to use ~/.ssh/id_* and the SSH agent") from exc  # fmt: skip
        except (OSError, asyncssh.Error) as exc:
            raise ProviderError(
                f"cannot connect to {host.name}: {exc or type(exc).__name__}; is sshd running there "
                f"and is the port right? (try: ssh -p {host.port} {host.host} true)") from exc  # fmt: skip
        c = _Conn(conn)
        host.conns.append(c)
        return c

    async def _session_conn(self, host: _Host) -> _Conn:
        """A connection to ``host`` with a free session slot (opening one if needed)."""
        if host.lock is None:
            host.lock = asyncio.Lock()
        async with host.lock:
            host.conns = [c for c in host.conns if c.usable or c.sessions > 0]
            for c in host.conns:
                if c.usable and c.sessions < self.sessions_per_connection:
                    c.sessions += 1
                    return c
            c = await self._connect(host)
            host.down_until, host.down_reason = 0.0, ""
            c.sessions += 1
            return c

    async def _short(self, host: _Host, command: str, timeout: float) -> Any:
        """Run a short command on ``host`` in a session slot of its own, released after it: any
        open connection could be full of workers' sessions, and sshd refused one more ("open
        failed": terminate and close left workers running; a bug hunt)."""
        c = await self._session_conn(host)
        proc = None
        try:
            async with asyncio.timeout(timeout):
                proc = await c.conn.create_process(command)
                return await proc.wait(check=False)
        finally:  # a command given up is closed: its channel is the slot given back
            if proc is not None:
                proc.close()
            c.sessions -= 1

    def _load(self, host: _Host) -> int:
        return sum(1 for w in self._workers.values() if w.host is host and not w.done.is_set())

    # ---- launch -----------------------------------------------------------------------------------
    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        """The ids the workers of this request register with (``<type>-<request>-<n>``)."""
        with self._loop_lock:
            ids = self._names.get(request_id)
            if ids is None:
                ids = [f"{node_type.name}-{request_id}-{next(self._seq)}"
                       for _ in range(count * node_type.workers_per_node)]  # fmt: skip
                self._names[request_id] = ids
            return list(ids)

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Start ``count`` nodes (``count * workers_per_node`` workers) on the loop that owns the
        provider (its private loop thread when none does yet) and return at once.  When no host can
        be reached or a worker could not be started, the workers of this request already started
        are stopped again and the failure comes back through ``poll_errors``."""
        self.worker_ids(node_type, count, request_id)
        with self._loop_lock:
            if self._closed:
                self._launch_errors.append(ProviderFailure(request_id, None, "this SSHProvider is closed"))
                return
            loop = self._ensure_loop()
            self._starting.add(request_id)
        coro = self._launch_reporting(node_type, count, request_id)
        if _running_loop() is loop:
            self._spawn(coro)
            return
        problem = self._blocking_problem(loop)
        if problem is None:
            try:
                loop.call_soon_threadsafe(self._spawn, coro)
                return
            except RuntimeError:  # closed meanwhile
                problem = "this SSHProvider's event loop is closed"
        coro.close()
        with self._loop_lock:
            self._starting.discard(request_id)
        self._launch_errors.append(ProviderFailure(request_id, None, f"launch {request_id}: {problem}"))

    async def launch_async(self, node_type: NodeType, count: int, request_id: str) -> None:
        """``launch`` for an event loop (:class:`AsyncProvider`): submits the launch as a task of
        the running loop and returns at once; the SSH connections and sessions live in this loop,
        which the provider is bound to from now on (another loop gets a :class:`ProviderError`)."""
        self.worker_ids(node_type, count, request_id)
        with self._loop_lock:
            if self._closed:
                self._launch_errors.append(ProviderFailure(request_id, None, "this SSHProvider is closed"))
                return
        self._bind_running()
        with self._loop_lock:
            self._starting.add(request_id)
        self._spawn(self._launch_reporting(node_type, count, request_id))

    async def terminate_async(self, worker_ids: builtins.list[str]) -> None:
        """``terminate`` awaited in the loop that owns the provider."""
        if not worker_ids or self._closed or not self._bind_running(bind=bool(self._unscanned)):
            return  # nothing was ever started (or re-found), or close() already stopped everything
        await self._terminate(list(worker_ids))

    async def list_async(self) -> dict[str, dict[str, Any]]:
        """``list`` awaited in the loop that owns the provider (a tagged provider looks for its
        workers of an earlier scheduler process first, once: ``tag_with``)."""
        if not self._closed and self._bind_running(bind=bool(self._unscanned)):
            await self._adopt_tagged()
        return self._list_now()

    async def poll_errors_async(self) -> builtins.list[ProviderFailure]:
        """``poll_errors`` awaited in the loop that owns the provider."""
        if not self._closed:
            self._bind_running(bind=False)
        return self._poll_now()

    async def _launch_reporting(self, nt: NodeType, count: int, rid: str) -> None:
        try:
            if self._closed:
                raise ProviderError("this SSHProvider is closed", rid)
            await self._launch(nt, count, rid)
        except ProviderError as exc:
            self._launch_errors.append(ProviderFailure(rid, None, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a failure is reported, never lost on the loop
            self._launch_errors.append(ProviderFailure(rid, None, f"launch {rid} failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._loop_lock:
                self._starting.discard(rid)

    def launch_now(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        """``launch``, blocking until the workers are started; raises :class:`ProviderError` (with
        ``request_id``) instead of reporting through ``poll_errors``.  For scripts and tests."""
        self.worker_ids(node_type, count, request_id)
        budget = (self.connect_timeout + 5) * (len(self._hosts) + 2) * max(1, count) + self.term_timeout
        return self._run(self._launch(node_type, count, request_id), budget)

    async def _launch(self, nt: NodeType, count: int, rid: str) -> builtins.list[str]:
        if rid in self._requests:
            return list(self._requests[rid])
        if rid in self._launching:  # the same request from another thread: wait for that launch
            return list(await asyncio.shield(self._launching[rid]))
        if not self.scheduler or not self.token:
            raise ProviderError(f"SSHProvider cannot launch {rid}: it has no scheduler address/token; "
                                "call bind(address, token) or use cluster.adapt(provider=...)", rid)  # fmt: skip
        fut: asyncio.Future[builtins.list[str]] = asyncio.get_running_loop().create_future()
        self._launching[rid] = fut
        try:
            ids = await self._launch_new(nt, count, rid)
        except BaseException as exc:
            if isinstance(exc, Exception):
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            else:
                fut.cancel()
            raise
        else:
            fut.set_result(ids)
            return ids
        finally:
            del self._launching[rid]

    async def _launch_new(self, nt: NodeType, count: int, rid: str) -> builtins.list[str]:
        started: builtins.list[_SSHWorker] = []
        try:
            names = self.worker_ids(nt, count, rid)
            per = nt.workers_per_node
            for n in range(count):
                host = await self._pick_host(nt, rid)
                ids = names[n * per:(n + 1) * per]
                results = await asyncio.gather(*(self._start(host, nt, rid, w) for w in ids),
                                               return_exceptions=True)  # fmt: skip
                started += [r for r in results if isinstance(r, _SSHWorker)]
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
        except BaseException as exc:
            stopped = True
            if started:
                try:
                    await self._stop(started)
                except Exception as stop_exc:  # noqa: BLE001 - they stay known, and close() stops them
                    stopped = False
                    log.warning("launch %s failed, and its workers that started (%s) could not be stopped "
                                "(%s): they stay listed, and are stopped at close", rid,
                                [w.worker_id for w in started], stop_exc)  # fmt: skip
            for w in started if stopped else ():  # forgotten only once gone: else they ran on unseen
                self._workers.pop(w.worker_id, None)
            if isinstance(exc, ProviderError):
                raise ProviderError(f"launch {rid} of {count} {nt.name!r} node(s) failed: {exc}", rid) from exc
            if isinstance(exc, Exception):
                raise ProviderError(f"launch {rid} of {count} {nt.name!r} node(s) failed: "
                                    f"{type(exc).__name__}: {exc}", rid) from exc  # fmt: skip
            raise
        ids = [w.worker_id for w in started]
        self._requests[rid] = ids
        log.info("launched %s on %s", ids, sorted({w.host.name for w in started}))
        return ids

    async def _pick_host(self, nt: NodeType, rid: str) -> _Host:
        """The least-loaded reachable host (connecting to check), skipping hosts that just failed."""
        now = time.monotonic()
        order = sorted(self._hosts, key=lambda h: (h.down_until > now, self._load(h), h.index))
        errors = []
        for h in order:
            if h.down_until > now and any(x.down_until <= now for x in order):
                continue
            if any(c.usable for c in h.conns):
                return h
            try:
                c = await self._connect(h)
            except ProviderError as exc:
                h.down_until, h.down_reason = time.monotonic() + self.host_retry, str(exc)
                log.warning("SSH host %s unusable for %gs: %s", h.name, self.host_retry, exc)
                errors.append(str(exc))
                continue
            h.down_until, h.down_reason = 0.0, ""
            log.debug("connected to %s (%d connections)", h.name, len(h.conns) if c else 0)
            return h
        raise ProviderError("no SSH host could be reached: " + "; ".join(errors or
                            [f"{h.name}: {h.down_reason}" for h in self._hosts]), rid)  # fmt: skip

    async def _start(self, host: _Host, nt: NodeType, rid: str, wid: str) -> _SSHWorker:
        conn = await self._session_conn(host)
        try:
            cmd = worker_command(contact_address(self.scheduler, self.scheduler_host), wid, nt, self.python,
                                 self.heartbeat_interval, self.extra_args)  # fmt: skip
            if self.tag:  # durable: outlives the connection, found again by its tag (ssh_adopt.py)
                script = durable_script(cmd, self.workdir, EXIT_NO_WORKDIR)
            else:
                script = remote_script(cmd, wid, self.workdir, max(1, int(self.term_timeout * 2)))
            proc = await asyncio.wait_for(
                conn.conn.create_process("sh -c " + shlex.quote(script), encoding="utf-8", errors="replace"),
                self.connect_timeout)  # fmt: skip
        except BaseException as exc:
            conn.sessions -= 1
            if isinstance(exc, TimeoutError):
                raise ProviderError(f"opening an SSH session on {host.name} for {wid} timed out") from None
            if isinstance(exc, Exception) and not isinstance(exc, ProviderError):
                hint = ""
                if type(exc).__name__ == "ChannelOpenError":  # sshd refused one more session
                    hint = (f" (sshd refused a session on a connection carrying {conn.sessions + 1}: lower "
                            "SSHProvider(sessions_per_connection=...) below the host's MaxSessions)")  # fmt: skip
                raise ProviderError(f"cannot start {wid} on {host.name}: {exc}{hint}") from exc
            raise
        env = {**self.env, "TIDEPOOL_TOKEN": self.token, "TIDEPOOL_WORKER_ID": wid}
        if self.tag:
            env[MARKER_VAR] = tag_marker(self.tag, nt.name, rid, wid)
        proc.stdin.write("".join(f"{k}={v}\n" for k, v in env.items()) + "\n")
        line, noise = "", builtins.list[str]()  # a chatty shell start-up file may print before the pid
        try:
            async with asyncio.timeout(self.connect_timeout):
                while not line.startswith(_PID_PREFIX) and len(noise) < 200:
                    line = await proc.stdout.readline()
                    if not line:
                        break
                    if not line.startswith(_PID_PREFIX):
                        noise.append(line.rstrip("\n"))
        except TimeoutError:
            line, noise = "", [*noise, f"(no pid line within connect_timeout={self.connect_timeout:g} s)"]
        if not line.startswith(_PID_PREFIX):
            proc.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait_closed(), 2)
            conn.sessions -= 1
            err = ""
            with contextlib.suppress(Exception):
                err = (await asyncio.wait_for(proc.stderr.read(), 0.5)).strip()[-500:]
            raise ProviderError(f"the shell on {host.name} did not start {wid} (output: {noise[-5:]!r}; "
                                f"stderr: {err!r}); is /bin/sh usable for this user?")  # fmt: skip
        w = _SSHWorker(wid, nt.name, rid, host, conn, proc, int(line[len(_PID_PREFIX):].strip()))
        w.output.extend(noise)
        self._workers[wid] = w
        w.task = asyncio.get_running_loop().create_task(self._watch(w))
        return w

    async def _watch(self, w: _SSHWorker) -> None:
        """Drain the worker's output (keeping the tail) and record how its process ended."""

        async def drain(stream: Any, prefix: str) -> None:
            with contextlib.suppress(Exception):
                async for line in stream:
                    text = line.rstrip("\n")
                    w.output.append(prefix + text)
                    log.debug("[%s] %s", w.worker_id, text)

        drains = asyncio.ensure_future(asyncio.gather(drain(w.proc.stdout, ""), drain(w.proc.stderr, "")))
        try:
            while not (await asyncio.wait([drains], timeout=EXIT_POLL))[0]:
                if _exit_status(w.proc) is not None and not w.adopted:
                    # the worker ended, but something holds its output open (a process a task
                    # started in the background): its group goes too, and the channel closes
                    await self._end_group(w, drains)
                    break
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.proc.wait_closed(), 30.0)
        finally:
            drains.cancel()
            rc = w.proc.returncode if w.proc.returncode is not None else _exit_status(w.proc)
            w.lost = rc is None
            w.returncode = None if w.adopted else rc  # an adopted worker is not the channel's process
            w.reported = w.reported or (w.adopted and not w.lost)  # how it ended is not known: nothing to report
            w.ended = time.time()
            w.conn.sessions -= 1
            w.done.set()

    async def _end_group(self, w: _SSHWorker, drains: asyncio.Future[Any]) -> None:
        """The worker's process is gone but its output is held open: end what is left of its
        process group on the host (its tasks' background processes), then close the channel."""
        with contextlib.suppress(Exception):
            await asyncio.wait([drains], timeout=EXIT_POLL)
            if drains.done():  # the output closed after all: nothing holds it, nothing to end
                return
            script = (f"kill -s TERM -- -{w.pid} 2>/dev/null; n=0; while [ $n -lt 20 ] && kill -0 -- -{w.pid} "
                      f"2>/dev/null; do {_SLEEP}; n=$((n+1)); done; kill -s KILL -- -{w.pid} 2>/dev/null; exit 0")  # fmt: skip
            await self._short(w.host, script, self.connect_timeout + 10)
        with contextlib.suppress(Exception):
            w.proc.close()

    # ---- terminate --------------------------------------------------------------------------------
    def terminate(self, worker_ids: builtins.list[str]) -> None:
        """Stop these workers for sure (TERM, then KILL after ``term_timeout``); unknown ids: no-op.

        Raises :class:`ProviderError` naming the workers it could not confirm stopped (host down).
        """
        if not worker_ids or self._closed or (self._loop is None and not self._unscanned):
            return  # nothing was ever started (or re-found), or close() already stopped everything
        self._run(self._terminate(list(worker_ids)),
                  self.term_timeout + 2 * self.connect_timeout + 15 + self._scan_budget())  # fmt: skip

    async def _terminate(self, ids: builtins.list[str]) -> None:
        await self._adopt_tagged()  # the ids may name workers of an earlier scheduler process
        ws = [self._workers[w] for w in ids if w in self._workers]
        await self._stop(ws)

    async def _stop(self, ws: builtins.list[_SSHWorker]) -> None:
        for w in ws:
            w.stopping = True
        # still running, or the connection was lost so we do not know: kill by pid on the host
        todo = [w for w in ws if not w.done.is_set() or w.lost]
        by_host: dict[int, builtins.list[_SSHWorker]] = {}
        for w in todo:
            by_host.setdefault(w.host.index, []).append(w)
        results = await asyncio.gather(*(self._kill_on(self._hosts[i], group) for i, group in by_host.items()),
                                       return_exceptions=True)  # fmt: skip
        problems = [str(r) for r in results if isinstance(r, BaseException)]
        if problems:
            raise ProviderError("; ".join(problems))

    async def _kill_on(self, host: _Host, ws: builtins.list[_SSHWorker]) -> None:
        ids = [w.worker_id for w in ws]
        try:
            res = await self._short(host, kill_script([(w.pid, w.worker_id) for w in ws], self.term_timeout),
                                    self.term_timeout + self.connect_timeout + 5)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported with what to do
            pids = " ".join(str(w.pid) for w in ws)
            after = ("durable (tag_with) workers exit past their reconnect window" if self.tag else
                     "their watchdog stops them when the SSH connection closes")  # fmt: skip
            raise ProviderError(
                f"could not confirm that workers {ids} on {host.name} stopped ({exc}); {after}, or run: "
                f"ssh {host.host} kill {pids}") from exc  # fmt: skip
        survivors = [line.split()[1] for line in str(res.stdout or "").splitlines() if line.startswith("survivor ")]
        if survivors:
            raise ProviderError(f"workers {ids} on {host.name}: pids {survivors} survived SIGKILL")
        # the processes are gone; give their channels a moment to report the exit
        live = [w for w in ws if not w.done.is_set()]
        if live:
            await asyncio.wait([asyncio.ensure_future(w.done.wait()) for w in live], timeout=5)
        for w in ws:
            w.lost = False  # confirmed gone on the host

    # ---- observation ------------------------------------------------------------------------------
    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        """Worker id -> {node_type, request_id, host, pid, alive, returncode, started}."""
        loop = self._loop
        running = _running_loop()
        if self._unscanned and not self._closed and not (loop is not None and loop.is_closed()):
            if loop is None or running is not loop:  # look for the tagged workers first (tag_with)
                return self._run(self._list_adopting(), self._scan_budget() + 10)
            self._spawn(self._adopt_tagged())  # inside the owning loop: cannot wait; the next list shows them
        if loop is None or self._closed or loop.is_closed() or running is loop:
            return self._list_now()  # nothing can change under us (no loop runs it), or on that loop
        return self._run(self._async(self._list_now), 10)

    async def _async(self, fn: Any) -> Any:
        return fn()

    async def _list_adopting(self) -> dict[str, dict[str, Any]]:
        await self._adopt_tagged()
        return self._list_now()

    def _scan_budget(self) -> float:
        """How long looking for the tagged workers may take (0 once it is done)."""
        return 2 * self.connect_timeout + 15 if self._unscanned else 0.0

    def _list_now(self) -> dict[str, dict[str, Any]]:
        out = {w.worker_id: {"node_type": w.node_type, "request_id": w.request_id, "host": w.host.name,
                             "pid": w.pid, "alive": not w.done.is_set(), "returncode": w.returncode,
                             "started": w.started, "stopping": w.stopping, "adopted": w.adopted}
               for w in self._workers.values()}  # fmt: skip
        with self._loop_lock:
            for rid in self._starting:  # sessions still opening: listed, so not reconciled away
                for wid in self._names.get(rid, ()):
                    out.setdefault(wid, {"request_id": rid, "alive": True, "state": "starting"})
        return out

    def host_status(self) -> dict[str, dict[str, Any]]:
        """Host -> {workers, connections, down_for, reason}: which hosts are skipped and why."""
        now = time.monotonic()
        return {h.name: {"workers": self._load(h), "connections": sum(c.usable for c in h.conns),
                         "down_for": max(0.0, h.down_until - now), "reason": h.down_reason}
                for h in self._hosts}  # fmt: skip

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        """Workers that exited with an error or lost their connection since the last call (each once)."""
        loop = self._loop
        if loop is None or self._closed or loop.is_closed() or _running_loop() is loop:
            return self._poll_now()
        return self._run(self._async(self._poll_now), 10)  # type: ignore[no-any-return]

    def _poll_now(self) -> builtins.list[ProviderFailure]:
        out, self._launch_errors = self._launch_errors, []
        seen_requests: set[str] = set()
        now = time.time()
        for wid, w in list(self._workers.items()):
            if not w.done.is_set():
                continue
            if not w.reported and not w.stopping and w.returncode != 0:
                w.reported = True
                if w.request_id in seen_requests:
                    continue  # one report per request per poll: the controller backs off once
                seen_requests.add(w.request_id)
                out.append(ProviderFailure(w.request_id, wid, self._describe_exit(w)))
            if w.ended is not None and now - w.ended > 600:
                del self._workers[wid]
        return out

    def _describe_exit(self, w: _SSHWorker) -> str:
        tail = " | ".join(list(w.output)[-6:])
        where = f"worker {w.worker_id} on {w.host.name} (pid {w.pid})"
        if w.lost:
            fate = ("it keeps running on the host and exits past its reconnect window if no scheduler "
                    "takes it" if self.tag else "the worker's watchdog stops it on the host")  # fmt: skip
            return f"{where}: lost the SSH connection; {fate}. Last output: {tail or '(none)'}"
        rc = w.returncode
        hint = ""
        if rc == 127:
            hint = f" (command not found: set python= to the interpreter on the host; now {self.python!r})"
        elif rc == EXIT_NO_WORKDIR:
            hint = f" (workdir {self.workdir!r} does not exist on the host)"
        elif "No module named" in tail:
            hint = " (install tidepool for that interpreter on the host, or set python=)"
        how = f"was killed by signal {-rc}" if rc is not None and rc < 0 else f"exited with code {rc}"
        return f"{where} {how}{hint}. Last output: {tail or '(none)'}"

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker this provider started and close its connections, on the loop that owns
        them (and stop the private loop thread if it has one).  Inside that loop it cannot wait, so
        it schedules the shutdown there: ``await close_async()`` instead to wait for it."""
        with self._loop_lock:
            if self._closed:
                return
            self._closed = True
            if self._loop is None and self._unscanned:  # tagged: stop the workers it re-finds too
                running = _running_loop()
                if running is not None:
                    self._loop = running
                else:
                    self._ensure_loop()
            loop, lt = self._loop, self._loop_thread
        if loop is None:
            return
        if lt is None and _running_loop() is loop:
            log.warning("SSHProvider.close() called inside the event loop that owns it: closing in the "
                        "background; await provider.close_async() there to wait for it")  # fmt: skip
            self._closing = loop.create_task(self._close())
            self._closing.add_done_callback(_log_close_failure)
            return
        problem = None if lt is not None else self._blocking_problem(loop)
        if problem is not None:  # the owning loop is gone: no coroutine can run on it any more
            cut = self._cut_connections()
            fate = ("the tagged workers keep running until their reconnect window ends" if self.tag
                    else "so the workers' watchdogs stop them")  # fmt: skip
            log.warning("SSHProvider.close: %s; shut its %d SSH connection(s) down instead; %s", problem, cut,
                        fate)  # fmt: skip
            return
        try:
            self._wait_on(loop, self._close(), self._close_budget())
        except Exception as exc:  # noqa: BLE001 - close must not raise into cleanup paths
            log.warning("SSHProvider.close: %s", exc)
        finally:
            if lt is not None:
                with self._loop_lock:  # calls already on the loop (e.g. a terminate) finish first
                    self._loop_lock.wait_for(lambda: self._inflight == 0, timeout=self.term_timeout + 10)
                lt.stop()

    async def close_async(self) -> None:
        """``close`` for an event loop: in the loop that owns the connections it is awaited right
        there (no thread); from any other loop the owner closes them while this loop waits."""
        loop = asyncio.get_running_loop()
        with self._loop_lock:
            if self._loop is None and self._unscanned and not self._closed:
                self._loop = loop  # tagged: stop the workers it re-finds too
            owner, closing, already = self._loop, self._closing, self._closed
            if owner is None or owner is loop:
                self._closed = True
        if already:
            if closing is not None and owner is loop:
                await asyncio.wait([closing])  # close() was called in this loop: wait for it
            return
        if owner is None:
            return
        if owner is not loop:
            await asyncio.to_thread(self.close)
            return
        try:
            await asyncio.wait_for(self._close(), self._close_budget())
        except Exception as exc:  # noqa: BLE001 - close must not raise into cleanup paths
            log.warning("SSHProvider.close_async: %s", exc)

    def _cut_connections(self) -> int:
        """The last resort when the owning loop ended before ``close``: shut the TCP connections
        down (a socket call, no loop needed), so sshd closes the channels and every worker's
        watchdog stops it.  Returns how many connections it shut down."""
        n = 0
        for h in self._hosts:
            for c in h.conns:
                with contextlib.suppress(Exception):
                    sock = c.conn.get_extra_info("socket")
                    if sock is not None:
                        sock.shutdown(socket.SHUT_RDWR)
                        n += 1
        return n

    def _close_budget(self) -> float:
        return 2 * self.term_timeout + 3 * self.connect_timeout + 25 + self._scan_budget()

    async def _close(self) -> None:
        launches = [t for t in self._tasks if not t.done()]
        for t in launches:  # a launch still opening sessions: it stops what it started
            t.cancel()
        if launches:
            await asyncio.wait(launches, timeout=self.term_timeout + self.connect_timeout + 5)
        with self._loop_lock:
            self._starting.clear()
        try:
            try:
                await asyncio.wait_for(self._adopt_tagged(), self._scan_budget() + 1)
            except Exception as exc:  # noqa: BLE001 - what was found is stopped below all the same
                log.warning("SSHProvider.close: looking for the tagged workers failed: %s", exc)
            await self._stop(list(self._workers.values()))
        finally:
            for h in self._hosts:
                for c in h.conns:
                    c.conn.close()
                for c in h.conns:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(c.conn.wait_closed(), 5)
                h.conns.clear()
            tasks = [w.task for w in self._workers.values() if w.task is not None and not w.task.done()]
            if tasks:
                await asyncio.wait(tasks, timeout=5)
                for t in tasks:
                    t.cancel()

    def __repr__(self) -> str:
        return f"<SSHProvider hosts={self.hosts} workers={sum(not w.done.is_set() for w in self._workers.values())}>"
