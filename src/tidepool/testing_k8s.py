"""KubeEmulator: a small Kubernetes API server for tests, speaking the real JSON and watch protocol.

No API server can be installed where the tests run, so this one serves the part of the core/v1 API
the Kubernetes provider uses, over HTTP (aiohttp), for any real client (``kubernetes_asyncio``,
``kubectl``) pointed at it through a kubeconfig (:meth:`KubeEmulator.write_kubeconfig`):

* ``pods``, ``secrets``, ``services``, ``events``, ``configmaps`` in namespaces:
  create (``POST``, ``409 AlreadyExists``, ``422 Invalid`` names), get, replace (``PUT``), delete
  (``404 NotFound``; pods are deleted gracefully: ``deletionTimestamp``, SIGTERM, then SIGKILL after
  the grace period), list with ``labelSelector`` / ``fieldSelector`` (equality, ``!=``, existence),
  and watch (``?watch=true``: one JSON event per line, from a ``resourceVersion``; a version older
  than the kept history answers an ``ERROR`` event with ``410 Expired``; ``timeoutSeconds`` ends the
  stream; ``BOOKMARK`` events when asked);
* one resource version counter for everything (as etcd), ``metadata.uid`` / ``creationTimestamp``;
  Secrets' ``stringData`` stored as base64 ``data``.

It also plays scheduler and kubelet for pods.  Nodes (:class:`EmuNode`) have a capacity, labels and
taints; a pod is bound to the first node that fits its requests, node selector and tolerations,
else it stays ``Pending`` with ``PodScheduled=False/Unschedulable`` and a ``FailedScheduling``
event in the real wording (``0/2 nodes are available: 2 Insufficient nvidia.com/gpu.``), and is
retried when capacity frees.  A bound pod's containers run as real processes: the container's
``command`` + ``args`` with ``python`` replaced by this interpreter, the environment resolved
(``valueFrom.secretKeyRef`` reads the Secret; a missing one is ``CreateContainerConfigError``) and
a ``TMPDIR`` of the pod's own that goes with the pod (a container's file system), so a pod running
``python -m tidepool.worker ...`` is a real worker and a killed one leaves nothing behind.  Container exits become
``terminated`` states and the pod's phase (``restartPolicy: Never``).

Faults, the way a cluster shows them: images in ``bad_images`` fail to pull (``ErrImagePull``, then
``ImagePullBackOff``); ``faults[<node type label>] = "oomkill" | "evict"`` kills every pod of that
node type when it starts (``OOMKilled``, exit 137; ``Evicted`` by node memory pressure);
:meth:`oomkill`, :meth:`evict` and :meth:`disrupt` (a ``DisruptionTarget`` condition: a spot or
drain notice) act on one running pod; ``quota_pods`` refuses creates over a pod count with the API
server's ``403 exceeded quota`` message; ``answer_delay`` makes pod creates answer late, after the
work; ``watch_lag`` holds watch events back (a lagging watch cache) until :meth:`catch_up`.  ``requests`` records every call (method, path, query).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_KINDS = {"pods": "Pod", "secrets": "Secret", "services": "Service", "events": "Event", "configmaps": "ConfigMap"}
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "K": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "m": 1e-3}  # fmt: skip
_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool, as the API server reads flags
HISTORY = 5000  # watch events kept; an older resourceVersion gets 410 Gone


def parse_quantity(q: Any) -> float:
    """A Kubernetes quantity (``500m``, ``2``, ``1Gi``, ``1e3``) as a number."""
    s = str(q).strip()
    for suf in sorted(_SUFFIX, key=len, reverse=True):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * _SUFFIX[suf]
    return float(s)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, name: str = "", kind: str = "") -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": {"name": name, "kind": kind}, "code": code}  # fmt: skip
    return web.json_response(body, status=code)


def _get_path(obj: Mapping[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def selector_matches(selector: str | None, values: Any) -> bool:
    """``a=b,c!=d,e,!f`` against a mapping (labels) or a callable path -> value (fields)."""
    if not selector:
        return True
    get = values if callable(values) else (lambda k: (values or {}).get(k))
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if str(get(k.strip())) != v.strip():
                return False
        elif term.startswith("!"):
            if get(term[1:].strip()) is not None:
                return False
        elif get(term) is None:
            return False
    return True


@dataclass
class EmuNode:
    """A node: capacity (Kubernetes quantities, e.g. ``{"cpu": "8", "memory": "32Gi",
    "nvidia.com/gpu": "2"}``), labels (for node selectors) and taints (``key``, ``value``, ``effect``)."""

    name: str
    capacity: Mapping[str, str] = field(default_factory=lambda: {"cpu": "64", "memory": "256Gi", "pods": "110"})
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)


@dataclass
class _Watcher:
    plural: str
    namespace: str
    labels: str | None
    fields: str | None
    queue: asyncio.Queue[tuple[int, str, dict[str, Any]]] = field(default_factory=asyncio.Queue)


@dataclass
class _Running:
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)  # container -> process
    oom: set[str] = field(default_factory=set)  # containers killed as OOMKilled
    task: asyncio.Task[None] | None = None


class KubeEmulator:
    """See the module docstring.  Start it in an event loop (``await start()``), or in a thread
    with :func:`run_emulator_in_thread`."""

    def __init__(self, nodes: list[EmuNode] | None = None, *, workdir: str | None = None) -> None:
        self.nodes = nodes or [EmuNode("node-1")]
        self.store: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, ns, name) -> object
        self.rv = 1
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, plural, type, object)
        self.watchers: list[_Watcher] = []
        self.running: dict[str, _Running] = {}  # pod key "ns/name" -> its processes
        self.bad_images: set[str] = set()
        self.faults: dict[str, str] = {}
        self.quota_pods: int | None = None
        self.answer_delay = 0.0  # seconds a create waits *after* doing the work (a slow or lost answer)
        self.watch_lag = False  # True: watch events wait (a lagging watch cache) until it is False again
        self._held: list[tuple[_Watcher, tuple[int, str, dict[str, Any]]]] = []
        self.requests: list[tuple[str, str, str]] = []
        self.expired_watches = 0  # watches answered 410 Gone (their resourceVersion was too old)
        self._own_workdir = workdir is None  # made here: removed by stop()
        self.workdir = workdir or tempfile.mkdtemp(prefix="tidepool-kube-")
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._stopping = False

    # ---- server ------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> KubeEmulator:
        app = web.Application()
        app.router.add_get("/version", self._version)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{plural}", self._collection)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{plural}/{name}", self._item)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self._stopping = True
        for w in self.watchers:
            w.queue.put_nowait((0, "", {}))  # wakes the stream to end it
        for key in list(self.running):
            await self._kill_all(key, signal.SIGKILL)
        if self._bg:  # the kubelets see their processes end and finish
            await asyncio.wait(list(self._bg), timeout=5)
        for t in list(self._bg):
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for (p, ns, name) in list(self.store):
            if p == "pods":
                shutil.rmtree(self._pod_tmp(ns, name), ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def write_kubeconfig(self, path: str, namespace: str = "default") -> str:
        """A kubeconfig pointing at this server (plain HTTP, a static token)."""
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                           "namespace": namespace}}],
        }  # fmt: skip
        with open(path, "w") as f:
            json.dump(cfg, f)  # JSON is YAML
        return path

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-tidepool-emulator"})

    # ---- storage and watch events ------------------------------------------------------------
    def objects(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored objects of a kind (for tests)."""
        return [copy.deepcopy(o) for (p, ns, _), o in sorted(self.store.items()) if p == plural
                and (namespace is None or ns == namespace)]  # fmt: skip

    def history_objects(self, plural: str) -> list[dict[str, Any]]:
        """Every version of every object of a kind that the watch history still holds (for tests)."""
        return [copy.deepcopy(o) for _, p, _, o in self.history if p == plural]

    def _emit(self, plural: str, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        snap = copy.deepcopy(obj)
        self.history.append((self.rv, plural, kind, snap))
        del self.history[:-HISTORY]
        for w in self.watchers:
            if self._matches(w.plural, w.namespace, w.labels, w.fields, plural, snap):
                self._held.append((w, (self.rv, kind, snap)))
        if not self.watch_lag:
            self.catch_up()

    def catch_up(self) -> None:
        """Send the watch events held while ``watch_lag`` was on."""
        self.watch_lag = False
        held, self._held = self._held, []
        for w, item in held:
            w.queue.put_nowait(item)

    @staticmethod
    def _matches(wplural: str, wns: str, labels: str | None, fields: str | None, plural: str,
                 obj: Mapping[str, Any]) -> bool:  # fmt: skip
        return (wplural == plural and obj["metadata"].get("namespace") == wns
                and selector_matches(labels, obj["metadata"].get("labels") or {})
                and selector_matches(fields, lambda k: _get_path(obj, k)))  # fmt: skip

    def _put(self, plural: str, obj: dict[str, Any], kind: str = "MODIFIED") -> None:
        md = obj["metadata"]
        self.store[(plural, md["namespace"], md["name"])] = obj
        self._emit(plural, kind, obj)

    def _remove(self, plural: str, ns: str, name: str) -> None:
        obj = self.store.pop((plural, ns, name), None)
        if obj is not None:
            self._emit(plural, "DELETED", obj)
        if plural == "pods":  # a container's file system goes with its pod
            shutil.rmtree(self._pod_tmp(ns, name), ignore_errors=True)

    def _pod_tmp(self, ns: str, name: str) -> str:
        return os.path.join(self.workdir, f"{ns}_{name}.tmp")

    def event(self, pod: Mapping[str, Any], reason: str, message: str, type_: str = "Normal",
              component: str = "kubelet") -> None:  # fmt: skip
        """Record an Event about ``pod``, as the scheduler or kubelet would."""
        md = pod["metadata"]
        name = f"{md['name']}.{uuid.uuid4().hex[:12]}"
        t = now_iso()
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"name": name, "namespace": md["namespace"], "uid": str(uuid.uuid4()), "creationTimestamp": t},
              "involvedObject": {"kind": "Pod", "name": md["name"], "namespace": md["namespace"], "uid": md.get("uid"),
                                 "apiVersion": "v1"},
              "reason": reason, "message": message, "type": type_, "count": 1, "firstTimestamp": t,
              "lastTimestamp": t, "source": {"component": component}}  # fmt: skip
        self._put("events", ev, "ADDED")

    # ---- HTTP handlers -------------------------------------------------------------------------
    async def _collection(self, request: web.Request) -> web.StreamResponse:
        ns, plural = request.match_info["ns"], request.match_info["plural"]
        self.requests.append((request.method, request.path, request.query_string))
        if plural not in _KINDS:
            return _status(404, "NotFound", f"the server could not find the requested resource ({plural})")
        if request.method == "GET":
            if request.query.get("watch") in _TRUE:
                return await self._watch(request, ns, plural)
            items = [copy.deepcopy(o) for (p, n, _), o in sorted(self.store.items())
                     if p == plural and n == ns and self._matches(plural, ns, request.query.get("labelSelector"),
                                                                  request.query.get("fieldSelector"), plural, o)]  # fmt: skip
            return web.json_response({"kind": f"{_KINDS[plural]}List", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})  # fmt: skip
        if request.method == "POST":
            return await self._create(ns, plural, await request.json())
        return _status(405, "MethodNotAllowed", f"{request.method} is not supported on {plural}")

    async def _item(self, request: web.Request) -> web.StreamResponse:
        ns, plural, name = request.match_info["ns"], request.match_info["plural"], request.match_info["name"]
        self.requests.append((request.method, request.path, request.query_string))
        obj = self.store.get((plural, ns, name))
        if plural not in _KINDS or obj is None:
            return _status(404, "NotFound", f'{plural} "{name}" not found', name, plural)
        if request.method == "GET":
            return web.json_response(obj)
        if request.method == "PUT":
            body = await request.json()
            body.setdefault("metadata", {}).update(namespace=ns, name=name, uid=obj["metadata"]["uid"],
                                                   creationTimestamp=obj["metadata"]["creationTimestamp"])  # fmt: skip
            self._normalise(plural, body)
            self._put(plural, body)
            return web.json_response(body)
        if request.method == "DELETE":
            grace = request.query.get("gracePeriodSeconds")
            if request.can_read_body:
                with contextlib.suppress(Exception):
                    opts = await request.json()
                    if isinstance(opts, dict) and opts.get("gracePeriodSeconds") is not None:
                        grace = opts["gracePeriodSeconds"]
            if plural == "pods":
                return web.json_response(self.delete_pod(ns, name, None if grace is None else int(grace)))
            self._remove(plural, ns, name)
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": {"name": name, "kind": plural, "uid": obj["metadata"]["uid"]}})  # fmt: skip
        return _status(405, "MethodNotAllowed", f"{request.method} is not supported")

    def _normalise(self, plural: str, body: dict[str, Any]) -> None:
        body["kind"], body["apiVersion"] = _KINDS[plural], "v1"
        if plural == "secrets" and body.get("stringData"):
            data = dict(body.get("data") or {})
            data.update({k: base64.b64encode(str(v).encode()).decode() for k, v in body.pop("stringData").items()})
            body["data"] = data

    async def _create(self, ns: str, plural: str, body: dict[str, Any]) -> web.Response:
        md = body.setdefault("metadata", {})
        name = md.get("name") or ""
        if not name and md.get("generateName"):
            name = md["name"] = f"{md['generateName']}{uuid.uuid4().hex[:5]}"
        if not _NAME.fullmatch(name) or len(name) > 253:
            return _status(422, "Invalid", f'{_KINDS[plural]} "{name}" is invalid: metadata.name: Invalid value: '
                                           f'"{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                                           "alphanumeric characters, '-' or '.'", name, plural)  # fmt: skip
        if (plural, ns, name) in self.store:
            return _status(409, "AlreadyExists", f'{plural} "{name}" already exists', name, plural)
        if plural == "pods":
            if not (body.get("spec") or {}).get("containers"):
                return _status(422, "Invalid", f'Pod "{name}" is invalid: spec.containers: Required value', name, plural)
            live = sum(1 for (p, n, _) in self.store if p == "pods" and n == ns)
            if self.quota_pods is not None and live >= self.quota_pods:
                return _status(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: pod-quota, requested: '
                                                 f"pods=1, used: pods={live}, limited: pods={self.quota_pods}", name, plural)  # fmt: skip
        md.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now_iso())
        self._normalise(plural, body)
        if plural == "pods":
            body["status"] = {"phase": "Pending", "conditions": [], "qosClass": "Guaranteed"}
        self._put(plural, body, "ADDED")
        if plural == "pods":
            self._schedule_pending()
        if self.answer_delay and plural == "pods":
            await asyncio.sleep(self.answer_delay)
        return web.json_response(body, status=201)

    async def _watch(self, request: web.Request, ns: str, plural: str) -> web.StreamResponse:
        labels, fields = request.query.get("labelSelector"), request.query.get("fieldSelector")
        rv_text = request.query.get("resourceVersion", "")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        bookmarks = request.query.get("allowWatchBookmarks") in _TRUE
        w = _Watcher(plural, ns, labels, fields)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        # what to send first, computed with no await in between, so no event falls in a gap
        first: list[tuple[int, str, dict[str, Any]]] = []
        if rv_text in ("", "0"):
            first = [(int(o["metadata"]["resourceVersion"]), "ADDED", copy.deepcopy(o))
                     for (p, n, _), o in sorted(self.store.items()) if self._matches(plural, ns, labels, fields, p, o)
                     and n == ns]  # fmt: skip
        else:
            since = int(rv_text)
            oldest = self.history[0][0] if self.history else self.rv
            if since < oldest - 1:
                gone = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
                        "reason": "Expired", "message": f"too old resource version: {since} ({oldest})"}  # fmt: skip
                self.expired_watches += 1
                await resp.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
                return resp
            first = [(rv, kind, o) for rv, p, kind, o in self.history
                     if rv > since and self._matches(plural, ns, labels, fields, p, o)]  # fmt: skip
        self.watchers.append(w)
        try:
            sent = 0
            for rv, kind, obj in first:
                await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
                sent = max(sent, rv)
            deadline = asyncio.get_running_loop().time() + timeout
            while not self._stopping:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    rv, kind, obj = await asyncio.wait_for(w.queue.get(), min(left, 5.0))
                except TimeoutError:
                    if bookmarks:
                        mark = {"kind": _KINDS[plural], "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}}
                        await resp.write((json.dumps({"type": "BOOKMARK", "object": mark}) + "\n").encode())
                    continue
                if not kind or rv <= sent:
                    continue
                await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.watchers.remove(w)
        with contextlib.suppress(Exception):
            await resp.write_eof()
        return resp

    # ---- the scheduler -------------------------------------------------------------------------
    @staticmethod
    def _requests_of(pod: Mapping[str, Any]) -> dict[str, float]:
        need: dict[str, float] = {"pods": 1}
        for c in pod["spec"].get("containers") or []:
            res = c.get("resources") or {}
            for k, v in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
                need[k] = need.get(k, 0.0) + parse_quantity(v)
        return need

    def _used(self, node: str) -> dict[str, float]:
        used: dict[str, float] = {}
        for (p, _, _), o in self.store.items():
            if p == "pods" and o["spec"].get("nodeName") == node and o["status"].get("phase") in ("Pending", "Running"):
                for k, v in self._requests_of(o).items():
                    used[k] = used.get(k, 0.0) + v
        return used

    def _schedule_pending(self) -> None:
        for (p, _, _), pod in sorted(self.store.items(), key=lambda kv: kv[1]["metadata"]["creationTimestamp"]):
            if p == "pods" and not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self._try_bind(pod)

    def _try_bind(self, pod: dict[str, Any]) -> None:
        need = self._requests_of(pod)
        selector = pod["spec"].get("nodeSelector") or {}
        tolerations = pod["spec"].get("tolerations") or []
        why: dict[str, int] = {}
        for node in self.nodes:
            if any(node.labels.get(k) != v for k, v in selector.items()):
                why["node(s) didn't match Pod's node affinity/selector"] = why.get("node(s) didn't match Pod's node affinity/selector", 0) + 1
                continue
            bad = [t for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")
                   and not any(tol.get("key") == t.get("key") and (tol.get("operator") == "Exists"
                                                                     or tol.get("value") == t.get("value"))
                               for tol in tolerations)]  # fmt: skip
            if bad:
                text = f"node(s) had untolerated taint {{{bad[0]['key']}: {bad[0].get('value', '')}}}"
                why[text] = why.get(text, 0) + 1
                continue
            used = self._used(node.name)
            short = [k for k, v in need.items() if used.get(k, 0.0) + v > parse_quantity(node.capacity.get(k, "0")) + 1e-9]
            if short:
                for k in short:
                    why[f"Insufficient {k}"] = why.get(f"Insufficient {k}", 0) + 1
                continue
            pod["spec"]["nodeName"] = node.name
            self._set_condition(pod, "PodScheduled", "True")
            self._put("pods", pod)
            self.event(pod, "Scheduled", f"Successfully assigned {pod['metadata']['namespace']}/"
                                         f"{pod['metadata']['name']} to {node.name}", component="default-scheduler")  # fmt: skip
            self._spawn(self._kubelet(pod["metadata"]["namespace"], pod["metadata"]["name"]))
            return
        message = (f"0/{len(self.nodes)} nodes are available: "
                   + ", ".join(f"{n} {text}" for text, n in sorted(why.items())) + ".")  # fmt: skip
        cond = self._condition(pod, "PodScheduled")
        if cond is None or cond.get("message") != message:
            self._set_condition(pod, "PodScheduled", "False", "Unschedulable", message)
            self._put("pods", pod)
            self.event(pod, "FailedScheduling", message, "Warning", "default-scheduler")

    @staticmethod
    def _condition(pod: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
        return next((c for c in pod["status"].get("conditions") or [] if c["type"] == type_), None)

    def _set_condition(self, pod: dict[str, Any], type_: str, status: str, reason: str | None = None,
                       message: str | None = None) -> None:  # fmt: skip
        conds = pod["status"].setdefault("conditions", [])
        conds[:] = [c for c in conds if c["type"] != type_]
        c: dict[str, Any] = {"type": type_, "status": status, "lastTransitionTime": now_iso()}
        if reason:
            c["reason"] = reason
        if message:
            c["message"] = message
        conds.append(c)

    # ---- the kubelet ---------------------------------------------------------------------------
    def _pod(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.store.get(("pods", ns, name))

    @staticmethod
    def _cstatus(c: Mapping[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
        return {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": ready, "restartCount": 0,
                "started": "running" in state, "state": state}  # fmt: skip

    def _env(self, ns: str, c: Mapping[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME", "LANG")}
        env["TMPDIR"] = self._pod_tmp(ns, c.get("_pod", ""))
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None:
                secret = self.store.get(("secrets", ns, ref["name"]))
                if secret is None or ref["key"] not in (secret.get("data") or {}):
                    raise LookupError(f'secret "{ref["name"]}" not found' if secret is None
                                      else f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")  # fmt: skip
                env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            else:
                env[e["name"]] = str(e.get("value", ""))
        return env

    async def _kubelet(self, ns: str, name: str) -> None:
        pod = self._pod(ns, name)
        if pod is None:
            return
        containers = pod["spec"]["containers"]
        bad = [c for c in containers if c.get("image") in self.bad_images]
        if bad:  # the pull fails, then backs off: the pod stays Pending
            img = bad[0]["image"]
            msg = (f'failed to pull and unpack image "{img}": failed to resolve reference "{img}": '
                   f"{img.rpartition(':')[0] or img}: not found")  # fmt: skip
            pod["status"]["containerStatuses"] = [self._cstatus(c, {"waiting": {"reason": "ErrImagePull", "message": msg}})
                                                  for c in containers]  # fmt: skip
            self._put("pods", pod)
            self.event(pod, "Failed", f'Failed to pull image "{img}": {msg}', "Warning")
            await asyncio.sleep(0.2)
            pod = self._pod(ns, name)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                back = f'Back-off pulling image "{img}"'
                pod["status"]["containerStatuses"] = [self._cstatus(c, {"waiting": {"reason": "ImagePullBackOff",
                                                                                    "message": back}}) for c in containers]  # fmt: skip
                self._put("pods", pod)
                self.event(pod, "BackOff", back, "Warning")
            return
        try:
            envs = [self._env(ns, {**c, "_pod": name}) for c in containers]
        except LookupError as exc:
            pod["status"]["containerStatuses"] = [self._cstatus(c, {"waiting": {"reason": "CreateContainerConfigError",
                                                                                "message": str(exc)}}) for c in containers]  # fmt: skip
            self._put("pods", pod)
            self.event(pod, "Failed", f"Error: {exc}", "Warning")
            return
        os.makedirs(self._pod_tmp(ns, name), exist_ok=True)  # the container's own /tmp
        run = self.running.setdefault(f"{ns}/{name}", _Running())
        logs = open(os.path.join(self.workdir, f"{ns}_{name}.log"), "ab")  # noqa: SIM115 - closed below
        try:
            for c, env in zip(containers, envs, strict=True):
                argv = [*(c.get("command") or []), *(c.get("args") or [])]
                if argv and os.path.basename(argv[0]) in ("python", "python3"):
                    argv[0] = sys.executable
                run.procs[c["name"]] = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=logs, stderr=logs,
                    cwd=self.workdir, start_new_session=True)  # fmt: skip
        finally:
            logs.close()
        started = now_iso()
        pod["status"].update(phase="Running", startTime=started, podIP="127.0.0.1", hostIP="127.0.0.1")
        pod["status"]["containerStatuses"] = [self._cstatus(c, {"running": {"startedAt": started}}, True)
                                              for c in containers]  # fmt: skip
        self._set_condition(pod, "Ready", "True")
        self._put("pods", pod)
        for c in containers:
            self.event(pod, "Started", f"Started container {c['name']}")
        fault = self.faults.get((pod["metadata"].get("labels") or {}).get("tidepool.io/node-type", ""))
        if fault == "oomkill":
            await self.oomkill(name, ns)
        elif fault == "evict":
            await self.evict(name, ns=ns)
        await self._reap(ns, name, run, started)

    async def _reap(self, ns: str, name: str, run: _Running, started: str) -> None:
        """Wait for the containers to exit; record how; end the pod (and remove it if deleted)."""
        codes = await asyncio.gather(*(p.wait() for p in run.procs.values()))
        self.running.pop(f"{ns}/{name}", None)
        pod = self._pod(ns, name)
        if pod is None:
            return
        finished = now_iso()
        states = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}
        for cname, rc in zip(run.procs, codes, strict=True):
            code = 128 - rc if rc < 0 else rc  # killed by a signal: 128 + signal, as a container runtime says
            reason = "OOMKilled" if cname in run.oom else ("Completed" if code == 0 else "Error")
            st = states.get(cname)
            if st is not None:
                st.update(ready=False, started=False, state={"terminated": {"exitCode": code, "reason": reason,
                                                                           "startedAt": started, "finishedAt": finished}})  # fmt: skip
        if pod["status"].get("phase") != "Failed":  # an eviction set it already
            ok = all((rc == 0) for rc in codes) and not run.oom
            pod["status"]["phase"] = "Succeeded" if ok else "Failed"
        self._set_condition(pod, "Ready", "False")
        if pod["metadata"].get("deletionTimestamp"):
            self._remove("pods", ns, name)
        else:
            self._put("pods", pod)
        self._schedule_pending()

    async def _kill_all(self, key: str, sig: int) -> None:
        run = self.running.get(key)
        for p in (run.procs.values() if run else ()):
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    # ---- deletion and faults -----------------------------------------------------------------
    def delete_pod(self, ns: str, name: str, grace: int | None = None) -> dict[str, Any]:
        pod = self._pod(ns, name)
        if pod is None:
            return {}
        grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace)
        key = f"{ns}/{name}"
        if key not in self.running or pod["metadata"].get("deletionTimestamp"):
            if key not in self.running:
                self._remove("pods", ns, name)
                self._schedule_pending()
            return pod
        pod["metadata"].update(deletionTimestamp=now_iso(), deletionGracePeriodSeconds=grace)
        self._put("pods", pod)
        self._spawn(self._terminate(key, grace))
        return pod

    async def _terminate(self, key: str, grace: int) -> None:
        await self._kill_all(key, signal.SIGTERM)
        run = self.running.get(key)
        if run is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in run.procs.values())), max(0.1, grace))
        await self._kill_all(key, signal.SIGKILL)

    async def oomkill(self, name: str, ns: str = "default", container: str | None = None) -> None:
        """The kernel's OOM killer ends a container (SIGKILL; the runtime reports ``OOMKilled``)."""
        run = self.running.get(f"{ns}/{name}")
        if run is None:
            raise LookupError(f"pod {ns}/{name} has no running containers")
        for cname, p in run.procs.items():
            if container in (None, cname) and p.returncode is None:
                run.oom.add(cname)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        pod = self._pod(ns, name)
        if pod is not None:
            self.event(pod, "OOMKilling", f"Memory cgroup out of memory: Killed process of {name}", "Warning", "kernel-monitor")

    async def evict(self, name: str, message: str = "", ns: str = "default") -> None:
        """The kubelet evicts the pod under node memory pressure: phase Failed, reason Evicted."""
        pod = self._pod(ns, name)
        if pod is None:
            raise LookupError(f"no pod {ns}/{name}")
        message = message or ("The node was low on resource: memory. Threshold quantity: 100Mi, available: 61Mi. "
                              f"Container {pod['spec']['containers'][0]['name']} was using 1432Mi, request is 512Mi, "
                              "has larger consumption of memory.")  # fmt: skip
        self._set_condition(pod, "DisruptionTarget", "True", "TerminationByKubelet", "The node was low on resource: memory.")
        pod["status"].update(phase="Failed", reason="Evicted", message=message)
        self._put("pods", pod)
        self.event(pod, "Evicted", message, "Warning")
        await self._kill_all(f"{ns}/{name}", signal.SIGKILL)

    def disrupt(self, name: str, reason: str = "PreemptionByScheduler", message: str = "", ns: str = "default") -> None:
        """A ``DisruptionTarget`` condition: the pod will go soon (a drain, a preemption, a spot notice)."""
        pod = self._pod(ns, name)
        if pod is None:
            raise LookupError(f"no pod {ns}/{name}")
        self._set_condition(pod, "DisruptionTarget", "True", reason, message or "the node is being preempted")
        self._put("pods", pod)


class EmulatorThread:
    """A :class:`KubeEmulator` serving from its own event loop thread (for synchronous tests).
    ``call(fn, *args)`` runs a function or coroutine function on that loop and returns its result."""

    def __init__(self, emulator: KubeEmulator) -> None:
        from tidepool.loop import LoopThread

        self.emulator = emulator
        self._lt = LoopThread("tidepool-kube-emulator")
        self._lt.run(emulator.start(), timeout=10)

    def call(self, fn: Any, *args: Any, timeout: float = 10.0) -> Any:
        async def run() -> Any:
            out = fn(*args)
            return await out if asyncio.iscoroutine(out) else out

        return self._lt.run(run(), timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._lt.run(self.emulator.stop(), timeout=15)
        self._lt.stop()
