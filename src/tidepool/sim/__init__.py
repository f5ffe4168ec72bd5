"""Discrete-event simulation of tidepool: the real scheduler state machine, scaling controller and
policies, driven on a fake clock by simulated workers, providers and a client.

Use it to see what a policy would do on 10,000 workers before paying for them, to replay a
recorded run under another policy, and to measure the state machine's own ceiling (events per
second, memory per task).  ``tidepool simulate`` is the command line; docs/simulation.md the guide.

Modules: ``engine`` (the loop, the simulated workers and client), ``shell`` (the autoscaler shell,
the only caller of the controller), ``provider`` (start-up delays, failures, walltimes),
``cluster`` (cluster files with a ``[simulate]`` table), ``workload`` and ``workloads`` (graphs:
JSON, journals, Python callables, built-ins), ``policies`` (Dask-like and HyperQueue-like rules,
policy names), ``dists`` (seeded distributions), ``report`` (tables and the makespan-cost plot).
"""

from __future__ import annotations

from tidepool.sim.cluster import SimCluster, load_cluster, preset_cluster
from tidepool.sim.engine import SimResult, SimStats, Simulation, simulate
from tidepool.sim.policies import DaskLike, HyperQueueLike, make_policy
from tidepool.sim.provider import PRESETS, SimProvider, StartupModel
from tidepool.sim.shell import StepCost
from tidepool.sim.workload import SimTask, Stage, Workload, load_workload

__all__ = [
    "PRESETS", "DaskLike", "HyperQueueLike", "SimCluster", "SimProvider", "SimResult", "SimStats", "SimTask",
    "Simulation", "Stage", "StartupModel", "StepCost", "Workload", "load_cluster", "load_workload",
    "make_policy", "preset_cluster", "simulate",
]  # fmt: skip
