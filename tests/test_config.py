"""Cluster files: parsing, validation errors, and a scheduler that scales from one (real processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tidepool
from tidepool.config import load, parse
from tidepool.errors import ConfigError
from tidepool.providers.callback import CallbackProvider
from tidepool.providers.local import LocalProvider
from tidepool.scaling.policies import Adaptive, CompletionTarget

GOOD = """
[scheduler]
port = 0

[provider]
kind = "local"

[policy]
kind = "adaptive"
idle_timeout = 2.5
max_eta = 600

[[node_types]]
name = "cpu"
resources = { cpu = 2, memory = "4GB" }
max_nodes = 3

[[node_types]]
name = "gpu"
resources = { cpu = 4, gpu = 2 }
max_nodes = 1
cost = 4.0
startup_estimate = 20
"""


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return str(p)


def test_good_file_gives_node_types_policy_and_provider(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, GOOD))
    assert [nt.name for nt in cfg.node_types] == ["cpu", "gpu"]
    assert cfg.node_types[0].resources == {"cpu": 2.0, "memory": 4e9}
    assert cfg.node_types[1].startup_estimate == 20
    pol = cfg.make_policy()
    assert isinstance(pol, Adaptive) and isinstance(pol.launcher, CompletionTarget)
    assert pol.launcher.max_eta == 600 and pol.idle.idle_timeout == 2.5  # type: ignore[union-attr]
    assert isinstance(cfg.make_provider("tcp://127.0.0.1:1", "tok"), LocalProvider)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at least one [[node_types]]"),
        ("[[node_types]]\nname='a'\nresources={cpu=1}\nmax_nodse=3\n", "unknown keys ['max_nodse']"),
        ("[[node_types]]\nname='a'\nresources={cpu='many'}\n", "byte amount"),
        ("[[node_types]]\nname='a'\n[[node_types]]\nname='a'\n", "unique"),
        ("[[node_types]]\nname='a'\nmin_nodes=2\nmax_nodes=1\n", "min_nodes <= max_nodes"),
        ("[policy]\nkind='magic'\n[[node_types]]\nname='a'\n", "kind must be one of"),
        ("[policy]\nidle_timout=1\n[[node_types]]\nname='a'\n", "unknown [policy] keys"),
        ("[nodes]\n", "unknown tables"),
        ("[[node_types]\n", "invalid TOML"),
    ],
)
def test_bad_files_fail_with_the_file_and_key_named(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert message in str(info.value)
    assert path in str(info.value)


def test_callback_provider_from_module_functions() -> None:
    cfg = parse({"provider": {"kind": "callback", "launch": "os:getcwd", "terminate": "os:getpid"},
                 "node_types": [{"name": "a"}]})  # fmt: skip
    prov = cfg.make_provider("tcp://127.0.0.1:1", "tok")
    assert isinstance(prov, CallbackProvider) and prov.scheduler == "tcp://127.0.0.1:1"
    with pytest.raises(ConfigError, match="cannot import"):
        parse({"provider": {"kind": "callback", "launch": "nope:x", "terminate": "os:getpid"},
               "node_types": [{"name": "a"}]}).make_provider("tcp://x:1", "t")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def work(x: int) -> int:
    time.sleep(0.2)
    return x * 2


@pytest.mark.integration
def test_scheduler_started_from_a_cluster_file_launches_its_own_workers(tmp_path: Path) -> None:
    port = free_port()
    path = write(tmp_path, f"""
[scheduler]
host = "127.0.0.1"
port = {port}

[[node_types]]
name = "cpu"
resources = {{ cpu = 1 }}
max_nodes = 2
startup_estimate = 0.5
""")
    token_file = tmp_path / "token"
    journal = tmp_path / "journal.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "scheduler", "--cluster", path,
                             "--token-file", str(token_file), "--journal", str(journal)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in first, first
        with tidepool.Client(f"tcp://127.0.0.1:{port}", token_file.read_text()) as client:
            assert client.gather(client.map(work, range(8))) == [x * 2 for x in range(8)]
            assert client.scheduler_info()["counters"]["workers_joined"] >= 1
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
    kinds = [line.split('"kind": "')[1].split('"')[0] for line in journal.read_text().splitlines()]
    assert "launch" in kinds and "worker-join" in kinds
