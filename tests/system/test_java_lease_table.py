"""A lease table written by the Java KCL is read as it is and processing resumes from it.

The items below are in exactly the Java KCL 2.x schema, as a Java application leaves them:
an owner that has since died, sequence-number checkpoints (one inside a KPL aggregate, via
checkpointSubSequenceNumber), hash key ranges, and an attribute kclpy does not know (from
KCL 3.x) that must survive kclpy's writes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator

from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, dynamodb_client, kinesis_client, unique_name
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _java_item(shard: Mapping[str, Any], checkpoint: str, sub: int, counter: int) -> dict[str, Any]:
    item: dict[str, Any] = {
        "leaseKey": {"S": shard["ShardId"]},
        "leaseOwner": {"S": "ip-10-0-0-1.ec2.internal:4f9c0e2a-dead-java"},
        "leaseCounter": {"N": str(counter)},
        "checkpoint": {"S": checkpoint},
        "checkpointSubSequenceNumber": {"N": str(sub)},
        "ownerSwitchesSinceCheckpoint": {"N": "0"},
        "startingHashKey": {"S": shard["HashKeyRange"]["StartingHashKey"]},
        "endingHashKey": {"S": shard["HashKeyRange"]["EndingHashKey"]},
        "throughputKBps": {"N": "12.5"},
    }
    return item


def test_resumes_from_java_kcl_items(kinesis_mock: LocalEndpoint,
                                     moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    dynamodb = dynamodb_client(moto_server.url)
    stream = unique_name("java")
    create_stream(kinesis, stream, 2)
    shards = sorted(kinesis.list_shards(StreamName=stream)["Shards"],
                    key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))
    plain_shard, kpl_shard = shards
    plain_seqs = []
    for n in range(10):
        response = kinesis.put_record(
            StreamName=stream, Data=f"plain-{n}".encode(), PartitionKey="p",
            ExplicitHashKey=plain_shard["HashKeyRange"]["StartingHashKey"])
        assert response["ShardId"] == plain_shard["ShardId"]
        plain_seqs.append(response["SequenceNumber"])
    aggregate_seqs = []
    for a in range(2):
        aggregator = RecordAggregator()
        for n in range(5):
            aggregator.add_user_record("k", f"agg{a}-{n}".encode(),
                                       kpl_shard["HashKeyRange"]["StartingHashKey"])
        record = aggregator.clear_and_get()
        partition_key, explicit_hash_key, data = record.get_contents()
        response = kinesis.put_record(StreamName=stream, Data=data, PartitionKey=partition_key,
                                      ExplicitHashKey=explicit_hash_key)
        assert response["ShardId"] == kpl_shard["ShardId"]
        aggregate_seqs.append(response["SequenceNumber"])

    table = unique_name("java-app")
    dynamodb.create_table(
        TableName=table, KeySchema=[{"AttributeName": "leaseKey", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "leaseKey", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST")
    dynamodb.put_item(TableName=table, Item=_java_item(plain_shard, plain_seqs[3], 0, 57))
    dynamodb.put_item(TableName=table, Item=_java_item(kpl_shard, aggregate_seqs[0], 2, 9))

    ledger = Ledger()
    config = KCLConfig(
        application_name=table, stream_name=stream, region="us-east-1",
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON", failover_time_ms=2000, idle_time_between_reads_ms=100,
        shard_sync_interval_ms=1000)
    worker = Worker(config, lambda: RecordingProcessor(ledger))
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_for(lambda: len(ledger.records) >= 6 + 2 + 5, 60, "resumed records processed")
    finally:
        worker.shutdown()
        thread.join(60)
    assert not thread.is_alive()

    got = ledger.payloads()
    assert sorted(got) == sorted(
        [f"plain-{n}".encode() for n in range(4, 10)]
        + [b"agg0-3", b"agg0-4"] + [f"agg1-{n}".encode() for n in range(5)])
    assert len(got) == len(set(got)), "nothing processed twice"
    initialized = sorted(name for _, name in ledger.events if name.startswith("initialize:"))
    assert initialized == sorted([f"initialize:{plain_seqs[3]}",
                                  f"initialize:{aggregate_seqs[0]}"])

    items = {i["leaseKey"]["S"]: i for i in
             dynamodb.scan(TableName=table, ConsistentRead=True)["Items"]}
    assert len(items) == 2, "no extra leases for the Java-managed shards"
    plain_item = items[plain_shard["ShardId"]]
    assert plain_item["checkpoint"]["S"] == plain_seqs[9]
    assert plain_item["throughputKBps"]["N"] == "12.5", "unknown attributes are kept"
    assert int(plain_item["leaseCounter"]["N"]) > 57
    kpl_item = items[kpl_shard["ShardId"]]
    assert (kpl_item["checkpoint"]["S"], kpl_item["checkpointSubSequenceNumber"]["N"]) == (
        aggregate_seqs[1], "4")
