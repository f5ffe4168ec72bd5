"""No import circle inside ``tidepool.scheduler`` or ``tidepool.worker`` (issue 26).

Walks the source with :mod:`ast`: every ``import`` in a module (at module level, inside a
function, or under ``if TYPE_CHECKING:`` -- two modules that name each other's types are tied
together as much as two that call each other) is an edge; a strongly connected set of more than one module, or a module importing itself, is a
circle and fails the test with the modules named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGES = ("tidepool.scheduler", "tidepool.worker")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # ``from pkg import module``
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    root = SRC / package.replace(".", "/")
    modules = {_module_name(p): p for p in root.rglob("*.py")}
    return {m: {i for i in _imports(p, m) if i in modules and i != package} for m, p in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    graph = _graph(package)
    assert len(graph) > 3, f"found too few modules of {package} under {SRC}"
    assert _circles(graph) == [], f"import circles in {package}"


def test_the_walk_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_imports_in_functions_and_for_type_checking_count(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\nelse:\n    import x.z\n"
                 "def f():\n    from . import w\n")  # fmt: skip
    assert _imports(f, "x.m") == {"typing", "typing.TYPE_CHECKING", "x.y", "x.z", "x", "x.w"}
