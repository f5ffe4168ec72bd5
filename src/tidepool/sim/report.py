"""Tables and the makespan-versus-cost plot of simulation results.

Pure functions of :class:`~tidepool.sim.engine.SimResult` s; matplotlib is imported only by
:func:`plot_cost`, which draws on a bare Agg canvas (no pyplot), like ``telemetry/report.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidepool.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tidepool.sim.engine import SimResult


def _s(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table_rows(results: Sequence[SimResult]) -> list[list[str]]:
    """Header plus one row per result: makespan, worker-seconds, cost by node type, actions.

    Worker-seconds as ``tidepool report`` counts them (docs/simulation.md): *held* a worker was
    registered, in the makespan and over the whole run (with the tail after the results); *busy*
    it ran at least one task (once however many slots); *task-s* the sum of task durations.
    Cost is billed node-hours times each node type's ``cost`` (its price per node-hour)."""
    types = sorted({k for r in results for k in r.cost})
    head = ["policy", "makespan s", "held w-s", "held w-s (whole run)", "busy w-s", "task-s",
            COST_HEADER, *[f"cost {t}" for t in types], "launches (nodes)", "retirements done",
            "failed launches", "peak workers"]  # fmt: skip
    rows = [head]
    for r in results:
        rows.append([
            r.policy + ("" if r.completed else " (did not finish)")
            + (f" ({r.failed_keys} results failed)" if r.failed_keys else ""), _s(r.makespan, 2), _s(r.held_worker_seconds),
            _s(r.held_worker_seconds_total), _s(r.busy_worker_seconds), _s(r.task_seconds), _s(r.total_cost, 2),
            *[_s(r.cost.get(t, 0.0), 2) for t in types], f"{r.launches} ({r.launched_nodes})", str(r.retirements),
            str(r.launch_failures), str(r.peak_workers),
        ])  # fmt: skip
    return rows


#: the cost column: billed node-hours times each node type's ``cost`` per node-hour
COST_HEADER = "cost (node-h x cost/node-h)"


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def render_markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|---|" + "--:|" * (len(rows[0]) - 1)]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def perf_lines(r: SimResult) -> list[str]:
    """How fast the simulation (and the real state machine and controller in it) ran."""
    s = r.stats
    lines = [
        f"simulated {r.end:,.1f}s in {s.wall:,.1f}s of wall time; {r.executions:,} task executions, "
        f"{s.loop_events:,} timed events",
        f"scheduler state: {s.events:,} events in {s.batches:,} batches, {s.state_seconds:,.1f}s inside "
        f"handle_many = {s.state_events_per_second:,.0f} events/s; peak {s.peak_tasks:,} tasks",
        f"controller: {s.steps:,} steps ({s.forecasts:,} with a forecast), {s.step_seconds:,.1f}s wall, "
        f"longest step {s.max_step_seconds * 1000:,.0f} ms",
    ]
    if s.bytes_per_task is not None:
        lines.append(f"memory: {s.bytes_per_task:,.0f} bytes per task held by the state; peak RSS "
                     f"{s.peak_rss / 2**20:,.0f} MiB")  # fmt: skip
    return lines


def plot_cost(results: Sequence[SimResult], path: str | None, *, title: str | None = None) -> Figure:
    """Makespan (x) against cost (y), one labelled point per result; saved to ``path`` if given."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError("plotting needs matplotlib: pip install 'tidepool[plot]'") from exc
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    done = [r for r in results if r.makespan is not None]
    for i, r in enumerate(done):
        assert r.makespan is not None
        ax.scatter([r.makespan], [r.total_cost], s=60, zorder=3, color=f"C{i % 10}", gid=f"point:{r.policy}")
        ax.annotate(r.policy, (r.makespan, r.total_cost), textcoords="offset points", xytext=(6, 4),  # type: ignore[arg-type]
                    fontsize="small")  # fmt: skip
    ax.set_xlabel("makespan, s (first submit to results gathered)")
    ax.set_ylabel("cost (billed node-hours x node type cost)")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if done:
        ax.margins(0.15)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    if title is None and results:
        title = f"{results[0].workload}: makespan vs cost per policy (lower left is better)"
    if title:
        ax.set_title(title, fontsize="medium")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def result_json(r: SimResult) -> dict[str, Any]:
    s = r.stats
    return {**r.row(), "workload": r.workload, "seed": r.seed, "end": r.end, "tasks": r.tasks,
            "executions": r.executions, "notes": r.notes, "journal": r.journal,
            "perf": {"wall": s.wall, "events": s.events, "state_seconds": s.state_seconds,
                     "state_events_per_second": s.state_events_per_second, "steps": s.steps,
                     "forecasts": s.forecasts, "step_seconds": s.step_seconds,
                     "bytes_per_task": s.bytes_per_task, "peak_rss": s.peak_rss}}  # fmt: skip
