"""Task keys: what a user may name a task with, and the one string the scheduler keeps for it.

Pure functions, no state.  The scheduler, the journal and the wire keep keys as strings; a user may
also name a task with a tuple of strings and numbers (Dask's ``("x-3fa2", 0, 1)`` chunk keys), an
int or a float.  Those are kept under ``str(key)``, the text Dask itself prints for them, so
errors, progress and the journal show the names users know.

Numpy integer and float scalars (Dask's ``vindex`` builds ``("x-3fa2", np.int64(0), 0)``) count as
the Python numbers they equal: Dask looks keys up by equality, so ``np.int64(0)`` and ``0`` name the
same chunk, and both become the same string here (numpy 2 would print ``np.int64(0)``).
"""

from __future__ import annotations

import numbers
from typing import Any

from tidepool.errors import ConfigError


def _normal(part: Any) -> Any:
    """``part`` as a plain str/bytes/int/float, or None if a key may not hold it."""
    t = type(part)
    if t is str or t is int or t is float or t is bytes:
        return part
    if t is bool:
        return None
    if isinstance(part, str):  # numpy.str_
        return str(part)
    if isinstance(part, numbers.Integral):  # numpy integer scalars register here
        return int(part)
    if isinstance(part, numbers.Real) and hasattr(part, "dtype"):  # numpy floating scalars
        return float(part)
    return None


def _plain(key: Any) -> Any:
    """``key`` with every part a plain Python value, or None if it is not a valid key."""
    if type(key) is tuple:
        if not key:
            return None
        parts = []
        for p in key:
            q = _plain(p) if type(p) is tuple else _normal(p)
            if q is None:
                return None
            parts.append(q)
        return tuple(parts)
    plain = _normal(key)
    return None if type(plain) is bytes else plain


def key_name(key: Any) -> str:
    """The scheduler's name for ``key``: a string as it is, a tuple/int/float as ``str(key)`` with
    numpy scalars written as the Python numbers they equal."""
    if type(key) is str:
        return key
    plain = _plain(key)
    if plain is None:
        raise ConfigError(
            f"a task key is a string, or a tuple of strings and numbers, or a number; got {key!r} "
            f"({type(key).__name__})"
        )
    return plain if type(plain) is str else str(plain)


__all__ = ["key_name"]
