"""Doubles for driving a ``ShardConsumer`` without AWS: a fetcher that serves scripted
pages (and, restarted, only what lies after a checkpoint), a lag recovery that serves
scripted gap batches, a checkpoint writer that records what it was asked to write, a lease
table of fixed leases, and the consumer's readers and host made of a test's callables."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from kclpy.checkpoint import Checkpointer
from kclpy.consumer import ConsumerSettings, FetcherLike, RecoveryLike
from kclpy.leases.lease import Lease
from kclpy.position import Position
from kclpy.records import Record, Records
from kclpy.retrieval.page import ChildShard, Page
from tests.support.checkpoints import CheckpointWriterBase

SETTINGS = ConsumerSettings(parent_shard_poll_interval_s=0.01, task_backoff_s=0.001,
                            max_task_backoff_s=0.002, poll_timeout_s=0.01)


def rec(seq: int, sub: int = 0) -> Record:
    return Record(sequence_number=str(seq), partition_key="k", timestamp_millis=0,
                  sub_sequence_number=sub, data=b"payload")


class Result(Page[Records]):
    """A page as the consumer reads it, written with plain lists and a lag of 0."""

    __slots__ = ()

    def __init__(self, records: Sequence[Record], millis_behind_latest: int | None = 0,
                 shard_end: bool = False, child_shards: Sequence[ChildShard] = (),
                 caught_up: bool = False) -> None:
        super().__init__(Records([list(records)]), millis_behind_latest, shard_end,
                         list(child_shards), caught_up)


class ScriptedFetcher:
    """Serves results; after a restart, serves what comes after the given checkpoint."""

    def __init__(self, pages: list[Result], start_after: tuple[str, int]) -> None:
        self.queue: queue.Queue[Result] = queue.Queue()
        after = (-1, 0) if not start_after[0].isdigit() else (int(start_after[0]), start_after[1])
        for page in pages:
            kept = [r for r in page.records if r.extended_sequence_number > after]
            if kept or page.shard_end or not page.records:
                self.queue.put(Result(kept, page.millis_behind_latest, page.shard_end,
                                      page.child_shards, page.caught_up))
        self.started = self.stopped = False
        self.millis_behind_latest: int | None = 0

    @property
    def caught_up(self) -> bool:
        return self.queue.empty()

    def start(self) -> None:
        self.started = True

    def get(self, timeout: float | None = None) -> Result | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self.stopped = True

    @property
    def retrieval(self) -> dict[str, Any]:
        return {"mode": "scripted"}


def _always() -> bool:
    return True


class Writer(CheckpointWriterBase):
    """Records the checkpoints written; the tenure holds its lease while ``holding`` says."""

    def __init__(self, holding: Callable[[], bool] = _always) -> None:
        self.writes: list[tuple[str, int]] = []
        self.holding = holding

    def holds(self, lease_key: str, token: str) -> bool:
        return self.holding()

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        self.writes.append((position.checkpoint, position.sub_sequence_number))


class Leases:
    def __init__(self, leases: dict[str, Lease] | None = None) -> None:
        self.leases = leases or {}

    def get_lease(self, lease_key: str) -> Lease | None:
        return self.leases.get(lease_key)


class LeaseReader(Protocol):
    def get_lease(self, lease_key: str) -> Lease | None: ...


def _ignore_shard_end(lease_key: str, children: Sequence[ChildShard]) -> None:
    """A test that does not look at shard ends."""


@dataclass
class Host:
    """A ``ShardHost``: leases read from ``leases``, every shard end told to ``on_end``,
    every shard not found confirmed gone or not by ``left_stream``."""

    leases: LeaseReader
    on_end: Callable[[str, Sequence[ChildShard]], None] = _ignore_shard_end
    #: what confirming that a shard left the stream answers (default: it did not)
    left_stream: Callable[[str], frozenset[str] | None] = lambda lease_key: None

    def get_lease(self, lease_key: str) -> Lease | None:
        return self.leases.get_lease(lease_key)

    def shard_ended(self, lease_key: str, children: Sequence[ChildShard]) -> None:
        self.on_end(lease_key, children)

    def shard_left_stream(self, lease_key: str) -> frozenset[str] | None:
        return self.left_stream(lease_key)


@dataclass
class Readers:
    """``ShardReaders`` made of a test's callables: ``fetcher`` is the live reader, no lag
    recovery unless ``make_recovery``, no retention check, the host's clock unless
    ``clock``."""

    fetcher: Callable[[Position], FetcherLike]
    make_recovery: Callable[[], RecoveryLike] | None = None
    clock: Callable[[], float] = time.time
    initial_timestamp: datetime | None = None

    def live(self, start: Position) -> FetcherLike:
        return self.fetcher(start)

    def recovery(self) -> RecoveryLike | None:
        return None if self.make_recovery is None else self.make_recovery()

    def oldest_record(self) -> Record | None:
        return None

    def now(self) -> float:
        return self.clock()


class _ReadFinisher(Writer):
    """The gaps' final checkpointer's writer: records only its SHARD_END checkpoints."""

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        if position.is_shard_end:
            super().update_checkpoint(lease_key, concurrency_token, position)


class FakeRecovery:
    """Serves scripted recovery batches with a checkpointer of their own."""

    def __init__(self, batches: list[Result], start_at: datetime | None = None) -> None:
        self.batches = list(batches)
        self.start_at = start_at
        self.begun: list[tuple[str, int]] = []
        self.writer = Writer()
        self.checkpointer = Checkpointer("shard-1", self.writer, "t", Position.trim_horizon())
        self.stopped = False
        self.not_found = False
        #: the end of the last batch served, and the writes of the gaps' final checkpointer
        self.handed: Position | None = None
        self.finishing = _ReadFinisher()

    def begin(self, live: Position) -> datetime | None:
        self.begun.append((live.checkpoint, live.sub_sequence_number))
        # as ShardRecovery: the gap read again comes with a new checkpointer, at its checkpoint
        self.checkpointer = Checkpointer("shard-1", self.writer, "t", self.checkpointer.position)
        return self.start_at

    def poll(self) -> tuple[Result, Checkpointer] | None:
        if not self.batches:
            return None
        batch = self.batches.pop(0)
        if batch.records:
            self.handed = Position.after(batch.records[-1])
        return batch, self.checkpointer

    @property
    def active(self) -> bool:
        return bool(self.batches)

    @property
    def read_unfinished(self) -> bool:
        """As ShardRecovery: read to the end, not checkpointed through it, not finished."""
        return (not self.batches and self.handed is not None and not self.finishing.writes
                and self.checkpointer.position < self.handed)

    def finisher(self) -> Writer:
        return self.finishing

    def left_stream(self) -> None:
        self.batches.clear()

    def stop(self) -> None:
        self.stopped = True

    def status(self) -> list[dict[str, Any]]:
        return [{"batches": len(self.batches)}]


class RewindingRecovery(FakeRecovery):
    """As ShardRecovery: ``begin`` drops what was read and serves the gap again after its
    own checkpoint."""

    def __init__(self, batches: list[Result]) -> None:
        super().__init__(batches)
        self.script = list(batches)

    def begin(self, live: Position) -> datetime | None:
        super().begin(live)
        done = self.checkpointer.last_checkpoint[0]
        after = int(done) if done is not None and done.isdigit() else -1
        self.batches = [b for b in self.script
                        if int(b.records[-1].sequence_number) > after]
        return None
