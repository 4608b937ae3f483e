"""Reading a batch's part of a shard (kclpy/spark/reading.py) against botocore's Stubber:
pages scripted call by call, each carrying Kinesis' ``Date`` as AWS sends it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kclpy.position import Position
from kclpy.spark.offsets import Budget, UptoEnd
from kclpy.spark.reading import BudgetedRead, ShardInfo, ShardReader, StreamRef, read_range
from tests.support import skew

SHARD = ShardInfo("shardId-000000000000", (), 0, 2**128 - 1, False)
#: the batch's end: every record of these scripts arrived a minute or more before it
UNTIL = skew.KINESIS_MS
#: pages without records ahead of the first record, as Kinesis answers a sparse shard read
#: from an old TRIM_HORIZON; MillisBehindLatest says more is there
EMPTY_PAGES = 5


def stubbed_client() -> Any:
    return boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="x",
                        aws_secret_access_key="x")


def script_empty_stretch(stubber: Stubber) -> None:
    """From TRIM_HORIZON: ``EMPTY_PAGES`` empty pages, then records 0 and 1 on one page,
    with record 2 stored after them."""
    k = skew.KINESIS_MS
    stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-0"))
    for n in range(1, EMPTY_PAGES + 1):
        stubber.add_response("get_records", skew.answer(
            k, Records=[], NextShardIterator=f"it-{n}", MillisBehindLatest=3_600_000))
    stubber.add_response("get_records", skew.answer(
        k, Records=[skew.record(0, k - 60_000), skew.record(1, k - 60_000)],
        NextShardIterator="it-10", MillisBehindLatest=60_000))


def ticking() -> Callable[[], float]:
    """A clock a second later at each look: any time budget is out after the first page."""
    return itertools.count().__next__


def reader_from(client: Any, start: Position) -> ShardReader:
    return ShardReader(client, StreamRef("s"), SHARD, start, until_ms=UNTIL)


def test_a_read_out_of_time_among_empty_pages_goes_on_to_a_row_and_ends_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``maxFetchDuration`` ran out on the first of a stretch of empty pages. The read
    ended at its own start: each batch walked the same pages and ran out again, and the
    shard never moved. It reads on to its first row now and ends after the page that holds
    it; the next batch starts there, and the two batches hold every record once."""
    monkeypatch.setattr(time, "sleep", lambda _: None)
    end = UptoEnd(Position.trim_horizon(), UNTIL, Budget(duration_ms=1), "p1")
    client = stubbed_client()
    with Stubber(client) as stubber:
        script_empty_stretch(stubber)
        reading = BudgetedRead(reader_from(client, end.start), end, clock=ticking())
        first = [r.binary_data for records in reading for r in records]
        stubber.assert_no_pending_responses()
    assert first == [b"r0", b"r1"], "the empty pages, then the page that holds rows"
    assert reading.reached == Position("101")

    k = skew.KINESIS_MS
    following = UptoEnd(Position("101"), UNTIL, Budget(duration_ms=1), "p2")
    with Stubber(client) as stubber:
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-20"))
        stubber.add_response("get_records", skew.answer(
            k, Records=[skew.record(1, k - 60_000), skew.record(2, k - 50_000)],
            NextShardIterator="it-21", MillisBehindLatest=50_000))
        reading = BudgetedRead(reader_from(client, following.start), following,
                               clock=ticking())
        second = [r.binary_data for records in reading for r in records]
        stubber.assert_no_pending_responses()
    assert second == [b"r2"]
    assert reading.reached == Position("102")


def test_a_rerun_reads_through_the_empty_pages_to_the_recorded_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch Spark runs again reads to the end its first attempt recorded (``read_range``
    to that record): the same rows, the empty pages crossed again."""
    monkeypatch.setattr(time, "sleep", lambda _: None)
    client = stubbed_client()
    with Stubber(client) as stubber:
        script_empty_stretch(stubber)
        rows = [r.binary_data for records in read_range(
            reader_from(client, Position.trim_horizon()), Position("101")) for r in records]
        stubber.assert_no_pending_responses()
    assert rows == [b"r0", b"r1"]


def test_a_read_out_of_time_after_a_row_still_ends_after_that_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a row is read, time ends the read after the page that outlasts the budget, as
    before: here the first page of records."""
    monkeypatch.setattr(time, "sleep", lambda _: None)
    k = skew.KINESIS_MS
    end = UptoEnd(Position.trim_horizon(), UNTIL, Budget(duration_ms=1), "p1")
    client = stubbed_client()
    with Stubber(client) as stubber:
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-0"))
        stubber.add_response("get_records", skew.answer(
            k, Records=[skew.record(0, k - 60_000)], NextShardIterator="it-1",
            MillisBehindLatest=60_000))
        reading = BudgetedRead(reader_from(client, end.start), end, clock=ticking())
        rows = [r.binary_data for records in reading for r in records]
        stubber.assert_no_pending_responses()
    assert rows == [b"r0"] and reading.reached == Position("100")
