"""WfCommons WfFormat traces as simulator inputs (sim/wfformat.py), on the real traces in
``<repo>/../shared/workloads/wfinstances``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tidepool.errors import ConfigError
from tidepool.sim.wfformat import fit_memory, from_wfformat, is_wfformat
from tidepool.sim.workload import load_workload


def _traces_dir() -> Path | None:
    root = Path(__file__).resolve().parents[1]
    for up in (root.parent, root.parent.parent):
        cand = up / "shared" / "workloads" / "wfinstances"
        if cand.is_dir():
            return cand
    return None


TRACES = _traces_dir()
needs_traces = pytest.mark.skipif(TRACES is None, reason="no ../shared/workloads/wfinstances beside the repository")
#: (tasks, sum of runtimes s) per trace, from the README of the traces
EXPECTED = {
    "montage-chameleon-2mass-01d-001.json": (103, 363), "montage-chameleon-2mass-05d-001.json": (1738, 8695),
    "montage-chameleon-dss-15d-001.json": (2122, 78088), "1000genome-chameleon-10ch-250k-001.json": (410, 25978),
    "1000genome-chameleon-22ch-100k-001.json": (572, 38867), "blast-chameleon-medium-001.json": (303, 31513),
    "bwa-chameleon-medium-001.json": (1004, 3612),
}  # fmt: skip


@needs_traces
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_trace_reads_with_its_tasks_runtimes_parents_and_sizes(name: str) -> None:
    assert TRACES is not None
    path = TRACES / name
    data = json.loads(path.read_text())
    assert is_wfformat(data)
    wl = load_workload(str(path))
    tasks = list(wl.tasks())
    n, seconds = EXPECTED[name]
    assert len(tasks) == n
    assert wl.total_seconds() == pytest.approx(seconds, abs=1.0)
    spec = {t["id"]: t for t in data["workflow"]["specification"]["tasks"]}
    runs = {t["id"]: t for t in data["workflow"]["execution"]["tasks"]}
    sizes = {f["id"]: f["sizeInBytes"] for f in data["workflow"]["specification"]["files"]}
    seen: set[str] = set()
    for t in tasks:
        assert set(t.deps) <= seen, f"{t.key} comes before an input"  # inputs first
        seen.add(t.key)
        assert set(t.deps) == set(spec[t.key]["parents"])
        assert t.duration == pytest.approx(runs[t.key]["runtimeInSeconds"])
        assert t.nbytes == max(8, sum(sizes[f] for f in spec[t.key]["outputFiles"]))
        assert not re.search(r"_ID\d+$", t.group)  # the program, not the task
        mem = runs[t.key].get("memoryInBytes")
        assert (t.resources or {}).get("memory") == (float(mem) if mem else None)
    assert set(wl.stages[0].wanted) == {k for k, t in spec.items() if not t.get("children")}


@needs_traces
def test_simulate_runs_a_trace_and_says_memory_is_not_placed_on(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:  # fmt: skip
    from tidepool.cli import main

    assert TRACES is not None
    trace = TRACES / "montage-chameleon-2mass-01d-001.json"
    rc = main(["simulate", str(trace), "--cluster", "cloud:50:4", "--policy", "default", "--policy", "dask",
               "--out", str(tmp_path), "--no-plot", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"^default\s+\d+\.\d\d\s", out, re.M) and re.search(r"^dask\s+\d+\.\d\d\s", out, re.M)
    assert "memoryInBytes" in out and "declare no memory" in out


@needs_traces
def test_memory_needs_stay_when_node_types_declare_memory() -> None:
    assert TRACES is not None
    wl = load_workload(str(TRACES / "blast-chameleon-medium-001.json"))
    fit_memory(wl, [64e9])
    assert all(t.resources and t.resources["memory"] > 0 for t in wl.tasks())
    fit_memory(wl, [0.0])
    assert all(not t.resources for t in wl.tasks())
    assert any("declare no memory" in n for n in wl.notes)


def _doc(tasks: list[dict[str, object]], runs: list[dict[str, object]]) -> dict[str, object]:
    return {"name": "t", "schemaVersion": "1.5",
            "workflow": {"specification": {"tasks": tasks, "files": [{"id": "o", "sizeInBytes": 1000}]},
                         "execution": {"tasks": runs}}}  # fmt: skip


def test_a_trace_out_of_order_is_sorted_and_scale_divides_runtimes() -> None:
    doc = _doc([{"id": "b_ID2", "parents": ["a_ID1"], "outputFiles": []},
                {"id": "a_ID1", "parents": [], "outputFiles": ["o"], "coreCount": 1}],
               [{"id": "a_ID1", "runtimeInSeconds": 10.0, "coreCount": 4}, {"id": "b_ID2", "runtimeInSeconds": 4.0}])  # fmt: skip
    wl = from_wfformat(doc, scale=2.0)
    a, b = list(wl.tasks())
    assert (a.key, a.duration, a.nbytes, a.resources, a.group) == ("a_ID1", 5.0, 1000, {"cpu": 4.0}, "a")
    assert (b.key, b.deps, b.duration) == ("b_ID2", ("a_ID1",), 2.0)


def test_broken_traces_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="cycle"):
        from_wfformat(_doc([{"id": "a", "parents": ["b"]}, {"id": "b", "parents": ["a"]}], []))
    with pytest.raises(ConfigError, match="parents that are not tasks"):
        from_wfformat(_doc([{"id": "a", "parents": ["zz"]}], []))
    with pytest.raises(ConfigError, match="non-empty list"):
        from_wfformat({"workflow": {"specification": {"tasks": []}}})
    assert not is_wfformat({"tasks": [], "workflow": {}})  # a tidepool graph is not a trace
    # a trace that lost its specification is told so, not that it lacks a tidepool graph's "tasks"
    for doc in ({"workflow": {"execution": {"tasks": []}}, "schemaVersion": "1.5"}, {"workflow": {}}):
        assert is_wfformat(doc)
        with pytest.raises(ConfigError, match=r"needs workflow\.specification\.tasks"):
            from_wfformat(doc)


@pytest.mark.parametrize(("task", "run", "said"), [
    ({}, {"runtimeInSeconds": "abc"}, "task 'a': runtimeInSeconds must be a finite number >= 0, got 'abc'"),
    ({}, {"runtimeInSeconds": [1, 2]}, "runtimeInSeconds must be a finite number"),
    ({}, {"runtimeInSeconds": True}, "runtimeInSeconds must be a finite number"),  # was taken as 1 s
    ({"parents": 5}, {}, "parents must be a list of task ids, got 5"),
    ({"parents": "b"}, {}, "parents must be a list of task ids"),  # was ['b'] read letter by letter
    ({"outputFiles": 5}, {}, "outputFiles must be a list of file ids"),
    ({}, {"coreCount": "4"}, "coreCount must be a finite number"),  # was silently ignored
    ({}, {"memoryInBytes": -5}, "memoryInBytes must be a finite number >= 0, got -5"),
])  # fmt: skip
def test_a_trace_field_of_the_wrong_type_is_a_config_error_naming_task_and_field(
        task: dict[str, object], run: dict[str, object], said: str) -> None:  # fmt: skip
    # found by a bug hunt: ValueError/TypeError/OverflowError tracebacks, or values silently misread
    doc = _doc([{"id": "a", "parents": [], "outputFiles": [], **task}], [{"id": "a", "runtimeInSeconds": 1, **run}])
    with pytest.raises(ConfigError, match=re.escape(said)):
        from_wfformat(doc)


def test_file_sizes_of_the_wrong_type_are_config_errors() -> None:
    for size in ("4MB", float("inf"), -1000, [1]):
        doc = _doc([{"id": "a", "parents": [], "outputFiles": ["o"]}], [{"id": "a", "runtimeInSeconds": 1}])
        doc["workflow"]["specification"]["files"] = [{"id": "o", "sizeInBytes": size}]  # type: ignore[index]
        with pytest.raises(ConfigError, match="file 'o': sizeInBytes must be a finite number >= 0"):
            from_wfformat(doc)


def test_a_wfformat_1_4_trace_names_parents_by_task_name() -> None:
    # found by a bug hunt: 1.4 tasks have both a name and an id, and parents refer to names
    doc = {"name": "t", "schemaVersion": "1.4", "workflow": {"tasks": [
        {"name": "a_ID1", "id": "ID1", "parents": [], "runtimeInSeconds": 2.0, "files": []},
        {"name": "b_ID2", "id": "ID2", "parents": ["a_ID1"], "runtimeInSeconds": 3.0, "files": []},
    ]}}  # fmt: skip
    a, b = list(from_wfformat(doc).tasks())
    assert (a.key, b.key, b.deps) == ("ID1", "ID2", ("ID1",))


def test_a_cycle_is_named_by_its_members_not_by_the_tasks_stuck_below_it() -> None:
    # found by a bug hunt: a self-loop on 'a' was reported "around ['c', 'd', ...]", tasks that only wait on it
    doc = _doc([{"id": "a", "parents": ["a"]}, {"id": "c", "parents": ["a"]}, {"id": "d", "parents": ["c"]}], [])
    with pytest.raises(ConfigError, match=re.escape("cycle ('a' -> 'a': each needs")):
        from_wfformat(doc)
    doc = _doc([{"id": "x", "parents": []}, {"id": "z", "parents": ["b"]},
                {"id": "a", "parents": ["b"]}, {"id": "b", "parents": ["a", "x"]}], [])  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape("cycle ('b' -> 'a' -> 'b'")):  # not 'z', which waits on it
        from_wfformat(doc)


def test_a_task_measured_twice_or_files_given_as_an_object_are_refused() -> None:
    # found by a bug hunt: the last of two measurements silently won (makespan 110 -> 1,064 s), and
    # files given as an object lost every size
    doc = _doc([{"id": "a", "parents": [], "outputFiles": ["o"]}],
               [{"id": "a", "runtimeInSeconds": 1}, {"id": "a", "runtimeInSeconds": 999}])  # fmt: skip
    with pytest.raises(ConfigError, match="lists task 'a' twice"):
        from_wfformat(doc)
    doc = _doc([{"id": "a", "parents": [], "outputFiles": ["o"]}], [{"id": "a", "runtimeInSeconds": 1}])
    doc["workflow"]["specification"]["files"] = {"o": {"sizeInBytes": 5}}  # type: ignore[index]
    with pytest.raises(ConfigError, match="specification.files must be a list, got dict"):
        from_wfformat(doc)


def test_a_1_5_trace_does_not_resolve_a_dangling_parent_id_by_task_name() -> None:
    # the third review: a dangling 1.5 parent id equal to another task's name was silently attached
    doc = _doc([{"id": "ID1", "name": "a", "parents": []}, {"id": "ID2", "name": "b", "parents": ["a"]}], [])
    with pytest.raises(ConfigError, match="parents that are not tasks"):
        from_wfformat(doc)


def test_edges_given_only_as_children_are_read() -> None:
    """Found by a bug hunt: a chain written with ``children`` (empty parents) ran as independent
    tasks; an edge is read from either end (given on both, it counts once)."""
    doc = _doc([{"id": "a", "children": ["b"], "outputFiles": []},
                {"id": "b", "parents": [], "children": ["c"], "outputFiles": []},
                {"id": "c", "parents": ["b"], "outputFiles": []}],
               [{"id": k, "runtimeInSeconds": 10.0} for k in "abc"])  # fmt: skip
    by_key = {t.key: t for t in from_wfformat(doc).tasks()}
    assert by_key["b"].deps == ("a",) and by_key["c"].deps == ("b",) and by_key["a"].deps == ()
    with pytest.raises(ConfigError, match="children that are not tasks"):
        from_wfformat(_doc([{"id": "a", "children": ["zz"]}], [{"id": "a", "runtimeInSeconds": 1.0}]))
    with pytest.raises(ConfigError, match="children must be a list"):
        from_wfformat(_doc([{"id": "a", "children": "b"}], [{"id": "a", "runtimeInSeconds": 1.0}]))
