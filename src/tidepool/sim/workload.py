"""What a simulation runs: tasks with durations, sizes and inputs, and when the client submits them.

A :class:`Workload` is a list of :class:`Stage` s (one ``UpdateGraph`` each, at a time in seconds
from the start), the keys the client holds futures of, and what the client does at the end: keep
its results ``hold`` seconds, then gather them (their bytes cross the network to the client).  The
makespan is the time from the first submit to the gathered results, as ``benchmarks/elastic.py``
measures a real run.

Where workloads come from (:func:`load_workload`):

- a JSON graph file (format below), or a WfCommons WfFormat trace (:mod:`tidepool.sim.wfformat`,
  detected by its ``workflow`` object; ``params`` may give ``scale``);
- a journal of a real run (``.jsonl``; ``task`` records carry key, start, duration, worker).
  Journals of this version also record each task's inputs and submit time: those are replayed as
  the recorded graph (:mod:`tidepool.sim.replay`).  An older journal has **no dependencies**: its
  tasks are replayed as independent tasks submitted at their recorded start times
  (``arrival="start"``, which keeps the phases of the original run) or all at once in their start
  order (``arrival="zero"``, also for new journals);
- a Python callable ``module:function`` or ``path/to/file.py:function`` (keyword arguments from
  ``params``) returning a :class:`Workload`, a dict in the JSON format, a list of
  :class:`SimTask`, or tidepool ``Delayed`` values (``@tidepool.task`` graphs; durations per
  function name from ``params["durations"]``, else 1 s);
- a built-in name from :mod:`tidepool.sim.workloads` (``bursty``, ``chain``, ``wide``, ``gpu``,
  ``scale-down``, ``layers``, ``bag``).

JSON graph format::

    {"name": "etl",
     "tasks": [
       {"key": "load-0", "duration": 2.5},
       {"key": "load-1", "duration": "lognormal(2, 0.5)", "nbytes": 50000000},
       {"key": "train", "deps": ["load-0", "load-1"], "duration": 30,
        "resources": {"gpu": 1}, "group": "train", "submit": 0.0, "priority": 0, "retries": 0}
     ],
     "wanted": ["train"],
     "hold": 0, "gather": true}

``duration`` is seconds or a distribution (:mod:`tidepool.sim.dists`, sampled once per task with
the run's seed); ``nbytes`` is the result's size (default 8); ``group`` defaults to the key up to
its last ``-``; ``submit`` is when the client submits the task (default 0; tasks submitted at the
same time form one stage); ``wanted`` defaults to the tasks nothing depends on.  Tasks must come
after their inputs (submission order).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scheduler import events as ev
from tidepool.sim import validate
from tidepool.sim.dists import Dist, parse_dist, stream

_HEXISH = re.compile(r"^[0-9a-f]{6,}$|^[0-9]+$")


class SimTask:
    """One task: its key, how long it runs, what it needs, and how big its result is."""

    __slots__ = ("key", "duration", "deps", "group", "resources", "nbytes", "priority", "retries")

    def __init__(self, key: str, duration: float, deps: Sequence[str] = (), group: str = "",
                 resources: Mapping[str, float] | None = None, nbytes: int = 8, priority: int = 0,
                 retries: int = 0) -> None:  # fmt: skip
        self.key = key
        # checked here, so every reader of graphs is held to the same rules (sim/validate.py); the
        # plain case is one comparison (a million tasks are built at once)
        if type(duration) is float and 0.0 <= duration <= validate.MAX_DURATION:
            self.duration = duration
        else:
            self.duration = validate.duration(duration, f"task {key!r}: duration")
        self.deps = tuple(deps)
        self.group = group or group_of(key)
        self.resources = dict(resources) if resources else None
        self.nbytes = nbytes if type(nbytes) is int and 0 <= nbytes <= validate.MAX_NBYTES else \
            validate.nbytes(nbytes, f"task {key!r}: nbytes")  # fmt: skip
        self.priority = int(validate.number(priority, f"task {key!r}: priority", lo=-math.inf, integer=True))
        self.retries = int(validate.number(retries, f"task {key!r}: retries", integer=True))

    def spec(self) -> ev.TaskSpec:
        return ev.TaskSpec(self.key, self.group, None, self.deps, self.resources or {}, self.retries,
                           self.group, self.priority)  # fmt: skip

    def __repr__(self) -> str:
        return f"SimTask({self.key!r}, {self.duration:g}s, deps={len(self.deps)})"


def group_of(key: str) -> str:
    """A task's group (its function, as the client names keys ``<function>-<id>``)."""
    head, sep, tail = key.rpartition("-")
    return head if sep and head and _HEXISH.match(tail) else key


@dataclass
class Stage:
    """Tasks the client submits at ``at`` seconds, and which of them it holds futures of."""

    tasks: list[SimTask]
    wanted: list[str]
    at: float = 0.0


@dataclass
class Workload:
    name: str
    stages: list[Stage]
    hold: float = 0.0  # seconds the client keeps its results before gathering them
    gather: bool = True  # fetch the wanted values to the client at the end
    notes: list[str] = field(default_factory=list)

    @property
    def n_tasks(self) -> int:
        return sum(len(s.tasks) for s in self.stages)

    def tasks(self) -> Iterable[SimTask]:
        for s in self.stages:
            yield from s.tasks

    def total_seconds(self) -> float:
        return sum(t.duration for t in self.tasks())


def single(name: str, tasks: list[SimTask], wanted: Sequence[str] | None = None, *, hold: float = 0.0,
           gather: bool = True) -> Workload:  # fmt: skip
    """A workload of one stage at t=0; ``wanted`` defaults to the tasks nothing depends on."""
    return Workload(name, [Stage(tasks, list(wanted) if wanted is not None else sinks(tasks))], hold, gather)


def sinks(tasks: Sequence[SimTask]) -> list[str]:
    used = {d for t in tasks for d in t.deps}
    return [t.key for t in tasks if t.key not in used]


# ---- JSON graphs ---------------------------------------------------------------------------------
def from_dict(data: Mapping[str, Any], *, seed: int = 0, source: str = "<graph>",
              max_tasks: int | None = None) -> Workload:  # fmt: skip
    """A workload from the JSON graph format (see the module docstring)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("tasks"), list):
        raise ConfigError(f"{source}: a graph is an object with a 'tasks' list (see docs/simulation.md)")
    validate.graph_size(len(data["tasks"]), source, max_tasks)
    unknown = set(data) - {"name", "tasks", "wanted", "hold", "gather", "notes"}
    if unknown:
        raise ConfigError(f"{source}: unknown graph fields {sorted(unknown)}; allowed: name, tasks, wanted, "
                          "hold, gather, notes")  # fmt: skip
    rng = stream(seed, "durations")
    by_time: dict[float, list[SimTask]] = {}
    seen: set[str] = set()
    dists: dict[str, Dist] = {}
    for i, raw in enumerate(data["tasks"]):
        where = f"{source}: task #{i + 1}"
        if not isinstance(raw, Mapping) or not isinstance(raw.get("key"), str):
            raise ConfigError(f"{where}: each task is an object with a string 'key'")
        bad = set(raw) - {"key", "duration", "deps", "group", "resources", "nbytes", "priority", "retries", "submit"}
        if bad:
            raise ConfigError(f"{where} ({raw['key']!r}): unknown fields {sorted(bad)}")
        key = raw["key"]
        if key in seen:
            raise ConfigError(f"{where}: key {key!r} appears twice")
        deps = raw.get("deps", [])
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            raise ConfigError(f"{where} ({key!r}): deps must be a list of keys")
        for d in deps:
            if d not in seen:
                raise ConfigError(f"{where} ({key!r}): input {d!r} is not defined before it; list tasks "
                                  "after their inputs")  # fmt: skip
        dur = raw.get("duration", 1.0)
        text = str(dur)
        dist = dists.get(text)
        if dist is None:
            dist = dists[text] = parse_dist(dur, f"{where} ({key!r}) duration")
        submit = float(validate.duration(raw.get("submit", 0.0), f"{where} ({key!r}): submit"))
        task = SimTask(key, dist.sample(rng), deps, str(raw.get("group", "")), raw.get("resources"),
                       raw.get("nbytes", 8), raw.get("priority", 0), raw.get("retries", 0))  # fmt: skip
        seen.add(key)
        by_time.setdefault(submit, []).append(task)
    all_tasks = [t for ts in by_time.values() for t in ts]
    wanted = data.get("wanted")
    if wanted is None:
        wanted = sinks(all_tasks)
    missing = [k for k in wanted if k not in seen]
    if missing:
        raise ConfigError(f"{source}: wanted keys {missing[:5]} are not tasks of the graph")
    want = set(wanted)
    stages = [Stage(ts, [t.key for t in ts if t.key in want], at) for at, ts in sorted(by_time.items())]
    hold = validate.duration(data.get("hold", 0.0), f"{source}: hold")
    return Workload(str(data.get("name", "graph")), stages, hold, bool(data.get("gather", True)),
                    list(data.get("notes", [])))  # fmt: skip


def to_dict(w: Workload) -> dict[str, Any]:
    """The JSON graph format of ``w`` (durations as sampled)."""
    tasks = []
    for s in w.stages:
        for t in s.tasks:
            d: dict[str, Any] = {"key": t.key, "duration": t.duration}
            if t.deps:
                d["deps"] = list(t.deps)
            if t.group != group_of(t.key):
                d["group"] = t.group
            if t.resources:
                d["resources"] = t.resources
            if t.nbytes != 8:
                d["nbytes"] = t.nbytes
            if t.priority:
                d["priority"] = t.priority
            if t.retries:
                d["retries"] = t.retries
            if s.at:
                d["submit"] = s.at
            tasks.append(d)
    return {"name": w.name, "tasks": tasks, "wanted": [k for s in w.stages for k in s.wanted],
            "hold": w.hold, "gather": w.gather}  # fmt: skip


# ---- journals of real runs ----------------------------------------------------------------------
def from_journal(records: Sequence[Mapping[str, Any]], *, arrival: str = "start", name: str = "journal",
                 infer_resources: bool = True) -> Workload:  # fmt: skip
    """Replay the tasks of a recorded run (see the module docstring: no dependencies are known).

    Time zero is the first ``launch`` record (when demand appeared, i.e. the submit) or else the
    first task start.  A task that ran on a worker with a scarce resource (``gpu``, ...) is assumed
    to need one of it (``infer_resources``).  Failed tasks are replayed as tasks of their duration.
    """
    if arrival not in ("start", "zero"):
        raise ConfigError(f"arrival must be 'start' or 'zero', got {arrival!r}")
    from tidepool.sim.replay import graph_from_journal, has_graph

    recorded = has_graph(records)  # task records with their inputs
    if arrival == "start" and recorded:  # replay the graph (sim/replay.py)
        return graph_from_journal(records, name=name)
    tasks = [r for r in records if r.get("kind") == "task"]
    if not tasks:
        raise ConfigError("the journal has no 'task' records: record one with tidepool scheduler --journal "
                          "or cluster.adapt(journal=...) (task records are on by default)")  # fmt: skip
    special: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("kind") == "worker-join":
            res = r.get("resources") or {}
            special[str(r.get("worker"))] = {k: 1.0 for k, v in res.items() if k not in ("cpu", "memory") and v}
    for i, r in enumerate(tasks):  # the times must be numbers before anything is computed from them
        where = f"journal task record #{i + 1} ({str(r.get('key', '?'))[:80]!r})"
        validate.number(r["t"], f"{where}: t", lo=-math.inf)
        validate.duration(r.get("duration", 0.0), f"{where}: duration")
        if "start" in r:
            validate.number(r["start"], f"{where}: start", lo=-math.inf)
    starts = [float(r.get("start", float(r["t"]) - float(r.get("duration", 0.0)))) for r in tasks]
    launches = [float(r["t"]) for r in records if r.get("kind") == "launch"]
    t0 = min(launches) if launches else min(starts)
    t0 = min(t0, min(starts))
    order = sorted(range(len(tasks)), key=lambda i: (starts[i], str(tasks[i].get("key"))))
    by_time: dict[float, list[SimTask]] = {}
    seen: set[str] = set()
    for n, i in enumerate(order):
        r = tasks[i]
        key = str(r.get("key", f"task-{i}"))
        if key in seen:  # recomputed in the original run: one more execution, under its own key
            key = f"{key}-again-{n}"
        seen.add(key)
        res = special.get(str(r.get("worker")), {}) if infer_resources else {}
        at = 0.0 if arrival == "zero" else round(starts[i] - t0, 6)
        by_time.setdefault(at, []).append(SimTask(key, float(r.get("duration", 0.0)), (), "", res or None,
                                                   priority=-n if arrival == "zero" else 0))  # fmt: skip
    stages = [Stage(ts, [t.key for t in ts], at) for at, ts in sorted(by_time.items())]
    how = ("submitted at their recorded start times" if arrival == "start"
           else "submitted all at once, in their recorded start order")  # fmt: skip
    deps = ("its dependencies left out (--arrival zero replays independent tasks; the default replays the "
            "recorded graph)" if recorded else "no dependencies (this journal does not record them)")  # fmt: skip
    note = f"replayed from a journal: {len(tasks)} task records, {deps}; tasks are independent, {how}"
    return Workload(name, stages, notes=[note])


# ---- Python callables and tidepool graphs --------------------------------------------------------
def from_delayed(values: Sequence[Any], durations: Mapping[str, Any] | None = None, *, seed: int = 0,
                 name: str = "graph") -> Workload:  # fmt: skip
    """A workload from ``@tidepool.task`` graphs; a task's duration by its function name from
    ``durations`` (seconds or a distribution), else 1 s."""
    from tidepool.graph.delayed import Delayed, func_name

    rng = stream(seed, "durations")
    dists = {k: parse_dist(v, f"duration of {k!r}") for k, v in (durations or {}).items()}
    order: list[Delayed[Any]] = []
    seen: set[str] = set()

    def visit(root: Delayed[Any]) -> None:
        stack: list[tuple[Delayed[Any], bool]] = [(root, False)]
        while stack:
            d, done = stack.pop()
            if done:
                if d.key not in seen:
                    seen.add(d.key)
                    order.append(d)
                continue
            if d.key in seen:
                continue
            stack.append((d, True))
            stack.extend((dep, False) for dep in reversed(list(d.dependencies())) if dep.key not in seen)

    for v in values:
        visit(v)
    tasks = []
    for d in order:
        group = d.options.name or func_name(d.func)
        dist = dists.get(group) or dists.get("*") or Dist("const", (1.0,))
        tasks.append(SimTask(d.key, dist.sample(rng), [x.key for x in d.dependencies()], group,
                             d.options.resources or None, retries=d.options.retries))  # fmt: skip
    return single(name, tasks, [v.key for v in values])


def _load_callable(spec: str) -> Any:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        if not os.path.exists(path):
            raise ConfigError(f"graph {spec!r}: no file {target}")
        mod_name = f"_tidepool_sim_graph_{abs(hash(path))}"
        loader = importlib.util.spec_from_file_location(mod_name, path)
        if loader is None or loader.loader is None:
            raise ConfigError(f"graph {spec!r}: cannot import {target}")
        mod = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = mod
        loader.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"graph {spec!r}: cannot import {target!r}: {exc}") from exc
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ConfigError(f"graph {spec!r}: {target} has no {attr!r}")
    return fn


def as_workload(value: Any, *, seed: int = 0, name: str = "graph", durations: Mapping[str, Any] | None = None) -> Workload:
    """Whatever a graph callable returned, as a :class:`Workload`."""
    from tidepool.graph.delayed import Delayed

    if isinstance(value, Workload):
        return value
    if isinstance(value, Mapping):
        return from_dict(value, seed=seed, source=name)
    if isinstance(value, Delayed):
        return from_delayed([value], durations, seed=seed, name=name)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Delayed) for v in value):
        return from_delayed(list(value), durations, seed=seed, name=name)
    if isinstance(value, (list, tuple)) and all(isinstance(v, SimTask) for v in value):
        return single(name, list(value))
    raise ConfigError(f"graph {name!r} returned {type(value).__name__}; return a Workload, a dict in the JSON "
                      "graph format, a list of SimTask, or tidepool Delayed values")  # fmt: skip


def load_workload(source: str, *, seed: int = 0, params: Mapping[str, Any] | None = None,
                  arrival: str = "start", max_tasks: int | None = None) -> Workload:  # fmt: skip
    """A workload from a built-in name, a ``.json`` graph, a ``.jsonl`` journal or ``module:function``;
    more than ``max_tasks`` tasks (default :data:`~tidepool.sim.validate.MAX_TASKS`) is refused."""
    w = _load_workload(source, seed=seed, params=params, arrival=arrival, max_tasks=max_tasks)
    validate.graph_size(w.n_tasks, source, max_tasks)
    return w


def _load_workload(source: str, *, seed: int, params: Mapping[str, Any] | None, arrival: str,
                   max_tasks: int | None) -> Workload:  # fmt: skip
    from tidepool.sim import workloads as builtin

    params = dict(params or {})
    if source.endswith(".jsonl"):
        from tidepool.telemetry.report import load_records

        records = load_records(source)
        validate.graph_size(sum(1 for r in records if r.get("kind") == "task"), source, max_tasks)
        return from_journal(records, arrival=arrival, name=os.path.basename(source))
    if source.endswith(".json"):
        try:
            with open(source) as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read graph {source}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ConfigError(f"{source}: not JSON: {exc}") from exc
        from tidepool.sim.wfformat import from_wfformat, is_wfformat

        if is_wfformat(data):  # a WfCommons trace (WRENCH / WfInstances)
            return from_wfformat(data, source=source, **validate.params(_trace_params, params, source))
        return from_dict(data, seed=seed, source=source, max_tasks=max_tasks)
    if source in builtin.BUILTIN:
        fn = builtin.BUILTIN[source]
        params = validate.params(fn, params, source)
        validate.graph_size(validate.BUILTIN_SIZE[source](**params), source, max_tasks)
        return fn(seed=seed, **params)  # type: ignore[no-any-return]
    if ":" in source:
        fn = _load_callable(source)
        durations = params.pop("durations", None)
        if callable(fn):
            params = validate.params(fn, params, source)
        value = fn(**params) if callable(fn) else fn
        return as_workload(value, seed=seed, name=source.rpartition(":")[2], durations=durations)
    raise ConfigError(f"graph {source!r}: expected a built-in workload ({', '.join(sorted(builtin.BUILTIN))}), "
                      "a .json graph, a .jsonl journal, or module:function")  # fmt: skip


def _trace_params(scale: float = 1.0, memory: bool = True) -> None:
    """The ``--param`` names a WfFormat trace takes (``from_wfformat``'s options), for checking."""
