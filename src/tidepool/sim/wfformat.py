"""WfCommons WfFormat traces (schema 1.4/1.5) as simulator workloads.

A WfFormat file (https://github.com/wfcommons/wfformat) describes one execution of a real workflow:
``workflow.specification.tasks`` (id, parents, input and output files), ``workflow.specification
.files`` (id, ``sizeInBytes``) and ``workflow.execution.tasks`` (what the run measured: id,
``runtimeInSeconds``, optionally ``memoryInBytes`` and ``coreCount``).  Traces of WRENCH and
WfCommons users (``wfcommons/WfInstances``) are in this format, so ``tidepool simulate
TRACE.json`` reads them as they are.

Mapping, per task: key = its id; duration = ``runtimeInSeconds`` (divided by ``scale``, so a trace
can be replayed faster); inputs = ``parents`` plus the tasks naming it among their ``children``; group = the id up to ``_ID`` (``mProject_ID0000001``
-> ``mProject``: the program); result size = the sum of its output files' sizes; resources =
``coreCount`` cpus when above 1, and ``memory`` = ``memoryInBytes`` when the trace gives it.
Tasks are ordered so inputs come first; the wanted results are the tasks nothing depends on.

Pure functions; :func:`is_wfformat` is the detection hook ``load_workload`` calls on a ``.json``
file, :func:`fit_memory` drops memory needs that no node type of a cluster declares (with a note).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tidepool.errors import ConfigError
from tidepool.sim.workload import SimTask, Stage, Workload, sinks

_PROGRAM = re.compile(r"^(.*?)_ID\d+$")


def is_wfformat(data: Any) -> bool:
    """True when ``data`` (parsed JSON) is a WfFormat document rather than a tidepool graph."""
    if not isinstance(data, Mapping):
        return False
    wf = data.get("workflow")
    # a "workflow" object and no tidepool "tasks" list: WfFormat, so a trace missing its
    # specification is told so (not that it lacks a tidepool graph's "tasks")
    return isinstance(wf, Mapping) and "tasks" not in data


def _program(task_id: str, name: str) -> str:
    m = _PROGRAM.match(task_id) or _PROGRAM.match(name)
    return m.group(1) if m else (name or task_id)


def _spec_and_exec(data: Mapping[str, Any], source: str) -> tuple[list[Any], list[Any], list[Any]]:
    wf = data["workflow"]
    if "specification" in wf:  # 1.5
        spec = wf.get("specification") or {}
        execution = wf.get("execution") or {}
        tasks, files, runs = spec.get("tasks"), spec.get("files", []), execution.get("tasks", [])
    else:  # 1.4 and earlier: one task list with runtimes and files inline
        tasks, files, runs = wf.get("tasks"), [], wf.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise ConfigError(f"{source}: a WfFormat trace needs workflow.specification.tasks (a non-empty list)")
    for what, value in (("specification.files", files), ("execution.tasks", runs)):
        if value is not None and not isinstance(value, list):  # an object's keys were read as ids: sizes lost
            raise ConfigError(f"{source}: workflow.{what} must be a list, got {type(value).__name__}")
    return tasks, list(files or []), list(runs or [])


def from_wfformat(data: Mapping[str, Any], *, source: str = "<wfformat>", scale: float = 1.0,
                  memory: bool = True) -> Workload:  # fmt: skip
    """A workload from a parsed WfFormat document (see the module docstring)."""
    if not scale > 0:
        raise ConfigError(f"{source}: scale must be positive, got {scale!r}")
    tasks, files, runs = _spec_and_exec(data, source)
    sizes: dict[str, int] = {}
    for f in files:
        if isinstance(f, Mapping) and "id" in f:
            sizes[str(f["id"])] = _size(f.get("sizeInBytes", 0), f"{source}: file {f['id']!r}: sizeInBytes")
    measured: dict[str, Mapping[str, Any]] = {}
    for r in runs:
        if isinstance(r, Mapping) and "id" in r:
            if str(r["id"]) in measured and r is not measured[str(r["id"])]:  # the last one silently won
                raise ConfigError(f"{source}: execution.tasks lists task {r['id']!r} twice; keep one measurement")
            measured[str(r["id"])] = r
    by_id: dict[str, Mapping[str, Any]] = {}
    for i, t in enumerate(tasks):
        if not isinstance(t, Mapping) or not isinstance(t.get("id", t.get("name")), str):
            raise ConfigError(f"{source}: task #{i + 1} has no string 'id'")
        tid = str(t.get("id", t.get("name")))
        if tid in by_id:
            raise ConfigError(f"{source}: task id {tid!r} appears twice")
        by_id[tid] = t
    # WfFormat 1.4 names parents by the tasks' names ("name ... to be used as references in
    # child/parent tasks"), 1.5 by their ids
    by_name: dict[str, str] = {}
    for tid, t in (by_id.items() if "specification" not in data["workflow"] else ()):  # 1.4 layout only
        name = t.get("name")
        if isinstance(name, str):
            by_name[name] = tid if name not in by_name else ""  # "": two tasks share it
    # an edge may be written on either end: a task's "children" make it their parent too (a trace
    # giving only children ran as independent tasks, silently: a bug hunt)
    from_children: dict[str, list[str]] = {}
    for tid, t in by_id.items():
        kids = t.get("children", []) or []
        if not isinstance(kids, list):
            raise ConfigError(f"{source}: task {tid!r}: children must be a list of task ids, got {kids!r:.60}")
        for c in map(str, kids):
            child = c if c in by_id else by_name.get(c) or c
            if child not in by_id:
                raise ConfigError(f"{source}: task {tid!r} names children that are not tasks: [{c!r}]")
            from_children.setdefault(child, []).append(tid)
    missing_runtime = 0
    out: dict[str, SimTask] = {}
    for tid, t in by_id.items():
        where = f"{source}: task {tid!r}"
        raw_parents = t.get("parents", []) or []
        if not isinstance(raw_parents, list):
            raise ConfigError(f"{where}: parents must be a list of task ids, got {raw_parents!r:.60}")
        parents = [p if p in by_id else by_name.get(p) or p for p in map(str, raw_parents)]
        unknown = [p for p in parents if p not in by_id]
        if unknown:
            raise ConfigError(f"{where} names parents that are not tasks: {unknown[:3]}")
        parents += [p for p in dict.fromkeys(from_children.get(tid, ())) if p not in parents]
        run = measured.get(tid, t)
        runtime = run.get("runtimeInSeconds", run.get("runtime"))
        if runtime is None:
            missing_runtime += 1
            runtime = 0.0
        runtime = _number(runtime, f"{where}: runtimeInSeconds")
        outputs = t.get("outputFiles")
        if outputs is None:  # 1.4: files inline with a link direction
            inline = t.get("files", []) or []
            if not isinstance(inline, list) or not all(isinstance(f, Mapping) for f in inline):
                raise ConfigError(f"{where}: files must be a list of file objects, got {inline!r:.60}")
            outputs = [f.get("name") for f in inline if f.get("link") == "output"]
            for f in inline:
                sizes.setdefault(str(f.get("name")), _size(f.get("sizeInBytes", f.get("size", 0)),
                                                           f"{where}: file {f.get('name')!r}: sizeInBytes"))  # fmt: skip
        if not isinstance(outputs, list):
            raise ConfigError(f"{where}: outputFiles must be a list of file ids, got {outputs!r:.60}")
        nbytes = sum(sizes.get(str(f), 0) for f in outputs)
        res: dict[str, float] = {}
        cores = run.get("coreCount", t.get("cores"))
        if cores is not None and _number(cores, f"{where}: coreCount") > 1:
            res["cpu"] = float(cores)
        mem = run.get("memoryInBytes")
        if mem is not None and _number(mem, f"{where}: memoryInBytes") > 0 and memory:
            res["memory"] = float(mem)
        out[tid] = SimTask(tid, runtime / scale, parents, _program(tid, str(t.get("name", ""))),
                           res or None, nbytes=max(8, nbytes))  # fmt: skip
    ordered = _topological(out, source)
    name = str(data.get("name") or "wfformat")
    notes = [f"WfFormat trace {source}: {len(ordered)} tasks from {_runtime_system(data)}"
             + (f", runtimes divided by {scale:g}" if scale != 1 else "")]
    if missing_runtime:
        notes.append(f"{missing_runtime} tasks have no runtimeInSeconds: they take 0 s")
    return Workload(name, [Stage(ordered, sinks(ordered))], notes=notes)


def _number(value: Any, what: str) -> float:
    """A trace's number (a runtime, a core count, a memory size): finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r:.60}")
    return float(value)


def _size(value: Any, what: str) -> int:
    """A file size in bytes (None or 0: none)."""
    return int(_number(value or 0, what))


def _runtime_system(data: Mapping[str, Any]) -> str:
    rs = data.get("runtimeSystem") or data.get("wms") or {}
    return str(rs.get("name", "an unknown system")) if isinstance(rs, Mapping) else "an unknown system"


def _topological(tasks: Mapping[str, SimTask], source: str) -> list[SimTask]:
    """Tasks with every input before its users, keeping the trace's order otherwise."""
    indeg = {k: len(set(t.deps)) for k, t in tasks.items()}
    users: dict[str, list[str]] = {k: [] for k in tasks}
    for k, t in tasks.items():
        for d in set(t.deps):
            users[d].append(k)
    position = {k: i for i, k in enumerate(tasks)}
    import heapq

    ready = [(position[k], k) for k, n in indeg.items() if n == 0]
    heapq.heapify(ready)
    out: list[SimTask] = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(tasks[k])
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (position[u], u))
    if len(out) != len(tasks):
        # walk up stuck parents until one repeats: those are the cycle (the stuck tasks below it
        # only wait on it; the message named them, alphabetically, before)
        stuck = {k for k, n in indeg.items() if n > 0}
        k = min(stuck, key=lambda x: position[x])
        path: list[str] = []
        seen: dict[str, int] = {}
        while k not in seen:
            seen[k] = len(path)
            path.append(k)
            k = next(d for d in tasks[k].deps if d in stuck)
        cycle = path[seen[k]:]
        shown = " -> ".join(repr(c) for c in [*cycle[:6], cycle[0]]) if len(cycle) <= 6 else \
            " -> ".join(repr(c) for c in cycle[:6]) + " -> ..."  # fmt: skip
        raise ConfigError(f"{source}: the trace's parents form a cycle ({shown}: each needs the next as a parent); "
                          "a workflow is a DAG")  # fmt: skip
    return out


def fit_memory(workload: Workload, node_memory: Sequence[float]) -> Workload:
    """Drop the tasks' ``memory`` needs when no node type declares memory (``node_memory`` all 0),
    so a trace runs on a cluster given as ``cloud:50:4``; says so in a note.  Unchanged otherwise."""
    if any(m > 0 for m in node_memory):
        return workload
    peak = 0.0
    for t in workload.tasks():
        if t.resources and "memory" in t.resources:
            peak = max(peak, t.resources.pop("memory"))
            if not t.resources:
                t.resources = None
    if peak:
        workload.notes.append(f"tasks' memoryInBytes (up to {peak / 2**30:.2f} GiB) not placed on: the cluster's "
                              "node types declare no memory (give them memory= to place by it)")  # fmt: skip
    return workload
