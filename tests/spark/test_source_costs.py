"""What the ``format("kinesis")`` source costs Kinesis, counted through a proxy over HTTP.

The reader is driven as Spark drives it (``latestOffset``, ``partitions``, ``read``) but in
this process, so the counts are exact and a simulated clock can stand for the seconds of an
idle query (the rate limits are about time, and a test must not sleep to fake it). Reads
are told apart by the User-Agent tag the source's driver and executor clients carry.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.serialize
import pytest

from kclpy.local import LocalEndpoint
from kclpy.position import Position
from kclpy.spark.offsets import decode_offset
from tests.support.counting import CountingProxy
from tests.support.faultproxy import FaultProxy
from tests.support.source_driving import available_now, make_reader, read_batch
from tests.support.streams import (
    TEST_CONFIG,
    create_stream,
    kinesis_client,
    put_aggregated,
    put_plain,
    session,
    unique_name,
)
from tests.support.waiting import wait_for

DRIVER, EXECUTOR = "kclpy-spark-driver", "kclpy-spark-executor"

pytestmark = pytest.mark.integration


class FakeClock:
    """Real time at the start, then only what a test adds."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def proxy(kinesis_mock: LocalEndpoint) -> Iterator[CountingProxy]:
    with CountingProxy(kinesis_mock.url) as counting:
        yield counting


def test_available_now_fetches_each_record_once_and_the_driver_reads_no_batch(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-cost")
    create_stream(kinesis, stream, 4)
    payloads = [f"r-{n}".encode() + bytes(200) for n in range(4000)]
    put_plain(kinesis, stream, payloads)
    reader = make_reader(proxy.url, stream, startingPosition="TRIM_HORIZON", settleTime="0")

    rows, _ = available_now(reader)

    assert sorted(rows) == sorted(payloads)
    fetched = proxy.records[DRIVER] + proxy.records[EXECUTOR]
    assert fetched / len(rows) <= 1.1, dict(proxy.records)
    # The driver's probes read one record per shard (and the executors read it again).
    assert proxy.records[DRIVER] <= 4, dict(proxy.records)
    assert proxy.bytes[DRIVER] <= 0.05 * proxy.bytes[EXECUTOR], dict(proxy.bytes)


@pytest.mark.parametrize("recorded", [True, False], ids=["metadata-path", "driver-reads"])
def test_a_row_limit_reads_each_record_once_on_the_executors(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint, tmp_path: Path,
        recorded: bool) -> None:
    """A batch that ends after N rows ends where its executor stops. With ``metadataPath``
    the executor records that position and the driver reads no record of a batch (its
    probes stop once a shard runs dry); without it the driver finds the position by reading
    the batch once more: never more than once per record on each side, as the GetRecords
    ``Limit`` is cut to what the batch still needs."""
    read_max_rows = pytest.importorskip("pyspark.sql.streaming.datasource").ReadMaxRows
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-cost-cap")
    create_stream(kinesis, stream, 4)
    payloads = [f"c-{n}".encode() for n in range(800)]
    put_plain(kinesis, stream, payloads)
    where = {"metadataPath": str(tmp_path / "ends")} if recorded else {}
    reader = make_reader(proxy.url, stream, startingPosition="TRIM_HORIZON", settleTime="0",
                         minFetchPeriod="0", **where)

    rows, batches = available_now(reader, read_max_rows(100))

    assert sorted(rows) == sorted(payloads)
    assert batches >= 8
    assert proxy.records[EXECUTOR] / len(rows) <= 1.1, dict(proxy.records)
    driver_share = 0.02 if recorded else 1.1
    assert proxy.records[DRIVER] / len(rows) <= driver_share, dict(proxy.records)


def test_a_row_limit_on_kpl_aggregates_fetches_each_aggregate_about_once(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint, tmp_path: Path) -> None:
    """A budget counts rows, GetRecords' ``Limit`` Kinesis records: a batch of 60 rows
    from aggregates of 20 needs 3 or 4 of them, and used to ask for every record up to the
    reader's limit, cut the page to its budget and leave the rest to be fetched again by
    the next batch (1,450 aggregates fetched for 100 on the parent commit, 191 now). The
    first page of the query still comes whole: nothing is known of the shard before it."""
    read_max_rows = pytest.importorskip("pyspark.sql.streaming.datasource").ReadMaxRows
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-cost-kpl")
    create_stream(kinesis, stream, 1)
    payloads = [f"k-{n}".encode() for n in range(2000)]
    written = put_aggregated(kinesis, stream, payloads, per_aggregate=20)
    reader = make_reader(proxy.url, stream, startingPosition="TRIM_HORIZON", settleTime="0",
                         minFetchPeriod="0", metadataPath=str(tmp_path / "ends"))

    rows, batches = available_now(reader, read_max_rows(60))

    assert sorted(rows) == sorted(payloads)
    assert batches >= 30
    # the first page whole, then each batch its 3 or 4 aggregates and the one it ends in
    # again (the next batch resumes inside it)
    assert proxy.records[EXECUTOR] <= len(written) + 5 * batches, dict(proxy.records)


def arrivals(kinesis: Any, stream: str) -> list[float]:
    """The arrival times (epoch seconds) of a one-shard stream's records, oldest first."""
    shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
    iterator = kinesis.get_shard_iterator(StreamName=stream, ShardId=shard,
                                          ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    records = kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
    return [float(record["ApproximateArrivalTimestamp"].timestamp()) for record in records]


def last_arrival(kinesis: Any, stream: str) -> float:
    """The arrival time (epoch seconds) of the newest record of a one-shard stream."""
    return arrivals(kinesis, stream)[-1]


def test_tip_is_an_empty_page_so_small_pages_over_put_records_batches_are_exact(
        kinesis_mock: LocalEndpoint) -> None:
    """kinesis-mock reports MillisBehindLatest 0 on a page that ends inside the last
    PutRecords batch while records remain; pages of 300 over batches of 500 show it.

    LATEST is resolved 1 ms after the last older record arrived, the instant that once
    lost the batch: an iterator at a second-precision time lands on the whole PutRecords
    batch of 500 older records, and a probe that stopped after 1 + 10 + 100 + 300 of them
    reported nothing new."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-tip")
    create_stream(kinesis, stream, 1)
    before = [f"old-{n}".encode() for n in range(1000)]
    put_plain(kinesis, stream, before)
    clock = FakeClock()
    clock.now = last_arrival(kinesis, stream) + 0.001
    latest = make_reader(kinesis_mock.url, stream, clock, startingPosition="LATEST",
                         settleTime="0", minFetchPeriod="0", maxRecordsPerFetch="300")
    start = latest.initialOffset()
    after = [f"new-{n}".encode() for n in range(1000)]
    put_plain(kinesis, stream, after)
    clock.now = last_arrival(kinesis, stream) + 0.001

    end = latest.latestOffset(start, None)

    assert read_batch(latest, start, end) == after
    everything = make_reader(kinesis_mock.url, stream, startingPosition="TRIM_HORIZON",
                             settleTime="0", minFetchPeriod="0", maxRecordsPerFetch="300")
    rows, _ = available_now(everything)
    assert rows == before + after


def whole_second_client(url: str) -> Any:
    """A Kinesis client that sends timestamps to the whole second, as botocore before 1.44
    does by default (and cannot be told otherwise); newer botocore does so at its
    ``legacy`` precision."""
    boto = session()
    legacy = getattr(botocore.serialize, "TIMESTAMP_PRECISION_LEGACY", None)
    if legacy is not None:
        def whole_seconds(serializer_kwargs: dict[str, Any], **_: Any) -> None:
            serializer_kwargs["timestamp_precision"] = legacy

        boto.events.register("creating-serializer.kinesis", whole_seconds)
    return boto.client("kinesis", endpoint_url=url, config=TEST_CONFIG)


def test_a_probe_steps_over_a_second_of_older_records_before_concluding_anything(
        kinesis_mock: LocalEndpoint) -> None:
    """A botocore that sends a timestamp to the whole second makes an ``AT_TIMESTAMP``
    iterator land up to a second early. The probe must step over every older record of
    that second, however many, and find the newer one; and where nothing newer exists,
    find the tip, not give up."""
    from kclpy.spark.reading import Probe, ShardReader, StreamRef, list_shards, probe

    kinesis = whole_second_client(kinesis_mock.url)
    stream = unique_name("spark-coarse")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"old-{n}".encode() for n in range(1000)])
    times = arrivals(kinesis, stream)
    newest = times[-1]
    # the records of the newest one's whole second: where a whole-second iterator lands
    # (how many depends on how fast the puts went)
    early = sum(int(t) == int(newest) for t in times)
    [shard] = list_shards(kinesis, StreamRef(stream))
    position = Position.at_timestamp(round(newest * 1000) + 1)

    nothing = ShardReader(kinesis, StreamRef(stream), shard, position, limit=300)
    assert probe(nothing) == Probe()
    assert nothing.fetched >= early or int(newest) != int(newest + 0.001), \
        "the iterator did not land early: the test no longer shows the stepping"

    put_plain(kinesis, stream, [b"new-0"])
    something = ShardReader(kinesis, StreamRef(stream), shard, position, limit=300)
    found = probe(something)
    assert found.first_arrival_ms is not None and found.first_arrival_ms > newest * 1000


def test_an_idle_query_polls_each_shard_at_most_once_a_second(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-idle")
    create_stream(kinesis, stream, 2)
    clock = FakeClock()
    reader = make_reader(proxy.url, stream, clock, startingPosition="LATEST")
    offset = reader.initialOffset()
    proxy.reset()

    # Spark polls an idle source every few milliseconds: 10 simulated seconds of it.
    for _ in range(1000):
        clock.now += 0.01
        assert reader.latestOffset(offset, None) == offset

    assert proxy.count(DRIVER, "GetRecords") <= 2 * 11, dict(proxy.calls)
    assert proxy.count(DRIVER, "GetShardIterator") <= 2, dict(proxy.calls)
    assert proxy.count(DRIVER, "ListShards") <= 3, dict(proxy.calls)
    assert proxy.records[EXECUTOR] == 0

    new = [f"n-{n}".encode() for n in range(50)]
    put_plain(kinesis, stream, new)

    def planned_past_the_records() -> dict[str, Any] | None:
        # A batch ends settleTime before Kinesis' own time (its Date headers), whatever the
        # driver's clock says: real time must pass the records' settle margin.
        clock.now = max(clock.now, time.time()) + 2.0
        end = reader.latestOffset(offset, None)
        return end if end != offset and len(read_batch(reader, offset, end)) == len(new) else None

    end = wait_for(planned_past_the_records, 30, "a batch that holds the new records")
    assert sorted(read_batch(reader, offset, end)) == sorted(new)
    assert {p.kind for p in decode_offset(end).values()} == {"AT_TIMESTAMP"}


def test_throttled_reads_back_off_and_lose_nothing(kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-throttle")
    create_stream(kinesis, stream, 2)
    payloads = [f"t-{n}".encode() for n in range(300)]
    put_plain(kinesis, stream, payloads)
    with FaultProxy(kinesis_mock.url, seed=7) as faults:
        faults.set_rule("GetRecords", throttle_rate=0.3)
        faults.set_rule("GetShardIterator", throttle_rate=0.3)
        reader = make_reader(faults.url, stream, startingPosition="TRIM_HORIZON",
                             settleTime="0", minFetchPeriod="0", maxRecordsPerFetch="40")
        rows, _ = available_now(reader)
        throttled = faults.faults("throttle")

    assert sorted(rows) == sorted(payloads)
    assert throttled > 0


def test_a_trimmed_position_fails_the_query_naming_the_shard_unless_told_to_skip(
        kinesis_mock: LocalEndpoint) -> None:
    """A checkpointed position whose record is gone: Kinesis answers from a later record.
    An offset naming a sequence number below the shard's first record stands for it."""
    from kclpy.spark.reading import DataLossError

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-loss")
    create_stream(kinesis, stream, 1)
    payloads = [f"l-{n}".encode() for n in range(20)]
    put_plain(kinesis, stream, payloads)
    shard = kinesis.list_shards(StreamName=stream)["Shards"][0]
    first = int(shard["SequenceNumberRange"]["StartingSequenceNumber"])
    trimmed = {"shards": {shard["ShardId"]: f"AFTER/{first}/0"}}

    strict = make_reader(kinesis_mock.url, stream, settleTime="0", minFetchPeriod="0")
    with pytest.raises(DataLossError, match=shard["ShardId"]):
        strict.latestOffset(trimmed, None)

    lenient = make_reader(kinesis_mock.url, stream, settleTime="0", minFetchPeriod="0",
                          failOnDataLoss="false")
    end = lenient.latestOffset(trimmed, None)
    assert read_batch(lenient, trimmed, end) == payloads
    counts = collections.Counter(p.kind for p in decode_offset(end).values())
    assert counts == {"AT_TIMESTAMP": 1}

    # A shard of the offset that the stream no longer lists (expired before it was read).
    gone = {"shards": {"shardId-000000000099": f"AFTER/{first}/0",
                       shard["ShardId"]: "TRIM_HORIZON"}}
    with pytest.raises(DataLossError, match="shardId-000000000099"):
        strict.latestOffset(gone, None)
    skipped = lenient.latestOffset(gone, None)
    assert "shardId-000000000099" not in skipped["shards"]
    assert lenient.data_loss_events == 2


def test_role_arn_signs_every_call_with_the_assumed_role(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """STS is moto's server; the proxy sees which access key signed each Kinesis call."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-role")
    create_stream(kinesis, stream, 1)
    payloads = [f"role-{n}".encode() for n in range(30)]
    put_plain(kinesis, stream, payloads)
    proxy.reset()
    reader = make_reader(proxy.url, stream, startingPosition="TRIM_HORIZON", settleTime="0",
                         roleArn="arn:aws:iam::123456789012:role/stream-reader",
                         roleSessionName="orders-job", roleExternalId="ext-1234",
                         stsEndpoint=moto_server.url)

    rows, _ = available_now(reader)

    assert sorted(rows) == sorted(payloads)
    keys = set(proxy.access_keys)
    assert "testing" not in keys, "a call was signed with the chain's own credentials"
    assert keys and all(key.startswith("ASIA") for key in keys), keys


def test_several_streams_in_one_source_each_row_naming_its_stream(
        kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    orders, clicks = unique_name("spark-orders"), unique_name("spark-clicks")
    create_stream(kinesis, orders, 2)
    create_stream(kinesis, clicks, 1)
    expected = {(orders, f"o-{n}".encode()) for n in range(60)}
    expected |= {(clicks, f"c-{n}".encode()) for n in range(40)}
    put_plain(kinesis, orders, [d for s, d in sorted(expected) if s == orders])
    put_plain(kinesis, clicks, [d for s, d in sorted(expected) if s == clicks])
    reader = make_reader(kinesis_mock.url, f"{orders}, {clicks}",
                         startingPosition="TRIM_HORIZON", settleTime="0")
    reader.prepareForTriggerAvailableNow()
    start = reader.initialOffset()

    end = reader.latestOffset(start, None)

    keys = set(decode_offset(end))
    assert {k.split("/")[0] for k in keys} == {orders, clicks} and len(keys) == 3
    rows = set()
    for partition in reader.partitions(start, end):
        for batch in reader.read(partition):
            rows |= set(zip(batch.column("stream").to_pylist(),
                            batch.column("data").to_pylist(), strict=True))
    assert rows == expected


def test_available_now_waits_out_the_probe_interval_instead_of_ending_early(
        kinesis_mock: LocalEndpoint) -> None:
    """Spark ends an AvailableNow run at the first batch with nothing new. Right after a
    parent's last batch, its next probe (the one that finds SHARD_END and frees its
    children) is due only a probe interval later: the reader must wait for it, not report
    nothing new."""
    from tests.support.streams import wait_for

    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-an-split")
    create_stream(kinesis, stream, 1)
    before = [f"b-{n}".encode() for n in range(50)]
    put_plain(kinesis, stream, before)
    parent = kinesis.list_shards(StreamName=stream)["Shards"][0]
    low, high = (int(parent["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(StreamName=stream, ShardToSplit=parent["ShardId"],
                        NewStartingHashKey=str((low + high) // 2))
    wait_for(lambda: kinesis.describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", 30, "split done")
    after = [f"a-{n}".encode() for n in range(50)]
    put_plain(kinesis, stream, after)
    # A clock that stands still: every probe after the first is inside the interval.
    reader = make_reader(kinesis_mock.url, stream, FakeClock(), startingPosition="TRIM_HORIZON",
                         settleTime="0", minFetchPeriod="1s")

    rows, batches = available_now(reader)

    assert sorted(rows) == sorted(before + after)
    assert batches >= 2, "the children come in a later batch than their parent's end"
