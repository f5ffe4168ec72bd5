"""Signals a worker process answers: SIGUSR1 is a preemption notice, not a kill.

No state; called once from the worker's event loop when the process starts (``tidepool worker``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal


def on_preemption_notice() -> None:
    """SIGUSR1 is a preemption notice (``LocalProvider.preempt``; some batch systems send it before
    a job ends): log it and keep working.  The scheduler learns of the notice from the provider and
    retires this worker gracefully, so its data moves; the default action would kill it at once."""

    def noted() -> None:
        logging.getLogger("tidepool.worker").warning("preemption notice (SIGUSR1): working on until retired")

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, noted)
