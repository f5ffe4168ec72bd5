"""The import layers (issue 25): nothing below the client imports it, and the client, its futures,
the Dask layer, the graph builder and the worker's context import each other in no circle.

Walks the source with tests/import_walk.py (nothing is imported): every ``import`` counts, at
module level or inside a function, except those under ``if TYPE_CHECKING:`` (annotations only).
Code that must reach the client from below goes through the public facade (``tidepool.default_client()``, resolved lazily by ``tidepool/__init__.py``).
"""

from __future__ import annotations

import ast

import pytest

from import_walk import SRC, circles, inside
from import_walk import import_graph as walk_imports

#: modules allowed to import the client besides the facade (``tidepool``): the client itself and
#: what is built on top of it
ABOVE_CLIENT = ("tidepool.client", "tidepool.cluster", "tidepool.cluster_durable", "tidepool.cli", "tidepool.demo",
                "tidepool.testing", "tidepool.testing_k8s")  # fmt: skip
#: the modules that used to import each other in a circle of eight files
CIRCLE_SUSPECTS = ("tidepool.client", "tidepool.futures", "tidepool.waiting", "tidepool.dask", "tidepool.graph",
                   "tidepool.worker.context", "tidepool.worker.server")  # fmt: skip



def import_graph() -> dict[str, set[str]]:
    return walk_imports(type_checking=False)


def test_the_walk_sees_imports_inside_functions_and_skips_type_checking_ones() -> None:
    graph = import_graph()
    assert "tidepool.client.api" in graph["tidepool.client"]  # package __init__, relative to itself
    assert "tidepool.comm.data" in graph["tidepool.worker.peers"]
    # dask/client.py imports the telemetry progress bar inside a function only
    assert "tidepool.telemetry.progress" in graph["tidepool.dask.client"]
    # scheduler/tally.py names TaskRecord for annotations only
    assert "tidepool.scheduler.records" not in graph["tidepool.scheduler.tally"]


def test_no_module_below_the_client_imports_it() -> None:
    graph = import_graph()
    offenders = sorted(f"{m} imports {', '.join(sorted(i for i in deps if inside(i, ('tidepool.client',))))}"
                       for m, deps in graph.items()
                       if m != "tidepool" and not inside(m, ABOVE_CLIENT) and any(inside(i, ("tidepool.client",)) for i in deps))  # fmt: skip
    # the facade ("tidepool") and the cluster tools may; everything else is below the client
    assert offenders == [], "\n".join(offenders)


def test_the_client_futures_dask_layer_graph_and_worker_context_import_in_no_circle() -> None:
    graph = import_graph()
    sub = {m: {d for d in deps if inside(d, CIRCLE_SUSPECTS)} for m, deps in graph.items() if inside(m, CIRCLE_SUSPECTS)}
    assert circles(sub) == []


@pytest.mark.parametrize("graph", [{"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}])
def test_the_circle_finder_finds_a_circle(graph: dict[str, set[str]]) -> None:
    assert circles(graph) == [["a", "b", "c"]]



def _private_uses(source: str, names: tuple[str, ...]) -> list[str]:
    """``x._private`` where ``x`` is one of ``names`` or ends in ``.client`` (``self.client._x``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in names) or (
            isinstance(owner, ast.Attribute) and owner.attr == "client"
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_futures_waiting_and_the_dask_layer_use_no_private_member_of_the_client() -> None:
    files = [SRC / "futures.py", SRC / "waiting.py", *sorted((SRC / "dask").glob("*.py"))]
    uses = [f"{f.name}:{u}" for f in files for u in _private_uses(f.read_text(), ("client", "c"))]
    assert uses == [], "\n".join(uses)


def test_the_private_use_finder_finds_them() -> None:
    source = "def f(client, self):\n    client._post({})\n    self.client._loop.run(1)\n    client.__class__\n"
    assert _private_uses(source, ("client",)) == ["2: client._post", "3: self.client._loop"]
