"""Task keys: what a user may name a task with, and the one string the scheduler keeps for it.

Pure functions, no state.  The scheduler, the journal and the wire keep keys as strings; a user may
also name a task with a tuple of strings and numbers (Dask's ``("x-3fa2", 0, 1)`` chunk keys), an
int or a float.  Those are kept under ``str(key)``, the text Dask itself prints for them, so
errors, progress and the journal show the names users know.
"""

from __future__ import annotations

from typing import Any

from tidepool.errors import ConfigError


def _valid(key: Any) -> bool:
    t = type(key)
    if t is str or t is int or t is float:
        return True
    if t is tuple:
        return bool(key) and all(_valid(p) or type(p) is bytes for p in key)
    return False


def key_name(key: Any) -> str:
    """The scheduler's name for ``key``: a string as it is, a tuple/int/float as ``str(key)``."""
    if type(key) is str:
        return key
    if not _valid(key):
        raise ConfigError(
            f"a task key is a string, or a tuple of strings and numbers, or a number; got {key!r} "
            f"({type(key).__name__})"
        )
    return str(key)


__all__ = ["key_name"]
