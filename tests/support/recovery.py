"""Lag recovery's test parts: a gap to queue, a worker holding a lease by hand (held set and
fence, no coordinator), and a shard's recovery through that worker's fence."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.recovery.queue import RecoveryRequest
from kclpy.recovery.rate import RecoveryRate
from kclpy.recovery.shard import ShardRecovery
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.polling import Pacer
from tests.support.determinism import Clock
from tests.support.waiting import wait_for

FAILOVER = 10.0


def gap(start: str, end_ms: int, first_ms: int | None, *, done: str | None = None
        ) -> RecoveryRequest:
    """A gap from ``start`` to ``end_ms``; with ``done``, checkpointed that far already."""
    request = RecoveryRequest.gap(start, 0, end_ms, first_ms, None)
    return request if done is None else request.checkpointed(Position(done), None)


@dataclass
class Holder:
    """One worker's held set and fence, taking by hand."""

    table: LeaseTable
    worker_id: str
    clock: Clock
    held: HeldSet = field(init=False)
    fence: LeaseFence = field(init=False)

    def __post_init__(self) -> None:
        self.held = HeldSet(self.worker_id, renewer_interval_s=FAILOVER / 2, metrics=Metrics())
        self.fence = LeaseFence(self.table, self.held, failover_time_s=FAILOVER,
                                clock=self.clock)

    def take(self, key: str) -> str:
        current = self.table.get(key)
        assert current is not None
        fresh = self.table.take(current, self.worker_id)
        fresh.concurrency_token = uuid.uuid4().hex
        self.held.install(fresh, self.clock())
        return fresh.concurrency_token


@dataclass
class Claimed:
    """A state store as lag recovery sees one that keeps the shard's live position at
    ``position`` and none of its gaps."""

    position: Position | None
    keeps_position = False

    def begin_tenure(self, writer: Any, lease_key: str, token: str) -> Position | None:
        return self.position


def unused_reader(start: Position, until_ms: int | None, pacer: Pacer | None,
                  max_records: int | None) -> ShardPipeline:
    """The reader of a recovery that must not read."""
    raise AssertionError("no read expected")


def recovery_for(holder: Holder, token: str, stored: str | None = None,
                 **options: Any) -> ShardRecovery:
    """The recovery of lease s1 by ``holder`` in tenure ``token``, from the queue
    ``stored``; 1000 records/s and a 1 s max lag unless ``options`` say otherwise."""
    options.setdefault("reader_factory", unused_reader)
    options.setdefault("max_lag_ms", 1000)
    return ShardRecovery(Lease("s1", recovery=stored), token=token, fence=holder.fence,
                         rate=RecoveryRate(1000), metrics=Metrics(), **options)


def age(max_lag_ms: int) -> None:
    """Let what was just written become older than ``max_lag_ms`` (an emulator cannot age
    records): waits for the wall clock, asserts nothing about it."""
    written = time.time()
    wait_for(lambda: time.time() > written + max_lag_ms / 1000, 10 + max_lag_ms / 1000,
             "the backlog to age", interval=0.1)
