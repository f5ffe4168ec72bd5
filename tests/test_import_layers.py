"""No import circle inside ``tidepool.scheduler`` or ``tidepool.worker`` (issue 26).

Walks the source with tests/import_walk.py: every ``import`` in a module (at module level, inside a
function, or under ``if TYPE_CHECKING:`` -- two modules that name each other's types are tied
together as much as two that call each other) is an edge; a strongly connected set of more than one module, or a module importing itself, is a
circle and fails the test with the modules named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from import_walk import SRC, circles, import_graph, imported_names

PACKAGES = ("tidepool.scheduler", "tidepool.worker")


def _graph(package: str) -> dict[str, set[str]]:
    graph = import_graph(SRC / package.split(".", 1)[1].replace(".", "/"), type_checking=True)
    return {m: deps & set(graph) for m, deps in graph.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    graph = _graph(package)
    assert len(graph) > 3, f"found too few modules of {package} under {SRC}"
    assert circles(graph) == [], f"import circles in {package}"


def test_the_walk_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_imports_in_functions_and_for_type_checking_count(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\nelse:\n    import x.z\n"
                 "def f():\n    from . import w\n")  # fmt: skip
    assert imported_names("x.m", f, type_checking=True) == {"typing", "typing.TYPE_CHECKING", "x.y", "x.z", "x", "x.w"}
