"""What a Dask user hit on the first day with collections (a bug hunt): the shuffle that loses rows
across hosts, a computation started from inside a task, ``wait`` on a persisted collection, and a
progress bar that counted one task.  Real clusters; the host check is fed a fake worker list."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
db = pytest.importorskip("dask.bag")
dd = pytest.importorskip("dask.dataframe")
pd = pytest.importorskip("pandas")

import tidepool  # noqa: E402
from tidepool.dask.client import check_shuffle_storage  # noqa: E402
from tidepool.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture()
def fresh_config() -> Iterator[None]:
    """Dask's configuration as a fresh process has it (no shuffle method chosen), restored after
    (in place: Dask's functions hold the dict itself as a default argument)."""
    saved = copy.deepcopy(dask.config.config)
    dask.config.config.get("dataframe", {}).get("shuffle", {}).pop("method", None)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


@pytest.fixture(scope="module")
def client() -> Iterator[tidepool.Client]:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as c:
        yield c


def partd_keys(collection: Any) -> list[Any]:
    return [k for k in dict(collection.__dask_graph__()) if str(k[0] if isinstance(k, tuple) else k).startswith(("partd-", "zpartd-"))]


def test_a_client_makes_dasks_default_shuffle_tasks_not_each_workers_local_disk(
        fresh_config: None, client: tidepool.Client) -> None:  # fmt: skip
    """Dask picks its "disk" shuffle (files in each worker's own temporary directory) when no Dask
    distributed client exists; on workers of several hosts, a default set_index or bag groupby then
    lost 40-50% of its rows without an error."""
    assert dask.utils.get_default_shuffle_method() == "disk"  # what Dask does on its own
    with tidepool.Client(client.cluster):
        assert dask.utils.get_default_shuffle_method() == "tasks"
        grouped = db.from_sequence(range(40), npartitions=4).groupby(lambda i: i % 3)
        assert not partd_keys(grouped)
        assert sorted((k, sorted(v)) for k, v in grouped.compute(scheduler=client)) == [
            (r, [i for i in range(40) if i % 3 == r]) for r in range(3)]  # fmt: skip


def test_a_chosen_shuffle_method_is_left_alone(fresh_config: None, client: tidepool.Client) -> None:
    with dask.config.set({"dataframe.shuffle.method": "disk"}):
        with tidepool.Client(client.cluster):
            assert dask.utils.get_default_shuffle_method() == "disk"


def test_a_frame_shuffled_on_tidepool_uses_tasks_even_if_built_before_any_client(
        fresh_config: None, client: tidepool.Client, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pdf = pd.DataFrame({"k": [i % 5 for i in range(100)], "v": range(100)})
    shuffled = dd.from_pandas(pdf, npartitions=4).shuffle("k")  # the method is chosen when optimized
    seen: list[bool] = []
    monkeypatch.setattr("tidepool.dask.client.check_shuffle_storage",
                        lambda c, graph: seen.append(any(str(k[0] if isinstance(k, tuple) else k).startswith("zpartd-")
                                                         for k in graph)))  # fmt: skip
    (future,) = [client.compute(shuffled)]
    assert sorted(future.result(timeout=60)["v"]) == list(range(100))
    assert seen and not any(seen)  # no local-disk storage task was sent


def test_a_disk_shuffle_on_workers_of_several_hosts_is_refused_with_what_to_do() -> None:
    grouped = db.from_sequence(range(10), npartitions=2).groupby(lambda i: i % 2, shuffle="disk")
    graph = dict(grouped.__dask_graph__())
    assert partd_keys(grouped)

    def fake(*addresses: str) -> Any:
        return SimpleNamespace(scheduler_info=lambda: {"workers": [{"address": a} for a in addresses]})

    check_shuffle_storage(fake("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4001"), graph)  # one host: fine
    with pytest.raises(ConfigError, match=r"local disk .*2 hosts.*shuffle_method='tasks'"):
        check_shuffle_storage(fake("tcp://10.0.0.1:4000", "tcp://10.0.0.2:4000"), graph)


def compute_inside(n: int) -> int:
    return int(da.arange(n, chunks=10).sum().compute(scheduler=tidepool.get_client()))


def test_a_task_computing_a_collection_on_get_client_gives_its_slot_back(client: tidepool.Client) -> None:
    """One worker, one slot: before, the task held the slot its own computation needed, for ever."""
    assert client.submit(compute_inside, 100).result(timeout=60) == sum(range(100))


def test_wait_takes_a_persisted_collection_and_refuses_what_is_not_futures(client: tidepool.Client) -> None:
    frame = client.persist(dd.from_pandas(pd.DataFrame({"v": range(10)}), npartitions=2))
    array = client.persist(da.ones(200_000, chunks=50_000))  # was iterated element by element
    tidepool.wait(frame, timeout=60)
    done, not_done = tidepool.wait(array, timeout=60)
    assert len(done) == 4 and not not_done
    with pytest.raises(ConfigError, match="not persisted.*client.persist"):
        tidepool.wait(da.ones(10, chunks=5), timeout=5)
    with pytest.raises(ConfigError, match="takes futures, got int"):
        tidepool.wait([1, 2], timeout=5)
    with pytest.raises(ConfigError, match="got str"):
        tidepool.wait("not futures", timeout=5)


def test_a_progress_bar_of_a_collection_counts_its_tasks(client: tidepool.Client,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    x = da.arange(100, chunks=10).sum()  # 10 blocks and their reduction (fused as Dask optimizes)
    assert x.compute(scheduler=client.get, progress=True) == sum(range(100))
    out = capsys.readouterr().out
    done = re.search(r"(\d+)/(\d+) done", out)
    assert done is not None and int(done[1]) == int(done[2]) > 10, out  # before: "1/1 done"


def _times_ten(x: int) -> int:
    return x * 10


def _plus(x: int, y: int) -> int:
    return x + y


def test_a_dask_key_reused_by_the_next_compute_is_a_new_task_not_a_collision(client: tidepool.Client) -> None:
    # found by a bug hunt: the second compute under a key the first one's (dropped) future still
    # held in the client's release queue was refused with KeyCollisionError
    from operator import add

    with client.as_dask_scheduler():
        got = [dask.delayed(_times_ten)(x, dask_key_name="result").compute() for x in range(3)]
    assert got == [0, 10, 20]
    for _ in range(3):
        assert client.get({"a": 1, "b": (add, "a", 10)}, "b") == 11
        assert client.get({"a": 1, "b": (_plus, "a", "a")}, "b") == 2
    # a key still held by a live future stays refused for a different task
    held = client.compute(dask.delayed(_times_ten)(1, dask_key_name="held"))
    assert held.result() == 10
    with pytest.raises(tidepool.KeyCollisionError):
        with client.as_dask_scheduler():
            dask.delayed(_times_ten)(2, dask_key_name="held").compute()
    assert held.result() == 10
