"""What the Kubernetes provider knows about its pods: a cache fed by watches, and what it means.

Place in the data flow: two watches run in the scheduler's loop (the provider starts them): one on
this cluster's pods (label selector ``tidepool.io/cluster=<id>``), one on the namespace's events
about pods.  Each starts with a list (which gives a ``resourceVersion``), then watches from there,
and lists again when the server says the version is too old (``410 Gone``) or the stream breaks.
Every change lands in a :class:`PodCache`, so ``list()`` and ``poll_errors()`` read memory and make
no API call, whatever the controller's step rate.

:func:`pod_problem` is the pure part: one pod (its JSON, as the API serves it), the warning events
seen about it and how long it has been unschedulable -> why its workers will never work (or None).
The Kubernetes reasons it recognises: ``Unschedulable`` (after a grace period, at once when the
cluster autoscaler says ``NotTriggerScaleUp``), image pull errors (``ErrImagePull``,
``ImagePullBackOff``, ``InvalidImageName``, ...), container configuration errors, ``OOMKilled`` and
other container exits, and pod-level failures such as ``Evicted`` or node shutdown.
:func:`disruption_notice` reads the ``DisruptionTarget`` condition (a drain, a preemption, a spot
node shutting down): those workers are listed by ``expiring()`` for a graceful retirement.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.providers.kubernetes_pods import LABEL_NODE_TYPE, LABEL_REQUEST, workers_of

log = logging.getLogger("tidepool.providers.kubernetes")

#: container waiting reasons that mean the container will not start without a change by someone
PULL_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff")


@dataclass
class PodEvents:
    """The warning events seen about one pod, and every event reason (cluster autoscaler's too)."""

    last_warning: tuple[str, str] | None = None  # (reason, message)
    reasons: set[str] = field(default_factory=set)
    warnings: dict[str, str] = field(default_factory=dict)  # reason -> its latest message


@dataclass
class PodCache:
    """Pods by name and events by pod name, as the watches last reported them (thread-safe reads)."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, PodEvents] = field(default_factory=dict)
    synced: bool = False  # the first pod list arrived
    gone: dict[str, dict[str, Any]] = field(default_factory=dict)  # deleted pods, last state
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replace_pods(self, items: list[dict[str, Any]]) -> None:
        """A fresh list: pods missing from it were deleted while nobody watched."""
        with self.lock:
            new = {p["metadata"]["name"]: p for p in items}
            for name, old in self.pods.items():
                if name not in new:
                    self.gone[name] = old
            self.pods = new
            self.synced = True

    def apply_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod.get("metadata", {}).get("name")
        if not name:
            return
        with self.lock:
            if kind == "DELETED":
                self.pods.pop(name, None)
                self.gone[name] = pod
            elif kind in ("ADDED", "MODIFIED"):
                self.pods[name] = pod
                self.gone.pop(name, None)

    def apply_event(self, ev: Mapping[str, Any]) -> None:
        obj = ev.get("involvedObject") or {}
        if obj.get("kind") != "Pod" or not obj.get("name"):
            return
        with self.lock:
            rec = self.events.setdefault(obj["name"], PodEvents())
            reason = str(ev.get("reason") or "")
            rec.reasons.add(reason)
            if ev.get("type") == "Warning":
                rec.last_warning = (reason, str(ev.get("message") or ""))
                rec.warnings[reason] = rec.last_warning[1]

    def forget(self, names: list[str]) -> None:
        """Drop what is kept about deleted pods once the provider has dealt with them."""
        with self.lock:
            for name in names:
                self.gone.pop(name, None)
                self.events.pop(name, None)

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, PodEvents]]:
        with self.lock:
            return dict(self.pods), dict(self.gone), dict(self.events)


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in (pod.get("status") or {}).get("conditions") or []}


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when the pod is Pending because no node fits it."""
    c = _conditions(pod).get("PodScheduled")
    if c and c.get("status") == "False" and c.get("reason") == "Unschedulable":
        return str(c.get("message") or "no node fits the pod")
    return None


def disruption_notice(pod: Mapping[str, Any]) -> str | None:
    """Why the pod is about to go (``DisruptionTarget``: drain, preemption, node shutdown), if it is."""
    c = _conditions(pod).get("DisruptionTarget")
    if c and c.get("status") == "True":
        return f"{c.get('reason') or 'DisruptionTarget'}: {c.get('message') or ''}".rstrip(": ")
    return None


def container_states(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Container name -> its ``state`` (``waiting`` / ``running`` / ``terminated``)."""
    return {s.get("name", ""): s.get("state") or {} for s in (pod.get("status") or {}).get("containerStatuses") or []}


def pod_ended(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _memory_limit(pod: Mapping[str, Any], container: str) -> str:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == container:
            return str(((c.get("resources") or {}).get("limits") or {}).get("memory", "?"))
    return "?"


def pod_problem(pod: Mapping[str, Any], events: PodEvents | None, unschedulable_for: float,
                grace: float) -> dict[str, str]:  # fmt: skip
    """Container name (``""`` for the whole pod) -> why it will never run a worker (empty: fine)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    warn = f" (last event: {events.last_warning[0]}: {events.last_warning[1]})" if events and events.last_warning else ""
    reason, message = status.get("reason"), status.get("message")
    if status.get("phase") == "Failed" and reason:  # pod level: Evicted, Shutdown, OutOfcpu, ...
        what = "was evicted" if reason == "Evicted" else "failed"
        return {"": f"pod {name} {what} ({reason}): {message or 'no message'}; the worker's tasks are retried "
                    "elsewhere. Evictions come from node pressure or drains: give the node type more "
                    "memory/ephemeral storage requests, or a PodDisruptionBudget"}  # fmt: skip
    why = unschedulable(pod)
    if why is not None:
        seen = events.reasons if events else set()
        if "NotTriggerScaleUp" in seen or ("TriggeredScaleUp" not in seen and unschedulable_for >= grace):
            return {"": f"pod {name} cannot be scheduled (Unschedulable): {why}. No node offers what the "
                        "node type asks for: check its resources (cpu, memory, gpu), node_selector and "
                        f"tolerations against the cluster's nodes (kubectl describe pod {name})"}  # fmt: skip
        return {}
    out: dict[str, str] = {}
    image = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
    for cname, state in container_states(pod).items():
        waiting, done = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason") in PULL_ERRORS:
            pulled = events.warnings.get("Failed") if events else None  # the kubelet's pull error itself
            out[cname] = (f"pod {name} cannot pull image {image.get(cname)!r} ({waiting['reason']}): "
                          f"{pulled or waiting.get('message') or 'no message'}; check the node type's image "
                          "name and tag, and that the cluster may pull it (imagePullSecrets)")  # fmt: skip
        elif waiting and waiting.get("reason") in CONFIG_ERRORS:
            out[cname] = (f"pod {name} cannot start its container ({waiting['reason']}): "
                          f"{waiting.get('message') or 'no message'}{warn}")  # fmt: skip
        elif done and done.get("reason") == "OOMKilled":
            out[cname] = (f"pod {name}: container {cname} was OOMKilled (exit code {done.get('exitCode', 137)}): "
                          f"the worker used more than its memory limit {_memory_limit(pod, cname)}; raise the "
                          "node type's memory or give its tasks less data")  # fmt: skip
        elif done and done.get("exitCode", 0) != 0:
            out[cname] = (f"pod {name}: container {cname} exited with code {done.get('exitCode')} "
                          f"({done.get('reason') or 'Error'}): {done.get('message') or ''}{warn}; see "
                          f"kubectl logs {name} -c {cname}").replace(": ;", ";")  # fmt: skip
    return out


def worker_view(pod: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Worker id -> what ``list()`` says about it (node type, request, pod, phase, alive, exit code)."""
    labels = pod.get("metadata", {}).get("labels") or {}
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    states = container_states(pod)
    out = {}
    for i, wid in enumerate(workers_of(pod)):
        done = states.get(f"worker-{i}", {}).get("terminated")
        rc = done.get("exitCode") if done else None
        out[wid] = {"node_type": labels.get(LABEL_NODE_TYPE), "request_id": labels.get(LABEL_REQUEST),
                    "pod": pod["metadata"]["name"], "phase": phase, "alive": done is None and not pod_ended(pod),
                    "returncode": rc, "state": "starting" if phase == "Pending" else phase.lower()}  # fmt: skip
    return out


async def watch_forever(name: str, list_call: Callable[[], Awaitable[tuple[list[dict[str, Any]], str]]],
                        watch_call: Callable[[str], Any], on_list: Callable[[list[dict[str, Any]]], None],
                        on_event: Callable[[str, dict[str, Any]], None], stopping: Callable[[], bool],
                        retry: float = 1.0) -> None:  # fmt: skip
    """List, then watch from the list's resourceVersion; list again after a 410 or a broken stream.

    ``watch_call(resource_version)`` returns an async-iterable ``kubernetes_asyncio`` watch stream
    (an async context manager) of ``{"type", "raw_object"}`` events.
    """
    from kubernetes_asyncio.client.exceptions import ApiException

    failures = 0
    while not stopping():
        try:
            items, rv = await list_call()
            on_list(items)
            while not stopping():
                stream = watch_call(rv)
                async with stream:
                    async for event in stream:
                        kind, obj = event["type"], event["raw_object"]
                        if kind == "BOOKMARK" or not isinstance(obj, dict):
                            continue
                        on_event(kind, obj)
                        rv = obj.get("metadata", {}).get("resourceVersion") or rv
                        failures = 0
                # the server ended the stream (its timeout): watch on from the last version
        except asyncio.CancelledError:
            raise
        except ApiException as exc:
            if exc.status == 410:
                log.debug("%s watch: resource version too old, listing again", name)
                continue
            failures += 1
            log.warning("%s watch failed (%s %s); listing again", name, exc.status, exc.reason)
        except Exception as exc:  # noqa: BLE001 - the watch must survive a broken connection
            failures += 1
            log.warning("%s watch failed (%s: %s); listing again", name, type(exc).__name__, exc)
        if failures:
            await asyncio.sleep(min(30.0, retry * 2 ** min(failures, 5)) * (0.5 + random.random() / 2))
