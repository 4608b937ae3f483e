"""Lease <-> DynamoDB item, in the Java KCL 2.x/3.x schema, and the update expressions on it.

Reading is lenient (Java writes some attributes only when set, and newer Java versions add
attributes we do not know); writing is surgical: an update names exactly the attributes it
changes, so attributes we do not model (``throughputKBps``, a future version's fields) survive
every write this library makes. Only ``create`` writes a whole item, and only where none exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kclpy.leases.lease import Lease
from kclpy.position import Position

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef

LEASE_KEY = "leaseKey"
LEASE_OWNER = "leaseOwner"
LEASE_COUNTER = "leaseCounter"
CHECKPOINT = "checkpoint"
CHECKPOINT_SUB_SEQUENCE_NUMBER = "checkpointSubSequenceNumber"
PENDING_CHECKPOINT = "pendingCheckpoint"
PENDING_CHECKPOINT_SUB_SEQUENCE_NUMBER = "pendingCheckpointSubSequenceNumber"
PENDING_CHECKPOINT_STATE = "pendingCheckpointState"
OWNER_SWITCHES_SINCE_CHECKPOINT = "ownerSwitchesSinceCheckpoint"
PARENT_SHARD_ID = "parentShardId"
CHILD_SHARD_IDS = "childShardIds"
STARTING_HASH_KEY = "startingHashKey"
ENDING_HASH_KEY = "endingHashKey"
CHECKPOINT_OWNER = "checkpointOwner"
#: kclpy's own attribute (lag recovery); unknown to the Java KCL, which ignores it
RECOVERY = "kclpyRecovery"
#: kclpy's own attribute (SS): operator requests to the recovery queue that the lease's
#: holder has not folded into it yet (``kclpy.recovery.requests``); Java ignores it
RECOVERY_REQUESTS = "kclpyRecoveryRequests"
#: kclpy's own attribute: the resolved start of a lease still at LATEST / AT_TIMESTAMP
START_AT = "kclpyStartAt"
#: kclpy's own attribute: the shard is parked, no kclpy worker takes it; Java ignores it
PARKED = "kclpyParked"
#: kclpy's lease incarnation (``Lease.incarnation``), written only when the item is created
INCARNATION = "kclpyIncarnation"
KCLPY_STREAM_NAME = "kclpyStreamName"
#: kclpy's own: the kclpy worker that last took the lease (``Lease.kclpy_holder``); Java
#: workers neither read nor clear it, so it names the owner only while a kclpy worker holds it
KCLPY_HOLDER = "kclpyHolder"
#: kclpy's own: a leader's notice to the lease's holder that it was assigned more leases
#: (``Lease.assignment_notice``); Java workers neither read nor clear it
ASSIGNMENT_NOTICE = "kclpyAssignmentNotice"
#: kclpy's own: the id of the holder's write that last changed the lease (``Lease.last_write``),
#: so that a writer whose answer was lost can recognise its own write in the item
#: (``fence.py``); Java workers neither read nor clear it
WRITE_ID = "kclpyWrite"
#: kclpy's own (SS): the parents read to their end (``Lease.finished_parents``), added by each
#: parent's holder without the counter; Java workers neither read nor clear it
FINISHED_PARENTS = "kclpyFinishedParents"
#: Java multi-stream leases: the serialised stream identifier (named so for legacy reasons)
#: and the bare shard id, beside a key that joins them
STREAM_NAME = "streamName"
SHARD_ID = "shardId"


def s(value: str) -> AttributeValueTypeDef:
    return {"S": value}


def n(value: int) -> AttributeValueTypeDef:
    return {"N": str(value)}


def ss(values: Iterable[str]) -> AttributeValueTypeDef:
    """A string set; DynamoDB rejects empty sets, so callers must not pass one."""
    items = sorted(set(values))
    if not items:
        raise ValueError("DynamoDB string sets cannot be empty")
    return {"SS": items}


def key_of(lease_key: str) -> dict[str, AttributeValueTypeDef]:
    return {LEASE_KEY: s(lease_key)}


def _str(item: Mapping[str, AttributeValueTypeDef], name: str) -> str | None:
    value = item.get(name)
    return None if value is None else value.get("S")


def _int(item: Mapping[str, AttributeValueTypeDef], name: str) -> int | None:
    value = item.get(name)
    if value is None or "N" not in value:
        return None
    return int(value["N"])


def _counter(key: str, item: Mapping[str, AttributeValueTypeDef]) -> int:
    """The lease counter: absent reads as 0 (never taken); of another type it is refused, as
    no conditional write on it could ever succeed and the lease would silently stay untaken."""
    value = item.get(LEASE_COUNTER)
    if value is None:
        return 0
    if "N" not in value:
        raise ValueError(f"lease {key}: {LEASE_COUNTER} is not a number: {sorted(value)}")
    return int(value["N"])


def _set(item: Mapping[str, AttributeValueTypeDef], name: str) -> frozenset[str]:
    value = item.get(name)
    if value is None:
        return frozenset()
    if "SS" in value:
        return frozenset(value["SS"])
    # Tolerate a hand-written single string where Java writes a set.
    single = value.get("S")
    return frozenset({single}) if single else frozenset()


def checkpoint_attributes(position: Position) -> dict[str, AttributeValueTypeDef]:
    """A position as the lease item stores it, the one way it is written there (the Java KCL
    2.x schema): ``checkpoint`` (a sequence number or a sentinel's name) and
    ``checkpointSubSequenceNumber``."""
    return {CHECKPOINT: s(position.checkpoint),
            CHECKPOINT_SUB_SEQUENCE_NUMBER: n(position.sub_sequence_number)}


def _position(key: str, attribute: str, checkpoint: str | None,
              sub_sequence_number: int | None) -> Position:
    """A checkpoint attribute read as a position. An item no KCL could have written (a
    checkpoint neither a sequence number nor a sentinel) fails the read naming the lease and
    the attribute, as the Java KCL's serializer fails on it: nothing can resume from it, and
    skipping the item would leave its shard unread without a word."""
    try:
        return Position.of(checkpoint, sub_sequence_number)
    except ValueError as exc:
        raise ValueError(f"lease {key}: {attribute} {checkpoint!r} "
                         f"(sub-sequence {sub_sequence_number}): {exc}") from exc


def lease_from_item(item: Mapping[str, AttributeValueTypeDef]) -> Lease:
    """Read a lease item written by this library or by any Java KCL 2.x/3.x version."""
    key = _str(item, LEASE_KEY)
    if key is None:
        raise ValueError(f"lease item without a string {LEASE_KEY}: {sorted(item)}")
    state = item.get(PENDING_CHECKPOINT_STATE)
    pending = _str(item, PENDING_CHECKPOINT) or None
    pending_sub = _int(item, PENDING_CHECKPOINT_SUB_SEQUENCE_NUMBER)
    return Lease(
        lease_key=key,
        lease_owner=_str(item, LEASE_OWNER),
        lease_counter=_counter(key, item),
        counter_absent=LEASE_COUNTER not in item,
        checkpoint=_position(key, CHECKPOINT, _str(item, CHECKPOINT) or None,
                             _int(item, CHECKPOINT_SUB_SEQUENCE_NUMBER)),
        pending_checkpoint=(None if pending is None
                            else _position(key, PENDING_CHECKPOINT, pending, pending_sub)),
        pending_checkpoint_state=None if state is None else state.get("B"),
        owner_switches_since_checkpoint=_int(item, OWNER_SWITCHES_SINCE_CHECKPOINT) or 0,
        parent_shard_ids=_set(item, PARENT_SHARD_ID),
        child_shard_ids=_set(item, CHILD_SHARD_IDS),
        starting_hash_key=_str(item, STARTING_HASH_KEY),
        ending_hash_key=_str(item, ENDING_HASH_KEY),
        checkpoint_owner=_str(item, CHECKPOINT_OWNER),
        recovery=_str(item, RECOVERY),
        recovery_requests=_set(item, RECOVERY_REQUESTS),
        start_at_ms=_int(item, START_AT),
        parked=_str(item, PARKED),
        stream=_str(item, STREAM_NAME),
        incarnation=_str(item, INCARNATION),
        stream_name=_str(item, KCLPY_STREAM_NAME),
        kclpy_holder=_str(item, KCLPY_HOLDER),
        assignment_notice=_str(item, ASSIGNMENT_NOTICE),
        last_write=_str(item, WRITE_ID),
        finished_parents=_set(item, FINISHED_PARENTS),
    )


def lease_to_new_item(lease: Lease) -> dict[str, AttributeValueTypeDef]:
    """The item ``create`` puts (conditionally on absence); optional attributes only when set,
    as Java writes them."""
    item: dict[str, AttributeValueTypeDef] = {
        LEASE_KEY: s(lease.lease_key),
        LEASE_COUNTER: n(lease.lease_counter),
        **checkpoint_attributes(lease.checkpoint),
        OWNER_SWITCHES_SINCE_CHECKPOINT: n(lease.owner_switches_since_checkpoint),
    }
    if lease.lease_owner is not None:
        item[LEASE_OWNER] = s(lease.lease_owner)
    if lease.parent_shard_ids:
        item[PARENT_SHARD_ID] = ss(lease.parent_shard_ids)
    if lease.child_shard_ids:
        item[CHILD_SHARD_IDS] = ss(lease.child_shard_ids)
    if lease.finished_parents:
        item[FINISHED_PARENTS] = ss(lease.finished_parents)
    if lease.pending_checkpoint is not None:
        item[PENDING_CHECKPOINT] = s(lease.pending_checkpoint.checkpoint)
        item[PENDING_CHECKPOINT_SUB_SEQUENCE_NUMBER] = n(
            lease.pending_checkpoint.sub_sequence_number
        )
    if lease.pending_checkpoint_state is not None:
        item[PENDING_CHECKPOINT_STATE] = {"B": lease.pending_checkpoint_state}
    if lease.starting_hash_key is not None and lease.ending_hash_key is not None:
        item[STARTING_HASH_KEY] = s(lease.starting_hash_key)
        item[ENDING_HASH_KEY] = s(lease.ending_hash_key)
    if lease.checkpoint_owner is not None:
        item[CHECKPOINT_OWNER] = s(lease.checkpoint_owner)
    if lease.stream is not None:
        item[STREAM_NAME] = s(lease.stream)
        item[SHARD_ID] = s(lease.shard_id)
    if lease.incarnation is not None:
        item[INCARNATION] = s(lease.incarnation)
    if lease.stream_name is not None:
        item[KCLPY_STREAM_NAME] = s(lease.stream_name)
    return item


class UpdateBuilder:
    """Collects one UpdateItem's clauses and conditions with placeholder names and values.

    Every attribute name goes through a placeholder so no DynamoDB reserved word can ever
    break an expression, whatever attribute a later change adds.
    """

    def __init__(self) -> None:
        self._set: list[str] = []
        self._add: list[str] = []
        self._remove: list[str] = []
        self._delete: list[str] = []
        self._conditions: list[str] = []
        self._placeholders: dict[str, str] = {}
        self._values: dict[str, AttributeValueTypeDef] = {}

    def copy(self) -> UpdateBuilder:
        """An independent builder with the same clauses: one change can be fenced again
        (e.g. retried as the handing-off holder) without stacking conditions."""
        other = UpdateBuilder()
        other._set, other._add, other._remove = list(self._set), list(self._add), list(self._remove)
        other._delete = list(self._delete)
        other._conditions = list(self._conditions)
        other._placeholders, other._values = dict(self._placeholders), dict(self._values)
        return other

    def _name(self, attribute: str) -> str:
        return self._placeholders.setdefault(attribute, f"#a{len(self._placeholders)}")

    def _value(self, value: AttributeValueTypeDef) -> str:
        placeholder = f":v{len(self._values)}"
        self._values[placeholder] = value
        return placeholder

    def set(self, attribute: str, value: AttributeValueTypeDef) -> UpdateBuilder:
        self._set.append(f"{self._name(attribute)} = {self._value(value)}")
        return self

    def add(self, attribute: str, value: AttributeValueTypeDef) -> UpdateBuilder:
        self._add.append(f"{self._name(attribute)} {self._value(value)}")
        return self

    def remove(self, attribute: str) -> UpdateBuilder:
        self._remove.append(self._name(attribute))
        return self

    def delete(self, attribute: str, value: AttributeValueTypeDef) -> UpdateBuilder:
        """Take ``value``'s elements out of a set attribute, leaving any others; an emptied
        set attribute is removed."""
        self._delete.append(f"{self._name(attribute)} {self._value(value)}")
        return self

    def expect_equal(self, attribute: str, value: AttributeValueTypeDef) -> UpdateBuilder:
        self._conditions.append(f"{self._name(attribute)} = {self._value(value)}")
        return self

    def expect_absent(self, attribute: str) -> UpdateBuilder:
        self._conditions.append(f"attribute_not_exists({self._name(attribute)})")
        return self

    def expect_present(self, attribute: str) -> UpdateBuilder:
        self._conditions.append(f"attribute_exists({self._name(attribute)})")
        return self

    def expect_owner(self, owner: str | None) -> UpdateBuilder:
        """The lease's owner is ``owner`` (None: the lease is unowned), as Java expects it."""
        if owner is None:
            return self.expect_absent(LEASE_OWNER)
        return self.expect_equal(LEASE_OWNER, s(owner))

    def condition(self) -> dict[str, Any]:
        """The keyword arguments of the conditions alone, for a write that is not an
        UpdateItem (a conditional DeleteItem)."""
        if not self._conditions:
            raise ValueError("no condition to state")
        request: dict[str, Any] = {
            "ConditionExpression": " AND ".join(self._conditions),
            "ExpressionAttributeNames": {p: a for a, p in self._placeholders.items()},
        }
        if self._values:
            request["ExpressionAttributeValues"] = dict(self._values)
        return request

    def request(self) -> dict[str, Any]:
        """The UpdateItem keyword arguments for the expression, condition, names and values."""
        clauses = []
        if self._set:
            clauses.append("SET " + ", ".join(self._set))
        if self._add:
            clauses.append("ADD " + ", ".join(self._add))
        if self._remove:
            clauses.append("REMOVE " + ", ".join(self._remove))
        if self._delete:
            clauses.append("DELETE " + ", ".join(self._delete))
        if not clauses:
            raise ValueError("an update must change at least one attribute")
        request: dict[str, Any] = {
            "UpdateExpression": " ".join(clauses),
            "ExpressionAttributeNames": {p: a for a, p in self._placeholders.items()},
        }
        if self._values:
            request["ExpressionAttributeValues"] = dict(self._values)
        if self._conditions:
            request["ConditionExpression"] = " AND ".join(self._conditions)
        return request
