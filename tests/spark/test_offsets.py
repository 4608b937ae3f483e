"""The offset log of a running query must stay readable: the source's offsets are kclpy's
position type written for Spark, and an offset written by an earlier kclpy (the checked-in
``offsets_written_before_position.json``, produced by the source before positions became
one type) decodes to the same positions and encodes back to the same text."""

from __future__ import annotations

import json
from pathlib import Path

from kclpy.position import Position
from kclpy.spark.offsets import Budget, UptoEnd, decode_entry, decode_offset, encode_offset

EXAMPLE = Path(__file__).with_name("offsets_written_before_position.json")


def test_an_offset_written_before_reads_the_same() -> None:
    written = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    offset = decode_offset(written)
    assert {key: p for key, p in offset.items() if isinstance(p, Position)} == {
        "shardId-000000000000": Position.trim_horizon(),
        "shardId-000000000001": Position(
            "49590338271490256608559692538361571095921575989136588898", 3),
        "shardId-000000000002": Position.at_timestamp(1_700_000_000_123),
        "shardId-000000000003": Position.shard_end(),
        "111122223333:orders:1700000000:shardId-000000000007": Position(
            "49590338271490256608559692538361571095921575989136588999", 0),
    }
    planned = offset["shardId-000000000004"]
    assert isinstance(planned, UptoEnd)
    assert planned.start == Position("4959", 2)
    assert (planned.until_ms, planned.budget, planned.plan) == (
        1_700_000_000_456, Budget(rows=50, duration_ms=2000), "a1b2c3")
    for key, start in (("shardId-000000000005", Position.at_timestamp(1_700_000_000_000)),
                       ("shardId-000000000006", Position.trim_horizon())):
        entry = offset[key]
        assert isinstance(entry, UptoEnd) and entry.start == start
    # Spark compares offsets by their JSON text: the same text must come back.
    assert encode_offset(offset) == written


def test_an_offsets_positions_are_the_one_position_type() -> None:
    record = Position("4959", 2)
    assert decode_entry("AFTER/4959/2") == record
    assert record.encode() == "AFTER/4959/2" and record.extended == (4959, 2)
    assert decode_entry("AT_TIMESTAMP/5") == Position.at_timestamp(5)
    upto = decode_entry("UPTO/7/3/-/-/p1/AFTER/4959/2")
    assert isinstance(upto, UptoEnd) and upto.start == record
    assert upto.encode() == "UPTO/7/3/-/-/p1/AFTER/4959/2"
