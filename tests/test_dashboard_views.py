"""What the dashboard shows and what it costs, without a browser: the model's counts (recomputed
values are not done twice), its bounded cost (no scan of the task table per request, one snapshot
shared by every reader), the post-mortem model, retirement that asks again only when the pool
changes, and resource-name typos failing at submit."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from tidepool.dashboard.model import DashboardModel
from tidepool.dashboard.replay import ReplayModel
from tidepool.scaling.controller import ControllerView, ScalingController
from tidepool.scaling.node_types import NodeType
from tidepool.scaling.observation import Retired, step_with_state
from tidepool.scaling.snapshot import ClusterSnapshot, ScaleDecision
from tidepool.scheduler import events as ev
from tidepool.scheduler.resource_names import suggestion
from tidepool.testing import StateDriver


class NoScan(dict):  # type: ignore[type-arg]
    """A task table that fails the test if anybody walks it."""

    def __iter__(self) -> Any:
        raise AssertionError("the dashboard walked the whole task table")

    def values(self) -> Any:
        raise AssertionError("the dashboard walked the whole task table")

    def items(self) -> Any:
        raise AssertionError("the dashboard walked the whole task table")


def _model(d: StateDriver, now: list[float], eta_calls: list[int]) -> DashboardModel:
    def eta() -> dict[str, Any]:
        eta_calls.append(1)
        return {"eta": 1.0}

    sched = SimpleNamespace(state=d.state, clock=lambda: now[0], eta=eta, launched_as={})
    return DashboardModel(sched, lambda: None, interval=0.5)


def test_a_recomputed_value_is_not_one_more_task_done() -> None:
    d = StateDriver()
    d.add_worker("a")
    now, calls = [0.0], []
    m = _model(d, now, calls)
    keys = [f"square-{i}" for i in range(4)]

    def send(*events: ev.Event) -> None:
        m.observe(list(events), d.send(*events))

    for k in keys:
        send(ev.UpdateGraph("c", [ev.TaskSpec(k, "f", None, group="square")], [k], 0.0))
    for k in keys:
        send(ev.TaskFinished("a", k, 8, 0.01, 0.1))
    d.add_worker("b")
    send(ev.WorkerRemove("a", 0.2, "died", graceful=False))  # the values are lost: recomputed on b
    for k in keys:
        send(ev.TaskFinished("b", k, 8, 0.01, 0.3))
    assert d.state.counters["recomputed"] == 4
    assert m.groups()["square"]["memory"] == 4  # 4 submitted, 4 done (not 8)
    assert m.group_stats["square"].seconds == pytest.approx(0.08)  # compute time counts both runs


def test_a_view_never_walks_the_task_table_and_pollers_share_one_snapshot() -> None:
    d = StateDriver()
    d.add_worker("a")
    specs = [ev.TaskSpec(f"inc-{i}", "f", None, group="inc") for i in range(30_000)]
    d.send(ev.UpdateGraph("c", specs, [s.key for s in specs], 0.0))
    d.state.tasks = NoScan(d.state.tasks)
    now, eta_calls = [1.0], []
    m = _model(d, now, eta_calls)
    first = m.view_json(now[0])[0]
    for _ in range(100):  # four pollers and a hundred pages within one interval
        assert m.view_json(now[0])[0] == first
    assert eta_calls == []  # a full forecast of 30,000 tasks would stall the loop: the work bound instead
    view = json.loads(first)
    assert view["point"]["eta"] is not None
    assert view["groups"]["inc"] == {"ready": 29_999, "running": 1}
    now[0] = 1.6  # the next interval: a new snapshot, the forecast only at its budgeted rate
    m.view_json(now[0])
    assert len(m.series) == 2


def test_the_post_mortem_model_rebuilds_the_run_at_any_moment() -> None:
    recs = [
        {"t": 0.0, "kind": "journal-start"},
        {"t": 0.1, "kind": "launch", "request": "a1", "node_type": "cpu", "nodes": 2, "reason": "backlog"},
        {"t": 1.0, "kind": "worker-join", "worker": "w1", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 1.2, "kind": "worker-join", "worker": "w2", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 1.2, "kind": "launch-arrived", "request": "a1", "node_type": "cpu", "seconds": 1.1},
        *[{"t": 2.0 + i, "kind": "task", "key": f"work-{i:08x}", "worker": "w1", "start": 1.0 + i,
           "duration": 1.0, "ok": i != 3} for i in range(5)],
        {"t": 7.0, "kind": "retire", "worker": "w2", "node_type": "cpu", "reason": "idle"},
        {"t": 7.5, "kind": "worker-leave", "worker": "w2", "reason": "retired", "graceful": True},
    ]  # fmt: skip
    m = ReplayModel(recs)
    early = m.view(0.5)["view"]
    assert early["point"]["pending"] == {"cpu": 2} and early["workers"] == []
    mid = m.view(3.5)
    assert mid["view"]["counters"] == {"finished": 2, "erred": 0}
    assert mid["view"]["point"]["workers"]["cpu"]["busy"] == 1 and mid["view"]["point"]["workers"]["cpu"]["idle"] == 1
    assert mid["view"]["groups"]["work"] == {"memory": 2, "erred": 0, "running": 1}
    assert all(p["t"] <= 3.5 for p in mid["history"])
    sweep = m._sweep([0.5, 1.1, 3.5, 7.6, 100.0])  # the time series, made in one pass, agrees point by point
    assert sweep == [m._point(t) for t in (0.5, 1.1, 3.5, 7.6, 100.0)]
    end = m.view(100.0)["view"]
    assert end["counters"] == {"finished": 4, "erred": 1}
    assert [w["id"] for w in end["workers"]] == ["w1"]
    assert [d["kind"] for d in end["decisions"]] == ["launch", "launch-arrived", "retire"]


def test_the_post_mortem_drops_retired_workers_and_keeps_the_rest_of_a_partly_called_off_launch() -> None:
    # found by bug hunts: a retired worker closes with no worker-leave and stayed on the page, idle,
    # to the end; a launch with 1 of 3 nodes called off showed nothing pending any more
    recs = [
        {"t": 0.0, "kind": "journal-start"},
        {"t": 0.1, "kind": "launch", "request": "a1", "node_type": "cpu", "nodes": 3, "reason": "wide"},
        {"t": 1.0, "kind": "cancel-launch", "request": "a1", "node_type": "cpu", "nodes": 1, "workers": ["w3"],
         "called_off": True, "reason": "called off: custom"},
        {"t": 2.0, "kind": "worker-join", "worker": "w1", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 2.0, "kind": "worker-join", "worker": "w2", "node_type": "cpu", "resources": {"cpu": 1}},
        {"t": 2.0, "kind": "launch-arrived", "request": "a1", "node_type": "cpu", "seconds": 1.9},
        {"t": 5.0, "kind": "retire", "worker": "w2", "node_type": "cpu", "reason": "idle"},
        {"t": 5.1, "kind": "worker-close", "worker": "w2", "reason": "retired (autoscaler)"},
    ]  # fmt: skip
    m = ReplayModel(recs)
    assert m.view(1.5)["view"]["point"]["pending"] == {"cpu": 2}
    assert [w["id"] for w in m.view(9.0)["view"]["workers"]] == ["w1"]
    assert m._sweep([1.5, 9.0]) == [m._point(t) for t in (1.5, 9.0)]
    assert sum(m._point(9.0)["workers"]["cpu"].values()) == 1


def test_a_key_that_opens_an_html_comment_cannot_stop_the_page() -> None:
    # found by a bug hunt: a key holding "<!--<script>" put the page's script in the HTML parser's
    # "double escaped" state: it never ran, for every viewer
    from tidepool.dashboard.server import page_with

    page = page_with(json.dumps({"key": "x<!--<script></script>"}))
    inline = page[page.index("x\\u003c"):]
    assert "<!--" not in inline.split("</script>")[0] and "\\u003c/script>" in inline
    assert json.loads(json.dumps({"key": "x<!--<script></script>"}).replace("<", "\\u003c")) == {
        "key": "x<!--<script></script>"}


CPU = NodeType("cpu", {"cpu": 1}, max_nodes=4, startup_estimate=0.5)


def test_a_refused_retirement_is_asked_again_only_when_the_pool_changes() -> None:
    d = StateDriver()
    d.add_worker("a", node_type="cpu")
    d.submit([("x", [])], ["x"])
    d.step()  # a holds x, which the client still wants

    def policy(snap: ClusterSnapshot) -> ScaleDecision:
        return ScaleDecision(retire=("a",), why=(("a", "idle"),))

    c = ScalingController((CPU,), policy, forecast_interval=0.25, manage_foreign=True)
    assert step_with_state(c, d.state, 1.0).retire == ["a"]
    refusal = Retired("a", "refused: it holds 1 needed values and no other running worker can take them", 1.1)
    assert step_with_state(c, d.state, 2.0, reports=[refusal]).retire == []
    for t in (15.0, 60.0, 600.0):  # nothing changed: no timer asks the same question again
        assert step_with_state(c, d.state, t).retire == []
    refusals = [r for r in c.journal.records if r["kind"] == "retire-done"]
    assert len(refusals) == 1  # said once
    d.add_worker("b", node_type="cpu")  # somebody who could take x joined
    assert step_with_state(c, d.state, 601.0).retire == ["a"]


def test_a_resource_name_nobody_offers_fails_at_submit_with_the_close_name() -> None:
    d = StateDriver()
    d.add_worker("a", {"cpu": 2.0, "gpu": 1.0})
    d.submit([("typo", [], {"CPU": 1}), ("new", [], {"fpga": 1}), ("ok", [], {"gpu": 1})], ["typo", "new", "ok"])
    typo = d.state.tasks["typo"]
    assert typo.state == "erred" and typo.exc_type == "InfeasibleTaskError"
    assert "'CPU'" in typo.message and "did you mean 'cpu'" in typo.message
    assert d.state.tasks["new"].state == "no-worker"  # an unknown name with no close match still waits
    assert d.state.tasks["ok"].state == "running"
    assert suggestion("cpus", {"cpu", "gpu"}) == "cpu" and suggestion("gpu", {"cpu"}) is None
    assert suggestion("gpu1", {"gpu0", "cpu"}) is None  # a family of names, not a typo


def test_a_name_a_node_type_offers_waits_for_its_worker() -> None:
    d = StateDriver()
    d.add_worker("a", {"cpu": 1.0})
    d.state.offered_resources.update({"GPU"})  # a node type offers it (the scheduler adds these)
    d.submit([("t", [], {"GPU": 1})], ["t"])
    assert d.state.tasks["t"].state == "no-worker"


def test_the_grafana_dashboard_only_queries_metrics_that_exist() -> None:
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from tidepool.dashboard.metrics import registry_for, render

    d = StateDriver()
    d.add_worker("a")
    now: list[float] = [0.0]
    m = _model(d, now, [])
    m.group_of("square").add(0.1, 8, True)  # a finished task, so its group's series exist
    names = set()
    for fam in text_string_to_metric_families(render(registry_for(m)).decode()):
        names.update(s.name for s in fam.samples)
        names.add(fam.name)
    doc = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text())
    used = {n for p in doc["panels"] for t in p["targets"] for n in re.findall(r"tidepool_[a-z_]+", t["expr"])}
    assert len(used) >= 15 and used <= names, used - names


def test_per_worker_series_only_below_the_label_limit_and_the_start_up_histogram() -> None:
    from tidepool.dashboard.metrics import registry_for, render

    d = StateDriver()
    for w in ("a", "b", "c"):
        d.add_worker(w)
    m = _model(d, [0.0], [])
    from tidepool.telemetry.journal import Journal

    journal = Journal()
    journal.record("launch", 0.0, request="r1", node_type="default", nodes=1)
    journal.record("launch-arrived", 3.0, request="r1", node_type="default", seconds=3.0)
    m.autoscaler = lambda: SimpleNamespace(journal=journal, view=ControllerView(),
                                           controller=SimpleNamespace(node_types={}))
    text = render(registry_for(m, 3)).decode()
    assert 'tidepool_worker_tasks{worker="a"}' in text
    assert 'tidepool_worker_startup_seconds_bucket{le="5.0",node_type="default"} 1.0' in text
    assert 'tidepool_worker_startup_seconds_bucket{le="2.0",node_type="default"} 0.0' in text
    assert 'tidepool_worker_startup_seconds_sum{node_type="default"} 3.0' in text
    assert "tidepool_launches_total 1.0" in text
    few = render(registry_for(m, 2)).decode()
    assert "worker=" not in few and 'tidepool_workers{node_type="default",state="idle"} 3.0' in few


def test_a_long_lived_journal_keeps_bounded_memory_and_the_dashboard_every_decision() -> None:
    """Found by a long-running-service hunt: the journal kept every task record and every
    submitted key's shape for ever (a kilobyte per task, 48 -> 352 MB), and the dashboard looked
    for decisions in the last 2,000 records only (under load it missed some)."""
    from tidepool.telemetry.journal import Journal

    j = Journal(keep=1_000)
    forgotten: set[str] = set()
    j.alive = lambda key: key not in forgotten  # as follow(scheduler) sets it: does the scheduler know it?
    decisions = []
    for n in range(20):
        specs = [ev.TaskSpec(f"t{n}-{i}", "f", None) for i in range(3_000)]
        j.observe([ev.UpdateGraph("c", specs, [], float(n))], [])
        j.observe([ev.TaskFinished("w", s.key, 8, 0.01, float(n)) for s in specs], [])
        j.record("decision", float(n), reason=f"round {n}")
        decisions.append(f"round {n}")
        never = [ev.TaskSpec(f"never-{n}-{i}", "f", None) for i in range(500)]
        j.observe([ev.UpdateGraph("c", never, [], 1.0)], [])
        forgotten.update(s.key for s in never)  # cancelled: the scheduler forgot them unrun
    assert len(j.records) <= 1_251 and j.end == 20 * 3_001 and j.dropped == j.end - len(j.records)
    assert len(j._graph) <= 3_500  # shapes let go when the task ran or was forgotten (2 x keep + a graph)
    assert not any(k.startswith("t") for k in j._graph)
    assert [r["reason"] for r in j.since(j.end - 1)] == ["round 19"]
    sched = SimpleNamespace(state=StateDriver().state, clock=lambda: 0.0, eta=lambda: {"eta": None}, launched_as={})
    m = DashboardModel(sched, lambda: SimpleNamespace(journal=j), interval=0.5)
    shown, nxt = m.decisions_since(0)
    assert [r["reason"] for r in shown] == decisions and nxt == j.end  # 3,000 task records between each
    assert m.decisions_since(nxt) == ([], nxt)
    # a review: a graph larger than the limit still pending keeps every shape (its records need them)
    big = [ev.TaskSpec(f"big-{i}", "f", None, (f"big-{i - 1}",) if i else ()) for i in range(5_000)]
    j.observe([ev.UpdateGraph("c", big, [], 30.0)], [])
    j.observe([ev.TaskFinished("w", "big-1", 8, 0.01, 31.0)], [])
    assert j.since(j.end - 1)[0]["deps"] == ["big-0"]
    assert sum(k.startswith("big-") for k in j._graph) == 4_999
    everything = Journal(keep=None)  # the simulator's: every record, for its figures
    for i in range(3_000):
        everything.record("task", 0.0, key=str(i))
    assert len(everything.records) == 3_000 and everything.dropped == 0


def test_finished_values_let_go_are_not_shown_waiting() -> None:
    # found by a bug hunt: a finished group showed "waiting 10, done 10" (its released records
    # were added to waiting), and the header's done counted recomputes
    d = StateDriver()
    d.add_worker("a")
    m = _model(d, [0.0], [])

    def send(*events: ev.Event) -> None:
        m.observe(list(events), d.send(*events))

    send(ev.UpdateGraph("c", [ev.TaskSpec("s1-0", "f", None, group="s1"),
                              ev.TaskSpec("s2-0", "f", None, ["s1-0"], group="s2")], ["s2-0"], 0.0))  # fmt: skip
    send(ev.TaskFinished("a", "s1-0", 8, 0.01, 0.1))
    send(ev.TaskFinished("a", "s2-0", 8, 0.01, 0.2))
    assert d.state.tasks["s1-0"].state == "released"
    assert m.groups()["s1"] == {"memory": 1, "erred": 0}
    from tidepool.dashboard.page import PAGE

    assert "last.counters.finished" not in PAGE and "(c.released||0)" not in PAGE


def test_reprs_keep_no_token_and_journal_fields_are_escaped_on_the_page() -> None:
    # a review: repr(cluster) / repr(client) (what logs and saved notebooks keep) carried the
    # dashboard link's token; a crafted journal's `nodes` and `duration` went into the page unescaped
    from tidepool.dashboard.links import describe, describe_html, without_token
    from tidepool.dashboard.page import PAGE

    link = "http://10.0.0.1:8787/?token=s3cret"
    assert without_token(link) == "http://10.0.0.1:8787/"
    assert without_token("http://h:1/?a=1&token=s3cret") == "http://h:1/?a=1"
    assert "s3cret" not in describe("LocalCluster", "tcp://h:1", {"cpu": 1}, link)
    assert "s3cret" not in describe_html("LocalCluster", "tcp://h:1", {"cpu": 1}, link)
    assert '" x"+esc(d.nodes)' in PAGE and "${esc(s.duration)}s" in PAGE and "Object.create(null)" in PAGE


def test_a_task_the_scheduler_fails_itself_is_journaled_counted_and_replayed() -> None:
    # found by a bug hunt: a task failed with KilledWorkerError (its workers died) was only in the
    # header's failed count: no journal record, no group count, `tidepool report` said 0 failed
    from tidepool.scheduler.state import SchedulerState
    from tidepool.telemetry.journal import Journal
    from tidepool.telemetry.report import summary

    d = StateDriver(SchedulerState(heartbeat_timeout=1e9, allowed_failures=0))
    m = _model(d, [0.0], [])
    journal = Journal(clock=lambda: 0.0)

    def send(*events: ev.Event) -> None:
        cmds = d.send(*events)
        m.observe(list(events), cmds)
        journal.observe(list(events), cmds)

    send(ev.WorkerJoin("w1", "tcp://w1:1", {"cpu": 1.0}, 0.0))
    send(ev.UpdateGraph("c", [ev.TaskSpec("crash-0", "f", None, group="crash")], ["crash-0"], 0.0))
    send(ev.TasksStarted("w1", ["crash-0"], 0.5))
    send(ev.WorkerRemove("w1", 1.0, "killed", False))
    assert d.state.tasks["crash-0"].state == "erred"
    assert m.groups()["crash"]["erred"] == 1
    (rec,) = [r for r in journal.records if r["kind"] == "task-failed"]
    assert rec["key"] == "crash-0" and rec["error"] == "KilledWorkerError" and rec["group"] == "crash"
    recs = [{"t": 0.0, "kind": "journal-start"}, *journal.records]
    assert summary(recs)["failed"] == 1 and summary(recs)["tasks"] == 1  # (a review: "tasks 0 (1 failed)")
    assert ReplayModel(recs).view(5.0)["view"]["groups"]["crash"]["erred"] == 1
