"""The lazy builder: ``@task`` turns calls into graph nodes (:class:`Delayed`).

Calling a decorated function does not run it; it returns a :class:`Delayed` that records the
function, its arguments (which may hold other delayed values or futures) and options (resources,
retries).  ``client.compute(d)`` submits the graph behind ``d``; ``d.compute()`` does the same on the
default client and returns the value.  Keys are ``<function name>-<random hex>`` and unique per call.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from tidepool.errors import ConfigError
from tidepool.graph.keys import key_name
from tidepool.resources import parse_resources

T = TypeVar("T")


def call_with(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: runs a task whose callable rides in its arguments (a changed version
    of a callable sent before, see ``client/specs.py``); importable on every worker."""
    return fn(*args, **kwargs)


def func_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if isinstance(fn, functools.partial):
        name = func_name(fn.func)
    return str(name).replace("<", "").replace(">", "")


class _KeySuffixes:
    """20 hex digits per call: a random 48-bit prefix per process (new after a fork, and after
    2**32 keys) and a counter.  Unique like a random id, without a system call per key (each one
    lets other threads take the interpreter lock, which a submit then waits to get back)."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self.prefix = os.urandom(6).hex()
        self.counter = itertools.count()

    def __call__(self) -> str:
        n = next(self.counter)
        if n >= 1 << 32:
            self._renew()
            n = next(self.counter)
        return f"{self.prefix}{n:08x}"


_suffix = _KeySuffixes()


def make_key(fn: Callable[..., Any]) -> str:
    return f"{func_name(fn)}-{_suffix()}"


class TaskOptions:
    """How a task runs: ``resources``, ``retries``, ``priority`` (higher first), ``workers`` (ids,
    names or addresses it may run on; ``loose``: only a preference)."""

    __slots__ = ("resources", "retries", "name", "priority", "workers", "loose")

    def __init__(self, resources: dict[str, Any] | None = None, retries: int | None = 0, name: str | None = None,
                 *, priority: int = 0, workers: Any = None, loose: bool = False) -> None:  # fmt: skip
        retries = 0 if retries is None else retries
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"retries must be a non-negative integer, got {retries!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ConfigError(f"priority must be an integer (higher runs first), got {priority!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty string (the tasks' group name), got {name!r}")
        if isinstance(workers, str):
            workers = [workers]
        if workers is not None and not all(isinstance(w, str) for w in workers):
            raise ConfigError(f"workers must be worker ids, names or addresses (strings), got {workers!r}")
        self.resources = parse_resources(resources) if resources else {}
        self.retries = retries
        self.name = name
        self.priority = priority
        self.workers: tuple[str, ...] = tuple(workers or ())
        self.loose = bool(loose)


class Delayed(Generic[T]):
    """A lazy task: a function call that has not run yet."""

    __slots__ = ("key", "func", "args", "kwargs", "options", "explicit", "__weakref__")

    def __init__(self, key: str, func: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: TaskOptions, explicit: bool = False) -> None:  # fmt: skip
        self.key = key
        self.explicit = explicit  # the user named it: checked against live tasks under that key
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.options = options

    def __repr__(self) -> str:
        return f"Delayed({self.key!r})"

    def compute(self, client: Any = None, **kwargs: Any) -> T:
        """Run the graph behind this value on ``client`` (default: the current client).

        The default client is found through the public facade (``tidepool.default_client``):
        the graph layer sits below the client and never imports it."""
        import tidepool

        c = client or tidepool.default_client()
        return c.compute(self, **kwargs).result()  # type: ignore[no-any-return]

    def dependencies(self) -> Iterator[Delayed[Any]]:
        from tidepool.graph.refs import collect

        return iter(collect(self.args, Delayed) + collect(self.kwargs, Delayed))


class TaskFunction(Generic[T]):
    """A function wrapped by ``@task``; calling it builds a :class:`Delayed`."""

    def __init__(self, fn: Callable[..., T], options: TaskOptions, key: str | None = None) -> None:
        self.fn = fn
        self.opts = options
        self.key = key
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Delayed[T]:
        """A lazy call.  Its key is ``<name>-<random hex>``, or the one given by
        ``.options(key=...)`` or by Dask's ``dask_key_name=`` keyword (not passed to the function)."""
        key = kwargs.pop("dask_key_name", None)
        key = key_name(key) if key is not None else self.key
        if key is not None:
            return Delayed(key, self.fn, args, kwargs, self.opts, explicit=True)
        return Delayed(f"{self.opts.name or func_name(self.fn)}-{_suffix()}", self.fn, args,
                       kwargs, self.opts)  # fmt: skip

    def options(self, *, resources: dict[str, Any] | None = None, retries: int | None = None,
                name: str | None = None, priority: int | None = None, key: Any = None) -> TaskFunction[T]:  # fmt: skip
        """A copy with other options: ``f.options(resources={"gpu": 1})(x)``.

        ``key`` names the task explicitly (a string, or a tuple of strings and numbers); every
        call of that copy builds a task under that key, so give each call its own.
        """
        return TaskFunction(self.fn, TaskOptions(
            resources if resources is not None else self.opts.resources,
            retries if retries is not None else self.opts.retries,
            name if name is not None else self.opts.name,
            priority=priority if priority is not None else self.opts.priority,
        ), key_name(key) if key is not None else None)  # fmt: skip

    def run(self, *args: Any, **kwargs: Any) -> T:
        """Call the plain function here, now (for tests and debugging)."""
        return self.fn(*args, **kwargs)


@overload
def task(fn: Callable[..., T], /) -> TaskFunction[T]: ...
@overload
def task(*, resources: dict[str, Any] | None = None, retries: int = 0,
         name: str | None = None) -> Callable[[Callable[..., T]], TaskFunction[T]]: ...  # fmt: skip
def task(fn: Callable[..., T] | None = None, /, *, resources: dict[str, Any] | None = None,
         retries: int = 0, name: str | None = None) -> Any:  # fmt: skip
    """Decorator: ``@task`` or ``@task(resources={"gpu": 1}, retries=2)``."""
    opts = TaskOptions(resources, retries, name)
    if fn is not None:
        if not callable(fn):
            raise ConfigError(f"@task needs a function, got {fn!r}")
        return TaskFunction(fn, opts)
    return lambda f: TaskFunction(f, opts)
