"""The polling page source: GetShardIterator once, then GetRecords page after page.

Positions follow the Java KCL: a checkpoint ``(sequence, sub-sequence)`` is the last record
done, so the iterator is taken AT that sequence number (the rest of a KPL aggregate may still
be due; the pipeline drops every user record at or before the checkpoint). After an
``ExpiredIteratorException`` the new iterator starts AFTER the last Kinesis record already
handled, or at the original position if nothing was read yet. Neither a restart nor an
expiry loses or repeats a record.

Two options make it lag recovery's gap reader, and nothing else changes for that: ``pacer``
(the worker-wide records-per-second budget, asked before each GetRecords for its ``Limit``)
and ``until_ms`` (the read ends, as at a shard end, before the first record that arrived at
or after it, or at the tip). The Spark source's executors read a batch's part with the same
two (``until_ms``: the batch's end; ``Reading.limit``: what its budget still allows), and its
driver probes with ``Reading.limit`` alone. A page says which end it met, apart: the shard
closed (``shard_closed``), the bound (``bound_reached``), the tip (``at_tip``: an empty page
not behind, never ``MillisBehindLatest`` alone).

A bounded read ends at the tip only once Kinesis' own time, as its answers show it
(:mod:`kclpy.retrieval.clock`), had passed ``until_ms`` when the GetRecords was sent: a
bound still in Kinesis' future (one computed on a local clock running ahead) keeps the read
polling the tip, and waiting ``idle_s`` between two looks, until a record at or after the
bound arrives or Kinesis' time passes it.

A tool's or a probe's look at a shard (the lag probe, ``kclpy checkpoint set --to``) reads
through the same source too (``one_off_pages``), with no retries and no pipeline.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from botocore.exceptions import ClientError

from kclpy.metrics import (
    CLOCK_SKEW,
    GET_RECORDS,
    ITERATOR_EXPIRATIONS,
    MILLIS_BEHIND_LATEST,
    Metrics,
)
from kclpy.position import Position
from kclpy.records import Record
from kclpy.retrieval.clock import kinesis_clock
from kclpy.retrieval.page import Page
from kclpy.retrieval.parse import get_records, install_fast_get_records
from kclpy.retrieval.source import Reading, Retrying, ShardAddress, Stopped
from kclpy.retry import Backoff, GaveUp, RetryPolicy, error_code, retrying

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

logger = logging.getLogger(__name__)

#: the longest a bounded read waits at the tip before looking again while Kinesis' time has
#: not reached its bound (it waits less when the bound is nearer)
BOUND_WAIT_S = 1.0
#: the shortest such wait: the tip is not polled in a busy loop
BOUND_WAIT_MIN_S = 0.05


def _short(iterator: str) -> str:
    """Iterators are bearer tokens for the shard's data: never log them whole."""
    return f"{iterator[:12]}..."


class Pacer(Protocol):
    """A budget of records to read (lag recovery's rate bound): asked before each GetRecords
    for its ``Limit``, given back what the page did not use."""

    def take(self, want: int, stop: threading.Event) -> int:
        """Records granted (at most ``want``); 0 once ``stop`` is set."""

    def give_back(self, records: int) -> None: ...


def get_iterator(client: KinesisClient, address: ShardAddress, reading: Reading,
                 retrying: Retrying) -> str:
    """A fresh iterator: after the last record handled, else at the start position."""
    params = address.params()
    kind, sequence_number, timestamp = reading.resume_point(reading.last_sequence_number)
    params["ShardIteratorType"] = kind
    if sequence_number is not None:
        params["StartingSequenceNumber"] = sequence_number
    if timestamp is not None:
        params["Timestamp"] = timestamp
    response = retrying.call(
        reading, "GetShardIterator", lambda: client.get_shard_iterator(**params))
    iterator: str = response["ShardIterator"]
    logger.debug("shard %s: %s iterator %s", address.lease_key, kind, _short(iterator))
    return iterator


class PollingSource:
    """GetRecords pages of one shard, ``max_records`` at most each (``pacer``: fewer)."""

    def __init__(
        self,
        client: KinesisClient,
        address: ShardAddress,
        *,
        max_records: int = 10000,
        idle_time_s: float = 1.0,
        backoff: Backoff | None = None,
        metrics: Metrics | None = None,
        pacer: Pacer | None = None,
        until_ms: int | None = None,
        probe: bool = False,
    ) -> None:
        if not 1 <= max_records <= 10000:
            raise ValueError("max_records must be between 1 and 10000")
        self._client = client
        self.address = address
        self._idle_s = idle_time_s
        #: ms still between Kinesis' time and the bound, when the last page was a tip the
        #: bounded read could not end at yet (0: not waiting for Kinesis' time)
        self._short_ms = 0
        self._max_records = max_records
        m = metrics if metrics is not None else Metrics()
        self._retrying = Retrying(address, backoff, m)
        #: GetRecords Limits come from this budget
        self._pacer = pacer
        #: the read ends before the first record that arrived at or after this (epoch ms)
        self._until_ms = until_ms
        #: a tool's or a probe's look: the ends it meets are the shard consumer's to log
        self._probe = probe
        shard = m.shard(address.lease_key, address.shard_id, address.stream_id)
        self._m_get_records = shard.bind(GET_RECORDS)
        self._m_expired = shard.bind(ITERATOR_EXPIRATIONS)
        self._m_behind = shard.bind(MILLIS_BEHIND_LATEST)
        self._m_skew = m.bind(CLOCK_SKEW)
        #: Kinesis' time as this client's answers show it: where a bounded read ends
        self._kinesis_clock = kinesis_clock(client)
        self._iterator: str | None = None
        #: Kinesis records the service returned (aggregates count one): what a read costs
        self.records_fetched = 0
        install_fast_get_records(client)

    @property
    def idle_s(self) -> float:
        """The wait after an empty page at the tip: the idle time between reads, and for a
        bounded read whose bound Kinesis' time has not reached, up to ``BOUND_WAIT_S``."""
        short = self._short_ms
        if not short:
            return self._idle_s
        return max(self._idle_s, min(BOUND_WAIT_S, max(BOUND_WAIT_MIN_S, short / 1000)))

    def status(self) -> dict[str, Any]:
        return {"mode": "polling"}

    def close(self) -> None:
        """An iterator holds nothing open."""

    def read(self, reading: Reading) -> Page[Sequence[Record]]:
        """One GetRecords (with retries), a fresh iterator first when there is none."""
        limit = self._max_records
        if reading.limit is not None:
            limit = max(1, min(limit, reading.limit))
        if self._pacer is not None:
            limit = self._pacer.take(limit, reading.stop)
            if not limit:
                raise Stopped
        backoff = self._retrying.backoff

        def once() -> tuple[Page[Sequence[Record]], int | None]:
            stale = self._iterator is not None
            try:
                return self._next_page(reading, limit)
            except ClientError as exc:
                if not stale or not _expired(exc):
                    raise
            # An iterator kept since the last read may well have expired (after 300 s): a
            # fresh one is due at once, not after a backoff.
            return self._next_page(reading, limit)

        try:
            # A brand-new iterator should not expire: back off rather than spin against a
            # service (or clock) that keeps answering so, and give up when the policy does.
            page, kinesis_ms = retrying(once, backoff, retry_on=_expired, wait=reading.pause)
        except GaveUp as gave_up:
            raise gave_up.last from None
        # Only a page is progress: a fresh iterator that then expires again must not reset.
        backoff.reset()
        clock = self._kinesis_clock
        self._iterator = page.next_shard_iterator
        millis = page.millis_behind_latest
        # A bounded read (a recovery gap) is behind on purpose: the shard's gauge is live's.
        if millis is not None and self._until_ms is None:
            self._m_behind.set(millis)
        if self._pacer is not None:
            self._pacer.give_back(limit - len(page.records))
        self.records_fetched += len(page.records)
        clock.observe_page(page.records, millis)
        skew = clock.skew_ms()
        if skew is not None:
            self._m_skew.set(skew / 1000)
        caught_up = millis == 0 or (millis is None and not page.records)
        closed = page.next_shard_iterator is None
        # the parse's page, completed with what only the source decides
        page.caught_up, page.at_tip = caught_up, caught_up and not page.records
        page.shard_end = page.shard_closed = closed
        if kinesis_ms is None:
            # An endpoint that showed no time of its own (no Date header): the local
            # clock, as before there was a Kinesis clock.
            kinesis_ms = round(time.time() * 1000)
        result = page.within(self._until_ms, kinesis_ms)
        until = self._until_ms
        self._short_ms = (until - kinesis_ms if until is not None and result.at_tip
                          and not result.shard_end else 0)
        if self._short_ms and not self._probe:
            logger.debug("shard %s: at the tip %d ms before Kinesis' time reaches the "
                         "read's end; looking again", self.address.lease_key, self._short_ms)
        if result.shard_end and not self._probe:
            if not closed:
                # a recovery read: the shard is open, only the gap being read is over
                logger.info("shard %s: the recovery gap was read to its end",
                            self.address.lease_key)
            else:
                logger.info("shard %s reached its end", self.address.lease_key)
        return result

    def _next_page(self, reading: Reading, limit: int
                   ) -> tuple[Page[Sequence[Record]], int | None]:
        """One GetRecords (with retries) and Kinesis' time shown before it, a fresh iterator
        first when there is none; an iterator that expired is counted and dropped."""
        if self._iterator is None:
            self._iterator = get_iterator(self._client, self.address, reading, self._retrying)
        # Taken before the call: the tip the answer shows is at least this late.
        kinesis_ms = self._kinesis_clock.shown_ms()
        try:
            page = self._retrying.call(
                reading, "GetRecords",
                functools.partial(self._timed_get_records, self._iterator, limit))
        except ClientError as exc:
            if _expired(exc):
                self._m_expired.inc()
                logger.info("iterator for %s expired; re-positioning", self.address.lease_key)
                self._iterator = None
            raise
        return page, kinesis_ms

    def _timed_get_records(self, iterator: str, limit: int) -> Page[Sequence[Record]]:
        started = time.perf_counter()
        ok = False
        try:
            page = get_records(self._client, iterator, limit)
            ok = True
            return page
        finally:
            self._m_get_records.call(time.perf_counter() - started, ok)



def _expired(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and error_code(exc) == "ExpiredIteratorException"


#: a one-off read's calls: the first failure is the caller's to report (it looks again later)
_ONCE = RetryPolicy(0.0, 0.0, max_attempts=1)


@functools.cache
def _uncounted() -> Metrics:
    """Metrics no worker serves, and without shard scopes: a probe's reads are not the
    shard's consumption."""
    metrics = Metrics()
    metrics.implicit_shards = False
    return metrics


def one_off_pages(client: KinesisClient, address: ShardAddress, start: Position, *,
                  after: str | None = None, limit: int = 10000
                  ) -> Generator[Page[Sequence[Record]], None, None]:
    """The shard's pages from ``start`` (or after the Kinesis record ``after``), read by a
    polling source for a tool or a probe: every call tried once, nothing counted in the
    worker's metrics, Kinesis records as the service returns them (aggregates whole). Ends
    after the page that finds the shard closed; the caller stops at the tip or earlier."""
    source = PollingSource(client, address, max_records=limit, idle_time_s=0.0,
                           backoff=Backoff(policy=_ONCE), metrics=_uncounted(), probe=True)
    reading = Reading(start, threading.Event(), time.sleep)
    reading.last_sequence_number = after
    while True:
        page = source.read(reading)
        if page.records:
            reading.last_sequence_number = page.records[-1].sequence_number
        yield page
        if page.shard_closed:
            return
