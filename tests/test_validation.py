"""Bad sizes fail at once, where they are written: NodeType fields and ``LocalCluster.adapt``.

An autoscaler that can never start a node would leave every task waiting forever, so ``adapt``
refuses one with a ConfigError that says so (and leaves the cluster as it was).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.scaling.node_types import NodeType


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_nodes": 2.5}, "max_nodes must be a whole number >= 0, got 2.5"),
        ({"max_nodes": 2.0}, "max_nodes must be a whole number >= 0, got 2.0"),
        ({"max_nodes": True}, "max_nodes must be a whole number >= 0, got True"),
        ({"max_nodes": -1}, "max_nodes must be a whole number >= 0, got -1"),
        ({"max_nodes": "3"}, "max_nodes must be a whole number >= 0, got '3'"),
        ({"min_nodes": -1}, "min_nodes must be a whole number >= 0"),
        ({"min_nodes": 0.5}, "min_nodes must be a whole number >= 0"),
        ({"min_nodes": 3, "max_nodes": 2}, "need 0 <= min_nodes <= max_nodes, got 3..2"),
        ({"workers_per_node": 0}, "workers_per_node must be a whole number >= 1"),
        ({"workers_per_node": 1.5}, "workers_per_node must be a whole number >= 1"),
        ({"workers_per_node": False}, "workers_per_node must be a whole number >= 1"),
        ({"cost": float("nan")}, "cost must be a finite number >= 0, got nan"),
        ({"cost": float("inf")}, "cost must be a finite number >= 0, got inf"),
        ({"cost": -1}, "cost must be a finite number >= 0"),
        ({"cost": True}, "cost must be a finite number >= 0"),
        ({"startup_estimate": float("nan")}, "startup_estimate must be a finite number >= 0"),
        ({"startup_estimate": float("-inf")}, "startup_estimate must be a finite number >= 0"),
        ({"startup_estimate": "5s"}, "startup_estimate must be a finite number >= 0"),
        ({"options": ["a"]}, "options must be a mapping"),
        ({"resources": {"cpu": -1}}, "must not be negative"),
    ],
)  # fmt: skip
def test_node_type_fields_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        NodeType("cpu", **kwargs)
    assert message in str(info.value) and "'cpu'" in str(info.value)


@pytest.mark.parametrize("name", ["", "a b", "gpu/large", "x\n", 3, None])
def test_node_type_names_must_be_usable_in_ids_and_file_names(name: Any) -> None:
    with pytest.raises(ConfigError, match="node type name must be letters, digits"):
        NodeType(name)


def test_good_node_types_are_normalised() -> None:
    nt = NodeType("gpu-large.v2", {"cpu": 4, "gpu": 1}, min_nodes=1, max_nodes=3, workers_per_node=2,
                  cost=4, startup_estimate=0)  # fmt: skip
    assert (nt.min_nodes, nt.max_nodes, nt.workers_per_node) == (1, 3, 2)
    assert isinstance(nt.cost, float) and nt.cost == 4.0 and nt.startup_estimate == 0.0
    assert nt.worker_resources == {"cpu": 2.0, "gpu": 0.5}
    assert NodeType("zero", max_nodes=0).max_nodes == 0  # allowed alone: a type kept in reserve


# ---- adapt -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    """A scheduler without workers: adapt() is refused before anything starts."""
    with tidepool.LocalCluster(n_workers=0) as c:
        yield c


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"maximum": 0}, "adapt(maximum=0) can never start a worker"),
        ({"minimum": 0, "maximum": 0}, "adapt(maximum=0) can never start a worker"),
        ({"node_types": [NodeType("a", max_nodes=0), NodeType("b", max_nodes=0)]},
         "can never start a worker: max_nodes is 0 for every node type ('a', 'b')"),
        ({"max_workers": 0}, "with 0 the autoscaler could never start a worker"),
        ({"max_workers": 1.5}, "adapt(max_workers=...) must be a whole number >= 1"),
        ({"maximum": 2.5}, "adapt(maximum=...) must be a whole number >= 0"),
        ({"maximum": True}, "adapt(maximum=...) must be a whole number >= 0"),
        ({"maximum": -1}, "adapt(maximum=...) must be a whole number >= 0"),
        ({"minimum": -1}, "adapt(minimum=...) must be a whole number >= 0"),
        ({"minimum": 1.5}, "adapt(minimum=...) must be a whole number >= 0"),
        ({"minimum": 3, "maximum": 2}, "minimum must not exceed maximum"),
        ({"node_types": [NodeType("a")], "maximum": 3}, "set min_nodes/max_nodes on each node type"),
        ({"node_types": [NodeType("a")], "minimum": 1}, "set min_nodes/max_nodes on each node type"),
        ({"node_types": ["cpu"]}, "must hold NodeType objects"),
        ({"node_types": NodeType("a")}, "must be a list of NodeType"),
        ({"interval": 0}, "adapt(interval=...) must be a positive number of seconds"),
        ({"interval": float("nan")}, "adapt(interval=...) must be a positive number of seconds"),
        # found by a bug hunt: accepted, then every step failed, launches were all given up, or the
        # cost limits cut every launch to 0: tasks waited for ever
        ({"maximum": 2, "forecast_interval": "5"}, "forecast_interval must be a finite number of seconds > 0"),
        ({"maximum": 2, "launch_timeout": -1}, "launch_timeout must be a finite number of seconds > 0"),
        ({"maximum": 2, "backoff_base": -5}, "backoff_base must be a finite number of seconds > 0"),
        ({"maximum": 2, "max_type_failures": 0}, "max_type_failures must be a whole number >= 1"),
        ({"maximum": 2, "manage_foreign": "no"}, "manage_foreign must be True or False"),
        ({"maximum": 2, "policy": "cheapest"}, "policy must be a callable"),
        ({"maximum": 2, "journal": 3}, "adapt(journal=...) takes a file path or a Journal"),
        ({"node_types": [NodeType("cpu", {"cpu": 1}, max_nodes=2, cost=1.0)], "max_cost_per_hour": 0.5},
         "max_cost_per_hour 0.5 is below the cost of the cheapest node type ('cpu': 1 per node-hour)"),
        ({"node_types": [NodeType("cpu", {"cpu": 1}, max_nodes=2, cost=1.0)], "budget": 0.001},
         "budget 0.001 is below what one node costs at the least"),
    ],
)  # fmt: skip
def test_adapt_that_cannot_work_is_refused_at_once(cluster: tidepool.LocalCluster, kwargs: dict[str, Any],
                                                   message: str) -> None:  # fmt: skip
    with pytest.raises(ConfigError) as info:
        cluster.adapt(**kwargs)
    assert message in str(info.value)
    assert cluster.autoscaler is None  # nothing started: a corrected call still works


def test_adapt_from_a_file_whose_node_types_can_never_launch(cluster: tidepool.LocalCluster,
                                                            tmp_path: Path) -> None:  # fmt: skip
    path = tmp_path / "cluster.toml"
    path.write_text("[[node_types]]\nname = 'cpu'\nmax_nodes = 0\n")
    with pytest.raises(ConfigError, match=r"max_nodes is 0 for every node type \('cpu'\)"):
        cluster.adapt(config=str(path))
    assert cluster.autoscaler is None


@pytest.mark.parametrize("n", [2.5, -1, True, "2"])
def test_local_cluster_worker_count_must_be_a_whole_number(n: Any) -> None:
    with pytest.raises(ConfigError, match="n_workers must be a whole number >= 0"):
        tidepool.LocalCluster(n_workers=n)


@pytest.mark.parametrize("slots", [0, -1, 1.5, True])
def test_local_cluster_slots_must_be_a_whole_number_of_at_least_one(slots: Any) -> None:
    """Before: ``slots=0`` started a cluster whose workers could run nothing; every task waited and
    ended in InfeasibleTaskError a minute later (the CLI's ``--slots 0`` was refused)."""
    with pytest.raises(ConfigError, match="slots must be a whole number >= 1"):
        tidepool.LocalCluster(n_workers=1, slots=slots)


@pytest.mark.parametrize(("slots", "resources", "match"), [
    (3, {"cpu": 1}, "slots=3 and resources={'cpu': 1} disagree"),
    (None, {"cpu": 0}, "a worker with less than 1 cpu and nothing else runs no default task"),
    (None, {"cpu": 0.5}, "a worker with less than 1 cpu and nothing else runs no default task"),
    (2, {"cpu": "2"}, "cpu must be a number >= 0"),
    (None, {"cpu": -1, "gpu": 1}, "cpu must be a number >= 0"),
])  # fmt: skip
def test_local_cluster_slots_and_cpu_must_agree(slots: Any, resources: dict[str, Any], match: str) -> None:
    """Found by a bug hunt: ``slots=3, resources={"cpu": 1}`` ran one task at a time (and
    ``slots=1, cpu=4`` four), and ``cpu=0`` started workers that could run no default task; both
    without a word."""
    from tidepool.cluster import local_resources

    with pytest.raises(ConfigError, match=re.escape(match)):
        local_resources(slots, resources)
    with pytest.raises(ConfigError, match=re.escape(match)):  # before anything starts
        tidepool.LocalCluster(n_workers=1, slots=slots, resources=resources)


def test_local_cluster_cpu_alone_sets_the_slots() -> None:
    from tidepool.cluster import local_resources

    assert local_resources(None, None) == {"cpu": 1}
    assert local_resources(3, None) == {"cpu": 3}
    assert local_resources(None, {"cpu": 4, "gpu": 1}) == {"cpu": 4, "gpu": 1}
    assert local_resources(4, {"cpu": 4.0}) == {"cpu": 4.0}
    # a review: a GPU-only worker for tasks that ask for cpu 0 worked before the check, and still does
    assert local_resources(None, {"cpu": 0, "gpu": 1}) == {"cpu": 0, "gpu": 1}


@pytest.mark.integration
def test_a_corrected_adapt_after_a_refused_one_scales() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(ConfigError):
            cluster.adapt(maximum=0)
        cluster.adapt(maximum=1)
        assert client.submit(sum, [1, 2, 3]).result(timeout=60) == 6


def test_dask_keyword_names_point_to_tidepools() -> None:
    """Before: ``threads_per_worker=`` listed every accepted keyword without naming ``slots``."""
    with pytest.raises(ConfigError, match=r"Dask's threads_per_worker= is slots= in tidepool"):
        tidepool.LocalCluster(threads_per_worker=2)


@pytest.mark.integration
def test_a_second_adapt_checks_its_keywords_first_then_says_the_first_settings_stay() -> None:
    """Before: any second adapt() said only "already called", hiding a typo such as minimun=."""
    with tidepool.LocalCluster(n_workers=0) as cluster:
        cluster.adapt(maximum=1)
        with pytest.raises(ConfigError, match="did you mean 'minimum'"):
            cluster.adapt(minimun=0)
        with pytest.raises(ConfigError, match="keeps the settings it was started with"):
            cluster.adapt(maximum=2)


@pytest.mark.integration
def test_scale_grows_and_shrinks_a_fixed_pool_as_in_dask_and_refuses_while_adapting() -> None:
    """Before: ``cluster.scale`` did not exist (AttributeError)."""
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        (first,) = cluster.workers
        started = cluster.scale(3)
        assert len(started) == 2 and sorted(cluster.workers) == sorted([first, *started])
        held = client.map(abs, [-1, -2, -3, -4, -5, -6])
        assert client.gather(held, timeout=60) == [1, 2, 3, 4, 5, 6]
        retired = cluster.scale(1)
        assert sorted(retired) == sorted(started) and cluster.workers == [first]  # the newest go
        assert client.gather(held, timeout=60) == [1, 2, 3, 4, 5, 6]  # their values moved first
        assert cluster.scale(1) == []
        with pytest.raises(ConfigError, match="whole number"):
            cluster.scale(-1)
        cluster.adapt(maximum=2)
        with pytest.raises(ConfigError, match="this cluster adapts"):
            cluster.scale(2)


@pytest.mark.parametrize("limit", ["10KB", 1000, "63MiB"])
def test_a_memory_limit_below_what_a_worker_uses_is_refused(limit: Any) -> None:
    """Found by a bug hunt: memory_limit="10KB" started workers that restarted themselves 49 times
    and killed every task; now refused before anything starts."""
    with pytest.raises(ConfigError, match="less than a worker process uses before any task"):
        tidepool.LocalCluster(n_workers=1, memory_limit=limit)


def test_a_worker_refuses_a_limit_it_already_passes() -> None:
    from tidepool.worker.server import Worker

    with pytest.raises(ConfigError, match="below what this worker uses before any task"):
        Worker("tcp://127.0.0.1:1", "0" * 64, memory_limit=1024)


@pytest.mark.parametrize("name", [5, "", b"x"])
def test_a_task_name_must_be_a_non_empty_string(name: Any) -> None:
    """Found by a review: ``tidepool.task(name=5)`` sent a group of 5, which the scheduler refuses at
    the door by closing the connection: every future of the client was lost.  Refused at the call."""
    with pytest.raises(ConfigError, match="name must be a non-empty string"):
        tidepool.task(name=name)(len)
