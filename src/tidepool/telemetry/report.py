"""Timeline plots and summary numbers from an event journal: what the pool held, what it used.

Place in the data flow: the scaling controller and the scheduler observer write records to a
:class:`~tidepool.telemetry.journal.Journal` (a JSON-lines file when given a path); ``tidepool
report`` (or a user) loads them and calls :func:`summary` and :func:`plot_timeline` here, and
:mod:`tidepool.telemetry.trace` exports the same records for Perfetto.  Nothing here talks to a
cluster: every function is a pure function of the records, so a journal from a crashed run, from
the simulator or written by hand gives the same answers.

Derived state, rebuilt on each call: the time origin (the first record, usually the first launch
decision, i.e. when demand first appeared: all plotted times are seconds from it), the spans in
which each worker was held (``worker-join`` to ``worker-leave``/``worker-close``), and per worker
the union of its task intervals (when it was busy).  Workers that appear in task records but
joined before the journal started (``LocalCluster(n_workers=2).adapt(...)``) are held from the
origin; workers still present at the end are held until the last record.  Busy time is clipped to
held time, so ``busy <= held`` always and efficiency is at most 1.

"Busy" counts a worker once however many of its slots run tasks; the sum of task durations is
reported separately as ``task_seconds`` (it exceeds busy time on multi-slot workers).  These are
the definitions everywhere: ``tidepool simulate`` computes held and busy worker-seconds the same
way (its whole-run columns equal this summary of its journal).  Retirements count those done
(``retire-done`` records with outcome ``retired``), not the attempts (``retire`` records).

matplotlib is an optional dependency (``pip install tidepool[plot]``), imported only by
:func:`plot_timeline`, which draws on a bare Agg canvas (no pyplot, no global figure state).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidepool.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Record = dict[str, Any]

#: Records the autoscaler writes when it acts, drawn as markers and exported as trace instants.
LAUNCH_KINDS = ("launch",)
RETIRE_KINDS = ("retire",)
UNKNOWN_TYPE = "unknown"


@dataclass(frozen=True)
class WorkerSpan:
    """One stretch of time a worker was registered (held)."""

    worker: str
    node_type: str
    start: float
    end: float
    joined: bool  # False: it joined before the journal began (held from the origin)


#: file types matplotlib writes (by suffix)
PLOT_SUFFIXES = (".png", ".svg", ".svgz", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


def check_output(path: str, flag: str, plot: bool = False) -> None:
    """Refuse, before any work, an output file that could not be written: an unknown plot type or
    a directory that does not exist (or is a file)."""
    import os

    if plot and os.path.splitext(path)[1].lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"{flag} {path!r}: a plot is written as one of {', '.join(PLOT_SUFFIXES)}; "
                          "give the file one of those suffixes")  # fmt: skip
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path!r}: the directory {parent!r} does not exist; create it first")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; give a file name")


def origin(records: Sequence[Record]) -> float:
    """The time origin: the earliest record time or task start (0.0 for no records)."""
    times = [float(r["t"]) for r in records]
    times += [float(r["start"]) for r in records if r["kind"] == "task" and "start" in r]
    return min(times, default=0.0)


def end_time(records: Sequence[Record]) -> float:
    """The last record time or task end."""
    times = [float(r["t"]) for r in records]
    times += [_task_end(r) for r in records if r["kind"] == "task"]
    return max(times, default=0.0)


def _task_start(r: Record) -> float:
    return float(r.get("start", float(r["t"]) - float(r.get("duration", 0.0))))


def _task_end(r: Record) -> float:
    return _task_start(r) + float(r.get("duration", 0.0))


def tasks_of(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r["kind"] == "task"]


def worker_spans(records: Sequence[Record]) -> list[WorkerSpan]:
    """Held spans of every worker, ordered by start then worker id.

    A second ``worker-join`` of a worker already held is ignored; a ``worker-leave`` after its
    ``worker-close`` (the journal may record both) closes nothing.  A worker seen only in task or
    leave records was there before the journal began: it is held from the origin.
    """
    recs = sorted(records, key=lambda r: float(r["t"]))  # stable: same-time records keep their order
    t0, t_end = origin(recs), end_time(recs)
    hint: dict[str, str] = {}
    for r in recs:
        if r.get("worker") is not None and r.get("node_type"):
            hint.setdefault(str(r["worker"]), str(r["node_type"]))
    held: dict[str, tuple[float, str, bool]] = {}
    seen: set[str] = set()
    spans: list[WorkerSpan] = []
    for r in recs:
        kind, w = r["kind"], r.get("worker")
        if w is None:
            continue
        w = str(w)
        t = float(r["t"])
        if kind == "worker-join":
            if w not in held:
                held[w] = (t, str(r.get("node_type") or hint.get(w, UNKNOWN_TYPE)), True)
            seen.add(w)
        elif kind in ("worker-leave", "worker-close"):
            if w in held:
                start, nt, joined = held.pop(w)
                spans.append(WorkerSpan(w, nt, start, max(t, start), joined))
            elif w not in seen:
                spans.append(WorkerSpan(w, hint.get(w, UNKNOWN_TYPE), t0, t, False))
            seen.add(w)
        elif kind == "task" and w not in seen:
            held[w] = (t0, hint.get(w, UNKNOWN_TYPE), False)
            seen.add(w)
    for w, (start, nt, joined) in held.items():
        spans.append(WorkerSpan(w, nt, start, max(t_end, start), joined))
    spans.sort(key=lambda s: (s.start, s.worker))
    return spans


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def busy_intervals(records: Sequence[Record], spans: Sequence[WorkerSpan] | None = None,
                   ) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    """worker -> disjoint intervals in which it ran at least one task, clipped to its held spans."""
    spans = worker_spans(records) if spans is None else spans
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for r in tasks_of(records):
        by_worker.setdefault(str(r["worker"]), []).append((_task_start(r), _task_end(r)))
    held: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        held.setdefault(s.worker, []).append((s.start, s.end))
    out: dict[str, list[tuple[float, float]]] = {}
    for w, ivs in by_worker.items():
        clipped = [(max(a, ha), min(b, hb)) for a, b in _merge(ivs) for ha, hb in held.get(w, ())]
        out[w] = [(a, b) for a, b in clipped if b > a]
    return out


def step_series(changes: Iterable[tuple[float, int]], start: float, end: float) -> tuple[list[float], list[int]]:
    """A count over time from ``(time, +n/-n)`` changes, as points for a ``where="post"`` step plot."""
    xs, ys = [start], [0]
    level = 0
    for t, delta in sorted(changes):
        level += delta
        if t == xs[-1]:
            ys[-1] = level
        else:
            xs.append(t)
            ys.append(level)
    if xs[-1] < end:
        xs.append(end)
        ys.append(level)
    return xs, ys


def held_series(spans: Sequence[WorkerSpan], start: float, end: float) -> dict[str, tuple[list[float], list[int]]]:
    """node type -> workers held over time."""
    changes: dict[str, list[tuple[float, int]]] = {}
    for s in spans:
        changes.setdefault(s.node_type, []).extend([(s.start, 1), (s.end, -1)])
    return {nt: step_series(ch, start, end) for nt, ch in sorted(changes.items())}


def busy_series(busy: dict[str, list[tuple[float, float]]], start: float, end: float) -> tuple[list[float], list[int]]:
    """Workers running at least one task, over time."""
    changes = [(t, d) for ivs in busy.values() for a, b in ivs for t, d in ((a, 1), (b, -1))]
    return step_series(changes, start, end)


def count_retirements(records: Iterable[Record]) -> tuple[int, int]:
    """(retirements done, refused): from ``retire-done`` outcomes; a journal without them (written
    before they existed) counts its ``retire`` decisions as done."""
    done = refused = decided = 0
    seen = False
    for r in records:
        kind = r["kind"]
        if kind == "retire-done":
            seen = True
            if r.get("outcome") == "retired":
                done += 1
            else:
                refused += 1
        elif kind in RETIRE_KINDS:
            decided += 1
    return (done, refused) if seen else (decided, 0)


def summary(records: Iterable[Record]) -> dict[str, Any]:
    """What the run cost and how well the pool was used.

    Times in seconds.  ``makespan``: origin to the end of the last task.  ``held_worker_seconds``:
    registered worker time; ``busy_worker_seconds``: time workers ran at least one task;
    ``efficiency``: busy / held (None when nothing was held).  ``time_to_first_worker``: origin to
    the first ``worker-join`` (None without one).  ``launches`` counts the autoscaler's launch
    decisions (``launched_nodes`` sums the nodes asked for; ``launch_failures`` launches given up,
    not the nodes a policy called off: ``called_off_nodes``); ``retirements`` those done and
    ``retire_refused`` those the scheduler refused (:func:`count_retirements`).
    """
    recs = list(records)
    t0, t_end = origin(recs), end_time(recs)
    spans = worker_spans(recs)
    tasks = tasks_of(recs)
    busy = busy_intervals(recs, spans)
    held_s = sum(s.end - s.start for s in spans)
    busy_s = sum(b - a for ivs in busy.values() for a, b in ivs)
    joins = [float(r["t"]) for r in recs if r["kind"] == "worker-join"]
    launches = [r for r in recs if r["kind"] in LAUNCH_KINDS]
    total_changes = [(t, d) for s in spans for t, d in ((s.start, 1), (s.end, -1))]
    peak = max(step_series(total_changes, t0, t_end)[1])
    node_types = Counter(s.node_type for s in {s.worker: s for s in spans}.values())
    retired, refused = count_retirements(recs)
    return {
        "start": t0,
        "duration": t_end - t0,
        "makespan": max((_task_end(r) for r in tasks), default=t0) - t0,
        # a task the scheduler failed itself has a task-failed record, no task record (it never ended on a worker)
        "tasks": len(tasks) + sum(1 for r in recs if r["kind"] == "task-failed"),
        "failed": sum(1 for r in tasks if not r.get("ok", True)) + sum(1 for r in recs if r["kind"] == "task-failed"),
        "task_seconds": sum(float(r.get("duration", 0.0)) for r in tasks),
        "workers": len({s.worker for s in spans}),
        "peak_workers": peak,
        "node_types": dict(sorted(node_types.items())),
        "held_worker_seconds": held_s,
        "busy_worker_seconds": busy_s,
        "efficiency": busy_s / held_s if held_s > 0 else None,
        "time_to_first_worker": min(joins) - t0 if joins else None,
        "launches": len(launches),
        "launched_nodes": sum(int(r.get("nodes", 1)) for r in launches),
        "retirements": retired,
        "retire_refused": refused,
        "launch_failures": sum(1 for r in recs if r["kind"] in ("launch-failed", "cancel-launch")
                               and not r.get("called_off")),  # fmt: skip
        # nodes of launches in flight a policy called off (no failure: a bug hunt saw them counted so)
        "called_off_nodes": sum(int(r.get("nodes", 0)) for r in recs if r["kind"] == "cancel-launch"
                                and r.get("called_off")),  # fmt: skip
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned ``name  value`` lines for a terminal."""

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    eff = s["efficiency"]
    types = ", ".join(f"{k}: {v}" for k, v in s["node_types"].items()) or "-"
    rows = [
        ("makespan", sec(s["makespan"])),
        ("tasks", f"{s['tasks']} ({s['failed']} failed, {s['task_seconds']:.2f} task-seconds)"),
        ("workers", f"{s['workers']} (peak {s['peak_workers']} at once; {types})"),
        ("time to first worker", sec(s["time_to_first_worker"])),
        ("held worker-seconds", f"{s['held_worker_seconds']:.2f}"),
        ("busy worker-seconds", f"{s['busy_worker_seconds']:.2f}"),
        ("efficiency", "-" if eff is None else f"{eff:.1%} (busy / held)"),
        ("launches", f"{s['launches']} ({s['launched_nodes']} nodes, {s['launch_failures']} failed"
                     + (f", {s['called_off_nodes']} nodes called off" if s.get("called_off_nodes") else "") + ")"),
        ("retirements", f"{s['retirements']} done ({s.get('retire_refused', 0)} refused)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


#: record fields the report reads as numbers
_NUMBERS = ("t", "start", "duration", "nodes")


def load_records(path: str) -> list[Record]:
    """Records of a JSON-lines journal; a cut-off last line (a run killed mid-write) is skipped.

    Raises :class:`ConfigError` for a missing file or a malformed line elsewhere.
    """
    try:
        with open(path) as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read journal {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a journal (JSON lines of text): {exc}") from exc
    out: list[Record] = []
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError as exc:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # the writer was stopped mid-line
            raise ConfigError(f"{path}:{n}: not a journal record ({exc})") from exc
        if not isinstance(rec, dict) or "t" not in rec or "kind" not in rec:
            raise ConfigError(f"{path}:{n}: not a journal record (needs 't' and 'kind')")
        for key in _NUMBERS:  # the fields the report computes with
            v = rec.get(key, 0) if key != "t" else rec["t"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{path}:{n}: not a journal record ({key!r} must be a finite number, got {v!r})")
        out.append(rec)
    return out


# ---- the plot ------------------------------------------------------------------------------------
_TASK_COLOR = "tab:blue"
_FAILED_COLOR = "tab:red"
_IDLE_COLOR = "0.88"
_BUSY_COLOR = "tab:green"
_LAUNCH_COLOR = "tab:purple"
_RETIRE_COLOR = "tab:orange"
#: node-type lines: none of the colours above, so a line is never mistaken for a marker
_TYPE_COLORS = ("tab:blue", "tab:cyan", "tab:brown", "tab:olive", "tab:pink", "tab:gray")


def launch_labels(recs: Sequence[Record], t0: float, span: float) -> list[tuple[float, str]]:
    """``(x, "+n")`` labels for launches; launches closer than 4% of ``span`` to the label before
    share it (their nodes summed), so labels never overlap however bursty the launches were."""
    gap = 0.04 * span if span > 0 else 0.0
    out: list[list[Any]] = []
    for r in sorted((r for r in recs if r["kind"] in LAUNCH_KINDS), key=lambda r: float(r["t"])):
        x = float(r["t"]) - t0
        n = r.get("nodes")
        if out and x - out[-1][0] < gap:
            prev = out[-1]
            prev[1] = prev[1] + n if isinstance(prev[1], int) and isinstance(n, int) else "?"
            continue
        out.append([x, n if isinstance(n, int) else "?"])
    return [(x, f" +{n}") for x, n in out]


def _markers(axes: Sequence[Axes], recs: Sequence[Record], t0: float, span: float) -> None:
    from matplotlib.transforms import blended_transform_factory

    top = axes[0]
    for x, text in launch_labels(recs, t0, span):  # how many nodes, at the top of the first panel
        top.text(x, 0.98, text, color=_LAUNCH_COLOR, fontsize="small", va="top", ha="left",
                 transform=blended_transform_factory(top.transData, top.transAxes))  # fmt: skip
    for kinds, color, style in ((LAUNCH_KINDS, _LAUNCH_COLOR, "--"), (RETIRE_KINDS, _RETIRE_COLOR, ":")):
        times = [float(r["t"]) - t0 for r in recs if r["kind"] in kinds]
        alpha = max(0.2, min(0.8, 16 / max(len(times), 1)))  # hundreds of retirements stay see-through
        for ax in axes:
            for x in times:
                ax.axvline(x, color=color, linestyle=style, linewidth=1.0, alpha=alpha, zorder=1,
                           gid=f"marker:{kinds[0]}")  # fmt: skip


def plot_timeline(records: Iterable[Record], path: str | None, *, title: str | None = None) -> Figure:
    """Draw the run and save it to ``path`` (format from the extension); returns the Figure.

    Top panel: workers held per node type (step lines, ``gid="held:<type>"``), their total when
    there are several types, and the workers busy running a task (green area).  Bottom panel: one
    row per worker, grey while held, a bar per task (red when it failed).  Launch (purple, dashed)
    and retire (orange, dotted) decisions are vertical lines on both panels.  Time axis: seconds
    from the journal's first record.  ``path=None`` only builds the figure.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError("plotting needs matplotlib: pip install 'tidepool[plot]'") from exc

    recs = sorted(records, key=lambda r: float(r["t"]))
    t0, t_end = origin(recs), end_time(recs)
    spans = worker_spans(recs)
    busy = busy_intervals(recs, spans)
    s = summary(recs)
    rows = list(dict.fromkeys(sp.worker for sp in spans))
    row_of = {w: i for i, w in enumerate(rows)}
    gantt_h = min(12.0, max(2.0, 0.28 * len(rows) + 1.0))
    fig = Figure(figsize=(12, 3.2 + gantt_h), layout="constrained")
    FigureCanvasAgg(fig)
    top, gantt = fig.subplots(2, 1, sharex=True, height_ratios=[3.2, gantt_h])
    if title is None:
        eff = "-" if s["efficiency"] is None else f"{s['efficiency']:.0%}"
        title = (f"tidepool run: {s['tasks']} tasks ({s['failed']} failed) on {s['workers']} workers, "
                 f"makespan {s['makespan']:.1f} s, efficiency {eff} (busy / held)")  # fmt: skip
    fig.suptitle(title)

    def rel(xs: list[float]) -> list[float]:
        return [x - t0 for x in xs]

    # top: held per node type, total, busy
    held = held_series(spans, t0, t_end)
    bx, by = busy_series(busy, t0, t_end)
    top.fill_between(rel(bx), by, step="post", color=_BUSY_COLOR, alpha=0.35, linewidth=0,
                     label="busy (running a task)", zorder=2)  # fmt: skip
    for i, (nt, (xs, ys)) in enumerate(held.items()):
        top.step(rel(xs), ys, where="post", linewidth=2, color=_TYPE_COLORS[i % len(_TYPE_COLORS)],
                 label=f"held: {nt}", gid=f"held:{nt}", zorder=3)  # fmt: skip
    if len(held) > 1:
        total_changes = [(t, d) for sp in spans for t, d in ((sp.start, 1), (sp.end, -1))]
        xs, ys = step_series(total_changes, t0, t_end)
        top.step(rel(xs), ys, where="post", color="black", linestyle="--", linewidth=1.2,
                 label="held: all types", gid="held-total", zorder=3)  # fmt: skip
    _markers([top, gantt], recs, t0, t_end - t0)
    top.set_ylabel("workers")
    top.set_ylim(0, max(1, s["peak_workers"]) * 1.15 + 0.2)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.grid(True, axis="y", alpha=0.3)
    handles, labels = top.get_legend_handles_labels()
    handles += [Line2D([], [], color=_LAUNCH_COLOR, linestyle="--", label="launch decision"),
                Line2D([], [], color=_RETIRE_COLOR, linestyle=":", label="retire decision")]  # fmt: skip
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
               title="workers over time", title_fontsize="small")  # fmt: skip

    # bottom: Gantt
    for sp in spans:
        gantt.broken_barh([(sp.start - t0, sp.end - sp.start)], (row_of[sp.worker] - 0.4, 0.8),
                          facecolors=_IDLE_COLOR, edgecolor="none", zorder=2)  # fmt: skip
    ok_bars: dict[str, list[tuple[float, float]]] = {}
    bad_bars: dict[str, list[tuple[float, float]]] = {}
    for r in tasks_of(recs):
        bars = ok_bars if r.get("ok", True) else bad_bars
        bars.setdefault(str(r["worker"]), []).append((_task_start(r) - t0, float(r.get("duration", 0.0))))
    for bars, color in ((ok_bars, _TASK_COLOR), (bad_bars, _FAILED_COLOR)):
        for w, xs_w in bars.items():
            gantt.broken_barh(xs_w, (row_of[w] - 0.32, 0.64), facecolors=color, edgecolor="white",
                              linewidth=0.3, zorder=3)  # fmt: skip
    several_types = len({sp.node_type for sp in spans}) > 1
    every = max(1, len(rows) // 40)
    ticks = list(range(0, len(rows), every))
    gantt.set_yticks(ticks)
    node_type_of = {sp.worker: sp.node_type for sp in spans}
    gantt.set_yticklabels([f"{rows[i]} ({node_type_of[rows[i]]})" if several_types else rows[i] for i in ticks],
                          fontsize="small")  # fmt: skip
    gantt.set_ylim(max(len(rows), 1) - 0.5, -0.5)  # first worker on top
    gantt.set_ylabel("worker")
    gantt.set_xlabel("seconds since the journal's first record")
    gantt.grid(True, axis="x", alpha=0.3)
    gantt.legend(handles=[Patch(color=_TASK_COLOR, label="task"), Patch(color=_FAILED_COLOR, label="failed task"),
                          Patch(color=_IDLE_COLOR, label="held, idle")],
                 loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="tasks",
                 title_fontsize="small")  # fmt: skip
    span = max(t_end - t0, 1e-3)
    gantt.set_xlim(-0.01 * span, span * 1.01)  # a margin, so a marker at 0 is not under the spine
    if not recs:
        gantt.text(0.5, 0.5, "the journal is empty", ha="center", va="center", transform=gantt.transAxes)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
