"""What a page source is: the one small interface every retrieval mode implements.

A shard is read by one pipeline (``pipeline.py``: the bounded queue, the retrieval gate,
stop, de-aggregation and KPL filtering, the resume point) fed by one page source, which only
knows how to get the next page of Kinesis records from the service: GetRecords
(``polling.py``), the events of a SubscribeToShard subscription (``fanout.py``), or a read
bounded in rate and end (a polling source with a ``pacer`` and ``until_ms``: lag recovery's
gap reader; ``Page.within`` is that end, for any source given one). As in the Java KCL,
where ``PrefetchRecordsPublisher`` and ``FanOutRecordsPublisher`` are siblings behind
``RecordsPublisher``, adding a retrieval mode means adding one module with a class that
satisfies ``PageSource``; nothing after the page changes, so a processor cannot tell which
mode fed it.

A source is pulled, never pushes: the pipeline's fetch thread calls ``read`` in a loop, so a
full queue holds the source back (no GetRecords, no bytes read from the subscription) and
``stop`` is seen between two reads, or inside one through ``Reading.pause``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from kclpy.metrics import GET_RECORDS_ERRORS, SUBSCRIPTIONS, THROTTLES, Metrics
from kclpy.position import AT_TIMESTAMP, Position
from kclpy.records import Record
from kclpy.retrieval.page import Page
from kclpy.retry import THROTTLED, Backoff, GaveUp, classify, retrying
from kclpy.streams import multi_stream_lease_key

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: the iterator types reading starts with: a record position is read from its Kinesis record
#: (its aggregate's sub-records up to it are dropped), a restart after the last record handled
AT_SEQUENCE_NUMBER = "AT_SEQUENCE_NUMBER"
AFTER_SEQUENCE_NUMBER = "AFTER_SEQUENCE_NUMBER"


def reading_start(checkpoint: Position, initial_timestamp: datetime | None) -> Position:
    """Where a lease's checkpoint has its shard read from: the checkpoint itself (after it,
    for a record), an ``AT_TIMESTAMP`` without a time at ``initial_timestamp``.

    A SHARD_END checkpoint means the shard is finished; reaching here with one is a bug in
    the caller, so it raises instead of reading the shard again.
    """
    if checkpoint.is_shard_end:
        raise ValueError("a SHARD_END checkpoint has nothing left to fetch")
    if checkpoint.sentinel == AT_TIMESTAMP and checkpoint.timestamp_ms is None:
        if initial_timestamp is None:
            raise ValueError("an AT_TIMESTAMP checkpoint needs the initial timestamp")
        return Position.at_time(initial_timestamp)
    return checkpoint


@dataclass(frozen=True)
class ShardAddress:
    """Which shard of which stream a source reads, and the name it is reported by.

    Kinesis calls take the bare ``shard_id`` with the stream's name, ARN or both (both also
    suits moto, whose ARN-only iterators fail); metrics and logs name the shard by its lease
    key (``lease_key``), which in a multi-stream application starts with the stream
    (``stream_id``, a serialised identifier).
    """

    shard_id: str
    stream_name: str | None = None
    stream_arn: str | None = None
    stream_id: str | None = None

    def __post_init__(self) -> None:
        if self.stream_name is None and self.stream_arn is None:
            raise ValueError("a shard's address needs stream_name or stream_arn")

    @property
    def lease_key(self) -> str:
        if self.stream_id is None:
            return self.shard_id
        return multi_stream_lease_key(self.stream_id, self.shard_id)

    def params(self) -> dict[str, Any]:
        """The stream and shard as a Kinesis request names them."""
        params: dict[str, Any] = {"ShardId": self.shard_id}
        if self.stream_arn is not None:
            params["StreamARN"] = self.stream_arn
        if self.stream_name is not None:
            params["StreamName"] = self.stream_name
        return params


class Stopped(Exception):
    """Unwinds a read once the pipeline was stopped."""


class Reading:
    """What the pipeline lends its source: where reading resumes, and a wait that ends at
    ``stop``. The pipeline notes every page it handled here, so a source that must start
    again (an expired iterator, a new subscription, a shard-end probe) resumes after the last
    Kinesis record already handled - a page holds whole aggregates, so all its sub-records
    were handled too - or at the start position if nothing was read yet."""

    def __init__(self, start: Position, stop: threading.Event,
                 sleep: Callable[[float], None]) -> None:
        self.start = start
        self.stop = stop
        self._sleep = sleep
        #: the last Kinesis record (aggregate or plain) fully handled
        self.last_sequence_number: str | None = None
        #: the most records the next read may return, for a reader that needs only so many
        #: more (a budgeted Spark batch, a probe); None: the source's own page size. A source
        #: the service pushes to cannot cut its pages and ignores it.
        self.limit: int | None = None

    def resume_point(self, after: str | None) -> tuple[str, str | None, datetime | None]:
        """Where reading resumes, for an iterator or a subscription alike: after ``after``
        (a record already handled), else at the start position."""
        if after is not None:
            return AFTER_SEQUENCE_NUMBER, after, None
        start = self.start
        if start.is_record:
            return AT_SEQUENCE_NUMBER, start.sequence_number, None
        if start.is_shard_end or (start.sentinel == AT_TIMESTAMP and start.moment is None):
            raise ValueError(f"cannot start reading at {start}")
        return start.sequence_number, None, start.moment

    def pause(self, seconds: float, cause: BaseException | None = None) -> None:
        """Wait before a retry; raise ``Stopped`` if the pipeline stopped meanwhile."""
        self._sleep(seconds)
        if self.stop.is_set():
            raise Stopped from cause


class PageSource(Protocol):
    """One shard's pages, from whichever service call the retrieval mode uses.

    ``read`` blocks until the next page (retrying what is worth retrying, waiting through
    ``Reading.pause`` so a stop is seen) and raises ``Stopped`` once the pipeline stopped, or
    the error retrying cannot fix. It is not called again after a page with ``shard_end``.
    """

    address: ShardAddress

    @property
    def idle_s(self) -> float:
        """How long the pipeline waits before the next read after an empty page at the tip
        (polling's idle time between reads, longer while a bounded read waits for Kinesis'
        time to reach its end; 0 for a source the service pushes to)."""

    def read(self, reading: Reading) -> Page[Sequence[Record]]: ...

    def close(self) -> None:
        """Let go of what the source holds open (a subscription); called once, at the end."""

    def status(self) -> dict[str, Any]:
        """How the shard is read, for ``/status``: the mode, and what the mode adds."""


class Retrying:
    """One source's retries of the calls it makes, with its backoff, counted per shard.

    The backoff is reset by the source, once a whole read succeeded: a fresh iterator that
    then expires again must not reset it. A backoff whose policy has ``max_attempts`` gives
    up after that many failed calls since that reset and raises the last error (a Spark
    task is better retried by Spark than stuck here); without one it retries until stopped.
    """

    def __init__(self, address: ShardAddress, backoff: Backoff | None, metrics: Metrics) -> None:
        self._address = address
        self.backoff = backoff if backoff is not None else Backoff()
        self._metrics = metrics
        self._shard = metrics.shard(address.lease_key, address.shard_id, address.stream_id)

    def call(self, reading: Reading, operation: str, call: Callable[[], _T],
             classifier: Callable[[BaseException], str | None] = classify) -> _T:
        """Run ``call`` until it succeeds, fails in a way retrying cannot fix, or the
        backoff's policy gives up (the last failure is raised as it is)."""
        kinds: list[str] = []

        def counted(exc: BaseException) -> bool:
            kind = classifier(exc)
            if kind is None:
                return False
            if kind == THROTTLED:
                self._metrics.inc(THROTTLES, operation)
            self._shard.inc(GET_RECORDS_ERRORS, kind)
            if operation == "SubscribeToShard":
                self._metrics.inc(SUBSCRIPTIONS, f"failed_{kind}")
            kinds.append(kind)
            return True

        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            logger.warning("%s on %s failed (%s, attempt %d); retrying in %.3fs: %s",
                           operation, self._address.lease_key, kinds[-1], attempt, delay, exc)

        try:
            return retrying(call, self.backoff, retry_on=counted, wait=reading.pause,
                            on_retry=retry_later)
        except GaveUp as gave_up:
            raise gave_up.last from None
