"""The demo behind ``kclpy-worker --local``: a stream with plain and KPL-aggregated records,
so a newcomer sees a worker consume something without an AWS account."""

from __future__ import annotations

import json
import time

import boto3
from aws_kinesis_agg.aggregator import RecordAggregator

DEMO_SHARDS = 2
DEMO_PLAIN_RECORDS = 10
DEMO_AGGREGATES = 2
DEMO_RECORDS_PER_AGGREGATE = 5


def local_session(region: str) -> boto3.session.Session:
    """Static dummy credentials: the embedded endpoint accepts any, and the user's real ones
    (if any) are never sent anywhere by the demo."""
    return boto3.session.Session(
        aws_access_key_id="kclpy-local",
        aws_secret_access_key="kclpy-local",  # noqa: S106
        region_name=region,
    )


def seed_demo_stream(session: boto3.session.Session, endpoint_url: str, stream: str) -> int:
    """Create ``stream`` if missing and write the demo records; returns user records written."""
    kinesis = session.client("kinesis", endpoint_url=endpoint_url)
    existing = kinesis.list_streams()["StreamNames"]
    if stream not in existing:
        kinesis.create_stream(StreamName=stream, ShardCount=DEMO_SHARDS)
        deadline = time.monotonic() + 30
        while (
            kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
                "StreamStatus"
            ]
            != "ACTIVE"
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream} did not become ACTIVE")
            time.sleep(0.1)
    for n in range(DEMO_PLAIN_RECORDS):
        kinesis.put_record(StreamName=stream, Data=json.dumps({"n": n, "kind": "plain"}).encode(),
                           PartitionKey=f"pk-{n}")
    written = DEMO_PLAIN_RECORDS
    for a in range(DEMO_AGGREGATES):
        aggregator = RecordAggregator()
        for n in range(DEMO_RECORDS_PER_AGGREGATE):
            body = json.dumps({"aggregate": a, "n": n, "kind": "kpl"}).encode()
            aggregator.add_user_record(f"agg-{a}", body)
        record = aggregator.clear_and_get()
        assert record is not None
        partition_key, _, data = record.get_contents()
        kinesis.put_record(StreamName=stream, Data=data, PartitionKey=partition_key)
        written += DEMO_RECORDS_PER_AGGREGATE
    return written
