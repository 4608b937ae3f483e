"""The lease table: every operation kclpy makes on a lease item, and the condition guarding it.

Ownership and checkpoint changes are UpdateItem calls conditional on the ``leaseCounter``
(and the owner where Java checks it), so a worker acting on a stale view fails instead of
overwriting a newer one; that failure surfaces as ``LeaseLostError``. Updates name only the
attributes they change and ask for ``ALL_NEW``, so the caller gets the fresh lease back
without a second read and attributes we do not model are never destroyed.

Requests, throttling retries and table creation are ``dynamo.py``'s; this module knows the
lease item and which conditions guard each change of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from botocore.exceptions import ClientError

from kclpy.errors import LeaseLostError, TransactionRejected
from kclpy.leases import serializer as ser
from kclpy.leases.dynamo import (
    CONDITION_FAILED,
    DynamoTable,
    LeaseTableThrottled,
    cancellation_reasons,
)
from kclpy.leases.lease import Lease, new_write_id
from kclpy.leases.serializer import UpdateBuilder, key_of, n, s, ss
from kclpy.position import SHARD_END, Position
from kclpy.retry import THROTTLED, TRANSACTION_CANCELED, classify, error_code

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import TransactWriteItemTypeDef

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the Java KCL 3.x's index of the lease table by owner: hash key ``leaseOwner``, range key
#: ``leaseKey``, keys only. kclpy uses it as it is, so a Java 3.x fleet finds it ready.
OWNER_INDEX = "LeaseOwnerToLeaseKeyIndex"

class LeaseChanged(LeaseLostError):
    """A fenced write found the lease changed. ``current`` is the lease as DynamoDB holds it
    now, when the request asked for it and the endpoint returned it (None otherwise): a
    failed renewal must tell "taken by another worker" from "asked to hand it off"."""

    def __init__(self, message: str, current: Lease | None) -> None:
        super().__init__(message)
        self.current = current


def checkpoint_changes(position: Position) -> UpdateBuilder:
    """The lease item's changes for a checkpoint at ``position``. As in Java's
    checkpointer, a checkpoint resets the owner-switch count and clears any pending
    (prepared) checkpoint."""
    changes = UpdateBuilder()
    for attribute, value in ser.checkpoint_attributes(position).items():
        changes.set(attribute, value)
    return (
        changes
        .set(ser.OWNER_SWITCHES_SINCE_CHECKPOINT, n(0))
        .remove(ser.PENDING_CHECKPOINT)
        .remove(ser.PENDING_CHECKPOINT_SUB_SEQUENCE_NUMBER)
        .remove(ser.PENDING_CHECKPOINT_STATE)
        .remove(ser.START_AT)
    )


class LeaseTable(DynamoTable):
    """One lease table (hash key ``leaseKey``). Thread-safe."""

    kind = "lease"
    throttled = LeaseTableThrottled

    def __init__(self, client: DynamoDBClient, table_name: str, **options: Any) -> None:
        super().__init__(client, table_name, hash_key=ser.LEASE_KEY, **options)

    # -- plumbing ------------------------------------------------------------------------

    def _update(
        self, lease_key: str, update: UpdateBuilder, token: str | None, *, report: bool = False
    ) -> Lease:
        """One fenced UpdateItem. With ``report``, a failed condition returns the item as it
        is (``ReturnValuesOnConditionCheckFailure``) in the raised ``LeaseChanged``."""
        extra: dict[str, Any] = {"ReturnValuesOnConditionCheckFailure": "ALL_OLD"} if report else {}
        try:
            response = self.call(
                "UpdateItem",
                self.client.update_item,
                TableName=self.table_name,
                Key=key_of(lease_key),
                ReturnValues="ALL_NEW",
                **update.request(),
                **extra,
            )
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                current = _lease_or_none(exc.response.get("Item"))
                raise LeaseChanged(
                    f"lease {lease_key} changed in {self.table_name}", current
                ) from exc
            raise
        fresh = ser.lease_from_item(response["Attributes"])
        fresh.concurrency_token = token
        return fresh

    # -- reads ---------------------------------------------------------------------------

    def list_leases(self, *, consistent: bool = True) -> list[Lease]:
        """Every lease; items that are not leases are skipped, not fatal.

        ``consistent=False`` halves the read capacity, as Java's taker scans: fine wherever
        every decision taken on the result is a fenced write, since a stale item can only
        make such a write fail."""
        leases: list[Lease] = []
        request: dict[str, Any] = {"TableName": self.table_name, "ConsistentRead": consistent}
        while True:
            page = self.call("Scan", self.client.scan, **request)
            for item in page.get("Items", []):
                try:
                    leases.append(ser.lease_from_item(item))
                except ValueError:
                    log.warning("skipping malformed item in %s: %s", self.table_name, sorted(item))
            last = page.get("LastEvaluatedKey")
            if not last:
                return leases
            request["ExclusiveStartKey"] = last

    def keys_owned_by(self, owner: str) -> list[str]:
        """The keys of the leases whose ``leaseOwner`` is ``owner``, from the owner index
        (eventually consistent, as every global secondary index): what a worker reads
        instead of scanning the table when a leader assigns the leases. Costs what the
        keys weigh, not what the table does."""
        keys: list[str] = []
        request: dict[str, Any] = {
            "TableName": self.table_name, "IndexName": OWNER_INDEX,
            "KeyConditionExpression": "#o = :o",
            "ExpressionAttributeNames": {"#o": ser.LEASE_OWNER},
            "ExpressionAttributeValues": {":o": s(owner)},
        }
        while True:
            page = self.call("Query", self.client.query, **request)
            keys.extend(str(item[ser.LEASE_KEY]["S"]) for item in page.get("Items", []))
            last = page.get("LastEvaluatedKey")
            if not last:
                return keys
            request["ExclusiveStartKey"] = last

    def ensure_owner_index(self) -> bool:
        """Add the owner index to the table unless it has it; True if this call added it.
        Queries of an index still being built fail; a leader-assigned worker then reads
        its keys from a scan until the index answers (``leader.index_unreadable``).

        A fleet started at once races to add it: whatever the losers' UpdateTable answers
        (DynamoDB a ValidationException, or ResourceInUseException while the table is
        updating; moto an internal error), the index being there afterwards is success."""
        if self._has_owner_index():
            return False
        try:
            self.call(
                "UpdateTable", self.client.update_table, TableName=self.table_name,
                AttributeDefinitions=[
                    {"AttributeName": ser.LEASE_OWNER, "AttributeType": "S"},
                    {"AttributeName": ser.LEASE_KEY, "AttributeType": "S"}],
                GlobalSecondaryIndexUpdates=[{"Create": {
                    "IndexName": OWNER_INDEX,
                    "KeySchema": [{"AttributeName": ser.LEASE_OWNER, "KeyType": "HASH"},
                                  {"AttributeName": ser.LEASE_KEY, "KeyType": "RANGE"}],
                    "Projection": {"ProjectionType": "KEYS_ONLY"}}}])
        except ClientError as exc:
            # another worker added it first (or is adding it): not an error
            # (or too many table updates are under way: a later start adds it)
            if (error_code(exc) not in ("ValidationException", "ResourceInUseException")
                    and classify(exc) != THROTTLED and not self._has_owner_index()):
                raise
            return False
        log.info("added index %s to lease table %s", OWNER_INDEX, self.table_name)
        return True

    def _has_owner_index(self) -> bool:
        described = self.call(
            "DescribeTable", self.client.describe_table, TableName=self.table_name)["Table"]
        return OWNER_INDEX in {index["IndexName"]
                               for index in described.get("GlobalSecondaryIndexes", [])}

    def get(self, lease_key: str) -> Lease | None:
        response = self.call(
            "GetItem",
            self.client.get_item,
            TableName=self.table_name,
            Key=key_of(lease_key),
            ConsistentRead=True,
        )
        item = response.get("Item")
        return None if item is None else ser.lease_from_item(item)

    # -- writes --------------------------------------------------------------------------

    def create(self, lease: Lease) -> bool:
        """Put a new lease unless one exists for the key; False if it existed (left unchanged)."""
        try:
            self.call(
                "PutItem",
                self.client.put_item,
                TableName=self.table_name,
                Item=ser.lease_to_new_item(lease),
                ConditionExpression="attribute_not_exists(#k)",
                ExpressionAttributeNames={"#k": ser.LEASE_KEY},
            )
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return False
            raise
        return True

    def take(self, lease: Lease, owner: str) -> Lease:
        """Make ``owner`` the owner if nobody changed the lease since ``lease`` was read.

        Clears a 3.x handoff marker: a take is a fresh assignment. Counts an owner switch
        whenever the worker that held the lease (``checkpointOwner`` during a handoff, so a
        take after asking for it counts too) was another one, as Java counts every owner
        change. Marks the owner as a kclpy worker (``mixed.py``).
        """
        return self._update(lease.lease_key, _owner_update(lease, owner, holds=True),
                            lease.concurrency_token)

    def assign(self, lease: Lease, owner: str) -> Lease:
        """A leader's assignment of a free or expired lease to ``owner``, who takes it when
        it finds it (``take``, a second write that starts its tenure on its own clock). The
        counter is bumped, so whoever held it before is fenced out; ``kclpyHolder`` is left
        alone: ``owner`` does not hold the lease until it takes it."""
        return self._update(lease.lease_key, _owner_update(lease, owner, holds=False), None)

    def renew(self, lease: Lease) -> Lease:
        """Bump the counter, proving to every other worker that the holder is alive.

        Fenced on the counter and on the holder (see ``_expect_holder``); a failure raises
        ``LeaseChanged`` with the current item, so the caller can recognise a handoff request.
        """
        return self.guarded_update(lease, UpdateBuilder())

    def evict(self, lease: Lease) -> Lease:
        """Release the lease so that it can move at once.

        Normally the owner is removed and any worker may take the lease. During a handoff
        (``checkpoint_owner`` set) only ``checkpointOwner`` is removed, as Java 3.x does: that
        completes the handoff and ``leaseOwner`` already names the worker that takes over.
        A parked lease (the holder's ``park`` policy marked it during the handoff) cancels
        the handoff instead: both names go, as an operator's park removes them, so the
        lease is left to nobody until it is resumed - never to a worker that would start a
        consumer on it (``handoff.next_step``).
        """
        update = UpdateBuilder()
        if lease.checkpoint_owner is None or lease.parked is not None:
            update.remove(ser.LEASE_OWNER)
        update.remove(ser.CHECKPOINT_OWNER)
        return self.guarded_update(lease, update)

    def adopt(self, lease: Lease) -> Lease:
        """Finish receiving a handed-off lease: ``lease_owner`` (the caller) already names the
        new owner and the previous owner has cleared ``checkpointOwner``. Bumping the counter
        starts the new tenure; it fails if the previous owner has not let go yet or anything
        else changed since ``lease`` was read, and it never adopts a parked lease (the
        counter alone already refuses a copy read before the park; the condition states the
        rule where it cannot be bypassed)."""
        if lease.lease_owner is None:
            raise ValueError(f"lease {lease.lease_key} has no owner to adopt it")
        update = (
            UpdateBuilder()
            .set(ser.LEASE_COUNTER, n(lease.lease_counter + 1))
            .set(ser.KCLPY_HOLDER, s(lease.lease_owner))
            .add(ser.OWNER_SWITCHES_SINCE_CHECKPOINT, n(1))
            .expect_equal(ser.LEASE_COUNTER, n(lease.lease_counter))
            .expect_owner(lease.lease_owner)
            .expect_absent(ser.CHECKPOINT_OWNER)
            .expect_absent(ser.PARKED)
        )
        return self._update(lease.lease_key, update, lease.concurrency_token)

    def update_checkpoint(self, lease: Lease, position: Position) -> Lease:
        """Record progress as the lease's holder (see ``checkpoint_changes``)."""
        return self.guarded_update(lease, checkpoint_changes(position))

    # -- writes only the holder may make (``fence.py`` is their one caller) ------------------

    def guarded_update(self, lease: Lease, changes: UpdateBuilder) -> Lease:
        """``changes`` made as the lease's holder: the counter bumped, fenced on the counter
        and the holder. A failed condition raises ``LeaseChanged`` with the current item."""
        update = _guard(changes, lease)
        return self._update(lease.lease_key, update, lease.concurrency_token, report=True)

    def guarded_transact(
        self,
        lease: Lease,
        changes: UpdateBuilder,
        items: Sequence[TransactWriteItemTypeDef],
    ) -> Lease:
        """``changes`` to the lease item, fenced as in ``guarded_update``, and ``items`` in
        one transaction: all or nothing. Returns ``lease`` with the counter it now has (a
        transaction returns no attributes); ``LeaseChanged`` when the lease item's condition
        failed, ``TransactionRejected`` when only the caller's items were refused."""
        write_id = lease.write_id or new_write_id()
        update: dict[str, Any] = {
            "TableName": self.table_name,
            "Key": key_of(lease.lease_key),
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
            **_guard(changes, lease.copy(write_id=write_id)).request(),
        }
        lease_item = cast("TransactWriteItemTypeDef", {"Update": update})
        try:
            self.call(
                "TransactWriteItems",
                self.client.transact_write_items,
                TransactItems=[lease_item, *items],
            )
        except ClientError as exc:
            if error_code(exc) != TRANSACTION_CANCELED:
                raise
            reasons = cancellation_reasons(exc)
            first = reasons[0] if reasons else {}
            if first.get("Code") == "ConditionalCheckFailed":
                raise LeaseChanged(
                    f"lease {lease.lease_key} changed in {self.table_name}",
                    _lease_or_none(first.get("Item")),
                ) from exc
            codes = [str(reason.get("Code", "None")) for reason in reasons]
            raise TransactionRejected(
                f"transaction on lease {lease.lease_key} cancelled by its items: {codes}", reasons
            ) from exc
        return lease.copy(lease_counter=lease.lease_counter + 1, last_write=write_id,
                          write_id=None)

    def set_checkpoint_owner(self, lease: Lease, new_owner: str) -> Lease:
        """Start a Java KCL 3.x graceful handoff of ``lease`` to ``new_owner``.

        Written exactly as Java 3.x writes it, so a mixed fleet understands it: ``leaseOwner``
        becomes ``new_owner`` and ``checkpointOwner`` names the current owner, who may finish
        and checkpoint before letting go. Like Java, the counter is not bumped; unlike Java,
        the write is also fenced on the counter so a stale view cannot start a handoff.
        """
        if lease.lease_owner is None:
            raise ValueError(f"lease {lease.lease_key} has no owner to hand off from")
        update = (
            UpdateBuilder()
            .set(ser.LEASE_OWNER, s(new_owner))
            .set(ser.CHECKPOINT_OWNER, s(lease.lease_owner))
            .expect_equal(ser.LEASE_COUNTER, n(lease.lease_counter))
            .expect_owner(lease.lease_owner)
            .expect_absent(ser.CHECKPOINT_OWNER)
        )
        return self._update(lease.lease_key, update, lease.concurrency_token)

    def abandon_handoff(self, lease: Lease, *, restore_holder: bool) -> Lease:
        """Remove a ``checkpointOwner`` that nobody will act on (``mixed.StaleHandoffs``).
        With ``restore_holder``, ``leaseOwner`` goes back to the worker ``checkpointOwner``
        names, which never stopped holding the lease (it ignored the request); without, the
        lease stays with ``leaseOwner``, which took it during the handoff. Not fenced on the
        counter, which the holder keeps bumping, nor bumping it (its renewals carry on): only
        on both names being unchanged, so it fails once anything else moved the lease."""
        if lease.checkpoint_owner is None or lease.lease_owner is None:
            raise ValueError(f"lease {lease.lease_key} is not being handed off")
        update = UpdateBuilder()
        if restore_holder:
            update.set(ser.LEASE_OWNER, s(lease.checkpoint_owner))
        update.remove(ser.CHECKPOINT_OWNER).expect_owner(lease.lease_owner).expect_equal(
            ser.CHECKPOINT_OWNER, s(lease.checkpoint_owner))
        return self._update(lease.lease_key, update, None)

    def notify_holder(self, lease: Lease, holder: str, notice: str) -> bool:
        """A leader's notice to ``holder`` that it was assigned more leases, written on a
        lease it holds (``Lease.assignment_notice``); False when ``holder`` no longer holds
        it. Fenced on the holder, not on the counter, and leaving the counter alone, so the
        holder's renewals go on undisturbed and the next one returns the notice."""
        update = (UpdateBuilder().set(ser.ASSIGNMENT_NOTICE, s(notice))
                  .expect_owner(holder).expect_equal(ser.KCLPY_HOLDER, s(holder))
                  .expect_absent(ser.CHECKPOINT_OWNER))
        try:
            self._update(lease.lease_key, update, None)
        except LeaseChanged:
            return False
        return True

    def update_child_shard_ids(self, lease_key: str, child_ids: Iterable[str]) -> None:
        """Add children to a parent's ``childShardIds``; the counter is left alone so the
        owner's renewals are not disturbed (Java does the same)."""
        children = set(child_ids)
        if not children:
            return
        update = UpdateBuilder().add(ser.CHILD_SHARD_IDS, ss(children))
        update.expect_present(ser.LEASE_KEY)
        self._update(lease_key, update, None)

    def add_finished_parent(self, lease_key: str, parent_shard_id: str) -> None:
        """Record in a child's ``kclpyFinishedParents`` that ``parent_shard_id`` was read to
        its end; the counter is left alone, as for ``update_child_shard_ids``, so the
        child's holder is not disturbed. Raises ``LeaseLostError`` when the child has no
        lease."""
        update = UpdateBuilder().add(ser.FINISHED_PARENTS, ss({parent_shard_id}))
        update.expect_present(ser.LEASE_KEY)
        self._update(lease_key, update, None)

    def delete(self, lease: Lease) -> bool:
        """Delete the lease if it is unchanged since read; False if it changed or is gone.

        Unchanged means the same counter *and* the same item: a lease deleted and created
        again under its key (a stream created again, or its shard sync run by two workers)
        counts up from 0 again and passes through the counter an earlier read saw, so a
        writer holding that read would delete the new lease. The incarnation, written once
        when an item is created, tells the two apart (items created without one, by Java
        or an older kclpy, have none)."""
        return self._delete(lease, self._unchanged(lease))

    def delete_finished(self, lease: Lease) -> bool:
        """``delete``, and only while the item is still finished (``Lease.is_finished``):
        at ``SHARD_END`` with no gap and no operator request in it. An operator's ``recovery
        add`` to a held lease leaves the counter alone (the holder folds it in at its next
        renewal), so lease cleanup acting on a scan from before it would otherwise delete
        the request the command had reported queued."""
        condition = self._unchanged(lease)
        condition.expect_equal(ser.CHECKPOINT, s(SHARD_END))
        condition.expect_absent(ser.RECOVERY).expect_absent(ser.RECOVERY_REQUESTS)
        return self._delete(lease, condition)

    @staticmethod
    def _unchanged(lease: Lease) -> UpdateBuilder:
        condition = expect_counter(UpdateBuilder(), lease)
        if lease.incarnation is None:
            condition.expect_absent(ser.INCARNATION)
        else:
            condition.expect_equal(ser.INCARNATION, s(lease.incarnation))
        return condition

    def _delete(self, lease: Lease, condition: UpdateBuilder) -> bool:
        try:
            self.call(
                "DeleteItem",
                self.client.delete_item,
                TableName=self.table_name,
                Key=key_of(lease.lease_key),
                **condition.condition(),
            )
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return False
            raise
        return True


def expect_counter(update: UpdateBuilder, lease: Lease) -> UpdateBuilder:
    """Condition ``update`` on the lease's counter being still the one ``lease`` was read
    with. An item read without a counter (written by hand or by a tool: ``counter_absent``)
    is expected still without one - and still there, since an UpdateItem would create a
    deleted lease again - as no counter is not ``leaseCounter = 0`` to DynamoDB: every
    write keyed on the counter states it here, so none of them can fail for ever on such
    an item (a take, a delete, an operator's write). A conjunction only, as the simulated
    DynamoDB evaluates."""
    if lease.counter_absent:
        return update.expect_present(ser.LEASE_KEY).expect_absent(ser.LEASE_COUNTER)
    return update.expect_equal(ser.LEASE_COUNTER, n(lease.lease_counter))


def _lease_or_none(item: object) -> Lease | None:
    """The lease in a ``ReturnValuesOnConditionCheckFailure`` item, if there is a valid one."""
    if not isinstance(item, dict) or not item:
        return None
    try:
        return ser.lease_from_item(item)
    except ValueError:
        return None


def _guard(changes: UpdateBuilder, lease: Lease) -> UpdateBuilder:
    """``changes`` as a holder's write (a copy: ``changes`` may be fenced again for another
    lease state): the counter bumped, the counter held and the holder expected - and the
    incarnation held, when the item has one: a lease deleted and created again starts its
    counter over, so the same holder and counter alone could name another item than the
    one this worker took (a stale holder of a deleted lease writing into its successor).
    Stamped with the write's id (``lease.write_id``, else a fresh one), so that a writer
    whose answer is lost can recognise its write in the item (``LeaseFence``)."""
    update = changes.copy().set(ser.LEASE_COUNTER, n(lease.lease_counter + 1))
    update.set(ser.WRITE_ID, s(lease.write_id or new_write_id()))
    _expect_holder(update.expect_equal(ser.LEASE_COUNTER, n(lease.lease_counter)), lease)
    if lease.incarnation is not None:
        update.expect_equal(ser.INCARNATION, s(lease.incarnation))
    return update


def _expect_holder(update: UpdateBuilder, lease: Lease) -> None:
    """Fence a write on whoever holds the lease: its owner, or during a handoff the previous
    owner named by ``checkpointOwner`` (``leaseOwner`` then already names the next owner)."""
    if lease.checkpoint_owner is not None:
        update.expect_equal(ser.CHECKPOINT_OWNER, s(lease.checkpoint_owner))
    else:
        update.expect_owner(lease.lease_owner)


def _owner_update(lease: Lease, owner: str, *, holds: bool) -> UpdateBuilder:
    """The write that makes ``owner`` the lease's owner, shared by a take and a leader's
    assignment so that both fence the same way: the counter is bumped on the condition that
    nobody changed it since ``lease`` was read, a 3.x handoff marker is cleared (a fresh
    assignment), and an owner switch counts whenever the worker that held the lease
    (``checkpointOwner`` during a handoff) was another one, as Java counts every owner change.
    ``holds``: the owner holds it from this write on (a take marks it a kclpy worker,
    ``mixed.py``); an assignment leaves ``kclpyHolder`` to the assignee's take."""
    update = UpdateBuilder().set(ser.LEASE_OWNER, s(owner))
    if holds:
        update.set(ser.KCLPY_HOLDER, s(owner))
    update.set(ser.LEASE_COUNTER, n(lease.lease_counter + 1)).remove(ser.CHECKPOINT_OWNER)
    expect_counter(update, lease)
    previous = lease.checkpoint_owner or lease.lease_owner
    if previous is not None and previous != owner:
        update.add(ser.OWNER_SWITCHES_SINCE_CHECKPOINT, n(1))
    return update
