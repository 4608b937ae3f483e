"""The ``kclpy`` command table is the command line's single source: every entry can be
reached and has a ``--help``, the parser offers exactly its words, each entry's words run
that entry's handler, and a word without an entry is a usage error naming it - never another
command's handler (the control commands used to run ``shard resume`` for any action their
dispatch did not list)."""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import io
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from kclpy.errors import ConfigError
from kclpy.ops import commands
from kclpy.ops.commands import COMMANDS, GROUPS, Clients, build_parser, execute
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]

#: the least each command parses with; a command added to the table needs a line here
MINIMAL_ARGS: dict[tuple[str, ...], list[str]] = {
    ("leases",): ["--application-name", "app"],
    ("status",): ["--application-name", "app", "--stream-name", "s"],
    ("monitor",): ["--application-name", "app", "--port", "0"],
    ("consumers",): ["--application-name", "app", "--stream-name", "s"],
    ("register-consumer",): ["--application-name", "app", "--stream-name", "s"],
    ("deregister-consumer",): ["--application-name", "app", "--stream-arn", "arn"],
    ("checkpoint", "set"): ["--application-name", "app", "--stream-name", "s",
                            "--shard-id", "shardId-0", "--to", "TRIM_HORIZON"],
    ("shard", "park"): ["--application-name", "app", "--shard-id", "shardId-0"],
    ("shard", "resume"): ["--application-name", "app", "--shard-id", "shardId-0"],
    ("recovery", "add"): ["--application-name", "app", "--stream-name", "s",
                          "--shard-id", "shardId-0", "--from", "1", "--to", "2"],
    ("recovery", "list"): ["--application-name", "app"],
    ("recovery", "cancel"): ["--application-name", "app", "--shard-id", "shardId-0", "--all"],
    ("local",): [],
}


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every entry's handler replaced by one that records its entry's words and exits with
    the entry's position in the table plus 10 (no AWS, no servers)."""
    calls: list[tuple[str, ...]] = []

    def recorder(words: tuple[str, ...], code: int) -> commands.Handler:
        def handler(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
            calls.append(words)
            return code
        return handler

    monkeypatch.setattr(commands, "COMMANDS", {
        words: dataclasses.replace(command, run=recorder(words, 10 + n))
        for n, (words, command) in enumerate(COMMANDS.items())})
    return calls


def _parsed_words(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    """The command words the parser accepts, walked down its subparsers."""
    found: list[tuple[str, ...]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                deeper = _parsed_words(sub)
                found += [(word, *rest) for rest in deeper] if deeper else [(word,)]
    return found


def test_the_parser_offers_exactly_the_tables_commands_in_its_order() -> None:
    assert _parsed_words(build_parser()) == list(COMMANDS)
    assert {words[0] for words in COMMANDS if len(words) == 2} == set(GROUPS)
    assert all(1 <= len(words) <= 2 for words in COMMANDS)
    assert set(MINIMAL_ARGS) == set(COMMANDS), "a command without a line in MINIMAL_ARGS"


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_each_commands_words_run_its_own_handler(
        words: tuple[str, ...], ran: list[tuple[str, ...]],
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, *words, *MINIMAL_ARGS[words])
    assert (code, ran, err) == (10 + list(COMMANDS).index(words), [words], "")


@pytest.mark.parametrize("words", [*COMMANDS, *((group,) for group in GROUPS)], ids=" ".join)
def test_each_command_and_group_has_a_help(words: tuple[str, ...],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *words, "--help")
    assert code == 0
    assert out.startswith(f"usage: kclpy {' '.join(words)} ")
    said = " ".join(out.split())
    entry = COMMANDS.get(words) or GROUPS[words[0]]
    assert " ".join(entry.description.split()) in said
    if len(words) == 1 and words[0] in GROUPS:
        for action in (w[1] for w in COMMANDS if w[0] == words[0]):
            assert f" {action} " in said, action


def test_the_top_level_help_lists_each_command_with_its_own_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    said = " ".join(out.split())
    assert code == 0
    for word in dict.fromkeys(words[0] for words in COMMANDS):
        help_text = GROUPS[word].help if word in GROUPS else COMMANDS[(word,)].help
        assert f" {word} {help_text} " in said + " ", word


@pytest.mark.parametrize(("argv", "prog", "suggested"), [
    (["shard", "frobnicate"], "kclpy shard", None),
    (["shard", "prak", "--application-name", "app"], "kclpy shard", "park"),
    (["recovery", "lsit"], "kclpy recovery", "list"),
    (["leasse", "--application-name", "app"], "kclpy", "leases"),
])
def test_an_unknown_command_or_action_exits_2_naming_it(
        argv: list[str], prog: str, suggested: str | None, ran: list[tuple[str, ...]],
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    unknown = argv[len(prog.split()) - 1]
    assert (code, out, ran) == (2, "", [])
    assert err.startswith(f"{prog}: error: "), err
    assert err.count("\n") == 1 and f"invalid choice: {unknown!r}" in err, err
    if suggested is None:
        assert "did you mean" not in err
    else:
        assert err.endswith(f" (did you mean {suggested}?)\n"), err


@pytest.mark.parametrize(("words", "suggested"), [
    (("shard", "frobnicate"), ""), (("shard", "prak"), " (did you mean shard park?)"),
    (("shard",), " (did you mean shard park?)"), (("nothing",), "")])
def test_dispatch_of_arguments_without_an_entry_raises_and_runs_no_handler(
        words: tuple[str, ...], suggested: str, ran: list[tuple[str, ...]]) -> None:
    """A caller that builds its own arguments (the simulation does) cannot reach a handler
    with words the table does not have: before the table, ``control.run`` ran
    ``resume_shard`` for any action other than ``park``."""
    args = argparse.Namespace(command=words[0], **({"action": words[1]} if words[1:] else {}))
    with pytest.raises(ConfigError) as error:
        execute(args, Clients(args, (None, None)), io.StringIO())
    assert str(error.value) == f"command: {' '.join(words)!r} is not a kclpy command{suggested}"
    assert ran == []


def test_the_console_script_and_python_m_run_the_table() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in
                   setup["options.entry_points"]["console_scripts"].strip().splitlines())
    assert scripts["kclpy"] == "kclpy.ops.commands:main"
    result = subprocess.run([sys.executable, "-m", "kclpy.ops.commands", "shard", "prak"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.endswith("(did you mean park?)\n"), result.stderr
