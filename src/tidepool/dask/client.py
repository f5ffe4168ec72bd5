"""The client's side of Dask collections: Dask's scheduler protocol, on the client's public API.

No state of its own: each call converts one Dask graph (``tidepool.dask.convert``) into tidepool
delayed values and submits them with one ``client.compute(...)`` (one graph update), then either
gathers the wanted keys (``get``), returns futures (``compute``) or rebuilds the collections around
futures (``persist``).  :class:`~tidepool.Client` delegates its Dask calls here; nothing here
touches the client's private state, so any object with ``compute`` and ``gather`` would do.

``client.get(dsk, keys, **options)`` is what Dask calls a scheduler, so ``x.compute(scheduler=
client.get)``, ``dask.compute(x, scheduler=client)`` and, inside ``with client.as_dask_scheduler():``,
plain ``x.compute()`` / ``x.persist()`` / ``dask.compute(...)`` run on tidepool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from tidepool.dask.convert import (
    OPTION_NAMES,
    convert,
    flatten_keys,
    materialize,
    pack,
    require_dask,
)
from tidepool.errors import ConfigError
from tidepool.graph.delayed import Delayed
from tidepool.graph.refs import RECURSE, Ref, replace

if TYPE_CHECKING:
    from tidepool.futures import Future


_log = logging.getLogger(__name__)
#: option names already reported as ignored (each is logged once per process)
_IGNORED: set[str] = set()


def _check_options(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """The options tidepool applies to Dask tasks (``OPTION_NAMES``, None dropped).  Others are
    ignored, as Dask's own schedulers and distributed ignore what they do not use (Dask forwards
    ``compute(num_workers=4, ...)`` to every scheduler); each is logged once at debug level."""
    unknown = sorted(set(kwargs) - set(OPTION_NAMES) - _IGNORED)
    if unknown:
        _IGNORED.update(unknown)
        _log.debug("%s ignores option(s) %s; tidepool applies %s to Dask tasks", where, ", ".join(unknown),
                   ", ".join(OPTION_NAMES))  # fmt: skip
    return {k: v for k, v in kwargs.items() if k in OPTION_NAMES and v is not None}


def dask_call(collection: Any, options: dict[str, Any], where: str
              ) -> tuple[list[Any], dict[str, Any], Callable[[list[Any]], Any]] | None:  # fmt: skip
    """For ``compute``/``persist``: if ``collection`` is a Dask collection, or a list, tuple or dict
    holding at least one (other entries are plain values, given back as they are, as Dask does),
    those collections, the checked ``options`` and how to give results back in its shape;
    otherwise None, after refusing ``options`` (tidepool tasks carry their own)."""
    from tidepool.graph.delayed import Delayed
    from tidepool.graph.refs import collect

    rebuild: Callable[[list[Any]], Any]
    if isinstance(collection, dict):
        names = list(collection)
        values = list(collection.values())
        rebuild = lambda vals: type(collection)(zip(names, vals, strict=True))  # noqa: E731
    elif isinstance(collection, (list, tuple)):
        values = list(collection)
        rebuild = lambda vals: type(collection)(vals)  # noqa: E731
    else:
        values = [collection]
        rebuild = lambda vals: vals[0]  # noqa: E731
    at = [i for i, v in enumerate(values) if is_dask_collection(v)]
    if at:
        others = [v for i, v in enumerate(values) if i not in set(at)]
        if collect(others, Delayed):
            raise ConfigError(f"{where} got Dask collections and tidepool delayed values together; "
                              "compute them in two calls")  # fmt: skip

        def repack(out: list[Any]) -> Any:
            vals = list(values)
            for i, o in zip(at, out, strict=True):
                vals[i] = o
            return rebuild(vals)

        return [values[i] for i in at], _check_options(options, where), repack
    if options:
        raise ConfigError(f"{where} options {sorted(options)} apply to Dask collections only; "
                          "tidepool tasks carry their own (@task(resources=...), .options())")  # fmt: skip
    return None


def is_dask_collection(x: Any) -> bool:
    """True for a Dask collection (array, dataframe, bag, delayed); never imports Dask itself."""
    import sys

    dask = sys.modules.get("dask")
    if dask is None or not hasattr(x, "__dask_graph__"):
        return False
    return bool(dask.is_dask_collection(x))


def submit_graph(client: Any, dsk: Any, keys: list[Hashable], options: dict[str, Any]) -> dict[Hashable, Future[Any]]:
    """Send the part of ``dsk`` that ``keys`` need (one graph update); returns Dask key -> future."""
    graph, annotations = materialize(dsk)
    conv = convert(graph, keys, client, annotations, options)
    nodes: dict[str, Any] = dict(conv.futures)  # tidepool key -> its Delayed (or the future it names)

    def link(x: Any) -> Any:
        if isinstance(x, Ref):
            return nodes.get(x.key, x)
        return RECURSE

    for t in conv.tasks:  # dependencies first: every input is in ``nodes`` already
        nodes[t.key] = Delayed(t.key, t.fn, replace(t.args, link), {}, t.options)
    wanted = list(dict.fromkeys(conv.names[k] for k in keys))
    roots = [nodes[n] for n in wanted if isinstance(nodes[n], Delayed)]
    done = dict(zip([r.key for r in roots], client.compute(roots), strict=True)) if roots else {}
    return {k: done[n] if (n := conv.names[k]) in done else nodes[n] for k in keys}


def get(client: Any, dsk: Any, keys: Any, *, progress: bool = False, **options: Any) -> Any:
    """Dask's scheduler protocol: compute ``keys`` (a key or nested lists of keys) of the Dask
    graph ``dsk`` on the cluster and return their values in the same shape (lists as tuples).

    ``options`` apply to every task, under the annotations of ``dask.annotate``:
    ``resources``, ``retries``, ``priority``, ``workers``, ``allow_other_workers``.
    Dask keys stay the task keys (a tuple key as ``str(key)``), so errors, progress and the
    journal name them as Dask does.  ``progress=True`` draws a progress bar.
    """
    opts = _check_options(options, "get()")
    flat = list(dict.fromkeys(flatten_keys(keys)))
    futs = submit_graph(client, dsk, flat, opts)
    if progress:
        from tidepool.telemetry.progress import show_progress

        show_progress(client, list(futs.values()))
    values = dict(zip(futs, client.gather(list(futs.values())), strict=True))
    return pack(keys, values)


def persist_collections(client: Any, collections: list[Any], optimize_graph: bool,
                        options: dict[str, Any]) -> list[Any]:  # fmt: skip
    """Dask collections whose graphs point at futures of their computed chunks."""
    require_dask()
    from dask.base import collections_to_expr

    expr = collections_to_expr(collections, optimize_graph).optimize()
    keys = expr.__dask_keys__()
    futs = submit_graph(client, expr, list(dict.fromkeys(flatten_keys(keys))), options)
    out = []
    for c, ks in zip(collections, keys, strict=True):
        rebuild, state = c.__dask_postpersist__()
        out.append(rebuild({k: futs[k] for k in flatten_keys(ks)}, *state))
    return out


def compute_collections(client: Any, collections: list[Any], optimize_graph: bool,
                        options: dict[str, Any]) -> list[Future[Any]]:  # fmt: skip
    """A future per collection, of its final value (what ``x.compute()`` would return)."""
    require_dask()
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    out = []
    for c in collections:  # one finalized expression each: one key each
        expr = FinalizeCompute(collections_to_expr([c], optimize_graph)).optimize()
        (key,) = flatten_keys(expr.__dask_keys__())
        out.append(submit_graph(client, expr, [key], options)[key])
    return out


__all__ = ["compute_collections", "dask_call", "get", "is_dask_collection", "persist_collections", "submit_graph"]
