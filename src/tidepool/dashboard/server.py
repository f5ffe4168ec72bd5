"""The dashboard's web server: aiohttp inside the scheduler's own event loop.

State: the aiohttp runner and site, the :class:`DashboardModel`, a Prometheus registry, and a
loop-lag probe task.  Routes: ``/`` (the page), ``/api/state`` and ``/api/history`` (JSON),
``/api/stream`` (server-sent events: one batched update per ``interval``, whatever the task rate),
``/metrics`` (Prometheus text).  Bound to localhost by default; bound anywhere else every request
must carry the scheduler's token (``?token=`` or ``Authorization: Bearer``), compared in constant
time.  When the scheduler uses TLS the page is served over HTTPS with the same certificate and key
(browsers bring no client certificate, so the token is what admits them).  The page's first
response carries the current state, so it draws before the first live update.

Port: ``port=None`` takes 8787 or the next free port above it (up to ``PORT_TRIES``, then any free
port), as Dask does; a port taken by someone else is skipped by the bind itself (no probe-then-bind
race), so two schedulers never collide and a busy range never fails a start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from tidepool.dashboard.model import DashboardModel
from tidepool.dashboard.page import PAGE
from tidepool.errors import ConfigError

log = logging.getLogger("tidepool.dashboard")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 8787
PORT_TRIES = 50


def available() -> bool:
    """Are the dashboard's dependencies importable (they are core dependencies, but a trimmed
    environment may lack them)?"""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("aiohttp", "prometheus_client"))


def _require_aiohttp() -> Any:
    try:
        import prometheus_client  # noqa: F401 - only checked here; metrics.py uses it
        from aiohttp import web
    except ImportError:
        raise ConfigError("the dashboard needs aiohttp and prometheus_client (tidepool's own dependencies): "
                          "pip install aiohttp prometheus_client, or pass dashboard=False") from None
    return web


def ssl_context_for(tls: Any) -> ssl.SSLContext | None:
    """The dashboard's HTTPS context from the cluster's TLS config: same certificate and key; no
    client certificate asked (a browser has none: the token admits it)."""
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"the dashboard cannot load TLS certificate {tls.cert!r}: {exc}") from exc
    return ctx


class Dashboard:
    def __init__(self, scheduler: Any, autoscaler: Callable[[], Any], host: str = "127.0.0.1",
                 port: int | None = 0, interval: float = 0.5, require_token: bool | None = None,
                 worker_label_limit: int | None = None) -> None:  # fmt: skip
        _require_aiohttp()
        from tidepool.dashboard.metrics import WORKER_LABEL_LIMIT, registry_for

        self.scheduler = scheduler
        self.model = DashboardModel(scheduler, autoscaler, interval)
        limit = WORKER_LABEL_LIMIT if worker_label_limit is None else worker_label_limit
        self.registry = registry_for(self.model, limit)
        self.host, self.port, self.interval = host, port, interval
        self.require_token = host not in LOOPBACK if require_token is None else require_token
        self.ssl = ssl_context_for(getattr(scheduler, "tls", None))
        self.address = ""
        self._runner: Any = None
        self._probe: asyncio.Task[None] | None = None
        self.streams = 0  # open event streams (pages watching)

    @property
    def link(self) -> str:
        return self.address + (f"?token={self.scheduler.token}" if self.require_token else "")

    async def start(self) -> Dashboard:
        web = _require_aiohttp()
        app = web.Application(middlewares=[self._auth])
        app.add_routes([web.get("/", self._page), web.get("/api/state", self._state),
                        web.get("/api/history", self._history), web.get("/api/stream", self._stream),
                        web.get("/metrics", self._metrics)])  # fmt: skip
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        # 8787 and up, then any free port: a busy range never fails a cluster's start
        ports = [self.port] if self.port is not None else [*range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES), 0]
        for i, port in enumerate(ports):
            site = web.TCPSite(self._runner, self.host, port, ssl_context=self.ssl)
            try:
                await site.start()
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or i == len(ports) - 1:
                    await self._runner.cleanup()
                    raise ConfigError(f"the dashboard cannot listen on {self.host}:{port}: {exc}; give it a free "
                                      "port (dashboard='host:port' in Python, --dashboard HOST:PORT on the command "
                                      "line) or turn it off (dashboard=False, --no-dashboard)") from exc  # fmt: skip
        sock = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        host = self.host if self.host not in ("0.0.0.0", "") else sock[0]
        self.address = f"{'https' if self.ssl else 'http'}://{host}:{sock[1]}/"
        self.scheduler.subscribe(self.model.observe)
        self.scheduler.dashboard_link = self.link
        self._probe = asyncio.get_running_loop().create_task(self._lag_probe())
        return self

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _lag_probe(self) -> None:
        """Measures the loop's lag, and keeps the time series going while no page watches."""
        loop = asyncio.get_running_loop()
        next_sample = 0.0
        while True:
            t = loop.time()
            await asyncio.sleep(0.1)
            self.model.loop_lag = lag = max(0.0, loop.time() - t - 0.1)
            self.model.loop_lag_max = max(self.model.loop_lag_max, lag)
            if loop.time() >= next_sample:
                next_sample = loop.time() + self.interval
                try:
                    self.model.point(self.scheduler.clock())  # keeps the time series going
                except Exception:  # noqa: BLE001 - a chart point is never worth the probe
                    log.exception("dashboard sample failed")

    @staticmethod
    def _web() -> Any:
        return _require_aiohttp()

    def _authorised(self, request: Any) -> bool:
        if not self.require_token:
            return True
        given = request.query.get("token", "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:]
        return hmac.compare_digest(given.encode(), self.scheduler.token.encode())

    @property
    def _auth(self) -> Any:
        web = _require_aiohttp()

        @web.middleware
        async def auth(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
            if not self._authorised(request):
                return web.Response(status=401, text="the dashboard needs the scheduler's token: ?token=...")
            return await handler(request)

        return auth

    async def _page(self, request: Any) -> Any:
        view, _, _ = self.model.view_json(self.scheduler.clock())
        initial = '{"live": true, "view": ' + view + ', "history": ' + _dumps(self.model.history()) + "}"
        return self._web().Response(text=page_with(initial), content_type="text/html")

    async def _state(self, request: Any) -> Any:
        text, _, _ = self.model.view_json(self.scheduler.clock())
        return self._web().Response(text=text, content_type="application/json")

    async def _history(self, request: Any) -> Any:
        return self._web().json_response(self.model.history(), dumps=_dumps)

    async def _metrics(self, request: Any) -> Any:
        from tidepool.dashboard.metrics import render

        web = self._web()
        now = self.scheduler.clock()
        cached = self.model.metrics_cache
        if cached is None or not 0 <= now - cached[0] < self.interval:  # one render per interval, shared
            cached = self.model.metrics_cache = (now, render(self.registry))
        return web.Response(body=cached[1], headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _stream(self, request: Any) -> Any:
        web = self._web()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.streams += 1
        try:  # a page that drew its first response continues from there
            stream_after = int(request.query.get("stream_after", 0))
            decisions_after = int(request.query.get("decisions_after", 0))
        except ValueError:
            stream_after = decisions_after = 0
        try:
            history = json.dumps({"history": self.model.history()}, default=str)
            await resp.write(f"event: history\ndata: {history}\n\n".encode())
            while True:
                text, stream_after, decisions_after = self.model.view_json(self.scheduler.clock(), stream_after,
                                                                           decisions_after)  # fmt: skip
                await resp.write(b"data: " + text.encode() + b"\n\n")
                await asyncio.sleep(self.interval)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.streams -= 1
            with contextlib.suppress(Exception):
                await resp.write_eof()
        return resp


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


def page_with(initial_json: str) -> str:
    """The page with ``initial_json`` inside it, every ``<`` escaped (``\\u003c``, the same string
    to JSON): no value can end the script or open an HTML comment in it (a key holding
    ``<!--<script>`` stopped the page's script for every viewer: a bug hunt)."""
    return PAGE.replace("/*INITIAL*/null", initial_json.replace("<", "\\u003c"), 1)


def parse_address(address: str) -> tuple[str, int | None]:
    """``"host:port"`` -> (host, port); ``"host"`` or ``"host:"`` -> (host, None): 8787 or the next free."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = address, ""
    if port and not port.isdigit():
        raise ConfigError(f"dashboard address {address!r} needs host:port, e.g. 127.0.0.1:8787")
    if port and int(port) > 65535:
        raise ConfigError(f"dashboard port {int(port)} in {address!r} is out of range: a port is 0-65535")
    return host or "127.0.0.1", int(port) if port else None


async def start_dashboard(scheduler: Any, address: str = "127.0.0.1:0", autoscaler: Callable[[], Any] | None = None,
                          interval: float = 0.5) -> Dashboard:  # fmt: skip
    """Serve the dashboard for ``scheduler`` at ``host:port`` (in the running loop); ``host`` alone
    (or ``host:``) takes 8787 or the next free port."""
    host, port = parse_address(address)
    return await Dashboard(scheduler, autoscaler or (lambda: None), host, port, interval).start()


__all__ = ["Dashboard", "start_dashboard"]
