"""The transaction handle a stateful processor writes to, and what one transaction may hold.

Reads see the transaction's own staged writes first, then the store. Writes are staged per
record, so a transaction can be cut exactly at a record boundary when the next record would
take it past the store's limits (DynamoDB: 100 items and 4 MB per transaction): the record's
writes are undone, the transaction commits without it, and the record is applied again in a
fresh one. Values are anything ``json`` can encode; keys are strings.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kclpy.errors import KCLError

#: staged value meaning "delete this key"
DELETED = object()


class TransactionTooLarge(KCLError):
    """One record's writes alone exceed what a single transaction can hold: they cannot be
    committed atomically with its checkpoint, so the record cannot be applied exactly once."""


@dataclass(frozen=True)
class Limits:
    """What one transaction may hold. ``items`` excludes the checkpoint's own write."""

    items: int
    bytes: int


@dataclass
class Versioned:
    """A value as the store holds it, with the version its conditional writes compare."""

    value: Any
    #: 0 when the key does not exist in the store
    version: int
    #: names this life of the key: drawn anew each time the key is created, so a key
    #: deleted and created again - its version starting over at 1 - never matches what was
    #: read of its former life (another worker's cached ``version`` 1). None: no such key,
    #: or a key written before keys had one (its own life, as distinct as any other)
    incarnation: str | None = None


def new_incarnation() -> str:
    """The incarnation of a key a transaction creates: 128 random bits."""
    return uuid.uuid4().hex


def encoded_size(key: str, value: Any) -> int:
    """Bytes a staged write adds to a transaction (key, JSON value and a margin for the
    attribute names, the version and the incarnation)."""
    body = 0 if value is DELETED else len(json.dumps(value, separators=(",", ":")))
    return len(key.encode("utf-8")) + body + 112


class StateTransaction:
    """One transaction's staged state. Not thread-safe: one shard's delivery thread uses it."""

    def __init__(self, read: Callable[[str], Versioned], limits: Limits) -> None:
        self._read = read
        self._limits = limits
        #: key -> (value or DELETED)
        self.writes: dict[str, Any] = {}
        #: versions of the keys read or written, as the store had them when first read
        self.versions: dict[str, int] = {}
        #: the incarnation each of those keys has, as read, or - a key read as absent - the
        #: one it gets if this transaction creates it. A commit's conditions compare it
        #: beside the version: a version alone repeats when a key is created again
        self.incarnations: dict[str, str | None] = {}
        #: the store's own extra writes (DynamoDB: TransactWriteItems entries; SQL:
        #: SQLAlchemy statements)
        self.outgoing: list[Any] = []
        self._size = 0
        self._undo: tuple[dict[str, Any], dict[str, int], dict[str, str | None], int, int
                          ] | None = None

    # -- the processor's API ---------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` as this transaction sees it (its own writes first)."""
        if key in self.writes:
            value = self.writes[key]
            return default if value is DELETED else value
        current = self._version_of(key)
        return default if current.value is None else current.value

    def put(self, key: str, value: Any) -> None:
        if value is None:
            raise ValueError("None is not a value; use delete()")
        json.dumps(value)  # fail now, in the record that wrote it, not at commit
        self._version_of(key)
        self._stage(key, value)

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """``put(key, fn(get(key, default)))``; returns the new value."""
        value = fn(self.get(key, default))
        self.put(key, value)
        return value

    def delete(self, key: str) -> None:
        self._version_of(key)
        self._stage(key, DELETED)

    def emit(self, item: Any) -> None:
        """Stage an outgoing write committed with this transaction: for the DynamoDB store a
        ``TransactWriteItems`` entry (``{"Put": {"TableName": ..., "Item": ...}}``), for the
        SQL store a SQLAlchemy statement (``insert(orders).values(...)``)."""
        self.outgoing.append(item)
        self._size += len(json.dumps(item, separators=(",", ":"), default=str))

    # -- kclpy's side ----------------------------------------------------------------------

    def begin_record(self) -> None:
        """Remember the state before the next record, so its writes can be undone."""
        self._undo = (dict(self.writes), dict(self.versions), dict(self.incarnations),
                      len(self.outgoing), self._size)

    def over_limits(self) -> bool:
        """Every key read or written is one item of the commit (a write, or a check that a
        key only read is unchanged), every outgoing write another."""
        return (len(self.versions) + len(self.outgoing) > self._limits.items
                or self._size > self._limits.bytes)

    def undo_record(self) -> None:
        """Take back the writes of the record begun last."""
        assert self._undo is not None
        self.writes, self.versions, self.incarnations, outgoing, self._size = self._undo
        del self.outgoing[outgoing:]
        self._undo = None

    @property
    def empty(self) -> bool:
        return not self.writes and not self.outgoing

    def _version_of(self, key: str) -> Versioned:
        current = self._read(key)
        if key not in self.versions:
            self.versions[key] = current.version
            self.incarnations[key] = (current.incarnation if current.version
                                      else new_incarnation())
            self._size += encoded_size(key, DELETED)
        return current

    def _stage(self, key: str, value: Any) -> None:
        previous = self.writes.get(key)
        if previous is not None:
            self._size -= encoded_size(key, previous)
        self.writes[key] = value
        self._size += encoded_size(key, value)
