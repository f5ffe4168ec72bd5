"""The asyncio shell around :class:`ScalingController`: runs it and carries out its actions.

It wakes every ``interval`` seconds and whenever the scheduler reports demand or a worker change,
polls the provider for failures, builds one observation of the scheduler's state (``observation.py``)
and calls ``controller.step`` with it,
then names the new workers (``provider.worker_ids``) and submits launches (``launch`` returns at
once; an :class:`AsyncProvider`'s coroutines are awaited in this loop, a plain provider's calls run in
a daemon thread bounded by a timeout, so one that breaks the contract and hangs fails that launch
and never blocks ``close`` or interpreter exit), retires gracefully through the scheduler, and
terminates.  While launches are in flight it lists the provider every ``LIST_EVERY`` seconds and
hands the listing to the controller, which fails launches whose workers vanished.  When a node type gets disabled it asks the scheduler to re-check
waiting tasks (``CheckFeasible``): those only that type could run fail with the provider's error.
``close`` terminates every worker it ever launched, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tidepool.errors import ProviderError
from tidepool.providers.base import AsyncProvider, ReportsExpiring
from tidepool.scaling.controller import ScalingController
from tidepool.scaling.observation import step_with_state
from tidepool.scheduler import events as ev
from tidepool.telemetry.journal import Journal

if TYPE_CHECKING:
    from tidepool.providers.base import Provider
    from tidepool.scheduler.server import Scheduler

log = logging.getLogger("tidepool.scaling")
T = TypeVar("T")
#: seconds a provider's poll/list/terminate call may take before the autoscaler stops waiting
PROVIDER_CALL_TIMEOUT = 30.0
#: seconds between provider listings while launches are in flight (listing may cost a squeue)
LIST_EVERY = 2.0


async def in_daemon_thread(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
    """Run a blocking call in a daemon thread; raise TimeoutError after ``timeout`` (the call keeps
    running in its thread, but nobody waits for it: not the loop, not interpreter exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def run() -> None:
        value: Any
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name=f"tidepool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    async with asyncio.timeout(timeout):  # (3.11's wait_for can swallow a cancel that races the result)
        return await asyncio.shield(fut)


class AutoScaler:
    def __init__(self, scheduler: Scheduler, provider: Provider, controller: ScalingController,
                 interval: float = 0.2, journal: Journal | None = None) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.provider = provider
        self.controller = controller
        self.interval = interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.steps = 0
        self._disabled_seen = 0  # how many disabled node types the scheduler was told about
        self._closing = False
        self._listed_at = float("-inf")
        #: the run's journal (a file, if given a path): scheduler events plus the controller's records
        self.journal = journal if journal is not None else Journal()

    async def start(self) -> AutoScaler:
        self.scheduler.subscribe(self._observe)
        journal = self.journal
        now = self.scheduler.clock()
        journal.record("journal-start", now, wall=time.time(), address=self.scheduler.address)
        for ws in self.scheduler.state.workers.values():  # present before autoscaling started
            journal.record("worker-join", ws.joined, worker=ws.id, node_type=ws.node_type,
                           resources=dict(ws.resources))  # fmt: skip
        self.scheduler.subscribe(journal.observe)
        self.scheduler.state.infeasible = self.controller.infeasible_reason
        for nt in self.controller.node_types.values():  # names these may offer are no typos
            self.scheduler.state.offered_resources.update(nt.resources)
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
                if e.cause is ev.RemoveCause.SETUP_FAILED:
                    self.controller.worker_failed(e.worker, e.reason, e.now, setup=True)
                wake = True
            elif isinstance(e, ev.UpdateGraph):
                wake = True
        self._sync()
        if wake or (self.scheduler.state.pending and self.controller.backlog_since is None):
            self._wake.set()

    def _sync(self) -> None:
        """Write the controller's new records into the run's journal."""
        for rec in self.controller.drain_records():
            self.journal.add(rec)

    def _arrivals(self, now: float) -> tuple[float, ...]:
        out: list[float] = []
        for rec in self.controller.launches.values():
            nt = self.controller.node_types[rec.node_type]
            slots = max(1, int(nt.worker_resources.get("cpu", 1))) * nt.workers_per_node * rec.nodes
            out.extend([max(0.0, rec.since + nt.startup_estimate - now)] * slots)
        return tuple(out)

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            if self._closing:
                return
            self._wake.clear()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaler step failed")

    async def step(self) -> None:
        now = self.scheduler.clock()
        for failure in await self._call("poll_errors"):
            if failure.worker_id:
                self.controller.worker_failed(failure.worker_id, failure.message, now)
            else:
                self.controller.launch_failed(failure.request_id, failure.message, now)
        expiring: list[str] = []
        if isinstance(self.provider, ReportsExpiring):  # e.g. Slurm jobs near their walltime
            expiring = await in_daemon_thread(self.provider.expiring, time.time(), timeout=PROVIDER_CALL_TIMEOUT)
        listing = None
        if self.controller.launches and now - self._listed_at >= LIST_EVERY:  # reconcile launches
            self._listed_at = now
            try:
                listing = await self._call("list")
            except Exception as exc:  # noqa: BLE001 - a listing that fails is just not used this round
                log.info("provider.list failed: %s", exc)
        actions = step_with_state(self.controller, self.scheduler.state, self.scheduler.clock(),
                                  expiring=expiring, listing=listing)  # fmt: skip
        for rec in actions.records:
            self.journal.add(rec)
        self.steps += 1
        if len(self.controller.unusable) != self._disabled_seen:
            self._disabled_seen = len(self.controller.unusable)
            await self.scheduler.apply([ev.CheckFeasible(self.scheduler.clock())])
        for rid, nt, n in actions.launch:
            self._spawn(self._launch(rid, nt, n))
        if actions.terminate:
            await self._call("terminate", actions.terminate)
        if actions.retire:
            self._spawn(self._retire(actions.retire))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _launch(self, rid: str, nt: Any, n: int) -> None:
        """Name the workers (so arrivals match), then submit: ``launch`` returns at once; what
        fails later comes through ``poll_errors``.  A sync provider's call still runs in a daemon
        thread, bounded by the launch timeout, so one that breaks the contract and blocks cannot
        stall the scheduler's loop."""
        rec = self.controller.launches.get(rid)
        timeout = max(1.0, rec.deadline - rec.since) if rec is not None else 60.0
        try:
            ids = list(self.provider.worker_ids(nt, n, rid))
            self.scheduler.expect_workers(ids, nt)
            self.controller.launched(rid, ids, self.scheduler.clock())
            self._sync()
            if isinstance(self.provider, AsyncProvider):
                async with asyncio.timeout(timeout):
                    await self.provider.launch_async(nt, n, rid)
            else:
                await in_daemon_thread(self.provider.launch, nt, n, rid, timeout=timeout)
        except TimeoutError:
            msg = (f"provider.launch({nt.name!r}, {n}, {rid!r}) did not return within {timeout:g}s; "
                   "a provider's launch must not block (submit the request and return)")  # fmt: skip
            log.warning("%s", msg)
            self.controller.launch_failed(rid, msg, self.scheduler.clock())
            self._sync()
        except Exception as exc:  # noqa: BLE001 - a provider breaking the contract by raising
            msg = str(exc) if isinstance(exc, ProviderError) else f"{type(exc).__name__}: {exc}"
            log.warning("launch %s of %s failed: %s", rid, nt.name, msg)
            self.controller.launch_failed(rid, msg, self.scheduler.clock())
            self._sync()

    async def _call(self, name: str, *args: Any) -> Any:
        """A provider call: awaited in this loop for an :class:`AsyncProvider`, else in a thread."""
        if isinstance(self.provider, AsyncProvider):
            async with asyncio.timeout(PROVIDER_CALL_TIMEOUT):
                return await getattr(self.provider, f"{name}_async")(*args)
        return await in_daemon_thread(getattr(self.provider, name), *args, timeout=PROVIDER_CALL_TIMEOUT)

    async def _retire(self, ids: list[str]) -> None:
        result = await self.scheduler.retire_workers(ids, "autoscaler")
        now = self.scheduler.clock()
        done = []
        for wid, outcome in result.items():
            self.controller.retire_done(wid, outcome, now)
            if outcome == "retired":
                done.append(wid)
        self._sync()
        if done:
            await self._call("terminate", done)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._bg):
            t.cancel()
        ids = self.controller.launched_worker_ids()
        if ids:
            with contextlib.suppress(Exception):
                await self._call("terminate", ids)
        self._sync()
        journal = self.journal
        now = self.scheduler.clock()
        for wid in list(self.scheduler.state.workers):
            journal.record("worker-leave", now, worker=wid, reason="cluster closed", graceful=True)
        journal.close()
