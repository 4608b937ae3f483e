"""MultiLangRecordProcessor driven directly, with real child processes: small amazon_kclpy
applications of each interface version (tests/multilang_apps/v*_app.py, on the real
amazon_kclpy package) and a hand-written protocol child for the misbehaviours."""

from __future__ import annotations

import json
import logging
import os
import random
import shlex
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kclpy.checkpoint import Checkpointer
from kclpy.consumer import ShardConsumer
from kclpy.errors import (
    CheckpointError,
    ConfigError,
    KinesisClientLibDependencyException,
    ProcessorRestartRequired,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases.lease import Lease
from kclpy.metrics import Metrics
from kclpy.multilang import (
    MultiLangChildError,
    MultiLangRecordProcessor,
    multilang_processor_factory,
    protocol,
    resolve_command,
)
from kclpy.position import Position
from kclpy.processor import (
    InitializeInput,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from tests.multilang_apps.amazon_kclpy_dist import amazon_kclpy_root
from tests.support.checkpoints import CheckpointWriterBase
from tests.support.scripted import (
    SETTINGS,
    Host,
    Leases,
    Readers,
    Result,
    RewindingRecovery,
    ScriptedFetcher,
    Writer,
)
from tests.support.waiting import wait_for

APPS = Path(__file__).parents[1] / "multilang_apps"
SHARD = "shardId-000000000007"
VERSIONS = [1, 2, 3]
STATUS = '{"action": "status", "responseFor": "%s"}'


class FakeWriter(CheckpointWriterBase):
    """The lease coordinator's side of a checkpoint: records writes, or fails as told."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, int]] = []
        self.failures: list[CheckpointError] = []

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.writes.append((lease_key, position.checkpoint, position.sub_sequence_number))


class Shard:
    """Plays the shard consumer: one checkpointer, increasing sequence numbers."""

    def __init__(self, processor: MultiLangRecordProcessor, writer: FakeWriter) -> None:
        self.processor = processor
        self.checkpointer = Checkpointer(SHARD, writer, "token-1", Position.trim_horizon())
        self._next = 49_600_000_000_000_000_000_000_000_000_000_000_000_000_000_001

    def initialize(self) -> None:
        self.processor.initialize(InitializeInput(SHARD, "TRIM_HORIZON", 0))

    def records(self, *payloads: str) -> list[Record]:
        made = []
        for index, payload in enumerate(payloads):
            made.append(Record(sequence_number=str(self._next), partition_key=f"pk-{index}",
                               timestamp_millis=1_700_000_000_000 + index,
                               data=payload.encode()))
            self._next += 10
        return made

    def deliver(self, records: list[Record]) -> None:
        self.checkpointer.mark_delivered(records[-1])
        self.processor.process_records(ProcessRecordsInput(SHARD, records, self.checkpointer, 250))


@pytest.fixture(scope="session")
def kclpy_path() -> Path:
    return amazon_kclpy_root()


@pytest.fixture
def output(tmp_path: Path) -> Path:
    return tmp_path / "events.jsonl"


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def make(kclpy_path: Path, output: Path, metrics: Metrics
         ) -> Iterator[Callable[..., MultiLangRecordProcessor]]:
    """Build processors for a test application; every child is killed at the end."""
    made: list[MultiLangRecordProcessor] = []

    def build(app: str, *, env: dict[str, str] | None = None,
              **options: Any) -> MultiLangRecordProcessor:
        child_env = {"PYTHONPATH": str(kclpy_path), "KCLPY_TEST_OUTPUT": str(output)}
        child_env.update(env or {})
        processor = MultiLangRecordProcessor(
            [sys.executable, str(APPS / app)], cwd=APPS, metrics=metrics, env=child_env,
            **options)
        made.append(processor)
        return processor

    yield build
    for processor in made:
        processor.close()


def events(output: Path, kind: str | None = None) -> list[dict[str, Any]]:
    if not output.exists():
        return []
    found = [json.loads(line) for line in output.read_text().splitlines()]
    return [e for e in found if kind is None or e.get("event") == kind]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def failures(metrics: Metrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value(
        "kclpy_multilang_child_failures_total", {"shard_id": SHARD, "reason": reason})


def lease_lost_event(version: int) -> dict[str, Any]:
    """How each interface version hears of a lost lease (v1/v2 through shutdown)."""
    if version == 3:
        return {"event": "lease_lost", "version": 3, "shard_id": SHARD}
    return {"event": "shutdown", "version": version, "reason": "ZOMBIE", "shard_id": SHARD}


def shard_ended_event(version: int) -> dict[str, Any]:
    if version == 3:
        return {"event": "shard_ended", "version": 3, "shard_id": SHARD}
    return {"event": "shutdown", "version": version, "reason": "TERMINATE", "shard_id": SHARD}


def started(processor: MultiLangRecordProcessor) -> int:
    pid = processor.child_pid
    assert pid is not None
    return pid


# -- the happy paths, per interface version --------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_records_reach_the_child_in_order_with_every_field(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    processor = make(f"v{version}_app.py")
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    first = shard.records("alpha", "b\u00e9ta", "gamma")
    kpl = Record(sequence_number=first[-1].sequence_number, partition_key="kpl",
                 timestamp_millis=1_700_000_000_999, sub_sequence_number=1,
                 data=b"sub-record")
    shard.deliver([*first, kpl])
    second = shard.records("delta", "epsilon")
    shard.deliver(second)

    (init,) = events(output, "initialize")
    assert init["shard_id"] == SHARD
    if version > 1:
        assert (init["sequence_number"], init["sub_sequence_number"]) == ("TRIM_HORIZON", 0)
    assert [b["count"] for b in events(output, "batch")] == [4, 2]
    if version > 1:
        assert [b["millis_behind_latest"] for b in events(output, "batch")] == [250, 250]
    got = [(r["data"], r["partition_key"], r["sequence_number"], r["sub_sequence_number"],
            r["approximate_arrival_timestamp"]) for r in events(output, "record")]
    expected = [(rec.binary_data.decode(), rec.partition_key, rec.sequence_number,
                 rec.sub_sequence_number, rec.timestamp_millis)
                for rec in [*first, kpl, *second]]
    assert got == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_shutdown_requested_lets_the_child_checkpoint_then_ends_it(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    processor = make(f"v{version}_app.py")
    shard = Shard(processor, writer)
    shard.initialize()
    batch = shard.records("one", "two")
    shard.deliver(batch)
    pid = started(processor)

    processor.shutdown_requested(ShutdownRequestedInput(SHARD, shard.checkpointer))

    assert writer.writes == [(SHARD, batch[-1].sequence_number, 0)]
    assert [e["error"] for e in events(output, "checkpoint")] == [None]
    # then leaseLost, as the Java daemon sends after shutdownRequested
    last = events(output)[-1]
    assert last == lease_lost_event(version)
    assert processor.child_pid is None
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_checkpoint_requested_by_the_child_lands(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    shard = Shard(make(f"v{version}_app.py"), writer)
    shard.initialize()
    batch = shard.records("first", "checkpoint", "third")
    shard.deliver(batch)

    assert writer.writes == [(SHARD, batch[1].sequence_number, 0)]
    assert shard.checkpointer.last_checkpoint == (batch[1].sequence_number, 0)
    assert [e["error"] for e in events(output, "checkpoint")] == [None]
    assert len(events(output, "record")) == 3


@pytest.mark.parametrize("version", VERSIONS)
def test_a_lost_lease_reaches_the_child_as_shutdown_exception(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    writer.failures.append(ShutdownException("lease taken"))
    shard = Shard(make(f"v{version}_app.py"), writer)
    shard.initialize()
    shard.deliver(shard.records("checkpoint"))

    assert writer.writes == []
    assert [e["error"] for e in events(output, "checkpoint")] == ["ShutdownException"]


@pytest.mark.parametrize("error", [ThrottlingException("slow down"),
                                   KinesisClientLibDependencyException("dynamodb down")])
def test_checkpoint_errors_keep_their_java_names(
        error: CheckpointError, make: Callable[..., MultiLangRecordProcessor],
        output: Path) -> None:
    writer = FakeWriter()
    writer.failures.append(error)
    shard = Shard(make("v3_app.py"), writer)
    shard.initialize()
    batch = shard.records("checkpoint", "checkpoint")
    shard.deliver(batch)

    # the child retried on the next record, and that one landed
    assert [e["error"] for e in events(output, "checkpoint")] == [error.name, None]
    assert writer.writes == [(SHARD, batch[1].sequence_number, 0)]


def test_checkpoint_beyond_what_was_delivered_is_invalid_state(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    shard = Shard(make("v3_app.py"), writer)
    shard.initialize()
    shard.deliver(shard.records("checkpoint 99999999999999999999999999999999999999999999999999999"))

    assert writer.writes == []
    assert [e["error"] for e in events(output, "checkpoint")] == ["InvalidStateException"]


@pytest.mark.parametrize("version", VERSIONS)
def test_shard_end_is_checkpointed_by_the_child(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    processor = make(f"v{version}_app.py")
    shard = Shard(processor, writer)
    shard.initialize()
    shard.deliver(shard.records("last"))
    pid = started(processor)
    shard.checkpointer.mark_shard_end()

    processor.shard_ended(ShardEndedInput(SHARD, shard.checkpointer))

    assert writer.writes == [(SHARD, "SHARD_END", 0)]
    ended = events(output)[-2]
    assert ended == shard_ended_event(version)
    assert processor.child_pid is None
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


def test_shard_end_not_checkpointed_keeps_the_child_for_the_retry(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    writer.failures.append(ThrottlingException("busy"))
    processor = make("v3_app.py")
    shard = Shard(processor, writer)
    shard.initialize()
    shard.deliver(shard.records("last"))
    shard.checkpointer.mark_shard_end()
    pid = started(processor)

    processor.shard_ended(ShardEndedInput(SHARD, shard.checkpointer))
    assert writer.writes == []
    assert processor.child_pid == pid

    processor.shard_ended(ShardEndedInput(SHARD, shard.checkpointer))
    assert writer.writes == [(SHARD, "SHARD_END", 0)]
    assert [e["error"] for e in events(output, "checkpoint")] == ["ThrottlingException", None]
    assert processor.child_pid is None


def test_shard_end_after_the_child_was_lost_starts_a_fresh_child_from_the_checkpoint(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    """The consumer calls shard_ended again on the same processor when a first attempt failed;
    by then every record was acknowledged, so a new child can end the shard."""
    writer = FakeWriter()
    processor = make("v3_app.py")
    shard = Shard(processor, writer)
    shard.initialize()
    batch = shard.records("checkpoint")
    shard.deliver(batch)
    shard.checkpointer.mark_shard_end()
    processor.close()

    processor.shard_ended(ShardEndedInput(SHARD, shard.checkpointer))

    starts = [e["sequence_number"] for e in events(output, "initialize")]
    assert starts == ["TRIM_HORIZON", batch[0].sequence_number]
    assert writer.writes == [(SHARD, batch[0].sequence_number, 0), (SHARD, "SHARD_END", 0)]
    assert processor.child_pid is None


def gap_batch(sequence_number: int) -> Result:
    """A lag recovery batch of one record that the application checkpoints."""
    return Result([Record(sequence_number=str(sequence_number), partition_key="k",
                          timestamp_millis=1_700_000_000_000, data=b"checkpoint-last")])


def test_gaps_left_at_shard_end_go_to_a_new_child(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    """Live reading ends the shard while lag recovery still has a gap batch queued: the
    child gets shardEnded and is stopped. On the code before, the consumer then handed the
    gap batch to that processor, which had no child, and asked for a restart; the consumer
    only read the gap again, and so on for ever (the lease held at SHARD_END, the gap never
    delivered). A second child, started at SHARD_END, gets the gap, then shardEnded."""
    recovery = RewindingRecovery([gap_batch(1), gap_batch(2)])
    made: list[MultiLangRecordProcessor] = []

    def factory() -> MultiLangRecordProcessor:
        made.append(make("v3_app.py"))
        return made[-1]

    writer = Writer()
    consumer = ShardConsumer(
        Lease(SHARD, checkpoint=Position("50")), concurrency_token="t",
        processor_factory=factory, fence=writer,
        readers=Readers(lambda start: ScriptedFetcher([Result([], shard_end=True)], (
            start.checkpoint, start.sub_sequence_number)), make_recovery=lambda: recovery),
        host=Host(Leases()), settings=SETTINGS, metrics=Metrics(), rng=random.Random(1))
    consumer.start()
    ended = consumer.join(20)
    if not ended:
        consumer.notify_lease_lost()
        consumer.join(20)
    assert ended and consumer.error is None
    seen = [(e["event"], e.get("sequence_number")) for e in events(output)
            if e["event"] in ("initialize", "record", "shard_ended")]
    assert seen == [("initialize", "50"), ("record", "1"), ("shard_ended", None),
                    ("initialize", "SHARD_END"), ("record", "2"), ("shard_ended", None)]
    assert recovery.writer.writes == [("1", 0), ("2", 0)]
    assert writer.writes == [("SHARD_END", 0)]
    assert len(made) == 2 and all(p.child_pid is None for p in made)


@pytest.mark.parametrize("version", VERSIONS)
def test_lease_lost_tells_the_child_and_ends_it_without_checkpointing(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    writer = FakeWriter()
    processor = make(f"v{version}_app.py")
    shard = Shard(processor, writer)
    shard.initialize()
    shard.deliver(shard.records("x"))
    pid = started(processor)

    processor.lease_lost(LeaseLostInput(SHARD))

    assert events(output)[-1] == lease_lost_event(version)
    assert writer.writes == []
    assert processor.child_pid is None
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


# -- children that fail ----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_a_child_that_exits_mid_batch_requires_a_restart(
        version: int, make: Callable[..., MultiLangRecordProcessor], metrics: Metrics,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kclpy.multilang")
    processor = make(f"v{version}_app.py")
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    batch = shard.records("fine", "crash")

    with pytest.raises(ProcessorRestartRequired) as info:
        shard.deliver(batch)

    assert isinstance(info.value, MultiLangChildError)
    assert info.value.reason == "exited"
    assert "exited with code 3" in str(info.value)
    assert failures(metrics, "exited") == 1
    (line,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = line.getMessage()
    assert SHARD in message
    assert "exited with code 3" in message
    assert "crashing on purpose" in message
    assert processor.child_pid is None
    # the failed processor stays failed: the consumer must replace it
    with pytest.raises(MultiLangChildError):
        shard.deliver(batch)
    assert failures(metrics, "exited") == 1
    processor.lease_lost(LeaseLostInput(SHARD))


def test_a_child_that_hangs_is_killed_after_the_response_timeout(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="kclpy.multilang")
    processor = make("v3_app.py", response_timeout_s=1.0)
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    pid = started(processor)

    with pytest.raises(MultiLangChildError) as info:
        shard.deliver(shard.records("hang"))

    assert info.value.reason == "timeout"
    assert failures(metrics, "timeout") == 1
    assert any(SHARD in r.getMessage() and "processRecords" in r.getMessage()
               for r in caplog.records)
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


def test_a_non_protocol_line_on_stdout_requires_a_restart(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="kclpy.multilang")
    processor = make("v2_app.py")
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    pid = started(processor)

    with pytest.raises(MultiLangChildError) as info:
        shard.deliver(shard.records("garbage"))

    assert info.value.reason == "protocol"
    assert failures(metrics, "protocol") == 1
    assert any("this is not a protocol message" in r.getMessage() for r in caplog.records)
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


def test_non_protocol_lines_can_be_skipped_as_the_java_daemon_does(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics, output: Path) -> None:
    shard = Shard(make("v1_app.py", stray_stdout="skip"), FakeWriter())
    shard.initialize()
    shard.deliver(shard.records("garbage", "checkpoint", "after"))

    assert [r["data"] for r in events(output, "record")] == ["garbage", "checkpoint", "after"]
    assert metrics.registry.get_sample_value(
        "kclpy_multilang_stray_stdout_lines_total", {"shard_id": SHARD}) == 1
    assert failures(metrics, "protocol") is None


def test_stderr_lines_go_to_the_log_tagged_with_the_shard(
        make: Callable[..., MultiLangRecordProcessor],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kclpy.multilang")
    shard = Shard(make("v3_app.py"), FakeWriter())
    shard.initialize()
    shard.deliver(shard.records("stderr hello from the application"))

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records
                if getattr(r, "child_stderr", None) == "hello from the application"]

    wait_for(logged, 20, "the child's stderr line in the log")
    (record,) = logged()
    assert record.name == "kclpy.multilang"
    assert record.levelno == logging.INFO
    assert getattr(record, "shard_id", None) == SHARD
    assert SHARD in record.getMessage()


# -- protocol edge cases, with a hand-written child -------------------------------------------


def raw_env(script: dict[str, Any] | None = None, **extra: str) -> dict[str, str]:
    env = {"KCLPY_TEST_SCRIPT": json.dumps(script or {})}
    env.update(extra)
    return env


def test_an_acknowledgement_for_the_wrong_action_breaks_the_protocol(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics) -> None:
    processor = make("raw_child.py", env=raw_env({"processRecords": [STATUS % "initialize"]}))
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    with pytest.raises(MultiLangChildError) as info:
        shard.deliver(shard.records("x"))
    assert info.value.reason == "protocol"
    assert "'initialize'" in str(info.value)
    assert failures(metrics, "protocol") == 1


def test_a_message_nested_too_deeply_breaks_the_protocol_in_step(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics) -> None:
    """The exchange ends on the defined protocol failure (the child is replaced), so the
    next child's answers are never read as replies to the wrong message."""
    deep = ('{"action": "status", "responseFor": "processRecords", "x": ' + "[" * 5_000
            + "]" * 5_000 + "}")
    processor = make("raw_child.py", env=raw_env({"processRecords": [deep]}))
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    with pytest.raises(MultiLangChildError) as info:
        shard.deliver(shard.records("x"))
    assert info.value.reason == "protocol"
    assert "nested too deeply" in str(info.value)
    assert failures(metrics, "protocol") == 1


def test_a_child_that_exits_before_acknowledging_initialize(
        make: Callable[..., MultiLangRecordProcessor], metrics: Metrics) -> None:
    processor = make("raw_child.py", env=raw_env({"initialize": "exit:7"}))
    with pytest.raises(MultiLangChildError) as info:
        processor.initialize(InitializeInput(SHARD, "LATEST", 0))
    assert info.value.reason == "exited"
    assert "exited with code 7" in str(info.value)
    assert failures(metrics, "exited") == 1


def test_a_child_that_cannot_start(metrics: Metrics, tmp_path: Path) -> None:
    processor = MultiLangRecordProcessor([str(tmp_path / "missing")], cwd=tmp_path,
                                         metrics=metrics)
    with pytest.raises(MultiLangChildError) as info:
        processor.initialize(InitializeInput(SHARD, "LATEST", 0))
    assert info.value.reason == "start_failed"
    assert failures(metrics, "start_failed") == 1


def test_checkpoint_requested_while_losing_the_lease_is_invalid_state(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    request = '{"action": "checkpoint", "sequenceNumber": null, "subSequenceNumber": null}'
    writer = FakeWriter()
    processor = make("raw_child.py",
                     env=raw_env({"leaseLost": [request, STATUS % "leaseLost"]}))
    shard = Shard(processor, writer)
    shard.initialize()
    processor.lease_lost(LeaseLostInput(SHARD))

    replies = [e["received"] for e in events(output)
               if e.get("received", {}).get("action") == "checkpoint"]
    assert replies == [{"action": "checkpoint", "sequenceNumber": None,
                        "subSequenceNumber": None, "error": "InvalidStateException"}]
    assert writer.writes == []


def test_a_child_that_ignores_the_end_of_its_input_is_killed_with_its_process_group(
        make: Callable[..., MultiLangRecordProcessor], output: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kclpy.multilang")
    processor = make("raw_child.py", env=raw_env(KCLPY_TEST_LINGER="1"), exit_timeout_s=0.5)
    shard = Shard(processor, FakeWriter())
    shard.initialize()
    pid = started(processor)
    (grandchild,) = [e["grandchild"] for e in events(output) if "grandchild" in e]

    processor.lease_lost(LeaseLostInput(SHARD))

    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")
    wait_for(lambda: not alive(grandchild), 20, f"process {grandchild} to be gone")
    assert any("killing its process group" in r.getMessage() for r in caplog.records)


def test_the_child_runs_in_the_given_folder(
        make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    shard = Shard(make("raw_child.py", env=raw_env()), FakeWriter())
    shard.initialize()
    (first,) = [e for e in events(output) if "received" in e]
    assert first["received"] == {"action": "initialize", "shardId": SHARD,
                                 "sequenceNumber": "TRIM_HORIZON", "subSequenceNumber": 0}
    assert Path(first["cwd"]) == APPS.resolve()


def test_close_kills_a_running_child(make: Callable[..., MultiLangRecordProcessor]) -> None:
    processor = make("v3_app.py")
    Shard(processor, FakeWriter()).initialize()
    pid = started(processor)
    processor.close()
    assert processor.child_pid is None
    wait_for(lambda: not alive(pid), 20, f"process {pid} to be gone")


# -- executableName and the factory ----------------------------------------------------------


def test_a_relative_script_resolves_against_the_properties_folder(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("")
    assert resolve_command("app/main.py --flag 'two words'", tmp_path) == [
        sys.executable, str(tmp_path / "app" / "main.py"), "--flag", "two words"]


def test_a_bare_name_prefers_the_file_next_to_the_properties(tmp_path: Path) -> None:
    script = tmp_path / "consumer"
    script.write_text("#!/bin/sh\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert resolve_command("consumer -v", tmp_path) == [str(script), "-v"]


def test_a_command_on_path_is_kept_as_written(tmp_path: Path) -> None:
    assert resolve_command("python3 -u 'my app.py'", tmp_path) == ["python3", "-u", "my app.py"]


@pytest.mark.parametrize("executable", ["", "   ", "python3 'unbalanced", "missing_app.py",
                                        "dir/missing.py", "no-such-command-kclpy-xyz",
                                        "data.txt"])
def test_a_bad_executable_name_fails_at_start_up_naming_the_key(executable: str,
                                                                tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("not a program")
    with pytest.raises(ConfigError) as info:
        multilang_processor_factory(executable, cwd=tmp_path, metrics=None)
    assert info.value.option == "executableName"


def test_the_factory_makes_one_processor_per_call(
        kclpy_path: Path, output: Path, metrics: Metrics) -> None:
    factory = multilang_processor_factory(
        f"{shlex.quote(sys.executable)} v3_app.py", cwd=APPS, metrics=metrics,
        env={"PYTHONPATH": str(kclpy_path), "KCLPY_TEST_OUTPUT": str(output)})
    first, second = factory(), factory()
    assert isinstance(first, MultiLangRecordProcessor)
    assert isinstance(second, MultiLangRecordProcessor)
    assert first is not second
    try:
        for number, processor in enumerate((first, second)):
            processor.initialize(InitializeInput(f"shardId-{number}", "LATEST", 0))
        assert [e["shard_id"] for e in events(output, "initialize")] == \
            ["shardId-0", "shardId-1"]
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_batch_larger_than_a_message_reaches_the_child_as_several_in_order(
        version: int, make: Callable[..., MultiLangRecordProcessor], output: Path) -> None:
    """Each line is acknowledged before the next is sent; while the child handles one, a
    checkpoint without arguments lands at that line's last record and one beyond it is
    refused: nothing the child has not been given is ever covered."""
    cap = 850
    writer = FakeWriter()
    shard = Shard(make(f"v{version}_app.py", max_message_bytes=cap), writer)
    shard.initialize()
    batch = shard.records("one", "checkpoint-last", "three", "four", "five", "six", "seven",
                          "eight")
    batch[2] = Record(sequence_number=batch[2].sequence_number, partition_key="pk-2",
                      timestamp_millis=batch[2].timestamp_millis,
                      data=f"checkpoint {batch[-1].sequence_number}".encode())
    lines = list(protocol.split_process_records(batch, 250, cap))
    assert len(lines) >= 3
    assert all(len(line) <= cap for line, _ in lines)
    first_last = lines[0][1]
    assert first_last is not None and 2 <= batch.index(first_last) < len(batch) - 1

    shard.deliver(batch)

    sizes = [len(json.loads(line)["records"]) for line, _ in lines]
    assert [b["count"] for b in events(output, "batch")] == sizes
    assert [r["data"] for r in events(output, "record")] == [
        r.binary_data.decode() for r in batch]
    assert writer.writes == [(SHARD, first_last.sequence_number, 0)]
    assert [e["error"] for e in events(output, "checkpoint")] == [
        None, "InvalidStateException"]
    # the consumer's mark is where the last line leaves it: the whole batch
    shard.checkpointer.checkpoint()
    assert writer.writes[-1] == (SHARD, batch[-1].sequence_number, 0)
