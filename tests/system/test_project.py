"""The project's promises about itself: README set-up, CI entry point, docs in sync, lint."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kclpy.config import OPTIONS

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_test_command_installs_through_the_committed_lock() -> None:
    pip = readme_commands()[1].partition(" && ")[0]
    assert pip.endswith(" -c .ci/constraints.txt"), pip


def test_the_lock_pins_every_dependency_the_test_command_installs() -> None:
    """A dependency added to setup.cfg without moving the lock forward (.ci/lock) would be
    installed at whatever release is newest: the lock would no longer hold the run still."""
    import configparser

    from packaging.requirements import Requirement

    from tests.support.lock import canonical, pins

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines()
    for extra in ("test", "spark", "local", "sql"):
        lines += setup["options.extras_require"][extra].splitlines()
    locked = pins()
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonical(requirement.name)
        assert name in locked, f"{name} is not in .ci/constraints.txt: run .ci/lock"
        assert requirement.specifier.contains(locked[name]), (
            f"setup.cfg wants {requirement}, the lock pins {locked[name]}: run .ci/lock")


def test_the_run_header_says_whether_the_lock_was_installed(tmp_path: Path) -> None:
    from tests.support.lock import status

    lock = tmp_path / "constraints.txt"
    lock.write_text('# a comment\npytest==0.0.1\nno-such-dist-kclpy==1.0\n'
                    'skipped==1.0; python_version < "3"\n')
    text = status(lock).header()
    assert text.startswith("dependencies: NOT the committed lock"), text
    assert "2 of 2 pins differ" in text and "no-such-dist-kclpy absent (lock 1.0)" in text
    from importlib.metadata import version

    lock.write_text(f"pytest=={version('pytest')}\n")
    assert status(lock).header().startswith("dependencies: the committed lock"), text


#: what an install line may name besides this checkout: kclpy's own distribution, and the
#: other distributions the docs mean on purpose (the bench's baseline, the Java daemon's app)
OTHER_DISTRIBUTIONS = frozenset({"async-kinesis", "amazon_kclpy", "amazon-kclpy"})


def install_lines() -> list[tuple[str, str]]:
    """Every ``pip install ...`` in the README, docs, examples, kclpy's hints and the bench."""
    found: list[tuple[str, str]] = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "kclpy").rglob("*.py")),
             *sorted((ROOT / "bench").rglob("*.py")), *sorted((ROOT / "localstack").rglob("*"))]
    for path in files:
        if not path.is_file():
            continue
        for match in re.finditer(r"pip install ([^\n`\"]+)", path.read_text()):
            command = re.split(r"&&|\|\||;|\)", match.group(1))[0]
            found.append((str(path.relative_to(ROOT)), command.strip()))
    return found


def test_every_install_line_names_this_distribution() -> None:
    """``pip install kclpy`` installs an unrelated 2016 project: every hint and doc must name
    the distribution this checkout builds (setup.cfg's name), or the checkout itself."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    ours = setup["metadata"]["name"]
    assert ours != "kclpy"
    lines = install_lines()
    assert any(ours in line for _, line in lines)
    for where, line in lines:
        for word in line.split():
            word = word.strip("'.,;:)(")
            if not word or word.startswith(("-", ".", "/", "$", "<")) or "=" in word:
                continue
            name = re.split(r"[\[<>=!~ ]", word, maxsplit=1)[0]
            if name in ("e", "q", "U") or not re.fullmatch(r"[A-Za-z][\w.-]*", name):
                continue
            assert name == ours or name in OTHER_DISTRIBUTIONS, (
                f"{where}: `pip install {line}` names {name!r}, not {ours!r}")


def test_no_reference_to_a_tracker_no_user_can_see() -> None:
    """A reference to the project's internal tracker (the word, a space and a number) means
    nothing to a user: say what was done (and when), or name the test or doc that holds
    the reason."""
    found = []
    for folder in ("kclpy", "docs", "examples", "bench", "tests", "localstack"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".properties", ".yml", ".yaml", ".txt"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bissues? #?\d+", line, re.IGNORECASE):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    for name in ("README.md", "CHANGELOG.md"):
        found += [f"{name}: {line}" for line in (ROOT / name).read_text().splitlines()
                  if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("example", ["spark_microbatch.py", "spark_structured_streaming.py"])
def test_an_example_without_its_extra_names_the_extra(example: str) -> None:
    """Without the spark extra the examples ended in a raw ModuleNotFoundError."""
    blocker = (
        "import runpy, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pyspark', 'pyarrow'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith("pip install 'kinesis-kclpy[spark]'"), result.stderr
    assert "Traceback" not in result.stderr


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
    rows = dict(re.findall(r"^\| `([a-z_/]+\.py)` \| `(tests/(?:[a-z_]+/)?test_[a-z_]+\.py)` \|",
                          section, re.M))
    modules = {"streams.py"} | {
        str(path.relative_to(ROOT / "kclpy"))
        for package in ("leases", "state", "recovery")
        for path in (ROOT / "kclpy" / package).glob("*.py")}
    assert modules - set(rows) == set(), "modules without a row in docs/design.md's test map"
    assert set(rows) - modules == set(), "docs/design.md's test map names modules that do not exist"
    missing = {test for test in rows.values() if not (ROOT / test).exists()}
    assert missing == set(), "docs/design.md's test map names test modules that do not exist"


def misplaced_tests(tests: Path, package: Path) -> list[str]:
    """The test modules under ``tests`` that are not where docs/design.md's "Tests" puts
    them: ``test_<name>[_<aspect>].py`` in the folder mirroring the package it tests, with
    ``<name>`` a module of that package (at the top, of ``package``), a sub-package of it, or
    the package itself; in ``support/``, a module of ``support/``; in ``system/``, anything.
    Every folder holding tests is a package."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        where = path.relative_to(tests.parent)
        if not (path.parent / "__init__.py").exists():
            found.append(f"{where}: its folder has no __init__.py")
        if folder.parts[:1] == ("system",):
            continue
        twin = tests / "support" if folder.parts == ("support",) else package / folder
        if not (twin / "__init__.py").exists():
            found.append(f"{where}: {twin.relative_to(tests.parent)}/ is no package to mirror")
            continue
        names = {module.stem for module in twin.glob("*.py")} - {"__init__"}
        if folder.parts:
            names |= {folder.name} | {sub.name for sub in twin.iterdir()
                                      if (sub / "__init__.py").exists()}
        tested = path.stem.removeprefix("test_")
        if not any(tested == name or tested.startswith(f"{name}_") for name in names):
            found.append(f"{where}: names no module of {twin.relative_to(tests.parent)}/")
    return found


def test_every_test_module_is_where_the_layout_puts_it() -> None:
    assert misplaced_tests(ROOT / "tests", ROOT / "kclpy") == []


def test_a_test_module_out_of_place_is_reported(tmp_path: Path) -> None:
    for name in ("pkg/__init__.py", "pkg/top.py", "pkg/low/__init__.py", "pkg/low/part.py",
                 "pkg/low/deep/__init__.py", "tests/__init__.py", "tests/support/__init__.py",
                 "tests/support/tool.py", "tests/low/__init__.py", "tests/system/__init__.py",
                 "tests/bare/test_part.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    placed = ["test_top.py", "test_top_real.py", "low/test_part.py", "low/test_part_fuzz.py",
              "low/test_low.py", "low/test_deep.py", "support/test_tool.py",
              "system/test_anything.py"]
    misplaced = ["test_part.py", "test_low.py", "test_topper.py", "low/test_top.py",
                 "support/test_part.py"]
    for name in placed + misplaced:
        (tmp_path / "tests" / name).write_text("")
    assert misplaced_tests(tmp_path / "tests", tmp_path / "pkg") == [
        "tests/bare/test_part.py: its folder has no __init__.py",
        "tests/bare/test_part.py: pkg/bare/ is no package to mirror",
        "tests/low/test_top.py: names no module of pkg/low/",
        "tests/support/test_part.py: names no module of tests/support/",
        "tests/test_low.py: names no module of pkg/",
        "tests/test_part.py: names no module of pkg/",
        "tests/test_topper.py: names no module of pkg/",
    ]


def test_the_design_says_where_to_change_each_common_thing_in_one_guess() -> None:
    """docs/design.md's guide: backoff, a retrieval mode, a store, a lease assignment
    strategy, a metric, an option, an operator command and a Spark planning rule each have
    an entry, and every module or test it names exists."""
    design = (ROOT / "docs" / "design.md").read_text()
    guide = design.split("Where to change, in one guess:", 1)[1].split("\n| Module |", 1)[0]
    entries = re.findall(r"^- \*\*(.+?)\*\*", guide, re.M)
    for topic in ("backoff", "retrieval mode", "state store", "assignment strategy", "metric",
                  "option", "operator command", "Spark offset-planning"):
        assert any(topic in entry for entry in entries), (topic, entries)
    named = set(re.findall(r"`((?:tests/)?[a-z_/]+\.py)`", guide))
    missing = {path for path in named
               if not (ROOT / path).exists() and not (ROOT / "kclpy" / path).exists()}
    assert named and missing == set(), "docs/design.md's guide names files that do not exist"


#: the most parameters a constructor in kclpy takes (docs/design.md, "Composition and
#: constructors")
MAX_CONSTRUCTOR_PARAMETERS = 10


def constructor_parameters(package: Path) -> dict[str, int]:
    """Every hand-written ``__init__`` under ``package`` (nested classes too) and how many
    parameters it takes besides ``self``: positional, keyword-only, ``*args`` and
    ``**kwargs`` each count. A dataclass's generated one is not hand-written: a frozen set
    of option values is one parameter wherever it goes."""
    counts = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    count = (len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                             + (args.vararg is not None) + (args.kwarg is not None) - 1)
                    counts[f"{path.relative_to(package.parent)}:{node.name}"] = count
    return counts


def test_no_constructor_takes_more_than_ten_parameters() -> None:
    """Callbacks that belong together are one protocol, collaborators one small object,
    option values one dataclass: a long constructor is a class doing several jobs, or
    wired from below by the caller instead of by ``composition.py``."""
    counts = constructor_parameters(ROOT / "kclpy")
    over = {name: count for name, count in counts.items()
            if count > MAX_CONSTRUCTOR_PARAMETERS}
    assert over == {}, f"constructors over {MAX_CONSTRUCTOR_PARAMETERS} parameters: {over}"


def test_the_constructor_count_sees_every_kind_of_parameter(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "from dataclasses import dataclass\n"
        "class A:\n    def __init__(self, a, /, b, *args, c, **kwargs): ...\n"
        "def f():\n    class Nested:\n        def __init__(self, x): ...\n"
        "@dataclass\nclass Options:\n    a: int = 1\n")
    assert constructor_parameters(package) == {"pkg/m.py:A": 5, "pkg/m.py:Nested": 1}


#: the one module that may name a retrieval mode in a comparison: its registry
MODE_REGISTRY = "retrieval/modes.py"


def mode_name_comparisons(package: Path, words: set[str], registry: str = MODE_REGISTRY, *,
                          tables: bool = True) -> list[str]:
    """Where a module of ``package`` (but ``registry``) compares a value with a retrieval
    mode's word (``==``, ``!=``, ``in`` a literal collection) or, with ``tables``, keys a
    table of its own by one: each is a second place that decides a mode, which the
    registry's lookup should. A word counts in lower or upper case (``fanout``, Java's
    ``FANOUT``); in mixed case it is an AWS operation (``SubscribeToShard``,
    ``GetRecords``), which a source names when it calls one."""
    found = []

    def strings(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for element in node.elts for s in strings(element)]
        return []

    for path in sorted(package.rglob("*.py")):
        relative = str(path.relative_to(package))
        if relative == registry:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                named = [s for side in (node.left, *node.comparators) for s in strings(side)]
            elif isinstance(node, ast.Dict) and tables:
                named = [s for key in node.keys if key is not None for s in strings(key)]
            else:
                continue
            named = [s for s in named if s in (s.lower(), s.upper()) and s.lower() in words]
            if named:
                found.append(f"{relative}:{node.lineno}: {', '.join(named)}")
    return sorted(found)


def test_no_module_but_the_registry_compares_against_a_retrieval_modes_name() -> None:
    from kclpy.retrieval.modes import retrieval_mode, retrieval_mode_names

    words = set()
    for name in retrieval_mode_names():
        mode = retrieval_mode(name)
        words |= {mode.name.lower(), *(alias.lower() for alias in mode.aliases)}
    assert {"polling", "fanout", "efo"} <= words
    found = mode_name_comparisons(ROOT / "kclpy", words)
    assert found == [], "decide a mode through kclpy.retrieval.modes:\n" + "\n".join(found)


def test_the_mode_name_check_sees_comparisons_memberships_and_tables(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "retrieval").mkdir(parents=True)
    (package / "m.py").write_text(
        "def f(mode):\n"
        "    if mode.upper() == 'FANOUT' or mode == 'SubscribeToShard': ...\n"
        "    if mode in ('getrecords', 'other'): ...\n"
        "    if mode == 'standard': ...\n"
        "    return {'efo': 1}\n")
    (package / "retrieval" / "modes.py").write_text("IS_FANOUT = 'fanout' == 'fanout'\n")
    words = {"fanout", "getrecords", "efo", "subscribetoshard"}
    assert mode_name_comparisons(package, words) == [
        "m.py:2: FANOUT", "m.py:3: getrecords", "m.py:5: efo"]


#: the one module that may name a lease assignment strategy: its registry
ASSIGNMENT_REGISTRY = "leases/assignment.py"


def strategy_branches(package: Path, words: set[str]) -> list[str]:
    """Where a module of ``package`` but the registry decides a lease assignment strategy
    itself: compares a value with a strategy's name (``lease_assignment == "load"``), or
    names a flag, parameter or function after one (``by_load``, ``_by_count``) - the shape
    a strategy took when each decider wrote it again behind a flag of its own. A dict keyed
    by a strategy's word is no decision here (``load`` is also a load report's attribute)."""
    found = mode_name_comparisons(package, words, ASSIGNMENT_REGISTRY, tables=False)
    flags = {f"by_{word}" for word in words}
    for path in sorted(package.rglob("*.py")):
        relative = str(path.relative_to(package))
        if relative == ASSIGNMENT_REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.arg):
                name = node.arg
            elif isinstance(node, ast.keyword):
                name = node.arg or ""
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            else:
                continue
            if name.lstrip("_").lower() in flags:
                found.append(f"{relative}:{node.lineno}: {name}")
    return sorted(found)


def test_no_module_but_the_registry_decides_a_lease_assignment_strategy() -> None:
    from kclpy.leases.assignment import assignment_strategy_names

    words = set(assignment_strategy_names())
    assert {"count", "load"} <= words
    found = strategy_branches(ROOT / "kclpy", words)
    assert found == [], ("ask the strategy (kclpy.leases.assignment) instead:\n"
                         + "\n".join(found))


def test_the_strategy_check_sees_comparisons_and_flags_named_after_a_strategy(
        tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "leases").mkdir(parents=True)
    (package / "m.py").write_text(
        "def f(config, leader, _by_count):\n"
        "    if config.lease_assignment == 'load': ...\n"
        "    leader.plan(by_load=True)\n"
        "    return {'load': 1.0}, config.by_load\n"
        "def by_load(): ...\n")
    (package / "leases" / "assignment.py").write_text(
        "def by_load(name):\n    return name == 'load'\n")
    assert strategy_branches(package, {"count", "load"}) == [
        "m.py:1: _by_count", "m.py:2: load", "m.py:3: by_load", "m.py:4: by_load",
        "m.py:5: by_load"]
