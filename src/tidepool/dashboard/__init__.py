"""The live dashboard (``/``) and Prometheus metrics (``/metrics``) of a scheduler.

``model`` gathers what is shown from the scheduler, ``metrics`` renders it for Prometheus,
``server`` serves both with aiohttp in the scheduler's loop, ``page`` is the page itself.  Optional
extra: ``pip install 'tidepool[dashboard]'``.
"""

from tidepool.dashboard.server import Dashboard, start_dashboard

__all__ = ["Dashboard", "start_dashboard"]
