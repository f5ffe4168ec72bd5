"""Graph intake: a client's task specs become task records.

Pure apart from linking: new records are made (state ``released``), each linked to its inputs
(``deps``, and the inputs' ``dependents``); the state machine (``state.py``) then files them and
decides what to compute.  A key already known is a collision unless the spec is the same task.

Priorities: ``-user_priority * PRIORITY_STEP + line * LINE + seq`` (lower runs first), where
``seq`` is the task's submission number (unique: runs replay exactly) and ``line`` its place in
line: its own ``seq``, or the line of an input of the same user priority from an earlier
submission that is still being computed (depth first across submissions: ``check(f)`` for each
``f`` of an earlier ``map`` runs soon after ``f``, not after every other task of that ``map``).

Compact records (records.py): equal resource shapes share one tuple, function ids and group names
are interned, a payload without out-of-band buffers is kept as its bytes, and ``deps`` is a tuple
of distinct records (an input given twice is linked once).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from tidepool.comm.serialize import Serialized
from tidepool.resources import Shape, task_shape
from tidepool.scheduler import events as ev
from tidepool.scheduler.kinds import ACTIVE
from tidepool.scheduler.records import TaskError, TaskRecord

#: one step of user priority outweighs any difference in submission order
PRIORITY_STEP = 1 << 80
LINE = 1 << 40

#: resource requests seen -> their shape (shared by every task asking the same): bounded
_SHAPES: dict[tuple[tuple[str, Any], ...], Shape] = {}
_SHAPES_MAX = 10_000


def shape_of(resources: Mapping[str, Any] | None) -> Shape:
    """``task_shape(resources)``, one tuple for equal requests."""
    try:
        req = tuple(sorted(resources.items())) if resources else ()
        shape = _SHAPES.get(req)
    except TypeError:  # unhashable or unorderable values: let task_shape judge them
        return task_shape(resources)
    if shape is None:
        shape = task_shape(resources)
        if len(_SHAPES) < _SHAPES_MAX:
            _SHAPES[req] = shape
    return shape


def compact_payload(payload: Serialized | None) -> Serialized | bytes | None:
    """The payload as a record keeps it: its bytes when it has no out-of-band buffers."""
    if payload is not None and not payload.buffers and type(payload.data) is bytes:
        return payload.data
    return payload


def records(specs: Iterable[ev.TaskSpec], known: Mapping[str, TaskRecord],
            seq: int) -> tuple[list[TaskRecord], dict[str, str], int]:  # fmt: skip
    """New records for ``specs`` (numbered from ``seq``), the colliding keys with the reason,
    and the next free ``seq``."""
    made: dict[str, TaskRecord] = {}
    collided: dict[str, str] = {}
    for spec in specs:
        old = made.get(spec.key) or known.get(spec.key)
        if old is not None:
            why = _differs(old, spec)
            if why:
                collided[spec.key] = why
            continue
        level = -spec.priority * PRIORITY_STEP
        ts = TaskRecord(spec.key, sys.intern(spec.func_id), compact_payload(spec.payload), shape_of(spec.resources),
                        spec.retries, level + seq * LINE + seq, sys.intern(spec.group) if spec.group else spec.key)  # fmt: skip
        if spec.workers:
            ts.restrict, ts.loose = frozenset(spec.workers), spec.loose
        made[spec.key] = ts
        deps: list[TaskRecord] = []
        for dk in spec.deps:
            dep = made.get(dk) or known.get(dk)
            if dep is ts:
                ts.error = TaskError("CycleError", f"task {dk!r} depends on itself (a cycle); a graph must be acyclic")
                continue
            if dep is None:
                ts.error = TaskError("DependencyError", f"input {dk!r} is unknown to the scheduler (was it released?)")
                continue
            if ts in dep.dependents:
                continue  # the same input given twice: one link (the records' collections hold each once)
            deps.append(dep)
            dep.add_dependent(ts)
            if dep.state in ACTIVE and dep.priority < ts.priority and (
                    dep.priority // PRIORITY_STEP == ts.priority // PRIORITY_STEP):  # fmt: skip
                # depth first: it takes its unfinished input's place in line (its own seq stays)
                ts.priority = dep.priority - dep.priority % LINE + seq
        if deps:
            ts.deps = tuple(deps)
        seq += 1
    return list(made.values()), collided, seq


def _differs(old: TaskRecord, spec: ev.TaskSpec) -> str:
    """Why ``spec`` is not the task already known under its key ("" when it is the same task)."""
    if old.func_id != spec.func_id:
        return "a different function"
    if old.spec_payload != spec.payload:
        return "different arguments"
    if [d.key for d in old.deps] != list(dict.fromkeys(spec.deps)):
        return "different inputs"
    return ""
