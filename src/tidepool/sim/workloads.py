"""Built-in workloads: the graphs of ``benchmarks/elastic.py`` and large synthetic ones.

The elastic workloads are written task for task as that benchmark submits them (same durations,
result sizes, resources, the same futures held by the client), so a simulated run can be compared
with a real one (``benchmarks/sim_fidelity.py``).  Every function takes ``seed`` (for sampled
durations) and returns a :class:`~tidepool.sim.workload.Workload`; the CLI passes ``--param
key=value`` as keyword arguments.

- ``bursty(n=40, work=0.5, reduce=3.0, final=0.1, keep=True)``: n tasks, a reduce over them, n
  tasks that each need the reduce's result, a final reduce (``keep``: the client holds every result);
- ``chain(n=20, step=0.2)``; ``wide(n=200, work=0.1)``;
- ``gpu(n_gpu=8, n_cpu=20, work=0.3)``: GPU tasks (``gpu: 1``) and CPU tasks submitted together;
- ``scale_down(n=20, work=0.2, nbytes=1 MiB, idle=3.0)``: results held, ``idle`` seconds of
  nothing, then gathered;
- ``layers(width=1000, depth=10, duration="expo(1)", fan_in=2, nbytes=1000)``: ``depth`` layers of
  ``width`` tasks, each needing ``fan_in`` tasks of the layer before; the last layer is wanted
  (``layers --param width=100000`` is the 1,000,000-task case);
- ``bag(n=1000, duration="expo(1)")``: independent tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidepool.sim.dists import parse_dist, stream
from tidepool.sim.workload import SimTask, Stage, Workload, single

INT_BYTES = 28  # sys.getsizeof(1): what the worker reports for a small int result
MIB = 1 << 20


def bursty(seed: int = 0, n: int = 40, work: float = 0.5, reduce: float = 3.0, final: float = 0.1,
           keep: bool = True) -> Workload:  # fmt: skip
    """``benchmarks/elastic.py`` bursty: the client holds every future until the end (``keep``;
    with ``keep=False`` only the final result, so values are freed as the run goes)."""
    n, work, reduce, final = int(n), float(work), float(reduce), float(final)
    a = [SimTask(f"work-{i:08x}", work, (), "work", nbytes=INT_BYTES) for i in range(n)]
    r = SimTask("reduce-0000000a", reduce, [t.key for t in a], "reduce", nbytes=INT_BYTES)
    b = [SimTask(f"phase2-{i}", work, (r.key,), "work", nbytes=INT_BYTES) for i in range(n)]
    f = SimTask("reduce-0000000b", final, [t.key for t in b], "reduce", nbytes=INT_BYTES)
    tasks = [*a, r, *b, f]
    return single("bursty", tasks, [t.key for t in tasks] if keep else [f.key])


def chain(seed: int = 0, n: int = 20, step: float = 0.2) -> Workload:
    """``f = submit(step, f)`` n times: the client drops each future but the last."""
    tasks: list[SimTask] = []
    for i in range(int(n)):
        tasks.append(SimTask(f"step-{i:08x}", float(step), (tasks[-1].key,) if tasks else (), "step",
                             nbytes=INT_BYTES))  # fmt: skip
    return single("chain", tasks, [tasks[-1].key])


def wide(seed: int = 0, n: int = 200, work: float = 0.1) -> Workload:
    tasks = [SimTask(f"work-{i:08x}", float(work), (), "work", nbytes=INT_BYTES) for i in range(int(n))]
    return single("wide", tasks, [t.key for t in tasks])


def gpu(seed: int = 0, n_gpu: int = 8, n_cpu: int = 20, work: float = 0.3) -> Workload:
    g = [SimTask(f"work-{i:08x}", float(work), (), "work", {"gpu": 1.0}, INT_BYTES) for i in range(int(n_gpu))]
    c = [SimTask(f"work-{i + 100:08x}", float(work), (), "work", nbytes=INT_BYTES) for i in range(int(n_cpu))]
    tasks = g + c
    return single("gpu", tasks, [t.key for t in tasks])


def scale_down(seed: int = 0, n: int = 20, work: float = 0.2, nbytes: int = MIB + 50, idle: float = 3.0) -> Workload:
    """Results held on the workers, ``idle`` seconds of nothing, then one gather of all of them."""
    tasks = [SimTask(f"blob-{i:08x}", float(work), (), "blob", nbytes=int(nbytes)) for i in range(int(n))]
    return single("scale-down", tasks, [t.key for t in tasks], hold=float(idle))


def layers(seed: int = 0, width: int = 1000, depth: int = 10, duration: Any = "expo(1)", fan_in: int = 2,
           nbytes: int = 1000) -> Workload:  # fmt: skip
    """``depth`` layers of ``width`` tasks; task i of a layer needs tasks i .. i+fan_in-1 (mod
    width) of the layer before.  Only the last layer is wanted, so values are freed as the run goes."""
    width, depth, fan_in = int(width), int(depth), max(0, int(fan_in))
    dist = parse_dist(duration, "layers duration")
    rng = stream(seed, "durations")
    sample = dist.sample
    tasks: list[SimTask] = []
    prev: list[str] = []
    for d in range(depth):
        keys = [f"l{d}-{i}" for i in range(width)]
        for i, k in enumerate(keys):
            deps = tuple(prev[(i + j) % width] for j in range(min(fan_in, width))) if prev else ()
            tasks.append(SimTask(k, sample(rng), deps, "step", nbytes=int(nbytes)))
        prev = keys
    return Workload("layers", [Stage(tasks, prev)])


def bag(seed: int = 0, n: int = 1000, duration: Any = "expo(1)", nbytes: int = 8) -> Workload:
    dist = parse_dist(duration, "bag duration")
    rng = stream(seed, "durations")
    tasks = [SimTask(f"job-{i}", dist.sample(rng), (), "job", nbytes=int(nbytes)) for i in range(int(n))]
    return single("bag", tasks, [t.key for t in tasks])


BUILTIN: dict[str, Callable[..., Workload]] = {
    "bursty": bursty, "chain": chain, "wide": wide, "gpu": gpu, "scale-down": scale_down,
    "layers": layers, "bag": bag,
}  # fmt: skip
