"""The live dashboard (``/``) and Prometheus metrics (``/metrics``) of a scheduler.

``model`` gathers what is shown from the scheduler, ``metrics`` renders it for Prometheus,
``server`` serves both with aiohttp in the scheduler's loop, ``page`` is the page itself,
``replay`` rebuilds the page from a finished run's journal (post-mortem), ``links`` formats the
reprs that show the link.  On by default (aiohttp and prometheus_client are core dependencies).
"""

from tidepool.dashboard.server import Dashboard, start_dashboard

__all__ = ["Dashboard", "start_dashboard"]
