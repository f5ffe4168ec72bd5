"""Dask graphs -> tidepool tasks, without a cluster: the converter's output is run here the way a
worker runs it (refs substituted, then ``fn(*args)``), and compared with Dask's own scheduler."""

from __future__ import annotations

import sys
from operator import add, mul
from typing import Any

import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")

from dask._task_spec import Alias, DataNode, Task, TaskRef  # noqa: E402

from tidepool.dask.convert import convert, flatten_keys, materialize, pack, require_dask  # noqa: E402
from tidepool.errors import ConfigError, CycleError, KeyCollisionError  # noqa: E402
from tidepool.futures import Future  # noqa: E402
from tidepool.graph.keys import key_name  # noqa: E402
from tidepool.graph.refs import Ref, collect, substitute  # noqa: E402


class FakeClient:
    """Stands in for a Client: futures only need an owner to compare with."""


def inc(x: int) -> int:
    return x + 1


def run_locally(dsk: Any, keys: list[Any], client: Any = None, known: dict[str, Any] | None = None) -> dict[Any, Any]:
    """Convert, then execute the tasks in order as a worker would; Dask key -> value."""
    client = client or FakeClient()
    graph, ann = materialize(dsk)
    conv = convert(graph, keys, client, ann)
    store: dict[str, Any] = dict(known or {})
    for t in conv.tasks:
        for ref in collect(t.args, Ref):
            assert ref.key in store, f"{t.key} ran before its dependency {ref.key}"
        store[t.key] = t.fn(*substitute(t.args, store))
    return {k: store[conv.names[k]] for k in keys}


def test_legacy_tuple_graph_is_culled_ordered_and_correct() -> None:
    dsk = {"x": 1, "y": (inc, "x"), "z": (add, "y", "x"), "unused": (inc, "z"), ("t", 0): (mul, "z", 10)}
    graph, _ = materialize(dsk)
    conv = convert(graph, ["z"], FakeClient())
    assert [t.key for t in conv.tasks] == ["x", "y", "z"]  # dependencies first, "unused" culled
    assert run_locally(dsk, ["z", ("t", 0)]) == {"z": 3, ("t", 0): 30}
    assert dask.get(dsk, ["z", ("t", 0)]) == (3, 30)


def test_tuple_keys_keep_dask_names_and_task_names_are_key_prefixes() -> None:
    x = da.arange(12, chunks=4)
    y = (x + 1).sum()
    graph, ann = materialize(dict(y.__dask_graph__()))
    conv = convert(graph, [y.__dask_keys__()[0] if isinstance(y.__dask_keys__(), list) else y.__dask_keys__()],
                   FakeClient(), ann)  # fmt: skip
    by_key = {t.key: t for t in conv.tasks}
    tuple_keys = [k for k in graph if isinstance(k, tuple)]
    assert tuple_keys
    for k in tuple_keys:
        if k in conv.names:
            assert conv.names[k] == str(k)
            assert by_key[str(k)].options.name == k[0].rsplit("-", 1)[0]  # Dask's key_split


def test_alias_runs_nothing_and_resolves_chains() -> None:
    graph = {"a": DataNode("a", 5), "b": Alias("b", "a"), "c": Alias("c", "b"),
             "d": Task("d", inc, TaskRef("c"))}  # fmt: skip
    conv = convert(graph, ["c", "d"], FakeClient())
    assert [t.key for t in conv.tasks] == ["a", "d"]
    assert conv.names["b"] == conv.names["c"] == "a"
    assert run_locally(graph, ["c", "d"]) == {"c": 5, "d": 6}


def test_a_future_in_a_data_node_is_used_not_recomputed() -> None:
    client = FakeClient()
    fut: Future[Any] = Future("held-1", client)  # type: ignore[arg-type]
    graph = {"p": DataNode("p", fut), "q": Task("q", inc, TaskRef("p"))}
    conv = convert(graph, ["q"], client)
    assert [t.key for t in conv.tasks] == ["q"] and conv.names["p"] == "held-1"
    assert run_locally(graph, ["q"], client, known={"held-1": 41}) == {"q": 42}
    with pytest.raises(ConfigError, match="another client"):
        convert(graph, ["q"], FakeClient())


def test_a_future_inside_a_task_becomes_a_dependency_delivered_with_it() -> None:
    client = FakeClient()
    fut: Future[Any] = Future("inline-7", client)  # type: ignore[arg-type]
    graph = {"r": Task("r", add, fut, 1)}  # the future sits in the arguments, not as a TaskRef
    conv = convert(graph, ["r"], client)
    (task,) = conv.tasks
    assert [r.key for r in collect(task.args, Ref)] == ["inline-7"]
    assert run_locally(graph, ["r"], client, known={"inline-7": 9}) == {"r": 10}


def test_bad_graphs_are_refused_with_the_key_named() -> None:
    c = FakeClient()
    with pytest.raises(ConfigError, match="'nope' is not in the Dask graph"):
        convert({"a": DataNode("a", 1)}, ["nope"], c)
    with pytest.raises(ConfigError, match="depends on 'ghost'"):
        convert({"a": Task("a", inc, TaskRef("ghost"))}, ["a"], c)
    with pytest.raises(CycleError, match="cycle"):  # the class errors.md names for a cycle
        convert({"a": Task("a", inc, TaskRef("b")), "b": Task("b", inc, TaskRef("a"))}, ["a"], c)
    with pytest.raises(CycleError, match="cycle"):
        convert({"a": Task("a", inc, TaskRef("a"))}, ["a"], c)
    with pytest.raises(ConfigError, match="needs a Dask graph"):
        materialize(42)


def test_two_dask_keys_with_one_scheduler_name_are_refused_not_merged() -> None:
    # found by a bug hunt: 1 and "1" (or ("x", 0) and "('x', 0)") became one task, and client.get
    # returned one task's value for both, or a sum of the wrong inputs
    c = FakeClient()
    with pytest.raises(KeyCollisionError, match="the Dask keys 1 and '1' are different tasks"):
        convert(materialize({1: "int-key", "1": "str-key"})[0], [1, "1"], c)
    g2 = {("x", 0): 10, "('x', 0)": 20, "total": (add, ("x", 0), "('x', 0)")}
    with pytest.raises(KeyCollisionError, match="scheduler key \"\\('x', 0\\)\""):
        convert(materialize(g2)[0], ["total"], c)
    assert run_locally({("x", 0): 10, ("x", 1): 20, "total": (add, ("x", 0), ("x", 1))}, ["total"])["total"] == 30


def test_annotations_and_defaults_become_task_options() -> None:
    graph = {"g": Task("g", inc, 1), "h": Task("h", inc, TaskRef("g"))}
    ann = {"resources": {"g": {"gpu": 1}}, "retries": {"g": 3}, "priority": {"h": 5},
           "workers": {"h": ["w-1"]}, "allow_other_workers": {"h": True}, "custom": {"g": "x"}}  # fmt: skip
    conv = convert(graph, ["h"], FakeClient(), ann, {"retries": 1})
    g, h = conv.tasks
    assert g.options.resources == {"gpu": 1.0} and g.options.retries == 3 and g.options.priority == 0
    assert h.options.resources == {} and h.options.retries == 1 and h.options.priority == 5
    assert h.options.workers == ("w-1",) and h.options.loose
    with pytest.raises(ConfigError, match="bad task options"):
        convert(graph, ["g"], FakeClient(), {"priority": {"g": "high"}})


def test_annotated_array_blocks_keep_their_resources_through_optimisation() -> None:
    x = da.ones((40, 40), chunks=(10, 10))
    with dask.annotate(resources={"gpu": 1}):
        y = x.map_blocks(lambda b: b * 2)
    total = y.sum()
    expr = dask.base.collections_to_expr([total], True).optimize()
    graph, ann = materialize(expr)
    conv = convert(graph, flatten_keys(expr.__dask_keys__()), FakeClient(), ann)
    on_gpu = [t for t in conv.tasks if t.options.resources.get("gpu")]
    assert len(on_gpu) == 16  # one per block (Dask's own fusion would have dropped them all)
    assert all(not t.options.resources for t in conv.tasks if t not in on_gpu)


@pytest.mark.parametrize("finalize", [False, True])
def test_an_annotated_bag_keeps_its_resources_through_its_own_fusion(finalize: bool) -> None:
    # found by a bug hunt: a bag's optimiser fuses its graph as a plain dict whatever the fuse
    # setting; the annotations were dropped, and a "gpu" bag ran on CPU workers
    db = pytest.importorskip("dask.bag")
    from dask._expr import FinalizeCompute

    with dask.annotate(resources={"gpu": 1}):
        bag = db.from_sequence(range(20), npartitions=5).map(inc)
    expr = dask.base.collections_to_expr([bag], True)
    expr = (FinalizeCompute(expr) if finalize else expr).optimize()
    graph, ann = materialize(expr)
    conv = convert(graph, flatten_keys(expr.__dask_keys__()), FakeClient(), ann)
    on_gpu = [t for t in conv.tasks if t.options.resources.get("gpu")]
    assert len(on_gpu) == 10, [t.key for t in conv.tasks]  # from_sequence and map, per partition (not fused)
    # an unannotated step after it is not on the gpu, and does not take the annotated ones with it
    dbl = bag.map(inc)
    expr = dask.base.collections_to_expr([dbl], True)
    expr = (FinalizeCompute(expr) if finalize else expr).optimize()
    graph, ann = materialize(expr)
    conv = convert(graph, flatten_keys(expr.__dask_keys__()), FakeClient(), ann)
    assert len([t for t in conv.tasks if t.options.resources.get("gpu")]) == 10
    assert len(conv.tasks) == 15 + finalize
    # an unannotated bag computed with an annotated array keeps its fusion (the second review)
    plain = db.from_sequence(range(20), npartitions=5).map(inc).map(inc)
    with dask.annotate(priority=5):
        arr = da.ones(4, chunks=2) + 1
    both = dask.base.collections_to_expr([plain, arr], True).optimize()
    graph, ann = materialize(both)
    fused = convert(graph, flatten_keys(both.__dask_keys__()), FakeClient(), ann)
    assert not [t.key for t in fused.tasks if t.key.startswith("('inc-")]  # the maps fused into from_sequence
    first = flatten_keys(expr.__dask_keys__())[0]
    assert run_locally(expr, [first])[first] == (list(range(2, 22)) if finalize else [2, 3, 4, 5])  # inc twice


def test_results_take_the_shape_of_the_keys() -> None:
    keys = [["a", "b"], "c"]
    assert flatten_keys(keys) == ["a", "b", "c"]
    assert pack(keys, {"a": 1, "b": 2, "c": 3}) == ((1, 2), 3)
    assert pack("a", {"a": 1}) == 1


def test_key_names() -> None:
    assert key_name("x") == "x"
    assert key_name(("x-1", 0, 2)) == "('x-1', 0, 2)"
    assert key_name(3) == "3"
    np = pytest.importorskip("numpy")
    # numpy scalars name the same task as the Python numbers they equal (Dask's vindex keys)
    assert key_name(("x-1", np.int64(0), np.uint8(2))) == key_name(("x-1", 0, 2))
    assert key_name(("x", np.float64(1.5), (np.str_("y"), np.int32(4)))) == "('x', 1.5, ('y', 4))"
    assert key_name(np.int16(7)) == "7"
    for bad in (None, ["x"], {"x": 1}, (), ("x", [1]), True, ("x", np.bool_(True)), ("x", None)):
        with pytest.raises(ConfigError, match="task key"):
            key_name(bad)


def test_without_dask_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dask", None)
    with pytest.raises(ConfigError, match=r"pip install 'tidepool\[dask\]'"):
        require_dask()


def test_a_high_level_graph_passes_its_layer_annotations() -> None:
    x = da.ones(8, chunks=4)
    with dask.annotate(retries=4):
        y = x + 1
    hlg = y.__dask_graph__()
    graph, ann = materialize(hlg)
    conv = convert(graph, list(y.__dask_keys__()), FakeClient(), ann)
    retried = {t.key for t in conv.tasks if t.options.retries == 4}
    assert retried == {str(k) for k in y.__dask_keys__()}
    assert run_locally(hlg, list(y.__dask_keys__()))[y.__dask_keys__()[0]].tolist() == [2.0] * 4
