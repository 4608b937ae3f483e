"""Every exception class of kclpy is a ``KCLError`` or one of a few named control-flow
signals, and docs/errors.md draws the hierarchy as it is: the page cannot go stale, and
``except kclpy.KCLError`` really catches every error kclpy raises on purpose."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kclpy
from kclpy.errors import KCLError

DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"

#: the control-flow signals allowed outside the hierarchy (docs/errors.md says why): each
#: unwinds to a handler written for it in the package that raises it, never to a user
SIGNALS = {
    "kclpy.retrieval.source.Stopped",
    "kclpy.loading._NotFound",
    "kclpy.cli._CannotStart",
    "kclpy.consumer._InitializeFailed",
    "kclpy.consumer._NotAtShardEnd",
    "kclpy.consumer._BatchFailed",
}


def import_every_module() -> set[str]:
    """Import every kclpy module; the names of those that need an extra not installed."""
    missing = set()
    for info in pkgutil.walk_packages(kclpy.__path__, "kclpy."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # runs the command line
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "kclpy").partition(".")[0] == "kclpy":
                raise
            missing.add(info.name)
    return missing


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in kclpy, wherever it is bound."""
    found, todo = [], [BaseException]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.partition(".")[0] == "kclpy":
            found.append(cls)
    return found


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def drawn_tree(text: str) -> dict[str, tuple[str | None, set[str]]]:
    """docs/errors.md's tree: each name -> (the name it is drawn under, its bracketed
    built-in bases)."""
    block = text.split("## The hierarchy", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    tree: dict[str, tuple[str | None, set[str]]] = {}
    path: list[str] = []
    for line in block.splitlines():
        drawn = re.fullmatch(r"[│ ]*(?:[├└]── )?(\w+)(?: \[([\w, ]+)\])?", line)
        assert drawn is not None, f"not a line of the tree: {line!r}"
        name, depth = drawn[1], drawn.start(1) // 4
        assert name not in tree, f"{name} drawn twice"
        del path[depth:]
        tree[name] = (path[-1] if path else None, set(re.findall(r"\w+", drawn[2] or "")))
        path.append(name)
    return tree


def documented_homes(text: str) -> dict[str, str]:
    """docs/errors.md's table: each name -> the module it says to import it from."""
    section = text.split("## Each error", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| `([\w.]+)` \|", section, re.M))


def test_every_exception_class_is_a_kcl_error_or_a_named_signal() -> None:
    import_every_module()
    outside = {qualified(cls) for cls in exception_classes() if not issubclass(cls, KCLError)}
    assert outside <= SIGNALS, f"not KCLErrors: {sorted(outside - SIGNALS)}"


def test_except_kcl_error_catches_the_spark_sources_errors_and_runtime_error_still_does(
) -> None:
    """Joining the hierarchy took nothing away: callers of the Spark source that catch
    ``RuntimeError`` still catch its errors."""
    pytest.importorskip("pyarrow")
    from kclpy.spark.metadata import ConflictingEndError
    from kclpy.spark.reading import DataLossError, EndNotFoundError

    for error in (DataLossError, EndNotFoundError, ConflictingEndError):
        with pytest.raises(kclpy.KCLError):
            raise error("shard gone")
        with pytest.raises(RuntimeError):
            raise error("shard gone")


def test_the_documented_tree_and_table_are_the_real_hierarchy() -> None:
    missing = import_every_module()
    text = DOC.read_text()
    tree, homes = drawn_tree(text), documented_homes(text)
    assert tree["KCLError"] == (None, set())
    assert set(homes) == set(tree), "the tree and the table name different errors"
    errors = {cls.__name__: cls for cls in exception_classes()
              if issubclass(cls, KCLError) and not cls.__name__.startswith("_")}
    assert len(errors) == len({qualified(cls) for cls in errors.values()}), \
        "two public errors share a name: the page must tell them apart"
    # a module that needs an extra not installed here: its errors cannot be looked at
    absent = {name for name, home in homes.items()
              if name not in errors and any(home == module or home.startswith(module + ".")
                                            for module in missing)}
    assert set(errors) == set(tree) - absent, "the page and the code name different errors"
    for name, cls in errors.items():
        parent, builtins = tree[name]
        kcl_bases: list[str | None] = [base.__name__ for base in cls.__bases__
                                       if issubclass(base, KCLError)]
        other_bases = {base.__name__ for base in cls.__bases__
                       if not issubclass(base, KCLError) and base is not Exception}
        assert [parent] == (kcl_bases or [None]), f"{name} is drawn under {parent}"
        assert builtins == other_bases, f"{name}'s built-in bases are {other_bases}"
        home = importlib.import_module(homes[name])
        assert getattr(home, name, None) is cls, f"{name} is not importable from {homes[name]}"


def test_the_page_names_every_signal_left_outside() -> None:
    section = DOC.read_text().split("## What is not a `KCLError`", 1)[1]
    assert set(re.findall(r"^- `([\w.]+)`", section, re.M)) == SIGNALS


def test_the_tree_reader_sees_depth_and_builtin_bases() -> None:
    """The tree is read by its drawing: a name moved one level is under another parent."""
    page = ("## The hierarchy\n\n```text\nKCLError\n├── A\n│   ├── B [RuntimeError]\n"
            "│   │   └── C\n│   └── D\n└── E [ValueError, KeyError]\n```\n")
    assert drawn_tree(page) == {
        "KCLError": (None, set()), "A": ("KCLError", set()), "B": ("A", {"RuntimeError"}),
        "C": ("B", set()), "D": ("A", set()), "E": ("KCLError", {"ValueError", "KeyError"})}


def test_every_public_error_in_kclpy_all_is_a_kcl_error() -> None:
    exported = [getattr(kclpy, name) for name in kclpy.__all__ if not name.startswith("_")]
    errors = [obj for obj in exported if isinstance(obj, type)
              and issubclass(obj, BaseException)]
    assert kclpy.TransactionRejected in errors and kclpy.StateStoreUnavailable in errors
    assert all(issubclass(error, KCLError) for error in errors)
