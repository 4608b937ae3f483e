"""retrieval/modes.py: one registry of retrieval modes, read by the worker's options, its
composition and a Spark task alike; a mode registered from outside joins all three, and the
example that registers a mode and a store of its own runs end to end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest

import kclpy
from kclpy.arguments import parse_worker_args, worker_parser
from kclpy.cli import worker_main
from kclpy.config import KCLConfig
from kclpy.errors import ConfigError
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.retrieval import modes
from kclpy.retrieval.modes import FAN_OUT, POLLING, RetrievalContext, retrieval_mode
from kclpy.retrieval.polling import PollingSource
from kclpy.retrieval.source import PageSource, ShardAddress
from kclpy.retry import Backoff
from kclpy.spark.options import SourceOptions
from kclpy.spark.reading import ShardInfo, ShardReader, StreamRef, TaskRetrieval

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Noting:
    """Polling, with every context it was asked to build a source from kept."""

    name: str = "noting"
    aliases: tuple[str, ...] = ("jotting",)
    needs_consumer: bool = False
    contexts: list[RetrievalContext] = field(default_factory=list)

    def source(self, context: RetrievalContext) -> PageSource:
        self.contexts.append(context)
        return POLLING.source(context)


@pytest.fixture
def noting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Noting]:
    """A mode registered from outside, for this test only."""
    monkeypatch.setattr(modes, "_MODES", dict(modes._MODES))
    monkeypatch.setattr(modes, "_NAMES", dict(modes._NAMES))
    mode = Noting()
    kclpy.register_retrieval_mode(mode)
    yield mode


def test_both_sides_words_name_the_two_built_in_modes_in_any_case() -> None:
    for word in ("polling", "POLLING", "GetRecords"):
        assert retrieval_mode(word) is POLLING
    for word in ("fanout", "FANOUT", "efo", "SubscribeToShard"):
        assert retrieval_mode(word) is FAN_OUT
    assert FAN_OUT.needs_consumer and not POLLING.needs_consumer
    assert kclpy.retrieval_mode is retrieval_mode


def test_an_unknown_mode_names_the_option_and_lists_the_known_names(noting: Noting) -> None:
    with pytest.raises(ConfigError) as excinfo:
        retrieval_mode("push", "--retrieval-mode")
    assert excinfo.value.option == "--retrieval-mode"
    assert excinfo.value.message == "'push' is not one of polling, fanout, noting"


def test_a_word_that_names_another_mode_is_refused(noting: Noting) -> None:
    with pytest.raises(ValueError, match="'efo' already names the retrieval mode 'fanout'"):
        kclpy.register_retrieval_mode(Noting(name="other", aliases=("efo",)))
    with pytest.raises(ValueError, match="'polling' already names"):
        kclpy.register_retrieval_mode(Noting(name="polling", aliases=()))
    again = Noting()
    kclpy.register_retrieval_mode(again)
    assert retrieval_mode("jotting") is again, "the module executed again replaces its mode"
    assert retrieval_mode("fanout") is FAN_OUT and retrieval_mode("polling") is POLLING


def test_a_mode_registered_before_the_options_are_read_is_accepted(noting: Noting) -> None:
    config = KCLConfig(application_name="a", stream_name="s", retrieval_mode="Jotting")
    assert not config.fan_out
    flags = ["--application-name", "a", "--stream-name", "s", "--processor",
             "examples/printing_processor.py:PrintingProcessor"]
    parsed, _ = parse_worker_args([*flags, "--retrieval-mode", "noting"])
    assert parsed.retrieval_mode == "noting"
    assert "choices: polling, fanout, noting" in " ".join(worker_parser().format_help().split())
    options = SourceOptions.parse({"streamName": "s", "consumerMode": "noting"})
    assert options.retrieval_mode == "noting" and not options.fan_out


def test_an_unknown_mode_is_one_line_naming_the_flag_and_exit_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code = worker_main(["--application-name", "a", "--stream-name", "s", "--processor",
                        "examples/printing_processor.py:PrintingProcessor",
                        "--retrieval-mode", "noting"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--retrieval-mode" in lines[0], lines
    assert "'noting' is not one of polling, fanout" in lines[0]


def test_a_spark_task_reads_through_the_mode_its_partition_names(noting: Noting) -> None:
    shard = ShardInfo("shardId-000000000000", (), 0, 2**128 - 1, False)
    # never called: building a reader sends nothing
    client = boto3.client("kinesis", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
    reader = ShardReader(client, StreamRef("s"), shard, Position.trim_horizon(), limit=300,
                         until_ms=5000, retrieval=TaskRetrieval("jotting"))
    (context,) = noting.contexts
    assert (context.max_records, context.until_ms, context.idle_time_s) == (300, 5000, 0)
    assert context.address.shard_id == "shardId-000000000000"
    reader.close()
    polling = ShardReader(client, StreamRef("s"), shard, Position.trim_horizon())
    assert isinstance(polling._source, PollingSource)
    assert len(noting.contexts) == 1, "polling is built without the registered mode"


def test_a_fan_out_source_without_its_consumer_is_refused() -> None:
    context = RetrievalContext(object(), ShardAddress("s-0", "s"), Metrics(), Backoff())
    with pytest.raises(ValueError, match="no consumer_arn"):
        FAN_OUT.source(context)


def test_the_toy_extensions_example_reads_through_its_mode_into_its_store() -> None:
    """examples/toy_extensions.py registers a retrieval mode, a state store and a lease
    assignment strategy through kclpy's public names only, runs a worker on the embedded
    endpoint, and exits 0 only when every record was handed over by its mode and applied
    once in its store, and the worker's taker asked its strategy."""
    result = subprocess.run([sys.executable, "examples/toy_extensions.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == (
        "every record came through the counting mode into the dict store once, "
        "leases spread by the sticky strategy")
