"""The polling page source (``kclpy.retrieval.polling``): start positions and iterators,
retries and expiry, idling and shard end, against a scripted in-memory shard, a botocore
Stubber, and over real HTTP against moto's server and kinesis-mock."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import boto3
import pytest
from aws_kinesis_agg.aggregator import RecordAggregator
from botocore.exceptions import ClientError, EndpointConnectionError
from botocore.stub import Stubber

from kclpy.metrics import Metrics
from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON, Position
from kclpy.records import Record, Records, UserRecords, WireRecords
from kclpy.retrieval.kpl import CORRUPT_REASONS
from kclpy.retrieval.page import ChildShard, Page
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.polling import PollingSource, one_off_pages
from kclpy.retrieval.source import (
    AFTER_SEQUENCE_NUMBER,
    AT_SEQUENCE_NUMBER,
    Reading,
    ShardAddress,
    reading_start,
)
from kclpy.retry import Backoff, RetryPolicy
from tests.support import skew
from tests.support.fakeshard import (
    SHARD,
    FakeShard,
    Sleeps,
    UpperBound,
    aggregate,
    drain,
    error,
    make,
    payloads,
    plain,
    polling,
    route_get_records,
    sample,
    seq,
)
from tests.support.streams import wait_for_stream_active
from tests.support.waiting import wait_for


@pytest.fixture(autouse=True)
def fake_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    route_get_records(monkeypatch)


# -- start positions ---------------------------------------------------------------------


@pytest.mark.parametrize("sentinel", [TRIM_HORIZON, LATEST])
def test_sentinel_checkpoints_map_to_their_iterator_type(sentinel: str) -> None:
    assert reading_start(Position(sentinel), None) == Position(sentinel)


def test_at_timestamp_checkpoint_needs_the_initial_timestamp() -> None:
    ts = datetime(2024, 1, 2, tzinfo=timezone.utc)
    assert reading_start(Position(AT_TIMESTAMP), ts) == Position.at_time(ts)
    with pytest.raises(ValueError):
        reading_start(Position(AT_TIMESTAMP), None)


def test_sequence_checkpoint_resumes_at_the_sequence_number() -> None:
    reading = Reading(reading_start(Position(seq(4), 7), None), threading.Event(), lambda s: None)
    assert reading.resume_point(None) == (AT_SEQUENCE_NUMBER, seq(4), None)
    assert reading.resume_point(seq(5)) == (AFTER_SEQUENCE_NUMBER, seq(5), None)


@pytest.mark.parametrize("checkpoint", [SHARD_END, "not-a-number", ""])
def test_impossible_checkpoints_are_refused(checkpoint: str) -> None:
    with pytest.raises(ValueError):
        reading_start(Position.of(checkpoint, 0), None)


def test_stream_name_or_arn_is_required() -> None:
    with pytest.raises(ValueError):
        ShardAddress(SHARD)


def test_iterator_request_carries_arn_and_timestamp() -> None:
    shard = FakeShard([plain(0), plain(1), plain(2)])
    ts = datetime.fromtimestamp((1_700_000_000_000 + 1) / 1000, tz=timezone.utc)
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    fetcher = polling(shard, Position.at_time(ts),
                      ShardAddress(SHARD, stream_arn=arn), sleep=Sleeps())
    assert payloads(drain(fetcher)) == [b"plain-1", b"plain-2"]
    assert shard.shard_iterator_calls == [
        {"ShardId": SHARD, "StreamARN": arn, "ShardIteratorType": AT_TIMESTAMP, "Timestamp": ts}
    ]


def test_both_stream_name_and_arn_are_sent_when_both_are_known() -> None:
    shard = FakeShard([plain(0)])
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    fetcher = polling(shard, Position.trim_horizon(),
                      ShardAddress(SHARD, stream_name="s", stream_arn=arn), sleep=Sleeps())
    fetcher.fetch_once()
    assert shard.shard_iterator_calls[0]["StreamARN"] == arn
    assert shard.shard_iterator_calls[0]["StreamName"] == "s"


def test_stream_name_is_used_without_arn_and_limit_is_max_records() -> None:
    shard = FakeShard([plain(0)])
    fetcher = make(shard, max_records=250)
    fetcher.fetch_once()
    assert shard.shard_iterator_calls[0]["StreamName"] == "s"
    assert "StreamARN" not in shard.shard_iterator_calls[0]
    assert shard.get_records_calls[0][1] == 250


# -- retries -----------------------------------------------------------------------------


def test_throttle_then_success_resumes_with_capped_backoff_and_metrics() -> None:
    shard = FakeShard([plain(i) for i in range(6)])
    throttle = error("ProvisionedThroughputExceededException")
    shard.errors["GetRecords"] = [throttle] * 6
    sleeps, metrics = Sleeps(), Metrics()
    fetcher = make(shard, sleeps=sleeps, metrics=metrics)

    first = fetcher.fetch_once()
    assert first is not None
    assert payloads([first]) == [b"plain-0", b"plain-1", b"plain-2"]
    # base 0.1 doubling, capped at 1.0; UpperBound answers the top of each jitter range
    assert sleeps.delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert sample(metrics, "kclpy_throttles_total", operation="GetRecords") == 6
    assert sample(metrics, "kclpy_get_records_errors_total", shard_id=SHARD, kind="throttled") == 6

    # the success reset the backoff: the next throttle waits the base delay again
    shard.errors["GetRecords"] = [throttle]
    sleeps.delays.clear()
    second = fetcher.fetch_once()
    assert second is not None
    assert payloads([second]) == [b"plain-3", b"plain-4", b"plain-5"]
    assert sleeps.delays == [0.1]


def test_a_botocore_client_throttled_then_answering_through_stubber() -> None:
    client = boto3.client(
        "kinesis",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    arrival = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    sleeps, metrics = Sleeps(), Metrics()
    with Stubber(client) as stubber:
        stubber.add_response(
            "get_shard_iterator",
            {"ShardIterator": "iterator-1"},
            {"StreamName": "s", "ShardId": SHARD, "ShardIteratorType": TRIM_HORIZON},
        )
        stubber.add_client_error(
            "get_records",
            service_error_code="ProvisionedThroughputExceededException",
            http_status_code=400,
        )
        stubber.add_response(
            "get_records",
            {
                "Records": [
                    {
                        "SequenceNumber": seq(0),
                        "Data": b"from-stub",
                        "PartitionKey": "p",
                        "ApproximateArrivalTimestamp": arrival,
                    }
                ],
                "NextShardIterator": "iterator-2",
                "MillisBehindLatest": 0,
            },
            {"ShardIterator": "iterator-1", "Limit": 500},
        )
        fetcher = polling(
            client,
            Position.trim_horizon(),
            ShardAddress(SHARD, stream_name="s"),
            max_records=500,
            backoff=Backoff(0.1, 1.0, rng=UpperBound()),
            metrics=metrics,
            sleep=sleeps,
        )
        result = fetcher.fetch_once()
        stubber.assert_no_pending_responses()
    assert result is not None
    assert payloads([result]) == [b"from-stub"]
    assert result.records[0].timestamp_millis == int(arrival.timestamp() * 1000)
    assert result.caught_up and not result.shard_end
    assert sleeps.delays == [0.1]
    assert sample(metrics, "kclpy_throttles_total", operation="GetRecords") == 1


def test_a_one_off_read_tries_each_call_once_and_ends_with_a_closed_shard(
        caplog: pytest.LogCaptureFixture) -> None:
    """The lag probe's and the inspector's reads: the first failure is theirs to report (no
    retry, no wait), reading resumes after the record named, and the shard's end is the
    consumer's to log, not a probe's."""
    caplog.set_level(logging.INFO)
    client = boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    address = ShardAddress(SHARD, stream_name="s")
    iterator = {"StreamName": "s", "ShardId": SHARD, "ShardIteratorType": AFTER_SEQUENCE_NUMBER,
                "StartingSequenceNumber": seq(4)}
    with Stubber(client) as stubber:
        stubber.add_response("get_shard_iterator", {"ShardIterator": "it-1"}, iterator)
        stubber.add_client_error("get_records",
                                 service_error_code="ProvisionedThroughputExceededException",
                                 http_status_code=400)
        with pytest.raises(ClientError):
            next(one_off_pages(client, address, Position(seq(4)), after=seq(4), limit=5))
        stubber.add_response("get_shard_iterator", {"ShardIterator": "it-2"}, iterator)
        stubber.add_response("get_records", {
            "Records": [{"SequenceNumber": seq(5), "Data": b"x", "PartitionKey": "p",
                         "ApproximateArrivalTimestamp": datetime(2024, 5, 6,
                                                                 tzinfo=timezone.utc)}],
            "MillisBehindLatest": 0}, {"ShardIterator": "it-2", "Limit": 5})
        pages = list(one_off_pages(client, address, Position(seq(4)), after=seq(4), limit=5))
        stubber.assert_no_pending_responses()
    assert [[r.sequence_number for r in page.records] for page in pages] == [[seq(5)]]
    assert pages[0].shard_closed
    assert "reached its end" not in caplog.text


def test_get_shard_iterator_errors_are_retried_with_their_own_operation_label() -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetShardIterator"] = [
        error("LimitExceededException", operation="GetShardIterator"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        error("InternalFailure", 500, operation="GetShardIterator"),
    ]
    sleeps, metrics = Sleeps(), Metrics()
    result = make(shard, sleeps=sleeps, metrics=metrics).fetch_once()
    assert result is not None and payloads([result]) == [b"plain-0"]
    assert len(sleeps.delays) == 3
    assert sample(metrics, "kclpy_throttles_total", operation="GetShardIterator") == 1
    for kind in ("throttled", "connection", "server_error"):
        assert sample(metrics, "kclpy_get_records_errors_total", shard_id=SHARD, kind=kind) == 1


def test_expired_iterator_repositions_after_the_last_fetched_record() -> None:
    shard = FakeShard([plain(0), aggregate(1, 3), plain(2), aggregate(3, 2)], page_size=2)
    metrics = Metrics()
    fetcher = make(shard, metrics=metrics)
    first = fetcher.fetch_once()
    assert first is not None
    shard.errors["GetRecords"] = [error("ExpiredIteratorException")]
    rest = drain(fetcher)
    assert payloads([first, *rest]) == [
        b"plain-0",
        b"agg-1-0",
        b"agg-1-1",
        b"agg-1-2",
        b"plain-2",
        b"agg-3-0",
        b"agg-3-1",
    ]
    assert sample(metrics, "kclpy_iterator_expirations_total", shard_id=SHARD) == 1
    reposition = shard.shard_iterator_calls[-1]
    assert reposition["ShardIteratorType"] == AFTER_SEQUENCE_NUMBER
    assert reposition["StartingSequenceNumber"] == seq(1)


def test_expired_iterator_before_any_record_restarts_from_the_checkpoint() -> None:
    shard = FakeShard([aggregate(0, 4), plain(1)])
    fetcher = make(shard, Position(seq(0), 1))
    shard.errors["GetRecords"] = [error("ExpiredIteratorException")]
    results = drain(fetcher)
    assert payloads(results) == [b"agg-0-2", b"agg-0-3", b"plain-1"]
    assert [c["ShardIteratorType"] for c in shard.shard_iterator_calls] == [
        AT_SEQUENCE_NUMBER,
        AT_SEQUENCE_NUMBER,
    ]


def test_an_iterator_that_keeps_expiring_backs_off_instead_of_spinning() -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetRecords"] = [error("ExpiredIteratorException")] * 3
    sleeps = Sleeps()
    result = make(shard, sleeps=sleeps).fetch_once()
    assert result is not None and payloads([result]) == [b"plain-0"]
    assert sleeps.delays == [0.1, 0.2, 0.4]


def bounded_source(shard: FakeShard, attempts: int, **kwargs: Any) -> ShardPipeline:
    """A polling pipeline whose retries give up after ``attempts`` failed calls."""
    source = PollingSource(
        shard,  # type: ignore[arg-type]
        ShardAddress(SHARD, stream_name="s"),
        backoff=RetryPolicy(0.1, 1.0, max_attempts=attempts).backoff(UpperBound()), **kwargs)
    return ShardPipeline(source, Position.trim_horizon(), sleep=Sleeps())


@pytest.mark.parametrize("operation", ["GetRecords", "GetShardIterator"])
def test_a_policy_with_max_attempts_gives_up_with_the_last_error(operation: str) -> None:
    shard = FakeShard([plain(0)])
    throttles: list[Exception] = [
        error("ProvisionedThroughputExceededException", operation=operation) for _ in range(3)]
    shard.errors[operation] = list(throttles)
    with pytest.raises(ClientError) as raised:
        bounded_source(shard, attempts=3).fetch_once()
    assert raised.value is throttles[2]

    shard.errors[operation] = throttles[:2]
    result = bounded_source(shard, attempts=3).fetch_once()
    assert result is not None and payloads([result]) == [b"plain-0"]


def test_an_iterator_that_keeps_expiring_gives_up_when_the_policy_does() -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetRecords"] = [error("ExpiredIteratorException") for _ in range(4)]
    with pytest.raises(ClientError, match="ExpiredIterator"):
        bounded_source(shard, attempts=3).fetch_once()
    assert len(shard.get_records_calls) == 3


def test_throttles_and_expiries_of_one_read_count_against_the_same_attempts() -> None:
    """The GetRecords inside a read and the read's re-positioning share one backoff: a
    throttle followed by two expiries of fresh iterators is three failures of three."""
    shard = FakeShard([plain(0)])
    shard.errors["GetRecords"] = [error("ProvisionedThroughputExceededException"),
                                  error("ExpiredIteratorException"),
                                  error("ExpiredIteratorException")]
    with pytest.raises(ClientError, match="ExpiredIterator"):
        bounded_source(shard, attempts=3).fetch_once()
    assert len(shard.get_records_calls) == 3


def test_a_per_read_limit_cuts_the_get_records_limit_to_what_the_reader_still_needs() -> None:
    shard = FakeShard([plain(i) for i in range(20)], page_size=100)
    fetcher = make(shard, max_records=250)
    fetcher.fetch_once(limit=7)
    fetcher.fetch_once(limit=1000)
    fetcher.fetch_once()
    assert [limit for _, limit in shard.get_records_calls] == [7, 250, 250]


def test_a_page_tells_the_tip_the_bound_and_the_shard_end_apart() -> None:
    """The tip is an empty page not behind, never MillisBehindLatest 0 alone (kinesis-mock
    reports 0 on a page inside the last PutRecords batch); a bounded read's end is not the
    shard's."""
    shard = FakeShard([plain(i) for i in range(4)], page_size=2, millis_behind=0)
    fetcher = make(shard, deliver_empty=True)
    first = fetcher.fetch_once()
    assert first is not None and first.caught_up and not first.at_tip
    fetcher.fetch_once()
    tip = fetcher.fetch_once()
    assert tip is not None and tip.at_tip and not (tip.shard_end or tip.shard_closed)

    bounded = bounded_source(shard, attempts=3, until_ms=1_700_000_000_000 + 1,
                             max_records=10)
    cut = bounded.fetch_once()
    assert cut is not None and payloads([cut]) == [b"plain-0"]
    assert cut.bound_reached and cut.shard_end and not cut.shard_closed and not cut.at_tip

    # (A stand-in that shows no time of its own: the local clock says the bound is past.
    # test_a_bounded_read_ends_at_the_tip_only_once_kinesis_time_has_passed_its_bound is
    # the tip before Kinesis' time reaches the bound.)
    at_tip = bounded_source(FakeShard([plain(0)], millis_behind=0), attempts=3,
                            until_ms=1_700_000_000_000 + 9)
    assert at_tip.fetch_once() is not None
    over = at_tip.fetch_once()
    assert over is not None and over.shard_end and over.at_tip
    assert not (over.shard_closed or over.bound_reached)

    closed = bounded_source(FakeShard([plain(0)], closed=True), attempts=3,
                            until_ms=1_700_000_000_000 + 9)
    last = closed.fetch_once()
    assert last is not None and last.shard_end and last.shard_closed
    assert not last.bound_reached


def test_fatal_error_propagates_from_fetch_once() -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetRecords"] = [error("AccessDeniedException")]
    sleeps = Sleeps()
    with pytest.raises(ClientError):
        make(shard, sleeps=sleeps).fetch_once()
    assert sleeps.delays == []


# -- idling, shard end, empty pages ------------------------------------------------------


def test_idle_sleep_only_when_the_page_is_empty_and_caught_up() -> None:
    shard = FakeShard([plain(0), plain(1)], page_size=1)
    sleeps, metrics = Sleeps(), Metrics()
    fetcher = make(shard, sleeps=sleeps, metrics=metrics, idle_time_s=0.75)

    assert fetcher.fetch_once() is not None  # records, behind: no sleep
    assert sleeps.delays == []
    shard.millis_behind = 0
    assert fetcher.fetch_once() is not None  # records, caught up: no sleep
    assert sleeps.delays == []
    shard.millis_behind = 3000
    assert fetcher.fetch_once() is None  # empty but behind: fetch again at once
    assert sleeps.delays == []
    assert sample(metrics, "kclpy_millis_behind_latest", shard_id=SHARD) == 3000
    shard.millis_behind = 0
    assert fetcher.fetch_once() is None  # empty and caught up: idle
    assert sleeps.delays == [0.75]
    assert sample(metrics, "kclpy_millis_behind_latest", shard_id=SHARD) == 0


def test_unknown_lag_with_an_empty_page_counts_as_caught_up() -> None:
    shard = FakeShard([])
    sleeps = Sleeps()
    original = shard.page

    def no_lag(iterator: str, limit: int) -> Page[Sequence[Record]]:
        page = original(iterator, limit)
        page.millis_behind_latest = None
        return page

    shard.page = no_lag  # type: ignore[method-assign]
    fetcher = make(shard, sleeps=sleeps, deliver_empty=True, idle_time_s=2.0)
    result = fetcher.fetch_once()
    assert result is not None
    assert result.caught_up and result.records == [] and result.millis_behind_latest is None
    assert sleeps.delays == [2.0]


def test_empty_results_are_delivered_only_when_asked() -> None:
    quiet = make(FakeShard([]))
    assert quiet.fetch_once() is None
    chatty = make(FakeShard([]), deliver_empty=True)
    result = chatty.fetch_once()
    assert result is not None
    assert result.records == [] and result.caught_up and not result.shard_end


def test_shard_end_carries_the_child_shards_and_stops_fetching() -> None:
    children = [
        ChildShard("shardId-000000000001", (SHARD,), "0", str(2**127 - 1)),
        ChildShard("shardId-000000000002", (SHARD,), str(2**127), str(2**128 - 1)),
    ]
    shard = FakeShard([plain(0), plain(1)], page_size=1, closed=True, child_shards=children)
    fetcher = make(shard)
    first = fetcher.fetch_once()
    assert first is not None and not first.shard_end and first.child_shards == []
    last = fetcher.fetch_once()
    assert last is not None and last.shard_end and last.child_shards == children
    assert payloads([last]) == [b"plain-1"]
    calls = len(shard.get_records_calls)
    assert fetcher.fetch_once() is None
    assert len(shard.get_records_calls) == calls
    assert fetcher.finished


def test_an_empty_final_page_is_still_delivered() -> None:
    child = ChildShard("shardId-000000000003", (SHARD,), "0", str(2**128 - 1))
    shard = FakeShard([], closed=True, child_shards=[child])
    result = make(shard).fetch_once()
    assert result is not None
    assert result.shard_end and result.records == [] and result.child_shards == [child]


def test_shard_end_checkpoint_never_reaches_the_fetcher() -> None:
    with pytest.raises(ValueError):
        reading_start(Position.of(SHARD_END, 0), None)


# -- over real HTTP ----------------------------------------------------------------------


@dataclass
class Endpoint:
    url: str
    verify: bool = True


@pytest.fixture(scope="module")
def moto_kinesis() -> Iterator[Endpoint]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield Endpoint(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture(params=["moto", "kinesis_mock"])
def kinesis_endpoint(request: pytest.FixtureRequest) -> Endpoint:
    if request.param == "moto":
        endpoint: Endpoint = request.getfixturevalue("moto_kinesis")
        return endpoint
    url: str = request.getfixturevalue("kinesis_mock").url
    return Endpoint(url, verify=not url.startswith("https"))


def kinesis_client(endpoint: Endpoint) -> Any:
    return boto3.client(
        "kinesis",
        endpoint_url=endpoint.url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        verify=endpoint.verify,
    )


def put_mixed(client: Any, stream: str, shard: dict[str, Any]) -> list[tuple[str, int, bytes]]:
    """Plain records and KPL aggregates routed to ``shard``; the expected user records."""
    low = shard["HashKeyRange"]["StartingHashKey"]
    expected: list[tuple[str, int, bytes]] = []
    sid = shard["ShardId"][-1]
    for i, subs in enumerate([0, 5, 0, 7, 0, 3, 0]):
        if subs == 0:
            data = f"{sid}-plain-{i}".encode()
            response = client.put_record(
                StreamName=stream, Data=data, PartitionKey=f"pk-{i}", ExplicitHashKey=low
            )
            assert response["ShardId"] == shard["ShardId"]
            expected.append((response["SequenceNumber"], 0, data))
            continue
        agg = RecordAggregator()
        payloads_ = [f"{sid}-agg-{i}-{j}".encode() for j in range(subs)]
        for j, payload in enumerate(payloads_):
            agg.add_user_record(f"pk-{i}-{j}", payload, low)
        partition_key, _, blob = agg.clear_and_get().get_contents()
        response = client.put_record(
            StreamName=stream, Data=blob, PartitionKey=partition_key, ExplicitHashKey=low
        )
        assert response["ShardId"] == shard["ShardId"]
        expected.extend((response["SequenceNumber"], j, p) for j, p in enumerate(payloads_))
    return expected


def read_all(fetcher: ShardPipeline, count: int) -> list[tuple[str, int, bytes]]:
    got: list[tuple[str, int, bytes]] = []
    fetcher.start()
    try:
        while len(got) < count:
            result = fetcher.get(timeout=30)
            assert result is not None, f"only {len(got)} of {count} records arrived"
            got.extend(
                (r.sequence_number, r.sub_sequence_number, r.binary_data) for r in result.records
            )
        # nothing beyond: once the fetcher read the tip empty with nothing queued, a
        # duplicate would have had to be queued behind the last page
        wait_for(lambda: fetcher.caught_up, 30, "the fetcher to read the tip of the shard")
        assert fetcher.get(timeout=0) is None
    finally:
        fetcher.stop(timeout=10)
    return got


@pytest.mark.integration
def test_reads_plain_and_aggregated_records_over_http_exactly_once_in_order(
    kinesis_endpoint: Endpoint,
) -> None:
    client = kinesis_client(kinesis_endpoint)
    stream = f"fetcher-{uuid.uuid4().hex[:8]}"
    client.create_stream(StreamName=stream, ShardCount=2)
    wait_for_stream_active(client, stream)
    shards = client.list_shards(StreamName=stream)["Shards"]
    assert len(shards) == 2
    expected = {s["ShardId"]: put_mixed(client, stream, s) for s in shards}

    for shard in shards:
        shard_id = shard["ShardId"]
        hash_range = (
            int(shard["HashKeyRange"]["StartingHashKey"]),
            int(shard["HashKeyRange"]["EndingHashKey"]),
        )
        metrics = Metrics()
        fetcher = polling(
            client,
            Position.trim_horizon(),
            ShardAddress(shard_id, stream_name=stream),
            max_records=2,  # small pages: the read spans many GetRecords calls
            idle_time_s=0.05,
            hash_range=hash_range,
            metrics=metrics,
        )
        assert read_all(fetcher, len(expected[shard_id])) == expected[shard_id]
        assert sample(metrics, "kclpy_records_filtered_total", shard_id=shard_id) == 0
        assert all(sample(metrics, "kclpy_deaggregation_errors_total", shard_id=shard_id,
                          reason=reason) == 0 for reason in CORRUPT_REASONS)

        # restart from a checkpoint inside the second aggregate (sub-record 2 of 7 done)
        done = next(i for i, (_, _, p) in enumerate(expected[shard_id]) if b"agg-3-2" in p)
        checkpoint_seq, checkpoint_sub, _ = expected[shard_id][done]
        assert checkpoint_sub == 2
        resumed = polling(
            client,
            reading_start(Position.of(checkpoint_seq, checkpoint_sub), None),
            ShardAddress(shard_id, stream_name=stream),
            max_records=2,
            idle_time_s=0.05,
            hash_range=hash_range,
        )
        rest = expected[shard_id][done + 1 :]
        assert read_all(resumed, len(rest)) == rest


@pytest.mark.integration
def test_a_split_parent_is_read_to_shard_end_with_its_children_over_http(
    request: pytest.FixtureRequest,
) -> None:
    url: str = request.getfixturevalue("kinesis_mock").url
    client = kinesis_client(Endpoint(url, verify=not url.startswith("https")))
    stream = f"fetcher-split-{uuid.uuid4().hex[:8]}"
    client.create_stream(StreamName=stream, ShardCount=1)
    wait_for_stream_active(client, stream)
    parent = client.list_shards(StreamName=stream)["Shards"][0]
    expected = put_mixed(client, stream, parent)
    client.split_shard(
        StreamName=stream, ShardToSplit=parent["ShardId"], NewStartingHashKey=str(2**127)
    )
    wait_for_stream_active(client, stream)

    fetcher = polling(
        client,
        Position.trim_horizon(),
        ShardAddress(parent["ShardId"], stream_name=stream),
        max_records=4,
        idle_time_s=0.05,
    )
    fetcher.start()
    got: list[tuple[str, int, bytes]] = []
    try:
        while True:
            result = fetcher.get(timeout=30)
            assert result is not None
            got.extend(
                (r.sequence_number, r.sub_sequence_number, r.binary_data) for r in result.records
            )
            if result.shard_end:
                break
    finally:
        fetcher.stop(timeout=10)
    assert got == expected
    assert len(result.child_shards) == 2
    assert all(c.parent_shards == (parent["ShardId"],) for c in result.child_shards)
    assert sorted(c.starting_hash_key for c in result.child_shards) == ["0", str(2**127)]




def test_a_bounded_read_ends_at_the_tip_only_once_kinesis_time_has_passed_its_bound() -> None:
    """A bound computed on a local clock 5 s ahead of Kinesis' (a gap's end 1 s before the
    local time) is in Kinesis' future: the tip reached before it is not the read's end,
    since records still arrive before the bound. Ending there skipped them: lag recovery's
    live reader starts at the bound, so such a record belonged to no read (10 of 40 with a
    5 s skew). The read looks again, waiting between looks, until Kinesis' answers show its
    time past the bound; the record that arrived meanwhile is read."""
    client = boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    bound = skew.KINESIS_MS + skew.SKEW_MS - 1000
    with Stubber(client) as stubber:
        skew.script_late_record(stubber)
        sleeps = Sleeps()
        reader = ShardPipeline(
            PollingSource(client, ShardAddress(SHARD, stream_name="s"), idle_time_s=0,
                          until_ms=bound),
            Position.trim_horizon(), sleep=sleeps)
        got: list[bytes] = []
        for _ in range(10):
            result = reader.fetch_once()
            if result is not None:
                got.extend(r.binary_data for r in result.records)
            if reader.finished:
                break
    assert got == [b"r0", b"r1"], "the record that arrived after the first tip is read"
    stubber.assert_no_pending_responses()
    assert result is not None and result.shard_end and result.at_tip
    assert not (result.bound_reached or result.shard_closed)
    assert len(sleeps.delays) == 2 and all(d > 0 for d in sleeps.delays), (
        "the tip is looked at again after a wait, not in a busy loop")


def test_a_bound_cuts_rows_and_aggregates_where_it_cuts_the_records_one_by_one() -> None:
    """Page.within reads whole runs' arrivals in C: the cut is the first record at or after
    the bound, as when every record is looked at, for wire rows, an aggregate's user records
    and records without an arrival time."""
    rows = WireRecords([("eA==", f"k{i}", str(10**20 + i),
                         None if i % 4 == 0 else 1_700_000_000.0005 + i / 1000)
                        for i in range(12)])
    users = UserRecords("9" * 30, 1_700_000_000.02, [b"a", b"b"], ["p", "q"])
    cases: list[Records | WireRecords] = [rows, Records([rows, users]), Records([users, rows])]
    for records in cases:
        built = list(records)
        for until in (1_699_999_999_000, 1_700_000_000_001, 1_700_000_000_005,
                      1_700_000_000_011, 1_700_000_000_020, 1_700_000_000_021,
                      1_800_000_000_000):
            expected = next((i for i, r in enumerate(built) if r.timestamp_millis is not None
                             and r.timestamp_millis >= until), len(built))
            page = Page[Sequence[Record]](records, 0).within(until)
            assert list(page.records) == built[:expected]
            assert page.bound_reached == (expected < len(built))
