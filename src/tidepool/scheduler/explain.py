"""Why a task is not done yet, in words: read-only over :class:`SchedulerState`.

Also the scheduler's read-only questions about the graph that end in a task failing or being
cancelled: which no-worker tasks waited too long (and the message that says what to do), and
what lies downstream of cancelled tasks.

The client asks (``why`` request) when ``future.result(timeout=)`` or ``gather(timeout=)`` times
out, so the ``TimeoutError`` says which key, its state, and the reason when the scheduler knows it
(no worker offers the resources it asks for, inputs still missing, waiting for a free slot).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tidepool.resources import Shape, fits
from tidepool.scheduler import events as ev
from tidepool.scheduler.kinds import ACTIVE
from tidepool.scheduler.kinds import ReportKind as RK
from tidepool.scheduler.kinds import TaskState as TS

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord, WorkerRecord


def explain(state: Any, key: str) -> dict[str, str]:
    """``{"state": ..., "why": ...}`` for ``key`` (state ``"unknown"`` when the scheduler has no
    record of it)."""
    ts = state.tasks.get(key)
    if ts is None:
        return {"state": "unknown", "why": "the scheduler does not know it (released, or never sent)"}
    st = str(ts.state)
    workers = [w for w in state.workers.values() if str(w.state) == "running"]
    if st == TS.WAITING:
        missing = sorted(d.key for d in ts.waiting_on)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        why = f"waiting for {len(missing)} input(s): {', '.join(map(repr, missing[:3]))}{more}"
    elif st == TS.NO_WORKER:
        shape = dict(ts.shape)
        lacking = sorted({k for k, v in shape.items()
                          if not any(w.resources.get(k, 0) >= v for w in workers)})  # fmt: skip
        offered = sorted({f"{k}={v:g}" for w in workers for k, v in w.resources.items()})
        if ts.restrict is not None and not ts.loose:
            why = f"it may run only on workers {sorted(ts.restrict)}, and none of them that fits {shape} is here"
        elif lacking:
            some = [k for k in lacking if any(w.resources.get(k, 0) > 0 for w in workers)]
            enough = " enough" if some and len(some) == len(lacking) else ""  # some, but too little
            why = (f"no worker offers{enough} {' or '.join(map(repr, lacking))} (it asks for {shape}; "
                   f"{_offered(len(workers), offered)})")  # fmt: skip
        else:
            why = f"no single worker offers all of {shape} at once ({_offered(len(workers), offered)})"
    elif st == TS.READY:
        free = [w for w in workers if fits(w.resources, ts.shape)]
        why = (f"ready, waiting for a free slot on one of {len(free)} workers that fit it"
               if free else "ready, but no running worker fits it yet")  # fmt: skip
    elif st == TS.RUNNING:
        doing = "executing" if ts.executing else "queued"
        why = f"{doing} on worker {ts.worker}"
    elif st == TS.MEMORY:
        why = f"done; its value is on {', '.join(sorted(ts.who_has)) or 'no worker'}"
    elif st == TS.ERRED:
        why = f"failed: {ts.exc_type}: {ts.message}"
    else:
        why = "not needed by any client now"
    return {"state": st, "why": why}


def _offered(n: int, offered: list[str]) -> str:
    """``n`` workers connected now and what they offer, said plainly (also for none)."""
    if n == 0:
        return "no worker is connected"
    return f"{n} worker{'s' if n != 1 else ''} connected, offering {', '.join(offered) or 'nothing'}"


def downstream(roots: Iterable[TaskRecord]) -> list[TaskRecord]:
    """``roots`` and every unfinished task computed from them, in priority order."""
    seen = set(roots)
    stack = list(seen)
    while stack:
        ts = stack.pop()
        for dt in ts.dependents:
            if dt not in seen and dt.state in ACTIVE:
                seen.add(dt)
                stack.append(dt)
    return sorted(seen, key=lambda t: t.priority)


def late_no_worker(no_worker: Mapping[Shape, set[TaskRecord]], workers: Mapping[str, WorkerRecord], now: float,
                   timeout: float) -> list[tuple[TaskRecord, str]]:  # fmt: skip
    """No-worker tasks that waited longer than ``timeout`` for a worker (no autoscaler to ask),
    each with the message it fails with."""
    out: list[tuple[TaskRecord, str]] = []
    for shape, tasks in no_worker.items():
        for ts in sorted((t for t in tasks if now - t.no_worker_since > timeout), key=lambda t: t.priority):
            if ts.restrict is not None:
                names = sorted(w.name for w in workers.values())
                out.append((ts, (
                    f"task {ts.key!r} may run only on workers {sorted(ts.restrict)} (workers=...), and "
                    f"none of them that fits {dict(shape)} has been here for {timeout:g}s (connected: "
                    f"{', '.join(names) or 'none'}); start that worker, name others in workers=, pass "
                    "allow_other_workers=True, or raise no_worker_timeout")))  # fmt: skip
                continue
            have = sorted({f"{k}={v:g}" for w in workers.values() for k, v in w.resources.items()})
            out.append((ts, (
                f"task {ts.key!r} needs {dict(shape)} and no worker has offered that for "
                f"{timeout:g}s ({_offered(len(workers), have)}); "
                "no autoscaler can launch one. Start a worker with these resources "
                "(tidepool worker --resources ...), use adapt() with a node type that has them, "
                "or raise no_worker_timeout")))  # fmt: skip
    return out


def setup_failed(ts: TaskRecord, reason: str) -> str:
    return (f"task {ts.key!r} cannot run: every worker left because a setup hook failed there ({reason}). Fix "
            "the setup and register it again under its name (or drop it: client.unregister_setup(name)), "
            "then add workers")  # fmt: skip


def killed_workers(ts: TaskRecord, last: str, reason: str) -> str:
    return (f"task {ts.key!r} was executing on {ts.suspicious} worker{'s' if ts.suspicious != 1 else ''} that died (last: {last}, {reason}); "
            "it is not retried again. Check it for crashes or memory blow-ups, or raise allowed_failures")  # fmt: skip


def lost_to_memory(ts: TaskRecord, last: str, reason: str) -> str:
    return (f"the value of task {ts.key!r} was lost {ts.memory_losses} time{'s' if ts.memory_losses != 1 else ''} with a worker that restarted over its "
            f"memory limit (last: {last}, {reason}); it is not recomputed again. The values held do not fit in the "
            "workers' memory: release futures you no longer need, raise memory_limit, or let workers spill to "
            "disk (docs/memory.md)")  # fmt: skip


def transfer_failed(ts: TaskRecord, dep: TaskRecord, holder: str, error: str) -> str:
    return (f"task {ts.key!r} could not get its input {dep.key!r}: its only copy could not be fetched "
            f"{dep.fetch_failures} times in a row (last from {holder}: {error or 'unknown error'}); "
            "check that workers can reach each other's data ports")  # fmt: skip


def collision(key: str, why: str) -> str:
    return (f"key {key!r} is already used by another task that is still alive ({why}); give this task "
            "another key, or release every future of the first one before reusing its key")  # fmt: skip


def infeasible(ts: TaskRecord, verdict: str | tuple[str, str] | None) -> tuple[str, str] | None:
    """(error type, message) for ``ts`` from the autoscaler's feasibility ``verdict``, or None."""
    if not verdict:
        return None
    if isinstance(verdict, tuple):
        return verdict[0], f"task {ts.key!r} can never run: {verdict[1]}"
    return "InfeasibleTaskError", f"task {ts.key!r} can never run: {verdict}"


def cancel_roots(tasks: Mapping[str, TaskRecord], client: str, keys: Iterable[str],
                 unless_started: bool) -> tuple[list[TaskRecord], list[ev.Report]]:  # fmt: skip
    """The tasks ``client`` cancels of ``keys``, and the reports for keys it has nothing to stop
    (``cancelled``) or, with ``unless_started``, that are executing (``running``); finished keys
    are kept quietly when ``unless_started``."""
    roots: list[TaskRecord] = []
    reports: list[ev.Report] = []
    for k in keys:
        ts = tasks.get(k)
        if ts is None or client not in ts.wanted_by:
            reports.append(ev.Report(client, k, RK.CANCELLED))  # nothing of ours to stop
            continue
        if unless_started:
            if ts.state in ("memory", "erred"):
                continue
            if ts.state == "running" and ts.executing:
                reports.append(ev.Report(client, k, RK.RUNNING))
                continue
        roots.append(ts)
    return roots, reports


def silent(seconds: float, timeout: float) -> str:
    return (f"no heartbeat for {seconds:.1f}s (time-to-live {timeout:g}s; raise heartbeat_timeout if tasks "
            "block workers longer)")  # fmt: skip
