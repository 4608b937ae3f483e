"""One shard's consumer: a small state machine on its own delivery thread.

WAITING_ON_PARENTS -> INITIALIZING -> PROCESSING -> SHUTTING_DOWN -> DONE, as in the Java KCL.
The fetcher runs ahead on its own thread; this thread is the only one that calls the
processor, so a processor sees its shard's records strictly in order and never concurrently.
Everything the consumer needs from above comes in three seams, so it never reaches back up
the chain to the worker: the lease fence it writes through (``ShardFence``), the readers of
its shard (``ShardReaders``, built by ``kclpy.composition``) and the worker that runs it
(``ShardHost``).
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any, Protocol, TypeVar

from botocore.exceptions import ClientError

from kclpy.checkpoint import Checkpointer, CheckpointWriter, StartWriter, keep_start
from kclpy.errors import CheckpointError, KCLError, ProcessorRestartRequired, ShutdownException
from kclpy.leases import park
from kclpy.leases.dynamo import TABLE_ERRORS
from kclpy.leases.lease import Lease
from kclpy.metrics import (
    BATCH_MILLIS_BEHIND_LATEST,
    BYTES_PROCESSED,
    DATA_LOST_TO_RETENTION,
    PROCESS_RECORDS,
    PROCESSOR_ERRORS,
    RECORDS_PROCESSED,
    SHARD_CONSUMER_STATE,
    SHARD_FAILING_SINCE,
    SHARD_FAILURE,
    SHARD_FAILURE_ATTEMPTS,
    SHARDS_PARKED_BY_POLICY,
    Metrics,
    Scope,
)
from kclpy.position import AT_TIMESTAMP, LATEST, Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record, Records
from kclpy.retrieval.page import ChildShard, Page
from kclpy.retrieval.pipeline import FetchError
from kclpy.retry import EQUAL, RetryPolicy, RetryStopped, is_not_found, retrying

_T = TypeVar("_T")

log = logging.getLogger(__name__)


class ConsumerState(enum.Enum):
    WAITING_ON_PARENTS = "WAITING_ON_PARENTS"
    INITIALIZING = "INITIALIZING"
    PROCESSING = "PROCESSING"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    DONE = "DONE"
    #: process_records keeps failing on one batch (``ShardConsumer.failure`` says how)
    FAILED = "FAILED"


class FetcherLike(Protocol):
    def start(self) -> None: ...
    def get(self, timeout: float | None = None) -> Page[Records] | None: ...
    def stop(self) -> None: ...
    @property
    def caught_up(self) -> bool: ...
    @property
    def millis_behind_latest(self) -> int | None: ...
    @property
    def retrieval(self) -> dict[str, Any]: ...


class RecoveryLike(Protocol):
    """A shard's lag recovery (``kclpy.recovery.shard.ShardRecovery``)."""

    def begin(self, live: Position) -> datetime | None: ...
    def poll(self) -> tuple[Page[Records], Checkpointer] | None: ...
    def left_stream(self) -> None: ...
    @property
    def active(self) -> bool: ...
    #: a gap's read was answered not found this tenure
    not_found: bool
    def stop(self) -> None: ...
    def status(self) -> list[dict[str, Any]]: ...
    @property
    def read_unfinished(self) -> bool: ...
    def finisher(self) -> CheckpointWriter: ...


class ShardFence(CheckpointWriter, StartWriter, Protocol):
    """The lease fence (``LeaseFence``) as one tenure of a shard uses it: checkpoints, the
    resolved start and the park mark are all writes only the holder may make, and whether
    the tenure still holds the lease is asked of the same fence that refuses them."""

    def holds(self, lease_key: str, token: str) -> bool:
        """Whether a checkpoint of tenure ``token`` would be let through now."""


class ShardReaders(Protocol):
    """How one lease's shard is read: the retrieval mode, lag recovery and the clock are
    chosen where the parts are built (``kclpy.composition``), so a new mode or reader
    changes nothing here."""

    def live(self, start: Position) -> FetcherLike:
        """A fetcher positioned right after ``start`` (the checkpoint), or at its time (an
        ``AT_TIMESTAMP`` position: where live reading starts while a gap is recovered, or
        where a lease still at ``LATEST`` / ``AT_TIMESTAMP`` was resolved to)."""

    def recovery(self) -> RecoveryLike | None:
        """The shard's lag recovery (None: none); made on the consumer's thread, so an
        unreadable queue fails this shard only."""

    def oldest_record(self) -> Record | None:
        """The shard's oldest record now (a one-record read from ``TRIM_HORIZON``), to tell
        a checkpoint the stream's retention trimmed past; None: nothing kept, or not looked."""

    def now(self) -> float:
        """Now in epoch seconds, where a ``LATEST`` lease starts (Kinesis' clock)."""

    @property
    def initial_timestamp(self) -> datetime | None:
        """Where an ``AT_TIMESTAMP`` lease starts (None: the fetcher resolves it)."""


class ShardHost(Protocol):
    """What a consumer asks of the worker running it, and tells it; the worker implements
    it (tests write their own)."""

    def get_lease(self, lease_key: str) -> Lease | None:
        """The lease as the table has it now (a parent at ``SHARD_END``, the durable
        checkpoint a restarted processor resumes from)."""

    def shard_ended(self, lease_key: str, children: Sequence[ChildShard]) -> None:
        """The shard is fully read: its children's leases are to be created (as GetRecords
        reported them; none: found by a shard sync)."""

    def shard_left_stream(self, lease_key: str) -> frozenset[str] | None:
        """Kinesis answered that the shard is not found: its children's lease keys when
        the shard is confirmed to have left the stream unfinished (its records past the
        retention), None when it is not (``ShardSyncer.left_unfinished``)."""


@dataclass(frozen=True)
class ConsumerSettings:
    parent_shard_poll_interval_s: float = 10.0
    task_backoff_s: float = 0.5
    max_task_backoff_s: float = 30.0
    processor_error_policy: str = "retry"
    #: ``park`` policy: failed attempts at one batch before the shard is parked
    processor_error_attempts: int = 3
    #: a checkpoint past the stream's retention parks the shard instead of reading on
    fail_on_data_loss: bool = False
    call_process_records_even_for_empty_record_list: bool = False
    poll_timeout_s: float = 0.2

    @property
    def task_retries(self) -> RetryPolicy:
        """Retries of a failed processor call or lease write: equal jitter, so the
        processor gets at least half the ceiling to recover."""
        return RetryPolicy(self.task_backoff_s, self.max_task_backoff_s, jitter=EQUAL)


class _InitializeFailed(Exception):
    """A processor's ``initialize`` raised (the ``__cause__``): that attempt is retried with
    a new processor."""


def _checkpoint_retryable(exc: BaseException) -> bool:
    """A write through the fence is retried after every checkpoint failure but a lost lease."""
    return isinstance(exc, CheckpointError) and not isinstance(exc, ShutdownException)


def _table_failure(exc: BaseException) -> bool:
    return isinstance(exc, TABLE_ERRORS)


class _NotAtShardEnd(Exception):
    """``shard_ended`` returned (or raised) without checkpointing at SHARD_END: it is called
    again, as the Java KCL's ShutdownTask is, since the children wait for that checkpoint."""


def _not_at_shard_end(exc: BaseException) -> bool:
    return isinstance(exc, _NotAtShardEnd)


class _BatchFailed(Exception):
    """``process_records`` raised (the ``__cause__``) under the ``retry`` policy, or under
    ``park`` with attempts left: the same batch is handed over again after a backoff."""


def _batch_failed(exc: BaseException) -> bool:
    return isinstance(exc, _BatchFailed)


def _initialize_failed(exc: BaseException) -> bool:
    return isinstance(exc, _InitializeFailed)


class FatalProcessorError(KCLError):
    """process_records failed under the ``shutdown`` policy: the worker must stop."""


class ShardConsumer:
    """Runs one held lease until the shard ends, the lease is lost, or shutdown is asked."""

    def __init__(
        self,
        lease: Lease,
        *,
        concurrency_token: str,
        processor_factory: Callable[[], IRecordProcessor],
        fence: ShardFence,
        readers: ShardReaders,
        host: ShardHost,
        settings: ConsumerSettings,
        metrics: Metrics,
        rng: random.Random | None = None,
        stream_name: str | None = None,
    ) -> None:
        #: the lease key, unique across the streams of a multi-stream application
        self.lease_key = lease.lease_key
        self.stream_name = stream_name
        self._lease = lease
        self._token = concurrency_token
        self._processor_factory = processor_factory
        self._fence = fence
        self._readers = readers
        self._host = host
        self._settings = settings
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._lease_lost = threading.Event()
        self._shutdown = threading.Event()
        self._wake = threading.Event()
        self._state = ConsumerState.WAITING_ON_PARENTS
        self._processor: IRecordProcessor | None = None
        self._checkpointer: Checkpointer | None = None
        #: the checkpointers handed to the current processor (its live one and those of the
        #: recovery batches it got), retired when it is replaced (``_retire``)
        self._handed: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
        self._fetcher: FetcherLike | None = None
        self._recovery: RecoveryLike | None = None
        #: the processor got its last callback (lease_lost, shutdown_requested, or
        #: shard_ended with SHARD_END checkpointed)
        self._processor_ended = False
        #: the shard's metrics (the worker opened its scope; closed when the shard leaves)
        self._m = metrics.shard(lease.lease_key, lease.shard_id, lease.stream)
        self._m_process = self._m.bind(PROCESS_RECORDS)
        self._m_records = self._m.bind(RECORDS_PROCESSED)
        self._m_bytes = self._m.bind(BYTES_PROCESSED)
        self._m_behind = self._m.bind(BATCH_MILLIS_BEHIND_LATEST)
        #: where a lease at LATEST / AT_TIMESTAMP reads from, once resolved (``_start_of``)
        self._start_at: datetime | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"kclpy-consumer-{self.lease_key}", daemon=True)
        #: set when the consumer stopped on an error the worker must act on
        self.error: BaseException | None = None
        #: the last fetch found the shard caught up (or the shard was already finished)
        self.caught_up = False
        #: the processor checkpointed SHARD_END
        self.shard_ended = False
        self.millis_behind_latest: int | None = None
        #: while process_records keeps failing on one batch: the last error and since when
        self.failure: dict[str, Any] | None = None
        #: the park policy parked the shard (its lease is then let go)
        self.parked = False
        self._publish_state()

    # -- control, from the worker's thread -----------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def notify_lease_lost(self) -> None:
        self._lease_lost.set()
        self._wake.set()

    def request_shutdown(self) -> None:
        self._shutdown.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def concurrency_token(self) -> str:
        """Identifies the lease incarnation this consumer serves (retaken => new token)."""
        return self._token

    @property
    def state(self) -> ConsumerState:
        return self._state

    @property
    def done(self) -> bool:
        return self._state is ConsumerState.DONE

    @property
    def ended_why(self) -> str:
        """Why the consumer stopped or is stopping, for the worker's log."""
        if self.error is not None:
            return f"error {self.error!r}"
        if self.parked:
            return "parked"
        if self.shard_ended:
            return "shard ended"
        if self._lease_lost.is_set():
            return "told the lease was lost"
        if self._shutdown.is_set():
            return "shutdown requested"
        return "running"

    @property
    def position(self) -> Position:
        """The shard's checkpoint: the processor's last, else the lease's."""
        if self._checkpointer is not None:
            return self._checkpointer.position
        return self._lease.checkpoint

    # -- the delivery thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._wait_for_parents():
                self._set_state(ConsumerState.INITIALIZING)
                self._recovery = self._readers.recovery()
                if self._lease.is_shard_end:
                    # A closed shard's lease is only taken while gaps of it are queued.
                    if self._recovering():
                        self._recover_after_shard_end()
                    self.caught_up = self.shard_ended = True
                elif self._initialize(self._lease.checkpoint):
                    self._set_state(ConsumerState.PROCESSING)
                    self._process_loop()
        except FatalProcessorError as exc:
            self.error = exc
            self._end_after_error()
        except Exception as exc:
            log.exception("shard %s: consumer failed", self.lease_key)
            self.error = exc
            self._end_after_error()
        finally:
            if self._fetcher is not None:
                self._fetcher.stop()
            if self._recovery is not None:
                self._recovery.stop()
            self._set_state(ConsumerState.DONE)

    def _end_after_error(self) -> None:
        """A consumer that fails (its fetcher stopped, a lease-table call, the ``shutdown``
        policy) still gives its processor a last callback: ``lease_lost``, since the lease
        is going and nothing may be checkpointed. Without it a processor holding resources
        (a MultiLang child, connections) would keep them for ever, and every retake of the
        shard would add another."""
        if self._processor is not None and not self._processor_ended:
            self._end_with_lease_lost()

    def _stopping(self) -> bool:
        return self._lease_lost.is_set() or self._shutdown.is_set()

    def _lease_gone(self) -> bool:
        """This tenure no longer holds the lease: told so, or its fence says so (a lease
        given up between the loop's last look and now, or not yet noticed by anyone): asked
        before every batch is handed to the processor."""
        return self._lease_lost.is_set() or not self._fence.holds(self.lease_key, self._token)

    def _wait_for_parents(self) -> bool:
        """Block until every parent that has a lease is checkpointed at SHARD_END, so that a
        parent's records are all processed before any of its children's."""
        pending = set(self._lease.parent_lease_keys)
        while pending:
            for parent in sorted(pending):
                lease = self._host.get_lease(parent)
                if lease is None or lease.is_shard_end:
                    pending.discard(parent)
            if not pending:
                break
            log.debug("shard %s waits on parents %s", self.lease_key, sorted(pending))
            if self._pause(self._settings.parent_shard_poll_interval_s):
                return False
        return not self._stopping()

    def _pause(self, seconds: float) -> bool:
        """Sleep, waking early on lease loss or shutdown. True when the consumer must stop."""
        self._wake.wait(seconds)
        self._wake.clear()
        return self._stopping()

    def _backoff(self, attempt: int) -> float:
        return self._settings.task_retries.delay(attempt, self._rng)

    def _retried(self, call: Callable[[], _T], retry_on: Callable[[BaseException], bool],
                 on_retry: Callable[[BaseException, int, float], None]) -> _T:
        """``call()`` retried with the task backoff until it succeeds or fails in a way
        ``retry_on`` refuses; :class:`RetryStopped` when the consumer must stop meanwhile."""
        return retrying(call, self._settings.task_retries, retry_on=retry_on,
                        wait=self._pause, rng=self._rng, on_retry=on_retry)

    def _initialize(self, position: Position) -> bool:
        """New processor, checkpointer and fetcher positioned right after ``position`` (the
        checkpoint; or, when the shard is too far behind, at the live start recovery chose; a
        lease still at ``LATEST`` / ``AT_TIMESTAMP`` at the start it was resolved to).

        At ``SHARD_END`` there is no fetcher: the processor gets only the gaps still queued.
        When it replaces one of this tenure (the live processor ended the shard, or one was
        restarted), the gaps are read again from their own checkpoints, with checkpointers
        of their own: those of the processor replaced were retired with it."""
        checkpoint, sub_sequence_number = position.checkpoint, position.sub_sequence_number
        start_at = None
        replacing = self._checkpointer is not None
        if self._recovery is not None and (replacing or not position.is_shard_end):
            try:
                start_at = self._recovery.begin(position)
            except ShutdownException as exc:
                log.info("shard %s: lease lost while queueing a recovery gap: %s",
                         self.lease_key, exc)
                self._lease_lost.set()
                return False
        if position.sentinel in (LATEST, AT_TIMESTAMP):
            start_at = self._start_of(checkpoint)
            if self._stopping():
                return False
        read_from = position
        if start_at is None and self._past_retention(position):
            if self._settings.fail_on_data_loss:
                self._park_shard(f"checkpoint {checkpoint} is past the stream's retention "
                                 "(fail_on_data_loss)")
                return False
            read_from = Position.trim_horizon()

        def initialized() -> IRecordProcessor | None:
            if self._lease_gone():
                # Given up while this consumer started (its worker starved past the failover
                # time): the next holder may have checkpointed past ``position`` since, so a
                # processor started now would start from a stale checkpoint.
                log.info("shard %s: lease lost before its processor was initialized",
                         self.lease_key)
                self.notify_lease_lost()
                return None
            processor = self._processor_factory()
            try:
                processor.initialize(
                    InitializeInput(self.lease_key, checkpoint, sub_sequence_number,
                                    self.stream_name, self._lease.stream))
            except Exception as exc:
                # a new processor for each attempt; the factory's own failure is not retried
                raise _InitializeFailed from exc
            return processor

        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            self._m.inc(PROCESSOR_ERRORS, "initialize")
            log.error("shard %s: initialize failed; retrying", self.lease_key,
                      exc_info=exc.__cause__)

        if self._stopping():
            return False
        try:
            processor = self._retried(initialized, _initialize_failed, retry_later)
        except RetryStopped:
            return False
        if processor is None:
            return False
        self._processor = processor
        self._processor_ended = False
        self._checkpointer = Checkpointer(
            self.lease_key, self._fence, self._token, position, self._metrics)
        self._handed = weakref.WeakSet([self._checkpointer])
        if not position.is_shard_end:
            self._fetcher = self._readers.live(
                read_from if start_at is None else Position.at_time(start_at))
            self._fetcher.start()
        return True

    def _start_of(self, checkpoint: str) -> datetime | None:
        """Where a lease still at ``LATEST`` or ``AT_TIMESTAMP`` is read from: the arrival
        time kept in the lease, else the one resolved now (``LATEST``: now;
        ``AT_TIMESTAMP``: the configured timestamp), kept in the lease before anything is
        read. Resolved once: a restarted processor, a new owner after a crash, a steal or
        a handoff all read from the same point, so records delivered but not checkpointed,
        or written while nobody read the shard, are not skipped. None: the fetcher
        resolves the sentinel itself (no timestamp configured for ``AT_TIMESTAMP``), or
        the consumer is stopping (the lease was lost meanwhile)."""
        if self._start_at is not None:
            return self._start_at
        at_ms = self._lease.start_at_ms
        if at_ms is not None:
            log.info("shard %s: %s lease resumes from %s, where it was first resolved",
                     self.lease_key, checkpoint, _iso(at_ms))
        else:
            initial_timestamp = self._readers.initial_timestamp
            if checkpoint == LATEST:
                at_ms = round(self._readers.now() * 1000)
            elif initial_timestamp is not None:
                at_ms = round(initial_timestamp.timestamp() * 1000)
            else:
                return None
            if not self._keep_start(at_ms):
                return None
            log.info("shard %s: %s resolved to %s; kept in the lease", self.lease_key,
                     checkpoint, _iso(at_ms))
        self._start_at = datetime.fromtimestamp(at_ms / 1000, tz=timezone.utc)
        return self._start_at

    def _keep_start(self, at_ms: int) -> bool:
        """Write the resolved start through the fence, retrying what a checkpoint would
        retry; False when the lease was lost or the consumer stops meanwhile."""
        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.warning("shard %s: keeping the resolved start failed (%s); retrying",
                        self.lease_key, exc)

        try:
            self._retried(partial(keep_start, self._fence, self.lease_key, self._token, at_ms),
                          _checkpoint_retryable, retry_later)
        except ShutdownException as exc:
            log.info("shard %s: lease lost while keeping its start: %s", self.lease_key, exc)
            self._lease_lost.set()
            return False
        except RetryStopped:
            return False
        return True

    def _restart(self, attempt: int) -> bool:
        """Throw the processor away and resume from the shard's durable checkpoint
        (at-least-once); a lease still at ``LATEST`` / ``AT_TIMESTAMP`` from where it was
        first resolved.

        The durable checkpoint is read from the lease item, as the Java KCL's InitializeTask
        reads it, not taken from the discarded processor's checkpointer: lag recovery moves
        the live checkpoint past a gap it finished (``ShardRecovery._store``) without that
        checkpointer knowing, and resuming from the stale one would queue and deliver the
        whole gap again. The discarded processor's checkpointers are retired first, so none
        of them can write behind the position read.

        Once the live checkpoint is ``SHARD_END`` (the processor was given only the gaps
        still queued) it stays there: the successor starts at ``SHARD_END`` and only the
        gaps are read again, each from its own checkpoint. A processor restarted there gets
        the same backoff as one that reads live, so a processor that keeps failing costs a
        backoff per attempt, not a busy loop."""
        assert self._checkpointer is not None
        if self._fetcher is not None:
            self._fetcher.stop()
            self._fetcher = None
        self._processor = None
        last = self._retire("the processor was restarted")
        if self._pause(self._backoff(attempt)):
            return False
        checkpoint = last if last.is_shard_end else self._durable_checkpoint(last)
        if checkpoint is None:
            return False
        start = self._start_at
        log.warning("shard %s: restarting the processor from checkpoint %s/%s%s",
                    self.lease_key, checkpoint.checkpoint, checkpoint.sub_sequence_number,
                    "" if start is None or checkpoint.sentinel not in (LATEST, AT_TIMESTAMP)
                    else f" (resolved to {start.isoformat(timespec='milliseconds')})")
        return self._initialize(checkpoint)

    def _retire(self, why: str) -> Position:
        """Retire the checkpointers handed to the processor being replaced: its live one and
        those of the recovery batches it got (whose gaps ``RecoveryLike.begin`` has read
        again from their checkpoints, with new checkpointers). Returns the live one's last
        checkpoint."""
        assert self._checkpointer is not None
        for checkpointer in list(self._handed):
            checkpointer.retire(why)
        self._handed = weakref.WeakSet()
        return self._checkpointer.position

    def _durable_checkpoint(self, last: Position) -> Position | None:
        """The live checkpoint the lease item holds now, never behind ``last`` (the discarded
        checkpointer's, which every write of this tenure went before). A failed read is tried
        again after a backoff; None when the consumer must stop meanwhile, or when the item
        shows the shard finished by another tenure (this one then lost the lease)."""
        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.warning("shard %s: reading the lease to restart the processor failed "
                        "(%r); retrying", self.lease_key, exc)

        try:
            lease = self._retried(partial(self._host.get_lease, self.lease_key),
                                  _table_failure, retry_later)
        except RetryStopped:
            return None
        durable = None if lease is None else lease.checkpoint
        if durable is not None and durable.is_shard_end:
            log.info("shard %s: the lease item is at SHARD_END, written by another tenure; "
                     "the lease was lost", self.lease_key)
            self.notify_lease_lost()
            return None
        # A sentinel in the item says nothing was checkpointed (a LATEST / AT_TIMESTAMP
        # start is resolved by ``_start_of``): only a record position can be ahead.
        if durable is not None and durable.is_record and (not last.is_record or durable > last):
            return durable
        return last

    def _recovering(self) -> bool:
        return self._recovery is not None and self._recovery.active

    def _process_loop(self) -> None:
        restarts = 0
        while True:
            if self._lease_lost.is_set():
                self._end_with_lease_lost()
                return
            if self._shutdown.is_set():
                self._end_with_shutdown_requested()
                return
            assert self._fetcher is not None
            recovering = self._recovering()
            # While a gap is recovered the live queue is looked at more often, so that
            # neither reader waits long behind the other's empty queue.
            timeout = self._settings.poll_timeout_s / (10 if recovering else 1)
            try:
                result = self._fetcher.get(timeout=timeout)
            except FetchError as exc:
                children = self._left_stream(exc)
                if children is None:
                    raise
                self._end_left_stream(children)
                return
            self.millis_behind_latest = self._fetcher.millis_behind_latest
            outcome = self._deliver_recovery() if recovering else "ok"
            if result is None:
                self.caught_up = self._fetcher.caught_up and not recovering
            else:
                empty_too = self._settings.call_process_records_even_for_empty_record_list
                if outcome == "ok" and (result.records or empty_too):
                    outcome = self._deliver(result)
            if outcome == "restart":
                if not self._restart(restarts):
                    continue
                restarts += 1
                continue
            if outcome == "stopped" or result is None:
                continue
            restarts = 0
            if result.shard_end:
                self._end_with_shard_end(result.child_shards)
                return

    def _deliver_recovery(self) -> str:
        """Hand the processor the recovery batch that is ready, if any; as ``_deliver``."""
        assert self._recovery is not None
        batch = self._recovery.poll()
        if batch is None:
            return "ok"
        result, checkpointer = batch
        return self._deliver(result, checkpointer, is_recovery=True)

    def _recover_after_shard_end(self) -> None:
        """Recover the gaps still queued once the live shard is finished - read to its end by
        this tenure, whose processor then got ``shard_ended``, or by an earlier one (a lease
        taken at ``SHARD_END`` for its gaps) - with a processor of their own, initialized at
        ``SHARD_END``, before the lease is let go.

        A processor gets no call after its final one, as in the Java KCL: a MultiLang
        processor stops its child in ``shard_ended`` and would answer any later call with a
        restart request. Delivering the gaps to the live processor before its
        ``shard_ended`` would keep the children waiting for the SHARD_END checkpoint until
        the gaps were recovered at ``recovery_max_rate``; so it ends the shard as soon as
        live reading is done, the children start then, and the gaps' processor, its
        checkpointers new, takes each gap from its checkpoint. It gets its own final call:
        ``shard_ended`` once no gap is left to read (``_end_recovered``), else ``lease_lost``
        or ``shutdown_requested`` as the tenure ends."""
        if self._checkpointer is not None:
            self._processor = None
            self._retire("the shard ended; the gaps still queued go to a new processor")
        if self._initialize(Position.shard_end()):
            self._set_state(ConsumerState.PROCESSING)
            self._drain_recovery()
        if self._lease_lost.is_set():
            self._end_with_lease_lost()
        elif self._shutdown.is_set():
            self._end_with_shutdown_requested()
        else:
            self._end_recovered()

    def _drain_recovery(self) -> None:
        """Hand the gaps' processor every gap batch until no gap is left to read or the
        tenure ends; a restart asked for goes through ``_restart``, as in the live loop."""
        recovery = self._recovery
        assert recovery is not None
        restarts = 0
        while recovery.active and not self._stopping():
            batch = recovery.poll()
            if batch is None:
                self._pause(self._settings.poll_timeout_s / 10)
                continue
            outcome = self._deliver(*batch, is_recovery=True)
            if outcome == "restart":
                if not self._restart(restarts):
                    return
                restarts += 1
            elif outcome == "ok":
                restarts = 0
        if recovery.not_found and not self._stopping():
            self._drop_gaps_left_with_the_shard(recovery)

    def _end_recovered(self) -> None:
        """The gaps' processor's final call: ``shard_ended``, with a checkpointer of its own
        whose ``SHARD_END`` checkpoint finishes every gap it was handed (``finisher``): a
        processor that checkpoints only now and then, or only at its end, has then processed
        all of them. Insisted on, as the live ``shard_ended`` is: gaps left queued would make
        the lease unfinished, and every next tenure would take it and read them again at
        once, since a finished shard's tenure ends as soon as its gaps are read."""
        processor, recovery = self._processor, self._recovery
        if processor is None or recovery is None:
            return
        self._set_state(ConsumerState.SHUTTING_DOWN)
        checkpointer = Checkpointer(self.lease_key, recovery.finisher(), self._token,
                                    Position.trim_horizon(), self._metrics)
        checkpointer.mark_shard_end()
        self._handed.add(checkpointer)
        self._shard_ended(processor, checkpointer, lambda: not recovery.read_unfinished,
                          "the gaps stay queued")
        self._processor_ended = True

    def _shard_ended(self, processor: IRecordProcessor, checkpointer: Checkpointer,
                     checkpointed: Callable[[], bool], until: str) -> bool:
        """Call ``shard_ended`` until the processor has checkpointed at SHARD_END
        (``checkpointed``), with the task backoff, as the Java KCL insists; False when the
        consumer must stop meanwhile. ``until`` says what waits for it, for the log."""
        def shard_ended() -> None:
            try:
                processor.shard_ended(ShardEndedInput(self.lease_key, checkpointer))
            except Exception:
                self._m.inc(PROCESSOR_ERRORS, "shard_ended")
                log.exception("shard %s: shard_ended failed", self.lease_key)
            if not checkpointed():
                raise _NotAtShardEnd

        def call_again(exc: BaseException, attempt: int, delay: float) -> None:
            log.error("shard %s: the processor did not checkpoint at SHARD_END in shard_ended; "
                      "%s until it does. Calling shard_ended again.", self.lease_key, until)

        try:
            self._retried(shard_ended, _not_at_shard_end, call_again)
        except RetryStopped:
            return False
        return True

    def _drop_gaps_left_with_the_shard(self, recovery: RecoveryLike) -> None:
        """Kinesis no longer finds the finished shard whose gaps this tenure took the lease
        for. Once the listings confirm that it aged out, its gaps' records went with it:
        they are dropped and reported, and the lease ends finished for lease cleanup.
        Otherwise every later holder took the lease for gaps nobody could read, and no
        shard sync or cleanup ever deleted it (at SHARD_END, with gaps queued)."""
        if self._confirm_left_stream() is None:
            return
        try:
            recovery.left_stream()
        except ShutdownException as exc:
            log.info("shard %s: lease lost while dropping the gaps of a shard that left the "
                     "stream: %s", self.lease_key, exc)
            self._lease_lost.set()

    @property
    def recovery(self) -> list[dict[str, Any]]:
        """The shard's queued recovery gaps (``/status``); empty without lag recovery."""
        recovery = self._recovery
        return recovery.status() if recovery is not None else []

    @property
    def retrieval(self) -> dict[str, Any]:
        """How the shard is read (``/status``); empty before the fetcher starts."""
        fetcher = self._fetcher
        return fetcher.retrieval if fetcher is not None else {}

    def _deliver(self, result: Page[Records], checkpointer: Checkpointer | None = None, *,
                 is_recovery: bool = False) -> str:
        """Hand one batch to the processor; 'ok', 'restart' or 'stopped'. A recovery batch
        comes with its gap's checkpointer; a live one uses the shard's."""
        if checkpointer is not None:
            self._handed.add(checkpointer)
        checkpointer = checkpointer or self._checkpointer
        assert self._processor is not None and checkpointer is not None
        records = result.records
        previous = checkpointer.mark_delivered(records[-1]) if records else None
        failures = 0

        def deliver_once() -> str:
            nonlocal failures
            assert self._processor is not None and checkpointer is not None
            if self._lease_gone():
                # Given up while this batch was fetched (the lease not renewed within the
                # failover time, or taken): its checkpoint would be refused, so every record
                # of it would be processed here and again by the next holder.
                log.info("shard %s: lease lost before a batch of %d record(s) was delivered; "
                         "left to the next holder", self.lease_key, len(records))
                if records:
                    checkpointer.unmark_delivered(previous)
                self.notify_lease_lost()
                return "stopped"
            started = time.perf_counter()
            try:
                self._processor.process_records(ProcessRecordsInput(
                    self.lease_key, records, checkpointer, result.millis_behind_latest,
                    is_at_shard_end=result.shard_end and not is_recovery,
                    is_recovery=is_recovery))
            except ProcessorRestartRequired as exc:
                self._m.inc(PROCESSOR_ERRORS, "process_records")
                log.error("shard %s: processor must restart: %s", self.lease_key, exc)
                return "restart"
            except ShutdownException as exc:
                # A checkpoint the processor let through was refused because the lease is no
                # longer this tenure's: not a processor failure, the lease-lost outcome.
                log.warning("shard %s: %s; ending with lease_lost", self.lease_key, exc)
                if records:
                    checkpointer.unmark_delivered(previous)
                self.notify_lease_lost()
                return "stopped"
            except Exception as exc:
                self._m.inc(PROCESSOR_ERRORS, "process_records")
                self._note_failure(exc, failures)
                failures += 1
                policy = self._settings.processor_error_policy
                if policy == "skip":
                    log.exception("shard %s: process_records failed; batch of %d skipped "
                                  "(processor_error_policy=skip)", self.lease_key, len(records))
                    return "ok"
                if policy == "shutdown":
                    log.exception("shard %s: process_records failed; shutting the worker down "
                                  "(processor_error_policy=shutdown)", self.lease_key)
                    raise FatalProcessorError(f"shard {self.lease_key}: {exc!r}") from exc
                if policy == "park" and failures >= self._settings.processor_error_attempts:
                    if records:
                        checkpointer.unmark_delivered(previous)
                    self._park_shard()
                    return "stopped"
                raise _BatchFailed from exc
            finally:
                # Each attempt is one Java ProcessTask, and its Success is 1 even when the
                # processor raised: the Java KCL catches processRecords' exception (logs it,
                # skips the batch) and reports the task itself as succeeded. A processor's
                # failures are kclpy_processor_errors_total.
                self._m_process.call(time.perf_counter() - started)
            self._m_records.inc(len(records))
            self._m_bytes.inc(records.payload_bytes())
            if result.millis_behind_latest is not None:
                self._m_behind.set(result.millis_behind_latest)
            if self.failure is not None:
                self._clear_failure()
                self._set_state(ConsumerState.PROCESSING)
            return "ok"

        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.error("shard %s: process_records failed; retrying the same batch",
                      self.lease_key, exc_info=exc.__cause__)

        try:
            return self._retried(deliver_once, _batch_failed, retry_later)
        except RetryStopped:
            if records:
                checkpointer.unmark_delivered(previous)
            return "stopped"

    def _left_stream(self, exc: FetchError) -> frozenset[str] | None:
        """The children's lease keys when the fetch failed because the shard left the
        stream unfinished; None for any other failure, and when the confirmation itself
        fails (the consumer then fails as before, its lease is released, and the shard
        sync deletes the lease once it sees the shard gone)."""
        if not is_not_found(exc.__cause__):
            return None
        return self._confirm_left_stream()

    def _confirm_left_stream(self) -> frozenset[str] | None:
        try:
            return self._host.shard_left_stream(self.lease_key)
        except Exception:
            log.exception("shard %s: not found, and confirming that it left the stream "
                          "failed", self.lease_key)
            return None

    def _end_left_stream(self, children: frozenset[str]) -> None:
        """End a shard that left the stream as if it had been read to its end, as the Java
        KCL ends one on ResourceNotFoundException: the processor checkpoints SHARD_END
        through the fence, and the children start at once instead of at the next shard
        sync, which would delete the lease while the same retention trims the children's
        oldest records. The loss is reported once the SHARD_END checkpoint is written: a
        holder that lost the lease first leaves it to the next holder or the shard sync."""
        assert self._checkpointer is not None
        checkpoint = self._checkpointer.position
        if self._recovery is not None:
            # the queued gaps' records left with the shard: dropped before SHARD_END, so
            # the lease ends finished (a SHARD_END refused leaves it unfinished, no gap
            # queued, for the next holder to confirm and end)
            self._recovery.left_stream()
        self._end_with_shard_end((), left_stream=True)
        if self.shard_ended:
            report_lost_to_retention(self._metrics, self.lease_key, checkpoint, children,
                                     "Its holder ended it at SHARD_END")

    def _end_with_shard_end(self, children: Sequence[ChildShard], *,
                            left_stream: bool = False) -> None:
        """Create the children's leases, then insist on a SHARD_END checkpoint, as the Java
        KCL does: without it the children would wait on this parent for ever. A shard that
        ``left_stream`` has listed children, made by the syncs that listed them, and no
        ``ChildShards``: the host's shard sync for the missing ones would find the lease
        aged out and delete it under its holder."""
        assert self._processor is not None and self._checkpointer is not None
        self._set_state(ConsumerState.SHUTTING_DOWN)
        if not left_stream:
            self._host.shard_ended(self.lease_key, children)
        self._checkpointer.mark_shard_end()
        checkpointer = self._checkpointer
        if not self._shard_ended(self._processor, checkpointer,
                                 lambda: checkpointer.position.is_shard_end,
                                 "its child shards cannot start"):
            if self._lease_lost.is_set():
                self._end_with_lease_lost()
            else:
                self._end_with_shutdown_requested()
            return
        self._processor_ended = True
        self.shard_ended = self.caught_up = True
        if self._recovering():
            self._recover_after_shard_end()

    def _end_with_lease_lost(self) -> None:
        self._set_state(ConsumerState.SHUTTING_DOWN)
        if self._fetcher is not None:
            self._fetcher.stop()
        if self._processor is None:
            return
        self._processor_ended = True
        try:
            self._processor.lease_lost(LeaseLostInput(self.lease_key))
        except Exception:
            self._m.inc(PROCESSOR_ERRORS, "lease_lost")
            log.exception("shard %s: lease_lost failed", self.lease_key)

    def _end_with_shutdown_requested(self) -> None:
        self._set_state(ConsumerState.SHUTTING_DOWN)
        if self._fetcher is not None:
            self._fetcher.stop()
        if self._processor is None or self._checkpointer is None:
            return
        self._processor_ended = True
        try:
            self._processor.shutdown_requested(
                ShutdownRequestedInput(self.lease_key, self._checkpointer))
        except Exception:
            self._m.inc(PROCESSOR_ERRORS, "shutdown_requested")
            log.exception("shard %s: shutdown_requested failed", self.lease_key)

    def _past_retention(self, checkpoint: Position) -> bool:
        """The stream's retention trimmed past ``checkpoint``: the shard's oldest record now
        comes after it, so the records between them (if any were written) are lost. Logged
        at ERROR with the range and counted, as lag recovery does for its gaps; live
        reading then starts at the oldest record instead of failing on the trimmed one."""
        if not checkpoint.is_record:
            return False
        try:
            oldest = self._readers.oldest_record()
        except ClientError as exc:
            if not is_not_found(exc):
                raise
            # The shard may have left the stream: the live read gets the same answer, and
            # the processing loop finds out, with the processor there to end the shard.
            log.info("shard %s: not found while looking for its oldest record; the live "
                     "read tells whether it left the stream", self.lease_key)
            return False
        if oldest is None or int(oldest.sequence_number) <= checkpoint.extended[0]:
            return False
        self._metrics.inc(DATA_LOST_TO_RETENTION, self.lease_key)
        arrived = oldest.timestamp_millis
        log.error("shard %s: the checkpoint is past the stream's retention: records after %s "
                  "up to %s (the oldest kept%s) are lost", self.lease_key,
                  checkpoint.sequence_number,
                  oldest.sequence_number,
                  "" if arrived is None else f", arrived {arrived} ms since the epoch")
        return True

    # -- failures ----------------------------------------------------------------------------

    def _note_failure(self, exc: Exception, attempt: int) -> None:
        """The shard is FAILED from the first failed attempt at a batch until one succeeds."""
        now_ms = int(time.time() * 1000)
        since = self.failure["since_ms"] if self.failure is not None and attempt else now_ms
        if self.failure is not None:
            self._clear_failure()
        self.failure = {"error_type": type(exc).__name__, "message": str(exc),
                        "attempts": attempt + 1, "since_ms": since}
        self._m.set(SHARD_FAILURE_ATTEMPTS, attempt + 1)
        self._m.set(SHARD_FAILING_SINCE, since / 1000)
        self._m.set(SHARD_FAILURE, 1, type(exc).__name__)
        self._set_state(ConsumerState.FAILED)

    def _clear_failure(self) -> None:
        assert self.failure is not None
        self._m.remove(SHARD_FAILURE, self.failure["error_type"])
        self._m.set(SHARD_FAILURE_ATTEMPTS, 0)
        self._m.set(SHARD_FAILING_SINCE, 0)
        self.failure = None

    def _park_shard(self, reason: str | None = None) -> None:
        """Mark the lease parked (no worker takes it) and end with lease_lost; the worker
        lets the lease go like that of any consumer that ended. Without ``reason``: the
        park policy, after the current batch failed too often."""
        if reason is None:
            failure = self.failure or {}
            error: str | None = f"{failure.get('error_type')}: {failure.get('message')}"
            log.error("shard %s: process_records failed %s times; parking the shard "
                      "(processor_error_policy=park): %s", self.lease_key,
                      failure.get("attempts"), error)
            value = park.marker("processor_error_policy=park", "worker", error=error,
                                attempts=failure.get("attempts"),
                                since_ms=failure.get("since_ms"))
        else:
            log.error("shard %s: parking the shard: %s", self.lease_key, reason)
            value = park.marker(reason, "worker")
        try:
            park.park_held(self._fence, self.lease_key, self._token, value)
        except ShutdownException as exc:
            log.warning("shard %s: lease lost before it could be parked: %s",
                        self.lease_key, exc)
        except KCLError as exc:
            log.error("shard %s: parking failed (%r); the lease is released and the "
                      "batch will be retried by its next holder", self.lease_key, exc)
        else:
            self.parked = True
            self._metrics.inc(SHARDS_PARKED_BY_POLICY, self.lease_key)
        self._lease_lost.set()

    # -- state -------------------------------------------------------------------------------

    def _set_state(self, state: ConsumerState) -> None:
        self._state = state
        self._publish_state()

    def _publish_state(self) -> None:
        for state in ConsumerState:
            self._m.set(SHARD_CONSUMER_STATE, 1 if state is self._state else 0, state.value)


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc).isoformat(
        timespec="milliseconds")


def report_lost_to_retention(metrics: Scope, lease_key: str, checkpoint: Position,
                             children: Iterable[str], ending: str) -> None:
    """Say once, at ERROR and in ``kclpy_data_lost_to_retention_total``, that an unfinished
    shard left the stream: the shard sync that deletes its lease and the holder that ends
    it (``ending`` says which) report it alike, so an operator finds one message whoever
    noticed."""
    metrics.inc(DATA_LOST_TO_RETENTION, lease_key)
    log.error(
        "shard %s left the stream unfinished: the stream's retention trimmed its "
        "records (those after checkpoint %s) before they were processed, and they "
        "are lost. %s so that its child shards (%s) can start.",
        lease_key, checkpoint, ending, ", ".join(sorted(children)))
