"""The record processor contract, with amazon_kclpy v3's names.

An application written against ``amazon_kclpy.kcl.RecordProcessorBase`` (v3) ports by
changing its import; the inputs carry the same attribute names.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kclpy.records import Record

if TYPE_CHECKING:
    from kclpy.checkpoint import Checkpointer


class ShutdownReason(enum.Enum):
    """Why a processor stops; the Java KCL's names."""

    #: the shard ended (split or merge): the processor must checkpoint SHARD_END
    SHARD_END = "SHARD_END"
    #: another worker owns the lease now; checkpointing is no longer possible
    LEASE_LOST = "LEASE_LOST"
    #: the worker is shutting down or handing the lease over; checkpointing still works
    REQUESTED = "REQUESTED"


@dataclass(frozen=True)
class InitializeInput:
    #: the shard's lease key: the shard id, or in a multi-stream application
    #: ``account-id:stream-name:creation-epoch:shard-id``, unique across the streams (every
    #: input and the checkpointer name the shard this way)
    shard_id: str
    #: the checkpoint the shard resumes from: a sequence number or a sentinel
    #: (``TRIM_HORIZON``, ``LATEST``, ``AT_TIMESTAMP``)
    sequence_number: str | None
    sub_sequence_number: int | None
    #: the stream the shard belongs to
    stream_name: str | None = field(default=None)
    #: multi-stream applications: the serialised stream identifier
    #: (``account-id:stream-name:creation-epoch``, Java's ``ShardInfo.streamIdentifier``);
    #: None for an application of one stream, as in Java
    stream_identifier: str | None = field(default=None)


@dataclass(frozen=True)
class ProcessRecordsInput:
    shard_id: str
    #: in order; a read-only sequence (``kclpy.records.Records``) that builds each record as
    #: it is read: index, slice and iterate it like a list, or ``list()`` it to keep them
    records: Sequence[Record]
    checkpointer: Checkpointer
    millis_behind_latest: int | None
    #: true for the last batch before SHARD_END, as the Java KCL flags it
    is_at_shard_end: bool = field(default=False)
    #: kclpy's lag recovery (``max_lag_ms``): the records come from a gap the live reader
    #: jumped over, read again in order. ``checkpointer`` then moves the gap's own
    #: checkpoint, never the live one.
    is_recovery: bool = field(default=False)


@dataclass(frozen=True)
class LeaseLostInput:
    shard_id: str


@dataclass(frozen=True)
class ShardEndedInput:
    shard_id: str
    checkpointer: Checkpointer


@dataclass(frozen=True)
class ShutdownRequestedInput:
    shard_id: str
    checkpointer: Checkpointer


class IRecordProcessor(abc.ABC):
    """Subclass this. One instance serves one shard at a time, called from one thread.

    Exceptions raised from ``process_records`` are handled by the configured
    ``processor_error_policy`` (retry the same batch by default): nothing is skipped
    unless you ask for it.
    """

    @abc.abstractmethod
    def initialize(self, initialize_input: InitializeInput) -> None: ...

    @abc.abstractmethod
    def process_records(self, process_records_input: ProcessRecordsInput) -> None: ...

    @abc.abstractmethod
    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None: ...

    @abc.abstractmethod
    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        """Checkpoint here (``checkpointer.checkpoint()``) or the shard's children never start."""

    @abc.abstractmethod
    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None: ...


#: The amazon_kclpy v3 base class name.
RecordProcessor = IRecordProcessor
RecordProcessorBase = IRecordProcessor


class ProcessorFactory(Protocol):
    def __call__(self) -> IRecordProcessor: ...


ProcessorFactoryLike = Callable[[], IRecordProcessor]
