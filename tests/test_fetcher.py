"""ShardPipeline against a scripted in-memory shard, and over real HTTP against moto's server."""

from __future__ import annotations

import logging
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import boto3
import pytest
from aws_kinesis_agg.aggregator import RecordAggregator
from botocore.exceptions import ClientError, EndpointConnectionError
from botocore.stub import Stubber

from kclpy.leases.lease import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON
from kclpy.metrics import Metrics
from kclpy.records import Record
from kclpy.retrieval import parse
from kclpy.retrieval import polling as polling_module
from kclpy.retrieval.backoff import Backoff
from kclpy.retrieval.parse import ChildShard, GetRecordsPage
from kclpy.retrieval.pipeline import FetchError, FetchResult, ShardPipeline
from kclpy.retrieval.polling import PollingSource
from kclpy.retrieval.source import (
    AFTER_SEQUENCE_NUMBER,
    AT_SEQUENCE_NUMBER,
    ShardAddress,
    StartPosition,
)

SHARD = "shardId-000000000000"
BASE_SEQ = 49_000_000_000_000_000_000


def seq(i: int) -> str:
    return str(BASE_SEQ + i * 10)


def plain(i: int, data: bytes | None = None) -> Record:
    return Record(
        sequence_number=seq(i),
        partition_key=f"pk-{i}",
        timestamp_millis=1_700_000_000_000 + i,
        data=data if data is not None else f"plain-{i}".encode(),
    )


def aggregate(i: int, n: int, explicit_hash_keys: list[str] | None = None) -> Record:
    agg = RecordAggregator()
    for j in range(n):
        ehk = explicit_hash_keys[j] if explicit_hash_keys else None
        agg.add_user_record(f"pk-{i}-{j}", f"agg-{i}-{j}".encode(), ehk)
    partition_key, _, data = agg.clear_and_get().get_contents()
    return Record(
        sequence_number=seq(i),
        partition_key=partition_key,
        timestamp_millis=1_700_000_000_000 + i,
        data=data,
    )


def error(code: str, status: int = 400, operation: str = "GetRecords") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)


def payloads(results: list[FetchResult]) -> list[bytes]:
    return [r.binary_data for result in results for r in result.records]


def positions(records: list[Record]) -> list[tuple[int, int]]:
    return [r.extended_sequence_number for r in records]


@dataclass
class FakeShard:
    """One shard as a list of Kinesis records; iterators are ``it-<index>-<n>`` tokens.

    ``errors[operation]`` is consumed front to back: each call raises the next one, if any.
    """

    records: list[Record]
    page_size: int = 3
    closed: bool = False
    child_shards: list[ChildShard] = field(default_factory=list)
    millis_behind: int | None = None
    errors: dict[str, list[Exception]] = field(default_factory=dict)
    shard_iterator_calls: list[dict[str, Any]] = field(default_factory=list)
    get_records_calls: list[tuple[str, int]] = field(default_factory=list)
    called: threading.Condition = field(default_factory=threading.Condition)
    _issued: int = 0

    def _raise_scripted(self, operation: str) -> None:
        pending = self.errors.get(operation)
        if pending:
            raise pending.pop(0)

    def get_shard_iterator(self, **params: Any) -> dict[str, Any]:
        self.shard_iterator_calls.append(params)
        self._raise_scripted("GetShardIterator")
        kind = params["ShardIteratorType"]
        seqs = [int(r.sequence_number) for r in self.records]
        if kind == TRIM_HORIZON:
            index = 0
        elif kind == LATEST:
            index = len(self.records)
        elif kind == AT_SEQUENCE_NUMBER:
            index = next(
                (k for k, s in enumerate(seqs) if s >= int(params["StartingSequenceNumber"])),
                len(seqs),
            )
        elif kind == AFTER_SEQUENCE_NUMBER:
            index = next(
                (k for k, s in enumerate(seqs) if s > int(params["StartingSequenceNumber"])),
                len(seqs),
            )
        elif kind == AT_TIMESTAMP:
            millis = params["Timestamp"].timestamp() * 1000
            arrivals = [r.timestamp_millis or 0 for r in self.records]
            index = next((k for k, a in enumerate(arrivals) if a >= millis), len(arrivals))
        else:
            raise AssertionError(kind)
        self._issued += 1
        return {"ShardIterator": f"it-{index}-{self._issued}"}

    def page(self, iterator: str, limit: int) -> GetRecordsPage:
        with self.called:
            self.get_records_calls.append((iterator, limit))
            self.called.notify_all()
        self._raise_scripted("GetRecords")
        match = re.fullmatch(r"it-(\d+)-\d+", iterator)
        assert match, iterator
        index = int(match.group(1))
        batch = self.records[index : index + min(limit, self.page_size)]
        after = index + len(batch)
        at_end = after >= len(self.records)
        self._issued += 1
        next_iterator = None if self.closed and at_end else f"it-{after}-{self._issued}"
        millis = self.millis_behind if self.millis_behind is not None else (0 if at_end else 5000)
        return GetRecordsPage(
            records=list(batch),
            next_shard_iterator=next_iterator,
            millis_behind_latest=millis,
            child_shards=list(self.child_shards) if next_iterator is None else [],
            size_bytes=sum(len(r.binary_data) for r in batch),
        )

    def wait_for_calls(self, n: int, timeout: float = 10.0) -> bool:
        with self.called:
            return self.called.wait_for(lambda: len(self.get_records_calls) >= n, timeout)


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class UpperBound(random.Random):
    """Full jitter's worst case: always the top of the range, so delays are predictable."""

    def uniform(self, a: float, b: float) -> float:
        return b


@pytest.fixture(autouse=True)
def fake_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the fetcher's GetRecords to ``FakeShard.page`` when the client is a fake."""

    def get_records(client: Any, iterator: str, limit: int) -> GetRecordsPage:
        if isinstance(client, FakeShard):
            return client.page(iterator, limit)
        return parse.get_records(client, iterator, limit)

    def install(client: Any) -> None:
        if not isinstance(client, FakeShard):
            parse.install_fast_get_records(client)

    monkeypatch.setattr(polling_module, "get_records", get_records)
    monkeypatch.setattr(polling_module, "install_fast_get_records", install)


def make(
    shard: FakeShard,
    start: StartPosition | None = None,
    *,
    sleeps: Sleeps | None = None,
    metrics: Metrics | None = None,
    max_records: int = 10000,
    idle_time_s: float = 1.0,
    **kwargs: Any,
) -> ShardPipeline:
    """A polling pipeline of ``shard``; ``kwargs`` are the pipeline's."""
    source = PollingSource(
        shard,  # type: ignore[arg-type]
        ShardAddress(SHARD, stream_name="s"),
        max_records=max_records,
        idle_time_s=idle_time_s,
        backoff=Backoff(0.1, 1.0, rng=UpperBound()),
        metrics=metrics,
    )
    return ShardPipeline(
        source,
        start or StartPosition(TRIM_HORIZON),
        metrics=metrics,
        sleep=sleeps if sleeps is not None else Sleeps(),
        **kwargs,
    )


def polling(client: Any, start: StartPosition, address: ShardAddress, *,
            metrics: Metrics | None = None, sleep: Sleeps | None = None,
            hash_range: tuple[int, int] | None = None, **kwargs: Any) -> ShardPipeline:
    """A polling pipeline of a real (or stubbed) client; ``kwargs`` are the source's."""
    return ShardPipeline(PollingSource(client, address, metrics=metrics, **kwargs), start,
                         hash_range=hash_range, metrics=metrics, sleep=sleep)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def drain(fetcher: ShardPipeline, limit: int = 100) -> list[FetchResult]:
    results = []
    for _ in range(limit):
        result = fetcher.fetch_once()
        if result is not None:
            results.append(result)
            if result.shard_end:
                return results
        elif fetcher.finished:
            return results
    return results


# -- start positions ---------------------------------------------------------------------


@pytest.mark.parametrize("sentinel", [TRIM_HORIZON, LATEST])
def test_sentinel_checkpoints_map_to_their_iterator_type(sentinel: str) -> None:
    assert StartPosition.from_checkpoint(sentinel, 0, None) == StartPosition(sentinel)


def test_at_timestamp_checkpoint_needs_the_initial_timestamp() -> None:
    ts = datetime(2024, 1, 2, tzinfo=timezone.utc)
    assert StartPosition.from_checkpoint(AT_TIMESTAMP, 0, ts) == StartPosition(
        AT_TIMESTAMP, timestamp=ts
    )
    with pytest.raises(ValueError):
        StartPosition.from_checkpoint(AT_TIMESTAMP, 0, None)


def test_sequence_checkpoint_resumes_at_the_sequence_number() -> None:
    assert StartPosition.from_checkpoint(seq(4), 7, None) == StartPosition(
        AT_SEQUENCE_NUMBER, seq(4), 7
    )


@pytest.mark.parametrize("checkpoint", [SHARD_END, "not-a-number", ""])
def test_impossible_checkpoints_are_refused(checkpoint: str) -> None:
    with pytest.raises(ValueError):
        StartPosition.from_checkpoint(checkpoint, 0, None)


def test_stream_name_or_arn_is_required() -> None:
    with pytest.raises(ValueError):
        ShardAddress(SHARD)


def test_iterator_request_carries_arn_and_timestamp() -> None:
    shard = FakeShard([plain(0), plain(1), plain(2)])
    ts = datetime.fromtimestamp((1_700_000_000_000 + 1) / 1000, tz=timezone.utc)
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    fetcher = polling(shard, StartPosition(AT_TIMESTAMP, timestamp=ts),
                      ShardAddress(SHARD, stream_arn=arn), sleep=Sleeps())
    assert payloads(drain(fetcher)) == [b"plain-1", b"plain-2"]
    assert shard.shard_iterator_calls == [
        {"ShardId": SHARD, "StreamARN": arn, "ShardIteratorType": AT_TIMESTAMP, "Timestamp": ts}
    ]


def test_both_stream_name_and_arn_are_sent_when_both_are_known() -> None:
    shard = FakeShard([plain(0)])
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    fetcher = polling(shard, StartPosition(TRIM_HORIZON),
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


# -- reading, resuming, de-aggregating ---------------------------------------------------


def test_reads_plain_and_aggregated_records_in_order() -> None:
    shard = FakeShard([plain(0), aggregate(1, 3), plain(2), aggregate(3, 2)], page_size=2)
    results = drain(make(shard))
    assert payloads(results) == [
        b"plain-0",
        b"agg-1-0",
        b"agg-1-1",
        b"agg-1-2",
        b"plain-2",
        b"agg-3-0",
        b"agg-3-1",
    ]
    assert positions([r for res in results for r in res.records]) == [
        (int(seq(0)), 0),
        (int(seq(1)), 0),
        (int(seq(1)), 1),
        (int(seq(1)), 2),
        (int(seq(2)), 0),
        (int(seq(3)), 0),
        (int(seq(3)), 1),
    ]


def test_resume_inside_an_aggregate_skips_the_sub_records_already_done() -> None:
    shard = FakeShard([plain(0), aggregate(1, 5), plain(2)], page_size=10)
    fetcher = make(shard, StartPosition.from_checkpoint(seq(1), 2, None))
    results = drain(fetcher)
    assert shard.shard_iterator_calls[0]["ShardIteratorType"] == AT_SEQUENCE_NUMBER
    assert shard.shard_iterator_calls[0]["StartingSequenceNumber"] == seq(1)
    assert payloads(results) == [b"agg-1-3", b"agg-1-4", b"plain-2"]


def test_resume_at_a_plain_record_does_not_deliver_it_again() -> None:
    shard = FakeShard([plain(0), plain(1), plain(2)])
    results = drain(make(shard, StartPosition.from_checkpoint(seq(1), 0, None)))
    assert payloads(results) == [b"plain-2"]


def test_resume_at_the_last_sub_record_of_an_aggregate_moves_past_it() -> None:
    shard = FakeShard([aggregate(0, 3), plain(1)], page_size=1)
    results = drain(make(shard, StartPosition.from_checkpoint(seq(0), 2, None)))
    assert payloads(results) == [b"plain-1"]


def test_after_sequence_number_starts_after_the_whole_record() -> None:
    shard = FakeShard([aggregate(0, 3), plain(1)])
    results = drain(make(shard, StartPosition(AFTER_SEQUENCE_NUMBER, seq(0))))
    assert shard.shard_iterator_calls[0]["ShardIteratorType"] == AFTER_SEQUENCE_NUMBER
    assert payloads(results) == [b"plain-1"]


def test_aggregates_outside_the_hash_range_are_filtered_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    # With the Java KCL's filter asked for: the KPL re-sends the user records of an aggregate
    # that landed on the wrong shard, so an aggregate with any sub-record outside the
    # shard's range is dropped whole - and said so at WARNING, with the shard and count.
    low, high = 0, 2**127 - 1
    inside, outside = str(2**100), str(2**127 + 5)
    shard = FakeShard([aggregate(0, 3, [inside, outside, inside]), aggregate(1, 2, [inside] * 2)])
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, logger="kclpy.retrieval.pipeline"):
        results = drain(make(shard, metrics=metrics, hash_range=(low, high),
                             filter_outside_hash_range=True))
    assert payloads(results) == [b"agg-1-0", b"agg-1-1"]
    assert sample(metrics, "kclpy_records_filtered_total", shard_id=SHARD) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"shard {SHARD}: 3 user record(s)" in m for m in warnings), warnings


def test_by_default_aggregates_outside_the_hash_range_are_delivered_whole() -> None:
    inside, outside = str(2**100), str(2**127 + 5)
    shard = FakeShard([aggregate(0, 3, [inside, outside, inside])])
    metrics = Metrics()
    results = drain(make(shard, metrics=metrics, hash_range=(0, 2**127 - 1)))
    assert payloads(results) == [b"agg-0-0", b"agg-0-1", b"agg-0-2"]
    assert sample(metrics, "kclpy_records_filtered_total", shard_id=SHARD) == 0


def test_a_page_filtered_to_nothing_is_not_delivered_and_not_idled_on() -> None:
    outside = str(2**127 + 5)
    shard = FakeShard([aggregate(0, 2, [outside] * 2), plain(1)], page_size=1)
    shard.millis_behind = 0
    sleeps = Sleeps()
    fetcher = make(shard, sleeps=sleeps, hash_range=(0, 2**127 - 1),
                   filter_outside_hash_range=True)
    assert fetcher.fetch_once() is None
    assert sleeps.delays == []


def test_a_corrupt_aggregate_is_delivered_raw_and_counted() -> None:
    good = aggregate(0, 2)
    data = bytearray(good.binary_data)
    data[-1] ^= 0xFF  # break the MD5 trailer
    corrupt = Record(
        sequence_number=seq(0),
        partition_key="pk",
        timestamp_millis=0,
        data=bytes(data),
    )
    metrics = Metrics()
    results = drain(make(FakeShard([corrupt, plain(1)]), metrics=metrics))
    assert payloads(results) == [bytes(data), b"plain-1"]
    assert sample(metrics, "kclpy_deaggregation_errors_total", shard_id=SHARD) == 1


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
            StartPosition(TRIM_HORIZON),
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
    fetcher = make(shard, StartPosition.from_checkpoint(seq(0), 1, None))
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

    def no_lag(iterator: str, limit: int) -> GetRecordsPage:
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
        StartPosition.from_checkpoint(SHARD_END, 0, None)


# -- the thread, the queue, stop and errors ----------------------------------------------


@pytest.fixture
def running() -> Iterator[list[ShardPipeline]]:
    fetchers: list[ShardPipeline] = []
    yield fetchers
    for f in fetchers:
        f.stop(timeout=5)


def test_thread_delivers_everything_then_shard_end(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(i) for i in range(10)], page_size=3, closed=True)
    fetcher = make(shard, queue_size=2)
    running.append(fetcher)
    fetcher.start()
    results = []
    while True:
        result = fetcher.get(timeout=10)
        assert result is not None
        results.append(result)
        if result.shard_end:
            break
    assert payloads(results) == [f"plain-{i}".encode() for i in range(10)]
    # after the end, get() answers at once instead of waiting
    assert fetcher.get() is None
    assert fetcher.get() is None
    assert fetcher.error is None


def test_full_queue_blocks_the_fetcher(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(i) for i in range(50)], page_size=1)
    metrics = Metrics()
    fetcher = make(shard, queue_size=2, metrics=metrics)
    running.append(fetcher)
    fetcher.start()
    # queue_size results queued, plus one held by the thread waiting for room
    assert shard.wait_for_calls(3)
    assert not shard.wait_for_calls(4, timeout=0.5)
    assert sample(metrics, "kclpy_prefetch_queue_depth", shard_id=SHARD) == 2

    first = fetcher.get(timeout=5)
    assert first is not None and payloads([first]) == [b"plain-0"]
    assert shard.wait_for_calls(4)
    assert not shard.wait_for_calls(5, timeout=0.5)


def test_stop_is_prompt_while_blocked_on_a_full_queue() -> None:
    shard = FakeShard([plain(i) for i in range(50)], page_size=1)
    fetcher = make(shard, queue_size=1)
    fetcher.start()
    assert shard.wait_for_calls(2)
    fetcher.stop(timeout=5)
    assert fetcher._thread is not None and not fetcher._thread.is_alive()
    assert fetcher.error is None


def test_stop_interrupts_the_idle_sleep_and_wakes_a_blocked_get() -> None:
    shard = FakeShard([])
    fetcher = polling(shard, StartPosition(LATEST), ShardAddress(SHARD, stream_name="s"),
                      idle_time_s=3600)
    fetcher.start()
    got: list[object] = []
    consumer = threading.Thread(target=lambda: got.append(fetcher.get()))
    consumer.start()
    assert shard.wait_for_calls(1)
    fetcher.stop(timeout=5)
    assert fetcher._thread is not None and not fetcher._thread.is_alive()
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    assert got == [None]
    assert len(shard.get_records_calls) == 1


def test_fatal_error_surfaces_after_the_results_fetched_before_it(
    running: list[ShardPipeline],
) -> None:
    shard = FakeShard([plain(0), plain(1)], page_size=1)
    not_found = error("ResourceNotFoundException")
    fetcher = make(shard)
    running.append(fetcher)
    original = shard.page

    def fail_third(iterator: str, limit: int) -> GetRecordsPage:
        if len(shard.get_records_calls) == 2:
            shard.errors["GetRecords"] = [not_found]
        return original(iterator, limit)

    shard.page = fail_third  # type: ignore[method-assign]
    fetcher.start()
    assert payloads([r for r in (fetcher.get(5), fetcher.get(5)) if r]) == [
        b"plain-0",
        b"plain-1",
    ]
    with pytest.raises(FetchError) as raised:
        fetcher.get(timeout=5)
    assert raised.value.__cause__ is not_found
    assert raised.value.shard_id == SHARD
    assert fetcher.error is not_found
    assert fetcher.finished
    # every later call says the same, at once
    with pytest.raises(FetchError):
        fetcher.get()


def test_fatal_error_on_get_shard_iterator_surfaces(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetShardIterator"] = [
        error("ResourceNotFoundException", operation="GetShardIterator")
    ]
    fetcher = make(shard)
    running.append(fetcher)
    fetcher.start()
    with pytest.raises(FetchError):
        fetcher.get(timeout=5)
    assert shard.get_records_calls == []


def test_start_twice_is_refused(running: list[ShardPipeline]) -> None:
    fetcher = make(FakeShard([]))
    running.append(fetcher)
    fetcher.start()
    with pytest.raises(RuntimeError):
        fetcher.start()


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


def wait_active(client: Any, stream: str) -> None:
    for _ in range(300):
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        time.sleep(0.1)
    raise AssertionError(f"stream {stream} never became ACTIVE")


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
        # nothing beyond: a duplicate would already be queued behind the last page
        assert fetcher.get(timeout=0.5) is None
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
    wait_active(client, stream)
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
            StartPosition(TRIM_HORIZON),
            ShardAddress(shard_id, stream_name=stream),
            max_records=2,  # small pages: the read spans many GetRecords calls
            idle_time_s=0.05,
            hash_range=hash_range,
            metrics=metrics,
        )
        assert read_all(fetcher, len(expected[shard_id])) == expected[shard_id]
        assert sample(metrics, "kclpy_records_filtered_total", shard_id=shard_id) == 0
        assert sample(metrics, "kclpy_deaggregation_errors_total", shard_id=shard_id) == 0

        # restart from a checkpoint inside the second aggregate (sub-record 2 of 7 done)
        done = next(i for i, (_, _, p) in enumerate(expected[shard_id]) if b"agg-3-2" in p)
        checkpoint_seq, checkpoint_sub, _ = expected[shard_id][done]
        assert checkpoint_sub == 2
        resumed = polling(
            client,
            StartPosition.from_checkpoint(checkpoint_seq, checkpoint_sub, None),
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
    wait_active(client, stream)
    parent = client.list_shards(StreamName=stream)["Shards"][0]
    expected = put_mixed(client, stream, parent)
    client.split_shard(
        StreamName=stream, ShardToSplit=parent["ShardId"], NewStartingHashKey=str(2**127)
    )
    wait_active(client, stream)

    fetcher = polling(
        client,
        StartPosition(TRIM_HORIZON),
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


# -- the lease coordinator's retrieval gate ---------------------------------------------


def test_a_closed_gate_holds_fetching_and_handing_out_until_it_opens() -> None:
    shard = FakeShard([plain(i) for i in range(4)], page_size=2, closed=True)
    gate = threading.Event()
    fetcher = make(shard, gate=gate)
    fetcher.start()
    try:
        assert fetcher.get(timeout=0.3) is None
        assert (shard.shard_iterator_calls, shard.get_records_calls) == ([], [])
        gate.set()
        first = fetcher.get(timeout=10)
        assert first is not None and payloads([first]) == [b"plain-0", b"plain-1"]
        with shard.called:
            shard.called.wait_for(lambda: len(shard.get_records_calls) == 2, timeout=10)
        gate.clear()
        # The second page is fetched and queued, but not handed out while the gate is shut.
        assert fetcher.get(timeout=0.3) is None
        gate.set()
        second = fetcher.get(timeout=10)
        assert second is not None and payloads([second]) == [b"plain-2", b"plain-3"]
        assert second.shard_end
    finally:
        fetcher.stop()


def test_a_fetcher_stops_while_its_gate_is_shut() -> None:
    gate = threading.Event()
    fetcher = make(FakeShard([plain(0)]), gate=gate)
    fetcher.start()
    fetcher.stop(timeout=10)
    assert fetcher.get(timeout=None) is None
