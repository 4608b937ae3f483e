"""aws-kinesis-agg's ``RecordAggregator`` across shards, over real HTTP (kinesis-mock, the
local DynamoDB): the aggregator puts user records of any shard in one aggregate, under the
first one's key, as its README shows. Every user record must reach the processor - through a
worker, lag recovery's reader (the same fetcher) and the Spark source's reader alike - unless
the Java KCL's filter is asked for, and then what it drops is logged at WARNING.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator

from kclpy import Worker
from kclpy.local import LocalEndpoint
from kclpy.metrics import RECORDS_FILTERED, Metrics
from kclpy.position import Position
from kclpy.spark.reading import ShardReader, StreamRef, list_shards
from tests.support.e2e import worker_config
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, unique_name
from tests.support.tally import Tally
from tests.support.waiting import wait_for
from tests.support.workers import running

pytestmark = pytest.mark.integration

AGGREGATES = 10
PER_AGGREGATE = 20


def produce_across_shards(kinesis: Any, stream: str) -> list[bytes]:
    """Aggregates of 20 user records with 20 different partition keys each, put with
    ``get_contents()`` as aws-kinesis-agg's README does; the payloads, in order."""
    payloads: list[bytes] = []
    for number in range(AGGREGATES):
        aggregator = RecordAggregator()
        for index in range(PER_AGGREGATE):
            payload = f"agg-{number}-{index}".encode()
            assert aggregator.add_user_record(f"key-{number}-{index}", payload) is None
            payloads.append(payload)
        partition_key, explicit_hash_key, data = aggregator.clear_and_get().get_contents()
        entry: dict[str, Any] = {"StreamName": stream, "Data": data,
                                 "PartitionKey": partition_key}
        if explicit_hash_key:
            entry["ExplicitHashKey"] = explicit_hash_key
        kinesis.put_record(**entry)
    return payloads


@pytest.fixture(scope="module")
def aggregated_stream(kinesis_mock: LocalEndpoint) -> tuple[str, list[bytes]]:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("agg")
    create_stream(kinesis, stream, 2)
    return stream, produce_across_shards(kinesis, stream)


def test_the_worker_delivers_every_user_record_by_default(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        aggregated_stream: tuple[str, list[bytes]]) -> None:
    stream, payloads = aggregated_stream
    ledger = Ledger()
    metrics = Metrics()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    with running(Worker(config, lambda: RecordingProcessor(ledger), metrics=metrics)):
        wait_for(lambda: len(ledger.payloads()) >= len(payloads), 90, "every user record")
        # read while the shard is held: its series leave the registry with it
        filtered = metrics.registry.get_sample_value("kclpy_records_filtered_total",
                                                     {"shard_id": "shardId-000000000000"})
    assert sorted(ledger.payloads()) == sorted(payloads), "each user record exactly once"
    assert filtered == 0


def test_with_the_java_filter_what_is_dropped_is_logged_with_shard_and_count(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        aggregated_stream: tuple[str, list[bytes]], caplog: pytest.LogCaptureFixture) -> None:
    stream, payloads = aggregated_stream
    ledger = Ledger()
    # the worker stops once caught up, and its shards' series leave the registry with them
    tally = Tally()
    metrics = Metrics(backends=[tally])
    config = worker_config(kinesis_mock.url, moto_server.url, stream, kpl_hash_range_filter=True,
                        stop_when_caught_up=True)
    shards = [s.shard_id for s in list_shards(kinesis_client(kinesis_mock.url),
                                              StreamRef(stream))]

    def filtered() -> float:
        return sum(tally.count(RECORDS_FILTERED, shard) for shard in shards)

    with caplog.at_level(logging.WARNING, logger="kclpy.retrieval.pipeline"), \
            running(Worker(config, lambda: RecordingProcessor(ledger), metrics=metrics)):
        wait_for(lambda: len(ledger.payloads()) + filtered() >= len(payloads), 90,
                 "every user record delivered or filtered")
    assert filtered() > 0, "aggregates spanning both shards are dropped by the Java rule"
    assert len(ledger.payloads()) + filtered() == len(payloads)
    logged = sum(int(r.getMessage().split(": ")[1].split(" ")[0]) for r in caplog.records
                 if r.levelno == logging.WARNING and "filtered out" in r.getMessage())
    assert logged == filtered(), "every filtered record is logged, with its shard"


def test_the_spark_source_reader_delivers_every_user_record(
        kinesis_mock: LocalEndpoint, aggregated_stream: tuple[str, list[bytes]]) -> None:
    stream, payloads = aggregated_stream
    kinesis = kinesis_client(kinesis_mock.url)
    ref = StreamRef(stream)
    seen: list[bytes] = []
    for shard in list_shards(kinesis, ref):
        reader = ShardReader(kinesis, ref, shard, Position.trim_horizon())
        while True:
            page = reader.next_page()
            seen.extend(record.binary_data for record in page.records)
            if page.done:
                break
    assert sorted(seen) == sorted(payloads)
