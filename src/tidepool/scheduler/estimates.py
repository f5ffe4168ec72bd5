"""Duration statistics per task group (the task's function name).

State: for each group an exponentially weighted mean and variance of measured durations plus a
count; once a group has a few samples, a sample far above its spread is clipped before it counts.  A group never seen uses the prior: the mean over all groups seen so far, or
``default_prior`` before anything finished.  The scheduler uses :meth:`estimate` to decide how much
work to queue on a worker (a worker holds at most ``queue_seconds`` of estimated work beyond its
slots), and the scaling policies use it to forecast remaining time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class GroupStats:
    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    def add(self, duration: float, alpha: float) -> None:
        self.count += 1
        if self.count == 1:
            self.mean = duration
            self.var = 0.0
            return
        if self.count > 5:
            # robust to outliers: one freak sample moves the estimate, but only so far
            duration = min(duration, max(self.mean + 4 * math.sqrt(self.var), 2 * self.mean))
        # plain average while few samples, then exponential weighting (adapts to drift)
        a = max(alpha, 1.0 / self.count)
        diff = duration - self.mean
        incr = a * diff
        self.mean += incr
        self.var = (1 - a) * (self.var + diff * incr)

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))


class DurationEstimates:
    """Per-group duration statistics with an adaptive prior."""

    def __init__(self, default_prior: float = 0.5, alpha: float = 0.1) -> None:
        self.default_prior = default_prior
        self.alpha = alpha
        self.groups: dict[str, GroupStats] = {}
        self._total = 0.0
        self._n = 0

    def observe(self, group: str, duration: float) -> None:
        duration = max(0.0, float(duration))
        st = self.groups.get(group)
        if st is None:
            st = self.groups[group] = GroupStats()
        st.add(duration, self.alpha)
        self._total += duration
        self._n += 1

    def prior(self) -> float:
        return self._total / self._n if self._n else self.default_prior

    def estimate(self, group: str) -> float:
        st = self.groups.get(group)
        if st is None or st.count == 0:
            return self.prior()
        return st.mean
