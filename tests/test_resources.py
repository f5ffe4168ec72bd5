"""Resources on real workers: placement never oversubscribes what a worker advertises."""

from __future__ import annotations

import time

import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.resources import parse_bytes, parse_resources
from tidepool.scaling.node_types import NodeType

pytestmark = pytest.mark.integration


def span(seconds: float) -> tuple[float, float, int]:
    import os

    start = time.monotonic()  # one system-wide clock for every worker process; never steps back
    time.sleep(seconds)
    return start, time.monotonic(), os.getpid()


def max_overlap(spans: list[tuple[float, float, int]]) -> int:
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    n = best = 0
    for _, d in events:
        n += d
        best = max(best, n)
    return best


def test_tasks_never_use_more_than_a_worker_advertises() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.add_workers(1, node_type=NodeType("box", {"cpu": 4, "gpu": 1, "memory": "1GB"}))
        gpu = client.map(span, [0.15] * 4, resources={"gpu": 1})
        big = client.map(span, [0.15] * 4, resources={"cpu": 1, "memory": "600MB"})
        cpu = client.map(span, [0.15] * 8, resources={"cpu": 2})
        g, b, c = client.gather(gpu), client.gather(big), client.gather(cpu)
    assert max_overlap(g) == 1  # one GPU: GPU tasks run one at a time
    assert max_overlap(b) == 1  # 600 MB each in 1 GB: one at a time
    assert max_overlap(c) <= 2  # 2 CPUs each on 4 CPUs: at most two together
    assert max_overlap(g + c) <= 4


def test_resource_amounts_are_validated_with_clear_messages() -> None:
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30) and parse_bytes(10) == 10
    assert parse_resources({"cpu": 2, "memory": "4GB"}) == {"cpu": 2.0, "memory": 4e9}
    # {"cpu": "two"}: "must be a number" (a bug hunt found "cannot read 'two' as a byte amount")
    for bad, msg in [({"cpu": -1}, "must not be negative"), ({"cpu": "two"}, "resource 'cpu' must be a number"),
                     ({"memory": "lots"}, "byte amount"),
                     ({"": 1}, "non-empty"), ({"gpu": True}, "must be a finite number")]:  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            parse_resources(bad)
    with pytest.raises(ConfigError, match="resources must be"):
        tidepool.task(resources=[1])(span)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_resources_are_rejected_at_submit(value: float) -> None:
    """Before: NaN was rejected but ``inf`` was accepted (and no worker could ever offer it)."""
    from tidepool.graph.delayed import TaskOptions

    with pytest.raises(ConfigError, match="'cpu' must be a finite number"):
        TaskOptions({"cpu": value})
    with pytest.raises(ConfigError, match="finite"):
        parse_resources({"memory": value})


def test_a_worker_given_slots_and_a_different_cpu_is_refused() -> None:
    # found by a bug hunt: `tidepool worker --slots 4 --resources '{"cpu": 2, "gpu": 1}'` ran with
    # cpu=4 and said nothing (LocalCluster refused the same)
    import pytest

    from tidepool.errors import ConfigError
    from tidepool.resources import worker_resources

    with pytest.raises(ConfigError, match=r"slots=4 \(--slots\) and resources cpu=2 \(--resources\) disagree"):
        worker_resources({"cpu": 2, "gpu": 1}, slots=4)
    assert worker_resources({"cpu": 4, "gpu": 1}, slots=4) == {"cpu": 4.0, "gpu": 1.0}
    assert worker_resources({"gpu": 1}, slots=3) == {"cpu": 3.0, "gpu": 1.0}
