"""The enhanced fan-out page source: the events of the shard's SubscribeToShard
subscriptions instead of GetRecords pages.

A subscription lasts at most five minutes and may drop at any time; the next one starts
after the last event's ``ContinuationSequenceNumber``. Everything after an event arrives
(de-aggregation, the resume point, the queue) is the pipeline's, shared with polling, so the
processor cannot tell which mode fed it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import urllib3
from botocore.eventstream import ParserError
from botocore.exceptions import ClientError

from kclpy.metrics import (
    MILLIS_BEHIND_LATEST,
    SUBSCRIPTION_BYTES,
    SUBSCRIPTION_EVENTS,
    SUBSCRIPTIONS,
    Metrics,
    Scope,
)
from kclpy.records import Record
from kclpy.retrieval.clock import kinesis_clock
from kclpy.retrieval.page import ChildShard, Page
from kclpy.retrieval.parse import get_records
from kclpy.retrieval.polling import get_iterator
from kclpy.retrieval.source import Reading, Retrying, ShardAddress
from kclpy.retrieval.subscription import subscribe
from kclpy.retry import CONNECTION, IN_USE, SERVER_ERROR, Backoff, classify

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

logger = logging.getLogger(__name__)

#: what the source answers for "where does reading resume after this sequence number
#: (None: nothing handled yet)": the StartingPosition of a SubscribeToShard
StartingPositionAfter = Callable[[str | None], dict[str, Any]]


class ShardSubscription:
    """The shard's open subscription, if any, and where the next one starts."""

    def __init__(
        self,
        client: KinesisClient,
        consumer_arn: str,
        shard_id: str,
        lease_key: str,
        *,
        http_version: str,
        metrics: Scope,
        clock: Callable[[], float],
    ) -> None:
        self._client = client
        self._consumer_arn = consumer_arn
        self._shard_id = shard_id
        self._lease_key = lease_key
        self._http_version = http_version
        self._metrics = metrics
        self._clock = clock
        self._events: Generator[Page[Sequence[Record]], None, None] | None = None
        #: the last event's ContinuationSequenceNumber (None before the first, and at the end)
        self.continuation: str | None = None
        #: clock() when the current subscription was opened (0: never)
        self._subscribed_at = 0.0

    @property
    def age_s(self) -> float | None:
        """How long the open subscription has run; None between two."""
        if self._events is None or not self._subscribed_at:
            return None
        return round(self._clock() - self._subscribed_at, 1)

    def next_event(self, position: StartingPositionAfter, last_sequence_number: str | None
                   ) -> Page[Sequence[Record]]:
        """The next event's page, opening a subscription when none is open: right away after one
        the service ended (after about five minutes), after the last event's continuation.
        A failure leaves no subscription open, so a retry opens a new one."""
        while True:
            if self._events is None:
                self._events = subscribe(
                    self._client, self._consumer_arn, self._shard_id,
                    position(self._resume_after(last_sequence_number)),
                    http_version=self._http_version)
                self._metrics.inc(SUBSCRIPTIONS, "renewed" if self._subscribed_at else "opened")
                self._subscribed_at = self._clock()
            try:
                event = next(self._events)
            except StopIteration:
                self._events = None
                continue
            except BaseException:
                self._events = None
                raise
            self.continuation = event.continuation_sequence_number
            self._metrics.inc(SUBSCRIPTION_EVENTS)
            self._metrics.inc(SUBSCRIPTION_BYTES, by=event.size_bytes)
            return event

    def _resume_after(self, last_sequence_number: str | None) -> str | None:
        """Java's rule: the first subscription starts at the start position, every later
        one after the last event's continuation, or the last record handled."""
        after = self.continuation
        if after is None or not (after.isascii() and after.isdigit()) or after == "0":
            # no continuation yet (kinesis-mock answers "0" for a shard with nothing read)
            after = last_sequence_number
        return after

    def close(self) -> None:
        """Close the open subscription's connection: the service ends a subscription whose
        connection closed, so the shard's next owner is not refused with
        ``ResourceInUseException`` until it times out (five minutes)."""
        events, self._events = self._events, None
        if events is not None:
            events.close()


def classify_subscribe(exc: BaseException) -> str | None:
    """GetRecords' retryable kinds, plus a subscription still open on the shard (the
    previous one, not yet closed by the service), a dropped streaming connection, and a
    frame that does not decode (a checksum mismatch, an impossible length: botocore's
    event-stream ``ParserError``). The Java KCL restarts the subscription after any of these
    (and after ``InternalFailureException``/``KMSThrottlingException`` events, which
    ``classify`` knows); the next subscription resumes after the last event handled, so a
    damaged frame costs a reconnection, never a record."""
    if isinstance(exc, ClientError) and exc.response.get("Error", {}).get(
            "Code") == "ResourceInUseException":
        return IN_USE
    if isinstance(exc, (urllib3.exceptions.HTTPError, httpx.TransportError)):
        return CONNECTION
    if isinstance(exc, ParserError):
        return SERVER_ERROR
    return classify(exc)


class FanOutSource:
    """One shard read through the registered consumer ``consumer_arn``'s subscriptions.

    Failures to open or read a subscription (``ResourceInUseException`` while the previous
    one is still open, throttling, 5xx, a dropped connection) back off and are counted as
    GetRecords failures are. An idle shard at the tip is also checked with one GetRecords
    every ``shard_end_probe_s``, for endpoints that never end a subscription on a closed
    shard. ``until_ms`` bounds the read as it bounds a polling one (``Page.within``): the
    Spark source's executors read a batch's part to its planned end this way.
    """

    #: the service pushes: nothing to wait for between two reads
    idle_s = 0.0

    def __init__(
        self,
        client: KinesisClient,
        address: ShardAddress,
        consumer_arn: str,
        *,
        http_version: str = "auto",
        shard_end_probe_s: float = 30.0,
        backoff: Backoff | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        until_ms: int | None = None,
    ) -> None:
        m = metrics if metrics is not None else Metrics()
        shard = m.shard(address.lease_key, address.shard_id, address.stream_id)
        self._client = client
        self.address = address
        self._retrying = Retrying(address, backoff, m)
        self._subscription = ShardSubscription(
            client, consumer_arn, address.shard_id, address.lease_key, http_version=http_version,
            metrics=shard, clock=clock)
        self._probe_s = shard_end_probe_s
        self._clock = clock
        self._probed_at = clock()
        self._m_behind = shard.bind(MILLIS_BEHIND_LATEST)
        self._until_ms = until_ms
        #: Kinesis' time as this client's answers show it: where a bounded read ends
        self._kinesis_clock = kinesis_clock(client)
        self._read_once = False
        #: Kinesis records the subscription delivered (aggregates count one)
        self.records_fetched = 0

    def status(self) -> dict[str, Any]:
        """With the age of the open subscription (None between two)."""
        return {"mode": "fanout", "subscription_age_s": self._subscription.age_s}

    def close(self) -> None:
        self._subscription.close()

    def read(self, reading: Reading) -> Page[Sequence[Record]]:
        """The next event of the shard's subscription, as a page."""
        subscription = self._subscription

        def position(after: str | None) -> dict[str, Any]:
            kind, sequence_number, timestamp = reading.resume_point(after)
            start: dict[str, Any] = {"Type": kind}
            if sequence_number is not None:
                start["SequenceNumber"] = sequence_number
            if timestamp is not None:
                start["Timestamp"] = timestamp
            return start

        # Taken before waiting for the event, which the service sends later; the tip it
        # shows is at least this late (``Page.within``). Before any answer showed Kinesis'
        # time (a fresh client: the subscription's own answer comes inside ``next_event``)
        # a bounded read stays open through its first event; an endpoint that still shows
        # none after it keeps the local clock, as before.
        kinesis_ms = self._kinesis_clock.shown_ms()
        if kinesis_ms is None and self._read_once:
            kinesis_ms = round(time.time() * 1000)
        self._read_once = True
        page = self._retrying.call(
            reading, "SubscribeToShard",
            lambda: subscription.next_event(position, reading.last_sequence_number),
            classify_subscribe)
        self._retrying.backoff.reset()
        self.records_fetched += len(page.records)
        millis = page.millis_behind_latest
        self._kinesis_clock.observe_page(page.records, millis)
        if millis is not None and self._until_ms is None:
            self._m_behind.set(millis)
        shard_end = page.continuation_sequence_number is None
        if shard_end:
            self.close()
            logger.info("shard %s reached its end", self.address.lease_key)
        caught_up = millis == 0
        children = page.child_shards
        if (caught_up and not page.records and not shard_end
                and self._clock() - self._probed_at >= self._probe_s):
            self._probed_at = self._clock()
            found = self._probe_shard_end(reading)
            if found is not None:
                shard_end, children = True, found
        # the parse's page, completed with what only the source decides
        page.caught_up, page.at_tip = caught_up, caught_up and not page.records
        page.shard_end = page.shard_closed = shard_end
        page.child_shards = children
        return page.within(self._until_ms, kinesis_ms)

    def _probe_shard_end(self, reading: Reading) -> list[ChildShard] | None:
        """Is the idle shard closed? One GetRecords after the last record handled: the
        child shards when it answers shard end, else None. A subscription normally says so
        itself (an event without a continuation); this covers endpoints that never do
        (kinesis-mock keeps sending empty events on a closed shard), at one GetRecords per
        ``shard_end_probe_s`` of an idle shard."""
        try:
            probe = self._retrying.call(
                reading, "GetRecords", lambda: get_records(
                    self._client,
                    get_iterator(self._client, self.address, reading, self._retrying), 1))
        except ClientError as exc:
            logger.info("shard %s: shard-end probe failed: %s", self.address.lease_key, exc)
            return None
        if probe.next_shard_iterator is not None or probe.records:
            return None
        logger.info("shard %s reached its end (found by a GetRecords probe)",
                    self.address.lease_key)
        self.close()
        return list(probe.child_shards)
