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

import contextlib
import logging
import sys
from collections.abc import Callable, Hashable, Iterator
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


def submit_graph(client: Any, dsk: Any, keys: list[Hashable], options: dict[str, Any],
                 graph_keys: list[str] | None = None) -> dict[Hashable, Future[Any]]:  # fmt: skip
    """Send the part of ``dsk`` that ``keys`` need (one graph update); returns Dask key -> future.
    ``graph_keys``, if given, gets the key of every task sent (what a progress bar counts)."""
    graph, annotations = materialize(dsk)
    check_shuffle_storage(client, graph)
    conv = convert(graph, keys, client, annotations, options)
    nodes: dict[str, Any] = dict(conv.futures)  # tidepool key -> its Delayed (or the future it names)

    def link(x: Any) -> Any:
        if isinstance(x, Ref):
            return nodes.get(x.key, x)
        return RECURSE

    for t in conv.tasks:  # dependencies first: every input is in ``nodes`` already
        # explicit: a Dask key is the user's name (dask_key_name, a graph dict), reused from one
        # compute to the next; a dropped earlier task under it is released before this one is sent
        nodes[t.key] = Delayed(t.key, t.fn, replace(t.args, link), {}, t.options, explicit=True)
    if graph_keys is not None:
        graph_keys.extend(t.key for t in conv.tasks)
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
    sent: list[str] = []
    futs = submit_graph(client, dsk, flat, opts, sent)
    _secede_if_in_a_task()
    if progress:
        from tidepool.telemetry.progress import show_progress

        show_progress(client, list(futs.values()), graph_keys=sent)
    values = dict(zip(futs, client.gather(list(futs.values())), strict=True))
    return pack(keys, values)


def persist_collections(client: Any, collections: list[Any], optimize_graph: bool,
                        options: dict[str, Any]) -> list[Any]:  # fmt: skip
    """Dask collections whose graphs point at futures of their computed chunks."""
    require_dask()
    from dask.base import collections_to_expr

    with tasks_shuffle():
        expr = collections_to_expr(collections, optimize_graph).optimize()
    keys = expr.__dask_keys__()
    futs = submit_graph(client, expr, list(dict.fromkeys(flatten_keys(keys))), options)
    out = []
    for c, ks in zip(collections, keys, strict=True):
        rebuild, state = c.__dask_postpersist__()
        out.append(rebuild({k: futs[k] for k in flatten_keys(ks)}, *state))
    return out


def compute_collections(client: Any, collections: list[Any], optimize_graph: bool,
                        options: dict[str, Any], graph_keys: list[str] | None = None) -> list[Future[Any]]:  # fmt: skip
    """A future per collection, of its final value (what ``x.compute()`` would return);
    ``graph_keys`` as in :func:`submit_graph`."""
    require_dask()
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    out = []
    with tasks_shuffle():
        for c in collections:  # one finalized expression each: one key each
            expr = FinalizeCompute(collections_to_expr([c], optimize_graph)).optimize()
            (key,) = flatten_keys(expr.__dask_keys__())
            out.append(submit_graph(client, expr, [key], options, graph_keys)[key])
    return out


def _secede_if_in_a_task() -> None:
    """Called from inside a task (``x.compute(scheduler=get_client())``): give the slot back
    before waiting, as Dask's ``Client.get`` does; else a task waiting for tasks that need its
    slot would wait for ever."""
    from tidepool.worker import context

    if context.current_task() is not None and context._worker is not None:
        context.secede()


#: shuffles that write through a worker's local disk (partd): keys of their storage tasks
_PARTD_PREFIXES = ("zpartd-", "partd-")


def prefer_tasks_shuffle() -> None:
    """Make Dask's default shuffle ``"tasks"`` unless the user chose one, as a Dask distributed
    client does while it exists (Dask otherwise picks ``"disk"``: files in each worker's own
    temporary directory, which workers on other hosts never see).  Only if Dask is imported."""
    dask = sys.modules.get("dask")
    config = getattr(dask, "config", None)
    if config is not None and config.get("dataframe.shuffle.method", None) is None:
        config.set({"dataframe.shuffle.method": "tasks"})


@contextlib.contextmanager
def tasks_shuffle() -> Iterator[None]:
    """While optimizing a collection for tidepool: the ``"tasks"`` shuffle unless the user chose one."""
    import dask

    if dask.config.get("dataframe.shuffle.method", None) is None:
        with dask.config.set({"dataframe.shuffle.method": "tasks"}):
            yield
    else:
        yield


def check_shuffle_storage(client: Any, graph: dict[Any, Any]) -> None:
    """Refuse a graph that shuffles through local disk (``shuffle_method="disk"``, or a bag's
    ``groupby`` built while Dask's default was ``"disk"``) when the workers are on more than one
    host: each would write its pieces where the others never read them, and rows would be lost
    without an error."""
    partd = next((k for k in graph if _name(k).startswith(_PARTD_PREFIXES)), None)
    if partd is None:
        return
    hosts = {_host(w.get("address", "")) for w in client.scheduler_info().get("workers", [])}
    if len(hosts) > 1:
        raise ConfigError(
            f"this Dask graph shuffles through each worker's local disk ({_name(partd)!r}: "
            f"shuffle_method='disk', or a bag groupby built before a tidepool client existed), and the "
            f"workers are on {len(hosts)} hosts that do not share it: rows would be lost. Use "
            "shuffle_method='tasks' (bags: groupby(..., shuffle='tasks')), or set "
            "dask.config.set({'dataframe.shuffle.method': 'tasks'}) before building the collection")  # fmt: skip


def _name(key: Any) -> str:
    return str(key[0] if isinstance(key, tuple) and key else key)


def _host(address: str) -> str:
    """The host part of a worker address (``tcp://10.0.0.2:4000`` -> ``10.0.0.2``)."""
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


__all__ = ["check_shuffle_storage", "compute_collections", "dask_call", "get", "is_dask_collection",
           "persist_collections", "prefer_tasks_shuffle", "submit_graph", "tasks_shuffle"]
