"""What the scheduler asks of a worker besides tasks: setup hooks, ``client.run``, restarts; and
the metrics a worker reports.

No state of their own: each function gets what it needs from the worker shell
(``worker/server.py``) and answers over the scheduler connection.  Setup hooks run in a thread,
in the order they came; a failing hook is reported (the scheduler closes the worker) and the
rest are not run.  ``client.run`` calls a function here, in a thread (coroutine functions in the
loop), and sends back its value or its exception with the traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from tidepool.comm import Connection, Serialized, serialize
from tidepool.errors import CommError
from tidepool.loop import in_daemon_thread_future
from tidepool.setup import run_setup
from tidepool.worker.memory import MemoryMonitor
from tidepool.worker.spill import SpillStore
from tidepool.worker.state import WorkerState

log = logging.getLogger("tidepool.worker")


def preload(modules: list[str]) -> None:
    """Import ``--preload`` modules before the worker registers."""
    import importlib

    from tidepool.errors import WorkerSetupError

    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            raise WorkerSetupError(f"preloading module {mod!r} failed: {type(exc).__name__}: {exc}") from exc


#: seconds between looks at the scheduler connection while a setup hook runs
SETUP_WATCH = 0.2


class SetupRuns:
    """A worker's record of its setup hooks: name -> digest of each one that ran to its end
    (a rejoining worker tells the scheduler, which sends it the ones it lacks), and the hook
    still running in its thread when the scheduler connection was lost (waited for before the
    next one starts, so no hook runs twice at once)."""

    def __init__(self) -> None:
        self.ran: dict[str, str] = {}
        self.running: asyncio.Future[Any] | None = None


def _record_run(runs: SetupRuns, name: str, digest: str, fut: asyncio.Future[Any]) -> None:
    """A setup's run ended: recorded if it ended well, also when it was cut off by a lost
    scheduler and nobody awaits it any more (its error is read here: never left unretrieved)."""
    if not fut.cancelled() and fut.exception() is None:
        runs.ran[name] = digest


async def apply_setups(conn: Connection, items: list[list[Any]], setup_dir: Path, initial: bool,
                       runs: SetupRuns | None = None) -> bool:  # fmt: skip
    """Run setup hooks ``[[name, blob], ...]``; False when one failed (it was reported).  The
    scheduler connection is watched meanwhile (nothing reads it while a hook runs): if it closes,
    ``CommError`` is raised, so the worker reconnects or exits as on any lost scheduler instead of
    waiting for the hook (a worker whose scheduler died during a long setup stayed, an orphan).
    The hooks not run then are sent again when it rejoins (``runs``)."""
    from tidepool.setup import setup_digest

    runs = runs if runs is not None else SetupRuns()
    done = []
    for name, blob in items:
        try:
            digest = setup_digest(blob)
            if runs.running is not None:  # one cut off by a lost scheduler: let it end first
                await asyncio.wait([runs.running])
                runs.running = None
            if runs.ran.get(name) == digest:  # that one, and it ended well meanwhile: not again
                done.append(name)
                continue
            spec = blob.load()
            # a daemon thread: a hook that never returns cannot keep the process from exiting
            running = runs.running = in_daemon_thread_future(run_setup, spec, setup_dir)
            running.add_done_callback(functools.partial(_record_run, runs, name, digest))
            while not (await asyncio.wait([running], timeout=SETUP_WATCH))[0]:
                if conn.closed:
                    raise CommError(f"the connection to the scheduler closed while setup {name!r} ran")
            runs.running = None
            running.result()
        except CommError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - report any setup failure, then wait to be closed
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            log.error("setup %s failed: %s", name, exc)
            await conn.send({"op": "setup-failed", "name": name, "error": str(exc),
                             "traceback": tb, "initial": initial})  # fmt: skip
            return False
        done.append(name)
    await conn.send({"op": "setup-done", "names": done, "initial": initial})
    return True


async def run_function(conn: Connection, msg: dict[str, Any]) -> None:
    """``client.run``: call a function here (in a thread; coroutine functions in the loop)."""
    reply: dict[str, Any] = {"op": "run-result", "rid": msg["rid"]}
    try:
        fn = msg["function"].load()
        args, kwargs = msg["args"].load() if msg.get("args") is not None else ((), {})
        if inspect.iscoroutinefunction(fn):
            value = await fn(*args, **kwargs)
        else:
            value = await asyncio.to_thread(fn, *args, **kwargs)
        reply.update(ok=True, value=serialize(value))
    except Exception as exc:  # noqa: BLE001 - the caller gets the exception and traceback
        reply.update(ok=False, error=f"{type(exc).__name__}: {exc}", exception=_blob(exc),
                     traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))  # fmt: skip
    with contextlib.suppress(CommError):
        await conn.send(reply)


def _blob(exc: BaseException) -> Serialized | None:
    try:
        return serialize(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text only
        return None


def error_report(exc: BaseException, tb: str, duration: float = 0.0) -> dict[str, Any]:
    """The ``erred`` entry of a task that raised ``exc`` (its key is added by the state); never
    raises (it runs in the worker loop, with the other outcomes of that wake-up waiting on it)."""
    try:
        message = str(exc)[:10_000]
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still fails its task
        message = f"<{type(exc).__name__}: str() failed>"
    return {"exception": _blob(exc), "traceback": tb, "type": type(exc).__name__,
            "message": message, "duration": duration}  # fmt: skip


def reexec(worker_id: str) -> None:
    """Replace this process with a fresh one, same command line (``client.restart``)."""
    log.info("worker %s restarting: %s", worker_id, sys.orig_argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def metrics(store: Mapping[str, Any], state: WorkerState, monitor: MemoryMonitor | None,
            proc: psutil.Process) -> dict[str, Any]:  # fmt: skip
    """What a heartbeat carries: memory (resident, held, spilled), load, pause."""
    if monitor is not None:
        rss = monitor.sample()
    else:
        try:
            rss = int(proc.memory_info().rss)
        except psutil.Error:
            rss = 0
    spill = store if isinstance(store, SpillStore) else None
    return {"rss": rss, "keys": len(store), "bytes": state.memory_bytes + state.spilled_bytes,
            "spilled": spill.spilled_bytes if spill else 0, "spilled_total": spill.spilled_total if spill else 0,
            "spill_disabled": spill.disabled if spill else "",
            "peak_rss": monitor.peak() if monitor is not None else rss, "memory_limit": state.limit,
            "paused": state.paused, "running": len(state.running), "queued": len(state.queue) + len(state.lined), "time": time.time()}  # fmt: skip
