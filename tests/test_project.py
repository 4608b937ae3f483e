"""The project's promises about itself: README set-up, CI entry point, docs in sync, lint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kclpy.config import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", setup, re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "kclpy-worker --local" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = readme_commands()[1]
    pip, _, runner = test_command.partition(" && ")
    assert pip.replace("pip install", "python -m pip install -q") in ci
    assert f"python -m {runner}" in ci


def test_configuration_reference_lists_every_option() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for option in OPTIONS:
        assert f"`{option.flag}`" in reference, option.flag
        for key in option.properties_keys:
            assert f"`{key}`" in reference, key


def test_public_api_is_explicit() -> None:
    import kclpy

    for name in kclpy.__all__:
        assert getattr(kclpy, name) is not None, name
    assert (ROOT / "kclpy" / "py.typed").exists()


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "ruff", "check", "kclpy", "tests", "bench", "examples"],
        [sys.executable, "-m", "mypy"],
    ],
    ids=["ruff", "mypy"],
)
def test_lint_and_types(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_design_module_map_names_every_module() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Module map", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_/]+\.py)` \|", section, re.M))
    # a package's row (**`leases/`**) stands for its __init__.py
    named |= {f"{package}__init__.py"
              for package in re.findall(r"^\| \*\*`([a-z_]+/)`\*\* \|", section, re.M)}
    modules = {str(path.relative_to(ROOT / "kclpy")) for path in (ROOT / "kclpy").rglob("*.py")}
    assert modules - named == set(), "modules missing from docs/design.md's map"
    assert named - modules == set(), "docs/design.md's map names modules that do not exist"


def test_the_design_test_map_names_the_tests_of_every_lease_state_and_recovery_module() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Tests", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_/]+\.py)` \| `(tests/test_[a-z_]+\.py)` \|", section, re.M))
    modules = {"streams.py"} | {
        str(path.relative_to(ROOT / "kclpy"))
        for package in ("leases", "state", "recovery")
        for path in (ROOT / "kclpy" / package).glob("*.py")}
    assert modules - set(rows) == set(), "modules without a row in docs/design.md's test map"
    assert set(rows) - modules == set(), "docs/design.md's test map names modules that do not exist"
    missing = {test for test in rows.values() if not (ROOT / test).exists()}
    assert missing == set(), "docs/design.md's test map names test modules that do not exist"


def test_the_design_says_where_to_change_each_common_thing_in_one_guess() -> None:
    """docs/design.md's guide: backoff, a retrieval mode, a store, a metric and an option each
    have an entry, and every module or test it names exists."""
    design = (ROOT / "docs" / "design.md").read_text()
    guide = design.split("Where to change, in one guess:", 1)[1].split("\n| Module |", 1)[0]
    entries = re.findall(r"^- \*\*(.+?)\*\*", guide, re.M)
    for topic in ("backoff", "retrieval mode", "state store", "metric", "option"):
        assert any(topic in entry for entry in entries), (topic, entries)
    named = set(re.findall(r"`((?:tests/)?[a-z_/]+\.py)`", guide))
    missing = {path for path in named
               if not (ROOT / path).exists() and not (ROOT / "kclpy" / path).exists()}
    assert named and missing == set(), "docs/design.md's guide names files that do not exist"
