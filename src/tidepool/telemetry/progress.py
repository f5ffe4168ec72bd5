"""A progress bar for futures: done/total, failures, the worker pool by node type, and an ETA.

Place in the data flow: ``Client.compute(..., progress=True)`` (or a user) calls
:func:`show_progress` on the calling thread after the graph was sent.  It blocks until every future
is done, waking when they all finish or every ``refresh`` seconds (``concurrent.futures.wait`` with a
timeout: no polling sleep), and on each wake asks the scheduler for ``scheduler_info()`` (the
workers present, by node type) and, at most once a second, for ``client.eta()`` (the scheduler's
forecast of the remaining seconds, counted down locally between asks).  A client without ``eta``
gets rich's own time-remaining column instead, which extrapolates from the completion rate.

State: only the set of futures still pending, the failure count, and the last answers from the
scheduler (kept when a request fails: a lost scheduler fails the futures, which ends the bar).

The text is built by the pure :func:`progress_line`, so it is tested without a terminal; the rich
display is transient and replaced, when done, by one final line, which is also all that is written
to a console that is not a terminal (a log file, a CI job).

What is counted: given ``graph_keys`` (``compute()`` passes every task of the graph), the bar
counts those tasks, asking the scheduler at most twice a second (the keys are sent once; later asks
name a watch id); otherwise it counts the futures it waits on.  Either way it ends when the futures
are done.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

log = logging.getLogger("tidepool.progress")

#: How often the scheduler's forecast is asked for, at most (it can cost a simulation there).
ETA_INTERVAL = 1.0


def format_seconds(seconds: float) -> str:
    """``4.2s``, ``42s``, ``3m05s``, ``2h07m``: short, and precise where it matters."""
    s = max(0.0, seconds)
    if s < 9.95:
        return f"{s:.1f}s"
    if s < 59.5:
        return f"{s:.0f}s"
    r = int(round(s))
    if r < 3600:
        m, sec = divmod(r, 60)
        return f"{m}m{sec:02d}s"
    h, rest = divmod(r, 3600)
    return f"{h}h{rest // 60:02d}m"


def progress_line(done: int, total: int, failed: int, workers_by_type: dict[str, int],
                  eta: float | None, *, show_eta: bool = True) -> str:  # fmt: skip
    """One status line, e.g. ``12/20 done | 1 failed | workers cpu:2 gpu:1 | ETA 3.2s``.

    ``eta`` is the forecast remaining seconds (None: unknown, shown as ``ETA ?``); ``show_eta=False``
    leaves the ETA out (when rich's own column shows it, or on the final line).  Node types are
    listed by name; types with no workers are left out.
    """
    parts = [f"{done}/{total} done", f"{failed} failed"]
    pool = {k: v for k, v in workers_by_type.items() if v > 0}
    if pool:
        parts.append("workers " + " ".join(f"{k}:{pool[k]}" for k in sorted(pool)))
    else:
        parts.append("no workers")
    if show_eta:
        parts.append("ETA ?" if eta is None else f"ETA {format_seconds(eta)}")
    return " | ".join(parts)


def workers_by_type(info: dict[str, Any]) -> dict[str, int]:
    """Registered workers per node type from ``scheduler_info()`` (workers already gone left out)."""
    counts: Counter[str] = Counter()
    for w in info.get("workers", ()):
        if w.get("state", "running") != "gone":
            counts[str(w.get("node_type", "default"))] += 1
    return dict(counts)


def _failed(f: concurrent.futures.Future[Any]) -> bool:
    return f.cancelled() or f.exception() is not None


#: How often the graph's task counts are asked for, at most.
COUNT_INTERVAL = 0.5


class _GraphCount:
    """Done/failed/total over all tasks of a graph, from the scheduler (None if it cannot say)."""

    def __init__(self, client: Any, keys: list[str]) -> None:
        self.client = client
        self.keys = keys
        self.watch: int | None = None
        self.counts: tuple[int, int, int] | None = None
        self._at = float("-inf")

    def refresh(self, now: float, force: bool = False) -> None:
        if not force and now - self._at < COUNT_INTERVAL:
            return
        self._at = now
        try:
            res = self.client._graph_progress(self.keys if self.watch is None else None, self.watch)
        except Exception as exc:  # noqa: BLE001 - a display must not fail the computation
            log.debug("graph progress failed: %s", exc)
            return
        self.watch = res["watch"]
        self.counts = (int(res["done"]), int(res["failed"]), int(res["total"]))

    def close(self) -> None:
        if self.watch is not None:
            try:
                self.client._graph_progress_end(self.watch)
            except Exception as exc:  # noqa: BLE001
                log.debug("graph progress end failed: %s", exc)


class _SchedulerView:
    """The last answers from the scheduler; failures to ask keep the previous ones."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.has_eta = callable(getattr(client, "eta", None))
        self.workers: dict[str, int] = {}
        self._eta: float | None = None
        self._eta_at = float("-inf")

    def refresh(self, now: float, *, with_eta: bool = True) -> None:
        try:
            self.workers = workers_by_type(self.client.scheduler_info())
        except Exception as exc:  # noqa: BLE001 - a display must not fail the computation
            log.debug("scheduler_info failed: %s", exc)
        if with_eta and self.has_eta and now - self._eta_at >= ETA_INTERVAL:
            try:
                eta = self.client.eta()
                self._eta = None if eta is None else float(eta)
                self._eta_at = now
            except Exception as exc:  # noqa: BLE001
                log.debug("eta failed: %s", exc)

    def eta(self, now: float) -> float | None:
        """The forecast, counted down since it was made."""
        if self._eta is None:
            return None
        return max(0.0, self._eta - (now - self._eta_at))


def show_progress(client: Any, futures: Iterable[concurrent.futures.Future[Any]], *,
                  console: Console | None = None, refresh: float = 0.2,
                  graph_keys: list[str] | None = None) -> None:  # fmt: skip
    """Show a progress bar until every future is done (finished, failed or cancelled).

    ``client`` needs ``scheduler_info()``; its ``eta()`` is used when it has one.  Ends with one
    line such as ``20/20 done | 1 failed | workers default:2 in 3.1s``.  On a console that is not
    a terminal (or Jupyter) only that line is written: no bar, and no requests while waiting.
    """
    futs = list(dict.fromkeys(futures))  # a future passed twice counts once
    console = console if console is not None else Console()
    view = _SchedulerView(client)
    graph = _GraphCount(client, list(dict.fromkeys(graph_keys))) if graph_keys and hasattr(client, "_graph_progress") else None
    start = time.monotonic()
    try:
        if console.is_terminal or console.is_jupyter:
            _live(futs, view, console, refresh, graph)
        else:
            concurrent.futures.wait(futs)
            view.refresh(time.monotonic(), with_eta=False)
        failed = sum(1 for f in futs if _failed(f))
        total = len(futs)
        if graph is not None:
            graph.refresh(time.monotonic(), force=True)
            if graph.counts is not None:
                total = graph.counts[2]
                failed = max(failed, graph.counts[1])
    finally:
        if graph is not None:
            graph.close()
    final = progress_line(total, total, failed, view.workers, None, show_eta=False)
    console.print(Text(f"{final} in {format_seconds(time.monotonic() - start)}"))


def _live(futs: list[concurrent.futures.Future[Any]], view: _SchedulerView, console: Console,
          refresh: float, graph: _GraphCount | None = None) -> None:  # fmt: skip
    """The rich bar, redrawn when all futures are done or every ``refresh`` seconds until then."""
    total = len(futs)
    columns: list[ProgressColumn] = [
        TextColumn("tidepool"),
        BarColumn(),
        TextColumn("{task.fields[line]}", markup=False),
    ]
    if not view.has_eta:
        columns.append(TimeRemainingColumn())
    pending = [f for f in futs if not f.done()]
    failed = sum(1 for f in futs if f.done() and _failed(f))
    with Progress(*columns, console=console, transient=True, auto_refresh=False) as bar:
        task = bar.add_task("tidepool", total=max(total, 1), line="")
        while True:
            now = time.monotonic()
            view.refresh(now)
            done, shown_failed, shown_total = total - len(pending), failed, total
            if graph is not None:
                graph.refresh(now, force=not pending)
                if graph.counts is not None:
                    done, shown_failed, shown_total = graph.counts
            line = progress_line(done, shown_total, shown_failed, view.workers, view.eta(now), show_eta=view.has_eta)
            bar.update(task, total=max(shown_total, 1), completed=done if shown_total else 1, line=line)
            bar.refresh()
            if not pending:
                break
            concurrent.futures.wait(pending, timeout=refresh)  # returns early when all are done
            still = []
            for f in pending:
                if not f.done():
                    still.append(f)
                elif _failed(f):
                    failed += 1
            pending = still
