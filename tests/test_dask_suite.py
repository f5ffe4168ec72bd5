"""Dask's own tests on tidepool: a sample of Dask's installed array, bag, dataframe and delayed test
modules, run by ``tests/dask_suite/run.py`` with tidepool as Dask's scheduler (every scheduler
name routed to ``client.get``).  The full runs, per module, are in docs/dask-collections.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dask.dataframe")
pytest.importorskip("dask.bag")

pytestmark = pytest.mark.integration

SUITE = Path(__file__).resolve().parent / "dask_suite"
sys.path.insert(0, str(SUITE))
import run  # noqa: E402

#: in the sample because they fail on any cluster and pass on Dask's synchronous scheduler
CLUSTER_ONLY_FAILURES = {"dask/array/tests/test_array_core.py::test_store_regions"}


def test_sample_of_dasks_own_tests_passes_with_tidepool_as_the_scheduler(tmp_path: Path) -> None:
    sample = [line.strip() for line in (SUITE / "sample.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]  # fmt: skip
    if not all((run.dask_root() / node.split("::")[0]).exists() for node in sample):
        pytest.skip("this Dask install has no test modules")
    out = tmp_path / "outcomes.json"
    proc = subprocess.run([sys.executable, str(SUITE / "run.py"), "--backends", "tidepool", "--tests",
                           str(SUITE / "sample.txt"), "--timeout", "90", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    outcomes: dict[str, str] = json.loads(out.read_text())["tidepool"]
    routed = re.search(r"graphs routed to it: (\d+)", proc.stderr)
    assert routed and int(routed.group(1)) >= len(sample), proc.stderr[-4000:]
    ran = {n.split("[")[0] for n in outcomes}
    assert {n.split("[")[0] for n in sample} <= ran, proc.stdout
    wrong = {n: o for n, o in outcomes.items()
             if o != ("failed" if n in CLUSTER_ONLY_FAILURES else "passed")}  # fmt: skip
    assert not wrong, f"{wrong}\n{proc.stdout}\n{proc.stderr[-4000:]}"
