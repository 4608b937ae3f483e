"""No import circles in kclpy: each module can be understood, and changed, below the ones that
use it (``tests/support/imports.py`` says what counts as an import)."""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import find_cycle, import_graph

ROOT = Path(__file__).resolve().parent.parent / "kclpy"


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
