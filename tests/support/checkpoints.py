"""The lease side of a checkpoint, for tests of what writes checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from kclpy.leases.fence import Guard


class CheckpointWriterBase:
    """A ``CheckpointWriter`` whose subclasses record or refuse ``update_checkpoint``;
    transactions and guarded writes belong to the exactly-once tests, and reaching them from
    any other test is a failure of that test."""

    def update_checkpoint(self, shard_id: str, concurrency_token: str, checkpoint: str,
                          sub_sequence_number: int) -> None:
        raise NotImplementedError

    def transact_checkpoint(self, shard_id: str, concurrency_token: str, checkpoint: str,
                            sub_sequence_number: int, items: Sequence[Any]) -> None:
        raise AssertionError(f"shard {shard_id}: this test's writer takes no transactions")

    def guard(self, shard_id: str, concurrency_token: str | None, *,
              what: str) -> AbstractContextManager[Guard]:
        raise AssertionError(f"shard {shard_id}: this test's writer guards no {what}")
