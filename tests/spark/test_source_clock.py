"""The Kinesis source with a driver clock ahead of Kinesis' by more than ``settleTime``.

A batch ends at an arrival time (``AT_TIMESTAMP``) planned a settle margin before the
driver's 'now'. Planned on a local clock ahead of Kinesis', that end was in Kinesis' future;
the executor stopped at the tip, and records arriving between the tip and the end belonged
to no batch (the next one starts at the end), silently. The driver now plans on Kinesis'
time as its answers show it, and an executor ends a read at the tip only once Kinesis'
time has passed the batch's end (:mod:`kclpy.retrieval.clock`). Deterministic with
botocore's Stubber (answers carrying Kinesis' ``Date``), and over real HTTP (kinesis-mock)
with the driver's clock skewed in-process; and a real Spark query whose Python processes'
wall clocks run ahead of kinesis-mock's."""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kclpy.local import LocalEndpoint
from kclpy.position import AT_TIMESTAMP, Position
from kclpy.spark.offsets import Budget, UptoEnd, decode_offset
from kclpy.spark.reading import (
    BudgetedRead,
    ShardInfo,
    ShardReader,
    StreamRef,
    read_range,
)
from kclpy.spark.source import KinesisStreamReader, SourceOptions
from tests.support import skew
from tests.support.chaos import SKEW_ENV, SKEWED_CLOCK
from tests.support.spark_query import spark_env
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for

SHARD = "shardId-000000000000"


def stubbed_client() -> Any:
    return boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="x",
                        aws_secret_access_key="x")


def test_an_executor_reads_to_a_batch_end_in_kinesis_future_without_skipping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch ends 4 s into Kinesis' future (a driver 5 s ahead, settleTime 1 s): the
    executor's read reaches the tip with Kinesis at the script's start, a record arrives a
    second later, and the read ends only once Kinesis' time is past the end - with it."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    end = skew.KINESIS_MS + skew.SKEW_MS - 1000
    client = stubbed_client()
    with Stubber(client) as stubber:
        skew.script_late_record(stubber)
        reader = ShardReader(client, StreamRef("s"), ShardInfo(SHARD, (), 0, 2**128 - 1, False),
                             Position.trim_horizon(), until_ms=end)
        rows = [r.binary_data for records in read_range(reader, Position.at_timestamp(end))
                for r in records]
    assert rows == [b"r0", b"r1"], "the record that arrived after the first tip is read"
    stubber.assert_no_pending_responses()
    assert waits and all(w > 0 for w in waits), "the tip is looked at again after a wait"


def test_a_budgeted_read_to_an_end_in_kinesis_future_does_not_stop_at_the_first_tip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a row budget (an ``UPTO`` end): the position it records for the next
    batch is the end only once the records before it were all read."""
    monkeypatch.setattr(time, "sleep", lambda _: None)
    end = skew.KINESIS_MS + skew.SKEW_MS - 1000
    client = stubbed_client()
    with Stubber(client) as stubber:
        skew.script_late_record(stubber)
        reader = ShardReader(client, StreamRef("s"), ShardInfo(SHARD, (), 0, 2**128 - 1, False),
                             Position.trim_horizon(), until_ms=end)
        reading = BudgetedRead(reader, UptoEnd(Position.trim_horizon(), end, Budget(rows=10),
                                               "p1"))
        rows = [r.binary_data for records in reading for r in records]
    assert rows == [b"r0", b"r1"]
    assert reading.reached == Position.at_timestamp(end)


def test_the_driver_plans_a_batch_end_on_kinesis_time_not_its_own_clock_ahead(
        caplog: pytest.LogCaptureFixture) -> None:
    """The driver's clock is 5 s ahead of Kinesis', settleTime 1 s: the batch used to end
    at the driver's time less 1 s, 4 s into Kinesis' future. It ends on Kinesis' time, as
    its answers show it (Date, to the second), less the settle margin; the skew is
    logged."""
    k = skew.KINESIS_MS
    reader = KinesisStreamReader(
        SourceOptions.parse({"streamName": "s", "region": "us-east-1", "settleTime": "1s",
                             "startingPosition": "TRIM_HORIZON"}),
        clock=lambda: (k + skew.SKEW_MS) / 1000)
    client = stubbed_client()
    reader._client = client
    with Stubber(client) as stubber:
        stubber.add_response("list_shards", skew.answer(k, Shards=[{
            "ShardId": SHARD, "HashKeyRange": {"StartingHashKey": "0",
                                               "EndingHashKey": str(2**128 - 1)},
            "SequenceNumberRange": {"StartingSequenceNumber": "1"}}]))
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-0"))
        stubber.add_response("get_records", skew.answer(
            k, Records=[skew.record(0, k - 3000)], NextShardIterator="it-1",
            MillisBehindLatest=2000))
        start = reader.initialOffset()
        with caplog.at_level(logging.WARNING, logger="kclpy"):
            end = decode_offset(reader.latestOffset(start, None))[SHARD]
        stubber.assert_no_pending_responses()
    assert isinstance(end, Position) and end.kind == AT_TIMESTAMP
    assert end.timestamp_ms is not None
    assert end.timestamp_ms - k <= 100, (
        f"the batch ends {end.timestamp_ms - k} ms into Kinesis' future")
    assert "ahead of Kinesis'" in caplog.text


@pytest.mark.integration
def test_a_driver_clock_ahead_of_kinesis_skips_no_record_over_real_http(
        kinesis_mock: LocalEndpoint) -> None:
    """Batches planned and read back to back by a driver whose clock is 5 s ahead of
    kinesis-mock's, settleTime 1 s; records written after the first batch was read arrive
    before that batch's end as the driver's clock put it. Every record is in exactly one
    batch."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-skew")
    create_stream(kinesis, stream, 1)
    reader = KinesisStreamReader(
        SourceOptions.parse({"streamName": stream, "endpointUrl": kinesis_mock.url,
                             "region": "us-east-1", "settleTime": "1s", "minFetchPeriod": "0",
                             "shardFetchInterval": "0", "startingPosition": "TRIM_HORIZON"}),
        clock=lambda: time.time() + skew.SKEW_MS / 1000)
    first = [f"a-{n}".encode() for n in range(10)]
    second = [f"b-{n}".encode() for n in range(10)]
    put_plain(kinesis, stream, first)
    rows: list[bytes] = []
    offset = reader.initialOffset()

    def batch() -> None:
        nonlocal offset
        end = reader.latestOffset(offset, None)
        for partition in reader.partitions(offset, end):
            for records in reader.read(partition):
                rows.extend(records.column("data").to_pylist())
        offset = end

    batch()
    put_plain(kinesis, stream, second)

    def read_everything() -> bool:
        batch()
        return set(first + second) <= set(rows)

    wait_for(read_everything, 30, "every record read", interval=0.2)
    assert sorted(rows) == sorted(first + second), "every record in exactly one batch"


def delivered(out: Path) -> collections.Counter[bytes]:
    """Every row the query's ``foreachBatch`` wrote, counted (each batch file is renamed
    into place whole)."""
    return collections.Counter(bytes.fromhex(row[3]) for path in out.glob("batch-*.json")
                               for row in json.loads(path.read_text()))


@pytest.mark.integration
@pytest.mark.slow
def test_a_spark_query_whose_python_clocks_are_ahead_of_kinesis_skips_no_record(
        kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    """A real query (its own SparkSession in a driver process, micro-batches every 200 ms
    into ``foreachBatch``) whose Python processes' wall clocks are 5 s ahead of
    kinesis-mock's, settleTime 1 s. The skew (``tests/support/skewed_clock``) is in the
    environment the JVM passes on, so the Python workers Spark starts to plan batches
    (``latestOffset``) and to read them run ahead too; the JVM's own clock, which only
    paces triggers, is not skewed. A batch planned on the skewed clock ends 4 s in Kinesis'
    future, and records arriving after its read reached the tip but before that end
    belonged to no batch (and kinesis-mock refuses the next batch's start, an
    ``AT_TIMESTAMP`` in its future: the query fails). Records are written before the query
    starts and all the while its next four batches run: every one is in exactly one row."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-skewq")
    create_stream(kinesis, stream, 2)
    out, log, checkpoint = tmp_path / "out", tmp_path / "driver.log", tmp_path / "checkpoint"
    out.mkdir()
    env = spark_env()
    env[SKEW_ENV] = str(skew.SKEW_MS / 1000)
    env["PYTHONPATH"] = os.pathsep.join([str(SKEWED_CLOCK), env["PYTHONPATH"]])
    command = [sys.executable, "-m", "tests.support.spark_query", "--endpoint", kinesis_mock.url,
               "--stream", stream, "--checkpoint", str(checkpoint), "--out", str(out),
               "--processing-time", "200 milliseconds", "--option", "settleTime=1s"]
    written = [f"before-{n}".encode() for n in range(100)]
    put_plain(kinesis, stream, written)
    stop = threading.Event()

    def produce() -> None:
        """A few records every 100 ms: some arrive in every window between a batch's read
        reaching the tip and the batch's end."""
        wave = 0
        while not stop.wait(0.1):
            payloads = [f"while-{wave}-{n}".encode() for n in range(4)]
            put_plain(kinesis, stream, payloads)
            written.extend(payloads)
            wave += 1

    with log.open("wb") as sink:
        driver = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    producer = threading.Thread(target=produce, name="producer", daemon=True)
    try:
        wait_for(lambda: (checkpoint / "commits" / "0").exists() or driver.poll() is not None,
                 240, "the first batch committed")
        assert driver.poll() is None, log.read_text(errors="replace")[-3000:]
        producer.start()
        wait_for(lambda: (checkpoint / "commits" / "4").exists() or driver.poll() is not None,
                 120, "four more batches committed while records were written")
        stop.set()
        producer.join(30)
        assert driver.poll() is None, log.read_text(errors="replace")[-3000:]
        wait_for(lambda: set(written) <= set(delivered(out)), 60, "every record delivered",
                 seen=lambda: (len(set(written) - set(delivered(out))), len(written)))
    finally:
        stop.set()
        driver.terminate()
        driver.wait(60)
    rows = delivered(out)
    assert rows == collections.Counter(written), (
        f"repeated: {sorted(r for r, n in rows.items() if n > 1)[:10]}")
    text = log.read_text(errors="replace")
    assert text.count("wall clock is skewed by +5.0 s") >= 2, "no Python worker was skewed"
    assert "ahead of Kinesis'" in text, "the planning worker did not see the skew"
