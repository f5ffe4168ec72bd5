"""``Future.traceback()``: traceback objects rebuilt from a worker's formatted traceback.

The pure part (parsing and rebuilding) is driven with text; one real cluster run checks that the
remote function names and lines come back through ``traceback.extract_tb``.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterator

import pytest

import tidepool
from tidepool.errors import RemoteTraceback
from tidepool.tracebacks import frames, of_exception, rebuild

CHAINED = """Traceback (most recent call last):
  File "/srv/a.py", line 3, in first
    open(path)
FileNotFoundError: nope

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/srv/b.py", line 10, in outer
    load()
  File "/srv/b.py", line 20, in load
    raise ValueError("bad")
ValueError: bad
"""


def test_the_frames_of_the_raised_exceptions_traceback_are_read_outermost_first() -> None:
    assert frames(CHAINED) == [("/srv/b.py", 10, "outer"), ("/srv/b.py", 20, "load")]
    assert frames("ValueError: no frames at all\n") == [] and rebuild("ValueError: x\n") is None


def test_rebuilt_entries_point_at_the_remote_file_line_and_function() -> None:
    tb = rebuild(CHAINED)
    summary = traceback.extract_tb(tb)
    assert [(f.filename, f.lineno, f.name) for f in summary] == [("/srv/b.py", 10, "outer"), ("/srv/b.py", 20, "load")]
    assert "in load" in "".join(traceback.format_tb(tb))


def test_a_local_source_line_is_shown_whole_without_markers_under_part_of_it() -> None:
    line = inspect.getsourcelines(rebuild)[1] + 3  # a long line inside rebuild
    text = f'Traceback (most recent call last):\n  File "{inspect.getsourcefile(rebuild)}", line {line}, in rebuild\nX: y\n'
    shown = "".join(traceback.format_tb(rebuild(text)))
    source = inspect.getsourcelines(rebuild)[0][3].strip()
    assert source in shown and "^" not in shown, shown


def test_an_error_without_remote_text_gives_its_own_traceback() -> None:
    try:
        raise KeyError("here")
    except KeyError as e:
        err = e
    assert of_exception(err) is err.__traceback__
    err.__cause__ = RemoteTraceback("no frames in this text")
    assert of_exception(err) is err.__traceback__


def inner(x: int) -> float:
    return 1 / x


def outer(x: int) -> float:
    return inner(x)


@pytest.fixture(scope="module")
def client() -> Iterator[tidepool.Client]:
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as c:
        yield c


@pytest.mark.integration
def test_future_traceback_names_the_remote_functions_and_lines_as_in_dask(client: tidepool.Client) -> None:
    failed = client.submit(outer, 0)
    tb = failed.traceback(timeout=60)
    names = [(f.name, f.lineno) for f in traceback.extract_tb(tb)]
    start = inspect.getsourcelines(inner)[1]
    assert names[-2:] == [("outer", inspect.getsourcelines(outer)[1] + 1), ("inner", start + 1)], names
    assert client.submit(outer, 1).traceback(timeout=60) is None
    with pytest.raises(TimeoutError):
        client.submit(inner, 1, resources={"nowhere": 1}).traceback(timeout=0.2)
