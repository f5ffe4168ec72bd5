"""The dashboard's web server: aiohttp inside the scheduler's own event loop.

State: the aiohttp runner and site, the :class:`DashboardModel`, a Prometheus registry, and a
loop-lag probe task.  Routes: ``/`` (the page), ``/api/state`` and ``/api/history`` (JSON),
``/api/stream`` (server-sent events: one batched update per ``interval``, whatever the task rate),
``/metrics`` (Prometheus text).  Bound to localhost by default; bound anywhere else every request
must carry the scheduler's token (``?token=`` or ``Authorization: Bearer``), compared in constant
time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tidepool.dashboard.model import DashboardModel
from tidepool.dashboard.page import PAGE
from tidepool.errors import ConfigError

log = logging.getLogger("tidepool.dashboard")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _require_aiohttp() -> Any:
    try:
        import prometheus_client  # noqa: F401 - only checked here; metrics.py uses it
        from aiohttp import web
    except ImportError:
        raise ConfigError("the dashboard needs aiohttp and prometheus_client: pip install 'tidepool[dashboard]'") from None
    return web


class Dashboard:
    def __init__(self, scheduler: Any, autoscaler: Callable[[], Any], host: str = "127.0.0.1", port: int = 0,
                 interval: float = 0.5, require_token: bool | None = None) -> None:  # fmt: skip
        _require_aiohttp()
        from tidepool.dashboard.metrics import registry_for

        self.scheduler = scheduler
        self.model = DashboardModel(scheduler, autoscaler)
        self.registry = registry_for(self.model)
        self.host, self.port, self.interval = host, port, interval
        self.require_token = host not in LOOPBACK if require_token is None else require_token
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
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sock = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        host = self.host if self.host not in ("0.0.0.0", "") else sock[0]
        self.address = f"http://{host}:{sock[1]}/"
        self.scheduler.subscribe(self.model.observe)
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
            self.model.loop_lag = max(0.0, loop.time() - t - 0.1)
            if not self.streams and loop.time() >= next_sample:
                next_sample = loop.time() + self.interval
                try:
                    self.model.sample(self.scheduler.clock())
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
        return self._web().Response(text=PAGE, content_type="text/html")

    async def _state(self, request: Any) -> Any:
        return self._web().json_response(self.model.view(self.scheduler.clock()), dumps=_dumps)

    async def _history(self, request: Any) -> Any:
        return self._web().json_response(self.model.history(), dumps=_dumps)

    async def _metrics(self, request: Any) -> Any:
        from tidepool.dashboard.metrics import render

        web = self._web()
        return web.Response(body=render(self.registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _stream(self, request: Any) -> Any:
        web = self._web()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.streams += 1
        stream_after = decisions_after = 0
        try:
            history = json.dumps({"history": self.model.history()}, default=str)
            await resp.write(f"event: history\ndata: {history}\n\n".encode())
            while True:
                view = self.model.view(self.scheduler.clock(), stream_after, decisions_after)
                stream_after, decisions_after = view["stream_next"], view["decisions_next"]
                await resp.write(f"data: {_dumps(view)}\n\n".encode())
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


async def start_dashboard(scheduler: Any, address: str = "127.0.0.1:0", autoscaler: Callable[[], Any] | None = None,
                          interval: float = 0.5) -> Dashboard:  # fmt: skip
    """Serve the dashboard for ``scheduler`` at ``host:port`` (in the running loop)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"dashboard address {address!r} needs host:port, e.g. 127.0.0.1:8787")
    return await Dashboard(scheduler, autoscaler or (lambda: None), host or "127.0.0.1", int(port), interval).start()


__all__ = ["Dashboard", "start_dashboard"]
