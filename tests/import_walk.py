"""One import walker for the layer tests (tests/test_layers.py, tests/test_import_layers.py).

Reads the source with :mod:`ast` (nothing is imported) and turns it into a graph of tidepool
modules: every ``import`` counts, at module level or inside a function.  Imports under
``if TYPE_CHECKING:`` count only when the caller asks (``type_checking=True``): a layer rule is
about what runs, a circle rule also about which modules name each other's types.  Importing
``a.b.c`` from outside package ``a.b`` also runs ``a/b/__init__.py``, so that counts as an import of
``a.b`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "tidepool"


def inside(module: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or lives under one of them."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root`` (``SRC`` or a package in it)."""
    base = SRC.parent
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imported_names(module: str, path: Path, *, type_checking: bool) -> set[str]:
    """Every dotted name ``module`` imports, relative imports resolved; ``from p import x`` gives
    both ``p`` and ``p.x`` (``x`` may be a submodule)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node):
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
            names.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def imports_of(module: str, path: Path, known: set[str], *, type_checking: bool) -> set[str]:
    """The ``known`` modules ``module`` imports, with the packages on the way to each (except its
    own packages and the top-level ``tidepool``, which every module is inside)."""
    found: set[str] = set()
    for name in imported_names(module, path, type_checking=type_checking):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and not inside(module, (prefix,)) and (i == len(parts) or prefix != "tidepool"):
                found.add(prefix)
    found.discard(module)
    return found


def import_graph(root: Path = SRC, *, type_checking: bool) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` it imports."""
    files = module_files(root)
    known = set(files)
    return {m: imports_of(m, p, known, type_checking=type_checking) for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module, and modules importing themselves
    (Tarjan's algorithm, iterative so deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
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
                if len(comp) > 1 or node in graph[node]:
                    out.append(sorted(comp))
    return out
