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

- ``UPTO/<until ms>/<rows>/<bytes>/<ms>/<plan>/<start>``: from ``start``, the records that
  arrived before ``until``, stopping once ``rows`` user records, ``bytes`` of payload or
  ``ms`` of reading are reached (``-``: no such budget). ``plan`` makes each planned end
  distinct. The executor that reads it records the concrete position it reached
  (:mod:`kclpy.spark.metadata`); rows and bytes alone make that position a function of the
  end, so it can also be found again by reading, while a time budget needs the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kclpy.position import AFTER, AT_TIMESTAMP, SHARD_END, TRIM_HORIZON, Position
from kclpy.records import Record

__all__ = ["AFTER", "AT_TIMESTAMP", "SHARD_END", "TRIM_HORIZON", "UPTO", "Budget",
           "ShardPosition", "decode_offset", "encode_offset"]

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
class ShardPosition:
    """One shard's entry in an offset: a ``Position`` (``position``; its kind, sequence,
    sub-sequence and time are its own) or an ``UPTO`` end, which is not a position yet but
    the rule that finds one (a budget from a start)."""

    kind: str
    sequence_number: str | None = None
    sub_sequence_number: int = 0
    timestamp_ms: int | None = None
    #: of an UPTO end: its budget, where reading starts and the plan that made it
    budget: Budget | None = None
    start: ShardPosition | None = None
    plan: str | None = None

    def __post_init__(self) -> None:
        if self.kind == UPTO:
            if (self.timestamp_ms is None or self.budget is None or self.start is None
                    or not self.plan or not self.plan.isalnum()):
                raise ValueError("UPTO needs a time, a budget, a start and a plan")
            if self.start.kind in (UPTO, SHARD_END):
                raise ValueError(f"UPTO cannot start at {self.start.kind}")
        elif self.kind not in (TRIM_HORIZON, AT_TIMESTAMP, AFTER, SHARD_END):
            raise ValueError(f"unknown position kind {self.kind!r}")
        else:
            self.position.encode()  # raises when the position has no offset-log form

    @property
    def position(self) -> Position:
        """The position this entry names (not for an ``UPTO`` end)."""
        if self.kind == UPTO:
            raise ValueError("an UPTO end names no position until it is read")
        if self.kind == AFTER:
            if self.sequence_number is None:
                raise ValueError("AFTER needs a sequence number")
            return Position(self.sequence_number, self.sub_sequence_number)
        return Position(self.kind, timestamp_ms=self.timestamp_ms)

    @classmethod
    def of(cls, position: Position) -> ShardPosition:
        return cls(position.kind, position.sequence_number if position.is_record else None,
                   position.sub_sequence_number, position.timestamp_ms)

    @classmethod
    def trim_horizon(cls) -> ShardPosition:
        return cls.of(Position.trim_horizon())

    @classmethod
    def shard_end(cls) -> ShardPosition:
        return cls.of(Position.shard_end())

    @classmethod
    def at_timestamp(cls, timestamp_ms: int) -> ShardPosition:
        return cls.of(Position.at_timestamp(timestamp_ms))

    @classmethod
    def after(cls, record: Record) -> ShardPosition:
        return cls.of(Position.after(record))

    @classmethod
    def upto(cls, start: ShardPosition, until_ms: int, budget: Budget,
             plan: str) -> ShardPosition:
        return cls(UPTO, timestamp_ms=until_ms, budget=budget, start=start, plan=plan)

    @property
    def is_budgeted(self) -> bool:
        """An end found only by reading (see the module's docstring)."""
        return self.kind == UPTO

    @property
    def is_shard_end(self) -> bool:
        return self.kind == SHARD_END

    @property
    def extended(self) -> tuple[int, int]:
        """(sequence, sub-sequence) of an AFTER position, for comparing with records."""
        assert self.kind == AFTER
        return self.position.extended

    def encode(self) -> str:
        if self.kind == UPTO:
            assert self.budget is not None and self.start is not None
            return (f"{UPTO}/{self.timestamp_ms}/{self.budget.encode()}/{self.plan}/"
                    f"{self.start.encode()}")
        return self.position.encode()

    @classmethod
    def decode(cls, text: str) -> ShardPosition:
        kind, _, rest = text.partition("/")
        if kind != UPTO:
            return cls.of(Position.decode(text))
        try:
            until, rows, size, duration, plan, start = rest.split("/", 5)
            return cls.upto(cls.decode(start), int(until),
                            Budget.decode(rows, size, duration), plan)
        except ValueError as exc:
            raise ValueError(f"not a shard position: {text!r} ({exc})") from None


def encode_offset(positions: Mapping[str, ShardPosition]) -> dict[str, Any]:
    return {"shards": {shard: positions[shard].encode() for shard in sorted(positions)}}


def decode_offset(offset: Mapping[str, Any]) -> dict[str, ShardPosition]:
    shards = offset.get("shards")
    if not isinstance(shards, dict):
        raise ValueError(f"not a kinesis source offset: {offset!r}")
    return {str(shard): ShardPosition.decode(str(text)) for shard, text in shards.items()}
