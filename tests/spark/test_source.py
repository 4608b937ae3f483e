"""The ``format("kinesis")`` source against kinesis-mock over HTTP.

The Spark tests run real streaming queries (``local[2]``, Trigger.AvailableNow) and compare
what reached ``foreachBatch`` with what was produced, record for record. The driver-side
tests call the reader the way Spark 4.0/4.1 does (``latestOffset()`` without arguments), which
the installed Spark no longer does by itself.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from pyspark.sql.datasource import DataSourceStreamReader

from kclpy.config import KCLConfig
from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from kclpy.position import Position
from kclpy.spark import source as source_module
from kclpy.spark.metadata import PositionStore
from kclpy.spark.offsets import (
    Budget,
    OffsetEntry,
    UptoEnd,
    decode_entry,
    decode_offset,
    encode_offset,
)
from kclpy.spark.reading import BudgetedRead
from kclpy.spark.source import KinesisStreamReader, SourceOptions
from tests.support import skew
from tests.support.source_driving import read_batch
from tests.support.spark_query import spark_env
from tests.support.streams import (
    create_stream,
    kinesis_client,
    put_aggregated,
    put_plain,
    unique_name,
    wait_for,
)

Row = tuple[int, str, str, int, bytes]

CONSUMER_ARN = "arn:aws:kinesis:us-east-1:123456789012:stream/s/consumer/orders-spark:1700000000"

#: Spark >= 4.2 passes read limits and drives AvailableNow through the reader; 4.0/4.1 do not
READ_LIMITS = hasattr(DataSourceStreamReader, "getDefaultReadLimit")


def produce(kinesis: Any, stream: str, tag: str, plain: int, aggregates: int = 0,
            per_aggregate: int = 10) -> list[bytes]:
    payloads = [f"{tag}-plain-{n}".encode() for n in range(plain)]
    put_plain(kinesis, stream, payloads)
    aggregated = [f"{tag}-kpl-{n}".encode() for n in range(aggregates * per_aggregate)]
    if aggregated:
        put_aggregated(kinesis, stream, aggregated, per_aggregate)
    return payloads + aggregated


def run_available_now(spark: Any, url: str, stream: str, checkpoint: Path,
                      **options: Any) -> list[Row]:
    """Run the query to the stream's current end; the rows each batch delivered."""
    reader = (spark.readStream.format("kinesis").option("streamName", stream)
              .option("endpointUrl", url).option("region", "us-east-1")
              .option("startingPosition", "TRIM_HORIZON"))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    rows: list[Row] = []

    def collect(df: Any, batch_id: int) -> None:
        rows.extend((batch_id, r.shard_id, r.sequence_number, r.sub_sequence_number,
                     bytes(r.data)) for r in df.collect())

    query = (reader.load().writeStream.foreachBatch(collect)
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(240), "availableNow query did not finish"
    assert query.exception() is None
    return rows


def assert_exactly(rows: list[Row], expected: list[bytes]) -> None:
    seen = collections.Counter(r[4] for r in rows)
    missing = collections.Counter(expected) - seen
    extra = seen - collections.Counter(expected)
    assert not missing, f"{sum(missing.values())} records missing"
    assert not extra, f"{sum(extra.values())} records extra or repeated"


def assert_ordered_per_shard(rows: list[Row]) -> None:
    by_shard: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for _, shard, seq, sub, _ in sorted(rows, key=lambda r: r[0]):
        by_shard[shard].append((int(seq), sub))
    for shard, positions in by_shard.items():
        assert positions == sorted(set(positions)), f"{shard} out of order or repeated"


@pytest.mark.integration
@pytest.mark.slow
def test_available_now_reads_every_record_once_and_a_restart_adds_only_new_ones(
        spark: Any, kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-an")
    create_stream(kinesis, stream, 4)
    first = produce(kinesis, stream, "first", plain=300, aggregates=6, per_aggregate=25)
    checkpoint = tmp_path / "checkpoint"

    rows = run_available_now(spark, kinesis_mock.url, stream, checkpoint,
                             maxRecordsPerBatch=200)

    assert_exactly(rows, first)
    assert_ordered_per_shard(rows)
    if READ_LIMITS:
        sizes = collections.Counter(r[0] for r in rows)
        assert max(sizes.values()) <= 200, "ReadMaxRows(200) exceeded"
        assert len(sizes) >= len(first) // 200
    assert {r[1] for r in rows} == {s["ShardId"] for s in
                                    kinesis.list_shards(StreamName=stream)["Shards"]}
    assert any(r[3] > 0 for r in rows), "KPL sub-records were not de-aggregated"

    second = produce(kinesis, stream, "second", plain=120, aggregates=2, per_aggregate=10)
    again = run_available_now(spark, kinesis_mock.url, stream, checkpoint,
                              maxRecordsPerBatch=200)

    assert_exactly(again, second)
    assert min(r[0] for r in again) > max(r[0] for r in rows)


@pytest.mark.integration
@pytest.mark.slow
def test_split_mid_stream_reads_the_parent_to_its_end_before_the_children(
        spark: Any, kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-split")
    create_stream(kinesis, stream, 2)
    checkpoint = tmp_path / "checkpoint"
    before = produce(kinesis, stream, "before", plain=100, aggregates=2)
    assert_exactly(run_available_now(spark, kinesis_mock.url, stream, checkpoint), before)

    pending = produce(kinesis, stream, "pending", plain=100, aggregates=2)
    parent = kinesis.list_shards(StreamName=stream)["Shards"][0]
    low, high = (int(parent["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(StreamName=stream, ShardToSplit=parent["ShardId"],
                        NewStartingHashKey=str((low + high) // 2))
    wait_for(lambda: kinesis.describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", 30, "split done")
    after = produce(kinesis, stream, "after", plain=200, aggregates=2)

    rows = run_available_now(spark, kinesis_mock.url, stream, checkpoint)
    if not READ_LIMITS:
        # Spark 4.0/4.1 run AvailableNow as one batch planned up front: the children, whose
        # parent only ends in that batch, are left to the next run.
        rows += run_available_now(spark, kinesis_mock.url, stream, checkpoint)

    assert_exactly(rows, pending + after)
    assert_ordered_per_shard(rows)
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    children = [s["ShardId"] for s in shards if s.get("ParentShardId") == parent["ShardId"]]
    assert len(children) == 2
    parent_batches = {r[0] for r in rows if r[1] == parent["ShardId"]}
    child_batches = {r[0] for r in rows if r[1] in children}
    assert parent_batches and child_batches, "the parent's rest and the children were read"
    assert max(parent_batches) < min(child_batches)


@pytest.mark.integration
@pytest.mark.slow
def test_available_now_in_spark_is_exact_with_small_pages_and_reads_each_record_once(
        spark: Any, kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    """2,000 records in PutRecords calls of 500, pages of 300: the tip is an empty page, not
    MillisBehindLatest 0. Counted through a proxy: executors fetch the records, once."""
    from tests.support.counting import CountingProxy

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-pages")
    create_stream(kinesis, stream, 2)
    payloads = [f"p-{n}".encode() + bytes(100) for n in range(2000)]
    put_plain(kinesis, stream, payloads)
    with CountingProxy(kinesis_mock.url) as proxy:
        rows = run_available_now(spark, proxy.url, stream, tmp_path / "checkpoint",
                                 maxRecordsPerFetch=300)
        records = dict(proxy.records)

    assert_exactly(rows, payloads)
    fetched = sum(records.values())
    assert fetched / len(rows) <= 1.1, records
    assert records.get("kclpy-spark-driver", 0) <= 2, records


@pytest.mark.integration
@pytest.mark.slow
def test_fan_out_reads_every_record_once_and_a_restart_adds_only_new_ones(
        spark: Any, kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    """``consumerName``: the driver registers the consumer once, the executors read the
    batch's part through SubscribeToShard to its planned end; counted through a proxy."""
    from kclpy.retrieval.registration import list_consumers
    from tests.support.faultproxy import FaultProxy

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-efo")
    create_stream(kinesis, stream, 2)
    first = produce(kinesis, stream, "first", plain=200, aggregates=3)
    checkpoint = tmp_path / "checkpoint"
    with FaultProxy(kinesis_mock.url) as proxy:
        rows = run_available_now(spark, proxy.url, stream, checkpoint,
                                 consumerName="orders-spark")
        assert_exactly(rows, first)
        assert_ordered_per_shard(rows)
        assert proxy.requests("SubscribeToShard") >= 2

        second = produce(kinesis, stream, "second", plain=80, aggregates=1)
        again = run_available_now(spark, proxy.url, stream, checkpoint,
                                  consumerName="orders-spark")
        assert_exactly(again, second)
        assert min(r[0] for r in again) > max(r[0] for r in rows)
        assert proxy.requests("RegisterStreamConsumer") == 1
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"]
    assert [c["ConsumerName"] for c in list_consumers(kinesis, arn)] == ["orders-spark"]


def test_load_rejects_a_misspelt_option_naming_the_closest_one(spark: Any) -> None:
    from pyspark.errors import PySparkException

    reader = (spark.readStream.format("kinesis").option("streamName", "s")
              .option("startingPositon", "TRIM_HORIZON"))
    with pytest.raises(PySparkException) as excinfo:
        reader.load()
    message = str(excinfo.value)
    # Spark hands a Python source its option names lower-cased.
    assert "unknown option 'startingpositon'" in message
    assert "did you mean 'startingPosition'" in message


# -- the driver side without Spark ---------------------------------------------------------


def reader_for(url: str, stream: str, **options: str) -> KinesisStreamReader:
    """A driver-side reader that plans with no settle margin and no probe interval: these
    tests call it back to back, right after writing."""
    return KinesisStreamReader(SourceOptions.parse(
        {"streamName": stream, "endpointUrl": url, "region": "us-east-1", "settleTime": "0",
         "minFetchPeriod": "0", "shardFetchInterval": "0", **options}))


@pytest.mark.integration
def test_spark_40_path_continues_from_its_cursor_and_after_a_restart(
        kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-40")
    create_stream(kinesis, stream, 2)
    first = produce(kinesis, stream, "one", plain=60, aggregates=2)
    reader = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                        maxRecordsPerBatch="10")
    start = reader.initialOffset()

    end = reader.latestOffset()  # Spark 4.0/4.1: no start, no limit (reads to the tip)

    assert sorted(read_batch(reader, start, end)) == sorted(first)
    # a restarted query: Spark announces the last offset with partitions(end, end)
    restarted = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON")
    assert restarted.partitions(end, end) == []
    second = produce(kinesis, stream, "two", plain=30, aggregates=1)
    end2 = restarted.latestOffset()
    assert sorted(read_batch(restarted, end, end2)) == sorted(second)
    assert restarted.latestOffset() == end2


@pytest.mark.integration
def test_latest_starts_after_what_is_already_there(kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-latest")
    create_stream(kinesis, stream, 2)
    produce(kinesis, stream, "old", plain=40, aggregates=1)
    reader = reader_for(kinesis_mock.url, stream, startingPosition="LATEST")
    start = reader.initialOffset()
    new = produce(kinesis, stream, "new", plain=30, aggregates=1)

    end = reader.latestOffset(start, None)

    assert sorted(read_batch(reader, start, end)) == sorted(new)


@pytest.mark.integration
@pytest.mark.parametrize("budget", [{}, {"maxFetchRecordsPerShard": "25"}],
                         ids=["ends-by-arrival-time", "ends-after-25-rows"])
def test_a_fan_out_batch_read_again_yields_the_same_rows_and_polling_agrees(
        kinesis_mock: LocalEndpoint, budget: dict[str, str]) -> None:
    """A batch's end is fixed when it is planned, whichever way the executor reads: a
    fan-out task run twice, with records written in between, yields the same rows, and so
    does a polling task over the same end."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-efo-end")
    create_stream(kinesis, stream, 1)
    first = produce(kinesis, stream, "first", plain=40, aggregates=2)
    fan_out = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                         consumerName="rerun", **budget)
    start = fan_out.initialOffset()
    end = fan_out.latestOffset(start, None)

    rows = read_batch(fan_out, start, end)
    produce(kinesis, stream, "later", plain=20)
    again = read_batch(fan_out, start, end)
    polled = read_batch(reader_for(kinesis_mock.url, stream, **budget), start, end)

    assert rows == again == polled
    assert rows == (first[:25] if budget else first)


@pytest.mark.integration
def test_row_limit_can_end_a_batch_inside_a_kpl_aggregate(kinesis_mock: LocalEndpoint) -> None:
    read_max_rows = pytest.importorskip("pyspark.sql.streaming.datasource").ReadMaxRows

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-mid")
    create_stream(kinesis, stream, 1)
    expected = produce(kinesis, stream, "agg", plain=0, aggregates=3, per_aggregate=10)
    reader = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON")
    offset = reader.initialOffset()
    seen: list[bytes] = []
    ends: list[OffsetEntry] = []
    for _ in range(10):
        end = reader.latestOffset(offset, read_max_rows(7))
        if end == offset:
            break
        batch = read_batch(reader, offset, end)
        assert 0 < len(batch) <= 7
        seen.extend(batch)
        ends.extend(decode_offset(end).values())
        offset = end
    assert seen == expected
    # each batch ends where its reader stopped: the next one starts there, mid-aggregate
    starts = [p.start for p in ends if isinstance(p, UptoEnd)]
    assert any(p.kind == "AFTER" and 0 < p.sub_sequence_number < 9 for p in starts), ends


@pytest.mark.integration
def test_byte_and_time_budgets_end_where_the_executor_stopped_and_a_rerun_ends_there_too(
        kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    """``fetchBufferSize`` stops each shard after the record that reaches its share;
    ``maxFetchDuration`` after the page that outlasts it. Where a part stopped is recorded
    under ``metadataPath``, and any later attempt at the batch is held to it: here an
    earlier attempt that stopped after 3 records (as a slower one might have)."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-budget")
    create_stream(kinesis, stream, 1)
    payloads = [f"{n:03d}".encode() + bytes(97) for n in range(50)]  # 100 bytes each
    put_plain(kinesis, stream, payloads)
    ends = tmp_path / "ends"
    sized = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                       fetchBufferSize="1kb", metadataPath=str(ends))
    offset = sized.initialOffset()
    batches: list[list[bytes]] = []
    while (end := sized.latestOffset(offset, None)) != offset:
        batches.append(read_batch(sized, offset, end))
        sized.commit(end)
        offset = end
    assert [row for batch in batches for row in batch] == payloads
    assert {len(batch) for batch in batches[:-1]} == {11}, "1,024 bytes: the 11th record"
    assert len(list(ends.rglob("*.json"))) == 1, "only the committed end's record is kept"

    timed = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                       maxFetchDuration="1ms", maxRecordsPerFetch="10",
                       metadataPath=str(ends))
    start = timed.initialOffset()
    end = timed.latestOffset(start, None)
    assert read_batch(timed, start, end) == payloads[:10], "one page, then out of time"
    assert read_batch(timed, start, end) == payloads[:10], "a re-run: the same rows"

    (key, planned), = decode_offset(end).items()
    assert isinstance(planned, UptoEnd)
    again = reader_for(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                       maxFetchDuration="1ms", maxRecordsPerFetch="10",
                       metadataPath=str(tmp_path / "other"))
    earlier = PositionStore(str(tmp_path / "other"))
    first = kinesis.get_shard_iterator(StreamName=stream, ShardId=key,
                                       ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    third = kinesis.get_records(ShardIterator=first, Limit=3)["Records"][-1]
    earlier.put(key, planned, Position(third["SequenceNumber"]))
    assert read_batch(again, start, end) == payloads[:3]
    following = again.latestOffset(end, None)
    assert read_batch(again, end, following)[:1] == [payloads[3]]


def test_a_shard_behind_empty_pages_moves_on_under_a_tiny_time_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse shard read from an old TRIM_HORIZON: Kinesis answers pages without records
    before the first one. With ``maxFetchDuration`` out after the first of them, the
    executor's part ended where it started: every batch planned the same part again and
    the shard stalled. The part reads on to its first row now; the next batch starts after
    it and reads the rest, every record once. The driver and the executors share one
    stubbed client, and their clocks are a second later at each look."""
    monkeypatch.setattr(time, "sleep", lambda _: None)
    k = skew.KINESIS_MS
    client = boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    monkeypatch.setattr(SourceOptions, "client", lambda *_, **__: client)
    ticks = itertools.count()
    monkeypatch.setattr(source_module, "BudgetedRead",
                        partial(BudgetedRead, clock=lambda: next(ticks)))
    reader = KinesisStreamReader(SourceOptions.parse(
        {"streamName": "s", "region": "us-east-1", "startingPosition": "TRIM_HORIZON",
         "maxFetchDuration": "1ms", "metadataPath": str(tmp_path / "ends")}),
        clock=lambda: k / 1000)
    shard = "shardId-000000000000"
    empty = [skew.answer(k, Records=[], NextShardIterator=f"it-{n}",
                         MillisBehindLatest=3_600_000) for n in range(1, 6)]
    with Stubber(client) as stubber:
        stubber.add_response("list_shards", skew.answer(k, Shards=[{
            "ShardId": shard, "HashKeyRange": {"StartingHashKey": "0",
                                               "EndingHashKey": str(2**128 - 1)},
            "SequenceNumberRange": {"StartingSequenceNumber": "100"}}]))
        for _ in ("the driver's probe", "the executor's read"):
            stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-0"))
            for answer in empty:
                stubber.add_response("get_records", answer)
            stubber.add_response("get_records", skew.answer(
                k, Records=[skew.record(0, k - 60_000), skew.record(1, k - 60_000)],
                NextShardIterator="it-6", MillisBehindLatest=60_000))
        # the next batch's part, AT the record the first one ended after
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-7"))
        stubber.add_response("get_records", skew.answer(
            k, Records=[skew.record(1, k - 60_000), skew.record(2, k - 50_000)],
            NextShardIterator="it-8", MillisBehindLatest=50_000))

        start = reader.initialOffset()
        first = reader.latestOffset(start, None)
        rows = read_batch(reader, start, first)
        reader.commit(first)
        second = reader.latestOffset(first, None)
        rows += read_batch(reader, first, second)
        stubber.assert_no_pending_responses()
    assert rows == [b"r0", b"r1", b"r2"]
    planned = decode_offset(second)[shard]
    assert isinstance(planned, UptoEnd) and planned.start == Position("101")


def test_offsets_round_trip_and_reject_garbage() -> None:
    positions: dict[str, OffsetEntry] = {
        "shardId-2": Position("49590338271490256608559692538361571095921575989136588898", 3),
        "shardId-1": Position.trim_horizon(),
        "shardId-3": Position.at_timestamp(1_700_000_000_123),
        "shardId-4": Position.shard_end(),
        "shardId-5": UptoEnd(Position("4959", 2), 1_700_000_000_123,
                             Budget(rows=50, bytes=None, duration_ms=2000), "a1b2c3"),
    }
    encoded = encode_offset(positions)
    assert list(encoded["shards"]) == sorted(positions)
    assert decode_offset(encoded) == positions
    for bad in ("AFTER/12x/0", "AFTER/1/-1", "AT_TIMESTAMP/", "LATEST", "SHARD_END/1",
                "UPTO/1/0/-/-/a1/TRIM_HORIZON", "UPTO/1/-/-/-/a1/SHARD_END",
                "UPTO/1/-/-/-//TRIM_HORIZON", "UPTO/1/5/-/-/a1"):
        with pytest.raises(ValueError):
            decode_entry(bad)


@pytest.mark.parametrize(("options", "option"), [
    ({}, "streamName"),
    ({"streamName": "s", "startingPosition": "SOMEWHERE"}, "startingPosition"),
    ({"streamName": "s", "startingPosition": "AT_TIMESTAMP"}, "timestamp"),
    ({"streamName": "s", "startingPosition": "AT_TIMESTAMP", "timestamp": "noon"}, "timestamp"),
    ({"streamName": "s", "maxRecordsPerBatch": "0"}, "maxRecordsPerBatch"),
    ({"streamName": "s", "maxRecordsPerFetch": "10001"}, "maxRecordsPerFetch"),
    ({"streamName": "s", "deaggregate": "maybe"}, "deaggregate"),
    ({"streamName": "s", "minFetchPeriod": "soon"}, "minFetchPeriod"),
    ({"streamName": "s", "failOnDataLoss": "yes"}, "failOnDataLoss"),
    ({"streamName": "s", "endpointUrl": "localhost:4566"}, "endpointUrl"),
    ({"streamName": "s", "timestamp": "2024-01-01T00:00:00Z"}, "timestamp"),
    ({"streamName": "a,,b"}, "streamName"),
    ({"streamName": "a,b,a"}, "streamName"),
    ({"streamName": "a", "streamArn": "arn:aws:kinesis:us-east-1:1:stream/a"}, "streamArn"),
    ({"streamName": "s", "kinesis.streamName": "t"}, "kinesis.streamName"),
    ({"streamName": "s", "initialPosition": "somewhere"}, "initialPosition"),
    ({"streamName": "s", "roleArn": "reader"}, "roleArn"),
    ({"streamName": "s", "roleArn": "arn:aws:iam::123456789012:role/r",
      "roleSessionName": "a b"}, "roleSessionName"),
    ({"streamName": "s", "stsEndpoint": "http://127.0.0.1:1"}, "stsEndpoint"),
    ({"streamName": "s", "kinesis.awsSecretKey": "x"}, "kinesis.awsSecretKey"),
    ({"streamName": "s", "startingPosition": "LATEST 2024-01-01T00:00:00Z"},
     "startingPosition"),
    ({"streamName": "s", "fetchBufferSize": "lots"}, "fetchBufferSize"),
    ({"streamName": "s", "maxFetchDuration": "10s"}, "maxFetchDuration"),
    ({"streamName": "s", "kinesis.maxFetchTimePerShardSec": "10"},
     "kinesis.maxFetchTimePerShardSec"),
    ({"streamName": "s", "metadataPath": "hdfs://namenode/ends"}, "metadataPath"),
    ({"streamName": "s", "maxFetchRate": "1.0"}, "maxFetchRate"),
    ({"streamName": "s", "consumerMode": "push"}, "consumerMode"),
    ({"streamName": "s", "consumerMode": "efo"}, "consumerName"),
    ({"streamName": "s", "kinesis.consumerType": "GetRecords", "consumerName": "c"},
     "consumerName"),
    ({"streamName": "s", "consumerName": "a b"}, "consumerName"),
    ({"streamName": "s", "consumerName": "c", "consumerArn": CONSUMER_ARN}, "consumerArn"),
    ({"streamName": "s", "consumerArn": "arn:aws:kinesis:us-east-1:1:stream/s"},
     "consumerArn"),
    ({"streamName": "s,t", "consumerArn": CONSUMER_ARN}, "consumerArn"),
    ({"streamName": "s", "requireConsumerDeregistration": "true"},
     "requireConsumerDeregistration"),
    ({"streamName": "s", "getRecordsBackoffBase": "2s", "getRecordsBackoffCap": "1s"},
     "getRecordsBackoffCap"),
    ({"streamName": "s", "getRecordsBackoffBase": "soon"}, "getRecordsBackoffBase"),
])
def test_bad_options_name_the_option(options: dict[str, str], option: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        SourceOptions.parse(options)
    assert excinfo.value.option == option


def test_an_unknown_option_is_an_error_naming_it_and_the_closest_known_name() -> None:
    with pytest.raises(ConfigError) as excinfo:
        SourceOptions.parse({"streamName": "s", "startingPositon": "TRIM_HORIZON"})
    assert excinfo.value.option == "startingPositon"
    assert "did you mean 'startingPosition'" in str(excinfo.value)
    with pytest.raises(ConfigError) as excinfo:
        SourceOptions.parse({"streamName": "s", "kinesis.startingPositon": "LATEST"})
    assert "did you mean 'kinesis.startingPosition'" in str(excinfo.value)


@pytest.mark.parametrize("options", [
    # Databricks
    {"streamName": "s", "initialPosition": "trim_horizon", "endpoint": "http://127.0.0.1:1",
     "region": "eu-west-1", "maxRecordsPerFetch": "300", "minFetchPeriod": "400ms",
     "shardFetchInterval": "5s"},
    # awslabs spark-sql-kinesis-connector
    {"kinesis.streamName": "s", "kinesis.startingPosition": "EARLIEST",
     "kinesis.endpointUrl": "http://127.0.0.1:1", "kinesis.region": "eu-west-1",
     "kinesis.getRecords.numberOfRecordsPerFetch": "300",
     "kinesis.describeShardInterval": "5000", "kinesis.failOnDataLoss": "false"},
    # qubole kinesis-sql
    {"streamName": "s", "startingPosition": "trim_horizon", "endpointUrl": "http://127.0.0.1:1",
     "region": "eu-west-1", "kinesis.executor.maxRecordPerRead": "300",
     "kinesis.client.describeShardInterval": "5s"},
])
def test_other_sources_option_names_are_aliases(options: dict[str, str]) -> None:
    parsed = SourceOptions.parse(options)
    assert parsed.stream.stream_name == "s"
    assert parsed.starting_position == "TRIM_HORIZON"
    assert parsed.endpoint_url == "http://127.0.0.1:1"
    assert parsed.region == "eu-west-1"
    assert parsed.max_records_per_fetch == 300
    assert parsed.shard_fetch_interval_ms == 5000


@pytest.mark.parametrize(("options", "name", "arn"), [
    ({"consumerName": "orders-spark"}, "orders-spark", None),
    ({"consumerMode": "efo", "consumerName": "orders-spark"}, "orders-spark", None),
    ({"kinesis.consumerType": "SubscribeToShard", "kinesis.consumerName": "orders-spark"},
     "orders-spark", None),
    ({"consumerArn": CONSUMER_ARN}, None, CONSUMER_ARN),
], ids=["name", "databricks", "awslabs", "arn"])
def test_fan_out_is_chosen_by_a_consumer_under_any_sources_names(
        options: dict[str, str], name: str | None, arn: str | None) -> None:
    parsed = SourceOptions.parse({"streamName": "s", **options})
    assert parsed.fan_out
    assert (parsed.consumer_name, parsed.consumer_arn) == (name, arn)
    polling = SourceOptions.parse({"streamName": "s", "kinesis.consumerType": "GetRecords"})
    assert not polling.fan_out


def test_options_are_case_insensitive_and_typed() -> None:
    parsed = SourceOptions.parse({"STREAMNAME": "s", "startingposition": "earliest",
                                  "MaxRecordsPerBatch": "500", "deAggregate": "false"})
    assert parsed.stream.stream_name == "s"
    assert parsed.starting_position == "TRIM_HORIZON"
    assert parsed.max_records_per_batch == 500
    assert parsed.deaggregate is False
    assert parsed.fail_on_data_loss is True
    assert (parsed.min_fetch_period_ms, parsed.settle_ms) == (1000, 1000)
    timed = SourceOptions.parse({"streamName": "s", "minFetchPeriod": "250ms",
                                 "settleTime": "2s", "shardFetchInterval": "1m"})
    assert (timed.min_fetch_period_ms, timed.settle_ms, timed.shard_fetch_interval_ms) == (
        250, 2000, 60_000)
    at = SourceOptions.parse({"streamArn": "arn:aws:kinesis:us-east-1:1:stream/x",
                              "startingPosition": "AT_TIMESTAMP",
                              "timestamp": "2024-01-02T03:04:05Z"})
    assert at.starting_timestamp_ms == 1_704_164_645_000
    awslabs = SourceOptions.parse({"kinesis.streamName": "s",
                                   "kinesis.startingPosition": "AT_TIMESTAMP 2024-01-02T03:04:05Z"})
    assert awslabs.starting_timestamp_ms == 1_704_164_645_000
    assert at.stream.label == "x"


def test_a_tasks_reads_retry_with_the_workers_backoff_capped_in_attempts() -> None:
    """One read policy (kclpy.retry.read_policy) for worker and executors: the defaults are
    the worker's, the options move both bounds, and a task gives up where Spark retries."""
    default = SourceOptions.parse({"streamName": "s"}).read_retries
    worker = KCLConfig(stream_name="s", application_name="a")
    assert replace(default, max_attempts=None) == worker.read_retries
    assert default.max_attempts == 9
    tuned = SourceOptions.parse({"streamName": "s", "getRecordsBackoffBase": "250ms",
                                 "getRecordsBackoffCap": "2s"}).read_retries
    tuned_worker = KCLConfig(stream_name="s", application_name="a",
                             get_records_backoff_base_ms=250, get_records_backoff_cap_ms=2000)
    assert replace(tuned, max_attempts=None) == tuned_worker.read_retries
    assert (tuned.base_s, tuned.cap_s) == (0.25, 2.0)


@pytest.mark.parametrize(("options", "duration_ms", "buffer_bytes"), [
    ({"maxFetchDuration": "2m", "fetchBufferSize": "10mb"}, 120_000, 10 * 1024**2),
    ({"maxFetchDuration": "1500", "fetchBufferSize": "2000"}, 1500, 2000),
    ({"kinesis.maxFetchTimePerShardSec": "30"}, 30_000, None),  # awslabs counts seconds
    ({"kinesis.executor.maxFetchTimeInMs": "1500"}, 1500, None),  # qubole, milliseconds
    ({"fetchBufferSize": "1.5GB"}, None, round(1.5 * 1024**3)),
])
def test_byte_and_time_budgets_parse_with_their_units(
        options: dict[str, str], duration_ms: int | None, buffer_bytes: int | None) -> None:
    parsed = SourceOptions.parse({"streamName": "s", "kinesis.metadataPath": "/tmp/ends",
                                  **options})
    assert (parsed.max_fetch_duration_ms, parsed.fetch_buffer_bytes) == (
        duration_ms, buffer_bytes)
    assert parsed.metadata_path == "/tmp/ends"
    assert parsed.budgeted


def test_reader_pickles_without_clients() -> None:
    import pickle

    reader = reader_for("http://127.0.0.1:1", "s")
    reader._client = object()  # type: ignore[assignment]
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.options == reader.options
    assert clone._client is None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("budget", "held_batch"), [
    ({}, 0),
    ({"maxRecordsPerBatch": "200", "maxFetchDuration": "300ms", "maxRecordsPerFetch": "40",
      "metadataPath": "ends"}, 1),
], ids=["ends-by-arrival-time", "ends-where-the-executors-stopped"])
def test_a_batch_rerun_after_kill_9_of_the_driver_yields_the_same_rows(
        kinesis_mock: LocalEndpoint, tmp_path: Path, budget: dict[str, str],
        held_batch: int) -> None:
    """The driver is killed after a batch was planned (its offsets are in the checkpoint)
    and before it was committed; records written meanwhile must not change the re-run.

    With budgets the batch ends where each executor stopped (after 100 rows, or 300 ms of
    reading pages of 40, whichever came first): a time budget stops elsewhere on every
    attempt, so the re-run must read to the end the killed run's executors recorded.
    """
    import signal
    import subprocess
    import sys

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-kill")
    create_stream(kinesis, stream, 2)
    first = produce(kinesis, stream, "first", plain=300, aggregates=3)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    out.mkdir()
    command = [sys.executable, "-m", "tests.support.spark_query", "--endpoint", kinesis_mock.url,
               "--stream", stream, "--checkpoint", str(checkpoint), "--out", str(out)]
    for name, value in budget.items():
        value = str(tmp_path / value) if name == "metadataPath" else value
        command += ["--option", f"{name}={value}"]
    env = spark_env()
    log = tmp_path / "held.log"
    with log.open("wb") as sink:
        held = subprocess.Popen([*command, "--hold-batch", str(held_batch)], env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(out.glob(f"batch-{held_batch}-*.json"))
                 or held.poll() is not None, 300, "the held batch reached foreachBatch")
        assert held.poll() is None, "the held driver exited by itself: " + log.read_text(
            errors="replace")[-3000:]
        assert (checkpoint / "offsets" / str(held_batch)).exists()
        assert not (checkpoint / "commits" / str(held_batch)).exists()
        held.send_signal(signal.SIGKILL)
    finally:
        if held.poll() is None:
            held.kill()
        held.wait()
    later = produce(kinesis, stream, "later", plain=100)

    rerun = subprocess.run(command, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=600, check=False)

    assert rerun.returncode == 0, rerun.stderr.decode()[-3000:]
    (killed_file,) = out.glob(f"batch-{held_batch}-{held.pid}.json")
    (rerun_file,) = [p for p in out.glob(f"batch-{held_batch}-*.json") if p != killed_file]
    assert json.loads(killed_file.read_text()) == json.loads(rerun_file.read_text())
    rows: dict[int, list[bytes]] = collections.defaultdict(list)
    for path in out.glob("batch-*.json"):
        batch_id = int(path.name.split("-")[1])
        if path == killed_file:
            continue
        rows[batch_id].extend(bytes.fromhex(r[3]) for r in json.loads(path.read_text()))
    delivered = [payload for batch in rows.values() for payload in batch]
    assert sorted(delivered) == sorted(first + later)
