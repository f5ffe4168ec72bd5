"""Seeded random durations: start-up delays, queue waits, task durations.

A :class:`Dist` is frozen data (a kind and its parameters) that samples from a ``random.Random``
the caller owns, so a simulation that hands every random choice its own seeded stream replays
exactly.  Written in files as text, ``"uniform(60, 120)"``, or as a bare number (a constant):

- ``const(x)`` or ``x`` -- always ``x``;
- ``uniform(a, b)`` -- uniform between ``a`` and ``b``;
- ``normal(mean, sd)`` -- normal, clipped at 0;
- ``lognormal(median, sigma)`` -- ``median * exp(sigma * N(0, 1))`` (queue waits: mostly short, a
  long tail);
- ``expo(mean)`` -- exponential with that mean;
- ``choice(a, b, ...)`` -- one of the values, equally likely.

Nothing here reads a clock or a global random state.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

from tidepool.errors import ConfigError

_KINDS = {"const": (1, 1), "uniform": (2, 2), "normal": (2, 2), "lognormal": (2, 2), "expo": (1, 1),
          "choice": (1, 10_000)}  # fmt: skip
_TEXT = re.compile(r"^\s*([a-z]+)\s*\(\s*(.*?)\s*\)\s*$")


@dataclass(frozen=True)
class Dist:
    """A distribution of non-negative seconds (see the module docstring for the kinds)."""

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"unknown distribution {self.kind!r}; use one of {', '.join(sorted(_KINDS))}")
        lo, hi = _KINDS[self.kind]
        if not lo <= len(self.params) <= hi:
            raise ConfigError(f"{self.kind} takes {lo if lo == hi else f'{lo}..'} parameters, got {self.params}")
        if any(not math.isfinite(p) for p in self.params):
            raise ConfigError(f"{self}: parameters must be finite numbers")
        if self.kind == "uniform" and not 0 <= self.params[0] <= self.params[1]:
            raise ConfigError(f"{self}: need 0 <= a <= b")
        if self.kind in ("const", "expo", "choice") and min(self.params) < 0:
            raise ConfigError(f"{self}: values must be >= 0")
        if self.kind in ("normal", "lognormal") and (self.params[0] < 0 or self.params[1] < 0):
            raise ConfigError(f"{self}: parameters must be >= 0")

    def sample(self, rng: random.Random) -> float:
        k, p = self.kind, self.params
        if k == "const":
            return p[0]
        if k == "uniform":
            return rng.uniform(p[0], p[1])
        if k == "normal":
            return max(0.0, rng.gauss(p[0], p[1]))
        if k == "lognormal":
            return p[0] * math.exp(p[1] * rng.gauss(0.0, 1.0))
        if k == "expo":
            return rng.expovariate(1.0 / p[0]) if p[0] > 0 else 0.0
        return p[rng.randrange(len(p))]

    @property
    def mean(self) -> float:
        k, p = self.kind, self.params
        if k == "const" or k == "expo":
            return p[0]
        if k == "uniform":
            return (p[0] + p[1]) / 2
        if k == "normal":
            return p[0]  # (ignoring the clip at 0)
        if k == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        return sum(p) / len(p)

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(f'{x:g}' for x in self.params)})"


def parse_dist(value: Any, where: str = "distribution") -> Dist:
    """A :class:`Dist` from a number, ``[a, b]`` (uniform), a text like ``"expo(0.5)"`` or a Dist."""
    if isinstance(value, Dist):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected seconds or a distribution like 'uniform(60, 120)', got {value!r}")
    if isinstance(value, (int, float)):
        return Dist("const", (float(value),))
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return Dist("uniform", (float(value[0]), float(value[1])))
    if isinstance(value, str):
        m = _TEXT.match(value)
        if m is None:
            try:
                return Dist("const", (float(value),))
            except ValueError:
                pass
        else:
            try:
                params = tuple(float(x) for x in m.group(2).split(",") if x.strip())
            except ValueError as exc:
                raise ConfigError(f"{where}: bad number in {value!r}: {exc}") from exc
            try:
                return Dist(m.group(1), params)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from exc
    raise ConfigError(f"{where}: expected seconds or a distribution like 'uniform(60, 120)', "
                      f"'lognormal(120, 0.8)', 'expo(0.5)', got {value!r}")  # fmt: skip


def stream(seed: int, *names: str) -> random.Random:
    """An independent random stream for ``names`` under ``seed`` (stable across processes:
    ``zlib.crc32``, not ``hash``, which changes with PYTHONHASHSEED)."""
    mix = seed & 0xFFFFFFFF
    for n in names:
        mix = zlib.crc32(n.encode(), mix)
    return random.Random((seed << 32) ^ mix)
