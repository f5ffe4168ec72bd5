"""Why a task is not done yet, in words: read-only over :class:`SchedulerState`.

The client asks (``why`` request) when ``future.result(timeout=)`` or ``gather(timeout=)`` times
out, so the ``TimeoutError`` says which key, its state, and the reason when the scheduler knows it
(no worker offers the resources it asks for, inputs still missing, waiting for a free slot).
"""

from __future__ import annotations

from typing import Any

from tidepool.resources import fits
from tidepool.scheduler.kinds import TaskState as TS


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
            why = (f"no worker offers {' or '.join(map(repr, lacking))} (it asks for {shape}; "
                   f"{len(workers)} workers offer {', '.join(offered) or 'nothing'})")  # fmt: skip
        else:
            why = (f"no single worker offers all of {shape} at once ({len(workers)} workers offer "
                   f"{', '.join(offered) or 'nothing'})")  # fmt: skip
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
