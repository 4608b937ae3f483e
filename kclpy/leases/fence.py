"""The lease fence: the one way to make a write that only the current holder of a lease may make.

Renewals, checkpoints, releases and every feature that commits progress (a stateful
processor's transaction, a recovery's own checkpoint) are such writes. Each one, here:

1. takes the lease's lock and checks, locally, that this worker still holds the lease in the
   tenure the caller belongs to (its concurrency token) and has written it within the failover
   time - a worker suspended for longer may already have been replaced, so it must not write;
2. adds the ownership condition to the write: the counter this worker holds and the holder
   (``leaseOwner``, or ``checkpointOwner`` while handing the lease off), and bumps the counter;
3. turns a failed condition into one of two things. If the item now asks this worker to hand
   the lease off (Java KCL 3.x ``checkpointOwner``), the write is repeated as the handing-off
   holder and the handoff listeners are told. Otherwise the lease is lost: it is dropped from
   the held set, the lost listeners are told, and the caller gets ``ShutdownException``.

A write can take three forms, so that new features never need to touch the coordinator:
``update`` (one UpdateItem on the lease item), ``transact`` (the lease item's fenced update
inside a DynamoDB ``TransactWriteItems`` with the caller's items, all or nothing), and
``guard`` (a write to another store, e.g. a SQL transaction, that compares the tenure counter
it is given against what the store recorded: see ``HeldLease.tenure``).

Errors the checkpointer contract names come out as such: throttling that persists is
``ThrottlingException``, any other DynamoDB failure ``KinesisClientLibDependencyException``;
neither loses the lease.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError

from kclpy.errors import (
    EarlierTransactionLanded,
    KinesisClientLibDependencyException,
    LeaseBusy,
    LeaseLostError,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases import handoff
from kclpy.leases.dynamo import TABLE_ERRORS, LeaseTableThrottled
from kclpy.leases.held import HeldLease, HeldSet
from kclpy.leases.lease import Lease, new_write_id
from kclpy.leases.serializer import UpdateBuilder
from kclpy.leases.table import LeaseChanged, LeaseTable, checkpoint_changes
from kclpy.position import Position

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import TransactWriteItemTypeDef

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Guard:
    """What a write to another store needs to fence itself: the lease as held now, the
    counter its tenure started at, and ``current``, a consistent read of the lease item as
    the table holds it now (None: gone). Raise ``LeaseLostError`` inside
    ``LeaseFence.guard`` when the store shows a newer tenure; the fence then treats the lease
    as lost.

    ``current`` is how a store tells which of two incarnations of a lease is the live one
    (``Lease.incarnation``): the one the table holds. Their creation times cannot tell it,
    since different workers' clocks stamp them (simulator seed 139)."""

    lease: Lease
    tenure: int
    current: Callable[[], Lease | None]
    #: how long the write may wait on the other store's locks. The lease's lock is held
    #: meanwhile, so a renewal that falls due waits too: renewals come every half failover
    #: time and the lease is lost after a whole one, so a wait of a quarter still leaves a
    #: quarter for the renewal's own round trip. The store must give up (nothing written)
    #: when it runs out, and retry with the lease's lock let go
    wait_s: float = float("inf")


class LeaseFence:
    """Fenced writes for the leases in ``held``. Thread-safe: one lock per lease."""

    def __init__(
        self,
        table: LeaseTable,
        held: HeldSet,
        *,
        failover_time_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.table = table
        self.held = held
        self.worker_id = held.worker_id
        self.failover_time_s = failover_time_s
        self._clock = clock

    # -- the three forms -------------------------------------------------------------------

    def update(
        self, lease_key: str, token: str | None, changes: UpdateBuilder, *, what: str
    ) -> Lease:
        """Apply ``changes`` to the lease item as its holder. ``token`` is the caller's tenure
        (None: whichever tenure is current, as the renewer writes). Returns the fresh lease."""
        return self.write(
            lease_key, token, lambda lease: self.table.guarded_update(lease, changes), what=what
        )

    def transact(
        self,
        lease_key: str,
        token: str | None,
        changes: UpdateBuilder,
        items: Sequence[TransactWriteItemTypeDef],
        *,
        what: str,
        apply: Callable[[Lease], Lease] | None = None,
    ) -> Lease:
        """Commit ``items`` and ``changes`` to the lease item in one ``TransactWriteItems``:
        if this worker no longer holds the lease, nothing is written, ``items`` included.
        ``apply`` updates the held copy the way ``changes`` updated the item (a transaction
        returns no attributes). A failed condition of one of ``items`` raises
        ``TransactionRejected`` and leaves the lease held; an earlier transaction of this
        lease whose answer was lost and that is found to have landed raises
        ``EarlierTransactionLanded``, a kind of it, and leaves it held too (``_attempt``)."""

        def write(lease: Lease) -> Lease:
            fresh = self.table.guarded_transact(lease, changes, items)
            return apply(fresh) if apply is not None else fresh

        return self.write(lease_key, token, write, what=what, transaction=True)

    @contextmanager
    def guard(self, lease_key: str, token: str | None, *, what: str,
              wait: bool = True) -> Iterator[Guard]:
        """Run a write to another store while holding the lease's lock (renewals and
        checkpoints of this lease wait for it). Raises ``ShutdownException`` before the block
        when the lease is not held, and after it when the block raised ``LeaseLostError``.
        Without ``wait``, a lock another write of the lease holds raises ``LeaseBusy`` at
        once: a caller that already holds other leases' locks must not sit on them while a
        slow write finishes (``MicroBatcher``'s commit fence)."""
        lost_why: str | None = None
        lock = self.held.lock_for(lease_key)
        if not lock.acquire(blocking=wait):
            raise LeaseBusy(f"shard {lease_key}: another write of the lease is on its way")
        try:
            held = self._holding(lease_key, token)
            if self._expired(held):
                lost_why = "not renewed for longer than the failover time"
                self.held.drop(lease_key, lost_why)
            else:
                try:
                    yield Guard(held.lease.copy(), held.tenure,
                                functools.partial(self._current, lease_key, what),
                                wait_s=self.failover_time_s / 4)
                except LeaseLostError as exc:
                    lost_why = f"{what} found a newer tenure: {exc}"
                    self.held.drop(lease_key, lost_why)
        finally:
            lock.release()
        if lost_why is not None:
            self.held.notify_lost(lease_key)
            raise ShutdownException(f"shard {lease_key}: lease lost ({lost_why})")

    # -- the mechanism ---------------------------------------------------------------------

    def write(
        self, lease_key: str, token: str | None, write: Callable[[Lease], Lease], *, what: str,
        transaction: bool = False,
    ) -> Lease:
        """Run ``write(held lease)`` as the holder. ``write`` must condition on the lease it
        is given (``LeaseTable.guarded_*`` do) and raise ``LeaseChanged`` when that fails.
        ``transaction``: ``write`` commits other items with the lease item
        (``guarded_transact``). What it returns is then not the item as written (a
        transaction returns no attributes), so it does not put the next renewal off
        (``HeldSet.refresh``), and it is never repeated over an earlier transaction of the
        lease that landed unanswered (``_attempt``)."""
        lost: str | None = None
        asked = False
        failure: Exception | None = None
        fresh: Lease | None = None
        with self.held.lock_for(lease_key):
            held = self._holding(lease_key, token)
            sent_at = self._clock()
            asked_before = held.handoff_since is not None
            if self._expired(held):
                lost = "expired on this worker (not renewed within the failover time)"
                self.held.drop(lease_key, lost)
            else:
                try:
                    fresh = self._attempt(held, write, what, transaction)
                except LeaseTableThrottled as exc:
                    failure = ThrottlingException(f"shard {lease_key}: {what}: {exc}")
                    failure.__cause__ = exc
                except (ClientError, BotoCoreError) as exc:
                    failure = KinesisClientLibDependencyException(
                        f"shard {lease_key}: {what} failed: {exc}")
                    failure.__cause__ = exc
                else:
                    if fresh is None:
                        lost = self.held.gone_why(lease_key)
                    elif not self.held.refresh(held, fresh, sent_at,
                                               observed=not transaction):
                        # Given up while this write was on its way: the write landed, but
                        # the processor was already told the lease is lost. Let it go at
                        # once instead of leaving it held by nobody until it expires.
                        lost = self.held.gone_why(lease_key)
                        self._let_go(fresh, what)
                        fresh = None
            asked = lost is None and not asked_before and held.handoff_since is not None
        if asked:
            self.announce_handoff(lease_key)
        if failure is not None:
            raise failure
        if lost is not None or fresh is None:
            self.held.notify_lost(lease_key)
            raise ShutdownException(f"shard {lease_key}: {what} refused: lease {lost}")
        return fresh.copy()

    def holds(self, lease_key: str, token: str) -> bool:
        """Whether a checkpoint of tenure ``token`` would be let through now: the lease is
        held in that tenure and was written within the failover time. Read without the
        lease's lock and without giving anything up (``write`` does that), so a consumer can
        ask before every batch: a batch handed to a processor once this is False can never
        be checkpointed, and the next holder delivers it again."""
        try:
            held = self._holding(lease_key, token)
        except ShutdownException:
            return False
        return not self._expired(held)

    def update_checkpoint(
        self, lease_key: str, concurrency_token: str, position: Position
    ) -> None:
        """``CheckpointWriter``: a checkpoint is a fenced update of the lease item. It never
        moves the lease back over a later checkpoint: one of this tenure whose answer was
        lost can land after a replaced processor's successor was made from the checkpoint
        read before it, and the successor's next checkpoint, repeated on the item that
        write left (``_attempt``), would undo it - the next holder would deliver again
        records at or before a checkpoint that was durable. ``SHARD_END`` is such a later
        checkpoint too: the one ``shard_ended`` wrote unanswered is followed by a checkpoint
        at the last record (``shard_ended`` called again, a batcher's late commit), and the
        shard's children may already have started on it. Such a write renews the lease and
        leaves its checkpoint where it is; the sentinels before every record never sort
        after one."""

        def write(lease: Lease) -> Lease:
            durable = lease.checkpoint
            if position.is_record and durable > position:
                log.warning("shard %s: checkpoint %s/%d left at %s/%d, where an earlier "
                            "checkpoint of this tenure landed unanswered", lease_key,
                            position.sequence_number, position.sub_sequence_number,
                            durable.sequence_number, durable.sub_sequence_number)
                return self.table.guarded_update(lease, UpdateBuilder())
            return self.table.guarded_update(lease, checkpoint_changes(position))

        self.write(lease_key, concurrency_token, write, what="checkpoint")

    def durable_checkpoint(self, lease_key: str, concurrency_token: str) -> Position | None:
        """``CheckpointWriter``: the lease item's checkpoint, read consistently."""
        current = self.durable_lease(lease_key, concurrency_token)
        return None if current is None else current.checkpoint

    def durable_lease(self, lease_key: str, token: str) -> Lease | None:
        """The lease item as the table holds it now, read consistently for its holder in
        tenure ``token`` (``ShutdownException`` when it is not held in it any more)."""
        self._holding(lease_key, token)
        return self._current(lease_key, "reading the lease back")

    def transact_checkpoint(
        self,
        lease_key: str,
        concurrency_token: str,
        position: Position,
        items: Sequence[TransactWriteItemTypeDef],
    ) -> None:
        """``CheckpointWriter``: a checkpoint committed with other items, all or nothing."""
        self.transact(
            lease_key, concurrency_token, checkpoint_changes(position),
            items, what="commit",
            apply=lambda lease: lease.copy(
                checkpoint=position,
                owner_switches_since_checkpoint=0))

    def release(self, lease_key: str) -> None:
        """Give a held lease back so it can move at once: unowned, or - during a handoff - to
        the worker that asked for it. Listeners are not called: the caller chose this.
        Failures are logged; the lease then simply expires."""
        held = self.give_up(lease_key)
        if held is not None:
            self.write_release(held)

    def give_up(self, lease_key: str) -> HeldLease | None:
        """Stop holding ``lease_key`` now, without waiting for a write of it that is on its
        way (that write then finds it gone and lets it go itself); ``write_release`` tells
        DynamoDB. None when it was not held."""
        return self.held.forget(lease_key)

    def write_release(self, held: HeldLease) -> None:
        """The release write of a lease given up (``give_up``), once its lock is free."""
        key = held.lease.lease_key
        with self.held.lock_for(key):
            try:
                if self._attempt(held, self.table.evict, "release") is None:
                    log.info("worker %s: lease %s had already moved on", self.worker_id, key)
            except TABLE_ERRORS as exc:
                log.warning("worker %s: releasing %s failed, it will expire instead: %r",
                            self.worker_id, key, exc)

    def announce_handoff(self, lease_key: str) -> None:
        """Tell the handoff listeners that another worker asked for this lease; without
        listeners nobody can wind a processor down, so the lease is released at once."""
        if not self.held.notify_handoff(lease_key):
            self.release(lease_key)

    # -- internals -------------------------------------------------------------------------

    def _holding(self, lease_key: str, token: str | None) -> HeldLease:
        held = self.held.entry(lease_key)
        if held is None:
            raise ShutdownException(f"shard {lease_key}: lease {self.held.gone_why(lease_key)}")
        if token is not None and held.lease.concurrency_token != token:
            raise ShutdownException(f"shard {lease_key}: lease held again in a newer tenure")
        return held

    def _current(self, lease_key: str, what: str) -> Lease | None:
        """``Guard.current``: the lease item, read consistently. A failed read raises what a
        failed fenced write raises, and loses nothing: the caller's batch is tried again."""
        try:
            return self.table.get(lease_key)
        except LeaseTableThrottled as exc:
            raise ThrottlingException(f"shard {lease_key}: {what}: {exc}") from exc
        except (ClientError, BotoCoreError) as exc:
            raise KinesisClientLibDependencyException(
                f"shard {lease_key}: {what}: reading the lease failed: {exc}") from exc

    def _let_go(self, lease: Lease, what: str) -> None:
        """Release a lease whose late write landed after this worker had given it up."""
        try:
            self.table.evict(lease)
        except LeaseLostError:
            return
        except TABLE_ERRORS as exc:
            log.warning("worker %s: releasing %s after its late %s failed, it will expire "
                        "instead: %r", self.worker_id, lease.lease_key, what, exc)
            return
        log.info("worker %s: the %s of %s landed after the lease was given up; released it",
                 self.worker_id, what, lease.lease_key)

    def _expired(self, held: HeldLease) -> bool:
        return self._clock() - held.renewed_at > self.failover_time_s

    def _attempt(self, held: HeldLease, write: Callable[[Lease], Lease], what: str,
                 transaction: bool = False) -> Lease | None:
        """One fenced write (the lease's lock held). Returns the fresh lease, or None when the
        lease is lost (already dropped). A handoff request discovered on the way puts
        ``held`` in the handing-off state (``handoff_since`` set, so the caller can tell) and
        the write is repeated as the handing-off holder, fenced on ``checkpointOwner``.
        Table errors other than a failed condition propagate; the write is then remembered
        as unanswered (``HeldLease.unanswered``), since it may have landed.

        A refused write is first checked against this worker's own writes (``own_write``):
        the usual way to a refusal that is no loss is a write applied but its answer lost,
        and the SDK's retry of the same request refused by the counter it had just moved.
        If the item carries this write's id, the write landed: it succeeded. If it carries
        the id of an earlier write of this lease that got no answer, that write landed: the
        lease is dated from its sending and this write is made again from the counter it
        left. Either way the lease is not dropped with "owner now <this worker>".

        Except a ``transaction`` over an earlier transaction that landed: its items (state
        writes conditioned on the versions read before it, a user's unconditioned ones) were
        built without it, and repeated they would be refused or applied twice. Nothing is
        written and ``EarlierTransactionLanded`` says so; the committer reads back what landed
        (``durable_checkpoint``) before it applies anything again."""
        key = held.lease.lease_key
        write_id = new_write_id()
        sent_at = self._clock()
        try:
            return write(held.lease.copy(write_id=write_id))
        except LeaseChanged as exc:
            current = exc.current if exc.current is not None else self._read(key)
        except TABLE_ERRORS:
            held.unanswered[write_id] = sent_at
            if transaction:
                held.unanswered_transactions.add(write_id)
            raise
        landed = own_write(held.lease, current, {write_id, *held.unanswered})
        if landed is not None:
            assert current is not None
            fresh = self._landed(held, current)
            if landed == write_id:
                log.info("worker %s: the %s of %s landed; its answer was lost", self.worker_id,
                         what, key)
                return fresh
            repeat = not (transaction and landed in held.unanswered_transactions)
            log.info("worker %s: an unanswered write of %s landed; %s", self.worker_id, key,
                     f"repeating the {what} on it" if repeat else f"the {what} is not repeated")
            if not self.held.refresh(held, fresh, held.unanswered[landed]):
                self._let_go(fresh, what)  # given up meanwhile; the write made it ours
                return None
            if not repeat:
                raise EarlierTransactionLanded(
                    f"shard {key}: an earlier transaction of this lease whose answer was lost "
                    f"landed; the {what} was not written")
            return self._attempt(held, write, what, transaction)
        if handoff.is_request_to_hand_off(held.lease, current, self.worker_id):
            assert current is not None
            log.info("worker %s: %s asks for lease %s", self.worker_id, current.lease_owner, key)
            held.lease = handoff.as_handing_off(held.lease, current, self.worker_id)
            held.handoff_since = self._clock()
            # repeated as the handing-off holder (an attempt of its own: its answer may be
            # lost too); refused again, the lease is dropped there
            return self._attempt(held, write, what, transaction)
        owner = current.lease_owner if current is not None else None
        self.held.drop(key, f"taken by another worker ({what} found it changed; owner now "
                            f"{owner or 'nobody'})", held)
        return None

    def _landed(self, held: HeldLease, current: Lease) -> Lease:
        """``current``, an item one of this worker's writes of ``held`` produced (its answer
        lost), as that write's result. A handoff request written after it (it does not bump
        the counter, so ``current`` shows it) is taken up as a refused write takes it up:
        ``held`` goes to the handing-off state and the caller announces it."""
        fresh = current.copy(concurrency_token=held.lease.concurrency_token)
        if handoff.is_request_to_hand_off(
                held.lease.copy(lease_counter=current.lease_counter), current, self.worker_id):
            log.info("worker %s: %s asks for lease %s", self.worker_id, current.lease_owner,
                     current.lease_key)
            held.lease = handoff.as_handing_off(held.lease, current, self.worker_id)
            held.handoff_since = self._clock()
        return fresh

    def _read(self, lease_key: str) -> Lease | None:
        """The current item after a failed condition, for endpoints that do not return it."""
        try:
            return self.table.get(lease_key)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: reading %s failed: %r", self.worker_id, lease_key, exc)
            return None


def own_write(expected: Lease, current: Lease | None, write_ids: set[str]) -> str | None:
    """Which of ``write_ids`` - ids of this worker's writes of ``expected``, each conditioned
    on its counter - produced ``current``, the item after one of them was refused; None if
    none did. One did when the item carries its id (``Lease.last_write``) at the counter it
    set, ``expected``'s plus one.

    Why this cannot be fooled (docs/leases.md, "A write whose answer was lost"): an id is
    random and stamped by one write alone, re-sent only by the SDK's retries of that same
    request, and a conditional write applies all its changes or none; so an item carrying
    it had that write applied. Every later change that bumps the counter (any holder's
    write, a take, an adoption, a leader's assignment, an operator's write, a Java worker's
    write) leaves the counter above ``expected + 1``, so at that counter the item is the
    write's result plus only changes that leave the counter alone (a handoff request, a
    leader's notice, child shard ids, recovery requests). Owner and counter alone would be
    ambiguous: an earlier write of the same worker from the same counter that got no answer
    leaves both the same, and taking it for the current one would report a checkpoint
    written that was not, or date a renewal later than it happened."""
    if (current is None or current.last_write is None
            or current.lease_counter != expected.lease_counter + 1):
        return None
    return current.last_write if current.last_write in write_ids else None

