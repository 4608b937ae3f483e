"""The set-up the end-to-end worker tests share: a stream on kinesis-mock, a worker's
configuration against kinesis-mock and moto's server, a producer of plain and KPL records,
a worker whose recording processor fills a ledger, and the checks of what the ledger saw.

``tests/conftest.py`` hands it to a test as the ``e2e`` fixture (with ``ledger``); a test
that builds its own endpoints (a fault proxy in front of one) uses ``worker_config``.
"""

from __future__ import annotations

import collections
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kclpy import KCLConfig, Worker
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    put_aggregated,
    put_plain,
    unique_name,
)
from tests.support.workers import running as running_worker

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

#: what every end-to-end worker runs with unless a test says otherwise: from the start of
#: the stream, with failover, polling and shard sync fast enough for a test on a slow machine
WORKER_DEFAULTS: dict[str, Any] = {
    "region": "us-east-1",
    "initial_position": "TRIM_HORIZON",
    "failover_time_ms": 3000,
    "idle_time_between_reads_ms": 100,
    "shard_sync_interval_ms": 1000,
    "parent_shard_poll_interval_ms": 200,
    "shutdown_grace_ms": 5000,
    "task_backoff_time_ms": 50,
}


def worker_config(kinesis_url: str, dynamodb_url: str, stream: str,
                  **overrides: Any) -> KCLConfig:
    """A worker of ``stream`` against these endpoints, under a fresh application name."""
    values: dict[str, Any] = {
        "application_name": unique_name("app"), "stream_name": stream,
        "kinesis_endpoint": kinesis_url, "dynamodb_endpoint": dynamodb_url,
        **WORKER_DEFAULTS}
    values.update(overrides)
    return KCLConfig(**values)


@dataclass
class EndToEnd:
    """kinesis-mock and moto's server, as one test sees them."""

    kinesis_url: str
    dynamodb_url: str
    kinesis: KinesisClient

    def stream(self, prefix: str, shards: int) -> str:
        """A new ACTIVE stream of ``shards`` shards; its name starts with ``prefix``."""
        name = unique_name(prefix)
        create_stream(self.kinesis, name, shards)
        return name

    def config(self, stream: str, **overrides: Any) -> KCLConfig:
        return worker_config(self.kinesis_url, self.dynamodb_url, stream, **overrides)

    def lease_items(self, table: str) -> dict[str, dict[str, Any]]:
        return lease_items(self.dynamodb_url, table)


def running(config: KCLConfig, ledger: Ledger) -> AbstractContextManager[Worker]:
    """A worker of ``config`` on a thread whose processors record into ``ledger``."""
    return running_worker(Worker(config, lambda: RecordingProcessor(ledger)))


def produce_mixed(kinesis: KinesisClient, stream: str, tag: str, plain: int, aggregates: int,
                  per_aggregate: int) -> list[bytes]:
    """``plain`` plain records, then ``aggregates`` KPL aggregates of ``per_aggregate`` user
    records each; returns every user record's payload (tagged, so runs never collide)."""
    payloads = [f"{tag}-plain-{n}".encode() for n in range(plain)]
    put_plain(kinesis, stream, payloads)
    aggregated = [f"{tag}-kpl-{n}".encode() for n in range(aggregates * per_aggregate)]
    put_aggregated(kinesis, stream, aggregated, per_aggregate)
    return payloads + aggregated


def assert_in_order(ledger: Ledger) -> None:
    for shard_id, records in ledger.by_shard().items():
        positions = [(seq, sub) for seq, sub, _ in records]
        assert positions == sorted(positions), f"{shard_id} out of order"


def assert_exactly_once(ledger: Ledger, expected: list[bytes]) -> None:
    seen = collections.Counter(ledger.payloads())
    missing = set(expected) - set(seen)
    duplicated = {p: n for p, n in seen.items() if n > 1}
    assert not missing, f"{len(missing)} records never processed"
    assert not duplicated, f"{len(duplicated)} records processed more than once"
    assert sorted(seen) == sorted(expected)


def stream_active(kinesis: KinesisClient, stream: str) -> bool:
    summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
    return bool(summary["StreamStatus"] == "ACTIVE")


def lease_items(dynamodb_url: str, table: str) -> dict[str, dict[str, Any]]:
    """The lease table's items by lease key, read consistently; none while the worker has
    not created the table yet."""
    client = dynamodb_client(dynamodb_url)
    try:
        items = client.scan(TableName=table, ConsistentRead=True)["Items"]
    except client.exceptions.ResourceNotFoundException:
        return {}
    return {item["leaseKey"]["S"]: item for item in items}
