"""The checkpointer a processor is handed, and the one rule it enforces: never move wrongly.

A checkpoint may only name a position that was delivered to the processor and is not before
the last checkpoint; anything else is ``InvalidStateException``, as in the Java KCL. A
checkpointer whose processor was replaced (``retire``) refuses every write with
``ShutdownException``, so within one tenure the checkpoint only moves forward. The
write itself goes through a ``CheckpointWriter`` (the lease coordinator), which fences it on
the lease's concurrency token so a worker that lost the lease can never overwrite the new
owner's progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kclpy.errors import CheckpointError, InvalidStateException, ShutdownException
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import START_AT, UpdateBuilder, n
from kclpy.metrics import CHECKPOINT_FAILURES, CHECKPOINTS, NOWHERE, Metrics
from kclpy.position import SHARD_END, Position
from kclpy.records import Record

if TYPE_CHECKING:
    from kclpy.leases.fence import Guard

T = TypeVar("T")

class CheckpointWriter(Protocol):
    def update_checkpoint(
        self, lease_key: str, concurrency_token: str, position: Position
    ) -> None:
        """Write ``position`` as the checkpoint, fenced. Raises ShutdownException,
        ThrottlingException or KinesisClientLibDependencyException."""

    def transact_checkpoint(
        self,
        lease_key: str,
        concurrency_token: str,
        position: Position,
        items: Sequence[Any],
    ) -> None:
        """Write ``position`` as the checkpoint and ``items`` (DynamoDB
        ``TransactWriteItems`` entries) in one fenced transaction; raises as
        ``update_checkpoint``, and ``TransactionRejected`` when one of ``items`` was refused
        (nothing written)."""

    def durable_checkpoint(self, lease_key: str, concurrency_token: str) -> Position | None:
        """The checkpoint this writer moves as the lease table holds it now (a consistent
        read): after a write whose answer was lost, the only way to learn whether it landed.
        None when the table holds none (the lease gone). Raises as ``update_checkpoint``."""

    def guard(
        self, lease_key: str, concurrency_token: str | None, *, what: str, wait: bool = True
    ) -> AbstractContextManager[Guard]:
        """Hold the lease for a write to another store (a SQL transaction) that fences
        itself on ``Guard.tenure``; raise ``LeaseLostError`` inside to report a newer
        tenure. Raises ``ShutdownException`` when the lease is (found) lost, and without
        ``wait`` ``LeaseBusy`` when another write of the lease holds it now."""


class StartWriter(Protocol):
    """Where a lease's resolved start is written: the lease fence (``LeaseFence.update``)."""

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease: ...


def keep_start(writer: StartWriter, lease_key: str, concurrency_token: str, at_ms: int) -> None:
    """Keep, in the lease item, the arrival time a lease still at ``LATEST`` or
    ``AT_TIMESTAMP`` was resolved to, fenced like a checkpoint: written before the shard is
    read, so every later owner and restart reads from the same point and nothing written
    after it is skipped. The ``checkpoint`` attribute keeps its sentinel, which the Java KCL
    reads as it always did; the first checkpoint removes the attribute. Raises as
    ``CheckpointWriter.update_checkpoint``."""
    writer.update(lease_key, concurrency_token, UpdateBuilder().set(START_AT, n(at_ms)),
                  what="start position")


#: ``Checkpointer.commit``'s write: (writer, lease key, token, position)
CommitWrite = Callable[[CheckpointWriter, str, str, Position], None]

class Checkpointer:
    """One per shard consumer. Thread-safe: a Spark batcher may checkpoint from its own thread.

    ``lease_key`` names the lease it writes (in a multi-stream application the stream
    identifier and the shard id); ``shard_id`` is kept as an alias of it, the name it had
    before, since a processor may read it. ``last`` is the checkpoint the lease had."""

    def __init__(
        self,
        lease_key: str,
        writer: CheckpointWriter,
        concurrency_token: str,
        last: Position,
        metrics: Metrics | None = None,
        *,
        gap: Position | None = None,
    ) -> None:
        self.lease_key = lease_key
        #: lag recovery: the gap (the position it starts after) whose own checkpoint this
        #: checkpointer moves; None for the shard's live checkpointer. A stateful processor
        #: keeps each gap's committed position apart from the live one by it.
        self.gap = gap
        self._writer = writer
        self._token = concurrency_token
        self._m = metrics.shard(lease_key) if metrics is not None else NOWHERE
        self._lock = threading.Lock()
        self._last = last
        #: the last record delivered (the end of the batch being processed)
        self._largest: Position | None = None
        self._at_shard_end = False
        #: why this checkpointer may no longer write (``retire``); None while it may
        self._retired: str | None = None

    @property
    def shard_id(self) -> str:
        """The lease key, under the name it had before ``lease_key`` (an alias)."""
        return self.lease_key

    # -- called by the consumer -------------------------------------------------------------

    def mark_delivered(self, record: Record) -> Position | None:
        """``record`` (the last of a batch) is being handed to the processor. Returns the
        previous mark, for ``unmark_delivered`` when the batch is not processed after all."""
        with self._lock:
            previous = self._largest
            self._largest = Position.after(record)
            return previous

    def unmark_delivered(self, previous: Position | None) -> None:
        """The batch failed and will not be retried by this processor: a no-argument
        ``checkpoint()`` (e.g. in ``shutdown_requested``) must not cover its records."""
        with self._lock:
            self._largest = previous

    def mark_shard_end(self) -> None:
        """Every record of the shard was delivered: SHARD_END becomes a valid position."""
        with self._lock:
            self._at_shard_end = True

    def retire(self, why: str) -> Position:
        """The processor this was handed to has been replaced (``ProcessorRestartRequired``):
        every later write through it raises ``ShutdownException``, the Java KCL's name for a
        checkpoint by a processor instance that was shut down. Such a processor may keep the
        checkpointer (a background thread, an asynchronous batcher), but its last checkpoint
        may be behind its successor's and its last delivered record may cover a batch that
        failed and was never processed: a write through it could move the checkpoint back or
        past records nobody processed. Waits for a write under way, so the position returned
        (the last checkpoint it wrote) is final, and a successor started from the durable
        checkpoint read after this is never overtaken by it."""
        with self._lock:
            self._retired = why
            return self._last

    def catch_up(self) -> None:
        """Take the checkpoint the lease holds now (read consistently) as the last one
        written when it is further: a commit of this tenure whose answer was lost - maybe a
        replaced processor's, landed after this checkpointer was made from the checkpoint
        read then - moved it on, and a checkpoint written behind it would move the lease
        back (``checkpoint`` refuses only positions before ``position``). Raises as a
        checkpoint does."""
        with self._lock:
            self._refuse_if_retired()
            durable = self._writer.durable_checkpoint(self.lease_key, self._token)
            if durable is not None and durable > self._last:
                self._last = durable

    @property
    def position(self) -> Position:
        """The last checkpoint written (or the one the lease had)."""
        with self._lock:
            return self._last

    @property
    def last_checkpoint(self) -> tuple[str, int]:
        """``position`` as the lease item stores it: (checkpoint, sub-sequence number)."""
        with self._lock:
            return self._last.checkpoint, self._last.sub_sequence_number

    # -- the processor's API (amazon_kclpy v3) ----------------------------------------------

    def checkpoint(
        self,
        sequence_number: str | int | Record | None = None,
        sub_sequence_number: int | None = None,
    ) -> None:
        """Checkpoint at ``sequence_number`` (a record, or a sequence number with an optional
        sub-sequence number), or without arguments at the last record delivered (SHARD_END
        once the shard has ended and everything was delivered)."""
        if isinstance(sequence_number, Record):
            sub_sequence_number = sequence_number.sub_sequence_number
            sequence_number = sequence_number.sequence_number
        self._write(sequence_number, sub_sequence_number,
                    lambda writer, key, token, position:
                    writer.update_checkpoint(key, token, position))

    def commit(self, record: Record, write: CommitWrite) -> None:
        """Checkpoint at ``record`` by ``write(writer, lease_key, token, position)``,
        which lands the checkpoint together with other writes, all or nothing: how a stateful
        processor's transaction lands (``kclpy.state``). The position rules are those of
        ``checkpoint``; the writer's fence refuses it when the lease is no longer this
        tenure's."""
        self._write(record.sequence_number, record.sub_sequence_number, write)

    def _write(self, sequence_number: str | int | None, sub_sequence_number: int | None,
               write: CommitWrite) -> None:
        with self._lock:
            self._refuse_if_retired()
            position = self._resolve(sequence_number, sub_sequence_number)
            if position is None:
                return
            try:
                write(self._writer, self.lease_key, self._token, position)
            except CheckpointError as exc:
                self._m.inc(CHECKPOINT_FAILURES, exc.name)
                raise
            self._last = position
        self._m.inc(CHECKPOINTS)

    def fenced(self, fn: Callable[[CheckpointWriter, str, str], T]) -> T:
        """``fn(writer, lease_key, token)``: a holder-only write that is not a checkpoint
        (a state store claiming the shard for this tenure), serialized with checkpoints."""
        with self._lock:
            self._refuse_if_retired()
            return fn(self._writer, self.lease_key, self._token)

    def _refuse_if_retired(self) -> None:
        """Raise ``ShutdownException`` once ``retire`` was called (the caller holds the lock)."""
        if self._retired is not None:
            self._m.inc(CHECKPOINT_FAILURES, ShutdownException.name)
            raise ShutdownException(f"shard {self.lease_key}: this checkpointer's processor "
                                    f"was shut down ({self._retired}); its successor "
                                    "checkpoints the shard now")

    def _resolve(
        self, sequence_number: str | int | None, sub_sequence_number: int | None
    ) -> Position | None:
        """The position to write, or None when there is nothing new."""
        if sequence_number is None:
            if self._at_shard_end:
                return Position.shard_end()
            if self._largest is None or self._largest <= self._last:
                return None
            return self._largest
        text = str(sequence_number)
        if text == SHARD_END:
            if not self._at_shard_end:
                raise self._invalid("SHARD_END before the shard's last record was delivered")
            return Position.shard_end()
        if not (text.isascii() and text.isdigit()):
            raise self._invalid(f"{text!r} is not a sequence number")
        sub = int(sub_sequence_number or 0)
        if sub < 0:
            raise self._invalid(f"sub-sequence number {sub} is negative")
        wanted = Position(text, sub)
        if wanted < self._last:
            raise self._invalid(f"{wanted} is before the last checkpoint {self._last}")
        if self._largest is None or wanted > self._largest:
            raise self._invalid(f"{wanted} is beyond the last record delivered")
        return wanted

    def _invalid(self, why: str) -> InvalidStateException:
        self._m.inc(CHECKPOINT_FAILURES, "InvalidStateException")
        return InvalidStateException(f"shard {self.lease_key}: {why}")
