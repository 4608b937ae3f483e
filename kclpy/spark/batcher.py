"""Micro-batches for Spark from a kclpy worker, checkpointed only once Spark has them.

A worker runs one record processor per held shard; each of them here is a thin hand-off
into one :class:`MicroBatcher`, which gathers what all shards delivered and, per trigger,
turns it into a DataFrame (through Arrow) for the user's ``foreach_batch(df, batch_id)``.
The shard checkpoints move only after ``foreach_batch`` returned, so a crash, a failing
sink or a lost lease can repeat records but never lose them.

Why the pieces look the way they do:

- ``process_records`` blocks while its shard has more than ``max_pending_per_shard``
  records waiting or in flight. The shard consumer then stops taking from its fetcher, whose
  bounded queue stops the fetch thread: memory stays bounded however slow the sink is.
- Batch ids are a hash of the stream and of each shard's first and last position in the
  batch, so the retry of a failed batch carries the same id and a sink can make the retry
  idempotent (see docs/spark.md for the exactly-once file-sink recipe).
- With lag recovery a shard delivers two kinds of batches: live ones and recovered gaps
  (``is_recovery``), each with its own checkpointer. They wait in separate lanes and make
  separate parts of a batch (``ShardRange.is_recovery``), so each part is one run of
  records read in order and is checkpointed through its own checkpointer: a gap's
  records never move the live checkpoint, and live records never move a gap's.
- A checkpoint refused with ``ShutdownException`` means another worker owns the shard now;
  its part of the batch was written but stays un-checkpointed, and the new owner reads it
  again from the last checkpoint. That is logged and counted, never raised into the loop.
- Before each call of ``foreach_batch`` every part's lease is asked of the lease fence (its
  ``guard``: held in the tenure the records were read in, and renewed within the failover
  time). A part whose lease is gone is dropped from the batch before Spark sees it: its new
  owner reads those records again, and a zombie that kept handing them to the sink would
  write them a second time. A sink that commits (``ParquetSink``) goes further: it commits
  inside ``BatchInfo.commit_fence``, which holds every part's lease for the commit and gives
  its tenure, and raises :class:`FencedOut` for the parts it refuses; the batcher then drops
  those parts and calls again with the rest.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from kclpy.checkpoint import Checkpointer
from kclpy.errors import (
    CheckpointError,
    InvalidStateException,
    LeaseBusy,
    ShutdownException,
)
from kclpy.metrics import (
    NOWHERE,
    SPARK_BATCHES,
    SPARK_FOREACH_BATCH_FAILURES,
    SPARK_LOST_CHECKPOINTS,
    SPARK_RECORDS,
    Metrics,
)
from kclpy.position import SHARD_END
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record, Records
from kclpy.retry import GaveUp, RetryPolicy, RetryStopped, retrying
from kclpy.spark.arrow import Decoder, records_to_table

if TYPE_CHECKING:
    import pyarrow as pa

    from kclpy.leases.fence import Guard

__all__ = [
    "BatchInfo",
    "BatchOptions",
    "BatcherStats",
    "FencedOut",
    "ForeachBatch",
    "MicroBatcher",
    "ShardRange",
    "current_batch",
]

log = logging.getLogger(__name__)


def _checkpoint_retryable(exc: BaseException) -> bool:
    """A checkpoint is tried again after a throttle or a failed dependency; a lost lease and
    a refused position are final."""
    return isinstance(exc, CheckpointError) and not isinstance(
        exc, (ShutdownException, InvalidStateException))

#: The user's sink: called with the batch's DataFrame and its deterministic id.
ForeachBatch = Callable[[Any, str], None]


class DataFrameFactory(Protocol):
    """What the batcher needs of a SparkSession (tests hand in a fake)."""

    def createDataFrame(self, data: Any) -> Any: ...


@dataclass(frozen=True)
class BatchOptions:
    """When a batch starts and how much it may hold."""

    #: a batch starts as soon as this many records wait, and never holds more
    max_records: int = 100_000
    #: the longest a record waits before its batch starts
    max_interval_s: float = 10.0
    #: the shortest time between the starts of two batches, so that a busy stream makes
    #: fewer, larger batches instead of one per GetRecords page
    min_interval_s: float = 1.0
    #: ``process_records`` blocks while its shard has more records than this waiting or
    #: in flight (backpressure on the fetcher)
    max_pending_per_shard: int = 50_000
    #: backoff between attempts of a failing ``foreach_batch`` (and of a throttled checkpoint)
    retry_base_s: float = 0.5
    retry_cap_s: float = 30.0
    #: attempts at a checkpoint that fails with a retryable error before giving up on it
    #: (the records are then read again after a restart: repeated, never lost)
    checkpoint_attempts: int = 5
    #: how long ``shutdown_requested`` waits for the shard's pending records to be committed
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_records < 1 or self.max_pending_per_shard < 1:
            raise ValueError("max_records and max_pending_per_shard must be >= 1")
        if self.min_interval_s < 0 or self.max_interval_s < self.min_interval_s:
            raise ValueError("need 0 <= min_interval_s <= max_interval_s")
        if self.checkpoint_attempts < 1:
            raise ValueError("checkpoint_attempts must be >= 1")
        # checked here, not at the first failure a backoff of them would have to wait out
        if not 0 < self.retry_base_s <= self.retry_cap_s:
            raise ValueError(f"need 0 < retry_base_s <= retry_cap_s, got retry_base_s="
                             f"{self.retry_base_s}, retry_cap_s={self.retry_cap_s}")

    @property
    def retries(self) -> RetryPolicy:
        """A failing ``foreach_batch``'s backoff, and a failing checkpoint's
        ``checkpoint_attempts`` times."""
        return RetryPolicy(self.retry_base_s, self.retry_cap_s)


@dataclass(frozen=True)
class ShardRange:
    """One shard's part of a batch: from the first record to the last, both included."""

    #: the lease key the records were read for (the processor input's ``shard_id``; in a
    #: multi-stream application it starts with the stream identifier), under the name of
    #: the sink's column
    shard_id: str
    first_sequence_number: str
    first_sub_sequence_number: int
    last_sequence_number: str
    last_sub_sequence_number: int
    count: int
    #: the records are a recovered gap's (lag recovery), not live ones
    is_recovery: bool = False


#: ``BatchInfo.commit_fence``: entered around a sink's commit, yields each lease key's Guard
CommitFence = Callable[[], AbstractContextManager[Mapping[str, "Guard"]]]


class FencedOut(ShutdownException):
    """Raised (by the batcher's commit fence, or by a sink) when some of a batch's leases are
    no longer this worker's: nothing of the batch was committed. ``lease_keys`` names them;
    the batcher drops their parts and calls ``foreach_batch`` again with the rest."""

    def __init__(self, lease_keys: Collection[str], why: str) -> None:
        super().__init__(f"lease(s) {', '.join(sorted(lease_keys))}: {why}")
        self.lease_keys = frozenset(lease_keys)


@dataclass(frozen=True)
class BatchInfo:
    """What a sink may want besides the DataFrame; see :func:`current_batch`."""

    batch_id: str
    stream: str
    ranges: tuple[ShardRange, ...]
    #: 0 for the first call of this batch, then 1, 2, ... for retries
    attempt: int
    #: enter around the sink's commit (None outside a batcher: nothing to fence on). It
    #: holds every part's lease through the lease fence's ``guard`` - this worker's
    #: renewals, checkpoints and release of the lease (the one a graceful handoff waits
    #: for) wait for the block - and yields each lease key's ``Guard`` (``tenure``: the
    #: lease counter the tenure started at). Raises :class:`FencedOut` when a lease is no
    #: longer held. Another worker taking the lease once it expired here does not wait, so
    #: a sink also stores the tenure with each commit and refuses an earlier one's.
    commit_fence: CommitFence | None = field(default=None, compare=False, repr=False)


@dataclass
class BatcherStats:
    """Counters for tests and for callers without Prometheus."""

    batches: int = 0
    records: int = 0
    foreach_batch_failures: int = 0
    #: shard parts written but not checkpointed because the lease was gone
    lost_checkpoints: int = 0
    #: shard parts not checkpointed for any other reason (after retries)
    failed_checkpoints: int = 0
    #: shard parts dropped from a batch, unwritten, because the lease fence refused them
    fenced_parts: int = 0


_CURRENT: contextvars.ContextVar[BatchInfo | None] = contextvars.ContextVar(
    "kclpy_spark_batch", default=None)


def current_batch() -> BatchInfo | None:
    """The batch being handed to ``foreach_batch`` right now (None outside of it).

    A context variable rather than a third argument, so ``foreach_batch`` keeps Spark's own
    ``(df, batch_id)`` signature and the same function works with ``writeStream.foreachBatch``.
    """
    return _CURRENT.get()


def batch_id_for(stream: str, ranges: Sequence[ShardRange]) -> str:
    """Deterministic: the same shard ranges give the same id, in any order."""
    h = hashlib.sha256(stream.encode())
    for r in sorted(ranges, key=lambda r: (r.shard_id, r.is_recovery,
                                            int(r.first_sequence_number),
                                            r.first_sub_sequence_number)):
        h.update(
            f"\0{r.shard_id}\0{r.first_sequence_number}.{r.first_sub_sequence_number}"
            f"\0{r.last_sequence_number}.{r.last_sub_sequence_number}".encode()
        )
        if r.is_recovery:
            h.update(b"\0recovery")
    return f"kclpy-{h.hexdigest()[:32]}"


@dataclass(eq=False)
class _Lane:
    """Records of one checkpointer waiting for a batch: the shard's live records, or one
    recovered gap's."""

    checkpointer: Checkpointer
    is_recovery: bool
    #: the shard's batches as they were delivered (a page's rows, an aggregate's columns),
    #: in order: copied into a list they would build a Record per row, which cost more than
    #: the rest of this path's work on a record
    runs: list[Sequence[Record]] = field(default_factory=list)
    count: int = 0

    def add(self, records: Sequence[Record]) -> None:
        self.runs.append(records)
        self.count += len(records)

    def take(self, most: int) -> Records:
        """The first ``most`` waiting records (fewer if fewer wait), removed from the lane."""
        taken: list[Sequence[Record]] = []
        left = most
        while self.runs and left:
            run = self.runs[0]
            if len(run) <= left:
                taken.append(self.runs.pop(0))
                left -= len(run)
            else:
                taken.append(run[:left])
                self.runs[0] = run[left:]
                left = 0
        self.count -= most - left
        return Records(taken)


@dataclass(eq=False)
class _Shard:
    """One processor's view in the batcher: records waiting for a batch, and records in one."""

    #: the lease the processor was initialised for (its input's ``shard_id``)
    lease_key: str
    #: the shard's stream (what its initialize input named)
    stream: str | None = None
    #: waiting records, in the order they were delivered, one lane per checkpointer
    lanes: list[_Lane] = field(default_factory=list)
    pending_since: float | None = None
    in_flight: int = 0
    #: the lease is gone (or the processor ended): nothing of this shard is batched any more
    closed: bool = False
    flush: bool = False

    @property
    def pending(self) -> int:
        """How many records wait for a batch."""
        return sum(lane.count for lane in self.lanes)


@dataclass
class _Part:
    shard: _Shard
    checkpointer: Checkpointer
    records: Sequence[Record]
    is_recovery: bool = False


class MicroBatcher:
    """Gathers the records of every shard a worker holds into Spark micro-batches.

    Use ``processor_factory`` as the worker's processor factory, ``start()`` it before the
    worker runs and ``stop()`` it after. ``run_once()`` forms and runs one batch on the
    calling thread, for tests and for callers that drive their own loop.
    """

    def __init__(
        self,
        spark: DataFrameFactory,
        foreach_batch: ForeachBatch,
        *,
        stream: str,
        options: BatchOptions | None = None,
        decode: Decoder | None = None,
        metrics: Metrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spark = spark
        self._foreach_batch = foreach_batch
        self.stream = stream
        self.options = options or BatchOptions()
        self._decode = decode
        self._clock = clock
        self._cond = threading.Condition()
        self._shards: list[_Shard] = []
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_start: float | None = None
        self._rotation = 0
        #: called (from the batch thread) when the loop stops on an unexpected error;
        #: ``run_worker`` shuts the worker down with it
        self.on_fatal = on_fatal
        #: the unexpected error that stopped the batch loop, if any
        self.error: BaseException | None = None
        self.stats = BatcherStats()
        self._m = metrics if metrics is not None else NOWHERE

    # -- lifecycle -----------------------------------------------------------------------

    def processor_factory(self) -> IRecordProcessor:
        """A new per-shard processor feeding this batcher (pass the method itself as the
        worker's factory)."""
        return _BatchingProcessor(self)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("batcher already started")
        self._thread = threading.Thread(target=self._run, name="kclpy-spark-batcher",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop making batches. A ``foreach_batch`` call in progress is waited for (up to
        ``timeout``); records not yet committed stay un-checkpointed and are read again by
        whoever holds their shard next."""
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def run_once(self) -> BatchInfo | None:
        """Take everything due regardless of the trigger intervals and run it as one batch."""
        with self._cond:
            parts = self._take()
        return self._run_batch(parts) if parts else None

    # -- called by the processors (consumer threads) -------------------------------------

    def _register(self, lease_key: str, stream: str | None = None) -> _Shard:
        shard = _Shard(lease_key, stream)
        with self._cond:
            self._shards.append(shard)
        return shard

    def _offer(
        self, shard: _Shard, records: Sequence[Record], checkpointer: Checkpointer,
        is_recovery: bool = False,
    ) -> None:
        """Queue a shard's records in the lane of their checkpointer, then block while the
        shard holds too many."""
        if not records:
            return
        with self._cond:
            if shard.closed or self.stopped:
                return
            if not shard.pending:
                shard.pending_since = self._clock()
            lane = next((lane for lane in shard.lanes if lane.checkpointer is checkpointer),
                        None)
            if lane is None:
                lane = _Lane(checkpointer, is_recovery)
                shard.lanes.append(lane)
            lane.add(records)
            self._cond.notify_all()
            bound = self.options.max_pending_per_shard
            while (shard.pending + shard.in_flight > bound
                   and not shard.closed and not self.stopped):
                self._cond.wait()

    def _drain(self, shard: _Shard, timeout: float | None) -> bool:
        """Ask for the shard's records to be batched now; True once all are committed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            shard.flush = True
            self._cond.notify_all()
            while shard.pending or shard.in_flight:
                if shard.closed or self.stopped:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            shard.flush = False
            return not shard.closed

    def _close(self, shard: _Shard, why: str) -> None:
        """Forget the shard: its waiting records are dropped (they were never checkpointed,
        so the shard's next owner reads them again) and its blocked caller is released."""
        with self._cond:
            if shard.pending:
                log.info("shard %s: %s; dropping %d uncommitted record(s), the next owner "
                         "reads them again", shard.lease_key, why, shard.pending)
            shard.closed = True
            shard.lanes = []
            shard.pending_since = None
            if shard.in_flight == 0 and shard in self._shards:
                self._shards.remove(shard)
            self._cond.notify_all()

    # -- the batch loop ------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopped:
            with self._cond:
                wait = self._due_in(self._clock())
                if wait is None or wait > 0:
                    self._cond.wait(wait)
                    continue
                parts = self._take()
            if parts:
                try:
                    self._run_batch(parts)
                except BaseException as exc:
                    # Only a bug can get here (sink and decoder errors are retried inside).
                    # Carrying on would let later batches checkpoint past this one's
                    # records, so stop, and let the owner shut the worker down.
                    log.exception("spark batcher: unexpected error; stopping")
                    self.error = exc
                    self.stop()
                    if self.on_fatal is not None:
                        self.on_fatal(exc)
                    return

    def _due_in(self, now: float) -> float | None:
        """Seconds until the next batch is due (<= 0: now), or None when nothing waits."""
        live = [s for s in self._shards if s.pending and not s.closed]
        if not live:
            return None
        opts = self.options
        if (sum(s.pending for s in live) >= opts.max_records
                or any(s.flush for s in live)):
            ready_at = now
        else:
            oldest = min((s.pending_since for s in live if s.pending_since is not None),
                         default=now)
            ready_at = oldest + opts.max_interval_s
        if self._last_start is not None:
            ready_at = max(ready_at, self._last_start + opts.min_interval_s)
        return ready_at - now

    def _take(self) -> list[_Part]:
        """Move up to ``max_records`` pending records into a batch (caller holds the lock).

        Shards are visited from a rotating start so that, when the limit cuts a batch short,
        the same shard is not always the one left waiting.
        """
        live = [s for s in self._shards if s.pending and not s.closed]
        if not live:
            return []
        self._rotation = (self._rotation + 1) % len(live)
        live = live[self._rotation:] + live[:self._rotation]
        room = self.options.max_records
        parts: list[_Part] = []
        for shard in live:
            for lane in list(shard.lanes):
                if room == 0:
                    break
                taken = lane.take(room)
                if not lane.count:
                    shard.lanes.remove(lane)
                shard.in_flight += len(taken)
                room -= len(taken)
                parts.append(_Part(shard, lane.checkpointer, taken, lane.is_recovery))
            if not shard.pending:
                shard.pending_since = None
        self._last_start = self._clock()
        return parts

    def _run_batch(self, parts: list[_Part]) -> BatchInfo | None:
        try:
            done = self._call_until_success(parts)
            if done is None:
                return None
            info, written = done
            count = sum(r.count for r in info.ranges)
            self.stats.batches += 1
            self.stats.records += count
            self._m.inc(SPARK_BATCHES)
            self._m.inc(SPARK_RECORDS, by=count)
            for part in written:
                self._checkpoint(part)
            return info
        finally:
            self._release(parts)

    def _call_until_success(
        self, parts: list[_Part]
    ) -> tuple[BatchInfo, list[_Part]] | None:
        """Call foreach_batch until it returns: the batch as written and its parts. None if
        the batcher stopped meanwhile, or every part's lease was lost.

        The table is built inside the retried block: a decoder that raises must hold the
        batch back like a failing sink does, since skipping it would let the shards' next
        batches checkpoint past records that never reached Spark. Before each call the
        parts whose lease the fence no longer lets through are dropped (their records are
        the new owner's to write), and so are those a sink refused with ``FencedOut``; the
        rest is a new batch, with its own id.
        """
        attempt = 0
        table: pa.Table | None = None
        batch_id = ""

        def call_once() -> tuple[BatchInfo, list[_Part]] | None:
            nonlocal parts, table, attempt, batch_id
            kept = self._drop_fenced(parts, self._lost_leases(parts), "lease lost before "
                                     "foreach_batch")
            if len(kept) != len(parts):
                parts, table, attempt = kept, None, 0
            if not parts:
                return None
            ranges = self._ranges(parts)
            batch_id = batch_id_for(self.stream, ranges)
            info = BatchInfo(batch_id, self.stream, ranges, attempt,
                             commit_fence=functools.partial(self._commit_fence, parts))
            token = _CURRENT.set(info)
            try:
                if table is None:
                    table = records_to_table(
                        self.stream, [(p.shard.lease_key, p.records) for p in parts],
                        self._decode, streams={p.shard.lease_key: p.shard.stream
                                               for p in parts if p.shard.stream})
                df = self._spark.createDataFrame(table)
                self._foreach_batch(df, batch_id)
                return info, parts
            except FencedOut as exc:
                # Nothing was committed; the refused parts go (a refusal naming none of them
                # is an ordinary failure: backed off)
                kept = self._drop_fenced(parts, exc.lease_keys & {p.shard.lease_key
                                                                  for p in parts},
                                         "sink's commit fenced out")
                if len(kept) == len(parts):
                    raise
                log.warning("batch %s: the sink refused %s; calling again without them",
                            batch_id, exc)
                parts, table, attempt = kept, None, 0
            finally:
                _CURRENT.reset(token)
            # the rest is a new batch, called now: parts only shrink, so this ends
            return call_once()

        def retry_later(exc: BaseException, failures: int, delay: float) -> None:
            nonlocal attempt
            self.stats.foreach_batch_failures += 1
            self._m.inc(SPARK_FOREACH_BATCH_FAILURES)
            if isinstance(exc, FencedOut):
                log.error("foreach_batch for batch %s refused leases it does not hold (%s); "
                          "retrying in %.2fs", batch_id, exc, delay)
            else:
                log.exception("foreach_batch failed for batch %s (attempt %d); nothing is "
                              "checkpointed, retrying in %.2fs", batch_id, attempt, delay)
            attempt += 1

        try:
            return retrying(call_once, self.options.retries.backoff(),
                            retry_on=lambda exc: True, wait=self._stopped.wait,
                            on_retry=retry_later)
        except RetryStopped:
            log.warning("batcher stopped while batch %s was failing; its records stay "
                        "un-checkpointed and will be read again", batch_id)
            return None

    @staticmethod
    def _ranges(parts: Sequence[_Part]) -> tuple[ShardRange, ...]:
        return tuple(
            ShardRange(
                p.shard.lease_key,
                p.records[0].sequence_number, p.records[0].sub_sequence_number,
                p.records[-1].sequence_number, p.records[-1].sub_sequence_number,
                len(p.records), p.is_recovery)
            for p in parts)

    @staticmethod
    def _guard(part: _Part, what: str, wait: bool = True) -> AbstractContextManager[Guard]:
        """The lease fence's guard of ``part``'s tenure (the writer and token its
        checkpointer holds: a gap's checkpointer guards the same lease and tenure)."""
        return part.checkpointer.fenced(
            lambda writer, lease_key, token: writer.guard(lease_key, token, what=what,
                                                          wait=wait))

    @staticmethod
    def _by_lease(parts: Sequence[_Part]) -> dict[str, _Part]:
        """One part per lease key (a live part and a gap's share the lease and its lock),
        in key order."""
        first: dict[str, _Part] = {}
        for part in parts:
            first.setdefault(part.shard.lease_key, part)
        return dict(sorted(first.items()))

    def _lost_leases(self, parts: Sequence[_Part]) -> set[str]:
        """The lease keys of ``parts`` the fence no longer lets this tenure write."""
        lost = set()
        for lease_key, part in self._by_lease(parts).items():
            try:
                with self._guard(part, "spark batch"):
                    pass
            except ShutdownException:
                lost.add(lease_key)
        return lost

    @contextmanager
    def _commit_fence(self, parts: Sequence[_Part]) -> Iterator[Mapping[str, Guard]]:
        """``BatchInfo.commit_fence``: every part's lease held for the block.

        A lease's lock is waited for only while no other is held: the first one taken
        waits, the others are tried, and one another write holds (``LeaseBusy``) makes the
        fence let go of all it took and wait for that one first. A fence that kept the
        locks it had while a renewal of another lease waited for a slow DynamoDB answer
        held back the renewals of those leases too, and lost them to their expiry
        (simulator seeds 665 and 380)."""
        by_lease = self._by_lease(parts)
        first = next(iter(by_lease), None)
        while True:
            guards: dict[str, Guard] = {}
            lost: set[str] = set()
            busy: str | None = None
            order = [] if first is None else [first, *(k for k in by_lease if k != first)]
            with ExitStack() as stack:
                for lease_key in order:
                    try:
                        guards[lease_key] = stack.enter_context(self._guard(
                            by_lease[lease_key], "spark sink commit", wait=not guards))
                    except LeaseBusy:
                        busy = lease_key
                        break
                    except ShutdownException:
                        lost.add(lease_key)
                if busy is None:
                    if lost:
                        raise FencedOut(lost, "no longer held by this worker's tenure")
                    yield guards
                    return
            first = busy

    def _drop_fenced(self, parts: list[_Part], lease_keys: Collection[str],
                     why: str) -> list[_Part]:
        """``parts`` without those of ``lease_keys``, whose shards are closed: their records
        were not written and are read again by whoever holds the lease now."""
        if not lease_keys:
            return parts
        kept = []
        for part in parts:
            if part.shard.lease_key not in lease_keys:
                kept.append(part)
                continue
            self.stats.fenced_parts += 1
            self._m.inc(SPARK_LOST_CHECKPOINTS)
            log.warning("shard %s: %s; its %d record(s) are left to the lease's new owner",
                        part.shard.lease_key, why, len(part.records))
            self._close(part.shard, why)
        return kept

    def _checkpoint(self, part: _Part) -> None:
        last = part.records[-1]
        lease_key = part.shard.lease_key
        retries = replace(self.options.retries, max_attempts=self.options.checkpoint_attempts)

        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.warning("shard %s: checkpoint failed (%s, attempt %d); retrying in %.2fs",
                        lease_key, getattr(exc, "name", type(exc).__name__), attempt, delay)

        try:
            retrying(functools.partial(part.checkpointer.checkpoint, last.sequence_number,
                                       last.sub_sequence_number),
                     retries, retry_on=_checkpoint_retryable, wait=self._stopped.wait,
                     on_retry=retry_later)
        except ShutdownException:
            self.stats.lost_checkpoints += 1
            self._m.inc(SPARK_LOST_CHECKPOINTS)
            log.warning("shard %s: lease lost while batch was in flight; its %d record(s) "
                        "were written but not checkpointed and will be read again by the "
                        "new owner", lease_key, len(part.records))
            self._close(part.shard, "lease lost")
            return
        except InvalidStateException:
            self.stats.failed_checkpoints += 1
            log.exception("shard %s: checkpoint refused", lease_key)
            return
        except (GaveUp, RetryStopped):
            self.stats.failed_checkpoints += 1
            log.error("shard %s: could not checkpoint after batch; its records will be read "
                      "again", lease_key)

    def _release(self, parts: list[_Part]) -> None:
        with self._cond:
            for part in parts:
                part.shard.in_flight -= len(part.records)
                if part.shard.closed and part.shard.in_flight == 0 and part.shard in self._shards:
                    self._shards.remove(part.shard)
            self._cond.notify_all()


class _BatchingProcessor(IRecordProcessor):
    """One shard's processor: everything goes to the batcher, which checkpoints."""

    def __init__(self, batcher: MicroBatcher) -> None:
        self._batcher = batcher
        self._shard: _Shard | None = None
        self._lease_key: str | None = None
        self._stream: str | None = None
        #: shard_ended checkpointed SHARD_END, or the processor was started at SHARD_END (it
        #: gets only a finished shard's recovered gaps): no live records come any more
        self._ended = False

    def initialize(self, initialize_input: InitializeInput) -> None:
        self._lease_key = initialize_input.shard_id
        self._stream = initialize_input.stream_name
        if initialize_input.sequence_number == SHARD_END:
            # A finished shard's queued gaps (the live processor ended the shard, or the
            # lease was taken for them): the consumer lets the lease go as soon as it
            # handed them over, so each must be committed before process_records returns
            # (else the batch finds the lease gone, the gap stays queued, and every next
            # owner does the same).
            self._ended = True
            return
        self._shard = self._batcher._register(self._lease_key, self._stream)

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        if self._ended:
            self._process_after_shard_end(process_records_input)
            return
        assert self._shard is not None
        self._batcher._offer(self._shard, process_records_input.records,
                             process_records_input.checkpointer,
                             process_records_input.is_recovery)

    def _process_after_shard_end(self, process_records_input: ProcessRecordsInput) -> None:
        """A recovered gap's batch of a shard that ended (the consumer recovers what is
        still queued with a processor started at SHARD_END before letting the lease go):
        committed before this returns, in a shard entry of its own that is forgotten again,
        so a finished shard leaves nothing in the batcher. Dropping it would leave the gap
        queued for the lease's next owner."""
        assert self._lease_key is not None
        shard = self._batcher._register(self._lease_key, self._stream)
        try:
            self._batcher._offer(shard, process_records_input.records,
                                 process_records_input.checkpointer,
                                 process_records_input.is_recovery)
            if not self._batcher._drain(shard, timeout=None):
                log.warning("shard %s: a recovered gap's batch after the shard's end was not "
                            "committed; the gap stays queued", self._lease_key)
        finally:
            self._batcher._close(shard, "recovered gap batch done")

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        if self._shard is not None:
            self._batcher._close(self._shard, "lease lost")

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        """SHARD_END only after every record of the shard is in a committed batch: the
        children start once it is written, and must not overtake their parent's records.
        A processor started at SHARD_END has nothing left: each gap batch it got was
        committed before ``process_records`` returned (the consumer calls it too, as the
        gaps' processor's final callback)."""
        if self._ended:
            return
        assert self._shard is not None
        if self._batcher._drain(self._shard, timeout=None):
            shard_ended_input.checkpointer.checkpoint()
            self._batcher._close(self._shard, "shard ended")
            self._shard = None
            self._ended = True

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        if self._shard is None:
            return
        if not self._batcher._drain(self._shard, self._batcher.options.drain_timeout_s):
            log.warning("shard %s: shutting down with records not yet committed; they will be "
                        "read again", self._shard.lease_key)
        self._batcher._close(self._shard, "shutdown requested")
