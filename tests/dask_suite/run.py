"""Run Dask's own collection test modules with a cluster as Dask's scheduler, and compare backends.

For each backend (``tidepool``, ``distributed``, or ``none`` = Dask's own schedulers) this runs
pytest in a subprocess over Dask's installed test modules with the ``dask_on_cluster`` plugin,
reads the JUnit XML it writes, and prints per module how many tests passed, failed and were
skipped, then every test that fails on tidepool but passes on the reference backend.

    python tests/dask_suite/run.py                       # the modules below, tidepool and distributed
    python tests/dask_suite/run.py --backends tidepool --modules dask/tests/test_delayed.py
    python tests/dask_suite/run.py --tests SAMPLE.txt    # node ids relative to the dask package
    python tests/dask_suite/run.py --pytest-args='-v -k vindex'

The full runs are documented in docs/dask-collections.md; tests/test_dask_suite.py runs a sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODULES = [
    "dask/array/tests/test_array_core.py",
    "dask/bag/tests/test_bag.py",
    "dask/tests/test_delayed.py",
    "dask/dataframe/tests/test_dataframe.py",
    "dask/dataframe/tests/test_groupby.py",
    "dask/dataframe/tests/test_shuffle.py",
]


def dask_root() -> Path:
    """The directory holding the installed ``dask`` package."""
    import dask

    return Path(dask.__file__).resolve().parent.parent


def run_backend(backend: str, targets: list[str], timeout: float, extra: list[str]) -> dict[str, str]:
    """Node id (relative to the dask package's parent) -> outcome: passed, failed or skipped."""
    site = dask_root()
    env = dict(os.environ, DASK_SUITE_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="dask-suite-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "dask_on_cluster", "-p", "no:cacheprovider", "-q",
               "--no-header", "--tb=short", "-o", "junit_family=xunit1", f"--timeout={timeout}", f"--junitxml={xml}",
               f"--rootdir={site}", *extra, *[str(site / t) for t in targets]]  # fmt: skip
        subprocess.run(cmd, cwd=tmp, env=env, stdout=sys.stderr, check=False)
        if not xml.exists():
            raise SystemExit(f"pytest wrote no report for backend {backend}")
        return parse(xml)


def parse(xml: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        node = f"{file}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            out[node] = "failed"
        elif "skipped" in kinds:
            out[node] = "skipped"
        else:
            out[node] = "passed"
    return out


def module_of(node: str) -> str:
    return node.split("::", 1)[0]


def counts(results: dict[str, str]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for node, outcome in results.items():
        row = table.setdefault(module_of(node), {"passed": 0, "failed": 0, "skipped": 0})
        row[outcome] += 1
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--backends", default="tidepool,distributed", help="comma list; the first is compared")
    ap.add_argument("--modules", nargs="*", default=MODULES, help="paths relative to the dask package's parent")
    ap.add_argument("--tests", help="a file of node ids (relative to the dask package's parent), one a line")
    ap.add_argument("--timeout", type=float, default=120, help="per test, seconds")
    ap.add_argument("--json", help="write the outcomes per backend here")
    ap.add_argument("--report", action="append", default=[], metavar="BACKEND=JUNIT.xml",
                    help="read a finished run's JUnit XML instead of running that backend")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '-v -k vindex'")
    args = ap.parse_args(argv)
    targets = args.modules
    if args.tests:
        targets = [line.strip() for line in Path(args.tests).read_text().splitlines()
                   if line.strip() and not line.startswith("#")]  # fmt: skip
    backends = args.backends.split(",")
    given = dict(r.split("=", 1) for r in args.report)
    results = {b: parse(Path(given[b])) if b in given else run_backend(b, targets, args.timeout,
                                                                       shlex.split(args.pytest_args))
               for b in backends}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    for b in backends:
        print(f"\n{b}:")
        for module, row in sorted(counts(results[b]).items()):
            print(f"  {module}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped")
    if len(backends) > 1:
        first, ref = results[backends[0]], results[backends[1]]
        only = sorted(n for n, o in first.items() if o == "failed" and ref.get(n) == "passed")
        print(f"\nfailing on {backends[0]} but passing on {backends[1]}: {len(only)}")
        for n in only:
            print("  " + n)
        return 1 if only else 0
    return 1 if any(o == "failed" for o in results[backends[0]].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
