"""Shared test setup.

Worker processes import task functions defined in test modules by reference (cloudpickle pickles
importable functions by name), so the tests folder goes on their PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [TESTS, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# The suite runs on the standard event loop, what a plain install gets (the test extra installs
# uvloop for tests/test_loop_choice.py); ``TIDEPOOL_LOOP=uvloop pytest`` runs all of it on uvloop.
os.environ.setdefault("TIDEPOOL_LOOP", "asyncio")


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Path]:
    """A file that gated tasks wait for; always created at teardown, so no worker slot stays busy."""
    path = tmp_path / "gate"
    yield path
    path.touch()
