"""One shard's read pipeline, the same for every retrieval mode: a fetch thread pulls pages
from the shard's page source (``source.py``) into a bounded queue, ahead of the processor.

A dedicated thread per shard keeps the network busy while the processor works on the
previous batch; the queue bound (``queue_size`` results) is what caps the memory a slow
processor can make a shard hold, because the thread blocks on a full queue instead of
reading. While the lease coordinator's retrieval gate is shut (renewals come first), nothing
is read or handed out.

Pages wait in the queue as the source read them, with KPL aggregates still whole: they are
expanded into user records by ``get()``, on the consumer's thread, right before the processor
needs them. A 10 MiB page of 100-byte user records is 200 aggregates but about 90,000 user
records; held whole it costs its 10 MiB, expanded several times that, and every long-lived
Python object in a queue is one more for the garbage collector to walk through on every full
collection.

The resume point is the pipeline's: user records at or before a checkpoint
``(sequence, sub-sequence)`` are dropped (the source starts AT the checkpoint's sequence
number, since the rest of a KPL aggregate may still be due), records that arrived before an
``AT_TIMESTAMP`` start are dropped, and every page handled is noted in the ``Reading`` the
source resumes from.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kclpy.errors import KCLError
from kclpy.metrics import DEAGGREGATION_ERRORS, PREFETCH_QUEUE_DEPTH, RECORDS_FILTERED, Metrics
from kclpy.position import AT_TIMESTAMP, Position
from kclpy.records import EMPTY, Record, Records
from kclpy.retrieval.kpl import CORRUPT_REASONS, HashKeyRange, deaggregate
from kclpy.retrieval.page import Page
from kclpy.retrieval.source import PageSource, Reading, Stopped

logger = logging.getLogger(__name__)

# How long a blocked put/get waits before looking at the stop flag again: bounds how late
# stop() is noticed without turning the wait into a busy loop.
_POLL_S = 0.05


class FetchError(KCLError):
    """The pipeline stopped on an error retrying cannot fix; the original is ``__cause__``.

    Wrapped so that a consumer catches one type and can tell a fetch failure from an error of
    its own; ``lease_key`` says which shard to shut down.
    """

    def __init__(self, lease_key: str, cause: BaseException) -> None:
        super().__init__(f"fetching shard {lease_key} failed: {cause!r}")
        self.lease_key = lease_key
        self.__cause__ = cause


_END = object()
"""Queued after the last result, so a get() blocked on an empty queue learns the thread ended."""


@dataclass(frozen=True)
class Batching:
    """How a page's records become the batch handed out: read together, because each
    reader of a shard (the worker's live one, lag recovery's, a Spark task's) picks them
    together."""

    #: the shard's hash key range, which the KPL parser checks sub-records against
    hash_range: tuple[int, int] | None = None
    #: the Java KCL's filter of aggregates with sub-records outside the shard's range;
    #: off by default, because it drops aws-kinesis-agg aggregates for good (kpl.py)
    filter_outside_hash_range: bool = False
    #: hand out pages without records too (the processor asked for empty batches)
    deliver_empty: bool = False
    #: False: KPL aggregates are handed over whole
    deaggregate: bool = True


class ShardPipeline:
    """Reads one shard from ``source`` on its own thread (``start``/``get``/``stop``), or
    step by step without a thread (``fetch_once``): deterministic tests, one-record probes,
    and the Spark source, whose executors read inside a Spark task.

    ``batching`` says what each page becomes. ``on_trimmed`` is told when a
    start AT a checkpoint finds the checkpoint's record gone (the first record back is a
    later one: those in between were trimmed by retention); it may raise, which ends the
    read. None (the worker, as the Java KCL) does not look.

    ``get()`` raises ``FetchError`` (cause: the botocore error) once the thread stopped on a
    non-retryable error such as ResourceNotFoundException; results fetched before the error
    are delivered first.
    """

    def __init__(
        self,
        source: PageSource,
        start: Position,
        *,
        queue_size: int = 3,
        batching: Batching = Batching(),
        on_trimmed: Callable[[str, str], None] | None = None,
        gate: threading.Event | None = None,
        metrics: Metrics | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self._source = source
        #: metrics and logs name the shard by its lease key
        self.lease_key = source.address.lease_key
        hash_range = batching.hash_range
        self._key_range = None if hash_range is None else HashKeyRange(*hash_range)
        self._filter_outside = batching.filter_outside_hash_range
        self._deliver_empty = batching.deliver_empty
        self._deaggregate = batching.deaggregate
        self._on_trimmed = on_trimmed
        self._stop = threading.Event()
        #: reading and handing out pages wait while it is clear (the lease coordinator's
        #: retrieval gate: renewals come first)
        self._gate = gate
        self._sleep = sleep if sleep is not None else self._interruptible_sleep
        self._reading = Reading(start, self._stop, self._sleep)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

        m = metrics if metrics is not None else Metrics()
        shard = m.shard(self.lease_key, source.address.shard_id, source.address.stream_id)
        self._m_corrupt = {reason: shard.bind(DEAGGREGATION_ERRORS, reason)
                           for reason in CORRUPT_REASONS}
        self._m_filtered = shard.bind(RECORDS_FILTERED)
        self._m_depth = shard.bind(PREFETCH_QUEUE_DEPTH)

        self._shard_ended = False
        self._at_tip = False
        self._millis_behind_latest: int | None = None
        #: Kinesis records (an aggregate counts once) the source handed over, whatever its
        #: mode: a Spark task's records-fetched-per-row figure
        self.records_fetched = 0
        # Records at or before this (sequence, sub-sequence) were processed before we started;
        # cleared as soon as one record beyond it is seen, since sequence numbers only grow.
        self._skip_through: tuple[int, int] | None = start.extended if start.is_record else None
        #: the checkpoint whose record the first record back must be (``on_trimmed``)
        self._check_trimmed = (start.sequence_number if on_trimmed is not None
                               and self._skip_through is not None else None)
        # AT_TIMESTAMP: records that arrived before the timestamp are dropped until one at
        # or after it is seen. Kinesis already starts there; an endpoint that rounds the
        # timestamp (kinesis-mock: to the second) must not hand out records a recovery gap
        # ending at that timestamp also reads.
        self._skip_before_ms: int | None = (
            start.timestamp_ms if start.sentinel == AT_TIMESTAMP else None)

    # -- consumer side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the fetch thread; a daemon so a stuck HTTP call never blocks interpreter exit."""
        if self._thread is not None:
            raise RuntimeError(f"fetcher for {self.lease_key} already started")
        self._thread = threading.Thread(
            target=self._run, name=f"kclpy-fetch-{self.lease_key}", daemon=True
        )
        self._thread.start()

    @property
    def caught_up(self) -> bool:
        """The last page was empty at the tip of the shard and nothing waits in the queue:
        empty pages are not queued, so this is how a consumer learns it has caught up."""
        return self._at_tip and self._queue.empty()

    @property
    def retrieval(self) -> dict[str, Any]:
        """How the shard is read, for ``/status``: the source's mode and what it adds."""
        return self._source.status()

    @property
    def millis_behind_latest(self) -> int | None:
        """MillisBehindLatest of the last page, empty pages included."""
        return self._millis_behind_latest

    def get(self, timeout: float | None = None) -> Page[Records] | None:
        """The next result, or None on timeout or once the pipeline finished (see ``finished``).

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
                    raise FetchError(self.lease_key, self._error)
                return None
            self._m_depth.set(self._queue.qsize())
            assert isinstance(item, Page)
            result = self._expand(item)
            if result is not None:
                return result

    def stop(self, timeout: float | None = None) -> None:
        """Stop reading and join the thread.

        Sleeps and queue waits notice at once; an HTTP call in flight is not interruptible, so
        ``timeout`` bounds the join for callers that cannot wait for it.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("fetch thread for %s still in a call after stop", self.lease_key)
                return
        # Wake a get() that is blocked on an empty queue.
        self._put_nowait(_END)

    @property
    def error(self) -> BaseException | None:
        """The non-retryable error that ended the fetch thread, if any."""
        return self._error

    @property
    def finished(self) -> bool:
        """True once nothing more will be read: shard end reached, failed, or stopped."""
        return self._shard_ended or self._error is not None or self._stop.is_set()

    def fetch_once(self, limit: int | None = None) -> Page[Records] | None:
        """One iteration of the fetch loop, without the thread or the queue.

        Returns what the loop would have queued: None for an empty page (unless
        ``deliver_empty``), after shard end, and after stop(). Waits the source's idle time
        when the page was empty and the shard caught up, as the loop does. Fatal errors
        propagate. ``limit``: at most that many Kinesis records this read (``Reading.limit``).
        """
        self._reading.limit = limit
        try:
            page, idle = self._fetch()
        except Stopped:
            return None
        if idle:
            self._sleep(self._source.idle_s)
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
                    self._sleep(self._source.idle_s)
        except Stopped:
            pass
        except Exception as exc:
            logger.error("fetching shard %s stopped: %r", self.lease_key, exc)
            self._error = exc
        finally:
            self._source.close()
            with contextlib.suppress(Stopped):
                self._put(_END)

    def _await_gate(self) -> None:
        gate = self._gate
        while gate is not None and not gate.wait(0.1):
            if self._stop.is_set():
                raise Stopped

    def _interruptible_sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _put(self, item: object) -> None:
        """Block until there is room, but notice stop() within ``_POLL_S``."""
        while True:
            if self._stop.is_set():
                raise Stopped
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

    def _fetch(self) -> tuple[Page[Sequence[Record]] | None, bool]:
        """One read of the source: the page to queue (or None), and whether to wait the
        source's idle time before the next."""
        if self._shard_ended:
            return None, False
        page = self._source.read(self._reading)
        self.records_fetched += len(page.records)
        raw = self._handled(page.records)
        shard_end = page.shard_end
        if shard_end:
            self._shard_ended = True
        at_tip = not raw and page.caught_up and not shard_end
        self._at_tip = at_tip
        self._millis_behind_latest = page.millis_behind_latest
        if not (raw or shard_end or self._deliver_empty):
            return None, at_tip and self._source.idle_s > 0
        page.records = raw
        return page, at_tip and self._source.idle_s > 0

    def _handled(self, raw: Sequence[Record]) -> Sequence[Record]:
        """Note the page as read (a source that starts again resumes after its last record)
        and drop what arrived before an AT_TIMESTAMP start."""
        if raw:
            self._reading.last_sequence_number = raw[-1].sequence_number
            if self._check_trimmed is not None:
                self._look_for_trim(raw[0].sequence_number)
        if self._skip_before_ms is not None and raw:
            raw = _arrived_from(raw, self._skip_before_ms)
            if raw:
                self._skip_before_ms = None
        return raw

    def _look_for_trim(self, first: str) -> None:
        """A start AT a checkpoint gets the checkpoint's record back first, unless Kinesis
        no longer has it; ``on_trimmed`` decides what that means. The records after the gap
        are all beyond the checkpoint, so the resume point lets them through."""
        checkpoint, self._check_trimmed = self._check_trimmed, None
        assert checkpoint is not None and self._on_trimmed is not None
        if int(first) > int(checkpoint):
            self._on_trimmed(checkpoint, first)

    def _expand(self, page: Page[Sequence[Record]]) -> Page[Records] | None:
        """The page's user records (de-aggregated, filtered, after the resume point), or None
        if nothing is left to deliver. Runs on the thread that calls ``get()``."""
        records = EMPTY
        if page.records and not self._deaggregate:
            records = self._drop_processed(Records([page.records]))
        elif page.records:
            agg = deaggregate(page.records, key_range=self._key_range,
                              filter_outside=self._filter_outside)
            for reason, count in agg.reasons.items():
                self._m_corrupt[reason].inc(count)
            if agg.filtered:
                self._m_filtered.inc(agg.filtered)
                logger.warning(
                    "shard %s: %d user record(s) of aggregates with keys outside the shard's "
                    "hash-key range filtered out (kpl_hash_range_filter is on)",
                    self.lease_key, agg.filtered)
            records = self._drop_processed(agg.records)
        if not (records or page.shard_end or self._deliver_empty):
            return None
        return Page(records, page.millis_behind_latest, page.shard_end, page.child_shards,
                    page.caught_up, page.at_tip, page.bound_reached, page.shard_closed)

    def _drop_processed(self, records: Records) -> Records:
        """Drop the records at or before the checkpoint we resumed from."""
        skip = self._skip_through
        if skip is None:
            return records
        records = records.after(skip)
        if records:
            self._skip_through = None
        return records


def _arrived_from(records: Sequence[Record], from_ms: int) -> Sequence[Record]:
    """The records from the first one that arrived at or after ``from_ms``."""
    for index, record in enumerate(records):
        arrived = record.timestamp_millis
        if arrived is None or arrived >= from_ms:
            return records[index:]
    return records[:0]
