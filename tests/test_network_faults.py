"""Faults of the network, not only of processes (issue 29), with real processes and sockets.

A silent peer (SIGSTOP here: alive, socket open, no FIN ever) stands for a frozen VM or a network
partition; the namespace tests below cut real links between "hosts" on this machine.
"""

from __future__ import annotations

import os
import signal

import pytest

import tidepool
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def make(n: int) -> list[int]:
    return list(range(n))


def total(xs: list[int]) -> int:
    return sum(xs)


def inc(x: int) -> int:
    return x + 1


def test_a_silent_holder_does_not_stall_its_dependents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only copy of x sits on a worker that stops answering without closing its socket.  y =
    total(x) on another worker used to wait for the 300 s heartbeat time-to-live; now the fetch
    gives up after the fetch timeout, x is recomputed on a worker that answers, the silent one is
    not removed, and once it answers again it gets work again."""
    monkeypatch.setenv("TIDEPOOL_FETCH_TIMEOUT", "2")
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        holder, other = cluster.workers
        # a first transfer while all is well: other keeps a pooled connection to holder's data port
        x0 = client.submit(make, 10, workers=[holder])
        assert client.submit(total, x0, workers=[other]).result(timeout=30) == 45
        x = client.submit(make, 1000, workers=[holder], allow_other_workers=True)
        wait_until(x.done, what="x computed")
        assert cluster.scheduler.state.tasks[x.key].who_has == {holder}
        pid = cluster.provider.procs[holder].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            y = client.submit(total, x, workers=[other])
            assert y.result(timeout=90) == sum(range(1000))
            state = cluster.scheduler.state
            assert state.workers[holder].suspect and holder in cluster.workers  # suspect, not removed
            assert state.counters["suspect_holders"] == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: not cluster.scheduler.state.workers[holder].suspect, timeout=30,
                   what="the holder trusted again after its next heartbeat")  # fmt: skip
        assert client.submit(inc, 1, workers=[holder]).result(timeout=30) == 2
