"""Reading shards between positions: what the source's executors do, and the driver's probes.

A batch's end is fixed when the driver plans it, but the driver does not read the batch:
Kinesis has no call that says where a shard's data ends, and reading forward to find out
would fetch every record twice (once on the driver, once on an executor) and make the driver
the bottleneck. Instead a batch ends at an arrival time (``AT_TIMESTAMP/<ms>`` as an end:
every record that arrived before it) chosen a settle margin in the past, so every record of
the batch is already stored when the batch is planned, and a batch re-run after a failure
reads exactly the same records. The driver only probes: one ``GetRecords(Limit=1)`` from
each shard's position says whether anything new is there and when it arrived.

A budget (rows, bytes, time per trigger) ends a batch where the executor stops
(:class:`BudgetedRead`), which the executor records for the driver
(:mod:`kclpy.spark.metadata`); the driver reads those records itself only when nothing was
recorded, which a deterministic budget (rows, bytes) allows.

"At the tip" is a page with no records whose ``MillisBehindLatest`` is 0 (or absent), or a
shard end (no next iterator) — never ``MillisBehindLatest`` alone: kinesis-mock reports 0 on
a page that ends inside the last PutRecords batch while records remain. A read bounded by
an arrival time ends at the tip only once Kinesis' own time has passed that time
(:mod:`kclpy.retrieval.clock`): a driver whose clock runs ahead of Kinesis' would otherwise
end a batch before records that still arrive before its end, which no batch would read.
The driver plans its ends on Kinesis' time too, so an executor seldom waits for it.

The reading itself is the worker's: :class:`ShardReader` is the polling source
(:mod:`kclpy.retrieval.polling`: iterators, expiry, retries, the time bound, a ``Limit`` per
read) under the read pipeline (:mod:`kclpy.retrieval.pipeline`: de-aggregation and the
resume point), stepped without the pipeline's thread. What is Spark's here is where a batch
ends: the probe, the budgets, the end a read must reach.

No threads, no state shared between calls: a reader lives for one task on one shard (or, on
the driver, for one shard's probes), which is what a pickled Spark reader needs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import ClientError

from kclpy.errors import KCLError
from kclpy.metrics import Metrics
from kclpy.position import AFTER, AT_TIMESTAMP, SHARD_END, Position
from kclpy.records import EMPTY, Record, Records
from kclpy.retrieval.modes import RetrievalContext, retrieval_mode
from kclpy.retrieval.pipeline import Batching, ShardPipeline
from kclpy.retrieval.source import ShardAddress
from kclpy.retry import (
    GaveUp,
    RetryPolicy,
    classify,
    is_not_found,
    is_transient,
    read_policy,
    retrying,
)
from kclpy.spark.offsets import UptoEnd

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

__all__ = [
    "BudgetedRead",
    "DataLossError",
    "EndNotFoundError",
    "Probe",
    "ShardInfo",
    "ShardReader",
    "StreamRef",
    "list_shards",
    "probe",
    "read_range",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Rows per Kinesis record of each (stream, shard) as this process last read it. A budget
#: counts rows, GetRecords' ``Limit`` counts Kinesis records, and a KPL aggregate holds
#: hundreds of rows: without the ratio a batch's first page was a whole 10 MiB page, cut to
#: the budget and fetched again by the next batch (about twice per row). Spark reuses its
#: Python workers, so the next task on a shard usually finds its predecessor's figure; a
#: process that has none asks as before. Only the ``Limit`` depends on it, never the rows.
_ROWS_PER_RECORD: dict[tuple[str, str], float] = {}


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


class DataLossError(KCLError, RuntimeError):
    """Records between a checkpointed position and what Kinesis still has are gone (trimmed
    by retention, or the shard expired): raised when ``failOnDataLoss`` is true."""


class EndNotFoundError(KCLError, RuntimeError):
    """The records a batch was planned with are not there (expired, or a different stream)."""


#: calls a task's read makes of one request before the error is raised: 8 retries
TASK_READ_ATTEMPTS = 9
#: a task's read retries with the source's default backoff (``SourceOptions.read_retries``)
TASK_READS = read_policy(max_attempts=TASK_READ_ATTEMPTS)


def list_shards(client: KinesisClient, stream: StreamRef,
                retries: RetryPolicy = TASK_READS) -> list[ShardInfo]:
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


def _retrying(operation: str, retries: RetryPolicy, call: Callable[[], _T],
              sleep: Callable[[float], None] = time.sleep) -> _T:
    """Retry throttles, server errors and dropped connections (:func:`kclpy.retry.classify`)
    as the source's reads are retried; the last failure is raised as it is."""
    def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
        log.warning("%s failed (%s); retrying in %.2fs: %s", operation, classify(exc), delay,
                    exc)

    try:
        return retrying(call, retries, retry_on=is_transient, wait=sleep,
                        on_retry=retry_later)
    except GaveUp as gave_up:
        raise gave_up.last from None


@dataclass
class Page:
    #: user records strictly after the start position and before the reader's time bound,
    #: de-aggregated and filtered
    records: Records
    #: the shard is closed and every record of it was returned
    shard_end: bool
    #: a page with no records and not behind: nothing more right now (for a reader with a
    #: time bound: and Kinesis' time has passed the bound, so the read ends here)
    at_tip: bool
    #: a record that arrived at or after the reader's ``until_ms`` was seen: the rest of the
    #: shard belongs to a later batch
    reached_bound: bool
    #: the arrival (epoch ms) of this page's first record after the start, None if there
    #: was none
    first_arrival_ms: int | None = None

    @property
    def done(self) -> bool:
        """Nothing more to read for the range this reader was made for."""
        return self.shard_end or self.at_tip or self.reached_bound


@dataclass(frozen=True)
class TaskRetrieval:
    """How a task reads its shard: the retrieval mode's name (each executor looks it up in
    the registry, so it travels as text), the registered consumer a fan-out mode reads
    through, and how often an idle subscription looks for a closed shard (some endpoints
    never end a subscription on a closed shard)."""

    mode: str = "polling"
    consumer_arn: str | None = None
    shard_end_probe_s: float = 30.0


POLLING_TASKS = TaskRetrieval()


class ShardReader:
    """Reads one shard forward from a position, one GetRecords page per ``next_page``,
    through the worker's own pieces: the polling source (iterators, GetRecords, expiry,
    retries, the ``until_ms`` bound, the per-read ``Limit``) and the read pipeline stepped
    without its thread (de-aggregation, the resume point inside an aggregate, the
    ``AT_TIMESTAMP`` drop, the trimmed-checkpoint check).

    ``until_ms``: the reader's time bound; records that arrived at or after it are not
    returned and the page that meets one reports ``reached_bound``. A start at
    ``AT_TIMESTAMP/<ms>`` drops records that arrived earlier on the client too, since some
    endpoints (kinesis-mock) position such an iterator only to the second. ``retries``: how
    failed calls are retried per page before the error is raised (Spark retries the task).

    ``retrieval``: the retrieval mode that builds the source (``retrieval/modes.py``'s
    registry, as the worker's), with its consumer: enhanced fan-out reads through that
    registered consumer's subscriptions, bounded the same way; ``close`` then ends the
    subscription, so the shard's next task can subscribe.
    """

    def __init__(
        self,
        client: KinesisClient,
        stream: StreamRef,
        shard: ShardInfo,
        start: Position,
        *,
        deaggregate: bool = True,
        limit: int = 10_000,
        until_ms: int | None = None,
        fail_on_data_loss: bool = True,
        retries: RetryPolicy = TASK_READS,
        retrieval: TaskRetrieval = POLLING_TASKS,
    ) -> None:
        if start.is_shard_end:
            raise ValueError(f"shard {shard.shard_id} is finished; nothing to read")
        self.stream = stream
        self.shard = shard
        self._start = start
        self._bounded = until_ms is not None
        self.limit = limit
        self._fail_on_data_loss = fail_on_data_loss
        address = ShardAddress(shard.shard_id, stream.stream_name, stream.stream_arn)
        # The worker's pieces count into a Metrics; a Spark task serves no /metrics, so
        # each reader keeps its own, private and gone with it (0.4 ms to build). What the
        # source reports goes through Spark's query progress (``fetched``).
        metrics = Metrics()
        self._source = retrieval_mode(retrieval.mode, "consumerMode").source(RetrievalContext(
            client, address, metrics, retries.backoff(), consumer_arn=retrieval.consumer_arn,
            max_records=limit, idle_time_s=0, until_ms=until_ms,
            shard_end_probe_s=retrieval.shard_end_probe_s))
        self._pipeline = ShardPipeline(
            self._source, start, batching=Batching(
                deliver_empty=True, deaggregate=deaggregate,
                hash_range=(shard.starting_hash_key, shard.ending_hash_key)),
            on_trimmed=self._trimmed if start.kind == AFTER else None, metrics=metrics,
            sleep=time.sleep)
        #: the page that ended the read, handed out again (without records) if asked
        self._over: Page | None = None
        #: gaps skipped with failOnDataLoss=false
        self.data_loss_events = 0

    @property
    def ended(self) -> bool:
        """The shard is closed and every record of it was returned."""
        return self._over is not None and self._over.shard_end

    @property
    def fetched(self) -> int:
        """Kinesis records fetched (for the records-fetched-per-row figure)."""
        return self._pipeline.records_fetched

    def close(self) -> None:
        """End what the source holds open (a subscription); reading again opens another."""
        self._source.close()

    def next_page(self, limit: int | None = None) -> Page:
        if self._over is not None:
            return self._over
        try:
            result = self._pipeline.fetch_once(limit or self.limit)
        except ClientError as exc:
            if not (exc.operation_name == "GetShardIterator" and self._start.kind == AFTER
                    and is_not_found(exc)):
                raise
            self._lost(f"shard {self.shard.shard_id} of {self.stream.label} is gone "
                       f"(expired) after {self._start.sequence_number}")
            self._over = Page(EMPTY, True, True, False)
            return self._over
        assert result is not None, "a reader's pipeline is never stopped"
        records = result.records
        # A record without an arrival time (optional in the API, AWS always sends it) counts
        # as settled long ago.
        first_ms = (records[0].timestamp_millis or 0) if records else None
        # A bounded read's tip is its end only once Kinesis' time passed the bound (the
        # source then ends the read there); before that it is one more page to look past.
        at_tip = result.at_tip and (result.shard_end or not self._bounded)
        page = Page(records, result.shard_closed and not result.bound_reached, at_tip,
                    result.bound_reached, first_ms)
        if result.shard_end:
            self._over = Page(EMPTY, page.shard_end, page.at_tip, page.reached_bound)
        return page

    def _trimmed(self, checkpoint: str, first: str) -> None:
        """An AFTER start resumes AT its sequence number: the first record back must be that
        record. A later one means Kinesis no longer has it (retention)."""
        self._lost(f"shard {self.shard.shard_id} of {self.stream.label}: records after "
                   f"{checkpoint} up to {first} are no longer in the stream (trimmed by "
                   "retention?)")

    def _lost(self, message: str) -> None:
        if self._fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip them")
        log.warning("kinesis source: data loss: %s; skipped (failOnDataLoss=false)", message)
        self.data_loss_events += 1


@dataclass
class Probe:
    """What a shard holds after a position, as far as the driver looked."""

    #: arrival (epoch ms) of the first record after the position; None: none seen yet
    first_arrival_ms: int | None = None
    #: the shard is closed and nothing is left after the position
    shard_end: bool = False
    #: the probe stepped over records it could not use (before an ``AT_TIMESTAMP`` start,
    #: already consumed, outside the shard's hash keys) for all its calls without reaching
    #: the tip: there may be something, so the shard is treated as holding something
    undecided: bool = False


def probe(reader: ShardReader, max_pages: int = 64) -> Probe:
    """Look for the first record after the reader's start, one record per call at first.

    The reader keeps its iterator, so the next probe of an idle shard is one GetRecords and
    no GetShardIterator. Records dropped on the client (already consumed, or before an
    ``AT_TIMESTAMP`` start: with botocore's default second-precision timestamps an
    iterator lands up to a second early, on a whole second of older records) are stepped
    over with a growing ``Limit``. "Nothing new" is only ever concluded from the tip or the
    shard's end, never from running out of calls: a probe that gave up after a few pages
    of older records once made a LATEST query skip a whole batch.
    """
    limit = 1
    for _ in range(max_pages):
        page = reader.next_page(limit)
        if page.first_arrival_ms is not None:
            return Probe(page.first_arrival_ms)
        if page.shard_end:
            return Probe(shard_end=True)
        if page.at_tip:
            return Probe()
        limit = min(limit * 10, reader.limit)
    return Probe(undecided=True)


class BudgetedRead:
    """The records of an ``UPTO`` end: from its start, those that arrived before its time,
    until one of its budgets is spent. Iterate it for the records (page by page); then
    ``reached`` is the position it stopped at, ready for the next batch to start from.

    Rows are a strict bound and cut the GetRecords ``Limit`` (in Kinesis records, at the
    rows per record seen on the shard: :data:`_ROWS_PER_RECORD`); bytes stop after the
    record that reaches them (the ``Limit`` is cut to an estimate from the sizes seen so
    far); time is checked between pages, once the read has yielded a row. ``timed=False``
    ignores the time budget: what the driver does to find again an end that no executor
    recorded.

    Why not before a row: a read stopped by time must end at a position the next batch
    starts from, and empty pages name none. Kinesis answers a sparse shard read from an old
    ``TRIM_HORIZON`` with many pages without records (and records a part drops - before an
    ``AT_TIMESTAMP`` start, outside the shard's hash keys - yield no row either); a read
    that ran out of time among them ended at its own start, so every batch walked the same
    pages again and the shard never moved. An empty page's only trace is its iterator,
    which expires and is no offset; its ``MillisBehindLatest`` is no arrival time to resume
    from (kinesis-mock counts it back from the tip's last record, so a time made of it can
    be later than records not yet read). A dropped record has a sequence number, but a
    re-run reads to its recorded end by the rows it yields (``read_range``), and a dropped
    record is none of them. So the read goes on past the deadline to its first row (or the
    tip, the bound, the shard's end): one batch takes longer than the budget, and every
    later batch starts past those pages. The end is recorded like any other, so a re-run
    still reads exactly to it.
    """

    def __init__(self, reader: ShardReader, end: UptoEnd, *, timed: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reader = reader
        self._end = end
        self._budget = end.budget
        self._timed = timed
        self._clock = clock
        self.reached: Position | None = None
        self.rows = 0
        #: payload bytes read, counted only under a bytes budget
        self.bytes = 0
        self._shard = (reader.stream.label, reader.shard.shard_id)
        #: whole pages' rows and the Kinesis records fetched for them
        self._page_rows = self._page_records = 0

    def __iter__(self) -> Iterator[Records]:
        budget, reader = self._budget, self._reader
        last: Record | None = None
        deadline = (self._clock() + budget.duration_ms / 1000
                    if self._timed and budget.duration_ms is not None else None)
        while True:
            fetched = reader.fetched
            page = reader.next_page(self._limit())
            self._learn(len(page.records), reader.fetched - fetched)
            records, full = self._cut(page.records)
            if records:
                last = records[-1]
                yield records
            if full:
                break
            if page.reached_bound or page.at_tip:
                self.reached = Position.at_timestamp(self._end.until_ms)
                return
            if page.shard_end:
                self.reached = Position.shard_end()
                return
            if deadline is not None and last is not None and self._clock() >= deadline:
                break
        # A budget stops the read only after a row: it always ends after one.
        assert last is not None
        self.reached = Position.after(last)

    def _learn(self, rows: int, records: int) -> None:
        if records:
            self._page_rows += rows
            self._page_records += records
            _ROWS_PER_RECORD[self._shard] = self._page_rows / self._page_records

    def _limit(self) -> int:
        """No more Kinesis records than the rows left in the budgets need."""
        rows_left: int | None = None
        if self._budget.rows is not None:
            rows_left = self._budget.rows - self.rows
        if self._budget.bytes is not None and self.rows:
            average = max(1, self.bytes // self.rows)
            by_bytes = (self._budget.bytes - self.bytes) // average + 1
            rows_left = by_bytes if rows_left is None else min(rows_left, by_bytes)
        limit = self._reader.limit
        if rows_left is not None:
            # Fewer rows than records (records dropped before the start or outside the
            # shard's keys) ask for more records, up to the reader's limit.
            per_record = _ROWS_PER_RECORD.get(self._shard) or 1.0
            limit = min(limit, math.ceil(rows_left / per_record))
        return max(1, limit)

    def _cut(self, records: Records) -> tuple[Records, bool]:
        """The part of a page within the budgets, and whether a budget is now spent."""
        take = len(records)
        full = False
        if self._budget.rows is not None and self.rows + take >= self._budget.rows:
            take = self._budget.rows - self.rows
            full = True
        if self._budget.bytes is not None:
            size = self.bytes
            for i in range(take):
                size += records[i].size
                if size >= self._budget.bytes:
                    take = i + 1
                    full = True
                    break
        if take < len(records):
            records = records[:take]
        self.rows += len(records)
        # Counted only for a bytes budget: over a page's base64 text, a twentieth of a
        # task's reading on 200 B records.
        if self._budget.bytes is not None and records:
            self.bytes += records.payload_bytes()
        return records, full


def read_range(
    reader: ShardReader, end: Position, *,
    idle_s: float = 0.5, idle_limit: int = 20, sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Records]:
    """The records after the reader's start through ``end``, page by page.

    ``end`` is ``AFTER`` (through that user record), ``AT_TIMESTAMP`` (everything that arrived
    before it: the reader must have been made with that ``until_ms``) or ``SHARD_END``.

    Raises EndNotFoundError when an ``AFTER`` or ``SHARD_END`` end is not reached (the shard
    ended before it, or the stream stays at its tip without it), instead of returning a short
    batch that would then be committed as complete.
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
                    if ext != target:
                        raise EndNotFoundError(
                            f"shard {shard_id}: record {end.encode()} not found (passed it)")
                    yield records[: i + 1]
                    return
        if records:
            idle = 0
            yield records
        if end.kind == AT_TIMESTAMP and (page.reached_bound or page.at_tip or page.shard_end):
            return
        if page.shard_end:
            if end.kind == SHARD_END:
                return
            raise EndNotFoundError(f"shard {shard_id}: ended before {end.encode()}")
        if page.at_tip:
            idle += 1
            if idle > idle_limit:
                raise EndNotFoundError(
                    f"shard {shard_id}: at its tip without reaching {end.encode()}")
            sleep(idle_s)
