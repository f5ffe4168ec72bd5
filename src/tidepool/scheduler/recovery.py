"""Carrying on after a scheduler restart: what is persisted, how it is loaded, how workers rejoin.

State
-----
:class:`Persister` (a scheduler observer) keeps, per stored key, the record and the outcome last
written (``p`` pending, ``m`` finished, ``e`` erred), a mirror of each client's wanted keys, and
the :class:`~tidepool.scheduler.store.Batch` being built.  :class:`Durability` (owned by the
server) holds the store, the recovery gate (workers expected back, and until when to wait for
them) and the restored clients not reconnected yet (and until when they may).

Data flow
---------
Running: :class:`SchedulerState` adds every record whose state changes, or that it forgets, to
``state.tally.dirty`` (one set insertion on the hot path).  Each scheduler tick the persister turns
that set and the tick's worker/client events into one batch: new tasks with their spec, outcome
changes, forgotten keys, wanted keys added or dropped; the store writes it on its own thread.

Tasks kept running for nobody (``fire_and_forget``) are stored as wants of the pseudo-client
``FIRE_AND_FORGET`` while it holds them (``forgotten_wants``), and kept so again at a restart.
The setup hooks clients register (``register_setup``) are stored as they come, in their order,
and given back to the server at a restart (:attr:`Durability.setups`), so workers that join
afterwards run them too.

Restart: :func:`restore_events` turns the stored snapshot into ordinary events (one graph update
with every task, each client's wanted keys, the errors of tasks that had erred), applied before the
listener opens, so nothing runs yet: there are no workers.  Workers re-register with what they hold
and run (``WorkerRejoin``): held values count as finished again, their running and queued tasks
stay theirs (no ``Execute`` is sent again); values of keys the store does not have (a graph sent
just before the kill) are kept for a while, for the client that resends it (``rejoin.py``).  Until every worker the store names is back (or
``recovery_wait`` passes) joining workers stay "starting", so nothing is placed on the first one
back while a value it would recompute sits on a worker still reconnecting.  Then they turn
running, and whatever is still missing is computed from the persisted graph.  Restored clients
that do not reconnect within the reconnect window are gone (their keys are released).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

from tidepool.comm.auth import new_token
from tidepool.comm.serialize import Serialized
from tidepool.scheduler import events as ev
from tidepool.scheduler.intake import LINE, PRIORITY_STEP
from tidepool.scheduler.kinds import TaskState as TS
from tidepool.scheduler.records import TaskRecord
from tidepool.scheduler.state import FIRE_AND_FORGET, SchedulerState
from tidepool.scheduler.store import FILE_NAME, Batch, Snapshot, StateStore, StoredTask

log = logging.getLogger("tidepool.scheduler.recovery")

#: the pseudo-client that holds every restored task until the clients' wants are restored
RESTORING = "<restoring>"
#: seconds workers and clients may take to reach a restarted scheduler (their retry window)
DEFAULT_RECONNECT_WINDOW = 300.0
#: seconds a restarted scheduler waits for the workers its store names before recomputing
DEFAULT_RECOVERY_WAIT = 10.0


def rejoin_event(wid: str, rejoin: dict[str, Any], now: float) -> ev.WorkerRejoin:
    """The ``rejoin`` part of a re-registering worker's message as an event."""
    held = [(str(k), int(n)) for k, n in rejoin.get("held") or ()]
    return ev.WorkerRejoin(wid, held, [str(k) for k in rejoin.get("running") or ()],
                           [str(k) for k in rejoin.get("queued") or ()], now)  # fmt: skip


# ---- snapshot -> events -----------------------------------------------------------------------------
def restore_events(snap: Snapshot, now: float) -> list[ev.Event]:
    """Events that rebuild the graph, the clients' wants and the errors of ``snap`` (no workers)."""
    specs = []
    for t in snap.tasks:
        fid, deps, resources, retries, group, priority, workers, loose = t.spec[:8]
        specs.append(ev.TaskSpec(t.key, str(fid), t.payload, tuple(deps), dict(resources), int(retries),
                                 str(group), int(priority), tuple(workers), bool(loose)))  # fmt: skip
    wanted = {k for keys in snap.wants.values() for k in keys}
    known = [t.key for t in snap.tasks]
    events: list[ev.Event] = [ev.UpdateGraph(RESTORING, specs, [k for k in known if k in wanted], now,
                                             dict(snap.functions))]  # fmt: skip
    for client, keys in sorted(snap.wants.items()):
        if client == FIRE_AND_FORGET:  # kept running for nobody, to the end (fire_and_forget)
            events.append(ev.FireAndForget(list(keys), now))
        else:
            events.append(ev.UpdateGraph(client, [], keys, now))
    errors = {t.key: t.error for t in snap.tasks if t.status == "e" and t.error is not None}
    if errors:
        events.append(ev.RestoreErrors(errors, now))
    events.append(ev.ClientGone(RESTORING, now))
    return events


# ---- persisting ---------------------------------------------------------------------------------------
def _status(ts: TaskRecord) -> str:
    return "m" if ts.state == TS.MEMORY else "e" if ts.state == TS.ERRED else "p"


def _error(ts: TaskRecord) -> dict[str, Any] | None:
    if ts.state != TS.ERRED:
        return None
    return {"exception": ts.exception, "traceback": ts.traceback, "type": ts.exc_type,
            "message": ts.message, "origin": ts.error_origin}  # fmt: skip


def spec_of(ts: TaskRecord) -> list[Any]:
    """What was submitted for ``ts`` (func, deps, resources, retries, group, priority, workers, loose)."""
    user_priority = -(ts.priority // PRIORITY_STEP)
    return [ts.func_id, [d.key for d in ts.deps], dict(ts.shape), ts.retries_left, ts.group, user_priority,
            sorted(ts.restrict or ()), ts.loose]  # fmt: skip


class Persister:
    """Scheduler observer: one batch per tick to the store (see the module docstring)."""

    def __init__(self, store: StateStore, state: SchedulerState) -> None:
        self.store = store
        self.state = state
        state.tally.dirty = set()
        self.stored: dict[str, tuple[TaskRecord, str]] = {}
        self.wants: dict[str, set[str]] = {}
        self.touched: set[str] = set()
        #: keys stored as wanted by nobody but fire_and_forget, and keys whose such want may have changed
        self.forgotten_wants: set[str] = set()
        self.faf_touched: set[str] = set()
        self.functions: set[str] = set()
        self.batch = Batch()
        self.paused = False  # while a restarted scheduler waits for its workers

    def adopt(self, snap: Snapshot) -> None:
        """The state was just rebuilt from ``snap``: its rows are what the store holds."""
        st = self.state
        status = {t.key: t.status for t in snap.tasks}
        for key, ts in st.tasks.items():
            self.stored[key] = (ts, status.get(key, "p"))
        self.batch.forgotten.extend(k for k in status if k not in st.tasks)
        for client, keys in snap.wants.items():
            if client == FIRE_AND_FORGET:
                self.forgotten_wants = set(keys)
                self.faf_touched.update(keys)
                continue
            self.wants[client] = set(keys)
            self.touched.add(client)
        self.functions.update(snap.functions)
        assert st.tally.dirty is not None
        st.tally.dirty.clear()
        st.tally.dirty.update(st.tasks.values())  # written with their state once the gate opens

    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        b = self.batch
        for e in events:
            if isinstance(e, ev.UpdateGraph):
                self.touched.add(e.client)
                for fid, blob in e.functions.items():
                    if fid not in self.functions:
                        self.functions.add(fid)
                        b.functions[fid] = blob
            elif isinstance(e, (ev.ReleaseKeys, ev.ClientGone)):
                self.touched.add(e.client)
            elif isinstance(e, ev.FireAndForget):
                self.faf_touched.update(e.keys)
            elif isinstance(e, ev.WorkerJoin):
                b.workers_left = [w for w in b.workers_left if w != e.worker]
                b.workers_joined.append((e.worker, e.address))
            elif isinstance(e, ev.WorkerRemove):
                b.workers_joined = [p for p in b.workers_joined if p[0] != e.worker]
                b.workers_left.append(e.worker)
            elif isinstance(e, ev.Restart):
                self.flush()
                assert self.state.tally.dirty is not None
                self.state.tally.dirty.clear()
                self.stored.clear()
                self.wants.clear()
                self.forgotten_wants.clear()
                self.faf_touched.clear()
                self.batch.clear_tasks = True
            elif isinstance(e, ev.Tick) and not self.paused:
                self.flush()

    def flush(self) -> None:
        st = self.state
        b, self.batch = self.batch, Batch()
        dirty = st.tally.dirty
        assert dirty is not None
        st.tally.dirty = set()
        tasks, stored = st.tasks, self.stored
        new: list[TaskRecord] = []
        faf = self.faf_touched
        self.faf_touched = set()
        for old in dirty:
            key = old.key
            if key in self.forgotten_wants:
                faf.add(key)
            ts = tasks.get(key)
            prev = stored.get(key)
            if ts is None:
                if prev is not None:
                    del stored[key]
                    b.forgotten.append(key)
                continue
            if ts is not old and ts in dirty:
                continue  # the key's new record comes up on its own
            if prev is None or prev[0] is not ts:
                new.append(ts)
                continue
            status = _status(ts)
            if prev[1] != status:
                b.outcomes[key] = (status, sorted(ts.who_has) if status == "m" else [], _error(ts))
                stored[key] = (ts, status)
        if new:
            self._insert(new, b)
        for client in self.touched:
            if client == FIRE_AND_FORGET or client == RESTORING:
                continue
            now = st.clients.get(client) or set()
            before = self.wants.get(client, set())
            b.wants_added.extend((client, k) for k in now - before)
            b.wants_removed.extend((client, k) for k in before - now)
            if now:
                self.wants[client] = set(now)
            else:
                self.wants.pop(client, None)
        self.touched.clear()
        for key in faf:  # fire-and-forget wants: a row while the task is kept for nobody
            ts = tasks.get(key)
            keep = ts is not None and FIRE_AND_FORGET in ts.wanted_by
            if keep and key not in self.forgotten_wants:
                self.forgotten_wants.add(key)
                b.wants_added.append((FIRE_AND_FORGET, key))
            elif not keep and key in self.forgotten_wants:
                self.forgotten_wants.discard(key)
                b.wants_removed.append((FIRE_AND_FORGET, key))
        if b:
            self.store.submit(b)


    def _insert(self, new: list[TaskRecord], b: Batch) -> None:
        """Store new records, inputs first (a restart replays them in the store's order), with any
        input not stored yet."""
        stored, tasks = self.stored, self.state.tasks
        seen = {id(ts) for ts in new}
        stack = list(new)
        while stack:
            for d in stack.pop().deps:
                if id(d) not in seen and tasks.get(d.key) is d and (d.key not in stored or stored[d.key][0] is not d):
                    seen.add(id(d))
                    new.append(d)
                    stack.append(d)
        new.sort(key=lambda t: t.priority % LINE)  # its submission number: inputs come first
        for ts in new:
            status = _status(ts)
            holders = sorted(ts.who_has) if status == "m" else []
            b.new_tasks.append(StoredTask(ts.key, spec_of(ts), ts.spec_payload, status, holders, _error(ts)))
            stored[ts.key] = (ts, status)


# ---- the server's helper ------------------------------------------------------------------------------
class Durability:
    """What a scheduler with a state directory does besides its usual work (see the module docstring)."""

    def __init__(self, state_dir: str, token: str | None, *, reconnect_window: float = DEFAULT_RECONNECT_WINDOW,
                 recovery_wait: float = DEFAULT_RECOVERY_WAIT) -> None:  # fmt: skip
        if not token and not (Path(state_dir) / FILE_NAME).exists():
            token = new_token()  # a new durable cluster: its token is kept in the store
        self.store = StateStore(state_dir, token)
        self.token = self.store.token
        self.reconnect_window = reconnect_window
        self.recovery_wait = recovery_wait
        self.snapshot = self.store.load()  # refused whole, before anything listens
        #: the setup hooks clients had registered (name, pickled spec), for workers that join from now on
        self.setups: list[tuple[str, Serialized]] = list(self.snapshot.setups)
        self.expected: set[str] = set()
        self.expected_at: dict[str, str] = {}
        self.back: set[str] = set()
        self.gate_until = 0.0
        self.gate_open = True
        self.restored_clients: dict[str, float] = {}
        self.reports: list[ev.Event] = []
        self.persister: Persister | None = None
        self.state: SchedulerState | None = None
        self._began = time.monotonic()
        #: until when requests naming a worker of the last run wait for it to rejoin (monotonic)
        self.rejoin_deadline = self._began + recovery_wait
        self._finished_before: set[str] = set()

    def address(self, requested: str) -> str:
        """Listen where the last run listened when no port was asked for (``:0``)."""
        stored = self.store.address
        if stored and requested.rsplit(":", 1)[-1] == "0" and requested.split("://")[0] == stored.split("://")[0]:
            return stored
        return requested

    def restore(self, st: SchedulerState, now: float) -> int:
        """Rebuild ``st`` from the snapshot; returns the highest restored client number (ids go on
        from there)."""
        snap = self.snapshot
        self.state = st
        began = time.perf_counter()
        # the state knows at once that it was restored: workers may rejoin before the next tick
        # delivers the "loaded" report (rejoin.py keeps their values of keys not known yet)
        st.handle_many([*restore_events(snap, now), ev.RecoveryReport("restored", {}, now)])
        self.persister = Persister(self.store, st)
        self.persister.adopt(snap)
        self._finished_before = {t.key for t in snap.tasks if t.status == "m"}
        # the workers registered at the last flush (a holder recorded on a row may have died since)
        self.expected = set(snap.workers)
        self.expected_at = {address: wid for wid, address in snap.workers.items()}  # address -> id
        if self.expected and snap.tasks:
            self.gate_open = False
            self.gate_until = now + self.recovery_wait
            self.persister.paused = True
        self.restored_clients = {c: now + self.reconnect_window for c in snap.wants if c != FIRE_AND_FORGET}
        numbers = [int(m.group(1)) for c in snap.wants if (m := re.fullmatch(r"client-(\d+)", c))]
        self.reports.append(ev.RecoveryReport("loaded", {
            "tasks": len(snap.tasks), "finished": len(self._finished_before),
            "erred": sum(1 for t in snap.tasks if t.status == "e"), "clients": len(self.restored_clients),
            "workers_expected": len(self.expected), "load_seconds": round(time.perf_counter() - began, 4),
        }, now))  # fmt: skip
        self.snapshot = Snapshot(snap.address, [], {}, {}, {}, snap.instances, [], snap.cost)  # free the memory
        return max(numbers, default=0)

    def claim_client(self, cid: str) -> bool:
        """A reconnecting client asks for its old id: it gets it if it is a restored client's (or
        the scheduler did not restart: then it is a new client with that id, wanting nothing)."""
        return bool(re.fullmatch(r"client-\d+", cid)) and self.restored_clients.pop(cid, None) is not None

    def park_client(self, cid: str, now: float) -> None:
        """A client's connection closed without its goodbye (a network cut, a client host that went
        away): keep its wanted keys for the reconnect window, as for a client of a restart."""
        self.restored_clients[cid] = now + self.reconnect_window

    def worker_joined(self, wid: str, now: float) -> list[ev.Event]:
        self.back.add(wid)
        return self._maybe_open(now)

    def on_tick(self, now: float) -> list[ev.Event]:
        out = self._maybe_open(now)
        gone = [c for c, until in self.restored_clients.items() if now >= until]
        for c in gone:
            del self.restored_clients[c]
            log.warning("client %s did not reconnect within %gs; its keys are released", c,
                        self.reconnect_window)  # fmt: skip
            out.append(ev.ClientGone(c, now))
        if self.reports:
            out.extend(self.reports)
            self.reports = []
        return out

    def _maybe_open(self, now: float) -> list[ev.Event]:
        if self.gate_open or (not self.expected <= self.back and now < self.gate_until):
            return []
        self.gate_open = True
        if self.persister is not None:
            self.persister.paused = False
            # those not back are not waited for by the next restart either
            self.persister.batch.workers_left.extend(sorted(self.expected - self.back))
        return self._opened(now)

    def _opened(self, now: float) -> list[ev.Event]:
        """The gate just opened: the waiting workers take tasks, and the journal hears the tally."""
        st = self.state
        assert st is not None
        ready: list[ev.Event] = [ev.WorkerReady(w, now) for w in sorted(self.back)
                                 if w in st.workers and st.workers[w].state == "starting"]  # fmt: skip
        recovered = sum(1 for k in self._finished_before if (t := st.tasks.get(k)) is not None and t.state == TS.MEMORY)
        recompute = sum(1 for k in self._finished_before
                        if (t := st.tasks.get(k)) is not None and t.state != TS.MEMORY and t.needed)  # fmt: skip
        ready.append(ev.RecoveryReport("resumed", {
            "recovered": recovered, "recomputed": recompute,
            "adopted_running": st.counters.get("adopted_running", 0),
            "workers_back": sorted(self.back & self.expected), "workers_missing": sorted(self.expected - self.back),
            "seconds_since_start": round(time.monotonic() - self._began, 3),
        }, now))  # fmt: skip
        return ready

    def record_setup(self, name: str, blob: Serialized) -> None:
        """A client registered a setup hook: stored at the next tick (workers that join after a
        restart run it, as they would have before)."""
        if self.persister is not None:
            self.persister.batch.setups.pop(name, None)
            self.persister.batch.setups[name] = blob

    def forget_setup(self, name: str) -> None:
        """A client unregistered a setup hook: workers that join after a restart do not run it."""
        if self.persister is not None:
            self.persister.batch.setups.pop(name, None)
            self.persister.batch.setups[name] = None

    def record_instances(self, rows: dict[str, dict[str, Any] | None]) -> None:
        """The autoscaler's instance rows that changed (``None``: ended), stored at the next tick."""
        if self.persister is not None:
            self.persister.batch.instances.update(rows)

    def record_cost(self, meter: dict[str, Any]) -> None:
        """The autoscaler's cost meter (``CostMeter.export`` with its wall time), stored at the next tick."""
        if self.persister is not None:
            self.persister.batch.cost = meter

    @property
    def cost(self) -> dict[str, Any] | None:
        """The autoscaler's cost meter as the store held it at the start (None: nothing billed)."""
        return self.snapshot.cost

    @property
    def instances(self) -> dict[str, dict[str, Any]]:
        """The autoscaler's instance rows as the store held them at the start."""
        return dict(self.snapshot.instances)

    def observe(self, events: list[ev.Event], cmds: list[ev.Command]) -> None:
        if self.persister is not None:
            self.persister.observe(events, cmds)

    def flush(self) -> None:
        if self.persister is not None:
            self.persister.flush()
        self.store.drain()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.store.close()
