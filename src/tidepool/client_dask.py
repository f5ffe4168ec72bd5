"""The part of the client that Dask users reach for, under Dask's names (a mixin of ``Client``).

Stateless helpers over the client's request channel: ``scatter``, ``run``, ``upload_file``,
``restart``, ``who_has``/``has_what``, ``wait_for_workers``, ``persist`` and ``fire_and_forget``.
Differences from Dask are on purpose and listed in docs/dask-users.md: ``scatter`` routes data
through the scheduler once (the scattered value is a task whose result is that value, so a copy
lost with a worker is restored from it instead of being lost), and ``restart`` re-executes worker
processes started by ``tidepool worker`` (others just stop).
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidepool.comm import serialize
from tidepool.errors import ConfigError, RemoteTraceback, SchedulerError
from tidepool.graph.refs import collect

if TYPE_CHECKING:
    from tidepool.futures import Future
    from tidepool.loop import LoopThread


def _identity_value(x: Any) -> Any:
    return x


class DaskAPI:
    """Mixed into :class:`tidepool.Client`; see the module docstring."""

    if TYPE_CHECKING:  # what the mixin uses of Client (declared for the type checker only)
        _loop: LoopThread
        _futures: Any
        timeout: float

        async def _request(self, msg: dict[str, Any]) -> Any: ...
        def _check_open(self) -> None: ...
        def _post(self, msg: dict[str, Any]) -> None: ...
        def _register_spec(self, nm: str, spec: Any) -> dict[str, str]: ...
        def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]: ...
        def compute(self, collection: Any, *, progress: bool = False) -> Any: ...
        def _dask_persist(self, collections: list[Any], optimize_graph: bool, options: dict[str, Any]) -> list[Any]: ...

    def _call(self, msg: dict[str, Any], timeout: float | None = None) -> Any:
        self._check_open()
        return self._loop.run(self._request(msg), timeout=timeout)

    # ---- data ----------------------------------------------------------------------------------
    def scatter(self, data: Any, *, broadcast: bool = False, hash: bool = True,  # noqa: A002 - Dask's name
                workers: str | Iterable[str] | None = None) -> Any:
        """Put local data on the cluster: a future per value, in the same structure as ``data``
        (a value, or a list/tuple/dict of values).  ``broadcast=True`` copies each value to every
        worker; ``hash=True`` names values by their content, so scattering equal data twice shares it.
        """
        def one(value: Any) -> Future[Any]:  # noqa: F821
            key = None
            if hash:
                blob = serialize(value)
                h = hashlib.blake2b(bytes(blob.data), digest_size=12)
                for b in blob.buffers:
                    h.update(b)
                key = f"{type(value).__name__}-{h.hexdigest()}"
            return self.submit(_identity_value, value, key=key, workers=workers, allow_other_workers=False)

        if isinstance(data, (list, tuple)):
            futs: Any = type(data)(one(v) for v in data)
        elif isinstance(data, dict):
            futs = {k: one(v) for k, v in data.items()}
        else:
            futs = one(data)
        if broadcast:
            flat: list[Any] = collect(futs, _future_type())
            from tidepool.waiting import wait

            wait(flat, timeout=self.timeout)
            self._post({"op": "broadcast", "keys": [f.key for f in flat]})
        return futs

    def who_has(self, futures: Any = None) -> dict[str, list[str]]:
        """Key -> addresses of the workers holding its value (every key the client holds if None)."""
        if futures is None:
            keys = list(self._futures.keys())
        else:
            keys = [f.key for f in collect(futures, _future_type())]  # type: ignore[var-annotated]
        return {k: v or [] for k, v in self._call({"op": "who-has", "keys": keys}).items()}

    def has_what(self) -> dict[str, list[str]]:
        """Worker address -> keys of the values it holds."""
        return self._call({"op": "has-what"})  # type: ignore[no-any-return]

    def persist(self, collection: Any, optimize_graph: bool = True, **options: Any) -> Any:
        """Start computing the lazy values in ``collection`` and keep their results on the workers.

        Tidepool delayed values: returns the same structure with each replaced by its future
        (tidepool futures are what Dask calls persisted values: pass them to later tasks and
        nothing is recomputed).  Dask collections (one, or a list/tuple of them): returns the same
        collections with graphs that point at the computed chunks, so later computations reuse
        them; ``options`` (``resources``, ``retries``, ``priority``, ...) apply to their tasks.
        """
        from tidepool.dask.client import dask_call

        call = dask_call(collection, options, "persist()")
        if call is not None:
            items, opts, repack = call
            return repack(self._dask_persist(items, optimize_graph, opts))
        return self.compute(collection)

    def fire_and_forget(self, futures: Any) -> None:
        """Let these tasks run to the end even if every future of them is dropped."""
        keys = [f.key for f in collect(futures, _future_type())]  # type: ignore[var-annotated]
        if keys:
            self._check_open()
            self._post({"op": "fire-and-forget", "keys": keys})

    # ---- workers ---------------------------------------------------------------------------------
    def run(self, function: Callable[..., Any], *args: Any, workers: Iterable[str] | None = None,
            on_error: str = "raise", **kwargs: Any) -> dict[str, Any]:  # fmt: skip
        """Call ``function(*args, **kwargs)`` on every worker (or ``workers``), now, outside the
        task graph; returns worker address -> result.  ``on_error``: "raise" (the first error),
        or "return" (the exception in place of the result)."""
        if on_error not in ("raise", "return"):
            raise ConfigError("on_error must be 'raise' or 'return'")
        msg = {"op": "run", "function": serialize(function), "args": serialize((args, kwargs)),
               "workers": list(workers) if workers is not None else None}  # fmt: skip
        replies = self._call(msg)
        out: dict[str, Any] = {}
        for addr, r in replies.items():
            if r.get("ok"):
                out[addr] = r["value"].load()
                continue
            exc = _run_error(addr, r)
            if on_error == "raise":
                raise exc
            out[addr] = exc
        return out

    def upload_file(self, path: str) -> dict[str, str]:
        """Send a ``.py`` module, a ``.zip``/``.egg`` of modules, or any other file to every worker,
        now and joining later.  Modules become importable (a ``.py`` is imported at once); other
        files are read with ``tidepool.setup_file(name)``."""
        from tidepool.setup import SetupSpec

        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"upload_file({path!r}): {exc}") from exc
        if p.suffix == ".py":
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as zf:
                zf.writestr(p.name, data)
            spec = SetupSpec(f"upload-{p.name}", archive=buf.getvalue(), modules=[p.stem])
        elif p.suffix in (".zip", ".egg"):
            spec = SetupSpec(f"upload-{p.name}", archive=data)
        else:
            spec = SetupSpec(f"upload-{p.name}", files={p.name: data})
        return self._register_spec(spec.name, spec)

    def restart(self, timeout: float = 30.0) -> int:
        """Forget all tasks (every future fails with TaskCancelledError) and restart the workers;
        wait up to ``timeout`` for as many to come back.  Returns how many came back."""
        res = self._call({"op": "restart", "timeout": timeout}, timeout=timeout + 10)
        return int(res["workers"])

    def wait_for_workers(self, n_workers: int = 1, timeout: float | None = None) -> None:
        """Block until at least ``n_workers`` workers are running (TimeoutError after ``timeout``)."""
        if not isinstance(n_workers, int) or n_workers < 0:
            raise ConfigError(f"n_workers must be a non-negative integer, got {n_workers!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.02
        while True:
            info = self._call({"op": "info"})
            running = sum(1 for w in info["workers"] if w["state"] == "running")
            if running >= n_workers:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{running} of {n_workers} workers after {timeout}s")
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(0.5, pause * 2)


def _future_type() -> type:
    from tidepool.futures import Future

    return Future


def _run_error(addr: str, r: dict[str, Any]) -> BaseException:
    blob = r.get("exception")
    if blob is not None:
        try:
            exc = blob.load()
            if isinstance(exc, BaseException):
                if r.get("traceback"):
                    exc.__cause__ = RemoteTraceback(r["traceback"])
                return exc
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return SchedulerError(f"run on {addr} failed: {r.get('error', 'unknown error')}")


def fire_and_forget(futures: Any) -> None:
    """Run these tasks to the end even if their futures are dropped (Dask's ``fire_and_forget``)."""
    flat: list[Any] = collect(futures, _future_type())
    by_client: dict[int, tuple[Any, list[Any]]] = {}
    for f in flat:
        by_client.setdefault(id(f.client), (f.client, []))[1].append(f)
    for client, futs in by_client.values():
        client.fire_and_forget(futs)


__all__ = ["DaskAPI", "fire_and_forget"]
