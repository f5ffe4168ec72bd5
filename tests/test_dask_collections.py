"""Real Dask collections (arrays, dataframes, bags, delayed) computed on a real tidepool cluster and
compared with Dask's synchronous scheduler: a slice of Dask's documented collection behaviour,
written as our own checks of its contract."""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
db = pytest.importorskip("dask.bag")
dd = pytest.importorskip("dask.dataframe")
np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")

import tidepool  # noqa: E402
from tidepool.errors import ConfigError, KeyCollisionError  # noqa: E402
from tidepool.scaling.node_types import NodeType  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client() -> Iterator[tidepool.Client]:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as c:
        yield c


def _array() -> Any:
    return da.random.RandomState(42).random((60, 80), chunks=(15, 20))


def _frame() -> Any:
    rng = np.random.default_rng(1)
    pdf = pd.DataFrame({"k": rng.integers(0, 7, 400), "v": rng.random(400), "w": np.arange(400)})
    return dd.from_pandas(pdf, npartitions=8)


def _bag() -> Any:
    lines = [" ".join(f"w{(i * j) % 13}" for j in range(6)) for i in range(50)]
    return db.from_sequence(lines, npartitions=5)


#: name -> a function building a Dask collection; each is computed on tidepool and synchronously.
CASES: dict[str, Callable[[], Any]] = {
    "array sum": lambda: _array().sum(),
    "array mean and std along an axis": lambda: _array().mean(axis=0) + _array().std(axis=0),
    "array slicing and fancy indexing": lambda: _array()[5:47:3, [1, 7, 30]],
    "array rechunk": lambda: _array().rechunk((20, 40)).T,
    "array matmul": lambda: _array() @ _array().T,
    "array map_blocks": lambda: _array().map_blocks(lambda b: b * 2 + 1, dtype=float),
    "array map_overlap": lambda: _array().map_overlap(lambda b: b - b.mean(), depth=1, boundary="reflect"),
    "array cumsum": lambda: _array().cumsum(axis=1),
    "array argmax and topk": lambda: da.concatenate([_array().argmax(axis=1), da.topk(_array()[0], 3)]),
    "array qr": lambda: da.linalg.qr(da.random.RandomState(3).random((60, 5), chunks=(20, 5)))[1],
    "dataframe groupby agg": lambda: _frame().groupby("k").agg({"v": ["sum", "mean"], "w": "max"}),
    "dataframe groupby tasks shuffle": lambda: _frame().groupby("k").v.apply(
        lambda s: s.sort_values().iloc[0], meta=("v", "f8"), shuffle_method="tasks"),
    "dataframe set_index": lambda: _frame().set_index("w", shuffle_method="tasks").v,
    "dataframe merge": lambda: _frame().merge(_frame()[["w", "v"]].rename(columns={"v": "v2"}), on="w",
                                              shuffle_method="tasks")[["w", "v2"]],
    "dataframe filters and assign": lambda: _frame()[_frame().v > 0.5].assign(x=lambda d: d.v * d.w),
    "dataframe rolling": lambda: _frame().v.rolling(5).mean(),
    "dataframe value_counts and nunique": lambda: _frame().k.value_counts() + _frame().k.nunique(),
    "dataframe describe": lambda: _frame()[["v", "w"]].describe(),
    "bag word count": lambda: _bag().str.split().flatten().frequencies(),
    "bag foldby": lambda: _bag().map(len).foldby(lambda n: n % 3, lambda a, b: a + b, 0),
    "bag groupby tasks": lambda: _bag().map(len).groupby(lambda n: n % 4, shuffle="tasks").map(
        lambda kv: (kv[0], sorted(kv[1]))),
    "bag distinct and pluck": lambda: db.from_sequence([{"a": i % 5} for i in range(40)], npartitions=4
                                                        ).pluck("a").distinct(),
    "delayed graph": lambda: dask.delayed(sum)([dask.delayed(pow)(i, 2) for i in range(10)]),
    # issue 35: metadata that raises when evaluated, and keys holding numpy integers
    "dataframe from_delayed": lambda: _from_delayed().a.sum(),
    "dataframe groupby cov": lambda: _frame().groupby("k").cov(),
    "dataframe groupby corr": lambda: _frame().groupby("k")[["v", "w"]].corr(),
    "array vindex (numpy integer keys)": lambda: da.from_array(np.arange(56).reshape((7, 8)), chunks=(3, 4)
                                                               ).vindex[[0, 1, 6], ::-1],
}


def _part(i: int) -> Any:
    return pd.DataFrame({"a": [i, i + 1, i + 2], "b": [0.5 * i] * 3})


def _from_delayed() -> Any:
    # Dask's from_delayed: an expression whose _meta raises NotImplementedError when evaluated
    return dd.from_delayed([dask.delayed(_part)(i) for i in range(4)], meta={"a": "i8", "b": "f8"})


def _same(got: Any, want: Any) -> None:
    if isinstance(want, (pd.DataFrame, pd.Series)):
        pd.testing.assert_frame_equal(pd.DataFrame(got).sort_index(), pd.DataFrame(want).sort_index())
    elif isinstance(want, np.ndarray) or np.isscalar(want):
        np.testing.assert_allclose(got, want)
    elif isinstance(want, list):
        assert sorted(map(repr, got)) == sorted(map(repr, want))
    else:
        assert got == want


@pytest.mark.parametrize("name", list(CASES))
def test_collection_computes_as_with_dasks_own_scheduler(client: tidepool.Client, name: str) -> None:
    want = CASES[name]().compute(scheduler="sync")
    got = CASES[name]().compute(scheduler=client.get)
    _same(got, want)


def test_all_the_ways_to_name_tidepool_as_dasks_scheduler(client: tidepool.Client) -> None:
    x = _array()
    want = float(x.sum().compute(scheduler="sync"))
    assert float(dask.compute(x.sum(), scheduler=client)[0]) == pytest.approx(want)
    with client.as_dask_scheduler():
        assert float(x.sum().compute()) == pytest.approx(want)
        a, b = dask.compute(x.sum(), x.max())
    assert float(a) == pytest.approx(want) and float(b) == pytest.approx(float(x.max().compute(scheduler="sync")))
    assert float(client.compute(x.sum()).result()) == pytest.approx(want)
    f1, f2 = client.compute([x.sum(), x.min()])
    assert float(f2.result()) == pytest.approx(float(x.min().compute(scheduler="sync")))


def test_compute_takes_sync_and_dicts_and_lists_mixing_collections_with_plain_values(
        client: tidepool.Client) -> None:  # fmt: skip
    """Dask's ``Client.compute`` shapes.  Before: ``sync=True`` was dropped as an unknown option (a
    pending future came back), and a dict or a list with a plain value was refused with "found no
    delayed values"."""
    x = da.arange(100, chunks=10)
    assert int(client.compute(x.sum(), sync=True)) == 4950
    out = client.compute({"total": x.sum(), "top": x.max()})
    assert set(out) == {"total", "top"} and all(isinstance(f, tidepool.Future) for f in out.values())
    assert client.gather(out) == {"total": 4950, "top": 99}
    mixed = client.compute([x.sum(), 5], sync=True)
    assert mixed == [4950, 5]
    assert client.compute((x.min(), "label"), sync=True) == (0, "label")

    @tidepool.task
    def one() -> int:
        return 1

    assert client.compute({"one": one()}, sync=True) == {"one": 1}  # tidepool tasks take sync too
    with pytest.raises(ConfigError, match="two calls"):
        client.compute([x.sum(), one()])


def test_tidepool_futures_inside_dask_graphs(client: tidepool.Client) -> None:
    fut = client.submit(abs, -5)
    assert dask.delayed(add_two)(fut, 2).compute(scheduler=client.get) == 7  # inline argument
    assert client.get({"f": fut, "g": (add_two, "f", 1)}, "g") == 6  # a graph value


def add_two(a: int, b: int) -> int:
    return a + b


def test_get_takes_nested_keys_and_legacy_graphs(client: tidepool.Client) -> None:
    dsk = {"a": 1, "b": (pow, "a", 2), ("c", 0): (sum, ["a", "b"]), "d": (max, "b", 7)}
    assert client.get(dsk, "b") == 1
    assert client.get(dsk, [["a", ("c", 0)], "d"]) == ((1, 2), 7)


def count_call(block: Any, path: str) -> Any:
    with open(path, "a") as f:
        f.write(f"{block.shape}\n")
    return block + 1


def test_persist_keeps_chunks_on_workers_and_later_computes_reuse_them(client: tidepool.Client,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    calls = tmp_path / "calls"
    runs = lambda: calls.read_text().count("(10, 10)") if calls.exists() else 0  # noqa: E731 - on workers
    x = da.ones((40, 40), chunks=(10, 10)).map_blocks(count_call, str(calls), dtype=float)
    xp = client.persist(x)
    values = list(dict(xp.__dask_graph__()).values())
    assert len(values) == 16 and all(isinstance(v, tidepool.Future) for v in values)
    tidepool.wait(values)
    assert runs() == 16
    assert float(xp.sum().compute(scheduler=client.get)) == 3200.0
    assert float((xp * 2).mean().compute(scheduler=client.get)) == 4.0
    with client.as_dask_scheduler():
        (xp2,) = dask.persist(x)  # the same keys: the chunks held for xp are shared, not recomputed
        assert float(xp2.max().compute()) == 2.0
        assert float(x.persist().min().compute()) == 2.0
    assert runs() == 16
    del xp, xp2, values
    gc.collect()
    assert float(x.sum().compute(scheduler=client.get)) == 3200.0  # nothing held: computed again
    assert runs() == 32


def test_a_failing_block_raises_its_own_exception(client: tidepool.Client) -> None:
    def boom(b: Any) -> Any:
        raise ValueError("block went wrong")

    with pytest.raises(ValueError, match="block went wrong"):
        da.ones(10, chunks=5).map_blocks(boom).sum().compute(scheduler=client.get)
    # the client stays usable
    assert int(da.ones(10, chunks=5).sum().compute(scheduler=client.get)) == 10


def test_from_delayed_computes_every_way_as_on_dasks_synchronous_scheduler(client: tidepool.Client) -> None:
    want = _from_delayed().a.sum().compute(scheduler="sync")
    assert want == 30
    assert _from_delayed().a.sum().compute(scheduler=client.get) == want
    with client.as_dask_scheduler():
        assert _from_delayed().a.sum().compute() == want
        pd.testing.assert_frame_equal(_from_delayed().compute(), _from_delayed().compute(scheduler="sync"))
    assert client.compute(_from_delayed().a.sum()).result() == want
    persisted = client.persist(_from_delayed())
    assert persisted.b.max().compute(scheduler=client.get) == 1.5


def test_numpy_integer_keys_name_the_same_task_as_python_integers(client: tidepool.Client) -> None:
    dsk = {("x", np.int64(0)): 5, ("y", 0): (add_two, ("x", 0), 1), "z": (add_two, ("y", np.int32(0)), 10)}
    assert client.get(dsk, [("y", np.int64(0)), "z"]) == (6, 16)
    assert client.submit(abs, -2, key=("n", np.int64(3))).key == "('n', 3)"
    # vindex's unoptimised graph keys its merge blocks ("vindex-merge-...", np.int64(0), 0)
    x = np.arange(56).reshape((7, 8))
    picked = da.from_array(x, chunks=(3, 4)).vindex[[0, 1, 6], ::-1]
    (got,) = dask.compute(picked, scheduler=client.get, optimize_graph=False)
    np.testing.assert_array_equal(got, x[[0, 1, 6], ::-1])


def test_options_apply_to_every_task_and_unknown_ones_are_ignored(client: tidepool.Client,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    x = da.ones(10, chunks=5).sum()
    assert int(x.compute(scheduler=client.get, retries=2, priority=3)) == 10
    with caplog.at_level(logging.DEBUG, logger="tidepool.dask.client"):
        # Dask forwards compute() keywords to the scheduler; like Dask's own, tidepool ignores unknown ones
        assert int(x.compute(scheduler=client.get, num_workers=4)) == 10
        assert int(dask.compute(x, scheduler=client.get, num_workers=4, bogus_keyword=1)[0]) == 10
        assert int(client.compute(x, num_workers=4, retries=1).result()) == 10
    ignored = [r.getMessage() for r in caplog.records if "ignores option" in r.getMessage()]
    assert sum("num_workers" in m for m in ignored) <= 1  # once per process, not per call
    with pytest.raises(ConfigError, match="retries must be"):  # known options are still applied
        x.compute(scheduler=client.get, retries="many")
    with pytest.raises(ConfigError, match="apply to Dask collections only"):
        client.persist(tidepool.task(abs)(-1), resources={"gpu": 1})


def test_tuple_and_explicit_keys_in_the_public_api(client: tidepool.Client) -> None:
    f = client.submit(abs, -3, key=("abs-x", 0))
    assert f.key == "('abs-x', 0)" and f.result() == 3
    futs = client.map(abs, [-1, -2], key=[("m", 0), ("m", 1)])
    assert [g.key for g in futs] == ["('m', 0)", "('m', 1)"] and client.gather(futs) == [1, 2]
    absolute = tidepool.task(abs)
    total = tidepool.task(sum)
    a = absolute.options(key="a-explicit")(-5)
    b = absolute(-6, dask_key_name=("b", 1))
    assert (a.key, b.key) == ("a-explicit", "('b', 1)")
    assert client.compute(total.options(key="t")([a, b])).result() == 11
    twin = absolute.options(key="a-explicit")(-7)  # a different task under a key used in one graph
    with pytest.raises(KeyCollisionError, match="a-explicit"):
        client.compute([a, twin])


def fail_once(block: Any, marker: str) -> Any:
    if block.size and not os.path.exists(marker):  # (Dask calls it on an empty block for metadata)
        open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return block


def test_retries_annotation_reruns_a_failed_block(client: tidepool.Client, tmp_path: Path) -> None:
    x = da.ones(4, chunks=4)
    with pytest.raises(RuntimeError, match="first attempt"):
        x.map_blocks(fail_once, str(tmp_path / "a"), dtype=float).sum().compute(scheduler=client.get)
    with dask.annotate(retries=1):
        y = x.map_blocks(fail_once, str(tmp_path / "b"), dtype=float)
    assert float(y.sum().compute(scheduler=client.get)) == 4.0


def on_gpu_node(block: Any) -> Any:
    return np.full(block.shape, 1.0 if tidepool.get_worker().node_type == "gpu" else 0.0)


def test_annotated_blocks_go_to_gpu_nodes_and_cpu_blocks_never_launch_them() -> None:
    cpu = NodeType("cpu", {"cpu": 1}, max_nodes=2, startup_estimate=0.5)
    gpu = NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=1, startup_estimate=0.5, cost=4.0)
    x = da.ones((40, 40), chunks=(10, 10))
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[cpu, gpu])
        assert float(x.map_blocks(on_gpu_node, dtype=float).sum().compute(scheduler=client.get)) == 0.0
        launched = [r["node_type"] for r in cluster.journal.records if r["kind"] == "launch"]  # type: ignore[union-attr]
        assert launched and set(launched) == {"cpu"}
        with dask.annotate(resources={"gpu": 1}):
            g = x.map_blocks(on_gpu_node, dtype=float)
        assert float(g.sum().compute(scheduler=client.get)) == 1600.0  # every block on a gpu node
        later = [r["node_type"] for r in cluster.journal.records if r["kind"] == "launch"][len(launched):]  # type: ignore[union-attr]
        assert "gpu" in later


def test_without_dask_installed_the_client_says_how_to_get_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['dask'] = None\n"
            "import tidepool\n"
            "with tidepool.LocalCluster(n_workers=0) as c, tidepool.Client(c) as cl:\n"
            "    try:\n        cl.get({'a': 1}, 'a')\n"
            "    except tidepool.ConfigError as e:\n        print(e)\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ}, cwd=tmp_path)  # fmt: skip
    assert "pip install 'tidepool[dask]'" in r.stdout, r.stderr


def test_a_weak_proxy_result_stays_valid_while_it_is_held(client: tidepool.Client) -> None:
    # Dask's test_use_of_weakref_proxy: a task returns a weak proxy to a partition its own
    # closure keeps alive, and the next task reads it
    def keep(part: Any, seen: list[Any] = []) -> Any:  # noqa: B006 - the closure that keeps it
        seen.append(part)
        return weakref.proxy(part)

    pdf = pd.DataFrame({"g": [0, 0, 1] * 3, "b": [1, 2, 3] * 3})
    ddf = dd.from_pandas(pdf, npartitions=1)
    proxied = ddf.map_partitions(keep, meta=ddf._meta)
    got = proxied["b"].groupby(proxied["g"]).sum().compute(scheduler=client.get)
    pd.testing.assert_series_equal(got.sort_index(), pdf.groupby("g").b.sum())
