"""``Ref(key)``: a placeholder for another task's value inside a task's arguments.

The client replaces futures and delayed values in arguments with refs before pickling; the worker
replaces refs with the values (local or fetched from peers) right before calling the function.
Containers walked: list, tuple, dict values, set/frozenset.  Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tidepool.errors import ConfigError

T = TypeVar("T")


class Ref:
    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Ref({self.key!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("tidepool-ref", self.key))

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (Ref, (self.key,))


def substitute(obj: Any, values: Mapping[str, Any]) -> Any:
    """Return ``obj`` with every :class:`Ref` replaced by ``values[ref.key]``."""
    return _substitute(obj, values, 0)


def _substitute(obj: Any, values: Mapping[str, Any], depth: int) -> Any:
    t = type(obj)
    if t is Ref:
        return values[obj.key]
    if depth >= DEEP and t in _CONTAINERS:  # deeper: a stack of our own, not the call stack's
        return _walk_children(obj, lambda x: values[x.key] if type(x) is Ref else RECURSE)
    d = depth + 1
    if t is list:
        return [_substitute(x, values, d) for x in obj]
    if t is tuple:
        return tuple(_substitute(x, values, d) for x in obj)
    if t is dict:
        return {k: _substitute(v, values, d) for k, v in obj.items()}
    if t is set or t is frozenset:
        return t(_substitute(x, values, d) for x in obj)
    return obj


class _Recurse:
    def __repr__(self) -> str:
        return "RECURSE"


#: Returned by a :func:`replace` callback to mean "not mine: look inside".
RECURSE: Any = _Recurse()


def collect(obj: Any, cls: type[T]) -> list[T]:
    """Every instance of ``cls`` inside ``obj``'s containers, in walk order."""
    found: list[T] = []

    def visit(x: Any) -> Any:
        if isinstance(x, cls):
            found.append(x)
            return x
        return RECURSE

    replace(obj, visit)
    return found


def replace(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Walk containers like :func:`substitute`; ``fn(x)`` returns a replacement, or ``RECURSE``.
    ``fn`` is called once per element, at any depth."""
    return _replace(obj, fn, 0)


def _replace(obj: Any, fn: Callable[[Any], Any], depth: int) -> Any:
    r = fn(obj)
    if r is not RECURSE:
        return r
    t = type(obj)
    if depth >= DEEP and t in _CONTAINERS:  # deeper: a stack of our own, not the call stack's
        return _walk_children(obj, fn)
    d = depth + 1
    if t is list:
        return [_replace(x, fn, d) for x in obj]
    if t is tuple:
        return tuple(_replace(x, fn, d) for x in obj)
    if t is dict:
        return {k: _replace(v, fn, d) for k, v in obj.items()}
    if t is set or t is frozenset:
        return t(_replace(x, fn, d) for x in obj)
    return obj


#: nesting depth from which the walks use a stack of their own: the recursive walk takes two call
#: frames per level, and stopped near half the recursion limit (a 1,000-deep tuple pickles)
DEEP = 100
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _walk_children(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` (a container ``fn`` said to look inside) rebuilt from its children as
    :func:`replace` would, without recursion."""
    # a frame: [container type, iterator over its children, their new values, its key in its
    # parent, the container]; ``path``: ids of the containers on the way down (one that holds
    # itself would be walked for ever: the recursive walk ran out of stack on it)
    stack: list[list[Any]] = [[type(obj), iter(obj.items() if type(obj) is dict else obj), [], None, obj]]
    path = {id(obj)}
    while True:
        frame = stack[-1]
        t, it, out = frame[0], frame[1], frame[2]
        pushed = False
        for child in it:
            key, x = child if t is dict else (None, child)
            r = fn(x)
            if r is RECURSE and type(x) in _CONTAINERS:
                if id(x) in path:
                    raise ConfigError(f"a task argument holds itself (a {type(x).__name__} inside itself); "
                                      "pass an object that does not contain itself")  # fmt: skip
                path.add(id(x))
                stack.append([type(x), iter(x.items() if type(x) is dict else x), [], key, x])
                pushed = True
                break
            value = x if r is RECURSE else r
            out.append((key, value) if t is dict else value)
        if pushed:
            continue
        stack.pop()
        path.discard(id(frame[4]))
        built = dict(out) if t is dict else t(out)
        if not stack:
            return built
        parent = stack[-1]
        parent[2].append((frame[3], built) if parent[0] is dict else built)
