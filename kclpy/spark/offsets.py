"""Per-shard positions: the Structured Streaming source's offsets.

Spark stores every batch's end offset as JSON in the query's checkpoint and compares offsets
by their JSON text, so an offset here is a plain dict with one short string per shard, keys
sorted: equal positions always serialise the same way.

A position says what has been consumed, never what comes next; it is kclpy's one position
type (:class:`kclpy.position.Position`), written as that type writes itself for the offset
log (``Position.encode``):

- ``TRIM_HORIZON``: nothing of the shard yet (also what a shard absent from an offset means:
  a shard discovered later, a child of a split or merge, is read from its beginning);
- ``AT_TIMESTAMP/<epoch ms>``: nothing yet, and reading starts at that arrival time;
- ``AFTER/<sequence>/<sub-sequence>``: everything up to and including that user record, so
  the next read resumes in the middle of a KPL aggregate if that is where a batch ended;
- ``SHARD_END``: the whole (closed) shard.

A batch cut by a budget (rows, bytes or time per trigger) ends at a position the driver does
not know when it plans, since only reading finds where N records end:

- ``UPTO/<until ms>/<rows>/<bytes>/<ms>/<plan>/<start>`` (an ``UptoEnd``; an offset's entry
  is a ``Position`` or one of these, ``OffsetEntry``): from ``start``, the records that
  arrived before ``until``, stopping once ``rows`` user records, ``bytes`` of payload or
  ``ms`` of reading are reached (``-``: no such budget). ``plan`` makes each planned end
  distinct. The executor that reads it records the concrete position it reached
  (:mod:`kclpy.spark.metadata`); rows and bytes alone make that position a function of the
  end, so it can also be found again by reading, while a time budget needs the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from kclpy.position import Position

__all__ = ["UPTO", "Budget", "OffsetEntry", "UptoEnd", "decode_entry", "decode_offset",
           "encode_offset"]

UPTO = "UPTO"


@dataclass(frozen=True)
class Budget:
    """What one shard's part of a batch may hold; None: no limit of that kind."""

    rows: int | None = None
    #: payload bytes: a stopping condition (the record that reaches it is the last one),
    #: not a strict bound, as Databricks' ``fetchBufferSize``
    bytes: int | None = None
    #: reading time of the task; the one budget whose end is not a function of the records
    duration_ms: int | None = None

    def __post_init__(self) -> None:
        for value in (self.rows, self.bytes, self.duration_ms):
            if value is not None and value < 1:
                raise ValueError(f"a budget must be at least 1, got {value}")

    @property
    def deterministic(self) -> bool:
        """Reading the same records always stops at the same one."""
        return self.duration_ms is None

    def encode(self) -> str:
        return "/".join("-" if v is None else str(v)
                        for v in (self.rows, self.bytes, self.duration_ms))

    @classmethod
    def decode(cls, rows: str, size: str, duration: str) -> Budget:
        def value(text: str) -> int | None:
            return None if text == "-" else int(text)

        return cls(value(rows), value(size), value(duration))


@dataclass(frozen=True)
class UptoEnd:
    """A budgeted batch's end (``UPTO``): not a position yet but the rule that finds one -
    from ``start``, the records that arrived before ``until_ms``, until ``budget`` is spent.
    ``plan`` makes each planned end distinct. Reading it yields a ``Position``."""

    start: Position
    until_ms: int
    budget: Budget
    plan: str

    def __post_init__(self) -> None:
        if not self.plan or not self.plan.isalnum():
            raise ValueError(f"UPTO needs a plan of letters and digits, got {self.plan!r}")
        if self.start.is_shard_end:
            raise ValueError("UPTO cannot start at SHARD_END")
        self.start.encode()  # raises when the start has no offset-log form

    @property
    def kind(self) -> str:
        return UPTO

    @property
    def is_shard_end(self) -> bool:
        """Never: it starts before the shard's end and names no position until read."""
        return False

    def encode(self) -> str:
        return (f"{UPTO}/{self.until_ms}/{self.budget.encode()}/{self.plan}/"
                f"{self.start.encode()}")


#: one shard's entry in an offset: a position, or a budgeted end that finds one
OffsetEntry: TypeAlias = Position | UptoEnd


def decode_entry(text: str) -> OffsetEntry:
    """The entry ``encode`` wrote as ``text``; ValueError for anything else."""
    kind, _, rest = text.partition("/")
    if kind != UPTO:
        return Position.decode(text)
    try:
        until, rows, size, duration, plan, start = rest.split("/", 5)
        return UptoEnd(Position.decode(start), int(until), Budget.decode(rows, size, duration),
                       plan)
    except ValueError as exc:
        raise ValueError(f"not a shard position: {text!r} ({exc})") from None


def encode_offset(positions: Mapping[str, OffsetEntry]) -> dict[str, Any]:
    return {"shards": {shard: positions[shard].encode() for shard in sorted(positions)}}


def decode_offset(offset: Mapping[str, Any]) -> dict[str, OffsetEntry]:
    shards = offset.get("shards")
    if not isinstance(shards, dict):
        raise ValueError(f"not a kinesis source offset: {offset!r}")
    return {str(shard): decode_entry(str(text)) for shard, text in shards.items()}
