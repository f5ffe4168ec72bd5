"""Checking keyword arguments that a public call passes on to internal classes.

``LocalCluster(**kw)`` hands unknown keywords to the scheduler and its state machine, and
``adapt(**kw)`` to the scaling controller; a typo there would otherwise surface as a ``TypeError``
naming an internal ``__init__``.  :func:`check_keywords` reads the accepted names from the
signatures themselves (so a new parameter is accepted without touching this file) and raises a
:class:`ConfigError` naming the public call and the closest accepted name, as cluster-file errors do.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from tidepool.errors import ConfigError

#: Dask's names for what tidepool calls otherwise (a close spelling cannot find these)
DASK_NAMES = {"threads_per_worker": "slots", "nthreads": "slots", "minimum_cores": "minimum",
              "maximum_cores": "maximum"}  # fmt: skip


#: Dask keywords with no tidepool counterpart, and what to do instead
DASK_ADVICE = {"asynchronous": "a LocalCluster starts at once and works from async code as it is (`async with "
                               "LocalCluster() as cluster:`); make the client asynchronous instead: "
                               "Client(cluster, asynchronous=True)"}  # fmt: skip


def accepted_keywords(targets: Iterable[Callable[..., Any]]) -> set[str]:
    """Every name the ``targets`` take by keyword (``self`` and ``*args``/``**kwargs`` excluded)."""
    names: set[str] = set()
    for target in targets:
        for p in inspect.signature(target).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return names


def check_keywords(call: str, given: Iterable[str], *targets: Callable[..., Any]) -> None:
    """Raise :class:`ConfigError` for the first name in ``given`` that none of ``targets`` takes.

    ``call`` is the public call as the user wrote it (``"LocalCluster"``, ``"LocalCluster.adapt"``).
    """
    known = accepted_keywords(targets)
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if DASK_NAMES.get(name) in known:
            hint = f" (Dask's {name}= is {DASK_NAMES[name]}= in tidepool)"
        if name in DASK_ADVICE:
            hint = f" ({DASK_ADVICE[name]})"
        raise ConfigError(f"{call}() got an unexpected keyword argument {name!r}{hint}; it takes "
                          f"{', '.join(sorted(known))}")  # fmt: skip
