"""Reading shards between positions: what the source's driver and executors both do.

The Kinesis API has no call that says where a shard's data ends, so the driver finds a
batch's end offset by reading (to the tip, or to the row limit), and the executors then read
exactly the same records again, from the start offset through the end offset. Both sides go
through :class:`ShardReader`, with the same de-aggregation and hash-key filtering, so they
agree on which user records lie between two positions.

No threads, no state shared between calls: a reader lives for one call on one shard, which
is what a pickled Spark reader and a short-lived task need.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import ClientError

from kclpy.records import EMPTY, Record, Records
from kclpy.retrieval.backoff import Backoff, classify
from kclpy.retrieval.kpl import HashKeyRange, deaggregate
from kclpy.retrieval.parse import get_records
from kclpy.spark.offsets import AFTER, AT_TIMESTAMP, SHARD_END, TRIM_HORIZON, ShardPosition

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

__all__ = [
    "ShardInfo",
    "ShardReader",
    "StreamRef",
    "advance",
    "list_shards",
    "read_range",
    "tip",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class StreamRef:
    stream_name: str | None = None
    stream_arn: str | None = None

    def __post_init__(self) -> None:
        if not self.stream_name and not self.stream_arn:
            raise ValueError("need a stream name or a stream ARN")

    @property
    def label(self) -> str:
        """The name for the ``stream`` column (the ARN's last part when only the ARN is set)."""
        if self.stream_name:
            return self.stream_name
        assert self.stream_arn is not None
        return self.stream_arn.rsplit("/", 1)[-1]

    def params(self) -> dict[str, str]:
        if self.stream_arn:
            return {"StreamARN": self.stream_arn}
        assert self.stream_name is not None
        return {"StreamName": self.stream_name}


@dataclass(frozen=True)
class ShardInfo:
    shard_id: str
    parent_shard_ids: tuple[str, ...]
    starting_hash_key: int
    ending_hash_key: int
    #: the shard is closed (split or merged): its data ends somewhere
    closed: bool


def list_shards(client: KinesisClient, stream: StreamRef, retries: int = 8) -> list[ShardInfo]:
    """Every shard the stream still has (closed ones within retention included).

    Pages follow AWS's rule that a call with ``NextToken`` names nothing else.
    """
    shards: list[ShardInfo] = []
    params: dict[str, Any] = dict(stream.params())
    while True:
        page = _retrying("ListShards", retries, partial(client.list_shards, **params))
        for s in page.get("Shards", []):
            parents = tuple(p for p in (s.get("ParentShardId"), s.get("AdjacentParentShardId"))
                            if p)
            hash_range = s["HashKeyRange"]
            shards.append(ShardInfo(
                s["ShardId"], parents, int(hash_range["StartingHashKey"]),
                int(hash_range["EndingHashKey"]),
                "EndingSequenceNumber" in s.get("SequenceNumberRange", {})))
        token = page.get("NextToken")
        if not token:
            return shards
        params = {"NextToken": token}


def _retrying(operation: str, retries: int, call: Callable[[], _T],
              sleep: Callable[[float], None] = time.sleep) -> _T:
    """Retry throttles, server errors and dropped connections with jittered backoff; a
    Spark task that still fails after that is better retried by Spark than stuck here."""
    backoff = Backoff(0.2, 5.0)
    while True:
        try:
            return call()
        except Exception as exc:
            kind = classify(exc)
            if kind is None or backoff.attempt >= retries:
                raise
            delay = backoff.next_delay()
            log.warning("%s failed (%s); retrying in %.2fs: %s", operation, kind, delay, exc)
            sleep(delay)


@dataclass
class Page:
    #: user records strictly after the start position, de-aggregated and filtered
    records: Records
    #: the shard is closed and every record of it was returned
    shard_end: bool
    #: nothing more to read right now
    caught_up: bool


class ShardReader:
    """Reads one shard forward from a position, one GetRecords page per ``next_page``."""

    def __init__(
        self,
        client: KinesisClient,
        stream: StreamRef,
        shard: ShardInfo,
        start: ShardPosition,
        *,
        deaggregate: bool = True,
        limit: int = 10_000,
        retries: int = 8,
    ) -> None:
        if start.is_shard_end:
            raise ValueError(f"shard {shard.shard_id} is finished; nothing to read")
        self._client = client
        self._stream = stream
        self.shard = shard
        self._start = start
        self._deaggregate = deaggregate
        self._key_range = HashKeyRange(shard.starting_hash_key, shard.ending_hash_key)
        self._limit = limit
        self._retries = retries
        self._iterator: str | None = None
        self._skip_through = start.extended if start.kind == AFTER else None
        #: the last Kinesis record (aggregate or plain) returned whole: an expired iterator
        #: resumes after it
        self._last_raw: str | None = None
        self.ended = False

    def next_page(self) -> Page:
        if self.ended:
            return Page(EMPTY, True, True)
        expired = 0
        while True:
            if self._iterator is None:
                self._iterator = self._get_iterator()
            iterator = self._iterator
            try:
                page = _retrying("GetRecords", self._retries,
                                 partial(get_records, self._client, iterator, self._limit))
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code != "ExpiredIteratorException" or expired >= 3:
                    raise
                expired += 1
                self._iterator = None
                continue
            break
        self._iterator = page.next_shard_iterator
        raw = page.records
        records = Records([raw])
        if raw:
            self._last_raw = raw[-1].sequence_number
            if self._deaggregate:
                records = deaggregate(raw, key_range=self._key_range).records
            records = self._drop_consumed(records)
        self.ended = page.next_shard_iterator is None
        millis = page.millis_behind_latest
        caught_up = millis == 0 or (millis is None and not raw)
        return Page(records, self.ended, caught_up or self.ended)

    def _drop_consumed(self, records: Records) -> Records:
        skip = self._skip_through
        if skip is None:
            return records
        records = records.after(skip)
        if records:
            self._skip_through = None
        return records

    def _get_iterator(self) -> str:
        params: dict[str, Any] = {**self._stream.params(), "ShardId": self.shard.shard_id}
        start = self._start
        if self._last_raw is not None:
            params.update(ShardIteratorType="AFTER_SEQUENCE_NUMBER",
                          StartingSequenceNumber=self._last_raw)
        elif start.kind == AFTER:
            # AT, not AFTER: the rest of a KPL aggregate may still be due; _drop_consumed
            # removes what was consumed.
            params.update(ShardIteratorType="AT_SEQUENCE_NUMBER",
                          StartingSequenceNumber=start.sequence_number)
        elif start.kind == AT_TIMESTAMP:
            assert start.timestamp_ms is not None
            params.update(ShardIteratorType=AT_TIMESTAMP, Timestamp=datetime.fromtimestamp(
                start.timestamp_ms / 1000, tz=timezone.utc))
        else:
            params.update(ShardIteratorType=TRIM_HORIZON)
        response = _retrying("GetShardIterator", self._retries,
                             partial(self._client.get_shard_iterator, **params))
        return response["ShardIterator"]


def _beyond(record: Record, bound: ShardPosition | None) -> bool:
    """Whether ``record`` lies past ``bound`` (an AvailableNow target; None: no bound)."""
    if bound is None or bound.kind == SHARD_END:
        return False
    if bound.kind == AFTER:
        return record.extended_sequence_number > bound.extended
    if bound.kind == AT_TIMESTAMP:
        # The tip probe saw no record from this time on: anything stamped since came later.
        assert bound.timestamp_ms is not None
        ts = record.timestamp_millis
        return ts is not None and ts >= bound.timestamp_ms
    return True


def advance(
    reader: ShardReader, start: ShardPosition, max_rows: int | None,
    bound: ShardPosition | None = None,
) -> tuple[ShardPosition, int]:
    """Read from ``start`` to the tip (or ``max_rows`` records, or ``bound``): the position
    reached and the number of records passed."""
    if max_rows == 0:
        return start, 0
    last: Record | None = None
    count = 0
    while True:
        page = reader.next_page()
        stopped = False
        for record in page.records:
            if _beyond(record, bound) or count == max_rows:
                stopped = True
                break
            last = record
            count += 1
            if bound is not None and bound.kind == AFTER and (
                    record.extended_sequence_number == bound.extended):
                stopped = True
                break
        if stopped or count == max_rows:
            break
        if page.shard_end:
            return ShardPosition.shard_end(), count
        if page.caught_up:
            break
    return (ShardPosition.after(last) if last is not None else start), count


def tip(reader: ShardReader, window_start_ms: int) -> ShardPosition:
    """Where the shard's data ends now, read from ``window_start_ms`` on (the reader must
    start there): the last record, SHARD_END for a closed shard, or — no record since the
    window start — that time, which then stands for "everything before it"."""
    last: Record | None = None
    while True:
        page = reader.next_page()
        if page.records:
            last = page.records[-1]
        if page.shard_end:
            return ShardPosition.shard_end()
        if page.caught_up:
            break
    return ShardPosition.after(last) if last is not None else ShardPosition.at_timestamp(
        window_start_ms)


class EndNotFoundError(RuntimeError):
    """The records a batch was planned with are not there (expired, or a different stream)."""


def read_range(
    reader: ShardReader, end: ShardPosition, *, idle_s: float = 0.5, idle_limit: int = 20,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Records]:
    """The records after the reader's start through ``end`` (AFTER or SHARD_END), page by page.

    Raises EndNotFoundError when the shard ends before ``end`` or when the stream stays
    caught up without reaching it, instead of returning a short batch that would then be
    committed as complete.
    """
    shard_id = reader.shard.shard_id
    target = end.extended if end.kind == AFTER else None
    idle = 0
    while True:
        page = reader.next_page()
        records = page.records
        if target is not None:
            for i, record in enumerate(records):
                ext = record.extended_sequence_number
                if ext >= target:
                    keep = records[: i + 1] if ext == target else records[:i]
                    if ext != target:
                        raise EndNotFoundError(
                            f"shard {shard_id}: record {end.encode()} not found (passed it)")
                    if keep:
                        yield keep
                    return
        if records:
            idle = 0
            yield records
        if page.shard_end:
            if target is None:
                return
            raise EndNotFoundError(f"shard {shard_id}: ended before {end.encode()}")
        if page.caught_up and not records:
            idle += 1
            if idle > idle_limit:
                raise EndNotFoundError(
                    f"shard {shard_id}: caught up without reaching {end.encode()}")
            sleep(idle_s)
