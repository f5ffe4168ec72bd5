"""``Ref(key)``: a placeholder for another task's value inside a task's arguments.

The client replaces futures and delayed values in arguments with refs before pickling; the worker
replaces refs with the values (local or fetched from peers) right before calling the function.
Containers walked: list, tuple, dict values, set/frozenset.  Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

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
    t = type(obj)
    if t is Ref:
        return values[obj.key]
    if t is list:
        return [substitute(x, values) for x in obj]
    if t is tuple:
        return tuple(substitute(x, values) for x in obj)
    if t is dict:
        return {k: substitute(v, values) for k, v in obj.items()}
    if t is set or t is frozenset:
        return t(substitute(x, values) for x in obj)
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
    """Walk containers like :func:`substitute`; ``fn(x)`` returns a replacement, or ``RECURSE``."""
    r = fn(obj)
    if r is not RECURSE:
        return r
    t = type(obj)
    if t is list:
        return [replace(x, fn) for x in obj]
    if t is tuple:
        return tuple(replace(x, fn) for x in obj)
    if t is dict:
        return {k: replace(v, fn) for k, v in obj.items()}
    if t is set or t is frozenset:
        return t(replace(x, fn) for x in obj)
    return obj
