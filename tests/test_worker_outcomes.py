"""What the worker loop makes of a task's outcome never raises, whatever the task returned or raised:
``sizeof`` (``worker/sizeof.py``) and ``error_report`` (``worker/jobs.py``) run in ``_on_done`` for
every outcome of a wake-up (a lane's), and one that raised lost the rest and their slot."""

from __future__ import annotations

from typing import Any

from tidepool.worker.jobs import error_report
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


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def test_an_exception_whose_str_raises_still_makes_an_error_report() -> None:
    report = error_report(_BadStr(), "Traceback ...", 0.5)
    assert report["type"] == "_BadStr" and "str() failed" in report["message"] and report["duration"] == 0.5
