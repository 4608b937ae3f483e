"""Per-shard positions: the Structured Streaming source's offsets.

Spark stores every batch's end offset as JSON in the query's checkpoint and compares offsets
by their JSON text, so an offset here is a plain dict with one short string per shard, keys
sorted: equal positions always serialise the same way.

A position says what has been consumed, never what comes next:

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

from kclpy.records import Record

__all__ = ["Budget", "ShardPosition", "decode_offset", "encode_offset"]

TRIM_HORIZON = "TRIM_HORIZON"
AT_TIMESTAMP = "AT_TIMESTAMP"
AFTER = "AFTER"
SHARD_END = "SHARD_END"
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
    kind: str
    sequence_number: str | None = None
    sub_sequence_number: int = 0
    timestamp_ms: int | None = None
    #: of an UPTO end: its budget, where reading starts and the plan that made it
    budget: Budget | None = None
    start: ShardPosition | None = None
    plan: str | None = None

    def __post_init__(self) -> None:
        if self.kind == AFTER:
            seq = self.sequence_number
            if seq is None or not (seq.isascii() and seq.isdigit()):
                raise ValueError(f"AFTER needs a numeric sequence number, got {seq!r}")
            if self.sub_sequence_number < 0:
                raise ValueError("sub-sequence number must be >= 0")
        elif self.kind == AT_TIMESTAMP:
            if self.timestamp_ms is None:
                raise ValueError("AT_TIMESTAMP needs a timestamp")
        elif self.kind == UPTO:
            if (self.timestamp_ms is None or self.budget is None or self.start is None
                    or not self.plan or not self.plan.isalnum()):
                raise ValueError("UPTO needs a time, a budget, a start and a plan")
            if self.start.kind in (UPTO, SHARD_END):
                raise ValueError(f"UPTO cannot start at {self.start.kind}")
        elif self.kind not in (TRIM_HORIZON, SHARD_END):
            raise ValueError(f"unknown position kind {self.kind!r}")

    @classmethod
    def trim_horizon(cls) -> ShardPosition:
        return cls(TRIM_HORIZON)

    @classmethod
    def shard_end(cls) -> ShardPosition:
        return cls(SHARD_END)

    @classmethod
    def at_timestamp(cls, timestamp_ms: int) -> ShardPosition:
        return cls(AT_TIMESTAMP, timestamp_ms=timestamp_ms)

    @classmethod
    def after(cls, record: Record) -> ShardPosition:
        return cls(AFTER, record.sequence_number, record.sub_sequence_number)

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
        assert self.kind == AFTER and self.sequence_number is not None
        return int(self.sequence_number), self.sub_sequence_number

    def encode(self) -> str:
        if self.kind == AFTER:
            return f"{AFTER}/{self.sequence_number}/{self.sub_sequence_number}"
        if self.kind == AT_TIMESTAMP:
            return f"{AT_TIMESTAMP}/{self.timestamp_ms}"
        if self.kind == UPTO:
            assert self.budget is not None and self.start is not None
            return (f"{UPTO}/{self.timestamp_ms}/{self.budget.encode()}/{self.plan}/"
                    f"{self.start.encode()}")
        return self.kind

    @classmethod
    def decode(cls, text: str) -> ShardPosition:
        kind, _, rest = text.partition("/")
        try:
            if kind == AFTER:
                seq, _, sub = rest.partition("/")
                return cls(AFTER, seq, int(sub))
            if kind == AT_TIMESTAMP:
                return cls(AT_TIMESTAMP, timestamp_ms=int(rest))
            if kind == UPTO:
                until, rows, size, duration, plan, start = rest.split("/", 5)
                return cls.upto(cls.decode(start), int(until),
                                Budget.decode(rows, size, duration), plan)
            if not rest:
                return cls(kind)
        except ValueError as exc:
            raise ValueError(f"not a shard position: {text!r} ({exc})") from None
        raise ValueError(f"not a shard position: {text!r}")


def encode_offset(positions: Mapping[str, ShardPosition]) -> dict[str, Any]:
    return {"shards": {shard: positions[shard].encode() for shard in sorted(positions)}}


def decode_offset(offset: Mapping[str, Any]) -> dict[str, ShardPosition]:
    shards = offset.get("shards")
    if not isinstance(shards, dict):
        raise ValueError(f"not a kinesis source offset: {offset!r}")
    return {str(shard): ShardPosition.decode(str(text)) for shard, text in shards.items()}
