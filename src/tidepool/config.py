"""Cluster files (TOML): node types, the provider, the scaling policy and scheduler options.

Example::

    [scheduler]
    host = "0.0.0.0"
    port = 8786

    [provider]
    kind = "local"              # local | ssh | slurm | callback
    # kind = "callback"; launch = "mymodule:launch"; terminate = "mymodule:terminate"

    [policy]
    kind = "adaptive"           # adaptive | completion | backlog | "module:function"
    idle_timeout = 5.0          # optional: seconds an empty idle worker is kept
    cached_idle_timeout = 60.0  # optional: ... a worker holding needed data
    max_eta = 600               # optional: scale up only while the forecast exceeds this

    [[node_types]]
    name = "cpu"
    resources = { cpu = 8, memory = "16GB" }
    max_nodes = 10

    [[node_types]]
    name = "gpu"
    resources = { cpu = 4, gpu = 2 }
    max_nodes = 2
    cost = 4.0

Loading validates everything up front and names the file and key in every error.
"""

from __future__ import annotations

import importlib
import tomllib
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scaling.node_types import NodeType

_NODE_KEYS = {"name", "resources", "min_nodes", "max_nodes", "workers_per_node", "cost", "startup_estimate", "options"}
_POLICY_KINDS = ("adaptive", "completion", "backlog")


@dataclass
class ClusterConfig:
    node_types: list[NodeType]
    provider: dict[str, Any] = field(default_factory=lambda: {"kind": "local"})
    policy: dict[str, Any] = field(default_factory=lambda: {"kind": "adaptive"})
    scheduler: dict[str, Any] = field(default_factory=dict)
    source: str = "<dict>"

    def make_policy(self) -> Any:
        """The policy object the ``[policy]`` table describes."""
        from tidepool.scaling.policies import Adaptive, Backlog, CompletionTarget, IdleRetire

        p = dict(self.policy)
        kind = p.pop("kind", "adaptive")
        idle_keys = {k: p.pop(k) for k in ("idle_timeout", "cached_idle_timeout") if k in p}
        max_eta = p.pop("max_eta", None)
        min_lifetime = p.pop("min_lifetime", 1.0)
        if kind == "adaptive":
            pol: Any = Adaptive(launcher=CompletionTarget(max_eta=max_eta), idle=IdleRetire(**idle_keys),
                                min_lifetime=min_lifetime)  # fmt: skip
        elif kind == "completion":
            pol = Adaptive(launcher=CompletionTarget(max_eta=max_eta), idle=IdleRetire(**idle_keys),
                           min_lifetime=min_lifetime)  # fmt: skip
            pol.no_progress = None
        elif kind == "backlog":
            pol = Adaptive(launcher=None, backlog=Backlog(**{k: p.pop(k) for k in ("delay", "interval") if k in p}),
                           idle=IdleRetire(**idle_keys), min_lifetime=min_lifetime)  # fmt: skip
        elif ":" in kind:
            pol = _import(kind, self.source)
            if isinstance(pol, type):
                pol = pol(**p)
                p = {}
        else:
            raise ConfigError(f"{self.source}: [policy] kind must be one of {_POLICY_KINDS} or 'module:function', got {kind!r}")
        if p:
            raise ConfigError(f"{self.source}: unknown [policy] keys {sorted(p)}")
        return pol

    def make_provider(self, scheduler: str, token: str) -> Any:
        """The provider the ``[provider]`` table describes, bound to the scheduler."""
        p = dict(self.provider)
        kind = p.pop("kind", "local")
        if kind == "local":
            from tidepool.providers.local import LocalProvider

            prov: Any = LocalProvider(scheduler, token, **p)
        elif kind == "callback":
            from tidepool.providers.callback import CallbackProvider

            try:
                launch, terminate = p.pop("launch"), p.pop("terminate")
            except KeyError as exc:
                raise ConfigError(f"{self.source}: [provider] kind='callback' needs launch and terminate") from exc
            prov = CallbackProvider(_import(launch, self.source), _import(terminate, self.source), **p)
        elif kind in ("ssh", "slurm"):
            mod = importlib.import_module(f"tidepool.providers.{kind}")
            cls = getattr(mod, "SSHProvider" if kind == "ssh" else "SlurmProvider")
            prov = cls(**p)
        elif ":" in kind:
            prov = _import(kind, self.source)(**p)
        else:
            raise ConfigError(f"{self.source}: [provider] kind must be local, ssh, slurm, callback or 'module:Class', got {kind!r}")
        if hasattr(prov, "bind"):
            prov.bind(scheduler, token)
        return prov


def _import(spec: str, source: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{source}: cannot import {spec!r}: {exc}") from exc


def parse(data: dict[str, Any], source: str = "<dict>") -> ClusterConfig:
    """Validate a parsed cluster file."""
    unknown = set(data) - {"scheduler", "provider", "policy", "node_types"}
    if unknown:
        raise ConfigError(f"{source}: unknown tables {sorted(unknown)}; expected scheduler, provider, policy, node_types")
    raw_types = data.get("node_types")
    if not raw_types or not isinstance(raw_types, list):
        raise ConfigError(f"{source}: define at least one [[node_types]] table with a name and resources")
    types = []
    for i, nt in enumerate(raw_types):
        if not isinstance(nt, dict):
            raise ConfigError(f"{source}: node_types[{i}] must be a table")
        bad = set(nt) - _NODE_KEYS
        if bad:
            raise ConfigError(f"{source}: node_types[{i}] has unknown keys {sorted(bad)}; allowed: {sorted(_NODE_KEYS)}")
        try:
            types.append(NodeType(**nt))
        except TypeError as exc:
            raise ConfigError(f"{source}: node_types[{i}]: {exc}") from exc
        except ConfigError as exc:
            raise ConfigError(f"{source}: node_types[{i}]: {exc}") from exc
    names = [t.name for t in types]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: node type names must be unique, got {names}")
    cfg = ClusterConfig(types, dict(data.get("provider", {"kind": "local"})),
                        dict(data.get("policy", {"kind": "adaptive"})), dict(data.get("scheduler", {})), source)  # fmt: skip
    cfg.make_policy()  # validate now, not at the first scaling decision
    return cfg


def load(path: str) -> ClusterConfig:
    """Read and validate a TOML cluster file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    return parse(data, path)
