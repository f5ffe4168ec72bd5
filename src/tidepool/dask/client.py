"""The client's side of Dask collections (a mixin of ``Client``): Dask's scheduler protocol.

No state of its own: each call converts one Dask graph (``tidepool.dask.convert``), sends it as one
graph update through the client's ordered outbox, and either gathers the wanted keys (``get``),
returns futures (``compute``) or rebuilds the collections around futures (``persist``).

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
    """For ``compute``/``persist``: if ``collection`` is Dask collections (one, or a list/tuple of
    them), those, the checked ``options`` and how to give results back in its shape; otherwise
    None, after refusing ``options`` (tidepool tasks carry their own)."""
    many = isinstance(collection, (list, tuple))
    items = list(collection) if many else [collection]
    if items and all(is_dask_collection(c) for c in items):
        return items, _check_options(options, where), (lambda out: type(collection)(out) if many else out[0])
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


class DaskCollections:
    """Mixed into :class:`tidepool.Client`; see the module docstring."""

    #: Dask asks this before it uses a Client-like object as its scheduler.
    asynchronous = False

    if TYPE_CHECKING:
        def _spec(self, key: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], opts: Any,
                  functions: dict[str, Any], extra: Any) -> list[Any]: ...  # fmt: skip
        def _new_future(self, key: str) -> Future[Any]: ...
        def _send_graph(self, tasks: list[list[Any]], wanted: list[str], functions: dict[str, Any]) -> None: ...
        def gather(self, futures: Any, errors: str = "raise", timeout: float | None = None) -> Any: ...

    def _submit_dask(self, dsk: Any, keys: list[Hashable], options: dict[str, Any]) -> dict[Hashable, Future[Any]]:
        """Send the part of ``dsk`` that ``keys`` need; returns Dask key -> future."""
        graph, annotations = materialize(dsk)
        conv = convert(graph, keys, self, annotations, options)
        functions: dict[str, Any] = {}
        specs = [self._spec(t.key, t.fn, t.args, {}, t.options, functions, None) for t in conv.tasks]
        futs = {k: self._new_future(conv.names[k]) for k in keys}
        self._send_graph(specs, list(dict.fromkeys(f.key for f in futs.values())), functions)
        return futs

    def get(self, dsk: Any, keys: Any, *, progress: bool = False, **options: Any) -> Any:
        """Dask's scheduler protocol: compute ``keys`` (a key or nested lists of keys) of the Dask
        graph ``dsk`` on the cluster and return their values in the same shape (lists as tuples).

        ``options`` apply to every task, under the annotations of ``dask.annotate``:
        ``resources``, ``retries``, ``priority``, ``workers``, ``allow_other_workers``.
        Dask keys stay the task keys (a tuple key as ``str(key)``), so errors, progress and the
        journal name them as Dask does.  ``progress=True`` draws a progress bar.
        """
        opts = _check_options(options, "get()")
        flat = list(dict.fromkeys(flatten_keys(keys)))
        futs = self._submit_dask(dsk, flat, opts)
        if progress:
            from tidepool.telemetry.progress import show_progress

            show_progress(self, list(futs.values()))  # type: ignore[arg-type]
        values = dict(zip(futs, self.gather(list(futs.values())), strict=True))
        return pack(keys, values)

    def as_dask_scheduler(self) -> Any:
        """``with client.as_dask_scheduler():`` makes this client Dask's scheduler, so plain
        ``x.compute()``, ``x.persist()`` and ``dask.compute(...)`` run here (Dask's own
        ``dask.config.set(scheduler=...)``; without ``with`` it stays set)."""
        dask = require_dask()
        return dask.config.set(scheduler=self.get)

    def _dask_persist(self, collections: list[Any], optimize_graph: bool, options: dict[str, Any]) -> list[Any]:
        """Dask collections whose graphs point at futures of their computed chunks."""
        require_dask()
        from dask.base import collections_to_expr

        expr = collections_to_expr(collections, optimize_graph).optimize()
        keys = expr.__dask_keys__()
        futs = self._submit_dask(expr, list(dict.fromkeys(flatten_keys(keys))), options)
        out = []
        for c, ks in zip(collections, keys, strict=True):
            rebuild, state = c.__dask_postpersist__()
            out.append(rebuild({k: futs[k] for k in flatten_keys(ks)}, *state))
        return out

    def _dask_compute(self, collections: list[Any], optimize_graph: bool, options: dict[str, Any]) -> list[Future[Any]]:
        """A future per collection, of its final value (what ``x.compute()`` would return)."""
        require_dask()
        from dask._expr import FinalizeCompute
        from dask.base import collections_to_expr

        out = []
        for c in collections:  # one finalized expression each: one key each
            expr = FinalizeCompute(collections_to_expr([c], optimize_graph)).optimize()
            (key,) = flatten_keys(expr.__dask_keys__())
            out.append(self._submit_dask(expr, [key], options)[key])
        return out


__all__ = ["DaskCollections", "is_dask_collection"]
