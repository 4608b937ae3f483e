"""One shard's read loop, running ahead of the processor into a bounded queue: GetRecords
pages, or with enhanced fan-out the events of the shard's subscription (``fanout``), which
then go the same way.

A dedicated thread per shard keeps the network busy while the processor works on the
previous batch; the queue bound (``queue_size`` results) is what caps the memory a slow
processor can make a shard hold, because the thread blocks on a full queue instead of fetching.

Pages wait in the queue as parsed, with KPL aggregates still whole: they are expanded into
user records by ``get()``, on the consumer's thread, right before the processor needs them.
A 10 MiB page of 100-byte user records is 200 aggregates but about 90,000 user records; held
whole it costs its 10 MiB, expanded several times that, and every long-lived Python object
in a queue is one more for the garbage collector to walk through on every full collection.

Positions follow the Java KCL: a checkpoint ``(sequence, sub-sequence)`` is the last record
done, so the iterator is taken AT that sequence number (the rest of a KPL aggregate may still
be due) and every user record at or before the checkpoint is dropped. After an
``ExpiredIteratorException`` the new iterator starts AFTER the last Kinesis record already
handled (a page always holds whole aggregates, so all its sub-records were handled too), or
at the original position if nothing was read yet. Neither a restart nor an expiry loses or
repeats a record.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from botocore.exceptions import ClientError

from kclpy.cloudwatch import COUNT, DETAILED, SUMMARY, shard_dimensions, success_and_time
from kclpy.errors import KCLError
from kclpy.metrics import Metrics
from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON
from kclpy.records import EMPTY, Record, Records
from kclpy.retrieval.fanout import ShardSubscription, classify_subscribe
from kclpy.retrieval.kpl import HashKeyRange, deaggregate
from kclpy.retrieval.parse import (
    ChildShard,
    GetRecordsPage,
    get_records,
    install_fast_get_records,
)
from kclpy.retry import THROTTLED, Backoff, classify
from kclpy.streams import multi_stream_lease_key

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

AT_SEQUENCE_NUMBER = "AT_SEQUENCE_NUMBER"
AFTER_SEQUENCE_NUMBER = "AFTER_SEQUENCE_NUMBER"
_KINDS = frozenset({TRIM_HORIZON, LATEST, AT_TIMESTAMP, AT_SEQUENCE_NUMBER, AFTER_SEQUENCE_NUMBER})

# How long a blocked put/get waits before looking at the stop flag again: bounds how late
# stop() is noticed without turning the wait into a busy loop.
_POLL_S = 0.05


def _short(iterator: str) -> str:
    """Iterators are bearer tokens for the shard's data: never log them whole."""
    return f"{iterator[:12]}..."


class Pacer(Protocol):
    """A budget of records to read (lag recovery's rate bound): asked before each GetRecords
    for its ``Limit``, given back what the page did not use."""

    def take(self, want: int, stop: threading.Event) -> int:
        """Records granted (at most ``want``); 0 once ``stop`` is set."""

    def give_back(self, records: int) -> None: ...


@dataclass(frozen=True)
class StartPosition:
    """Where a shard's reading begins.

    For ``AT_SEQUENCE_NUMBER`` the position is a checkpoint: records at or before
    ``(sequence_number, sub_sequence_number)`` were already processed and are not delivered
    again. ``AFTER_SEQUENCE_NUMBER`` starts after the whole (possibly aggregated) record.
    """

    kind: str
    sequence_number: str | None = None
    sub_sequence_number: int = 0
    timestamp: datetime | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown start position kind {self.kind!r}")
        if self.kind in (AT_SEQUENCE_NUMBER, AFTER_SEQUENCE_NUMBER):
            seq = self.sequence_number
            if seq is None or not (seq.isascii() and seq.isdigit()):
                raise ValueError(f"{self.kind} needs a numeric sequence number")
        if self.kind == AT_TIMESTAMP and self.timestamp is None:
            raise ValueError("AT_TIMESTAMP needs a timestamp")
        if self.sub_sequence_number < 0:
            raise ValueError("sub_sequence_number must be >= 0")

    @classmethod
    def from_checkpoint(
        cls, checkpoint: str, sub_sequence_number: int, initial_timestamp: datetime | None
    ) -> StartPosition:
        """The position for a lease's checkpoint (a sentinel or a sequence number).

        A SHARD_END checkpoint means the shard is finished; reaching here with one is a bug in
        the caller, so it raises instead of reading the shard again.
        """
        if checkpoint == SHARD_END:
            raise ValueError("a SHARD_END checkpoint has nothing left to fetch")
        if checkpoint in (TRIM_HORIZON, LATEST):
            return cls(checkpoint)
        if checkpoint == AT_TIMESTAMP:
            if initial_timestamp is None:
                raise ValueError("an AT_TIMESTAMP checkpoint needs the initial timestamp")
            return cls(AT_TIMESTAMP, timestamp=initial_timestamp)
        return cls(AT_SEQUENCE_NUMBER, checkpoint, sub_sequence_number)


@dataclass(slots=True)
class FetchResult:
    """One GetRecords page, ready for the processor."""

    #: de-aggregated, filtered, strictly after the resume point, in order
    records: Records
    millis_behind_latest: int | None
    #: True on the final result of a closed shard (no next iterator)
    shard_end: bool
    #: the children named by the final page (empty before shard end)
    child_shards: list[ChildShard]
    #: millis_behind_latest == 0, or unknown and the page was empty
    caught_up: bool


@dataclass
class _Page:
    """A page as the fetch thread queues it: records not yet de-aggregated."""

    records: Sequence[Record]
    millis_behind_latest: int | None
    shard_end: bool
    child_shards: list[ChildShard]
    caught_up: bool


class FetchError(KCLError):
    """The fetcher stopped on an error retrying cannot fix; the original is ``__cause__``.

    Wrapped so that a consumer catches one type and can tell a fetch failure from an error of
    its own; ``shard_id`` says which shard to shut down.
    """

    def __init__(self, shard_id: str, cause: BaseException) -> None:
        super().__init__(f"fetching shard {shard_id} failed: {cause!r}")
        self.shard_id = shard_id
        self.__cause__ = cause


class _Stopped(Exception):
    """Unwinds a retry loop once stop() was called."""


_END = object()
"""Queued after the last result, so a get() blocked on an empty queue learns the thread ended."""


class ShardFetcher:
    """Fetches one shard on its own thread (``start``/``get``/``stop``), or step by step
    (``fetch_once``) for deterministic tests.

    ``get()`` raises ``FetchError`` (cause: the botocore error) once the thread stopped on a
    non-retryable error such as ResourceNotFoundException; results fetched before the error
    are delivered first.
    """

    def __init__(
        self,
        client: KinesisClient,
        shard_id: str,
        start: StartPosition,
        *,
        stream_name: str | None = None,
        stream_arn: str | None = None,
        max_records: int = 10000,
        idle_time_s: float = 1.0,
        queue_size: int = 3,
        hash_range: tuple[int, int] | None = None,
        filter_outside_hash_range: bool = False,
        backoff: Backoff | None = None,
        metrics: Metrics | None = None,
        sleep: Callable[[float], None] | None = None,
        deliver_empty: bool = False,
        gate: threading.Event | None = None,
        consumer_arn: str | None = None,
        http_version: str = "auto",
        shard_end_probe_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        pacer: Pacer | None = None,
        until_ms: int | None = None,
        stream_id: str | None = None,
    ) -> None:
        if stream_name is None and stream_arn is None:
            raise ValueError("a ShardFetcher needs stream_name or stream_arn")
        if not 1 <= max_records <= 10000:
            raise ValueError("max_records must be between 1 and 10000")
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self._client = client
        self.shard_id = shard_id
        #: metrics and logs name the shard by its lease key, which in a multi-stream
        #: application starts with the stream (``stream_id``, a serialised identifier)
        self.label = shard_id if stream_id is None else multi_stream_lease_key(stream_id, shard_id)
        self._start = start
        self._stream_name = stream_name
        self._stream_arn = stream_arn
        self._max_records = max_records
        self._idle_time_s = idle_time_s
        self._key_range = None if hash_range is None else HashKeyRange(*hash_range)
        #: the Java KCL's filter of aggregates with sub-records outside the shard's range;
        #: off by default, because it drops aws-kinesis-agg aggregates for good (kpl.py)
        self._filter_outside = filter_outside_hash_range
        self._backoff = backoff if backoff is not None else Backoff()
        self._deliver_empty = deliver_empty
        self._stop = threading.Event()
        #: fetching and handing out pages wait while it is clear (the lease coordinator's
        #: retrieval gate: renewals come first)
        self._gate = gate
        self._probe_s = shard_end_probe_s
        self._clock = clock
        #: polling only: GetRecords Limits come from this budget
        self._pacer = pacer
        #: the read ends, as at a shard end, before the first record that arrived at or
        #: after this (epoch ms), or at the tip: a recovery gap's end
        self._until_ms = until_ms
        self._probed_at = clock()
        self._sleep = sleep if sleep is not None else self._interruptible_sleep
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

        m = metrics if metrics is not None else Metrics()
        self._metrics = m
        label = self.label
        #: enhanced fan-out: read through this registered consumer's subscriptions
        self._subscription = None if consumer_arn is None else ShardSubscription(
            client, consumer_arn, shard_id, label, http_version=http_version, metrics=m,
            clock=clock)
        self._m_seconds = m.get_records_seconds.labels(label)
        self._m_expired = m.iterator_expirations.labels(label)
        self._m_corrupt = m.deaggregation_errors.labels(label)
        self._m_filtered = m.records_filtered.labels(label)
        self._m_depth = m.prefetch_queue_depth.labels(label)
        self._m_behind = m.millis_behind_latest.labels(label)
        self._cw_dims = shard_dimensions(shard_id, stream_id)

        self._iterator: str | None = None
        self._shard_ended = False
        self._at_tip = False
        self._millis_behind_latest: int | None = None
        # Records at or before this (sequence, sub-sequence) were processed before we started;
        # cleared as soon as one record beyond it is seen, since sequence numbers only grow.
        self._skip_through: tuple[int, int] | None = (
            (int(start.sequence_number), start.sub_sequence_number)
            if start.kind == AT_SEQUENCE_NUMBER and start.sequence_number is not None
            else None
        )
        # AT_TIMESTAMP: records that arrived before the timestamp are dropped until one at
        # or after it is seen. Kinesis already starts there; an endpoint that rounds the
        # timestamp (kinesis-mock: to the second) must not hand out records a recovery gap
        # ending at that timestamp also reads.
        self._skip_before_ms: int | None = (
            round(start.timestamp.timestamp() * 1000)
            if start.kind == AT_TIMESTAMP and start.timestamp is not None else None)
        # The last Kinesis record (aggregate or plain) fully handled: an expired iterator
        # resumes after it.
        self._last_sequence_number: str | None = None
        install_fast_get_records(client)

    # -- consumer side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the fetch thread; a daemon so a stuck HTTP call never blocks interpreter exit."""
        if self._thread is not None:
            raise RuntimeError(f"fetcher for {self.shard_id} already started")
        self._thread = threading.Thread(
            target=self._run, name=f"kclpy-fetch-{self.shard_id}", daemon=True
        )
        self._thread.start()

    @property
    def caught_up(self) -> bool:
        """The last page was empty at the tip of the shard and nothing waits in the queue:
        empty pages are not queued, so this is how a consumer learns it has caught up."""
        return self._at_tip and self._queue.empty()

    @property
    def retrieval(self) -> dict[str, Any]:
        """How the shard is read, for ``/status``: the mode, and with fan-out the age of the
        open subscription (None between two)."""
        if self._subscription is None:
            return {"mode": "polling"}
        return {"mode": "fanout", "subscription_age_s": self._subscription.age_s}

    @property
    def millis_behind_latest(self) -> int | None:
        """MillisBehindLatest of the last page, empty pages included."""
        return self._millis_behind_latest

    def get(self, timeout: float | None = None) -> FetchResult | None:
        """The next result, or None on timeout or once the fetcher finished (see ``finished``).

        Raises FetchError if the thread stopped on a fatal error.
        """
        if self._stop.is_set():
            timeout = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        gate = self._gate
        while gate is not None and not self._stop.is_set() and not gate.wait(
                0.1 if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                return None
        while True:
            try:
                item = self._queue.get(timeout=None if deadline is None
                                       else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if item is _END:
                # Leave the marker for the next call, so every later get() answers at once.
                self._put_nowait(_END)
                if self._error is not None:
                    raise FetchError(self.shard_id, self._error)
                return None
            self._m_depth.set(self._queue.qsize())
            assert isinstance(item, _Page)
            result = self._expand(item)
            if result is not None:
                return result

    def stop(self, timeout: float | None = None) -> None:
        """Stop fetching and join the thread.

        Sleeps and queue waits notice at once; an HTTP call in flight is not interruptible, so
        ``timeout`` bounds the join for callers that cannot wait for it.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("fetch thread for %s still in a call after stop", self.shard_id)
                return
        # Wake a get() that is blocked on an empty queue.
        self._put_nowait(_END)
        with contextlib.suppress(KeyError):
            self._metrics.prefetch_queue_depth.remove(self.label)

    @property
    def error(self) -> BaseException | None:
        """The non-retryable error that ended the fetch thread, if any."""
        return self._error

    @property
    def finished(self) -> bool:
        """True once nothing more will be fetched: shard end reached, failed, or stopped."""
        return self._shard_ended or self._error is not None or self._stop.is_set()

    def fetch_once(self) -> FetchResult | None:
        """One iteration of the fetch loop, without the thread or the queue.

        Returns what the loop would have queued: None for an empty page (unless
        ``deliver_empty``), after shard end, and after stop(). Sleeps the idle time when the
        page was empty and the shard caught up, as the loop does. Fatal errors propagate.
        """
        try:
            page, idle = self._fetch()
        except _Stopped:
            return None
        if idle:
            self._sleep(self._idle_time_s)
        return None if page is None else self._expand(page)

    # -- fetch thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._shard_ended:
                self._await_gate()
                page, idle = self._fetch()
                if page is not None:
                    self._put(page)
                if idle:
                    self._sleep(self._idle_time_s)
        except _Stopped:
            pass
        except Exception as exc:
            logger.error("fetching shard %s stopped: %r", self.shard_id, exc)
            self._error = exc
        finally:
            self._end_subscription()
            with contextlib.suppress(_Stopped):
                self._put(_END)

    def _end_subscription(self) -> None:
        if self._subscription is not None:
            self._subscription.close()

    def _await_gate(self) -> None:
        gate = self._gate
        while gate is not None and not gate.wait(0.1):
            if self._stop.is_set():
                raise _Stopped

    def _interruptible_sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _put(self, item: object) -> None:
        """Block until there is room, but notice stop() within ``_POLL_S``."""
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                self._queue.put(item, timeout=_POLL_S)
            except queue.Full:
                continue
            if item is not _END:
                self._m_depth.set(self._queue.qsize())
            return

    def _put_nowait(self, item: object) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(item)

    def _fetch(self) -> tuple[_Page | None, bool]:
        """One GetRecords (with retries): the page to queue (or None) and whether to idle."""
        if self._shard_ended:
            return None, False
        if self._subscription is not None:
            return self._fetch_event(self._subscription), False
        limit = self._max_records
        if self._pacer is not None:
            limit = self._pacer.take(limit, self._stop)
            if not limit:
                raise _Stopped
        fresh = False
        while True:
            if self._iterator is None:
                self._iterator = self._get_iterator()
                fresh = True
            try:
                page = self._retrying(
                    "GetRecords",
                    functools.partial(self._timed_get_records, self._iterator, limit))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ExpiredIteratorException":
                    raise
                self._m_expired.inc()
                self._metrics.cloudwatch.record(
                    "ProcessTask", "ExpiredIterator", 1, COUNT, SUMMARY, self._cw_dims)
                logger.info("iterator for %s expired; re-positioning", self.shard_id)
                self._iterator = None
                if fresh:
                    # A brand-new iterator should not expire; back off rather than spin
                    # against a service (or clock) that keeps answering so.
                    self._pause(self._backoff.next_delay(), exc)
                continue
            break
        # Only a page is progress: a fresh iterator that then expires again must not reset.
        self._backoff.reset()

        self._iterator = page.next_shard_iterator
        millis = page.millis_behind_latest
        # A bounded read (a recovery gap) is behind on purpose: the shard's gauge is live's.
        if millis is not None and self._until_ms is None:
            self._m_behind.set(millis)
        if self._pacer is not None:
            self._pacer.give_back(limit - len(page.records))
        caught_up = millis == 0 or (millis is None and not page.records)
        shard_end = page.next_shard_iterator is None
        children = page.child_shards
        raw = self._handled(page.records)
        if self._until_ms is not None:
            kept = _arrived_before(raw, self._until_ms)
            if len(kept) < len(raw) or (caught_up and not raw):
                shard_end, children = True, []
            raw = kept
        if shard_end:
            self._shard_ended = True
            if self._until_ms is not None and page.next_shard_iterator is not None:
                # a recovery read: the shard is open, only the gap being read is over
                logger.info("shard %s: the recovery gap was read to its end", self.shard_id)
            else:
                logger.info("shard %s reached its end", self.shard_id)
        deliver = bool(raw) or shard_end or self._deliver_empty
        idle = not raw and caught_up and not shard_end
        self._at_tip = idle
        self._millis_behind_latest = millis
        pending = _Page(raw, millis, shard_end, children, caught_up)
        return (pending if deliver else None), idle

    def _fetch_event(self, subscription: ShardSubscription) -> _Page | None:
        """The next event of the shard's subscription: the page to queue, or None. Failures
        to open or read a subscription (``ResourceInUseException`` while the previous one
        is still open, throttling, 5xx, a dropped connection) back off and are counted as
        GetRecords failures are."""
        event = self._retrying(
            "SubscribeToShard",
            lambda: subscription.next_event(self._subscribe_position, self._last_sequence_number),
            classify_subscribe)
        self._backoff.reset()
        page = event.page
        millis = page.millis_behind_latest
        if millis is not None:
            self._m_behind.set(millis)
        raw = self._handled(page.records)
        shard_end = event.continuation_sequence_number is None
        if shard_end:
            self._shard_ended = True
            self._end_subscription()
            logger.info("shard %s reached its end", self.shard_id)
        caught_up = millis == 0
        self._at_tip = caught_up and not raw
        self._millis_behind_latest = millis
        children = page.child_shards
        if self._at_tip and not shard_end and self._clock() - self._probed_at >= self._probe_s:
            self._probed_at = self._clock()
            found = self._probe_shard_end()
            if found is not None:
                shard_end, children = True, found
        if not (raw or shard_end or self._deliver_empty):
            return None
        return _Page(raw, millis, shard_end, children, caught_up)

    def _handled(self, raw: Sequence[Record]) -> Sequence[Record]:
        """Note the page as read (an expired iterator or a new subscription resumes after
        its last record) and drop what arrived before an AT_TIMESTAMP start."""
        if raw:
            self._last_sequence_number = raw[-1].sequence_number
        if self._skip_before_ms is not None and raw:
            raw = _arrived_from(raw, self._skip_before_ms)
            if raw:
                self._skip_before_ms = None
        return raw

    def _probe_shard_end(self) -> list[ChildShard] | None:
        """Is the idle shard closed? One GetRecords after the last record handled: the
        child shards when it answers shard end, else None. A subscription normally says so
        itself (an event without a continuation); this covers endpoints that never do
        (kinesis-mock keeps sending empty events on a closed shard), at one GetRecords per
        ``shard_end_probe_s`` of an idle shard."""
        try:
            probe = self._retrying(
                "GetRecords", lambda: get_records(self._client, self._get_iterator(), 1))
        except ClientError as exc:
            logger.info("shard %s: shard-end probe failed: %s", self.shard_id, exc)
            return None
        if probe.next_shard_iterator is not None or probe.records:
            return None
        logger.info("shard %s reached its end (found by a GetRecords probe)", self.shard_id)
        self._shard_ended = True
        self._end_subscription()
        return list(probe.child_shards)

    def _subscribe_position(self, after: str | None) -> dict[str, Any]:
        """A subscription's StartingPosition: after ``after``, else the start position."""
        kind, sequence_number, timestamp = self._resume_point(after)
        position: dict[str, Any] = {"Type": kind}
        if sequence_number is not None:
            position["SequenceNumber"] = sequence_number
        if timestamp is not None:
            position["Timestamp"] = timestamp
        return position

    def _resume_point(self, after: str | None) -> tuple[str, str | None, datetime | None]:
        """Where reading resumes, for an iterator or a subscription alike: after ``after``
        (a record already handled), else at the start position."""
        if after is not None:
            return AFTER_SEQUENCE_NUMBER, after, None
        start = self._start
        return start.kind, start.sequence_number, start.timestamp

    def _expand(self, page: _Page) -> FetchResult | None:
        """The page's user records (de-aggregated, filtered, after the resume point), or None
        if nothing is left to deliver. Runs on the thread that calls ``get()``."""
        records = EMPTY
        if page.records:
            agg = deaggregate(page.records, key_range=self._key_range,
                              filter_outside=self._filter_outside)
            if agg.corrupt:
                self._m_corrupt.inc(agg.corrupt)
            if agg.filtered:
                self._m_filtered.inc(agg.filtered)
                logger.warning(
                    "shard %s: %d user record(s) of aggregates with keys outside the shard's "
                    "hash-key range filtered out (kpl_hash_range_filter is on)",
                    self.label, agg.filtered)
            records = self._drop_processed(agg.records)
        if not (records or page.shard_end or self._deliver_empty):
            return None
        return FetchResult(records, page.millis_behind_latest, page.shard_end,
                           page.child_shards, page.caught_up)

    def _drop_processed(self, records: Records) -> Records:
        """Drop the records at or before the checkpoint we resumed from."""
        skip = self._skip_through
        if skip is None:
            return records
        records = records.after(skip)
        if records:
            self._skip_through = None
        return records

    def _timed_get_records(self, iterator: str, limit: int) -> GetRecordsPage:
        started = time.perf_counter()
        ok = False
        try:
            page = get_records(self._client, iterator, limit)
            ok = True
            return page
        finally:
            elapsed = time.perf_counter() - started
            self._m_seconds.observe(elapsed)
            success_and_time(self._metrics.cloudwatch, "ProcessTask",
                             "KinesisDataFetcher.getRecords", ok, elapsed, DETAILED,
                             self._cw_dims)

    def _get_iterator(self) -> str:
        """A fresh iterator: after the last record handled, else at the start position."""
        params: dict[str, Any] = {"ShardId": self.shard_id}
        # Kinesis accepts either or both; both also suits moto, whose ARN-only iterators fail.
        if self._stream_arn is not None:
            params["StreamARN"] = self._stream_arn
        if self._stream_name is not None:
            params["StreamName"] = self._stream_name
        kind, sequence_number, timestamp = self._resume_point(self._last_sequence_number)
        params["ShardIteratorType"] = kind
        if sequence_number is not None:
            params["StartingSequenceNumber"] = sequence_number
        if timestamp is not None:
            params["Timestamp"] = timestamp
        response = self._retrying(
            "GetShardIterator", lambda: self._client.get_shard_iterator(**params)
        )
        iterator: str = response["ShardIterator"]
        logger.debug(
            "shard %s: %s iterator %s",
            self.shard_id,
            params["ShardIteratorType"],
            _short(iterator),
        )
        return iterator

    def _pause(self, delay: float, cause: Exception) -> None:
        self._sleep(delay)
        if self._stop.is_set():
            raise _Stopped from cause

    def _retrying(self, operation: str, call: Callable[[], _T],
                  classifier: Callable[[BaseException], str | None] = classify) -> _T:
        """Run ``call`` until it succeeds or fails in a way retrying cannot fix.

        The backoff is reset by the caller, once a whole fetch succeeded.
        """
        while True:
            try:
                result = call()
            except Exception as exc:
                kind = classifier(exc)
                if kind is None:
                    raise
                if kind == THROTTLED:
                    self._metrics.throttles.labels(operation).inc()
                self._metrics.get_records_errors.labels(self.label, kind).inc()
                if operation == "SubscribeToShard":
                    self._metrics.subscriptions.labels(self.label, f"failed_{kind}").inc()
                delay = self._backoff.next_delay()
                logger.warning(
                    "%s on %s failed (%s, attempt %d); retrying in %.3fs: %s",
                    operation,
                    self.shard_id,
                    kind,
                    self._backoff.attempt,
                    delay,
                    exc,
                )
                self._pause(delay, exc)
                continue
            return result


def _arrived_before(records: Sequence[Record], until_ms: int) -> Sequence[Record]:
    """The leading records that arrived before ``until_ms``: sequence numbers and arrival
    times grow together within a shard, so the first one at or after it ends the range."""
    for index, record in enumerate(records):
        arrived = record.timestamp_millis
        if arrived is not None and arrived >= until_ms:
            return records[:index]
    return records


def _arrived_from(records: Sequence[Record], from_ms: int) -> Sequence[Record]:
    """The records from the first one that arrived at or after ``from_ms``."""
    for index, record in enumerate(records):
        arrived = record.timestamp_millis
        if arrived is None or arrived >= from_ms:
            return records[index:]
    return records[:0]
