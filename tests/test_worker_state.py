"""``WorkerState`` (worker/state.py) under random event sequences, with invariants after every step.

A small fake shell (:class:`Shell`) carries out the commands as both real shells must: values it
is told to ``Store`` are kept (in memory), ``Spill`` moves them to its "disk", ``Drop`` removes
them; ``Run`` puts a task in a slot.  The events are what a scheduler, slot threads, peers and
the memory monitor could send at that point.  After every step:
- held + spilled bytes are accounted for: the state's ``memory``/``spilled`` are exactly the
  shell's in-memory/on-disk values, with the same sizes;
- no task is in two places (queue, waiting, a slot), slots never leak or go negative;
- every task received is reported once: an assignment ends in exactly one outcome report
  (finished, erred, missing, stolen) or is dropped by ``free``; open ones are queued, waiting or
  running; ``started`` always precedes the ``Run`` of the same task.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from tidepool.worker import state as ws
from tidepool.worker.memory import MemoryThresholds

KEYS = [f"k{i}" for i in range(8)]
LIMIT = 1000
CPU = (("cpu", 1.0),)
OUTCOMES = ("finished", "erred", "missing", "stolen")


class Shell:
    def __init__(self, limit: int) -> None:
        self.state = ws.WorkerState({"cpu": 2.0, "gpu": 1.0}, limit=limit,
                                    thresholds=MemoryThresholds(0.5, 0.6, 0.8, 0.95))  # fmt: skip
        self.mem: dict[str, int] = {}
        self.disk: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        self.slots: set[str] = set()
        self.open: dict[str, int] = {}  # assignments not ended: key -> outcome reports seen
        self.freed: set[str] = set()
        self.terminated = False

    def send(self, event: Any) -> list[Any]:
        if isinstance(event, ws.Compute):
            for t in event.tasks:
                if t.key not in self.state.running and t.key not in self.state.waiting and \
                        t.key not in self.state.queued and t.key not in self.state:  # fmt: skip
                    self.open[t.key] = 0
        if isinstance(event, ws.TaskDone):
            self.slots.discard(event.key)
            if event.key in self.state.cancelled:
                self.open.pop(event.key, None)  # freed while it ran: its result is dropped, not reported
        if isinstance(event, ws.FreeKeys):
            for k in event.keys:
                if k in self.open and k not in self.state.running:
                    del self.open[k]  # a queued or waiting task freed: it never runs, nothing to report
        if isinstance(event, ws.SpillFailed):  # the shell's disk refused: the values stayed in memory
            for k in event.keys:
                self.mem[k] = self.disk.pop(k)
        cmds = self.state.handle(event)
        started: set[str] = set()
        for c in cmds:
            if isinstance(c, ws.Report):
                if c.kind == "started":
                    started.add(c.item)
                kind, key = c.kind, _key(c)
                if kind in OUTCOMES and key in self.open:
                    del self.open[key]
                elif kind in ("erred", "missing", "stolen"):
                    raise AssertionError(f"{kind} reported for {key}, which has no open assignment")
            elif isinstance(c, ws.Run | ws.RunBatch):
                for key in c.keys if isinstance(c, ws.RunBatch) else (c.key,):
                    assert key in started, f"Run({key}) before its started report"
                    assert key not in self.slots, f"{key} in two slots"
                    self.slots.add(key)
            elif isinstance(c, ws.Store):
                self.mem[c.key] = c.nbytes
                self.disk.pop(c.key, None)
            elif isinstance(c, ws.Drop):
                for k in c.keys:
                    self.mem.pop(k, None)
                    self.disk.pop(k, None)
            elif isinstance(c, ws.Spill):
                for k in c.keys:
                    self.disk[k] = self.mem.pop(k)
            elif isinstance(c, ws.Terminate):
                self.terminated = True
        return cmds

    def check(self) -> None:
        s = self.state
        s.validate()
        assert s.memory == self.mem, (s.memory, self.mem)
        assert s.spilled == self.disk, (s.spilled, self.disk)
        assert s.memory_bytes + s.spilled_bytes == sum(self.mem.values()) + sum(self.disk.values())
        assert set(s.running) == self.slots
        assert all(v >= -1e-9 for v in s.free.values()), s.free
        places = {t.key for t in s.queue} | set(s.waiting) | set(s.running)
        for k in self.open:
            assert k in places, f"{k} was received, is not done, and is nowhere"


def _key(c: ws.Report) -> str:
    item = c.item
    if isinstance(item, dict):
        return str(item["key"])
    if isinstance(item, list):
        return str(item[0])
    return str(item)


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, Any]]:
    return draw(st.lists(st.tuples(
        st.sampled_from(["compute", "free", "steal", "done", "fetched", "fetch-failed", "memory", "secede",
                         "replicate", "spill-failed"]),
        st.randoms(use_true_random=False)), min_size=1, max_size=60))  # fmt: skip


def _event(sh: Shell, kind: str, rnd: Any) -> Any | None:
    s = sh.state
    pick = lambda xs: rnd.choice(sorted(xs)) if xs else None  # noqa: E731
    if kind == "compute":
        tasks = []
        for key in rnd.sample(KEYS, rnd.randint(1, 3)):
            deps = {d: (("peer", "tcp://peer:1"),) for d in rnd.sample(KEYS, rnd.randint(0, 2)) if d != key}
            res = (("cpu", float(rnd.choice([1, 2]))),) + ((("gpu", 1.0),) if rnd.random() < 0.2 else ())
            tasks.append(ws.TaskIn(key, deps, res, rnd.randint(0, 300), rnd.choice(["", "f", "g"]), rnd.random() < 0.2))
        return ws.Compute(tuple(tasks))
    if kind == "free":
        return ws.FreeKeys(tuple(rnd.sample(KEYS, rnd.randint(1, 3))))
    if kind == "steal":
        return ws.StealKeys(tuple(rnd.sample(KEYS, rnd.randint(1, 3))))
    if kind == "done":
        key = pick(s.running)
        if key is None:
            return None
        if rnd.random() < 0.8:
            return ws.TaskDone(key, True, rnd.randint(1, 400), rnd.choice([0.0005, 0.1]))
        return ws.TaskDone(key, False, error={"type": "ValueError", "message": "boom"})
    if kind == "fetched":
        key = pick(s.fetching)
        return None if key is None else ws.FetchDone(key, rnd.randint(1, 400))
    if kind == "fetch-failed":
        key = pick(s.fetching)
        return None if key is None else ws.FetchFailed(key, rnd.choice(["missing", "silent", "broken"]), "gone", "peer")
    if kind == "memory":
        return ws.MemorySample(rnd.randint(0, int(LIMIT * 0.97)))
    if kind == "secede":
        key = pick(s.running)
        return None if key is None else ws.Secede(key)
    if kind == "replicate":
        return ws.Replicate(rnd.choice(KEYS), (("peer", "tcp://peer:1"),))
    key = pick(s.spilled)
    return None if key is None else ws.SpillFailed((key,), "disk full" if rnd.random() < 0.3 else "")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps(), st.sampled_from([0, LIMIT]))
def test_random_event_sequences_keep_every_invariant(seq: list[tuple[str, Any]], limit: int) -> None:
    sh = Shell(limit)
    for kind, rnd in seq:
        event = _event(sh, kind, rnd)
        if event is None:
            continue
        sh.send(event)
        sh.check()


def test_a_task_whose_input_arrives_runs_and_is_reported_once() -> None:
    sh = Shell(LIMIT)
    cmds = sh.send(ws.Compute((ws.TaskIn("b", {"a": (("w1", "tcp://w1:1"),)}, (("cpu", 1.0),)),)))
    assert cmds == [ws.Fetch("a", (("w1", "tcp://w1:1"),))]
    cmds = sh.send(ws.FetchDone("a", 100))
    assert cmds == [ws.Store("a", 100), ws.Report("replicas", ["a", 100]), ws.Report("started", "b"), ws.Run("b")]
    cmds = sh.send(ws.TaskDone("b", True, 50, 1.5))
    assert cmds == [ws.Store("b", 50), ws.Report("finished", ["b", 50, 1.5])]
    assert sh.send(ws.Compute((ws.TaskIn("b"),))) == [ws.Report("finished", ["b", 50, 0.0])]  # held already
    sh.check()


def test_values_past_the_target_spill_least_recently_used_first_and_pause_stops_new_tasks() -> None:
    sh = Shell(LIMIT)  # target 500 bytes
    for key, nb in (("a", 200), ("b", 200), ("c", 200)):
        sh.send(ws.Compute((ws.TaskIn(key),)))
        cmds = sh.send(ws.TaskDone(key, True, nb))
    assert ws.Spill(("a",)) in cmds and sh.disk == {"a": 200}
    # over the pause level: spill down to the target (350 bytes: b and c), and pause
    assert sh.send(ws.MemorySample(850)) == [ws.Spill(("b", "c")), ws.SendMetrics(True)]
    sh.send(ws.Compute((ws.TaskIn("d"), ws.TaskIn("e"))))
    assert list(sh.state.running) == ["d"]  # paused with nothing running: one task at a time
    assert sh.send(ws.MemorySample(100)) == [ws.SendMetrics(False), ws.Report("started", "e"), ws.Run("e")]
    assert sh.send(ws.MemorySample(960)) == [ws.Terminate(960)]
    sh.check()


def quick_shell() -> Shell:
    """One slot; function ``f`` has run once, in a millisecond."""
    sh = Shell(0)
    sh.state = ws.WorkerState({"cpu": 1.0})
    sh.send(ws.Compute((ws.TaskIn("warm", func="f", resources=CPU),)))
    sh.send(ws.TaskDone("warm", True, 8, 0.001))
    return sh


def test_quick_tasks_queued_together_run_as_one_batch_that_holds_the_slot_until_its_last_task() -> None:
    sh = quick_shell()
    cmds = sh.send(ws.Compute(tuple(ws.TaskIn(f"t{i}", func="f", resources=CPU) for i in range(ws.BATCH + 5))))
    batch = [c for c in cmds if isinstance(c, ws.Run | ws.RunBatch)]
    assert batch == [ws.RunBatch(tuple(f"t{i}" for i in range(ws.BATCH)))]  # one slot: one batch
    started = [c.item for c in cmds if isinstance(c, ws.Report) and c.kind == "started"]
    assert started == list(batch[0].keys)  # every task of it is reported started, before it runs
    sh.check()
    for key in batch[0].keys[:-1]:  # the slot stays taken while any task of the batch runs
        cmds = sh.send(ws.TaskDone(key, True, 8, 0.001))
        assert not [c for c in cmds if isinstance(c, ws.Run | ws.RunBatch)] and sh.state.free["cpu"] == 0.0
        sh.check()
    cmds = sh.send(ws.TaskDone(batch[0].keys[-1], True, 8, 0.001))
    assert [c for c in cmds if isinstance(c, ws.RunBatch)] == [ws.RunBatch(tuple(f"t{i}" for i in range(ws.BATCH, ws.BATCH + 5)))]
    sh.check()


def test_slow_unknown_solo_or_differently_shaped_tasks_are_never_batched() -> None:
    sh = quick_shell()
    sh.send(ws.Compute((ws.TaskIn("slow-warm", func="s", resources=CPU),)))
    sh.send(ws.TaskDone("slow-warm", True, 8, 0.5))  # s is slow
    sh.send(ws.Compute((ws.TaskIn("head", func="f", resources=CPU),)))  # takes the slot
    sh.send(ws.Compute((ws.TaskIn("a", func="f", resources=CPU), ws.TaskIn("solo", func="f", solo=True, resources=CPU), ws.TaskIn("b", func="f", resources=CPU),
                        ws.TaskIn("slow", func="s", resources=CPU), ws.TaskIn("new", func="n", resources=CPU), ws.TaskIn("c", func="f", resources=CPU),
                        ws.TaskIn("big", (), (("cpu", 1.0), ("gpu", 1.0)), func="f"))))  # fmt: skip
    sh.state.resources["gpu"] = sh.state.free["gpu"] = 1.0
    order = []
    key = "head"
    while key is not None:
        cmds = sh.send(ws.TaskDone(key, True, 8, 0.001 if key not in ("slow",) else 0.5))
        sh.check()
        runs = [c for c in cmds if isinstance(c, ws.Run | ws.RunBatch)]
        order += [c.keys if isinstance(c, ws.RunBatch) else (c.key,) for c in runs]
        key = next(iter(sh.state.running), None)
        while key is not None and sh.state.batch_of.get(key) is not None and len(sh.state.running) > 1:
            sh.send(ws.TaskDone(key, True, 8, 0.001))  # finish a batch's tasks in order
            key = next(iter(sh.state.running), None)
    # a alone (solo is next, and cannot join), solo alone, b alone (slow is next), slow, new (never
    # ran: unknown), then c with ... big needs a gpu as well: another shape, so c runs alone too
    assert order == [("a",), ("solo",), ("b",), ("slow",), ("new",), ("c",), ("big",)], order


def test_a_batch_task_that_secedes_leaves_the_batch_and_the_rest_keeps_the_slot() -> None:
    sh = quick_shell()
    cmds = sh.send(ws.Compute(tuple(ws.TaskIn(k, func="f", resources=CPU) for k in ("a", "b", "c"))))
    assert ws.RunBatch(("a", "b", "c")) in cmds
    assert sh.send(ws.Secede("a")) == [ws.Report("seceded", "a")]
    assert sh.state.free["cpu"] == 0.0  # b and c run on in the slot
    sh.check()
    sh.send(ws.TaskDone("b", True, 8, 0.001))
    assert sh.state.free["cpu"] == 0.0
    sh.send(ws.TaskDone("c", True, 8, 0.001))
    assert sh.state.free["cpu"] == 1.0  # the batch ended; a, seceded, holds no slot
    sh.send(ws.TaskDone("a", True, 8, 0.3))
    assert sh.state.free["cpu"] == 1.0 and not sh.state.running
    sh.check()


def test_a_quick_task_run_alone_is_marked_quick_and_an_unknown_or_solo_one_is_not() -> None:
    sh = quick_shell()
    assert ws.Run("q", True) in sh.send(ws.Compute((ws.TaskIn("q", func="f", resources=CPU),)))
    sh.send(ws.TaskDone("q", True, 8, 0.001))
    assert ws.Run("u", False) in sh.send(ws.Compute((ws.TaskIn("u", func="unknown", resources=CPU),)))
    sh.send(ws.TaskDone("u", True, 8, 0.001))
    assert ws.Run("s", False) in sh.send(ws.Compute((ws.TaskIn("s", func="f", solo=True, resources=CPU),)))
    sh.check()
