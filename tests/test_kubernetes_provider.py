"""The Kubernetes provider against the Kubernetes API.

Everything here drives the real ``kubernetes_asyncio`` client; only the server is emulated
(``tidepool.testing_k8s.KubeEmulator``: the real JSON and watch protocol over HTTP, and real
``tidepool worker`` processes for the pods it runs).  The last test runs against a real cluster
when ``KUBECONFIG`` points at one (docs/providers.md says how, with kind).
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidepool
from tidepool.config import parse
from tidepool.errors import ConfigError, ProviderError
from tidepool.providers.kubernetes import KubernetesProvider
from tidepool.providers.kubernetes_pods import PodTemplate, dns_name, label_value
from tidepool.providers.kubernetes_watch import PodEvents, pod_problem
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.policies import Adaptive, IdleRetire
from tidepool.testing import journal_records, wait_until
from tidepool.testing_k8s import EmulatorThread, EmuNode, KubeEmulator

pytestmark = pytest.mark.integration

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def slow_double(x: int) -> int:
    time.sleep(0.3)
    return 2 * x


def on_gpu(x: int) -> tuple[int, str]:
    return x + 1, os.environ.get("TIDEPOOL_WORKER_ID", "")


@pytest.fixture
def emu(tmp_path: Path) -> Iterator[EmulatorThread]:
    nodes = [EmuNode("cpu-node", {"cpu": "3", "memory": "8Gi", "pods": "20"}),
             EmuNode("gpu-node", {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1", "pods": "20"},
                     labels={"accelerator": "nvidia"}, taints=[GPU_TAINT])]  # fmt: skip
    thread = EmulatorThread(KubeEmulator(nodes, workdir=str(tmp_path)))
    yield thread
    thread.close()


def provider(emu: EmulatorThread, tmp_path: Path, **kw: Any) -> KubernetesProvider:
    kubeconfig = emu.emulator.write_kubeconfig(str(tmp_path / "kubeconfig"))
    kw.setdefault("unschedulable_grace", 0.0)
    kw.setdefault("terminate_grace", 5)
    return KubernetesProvider(kubeconfig=kubeconfig, **kw)


def pods(emu: EmulatorThread) -> list[dict[str, Any]]:
    return emu.call(lambda: emu.emulator.objects("pods"))  # type: ignore[no-any-return]


def gpu_type(**kw: Any) -> NodeType:
    return NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=1.0,
                    options={"node_selector": {"accelerator": "nvidia"},
                             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
                    **kw)  # fmt: skip


def test_elastic_graph_runs_through_the_api_from_zero_pods_grows_and_shrinks(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="elastic")
    cpu = NodeType("cpu", {"cpu": 1, "memory": "1GiB"}, max_nodes=3, startup_estimate=1.0)
    peak = 0
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        token = cluster.token
        assert pods(emu) == []  # from zero
        cluster.adapt(node_types=[cpu, gpu_type()], provider=prov, policy=Adaptive(idle=IdleRetire(idle_timeout=0.5)))
        futs = client.map(slow_double, range(24))
        gpu_fut = client.submit(on_gpu, 41, resources={"gpu": 1})
        while not all(f.done() for f in futs):
            peak = max(peak, sum(1 for p in pods(emu) if p["status"].get("phase") == "Running"))
            time.sleep(0.05)
        assert client.gather(futs) == [2 * x for x in range(24)]
        value, gpu_worker = gpu_fut.result(timeout=60)
        assert value == 42 and gpu_worker.startswith("gpu-")
        assert peak >= 2, f"the pool never grew beyond {peak} running pod(s)"
        # the GPU pod asked for the GPU, went to the GPU node (selector + toleration) and ran there
        gpu_pods = [p for p in emu.emulator.history_objects("pods") if p["metadata"]["labels"]["tidepool.io/node-type"] == "gpu"]
        assert gpu_pods and {p["spec"].get("nodeName") for p in gpu_pods} - {None} == {"gpu-node"}
        limits = gpu_pods[0]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1" and limits["cpu"] == "1000m"
        assert gpu_pods[0]["metadata"]["labels"]["tidepool.io/cluster"] == "elastic"
        # the token travels as a Secret the pods reference; no pod spec ever held it
        secrets = emu.call(lambda: emu.emulator.objects("secrets"))
        assert [base64.b64decode(s["data"]["token"]).decode() for s in secrets] == [token]
        for p in emu.emulator.history_objects("pods"):
            assert token not in json.dumps(p)
            env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
            assert env["TIDEPOOL_TOKEN"] == {"name": "TIDEPOOL_TOKEN",
                                             "valueFrom": {"secretKeyRef": {"name": secrets[0]["metadata"]["name"], "key": "token"}}}  # fmt: skip
        # and it shrinks: idle workers retire (once their results are released), their pods are deleted
        for f in [*futs, gpu_fut]:
            f.release()
        wait_until(lambda: pods(emu) == [], 30, "every idle worker's pod to be deleted")
        # listing came from the watch, not one list call per autoscaler round: one list for
        # left-overs of an earlier scheduler, one to start the watch
        plain_lists = [r for r in emu.emulator.requests if r[0] == "GET" and r[1].endswith("/pods") and "watch" not in r[2]]
        assert len(plain_lists) == 2, plain_lists
        assert any(r[0] == "GET" and r[1].endswith("/pods") and "watch=" in r[2] for r in emu.emulator.requests)
    assert emu.call(lambda: emu.emulator.objects("secrets")) == []  # close deleted the Secret


FAILURES = {
    # node type, what the emulated cluster does to its pods, what the user must read
    "unschedulable": ({"cpu": 1, "gpu": 4}, {}, None, ["Unschedulable", "Insufficient nvidia.com/gpu"]),
    "image-pull": ({"cpu": 1}, {"image": "registry.example/tidepool:nope"}, None,
                   ["ImagePull", "registry.example/tidepool:nope", "not found"]),
    "eviction": ({"cpu": 1}, {}, "evict", ["Evicted", "low on resource: memory"]),
    "oomkill": ({"cpu": 1, "memory": "256MiB"}, {}, "oomkill", ["OOMKilled", "memory limit 268435456"]),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_pod_failures_reach_the_futures_as_provider_errors_with_the_kubernetes_reason(
        case: str, emu: EmulatorThread, tmp_path: Path) -> None:  # fmt: skip
    resources, options, fault, expected = FAILURES[case]
    if fault:
        emu.emulator.faults["special"] = fault
    emu.emulator.bad_images.add("registry.example/tidepool:nope")
    prov = provider(emu, tmp_path, cluster_id=f"fail-{case}")
    nt = NodeType("special", {**resources, "special": 1}, max_nodes=1, startup_estimate=0.5, options=options)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        scaler = cluster.adapt(node_types=[nt], provider=prov, max_type_failures=1, backoff_base=0.05)
        fut = client.submit(slow_double, 1, resources={"special": 1})
        with pytest.raises(ProviderError) as info:
            fut.result(timeout=60)
        for text in expected:
            assert text in str(info.value), str(info.value)
        assert "disabled" in str(info.value)
        failed = scaler.journal.of_kind("launch-failed")
        assert failed and expected[0] in failed[0]["reason"]
        # the failed pod is deleted, so it holds no place in the cluster
        wait_until(lambda: pods(emu) == [], 20, "the failed pod to be deleted")


@pytest.mark.parametrize(("action", "expected"), [("oomkill", "OOMKilled (exit code 137)"), ("evict", "was evicted (Evicted)")])
def test_a_running_pod_killed_by_the_cluster_is_reported_once_with_the_reason(
        action: str, expected: str, emu: EmulatorThread, tmp_path: Path) -> None:  # fmt: skip
    prov = provider(emu, tmp_path, cluster_id=f"run-{action}", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    nt = NodeType("cpu", {"cpu": 1, "memory": "1GiB"})
    try:
        prov.launch(nt, 1, "r1")
        (wid,) = prov.worker_ids(nt, 1, "r1")
        wait_until(lambda: prov.list().get(wid, {}).get("phase") == "Running", 10, "the pod running")
        assert prov.poll_errors() == []
        name = prov.list()[wid]["pod"]
        emu.call(getattr(emu.emulator, action), name)
        errors: list[Any] = []
        wait_until(lambda: bool(errors.extend(prov.poll_errors()) or errors), 10, "the failure reported")
        assert [(e.request_id, e.worker_id) for e in errors] == [("r1", wid)]
        assert expected in errors[0].message and name in errors[0].message
        wait_until(lambda: pods(emu) == [], 10, "the failed pod deleted")
        assert prov.poll_errors() == []  # once
    finally:
        prov.close()


def test_the_emulator_answers_the_real_client_as_an_api_server_does(emu: EmulatorThread, tmp_path: Path) -> None:
    import asyncio

    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.exceptions import ApiException

    kubeconfig = emu.emulator.write_kubeconfig(str(tmp_path / "kubeconfig"))

    async def session() -> None:
        cfg = client.Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        async with client.ApiClient(cfg) as api:
            core = client.CoreV1Api(api)
            svc = {"metadata": {"name": "tidepool-scheduler", "labels": {"app": "tp"}},
                   "spec": {"selector": {"app": "tp"}, "ports": [{"port": 8786}]}}  # fmt: skip
            made = await core.create_namespaced_service("default", svc)
            assert made.metadata.uid and made.spec.ports[0].port == 8786
            with pytest.raises(ApiException) as again:
                await core.create_namespaced_service("default", svc)
            assert again.value.status == 409 and json.loads(again.value.body)["reason"] == "AlreadyExists"
            assert [s.metadata.name for s in (await core.list_namespaced_service("default", label_selector="app=tp")).items] == ["tidepool-scheduler"]
            assert (await core.list_namespaced_service("default", label_selector="app!=tp")).items == []
            await core.delete_namespaced_service("tidepool-scheduler", "default")
            with pytest.raises(ApiException) as gone:
                await core.read_namespaced_service("tidepool-scheduler", "default")
            assert gone.value.status == 404
            with pytest.raises(ApiException) as bad:
                await core.create_namespaced_secret("default", {"metadata": {"name": "Not_A_Name"}})
            assert bad.value.status == 422

    asyncio.run(session())


def test_unschedulable_waits_a_grace_period_unless_the_cluster_autoscaler_gives_up() -> None:
    pod = {"metadata": {"name": "tp-x-cpu-r1-1"},
           "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                          "message": "0/3 nodes are available: 3 Insufficient cpu."}]}}  # fmt: skip
    assert pod_problem(pod, None, 5.0, 60.0) == {}  # a node may still come
    assert "Insufficient cpu" in pod_problem(pod, None, 61.0, 60.0)[""]
    scaling = PodEvents(reasons={"TriggeredScaleUp"})  # cluster autoscaler adds a node: wait for it
    assert pod_problem(pod, scaling, 600.0, 60.0) == {}
    hopeless = PodEvents(last_warning=("NotTriggerScaleUp", "pod didn't trigger scale-up"), reasons={"NotTriggerScaleUp"})
    assert "Unschedulable" in pod_problem(pod, hopeless, 0.0, 60.0)[""]


def test_names_and_labels_are_dns_safe_and_distinct() -> None:
    assert dns_name("tp-c-cpu-r1-1") == "tp-c-cpu-r1-1"
    a, b = dns_name("tp-c-GPU_big-r1-1"), dns_name("tp-c-gpu-big-r1-1")
    assert a != b and a.startswith("tp-c-gpu-big-r1-1-") and len(a) <= 63
    assert len(dns_name("x" * 300)) <= 63
    assert label_value("ok.name-1") == "ok.name-1"
    long = label_value("w" * 100)
    assert len(long) <= 63 and long[0].isalnum() and long[-1].isalnum()


def test_launch_is_idempotent_and_a_pod_already_there_counts_as_created(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="idem", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4, workers_per_node=2)
    try:
        prov.launch(nt, 1, "r0")  # connected, Secret made, watching
        wait_until(lambda: any(i.get("phase") for i in prov.list().values()), 10, "the first pod in the cache")
        # a create whose answer was lost (the call timed out after the server did the work) and is
        # tried again: the server answers 409 AlreadyExists, which counts as created
        first = prov.manifests(nt, 2, "r1")[0]
        emu.call(lambda: emu.emulator._put("pods", {**json.loads(json.dumps(first)), "status": {"phase": "Pending"},
                                                    "metadata": {**first["metadata"], "namespace": "default",
                                                                 "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"}},
                                           "ADDED"))  # fmt: skip
        prov.launch(nt, 2, "r1")
        prov.launch(nt, 2, "r1")
        ids = prov.worker_ids(nt, 2, "r1")
        wait_until(lambda: not prov._creating and set(ids) <= set(prov.list())
                   and all(i.get("pod") for i in prov.list().values()), 10, "r1's creates done, both pods listed")  # fmt: skip
        posts = [r for r in emu.emulator.requests if r[0] == "POST" and r[1].endswith("/pods")]
        assert len(posts) == 3, '\n'.join(map(str, emu.emulator.requests))  # r0's pod and one per node of r1; the second launch of r1 made none
        r1 = [p for p in pods(emu) if p["metadata"]["labels"]["tidepool.io/request"] == "r1"]
        assert len(r1) == 2 and all(len(p["spec"]["containers"]) == 2 for p in r1)
        assert prov.poll_errors() == []
        prov.terminate(["no-such-worker"])  # unknown: nothing to do
        prov.terminate(ids[:1])  # one worker of a two-worker pod: the pod stays for its sibling
        assert len(pods(emu)) == 3
        prov.terminate(ids[1:2])
        wait_until(lambda: len(pods(emu)) == 2, 10, "the pod of both terminated workers to go")
        assert prov.poll_errors() == []  # stopped on purpose: not failures
    finally:
        prov.close()
    assert all(p["metadata"].get("deletionTimestamp") for p in pods(emu))  # close deleted them (gracefully)
    assert emu.call(lambda: emu.emulator.objects("secrets")) == []
    wait_until(lambda: pods(emu) == [], 15, "the pods' processes to end on SIGTERM")


def test_pods_left_by_an_earlier_scheduler_with_the_same_cluster_id_are_deleted(emu: EmulatorThread,
                                                                               tmp_path: Path) -> None:  # fmt: skip
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4)
    old = provider(emu, tmp_path, cluster_id="again", scheduler="tcp://127.0.0.1:1", token="a" * 64)
    old.launch(nt, 1, "r1")
    wait_until(lambda: len(pods(emu)) == 1, 10, "the first scheduler's pod")
    (left,) = pods(emu)
    # that scheduler dies without close(); a new one with the same cluster id starts
    new = provider(emu, tmp_path, cluster_id="again", scheduler="tcp://127.0.0.1:1", token="b" * 64)
    try:
        assert new.worker_ids(nt, 1, "r1") != old.worker_ids(nt, 1, "r1")  # never the same pod names
        new.launch(nt, 1, "r1")
        mine = new.worker_ids(nt, 1, "r1")
        wait_until(lambda: [json.loads(p["metadata"]["annotations"]["tidepool.io/workers"]) for p in pods(emu)] == [mine],
                   15, "the left-over pod deleted and the new one created")  # fmt: skip
        assert left["metadata"]["name"] not in {p["metadata"]["name"] for p in pods(emu)}
        assert new.poll_errors() == []
    finally:
        new.close()
        old._closed = True  # it "died": nothing of it is left to close
        if old._loop_thread is not None:
            old._loop_thread.stop()


def test_a_provider_tagged_alike_takes_over_the_pods_of_an_earlier_one(emu: EmulatorThread, tmp_path: Path) -> None:
    """What a restarted durable scheduler's provider does (tag_with): the live pods of the dead
    one's provider are listed (same workers, request, node type) and deleted at close, not at start."""
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4)
    old = provider(emu, tmp_path, scheduler="tcp://127.0.0.1:1", token="a" * 64)
    old.tag_with("tpfeed")
    assert old.cluster_id == "tpfeed"  # no cluster_id given: the tag names the cluster
    old.launch(nt, 1, "a3")
    mine = old.worker_ids(nt, 1, "a3")
    wait_until(lambda: [p["status"].get("phase") for p in pods(emu)] == ["Running"], 30, "the first scheduler's pod")
    (pod,) = pods(emu)
    new = provider(emu, tmp_path, scheduler="tcp://127.0.0.1:1", token="a" * 64)
    new.tag_with("tpfeed")
    other = provider(emu, tmp_path, scheduler="tcp://127.0.0.1:1", token="a" * 64)
    other.tag_with("tpother")
    try:
        listed = new.list()  # the first listing already shows it (no watch event waited for)
        assert set(listed) == set(mine)
        assert listed[mine[0]]["request_id"] == "a3" and listed[mine[0]]["node_type"] == "cpu"
        assert listed[mine[0]]["alive"] and listed[mine[0]]["pod"] == pod["metadata"]["name"]
        assert new.worker_ids(nt, 1, "a3") == mine
        assert other.list() == {}  # another cluster's pods are not taken
        assert [p["metadata"]["name"] for p in pods(emu)] == [pod["metadata"]["name"]]  # not deleted
        assert not pods(emu)[0]["metadata"].get("deletionTimestamp")
        assert new.poll_errors() == []
    finally:
        other.close()
        new.close()
        old._closed = True  # it "died": nothing of it is left to close
        if old._loop_thread is not None:
            old._loop_thread.stop()
    wait_until(lambda: pods(emu) == [], 30, "the taken-over pod deleted at close")


def where(x: int) -> tuple[int, str, int]:
    return x, os.environ.get("TIDEPOOL_WORKER_ID", ""), os.getpid()



@pytest.mark.timeout(900)  # process starts are slow on a loaded machine
def test_a_restarted_durable_scheduler_adopts_its_pod(emu: EmulatorThread, tmp_path: Path) -> None:
    """kill -9 ``tidepool scheduler --state-dir --cluster`` (Kubernetes provider): the restarted one
    takes over the pod by its cluster label, adopts its worker (no new pod) and deletes it at close."""
    state = tmp_path / "state"
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    kubeconfig = emu.emulator.write_kubeconfig(str(tmp_path / "kubeconfig"))
    cluster = tidepool.LocalCluster(0, state_dir=str(state), reconnect_window=300.0, recovery_wait=120.0,
                                    timeout=180)  # fmt: skip
    try:
        cluster.use_cluster_file(
            f'[provider]\nkind = "kubernetes"\nkubeconfig = "{kubeconfig}"\nterminate_grace = 5\n\n'
            '[[node_types]]\nname = "kp"\nresources = { cpu = 1 }\nmin_nodes = 1\nmax_nodes = 1\n'
            "startup_estimate = 60\n",
            journal=str(before),
        )  # fmt: skip
        wait_until(lambda: len(cluster.workers()) == 1, 300, "the pod's worker")
        [worker] = cluster.workers()
        [pod] = pods(emu)
        with tidepool.Client(cluster.address, cluster.token, timeout=120) as client:
            _, wid, pid = client.submit(where, 1, pure=False).result(timeout=120)
            assert wid == worker
            cluster.kill_scheduler()
            cluster.restart_scheduler(str(after))
            wait_until(lambda: journal_records(after, "adopt"), 120, "the journal's adopt record")
            _, wid2, pid2 = client.submit(where, 2, pure=False).result(timeout=300)
            assert (wid2, pid2) == (worker, pid)  # the same pod's worker process serves the graph
        adopted = journal_records(after, "adopt")
        assert [(r["worker"], r["outcome"]) for r in adopted] == [(worker, "adopted")]
        assert journal_records(after, "launch") == []  # no second pod
        assert [p["metadata"]["uid"] for p in pods(emu)] == [pod["metadata"]["uid"]]
    finally:
        cluster.close()
    wait_until(lambda: pods(emu) == [], 120, "the adopted pod deleted at close")


def test_close_while_a_create_awaits_its_answer_leaves_no_pod(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="inflight", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    prov.launch(NodeType("cpu", {"cpu": 1}), 0, "r0")  # connected and watching, no pod
    wait_until(lambda: any(w.plural == "pods" for w in emu.emulator.watchers), 10, "the pod watch")
    emu.emulator.answer_delay = 3.0  # the server creates the pod, the answer is not back when close() runs
    emu.emulator.watch_lag = True  # ... and the watch has not shown it yet
    prov.launch(NodeType("cpu", {"cpu": 1}), 1, "r1")
    wait_until(lambda: len(pods(emu)) == 1, 10, "the pod created on the server")
    assert prov._created == {} and prov.cache.pods == {}  # the provider has not heard of it
    try:
        prov.close()
    finally:
        emu.call(emu.emulator.catch_up)
    assert all(p["metadata"].get("deletionTimestamp") for p in pods(emu))
    wait_until(lambda: pods(emu) == [], 15, "the pod deleted by close")


def test_quota_refusal_is_a_failed_launch_with_the_api_message(emu: EmulatorThread, tmp_path: Path) -> None:
    emu.emulator.quota_pods = 0
    prov = provider(emu, tmp_path, cluster_id="quota", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    try:
        prov.launch(NodeType("cpu", {"cpu": 1}), 1, "r1")
        errors: list[Any] = []
        wait_until(lambda: bool(errors.extend(prov.poll_errors()) or errors), 20, "the launch to fail")
        assert errors[0].request_id == "r1" and errors[0].worker_id is None
        assert "exceeded quota" in errors[0].message and "ResourceQuota" in errors[0].message
    finally:
        prov.close()


def test_a_disruption_notice_lists_the_worker_as_expiring(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="notice", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    nt = NodeType("spot", {"cpu": 1})
    try:
        prov.launch(nt, 1, "r1")
        (wid,) = prov.worker_ids(nt, 1, "r1")
        wait_until(lambda: prov.list().get(wid, {}).get("phase") == "Running", 10, "the pod running")
        assert prov.expiring(time.time()) == []
        (pod,) = pods(emu)
        emu.call(emu.emulator.disrupt, pod["metadata"]["name"], "PreemptionByScheduler", "spot node reclaimed")
        wait_until(lambda: prov.expiring(time.time()) == [wid], 10, "the notice to reach the provider")
        assert prov.poll_errors() == []  # a notice, not a failure (yet)
    finally:
        prov.close()


def test_the_autoscaler_retires_a_worker_whose_pod_got_a_disruption_notice(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="spot")
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        # idle=None: no idle retirement, so only the notice can make it retire the worker
        scaler = cluster.adapt(node_types=[NodeType("spot", {"cpu": 1}, max_nodes=1, startup_estimate=0.5)],
                               provider=prov, policy=Adaptive(idle=None))  # fmt: skip
        assert client.submit(slow_double, 2).result(timeout=60) == 4
        (pod,) = pods(emu)
        (wid,) = json.loads(pod["metadata"]["annotations"]["tidepool.io/workers"])
        assert not scaler.journal.of_kind("retire")
        emu.call(emu.emulator.disrupt, pod["metadata"]["name"], "PreemptionByScheduler", "spot node reclaimed")
        wait_until(lambda: any(r.get("worker") == wid for r in scaler.journal.of_kind("retire")), 20, "retirement")
        wait_until(lambda: pods(emu) == [], 20, "the pod to be deleted")


def test_cluster_file_with_a_kubernetes_provider_and_pod_templates(tmp_path: Path) -> None:
    cfg = parse({
        "provider": {"kind": "kubernetes", "namespace": "science", "image": "ghcr.io/me/tp:1", "cluster_id": "lab",
                     "scheduler_service": "tidepool-scheduler", "env": {"OMP_NUM_THREADS": "1"}},
        "node_types": [{"name": "gpu", "resources": {"cpu": 4, "gpu": 1, "memory": "16GiB"},
                        "options": {"node_selector": {"accelerator": "nvidia"}, "service_account": "worker",
                                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                    "env": {"CUDA_CACHE": "/tmp"}}}],
    }, "cluster.toml")  # fmt: skip
    prov = cfg.make_provider("tcp://0.0.0.0:8786", "secret-token")
    try:
        assert isinstance(prov, KubernetesProvider) and prov.namespace == "science"
        (body,) = prov.manifests(cfg.node_types[0], 1, "r7")
        spec = body["spec"]
        assert spec["nodeSelector"] == {"accelerator": "nvidia"} and spec["serviceAccountName"] == "worker"
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
        c = spec["containers"][0]
        assert c["image"] == "ghcr.io/me/tp:1"
        assert c["resources"]["limits"] == {"cpu": "4000m", "memory": str(16 * 2**30), "nvidia.com/gpu": "1"}
        assert "tcp://tidepool-scheduler.science.svc:8786" in c["command"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_CACHE"] == "/tmp"
        assert "secret-token" not in json.dumps(body)
    finally:
        prov.close()
    with pytest.raises(ConfigError, match="imagee"):
        PodTemplate.from_options({"imagee": "x"})
    with pytest.raises(ConfigError, match="namespace"):
        parse({"provider": {"kind": "kubernetes", "namespace": "Not_DNS"}, "node_types": [{"name": "cpu"}]})


def test_the_documented_cluster_file_builds_the_provider() -> None:
    import re
    import tomllib

    doc = (Path(__file__).resolve().parent.parent / "docs" / "providers.md").read_text()
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", doc, re.S) if 'kind = "kubernetes"' in b]
    assert blocks, "docs/providers.md has no TOML example for kind = 'kubernetes'"
    for text in blocks:
        cfg = parse(tomllib.loads(text), "providers.md (kubernetes)")
        prov = cfg.make_provider("tcp://0.0.0.0:8786", "t" * 32)
        try:
            assert isinstance(prov, KubernetesProvider)
            for nt in cfg.node_types:  # every node type's options make a valid pod
                (body,) = prov.manifests(nt, 1, "r1")
                assert body["spec"]["containers"][0]["image"].startswith("ghcr.io/me/tidepool")
        finally:
            prov.close()
        # every documented key, commented ones too, is a constructor argument
        commented = tomllib.loads(re.sub(r"^# ?(\w+ = )", r"\1", text, flags=re.M))
        import inspect

        keys = set(commented["provider"]) - {"kind"}
        assert keys <= set(inspect.signature(KubernetesProvider).parameters), keys


def test_the_watch_lists_again_after_410_gone_and_keeps_up(emu: EmulatorThread, tmp_path: Path) -> None:
    prov = provider(emu, tmp_path, cluster_id="relist", scheduler="tcp://127.0.0.1:1", token="t" * 64,
                    watch_timeout=1)  # fmt: skip
    nt = NodeType("cpu", {"cpu": 1}, max_nodes=4)
    try:
        prov.launch(nt, 1, "r1")
        wait_until(lambda: any(i.get("phase") for i in prov.list().values()), 10, "the first pod in the cache")

        def forget_history() -> None:  # as an API server whose watch cache moved on: old versions are gone
            emu.emulator.history.clear()
            emu.emulator.rv += 10

        def lists() -> int:
            return len([r for r in emu.emulator.requests
                        if r[0] == "GET" and r[1].endswith("/pods") and "watch" not in r[2]])  # fmt: skip

        before = lists()
        emu.call(forget_history)
        wait_until(lambda: lists() > before, 15, "a fresh list after 410 Gone")
        assert emu.emulator.expired_watches >= 1  # it was the 410 that made it list again
        prov.launch(nt, 1, "r2")  # changes after the relist still arrive through the watch
        ids = prov.worker_ids(nt, 1, "r1") + prov.worker_ids(nt, 1, "r2")
        wait_until(lambda: all(prov.list().get(w, {}).get("phase") for w in ids), 10, "both pods in the cache")
    finally:
        prov.close()


def test_no_api_server_or_no_kubeconfig_fails_the_launch_saying_what_to_check(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    emulator = KubeEmulator(workdir=str(tmp_path))  # never started: only its kubeconfig is used
    emulator.url = f"http://127.0.0.1:{port}"
    cases = [(emulator.write_kubeconfig(str(tmp_path / "kubeconfig")), "reachable"),
             (str(tmp_path / "missing"), "cannot load the Kubernetes configuration")]  # fmt: skip
    for kubeconfig, expected in cases:
        prov = KubernetesProvider(kubeconfig=kubeconfig, scheduler="tcp://127.0.0.1:1", token="t" * 64, retry_for=0.3)
        try:
            prov.launch(NodeType("cpu", {"cpu": 1}), 1, "r1")
            errors: list[Any] = []
            wait_until(lambda p=prov, e=errors: bool(e.extend(p.poll_errors()) or e), 20, "the launch to fail")
            assert errors[0].worker_id is None and expected in errors[0].message, errors[0].message
        finally:
            prov.close()


def test_the_provider_belongs_to_the_loop_that_first_awaits_it(emu: EmulatorThread, tmp_path: Path) -> None:
    import asyncio

    prov = provider(emu, tmp_path, cluster_id="loops", scheduler="tcp://127.0.0.1:1", token="t" * 64)
    nt = NodeType("cpu", {"cpu": 1})

    async def first() -> None:
        await prov.launch_async(nt, 1, "r1")
        while not any(i.get("phase") for i in (await prov.list_async()).values()):
            await asyncio.sleep(0.02)
        assert prov._loop_thread is None  # no thread: the API client lives in this loop
        await prov.close_async()

    async def second() -> None:
        await prov.list_async()

    asyncio.run(first())
    assert emu.call(lambda: emu.emulator.objects("secrets")) == []
    with pytest.raises(ProviderError, match="bound to another event loop"):
        asyncio.run(second())
    wait_until(lambda: pods(emu) == [], 15, "the pod deleted by close_async")


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="no real cluster: set KUBECONFIG (and TIDEPOOL_K8S_IMAGE, "
                    "TIDEPOOL_K8S_SCHEDULER_HOST) to run it; docs/providers.md shows how with kind")  # fmt: skip
def test_end_to_end_on_a_real_cluster() -> None:
    image = os.environ.get("TIDEPOOL_K8S_IMAGE", "tidepool:test")
    host = os.environ.get("TIDEPOOL_K8S_SCHEDULER_HOST")  # an address of this machine the pods reach
    prov = KubernetesProvider(namespace=os.environ.get("TIDEPOOL_K8S_NAMESPACE", "default"), image=image,
                              image_pull_policy="IfNotPresent", scheduler_host=host,
                              cluster_id=f"e2e{int(time.time()) % 100000}")  # fmt: skip
    nt = NodeType("cpu", {"cpu": 1, "memory": "512MiB"}, max_nodes=2, startup_estimate=30.0)
    with tidepool.LocalCluster(n_workers=0, host="0.0.0.0") as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[nt], provider=prov, policy=Adaptive(idle=IdleRetire(idle_timeout=2.0)))
        # built-ins only: the image has tidepool, not this test module
        parts = client.map(abs, range(-6, 0))
        total = client.submit(sum, parts)
        assert total.result(timeout=300) == 21
        for f in [*parts, total]:  # nothing held: the idle workers retire and their pods go
            f.release()
        wait_until(lambda: prov.list() == {}, 120, "the pods to be deleted after the run")
