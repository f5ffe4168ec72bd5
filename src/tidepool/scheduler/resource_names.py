"""Resource-name typos fail at submit: ``resources={"CPU": 1}`` when only ``cpu`` was ever offered.

State (on :class:`SchedulerState`): ``offered_resources``, every resource name a registered worker
or a known node type (expected workers, the autoscaler's node types) has ever offered.  A task
asking for a name outside that set that is *close* to one inside it (another case, or a one-letter
slip) is a typo: it fails at once with the suggestion, instead of waiting out the no-worker
timeout.  A new name with no close match still waits (a worker offering it may be on its way), as
does one that differs from an offered name only in its digits (``gpu1`` beside ``gpu0``); nothing
is judged before anything has been offered at all.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable

_DIGITS = re.compile(r"[0-9]+")


def suggestion(name: str, offered: Iterable[str]) -> str | None:
    """The offered name ``name`` is probably a typo of, or None."""
    names = sorted(offered)
    for n in names:
        if n.lower() == name.lower():
            return n
    # names that differ only in digits are a family (gpu0, gpu1: one may be on its way), not a typo
    family = _DIGITS.sub("", name)
    close = [n for n in difflib.get_close_matches(name, names, n=3, cutoff=0.75) if _DIGITS.sub("", n) != family]
    return close[0] if close else None


@functools.lru_cache(maxsize=1024)
def _suggestion(name: str, offered: frozenset[str]) -> str | None:
    return suggestion(name, offered)


def typo_reason(needed: Iterable[str], offered: set[str]) -> str | None:
    """Why a task asking for ``needed`` names can never run, if one is a typo; else None."""
    if not offered:
        return None
    for name in needed:
        if name in offered:
            continue
        near = _suggestion(name, frozenset(offered))  # cached: many tasks share a shape
        if near is not None:
            return (f"it asks for resource {name!r}, which no worker or node type has ever offered; "
                    f"did you mean {near!r}? (offered: {', '.join(sorted(offered))})")  # fmt: skip
    return None


__all__ = ["suggestion", "typo_reason"]
