"""The benchmarks' replay endpoint answers like Kinesis, as a botocore client sees it."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bench import replay
from kclpy.retrieval.kpl import deaggregate
from kclpy.retrieval.parse import get_records
from kclpy.retrieval.subscription import subscribe


@pytest.fixture(scope="module")
def streams() -> list[replay.Stream]:
    return [replay.build_stream(0, replay.StreamSpec("plain", 3, 250, 40)),
            replay.build_stream(1, replay.StreamSpec("kpl", 1, 900, 100, kpl=True)),
            replay.build_stream(2, replay.StreamSpec("empty", 0, 0, 10))]


@pytest.fixture(scope="module")
def client(streams: list[replay.Stream]) -> Iterator[Any]:
    with replay.ReplayServer(streams) as server:
        yield boto3.client("kinesis", endpoint_url=server.url, region_name="us-east-1")


def iterator(client: Any, stream: str = "plain", shard: str = "shardId-000000000000",
             kind: str = "TRIM_HORIZON", **position: Any) -> str:
    return str(client.get_shard_iterator(StreamName=stream, ShardId=shard,
                                         ShardIteratorType=kind, **position)["ShardIterator"])


def read_all(client: Any, shard_iterator: str, limit: int = 10_000) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    while True:
        page = client.get_records(ShardIterator=shard_iterator, Limit=limit)
        records += page["Records"]
        shard_iterator = page["NextShardIterator"]
        if not page["Records"]:
            assert page["MillisBehindLatest"] == 0
            return records


def test_stream_spec_round_trips() -> None:
    spec = replay.StreamSpec.parse("s:2:10:100:kpl")
    assert spec == replay.StreamSpec("s", 2, 10, 100, kpl=True)
    assert replay.StreamSpec.parse(str(spec)) == spec
    with pytest.raises(ValueError):
        replay.StreamSpec.parse("s:2:10")


def test_list_shards_pages_and_covers_the_key_space(client: Any) -> None:
    first = client.list_shards(StreamName="plain", MaxResults=2)
    assert [s["ShardId"] for s in first["Shards"]] == ["shardId-000000000000",
                                                      "shardId-000000000001"]
    rest = client.list_shards(NextToken=first["NextToken"], MaxResults=2)
    assert [s["ShardId"] for s in rest["Shards"]] == ["shardId-000000000002"]
    assert "NextToken" not in rest
    shards = first["Shards"] + rest["Shards"]
    assert shards[0]["HashKeyRange"]["StartingHashKey"] == "0"
    assert shards[-1]["HashKeyRange"]["EndingHashKey"] == str(2**128 - 1)
    for left, right in itertools.pairwise(shards):
        assert int(left["HashKeyRange"]["EndingHashKey"]) + 1 == int(
            right["HashKeyRange"]["StartingHashKey"])
    with pytest.raises(ClientError) as error:
        client.list_shards(StreamName="plain", NextToken=first["NextToken"])
    assert error.value.response["Error"]["Code"] == "InvalidArgumentException"
    assert client.list_shards(StreamName="empty")["Shards"] == []


def test_describe_stream_and_summary(client: Any) -> None:
    summary = client.describe_stream_summary(StreamName="plain")["StreamDescriptionSummary"]
    assert summary["StreamStatus"] == "ACTIVE"
    assert summary["OpenShardCount"] == 3
    by_arn = client.describe_stream(StreamARN=summary["StreamARN"])["StreamDescription"]
    assert by_arn["StreamName"] == "plain"
    assert len(by_arn["Shards"]) == 3 and not by_arn["HasMoreShards"]
    page = client.describe_stream(StreamName="plain", Limit=1,
                                  ExclusiveStartShardId="shardId-000000000000")
    assert [s["ShardId"] for s in page["StreamDescription"]["Shards"]] == [
        "shardId-000000000001"]
    assert page["StreamDescription"]["HasMoreShards"]


def test_get_records_pages_through_a_shard_to_its_tip(client: Any,
                                                      streams: list[replay.Stream]) -> None:
    page = client.get_records(ShardIterator=iterator(client), Limit=100)
    assert len(page["Records"]) == 100
    assert page["MillisBehindLatest"] > 0
    records = page["Records"] + read_all(client, page["NextShardIterator"], limit=100)
    shard = streams[0].shards[0]
    assert [int(r["SequenceNumber"]) for r in records] == shard.sequence_numbers
    assert all(len(r["Data"]) == 40 for r in records)
    arrivals = [round(r["ApproximateArrivalTimestamp"].timestamp() * 1000) for r in records]
    assert arrivals == shard.arrivals_ms


def test_the_tip_of_an_open_shard_keeps_an_iterator(client: Any) -> None:
    page = client.get_records(ShardIterator=iterator(client, kind="LATEST"))
    assert page["Records"] == [] and page["MillisBehindLatest"] == 0
    again = client.get_records(ShardIterator=page["NextShardIterator"])
    assert again["Records"] == [] and again["NextShardIterator"]


def test_iterator_positions(client: Any, streams: list[replay.Stream]) -> None:
    shard = streams[0].shards[1]
    tenth = str(shard.sequence_numbers[10])

    def first(**position: Any) -> str:
        page = client.get_records(ShardIterator=iterator(
            client, shard="shardId-000000000001", **position), Limit=1)
        return str(page["Records"][0]["SequenceNumber"])

    assert first(kind="AT_SEQUENCE_NUMBER", StartingSequenceNumber=tenth) == tenth
    assert first(kind="AFTER_SEQUENCE_NUMBER", StartingSequenceNumber=tenth) == str(
        shard.sequence_numbers[11])
    # botocore sends whole seconds; the shard's records all arrived within its first second.
    assert first(kind="AT_TIMESTAMP", Timestamp=shard.arrivals_ms[0] // 1000) == str(
        shard.sequence_numbers[0])
    after = iterator(client, shard="shardId-000000000001", kind="AT_TIMESTAMP",
                     Timestamp=shard.arrivals_ms[-1] // 1000 + 1)
    assert client.get_records(ShardIterator=after)["Records"] == []


@pytest.mark.parametrize(("call", "code"), [
    (lambda c: c.get_records(ShardIterator="bm90LWFuLWl0ZXJhdG9y"), "InvalidArgumentException"),
    (lambda c: c.get_records(ShardIterator=iterator(c), Limit=10_001), "ValidationException"),
    (lambda c: c.list_shards(StreamName="nope"), "ResourceNotFoundException"),
    (lambda c: iterator(c, shard="shardId-000000000099"), "ResourceNotFoundException"),
    (lambda c: iterator(c, kind="AT_SEQUENCE_NUMBER"), "InvalidArgumentException"),
    (lambda c: c.list_streams(), "UnknownOperationException"),
])
def test_errors_are_kinesis_errors(client: Any, call: Any, code: str) -> None:
    with pytest.raises(ClientError) as error:
        call(client)
    assert error.value.response["Error"]["Code"] == code
    assert error.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_kpl_stream_holds_aggregates_of_the_user_records(client: Any) -> None:
    records = read_all(client, iterator(client, stream="kpl"))
    assert 1 < len(records) < 900
    assert all(r["Data"].startswith(b"\xf3\x89\x9a\xc2") for r in records)
    assert all(len(r["Data"]) <= replay.KPL_AGGREGATE_BYTES for r in records)


def test_kclpy_fast_parse_reads_the_pages(client: Any) -> None:
    shard_iterator: str | None = iterator(client, stream="kpl")
    users = 0
    while shard_iterator is not None:
        page = get_records(client, shard_iterator, 10_000)
        result = deaggregate(page.records)
        assert result.corrupt == 0
        users += len(result.records)
        shard_iterator = page.next_shard_iterator if page.records else None
    assert users == 900


def test_pages_are_capped_at_ten_mebibytes() -> None:
    stream = replay.build_stream(0, replay.StreamSpec("big", 1, 30, 1024 * 1024))
    shard = stream.shards[0]
    first = replay.page(stream, shard, 0, 10_000)
    # 10 records of 1 MiB fill 10 MiB; the 11th would pass it.
    assert first.count(b'"SequenceNumber"') == 10
    token = base64.b64encode(b"kclpy-replay:0:0:10").decode()
    assert token.encode() in first


def test_builds_are_deterministic() -> None:
    spec = replay.StreamSpec("s", 1, 20, 10)
    assert replay.build_stream(0, spec).shards[0].fragments == replay.build_stream(
        0, spec).shards[0].fragments


# -- enhanced fan-out and live mode ---------------------------------------------------------


@pytest.fixture
def live() -> Iterator[tuple[replay.ReplayServer, Any]]:
    """A fresh server (records are put into it) with one static and one empty stream."""
    streams = [replay.build_stream(0, replay.StreamSpec("static", 1, 120, 30)),
               replay.build_stream(1, replay.StreamSpec("live", 2, 0, 10))]
    with replay.ReplayServer(streams) as server:
        server.replay.subscription_s = 2.0
        yield server, boto3.client("kinesis", endpoint_url=server.url,
                                   region_name="us-east-1")


def test_consumers_register_once_and_are_described_listed_and_deregistered(
        live: tuple[replay.ReplayServer, Any]) -> None:
    _, client = live
    arn = client.describe_stream_summary(StreamName="static")["StreamDescriptionSummary"][
        "StreamARN"]
    consumer = client.register_stream_consumer(StreamARN=arn, ConsumerName="app")["Consumer"]
    assert consumer["ConsumerStatus"] == "ACTIVE"
    with pytest.raises(ClientError, match="ResourceInUseException"):
        client.register_stream_consumer(StreamARN=arn, ConsumerName="app")
    described = client.describe_stream_consumer(StreamARN=arn, ConsumerName="app")[
        "ConsumerDescription"]
    assert (described["ConsumerARN"], described["StreamARN"]) == (consumer["ConsumerARN"], arn)
    assert [c["ConsumerName"] for c in client.list_stream_consumers(StreamARN=arn)[
        "Consumers"]] == ["app"]
    client.deregister_stream_consumer(ConsumerARN=consumer["ConsumerARN"])
    assert client.list_stream_consumers(StreamARN=arn)["Consumers"] == []


def consumer_arn(client: Any, stream: str) -> str:
    arn = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"]
    return str(client.register_stream_consumer(StreamARN=arn, ConsumerName="c")["Consumer"][
        "ConsumerARN"])


def test_botocore_reads_a_subscription_from_its_start_to_the_end_of_the_subscription(
        live: tuple[replay.ReplayServer, Any]) -> None:
    _, client = live
    answer = client.subscribe_to_shard(
        ConsumerARN=consumer_arn(client, "static"), ShardId="shardId-000000000000",
        StartingPosition={"Type": "AT_SEQUENCE_NUMBER",
                          "SequenceNumber": str(replay.FIRST_SEQUENCE + 20 * 100_000)})
    events = [e["SubscribeToShardEvent"] for e in answer["EventStream"]]
    records = [r for e in events for r in e["Records"]]
    assert len(records) == 100
    assert int(records[0]["SequenceNumber"]) == replay.FIRST_SEQUENCE + 20 * 100_000
    assert events[0]["ContinuationSequenceNumber"] == records[-1]["SequenceNumber"]
    assert events[-1]["Records"] == [] and events[-1]["MillisBehindLatest"] == 0, \
        "an empty event at the tip until the subscription ends"


def test_put_records_reach_get_records_and_are_pushed_to_a_waiting_subscription(
        live: tuple[replay.ReplayServer, Any]) -> None:
    server, client = live
    server.replay.subscription_s = 30.0
    arn = consumer_arn(client, "live")
    put = client.put_record(StreamName="live", Data=b"first", PartitionKey="k")
    shard = put["ShardId"]
    events = subscribe(client, arn, shard, {"Type": "LATEST"}, http_version="1.1")
    client.put_records(StreamName="live", Records=[
        {"Data": b"second", "PartitionKey": "k"}, {"Data": b"third", "PartitionKey": "k"}])
    pushed = next(e for e in events if e.records)
    events.close()
    assert [r.binary_data for r in pushed.records] == [b"second", b"third"]
    assert int(pushed.continuation_sequence_number or 0) > int(put["SequenceNumber"])
    records = client.get_records(ShardIterator=iterator(client, "live", shard))["Records"]
    assert [r["Data"] for r in records] == [b"first", b"second", b"third"]
    with pytest.raises(ClientError, match="ResourceNotFoundException"):
        subscribe(client, arn + "x", shard, {"Type": "LATEST"}, http_version="1.1")
