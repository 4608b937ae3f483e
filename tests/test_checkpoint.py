"""The checkpointer's validation and fencing rules, against a recording writer."""

from __future__ import annotations

import pytest

from kclpy.checkpoint import Checkpointer
from kclpy.errors import InvalidStateException, ShutdownException
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.records import Record
from tests.support.checkpoints import CheckpointWriterBase


class RecordingWriter(CheckpointWriterBase):
    def __init__(self, fail: Exception | None = None) -> None:
        self.writes: list[tuple[str, str, str, int]] = []
        self.fail = fail

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        if self.fail is not None:
            raise self.fail
        self.writes.append((lease_key, concurrency_token, position.checkpoint,
                            position.sub_sequence_number))


def rec(seq: int, sub: int = 0) -> Record:
    return Record(sequence_number=str(seq), partition_key="k", timestamp_millis=0,
                  sub_sequence_number=sub, data=b"x")


def make(writer: RecordingWriter, checkpoint: str = "TRIM_HORIZON", sub: int = 0,
         metrics: Metrics | None = None) -> Checkpointer:
    return Checkpointer("shard-1", writer, "tok", Position.of(checkpoint, sub), metrics)


def test_checkpoint_without_arguments_writes_last_delivered() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.mark_delivered(rec(105, 3))
    cp.checkpoint()
    assert writer.writes == [("shard-1", "tok", "105", 3)]
    assert cp.last_checkpoint == ("105", 3)


def test_checkpoint_without_arguments_is_a_no_op_when_nothing_is_new() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.checkpoint()
    cp.mark_delivered(rec(7))
    cp.checkpoint()
    cp.checkpoint()
    assert writer.writes == [("shard-1", "tok", "7", 0)]


def test_checkpoint_at_a_record_and_at_a_sequence_number() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.mark_delivered(rec(200, 4))
    cp.checkpoint(rec(150, 2))
    cp.checkpoint("200", 1)
    cp.checkpoint(200, 4)
    assert [w[2:] for w in writer.writes] == [("150", 2), ("200", 1), ("200", 4)]


def test_beyond_delivered_is_invalid() -> None:
    metrics = Metrics()
    cp = make(RecordingWriter(), metrics=metrics)
    cp.mark_delivered(rec(100, 2))
    with pytest.raises(InvalidStateException):
        cp.checkpoint("100", 3)
    with pytest.raises(InvalidStateException):
        cp.checkpoint("101")
    value = metrics.registry.get_sample_value(
        "kclpy_checkpoint_failures_total", {"shard_id": "shard-1", "kind": "InvalidStateException"})
    assert value == 2


def test_before_last_checkpoint_is_invalid() -> None:
    cp = make(RecordingWriter(), checkpoint="500", sub=2)
    cp.mark_delivered(rec(900))
    with pytest.raises(InvalidStateException):
        cp.checkpoint("500", 1)
    with pytest.raises(InvalidStateException):
        cp.checkpoint("499")
    cp.checkpoint("500", 2)


def test_nothing_delivered_means_any_explicit_position_is_invalid() -> None:
    cp = make(RecordingWriter())
    with pytest.raises(InvalidStateException):
        cp.checkpoint("1")


def test_not_a_sequence_number_is_invalid() -> None:
    cp = make(RecordingWriter())
    cp.mark_delivered(rec(5))
    with pytest.raises(InvalidStateException):
        cp.checkpoint("abc")
    with pytest.raises(InvalidStateException):
        cp.checkpoint("5", -1)


def test_digits_of_other_scripts_are_not_a_sequence_number() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.mark_delivered(rec(200))
    with pytest.raises(InvalidStateException):
        cp.checkpoint("\u0661\u0665\u0660")  # "150" in Arabic-Indic digits
    assert writer.writes == []


def test_shard_end_only_after_the_shard_ended() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.mark_delivered(rec(5))
    with pytest.raises(InvalidStateException, match="before the shard's last record"):
        cp.checkpoint("SHARD_END")
    cp.mark_shard_end()
    cp.checkpoint()
    assert writer.writes[-1][2:] == ("SHARD_END", 0)
    assert cp.last_checkpoint == ("SHARD_END", 0)
    named = make(writer)  # SHARD_END named, as amazon_kclpy processors may
    named.mark_delivered(rec(5))
    named.mark_shard_end()
    named.checkpoint("SHARD_END")
    assert named.last_checkpoint == ("SHARD_END", 0)


def test_writer_errors_propagate_and_do_not_move_the_checkpoint() -> None:
    metrics = Metrics()
    cp = make(RecordingWriter(fail=ShutdownException("gone")), checkpoint="10", metrics=metrics)
    cp.mark_delivered(rec(20))
    with pytest.raises(ShutdownException):
        cp.checkpoint()
    assert cp.last_checkpoint == ("10", 0)
    assert metrics.registry.get_sample_value(
        "kclpy_checkpoint_failures_total",
        {"shard_id": "shard-1", "kind": "ShutdownException"}) == 1


def test_unmark_delivered_withdraws_a_failed_batch() -> None:
    writer = RecordingWriter()
    cp = make(writer)
    cp.mark_delivered(rec(10))
    cp.checkpoint()
    previous = cp.mark_delivered(rec(20))
    cp.unmark_delivered(previous)
    cp.checkpoint()
    assert [w[2] for w in writer.writes] == ["10"]
    with pytest.raises(InvalidStateException):
        cp.checkpoint("20")


def test_positions_order_sentinels_around_sequence_numbers() -> None:
    assert Position.of("TRIM_HORIZON", 0) < Position.of("1", 0) < Position.of("1", 1)
    assert Position.of("LATEST", None) < Position.of("0", 0)
    assert Position.of("99999999999999999999999999999999999999999999999999999999", 9) < \
        Position.of("SHARD_END", 0)


def test_a_retired_checkpointer_writes_nothing_by_any_path() -> None:
    """Once its processor was replaced, a checkpointer refuses every write - a checkpoint,
    a commit, a fenced claim - and the position it returned on retiring stays its last."""
    writer = RecordingWriter()
    metrics = Metrics()
    cp = make(writer, metrics=metrics)
    cp.mark_delivered(rec(10))
    cp.checkpoint()
    assert cp.retire("restarted") == Position("10")
    cp.mark_delivered(rec(11))
    with pytest.raises(ShutdownException, match="restarted"):
        cp.checkpoint()
    with pytest.raises(ShutdownException):
        cp.commit(rec(11), lambda w, key, token, position: w.update_checkpoint(
            key, token, position))
    with pytest.raises(ShutdownException):
        cp.fenced(lambda w, key, token: None)
    assert writer.writes == [("shard-1", "tok", "10", 0)]
    assert cp.position == Position("10")
    failures = metrics.registry.get_sample_value(
        "kclpy_checkpoint_failures_total", {"shard_id": "shard-1", "kind": "ShutdownException"})
    assert failures == 3
