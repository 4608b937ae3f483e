"""Helpers that set up and feed streams and tables on a local endpoint over real HTTP."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import boto3
from aws_kinesis_agg.aggregator import RecordAggregator
from botocore.config import Config

# Re-exported for the test modules that still import it from here; new code imports it from
# tests.support.waiting.
from tests.support.waiting import wait_for as wait_for

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_kinesis.type_defs import PutRecordsRequestEntryTypeDef

REGION = "us-east-1"
# Emulators accept any credentials; explicit dummies keep real ones out of every test request.
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"

# A few quick retries absorb an emulator hiccup without hiding a hang: a test that waits on
# a dead endpoint fails within seconds instead of sitting in botocore's default backoff.
TEST_CONFIG = Config(
    connect_timeout=2,
    read_timeout=30,
    retries={"total_max_attempts": 3, "mode": "standard"},
    max_pool_connections=32,
)

_PUT_RECORDS_MAX_ENTRIES = 500
_PUT_RECORDS_MAX_BYTES = 5 * 1024 * 1024

_T = TypeVar("_T")


def session() -> boto3.session.Session:
    """A boto3 session with the dummy credentials and test region."""
    return boto3.session.Session(
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
        region_name=REGION,
    )


def kinesis_client(url: str, config: Config | None = None) -> KinesisClient:
    """A Kinesis client for ``url``; ``config`` is merged over the test defaults."""
    merged = TEST_CONFIG.merge(config) if config is not None else TEST_CONFIG
    return session().client("kinesis", endpoint_url=url, config=merged)


def dynamodb_client(url: str, config: Config | None = None) -> DynamoDBClient:
    """A DynamoDB client for ``url``; ``config`` is merged over the test defaults."""
    merged = TEST_CONFIG.merge(config) if config is not None else TEST_CONFIG
    return session().client("dynamodb", endpoint_url=url, config=merged)


def unique_name(prefix: str) -> str:
    """A stream or table name no other test (or earlier run on a shared endpoint) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def create_stream(client: KinesisClient, name: str, shard_count: int) -> None:
    """Create a provisioned stream and return once it is ACTIVE."""
    client.create_stream(StreamName=name, ShardCount=shard_count)
    wait_for_stream_active(client, name)


def wait_for_stream_active(client: KinesisClient, name: str, timeout: float = 30.0) -> None:
    """Wait out CREATING/UPDATING; boto3's waiter polls every 10 s, far too slow for tests."""

    def active() -> bool:
        summary = client.describe_stream_summary(StreamName=name)["StreamDescriptionSummary"]
        return summary["StreamStatus"] == "ACTIVE"

    wait_for(active, timeout=timeout, message=f"stream {name} to become ACTIVE")


def put_plain(
    client: KinesisClient,
    stream: str,
    payloads: Sequence[bytes],
    partition_keys: Sequence[str] | None = None,
) -> list[tuple[str, str]]:
    """Write one record per payload, in order; returns ``(shard_id, sequence_number)`` each.

    Partition keys default to the payload's index, which spreads records over all shards.
    """
    if partition_keys is None:
        partition_keys = [str(index) for index in range(len(payloads))]
    if len(partition_keys) != len(payloads):
        raise ValueError("need exactly one partition key per payload")
    return _put_records(client, stream, list(zip(payloads, partition_keys, strict=True)))


def put_aggregated(
    client: KinesisClient,
    stream: str,
    payloads: Sequence[bytes],
    per_aggregate: int,
    partition_key: str = "aggregated",
) -> list[tuple[str, str, int]]:
    """Write ``payloads`` as KPL aggregated records of ``per_aggregate`` user records each.

    Every user record carries ``partition_key``, so the whole batch lands on one shard in
    order. Returns ``(shard_id, sequence_number, user_record_count)`` per aggregate.
    """
    if per_aggregate < 1:
        raise ValueError("per_aggregate must be at least 1")
    records: list[tuple[bytes, str]] = []
    counts: list[int] = []
    for group in _chunks(payloads, per_aggregate):
        aggregator = RecordAggregator()
        for payload in group:
            if aggregator.add_user_record(partition_key, payload) is not None:
                raise ValueError(f"{per_aggregate} payloads do not fit in one 1 MiB aggregate")
        aggregate_key, _, data = aggregator.clear_and_get().get_contents()
        records.append((data, aggregate_key))
        counts.append(len(group))
    written = _put_records(client, stream, records)
    return [(shard, sequence, n) for (shard, sequence), n in zip(written, counts, strict=True)]


def _put_records(
    client: KinesisClient, stream: str, records: Sequence[tuple[bytes, str]]
) -> list[tuple[str, str]]:
    """PutRecords ``(data, partition_key)`` pairs in batches within the API limits.

    Any failed entry fails the test: retrying only the failed entries would reorder them
    after later ones, and tests rely on the order they wrote.
    """
    written: list[tuple[str, str]] = []
    for batch in _batches(records):
        entries: list[PutRecordsRequestEntryTypeDef] = [
            {"Data": data, "PartitionKey": key} for data, key in batch
        ]
        response = client.put_records(StreamName=stream, Records=entries)
        failed = response.get("FailedRecordCount", 0)
        if failed:
            codes = sorted({r["ErrorCode"] for r in response["Records"] if "ErrorCode" in r})
            raise AssertionError(
                f"PutRecords to {stream}: {failed} of {len(batch)} records failed: {codes}"
            )
        written.extend((r["ShardId"], r["SequenceNumber"]) for r in response["Records"])
    return written


def _batches(records: Sequence[tuple[bytes, str]]) -> Iterator[Sequence[tuple[bytes, str]]]:
    batch: list[tuple[bytes, str]] = []
    size = 0
    for data, key in records:
        record_size = len(data) + len(key.encode())
        if batch and (
            len(batch) == _PUT_RECORDS_MAX_ENTRIES or size + record_size > _PUT_RECORDS_MAX_BYTES
        ):
            yield batch
            batch, size = [], 0
        batch.append((data, key))
        size += record_size
    if batch:
        yield batch


def _chunks(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
