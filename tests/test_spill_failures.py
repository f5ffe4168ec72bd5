"""Spilling when the disk says no: real limits (``RLIMIT_FSIZE`` in a child process, a small tmpfs
where mounting is allowed, the worker's own ``--spill-limit``), never a mocked ``open``.

A failed write leaves no partial file, turns spilling off once (never retried on the same key),
and every value stays readable from memory; a value that cannot be pickled stays in memory alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import tidepool
from tidepool.errors import ConfigError
from tidepool.worker.spill import SpillStore, resolve_spill_limit

MB = 2**20


def arr(i: int, mb: float = 1) -> np.ndarray:  # type: ignore[type-arg]
    return np.full(int(mb * MB), i % 251, dtype=np.uint8)


def files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file()) if d.exists() else []


# ---- the spill limit (the worker's own cap) ---------------------------------------------------------
def test_the_spill_limit_is_enforced_and_then_spilling_stops_with_a_reason(tmp_path: Path) -> None:
    told: list[str] = []
    store = SpillStore(tmp_path / "s", target=1.5 * MB, limit=int(3.5 * MB), on_disable=told.append)
    for i in range(8):
        store[f"x{i}"] = arr(i)
    assert 0 < store.spilled_bytes <= 3.5 * MB
    assert sum(p.stat().st_size for p in files(tmp_path / "s")) <= 3.5 * MB
    assert "spill limit" in store.disabled and told == [store.disabled]  # said once
    written = store.spilled_total
    for i in range(8, 12):  # no further write is even tried
        store[f"x{i}"] = arr(i)
    assert store.spilled_total == written and len(files(tmp_path / "s")) == 3
    assert all((store[f"x{i}"] == i).all() for i in range(12))  # nothing lost
    store.close()
    assert not (tmp_path / "s").exists()


def test_a_value_that_cannot_be_pickled_stays_in_memory_and_is_not_tried_again(tmp_path: Path) -> None:
    store = SpillStore(tmp_path / "s", target=1.5 * MB)
    lock = threading.Lock()  # cannot be pickled
    store["lock"] = lock
    for i in range(5):
        store[f"x{i}"] = arr(i)
    assert store["lock"] is lock and "lock" in store.pinned
    assert not store.disabled and store.spilled_bytes > 0  # other values still spill
    assert store.evict(100 * MB) > 0 or store.memory_bytes <= 2 * MB
    assert all((store[f"x{i}"] == i).all() for i in range(5))
    del store["lock"]
    assert "lock" not in store and "lock" not in store.pinned


def test_a_spill_limit_of_zero_means_no_spilling_and_says_so(tmp_path: Path) -> None:
    """Found by a bug hunt: 0 meant *no cap* (83 MB spilled under "limit 0")."""
    for zero in (0, "0", "0B"):
        assert resolve_spill_limit(zero, "/") == -1
    told: list[str] = []
    store = SpillStore(tmp_path / "s", target=1.5 * MB, limit=resolve_spill_limit(0, "/"), on_disable=told.append)
    for i in range(6):
        store[f"x{i}"] = arr(i)
    assert store.spilled_total == 0 and not files(tmp_path / "s")
    # said as the setting it is, not as a failed write (a bug hunt: "writing to ... failed: [Errno 28]")
    assert store.disabled == "the spill limit is 0 (spill_limit=0, --spill-limit 0)" and told == [store.disabled]
    assert all((store[f"x{i}"] == i).all() for i in range(6))  # nothing lost: all in memory


def test_spill_limit_forms() -> None:
    assert resolve_spill_limit("none", "/") == 0
    assert resolve_spill_limit("10MB", "/") == 10_000_000
    assert 0 < resolve_spill_limit("10%", "/") <= resolve_spill_limit(None, "/")
    for bad in ("0%", "150%", "abc%", "lots"):
        with pytest.raises(ConfigError):
            resolve_spill_limit(bad, "/")
    with pytest.raises(ConfigError, match="spill"):
        tidepool.LocalCluster(n_workers=0, spill_limit="lots%")


# ---- a real file size limit -------------------------------------------------------------------------
FSIZE_CHILD = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    from tidepool.worker.spill import SpillStore

    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))  # files of at most 2 MiB
    told = []
    store = SpillStore(sys.argv[1], target=3.5 * 2**20, on_disable=told.append)
    for i in range(10):
        store[f"x{i}"] = np.full((1 + 2 * (i == 4)) * 2**20, i, dtype=np.uint8)  # x4: 3 MiB, too big
    sizes = sorted(os.path.getsize(os.path.join(sys.argv[1], n)) for n in os.listdir(sys.argv[1]))
    print("disabled:", store.disabled)
    print("told:", len(told))
    print("files:", len(sizes), "partial:", sum(1 for s in sizes if s > 2**20 + 4096))
    print("ok:", all(int(store[f"x{i}"][0]) == i for i in range(10)))
""")


def test_a_write_past_the_file_size_limit_leaves_no_partial_file_and_turns_spilling_off(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "File too large" in out and "told: 1" in out, out  # EFBIG, said once
    assert "partial: 0" in out and "ok: True" in out, out


# ---- a real full disk (tmpfs) ---------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> object:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the RLIMIT_FSIZE test covers failed writes")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_leaves_no_partial_file_and_every_value_stays_readable(small_tmpfs: Path) -> None:
    d = small_tmpfs / "s"
    store = SpillStore(d, target=1.5 * MB, limit=0)
    for i in range(10):
        store[f"x{i}"] = arr(i, 1.4)
    assert "No space left" in store.disabled
    on_disk = files(d)
    assert len(on_disk) == len(store.on_disk)  # one file per spilled value: the failed one is gone
    assert all(p.stat().st_size > 1.4 * MB for p in on_disk)  # and each is whole
    assert all((store[f"x{i}"] == i).all() for i in range(10))
    store.close()
    assert os.listdir(small_tmpfs) == []


# ---- a worker whose spill writes fail -------------------------------------------------------------
FSIZE_PRELOAD = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, 20 * 2**20))\n"


def make(i: int) -> np.ndarray:  # type: ignore[type-arg]
    return np.full(100 * MB, i % 251, dtype=np.uint8)


@pytest.mark.integration
def test_a_worker_whose_spill_writes_fail_keeps_values_in_memory_and_says_so(tmp_path: Path) -> None:
    """Before: the failed write escaped into the worker's result handling and the tasks stalled."""
    (tmp_path / "fsize20.py").write_text(FSIZE_PRELOAD)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(tmp_path)}
    from tidepool.telemetry.journal import Journal

    journal = Journal()
    with tidepool.LocalCluster(n_workers=1, memory_limit="1GB", env=env, preload=["fsize20"]) as cluster, \
            tidepool.Client(cluster) as client:  # fmt: skip
        cluster.scheduler.subscribe(journal.observe)
        futs = client.map(make, range(7))  # 700 MB: past the 600 MB target, under the pause level
        assert [int(a[0]) for a in client.gather(futs, timeout=120)] == list(range(7))
        (info,) = client.scheduler_info()["workers"]
        assert "File too large" in info["spill_disabled"] and info["spilled_bytes"] == 0
        (rec,) = journal.of_kind("spill-disabled")
        assert rec["worker"] == info["id"] and "File too large" in rec["reason"]
        (wdir,) = [p for p in tmp_path.iterdir() if p.name.startswith(f"tidepool-{info['id']}-")]
        assert files(wdir / ".spill") == []  # the partial 20 MiB file was removed


def test_the_spill_limit_reaches_every_worker(tmp_path: Path) -> None:
    """``--spill-limit`` / ``LocalCluster(spill_limit=)`` set the worker's cap; the default is a
    share of the free space (never unlimited)."""
    import shutil

    from tidepool.cli import build_parser
    from tidepool.worker.server import Worker
    from tidepool.worker.spill import DEFAULT_SPILL_FRACTION

    assert build_parser().parse_args(["worker", "tcp://h:1", "--spill-limit", "5GB"]).spill_limit == "5GB"
    with tidepool.LocalCluster(n_workers=0, spill_limit="10MB") as cluster:
        args = cluster.provider.extra_args
        assert args[args.index("--spill-limit") + 1] == "10MB"
    for given, expect in (("10MB", 10_000_000), (None, None)):
        # (a limit well above what this test process uses: the whole suite runs in it, and a worker
        # refuses a limit its process already nearly passes)
        w = Worker("tcp://127.0.0.1:1", "token", memory_limit="8GB", spill_limit=given, spill_dir=str(tmp_path))
        try:
            assert isinstance(w.data, SpillStore)
            free = shutil.disk_usage(tmp_path).free
            if expect is None:  # the default: about half of what is free
                assert 0.9 * DEFAULT_SPILL_FRACTION * free <= w.data.limit <= 1.1 * DEFAULT_SPILL_FRACTION * free
            else:
                assert w.data.limit == expect
        finally:
            w.data.close()  # type: ignore[attr-defined]
            shutil.rmtree(w.setup_dir, ignore_errors=True)


def test_a_file_error_is_not_blamed_on_the_address(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every OSError, e.g. the missing spill directory at close, ended in '(is the address
    right and the port free?)'."""
    from tidepool.cli import main

    assert main(["certs", "/proc/no-such-dir/certs"]) == 2
    err = capsys.readouterr().err
    assert "No such file or directory" in err and "address" not in err


def test_a_missing_spill_dir_is_created_and_an_unusable_one_is_named(tmp_path: Path) -> None:
    # found by a bug hunt: a missing --spill-dir failed with "[Errno 2] No such file or directory:
    # '/nonexistent/x/tidepool-w-...'", naming neither the option nor the fix
    from tidepool.errors import ConfigError
    from tidepool.worker.server import Worker

    where = tmp_path / "not" / "yet"
    w = Worker("tcp://127.0.0.1:1", "token", memory_limit="8GB", spill_dir=str(where))
    try:
        assert isinstance(w.data, SpillStore) and where.is_dir()
    finally:
        w.data.close()  # type: ignore[attr-defined]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--spill-dir .*a-file/x.*give a directory this worker may create"):
        Worker("tcp://127.0.0.1:1", "token", memory_limit="8GB", spill_dir=str(blocker / "x"))
