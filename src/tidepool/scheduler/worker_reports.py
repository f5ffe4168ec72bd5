"""A worker's ``task-batch`` as the scheduler's events: the one translation, used by the scheduler's
shell (``scheduler/server.py``) and by the simulator's worker processes (``sim/process.py``) alike.

Stateless.  Data flow: worker state ``Report`` commands -> :class:`~tidepool.comm.messages.TaskBatch`
(worker outbox, or the simulated process) -> :func:`batch_events` -> ``SchedulerState.handle_many``.
The order is fixed: ``started`` first (a task that started and finished in one batch is seen in that
order), then finished, erred, missing, replicas, the steal reply, seceded, unservable and the ended
runs nobody wanted.
"""

from __future__ import annotations

from tidepool.comm.messages import TaskBatch
from tidepool.scheduler import events as ev


def batch_events(wid: str, batch: TaskBatch, now: float) -> list[ev.Event]:
    out: list[ev.Event] = []
    if batch.started:
        out.append(ev.TasksStarted(wid, list(batch.started), now))
    for key, nbytes, duration, *rest in batch.finished:  # [inline pickle or None, serial] (comm/inline.py)
        out.append(ev.TaskFinished(wid, key, int(nbytes), float(duration), now, int(rest[1] or 0) if len(rest) > 1 else 0))
    for e in batch.erred:
        out.append(ev.TaskErred(wid, e["key"], e.get("exception"), e.get("traceback", ""),
                                e.get("type", ""), e.get("message", ""), float(e.get("duration", 0)), now,
                                int(e.get("run") or 0)))  # fmt: skip
    for item in batch.missing:
        key, dep, holder = item[0], item[1], item[2]
        out.append(ev.MissingData(wid, key, dep, holder, now, str(item[3]) if len(item) > 3 else "",
                                  silent=bool(item[4]) if len(item) > 4 else False))  # fmt: skip
    for key, nbytes in batch.replicas:
        out.append(ev.AddReplica(wid, key, int(nbytes), now))
    if batch.steal_reply:
        out.append(ev.StealReply(wid, list(batch.stolen), list(batch.kept), now))
    for key in batch.seceded:
        out.append(ev.TaskSeceded(wid, str(key), now))
    for key, typ, message in batch.unservable:
        out.append(ev.ValueUnservable(wid, str(key), str(typ), str(message), now))
    if batch.ended:
        out.append(ev.AbandonedRunsEnded(wid, [str(k) for k in batch.ended], now))
    return out
