"""A position in a shard: the one type every layer names one by (the Java KCL's
``ExtendedSequenceNumber``), and the sentinels, defined once here.

A position is a user record - a sequence number with a sub-sequence number (its place in a
KPL aggregate; 0 for a plain record) - meaning "everything through this record is done",
or a sentinel. ``AT_TIMESTAMP``, ``TRIM_HORIZON`` and ``LATEST`` name no record and sort
before every one, in that order (Java's -3, -2, -1); ``SHARD_END`` sorts after every one.
Where it is known, an ``AT_TIMESTAMP`` position carries its arrival time (epoch ms): reading
starts at the first record that arrived at or after it.

The same value is a lease's checkpoint, what a checkpointer writes, where a pipeline starts
reading (after the record: an aggregate is read again from its start and the sub-records
through the position are dropped), a recovery gap's progress and a Spark offset's entry.
It is written in two ways only: the lease item's ``checkpoint`` and
``checkpointSubSequenceNumber`` attributes (``checkpoint`` / ``sub_sequence_number`` here;
``leases/serializer.py`` writes them, the Java KCL 2.x schema unchanged), and the Spark
offset log's text (``encode`` / ``decode``). Nothing here imports the rest of kclpy, so
every layer can use it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

TRIM_HORIZON = "TRIM_HORIZON"
LATEST = "LATEST"
AT_TIMESTAMP = "AT_TIMESTAMP"
SHARD_END = "SHARD_END"
SENTINELS = frozenset({TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END})
#: where a new lease may start (``initialPositionInStream``), in the order options list them
INITIAL_POSITIONS = (LATEST, TRIM_HORIZON, AT_TIMESTAMP)
#: the kind of a position that names a record, as the Spark offset log spells it
AFTER = "AFTER"

#: ``Position.extended`` of the sentinels: before every record, after every record
_BEFORE_ALL = (-1, 0)
_AFTER_ALL = (2**200, 0)
#: a sentinel's place among positions (a record's is 0)
#: the most digits a sequence number may have: as many as int() reads (positions are ordered
#: by int(), which raises ValueError beyond Python's limit, 4,300 digits by default)
MAX_SEQUENCE_DIGITS = sys.get_int_max_str_digits() or sys.maxsize

_RANK = {AT_TIMESTAMP: -3, TRIM_HORIZON: -2, LATEST: -1, SHARD_END: 1}


class _UserRecord(Protocol):
    @property
    def sequence_number(self) -> str: ...

    @property
    def sub_sequence_number(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Position:
    """A user record (everything through it is done) or a sentinel; ordered, hashable.

    ``sequence_number`` is ASCII digits or one of the sentinels' names: exactly what the
    lease item's ``checkpoint`` attribute holds.
    """

    sequence_number: str
    sub_sequence_number: int = 0
    #: ``AT_TIMESTAMP`` only, when known: the arrival time reading starts at (epoch ms)
    timestamp_ms: int | None = None

    def __post_init__(self) -> None:
        seq = self.sequence_number
        # isdigit() alone accepts other scripts' digits (Arabic-Indic ones), which int()
        # reads but no other KCL could: a lease must only ever hold ASCII sequence numbers.
        if seq not in SENTINELS and not (seq.isascii() and seq.isdigit()):
            raise ValueError(f"not a sequence number or a sentinel: {seq!r}")
        if len(seq) > MAX_SEQUENCE_DIGITS:
            # read as a position, it would fail every comparison later, wherever made
            raise ValueError(f"a sequence number of {len(seq)} digits: more than "
                             f"{MAX_SEQUENCE_DIGITS}, too many to order")
        if self.sub_sequence_number < 0:
            raise ValueError(f"sub-sequence number {self.sub_sequence_number} is negative")
        if self.timestamp_ms is not None and seq != AT_TIMESTAMP:
            raise ValueError(f"only an AT_TIMESTAMP position has a time, not {seq}")

    # -- making one --------------------------------------------------------------------------

    @classmethod
    def of(cls, checkpoint: str | None, sub_sequence_number: int | None = 0) -> Position:
        """The position a lease item stores as ``checkpoint`` and
        ``checkpointSubSequenceNumber`` (either may be absent: Java writes them only when
        set, and an absent checkpoint is ``TRIM_HORIZON``)."""
        return cls(checkpoint if checkpoint is not None else TRIM_HORIZON,
                   sub_sequence_number or 0)

    @classmethod
    def after(cls, record: _UserRecord) -> Position:
        """Everything through ``record`` (a ``Record``, or any user record) is done."""
        return cls(record.sequence_number, record.sub_sequence_number)

    @classmethod
    def trim_horizon(cls) -> Position:
        return cls(TRIM_HORIZON)

    @classmethod
    def latest(cls) -> Position:
        return cls(LATEST)

    @classmethod
    def shard_end(cls) -> Position:
        return cls(SHARD_END)

    @classmethod
    def at_timestamp(cls, timestamp_ms: int | None = None) -> Position:
        return cls(AT_TIMESTAMP, timestamp_ms=timestamp_ms)

    @classmethod
    def at_time(cls, moment: datetime) -> Position:
        """``AT_TIMESTAMP`` at ``moment``, to the nearest millisecond (arrival times are
        whole milliseconds)."""
        return cls(AT_TIMESTAMP, timestamp_ms=round(moment.timestamp() * 1000))

    # -- what it is ---------------------------------------------------------------------------

    @property
    def sentinel(self) -> str | None:
        """The sentinel's name, or None for a record."""
        return self.sequence_number if self.sequence_number in SENTINELS else None

    @property
    def is_record(self) -> bool:
        return self.sequence_number not in SENTINELS

    @property
    def is_shard_end(self) -> bool:
        return self.sequence_number == SHARD_END

    @property
    def kind(self) -> str:
        """``AFTER`` for a record, else the sentinel's name."""
        return AFTER if self.is_record else self.sequence_number

    @property
    def checkpoint(self) -> str:
        """The lease item's ``checkpoint`` attribute for this position."""
        return self.sequence_number

    @property
    def extended(self) -> tuple[int, int]:
        """What a ``Record.extended_sequence_number`` is compared with on the hot path:
        (sequence, sub-sequence) of a record position; a sentinel before every record is
        (-1, 0), ``SHARD_END`` a number larger than any sequence number."""
        if self.is_record:
            return int(self.sequence_number), self.sub_sequence_number
        return _AFTER_ALL if self.sequence_number == SHARD_END else _BEFORE_ALL

    @property
    def moment(self) -> datetime | None:
        """An ``AT_TIMESTAMP`` position's time as Kinesis requests take it."""
        if self.timestamp_ms is None:
            return None
        return datetime.fromtimestamp(self.timestamp_ms / 1000, tz=timezone.utc)

    # -- order (Java's ExtendedSequenceNumber.compareTo) --------------------------------------

    def _key(self) -> tuple[int, int, int, int]:
        if self.is_record:
            return 0, int(self.sequence_number), self.sub_sequence_number, 0
        return _RANK[self.sequence_number], 0, self.sub_sequence_number, self.timestamp_ms or 0

    def __lt__(self, other: Position) -> bool:
        return self._key() < other._key()

    def __le__(self, other: Position) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: Position) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: Position) -> bool:
        return self._key() >= other._key()

    # -- the Spark offset log's text ----------------------------------------------------------

    def encode(self) -> str:
        """The text Spark's offset log keeps, unchanged since the source's first release:
        ``TRIM_HORIZON``, ``AT_TIMESTAMP/<ms>``, ``AFTER/<sequence>/<sub-sequence>`` or
        ``SHARD_END``. ``LATEST`` and a time not yet known have none: an offset must name
        the same records whenever it is read, so the source resolves them to a time first."""
        if self.is_record:
            return f"{AFTER}/{self.sequence_number}/{self.sub_sequence_number}"
        if self.sequence_number == AT_TIMESTAMP and self.timestamp_ms is not None:
            return f"{AT_TIMESTAMP}/{self.timestamp_ms}"
        if self.sequence_number in (TRIM_HORIZON, SHARD_END) and not self.sub_sequence_number:
            return self.sequence_number
        raise ValueError(f"{self!r} has no offset-log form")

    @classmethod
    def decode(cls, text: str) -> Position:
        """The position ``encode`` wrote as ``text``; ValueError for anything else."""
        kind, _, rest = text.partition("/")
        try:
            if kind == AFTER:
                seq, _, sub = rest.partition("/")
                return cls(seq, int(sub))
            if kind == AT_TIMESTAMP:
                return cls(AT_TIMESTAMP, timestamp_ms=int(rest))
            if kind in (TRIM_HORIZON, SHARD_END) and not rest:
                return cls(kind)
        except ValueError as exc:
            raise ValueError(f"not a shard position: {text!r} ({exc})") from None
        raise ValueError(f"not a shard position: {text!r}")

    def __str__(self) -> str:
        if self.is_record:
            return f"{self.sequence_number}/{self.sub_sequence_number}"
        if self.timestamp_ms is not None:
            return f"{AT_TIMESTAMP}/{self.timestamp_ms}"
        return self.sequence_number
