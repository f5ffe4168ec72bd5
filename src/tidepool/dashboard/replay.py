"""The post-mortem dashboard: the same page for a finished run, rebuilt from its journal.

``tidepool dashboard run.jsonl`` serves it; no cluster runs.  :class:`ReplayModel` reads the
journal once (records sorted by time) and answers :meth:`view` for any moment ``t`` of the run in
the shape the live page reads: the time series up to ``t`` (workers per node type, busy when a task
of theirs spanned the moment, pending launches), task groups done and failed by then, the workers
present then, the scaling decisions made by then and the task stream of the minute before ``t``.
Held bytes and the forecast are not in a journal, so they read 0 and "-".  Pure: no I/O beyond
reading the file; the server is :func:`serve_replay`.
"""

from __future__ import annotations

import asyncio
import bisect
import json
from typing import Any

from tidepool.dashboard.model import ACTIVITIES, DECISIONS
from tidepool.errors import ConfigError
from tidepool.sim.workload import group_of

#: points of the time series over the whole run
POINTS = 400


def _close_launch(open_: dict[str, tuple[str, int]], r: dict[str, Any]) -> None:
    """A launch record ended a request in flight: all of it, or only the nodes a policy called off
    (``called_off``; the rest still comes: a bug hunt saw a partly called-off launch drop to 0)."""
    rid = str(r.get("request"))
    if r.get("kind") == "cancel-launch" and r.get("called_off") and rid in open_:
        nt, n = open_[rid]
        n -= int(r.get("nodes", n))
        if n > 0:
            open_[rid] = (nt, n)
            return
    open_.pop(rid, None)


class ReplayModel:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        recs = sorted((r for r in records if isinstance(r.get("t"), (int, float))), key=lambda r: r["t"])
        if not recs:
            raise ConfigError("the journal has no timed records: nothing to show (was it written by "
                              "cluster.adapt(journal='run.jsonl') or `tidepool scheduler --journal`?)")  # fmt: skip
        self.records = recs
        self.times = [float(r["t"]) for r in recs]
        tasks = [r for r in recs if r.get("kind") == "task"]
        self.t0 = min(self.times[0], min((float(r.get("start", r["t"])) for r in tasks), default=self.times[0]))
        self.t1 = max(self.times[-1], self.t0 + 1e-3)
        self.tasks = tasks
        self.task_ends = [float(r["t"]) for r in tasks]
        #: tasks the scheduler failed itself (no worker ran them to the end), by time
        self.failed_here = [r for r in recs if r.get("kind") == "task-failed"]
        self.node_types = sorted({str(r.get("node_type")) for r in recs
                                  if r.get("kind") in ("worker-join", "launch") and r.get("node_type")})  # fmt: skip
        step = (self.t1 - self.t0) / (POINTS - 1)
        self.series = self._sweep([self.t0 + i * step for i in range(POINTS)])

    def _sweep(self, times: list[float]) -> list[dict[str, Any]]:
        """The points at ``times`` (ascending) in one pass over the run (as :meth:`_point` each)."""
        member = [r for r in self.records if r.get("kind") in ("worker-join", "worker-leave", "worker-close", "launch",
                                                               "launch-arrived", "launch-failed", "cancel-launch")]
        starts = sorted(self.tasks, key=lambda r: float(r.get("start", r["t"])))
        ends = self.tasks  # sorted by end already
        present: dict[str, str] = {}
        open_: dict[str, tuple[str, int]] = {}
        running: dict[str, int] = {}
        i = j = k = 0
        out = []
        for t in times:
            while i < len(member) and float(member[i]["t"]) <= t:
                r = member[i]
                kind, rid = r.get("kind"), str(r.get("request"))
                if kind == "worker-join":
                    present[str(r["worker"])] = str(r.get("node_type", "default"))
                elif kind in ("worker-leave", "worker-close"):  # (a retired worker closes, no leave)
                    present.pop(str(r["worker"]), None)
                elif kind == "launch" and r.get("request"):
                    open_[rid] = (str(r.get("node_type")), int(r.get("nodes", 1)))
                elif r.get("request"):
                    _close_launch(open_, r)
                i += 1
            while j < len(starts) and float(starts[j].get("start", starts[j]["t"])) <= t:
                w = str(starts[j]["worker"])
                running[w] = running.get(w, 0) + 1
                j += 1
            while k < len(ends) and float(ends[k]["t"]) < t:
                w = str(ends[k]["worker"])
                running[w] = running.get(w, 0) - 1
                k += 1
            by_type: dict[str, dict[str, int]] = {nt: dict.fromkeys(ACTIVITIES, 0) for nt in self.node_types}
            for wid, nt in present.items():
                c = by_type.setdefault(nt, dict.fromkeys(ACTIVITIES, 0))
                c["busy" if running.get(wid, 0) > 0 else "idle"] += 1
            pending: dict[str, int] = dict.fromkeys(self.node_types, 0)
            for nt, n in open_.values():
                pending[nt] = pending.get(nt, 0) + n
            out.append({"t": round(t, 3), "workers": by_type, "pending": pending, "eta": None, "tasks": 0})
        return out

    # ---- the run at a moment ----------------------------------------------------------------------
    def _upto(self, t: float) -> list[dict[str, Any]]:
        return self.records[: bisect.bisect_right(self.times, t)]

    def _workers_at(self, t: float) -> dict[str, dict[str, Any]]:
        present: dict[str, dict[str, Any]] = {}
        for r in self._upto(t):
            k = r.get("kind")
            if k == "worker-join":
                present[str(r["worker"])] = {"id": r["worker"], "node_type": r.get("node_type", "default"),
                                             "resources": r.get("resources") or {}, "joined": r["t"]}  # fmt: skip
            elif k in ("worker-leave", "worker-close"):
                present.pop(str(r["worker"]), None)
        return present

    def _running_at(self, t: float) -> dict[str, int]:
        """Tasks running at ``t`` per worker (those that started by ``t`` and ended after it)."""
        out: dict[str, int] = {}
        for r in self.tasks[bisect.bisect_left(self.task_ends, t):]:
            if float(r.get("start", r["t"])) <= t:
                out[str(r["worker"])] = out.get(str(r["worker"]), 0) + 1
        return out

    def _pending_at(self, t: float) -> dict[str, int]:
        pending: dict[str, int] = dict.fromkeys(self.node_types, 0)
        open_: dict[str, tuple[str, int]] = {}
        for r in self._upto(t):
            k, rid = r.get("kind"), r.get("request")
            if k == "launch" and rid:
                open_[str(rid)] = (str(r.get("node_type")), int(r.get("nodes", 1)))
            elif k in ("launch-arrived", "launch-failed", "cancel-launch") and rid:
                _close_launch(open_, r)
        for nt, n in open_.values():
            pending[nt] = pending.get(nt, 0) + n
        return pending

    def _point(self, t: float) -> dict[str, Any]:
        by_type: dict[str, dict[str, int]] = {nt: dict.fromkeys(ACTIVITIES, 0) for nt in self.node_types}
        running = self._running_at(t)
        for wid, w in self._workers_at(t).items():
            c = by_type.setdefault(str(w["node_type"]), dict.fromkeys(ACTIVITIES, 0))
            c["busy" if running.get(wid) else "idle"] += 1
        return {"t": round(t, 3), "workers": by_type, "pending": self._pending_at(t), "eta": None,
                "tasks": 0}  # fmt: skip

    def view(self, t: float) -> dict[str, Any]:
        """The page's ``{"view": ..., "history": ...}`` for the run as it was at ``t``."""
        t = min(max(t, self.t0), self.t1)
        done = self.tasks[: bisect.bisect_right(self.task_ends, t)]
        groups: dict[str, dict[str, int]] = {}
        finished = erred = 0
        for r in done:
            g = groups.setdefault(_group(r), {"memory": 0, "erred": 0})
            if r.get("ok", True):
                g["memory"] += 1
                finished += 1
            else:
                g["erred"] += 1
                erred += 1
        for r in self.failed_here:
            if float(r["t"]) > t:
                break
            g = groups.setdefault(_group(r), {"memory": 0, "erred": 0})
            g["erred"] += 1
            erred += 1
        running = self._running_at(t)
        for r in self.tasks[bisect.bisect_left(self.task_ends, t):]:
            if float(r.get("start", r["t"])) <= t:
                g = groups.setdefault(_group(r), {"memory": 0, "erred": 0})
                g["running"] = g.get("running", 0) + 1
        workers = []
        for wid, w in sorted(self._workers_at(t).items()):
            n = running.get(wid, 0)
            workers.append({"id": wid, "name": wid, "node_type": w["node_type"], "state": "running",
                            "resources": w["resources"], "running": n, "held_keys": 0, "held_bytes": 0,
                            "spilled_bytes": 0, "rss": 0, "memory_limit": 0, "idle_for": None,
                            "idle_and_empty": n == 0})  # fmt: skip
        decisions = [dict(r, i=i) for i, r in enumerate(self._upto(t)) if r.get("kind") in DECISIONS][-200:]
        stream = [{"seq": i, "key": r["key"], "group": _group(r), "worker": r["worker"],
                   "start": float(r.get("start", r["t"])), "duration": float(r.get("duration", 0.0)),
                   "ok": bool(r.get("ok", True))}
                  for i, r in enumerate(done) if float(r["t"]) >= t - 60][-2000:]  # fmt: skip
        point = self._point(t)
        view = {"now": round(t, 3), "t0": round(self.t0, 3), "point": point, "counts": {},
                "counters": {"finished": finished, "erred": erred}, "groups": groups, "workers": workers,
                "decisions": decisions, "decisions_next": len(decisions), "stream": stream,
                "stream_next": len(done), "loop_lag": 0.0}  # fmt: skip
        history = [p for p in self.series if p["t"] < t] + [point]
        return {"live": False, "view": view, "history": history, "range": [self.t0, self.t1]}


async def serve_replay(path: str, address: str = "127.0.0.1:", ready: asyncio.Future[str] | None = None) -> None:
    """Serve the post-mortem page for the journal at ``path`` until cancelled; ``ready`` gets the link."""
    from tidepool.dashboard.server import LOOPBACK, _require_aiohttp, page_with, parse_address
    from tidepool.telemetry.report import load_records

    web = _require_aiohttp()
    model = ReplayModel(load_records(path))
    host, port = parse_address(address)
    if host not in LOOPBACK:
        raise ConfigError(f"the post-mortem dashboard serves on localhost only (it has no token), not {host!r}; "
                          "reach it through an SSH tunnel (ssh -L 8787:127.0.0.1:8787 ...)")  # fmt: skip

    async def page(request: Any) -> Any:
        return web.Response(text=page_with(json.dumps(model.view(model.t1), default=str)), content_type="text/html")

    async def state(request: Any) -> Any:
        try:
            t = float(request.query.get("t", model.t1))
        except ValueError:
            raise web.HTTPBadRequest(text="t must be a number (seconds, as in the journal)") from None
        return web.Response(text=json.dumps(model.view(t), default=str), content_type="application/json")

    app = web.Application()
    app.add_routes([web.get("/", page), web.get("/api/state", state)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    from tidepool.dashboard.server import DEFAULT_PORT, PORT_TRIES

    ports = [port] if port is not None else [*range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES), 0]
    try:
        for i, p in enumerate(ports):
            site = web.TCPSite(runner, host, p)
            try:
                await site.start()
                break
            except OSError:
                if i == len(ports) - 1:
                    raise
        sock = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        link = f"http://{host}:{sock[1]}/"
        if ready is not None:
            ready.set_result(link)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["ReplayModel", "serve_replay"]


def _group(r: dict[str, Any]) -> str:
    """A task record's group: as journaled (the client's name for it), else read off its key."""
    return str(r.get("group") or group_of(str(r["key"])))
