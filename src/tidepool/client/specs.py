"""Task specs: a call (function, arguments, options) turned into what a graph update carries.

State: the function cache (id of a function pickled by reference -> weak reference, content hash
and pickle: pickled once while it lives, and never kept alive by the cache; anything pickled by
value is pickled again per call, since its state may change).  Which
functions the scheduler has already (``sent_funcs``) and which explicit keys are live
(``idents``) belong to the core (:class:`~tidepool.client.protocol.ClientProtocol`); the builder
reads them under the shell's lock.

Data flow: ``submit``/``map``/``compute`` call :meth:`SpecBuilder.spec` per task (arguments pickled
in the calling thread, futures and delayed values among them turned into dependency references)
and :meth:`SpecBuilder.delayed_specs` for the graphs behind delayed values (dependencies first);
:func:`check_acyclic` refuses a batch that depends on itself.  A spec is the wire record of
:class:`~tidepool.comm.messages.TaskSpec`.
"""

from __future__ import annotations

import hashlib
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from tidepool.client.protocol import ClientProtocol
from tidepool.comm import serialize
from tidepool.comm.messages import TaskSpec
from tidepool.comm.serialize import Serialized
from tidepool.errors import (
    ConfigError,
    CycleError,
    KeyCollisionError,
    TidepoolError,
    UnpicklableError,
)
from tidepool.futures import Future
from tidepool.graph.delayed import Delayed, TaskOptions, call_with, func_name
from tidepool.graph.refs import RECURSE, Ref, replace


class SpecBuilder:
    """Builds :class:`TaskSpec` records for one client (``client``: whose futures may be inputs)."""

    def __init__(self, client: Any, core: ClientProtocol, lock: threading.RLock) -> None:
        self.client = client
        self.core = core
        self.lock = lock
        self._cache: dict[int, tuple[weakref.ref[Any], str, bytes]] = {}
        #: callable pickled by value (its id, a bound method's object and function ids) -> the id of
        #: its first version sent (see :meth:`_changed`)
        self._versions: dict[Any, str] = {}

    def function(self, fn: Callable[..., Any], memo: dict[int, tuple[Any, str, bytes]] | None = None
                 ) -> tuple[str, bytes | None]:  # fmt: skip
        """``fn``'s id (content hash) and its pickle unless the scheduler has it already.

        A function pickled by reference (importable by its module and name) is pickled once while it
        lives: the cache holds it weakly, so it is never kept alive.  Anything pickled by value (a
        lambda, a function of ``__main__``, a closure, a callable object, a bound method) carries
        its state in the pickle, and that state may change between two calls (an attribute set, a
        global list grown): it is pickled again for every submit, as Dask does, and once per
        ``map``/``compute`` call (``memo``: that call's pickles).  A bug hunt found ``Scale(2)``
        set to 3 between two submits still scaling by 2.
        """
        ident = id(fn)
        sent = self.core.sent_funcs
        hit = memo.get(ident) if memo is not None else None
        if hit is not None and hit[0] is fn:
            fid, blob = hit[1], hit[2]
        else:
            cached = self._cache.get(ident)
            if cached is not None and cached[0]() is fn:
                fid, blob = cached[1], cached[2]
            else:
                blob = cloudpickle.dumps(fn, protocol=5)
                fid = hashlib.sha1(blob).hexdigest()[:20]
                if _by_reference(fn):
                    self._remember(fn, ident, fid, blob)
            if memo is not None:
                memo[ident] = (fn, fid, blob)  # held strongly for the call: its id is not reused meanwhile
        return (fid, None) if fid in sent else (fid, blob)

    def _changed(self, fn: Callable[..., Any], fid: str) -> bool:
        """Whether ``fn``, pickled by value to ``fid`` (which the scheduler does not have), is a new
        version of a callable whose first version was sent under another id.  The first version of
        each callable is kept by the scheduler like any function (a lambda submitted again and
        again is sent once); later versions ride with their tasks."""
        if _by_reference(fn):
            return False
        owner = getattr(fn, "__self__", None)
        ident: Any = (id(owner), id(getattr(fn, "__func__", None))) if owner is not None else id(fn)
        first = self._versions.get(ident)
        if first is None:
            if len(self._versions) > 10_000:  # ids of dead callables (a reused id only costs a ride)
                self._versions.clear()
            self._versions[ident] = fid
            return False
        return first != fid

    def _remember(self, fn: Callable[..., Any], ident: int, fid: str, blob: bytes) -> None:
        cache = self._cache
        try:
            ref = weakref.ref(fn, _forget_function(cache, ident))
        except TypeError:  # not weakly referenceable
            return
        if len(cache) > 10_000:
            cache.clear()
        cache[ident] = (ref, fid, blob)

    def spec(self, key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             opts: TaskOptions, functions: dict[str, Any], extra: list[Delayed[Any]] | None,
             memo: dict[int, tuple[Any, str, bytes]] | None = None) -> TaskSpec:  # fmt: skip
        """One task; delayed values met among the arguments go to ``extra`` (their graphs are
        added by the caller), functions the scheduler lacks to ``functions``; ``memo``: the
        function pickles of the call this task is part of (see :meth:`function`)."""
        deps: list[str] = []
        me = self.client

        def swap(x: Any) -> Any:
            if isinstance(x, Future):
                if x.client is not me:
                    raise ConfigError(f"future {x.key} belongs to another client")
                deps.append(x.key)
                return Ref(x.key)
            if isinstance(x, Delayed):
                deps.append(x.key)
                if extra is not None:
                    extra.append(x)
                return Ref(x.key)
            if isinstance(x, Ref):
                deps.append(x.key)
                return x
            return RECURSE

        try:
            fid, blob = self.function(fn, memo)
        except TidepoolError:
            raise
        except Exception as e:
            raise _unpicklable(key, f"function {func_name(fn)!r}", e) from e
        call_args = args
        if memo is None and blob is not None and self._changed(fn, fid):
            # a callable sent before whose state has changed since (an attribute set, a global
            # reassigned), in a single submit: this version rides with its task and goes with it,
            # instead of being kept by the scheduler and every worker for ever, one copy per
            # version.  A map or a graph registers it once for all its tasks (riding with each,
            # it was pickled into every task's arguments: a review's 100-task map of a function
            # reading a 1 MB global sent 100 MB)
            call_args = (fn, *args)
            fid, blob = self.function(call_with, None)
        if call_args or kwargs:
            refd = (replace(call_args, swap), replace(kwargs, swap))
            try:
                payload = serialize(refd)
            except TidepoolError:
                raise  # already says what to do (a Future pickled inside an object)
            except Exception as e:
                raise _unpicklable(key, "arguments", e) from e
        else:
            payload = None
        if blob is not None:
            functions[fid] = Serialized(blob, [])
        return TaskSpec(key, fid, payload, list(dict.fromkeys(deps)) if deps else (), opts.resources, opts.retries,
                        opts.name or func_name(fn), opts.priority, opts.workers, opts.loose)  # fmt: skip

    def check_collisions(self, specs: list[TaskSpec], batch: str | None = None) -> None:
        """Explicit keys: the same task may share a live key, a different one may not; nor may two
        different tasks of ``specs`` share one.  ``batch`` (e.g. ``"this map"``): what the error
        says was not submitted."""
        given: dict[str, tuple[Any, ...]] = {}
        unsent = f"; nothing of {batch} was submitted" if batch else ""
        for spec in specs:
            ident = identity(spec)
            first = given.setdefault(spec.key, ident)
            if first != ident:
                raise KeyCollisionError(
                    f"key {spec.key!r} is given to two different tasks (another function, arguments or "
                    f"inputs); give each task its own key{unsent}", spec.key)  # fmt: skip
            with self.lock:
                taken = self.core.collision(spec.key, ident)
            if taken:
                raise KeyCollisionError(
                    f"key {spec.key!r} is already used by a different task that is still alive (another "
                    "function, arguments or inputs); give this task its own key, or drop the first "
                    f"future (del it: a future still referenced keeps its key) before reusing the key{unsent}",
                    spec.key)  # fmt: skip

    def delayed_specs(self, roots: list[Delayed[Any]], functions: dict[str, Any]) -> list[TaskSpec]:
        """Specs for the graphs behind ``roots``, dependencies first (iterative DFS)."""
        specs: list[TaskSpec] = []
        memo: dict[int, tuple[Any, str, bytes]] = {}
        seen: dict[str, Delayed[Any]] = {}
        open_: dict[str, Delayed[Any]] = {}  # on the current DFS path: reaching one again is a cycle
        explicit: list[TaskSpec] = []
        for root in roots:
            if root.key in seen:
                _same_task(seen[root.key], root)
                continue
            stack: list[tuple[Delayed[Any], bool]] = [(root, False)]
            while stack:
                d, expanded = stack.pop()
                if d.key in seen:
                    _same_task(seen[d.key], d)
                    continue
                if expanded:
                    del open_[d.key]
                    seen[d.key] = d
                    specs.append(self.spec(d.key, d.func, d.args, d.kwargs, d.options, functions, None, memo))
                    if d.explicit:
                        explicit.append(specs[-1])
                    continue
                if d.key in open_:
                    _same_task(open_[d.key], d)
                    continue  # reached twice by different paths before finishing: handled below
                open_[d.key] = d
                stack.append((d, True))
                for dep in reversed(list(d.dependencies())):
                    if dep.key in open_:
                        path = list(open_)
                        cycle = path[path.index(dep.key):] + [dep.key]
                        raise CycleError(f"the task graph has a cycle: {' -> '.join(map(repr, cycle))}; "
                                         "a task cannot depend on its own result")  # fmt: skip
                    if dep.key not in seen:
                        stack.append((dep, False))
        if explicit:
            self.check_collisions(explicit)
        return specs


def _same_task(a: Delayed[Any], b: Delayed[Any]) -> None:
    """Two lazy values met under one key in one graph must be the same task."""
    if a is not b:
        raise KeyCollisionError(
            f"two different tasks in this graph have the key {a.key!r}; give each call its own key "
            "(.options(key=...) or dask_key_name=)", a.key)  # fmt: skip


def _unpicklable(key: str, what: str, e: Exception) -> UnpicklableError:
    """The error for a task whose ``what`` (its arguments or its function) cannot be pickled: raised
    by ``submit``/``map``/``compute`` before anything of the call is sent."""
    if isinstance(e, RecursionError) or "recursion" in str(e):  # (cloudpickle says so in a PicklingError)
        return UnpicklableError(f"the {what} of task {key!r} are nested too deeply to pickle ({e}); nothing of "
                                "this call was sent: flatten the structure (a list of items rather than items "
                                "nested in each other)", key)  # fmt: skip
    return UnpicklableError(
        f"the {what} of task {key!r} cannot be pickled ({type(e).__name__}: {e}); nothing of this call "
        "was sent. Objects such as locks, open files, sockets and database connections cannot travel "
        "to a worker: create them inside the task (or in a worker setup hook), and pass what is needed "
        "to build them (a path, an address) instead", key)  # fmt: skip


def _by_reference(fn: Any) -> bool:
    """Whether cloudpickle pickles ``fn`` by its module and name (so its pickle never changes)."""
    check = getattr(cloudpickle.cloudpickle, "_should_pickle_by_reference", None)
    if check is None or not isinstance(fn, types.FunctionType):
        return False  # pickled again each call: always right, only slower
    try:
        return bool(check(fn))
    except Exception:  # noqa: BLE001 - an odd object: take the safe side
        return False


def _forget_function(cache: dict[int, Any], ident: int) -> Callable[[weakref.ref[Any]], None]:
    """Weak-reference callback: drop a dead callable's cache entry (if it is still that one's)."""

    def forget(ref: weakref.ref[Any]) -> None:
        entry = cache.get(ident)
        if entry is not None and entry[0] is ref:
            cache.pop(ident, None)

    return forget


def identity(spec: TaskSpec) -> tuple[Any, ...]:
    """What the task is (function, arguments, inputs): equal for the same task under one key."""
    payload = spec.payload
    digest = None
    if payload is not None:
        h = hashlib.blake2b(bytes(payload.data), digest_size=16)
        digest = (h.hexdigest(), tuple(b.nbytes for b in payload.buffers))
    return (spec.func_id, digest, tuple(spec.deps))


def pure_key(spec: TaskSpec) -> str:
    """A key from the task's function, arguments and inputs: equal calls get equal keys."""
    h = hashlib.blake2b(repr(identity(spec)).encode(), digest_size=12)
    payload = spec.payload
    if payload is not None:
        for b in payload.buffers:
            h.update(b)
    return f"{spec.group}-{h.hexdigest()}"


def check_acyclic(tasks: list[TaskSpec]) -> None:
    """Raise :class:`CycleError` if the specs depend on themselves.

    Specs arrive dependencies first, so a dependency on a key that comes later in the same batch
    (or on itself) is the only way to close a cycle; such a batch is checked fully to name it.
    """
    pos = {t.key: i for i, t in enumerate(tasks)}
    if not any(pos.get(d, -1) >= i for i, t in enumerate(tasks) for d in t.deps):
        return
    graph = {t.key: [d for d in t.deps if d in pos] for t in tasks}
    state: dict[str, int] = {}
    for root in graph:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = []
        while stack:
            k, i = stack.pop()
            if i == 0:
                state[k] = 1
                path.append(k)
            deps = graph[k]
            if i < len(deps):
                stack.append((k, i + 1))
                d = deps[i]
                if state.get(d) == 1:
                    cycle = path[path.index(d):] + [d]
                    raise CycleError(f"the task graph has a cycle: {' -> '.join(map(repr, cycle))}; "
                                     "a task cannot depend on its own result")  # fmt: skip
                if d not in state:
                    stack.append((d, 0))
            else:
                state[k] = 2
                path.pop()
