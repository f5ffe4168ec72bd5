"""Pod templates: what one node of a node type looks like as a Kubernetes pod (pure, no I/O).

Place in the data flow: :class:`~tidepool.providers.kubernetes.KubernetesProvider` asks
:func:`pod_manifest` for the JSON body of each pod it creates, and :func:`secret_manifest` for the
token's Secret.  A node is one pod; each of its ``workers_per_node`` workers is one container of
that pod, asking for the worker's share of the node type's resources (``cpu``, ``memory`` and
``gpu`` become ``cpu``, ``memory`` and ``nvidia.com/gpu`` requests and limits; other resource
names are only labels the worker advertises, unless ``resource_names`` maps them to an extended
resource).

Names and labels carry the ids, so creation is idempotent: the pod is ``tp-<cluster>-<first worker
id>`` made DNS-safe (a second create of the same node answers ``409 AlreadyExists``), labelled
``tidepool.io/cluster``, ``tidepool.io/node-type``, ``tidepool.io/request`` and
``tidepool.io/worker``, and annotated with the full worker ids (labels are limited to 63
characters).  The token is never in the pod: each container reads it from the Secret through
``valueFrom.secretKeyRef`` (the spec names the Secret, not the value).

A :class:`PodTemplate` is given per node type in Python (``KubernetesProvider(templates={...})``) or
in the cluster TOML as the node type's ``options`` table (``image``, ``node_selector``,
``tolerations``, ``service_account``, ``env``, ...); keys it does not know are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.errors import ConfigError
from tidepool.scaling.node_types import NodeType

LABEL_CLUSTER = "tidepool.io/cluster"
LABEL_NODE_TYPE = "tidepool.io/node-type"
LABEL_REQUEST = "tidepool.io/request"
LABEL_WORKER = "tidepool.io/worker"
ANNOTATION_WORKERS = "tidepool.io/workers"
TOKEN_KEY = "token"
#: tidepool resource names -> Kubernetes resource names (requests and limits)
DEFAULT_RESOURCE_NAMES: Mapping[str, str] = {"cpu": "cpu", "memory": "memory", "gpu": "nvidia.com/gpu"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


@dataclass(frozen=True)
class PodTemplate:
    """What the pods of one node type look like.

    ``image`` must have tidepool installed and ``python`` on its path (the worker runs as
    ``python -m tidepool.worker ...``).  ``node_selector``, ``tolerations``, ``service_account``,
    ``priority_class`` and ``image_pull_policy`` go into the pod spec as written; ``env`` is
    exported to every worker; ``labels``/``annotations`` are added to the pod's own;
    ``resource_names`` maps a tidepool resource to a Kubernetes one (``{"gpu": "amd.com/gpu"}``).
    """

    image: str = "tidepool:latest"
    python: str = "python"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    service_account: str | None = None
    priority_class: str | None = None
    image_pull_policy: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    resource_names: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image:
            raise ConfigError(f"pod template: image must be an image name like 'ghcr.io/me/tidepool:1', got {self.image!r}")
        for name, value in (("node_selector", self.node_selector), ("env", self.env), ("labels", self.labels),
                            ("annotations", self.annotations), ("resource_names", self.resource_names)):  # fmt: skip
            if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in value.items()):  # fmt: skip
                raise ConfigError(f"pod template: {name} must be a table of strings, got {value!r}")
        if not isinstance(self.tolerations, Sequence) or not all(isinstance(t, Mapping) for t in self.tolerations):
            raise ConfigError("pod template: tolerations must be a list of tables like "
                              f"{{ key = 'gpu', operator = 'Exists', effect = 'NoSchedule' }}, got {self.tolerations!r}")  # fmt: skip
        for k in self.env:
            if not _ENV_NAME.fullmatch(k):
                raise ConfigError(f"pod template: env name {k!r} is not a valid environment variable name")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], base: PodTemplate | None = None,
                     where: str = "node type options") -> PodTemplate:  # fmt: skip
        """``base`` with the keys of a node type's ``options`` table (the cluster TOML) applied;
        ``env``, ``labels`` and ``annotations`` are merged, the rest replaced."""
        base = base if base is not None else cls()
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"{where}: unknown pod template key(s) {unknown}; allowed: {', '.join(allowed)}")
        changes = dict(options)
        for merged in ("env", "labels", "annotations", "resource_names"):
            if merged in changes and isinstance(changes[merged], Mapping):
                changes[merged] = {**getattr(base, merged), **changes[merged]}
        if "tolerations" in changes and isinstance(changes["tolerations"], list):
            changes["tolerations"] = tuple(changes["tolerations"])
        try:
            return dataclasses.replace(base, **changes)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc


def dns_name(text: str, limit: int = 63) -> str:
    """``text`` as a DNS-1123 label (lowercase letters, digits, ``-``; at most ``limit`` chars).
    When anything had to change, a short hash of the original keeps distinct texts distinct."""
    low = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if low == text and len(low) <= limit:
        return low
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{low[:limit - 9].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """``text`` as a label value (63 chars of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-_.") or "x"
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{clean[:54].rstrip('-_.')}-{digest}"


def pod_name(cluster_id: str, first_worker: str) -> str:
    """The pod of the node whose first worker is ``first_worker`` (deterministic: idempotent create)."""
    return dns_name(f"tp-{cluster_id}-{first_worker}")


def secret_name(cluster_id: str) -> str:
    return dns_name(f"tp-{cluster_id}-token")


def quantity(name: str, value: float) -> str:
    """A Kubernetes quantity: cpu in millicores, memory in bytes, anything else a whole count."""
    if name == "cpu":
        return f"{max(1, round(value * 1000))}m"
    if name == "memory":
        return str(int(value))
    return str(int(round(value)))


def container_resources(node_type: NodeType, template: PodTemplate) -> dict[str, dict[str, str]]:
    """Requests and limits (equal: the pod gets the Guaranteed QoS class) of one worker's container."""
    names = {**DEFAULT_RESOURCE_NAMES, **template.resource_names}
    res: dict[str, str] = {}
    for key, value in node_type.worker_resources.items():
        if key in names and value > 0:
            res[names[key]] = quantity(key if key in ("cpu", "memory") else "count", value)
    return {"requests": dict(res), "limits": dict(res)}


def pod_manifest(*, cluster_id: str, node_type: NodeType, template: PodTemplate, request_id: str,
                 worker_ids: Sequence[str], commands: Sequence[Sequence[str]], token_secret: str,
                 owner: Mapping[str, Any] | None = None,
                 grace_seconds: int = 30) -> dict[str, Any]:  # fmt: skip
    """The JSON body of the pod running ``worker_ids`` (one container each, ``commands[i]`` its argv)."""
    labels = {
        **template.labels,
        LABEL_CLUSTER: label_value(cluster_id),
        LABEL_NODE_TYPE: label_value(node_type.name),
        LABEL_REQUEST: label_value(request_id),
        LABEL_WORKER: label_value(worker_ids[0]),
    }
    env_common = [{"name": k, "value": v} for k, v in sorted(template.env.items())]
    containers = []
    for i, (wid, cmd) in enumerate(zip(worker_ids, commands, strict=True)):
        env = [*env_common, {"name": "TIDEPOOL_WORKER_ID", "value": wid},
               {"name": "TIDEPOOL_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": TOKEN_KEY}}}]  # fmt: skip
        c: dict[str, Any] = {"name": f"worker-{i}", "image": template.image, "command": list(cmd), "env": env,
                             "resources": container_resources(node_type, template)}  # fmt: skip
        if template.image_pull_policy:
            c["imagePullPolicy"] = template.image_pull_policy
        containers.append(c)
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": containers,
                            "terminationGracePeriodSeconds": int(grace_seconds)}  # fmt: skip
    if template.node_selector:
        spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        spec["tolerations"] = [dict(t) for t in template.tolerations]
    if template.service_account:
        spec["serviceAccountName"] = template.service_account
    if template.priority_class:
        spec["priorityClassName"] = template.priority_class
    meta: dict[str, Any] = {
        "name": pod_name(cluster_id, worker_ids[0]),
        "labels": labels,
        "annotations": {**template.annotations, ANNOTATION_WORKERS: json.dumps(list(worker_ids))},
    }
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def secret_manifest(cluster_id: str, token: str, owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Secret holding the token the workers authenticate with."""
    meta: dict[str, Any] = {"name": secret_name(cluster_id), "labels": {LABEL_CLUSTER: label_value(cluster_id)}}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta,
            "stringData": {TOKEN_KEY: token}}  # fmt: skip


def workers_of(pod: Mapping[str, Any]) -> list[str]:
    """The worker ids a pod runs, from its annotation (one per container, in order)."""
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_WORKERS)
    try:
        ids = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [str(w) for w in ids] if isinstance(ids, list) else []
