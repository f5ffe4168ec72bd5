"""What became of every launch: the scaling controller's lifecycle table of instances.

State: ``requests`` (launch request id -> :class:`Request`) and ``instances`` (worker id ->
:class:`Instance`), each with a state from :class:`IS` and the history of its moves, a reason on
each edge.  Nothing here reads a clock (``now`` comes in) or does I/O; the controller
(``controller.py``) is the only writer, from the reports in its observation.

Lifecycle::

    requested ──► named ──► joined ──► ready ──► retiring ──► gone
        │           │          │         │  ▲        │
        └─► failed ◄┴──────────┘         │  └────────┘ (refused)
                                         └─► gone (left without being retired)

(and ``gone``/``failed`` -> ``joined`` when a worker given up registers after all).

A *request* (``launch(node_type, nodes, request_id)``) starts ``requested``; the provider names
its workers (``named``), and each named worker becomes an :class:`Instance` that joins the
scheduler, becomes ready (its setup ran), may be retired, and ends ``gone`` (it left) or
``failed`` (it ended before it registered, or its setup failed).  The request itself ends
``joined`` when every worker still coming has registered, or ``failed`` when none is left to come
(or it timed out, or the provider refused it).  A move not in the tables below is a bug and
raises :class:`InvalidTransition`, as in the scheduler's state machine.

Workers the controller did not launch but may retire (a LocalCluster's own, ``Adopted``) enter at
``named`` with no request; a foreign worker retired under ``manage_foreign`` enters at ``ready``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from tidepool.scheduler.kinds import InvalidTransition


class IS(StrEnum):
    """An instance's (or a request's) place in its lifecycle."""

    REQUESTED = "requested"
    NAMED = "named"
    JOINED = "joined"
    READY = "ready"
    RETIRING = "retiring"
    GONE = "gone"
    FAILED = "failed"


#: Every legal move of one worker, with the reason it happens.  Anything else raises.
INSTANCE_TRANSITIONS: dict[tuple[IS, IS], str] = {
    (IS.NAMED, IS.JOINED): "its worker registered with the scheduler",
    (IS.NAMED, IS.FAILED): "it ended, vanished from the listing, timed out or its request failed before it registered",
    (IS.JOINED, IS.READY): "its setup finished: it takes tasks",
    (IS.JOINED, IS.FAILED): "its setup failed",
    (IS.JOINED, IS.RETIRING): "the controller retires it",
    (IS.JOINED, IS.GONE): "it left the scheduler",
    (IS.READY, IS.RETIRING): "the controller retires it",
    (IS.READY, IS.GONE): "it left the scheduler",
    (IS.RETIRING, IS.READY): "the scheduler refused to retire it",
    (IS.RETIRING, IS.GONE): "retired, or it left the scheduler",
    (IS.GONE, IS.JOINED): "it registered again (it reconnected)",
    (IS.FAILED, IS.JOINED): "it registered after all, after it was given up",
}

#: Every legal move of a launch request.
REQUEST_TRANSITIONS: dict[tuple[IS, IS], str] = {
    (IS.REQUESTED, IS.NAMED): "the provider named its workers",
    (IS.REQUESTED, IS.FAILED): "the provider refused it, or it timed out before its workers were named",
    (IS.NAMED, IS.JOINED): "every worker still coming registered",
    (IS.NAMED, IS.FAILED): "none of its workers is left to come, or it timed out",
}

#: states of a worker that is (or was last seen) registered with the scheduler
LIVE = frozenset({IS.JOINED, IS.READY, IS.RETIRING})
#: states after which nothing happens any more
FINAL = frozenset({IS.GONE, IS.FAILED})
#: states of a worker that has not registered (yet, or ever): it has not arrived
NOT_ARRIVED = frozenset({IS.NAMED, IS.FAILED})


@dataclass
class Instance:
    """One worker: launched here (``request`` set), adopted, or a foreign one being retired."""

    worker: str
    node_type: str
    request: str | None
    state: IS
    origin: str = "launched"  # launched / adopted / foreign
    #: (time, state entered, why) of every move, the first one included
    history: list[tuple[float, IS, str]] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return self.history[-1][2] if self.history else ""


@dataclass
class Request:
    """One launch: ``nodes`` nodes of ``node_type`` asked at ``since``, given up at ``deadline``."""

    id: str
    node_type: str
    nodes: int
    since: float
    deadline: float
    state: IS = IS.REQUESTED
    #: the workers still part of it (named, minus those that failed before registering)
    workers: list[str] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  # launch-to-join seconds of each arrival
    #: its workers called off before they came: each would have taken longer than every arrival
    censored: int = 0
    history: list[tuple[float, IS, str]] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.state in (IS.REQUESTED, IS.NAMED)


class InstanceTable:
    """Requests and instances, moved only through :meth:`move` / :meth:`move_request`."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.instances: dict[str, Instance] = {}
        #: requests still open (requested or named), in launch order
        self.open: dict[str, Request] = {}
        #: instances registered with the scheduler now (joined, ready, retiring)
        self.live: dict[str, Instance] = {}
        #: instances being retired now
        self.retiring: dict[str, Instance] = {}
        #: request id -> its workers (``Request.workers`` as a set) and how many of them arrived:
        #: kept as instances move, so "has every worker of a 10,000-node request arrived?" is not
        #: a scan of the request per join (that made 10,000 joins 10**8 steps)
        self._members: dict[str, set[str]] = {}
        self._arrived_n: dict[str, int] = {}

    # ---- requests -------------------------------------------------------------------------------
    def request(self, rid: str, node_type: str, nodes: int, now: float, deadline: float, why: str) -> Request:
        req = Request(rid, node_type, nodes, now, deadline, history=[(now, IS.REQUESTED, why)])
        self.requests[rid] = req
        self.open[rid] = req
        return req

    def move_request(self, req: Request, new: IS, now: float, why: str) -> None:
        if (req.state, new) not in REQUEST_TRANSITIONS:
            raise InvalidTransition(f"launch request {req.id}: {req.state} -> {new} ({why})")
        req.state = new
        req.history.append((now, new, why))
        if not req.open:
            self.open.pop(req.id, None)

    def arrived(self, req: Request) -> list[str]:
        """Its workers that registered (whatever became of them since)."""
        inst = self.instances
        return [w for w in req.workers if w in inst and inst[w].state not in NOT_ARRIVED]

    def all_arrived(self, req: Request) -> bool:
        """Every worker of ``req`` registered (whatever became of them since); ``arrived`` without
        the scan."""
        return self._arrived_n.get(req.id, 0) >= len(req.workers)

    def enlist(self, req: Request, wid: str) -> None:
        """``wid`` (in the table already) becomes one of ``req``'s workers."""
        req.workers.append(wid)
        self._members.setdefault(req.id, set()).add(wid)
        inst = self.instances.get(wid)
        if inst is not None and inst.state not in NOT_ARRIVED:
            self._arrived_n[req.id] = self._arrived_n.get(req.id, 0) + 1

    def delist(self, req: Request, wid: str) -> None:
        """``wid`` is no longer one of ``req``'s workers (it failed; the rest stay pending)."""
        req.workers.remove(wid)
        self._members.get(req.id, set()).discard(wid)
        inst = self.instances.get(wid)
        if inst is not None and inst.state not in NOT_ARRIVED:
            self._arrived_n[req.id] -= 1

    def missing(self, req: Request) -> list[str]:
        """Its workers that have not registered yet."""
        inst = self.instances
        return [w for w in req.workers if w in inst and inst[w].state is IS.NAMED]

    # ---- instances ------------------------------------------------------------------------------
    def add(self, wid: str, node_type: str, request: str | None, state: IS, now: float, why: str, *,
            origin: str = "launched") -> Instance:  # fmt: skip
        """A worker enters the table (named by the provider, adopted, or a foreign one retired)."""
        if wid in self.instances:
            raise InvalidTransition(f"worker {wid} is already in the instance table")
        inst = Instance(wid, node_type, request, state, origin, [(now, state, why)])
        self.instances[wid] = inst
        if state in LIVE:
            self.live[wid] = inst
        return inst

    def move(self, inst: Instance, new: IS, now: float, why: str) -> None:
        if (inst.state, new) not in INSTANCE_TRANSITIONS:
            raise InvalidTransition(f"worker {inst.worker}: {inst.state} -> {new} ({why})")
        rid = inst.request
        if rid is not None and (inst.state in NOT_ARRIVED) != (new in NOT_ARRIVED) \
                and inst.worker in self._members.get(rid, ()):  # fmt: skip
            self._arrived_n[rid] = self._arrived_n.get(rid, 0) + (1 if inst.state in NOT_ARRIVED else -1)
        inst.state = new
        inst.history.append((now, new, why))
        if new in LIVE:
            self.live[inst.worker] = inst
        else:
            self.live.pop(inst.worker, None)
        if new is IS.RETIRING:
            self.retiring[inst.worker] = inst
        else:
            self.retiring.pop(inst.worker, None)

    def get(self, wid: str) -> Instance | None:
        return self.instances.get(wid)

    def in_state(self, *states: IS) -> Iterator[Instance]:
        return (i for i in self.instances.values() if i.state in states)

    def validate(self) -> None:
        """Check the indexes agree with the records (tests call this after every step)."""
        for wid, inst in self.instances.items():
            assert (wid in self.live) == (inst.state in LIVE), (wid, inst.state)
            assert (wid in self.retiring) == (inst.state is IS.RETIRING), (wid, inst.state)
            assert all(why for _, _, why in inst.history), (wid, inst.history)
            assert inst.history and inst.history[-1][1] is inst.state, (wid, inst.history)
            if inst.request is not None:
                assert inst.request in self.requests, (wid, inst.request)
        for rid, req in self.requests.items():
            assert (rid in self.open) == req.open, (rid, req.state)
            assert self._members.get(rid, set()) == set(req.workers), (rid, req.workers)
            assert self._arrived_n.get(rid, 0) == len(self.arrived(req)), (rid, self._arrived_n.get(rid))
            assert req.history and req.history[-1][1] is req.state, (rid, req.history)
            assert all(why for _, _, why in req.history), (rid, req.history)
