"""Talking to the Kubernetes API server: the client, its configuration, retries and error text.

Place in the data flow: :class:`~tidepool.providers.kubernetes.KubernetesProvider` loads its
configuration here (a kubeconfig, or the pod's service account when it runs in the cluster), makes
every call through :func:`call_api` (a timeout per call; throttling, server errors and dropped
connections retried with jittered backoff for a bounded time) and turns a refused call into a
message that says what to do (:func:`api_message` + :func:`hint`).  No state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from typing import Any

from tidepool.errors import ConfigError, ProviderError

#: HTTP statuses worth retrying: throttled, or the API server briefly unwell
RETRY = (429, 500, 502, 503, 504)


def kube() -> Any:
    """The ``kubernetes_asyncio`` package (a :class:`ConfigError` naming the extra when missing)."""
    try:
        import kubernetes_asyncio
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
        import kubernetes_asyncio.watch  # noqa: F401 - the submodules the provider uses
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError("KubernetesProvider needs kubernetes_asyncio: pip install 'tidepool[kubernetes]'") from exc
    return kubernetes_asyncio


async def load_configuration(kubeconfig: str | None, context: str | None, in_cluster: bool | None) -> Any:
    """A client ``Configuration``: in-cluster (``in_cluster``, or by default when
    ``$KUBERNETES_SERVICE_HOST`` is set and no kubeconfig is named), else from the kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config`` when None).  Failures are :class:`ProviderError`."""
    k = kube()
    cfg = k.client.Configuration()
    use_incluster = in_cluster if in_cluster is not None else (
        kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST")))  # fmt: skip
    try:
        if use_incluster:
            k.config.load_incluster_config(client_configuration=cfg)
        else:
            await k.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    except Exception as exc:  # noqa: BLE001 - ConfigException, file errors: said how to fix
        where = "the pod's service account" if use_incluster else (kubeconfig or "$KUBECONFIG / ~/.kube/config")
        raise ProviderError(f"cannot load the Kubernetes configuration from {where}: {exc}; point "
                            "kubeconfig= (or $KUBECONFIG) at a cluster's config, or run the "
                            "scheduler in the cluster") from exc  # fmt: skip
    return cfg


async def call_api(fn: Any, *args: Any, request_timeout: float, retry_for: float, **kwargs: Any) -> Any:
    """``await fn(*args, **kwargs)`` with a timeout; 429/5xx and dropped connections retried for
    ``retry_for`` seconds (jittered exponential backoff), then raised."""
    deadline = time.monotonic() + retry_for
    delay = 0.2
    while True:
        try:
            return await fn(*args, _request_timeout=request_timeout, **kwargs)
        except Exception as exc:
            status = getattr(exc, "status", None)
            dropped = isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.startswith("aiohttp")
            transient = status in RETRY or (status is None and dropped)
            if not transient or time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)


def api_message(exc: BaseException) -> str:
    """The API server's own message for a failed call (``403 Forbidden: pods is forbidden: ...``)."""
    status = getattr(exc, "status", None)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    text = getattr(exc, "reason", "") or ""
    body = getattr(exc, "body", None)
    with contextlib.suppress(Exception):
        data = json.loads(body) if body else {}
        if isinstance(data, dict) and data.get("message"):
            text = f"{data.get('reason') or text}: {data['message']}"
    return f"{status} {text}".strip()


def hint(exc: BaseException, what: str, namespace: str) -> str:
    """What to do about a failed API call (``what``: the verb and resource, e.g. "create pods")."""
    status = getattr(exc, "status", None)
    if status in (401, 403) and "quota" in api_message(exc).lower():
        return f"; raise the ResourceQuota of namespace {namespace!r} or lower the node type's max_nodes"
    if status in (401, 403):
        return (f"; the scheduler's service account (or kubeconfig user) may not {what} in namespace "
                f"{namespace!r}: apply the Role and RoleBinding in docs/providers.md")  # fmt: skip
    if status == 404:
        return f"; does namespace {namespace!r} exist? (kubectl create namespace {namespace})"
    if status == 422:
        return "; the node type's pod template is invalid: fix its options (image, resources, node_selector, ...)"
    if status is None:
        return "; is the Kubernetes API server reachable from here (kubeconfig server address, network)?"
    return ""
