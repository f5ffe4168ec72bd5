"""A simulated provider: the ``Provider`` interface on the simulator's clock, with seeded delays.

Per node type a :class:`StartupModel` says how a launched node comes up: it waits ``queue``
seconds for an allocation (a batch queue; 0 for a cloud API), is then billed, and its workers
register ``boot`` seconds later.  With probability ``fail`` the allocation fails instead (reported
once through :meth:`SimProvider.poll_errors`, like a Slurm job that never started; nothing is
billed).  With a ``walltime``, the allocation ends that long after it started: its workers are
killed (reported as ended, like Slurm's TIMEOUT) unless retired first; :meth:`expiring` lists them
``retire_margin`` seconds before, so the controller retires them gracefully, as with Slurm.

Spot capacity: with a ``preempt_rate`` (preemptions per node-hour, a Poisson process from the
allocation on), a node gets a preemption notice at a random time (:meth:`preemptions` lists its
workers with their deadline from then on) and its workers are killed ``notice`` seconds later
unless they left first (nothing is reported as a failure: a preemption is not a broken node type;
the notice is what the controller counts).  ``capacity_errors`` is the probability that a node's
launch is refused at once for lack of capacity (reported through :meth:`poll_errors`, nothing
billed), which the controller counts against a preemptible type too.  :meth:`ends` lists the
walltime ends minus the margin (for ``replace_before``).

Presets (:data:`PRESETS`): ``local`` (a worker process on this machine, ~0.3 s), ``ssh`` (1-3 s),
``cloud`` (a VM: 60-120 s), ``slurm`` (queue waits of minutes with a long tail, 2% of jobs fail,
one-hour walltime).

State: ``nodes`` (one per launched node: request, type, worker ids, when it was allocated, when it
ended) and ``workers`` (worker id -> its node and state).  Randomness: one stream per node type
from the run's seed, drawn in launch order, so the same seed and the same decisions give the same
delays.  The provider never schedules anything itself: the simulation passes ``up`` (a worker
registers at a time) and ``kill`` (a live worker's process ends now) hooks, and the rest
(failures, listings, expiry) is computed from the clock when asked.
"""

from __future__ import annotations

import builtins
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.providers.base import ProviderFailure
from tidepool.scaling.node_types import NodeType
from tidepool.sim.dists import Dist, parse_dist, stream

ZERO = Dist("const", (0.0,))


@dataclass(frozen=True)
class StartupModel:
    boot: Dist  # allocation -> workers registered
    queue: Dist = ZERO  # request -> allocation (batch queue wait)
    fail: float = 0.0  # probability that an allocation fails (no worker, nothing billed)
    walltime: float | None = None  # the allocation ends this long after it started
    retire_margin: float | None = None  # expiring() names workers this long before the walltime ends
    preempt_rate: float = 0.0  # preemption notices per node-hour (spot capacity)
    notice: float = 120.0  # seconds from a preemption notice to the kill
    capacity_errors: float = 0.0  # probability that a node's launch is refused at once (no capacity)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail <= 1.0:
            raise ConfigError(f"fail must be a probability 0..1, got {self.fail!r}")
        if not 0.0 <= self.capacity_errors <= 1.0:
            raise ConfigError(f"capacity_errors must be a probability 0..1, got {self.capacity_errors!r}")
        for key in ("preempt_rate", "notice"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{key} must be a finite number >= 0, got {v!r}")
        if self.walltime is not None and not (math.isfinite(self.walltime) and self.walltime > 0):
            raise ConfigError(f"walltime must be a positive number of seconds, got {self.walltime!r}")

    @property
    def margin(self) -> float:
        """Seconds before the walltime at which workers are reported as expiring (Slurm's rule)."""
        if self.walltime is None:
            return 0.0
        if self.retire_margin is not None:
            return self.retire_margin
        return min(max(60.0, 0.1 * self.walltime), self.walltime / 2)

    @property
    def mean_startup(self) -> float:
        return self.queue.mean + self.boot.mean

    def describe(self) -> str:
        parts = [f"boot {self.boot}"]
        if self.queue != ZERO:
            parts.insert(0, f"queue {self.queue}")
        if self.fail:
            parts.append(f"{self.fail:.0%} fail")
        if self.walltime:
            parts.append(f"walltime {self.walltime:g}s")
        if self.preempt_rate:
            parts.append(f"preempted {self.preempt_rate:g}/node-h, {self.notice:g}s notice")
        if self.capacity_errors:
            parts.append(f"{self.capacity_errors:.0%} capacity errors")
        return ", ".join(parts)


PRESETS: dict[str, StartupModel] = {
    "local": StartupModel(boot=Dist("normal", (0.1, 0.03))),  # fork-server workers (docs/simulation.md)
    "ssh": StartupModel(boot=Dist("uniform", (1.0, 3.0))),
    "cloud": StartupModel(boot=Dist("uniform", (60.0, 120.0))),
    "slurm": StartupModel(boot=Dist("uniform", (5.0, 15.0)), queue=Dist("lognormal", (120.0, 1.0)),
                          fail=0.02, walltime=3600.0),  # fmt: skip
}
_MODEL_KEYS = ("startup", "boot", "queue", "fail", "walltime", "retire_margin", "preempt_rate", "notice",
               "capacity_errors")


def model_from(value: Any, where: str, base: StartupModel | None = None) -> StartupModel:
    """A model from a preset name or a table of ``startup`` (preset), ``boot``, ``queue``, ``fail``,
    ``walltime``, ``retire_margin`` (given keys override the preset, or ``base``)."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ConfigError(f"{where}: unknown start-up preset {value!r}; use one of {', '.join(PRESETS)} "
                              "or a table with boot/queue/fail/walltime")  # fmt: skip
        return PRESETS[value]
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a preset name or a table, got {value!r}")
    bad = set(value) - set(_MODEL_KEYS)
    if bad:
        raise ConfigError(f"{where}: unknown keys {sorted(bad)}; allowed: {', '.join(_MODEL_KEYS)}")
    m = model_from(value["startup"], where) if "startup" in value else (base or PRESETS["local"])
    kw: dict[str, Any] = {}
    if "boot" in value:
        kw["boot"] = parse_dist(value["boot"], f"{where} boot")
    if "queue" in value:
        kw["queue"] = parse_dist(value["queue"], f"{where} queue")
    if "fail" in value:
        kw["fail"] = float(value["fail"])
    if "walltime" in value:
        kw["walltime"] = float(value["walltime"]) if value["walltime"] else None
    if "retire_margin" in value:
        kw["retire_margin"] = float(value["retire_margin"])
    for key in ("preempt_rate", "notice", "capacity_errors"):
        if key in value:
            v = value[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
            kw[key] = float(v)
    from dataclasses import replace

    try:
        return replace(m, **kw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


@dataclass
class _Node:
    request_id: str
    node_type: str
    workers: list[str]
    allocated: float  # billed from
    up_at: float
    end_at: float | None  # walltime end
    failed: bool
    ended: float | None = None  # billed to
    live: set[str] = field(default_factory=set)  # workers whose process has not ended
    notice_at: float | None = None  # when its preemption notice comes (spot)
    kill_at: float | None = None  # ... and when it is taken back


class SimProvider:
    """The Provider protocol (launch, terminate, list, poll_errors, close) plus ``expiring``."""

    def __init__(self, models: Mapping[str, StartupModel], seed: int, clock: Callable[[], float], *,
                 up: Callable[[float, str], None], kill: Callable[[str, str], None]) -> None:  # fmt: skip
        self.models = dict(models)
        self.seed = seed
        self.clock = clock
        self._up = up
        self._kill = kill
        self._rngs: dict[str, random.Random] = {}
        self.requests: dict[str, list[str]] = {}
        self.nodes: list[_Node] = []
        self.worker_node: dict[str, _Node] = {}
        self.registered: set[str] = set()
        self._errors: list[tuple[float, ProviderFailure]] = []  # (visible from, failure)
        self.launch_calls = 0

    def _model(self, name: str) -> StartupModel:
        m = self.models.get(name)
        if m is None:
            raise ConfigError(f"no start-up model for node type {name!r}")
        return m

    def _rng(self, name: str) -> random.Random:
        r = self._rngs.get(name)
        if r is None:
            r = self._rngs[name] = stream(self.seed, "provider", name)
        return r

    # ---- the Provider protocol -------------------------------------------------------------------
    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        return [f"{node_type.name}-{request_id}-{i}" for i in range(count * node_type.workers_per_node)]

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        self.launch_calls += 1
        if request_id in self.requests:
            return
        now = self.clock()
        model = self._model(node_type.name)
        rng = self._rng(node_type.name)
        ids: list[str] = []
        for n in range(count):
            wids = [f"{node_type.name}-{request_id}-{n * node_type.workers_per_node + i}"
                    for i in range(node_type.workers_per_node)]  # fmt: skip
            if model.capacity_errors > 0 and rng.random() < model.capacity_errors:
                node = _Node(request_id, node_type.name, wids, now, now, None, True, ended=now)
                self.nodes.append(node)
                for w in wids:
                    self.worker_node[w] = node
                    self._errors.append((now, ProviderFailure(request_id, w, (
                        f"simulated: no capacity for {node_type.name!r} node {n} of request {request_id} "
                        "(InsufficientCapacity)"))))  # fmt: skip
                ids.extend(wids)
                continue
            q = model.queue.sample(rng)
            b = model.boot.sample(rng)
            failed = model.fail > 0 and rng.random() < model.fail
            alloc = now + q
            end_at = alloc + model.walltime if model.walltime is not None else None
            node = _Node(request_id, node_type.name, wids, alloc, alloc + b, end_at, failed)
            if model.preempt_rate > 0 and not failed:
                node.notice_at = alloc + rng.expovariate(model.preempt_rate / 3600.0)
                node.kill_at = node.notice_at + model.notice
            self.nodes.append(node)
            for w in wids:
                self.worker_node[w] = node
            if failed:
                node.ended = alloc
                for w in wids:  # its workers fail; the rest of the request is still coming
                    self._errors.append((alloc, ProviderFailure(request_id, w, (
                        f"simulated: the allocation of {node_type.name!r} node {n} of request {request_id} "
                        f"failed after {q:.1f}s in the queue"))))  # fmt: skip
            else:
                node.live.update(wids)
                for w in wids:
                    self._up(node.up_at, w)
            ids.extend(wids)
        self.requests[request_id] = ids

    def terminate(self, worker_ids: builtins.list[str]) -> None:
        now = self.clock()
        for w in worker_ids:
            node = self.worker_node.get(w)
            if node is None or w not in node.live:
                continue
            self._end_worker(node, w, now)
            if w in self.registered:
                self._kill(w, "terminated by the provider")

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for w, node in self.worker_node.items():
            alive = w in node.live or (node.failed and now < node.allocated)  # fails only when allocated
            if node.failed and now >= node.allocated:
                state, alive = "failed", False
            elif not alive:
                state = "gone"
            elif now < node.allocated:
                state = "queued"
            elif w not in self.registered:
                state = "starting"
            else:
                state = "running"
            out[w] = {"node_type": node.node_type, "request_id": node.request_id, "alive": alive, "state": state}
        return out

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        now = self.clock()
        due = [f for t, f in self._errors if t <= now]
        self._errors = [(t, f) for t, f in self._errors if t > now]
        return due

    def expiring(self, now_wall: float) -> builtins.list[str]:
        """Registered workers whose allocation ends within its model's retire margin (``now_wall``
        is the simulation's clock here)."""
        out = []
        for w in sorted(self.registered):
            node = self.worker_node[w]
            if node.end_at is None or w not in node.live:
                continue
            if node.end_at - now_wall <= self._model(node.node_type).margin:
                out.append(w)
        return out

    def preemptions(self, now_wall: float) -> dict[str, float]:
        """Registered live workers under a preemption notice -> when they are taken back
        (``now_wall`` is the simulation's clock here)."""
        out = {}
        for w in sorted(self.registered):
            node = self.worker_node[w]
            if node.notice_at is not None and node.notice_at <= now_wall and w in node.live:
                assert node.kill_at is not None
                out[w] = node.kill_at
        return out

    def ends(self, now_wall: float) -> dict[str, float]:
        """Registered live workers with a walltime -> when they must be gone (end minus margin)."""
        out = {}
        for w in sorted(self.registered):
            node = self.worker_node[w]
            if node.end_at is not None and w in node.live:
                out[w] = node.end_at - self._model(node.node_type).margin
        return out

    def preempted_at(self, wid: str) -> float | None:
        """When ``wid``'s node is taken back (None: never)."""
        node = self.worker_node.get(wid)
        return node.kill_at if node is not None else None

    def close(self) -> None:
        self.terminate(builtins.list(self.worker_node))

    # ---- reports from the simulation -------------------------------------------------------------
    def registered_worker(self, wid: str) -> None:
        self.registered.add(wid)

    def is_live(self, wid: str) -> bool:
        node = self.worker_node.get(wid)
        return node is not None and wid in node.live

    def walltime_end(self, wid: str) -> float | None:
        node = self.worker_node.get(wid)
        return node.end_at if node is not None else None

    def exited(self, wid: str, reason: str, *, failure: bool = False) -> None:
        """``wid``'s process ended by itself (closed by the scheduler, or its walltime ended)."""
        node = self.worker_node.get(wid)
        if node is None or wid not in node.live:
            return
        now = self.clock()
        self._end_worker(node, wid, now)
        if failure:
            self._errors.append((now, ProviderFailure(node.request_id, wid, reason)))

    def _end_worker(self, node: _Node, wid: str, now: float) -> None:
        node.live.discard(wid)
        if not node.live and node.ended is None:
            node.ended = max(node.allocated, now) if now >= node.allocated else node.allocated

    # ---- what it cost ------------------------------------------------------------------------------
    def billed_node_seconds(self, until: float) -> dict[str, float]:
        """Node-seconds billed per node type: from allocation to the end of its last worker (a
        node still in the queue, or one whose allocation failed, costs nothing)."""
        out: dict[str, float] = {}
        for node in self.nodes:
            if node.failed:
                continue
            end = node.ended if node.ended is not None else until
            out[node.node_type] = out.get(node.node_type, 0.0) + max(0.0, min(end, until) - node.allocated)
        return out
