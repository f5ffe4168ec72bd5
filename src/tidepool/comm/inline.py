"""Small results carried inline: a value the client would fetch anyway rides on the reports.

No state.  The rule, in one place for the three sides: a task of a small submission (an
``update-graph`` wanting at most :data:`INLINE_WANTED` keys, e.g. one ``submit``) is sent to its
worker with ``inline`` set; the worker pickles such a task's value in the slot thread and, when
the pickle is at most :data:`INLINE_BYTES` with no out-of-band buffer, puts it in its ``finished``
report; the scheduler forwards it in the client's ``memory`` report; the client keeps it (up to
:data:`CLIENT_CACHE_BYTES` in all, until the key is released) and ``result()`` reads it there
instead of asking the holder.  Larger values, and those of large submissions (a map of 100,000
tasks should not stream every value through the scheduler), are still read from the holder.
"""

from __future__ import annotations

from typing import Any

from tidepool.comm.serialize import Serialized, serialize

#: largest pickle (bytes) carried inline in the reports
INLINE_BYTES = 1024
#: submissions wanting more keys than this get no inline values
INLINE_WANTED = 64
#: the client's cache of inline values (bytes of pickles); beyond it values are fetched
CLIENT_CACHE_BYTES = 32 * 1024 * 1024


def small_pickle(value: Any, approx_size: int) -> Serialized | None:
    """``value`` pickled if it is small enough to ride inline, else None (also when it does not
    pickle: the holder's data server reports that error as usual).  ``approx_size`` (the worker's
    sizeof) skips pickling values that are clearly too large."""
    if approx_size > 8 * INLINE_BYTES:
        return None
    try:
        blob = serialize(value)
    except Exception:  # noqa: BLE001 - any pickling failure: fetch (and fail) the usual way
        return None
    if blob.buffers or len(blob.data) > INLINE_BYTES:
        return None
    return blob
