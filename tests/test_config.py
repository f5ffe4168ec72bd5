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


NT = "[[node_types]]\nname='a'\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at least one [[node_types]]"),
        ("[[node_types]]\nname='a'\nresources={cpu='many'}\n", "resource 'cpu' must be a number"),
        ("[[node_types]]\nname='a'\n[[node_types]]\nname='a'\n", "unique"),
        ("[[node_types]]\nname='a'\nmin_nodes=2\nmax_nodes=1\n", "min_nodes <= max_nodes"),
        ("[policy]\nkind='magic'\n" + NT, "kind must be one of"),
        ("[[node_types]\n", "invalid TOML"),
        # unknown keys, in every table: named, with the closest allowed key and the allowed list
        ("[[node_types]]\nname='a'\nresources={cpu=1}\nmax_nodse=3\n",
         "unknown key 'max_nodse' (did you mean 'max_nodes'?) in [[node_types]] #1 ('a')"),
        ("[policy]\nidle_timout=1\n" + NT, "unknown key 'idle_timout' (did you mean 'idle_timeout'?) in [policy]"),
        ("[nodes]\n", "unknown key 'nodes' (did you mean 'node_types'?) in the top level"),
        ("[scheduler]\nprot=1\n" + NT, "unknown key 'prot' (did you mean 'port'?) in [scheduler]; allowed keys: host, port"),
        ("[scheduler]\nprot=1\n", "unknown key 'prot' (did you mean 'port'?)"),  # before "define [[node_types]]"
        ("[provider]\nenvv={A='1'}\n" + NT, "unknown key 'envv' (did you mean 'env'?) in [provider]"),
        ("[provider]\nkind='slurm'\nwaltime='1:00:00'\n" + NT, "unknown key 'waltime' (did you mean 'walltime'?)"),
        ("[provider]\nkind='callback'\nlaunch='os:getcwd'\nterminate='os:getpid'\npyton='x'\n" + NT,
         "unknown key 'pyton' (did you mean 'python'?)"),
        ("[policy]\nkind='backlog'\nmax_eta=5\n" + NT, "unknown key 'max_eta' in [policy] (kind = 'backlog')"),
        ("[policy]\nkind='tidepool.scaling.policies:Backlog'\ndellay=1\n" + NT, "unknown key 'dellay'"),
        # bad values fail at load time, not when the scheduler starts
        ("[[node_types]]\nname='a'\nmax_nodes=2.5\n", "max_nodes must be a whole number >= 0, got 2.5"),
        ("[[node_types]]\nname='a'\nmax_nodes=true\n", "max_nodes must be a whole number >= 0, got True"),
        ("[[node_types]]\nname='a'\nmin_nodes=-1\n", "min_nodes must be a whole number >= 0"),
        ("[[node_types]]\nname='a'\nworkers_per_node=0\n", "workers_per_node must be a whole number >= 1"),
        ("[[node_types]]\nname='a'\ncost=nan\n", "cost must be a finite number >= 0, got nan"),
        ("[[node_types]]\nname='a'\nstartup_estimate=inf\n", "startup_estimate must be a finite number >= 0"),
        ("[[node_types]]\nname='a'\nbilled_startup=-5\n", "billed_startup must be a finite number >= 0"),
        ("[[node_types]]\nname='a b'\n", "node type name must be letters, digits"),
        ("[[node_types]]\nmax_nodes=1\n", "[[node_types]] #1 needs a name"),
        ("[node_types]\nname='a'\n", "write [[node_types]] (double brackets)"),
        ("[scheduler]\nport=70000\n" + NT, "port must be a whole number 0..65535"),
        ("[scheduler]\nport='8786'\n" + NT, "port must be a whole number 0..65535"),
        ("[scheduler]\nhost=1\n" + NT, "host must be a host name or address"),
        # a bug hunt: a number crashed the scheduler with a TypeError traceback
        ("[scheduler]\ntls_ca_file=5\ntls_cert='c'\ntls_key='k'\n" + NT, "tls_ca_file must be the path of a PEM file"),
        ("[scheduler]\ntls_cert=['c.pem']\n" + NT, "tls_cert must be the path of a PEM file"),
        ("[scheduler]\ntls_cert='c.pem'\n" + NT, "TLS needs tls_ca_file, tls_cert and tls_key together"),
        ("scheduler=3\n" + NT, "[scheduler] must be a table"),
        ("[provider]\nkind='nomad'\n" + NT, "[provider] kind must be one of local, ssh, slurm, callback"),
        ("[provider]\nenv='A=1'\n" + NT, "[provider] env must be a table of strings"),
        ("[provider]\nextra_args='--x'\n" + NT, "[provider] extra_args must be a list of strings"),
        ("[provider]\nheartbeat_interval=-1\n" + NT, "heartbeat_interval must be a finite number >= 0"),
        ("[provider]\nkind='slurm'\nwalltime='soon'\n" + NT, "cannot read walltime 'soon'"),
        ("[provider]\nkind='slurm'\ncores=0\n" + NT, "cores must be >= 1"),
        ("[provider]\nkind='callback'\nlaunch='os:getcwd'\n" + NT, "needs launch and terminate"),
        ("[provider]\nkind='callback'\nlaunch='nope_mod:x'\nterminate='os:getpid'\n" + NT, "cannot import 'nope_mod:x'"),
        ("[provider]\nkind='nope_mod:Provider'\n" + NT, "cannot import 'nope_mod:Provider'"),
        ("[policy]\nidle_timeout=-1\n" + NT, "[policy] idle_timeout must be a number of seconds >= 0"),
        ("[policy]\nmax_eta='soon'\n" + NT, "[policy] max_eta must be a number of seconds >= 0"),
        ("[policy]\nkind='tidepool.scaling.policies:Backlog'\ndelay='x'\n" + NT, "[policy] delay must be a number"),
        ("[policy]\nkind='os:getcwd'\nx=1\n" + NT, "a function: it takes no options"),
        ("[policy]\nkind='os:sep'\n" + NT, "is not callable"),
    ],
)  # fmt: skip
def test_bad_files_fail_with_the_file_and_key_named(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert message in str(info.value)
    assert path in str(info.value)


def test_unknown_keys_list_every_allowed_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, "[provider]\nkind='local'\nenvv={}\nfoo=1\n" + NT))
    msg = str(info.value)
    assert "unknown keys 'envv' (did you mean 'env'?), 'foo' in [provider]" in msg
    assert "allowed keys: cwd, env, extra_args, fork_server, heartbeat_interval, kind, preload" in msg


def test_provider_values_are_checked_without_starting_anything(tmp_path: Path) -> None:
    """Loading builds nothing that runs: a slurm file loads on a machine without sbatch."""
    cfg = load(write(tmp_path, "[provider]\nkind='slurm'\nwalltime='02:00:00'\njob_extra=['--qos=x']\n"
                               "submit_command='/nonexistent/sbatch'\n" + NT))  # fmt: skip
    assert cfg.provider["submit_command"] == "/nonexistent/sbatch"


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


def test_a_file_whose_node_types_can_never_launch_is_refused_for_every_command() -> None:
    """Found by a bug hunt: ``tidepool scheduler --cluster`` and ``tidepool simulate --cluster``
    took a file with ``max_nodes = 0`` on every node type (only ``adapt`` refused it): the scheduler
    let every task wait for ever, the simulation ran to its stall limit."""
    two = {"node_types": [{"name": "a", "max_nodes": 0}, {"name": "b", "max_nodes": 0}]}
    with pytest.raises(ConfigError, match=r"max_nodes is 0 for every node type \('a', 'b'\)"):
        parse(two, "c.toml")
    two["node_types"][1]["max_nodes"] = 1  # one kept in reserve beside one that launches: fine
    assert [nt.max_nodes for nt in parse(two, "c.toml").node_types] == [0, 1]


def test_a_cluster_file_can_pick_the_planned_default_policy_with_its_objective() -> None:
    # a bug hunt found a cluster file could only run the older Adaptive, never adapt()'s default
    from tidepool.scaling.planned import Planned

    nodes = [{"name": "cpu", "max_nodes": 2}]
    pol = parse({"policy": {"kind": "default", "objective": "cheapest", "guess_budget": 0.5}, "node_types": nodes},
                "c.toml").make_policy()  # fmt: skip
    assert isinstance(pol, Planned) and pol.plan.objective == "cheapest" and pol.plan.guess_budget == 0.5
    assert parse({"policy": {"kind": "default", "budget": 3}, "node_types": nodes}, "c.toml").make_policy().plan.budget == 3
    # the budget is also the controller's hard limit, as adapt(budget=) makes it (a review found
    # the file's planned only within it); an [autoscaler] budget given too is kept
    assert parse({"policy": {"kind": "default", "budget": 3}, "node_types": nodes}, "c.toml").autoscaler == {"budget": 3}
    both = {"policy": {"kind": "default", "budget": 3}, "autoscaler": {"budget": 2.5}, "node_types": nodes}
    assert parse(both, "c.toml").autoscaler == {"budget": 2.5}
    assert parse({"policy": {"kind": "default"}, "node_types": nodes}, "c.toml").autoscaler == {}
    for bad, said in (({"objective": "cheap"}, "did you mean 'cheapest'"), ({"budget": -1}, "budget must be"),
                      ({"idle_timeout": 5}, "unknown key 'idle_timeout'"),
                      ({"min_lifetime": "x"}, "min_lifetime must be a number of seconds")):  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            parse({"policy": {"kind": "default", **bad}, "node_types": nodes}, "c.toml")
