"""No import circles in kclpy and no import up its layers: each module can be understood,
and changed, below the ones that use it (``tests/support/imports.py`` says what counts as an
import; docs/design.md's "Layers" table says which layer each module is in)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.imports import find_cycle, import_graph, read_layers, upward_imports

ROOT = Path(__file__).resolve().parents[2] / "kclpy"
DESIGN = ROOT.parent / "docs" / "design.md"


def test_kclpy_has_no_import_cycle() -> None:
    graph = import_graph(ROOT)
    assert "kclpy.worker" in graph and "kclpy.leases.fence" in graph["kclpy.leases.coordinator"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_finder_reports_a_cycle_with_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_lazy_imports_count_and_type_checking_imports_do_not(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("from pkg.supervisor import run\n")
    (package / "supervisor.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import typed\n"
        "def run():\n    from pkg.cli import main\n")
    (package / "typed.py").write_text("from pkg import supervisor\n")
    graph = import_graph(package)
    assert graph["pkg.supervisor"] == {"pkg.cli"}
    assert find_cycle(graph) == ["pkg.cli", "pkg.supervisor", "pkg.cli"]


def test_every_module_is_in_exactly_one_layer() -> None:
    layers = read_layers(DESIGN.read_text(), ROOT)
    modules = set(import_graph(ROOT))
    placed = [module for layer in layers for module in layer]
    assert sorted(m for m in set(placed) if placed.count(m) > 1) == []
    assert modules - set(placed) == set(), "modules missing from docs/design.md's layers"
    assert set(placed) - modules == set(), "docs/design.md's layers name missing modules"


def test_no_module_imports_one_above_its_layer() -> None:
    upward = upward_imports(import_graph(ROOT), read_layers(DESIGN.read_text(), ROOT))
    assert upward == [], "imports up the layers: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_an_import_up_the_layers_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "part.py").write_text("def f():\n    from pkg import top\n")
    (package / "top.py").write_text("from pkg.low import part\n")
    layers = read_layers("\n## Layers\n\n| Layer | Modules |\n|---|---|\n"
                         "| top | `__init__.py` `top.py` |\n| low | `low/` |\n", package)
    assert layers == [{"pkg", "pkg.top"}, {"pkg.low", "pkg.low.part"}]
    assert upward_imports(import_graph(package), layers) == [("pkg.low.part", "pkg.top")]


#: test modules importing another, each pinned until its shared part moves to tests/support/:
#: an entry no longer found is stale and fails too
IMPORTS_OF_TEST_MODULES: set[tuple[str, str]] = set()


def test_no_module_imports_a_test_module() -> None:
    """What several test modules or a benchmark share lives in tests/support/ or
    tests/simulation/, so that a test module can change without breaking another. A test
    module is one named ``test_*`` in any folder of tests/ (docs/design.md, "Tests")."""
    tests = ROOT.parent / "tests"
    graph = import_graph(tests)
    bench = {f"bench.{path.stem}": path for path in sorted((ROOT.parent / "bench").glob("*.py"))}
    for name, path in bench.items():
        graph[name] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.ImportFrom) and node.module}
        graph[name] |= {alias.name for node in ast.walk(ast.parse(path.read_text()))
                        if isinstance(node, ast.Import) for alias in node.names}
    found = {(name, target) for name, targets in graph.items() for target in targets
             if target.startswith("tests.") and target.rpartition(".")[2].startswith("test_")}
    assert sorted(found - IMPORTS_OF_TEST_MODULES) == []
    assert sorted(IMPORTS_OF_TEST_MODULES - found) == [], "stale entries"
