"""A value its worker cannot serialise for lack of memory is not asked for forever: after
``MAX_SERVE_TRIES`` the futures wanting it fail with the underlying error.

The shortage is real: the worker runs under an address-space limit (``RLIMIT_AS``, set by a
preloaded module) with room for the value but not for its pickled copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tidepool
from tidepool.errors import SerializationError

pytestmark = pytest.mark.integration

AS_LIMIT = '''
import resource

def _vm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0

# room for the worker's threads and one 400 MiB value, not for a second (pickled) copy of it
resource.setrlimit(resource.RLIMIT_AS, (_vm() + 700 * 2**20, resource.RLIM_INFINITY))
'''


def big() -> bytes:
    return b"x" * (400 * 2**20)  # bytes pickle in-band: serving copies them


def test_a_value_that_runs_out_of_memory_when_serialised_fails_its_future_with_the_reason(tmp_path: Path) -> None:
    """Before: ``result()`` retried about once a second with no end (here: the timeout)."""
    (tmp_path / "aslimit.py").write_text(AS_LIMIT)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with tidepool.LocalCluster(n_workers=1, memory_limit="none", env=env, preload=["aslimit"]) as cluster, \
            tidepool.Client(cluster) as client:  # fmt: skip
        fut = client.submit(big)
        with pytest.raises(SerializationError, match="ran out of memory 3 times") as info:
            fut.result(timeout=90)
        assert "MemoryError" in str(info.value)
        assert client.submit(len, "abc").result(timeout=30) == 3  # the worker serves on
        assert cluster.scheduler.state.tasks[fut.key].state == "erred"
