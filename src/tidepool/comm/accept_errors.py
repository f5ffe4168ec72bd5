"""Accept failures for lack of resources, logged once per interval with counts.

When the process runs out of file descriptors (``EMFILE``/``ENFILE``) or buffers (``ENOBUFS``,
``ENOMEM``), asyncio's accept loop logs a full traceback for every failed ``accept()`` and tries
again: thousands of lines within seconds while the scheduler is under a connection flood.
:func:`install` puts an exception handler on the event loop that counts these instead, logs the
first at once and then one line per ``ACCEPT_LOG_INTERVAL`` seconds (how many, the last error, the
descriptors open against the limit); every other exception goes to the handler that was there.
State: the count and window start of the :class:`AcceptErrorLog` installed on each loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from typing import Any

log = logging.getLogger("tidepool.comm")

#: seconds between two log lines about failed accepts
ACCEPT_LOG_INTERVAL = 10.0
#: asyncio's message for these failures (selector_events._accept_connection)
_MESSAGE = "socket.accept() out of system resource"


def _open_fds() -> str:
    try:
        return str(len(os.listdir("/proc/self/fd")))
    except OSError:  # out of descriptors to even look (or not Linux)
        return "?"


class AcceptErrorLog:
    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float | None = None) -> None:
        self.loop = loop
        self.interval = ACCEPT_LOG_INTERVAL if interval is None else interval
        self.previous = loop.get_exception_handler()
        self.total = 0  # failed accepts since installed
        self.quiet = 0  # failed accepts not logged yet
        self.last: object = None
        self._window = -1e18
        self._flush: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith(_MESSAGE):
            self.note(context.get("exception"))
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def note(self, exc: object) -> None:
        self.total += 1
        self.quiet += 1
        self.last = exc
        now = self.loop.time()
        if now - self._window >= self.interval:
            self.report()
        elif self._flush is None:  # the rest of this window is said when it ends
            self._flush = self.loop.call_at(self._window + self.interval, self.report)

    def report(self) -> None:
        self._flush = None
        if not self.quiet:
            return
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.error("accepting connections failed %d time(s) in the last %gs (%d in all): %s; %s file descriptors "
                  "open, limit %d. Raise the limit (ulimit -n) or reduce the connections", self.quiet,
                  self.interval, self.total, self.last, _open_fds(), soft)  # fmt: skip
        self.quiet = 0
        self._window = self.loop.time()


def install(loop: asyncio.AbstractEventLoop | None = None) -> AcceptErrorLog:
    """Put the counting handler on ``loop`` (the running one by default), once per loop."""
    loop = loop or asyncio.get_running_loop()
    current = loop.get_exception_handler()
    if isinstance(current, AcceptErrorLog):
        return current
    handler = AcceptErrorLog(loop)
    loop.set_exception_handler(handler)
    return handler


__all__ = ["ACCEPT_LOG_INTERVAL", "AcceptErrorLog", "install"]
