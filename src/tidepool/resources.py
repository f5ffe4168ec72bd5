"""The resource algebra, in one place: parsing amounts, :data:`Shape`, :func:`fits`, :func:`capacity`.

Parsing: ``{"cpu": 1, "gpu": 1, "memory": "4GB", "custom": 2}`` -> floats.  Memory-like values
accept byte strings ("512MiB", "4GB", "1.5 TB"); everything else must be a non-negative number.
Used by task submission, workers and node types alike, so a typo fails the same way everywhere.

A task's demand travels as a :data:`Shape` (sorted ``(name, amount)`` pairs: hashable, so many
tasks share one); the scheduler's placement, the worker's slots, the scaling planner and the
forecast all ask the same two questions of it: does it :func:`fit` what is free, and how many
copies of it fit at once (:func:`capacity`).  Pure functions, no state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tidepool.errors import ConfigError

#: a task's resource demand: ``(("cpu", 1.0), ("gpu", 1.0))``, hashable so tasks share it
Shape = tuple[tuple[str, float], ...]


def fits(available: Mapping[str, float], demand: Iterable[tuple[str, float]]) -> bool:
    """True when ``available`` covers every ``(resource, amount)`` in ``demand``."""
    for name, amount in demand:
        if available.get(name, 0.0) < amount:
            return False
    return True


def capacity(resources: Mapping[str, float], shape: Shape) -> int:
    """How many tasks of ``shape`` fit at once into ``resources`` (a huge number if it asks for nothing)."""
    n = math.inf
    for name, amount in shape:
        if amount <= 0:
            continue
        n = min(n, resources.get(name, 0.0) // amount)
    return int(n) if n != math.inf else 1_000_000


def task_slots(resources: Mapping[str, float], shape: Shape) -> int:
    """How many tasks of ``shape`` a worker with ``resources`` runs at once: what fits, at most its
    slots (one per whole cpu, at least one: the scheduler's ``WorkerRecord.slots``).  A task asking
    for no cpu still takes a slot; the forecast counted a million of them per node (and a node type
    offering 10**12 cpu that many), which stalled or failed every autoscaler step."""
    return min(capacity(resources, shape), max(1, int(min(resources.get("cpu", 1), 1e9))))

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}  # fmt: skip
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """``"4GB"`` -> 4_000_000_000; numbers pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"byte amount must be a finite number, got {value}")
        if value < 0:
            raise ConfigError(f"byte amount must not be negative, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _BYTES.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"cannot read {value!r} as a byte amount; use e.g. 512MiB or 4GB")


def parse_resources(resources: Mapping[str, Any]) -> dict[str, float]:
    """Validate and normalise a resource mapping (names are case-sensitive labels)."""
    if not isinstance(resources, Mapping):
        raise ConfigError(f"resources must be a mapping like {{'cpu': 1}}, got {resources!r}")
    out: dict[str, float] = {}
    for name, value in resources.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"resource names must be non-empty strings, got {name!r}")
        if name == "memory" or isinstance(value, str):
            try:
                out[name] = float(parse_bytes(value))
            except ConfigError:
                if name == "memory":
                    raise
                raise ConfigError(f"resource {name!r} must be a number, got {value!r}") from None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"resource {name!r} must be a finite number, got {value!r}")
        if value < 0:
            raise ConfigError(f"resource {name!r} must not be negative, got {value}")
        out[name] = float(value)
    return out


def task_shape(resources: Mapping[str, Any] | None) -> Shape:
    """A task's resource demand as a canonical :data:`Shape`; ``cpu`` defaults to 1."""
    res = parse_resources(resources or {})
    res.setdefault("cpu", 1.0)
    return tuple(sorted((k, v) for k, v in res.items() if v > 0 or k == "cpu"))


def worker_resources(resources: Mapping[str, Any] | None, slots: int | None = None) -> dict[str, float]:
    """A worker's resources: ``slots`` sets ``cpu``, which defaults to the machine's cores."""
    import os

    res = parse_resources(resources or {})
    if slots is not None:
        if slots < 1:
            raise ConfigError(f"slots must be at least 1, got {slots}")
        if "cpu" in res and res["cpu"] != float(slots):  # (--slots won silently: a bug hunt)
            raise ConfigError(f"slots={slots} (--slots) and resources cpu={res['cpu']:g} (--resources) disagree: a "
                              "worker runs as many default tasks at once as its cpu; give one of them")  # fmt: skip
        res["cpu"] = float(slots)
    res.setdefault("cpu", float(os.cpu_count() or 1))
    return res


def format_resources(resources: Mapping[str, float]) -> str:
    """``cpu=2, memory=4.0GiB`` for messages."""
    parts = []
    for k, v in sorted(resources.items()):
        if k == "memory":
            parts.append(f"memory={v / 2**30:.1f}GiB")
        else:
            parts.append(f"{k}={v:g}")
    return ", ".join(parts) or "nothing"
