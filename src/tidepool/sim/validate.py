"""Checks of what the simulator is given, shared by every way a workload comes in.

Pure functions that raise :class:`~tidepool.errors.ConfigError` naming the field: task durations
and sizes (finite, in range: :func:`duration`, :func:`nbytes`), a workload function's ``--param``
values (known names, numbers where the default is a number, finite and >= 0: :func:`params`), the
graph's size against :data:`MAX_TASKS` (``--max-tasks`` raises it: :func:`graph_size`), and the
CLI's numbers (:func:`seconds`).  :class:`~tidepool.sim.workload.SimTask` checks its own fields, so
a JSON graph, a journal, a Python callable or any other reader is held to the same rules.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from tidepool.errors import ConfigError

#: the most tasks a simulated graph may have unless ``--max-tasks`` (or ``max_tasks=``) says more;
#: a task costs about 1-2 KB of memory in the simulator (docs/simulation.md)
MAX_TASKS = 2_000_000
#: the longest task duration accepted, in seconds (about 32 years: beyond it a number is a mistake)
MAX_DURATION = 1e9
#: the largest result size accepted, in bytes (1 PiB)
MAX_NBYTES = 2**50


def number(value: Any, field: str, *, lo: float = 0.0, hi: float = math.inf, integer: bool = False) -> float:
    """``value`` as a finite number in ``[lo, hi]`` (a whole one if ``integer``), else a ConfigError
    naming ``field``."""
    kind = "a whole number" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field} must be {kind}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{field} must be a finite number, got {value!r}")
    if integer and value != int(value):
        raise ConfigError(f"{field} must be a whole number, got {value!r}")
    if not lo <= value <= hi:
        bound = f">= {lo:g}" if hi == math.inf else f"between {lo:g} and {hi:g}"
        raise ConfigError(f"{field} must be {bound}, got {value!r}")
    return value


def duration(value: Any, field: str) -> float:
    return float(number(value, field, hi=MAX_DURATION))


def nbytes(value: Any, field: str) -> int:
    return int(number(value, field, hi=MAX_NBYTES, integer=True))


def seconds(value: float, flag: str, *, positive: bool = False) -> float:
    """A CLI number of seconds: finite and >= 0 (> 0 if ``positive``)."""
    if positive and isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        # said before the ">= 0" check: "-1: must be >= 0" would suggest that 0 is accepted
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value!r}")
    v = number(value, flag)
    if positive and v <= 0:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value!r}")
    return v


def params(fn: Callable[..., Any], given: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``--param`` values for ``fn``: unknown names and non-numbers where ``fn``'s default is a
    number are ConfigErrors naming the parameter; numbers must be finite and >= 0.  Integers stay
    integers, ``"1e3"`` given for an integer parameter is accepted when it is whole."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return dict(given)
    accepted = {n: p for n, p in sig.parameters.items() if n != "seed"
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}  # fmt: skip
    open_ended = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    out: dict[str, Any] = {}
    for name, value in given.items():
        p = accepted.get(name)
        if p is None:
            if open_ended:
                out[name] = value
                continue
            close = difflib.get_close_matches(name, list(accepted), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{source}: unknown --param {name!r}{hint}; it takes {', '.join(accepted) or 'none'}")
        default = p.default
        if isinstance(default, bool) or default is p.empty or not isinstance(default, (int, float)):
            out[name] = value
            continue
        field = f"{source}: --param {name}"
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{field} must be a number, got {value!r}") from None
        num = number(value, field, integer=isinstance(default, int))
        out[name] = int(num) if isinstance(default, int) else float(num)
    missing = [n for n, p in sig.parameters.items() if n != "seed" and n not in out and p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
    if missing:  # (a TypeError traceback before: a bug hunt)
        raise ConfigError(f"{source} needs {', '.join(repr(n) for n in missing)}: pass "
                          f"{' '.join(f'--param {n}=VALUE' for n in missing)}")  # fmt: skip
    return out


def graph_size(n: int | float, source: str, limit: int | None = None) -> None:
    """Refuse a graph of more than ``limit`` (default :data:`MAX_TASKS`) tasks before building it."""
    cap = MAX_TASKS if limit is None else limit
    if n > cap:
        raise ConfigError(f"{source}: {n:,.0f} tasks is more than the simulator's limit of {cap:,} "
                          f"(about 1-2 KB of memory each); raise it with --max-tasks {int(n)} if this "
                          "machine has the memory")  # fmt: skip


#: tasks a built-in workload makes for its parameters (checked before it is built)
BUILTIN_SIZE: dict[str, Callable[..., float]] = {
    "bursty": lambda n=40, **_: 2 * n + 2,
    "chain": lambda n=20, **_: n,
    "wide": lambda n=200, **_: n,
    "gpu": lambda n_gpu=8, n_cpu=20, **_: n_gpu + n_cpu,
    "scale-down": lambda n=20, **_: n,
    "layers": lambda width=1000, depth=10, **_: width * depth,
    "bag": lambda n=1000, **_: n,
}


__all__ = ["BUILTIN_SIZE", "MAX_DURATION", "MAX_NBYTES", "MAX_TASKS", "duration", "graph_size", "nbytes",
           "number", "params", "seconds"]
