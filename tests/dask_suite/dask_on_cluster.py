"""A pytest plugin that runs Dask's own collection tests with a cluster as Dask's scheduler.

Loaded with ``-p dask_on_cluster`` (this directory on ``PYTHONPATH``; ``run.py`` does that) when
pytest runs Dask's installed test modules (``dask/array/tests/...``).  State: one cluster and
client per pytest session, started in ``pytest_configure`` and closed in ``pytest_unconfigure``,
and a count of the graphs routed to it.

``DASK_SUITE_BACKEND`` picks the cluster: ``tidepool`` (a ``tidepool.LocalCluster``),
``distributed`` (Dask's ``distributed.LocalCluster``, the reference with the same setup) or
``none`` (Dask's own schedulers, untouched).  Before every test the client's ``get`` becomes
Dask's global scheduler (``dask.config.set(scheduler=client.get)``) and every name of Dask's own
schedulers (``"sync"``, ``"threads"``, ``"processes"``, ...) points at it too: Dask's
``assert_eq`` computes with ``scheduler="sync"``, and tests set ``scheduler="threads"`` themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

BACKEND = os.environ.get("DASK_SUITE_BACKEND", "tidepool")
WORKERS = int(os.environ.get("DASK_SUITE_WORKERS", "2"))
#: every name Dask's ``get_scheduler`` resolves through ``dask.base.named_schedulers``
NAMED = ("sync", "synchronous", "single-threaded", "threads", "threading", "processes", "multiprocessing")

_state: dict[str, Any] = {"calls": 0}


def _start() -> tuple[Any, Any, Callable[..., Any]]:
    if BACKEND == "tidepool":
        import tidepool

        cluster: Any = tidepool.LocalCluster(n_workers=WORKERS, dashboard=False)
        client: Any = tidepool.Client(cluster)
        client.wait_for_workers(WORKERS, timeout=120)
    elif BACKEND == "distributed":
        import logging

        import distributed

        logging.getLogger("distributed").setLevel(logging.ERROR)
        cluster = distributed.LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                                           dashboard_address=None)  # fmt: skip
        client = distributed.Client(cluster)
        client.wait_for_workers(WORKERS, timeout=120)
    else:
        raise pytest.UsageError(f"DASK_SUITE_BACKEND={BACKEND!r}: use tidepool, distributed or none")
    get = client.get

    def counted(*args: Any, **kwargs: Any) -> Any:
        _state["calls"] += 1
        return get(*args, **kwargs)

    return cluster, client, counted


def pytest_configure(config: pytest.Config) -> None:
    if BACKEND == "none" or hasattr(config, "workerinput"):
        return
    _state["cluster"], _state["client"], _state["get"] = _start()


def pytest_unconfigure(config: pytest.Config) -> None:
    client, cluster = _state.pop("client", None), _state.pop("cluster", None)
    if client is not None:
        client.close()
    if cluster is not None:
        cluster.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"dask-suite backend={BACKEND} graphs routed to it: {_state['calls']}")


@pytest.fixture(autouse=True)
def _dask_scheduler_is_the_cluster() -> Iterator[None]:
    get = _state.get("get")
    if get is None:
        yield
        return
    import dask
    from dask import base

    saved = {name: base.named_schedulers.get(name) for name in NAMED}
    base.named_schedulers.update(dict.fromkeys(NAMED, get))
    try:
        with dask.config.set(scheduler=get):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                base.named_schedulers.pop(name, None)
            else:
                base.named_schedulers[name] = value
