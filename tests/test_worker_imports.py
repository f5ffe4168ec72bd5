"""A worker imports only what a worker needs (issue 34): ``python -m tidepool.worker`` must not
load the client, the cluster, the scheduler's server, the Dask layer, the dashboard or the
simulator; ``import tidepool`` keeps every public name (lazily, PEP 562)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import tidepool

FORBIDDEN = ("tidepool.client", "tidepool.client_dask", "tidepool.cluster", "tidepool.futures", "tidepool.dask",
             "tidepool.dashboard", "tidepool.sim", "tidepool.scheduler.server", "tidepool.scheduler.state",
             "tidepool.scaling.autoscaler", "tidepool.scaling.controller", "dask", "distributed")  # fmt: skip


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``-X importtime`` output (``import time: self | cumulative | name``)."""
    return {m.group(1).strip() for m in re.finditer(r"^import time:\s*\d+ \|\s*\d+ \|\s*(.+)$", importtime_stderr, re.M)}


def forbidden(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_a_worker_process_imports_no_client_cluster_dask_dashboard_or_simulator() -> None:
    # an invalid option that the worker command checks right after importing the worker code: the
    # process has imported everything a worker needs, then exits at once
    env = {**os.environ, "TIDEPOOL_TOKEN": "t" * 32}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tidepool.worker", "tcp://127.0.0.1:9",
                           "--heartbeat-interval", "-1"], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--heartbeat-interval must be a positive number" in proc.stderr, proc.stderr[-2000:]
    mods = imported_modules(proc.stderr)
    assert {"tidepool.worker.server", "tidepool.comm.core", "tidepool.setup"} <= mods  # it got as far as a worker
    assert forbidden(mods) == []


def test_import_tidepool_is_lazy_and_keeps_every_public_name() -> None:
    code = ("import sys, tidepool; print(sorted(m for m in sys.modules if m.startswith('tidepool.')));"
            "print(tidepool.Client.__module__, tidepool.LocalCluster.__name__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    first, second = out.splitlines()
    assert "tidepool.client" not in first and "tidepool.cluster" not in first
    assert second == "tidepool.client LocalCluster"
    for name in tidepool.__all__:
        assert getattr(tidepool, name) is not None, name
    assert set(tidepool.__all__) <= set(dir(tidepool))
    try:
        tidepool.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
    ns: dict[str, object] = {}
    exec("from tidepool import *", ns)  # noqa: S102
    assert set(tidepool.__all__) <= set(ns)


def test_every_documented_error_is_a_public_name() -> None:
    """Each class of the error tree (errors.py, docs/errors.md) can be caught as ``tidepool.X``."""
    import inspect

    from tidepool import errors

    tree = {name for name, obj in vars(errors).items()
            if inspect.isclass(obj) and issubclass(obj, errors.TidepoolError) and obj.__module__ == errors.__name__}
    assert "PeerSilentError" in tree
    missing = sorted(tree - set(tidepool.__all__))
    assert not missing, f"errors not exported from tidepool: {missing}"
    for name in tree:
        assert getattr(tidepool, name) is getattr(errors, name)
