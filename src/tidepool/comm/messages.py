"""Typed wire records: the messages between client and scheduler, by name instead of by position.

On the wire a message stays what the frames carry (a msgpack map with ``op``, out-of-band pickle
buffers inside); this module is the one place that knows each message's fields.  Senders build a
record and call ``encode()``; receivers call a ``decode_*`` function and get the record back, so
no caller indexes a list to find a field.  Records are frozen, slotted dataclasses: cheap to make
per message, and per task only where a message is about many tasks (a graph update's specs, a
report's items) — those stay compact lists on the wire, with one encoder and one decoder here.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ProtocolError


# ---- client -> scheduler ---------------------------------------------------------------------------
@dataclass(slots=True)
class TaskSpec:
    """One task of a graph update: ``func_id`` names a function shipped once (in ``functions``),
    ``payload`` is the pickled ``(args, kwargs)`` with dependencies as references, ``group`` the
    name shown for it.  On the wire a compact list (positions fixed here, and only here); the
    placement fields are left out when they have their defaults."""

    key: str
    func_id: str
    payload: Any
    deps: Sequence[str] = ()  # a list when there are some; one shared empty tuple when none
    resources: dict[str, float] = field(default_factory=dict)
    retries: int = 0
    group: str = ""
    priority: int = 0
    workers: tuple[str, ...] = ()
    loose: bool = False

    def encode(self) -> list[Any]:
        out = [self.key, self.func_id, self.payload, self.deps, self.resources, self.retries, self.group]
        if self.priority or self.workers:
            out += [self.priority, list(self.workers), self.loose]
        return out

    @staticmethod
    def decode(raw: list[Any]) -> TaskSpec:
        try:
            if type(raw[0]) is not str or type(raw[1]) is not str or type(raw[6]) is not str:
                # the key and group name metrics, dashboards and sorting (a bug hunt's integer key
                # broke /metrics for good)
                raise TypeError("the key, function id and group must be strings")
            if len(raw) > 7:
                return TaskSpec(raw[0], raw[1], raw[2], list(raw[3]), raw[4] or {}, int(raw[5]), raw[6],
                                int(raw[7]), tuple(raw[8] or ()), bool(raw[9]))  # fmt: skip
            return TaskSpec(raw[0], raw[1], raw[2], list(raw[3]), raw[4] or {}, int(raw[5]), raw[6])
        except (TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"malformed task spec {str(raw)[:200]} ({type(exc).__name__}: {exc})") from None


@dataclass(slots=True)
class UpdateGraph:
    """``update-graph``: new tasks (dependencies first), the keys the client wants, and the pickles
    of functions the scheduler does not have yet (id -> pickle)."""

    tasks: list[TaskSpec]
    wanted: list[str]
    functions: dict[str, Any] = field(default_factory=dict)
    #: ``wanted`` is all the client wants (a reconnecting client's resync): release any other key
    exact: bool = False

    def encode(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "update-graph", "tasks": [t.encode() for t in self.tasks], "wanted": self.wanted,
                               "functions": self.functions}  # fmt: skip
        if self.exact:
            msg["exact"] = True
        return msg

    @staticmethod
    def decode(msg: dict[str, Any]) -> UpdateGraph:
        wanted = list(msg["wanted"])
        if not all(type(k) is str for k in wanted):
            raise ProtocolError(f"update-graph: wanted keys must be strings, got {str(wanted)[:200]}")
        return UpdateGraph([TaskSpec.decode(t) for t in msg["tasks"]], wanted, msg.get("functions") or {},
                           msg.get("exact") is True)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Release:
    """``release``: the client no longer needs these keys."""

    keys: list[str]

    def encode(self) -> dict[str, Any]:
        return {"op": "release", "keys": self.keys}

    @staticmethod
    def decode(msg: dict[str, Any]) -> Release:
        return Release(list(msg["keys"]))


@dataclass(frozen=True, slots=True)
class Cancel:
    """``cancel``: cancel these keys for this client (``unless_started``: ``Future.cancel``'s
    rule, only tasks not executing yet); answered by reports, then by a reply if ``id`` is set."""

    keys: list[str]
    unless_started: bool = False
    id: int | None = None

    def encode(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "cancel", "keys": self.keys, "unless_started": self.unless_started}
        if self.id is not None:
            msg["id"] = self.id
        return msg

    @staticmethod
    def decode(msg: dict[str, Any]) -> Cancel:
        return Cancel(list(msg["keys"]), bool(msg.get("unless_started")), msg.get("id"))


#: requests about keys, answered by a reply: who holds them, which execute now, why not done
KEY_QUERIES = ("who-has", "running", "why")


@dataclass(frozen=True, slots=True)
class KeyQuery:
    """``who-has`` (key -> holder addresses, None if unknown), ``running`` (the keys executing
    now) or ``why`` (key -> state and reason): a question about ``keys``, answered by a reply."""

    op: str
    keys: list[str]
    id: int | None = None

    def encode(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": self.op, "keys": self.keys}
        if self.id is not None:
            msg["id"] = self.id
        return msg

    @staticmethod
    def decode(msg: dict[str, Any]) -> KeyQuery:
        if msg.get("op") not in KEY_QUERIES:
            raise ProtocolError(f"not a key query: {msg.get('op')!r}")
        return KeyQuery(msg["op"], list(msg["keys"]), msg.get("id"))


# ---- scheduler -> worker, worker -> worker/client ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ComputeTask:
    """One task of a ``compute`` message: where each input lives (``deps``: key -> [[worker id,
    address], ...]) and the resources it reserves while it runs."""

    key: str
    func_id: str
    payload: Any
    deps: dict[str, list[list[str]]] | None = None
    resources: list[list[Any]] | None = None
    #: a small value goes back inline in the finished report (``comm/inline.py``)
    inline: bool = False
    #: run it alone, never in a batch of quick tasks (a worker died while it ran: exact blame)
    solo: bool = False
    #: the scheduler's serial of this task record, echoed in the worker's outcome (0: none)
    run: int = 0

    def encode(self) -> dict[str, Any]:
        item: dict[str, Any] = {"key": self.key, "func": self.func_id, "payload": self.payload}
        if self.run:
            item["run"] = self.run
        if self.deps:
            item["deps"] = self.deps
        item["resources"] = self.resources or [["cpu", 1.0]]
        if self.inline:
            item["inline"] = True
        if self.solo:
            item["solo"] = True
        return item

    @staticmethod
    def decode(item: dict[str, Any]) -> ComputeTask:
        return ComputeTask(item["key"], item["func"], item.get("payload"), item.get("deps") or {},
                           item.get("resources") or [], bool(item.get("inline")), bool(item.get("solo")),
                           int(item.get("run") or 0))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Compute:
    """``compute``: tasks for a worker, with the functions it does not have yet (id -> pickle)."""

    tasks: list[ComputeTask]
    functions: dict[str, Any] | None = None

    def encode(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "compute", "tasks": [t.encode() for t in self.tasks]}
        if self.functions:
            msg["functions"] = self.functions
        return msg


@dataclass(frozen=True, slots=True)
class GetData:
    """``get-data``: ask a worker's data server for values."""

    keys: list[str]

    def encode(self) -> dict[str, Any]:
        return {"op": "get-data", "keys": self.keys}


@dataclass(frozen=True, slots=True)
class DataReply:
    """The answer to ``get-data``: pickled values, keys not held (``missing``), values that can
    never be sent (``failed``: key -> why) and those that did not fit this frame (``deferred``:
    ask again)."""

    data: dict[str, Any]
    missing: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)

    def encode(self) -> dict[str, Any]:
        return {"op": "data", "data": self.data, "missing": self.missing, "failed": self.failed,
                "deferred": self.deferred}  # fmt: skip

    @staticmethod
    def decode(msg: dict[str, Any]) -> DataReply:
        if "data" not in msg:
            raise ProtocolError(f"expected a data reply, got {msg.get('op')!r}: {str(msg)[:200]}")
        return DataReply(msg["data"], list(msg.get("missing") or ()), dict(msg.get("failed") or {}),
                         list(msg.get("deferred") or ()))  # fmt: skip


# ---- worker -> scheduler ---------------------------------------------------------------------------
#: the kinds a ``task-batch`` carries, each a list of entries (in the order the scheduler reads them):
#: ``started`` keys; ``finished`` [key, nbytes, duration]; ``erred`` {key, exception, traceback, type,
#: message, duration}; ``missing`` [key, dep, holder, why?, silent?]; ``replicas`` [key, nbytes];
#: ``stolen`` / ``kept`` keys (a steal reply: both or neither); ``seceded`` keys; ``unservable``
#: [key, type, message]; ``ended`` keys (runs nobody wanted any more have returned: their slots are free)
BATCH_KINDS = ("started", "finished", "erred", "missing", "replicas", "stolen", "kept", "seceded", "unservable",
               "ended")  # fmt: skip
_batch_lists = operator.attrgetter(*BATCH_KINDS)


@dataclass(slots=True)
class TaskBatch:
    """``task-batch``: a worker's reports of one loop turn, one list per kind.

    Only the kinds with entries go on the wire (an absent kind costs nothing); a steal reply
    (``stolen`` or ``kept`` given) always carries both lists, even if one is empty, because the
    scheduler reads them as one answer."""

    started: list[str] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)
    erred: list[dict[str, Any]] = field(default_factory=list)
    missing: list[Any] = field(default_factory=list)
    replicas: list[Any] = field(default_factory=list)
    stolen: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    seceded: list[str] = field(default_factory=list)
    unservable: list[Any] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    steal_reply: bool = False
    #: kinds this version does not know: sent as they are, and ignored by a reader that does not know
    #: them either (so a worker may report a new kind before every scheduler reads it)
    other: dict[str, list[Any]] | None = None

    def add(self, kind: str, item: Any) -> None:
        if kind not in BATCH_KINDS:
            if self.other is None:
                self.other = {}
            self.other.setdefault(kind, []).append(item)
            return
        getattr(self, kind).append(item)
        if kind == "stolen" or kind == "kept":
            self.steal_reply = True

    def clear(self, kind: str) -> None:
        """Drop every entry of ``kind`` (a steal reply as a whole with ``stolen`` or ``kept``)."""
        if kind not in BATCH_KINDS:
            if self.other is not None:
                self.other.pop(kind, None)
            return
        getattr(self, kind).clear()
        if kind == "stolen" or kind == "kept":
            self.steal_reply = bool(self.stolen or self.kept)

    def __bool__(self) -> bool:  # asked on every report: one C-level read of all kinds, no generator
        return self.steal_reply or bool(self.other) or any(_batch_lists(self))

    def encode(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "task-batch", **self.other} if self.other else {"op": "task-batch"}
        for k in BATCH_KINDS:
            v = getattr(self, k)
            if v:
                msg[k] = v
        if self.steal_reply:
            msg["stolen"], msg["kept"] = self.stolen, self.kept
        return msg

    @staticmethod
    def decode(msg: dict[str, Any]) -> TaskBatch:
        try:
            return TaskBatch(
                list(msg.get("started") or ()), list(msg.get("finished") or ()), list(msg.get("erred") or ()),
                list(msg.get("missing") or ()), list(msg.get("replicas") or ()), list(msg.get("stolen") or ()),
                list(msg.get("kept") or ()), list(msg.get("seceded") or ()), list(msg.get("unservable") or ()),
                list(msg.get("ended") or ()), "stolen" in msg or "kept" in msg,
            )  # fmt: skip
        except TypeError as exc:
            raise ProtocolError(f"malformed task-batch ({exc})") from None


# ---- scheduler -> client ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReportItem:
    """News of one of a client's keys.

    ``status``: "memory" (``detail``: the address of a worker holding the value, "" if unknown),
    "erred" (``detail``: the error record: type, message, origin, pickled exception, traceback),
    "cancelled", "running" (answers to a cancel request) or "lost" (the scheduler does not know it).
    ``value``: with "memory", the pickled value itself when it is small (``comm/inline.py``).
    """

    key: str
    status: str
    detail: Any = None
    value: Any = None

    def encode(self) -> list[Any]:
        if self.value is not None:
            return [self.key, self.status, self.detail or "", self.value]
        return [self.key, self.status] if self.detail is None else [self.key, self.status, self.detail]


@dataclass(frozen=True, slots=True)
class ClientReport:
    """``report``: news of a client's keys, in one message per scheduler round."""

    items: list[ReportItem]

    def encode(self) -> dict[str, Any]:
        return {"op": "report", "items": [i.encode() for i in self.items]}


@dataclass(frozen=True, slots=True)
class Reply:
    """``reply``: the answer to request ``id``: its ``result``, or the ``error`` text if refused."""

    id: int
    result: Any = None
    error: str | None = None

    def encode(self) -> dict[str, Any]:
        if self.error is not None:
            return {"op": "reply", "id": self.id, "error": self.error}
        return {"op": "reply", "id": self.id, "result": self.result}


@dataclass(frozen=True, slots=True)
class SetupError:
    """``setup-error``: worker ``worker`` failed setup ``name``."""

    worker: str
    name: str
    error: str
    traceback: str = ""

    def encode(self) -> dict[str, Any]:
        return {"op": "setup-error", "worker": self.worker, "name": self.name, "error": self.error,
                "traceback": self.traceback}  # fmt: skip


def _report_item(raw: Any) -> ReportItem:
    try:
        return ReportItem(raw[0], raw[1], raw[2] if len(raw) > 2 else None, raw[3] if len(raw) > 3 else None)
    except (TypeError, IndexError, KeyError) as exc:
        raise ProtocolError(f"malformed report item {raw!r} from the scheduler ({type(exc).__name__}: {exc})") from None


def decode_from_scheduler(msg: dict[str, Any]) -> ClientReport | Reply | SetupError | None:
    """The record of a message a client receives (None: an op this client does not know)."""
    op = msg.get("op")
    if op == "report":
        return ClientReport([_report_item(i) for i in msg.get("items") or ()])
    if op == "reply":
        return Reply(msg.get("id", -1), msg.get("result"), msg.get("error"))
    if op == "setup-error":
        return SetupError(str(msg.get("worker", "?")), str(msg.get("name", "?")), str(msg.get("error", "")),
                          str(msg.get("traceback") or ""))  # fmt: skip
    return None


__all__ = ["Cancel", "ClientReport", "Compute", "ComputeTask", "DataReply", "GetData", "KeyQuery", "Release", "TaskSpec", "UpdateGraph", "Reply", "ReportItem", "SetupError", "TaskBatch", "decode_from_scheduler"]
