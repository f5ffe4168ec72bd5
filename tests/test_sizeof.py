"""``worker/sizeof.py``: a size estimate never raises, whatever the result."""

from __future__ import annotations

from typing import Any

from tidepool.worker.sizeof import sizeof


class _BadNbytes:
    @property
    def nbytes(self) -> int:
        raise RuntimeError("not materialised")


class _BadLen(list[Any]):
    def __len__(self) -> int:
        raise ValueError("unsized")


def test_a_result_whose_nbytes_or_len_raises_still_has_a_size() -> None:
    # the worker sizes every outcome in its loop (_on_done): one that raised there lost the
    # outcomes drained with it (a whole lane's) and never freed their slot
    for obj in (_BadNbytes(), _BadLen([1, 2]), [_BadNbytes()], {"k": _BadNbytes()}):
        assert isinstance(sizeof(obj), int) and sizeof(obj) > 0
    assert sizeof(b"x" * 100) == 150
