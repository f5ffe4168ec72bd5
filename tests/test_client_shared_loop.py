"""A client of a LocalCluster shares its scheduler's event-loop thread: nothing the client does
there may hold that thread for a time the user's data decides (real processes and sockets)."""

from __future__ import annotations

from typing import Any

import pytest

import tidepool

pytestmark = pytest.mark.integration


def _value_that_says_where_it_was_unpickled() -> Any:
    import threading

    def rebuild(payload: bytes) -> tuple[str, int]:
        import threading

        return threading.current_thread().name, len(payload)

    class Where:  # local: pickled by value (cloudpickle), so the client needs no module of ours
        def __reduce__(self) -> Any:
            return rebuild, (b"x" * 4096,)  # over the inline limit: read from the worker

    del threading
    return Where()


def test_a_value_read_from_a_worker_is_not_unpickled_on_the_schedulers_thread() -> None:
    """Unpickling a value runs the user's code (reconstructors, imports) for as long as it takes; on
    the scheduler's thread that time stops every worker's and client's traffic.  Before the fix it
    ran there: the value said it was rebuilt in ``tidepool-cluster``."""
    with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
        where, n = client.submit(_value_that_says_where_it_was_unpickled).result(timeout=60)
        assert n == 4096
        assert where != cluster._loop.thread.name, where
