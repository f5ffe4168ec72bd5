"""The asyncio shell around :class:`ScalingController`: runs it and carries out its actions.

It wakes every ``interval`` seconds and whenever the scheduler reports demand or a worker change,
polls the provider for failures, calls ``controller.step`` with the scheduler's state and clock,
then launches (in a thread: providers may block), retires gracefully through the scheduler, and
terminates.  ``close`` terminates every worker it ever launched, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from tidepool.errors import ProviderError
from tidepool.scaling.controller import ScalingController
from tidepool.scheduler import events as ev

if TYPE_CHECKING:
    from tidepool.providers.base import Provider
    from tidepool.scheduler.server import Scheduler

log = logging.getLogger("tidepool.scaling")


class AutoScaler:
    def __init__(self, scheduler: Scheduler, provider: Provider, controller: ScalingController,
                 interval: float = 0.2) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.provider = provider
        self.controller = controller
        self.interval = interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.steps = 0
        self._expiry_tried: dict[str, float] = {}  # worker -> when its walltime retire was asked

    async def start(self) -> AutoScaler:
        self.scheduler.subscribe(self._observe)
        journal = self.controller.journal
        now = self.scheduler.clock()
        journal.record("journal-start", now, wall=time.time(), address=self.scheduler.address)
        for ws in self.scheduler.state.workers.values():  # present before autoscaling started
            journal.record("worker-join", ws.joined, worker=ws.id, node_type=ws.node_type,
                           resources=dict(ws.resources))  # fmt: skip
        self.scheduler.subscribe(journal.observe)
        self.scheduler.state.infeasible = self.controller.infeasible_reason
        self.scheduler.eta_hooks.append(self._arrivals)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def _observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        wake = False
        for e in events:
            if isinstance(e, ev.WorkerJoin):
                self.controller.worker_joined(e.worker, e.now)
                if e.ready:
                    self.controller.worker_ready(e.worker)
                wake = True
            elif isinstance(e, ev.WorkerReady):
                self.controller.worker_ready(e.worker)
            elif isinstance(e, ev.WorkerRemove):
                if e.reason.startswith("setup failed"):
                    self.controller.worker_failed(e.worker, e.reason, e.now)
                wake = True
            elif isinstance(e, ev.UpdateGraph):
                wake = True
        if wake or (self.scheduler.state.pending and self.controller.backlog_since is None):
            self._wake.set()

    def _arrivals(self, now: float) -> tuple[float, ...]:
        out: list[float] = []
        for rec in self.controller.launches.values():
            nt = self.controller.node_types[rec.node_type]
            slots = max(1, int(nt.worker_resources.get("cpu", 1))) * nt.workers_per_node * rec.nodes
            out.extend([max(0.0, rec.since + nt.startup_estimate - now)] * slots)
        return tuple(out)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaler step failed")

    async def step(self) -> None:
        now = self.scheduler.clock()
        for failure in await asyncio.to_thread(self.provider.poll_errors):
            if failure.worker_id:
                self.controller.worker_failed(failure.worker_id, failure.message, now)
            else:
                self.controller.launch_failed(failure.request_id, failure.message, now)
        expiring = getattr(self.provider, "expiring", None)  # e.g. Slurm jobs near their walltime
        if expiring is not None:
            st = self.scheduler.state
            ids = [w for w in await asyncio.to_thread(expiring, time.time())
                   if w in st.workers and st.workers[w].state == "running" and w not in self.controller.retiring
                   and now - self._expiry_tried.get(w, -1e9) > 5.0]  # a refused retire is retried in 5 s  # fmt: skip
            if ids:
                self._expiry_tried.update(dict.fromkeys(ids, now))
                self.controller.retiring.update(ids)
                for w in ids:
                    self.controller.journal.record("retire", now, worker=w, reason="provider: walltime ends soon")
                self._spawn(self._retire(ids))
        actions = self.controller.step(self.scheduler.state, self.scheduler.clock())
        self.steps += 1
        for rid, nt, n in actions.launch:
            self._spawn(self._launch(rid, nt, n))
        if actions.terminate:
            await asyncio.to_thread(self.provider.terminate, actions.terminate)
        if actions.retire:
            self._spawn(self._retire(actions.retire))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _launch(self, rid: str, nt: Any, n: int) -> None:
        try:
            ids = await asyncio.to_thread(self.provider.launch, nt, n, rid)
        except Exception as exc:  # noqa: BLE001 - any provider failure backs the type off
            msg = str(exc) if isinstance(exc, ProviderError) else f"{type(exc).__name__}: {exc}"
            log.warning("launch %s of %s failed: %s", rid, nt.name, msg)
            self.controller.launch_failed(rid, msg, self.scheduler.clock())
            return
        self.controller.launched(rid, ids, self.scheduler.clock())

    async def _retire(self, ids: list[str]) -> None:
        result = await self.scheduler.retire_workers(ids, "autoscaler")
        now = self.scheduler.clock()
        done = []
        for wid, outcome in result.items():
            self.controller.retire_done(wid, outcome, now)
            if outcome == "retired":
                done.append(wid)
        if done:
            await asyncio.to_thread(self.provider.terminate, done)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._bg):
            t.cancel()
        ids = self.controller.launched_worker_ids()
        if ids:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.provider.terminate, ids)
        journal = self.controller.journal
        now = self.scheduler.clock()
        for wid in list(self.scheduler.state.workers):
            journal.record("worker-leave", now, worker=wid, reason="cluster closed", graceful=True)
        journal.close()
