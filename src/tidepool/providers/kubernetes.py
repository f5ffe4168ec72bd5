"""KubernetesProvider: worker pods that come and go, through the Kubernetes API (kubernetes_asyncio).

Place in the data flow: the scaling controller asks for ``count`` nodes of a node type; this
provider creates one pod per node (one container per worker, see ``kubernetes_pods.py``), named
after its first worker id and labelled with the cluster, node type, request and worker, so a second
create of the same request answers ``409 AlreadyExists``, which counts as success.  The workers dial
the scheduler back (the address it gives, or ``scheduler_service``, a Service in front of a
scheduler that runs in the cluster), and authenticate with the token from a Secret the provider
creates before its first pod and deletes on ``close``: the pod spec names the Secret, never the value.

Where the state lives: on one asyncio event loop, the first that awaits the provider (the
scheduler's, through the :class:`~tidepool.providers.base.AsyncProvider` coroutines the
autoscaler prefers; no thread), like the SSH provider.  The API client, the watches and the
creation tasks belong to that loop; a synchronous call from a plain thread hands its work to that
loop, and a caller without any loop gets a private loop thread (``tidepool-kubernetes``).

- ``launch`` queues the pod creations as a task and returns at once.  A request that fails as a
  whole (no API server, RBAC refusal, quota, invalid spec) comes back once through
  ``poll_errors`` as a failed launch with the API's message; a pod that failed comes back as a
  failure of its workers.
- Two watches (``kubernetes_watch.py``) keep a cache of this cluster's pods and of the events about
  them: ``list()`` and ``poll_errors()`` read it and make no API call.  ``poll_errors`` turns what
  the cache shows into one :class:`~tidepool.providers.base.ProviderFailure` per worker, with the
  Kubernetes reason (``Unschedulable``, image pull errors, ``OOMKilled``, ``Evicted``, ...), and
  deletes the failed pods (``keep_failed_pods=True`` keeps them for ``kubectl describe``).
- ``expiring()`` lists workers whose pod carries a ``DisruptionTarget`` condition or is being
  deleted by someone else (a drain, preemption, a spot node's shutdown): the autoscaler retires them
  gracefully while their grace period runs.
- ``terminate`` deletes pods (``gracePeriodSeconds``: the kubelet sends SIGTERM, the worker closes);
  a pod already gone is success.  A pod with several workers is deleted once all of them are
  terminated.  ``close`` deletes every pod it created and the Secret.  With ``owner_pod`` (default:
  ``$TIDEPOOL_POD_NAME``, set in the documented scheduler manifest) every pod and the Secret carry
  an ownerReference to the scheduler's pod, so the garbage collector removes them if the scheduler
  dies without closing.

Across scheduler restarts (``tag_with``, which a durable scheduler calls with a hash of its token,
the cluster id unless ``cluster_id`` was given): instead of deleting the pods with its cluster label
found at the start as left-overs, the provider takes the live ones over (``_created``, its cache)
before its first listing returns, so a restarted scheduler's autoscaler adopts their workers, and
terminates and closes them like its own.

API calls (``kubernetes_api.py``) have a timeout (``request_timeout``); throttling and server
errors (429, 5xx) are retried with jittered backoff for up to ``retry_for`` seconds, then reported
with the API server's message and what to do.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from tidepool.errors import ConfigError, ProviderError
from tidepool.providers._address import contact_address
from tidepool.providers.base import IdNames, ProviderFailure, worker_command
from tidepool.providers.kubernetes_api import api_message, call_api, hint, kube, load_configuration
from tidepool.providers.kubernetes_pods import (
    LABEL_CLUSTER,
    LABEL_REQUEST,
    PodTemplate,
    dns_name,
    label_value,
    pod_manifest,
    secret_manifest,
    secret_name,
    workers_of,
)
from tidepool.providers.kubernetes_watch import (
    PodCache,
    disruption_notice,
    pod_ended,
    pod_problem,
    unschedulable,
    watch_forever,
    worker_view,
)
from tidepool.scaling.node_types import NodeType

if TYPE_CHECKING:
    from tidepool.loop import LoopThread

log = logging.getLogger("tidepool.providers.kubernetes")
T = TypeVar("T")
def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None



class KubernetesProvider:
    """Start tidepool workers as pods in ``namespace``; see the module docstring for how and why.

    Every node type gets a :class:`PodTemplate`: ``templates[name]`` if given, else the provider's
    defaults (``image``, ``python``, ``node_selector``, ``tolerations``, ``service_account``,
    ``priority_class``, ``image_pull_policy``, ``env``) with the node type's ``options`` applied
    (the cluster TOML's way).  The API is reached through ``kubeconfig``/``context`` (default:
    ``$KUBECONFIG`` or ``~/.kube/config``), or the pod's service account when the scheduler runs in
    the cluster (``in_cluster``; default: when ``$KUBERNETES_SERVICE_HOST`` is set and no
    kubeconfig is given).  ``cluster_id`` labels everything this provider creates (default: a new
    random id; give a fixed one so an operator can find the pods, and only one running scheduler per
    id: pods with that label found before the first launch are deleted as left-overs, unless
    :meth:`tag_with` made it a durable scheduler's provider: then they are taken over).  Workers dial
    ``scheduler_service`` (``name`` or ``name:port``, resolved as ``name.<namespace>.svc``) if
    given, else the scheduler's address with ``scheduler_host`` as its host.
    """

    def __init__(self, namespace: str = "default", image: str = "tidepool:latest", *,
                 templates: Mapping[str, PodTemplate] | None = None, python: str = "python",
                 node_selector: dict[str, str] | None = None, tolerations: list[dict[str, Any]] | None = None,
                 service_account: str | None = None, priority_class: str | None = None,
                 image_pull_policy: str | None = None, env: dict[str, str] | None = None,
                 cluster_id: str | None = None, kubeconfig: str | None = None, context: str | None = None,
                 in_cluster: bool | None = None, scheduler: str = "", token: str = "",
                 scheduler_host: str | None = None, scheduler_service: str | None = None,
                 owner_pod: str | None = None, unschedulable_grace: float = 60.0,
                 request_timeout: float = 10.0, retry_for: float = 20.0, terminate_grace: int = 30,
                 watch_timeout: int = 300, heartbeat_interval: float = 1.0,
                 extra_args: list[str] | None = None, keep_failed_pods: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not isinstance(namespace, str) or dns_name(namespace) != namespace:
            raise ConfigError(f"KubernetesProvider: namespace must be a DNS label like 'tidepool', got {namespace!r}")
        if cluster_id is not None and (not isinstance(cluster_id, str) or dns_name(cluster_id, 40) != cluster_id):
            raise ConfigError("KubernetesProvider: cluster_id must be lowercase letters, digits and '-' "
                              f"(at most 40), got {cluster_id!r}")  # fmt: skip
        if request_timeout <= 0 or watch_timeout < 1:
            raise ConfigError("KubernetesProvider: request_timeout must be > 0 and watch_timeout >= 1")
        self.namespace = namespace
        self.default_template = PodTemplate(image=image, python=python, node_selector=dict(node_selector or {}),
                                            tolerations=tuple(tolerations or ()), service_account=service_account,
                                            priority_class=priority_class, image_pull_policy=image_pull_policy)  # fmt: skip
        self.templates = dict(templates or {})
        for name, t in self.templates.items():
            if not isinstance(t, PodTemplate):
                raise ConfigError(f"KubernetesProvider: templates[{name!r}] must be a PodTemplate, got {t!r}")
        self.env = dict(env or {})  # a dict: the cluster file adds the TLS variables here
        self.cluster_id = cluster_id or f"tp{secrets.token_hex(4)}"
        self._fixed_id = cluster_id is not None
        self.adopting = False  # tag_with(): take over an earlier scheduler process's pods, not delete them
        self.kubeconfig, self.context, self.in_cluster = kubeconfig, context, in_cluster
        self.scheduler, self.token = scheduler, token
        self.scheduler_host, self.scheduler_service = scheduler_host, scheduler_service
        self.owner_pod = owner_pod if owner_pod is not None else os.environ.get("TIDEPOOL_POD_NAME")
        self.unschedulable_grace = float(unschedulable_grace)
        self.request_timeout, self.retry_for = float(request_timeout), float(retry_for)
        self.terminate_grace, self.watch_timeout = int(terminate_grace), int(watch_timeout)
        self.heartbeat_interval = heartbeat_interval
        self.extra_args = list(extra_args or [])
        self.keep_failed_pods = keep_failed_pods
        self.clock = clock
        self.cache = PodCache()
        # worker ids carry a per-provider suffix: a later scheduler with the same cluster_id never
        # names a pod like one an earlier one left behind (a 409 for that pod would count as created)
        self._names = IdNames(f"-{secrets.token_hex(2)}")
        self._lock = threading.RLock()  # guards the bookkeeping below (sync calls come from threads)
        self._requests: dict[str, builtins.list[str]] = {}  # request -> worker ids (launch accepted)
        self._creating: set[str] = set()  # requests whose pods are being created
        self._created: dict[str, tuple[str, builtins.list[str]]] = {}  # pod -> (request, workers)
        self._deleting: set[str] = set()  # pods this provider deletes (not failures)
        self._terminated: set[str] = set()  # workers asked to stop
        self._reported: set[str] = set()  # workers whose failure was reported
        self._unsched_since: dict[str, float] = {}
        self._errors: builtins.list[ProviderFailure] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: LoopThread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watches: builtins.list[asyncio.Task[None]] = []
        self._start_lock: asyncio.Lock | None = None
        self._api: Any = None
        self._core: Any = None
        self._owner: dict[str, Any] | None = None
        self._closed = False
        kube()  # fail at construction, not at the first launch, when the client is missing

    # ---- across scheduler restarts -----------------------------------------------------------------
    def tag_with(self, tag: str) -> None:
        """A durable scheduler's provider: the pods with its cluster label found at the start (left
        by the provider of an earlier scheduler process of the same cluster) are taken over --
        listed, terminated and closed like this provider's own -- instead of deleted, so the
        autoscaler adopts their workers.  ``tag`` (stable across restarts: a hash of the token,
        :func:`~tidepool.providers.slurm.cluster_tag`) is the cluster id when none was given."""
        if dns_name(tag, 40) != tag:
            raise ConfigError(f"KubernetesProvider tag must be lowercase letters, digits and '-', got {tag!r}")
        with self._lock:
            if self._watches or self._api is not None:
                raise ProviderError("KubernetesProvider.tag_with must be called before the provider starts")
            if not self._fixed_id:
                self.cluster_id = tag
            self.adopting = True

    # ---- the owning loop --------------------------------------------------------------------------
    def bind(self, scheduler: str, token: str) -> None:
        """Called by the cluster once the scheduler's address and token are known."""
        self.scheduler, self.token = scheduler, token

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                from tidepool.loop import LoopThread

                self._loop_thread = LoopThread("tidepool-kubernetes")
                self._loop = self._loop_thread.loop
            return self._loop

    def _bind_running(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is None:
                self._loop = loop
            if self._loop is not loop:
                raise ProviderError("this KubernetesProvider is bound to another event loop (the first that used "
                                    "it); its API client and watches live there: use it from that loop, or its "
                                    "synchronous methods from plain threads")  # fmt: skip

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Start ``coro`` on the owning loop without waiting (from it, or from another thread)."""
        loop = self._ensure_loop()
        if _running_loop() is loop:
            self._spawn(coro)
            return True
        try:
            loop.call_soon_threadsafe(self._spawn, coro)
            return True
        except RuntimeError:  # the loop is closed
            coro.close()
            return False

    def _wait(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the owning loop from another thread and wait for it."""
        loop = self._ensure_loop()
        if loop.is_closed() or not loop.is_running():
            coro.close()
            raise ProviderError("this KubernetesProvider's event loop is not running; await the *_async "
                                "methods inside the loop that owns it")  # fmt: skip
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ProviderError(f"a Kubernetes API call did not finish within {timeout:g}s") from None

    # ---- API plumbing ---------------------------------------------------------------------------
    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await call_api(fn, *args, request_timeout=self.request_timeout, retry_for=self.retry_for, **kwargs)

    async def _start(self) -> None:
        """Connect, create the token Secret and start the watches (once; retried after a failure)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._watches:
                return
            if self._closed:
                raise ProviderError("this KubernetesProvider is closed; create a new one")
            if not self.scheduler or not self.token:
                raise ProviderError("KubernetesProvider has no scheduler address/token; call bind(address, token) "
                                    "or use cluster.adapt(provider=...)")  # fmt: skip
            k = kube()
            if self._api is None:
                cfg = await load_configuration(self.kubeconfig, self.context, self.in_cluster)
                self._api = k.client.ApiClient(configuration=cfg)
                self._core = k.client.CoreV1Api(self._api)
            core = self._core
            if self.owner_pod and self._owner is None:
                try:
                    me = await self._call(core.read_namespaced_pod, self.owner_pod, self.namespace)
                except Exception as exc:  # noqa: BLE001 - reported with what to do
                    raise ProviderError(f"cannot read the scheduler's own pod {self.owner_pod!r} (owner_pod): "
                                        f"{api_message(exc)}{hint(exc, 'get pods', self.namespace)}") from exc  # fmt: skip
                self._owner = {"apiVersion": "v1", "kind": "Pod", "name": me.metadata.name, "uid": me.metadata.uid,
                               "blockOwnerDeletion": False, "controller": False}  # fmt: skip
            body = secret_manifest(self.cluster_id, self.token, self._owner)
            try:
                await self._call(core.create_namespaced_secret, self.namespace, body)
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise ProviderError(f"cannot create the token Secret {body['metadata']['name']!r}: "
                                        f"{api_message(exc)}{hint(exc, 'create secrets', self.namespace)}") from exc  # fmt: skip
                try:  # left by an earlier scheduler with this cluster id: it gets our token
                    await self._call(core.replace_namespaced_secret, body["metadata"]["name"], self.namespace, body)
                except Exception as exc2:
                    raise ProviderError(f"cannot update the token Secret {body['metadata']['name']!r}: "
                                        f"{api_message(exc2)}{hint(exc2, 'update secrets', self.namespace)}") from exc2  # fmt: skip
            if self.adopting:
                await self._take_over()
            else:
                await self._delete_leftovers()
            self._watches = [asyncio.get_running_loop().create_task(self._watch_pods()),
                             asyncio.get_running_loop().create_task(self._watch_events())]  # fmt: skip

    async def _delete_leftovers(self) -> None:
        """Pods with our cluster label that exist before our first create were left by an earlier
        scheduler with this cluster id (it crashed, or its close never ran): delete them."""
        try:
            resp = await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=self._selector())
        except Exception as exc:
            raise ProviderError(f"cannot list pods in namespace {self.namespace!r}: {api_message(exc)}"
                                f"{hint(exc, 'list pods', self.namespace)}") from exc  # fmt: skip
        names = [p.metadata.name for p in resp.items]
        if names:
            log.warning("KubernetesProvider: deleting %d pod(s) left by an earlier scheduler with cluster id %r: %s",
                        len(names), self.cluster_id, names)  # fmt: skip
            with self._lock:
                self._deleting.update(names)
            await self._delete(names)

    async def _take_over(self) -> None:
        """Pods with our cluster label that exist before our first create (a durable scheduler's
        restart): the live ones become this provider's (its cache lists them at once, so the first
        listing shows them to the autoscaler); ended ones are deleted."""
        try:
            resp = await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=self._selector())
        except Exception as exc:
            raise ProviderError(f"cannot list pods in namespace {self.namespace!r}: {api_message(exc)}"
                                f"{hint(exc, 'list pods', self.namespace)}") from exc  # fmt: skip
        items = [self._api.sanitize_for_serialization(p) for p in resp.items]
        ended = [p["metadata"]["name"] for p in items if pod_ended(p) or p["metadata"].get("deletionTimestamp")]
        live = [p for p in items if p["metadata"]["name"] not in ended]
        with self._lock:
            for pod in live:
                name, wids = pod["metadata"]["name"], workers_of(pod)
                rid = str((pod["metadata"].get("labels") or {}).get(LABEL_REQUEST) or "")
                self._created[name] = (rid, wids)
                self._requests.setdefault(rid, []).extend(wids)
                self._names.by_request.setdefault(rid, []).extend(wids)
                log.info("KubernetesProvider: took over pod %s (launch %s, workers %s) of an earlier scheduler "
                         "process of cluster %r", name, rid, wids, self.cluster_id)  # fmt: skip
            self._deleting.update(ended)
        self.cache.replace_pods(live)
        if ended:
            await self._delete_quietly(ended)

    def _selector(self) -> str:
        return f"{LABEL_CLUSTER}={label_value(self.cluster_id)}"

    async def _watch_pods(self) -> None:
        k, core, ns = kube(), self._core, self.namespace

        async def list_call() -> tuple[builtins.list[dict[str, Any]], str]:
            resp = await self._call(core.list_namespaced_pod, ns, label_selector=self._selector())
            return [self._api.sanitize_for_serialization(p) for p in resp.items], resp.metadata.resource_version

        def watch_call(rv: str) -> Any:
            return k.watch.Watch().stream(core.list_namespaced_pod, ns, label_selector=self._selector(),
                                          resource_version=rv, timeout_seconds=self.watch_timeout,
                                          allow_watch_bookmarks=True,
                                          _request_timeout=(self.request_timeout, self.watch_timeout + 30))  # fmt: skip

        await watch_forever("pods", list_call, watch_call, self.cache.replace_pods, self.cache.apply_pod,
                            lambda: self._closed)  # fmt: skip

    async def _watch_events(self) -> None:
        k, core, ns = kube(), self._core, self.namespace
        ours = f"tp-{self.cluster_id}-"  # our pod names start so (see pod_name; cluster ids are DNS-safe)

        def mine(ev: Mapping[str, Any]) -> bool:
            return str((ev.get("involvedObject") or {}).get("name", "")).startswith(ours)

        async def list_call() -> tuple[builtins.list[dict[str, Any]], str]:
            resp = await self._call(core.list_namespaced_event, ns, field_selector="involvedObject.kind=Pod")
            return [self._api.sanitize_for_serialization(e) for e in resp.items], resp.metadata.resource_version

        def watch_call(rv: str) -> Any:
            return k.watch.Watch().stream(core.list_namespaced_event, ns, field_selector="involvedObject.kind=Pod",
                                          resource_version=rv, timeout_seconds=self.watch_timeout,
                                          _request_timeout=(self.request_timeout, self.watch_timeout + 30))  # fmt: skip

        def on_list(items: builtins.list[dict[str, Any]]) -> None:
            for ev in items:
                if mine(ev):
                    self.cache.apply_event(ev)

        def on_event(kind: str, ev: dict[str, Any]) -> None:
            if kind in ("ADDED", "MODIFIED") and mine(ev):
                self.cache.apply_event(ev)

        await watch_forever("events", list_call, watch_call, on_list, on_event, lambda: self._closed)

    # ---- templates --------------------------------------------------------------------------------
    def template_for(self, node_type: NodeType) -> PodTemplate:
        """The pod template of ``node_type``: ``templates[name]``, else the defaults + its options."""
        if node_type.name in self.templates:
            return self.templates[node_type.name]
        base = PodTemplate.from_options({"env": self.env}, self.default_template)
        return PodTemplate.from_options(dict(node_type.options), base, f"node type {node_type.name!r} options")

    def contact(self) -> str:
        """The scheduler address the workers dial."""
        if self.scheduler_service:
            scheme, _, rest = self.scheduler.partition("://")
            name, _, port = self.scheduler_service.partition(":")
            return f"{scheme or 'tcp'}://{name}.{self.namespace}.svc:{port or rest.rpartition(':')[2]}"
        return contact_address(self.scheduler, self.scheduler_host)

    def manifests(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[dict[str, Any]]:
        """The pod bodies a launch creates (pure: for tests and ``kubectl``-minded users)."""
        template = self.template_for(node_type)
        ids, per = self.worker_ids(node_type, count, request_id), node_type.workers_per_node
        out = []
        for n in range(count):
            wids = ids[n * per:(n + 1) * per]
            cmds = [worker_command(self.contact(), w, node_type, template.python, self.heartbeat_interval,
                                   self.extra_args) for w in wids]  # fmt: skip
            out.append(pod_manifest(cluster_id=self.cluster_id, node_type=node_type, template=template,
                                    request_id=request_id, worker_ids=wids, commands=cmds,
                                    token_secret=secret_name(self.cluster_id), owner=self._owner,
                                    grace_seconds=self.terminate_grace))  # fmt: skip
        return out

    # ---- the Provider protocol --------------------------------------------------------------------
    def worker_ids(self, node_type: NodeType, count: int, request_id: str) -> builtins.list[str]:
        with self._lock:
            return self._names(node_type, count, request_id)

    def _accept(self, node_type: NodeType, count: int, request_id: str) -> bool:
        """Record a launch once; False when it was already accepted (idempotent) or we are closed."""
        ids = self.worker_ids(node_type, count, request_id)
        with self._lock:
            if self._closed:
                self._errors.append(ProviderFailure(request_id, None, "this KubernetesProvider is closed"))
                return False
            if request_id in self._requests:
                return False
            self._requests[request_id] = ids
            self._creating.add(request_id)
            return True

    def launch(self, node_type: NodeType, count: int, request_id: str) -> None:
        """Queue the pod creations on the owning loop and return at once."""
        if self._accept(node_type, count, request_id) and not self._submit(self._launch(node_type, count, request_id)):
            with self._lock:
                self._creating.discard(request_id)
                self._errors.append(ProviderFailure(request_id, None, "this KubernetesProvider's event loop is closed"))

    async def launch_async(self, node_type: NodeType, count: int, request_id: str) -> None:
        """``launch`` awaited in the scheduler's loop, which then owns the provider."""
        self._bind_running()
        if self._accept(node_type, count, request_id):
            self._spawn(self._launch(node_type, count, request_id))

    async def _launch(self, nt: NodeType, count: int, rid: str) -> None:
        try:
            await self._start()
            bodies = self.manifests(nt, count, rid)
            results = await asyncio.gather(*(self._create(b, rid) for b in bodies), return_exceptions=True)
            failed = [(b, r) for b, r in zip(bodies, results, strict=True) if isinstance(r, BaseException)]
            if failed and len(failed) == len(bodies):  # nothing will come: one failed launch
                exc = failed[0][1]
                raise ProviderError(f"launch {rid} of {count} {nt.name!r} pod(s) failed: {api_message(exc)}"
                                    f"{hint(exc, 'create pods', self.namespace)}") from exc  # fmt: skip
            with self._lock:
                for body, exc in failed:  # partial: the pods that will not come, worker by worker
                    for wid in workers_of(body):
                        self._reported.add(wid)
                        self._errors.append(ProviderFailure(rid, wid, f"creating pod {body['metadata']['name']} "
                                                            f"failed: {api_message(exc)}"))  # fmt: skip
        except ProviderError as exc:
            with self._lock:
                self._errors.append(ProviderFailure(rid, None, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a failure is reported, never lost on the loop
            with self._lock:
                self._errors.append(ProviderFailure(rid, None, f"launch {rid} failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._creating.discard(rid)

    async def _create(self, body: dict[str, Any], rid: str) -> None:
        name = body["metadata"]["name"]
        try:
            await self._call(self._core.create_namespaced_pod, self.namespace, body)
        except Exception as exc:
            if getattr(exc, "status", None) != 409:  # 409 AlreadyExists: created by an earlier try
                raise
        with self._lock:
            self._created[name] = (rid, workers_of(body))
            stopped = set(workers_of(body)) <= self._terminated and name not in self._deleting
            if stopped:  # terminated while its create was in flight: it must not stay
                self._deleting.add(name)
        if stopped:
            await self._delete([name])

    def terminate(self, worker_ids: builtins.list[str]) -> None:
        """Delete the pods of these workers (a gone pod or unknown worker: nothing to do).  Inside
        the owning loop the deletions are queued; from another thread they are waited for."""
        names = self._to_delete(worker_ids)
        if not names or self._loop is None:
            return
        if _running_loop() is self._loop:
            self._spawn(self._delete(names))
        else:
            self._wait(self._delete(names), self.retry_for + 2 * self.request_timeout + 5)

    async def terminate_async(self, worker_ids: builtins.list[str]) -> None:
        self._bind_running()
        names = self._to_delete(worker_ids)
        if names:
            await self._delete(names)

    def _to_delete(self, worker_ids: builtins.list[str]) -> builtins.list[str]:
        """Mark the workers stopped; the pods all of whose workers are now stopped."""
        pods, _, _ = self.cache.snapshot()
        with self._lock:
            self._terminated.update(worker_ids)
            by_pod = {name: wids for name, (_, wids) in self._created.items()}
            by_pod.update({name: workers_of(p) for name, p in pods.items()})
            out = [name for name, wids in by_pod.items()
                   if set(wids) & set(worker_ids) and set(wids) <= self._terminated and name not in self._deleting]  # fmt: skip
            self._deleting.update(out)
            return out

    async def _delete(self, names: builtins.list[str]) -> None:
        if self._core is None:
            return
        results = await asyncio.gather(*(self._delete_one(n) for n in names), return_exceptions=True)
        errors = [(n, r) for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)]
        if errors:
            problems = [f"{n}: {api_message(r)}" for n, r in errors]
            raise ProviderError(f"could not delete pods {problems}{hint(errors[0][1], 'delete pods', self.namespace)}; "
                                f"delete them by hand: kubectl delete pods -n {self.namespace} -l {self._selector()}")  # fmt: skip

    async def _delete_one(self, name: str) -> None:
        try:
            await self._call(self._core.delete_namespaced_pod, name, self.namespace,
                             grace_period_seconds=self.terminate_grace)  # fmt: skip
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise

    def list(self) -> dict[str, dict[str, Any]]:  # noqa: A003
        """Worker id -> {node_type, request_id, pod, phase, alive, returncode, state}, from the cache
        (after :meth:`tag_with`, the first call from a plain thread starts the provider and waits
        for the pods it takes over)."""
        if self.adopting and not self._watches and not self._closed and _running_loop() is None:
            self._ensure_loop()
            self._wait(self._start(), self.retry_for + 3 * self.request_timeout + 5)
        pods, gone, _ = self.cache.snapshot()
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for rid in self._creating:  # pods still being created: listed, so not reconciled away
                for wid in self._requests.get(rid, ()):
                    out[wid] = {"request_id": rid, "alive": True, "state": "starting"}
            for name, (rid, wids) in self._created.items():  # created, not seen by the watch yet
                if name not in pods and name not in gone:
                    out.update({w: {"request_id": rid, "pod": name, "alive": True, "state": "starting"} for w in wids})
        for pod in pods.values():
            out.update(worker_view(pod))
        return out

    async def list_async(self) -> dict[str, dict[str, Any]]:
        self._bind_running()
        if self.adopting and not self._closed:
            await self._start()  # a restarted scheduler's first listing must show the pods it takes over
        return self.list()

    def poll_errors(self) -> builtins.list[ProviderFailure]:
        """Workers whose pods failed (with the Kubernetes reason) and failed launches, each once."""
        pods, gone, events = self.cache.snapshot()
        now = self.clock()
        doomed: builtins.list[str] = []
        with self._lock:
            out, self._errors = self._errors, []
            for name, pod in pods.items():
                if name in self._deleting:
                    continue
                if unschedulable(pod) is not None:
                    since = self._unsched_since.setdefault(name, now)
                else:
                    since = self._unsched_since.pop(name, now)
                problems = pod_problem(pod, events.get(name), now - since, self.unschedulable_grace)
                wids = workers_of(pod)
                rid = (pod["metadata"].get("labels") or {}).get("tidepool.io/request", "")
                rid = self._created.get(name, (rid, []))[0]
                for i, wid in enumerate(wids):
                    msg = problems.get("") or problems.get(f"worker-{i}")
                    if msg and wid not in self._reported and wid not in self._terminated:
                        self._reported.add(wid)
                        out.append(ProviderFailure(rid, wid, msg))
                        log.warning("%s", msg)
                if (problems and (problems.get("") or pod_ended(pod) or len(problems) == len(wids))) or (
                        pod_ended(pod) and not problems):  # fmt: skip
                    doomed.append(name)  # failed, or ended by itself: nothing will run there any more
            for name, pod in gone.items():
                if name in self._deleting:
                    continue
                for wid in workers_of(pod):
                    if wid not in self._reported and wid not in self._terminated:
                        self._reported.add(wid)
                        rid = self._created.get(name, ("", []))[0]
                        out.append(ProviderFailure(rid, wid, f"pod {name} was deleted outside tidepool "
                                                   "(kubectl delete, a drain or the garbage collector)"))  # fmt: skip
            for name in gone:  # dealt with: forget it (it is not listed any more)
                self._created.pop(name, None)
                self._unsched_since.pop(name, None)
            self.cache.forget(builtins.list(gone))
            if self.keep_failed_pods:
                doomed = [n for n in doomed if pod_ended(pods[n]) and not pod_problem(pods[n], None, 0, 1)]
            doomed = [n for n in doomed if n not in self._deleting]
            self._deleting.update(doomed)
        if doomed and self._loop is not None:
            self._submit(self._delete_quietly(doomed))
        return out

    async def poll_errors_async(self) -> builtins.list[ProviderFailure]:
        self._bind_running()
        return self.poll_errors()

    async def _delete_quietly(self, names: builtins.list[str]) -> None:
        try:
            await self._delete(names)
        except Exception as exc:  # noqa: BLE001 - logged; close() tries again
            log.warning("KubernetesProvider: %s", exc)

    def expiring(self, now_wall: float) -> builtins.list[str]:
        """Workers whose pods are about to go (DisruptionTarget, or deleted by someone else)."""
        pods, _, _ = self.cache.snapshot()
        with self._lock:
            deleting = set(self._deleting)
        out = []
        for name, pod in pods.items():
            if name in deleting or pod_ended(pod):
                continue
            if disruption_notice(pod) is not None or pod.get("metadata", {}).get("deletionTimestamp"):
                out.extend(workers_of(pod))
        return out

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete every pod this provider created and its Secret, stop the watches, close the client."""
        with self._lock:
            if self._closed:
                return
            loop, lt = self._loop, self._loop_thread
        if loop is None:
            self._closed = True
            return
        if _running_loop() is loop:
            self._spawn(self.close_async())
            return
        try:
            if loop.is_closed() or not loop.is_running():
                log.warning("KubernetesProvider.close: its event loop has ended; delete its pods by hand: "
                            "kubectl delete pods,secrets -n %s -l %s", self.namespace, self._selector())  # fmt: skip
                self._closed = True
                return
            self._wait(self.close_async(), self.retry_for + 3 * self.request_timeout + 15)
        except Exception as exc:  # noqa: BLE001 - close must not raise into cleanup paths
            log.warning("KubernetesProvider.close: %s", exc)
        finally:
            if lt is not None:
                lt.stop()

    async def close_async(self) -> None:
        """``close`` awaited in the loop that owns the provider."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        running = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in running:  # launches in flight: a create may be done on the server, unrecorded here
            t.cancel()
        if running:
            await asyncio.wait(running, timeout=self.request_timeout)
        if self._core is None:
            return
        pods, _, _ = self.cache.snapshot()
        names = set(pods)
        with contextlib.suppress(Exception):  # so the listing catches those creates too
            resp = await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=self._selector())
            names.update(p.metadata.name for p in resp.items)
        with self._lock:
            todo = sorted(names | set(self._created))
            self._deleting.update(todo)
        try:
            await self._delete(todo)
            with contextlib.suppress(Exception):
                await self._call(self._core.delete_namespaced_secret, secret_name(self.cluster_id), self.namespace)
        except Exception as exc:  # noqa: BLE001 - close must not raise into cleanup paths
            log.warning("KubernetesProvider.close: %s", exc)
        finally:
            for t in self._watches:
                t.cancel()
            if self._watches:
                await asyncio.wait(self._watches, timeout=5)
            await self._api.close()

    def __repr__(self) -> str:
        return f"<KubernetesProvider namespace={self.namespace} cluster={self.cluster_id} pods={len(self._created)}>"

