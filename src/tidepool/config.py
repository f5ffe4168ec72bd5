"""Cluster files (TOML): node types, the provider, the scaling policy and scheduler options.

Example::

    [scheduler]
    host = "0.0.0.0"
    port = 8786
    # tls_ca_file = "certs/ca.pem"; tls_cert = "certs/cert.pem"; tls_key = "certs/key.pem"
    #   (optional: TLS on every connection; the provider's workers get the same files)
    # state_dir = "/var/lib/tidepool"   (optional: survive a restart, docs/recovery.md)
    # reconnect_window = 300            (seconds workers and clients retry a restarted scheduler)

    [provider]
    kind = "local"              # local | ssh | slurm | callback | kubernetes
    # kind = "callback"; launch = "mymodule:launch"; terminate = "mymodule:terminate"

    [policy]
    kind = "adaptive"           # adaptive | completion | backlog | default | "module:function"
                                # (default: adapt()'s planned policy; objective/deadline/budget keys)
    idle_timeout = 5.0          # optional: seconds an empty idle worker is kept while work may come
                                # (retired at once when the forecast says none can: docs/scaling.md)
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

Loading validates everything up front, so a scheduler never starts on a file it would trip over
later: every table's keys are checked against the keys it accepts (an unknown key names the file,
the table, the closest allowed key and the full list), and every value against its type and range.
The provider's keys are its constructor's keyword arguments (read from its signature, with their
annotations as the types); a built-in provider is also constructed once, unbound, so its own checks
(hosts, walltime, ...) run at load time too.  Nothing here connects, launches or writes a file.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib
import inspect
import math
import numbers
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError, TidepoolError
from tidepool.scaling.node_types import NodeType

_TOP_KEYS = ("scheduler", "provider", "policy", "node_types", "autoscaler")
#: ``[autoscaler]``: the controller's pool-wide settings (``ScalingController`` keywords), all
#: finite numbers > 0: cost ceilings (``scaling/limits.py``) and the idle time before scaling to zero
_AUTOSCALER_KEYS = ("max_cost_per_hour", "budget", "scale_to_zero_after")
_SCHEDULER_KEYS = ("host", "port", "tls_ca_file", "tls_cert", "tls_key", "state_dir",
                  "reconnect_window")
_NODE_KEYS = tuple(f.name for f in dataclasses.fields(NodeType))
_POLICY_KINDS = ("adaptive", "completion", "backlog", "default")
_PROVIDER_KINDS = ("local", "ssh", "slurm", "callback", "kubernetes")
#: keys every built-in policy kind accepts besides ``kind`` (all seconds: finite numbers >= 0)
_POLICY_KEYS: dict[str, tuple[str, ...]] = {
    "adaptive": ("idle_timeout", "cached_idle_timeout", "max_eta", "min_lifetime"),
    "completion": ("idle_timeout", "cached_idle_timeout", "max_eta", "min_lifetime"),
    "backlog": ("idle_timeout", "cached_idle_timeout", "min_lifetime", "delay", "interval"),
    # the planned default policy (adapt()'s): ``objective`` is a name, the rest numbers
    "default": ("objective", "deadline", "budget", "guess_budget", "min_lifetime"),
}
#: constructor arguments the scheduler supplies itself (``bind``), never read from the file
_BOUND = ("scheduler", "token")


@dataclass
class ClusterConfig:
    node_types: list[NodeType]
    provider: dict[str, Any] = field(default_factory=lambda: {"kind": "local"})
    policy: dict[str, Any] = field(default_factory=lambda: {"kind": "adaptive"})
    scheduler: dict[str, Any] = field(default_factory=dict)
    source: str = "<dict>"
    #: ``[autoscaler]``: keyword arguments of the scaling controller (``_AUTOSCALER_KEYS``)
    autoscaler: dict[str, Any] = field(default_factory=dict)

    def make_policy(self) -> Any:
        """The policy object the ``[policy]`` table describes."""
        from tidepool.scaling.policies import Adaptive, Backlog, CompletionTarget, IdleRetire

        p = dict(self.policy)
        kind = _policy_kind(p, self.source)
        if ":" in kind:
            return _custom_policy(kind, p, self.source)
        _check_keys(self.source, f"[policy] (kind = {kind!r})", p, ("kind", *_POLICY_KEYS[kind]))
        if kind == "default":
            from tidepool.scaling.planned import default_policy

            if "min_lifetime" in p:
                _seconds(self.source, "[policy]", "min_lifetime", p["min_lifetime"])

            try:
                return default_policy(**{k: v for k, v in p.items() if k != "kind"})
            except ConfigError as exc:
                raise ConfigError(f"{self.source}: [policy] {exc}") from None
        for key in _POLICY_KEYS[kind]:
            if key in p:
                _seconds(self.source, "[policy]", key, p[key])
        idle = IdleRetire(**{k: p[k] for k in ("idle_timeout", "cached_idle_timeout") if k in p})
        min_lifetime = p.get("min_lifetime", 1.0)
        if kind == "backlog":
            backlog = Backlog(**{k: p[k] for k in ("delay", "interval") if k in p})
            return Adaptive(launcher=None, backlog=backlog, idle=idle, min_lifetime=min_lifetime)
        pol = Adaptive(launcher=CompletionTarget(max_eta=p.get("max_eta")), idle=idle, min_lifetime=min_lifetime)
        if kind == "completion":
            pol.no_progress = None
        return pol

    def make_provider(self, scheduler: str, token: str, tls: Any = None) -> Any:
        """The provider the ``[provider]`` table describes, bound to the scheduler; with ``tls``
        (a TLSConfig), the workers it starts get its certificates (their environment)."""
        cls, kwargs = _provider_spec(self.provider, self.source)
        prov = _construct(cls, kwargs, self.source, scheduler, token)
        if tls is not None:
            if not isinstance(getattr(prov, "env", None), dict):
                raise ConfigError(f"{self.source}: TLS is on but the {self.provider.get('kind', 'local')} "
                                  "provider cannot pass the certificates to its workers (no env)")  # fmt: skip
            prov.env.update(tls.env())
        if hasattr(prov, "bind"):
            prov.bind(scheduler, token)
        return prov


# ---- helpers -------------------------------------------------------------------------------------
def _check_keys(source: str, table: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Refuse keys outside ``allowed``, naming the closest allowed one and the whole list."""
    allowed = sorted(allowed)
    unknown = sorted(set(given) - set(allowed))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    noun = "key" if len(unknown) == 1 else "keys"
    raise ConfigError(f"{source}: unknown {noun} {', '.join(hints)} in {table}; allowed keys: "
                      f"{', '.join(allowed) or '(none)'}; fix or remove {'it' if len(unknown) == 1 else 'them'}")  # fmt: skip


def _table(source: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} must be a table ({name} with key = value lines), got {value!r}")
    return value


def _seconds(source: str, table: str, key: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0):  # fmt: skip
        raise ConfigError(f"{source}: {table} {key} must be a number of seconds >= 0, got {value!r}")


def _import(spec: str, source: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{source}: cannot import {spec!r}: {exc}; check the module is installed on "
                          "this machine and spelled 'module:name'") from exc  # fmt: skip
    except ValueError as exc:  # e.g. an empty module name
        raise ConfigError(f"{source}: cannot import {spec!r}: {exc}; write it as 'module:name'") from exc


def _policy_kind(p: dict[str, Any], source: str) -> str:
    kind = p.get("kind", "adaptive")
    if not isinstance(kind, str) or (kind not in _POLICY_KINDS and ":" not in kind):
        raise ConfigError(f"{source}: [policy] kind must be one of {_POLICY_KINDS} or 'module:function', "
                          f"got {kind!r}")  # fmt: skip
    return kind


def _custom_policy(kind: str, p: dict[str, Any], source: str) -> Any:
    pol = _import(kind, source)
    rest = {k: v for k, v in p.items() if k != "kind"}
    if isinstance(pol, type):
        allowed, kwargs_ok = _parameters(pol)
        if not kwargs_ok:
            _check_keys(source, f"[policy] (kind = {kind!r})", rest, ("kind", *allowed))
        _check_types(source, "[policy]", pol, rest, ours=pol.__module__.startswith("tidepool."))
        try:
            pol = pol(**rest)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: [policy] {kind} rejected its keys {sorted(rest)}: {exc}") from exc
    elif rest:
        _check_keys(source, f"[policy] (kind = {kind!r}, a function: it takes no options)", rest, ("kind",))
    if not callable(pol):
        raise ConfigError(f"{source}: [policy] kind {kind!r} is not callable; name a function "
                          "snapshot -> ScaleDecision or a class whose instances are")  # fmt: skip
    return pol


def _parameters(fn: Callable[..., Any]) -> tuple[list[str], bool]:
    """Keyword arguments ``fn`` takes (without the scheduler-supplied ones), and whether it has ``**kw``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], True  # cannot tell: let the call decide
    names, var_kw = [], False
    for prm in sig.parameters.values():
        if prm.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif prm.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            if prm.name not in _BOUND and prm.name != "self":
                names.append(prm.name)
    return names, var_kw


def _provider_spec(table: Mapping[str, Any], source: str) -> tuple[Any, dict[str, Any]]:
    """The provider class the table names and its checked keyword arguments."""
    p = dict(table)
    kind = p.pop("kind", "local")
    if not isinstance(kind, str) or (kind not in _PROVIDER_KINDS and ":" not in kind):
        raise ConfigError(f"{source}: [provider] kind must be one of {', '.join(_PROVIDER_KINDS)} or "
                          f"'module:Class', got {kind!r}")  # fmt: skip
    if kind == "local":
        from tidepool.providers.local import LocalProvider

        cls: Any = LocalProvider
    elif kind == "callback":
        from tidepool.providers.callback import CallbackProvider

        cls = CallbackProvider
        missing = [k for k in ("launch", "terminate") if k not in p]
        if missing:
            raise ConfigError(f"{source}: [provider] kind='callback' needs launch and terminate "
                              f"('module:function'); missing {', '.join(missing)}")  # fmt: skip
        for k in ("launch", "terminate"):
            if not isinstance(p[k], str) or ":" not in p[k]:
                raise ConfigError(f"{source}: [provider] {k} must be 'module:function', got {p[k]!r}")
    elif kind in ("ssh", "slurm", "kubernetes"):
        try:
            mod = importlib.import_module(f"tidepool.providers.{kind}")
        except ImportError as exc:
            raise ConfigError(f"{source}: [provider] kind={kind!r} cannot be loaded: {exc}") from exc
        cls = getattr(mod, {"ssh": "SSHProvider", "slurm": "SlurmProvider"}.get(kind, "KubernetesProvider"))
    else:
        cls = _import(kind, source)
        if not callable(cls):
            raise ConfigError(f"{source}: [provider] kind {kind!r} is not a class or factory")
    allowed, var_kw = _parameters(cls)
    if not var_kw:
        _check_keys(source, f"[provider] (kind = {kind!r})", p, ("kind", *allowed))
    _check_types(source, "[provider]", cls, p, ours=kind in _PROVIDER_KINDS)
    if kind == "callback":
        p["launch"], p["terminate"] = _import(p["launch"], source), _import(p["terminate"], source)
    return cls, p


def _construct(cls: Any, kwargs: dict[str, Any], source: str, scheduler: str, token: str) -> Any:
    from tidepool.providers.local import LocalProvider

    try:
        if cls is LocalProvider:
            return cls(scheduler, token, **kwargs)
        return cls(**kwargs)
    except TidepoolError as exc:
        raise ConfigError(f"{source}: [provider] {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: [provider] {getattr(cls, '__name__', cls)} rejected "
                          f"{sorted(kwargs)}: {exc}") from exc  # fmt: skip


# ---- value types from annotations --------------------------------------------------------------
def _check_types(source: str, table: str, fn: Any, values: Mapping[str, Any], *, ours: bool) -> None:
    """Check ``values`` against ``fn``'s annotations (plain types, unions, lists and tables only;
    anything fancier is left to ``fn``).  For ``ours`` (built-in classes, whose numbers are all
    counts, ports and seconds) numbers must also be finite and >= 0."""
    try:
        target = fn.__init__ if isinstance(fn, type) else fn  # type: ignore[misc]
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to check against
        return
    for key, value in values.items():
        if key in hints and not _fits(value, hints[key]):
            raise ConfigError(f"{source}: {table} {key} must be {_describe(hints[key])}, got {value!r}")
        if ours and isinstance(value, numbers.Real) and not isinstance(value, bool):
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{source}: {table} {key} must be a finite number >= 0, got {value!r}")


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return True
    if tp is None or tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        elem = args[0] if args else Any
        return all(_fits(v, elem) for v in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            return False
        kt, vt = args if len(args) == 2 else (Any, Any)
        return all(_fits(k, kt) and _fits(v, vt) for k, v in value.items())
    return True  # a type we do not model: the constructor checks it


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None)) or "nothing"
    if origin in (list, tuple, collections.abc.Sequence):
        return f"a list of {_PLURAL.get(args[0], 'values') if args else 'values'}"
    if origin in (dict, collections.abc.Mapping):
        values = _PLURAL.get(args[1], "values") if len(args) == 2 else "values"
        return f"a table of {values}, e.g. {{ KEY = ... }}"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(tp, str(tp))


_PLURAL = {bool: "true/false values", int: "whole numbers", float: "numbers", str: "strings"}


# ---- the file ------------------------------------------------------------------------------------
def _check_scheduler(source: str, s: dict[str, Any]) -> None:
    _check_keys(source, "[scheduler]", s, _SCHEDULER_KEYS)
    if "host" in s and (not isinstance(s["host"], str) or not s["host"]):
        raise ConfigError(f"{source}: [scheduler] host must be a host name or address like \"0.0.0.0\", "
                          f"got {s['host']!r}")  # fmt: skip
    if "state_dir" in s and (not isinstance(s["state_dir"], str) or not s["state_dir"]):
        raise ConfigError(f"{source}: [scheduler] state_dir must be a directory path, got {s['state_dir']!r}")
    window = s.get("reconnect_window", 1.0)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window < float("inf"):
        raise ConfigError(f"{source}: [scheduler] reconnect_window must be a positive number of seconds, "
                          f"got {window!r}")  # fmt: skip
    port = s.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{source}: [scheduler] port must be a whole number 0..65535 (0: any free port), "
                          f"got {port!r}")  # fmt: skip
    for key in ("tls_ca_file", "tls_cert", "tls_key"):  # (a number crashed the scheduler later: a bug hunt)
        if key in s and (not isinstance(s[key], str) or not s[key]):
            raise ConfigError(f"{source}: [scheduler] {key} must be the path of a PEM file, got {s[key]!r}")
    tls = [key for key in ("tls_ca_file", "tls_cert", "tls_key") if key in s]
    if tls and len(tls) != 3:
        raise ConfigError(f"{source}: [scheduler] TLS needs tls_ca_file, tls_cert and tls_key together; "
                          f"only {', '.join(tls)} given")  # fmt: skip


def _node_types(source: str, raw: Any) -> list[NodeType]:
    if isinstance(raw, dict):
        raise ConfigError(f"{source}: node_types must be an array of tables: write [[node_types]] "
                          "(double brackets) before each node type")  # fmt: skip
    if not raw or not isinstance(raw, list):
        raise ConfigError(f"{source}: define at least one [[node_types]] table with a name and resources")
    types_: list[NodeType] = []
    for i, nt in enumerate(raw):
        where = f"[[node_types]] #{i + 1}"
        if not isinstance(nt, dict):
            raise ConfigError(f"{source}: {where} must be a table, got {nt!r}")
        named = f"{where} ({nt['name']!r})" if isinstance(nt.get("name"), str) else where
        _check_keys(source, named, nt, _NODE_KEYS)
        if "name" not in nt:
            raise ConfigError(f"{source}: {where} needs a name, e.g. name = \"cpu\"")
        try:
            types_.append(NodeType(**nt))
        except ConfigError as exc:  # its message names the node type
            raise ConfigError(f"{source}: {where}: {exc}") from exc
    names = [t.name for t in types_]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: node type names must be unique, got {names}")
    if all(t.max_nodes == 0 for t in types_):  # as adapt() refuses it: every task would wait for ever
        raise ConfigError(f"{source}: max_nodes is 0 for every node type ({', '.join(map(repr, names))}): the "
                          "autoscaler could never start a worker; give at least one node type max_nodes >= 1")  # fmt: skip
    for t in types_:
        if t.fallback is not None and t.fallback not in names:
            raise ConfigError(f"{source}: [[node_types]] {t.name!r}: fallback {t.fallback!r} is not one of the node "
                              f"types {names}; add it or fix the name")  # fmt: skip
    return types_


def parse(data: dict[str, Any], source: str = "<dict>") -> ClusterConfig:
    """Validate a parsed cluster file: every key of every table, every value, the policy and provider."""
    _check_keys(source, "the top level (tables)", data, _TOP_KEYS)
    scheduler = dict(_table(source, "[scheduler]", data.get("scheduler", {})))
    _check_scheduler(source, scheduler)  # a typo is named first, before what the typo hides
    types_ = _node_types(source, data.get("node_types"))
    provider = dict(_table(source, "[provider]", data.get("provider", {"kind": "local"})))
    policy = dict(_table(source, "[policy]", data.get("policy", {"kind": "adaptive"})))
    autoscaler = dict(_table(source, "[autoscaler]", data.get("autoscaler", {})))
    _check_keys(source, "[autoscaler]", autoscaler, _AUTOSCALER_KEYS)
    for key, value in autoscaler.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{source}: [autoscaler] {key} must be a finite number > 0, got {value!r}; "
                              "remove the key for no limit")  # fmt: skip
    cfg = ClusterConfig(types_, provider, policy, scheduler, source, autoscaler)
    cfg.make_policy()  # validate now, not at the first scaling decision
    if policy.get("kind") == "default" and "budget" in policy:  # also the hard limit, as adapt(budget=)
        autoscaler.setdefault("budget", policy["budget"])
    cls, kwargs = _provider_spec(provider, source)  # ... nor when the scheduler starts
    if provider.get("kind", "local") in _PROVIDER_KINDS:  # ours: constructing checks the rest, no I/O
        _construct(cls, kwargs, source, "tcp://127.0.0.1:0", "")  # never bound nor used: nothing to close
    return cfg


def read_toml(path: str) -> dict[str, Any]:
    """The TOML table in ``path``; unreadable files and bad TOML are :class:`ConfigError`."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def load(path: str) -> ClusterConfig:
    """Read and validate a TOML cluster file."""
    return parse(read_toml(path), path)
