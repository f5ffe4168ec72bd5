"""Which pickler a payload gets: the standard one where it is safe, cloudpickle where it is needed
(tidepool.comm.serialize.dumps).  Each case is loaded back the way a worker loads it."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator

import cloudpickle
import pytest

from tidepool.comm.serialize import deserialize, dumps, serialize


def test_plain_values_use_the_standard_pickler_and_keep_large_buffers_out_of_band() -> None:
    np = pytest.importorskip("numpy")
    value = {"a": np.arange(100_000), "b": [1, "x"]}
    ser = serialize(value)
    assert len(ser.buffers) == 1 and ser.buffers[0].nbytes == value["a"].nbytes
    back = deserialize(ser)
    assert back["b"] == [1, "x"] and (back["a"] == value["a"]).all()
    assert dumps(value["b"]) == pickle.dumps(value["b"], protocol=5)


def test_lambdas_and_local_functions_fall_back_to_cloudpickle() -> None:
    offset = 5
    ser = serialize([lambda x: x + offset])
    assert deserialize(ser)[0](1) == 6


@pytest.fixture
def main_function() -> Iterator[object]:
    """A function that claims to live in ``__main__``, as one defined in the client's script."""
    def triple(x: int) -> int:
        return 3 * x

    triple.__module__, triple.__qualname__ = "__main__", "_tidepool_test_triple"
    main = sys.modules["__main__"]
    main._tidepool_test_triple = triple  # type: ignore[attr-defined]
    yield triple
    del main._tidepool_test_triple  # type: ignore[attr-defined]


def test_functions_of_the_clients_main_script_travel_by_value(main_function: object) -> None:
    blob = dumps([main_function])
    del sys.modules["__main__"]._tidepool_test_triple  # a worker's __main__ has no such name
    try:
        assert pickle.loads(blob)[0](2) == 6
    finally:
        sys.modules["__main__"]._tidepool_test_triple = main_function  # type: ignore[attr-defined]


def test_modules_registered_for_pickling_by_value_keep_that(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(cloudpickle, "list_registry_pickle_by_value", lambda: {"somemodule"})
    monkeypatch.setattr(cloudpickle, "dumps", lambda obj, **kw: seen.append(obj) or pickle.dumps(obj, protocol=5))
    assert pickle.loads(dumps((1, 2))) == (1, 2)
    assert seen == [(1, 2)]
