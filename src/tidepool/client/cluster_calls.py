"""The Dask-named cluster calls of the client: data placement, introspection, setup, workers.

``scatter``, ``who_has``/``has_what``, ``fire_and_forget``, ``run``, ``upload_file``, ``restart``,
``wait_for_workers``, ``register_setup``, ``scheduler_info``, ``eta``, ``retire_workers``: each is
one request (or a few) over the client's connection, with no state of its own; :class:`ClusterCalls`
is the base of :class:`~tidepool.Client` that holds that connection.  Differences from Dask are on
purpose and listed in docs/dask-users.md: ``scatter`` routes data through the scheduler once (the
scattered value is a task whose result is that value, so a copy lost with a worker is restored from
it instead of being lost), and ``restart`` re-executes worker processes started by ``tidepool
worker`` (others just stop).
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidepool.client.connection import ClientConnection
from tidepool.comm import serialize
from tidepool.errors import ConfigError, RemoteTraceback, SchedulerError, WorkerSetupError
from tidepool.futures import Future
from tidepool.graph.refs import collect


def _identity_value(x: Any) -> Any:
    return x


class ClusterCalls:
    """The base of :class:`~tidepool.Client` that owns its connection; see the module docstring."""

    _connection: ClientConnection
    timeout: float

    if TYPE_CHECKING:
        def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]: ...

    # ---- introspection and setup -----------------------------------------------------------------
    def scheduler_info(self) -> dict[str, Any]:
        """Workers (running tasks, held keys/bytes, idle since), task counts and counters."""
        return self._call({"op": "info"})  # type: ignore[no-any-return]

    def nthreads(self) -> dict[str, int]:
        """Dask's ``nthreads()``: each worker's address -> how many tasks it runs at once."""
        return {w["address"]: max(1, int(w["resources"].get("cpu", 1))) for w in self.scheduler_info()["workers"]}

    def register_setup(self, fn: Callable[[], Any] | None = None, *, modules: Iterable[str] = (),
                       files: Iterable[str] = (), requirements: Iterable[str] = (),
                       env: dict[str, str] | None = None, name: str | None = None,
                       pip_args: Iterable[str] = (), timeout: float | None = None) -> dict[str, str]:  # fmt: skip
        """Prepare every worker, now and joining later, before it runs another task.

        ``modules``: local modules/packages to ship (importable on the workers afterwards);
        ``files``: local files (read them on a worker with ``tidepool.setup_file(name)``);
        ``requirements``: pip requirement strings installed on each worker; ``env``: environment
        variables; ``fn``: a function run last.  A setup with the same ``name`` replaces the
        earlier one for future workers.  Returns worker id -> "ok"; raises
        :class:`WorkerSetupError` (with the remote traceback) if it failed anywhere — such
        workers are closed and take no tasks.  ``timeout``: seconds to wait for the current
        workers (default: until each has run it); a worker still running it then is named in a
        :class:`WorkerSetupError` (it runs the setup to its end and takes no task until then).
        """
        check_seconds("register_setup: timeout", timeout)
        from tidepool.setup import build_spec

        spec = build_spec(name or "", fn, modules=modules, files=files, requirements=requirements, env=env,
                          pip_args=pip_args)  # fmt: skip
        if not name:  # named by what it does: two different setups never replace each other by chance
            # (two clients' "setup-1", two lambdas, two functions called init), the same one is kept once
            digest = hashlib.sha1(serialize(spec).data).hexdigest()[:10]  # noqa: S324 - a name, not security
            spec.name = f"{(getattr(fn, '__name__', None) if fn is not None else None) or 'setup'}-{digest}"
        return self._register_spec(spec.name, spec, timeout)

    def unregister_setup(self, name: str) -> None:
        """Workers that join from now on no longer run the setup ``name`` (as ``register_setup``
        named it, or as its :class:`WorkerSetupError` names it); workers that ran it keep what it
        did.  Raises :class:`ConfigError` if no setup has that name."""
        if not self._call({"op": "unregister-setup", "name": str(name)}):
            raise ConfigError(f"unregister_setup: no setup is registered as {name!r} (names are those "
                              f"register_setup(name=...) gave, or its error message shows)")  # fmt: skip

    def _register_spec(self, nm: str, spec: Any, timeout: float | None = None) -> dict[str, str]:
        self._connection.check_open()
        msg: dict[str, Any] = {"op": "register-setup", "name": nm, "setup": serialize(spec)}
        if timeout is not None:
            msg["timeout"] = float(timeout)
        result = self._call(msg)
        late = {w: r for w, r in result.items() if r.startswith("timeout:")}
        failed = {w: r for w, r in result.items() if r != "ok" and w not in late}
        if failed or late:
            parts = []
            if failed:
                parts.append(f"failed on {len(failed)} of {len(result)} workers (they were closed)")
            if late:
                parts.append(f"did not finish within {timeout:g} s on {len(late)} of {len(result)} workers "
                             f"(they run it to its end and take no task until then; retire them with "
                             f"client.retire_workers({sorted(late)!r}) if it never ends; drop it for later workers with client.unregister_setup({nm!r}))")  # fmt: skip
            details = "\n".join(f"--- worker {w}: {r}" for w, r in {**failed, **late}.items())
            raise WorkerSetupError(f"setup {nm!r} {' and '.join(parts)}; it is kept for workers that join "
                                   f"later:\n{details}")  # fmt: skip
        return result  # type: ignore[no-any-return]

    def _graph_progress(self, keys: list[str] | None, watch: int | None) -> dict[str, int]:
        """How many of a graph's tasks are done (for the progress bar): keys once, then the watch id."""
        msg: dict[str, Any] = {"op": "progress", "keys": keys} if keys is not None else {"op": "progress", "watch": watch}
        return self._call(msg)  # type: ignore[no-any-return]

    def _graph_progress_end(self, watch: int) -> None:
        self._connection.post({"op": "progress-end", "watch": watch})

    def eta(self) -> float | None:
        """Forecast seconds until everything submitted so far is done (None: no worker, no launch).

        At least max(remaining critical path, remaining work / slots), refined by simulating the
        scheduler on the workers present and those being launched.
        """
        res = self._call({"op": "eta"})
        return res["eta"]  # type: ignore[no-any-return]

    def retire_workers(self, workers: str | Iterable[str]) -> dict[str, str]:
        """Gracefully retire workers (ids, names or addresses; or one of them): their needed data
        moves to survivors first.

        Returns each worker as given -> ``"retired"``, ``"refused: <reason>"`` or ``"unknown worker"``.
        """
        if isinstance(workers, str):  # one worker (a string is not a list of one-letter ids)
            workers = [workers]
        return self._call({"op": "retire", "workers": list(workers)})  # type: ignore[no-any-return]


    # ---- Dask-named calls ---------------------------------------------------------------------
    def _call(self, msg: dict[str, Any], timeout: float | None = None) -> Any:
        return self._connection.call(msg, timeout)

    def scatter(self, data: Any, *, broadcast: bool = False, hash: bool = True,  # noqa: A002 - Dask's name
                workers: str | Iterable[str] | None = None) -> Any:
        """Put local data on the cluster: a future per value, in the same structure as ``data``
        (a value, or a list/tuple/dict of values).  ``broadcast=True`` copies each value to every
        worker; ``hash=True`` names values by their content, so scattering equal data twice shares it.
        """
        def one(value: Any) -> Future[Any]:
            key = None
            if hash:
                blob = serialize(value)
                h = hashlib.blake2b(bytes(blob.data), digest_size=12)
                for b in blob.buffers:
                    h.update(b)
                key = f"{type(value).__name__}-{h.hexdigest()}"
            # on ``workers`` while one of them is here; restored anywhere from the scheduler's copy once
            # they are all gone (strict, it waited for a dead worker, then failed)
            return self.submit(_identity_value, value, key=key, workers=workers, allow_other_workers=True)

        if isinstance(data, (list, tuple)):
            futs: Any = type(data)(one(v) for v in data)
        elif isinstance(data, dict):
            futs = {k: one(v) for k, v in data.items()}
        else:
            futs = one(data)
        if broadcast:
            self._copy_when_done(collect(futs, Future), 0, self.timeout)
        return futs

    def replicate(self, futures: Any, n: int | None = None, workers: Any = None) -> None:
        """Copy the values of ``futures`` (a future, or a list/tuple/dict of them) to every running
        worker, or (``n``) until each is held by ``n`` workers; waits until they are computed (as
        Dask does: no timeout), and the copies are made in the background.  Copies beyond ``n`` are not removed, and Dask's
        ``workers=`` is not supported (a ConfigError)."""
        if workers is not None:
            raise ConfigError("replicate(workers=...) is not supported by tidepool: copies go to every running "
                              "worker, or (n=) to the least loaded ones")  # fmt: skip
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"replicate(n=) takes a whole number of copies >= 1, got {n!r}")
        flat = futures_of(futures, "replicate()")
        if flat:
            self._copy_when_done(flat, n or 0, None)

    def _copy_when_done(self, futures: list[Any], copies: int, timeout: float | None) -> None:
        """Once ``futures`` are done (within ``timeout``), ask the scheduler to copy their values to
        every running worker (``copies`` 0) or until each is held ``copies`` times."""
        from tidepool.waiting import wait

        wait(futures, timeout=timeout)
        self._connection.post({"op": "broadcast", "keys": [f.key for f in futures], "copies": copies})

    def who_has(self, futures: Any = None) -> dict[str, list[str]]:
        """Key -> addresses of the workers holding its value (every key the client holds if None)."""
        if futures is None:
            keys = list(self._connection.core.futures.keys())
        else:
            keys = [f.key for f in futures_of(futures, "who_has()")]
        return {k: v or [] for k, v in self._call({"op": "who-has", "keys": keys}).items()}

    def has_what(self) -> dict[str, list[str]]:
        """Worker address -> keys of the values it holds."""
        return self._call({"op": "has-what"})  # type: ignore[no-any-return]

    def fire_and_forget(self, futures: Any) -> None:
        """Let these tasks run to the end even if every future of them is dropped."""
        keys = [f.key for f in futures_of(futures, "fire_and_forget()")]
        if keys:
            self._connection.check_open()
            self._connection.post({"op": "fire-and-forget", "keys": keys})

    # ---- workers ---------------------------------------------------------------------------------
    def run(self, function: Callable[..., Any], *args: Any, workers: Iterable[str] | None = None,
            on_error: str = "raise", **kwargs: Any) -> dict[str, Any]:  # fmt: skip
        """Call ``function(*args, **kwargs)`` on every worker (or ``workers``: ids, names or addresses,
        or one of them; an unknown one is an error), now, outside the task graph; returns worker
        address -> result.  ``on_error``: "raise" (the first error),
        or "return" (the exception in place of the result)."""
        if on_error not in ("raise", "return"):
            raise ConfigError("on_error must be 'raise' or 'return'")
        if isinstance(workers, str):  # one worker (a string is not a list of one-letter names)
            workers = [workers]
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


def futures_of(x: Any, call: str = "futures_of()") -> list[Any]:
    """The futures in ``x`` (a future, or a list/tuple/dict of them), or those a persisted Dask
    collection's graph points at (Dask's ``futures_of``; ``tidepool.futures_of(x)``)."""
    if callable(getattr(x, "__dask_graph__", None)):
        from tidepool.waiting import futures_in

        return futures_in(x, call)
    if isinstance(x, (list, tuple, set, frozenset)):  # [x, y] of collections and futures, as Dask takes it
        return [f for v in x for f in futures_of(v, call)]
    if isinstance(x, dict):
        return [f for v in x.values() for f in futures_of(v, call)]
    return collect(x, Future)


def fire_and_forget(futures: Any) -> None:
    """Run these tasks to the end even if their futures are dropped (Dask's ``fire_and_forget``)."""
    flat = futures_of(futures, "fire_and_forget()")
    by_client: dict[int, tuple[Any, list[Any]]] = {}
    for f in flat:
        by_client.setdefault(id(f.client), (f.client, []))[1].append(f)
    for client, futs in by_client.values():
        client.fire_and_forget(futs)


__all__ = ["ClusterCalls", "fire_and_forget", "futures_of"]


def check_seconds(what: str, value: Any) -> None:
    """Refuse a timeout argument that is not None or a number of seconds > 0 (``what`` names it)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"{what} must be a number of seconds > 0 or None, got {value!r}")
