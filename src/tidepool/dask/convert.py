"""Dask graphs -> tidepool tasks (client side; pure apart from pickling each node).

No state between calls.  Data flow: ``Client.get`` / ``persist`` / ``compute`` hand a Dask graph
(an expression, a ``HighLevelGraph`` or a plain dict in either Dask's task spec or legacy tuples) to
:func:`materialize`, which yields ``{key: GraphNode}`` and the per-key annotations; :func:`convert`
culls it to what the wanted keys need and returns one :class:`DaskTask` per node to run, in
dependency order, plus the tidepool key that holds each Dask key's value:

- a ``Task`` becomes a ``run_node`` task: the node pickled to bytes, its dependencies as refs;
- a ``DataNode`` becomes a ``data_value`` task carrying the value, except a tidepool ``Future``
  (what ``persist`` puts in a graph), which is that future's key and runs nothing;
- an ``Alias`` runs nothing: its key maps to its target's.

Annotations (``dask.annotate``) and the options given to ``get`` map onto tidepool's task options:
``resources``, ``retries``, ``priority``, ``workers`` and ``allow_other_workers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.comm.serialize import dumps
from tidepool.errors import ConfigError, CycleError, KeyCollisionError
from tidepool.futures import _INLINE_FUTURES, Future
from tidepool.graph.delayed import TaskOptions
from tidepool.graph.keys import key_name
from tidepool.graph.refs import Ref

#: Annotation (and ``get`` keyword) names that become task options; others are ignored, as Dask does.
OPTION_NAMES = ("resources", "retries", "priority", "workers", "allow_other_workers")


@dataclass
class DaskTask:
    """One tidepool task for one Dask node: ``fn(*args)`` under ``key`` with ``options``."""

    key: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    options: TaskOptions


@dataclass
class Converted:
    tasks: list[DaskTask] = field(default_factory=list)
    #: every Dask key reached -> the tidepool key whose value it is
    names: dict[Hashable, str] = field(default_factory=dict)
    #: tidepool key -> the future the graph holds for it (what ``persist`` put there)
    futures: dict[str, Future[Any]] = field(default_factory=dict)


def require_dask() -> Any:
    """Import Dask, or say how to get it."""
    try:
        import dask
    except ImportError:
        raise ConfigError(
            "running Dask collections on tidepool needs Dask: pip install 'tidepool[dask]'"
        ) from None
    return dask


def _has_layer_annotations(expr: Any) -> bool:
    """True if any high-level layer under ``expr`` carries annotations (``dask.annotate``).

    Looks only at types and raw operands: an expression's other attributes may compute its
    metadata (a dataframe's ``_meta``), which can raise or be slow, and must not run here."""
    from dask._expr import Expr
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    stack = [expr]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, HighLevelGraph):
            if any(layer.annotations for layer in e.layers.values()):
                return True
        elif isinstance(e, Expr):
            stack.extend(e.operands)
        elif isinstance(e, Delayed):
            stack.append(e.__dask_graph__())
        elif isinstance(e, (list, tuple)):
            stack.extend(e)
    return False


def materialize(dsk: Any) -> tuple[dict[Hashable, Any], dict[str, dict[Hashable, Any]]]:
    """``{key: GraphNode}`` and ``{annotation: {key: value}}`` for any graph Dask hands a scheduler.

    Dask's low-level fusion drops annotations; when a graph has any, it is materialised without
    that fusion, so annotated blocks keep their resources (Dask's distributed loses them there).
    """
    dask = require_dask()
    from dask._task_spec import convert_legacy_graph
    from dask.highlevelgraph import HighLevelGraph

    annotations: dict[str, dict[Hashable, Any]] = {}
    graph: Mapping[Hashable, Any]
    if isinstance(dsk, HighLevelGraph):
        for layer in dsk.layers.values():
            for name, value in (layer.annotations or {}).items():
                annotations.setdefault(name, {}).update(
                    {k: value(k) if callable(value) else value for k in layer}
                )
        graph = {k: v for k, v in dsk.items()}  # noqa: C416 - typed for mypy
    elif isinstance(dsk, Mapping):
        graph = dsk
    elif hasattr(dsk, "__dask_graph__"):
        keep = None
        source = dsk
        if _has_layer_annotations(dsk):
            keep = dask.config.set({"optimization.fuse.active": False})
            source = _without_bag_fusion(dsk)
        with keep or contextlib.nullcontext():
            graph = dict(source.__dask_graph__())
            annotations = dict(source.__dask_annotations__())
        if source is not dsk:  # its final keys are named by its content: the keys asked for point at them
            from dask._task_spec import Alias

            for asked, made in zip(flatten_keys(dsk.__dask_keys__()), flatten_keys(source.__dask_keys__()),
                                   strict=True):  # fmt: skip
                if asked != made and asked not in graph:
                    graph[asked] = Alias(asked, made)  # type: ignore[arg-type]
    else:
        raise ConfigError(f"get() needs a Dask graph (a dict, a HighLevelGraph or an expression), got {type(dsk).__name__}")
    return convert_legacy_graph(graph), annotations


def _without_bag_fusion(expr: Any) -> Any:
    """``expr`` with the low-level optimiser of every ``dask.bag`` in it switched off, run instead
    of it: a bag's optimiser fuses its graph as a plain dict whatever the fuse setting, which drops
    the annotations (an annotated bag's tasks ran on any worker, a GPU one on a CPU worker).  Its
    final keys are not the ones asked for (an expression is named by its content's token)."""
    from dask._expr import Expr, HLGExpr

    if isinstance(expr, HLGExpr):
        inner = expr.operand("dsk")
        if isinstance(inner, HLGExpr):
            expr = expr.substitute_parameters({"dsk": _without_bag_fusion(inner)})
        opt = expr.operand("low_level_optimizer")
        # only a bag whose own layers are annotated: the others keep their fusion
        if (opt is not None and str(getattr(opt, "__module__", "")).startswith("dask.bag")
                and _has_layer_annotations(expr.operand("dsk"))):  # fmt: skip
            expr = expr.substitute_parameters({"low_level_optimizer": None})
        return expr
    if isinstance(expr, Expr):
        ops = [_without_bag_fusion(o) if isinstance(o, Expr)
               else [_without_bag_fusion(x) for x in o] if isinstance(o, list) else o
               for o in expr.operands]  # fmt: skip
        if any(a is not b for a, b in zip(ops, expr.operands, strict=True)):
            return type(expr)(*ops)
    return expr


class _Options:
    """TaskOptions per (name, annotation values), made once each."""

    def __init__(self, annotations: Mapping[str, Mapping[Hashable, Any]], defaults: Mapping[str, Any]) -> None:
        self.annotations = {n: annotations[n] for n in OPTION_NAMES if annotations.get(n)}
        self.defaults = defaults
        self.cache: dict[tuple[Any, ...], TaskOptions] = {}

    def __call__(self, key: Hashable, name: str) -> TaskOptions:
        values = dict(self.defaults)
        for n, per_key in self.annotations.items():
            if key in per_key:
                values[n] = per_key[key]
        ident = (name, repr(sorted(values.items())))
        opts = self.cache.get(ident)
        if opts is None:
            workers = values.get("workers")
            if workers is not None and not isinstance(workers, str):
                workers = list(workers)
            try:
                opts = TaskOptions(values.get("resources"), values.get("retries") or 0, name,
                                   priority=int(values.get("priority") or 0), workers=workers,
                                   loose=bool(values.get("allow_other_workers")))  # fmt: skip
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"task {key!r}: bad task options {values!r}: {exc}") from None
            self.cache[ident] = opts
        return opts


def _key_split(key: Hashable) -> str:
    from dask.utils import key_split

    return str(key_split(key))


def convert(graph: Mapping[Hashable, Any], keys: list[Hashable], client: Any,
            annotations: Mapping[str, Mapping[Hashable, Any]] | None = None,
            defaults: Mapping[str, Any] | None = None) -> Converted:  # fmt: skip
    """The tidepool tasks that compute ``keys`` of ``graph`` (see the module docstring)."""
    from dask._task_spec import Alias, DataNode

    from tidepool.dask.run import data_value, run_node

    options = _Options(annotations or {}, defaults or {})
    out = Converted()
    names = out.names
    owner: dict[str, Hashable] = {}  # tidepool key -> the Dask key it names

    def name_of(k: Hashable) -> str:
        # Dask keys 1 and "1", or ("x", 0) and "('x', 0)", are two tasks; the scheduler's names of
        # them are one (graph/keys.py): one task would silently take the other's place
        tk = key_name(k)
        first = owner.setdefault(tk, k)
        if first is not k and first != k:  # equal keys are one Dask key (1 and 1.0, as a dict sees them)
            raise KeyCollisionError(f"the Dask keys {first!r} and {k!r} are different tasks with the same "
                                    f"scheduler key {tk!r}; rename one of them")  # fmt: skip
        return tk
    # iterative post-order walk: dependencies first
    for root in keys:
        if root in names:
            continue
        if root not in graph:
            raise ConfigError(f"key {root!r} is not in the Dask graph given to get()")
        stack: list[tuple[Hashable, bool]] = [(root, False)]
        open_: set[Hashable] = set()
        while stack:
            k, expanded = stack.pop()
            if k in names:
                continue
            node = graph[k]
            deps = node.dependencies
            if not expanded:
                if k in open_:
                    raise CycleError(f"the Dask graph has a cycle through {k!r}; a task cannot depend on its own result")
                open_.add(k)
                stack.append((k, True))
                for d in deps:
                    if d not in names:
                        if d not in graph:
                            raise ConfigError(f"Dask task {k!r} depends on {d!r}, which is not in the graph")
                        if d in open_:
                            raise CycleError(f"the Dask graph has a cycle through {d!r}; a task cannot depend on its own result")
                        stack.append((d, False))
                continue
            open_.discard(k)
            if isinstance(node, Alias):
                names[k] = names[next(iter(deps))]
                continue
            if isinstance(node, DataNode):
                value = node.value
                if isinstance(value, Future):
                    if value.client is not client:
                        raise ConfigError(f"future {value.key} in the Dask graph belongs to another client")
                    names[k] = value.key
                    out.futures[value.key] = value
                    continue
                tk = name_of(k)
                names[k] = tk
                out.tasks.append(DaskTask(tk, data_value, (value,), options(k, _key_split(k))))
                continue
            held: tuple[Any, list[str]] = (client, [])
            token = _INLINE_FUTURES.set(held)
            try:
                blob = dumps(node)
            finally:
                _INLINE_FUTURES.reset(token)
            values = {d: Ref(names[d]) for d in deps}
            inline = {fk: Ref(fk) for fk in dict.fromkeys(held[1])}
            tk = name_of(k)
            names[k] = tk
            out.tasks.append(DaskTask(tk, run_node, (blob, values, inline), options(k, _key_split(k))))
    return out


def flatten_keys(keys: Any) -> list[Hashable]:
    """The keys in Dask's nested key lists, in order."""
    out: list[Hashable] = []
    stack = [keys]
    while stack:
        k = stack.pop()
        if isinstance(k, list):
            stack.extend(reversed(k))
        else:
            out.append(k)
    return out


def pack(keys: Any, values: Mapping[Hashable, Any]) -> Any:
    """Results in the shape of ``keys``: a key's value, or a tuple per (nested) list, as Dask's
    own schedulers return them."""
    if isinstance(keys, list):
        return tuple(pack(k, values) for k in keys)
    return values[keys]


__all__ = ["Converted", "DaskTask", "OPTION_NAMES", "convert", "flatten_keys", "materialize", "pack",
           "require_dask"]  # fmt: skip
