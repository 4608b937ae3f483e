"""One shard read with enhanced fan-out: the subscription a ShardFetcher reads instead of
GetRecords pages.

A subscription lasts at most five minutes and may drop at any time; the next one starts
after the last event's ``ContinuationSequenceNumber``. Everything after an event arrives
(de-aggregation, the resume point, the queue, shard end) is the fetcher's, shared with
polling, so the processor cannot tell which mode fed it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import httpx
import urllib3
from botocore.eventstream import ParserError
from botocore.exceptions import ClientError

from kclpy.metrics import Metrics
from kclpy.retrieval.subscription import SubscribeEvent, subscribe
from kclpy.retry import CONNECTION, IN_USE, SERVER_ERROR, classify

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

#: what the fetcher answers for "where does reading resume after this sequence number
#: (None: nothing handled yet)": the StartingPosition of a SubscribeToShard
Position = Callable[[str | None], dict[str, Any]]


class ShardSubscription:
    """The shard's open subscription, if any, and where the next one starts."""

    def __init__(
        self,
        client: KinesisClient,
        consumer_arn: str,
        shard_id: str,
        label: str,
        *,
        http_version: str,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._client = client
        self._consumer_arn = consumer_arn
        self._shard_id = shard_id
        self._label = label
        self._http_version = http_version
        self._metrics = metrics
        self._clock = clock
        self._events: Generator[SubscribeEvent, None, None] | None = None
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

    def next_event(self, position: Position, last_sequence_number: str | None
                   ) -> SubscribeEvent:
        """The next event, opening a subscription when none is open: right away after one
        the service ended (after about five minutes), after the last event's continuation.
        A failure leaves no subscription open, so a retry opens a new one."""
        while True:
            if self._events is None:
                self._events = subscribe(
                    self._client, self._consumer_arn, self._shard_id,
                    position(self._resume_after(last_sequence_number)),
                    http_version=self._http_version)
                self._metrics.subscriptions.labels(
                    self._label, "renewed" if self._subscribed_at else "opened").inc()
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
            self._metrics.subscription_events.labels(self._label).inc()
            self._metrics.subscription_bytes.labels(self._label).inc(event.page.size_bytes)
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
