"""State in a DynamoDB table, committed in the lease item's own ``TransactWriteItems``.

One item per key: ``stateKey`` (S, the hash key), ``stateValue`` (S, JSON), ``stateVersion``
(N) and ``stateIncarnation`` (S: drawn when the key is created; items written before it
existed have none, and are read and updated as they are). Every write is conditioned on the
version and incarnation the transaction read - the version alone starts over at 1 when a key
is deleted and created again, and would let another worker's cached version 1 of the
former key through (a lost update) - so two
workers of one application that update the same key from different shards never lose each
other's update: the second one's transaction is refused (``TransactionRejected``), and its
records are applied again to the state as it now is. A transaction holds the lease item
plus at most 99 writes and stays under 4 MB (``transaction.py`` cuts it at record
boundaries to stay there).

Every key a transaction read is checked at the version it read, absent keys included: a key
only read gets a ``ConditionCheck`` (``attribute_not_exists`` when it was read as absent), and
so does the delete of a key read as absent - there is nothing to delete, but a commit that
assumed the key absent must be refused when another shard created it meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kclpy.checkpoint import CheckpointWriter
from kclpy.leases.dynamo import DynamoTable
from kclpy.position import Position
from kclpy.state.store import CommittedCache
from kclpy.state.transaction import DELETED, Limits, StateTransaction, Versioned

KEY = "stateKey"
VALUE = "stateValue"
VERSION = "stateVersion"
INCARNATION = "stateIncarnation"
#: DynamoDB allows 100 items per transaction; the lease item is one of them
MAX_ITEMS = 99
#: DynamoDB allows 4 MB per transaction; the margin covers the lease item and encoding
MAX_BYTES = 3_500_000
#: marks a key the transaction read but did not write
_READ_ONLY = object()


class DynamoDBStateStore:
    """A state table (hash key ``stateKey``), created PAY_PER_REQUEST when missing."""

    limits = Limits(items=MAX_ITEMS, bytes=MAX_BYTES)
    #: its position is the lease item's checkpoint (and a gap's, the gap entry's)
    keeps_position = False

    def __init__(self, table_name: str, *, client: Any = None) -> None:
        self.table_name = table_name
        self._table: DynamoTable | None = None
        if client is not None:
            self.open(client)
        self._cache = CommittedCache()

    def open(self, dynamodb: Any) -> None:
        if self._table is not None:
            return
        table = DynamoTable(dynamodb, self.table_name, hash_key=KEY)
        table.kind = "state"
        table.create_if_missing()
        self._table = table

    @property
    def table(self) -> DynamoTable:
        if self._table is None:
            raise RuntimeError(f"state store {self.table_name} used before open()")
        return self._table

    def read(self, key: str) -> Versioned:
        return self._cache.read(key, self._fetch)

    def _fetch(self, key: str) -> Versioned:
        table = self.table
        response = table.call(
            "GetItem", table.client.get_item, TableName=self.table_name,
            Key={KEY: {"S": key}}, ConsistentRead=True)
        item = response.get("Item")
        if item is None:
            return Versioned(None, 0)
        return Versioned(json.loads(item[VALUE]["S"]), int(item[VERSION]["N"]),
                         item.get(INCARNATION, {}).get("S"))

    def begin_tenure(
        self, writer: CheckpointWriter, lease_key: str, token: str
    ) -> Position | None:
        """Nothing to claim: the lease item, fenced by its counter, holds the checkpoint."""
        return None

    def commit(
        self,
        writer: CheckpointWriter,
        lease_key: str,
        token: str,
        position: Position,
        txn: StateTransaction,
        gap: Position | None = None,
    ) -> None:
        """``writer`` is the gap's when ``gap`` is set: the lease item's recovery queue, not
        its checkpoint, moves in the same transaction."""
        writer.transact_checkpoint(lease_key, token, position, self.items(txn))
        self._cache.committed(txn)

    def durable_position(
        self, writer: CheckpointWriter, lease_key: str, token: str, gap: Position | None
    ) -> Position | None:
        """The lease item's checkpoint (or its gap's), which commits with the state."""
        return writer.durable_checkpoint(lease_key, token)

    def gap_position(self, lease_key: str, gap: Position) -> Position | None:
        """Nothing stored here: a gap's checkpoint in the lease item commits with its state."""
        return None

    def items(self, txn: StateTransaction) -> list[Any]:
        """The transaction's entries besides the lease item: each write, and a check of
        each key only read (or deleted after being read as absent), conditioned on the
        version it was read at."""
        entries: list[Any] = []
        for key, version in txn.versions.items():
            value = txn.writes.get(key, _READ_ONLY)
            incarnation = txn.incarnations[key]
            condition = _condition(version, incarnation)
            target = {"TableName": self.table_name, "Key": {KEY: {"S": key}}}
            if value is _READ_ONLY or (value is DELETED and version == 0):
                entries.append({"ConditionCheck": {**target, **condition}})
            elif value is DELETED:
                entries.append({"Delete": {**target, **condition}})
            else:
                item = {KEY: {"S": key},
                        VALUE: {"S": json.dumps(value, separators=(",", ":"))},
                        VERSION: {"N": str(version + 1)}}
                if incarnation is not None:
                    item[INCARNATION] = {"S": incarnation}
                entries.append({"Put": {"TableName": self.table_name, "Item": item,
                                        **condition}})
        return [*entries, *txn.outgoing]

    def forget(self, keys: Sequence[str]) -> None:
        self._cache.forget(keys)


def _condition(version: int, incarnation: str | None) -> dict[str, Any]:
    """The key is as the transaction read it: absent (``version`` 0), or at ``version`` in
    ``incarnation`` (None: an item written before keys had one)."""
    if version == 0:
        return {"ConditionExpression": "attribute_not_exists(#k)",
                "ExpressionAttributeNames": {"#k": KEY}}
    values: dict[str, Any] = {":v": {"N": str(version)}}
    if incarnation is None:
        expression = "#v = :v AND attribute_not_exists(#i)"
    else:
        expression = "#v = :v AND #i = :i"
        values[":i"] = {"S": incarnation}
    return {"ConditionExpression": expression,
            "ExpressionAttributeNames": {"#v": VERSION, "#i": INCARNATION},
            "ExpressionAttributeValues": values}
