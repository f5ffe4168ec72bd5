"""The walks over task arguments (``graph/refs.py``): refs put in and taken out at any nesting depth.

Before: both walks recursed, two call frames per level, so an argument nested about 500 deep
(which pickle takes) failed ``submit`` with a bare RecursionError (found by a bug hunt)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidepool.errors import ConfigError
from tidepool.graph.refs import DEEP, RECURSE, Ref, collect, replace, substitute


def nested(depth: int, leaf: Any) -> Any:
    """``leaf`` under ``depth`` levels of alternating tuple, list, dict and set-of-frozenset."""
    x = leaf
    for i in range(depth):
        kind = i % 4
        if kind == 0:
            x = (x, i)
        elif kind == 1:
            x = [i, x]
        elif kind == 2:
            x = {"k": x, "i": i}
        else:
            x = (frozenset({i}), x)
    return x


def same(a: Any, b: Any) -> bool:
    """``a == b`` without recursion (comparing 5,000-deep tuples overflows the C stack's limit)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if type(x) in (list, tuple):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif type(x) is dict:
            if x.keys() != y.keys():
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif x is not y and x != y:
            return False
    return True


@pytest.mark.parametrize("depth", [0, 3, DEEP - 1, DEEP, DEEP + 1, 5_000])
def test_refs_are_swapped_in_and_out_at_any_depth(depth: int) -> None:
    marker = object()
    shape = nested(depth, marker)
    with_ref = replace(shape, lambda x: Ref("key") if x is marker else RECURSE)
    assert collect(with_ref, Ref) == [Ref("key")]  # exactly one, visited once
    back = substitute(with_ref, {"key": marker})
    assert same(back, shape)  # the same structure, with the same types, rebuilt around the value


def test_the_callback_sees_every_element_once_at_any_depth() -> None:
    seen: list[Any] = []

    def visit(x: Any) -> Any:
        seen.append(x)
        return RECURSE

    shape = nested(3 * DEEP, "leaf")
    assert same(replace(shape, visit), shape)
    assert seen.count("leaf") == 1 and len(seen) == len({id(x) for x in seen})


values = st.recursive(st.integers() | st.text(max_size=3) | st.just("REF"),
                      lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=2), inner, max_size=3), max_leaves=30)  # fmt: skip


@given(values)
def test_the_stack_walk_gives_what_the_recursive_one_gives(value: Any) -> None:
    swap = lambda x: Ref("r") if x == "REF" else RECURSE  # noqa: E731
    shallow = replace(value, swap)
    deep = replace(nested(DEEP + 2, value), swap)  # the same value, reached past DEEP
    assert replace(nested(DEEP + 2, "REF"), swap) == nested(DEEP + 2, Ref("r"))
    assert substitute(deep, {"r": "REF"}) == nested(DEEP + 2, value)
    assert substitute(shallow, {"r": "REF"}) == value


def test_an_argument_that_holds_itself_is_a_clear_error_not_an_endless_walk() -> None:
    """Found by review: past DEEP the stack walk pushed the same list for ever (memory grew
    ~150 MB/s); the recursive walk had run out of stack.  Shared, non-cyclic parts are fine."""
    a: list[Any] = [1]
    a.append(a)
    with pytest.raises(ConfigError, match="holds itself"):
        replace(a, lambda x: RECURSE)
    shared = [1, 2]
    value = nested(DEEP + 5, (shared, shared))
    assert same(replace(value, lambda x: RECURSE), value)
