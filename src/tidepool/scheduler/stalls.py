"""How the scheduler reports its own stalls (time its loop could not run): pure, time injected.

A busy machine stalls the loop for a second now and then; that is normal and is not counted
against workers, so it is summed up at INFO at most once per ``period``.  A stall that approaches
the heartbeat timeout could matter (a longer one would be within reach of removing live workers
if it were not discounted), so it is logged at WARNING at once.
"""

from __future__ import annotations

import logging

#: seconds between two INFO summaries of ordinary stalls
STALL_LOG_PERIOD = 60.0
#: a stall of at least this fraction of the heartbeat timeout is logged at WARNING
STALL_WARN_FRACTION = 0.5


class StallLog:
    """Feed every measured stall to :meth:`note`; it returns what to log, if anything, now."""

    def __init__(self, heartbeat_timeout: float, period: float = STALL_LOG_PERIOD) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.period = period
        self._since: float | None = None  # start of the period being summed
        self._count = 0
        self._total = 0.0
        self._longest = 0.0

    def note(self, stalled: float, now: float) -> tuple[int, str] | None:
        """``(level, message)`` to log for a stall of ``stalled`` seconds measured at ``now``."""
        if stalled >= STALL_WARN_FRACTION * self.heartbeat_timeout:
            return logging.WARNING, (
                f"the scheduler was stalled for {stalled:.1f}s, {stalled / self.heartbeat_timeout:.0%} of the "
                f"heartbeat timeout ({self.heartbeat_timeout:g}s); not counted against workers, but this "
                "machine is overloaded (or the process was suspended): give the scheduler a core of its own"
            )
        self._count += 1
        self._total += stalled
        self._longest = max(self._longest, stalled)
        if self._since is not None and now - self._since < self.period:
            return None
        window = "" if self._since is None else f" in the last {now - self._since:.0f}s"
        msg = (f"the scheduler was stalled {self._count} time(s) for {self._total:.1f}s in all (longest "
               f"{self._longest:.1f}s{window}; a busy machine); not counted against workers")  # fmt: skip
        self._since, self._count, self._total, self._longest = now, 0, 0.0, 0.0
        return logging.INFO, msg
