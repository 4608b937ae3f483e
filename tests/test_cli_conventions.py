"""What a user of uvicorn or gunicorn expects of ``kclpy-worker``: ``--help`` grouped, with
each option's default and choices; a "did you mean" for every name a user can misspell
(environment variable, properties key, stream, processor class); one log line per event, in
order; and the lines of ``--processes N`` saying which worker they come from."""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import boto3
import pytest
from botocore.stub import Stubber

from kclpy.arguments import HELP_GROUPS, worker_parser
from kclpy.config import OPTIONS, OTHER_VARIABLES, KCLConfig, from_environment, from_properties
from kclpy.errors import ConfigError, closest
from kclpy.leases.streams import StreamSet
from kclpy.leases.table import LeaseTable
from kclpy.loading import load_object

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

ROOT = Path(__file__).resolve().parent.parent
_MAIN_JOB = ["--local", "--processor", "examples/printing_processor.py:PrintingProcessor",
             "--stop-when-caught-up"]


# -- --help -----------------------------------------------------------------------------------


def _grouped(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {group.title or "": list(group._group_actions) for group in parser._action_groups}


def test_every_option_is_in_exactly_one_help_group() -> None:
    parser = worker_parser()
    listed = [dest for _, dests in HELP_GROUPS for dest in dests]
    assert len(listed) == len(set(listed)), "an option is in two groups"
    groups = _grouped(parser)
    assert groups["positional arguments"] == []
    placed = [action.dest for title, actions in groups.items() if title != "options"
              for action in actions]
    assert sorted(placed) == sorted(listed)
    general = {action.dest for action in groups["options"]}
    assert general == {"help", "version"}
    assert {o.name for o in OPTIONS} - set(placed) == {"executable_name"}
    titled = [title for title in groups if title not in ("options", "positional arguments")]
    assert titled == [t for t, _ in HELP_GROUPS]


def test_help_shows_each_options_default_and_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker_parser().parse_args(["--help"])
    assert exit_.value.code == 0
    # one option's help as one line, whatever the terminal's width
    text = " ".join(capsys.readouterr().out.split())
    for title, _ in HELP_GROUPS:
        assert f" {title}: " in text, title
    flags = [o.flag for o in OPTIONS if o.name != "executable_name"]
    for option in OPTIONS:
        if option.name == "executable_name":
            continue
        start = text.index(f" {option.flag} ")
        later = [i for i in (text.find(f" {f} ", start + 1) for f in flags) if i > start]
        own = text[start:min(later, default=len(text))]
        if option.listed_choices:
            assert f"choices: {', '.join(option.listed_choices)}" in own, option.flag
        default = option.default
        if default is not None:
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            assert f"default: {shown})" in own, option.flag
    for flag, said in (("--log-level", "choices: DEBUG, INFO, WARNING, ERROR; default: INFO"),
                       ("--processes", "default: 1"), ("--progress-interval", "default: 30")):
        assert said in text[text.index(f" {flag} "):], flag


def test_the_defaults_shown_are_the_configs_own() -> None:
    """One source: a default changed in KCLConfig changes --help."""
    config = KCLConfig(application_name="a", stream_name="s")
    for option in OPTIONS:
        if option.default is not None:
            assert getattr(config, option.name) == option.default, option.name


def test_the_configuration_reference_shows_the_same_defaults() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    rows = {match[1]: [cell.strip() for cell in match[0].split("|")[1:-1]]
            for match in re.finditer(r"^\| `(--[a-z0-9-]+)` \|.*\|$", reference, re.M)}
    for option in OPTIONS:
        if option.default is not None:
            default = str(option.default)
            assert rows[option.flag][3].lower() == default.lower(), option.flag


# -- did you mean -----------------------------------------------------------------------------


def test_one_helper_finds_the_near_miss_in_its_own_spelling() -> None:
    assert closest("--stream-nme", ["--stream-name", "--stream-arn"]) == "--stream-name"
    assert closest("STARTINGPOSITON", ["startingPosition"], ignore_case=True) == \
        "startingPosition"
    assert closest("shard", ["--failover-time-ms"]) is None


def test_a_misspelt_environment_variable_is_warned_about_with_the_closest_name(
        caplog: pytest.LogCaptureFixture) -> None:
    """It used to be ignored without a word: the stream name came from somewhere else, or
    the worker failed with "--stream-name is required" beside the variable that sets it."""
    with caplog.at_level(logging.WARNING, logger="kclpy.config"):
        values, _ = from_environment({"KCLPY_STREAM_NAMES": "orders", "KCLPY_REGION": "eu",
                                      "KCLPY_XYZZY": "1", "OTHER_STREAM_NAMES": "x",
                                      **dict.fromkeys(OTHER_VARIABLES, "1")})
    assert values == {"region": "eu"}
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        "environment variable KCLPY_STREAM_NAMES is not a kclpy setting and is ignored "
        "(did you mean KCLPY_STREAM_NAME?)",
        "environment variable KCLPY_XYZZY is not a kclpy setting and is ignored",
    ]


def test_every_kclpy_variable_the_package_reads_is_known() -> None:
    """A variable read somewhere in kclpy but missing from OTHER_VARIABLES would be warned
    about as unknown while it works."""
    read = set()
    for path in (ROOT / "kclpy").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get\(|\[)\"(KCLPY_[A-Z_]+)\"",
                               path.read_text()))
    assert read and read <= set(OTHER_VARIABLES)


def test_a_misspelt_properties_key_is_warned_about_with_the_closest_key() -> None:
    said: list[str] = []
    values, _ = from_properties({"maxRecordz": "5", "retrievalMode": "POLLING",
                                 "somethingElse": "1", "maxActiveThreads": "4"},
                                warn=said.append)
    assert "max_records" not in values
    assert said == ["unknown properties key 'maxRecordz' ignored (did you mean 'maxRecords'?)",
                    "unknown properties key 'somethingElse' ignored"]


def test_a_misspelt_processor_class_is_named_as_it_is_spelt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as error:
        load_object("examples/printing_processor.py:PrintingProcesor", "--processor")
    assert error.value.option == "--processor"
    assert error.value.message.endswith(
        "has no attribute 'PrintingProcesor' (did you mean "
        "examples/printing_processor.py:PrintingProcessor?)")


def _stream_set(kinesis: KinesisClient, stream_name: str) -> StreamSet:
    config = KCLConfig(application_name="a", stream_name=stream_name)
    # a stream that does not exist is refused before the lease table is touched
    return StreamSet(kinesis, cast(LeaseTable, None), config)


def _missing(stubber: Stubber, name: str) -> None:
    stubber.add_client_error("describe_stream_summary", "ResourceNotFoundException",
                             expected_params={"StreamName": name})


def test_a_stream_that_does_not_exist_is_refused_with_the_closest_stream_name() -> None:
    kinesis: KinesisClient = boto3.client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(kinesis) as stubber:
        _missing(stubber, "ordrs")
        stubber.add_response("list_streams", {"StreamNames": ["audit", "orders"],
                                              "HasMoreStreams": True, "NextToken": "next"})
        stubber.add_response("list_streams", {"StreamNames": ["payments"],
                                              "HasMoreStreams": False}, {"NextToken": "next"})
        with pytest.raises(ConfigError) as error:
            _stream_set(kinesis, "ordrs").refresh(starting=True)
        stubber.assert_no_pending_responses()
    assert str(error.value) == "--stream-name: stream ordrs does not exist (did you mean orders?)"


def test_a_caller_who_may_not_list_streams_gets_the_same_error_without_a_suggestion() -> None:
    kinesis: KinesisClient = boto3.client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(kinesis) as stubber:
        _missing(stubber, "ordrs")
        stubber.add_client_error("list_streams", "AccessDeniedException")
        with pytest.raises(ConfigError) as error:
            _stream_set(kinesis, "ordrs").refresh(starting=True)
    assert str(error.value) == "--stream-name: stream ordrs does not exist"


# -- the log of a run -------------------------------------------------------------------------

#: ``2026-01-01 00:00:00,000 LEVEL [worker id] [thread] logger: message``
_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?:\[(?P<worker>[^\]]+)\] )?"
                   r"\[(?P<thread>[^\]]+)\] (?P<logger>\S+): (?P<message>.*)$")


def _kclpy_worker(args: list[str], env: dict[str, str] | None = None
                  ) -> tuple[int, list[re.Match[str]]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KCLPY_")}
    result = subprocess.run(
        [sys.executable, "-m", "kclpy", *args], cwd=ROOT, capture_output=True, text=True,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=240, check=False)
    lines = [_LINE.match(line) for line in result.stderr.splitlines()]
    assert all(lines), result.stderr
    return result.returncode, cast("list[re.Match[str]]", lines)


def _first(lines: list[str], pattern: str) -> int:
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


@pytest.mark.integration
def test_a_local_run_logs_each_event_once_and_in_order() -> None:
    """The shard sync and the worker both logged the leases created, and the stream was
    said to be consumed before the lease table existed and again by the worker."""
    code, parsed = _kclpy_worker(_MAIN_JOB)
    assert code == 0
    lines = [m["message"] for m in parsed]
    assert len(lines) == len(set(lines)), lines
    assert len([line for line in lines if "created" in line and "lease" in line]) == 2, lines
    assert len([line for line in lines if "consuming" in line]) == 1, lines
    order = [_first(lines, r"^created lease table"),
             _first(lines, r"^shard sync created leases"),
             _first(lines, r"^worker \S+ consuming kclpy-demo"),
             _first(lines, r"^worker \S+ took shardId"),
             _first(lines, r"^every shard is caught up; stopping"),
             _first(lines, r"^worker \S+ stopped")]
    assert order == sorted(order), lines


@pytest.mark.integration
def test_every_line_of_a_worker_process_names_its_worker_and_warnings_are_said_once(
        tmp_path: Path) -> None:
    """The supervisor and each of its N workers loaded the configuration and warned about it,
    and N workers' lines (progress included) were interleaved without saying whose."""
    properties = tmp_path / "app.properties"
    properties.write_text("maxRecordz = 5\nretrievalMode = POLLING\n")
    code, parsed = _kclpy_worker(
        [*_MAIN_JOB, "--processes", "2", "--properties", str(properties),
         "--worker-id", "w", "--progress-interval", "0.1"],
        {"KCLPY_STREAM_NAMES": "x"})
    assert code == 0
    messages = [m["message"] for m in parsed]
    assert sum("KCLPY_STREAM_NAMES" in line for line in messages) == 1, messages
    assert sum("maxRecordz" in line for line in messages) == 1, messages
    for i in (0, 1):
        started = rf"^worker process {i} started \(pid \d+, worker id w-{i}\)$"
        assert sum(bool(re.match(started, line)) for line in messages) == 1, messages
    from_workers = [m for m in parsed if m["logger"] not in ("kclpy.supervisor", "kclpy.config")]
    assert from_workers, messages
    assert all(m["worker"] in ("w-0", "w-1") for m in from_workers), messages
    for i in (0, 1):
        assert any(m["worker"] == f"w-{i}" and m["message"].startswith(f"worker w-{i} stopped")
                   for m in from_workers)
