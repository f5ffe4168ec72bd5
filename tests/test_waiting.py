"""``tidepool.wait`` and ``tidepool.as_completed`` follow Dask's documented behaviour; each contract
test runs on tidepool futures and on a ThreadPoolExecutor's, so it tests the contract itself."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import tidepool


def inc(x: int) -> int:
    return x + 1


def gated(x: int, gate_name: str) -> int:
    # a task that finishes only when the test says so (a file appears)
    import os
    import time

    while not os.path.exists(gate_name):
        time.sleep(0.01)
    return x


def boom(x: int) -> int:
    raise ValueError(f"bad {x}")


@pytest.fixture(scope="module")
def tp_client() -> Iterator[tidepool.Client]:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        yield client


@pytest.fixture(params=["tidepool", "threads"])
def executor(request: pytest.FixtureRequest, tp_client: tidepool.Client) -> Iterator[concurrent.futures.Executor]:
    if request.param == "tidepool":
        yield tp_client.get_executor()
    else:
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            yield ex


def test_wait_returns_done_and_not_done(executor: concurrent.futures.Executor) -> None:
    futs = [executor.submit(inc, i) for i in range(5)]
    done, not_done = tidepool.wait(futs, timeout=30)
    assert done == set(futs) and not_done == set()
    assert sorted(f.result() for f in done) == [1, 2, 3, 4, 5]


def test_wait_raises_timeout_error_like_dask(executor: concurrent.futures.Executor, tmp_path: Any) -> None:
    gate = str(tmp_path / "gate")
    slow = executor.submit(gated, 1, gate)
    with pytest.raises(TimeoutError):
        tidepool.wait([slow], timeout=0.2)
    open(gate, "w").close()
    assert tidepool.wait(slow, timeout=30).done == {slow}


def test_wait_first_completed(executor: concurrent.futures.Executor, tmp_path: Any) -> None:
    gate = str(tmp_path / "gate")
    slow = executor.submit(gated, 1, gate)
    fast = executor.submit(inc, 1)
    done, not_done = tidepool.wait([slow, fast], timeout=30, return_when="FIRST_COMPLETED")
    assert fast in done and slow in not_done
    open(gate, "w").close()
    with pytest.raises(ValueError, match="return_when"):
        tidepool.wait([slow], return_when="SOMETIMES")


def test_wait_first_exception_times_out_when_nothing_failed(executor: concurrent.futures.Executor,
                                                             tmp_path: Any) -> None:  # fmt: skip
    """Found by a bug hunt: with one future done (no error) and one not, the timeout passed
    without an error, so a caller could not tell it from a completed wait (Dask raises)."""
    gate = str(tmp_path / "gate")
    slow = executor.submit(gated, 1, gate)
    fast = executor.submit(inc, 1)
    assert fast.result(timeout=30) == 2
    with pytest.raises(TimeoutError, match="no future failed"):
        tidepool.wait([slow, fast], timeout=0.2, return_when="FIRST_EXCEPTION")
    failing = executor.submit(boom, 1)
    done, not_done = tidepool.wait([slow, fast, failing], timeout=30, return_when="FIRST_EXCEPTION")
    assert failing in done and slow in not_done
    open(gate, "w").close()


def test_as_completed_yields_in_finishing_order_and_accepts_additions(
        executor: concurrent.futures.Executor, tmp_path: Any) -> None:  # fmt: skip
    gate = str(tmp_path / "gate")
    slow = executor.submit(gated, "slow", gate)
    fast = executor.submit(inc, 1)
    ac = tidepool.as_completed([slow, fast])
    first = next(ac)
    assert first is fast
    later = executor.submit(inc, 10)
    ac.add(later)
    assert next(ac) is later
    open(gate, "w").close()
    assert next(ac) is slow
    assert ac.is_empty()
    with pytest.raises(StopIteration):
        next(ac)


def test_as_completed_with_results_and_errors(executor: concurrent.futures.Executor) -> None:
    good = [executor.submit(inc, i) for i in range(3)]
    bad = executor.submit(boom, 7)
    results = sorted(r for _, r in tidepool.as_completed(good, with_results=True))
    assert results == [1, 2, 3]
    with pytest.raises(ValueError, match="bad 7"):
        list(tidepool.as_completed([bad], with_results=True))
    (pair,) = list(tidepool.as_completed([bad], with_results=True, raise_errors=False))
    assert pair[0] is bad and isinstance(pair[1], ValueError)


def test_as_completed_timeout_counts_from_the_call_as_in_dask(executor: concurrent.futures.Executor,
                                                                tmp_path: Any) -> None:  # fmt: skip
    """Before: ``timeout=`` was a TypeError (Dask's as_completed takes it)."""
    gate = str(tmp_path / "gate")
    slow = executor.submit(gated, 5, gate)
    fast = executor.submit(inc, 1)
    assert fast.result(timeout=120) == 2  # done before the clock starts: a loaded machine cannot race it
    ac = tidepool.as_completed([slow, fast], timeout=0.5)
    assert next(ac) is fast
    with pytest.raises(TimeoutError, match="1 futures still not done 0.5s after"):
        next(ac)
    with pytest.raises(TimeoutError):
        ac.next_batch(block=True)
    assert ac.next_batch(block=False) == []  # not blocking: never a timeout
    open(gate, "w").close()
    assert slow.result(timeout=30) == 5
    with pytest.raises(tidepool.ConfigError, match="timeout"):
        tidepool.as_completed([], timeout=-1)


def test_as_completed_batches_hold_everything(executor: concurrent.futures.Executor) -> None:
    futs = [executor.submit(inc, i) for i in range(20)]
    ac = tidepool.as_completed(futs)
    seen = [f for batch in ac.batches() for f in batch]
    assert sorted(f.result() for f in seen) == list(range(1, 21))
    assert ac.count() == 0


def test_as_completed_is_safe_with_concurrent_adds(executor: concurrent.futures.Executor) -> None:
    ac = tidepool.as_completed()
    futs = [executor.submit(inc, i) for i in range(50)]
    adders = [threading.Thread(target=ac.update, args=(futs[i::5],)) for i in range(5)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    assert sorted(f.result() for f in ac) == list(range(1, 51))


def test_an_infinite_or_huge_timeout_means_no_timeout() -> None:
    """Found by review: ``timeout=float("inf")`` (or 1e12) raised OverflowError from the lock wait."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gate = threading.Event()
        f = pool.submit(gate.wait, 30)
        g = pool.submit(inc, 1)
        threading.Timer(0.2, gate.set).start()
        assert tidepool.wait([f, g], timeout=float("inf")).done == {f, g}
        h = pool.submit(inc, 2)
        assert [x.result() for x in tidepool.as_completed([h], timeout=1e12)] == [3]
