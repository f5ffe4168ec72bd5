"""The import layers (issue 25): nothing below the client imports it, and the client, its futures,
the Dask layer, the graph builder and the worker's context import each other in no circle.

Walks the source with ``ast`` (nothing is imported): every ``import`` counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:`` (annotations only).  Importing
``a.b.c`` from outside package ``a.b`` also runs ``a/b/__init__.py``, so that counts as an import
of ``a.b`` too.  Code that must reach the client from below goes through the public facade
(``tidepool.default_client()``, resolved lazily by ``tidepool/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tidepool"

#: modules allowed to import the client besides the facade (``tidepool``): the client itself and
#: what is built on top of it
ABOVE_CLIENT = ("tidepool.client", "tidepool.cluster", "tidepool.cluster_durable", "tidepool.cli", "tidepool.demo",
                "tidepool.testing", "tidepool.testing_k8s")  # fmt: skip
#: the modules that used to import each other in a circle of eight files
CIRCLE_SUSPECTS = ("tidepool.client", "tidepool.futures", "tidepool.waiting", "tidepool.dask", "tidepool.graph",
                   "tidepool.worker.context", "tidepool.worker.server")  # fmt: skip


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def module_files() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The tidepool modules ``module`` imports (see the module docstring for what counts)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # a submodule, if it is one
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found: set[str] = set()
    for name in names:
        if not name.startswith("tidepool"):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # the module and every package on the way to it
            prefix = ".".join(parts[:i])
            if prefix in known and not _in(module, (prefix,)) and (i == len(parts) or prefix != "tidepool"):
                found.add(prefix)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: imports_of(m, p, known) for m, p in files.items()}


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
    offenders = sorted(f"{m} imports {', '.join(sorted(i for i in deps if _in(i, ('tidepool.client',))))}"
                       for m, deps in graph.items()
                       if m != "tidepool" and not _in(m, ABOVE_CLIENT) and any(_in(i, ("tidepool.client",)) for i in deps))  # fmt: skip
    # the facade ("tidepool") and the cluster tools may; everything else is below the client
    assert offenders == [], "\n".join(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_client_futures_dask_layer_graph_and_worker_context_import_in_no_circle() -> None:
    graph = import_graph()
    sub = {m: {d for d in deps if _in(d, CIRCLE_SUSPECTS)} for m, deps in graph.items() if _in(m, CIRCLE_SUSPECTS)}
    assert _cycles(sub) == []


@pytest.mark.parametrize("graph", [{"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}])
def test_the_circle_finder_finds_a_circle(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == [["a", "b", "c"]]



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
