"""A worker's directory on its host, and the sweep of directories left by killed workers.

Every worker process works in one temporary directory of its own, ``tidepool-<worker id>-XXXXXXXX``
(setup hooks run there; spilled values live in its ``.spill`` unless a spill directory is given,
which gets such a directory too).  A worker that exits removes it, and the local provider removes
those of the workers it started; but a worker started by hand, by SSH or by a batch system and
then killed with SIGKILL (the out-of-memory killer, ``kill -9``, a test) cannot, and its spilled
values would stay on the disk for good.

So each directory holds an owner file, ``.owner``: the pid of the worker process and the kernel's
start time of that pid.  When a worker claims its directory it first sweeps the same parent
directory: a ``tidepool-*`` directory whose owner file names a process that is gone (no such pid,
or a pid reused by a process started at another time) is removed.  Directories without an owner
file (other programs, older versions) and those of live workers are never touched.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

__all__ = ["OWNER_FILE", "claim", "sweep_stale"]

logger = logging.getLogger("tidepool.worker")

OWNER_FILE = ".owner"


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _is_stale(directory: Path) -> bool:
    try:
        pid_text, started_text = (directory / OWNER_FILE).read_text().split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        return False  # not ours to judge: no owner file, or one being written
    now = _start_time(pid)
    return now is None or abs(now - started) > 0.01


def sweep_stale(root: str | Path) -> list[Path]:
    """Remove the ``tidepool-*`` directories under ``root`` whose owner process is gone; returns
    what was removed.  Never raises: a sweep that cannot read or remove something leaves it."""
    removed: list[Path] = []
    try:
        entries = [Path(e.path) for e in os.scandir(root)
                   if e.name.startswith("tidepool-") and e.is_dir(follow_symlinks=False)]  # fmt: skip
    except OSError:
        return removed
    for directory in entries:
        if _is_stale(directory):
            shutil.rmtree(directory, ignore_errors=True)
            if not directory.exists():
                removed.append(directory)
    if removed:
        logger.info("removed %d directories of killed workers under %s", len(removed), root)
    return removed


def claim(worker_id: str, root: str | Path | None = None) -> Path:
    """Make this process's ``tidepool-<worker_id>-XXXXXXXX`` directory under ``root`` (the
    system's temp directory by default), after sweeping stale ones there; it is removed at exit."""
    parent = Path(root) if root is not None else Path(tempfile.gettempdir())
    sweep_stale(parent)
    directory = Path(tempfile.mkdtemp(prefix=f"tidepool-{worker_id}-", dir=parent))
    started = _start_time(os.getpid())
    (directory / OWNER_FILE).write_text(f"{os.getpid()} {started if started is not None else 0.0!r}\n")
    atexit.register(shutil.rmtree, directory, True)  # also on exits that skip close()
    return directory
