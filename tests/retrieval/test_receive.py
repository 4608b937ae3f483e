"""GetRecords bodies received into reused buffers (kclpy.retrieval.receive)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ConnectionClosedError
from moto import mock_aws

from bench import replay
from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint
from kclpy.records import Record
from kclpy.retrieval import receive
from kclpy.retrieval.page import Page
from kclpy.retrieval.parse import get_records
from kclpy.retrieval.receive import MIN_POOLED_BYTES, BufferPool
from kclpy.retry import CONNECTION, classify
from tests.support.faultproxy import FaultProxy
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

NO_RETRIES = Config(retries={"mode": "standard", "total_max_attempts": 1})


# -- the pool ----------------------------------------------------------------------------

def test_a_returned_buffer_is_taken_again() -> None:
    pool = BufferPool()
    first = pool.take(300_000)
    assert len(first) >= 300_000
    pool.give(first, 300_000)
    assert pool.take(290_000) is first
    assert pool.idle() == []


def test_a_buffer_too_small_for_the_body_is_replaced() -> None:
    pool = BufferPool()
    small = pool.take(300_000)
    pool.give(small, 300_000)
    larger = pool.take(len(small) + 1)
    assert larger is not small
    assert len(larger) > len(small)


def test_a_buffer_far_larger_than_its_last_body_is_not_kept() -> None:
    """Once a worker caught up, its pages are small: buffers sized for full pages go."""
    pool = BufferPool()
    big = pool.take(16 * MIN_POOLED_BYTES)
    pool.give(big, MIN_POOLED_BYTES)
    assert pool.idle() == []
    fitting = pool.take(4 * MIN_POOLED_BYTES)
    pool.give(fitting, 3 * MIN_POOLED_BYTES)
    assert [b is fitting for b in pool.idle()] == [True]


def test_idle_buffers_are_bounded() -> None:
    pool = BufferPool(max_idle=2)
    buffers = [pool.take(MIN_POOLED_BYTES) for _ in range(3)]
    for buffer in buffers:
        pool.give(buffer, MIN_POOLED_BYTES)
    assert [id(b) for b in pool.idle()] == [id(buffers[0]), id(buffers[1])]


# -- GetRecords through the pool, over HTTP ----------------------------------------------

@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> BufferPool:
    """A pool of the test's own, in place of the process's."""
    fresh = BufferPool()
    monkeypatch.setattr(receive, "POOL", fresh)
    return fresh


@pytest.fixture(scope="module")
def replay_url() -> Iterator[str]:
    streams = [replay.build_stream(0, replay.StreamSpec("large", 1, 1_200, 1_000)),
               replay.build_stream(1, replay.StreamSpec("small", 1, 50, 20))]
    with replay.ReplayServer(streams) as server:
        yield server.url


def client_for(url: str) -> Any:
    return boto3.client("kinesis", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=NO_RETRIES)


def trim_horizon(client: Any, stream: str) -> str:
    return str(client.get_shard_iterator(StreamName=stream, ShardId="shardId-000000000000",
                                         ShardIteratorType="TRIM_HORIZON")["ShardIterator"])


def assert_same_as_botocore(page: Page[Sequence[Record]], expected: dict[str, Any]) -> None:
    assert len(page.records) == len(expected["Records"])
    for ours, theirs in zip(page.records, expected["Records"], strict=True):
        assert (ours.sequence_number, ours.partition_key, ours.binary_data) == (
            theirs["SequenceNumber"], theirs["PartitionKey"], theirs["Data"])
    assert page.millis_behind_latest == expected["MillisBehindLatest"]


@pytest.mark.integration
def test_large_pages_are_received_into_one_reused_buffer(replay_url: str,
                                                         pool: BufferPool) -> None:
    client, plain = client_for(replay_url), client_for(replay_url)
    first = get_records(client, trim_horizon(client, "large"), 400)
    assert first.size_bytes >= MIN_POOLED_BYTES
    [buffer] = pool.idle()
    assert first.next_shard_iterator is not None
    second = get_records(client, first.next_shard_iterator, 400)
    assert [b is buffer for b in pool.idle()] == [True]

    expected = plain.get_records(ShardIterator=trim_horizon(plain, "large"), Limit=400)
    assert_same_as_botocore(first, expected)
    assert_same_as_botocore(
        second, plain.get_records(ShardIterator=expected["NextShardIterator"], Limit=400))


@pytest.mark.integration
def test_small_pages_are_read_the_ordinary_way(replay_url: str, pool: BufferPool) -> None:
    client, plain = client_for(replay_url), client_for(replay_url)
    page = get_records(client, trim_horizon(client, "small"), 100)
    assert 0 < page.size_bytes < MIN_POOLED_BYTES
    assert pool.idle() == []
    assert_same_as_botocore(
        page, plain.get_records(ShardIterator=trim_horizon(plain, "small"), Limit=100))


@pytest.mark.integration
def test_a_body_cut_short_is_a_connection_error_and_costs_no_records(
        replay_url: str, pool: BufferPool) -> None:
    with FaultProxy(replay_url) as proxy:
        client = client_for(proxy.url)
        iterator = trim_horizon(client, "large")
        proxy.once("GetRecords", "cut_body")
        with pytest.raises(ConnectionClosedError) as raised:
            get_records(client, iterator, 400)
        assert classify(raised.value) == CONNECTION
        assert proxy.faults("cut_body") == 1
        # The half-filled buffer went back; the same iterator reads the whole page into it.
        [buffer] = pool.idle()
        page = get_records(client, iterator, 400)
        assert [b is buffer for b in pool.idle()] == [True]
    plain = client_for(replay_url)
    assert_same_as_botocore(
        page, plain.get_records(ShardIterator=trim_horizon(plain, "large"), Limit=400))


def test_moto_in_process_still_answers_instead_of_the_network(pool: BufferPool) -> None:
    """moto's mock answers from a before-send handler; the session (and the pool) behind it
    must never be reached, or the request would go to the real endpoint."""
    with mock_aws():
        client = boto3.client("kinesis", region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_stream(StreamName="mocked", ShardCount=1)
        payloads = [bytes([n]) * 3_000 for n in range(100)]  # a 400 KB page
        for data in payloads:
            client.put_record(StreamName="mocked", Data=data, PartitionKey="pk")
        page = get_records(client, trim_horizon(client, "mocked"), 1_000)
    assert isinstance(cast(Any, client)._endpoint.http_session, receive.PooledSession)
    assert [r.binary_data for r in page.records] == payloads
    assert pool.idle() == []


@pytest.mark.integration
@pytest.mark.parametrize("emulator", ["kinesis_mock", "moto_server"])
def test_a_worker_loses_nothing_to_a_body_cut_short(
        emulator: str, moto_server: LocalEndpoint, pool: BufferPool,
        request: pytest.FixtureRequest) -> None:
    """On kinesis-mock and on moto's server: the fetcher retries a page whose body broke
    off, counts it as a connection error, and every record arrives once, in order."""
    kinesis_endpoint: LocalEndpoint = request.getfixturevalue(emulator)
    kinesis = kinesis_client(kinesis_endpoint.url)
    stream = unique_name("receive")
    create_stream(kinesis, stream, 1)
    payloads = [f"{n:04d}".encode() * 2_500 for n in range(40)]  # 400 KB in all
    put_plain(kinesis, stream, payloads)
    ledger = Ledger()
    with FaultProxy(kinesis_endpoint.url) as proxy:
        proxy.once("GetRecords", "cut_body")
        config = KCLConfig(
            application_name=unique_name("receive-app"), stream_name=stream,
            region="us-east-1", kinesis_endpoint=proxy.url,
            dynamodb_endpoint=moto_server.url, initial_position="TRIM_HORIZON",
            idle_time_between_reads_ms=100)
        worker = Worker(config, lambda: RecordingProcessor(ledger))
        with running(worker):
            wait_for(lambda: len(ledger.records) >= len(payloads), 60, "every record")
            errors = worker.metrics.registry.get_sample_value(
                "kclpy_get_records_errors_total",
                {"shard_id": "shardId-000000000000", "kind": CONNECTION})
        assert proxy.faults("cut_body") == 1
    assert ledger.payloads() == payloads
    assert errors == 1
    assert pool.idle(), "the whole page was received into a pooled buffer"
