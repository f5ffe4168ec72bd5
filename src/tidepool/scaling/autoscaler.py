"""The asyncio shell around :class:`ScalingController`: runs the shared round, awaiting the provider.

It wakes every ``interval`` seconds and whenever the scheduler reports demand or a worker change.
The round itself (``scaling/shell/round.py``) is shared with the simulator and the tests: the
scheduler's events and the provider's failures become reports in its inbox, the provider is
listed every ``LIST_EVERY`` seconds while launches are in flight, and one observation of the
scheduler's state (``observation.py``) goes to ``controller.step``.  This shell then carries out
the actions: a new feasibility rule goes to the scheduler (``CheckFeasible``: tasks only a disabled
type could run fail with the provider's error), launches are named (``provider.worker_ids``) and
submitted (``launch`` returns at once; an :class:`AsyncProvider`'s coroutines are awaited in this
loop, a plain provider's calls run in a daemon thread bounded by a timeout, so one that breaks the
contract and hangs fails that launch and never blocks ``close`` or interpreter exit), workers are
terminated and retired gracefully through the scheduler.  ``close`` terminates every worker it
ever named, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tidepool.errors import ProviderError
from tidepool.loop import in_daemon_thread_future
from tidepool.providers.base import (
    AsyncProvider,
    ReportsEnds,
    ReportsEvents,
    ReportsExpiring,
    ReportsPreemption,
)
from tidepool.scaling.controller import ControllerView, ScalingController
from tidepool.scaling.shell.round import LIST_EVERY, Round
from tidepool.scheduler import events as ev
from tidepool.telemetry.journal import Journal
from tidepool.telemetry.startup import StartupTracker

if TYPE_CHECKING:
    from tidepool.providers.base import Provider
    from tidepool.scheduler.server import Scheduler

log = logging.getLogger("tidepool.scaling")
T = TypeVar("T")
#: seconds a provider's poll/list/terminate call may take before the autoscaler stops waiting
PROVIDER_CALL_TIMEOUT = 30.0
__all__ = ["LIST_EVERY", "PROVIDER_CALL_TIMEOUT", "AutoScaler", "in_daemon_thread"]


async def in_daemon_thread(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
    """Run a blocking call in a daemon thread; raise TimeoutError after ``timeout`` (the call keeps
    running in its thread, but nobody waits for it: not the loop, not interpreter exit)."""
    fut: asyncio.Future[T] = in_daemon_thread_future(fn, *args)
    async with asyncio.timeout(timeout):  # (3.11's wait_for can swallow a cancel that races the result)
        return await asyncio.shield(fut)


def on_clock(wall_times: dict[str, float], now: float) -> dict[str, float]:
    """Epoch-second times (a provider's) as times on the scheduler's clock, which reads ``now``."""
    offset = now - time.time()
    return {k: t + offset for k, t in wall_times.items()}


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0
        self._closing = False
        #: the run's journal (a file, if given a path): scheduler events plus the controller's records
        self.journal = journal if journal is not None else Journal()
        #: the shared round: the inbox of reports, listing times, the controller's last view
        self.round = Round(controller, self.journal)
        #: requested -> registered -> ready of every worker launched here (``worker-startup`` records)
        self.startup = StartupTracker()
        #: the provider, if it reports journal records of its own (checked once: _observe runs per batch)
        self._events_source: ReportsEvents | None = provider if isinstance(provider, ReportsEvents) else None
        replacing = any(nt.replace_before for nt in controller.node_types.values())
        self._ends_source: ReportsEnds | None = provider if replacing and isinstance(provider, ReportsEnds) else None

    @property
    def view(self) -> ControllerView:
        """The controller's read-only view as of its last step (backlog, launches in flight,
        failures and disabled node types, learned start-up)."""
        return self.round.view

    def adopt(self, wid: str) -> None:
        """``wid`` (the cluster's own worker) is the autoscaler's to retire too.  Callable from
        any thread: the report joins the inbox in the event loop's thread."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if loop is None or here:
            self.round.adopt(wid, self.scheduler.clock())
        else:
            loop.call_soon_threadsafe(self.round.adopt, wid, self.scheduler.clock())

    async def start(self) -> AutoScaler:
        self._loop = asyncio.get_running_loop()
        self.scheduler.subscribe(self._observe)
        journal = self.journal
        now = self.scheduler.clock()
        journal.record("journal-start", now, wall=time.time(), address=self.scheduler.address)
        for ws in self.scheduler.state.workers.values():  # present before autoscaling started
            journal.record("worker-join", ws.joined, worker=ws.id, node_type=ws.node_type,
                           resources=dict(ws.resources))  # fmt: skip
        journal.follow(self.scheduler)
        await self.scheduler.apply([ev.CheckFeasible(now, self.round.view.feasibility)])
        for nt in self.controller.node_types.values():  # names these may offer are no typos
            self.scheduler.state.offered_resources.update(nt.resources)
        self.scheduler.eta_hooks.append(self.round.arrivals)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def _observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        self._provider_events()
        for e in events:
            if isinstance(e, ev.WorkerJoin):
                self.startup.joined(e.worker, e.now)
                if e.ready:
                    self._startup_record(e.worker, e.now)
            elif isinstance(e, ev.WorkerReady):
                self._startup_record(e.worker, e.now)
            elif isinstance(e, ev.WorkerRemove):
                self.startup.forget(e.worker)
        if self.round.scheduler_events(events, bool(self.scheduler.state.pending)):
            self._wake.set()

    def _startup_record(self, wid: str, now: float) -> None:
        rec = self.startup.ready(wid, now)
        if rec is not None:
            self.journal.add(rec)

    def _provider_events(self) -> None:
        """The provider's own records (how each worker was started, a fork server replaced ...)."""
        if self._events_source is None:
            return
        now = self.scheduler.clock()
        for rec in self._events_source.drain_events():
            kind = str(rec.pop("kind", "provider"))
            if kind == "worker-launch" and rec.get("worker"):
                self.startup.started_by(str(rec["worker"]), str(rec.get("how")))
            self.journal.record(kind, now, **rec)

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
        rnd = self.round
        now = self.scheduler.clock()
        self._provider_events()
        expiring: list[str] = []
        if isinstance(self.provider, ReportsExpiring):  # e.g. Slurm jobs near their walltime
            expiring = await in_daemon_thread(self.provider.expiring, time.time(), timeout=PROVIDER_CALL_TIMEOUT)
        notices = ends = None  # wall-clock times from the provider, on the scheduler's clock
        if isinstance(self.provider, ReportsPreemption):  # cheap by contract: called in this loop
            notices = on_clock(self.provider.preemptions(time.time()), self.scheduler.clock())
        if self._ends_source is not None:  # only when a node type replaces workers ahead of their end
            ends = on_clock(await in_daemon_thread(self._ends_source.ends, time.time(), timeout=PROVIDER_CALL_TIMEOUT),
                            self.scheduler.clock())  # fmt: skip
        listing = None
        listed_at = None
        if rnd.listing_due(now):  # reconcile launches
            try:
                # a launch of an earlier round may name its workers while this listing runs: the
                # listing cannot show them, so they are not failed for missing from it
                listed_at = self.scheduler.clock()
                listing = await self._call("list")
            except Exception as exc:  # noqa: BLE001 - a listing that fails is just not used this round
                log.info("provider.list failed: %s", exc)
        # failures after the listing: a watch event landing between the two calls would otherwise
        # show a worker as ended in the listing whose failure (the provider's reason: OOMKilled,
        # Evicted, ...) is not in this round, and the reconcile would blame a bare exit code
        rnd.provider_failures(await self._call("poll_errors"), now)
        now = self.scheduler.clock()
        actions, _ = rnd.step(self.scheduler.state, now, expiring=expiring, listing=listing, notices=notices,
                              ends=ends, listed_at=listed_at)  # fmt: skip
        self.steps += 1
        durable = getattr(self.scheduler, "durable", None)
        if actions.instances and durable is not None:  # the instance table, stored once a tick
            durable.record_instances(actions.instances)
        if actions.cost is not None and durable is not None:  # so is the cost meter (a restart goes on)
            durable.record_cost({**actions.cost, "wall": time.time()})
        if actions.feasibility is not None:
            await self.scheduler.apply([ev.CheckFeasible(now, actions.feasibility)])
        for rid, nt, n in actions.launch:
            self._spawn(self._launch(rid, nt, n, actions.launch_timeouts.get(rid, 60.0)))
        if actions.terminate:
            await self._call("terminate", actions.terminate)
        if actions.retire:
            self._spawn(self._retire(actions.retire))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _launch(self, rid: str, nt: Any, n: int, timeout: float) -> None:
        """Name the workers (so arrivals match), then submit: ``launch`` returns at once; what
        fails later comes through ``poll_errors``.  A sync provider's call still runs in a daemon
        thread, bounded by half the launch timeout (so a call that hangs is reported as such,
        before the controller gives up on the launch's workers), so one that breaks the contract
        and blocks cannot stall the scheduler's loop."""
        timeout = max(0.5, timeout / 2)
        ids: list[str] = []
        try:
            ids = list(self.provider.worker_ids(nt, n, rid))
            self.scheduler.expect_workers(ids, nt)
            self.round.name(rid, ids, self.scheduler.clock(), submitted=False)
            self.startup.launched(ids, rid, nt.name, self.scheduler.clock())
            if isinstance(self.provider, AsyncProvider):
                async with asyncio.timeout(timeout):
                    await self.provider.launch_async(nt, n, rid)
            else:
                await in_daemon_thread(self.provider.launch, nt, n, rid, timeout=timeout)
            self._provider_events()
        except TimeoutError:
            msg = (f"provider.launch({nt.name!r}, {n}, {rid!r}) did not return within {timeout:g}s; "
                   "a provider's launch must not block (submit the request and return)")  # fmt: skip
            log.warning("%s", msg)
            self.round.launch_failed(rid, msg, self.scheduler.clock())
        except Exception as exc:  # noqa: BLE001 - a provider breaking the contract by raising
            msg = str(exc) if isinstance(exc, ProviderError) else f"{type(exc).__name__}: {exc}"
            log.warning("launch %s of %s failed: %s", rid, nt.name, msg)
            self.round.launch_failed(rid, msg, self.scheduler.clock())
        finally:  # listings asked for from now on can show them (or their end)
            self.round.submitted(ids, self.scheduler.clock())

    async def _call(self, name: str, *args: Any) -> Any:
        """A provider call: awaited in this loop for an :class:`AsyncProvider`, else in a thread."""
        if isinstance(self.provider, AsyncProvider):
            async with asyncio.timeout(PROVIDER_CALL_TIMEOUT):
                return await getattr(self.provider, f"{name}_async")(*args)
        return await in_daemon_thread(getattr(self.provider, name), *args, timeout=PROVIDER_CALL_TIMEOUT)

    async def _retire(self, ids: list[str]) -> None:
        result = await self.scheduler.retire_workers(ids, "autoscaler")
        done = self.round.retired(result, self.scheduler.clock())
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
        ids = list(dict.fromkeys(self.round.named))
        if ids:
            with contextlib.suppress(Exception):
                await self._call("terminate", ids)
        journal = self.journal
        now = self.scheduler.clock()
        for wid in list(self.scheduler.state.workers):
            journal.record("worker-leave", now, worker=wid, reason="cluster closed", graceful=True)
        journal.close()
