"""The import graph of a package, read statically, the cycles in it, and the imports that
go up the layers docs/design.md sets.

Every ``import`` counts wherever it stands (module level or inside a function: a lazy import
only hides a cycle until the function runs), except those under ``if TYPE_CHECKING:`` - they
never execute, and they are how a module names a type from a module that depends on it
without depending on it back at run time.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _runtime_imports(node)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (``from pkg import module``
    counts as importing the module; ``from pkg.module import name`` as importing pkg.module)."""
    paths = {module_name(root, path): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t != name and t in paths)
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child):], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return None


def read_layers(design: str, root: Path) -> list[set[str]]:
    """The modules of each layer of docs/design.md's "Layers" table, top layer first. A
    name ending in ``/`` stands for every module of that directory."""
    section = design.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    modules = {module_name(root, path): path for path in root.rglob("*.py")}
    layers: list[set[str]] = []
    for row in re.findall(r"^\| [^|`]+ \| (`.+) \|$", section, re.M):
        layer: set[str] = set()
        for name in re.findall(r"`([^`]+)`", row):
            if name.endswith("/"):
                folder = root / name
                layer.update(m for m, path in modules.items() if folder in path.parents)
            else:
                layer.add(module_name(root, root / name))
        layers.append(layer)
    return layers


def upward_imports(graph: Mapping[str, set[str]],
                   layers: list[set[str]]) -> list[tuple[str, str]]:
    """Every import of a module from a layer above its own (``layers`` top first)."""
    rank = {module: index for index, layer in enumerate(layers) for module in layer}
    return sorted((module, target) for module, targets in graph.items() for target in targets
                  if rank[target] < rank[module])
