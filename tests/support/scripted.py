"""Doubles for driving a ``ShardConsumer`` without AWS: a fetcher that serves scripted
pages (and, restarted, only what lies after a checkpoint), a checkpoint writer that records
what it was asked to write, and a lease table of fixed leases."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

from kclpy.consumer import ConsumerSettings
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


class Writer(CheckpointWriterBase):
    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        self.writes.append((position.checkpoint, position.sub_sequence_number))


class Leases:
    def __init__(self, leases: dict[str, Lease] | None = None) -> None:
        self.leases = leases or {}

    def get_lease(self, lease_key: str) -> Lease | None:
        return self.leases.get(lease_key)
