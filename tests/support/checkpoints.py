"""The lease side of a checkpoint, for tests of what writes checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from kclpy.leases.fence import Guard
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder
from kclpy.position import Position


class CheckpointWriterBase:
    """A ``CheckpointWriter`` whose subclasses record or refuse ``update_checkpoint``;
    transactions and guarded writes belong to the exactly-once tests, and reaching them from
    any other test is a failure of that test. Also a consumer's ``ShardFence``: the tenure
    always holds its lease, and a fenced update (a resolved start, a park mark) belongs to
    the tests of those, whose writers override it."""

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        raise NotImplementedError

    def transact_checkpoint(self, lease_key: str, concurrency_token: str, position: Position,
                            items: Sequence[Any]) -> None:
        raise AssertionError(f"shard {lease_key}: this test's writer takes no transactions")

    def durable_checkpoint(self, lease_key: str, concurrency_token: str) -> Position | None:
        raise AssertionError(f"shard {lease_key}: this test's writer reads no checkpoint back")

    def guard(self, lease_key: str, concurrency_token: str | None, *,
              what: str, wait: bool = True) -> AbstractContextManager[Guard]:
        raise AssertionError(f"shard {lease_key}: this test's writer guards no {what}")

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease:
        raise AssertionError(f"shard {lease_key}: this test's writer takes no {what} write")

    def holds(self, lease_key: str, token: str) -> bool:
        return True
