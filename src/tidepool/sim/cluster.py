"""What the simulated cluster is: node types, start-up models, network, timers.

A simulation reads an ordinary cluster file (``tidepool scheduler --cluster``: node types, provider,
policy) plus an optional ``[simulate]`` table that only the simulator reads::

    [simulate]
    startup = "cloud"      # start-up preset of every node type (default: from [provider] kind)
    latency = 0.001        # one-way message delay between scheduler, workers and client, s
    bandwidth = "1GB"      # bytes per second of one transfer (worker-worker, worker-client)
    interval = 0.2         # autoscaler period, s (it also wakes on joins, leaves and submits)
    tick = 0.5             # scheduler tick period, s
    heartbeat = 30         # worker heartbeat period, s
    forecast_budget = 0.1  # optional: forecasts at most this fraction of the time (not in the real shell)
    cores = 2              # optional: one worker's cores (or a table by node type); tasks beyond share them
    setup = 5              # optional: seconds a worker's setup hooks take before it takes tasks
    restart = 1            # seconds a worker that passed its memory limit takes to come back
    disk = "500MB"         # optional: bytes per second a worker spills and reads back (default: free)
    unmanaged = "100MB"    # optional: a worker process's own memory, counted against its memory limit
    overhead = 0.002       # optional: seconds a worker's loop spends on each task it starts
    seed = 1               # the CLI's --seed wins

    [simulate.node_types.gpu]   # one node type's start-up: a preset and/or its own numbers
    startup = "slurm"
    queue = "lognormal(300, 1)"
    fail = 0.05
    walltime = 7200

The default preset follows ``[provider] kind``: ``local`` -> local, ``ssh`` -> ssh, ``slurm`` ->
slurm, anything else -> cloud.  ``cost`` of a node type is read as its price per node-hour.

Short forms for the command line (:func:`preset_cluster`): ``local:4`` (node type ``default``,
1 cpu, at most 4 nodes, local start-up, as ``LocalCluster.adapt(maximum=4)``), ``cloud:10000``,
``slurm:1000``, optionally ``:CPUS`` per worker (``cloud:1000:8``).  A short form's node type
says what the simulator bills of a start-up (``billed_startup``: from allocation, so a preset with
a queue wait bills only its mean boot; the others all of it); a cluster file's node types keep
their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tidepool.config import ClusterConfig, parse
from tidepool.errors import ConfigError
from tidepool.resources import parse_bytes
from tidepool.scaling.node_types import NodeType
from tidepool.sim.provider import PRESETS, ZERO, StartupModel, model_from

_SIM_KEYS = ("startup", "latency", "bandwidth", "interval", "tick", "heartbeat", "seed", "node_types",
             "forecast_budget", "cores", "setup", "restart", "disk", "unmanaged", "overhead")
_DEFAULT_PRESET = {"local": "local", "ssh": "ssh", "slurm": "slurm"}


@dataclass
class SimCluster:
    """Everything about the simulated machines; the policy comes from the cluster file or the CLI."""

    node_types: list[NodeType]
    models: dict[str, StartupModel]
    config: ClusterConfig | None = None
    latency: float = 0.001
    bandwidth: float = 1e9
    interval: float = 0.2
    tick: float = 0.5
    heartbeat: float = 30.0
    seed: int | None = None
    forecast_budget: float | None = None  # see Simulation
    source: str = "<cluster>"
    notes: list[str] = field(default_factory=list)
    #: cores of one worker per node type: more running tasks than that share them (none: no contention)
    cores: dict[str, float] = field(default_factory=dict)
    #: seconds a worker's setup hooks take after it registers (it takes no task before)
    setup: float = 0.0
    #: seconds a worker over its memory limit takes to come back
    restart: float = 1.0
    #: bytes per second a worker spills to disk and reads back (None: spilling takes no time)
    disk: float | None = None
    #: a worker process's own resident memory (interpreter, libraries), counted against its limit
    unmanaged: float = 0.0
    #: seconds a worker's loop spends on each task it starts (hand-off, bookkeeping); 0: none
    overhead: float = 0.0

    def make_policy(self) -> Any:
        """The policy of the cluster file (the default policy without one)."""
        if self.config is not None:
            return self.config.make_policy()
        from tidepool.scaling.policies import Adaptive

        return Adaptive()

    def describe(self) -> str:
        parts = []
        for nt in self.node_types:
            parts.append(f"{nt.name}: {dict(nt.worker_resources)} x{nt.workers_per_node}/node, "
                         f"max {nt.max_nodes} nodes, cost {nt.cost:g}/node-hour, {self.models[nt.name].describe()}")  # fmt: skip
        return "; ".join(parts)


def _seconds(source: str, key: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):  # fmt: skip
        raise ConfigError(f"{source}: [simulate] {key} must be a {'positive ' if positive else ''}number of "
                          f"seconds, got {value!r}")  # fmt: skip
    return float(value)


def from_dict(data: Mapping[str, Any], source: str = "<cluster>") -> SimCluster:
    """A :class:`SimCluster` from a parsed cluster file (with an optional ``[simulate]`` table)."""
    data = dict(data)
    sim = data.pop("simulate", {}) or {}
    if not isinstance(sim, Mapping):
        raise ConfigError(f"{source}: [simulate] must be a table")
    bad = set(sim) - set(_SIM_KEYS)
    if bad:
        raise ConfigError(f"{source}: unknown keys {sorted(bad)} in [simulate]; allowed: {', '.join(_SIM_KEYS)}")
    cfg = parse(data, source)
    kind = str(cfg.provider.get("kind", "local"))
    default = sim.get("startup", _DEFAULT_PRESET.get(kind, "cloud"))
    base = model_from(default, f"{source}: [simulate] startup")
    per_type = sim.get("node_types", {}) or {}
    if not isinstance(per_type, Mapping):
        raise ConfigError(f"{source}: [simulate.node_types] must be tables named after node types")
    names = {nt.name for nt in cfg.node_types}
    unknown = set(per_type) - names
    if unknown:
        raise ConfigError(f"{source}: [simulate.node_types] names {sorted(unknown)}, which are not node types "
                          f"({', '.join(sorted(names))})")  # fmt: skip
    models = {nt.name: model_from(per_type[nt.name], f"{source}: [simulate.node_types.{nt.name}]", base)
              if nt.name in per_type else base for nt in cfg.node_types}  # fmt: skip
    # a walltime from the Slurm provider's own option, when the model has none
    if kind == "slurm" and "walltime" in cfg.provider:
        from tidepool.providers.slurm import parse_walltime

        wall = parse_walltime(cfg.provider["walltime"])
        models = {k: (replace(m, walltime=float(wall)) if wall else m) for k, m in models.items()}
    bw = sim.get("bandwidth", 1e9)
    bandwidth = float(parse_bytes(bw)) if isinstance(bw, str) else float(bw)
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ConfigError(f"{source}: [simulate] bandwidth must be positive bytes per second, got {bw!r}")
    seed = sim.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"{source}: [simulate] seed must be a whole number, got {seed!r}")
    return SimCluster(
        list(cfg.node_types), models, cfg,
        latency=_seconds(source, "latency", sim.get("latency", 0.001)), bandwidth=bandwidth,
        interval=_seconds(source, "interval", sim.get("interval", 0.2), positive=True),
        tick=_seconds(source, "tick", sim.get("tick", 0.5), positive=True),
        heartbeat=_seconds(source, "heartbeat", sim.get("heartbeat", 30.0), positive=True),
        seed=seed, source=source, forecast_budget=_budget(source, sim.get("forecast_budget")),
        cores=_cores(source, sim.get("cores"), names), setup=_seconds(source, "setup", sim.get("setup", 0.0)),
        restart=_seconds(source, "restart", sim.get("restart", 1.0)), disk=_disk(source, sim.get("disk")),
        unmanaged=float(parse_bytes(sim.get("unmanaged", 0))),
        overhead=_seconds(source, "overhead", sim.get("overhead", 0.0)),
    )  # fmt: skip


def _disk(source: str, value: Any) -> float | None:
    if value is None:
        return None
    disk = float(parse_bytes(value)) if isinstance(value, str) else float(value)
    if not (math.isfinite(disk) and disk > 0):
        raise ConfigError(f"{source}: [simulate] disk must be positive bytes per second (e.g. \"500MB\"), got {value!r}")
    return disk


def _cores(source: str, value: Any, names: set[str]) -> dict[str, float]:
    """``cores = 2`` (every node type) or ``cores = {gpu = 8}``: one worker's cores."""
    if value is None:
        return {}
    items = value.items() if isinstance(value, Mapping) else ((n, value) for n in names)
    out = {}
    for name, n in items:
        if name not in names or isinstance(n, bool) or not isinstance(n, (int, float)) or not n > 0:
            raise ConfigError(f"{source}: [simulate] cores must be a positive number, or a table of them by node "
                              f"type ({', '.join(sorted(names))}); got {name!r} = {n!r}")  # fmt: skip
        out[str(name)] = float(n)
    return out


def _budget(source: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{source}: [simulate] forecast_budget must be a fraction 0 < f <= 1, got {value!r}")
    return float(value)


def load(path: str) -> SimCluster:
    """Read a cluster file for simulation (see the module docstring)."""
    from tidepool.config import read_toml

    return from_dict(read_toml(path), path)


def preset_cluster(text: str) -> SimCluster:
    """``KIND:NODES[:CPUS]``: one node type named ``default`` with that start-up preset."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in PRESETS:
        raise ConfigError(f"cluster {text!r}: expected a cluster file or KIND:NODES[:CPUS] with KIND one of "
                          f"{', '.join(PRESETS)} (e.g. cloud:10000)")  # fmt: skip
    try:
        nodes = int(parts[1])
        cpus = float(parts[2]) if len(parts) == 3 else 1.0
    except ValueError as exc:
        raise ConfigError(f"cluster {text!r}: NODES and CPUS are numbers") from exc
    if nodes < 1 or not cpus > 0 or cpus == float("inf"):
        raise ConfigError(f"cluster {text!r}: NODES must be at least 1 and CPUS (per node) above 0, e.g. "
                          f"{parts[0]}:10:4")  # fmt: skip
    model = PRESETS[parts[0]]
    estimate = 0.5 if parts[0] == "local" else round(model.mean_startup, 1)
    # the simulator bills from allocation: a queue wait (Slurm's) is not billed, the boot after it is
    billed = None if model.queue == ZERO else round(model.boot.mean, 1)
    nt = NodeType("default", {"cpu": cpus}, max_nodes=nodes, startup_estimate=estimate, billed_startup=billed)
    return SimCluster([nt], {"default": model}, None, source=text)


def load_cluster(text: str) -> SimCluster:
    """A cluster file path, or a ``KIND:NODES[:CPUS]`` short form."""
    if text.endswith(".toml") or os.path.exists(text):
        return load(text)
    if ":" in text:
        return preset_cluster(text)
    return load(text)
