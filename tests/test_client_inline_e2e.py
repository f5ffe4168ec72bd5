"""On a real cluster: a small result of a small submission comes with its report (``result()``
reads nothing from the worker), a large one and those of a large submission are still read from
their holder, and the scheduler keeps nothing of the inline values afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import tidepool
from tidepool.client.connection import ClientConnection
from tidepool.comm.inline import INLINE_BYTES, INLINE_WANTED


def inc(x: int) -> int:
    return x + 1


def blob(n: int) -> bytes:
    return b"x" * n


@pytest.fixture(scope="module")
def cluster() -> Iterator[tidepool.LocalCluster]:
    with tidepool.LocalCluster(n_workers=1) as c:
        yield c


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of every get-data read the client makes from a worker."""
    seen: list[list[str]] = []
    real = ClientConnection._get_from

    async def counted(self: ClientConnection, address: str, keys: list[str]) -> Any:
        seen.append(list(keys))
        return await real(self, address, keys)

    monkeypatch.setattr(ClientConnection, "_get_from", counted)
    return seen


def test_a_small_result_arrives_with_its_report_and_a_large_one_is_read(cluster: tidepool.LocalCluster,
                                                                         reads: list[list[str]]) -> None:  # fmt: skip
    with tidepool.Client(cluster) as client:
        assert client.submit(inc, 1).result(timeout=30) == 2
        assert [client.submit(inc, i).result(timeout=30) for i in range(5)] == [1, 2, 3, 4, 5]
        assert reads == []
        big = client.submit(blob, 4 * INLINE_BYTES)
        assert big.result(timeout=30) == blob(4 * INLINE_BYTES)
        assert reads == [[big.key]]
        many = client.map(inc, range(INLINE_WANTED + 1))  # a large submission: values stay on the worker
        assert client.gather(many, timeout=30) == list(range(1, INLINE_WANTED + 2))
        assert sum(len(r) for r in reads) == 1 + INLINE_WANTED + 1
        left = cluster.run(lambda s: (len(s.inline_keys), len(s.inline_values)))
        assert left == (0, 0)


def test_gather_of_small_submissions_reads_nothing(cluster: tidepool.LocalCluster, reads: list[list[str]]) -> None:
    with tidepool.Client(cluster) as client:
        futs = client.map(inc, range(10))
        assert client.gather(futs, timeout=30) == list(range(1, 11))
        assert reads == []


def test_the_schedulers_inline_keys_of_vanished_tasks_are_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of small submissions whose client left without a report or release do not pile up."""
    import asyncio

    from tidepool.comm.messages import TaskSpec, UpdateGraph
    from tidepool.scheduler import server as srv

    monkeypatch.setattr(srv, "INLINE_KEYS_PRUNE", 5)
    s = srv.Scheduler()
    s._inline_prune_at = 5
    s.inline_keys.update(f"gone-{i}" for i in range(5))
    msg = UpdateGraph([TaskSpec("k", "f1", None)], ["k"], {"f1": b""}).encode()
    asyncio.run(s._client_message("client-1", None, msg))  # type: ignore[arg-type]
    assert s.inline_keys == {"k"}  # the state knows "k" (no worker yet), not the others
