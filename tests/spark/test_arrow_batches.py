"""Records to Arrow in batches bounded by bytes: however many records share one partition
key, no record batch grows past its cap, and no record is lost or moved."""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pytest
from aws_kinesis_agg.aggregator import RecordAggregator

from kclpy.records import Record, Records
from kclpy.retrieval.kpl import MAGIC, deaggregate
from kclpy.retrieval.parse import parse_get_records
from kclpy.spark.arrow import (
    MAX_BATCH_BYTES,
    SCHEMA,
    records_to_batch,
    records_to_batches,
    records_to_table,
)
from tests.support.aggregates import sign
from tests.support.protowire import field

#: what a batch may hold beyond its cap: the one extra offset of each of its five
#: variable-length columns
SLACK = 5 * 4


def varied(count: int) -> list[Record]:
    keys = ["pk", "\u00e9t\u00e9", "\U0001f600" * 3, "k" * 256]
    return [Record(sequence_number=str(10**40 + i), partition_key=keys[i % len(keys)],
                   timestamp_millis=None if i % 5 == 0 else 1_700_000_000_000 + i,
                   sub_sequence_number=i, data=bytes(range(256))[: (i * 37) % 300])
            for i in range(count)]


@pytest.mark.parametrize("cap", [1, 500, 4_000, 50_000])
def test_batches_stay_within_the_cap_and_keep_every_record_in_order(cap: int) -> None:
    records = varied(80)
    batches = list(records_to_batches("stream", "shardId-000000000001", records, cap))
    assert all(batch.nbytes <= cap + SLACK or batch.num_rows == 1 for batch in batches)
    whole = records_to_batch("stream", "shardId-000000000001", records)
    assert pa.Table.from_batches(batches, schema=SCHEMA).equals(
        pa.Table.from_batches([whole], schema=SCHEMA))
    # not needlessly small: a row is at most about 700 bytes
    if cap >= 4_000:
        assert all(batch.nbytes > cap - 800 for batch in batches[:-1])
    assert sum(batch.num_rows for batch in batches) == len(records)


def test_no_records_make_no_batch() -> None:
    assert list(records_to_batches("s", "shard", [])) == []


def test_a_page_of_tiny_records_under_one_long_key_is_many_bounded_batches() -> None:
    """A 1 MiB aggregate of empty sub-records sharing a 256-character key, within Kinesis'
    limits and expanded: about 44 MiB of partition keys once every row carries its own."""
    count = 170_000
    body = field(1, b"k" * 256) + field(3, field(1, 0) + field(3, b"")) * count
    blob = sign(body)
    assert blob.startswith(MAGIC) and len(blob) < 2**20
    page = deaggregate([Record(sequence_number="4" * 56, partition_key="outer",
                               timestamp_millis=1_700_000_000_000, data=blob)])
    assert (len(page.records), page.corrupt) == (count, 0)
    sizes = [(batch.num_rows, batch.nbytes) for batch in
             records_to_batches("stream", "shardId-000000000001", page.records)]
    assert len(sizes) > 10
    assert all(nbytes <= MAX_BATCH_BYTES + SLACK for _, nbytes in sizes)
    assert sum(rows for rows, _ in sizes) == count


def test_a_table_of_several_shards_is_made_of_bounded_batches() -> None:
    records = varied(40)
    table = records_to_table("stream", [("a", records), ("b", records)])
    assert table.num_rows == 80
    assert table.column("shard_id").to_pylist() == ["a"] * 40 + ["b"] * 40
    assert table.column("sequence_number").to_pylist() == [
        r.sequence_number for r in records] * 2


def test_columns_read_from_rows_and_aggregates_equal_the_records_read_one_by_one() -> None:
    """The columnar reading of a page's rows and an aggregate's columns (no record built)
    gives the table the records themselves give: payloads decoded the same (a non-canonical
    one included), arrival times rounded as ``timestamp_millis`` rounds them."""
    wire = [{"SequenceNumber": str(10**50 + i), "PartitionKey": f"k\u00e9{i % 3}",
             "Data": base64.b64encode(bytes([i]) * (i % 7)).decode(),
             "ApproximateArrivalTimestamp": 1.001 + i / 1000} for i in range(30)]
    wire[3]["Data"] = "aG\nk="  # not canonical: a line break inside
    del wire[5]["ApproximateArrivalTimestamp"]
    page = parse_get_records(json.dumps({"Records": wire, "NextShardIterator": "x"}).encode())
    aggregator = RecordAggregator()
    for i in range(50):
        aggregator.add_user_record(f"key{i % 4}", b"x" * i)
    blob = aggregator.clear_and_get().get_contents()[2]
    outer = Record(sequence_number="7" * 56, partition_key="outer",
                   timestamp_millis=1_700_000_000_001, data=blob)
    user = deaggregate([outer]).records[3:]
    together = Records([page.records, user])
    assert isinstance(together.parts[1], Records)
    built = list(together)
    assert records_to_batch("s", "shard", together).equals(
        records_to_batch("s", "shard", built))
    for cap in (1, 300, MAX_BATCH_BYTES):
        fast = list(records_to_batches("s", "shard", together, cap))
        slow = list(records_to_batches("s", "shard", built, cap))
        assert [b.num_rows for b in fast] == [b.num_rows for b in slow]
        assert pa.Table.from_batches(fast).equals(pa.Table.from_batches(slow))
