"""Code and environment on every worker, including workers that join later (real processes)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tidepool
from tidepool.errors import WorkerSetupError
from tidepool.scaling.node_types import NodeType
from tidepool.testing import wait_until

pytestmark = pytest.mark.integration


def read_env(name: str) -> str | None:
    return os.environ.get(name)


def read_setup_file(name: str) -> str:
    with open(tidepool.setup_file(name)) as f:
        return f.read()


def pid() -> int:
    return os.getpid()


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local package the workers cannot import until it is shipped."""
    pkg = tmp_path / "src" / "tp_shipped_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .core import triple\n")
    (pkg / "core.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for m in [m for m in sys.modules if m.startswith("tp_shipped_pkg")]:
        del sys.modules[m]
    return "tp_shipped_pkg"


def test_modules_env_files_and_function_reach_current_and_later_workers(shipped: str, tmp_path: Path) -> None:
    import importlib

    mod = importlib.import_module(shipped)
    data = tmp_path / "table.csv"
    data.write_text("a,b\n1,2\n")
    marker = "TIDEPOOL_TEST_SETUP_FN"

    def init() -> None:
        os.environ[marker] = "ran"

    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(ModuleNotFoundError):  # not importable on workers before shipping
            client.submit(mod.triple, 2).result()
        out = client.register_setup(init, modules=[shipped], files=[str(data)], env={"TP_COLOR": "teal"})
        assert list(out.values()) == ["ok"]
        assert client.submit(mod.triple, 5).result() == 15
        (late,) = cluster.add_workers(1, node_type=NodeType("late", {"cpu": 1, "late": 1}))
        checks = [client.submit(f, *a, resources={"late": 1}) for f, a in
                  [(mod.triple, (7,)), (read_env, ("TP_COLOR",)), (read_env, (marker,)),
                   (read_setup_file, ("table.csv",))]]  # fmt: skip
        assert client.gather(checks) == [21, "teal", "ran", "a,b\n1,2\n"]
        assert cluster.scheduler.state.workers[late].executed >= 4


def test_worker_runs_no_task_before_its_setup_finished() -> None:
    def slow_setup() -> None:
        import time

        time.sleep(1.0)
        os.environ["TP_READY"] = "yes"

    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        client.register_setup(slow_setup)  # no workers yet: stored for the future
        futs = client.map(read_env, ["TP_READY"] * 5)
        cluster.add_workers(2, wait=False)
        assert client.gather(futs) == ["yes"] * 5


def bad_setup() -> None:
    raise RuntimeError("cannot reach the license server")


def test_failing_setup_is_reported_with_traceback_and_the_worker_takes_no_tasks() -> None:
    with tidepool.LocalCluster(n_workers=2) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(WorkerSetupError) as info:
            client.register_setup(bad_setup)
        msg = str(info.value)
        assert "license server" in msg and "bad_setup" in msg and "Traceback" in msg
        # both leave, and a fixed pool does not start new ones only to fail the same setup again
        wait_until(lambda: cluster.workers == [], timeout=30, what="the workers whose setup failed to leave")
        wait_until(lambda: all(p.proc.poll() is not None for p in cluster.provider.procs.values()), timeout=30,
                   what="their processes to exit")  # fmt: skip
        assert all("-r1-" in wid for wid in cluster.provider.procs), list(cluster.provider.procs)  # no replacements
        # a task submitted now fails at once with the setup's error (a docs review: it waited
        # no_worker_timeout, 60 s, then blamed resources "no worker has offered")
        with pytest.raises(WorkerSetupError, match="setup hook failed there") as late:
            client.submit(read_env, "HOME").result(timeout=20)
        assert "license server" in str(late.value) and "unregister_setup" in str(late.value)


def test_autoscaler_stops_launching_a_node_type_whose_setup_keeps_failing() -> None:
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        client.register_setup(bad_setup)
        scaler = cluster.adapt(node_types=[NodeType("flaky", {"cpu": 1}, max_nodes=1, startup_estimate=0.3)],
                               max_type_failures=2, backoff_base=0.2)  # fmt: skip
        fut = client.submit(read_env, "HOME")
        wait_until(lambda: "flaky" in scaler.view.unusable, timeout=30,
                   what="the autoscaler to disable the node type whose setup keeps failing")  # fmt: skip
        why = scaler.view.unusable["flaky"]
        assert "setup failed" in why and "license server" in why
        # the task never runs unprepared, and it does not wait forever either: it fails with the
        # setup's own error once the only node type that could run it is disabled
        with pytest.raises(WorkerSetupError, match="license server") as info:
            fut.result(timeout=30)
        assert "flaky" in str(info.value) and "disabled" in str(info.value)
        assert len(client.setup_errors) >= 2
        kinds = [r["kind"] for r in scaler.journal.records]
        assert "node-type-disabled" in kinds


def test_pip_requirements_install_on_workers_and_failures_are_clear(tmp_path: Path) -> None:
    wheel = tmp_path / "tp_pip_demo-1.0-py3-none-any.whl"  # a real wheel, built by hand: no network
    files = {
        "tp_pip_demo/__init__.py": "VALUE = 41\n",
        "tp_pip_demo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tp-pip-demo\nVersion: 1.0\n",
        "tp_pip_demo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                           "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("tp_pip_demo-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files) +
                    "tp_pip_demo-1.0.dist-info/RECORD,,\n")

    def value() -> int:
        import tp_pip_demo  # type: ignore[import-not-found]

        return int(tp_pip_demo.VALUE) + 1

    try:
        with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
            client.register_setup(requirements=[str(wheel)], pip_args=["--no-deps", "--no-index"])
            assert client.submit(value).result() == 42
            with pytest.raises(WorkerSetupError, match="pip exited"):
                client.register_setup(requirements=[str(tmp_path / "does-not-exist")], name="broken")
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "tp-pip-demo"], check=False)


def test_worker_cli_preload_env_and_workdir(tmp_path: Path) -> None:
    (tmp_path / "tp_preloaded.py").write_text("import os\nos.environ['TP_PRELOADED'] = 'yes'\n")
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        env = {**os.environ, "TIDEPOOL_TOKEN": cluster.token,
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "worker", cluster.address,
                                 "--preload", "tp_preloaded", "--env", "TP_FLAVOR=mint",
                                 "--workdir", str(tmp_path), "--id", "cli-w"], env=env)  # fmt: skip
        try:
            cluster.wait_for_workers(["cli-w"])
            got = client.gather([client.submit(read_env, "TP_PRELOADED"), client.submit(read_env, "TP_FLAVOR"),
                                 client.submit(os.getcwd)])  # fmt: skip
            assert got == ["yes", "mint", str(tmp_path)]
        finally:
            proc.terminate()
            proc.wait(10)
        bad = subprocess.run([sys.executable, "-m", "tidepool.cli", "worker", cluster.address,
                              "--preload", "tp_no_such_module"], env=env, capture_output=True, text=True,
                             timeout=30)  # fmt: skip
        assert bad.returncode == 2 and "tp_no_such_module" in bad.stderr


def test_a_setup_function_from_the_module_it_ships_runs_after_the_module_arrived(shipped: str,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """Found by a bug hunt: ``register_setup(mylib.init, modules=["mylib"])`` failed on every worker
    ("No module named 'mylib'") and closed them all: the function was unpickled before the modules
    step, by reference to a module the worker did not have yet."""
    import importlib

    (tmp_path / "src" / shipped / "boot.py").write_text(
        "import os\n\ndef init():\n    os.environ['TP_BOOTED'] = 'yes'\n")  # fmt: skip
    boot = importlib.import_module(f"{shipped}.boot")
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        assert list(client.register_setup(boot.init, modules=[shipped]).values()) == ["ok"]
        assert client.submit(read_env, "TP_BOOTED").result(timeout=60) == "yes"


def test_register_setup_arguments_a_user_gets_wrong_are_taken_or_refused_clearly(tmp_path: Path) -> None:
    """Found by a bug hunt: a plain string was read letter by letter (``requirements="numpy"`` ran
    ``pip install n u m p y``), two files of one name overwrote each other, and a sub-package was
    shipped without its parent's ``__init__``."""
    from tidepool.errors import ConfigError
    from tidepool.setup import build_spec

    assert build_spec("s", requirements="numpy").requirements == ["numpy"]
    assert build_spec("s", pip_args="--no-deps").pip_args == ["--no-deps"]
    one = tmp_path / "one.txt"
    one.write_text("1")
    assert list(build_spec("s", files=str(one)).files) == ["one.txt"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "params.txt").write_text(d)
    with pytest.raises(ConfigError, match="two files are named 'params.txt'"):
        build_spec("s", files=[str(tmp_path / "a" / "params.txt"), str(tmp_path / "b" / "params.txt")])
    with pytest.raises(ConfigError, match="ship the package 'email' instead of 'email.mime'"):
        build_spec("s", modules=["email.mime"])


def exits() -> None:
    sys.exit("bad arguments")


def test_a_setup_that_calls_sys_exit_is_a_setup_failure_not_a_crash_to_replace() -> None:
    """Found by a bug hunt: ``sys.exit()`` in a setup killed the worker; the cluster replaced it 20
    times and the client heard only "worker left"."""
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        with pytest.raises(WorkerSetupError, match="SystemExit: bad arguments"):
            client.register_setup(exits)
        assert len(cluster.provider.procs) <= 2  # not a chain of replacements


def test_setups_without_a_name_never_replace_each_other_by_chance() -> None:
    """Found by a bug hunt: two clients' env-only setups were both "setup-1", and two lambdas both
    "<lambda>": the first was dropped for workers joining later."""
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as one, \
            tidepool.Client(cluster) as two:  # fmt: skip
        one.register_setup(env={"TP_FROM_ONE": "1"})
        two.register_setup(env={"TP_FROM_TWO": "2"})
        one.register_setup(lambda: os.environ.setdefault("TP_LAMBDA_A", "a"))
        one.register_setup(lambda: os.environ.setdefault("TP_LAMBDA_B", "b"))
        cluster.add_workers(1)  # joins after all four: it must get all four
        got = [one.submit(read_env, v).result(timeout=60) for v in ("TP_FROM_ONE", "TP_FROM_TWO", "TP_LAMBDA_A",
                                                                    "TP_LAMBDA_B")]  # fmt: skip
        assert got == ["1", "2", "a", "b"]


def slow_ok_setup() -> None:
    import time

    time.sleep(1.0)


def broken_setup() -> None:
    raise RuntimeError("version 2 is broken")


def test_a_setup_registered_again_while_a_joining_worker_runs_the_old_one_reports_the_new_outcome() -> None:
    """Found by a bug hunt: the old version's "done" (run as the worker joined) answered the new
    registration: ``register_setup`` said "ok" for a worker where the new version then failed."""
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        client.register_setup(slow_ok_setup, name="init")  # no worker yet: kept for joiners
        cluster.add_workers(1, wait=False)
        wait_until(lambda: bool(cluster.scheduler.worker_conns), what="the worker to register (its setup runs)")
        with pytest.raises(WorkerSetupError, match="version 2 is broken"):
            client.register_setup(broken_setup, name="init")


def test_a_preload_that_fails_is_named_when_the_cluster_cannot_start(tmp_path: Path) -> None:
    """Found by a bug hunt: the error said only "worker ... exited with code 2"."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "tp_bad_preload.py").write_text("raise RuntimeError('DB_URL not set')\n")
    with pytest.raises(tidepool.ConfigError, match=r"exited with code 2: preloading module 'tp_bad_preload' failed: RuntimeError: DB_URL not set"):
        tidepool.LocalCluster(n_workers=1, preload=["tp_bad_preload"], env={"PYTHONPATH": str(mods)})


def test_two_registrations_of_one_setup_at_once_both_return() -> None:
    """Review: the second registration's waiter replaced the first's, which then waited for ever
    (two clients registering the same unnamed setup now share its name)."""
    import concurrent.futures as cf

    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as one, \
            tidepool.Client(cluster) as two:  # fmt: skip
        with cf.ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(c.register_setup, slow_ok_setup) for c in (one, two)]
            assert [list(f.result(timeout=60).values()) for f in calls] == [["ok"], ["ok"]]


def set_flag_env() -> None:
    os.environ["TP_JOIN_RACE"] = "set"


def test_a_worker_whose_registration_is_on_its_way_during_a_register_setup_gets_that_setup(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Found by a bug hunt: a setup registered while a joining worker's "registered" answer was
    being sent (slow: it carries every earlier setup, 80 MB of files in the hunt) reached neither
    that answer nor the worker, and register_setup still said "ok": the worker then ran tasks
    without it (237 of 2,058 setups missed in a stress run).  The answer is held here until the
    registration is done, so the race happens every time."""
    import asyncio
    import threading

    from tidepool.comm.core import TCPConnection

    arrived, release = threading.Event(), threading.Event()
    real_send = TCPConnection.send

    async def send(self: TCPConnection, msg: dict) -> None:  # type: ignore[type-arg]
        if msg.get("op") == "registered":
            arrived.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        await real_send(self, msg)

    monkeypatch.setattr(TCPConnection, "send", send)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.add_workers(1, wait=False)
        assert arrived.wait(60), "the worker never registered"
        assert client.register_setup(set_flag_env, name="flag") == {}  # no worker had registered yet
        release.set()
        client.wait_for_workers(1, timeout=60)
        assert client.submit(read_env, "TP_JOIN_RACE", pure=False).result(timeout=60) == "set"


def test_a_module_shipped_again_after_an_edit_runs_its_new_code_on_old_and_new_workers(shipped: str,
                                                                                      tmp_path: Path) -> None:  # fmt: skip
    """Found by a bug hunt: workers that had run a function of a shipped module kept running the
    old code after the edited module was registered again (its pickle, by reference, and so its
    id were unchanged: the loaded function was reused), and a package's submodule stayed old
    everywhere, on workers that joined later too (only the top module was reloaded).  The edit
    keeps the file's size: a .pyc from the same second would pass as up to date."""
    import importlib

    mod = importlib.import_module(shipped)
    core = tmp_path / "src" / shipped / "core.py"
    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        client.register_setup(modules=[shipped], name="code")
        assert client.submit(mod.triple, 2, pure=False).result(timeout=60) == 6
        core.write_text(core.read_text().replace("3 * x", "4 * x"))
        assert list(client.register_setup(modules=[shipped], name="code").values()) == ["ok"]
        assert client.submit(mod.triple, 2, pure=False).result(timeout=60) == 8
        (late,) = cluster.add_workers(1, node_type=NodeType("late", {"cpu": 1, "late": 1}))
        assert client.submit(mod.triple, 3, pure=False, resources={"late": 1}).result(timeout=60) == 12


ORPHAN = """
import os, sys, threading, time, tidepool
marker = sys.argv[1]
def slow():
    open(marker, "w").close()
    time.sleep(120)
with tidepool.LocalCluster(n_workers=1, dashboard=False) as cluster, tidepool.Client(cluster) as client:
    print(*client.run(os.getpid).values(), flush=True)
    threading.Thread(target=client.register_setup, args=(slow,), daemon=True).start()
    while not os.path.exists(marker):  # the setup runs on the worker: now this process (the scheduler) dies
        time.sleep(0.01)
    os.kill(os.getpid(), 9)
"""


def test_a_worker_whose_scheduler_dies_during_a_long_setup_exits(tmp_path: Path) -> None:
    """Found by a bug hunt: nothing read the scheduler connection while a setup ran, so a worker
    whose scheduler died then lived on as an orphan, and SIGTERM did not end it either (the exit
    waited for the setup's thread): 12 minutes behind a 3,600 s setup."""
    import psutil

    p = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path / "started")], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(p.stdout.readline()))  # type: ignore[union-attr]
        p.wait(timeout=60)
        wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, timeout=60,
                   what="the orphaned worker to exit")  # fmt: skip
    finally:
        p.kill()
        with contextlib.suppress(psutil.Error):
            worker.kill()


RESHIP = """
import importlib, sys
from pathlib import Path
from tidepool.setup import build_spec, run_setup
base = Path(sys.argv[1])
def ship(root):
    sys.path.insert(0, str(root))
    try:
        return build_spec("s", modules=["tp_reship"])
    finally:
        sys.path.remove(str(root))
        for n in [n for n in sys.modules if n.startswith("tp_reship")]:
            del sys.modules[n]
v1 = base / "v1" / "tp_reship"
(v1 / "helpers").mkdir(parents=True)
(v1 / "__init__.py").write_text("")
(v1 / "helpers" / "__init__.py").write_text("VALUE = 1\\n")
(v1 / "gone.py").write_text("X = 1\\n")
v2 = base / "v2" / "tp_reship"
v2.mkdir(parents=True)
(v2 / "__init__.py").write_text("")
(v2 / "helpers.py").write_text("VALUE = 2\\n")
s1, s2 = ship(base / "v1"), ship(base / "v2")
run_setup(s1, base / "worker")
import tp_reship.helpers, tp_reship.gone
held = tp_reship.helpers  # a task still using the first version
run_setup(s2, base / "worker")
importlib.import_module("tp_reship.helpers")
print("helpers", sys.modules["tp_reship.helpers"].VALUE)
try:
    importlib.import_module("tp_reship.gone")
    print("gone importable")
except ModuleNotFoundError:
    print("gone gone")
print("first version's files still there", Path(held.__file__).exists())
"""


def test_a_module_shipped_again_leaves_nothing_of_the_earlier_version_in_the_way(tmp_path: Path) -> None:
    """A third review: extracting the new version over the old one kept a package the new version
    turned into a module (a package wins: the old code ran) and modules it deleted.  Each version
    now has a directory of its own; the earlier one stays whole for tasks still using it."""
    r = subprocess.run([sys.executable, "-c", RESHIP, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["helpers 2", "gone gone", "first version's files still there True"], r.stdout


def test_a_setup_that_does_not_end_in_its_timeout_names_the_worker_and_can_be_unregistered(tmp_path: Path) -> None:
    flag = tmp_path / "release"

    def wait_for_release() -> None:
        import time

        while not flag.exists():
            time.sleep(0.05)
        os.environ["TP_RELEASED"] = "yes"

    with tidepool.LocalCluster(n_workers=1) as cluster, tidepool.Client(cluster) as client:
        stuck = cluster.workers[0]
        with pytest.raises(WorkerSetupError) as info:
            client.register_setup(wait_for_release, name="hang", timeout=0.5)
        msg = str(info.value)
        assert "'hang'" in msg and "did not finish within 0.5 s" in msg and stuck in msg, msg
        assert "retire_workers" in msg and "unregister_setup" in msg, msg
        with pytest.raises(tidepool.ConfigError, match="no setup is registered as 'nope'"):
            client.unregister_setup("nope")
        client.unregister_setup("hang")
        # a worker joining now does not run it, and takes the work while the stuck one waits
        cluster.add_workers(1)
        assert client.submit(read_env, "TP_RELEASED", pure=False).result(timeout=30) is None
        flag.write_text("go")  # the stuck worker's setup ends: it takes tasks again, prepared
        wait_until(lambda: list(client.run(read_env, "TP_RELEASED", workers=[stuck]).values()) == ["yes"], timeout=30,
                   what="the setup to end on the worker it timed out on")  # fmt: skip
        with pytest.raises(tidepool.ConfigError, match="timeout must be a number"):
            client.register_setup(wait_for_release, timeout=0)
