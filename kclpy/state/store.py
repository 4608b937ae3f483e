"""What a stateful processor's store must do, whatever holds the state."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from kclpy.checkpoint import CheckpointWriter
from kclpy.position import Position
from kclpy.state.transaction import DELETED, Limits, StateTransaction, Versioned

if TYPE_CHECKING:
    from kclpy.recovery.queue import RecoveryRequest


class StateStore(Protocol):
    """A store whose writes commit in one atomic write with a lease's checkpoint.

    Chosen by the ``state_store`` option's URL scheme (:func:`kclpy.state.open_store`, whose
    registry a store of one's own joins with :func:`kclpy.state.register_store`)."""

    #: what one transaction may hold
    limits: Limits
    #: the store keeps each lease's position itself, beside the lease item's checkpoint (a
    #: stateful processor resumes after the later of the two), and is then a
    #: :class:`PositionKeepingStore`. False: the lease item's checkpoint is the store's own,
    #: and moves with it.
    keeps_position: bool

    def open(self, dynamodb: Any) -> None:
        """Get ready (create what is missing), given the worker's DynamoDB client."""

    def begin_tenure(
        self, writer: CheckpointWriter, lease_key: str, token: str
    ) -> Position | None:
        """A worker starts holding ``lease_key``: fence out earlier tenures and return the
        position the store last committed for it, or None when the lease table's
        checkpoint is the store's own (the DynamoDB store)."""

    def read(self, key: str) -> Versioned:
        """The committed value of ``key`` and its version (0: no such key)."""

    def commit(
        self,
        writer: CheckpointWriter,
        lease_key: str,
        token: str,
        position: Position,
        txn: StateTransaction,
        gap: Position | None = None,
    ) -> None:
        """Commit ``txn`` with the checkpoint at ``position``, all or nothing, fenced by the
        lease through ``writer``. ``gap`` names the lag-recovery gap the checkpoint is of
        (``writer`` is then the gap's), None the shard's live checkpoint: the two never share
        a position. Raises ``TransactionRejected`` (nothing written) when a key changed since
        ``txn`` read it; what the writer raises when the lease is lost or the write fails."""

    def durable_position(
        self, writer: CheckpointWriter, lease_key: str, token: str, gap: Position | None
    ) -> Position | None:
        """The position the store holds for ``lease_key``'s live line (``gap`` None) or for
        ``gap``, read afresh (``writer`` is the gap's when ``gap`` is set): after a commit
        whose outcome is unknown or that was refused, what landed - an attempt whose answer
        was lost included. None when the store holds none."""

    def gap_position(self, lease_key: str, gap: Position) -> Position | None:
        """The position the store last committed for ``gap`` of ``lease_key``, or None when
        the gap's checkpoint in the lease item is the store's own (the DynamoDB store)."""

    def forget(self, keys: Sequence[str]) -> None:
        """What is known of ``keys`` may be stale (a conflicting writer, a new tenure)."""


class PositionKeepingStore(StateStore, Protocol):
    """A store that keeps each lease's position (and each lag-recovery gap's) itself,
    beside the lease item (``keeps_position`` True): an operator's move of a checkpoint
    must move the store's too, and the gaps must be kept where a lease-table reset, which
    deletes the lease item's queue, cannot lose them. A store whose position is the lease
    item's checkpoint has none of this to do, and implements :class:`StateStore` alone."""

    def move_position(self, lease_key: str, position: Position, *, tenure: int,
                      incarnation: str | None, gaps: Collection[Position]) -> None:
        """An operator moved ``lease_key``'s checkpoint to ``position`` (``kclpy checkpoint
        set --state-store``), the lease now at counter ``tenure`` (and, for a lease created
        again, ``incarnation``): move the store's own position there, refuse commits of
        earlier tenures, and forget the progress of every gap not in ``gaps`` (the queue
        the move kept)."""

    def record_gaps(self, writer: CheckpointWriter, lease_key: str, token: str,
                    queue: Sequence[RecoveryRequest]) -> None:
        """The holder is about to write ``queue`` to the lease item: keep each gap's end (and,
        for a gap new to the store, its checkpoint), fenced like a commit. A lease-table
        reset deletes the queue with the lease item; a store that keeps positions would
        otherwise resume past a gap it can no longer tell the end of (simulator seed 186)."""

    def drop_gaps(self, writer: CheckpointWriter, lease_key: str, token: str,
                  gaps: Collection[Position]) -> None:
        """``gaps`` (by where they start) left the lease item's queue in a write that
        landed: forget them, fenced like a commit."""

    def forget_gaps(self, lease_key: str, gaps: Collection[Position]) -> None:
        """An operator took ``gaps`` (by where they start) out of the queue of a lease
        nobody holds, parked meanwhile (``kclpy recovery cancel --state-store``): forget
        them, unfenced - no tenure runs - or the next tenure would queue them again as gaps
        a lease-table reset lost."""

    def stored_gaps(self, lease_key: str) -> dict[Position, RecoveryRequest | None]:
        """The gaps the store keeps for ``lease_key``, by where they start: each as queued,
        its checkpoint where the store's commits reached; None when the store knows its
        progress but not its end."""


def keeps_own_position(store: StateStore) -> TypeGuard[PositionKeepingStore]:
    """The store's declaration, for the callers that move or keep its positions."""
    return store.keeps_position


#: committed values remembered per store, beyond which the cache starts over
CACHE_SIZE = 100_000


class CommittedCache:
    """Committed values with their versions, so a key only this worker updates is read from
    the store once. A stale entry costs one refused commit (its version or, for a key deleted
    and created again since, its incarnation no longer matches), never a wrong value.
    Thread-safe: shards of one worker share their store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, Versioned] = {}

    def read(self, key: str, fetch: Callable[[str], Versioned]) -> Versioned:
        """The cached value of ``key``, else ``fetch(key)`` from the store, remembered."""
        with self._lock:
            cached = self._values.get(key)
        if cached is not None:
            return cached
        current = fetch(key)
        self.remember({key: current})
        return current

    def remember(self, values: dict[str, Versioned]) -> None:
        with self._lock:
            if len(self._values) + len(values) > CACHE_SIZE:
                self._values.clear()
            self._values.update(values)

    def committed(self, txn: StateTransaction) -> None:
        """``txn`` landed: its writes are the committed values, one version on, in the
        incarnation the transaction read or created them in."""
        self.remember({
            key: Versioned(None, 0) if value is DELETED
            else Versioned(value, txn.versions[key] + 1, txn.incarnations[key])
            for key, value in txn.writes.items()})

    def forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._values.pop(key, None)
