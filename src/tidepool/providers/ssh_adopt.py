"""SSH workers that outlive their scheduler: the durable launch script and re-finding them by tag.

State: none; pure functions returning shell text, and a parser of ``ps`` output.  Used by
:class:`~tidepool.providers.ssh.SSHProvider` once a durable scheduler tags it (``tag_with``).

Data flow: a tagged provider starts each worker with :func:`durable_script` instead of the
watchdog script: the worker runs in the background with its output relayed to the SSH channel, so
when the channel closes (the scheduler process was killed) the worker keeps running and relies on
its own reconnect window; past it, it exits, and the shell around it with it.  Its command line
carries ``--env TIDEPOOL_PROVIDER_TAG=TAG:NODE_TYPE:REQUEST:WORKER`` (:func:`tag_marker`; the
worker just sets that variable).  The provider of a restarted scheduler runs :data:`SCAN_COMMAND`
on each host, keeps the lines :func:`parse_tagged_processes` finds for its tag, watches each such
pid with :func:`watch_script` (a channel that ends when the process does), and lists, terminates
and closes them like its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

MARKER_VAR = "TIDEPOOL_PROVIDER_TAG"
PID_PREFIX = "tidepool-pid "
# this user's processes on the host with their whole command lines (procps needs -ww not to cut them
# at 80 columns); a ps without these options lists every process
SCAN_COMMAND = 'ps -ww -o pid=,args= -u "$(id -u)" 2>/dev/null || ps -eo pid,args'

# Shell helper: is process $1 still the worker whose id is $2?  On Linux the id must be one argument
# of /proc/$1/cmdline (so a pid recycled by another process is never signalled); elsewhere kill -0.
ALIVE_FN = (
    'tp_alive() { if [ -d /proc/self ]; then tr "\\000" "\\n" < "/proc/$1/cmdline" 2>/dev/null '
    '| grep -qxF -- "$2"; else kill -0 "$1" 2>/dev/null; fi; }'
)

_READ_ENV = 'while IFS= read -r tp_kv && [ -n "$tp_kv" ]; do export "$tp_kv"; done'


@dataclass(frozen=True)
class TaggedProcess:
    """A worker process found on a host by its tag."""

    pid: int
    node_type: str
    request_id: str
    worker_id: str


def tag_marker(tag: str, node_type: str, request_id: str, worker_id: str) -> str:
    """``TAG:NODE_TYPE:REQUEST:WORKER``, each field but the tag percent-encoded (no ':' or spaces)."""
    return ":".join([tag, *(quote(x, safe="-_.") for x in (node_type, request_id, worker_id))])


def parse_tagged_processes(text: str, tag: str) -> list[TaggedProcess]:
    """The tidepool worker processes carrying ``tag`` in ``ps -eo pid,args`` output, one per
    worker id (the first line wins).  Lines of other tags, of processes that are not tidepool
    workers (a shell whose script merely mentions the variable, say) and malformed ones are skipped."""
    prefix = f"{MARKER_VAR}={tag}:"
    out: dict[str, TaggedProcess] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit() or "tidepool.worker" not in parts[1:]:
            continue
        for token in parts[1:]:
            if not token.startswith(prefix):
                continue
            fields = token[len(prefix):].split(":")
            if len(fields) == 3 and all(fields):
                nt, rid, wid = (unquote(f) for f in fields)
                out.setdefault(wid, TaggedProcess(int(parts[0]), nt, rid, wid))
            break
    return list(out.values())


def durable_script(command: Sequence[str], workdir: str | None, no_workdir_code: int) -> str:
    """The ``sh`` script that runs one worker of a tagged provider (env, with ``MARKER_VAR``,
    comes on stdin like the watchdog script's).

    The worker runs in the background with stdin from /dev/null and its output (stdout and stderr)
    piped through a relay that ignores SIGPIPE and drains on once the channel is gone, so closing
    the channel (or the connection) never stops or blocks it.  Prints ``tidepool-pid PID`` (the
    worker's pid), waits for the worker and exits with its status, so a live channel still
    reports how the worker ended."""
    lines = [_READ_ENV]
    if workdir:
        d = shlex.quote(workdir)
        lines.append(f'cd {d} || {{ echo "tidepool: cannot cd to {workdir} on $(hostname)" >&2; '
                     f"exit {no_workdir_code}; }}")  # fmt: skip
    cmd = " ".join(shlex.quote(a) for a in command) + f' --env "{MARKER_VAR}=${MARKER_VAR}"'
    lines += [
        "exec 4>&1",
        # fd 3: the worker's status out of the pipeline; fd 4: the channel's stdout
        f"tp_rc=$( {{ {{ {cmd} </dev/null 2>&1 3>&- 4>&- &",
        f'  echo "{PID_PREFIX}$!" >&4; wait $!; echo $? >&3; }}'
        " | ( trap '' PIPE; cat; exec cat >/dev/null ) >&4 3>&-; } 3>&1 )",
        'exit "${tp_rc:-1}"',
    ]
    return "\n".join(lines)


def watch_script(pid: int, worker_id: str, interval: float = 1.0) -> str:
    """A script that returns when process ``pid`` is no longer the worker ``worker_id``: the
    channel that tells a provider when an adopted worker (not its channel's child) ended."""
    return "\n".join([
        ALIVE_FN,
        f"while tp_alive {int(pid)} {shlex.quote(worker_id)}; do sleep {interval:g} 2>/dev/null || sleep 1; done",
        "exit 0",
    ])  # fmt: skip
