"""Graceful retirement: move a worker's unique data to survivors, then close it.

A retiring worker takes no new tasks and finishes the ones it runs.  Every value that only it
holds and that somebody still needs is copied (``Replicate``) to the survivor with the fewest held
bytes that has memory room; once nothing unique is left and nothing runs, the worker is closed and
removed gracefully (no recomputation, no failure counted).  If no survivor can take the data, the
retirement is refused with the reason and the worker goes back to ``running`` (at the start, or
once its running tasks end if the values they made have no survivor to go to).  A copy that has not
arrived ``REASK_AFTER`` seconds after it was asked for (the survivor's fetch failed: the retiring
worker was frozen, the line was down), or whose survivor left, is asked for again, of the least
loaded survivor; after ``MAX_ASKS`` asks for one value the retirement is given up (refused, back to
``running``), so a retirement always ends.  A retiring worker lost meanwhile ends its retirement as
refused too (its values are recomputed as for any lost worker).

Data flow: these functions read a :class:`RetireView` of the scheduler state (its workers, ``now``
and ``retiring``: worker id -> key -> the :class:`Ask` for its copy) and return *intents*; they
change nothing.  The state machine (``state.py``) applies the intents in order: :class:`Begin`,
:class:`Finish` and :class:`GiveUp` are worker-state moves, :class:`Asked` and :class:`Forget` its
bookkeeping, and the commands (``Replicate``, ``RetireRefused``) go out as they are.  So this module imports nothing of the
state's, and the state owns every write to its fields.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tidepool.scheduler import events as ev

if TYPE_CHECKING:
    from tidepool.scheduler.records import TaskRecord, WorkerRecord

MEMORY_FRACTION = 0.8
#: seconds after which a copy asked for and not arrived is asked for again (a survivor's fetch of a
#: frozen or unreachable holder gives up within about the handshake timeout, 10 s)
REASK_AFTER = 20.0
#: ... plus the time a copy of the value's size takes at this rate (bytes/s): a multi-GB copy on a
#: slow network is still going, not failed (asking again would start a second transfer)
COPY_RATE = 20e6
#: asks for one value's copy before the retirement is given up
MAX_ASKS = 3


@dataclass(frozen=True, slots=True)
class Ask:
    """The copy of one value asked of survivor ``target`` at ``at``; ``tries``: asks so far."""

    target: str
    at: float
    tries: int


@dataclass(frozen=True, slots=True)
class Begin:
    """``worker`` starts retiring (takes no new task) for ``reason``."""

    worker: str
    reason: str


@dataclass(frozen=True, slots=True)
class Asked:
    """Copies of the values held only by retiring ``worker`` were asked for: key -> :class:`Ask`."""

    worker: str
    asks: dict[str, Ask]


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The retirement of ``worker`` ends unfinished: back to running, refused for ``reason``."""

    worker: str
    reason: str


@dataclass(frozen=True, slots=True)
class Finish:
    """Nothing unique left on ``worker`` and nothing running: close it and remove it gracefully."""

    worker: str


@dataclass(frozen=True, slots=True)
class Forget:
    """``worker`` left while retiring: drop its retirement bookkeeping."""

    worker: str


Intent = Begin | Asked | Finish | Forget | GiveUp | ev.Replicate | ev.RetireRefused


class RetireView(Protocol):
    """What retirement reads of the scheduler state (read-only by convention)."""

    @property
    def workers(self) -> Mapping[str, WorkerRecord]: ...

    @property
    def retiring(self) -> Mapping[str, Mapping[str, Ask]]: ...

    @property
    def now(self) -> float: ...


def unique_data(ws: WorkerRecord, leaving: Iterable[str] = ()) -> list[TaskRecord]:
    """Values ``ws`` holds that somebody still needs and no other worker (outside ``leaving``) has."""
    gone = set(leaving)
    return [ts for ts in ws.has_what
            if ts.needed and (sum(w not in gone for w in ts.who_has) if gone else len(ts.who_has)) == 1]  # fmt: skip


def unique_summary(ws: WorkerRecord) -> tuple[int, int, int]:
    """``unique_data(ws)`` counted without the list: how many values, their bytes, and how many of
    them an unfinished task waits for (the controller reads this for every worker on every step)."""
    n = nbytes = for_tasks = 0
    for ts in ws.has_what:
        if len(ts.who_has) == 1:
            waiters = ts.waiters
            if waiters or ts.wanted_by:
                n += 1
                nbytes += ts.nbytes
                if waiters:
                    for_tasks += 1
    return n, nbytes, for_tasks


def start_retire(view: RetireView, e: ev.RetireWorkers) -> list[Intent]:
    """Which of ``e.workers`` may begin retiring, and refusals (with reasons) for the rest."""
    out: list[Intent] = []
    names: set[str] = set()  # accepted for retirement in this batch
    for wid in e.workers:
        ws = view.workers.get(wid)
        if ws is None or ws.state == "retiring" or wid in names:
            continue
        survivors = [
            w for w in view.workers.values()
            if w.state == "running" and w.id != wid and w.id not in names and w.id not in view.retiring
        ]  # fmt: skip
        unique = unique_data(ws)
        need = sum(ts.nbytes for ts in unique)
        if unique and not survivors:
            out.append(ev.RetireRefused(wid, f"it holds {len(unique)} needed values ({need} bytes) "
                                              "and no other running worker can take them"))  # fmt: skip
            continue
        room = sum(_room(w) for w in survivors)
        if need > room:
            out.append(ev.RetireRefused(wid, f"its {need} bytes of needed data do not fit in the "
                                              f"{room:.0f} bytes the survivors have free"))  # fmt: skip
            continue
        names.add(wid)
        out.append(Begin(wid, e.reason))
    return out


def _room(w: WorkerRecord) -> float:
    if w.memory_limit <= 0:
        return float("inf")
    return max(0.0, w.memory_limit * MEMORY_FRACTION - w.nbytes)


def progress_retirements(view: RetireView) -> list[Intent]:
    """Ask survivors for copies of unique data; close retiring workers that are done.

    Workers finishing in this pass count as gone already: a value two retiring workers share is
    unique to the second once the first is closed, so it is copied, not lost."""
    out: list[Intent] = []
    leaving: list[str] = []
    # the survivors by what they hold (and will hold, with the copies planned in this pass), made
    # once per pass: sorting every survivor again for each retiring worker, and scanning them all
    # for each value, made a pass over 10,000 retiring workers quadratic
    targets: list[tuple[float, int, str]] | None = None
    now = view.now
    workers = view.workers
    for wid in list(view.retiring):
        ws = workers.get(wid)
        if ws is None:
            out.append(Forget(wid))
            out.append(ev.RetireRefused(wid, "it was lost before its data was moved (its values are recomputed "
                                             "where needed)"))  # fmt: skip
            continue
        asked = view.retiring[wid]
        unique = unique_data(ws, leaving)
        if not unique and not ws.processing:
            out.append(Finish(wid))
            leaving.append(wid)
            continue
        todo = [ts for ts in unique if _due(asked.get(ts.key), workers, now, ts.nbytes)]
        if not todo:
            continue
        spent = next((ts for ts in todo if (a := asked.get(ts.key)) is not None and a.tries >= MAX_ASKS), None)
        if spent is not None:
            a = asked[spent.key]
            out.append(GiveUp(wid, f"a copy of its value {spent.key!r} did not reach a survivor after {a.tries} "
                                   f"asks over {now - a.at + REASK_AFTER * (a.tries - 1):.0f}s (the survivors "
                                   "could not fetch it: is the worker frozen, or its data port unreachable?)"))  # fmt: skip
            continue
        if targets is None:
            targets = [(float(w.nbytes), w.seq, w.id) for w in workers.values() if w.state == "running"]
            heapq.heapify(targets)
        if not targets:
            if ws.processing:
                continue  # wait: a survivor may join before its tasks end
            # its running tasks ended and made values nobody else can take: refused, as at the
            # start (it waited for ever, its caller too, and tasks only it could run never ran)
            need = sum(ts.nbytes for ts in unique)
            out.append(GiveUp(wid, f"it holds {len(unique)} needed values ({need} bytes) made while it "
                                   "retired, and no other running worker can take them"))  # fmt: skip
            continue
        plan: dict[str, list[str]] = {}
        asks: dict[str, Ask] = {}
        for ts in sorted(todo, key=lambda t: (-t.nbytes, t.priority, str(t.key))):  # deterministic order
            load, seq, target = heapq.heappop(targets)  # the survivor holding the least
            heapq.heappush(targets, (load + ts.nbytes, seq, target))
            plan.setdefault(target, []).append(ts.key)
            before = asked.get(ts.key)
            asks[ts.key] = Ask(target, now, 1 if before is None else before.tries + 1)
        out.append(Asked(wid, asks))
        for target_id, keys in plan.items():
            out.append(ev.Replicate(target_id, keys))
    return out


def _due(ask: Ask | None, workers: Mapping[str, WorkerRecord], now: float, nbytes: int = 0) -> bool:
    """Ask (again) for this copy: never asked, its survivor is no longer running, or it has not
    arrived ``REASK_AFTER`` seconds (plus its size at ``COPY_RATE``) after the last ask."""
    if ask is None:
        return True
    target = workers.get(ask.target)
    return target is None or target.state != "running" or now - ask.at >= REASK_AFTER + nbytes / COPY_RATE
