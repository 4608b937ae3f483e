"""Where ``kclpy checkpoint set --to`` puts a checkpoint: an operator's position resolved to
the checkpoint a worker resumes right after.

A checkpoint names the last record processed, so every position becomes "the record before
the first one to process next":

- ``TRIM_HORIZON``: the sentinel itself; the shard is read from its oldest record.
- a sequence number: that record (it must be in the shard now: a number from another shard or
  one trimmed by retention is refused, since resuming after it would silently mean
  ``TRIM_HORIZON`` or an error).
- an ISO-8601 time: the last record that arrived before it, so the first record processed
  is the first at or after the time (``AT_TIMESTAMP``'s own definition). Kinesis has no
  "before" iterator, so the record is found by reading forward from ever earlier times.
- ``LATEST``: the time of the command; everything that arrived before it is skipped and
  nothing written after it is (the ``LATEST`` sentinel would instead skip whatever arrives
  until a worker takes the lease).

A KPL aggregate before the time is checkpointed at its last sub-record, so none of its user
records is delivered again.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.exceptions import ClientError

from kclpy.errors import KCLError
from kclpy.position import LATEST, SHARD_END, TRIM_HORIZON, Position
from kclpy.records import Record
from kclpy.retrieval import kpl
from kclpy.retrieval.polling import one_off_pages
from kclpy.retrieval.source import ShardAddress
from kclpy.retry import error_code, is_not_found

#: GetRecords pages one resolution may read before giving up (a shard read end to end)
MAX_PAGES = 10_000
#: the first look-back from a time; doubled until a record before the time is found
FIRST_LOOK_BACK = timedelta(seconds=30)
_SEQUENCE = re.compile(r"^[0-9]{1,128}$")


class PositionError(KCLError, ValueError):
    """The position cannot be used for this shard; the message says why."""


@dataclass(frozen=True)
class Target:
    """The checkpoint to write and, for the operator, what it means."""

    position: Position
    meaning: str

    @property
    def checkpoint(self) -> str:
        return self.position.checkpoint

    @property
    def sub_sequence_number(self) -> int:
        return self.position.sub_sequence_number


@dataclass(frozen=True)
class Destination:
    """``--to`` as parsed: one of the sentinels, a sequence number or a time; resolved
    against a shard (``resolve``) it becomes a checkpoint ``Position``."""

    kind: str  # TRIM_HORIZON, LATEST, SEQUENCE or TIME
    sequence_number: str | None = None
    time: datetime | None = None

    @property
    def names_one_shard(self) -> bool:
        return self.kind == "SEQUENCE"

    def __str__(self) -> str:
        if self.kind == "SEQUENCE":
            return str(self.sequence_number)
        if self.kind == "TIME" and self.time is not None:
            return self.time.isoformat()
        return self.kind


def parse_position(text: str) -> Destination:
    """``--to``'s value; a naive time is UTC. Raises ValueError with the reason."""
    if text in (TRIM_HORIZON, LATEST):
        return Destination(text)
    if _SEQUENCE.match(text):
        return Destination("SEQUENCE", sequence_number=str(int(text)))
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not TRIM_HORIZON, LATEST, a sequence number or an "
                         "ISO-8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return Destination("TIME", time=moment)


class ShardReader:
    """Reads one shard just enough to resolve a position, through retrieval's polling
    source (``one_off_pages``: each call tried once; Kinesis records, aggregates whole)."""

    def __init__(self, kinesis: Any, stream: Mapping[str, str], shard_id: str) -> None:
        self._kinesis = kinesis
        self._address = ShardAddress(shard_id, stream.get("StreamName"), stream.get("StreamARN"))

    def records(self, start: Position) -> Iterator[Record]:
        """The shard's records from ``start`` on, page by page, up to its tip."""
        with contextlib.closing(one_off_pages(self._kinesis, self._address, start)) as pages:
            for read, page in enumerate(pages, 1):
                yield from page.records
                if not page.records and page.millis_behind_latest == 0:
                    return
                if read >= MAX_PAGES:
                    raise PositionError(f"shard {self._address.shard_id}: gave up after "
                                        f"reading {MAX_PAGES} pages")

    def first(self, start: Position) -> Record | None:
        return next(iter(self.records(start)), None)


def _last_sub_sequence(record: Record) -> int:
    """The sub-sequence number of the record's last user record (0 unless an aggregate)."""
    if not kpl.is_aggregated(record):
        return 0
    users = list(kpl.deaggregate([record]).records)
    return max((user.sub_sequence_number for user in users), default=0)


def _describe(record: Record) -> str:
    millis = record.timestamp_millis
    when = "" if millis is None else (
        " (arrived " + datetime.fromtimestamp(millis / 1000, timezone.utc).isoformat(
            timespec="milliseconds") + ")")
    return f"record {record.sequence_number}{when}"


def resolve(reader: ShardReader, position: Destination, *, checkpoint: str,
            now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> Target | None:
    """The checkpoint for ``position`` in the reader's shard; None when the shard has
    nothing at or after the position and its lease is already at ``SHARD_END`` (a finished
    shard is left alone rather than read again)."""
    if position.kind == TRIM_HORIZON:
        return Target(Position.trim_horizon(), "before the shard's oldest record")
    if position.kind == "SEQUENCE":
        assert position.sequence_number is not None
        return _at_sequence(reader, position.sequence_number)
    moment = now() if position.kind == LATEST else position.time
    assert moment is not None
    return _before_time(reader, moment, finished=checkpoint == SHARD_END)


def _at_sequence(reader: ShardReader, sequence_number: str) -> Target:
    record = record_at(reader, sequence_number)
    return Target(Position(sequence_number, _last_sub_sequence(record)),
                  f"after {_describe(record)}")


def _before_time(reader: ShardReader, moment: datetime, *, finished: bool) -> Target | None:
    """The last record that arrived before ``moment``. Arrival times are compared here rather
    than trusted to the iterator, which some emulators position only roughly."""
    cut_ms = round(moment.timestamp() * 1000)
    last, reached = last_before(reader, moment,
                                lambda record: (record.timestamp_millis or 0) >= cut_ms)
    if last is None:
        if finished and not reached:
            return None  # an empty finished shard
        return Target(Position.trim_horizon(), "nothing arrived before " + moment.isoformat())
    if finished and not reached:
        return None
    return Target(Position(last.sequence_number, _last_sub_sequence(last)),
                  f"after {_describe(last)}, the last before {moment.isoformat()}")


def last_before(reader: ShardReader, moment: datetime, is_past: Callable[[Record], bool]
                ) -> tuple[Record | None, bool]:
    """The last record before the first one ``is_past`` accepts (records arrive in sequence
    order, and ``is_past`` must accept every record that arrived at or after ``moment``),
    and whether such a first record was seen at all. Kinesis has no backwards iterator, so
    this reads forward from ever earlier times until a record before it is found."""
    oldest = reader.first(Position.trim_horizon())
    if oldest is None:
        return None, False
    oldest_ms = oldest.timestamp_millis or 0
    look_back = FIRST_LOOK_BACK
    while True:
        since = moment - look_back
        from_oldest = since.timestamp() * 1000 <= oldest_ms
        records = reader.records(Position.trim_horizon() if from_oldest
                                 else Position.at_time(since))
        last: Record | None = None
        reached = False
        for record in records:
            if is_past(record):
                reached = True
                break
            last = record
        if last is not None or from_oldest:
            return last, reached
        look_back *= 2


def record_at(reader: ShardReader, sequence_number: str) -> Record:
    """The shard's record ``sequence_number``; PositionError when the shard has no such
    record now."""
    try:
        record = reader.first(Position(sequence_number))
    except ClientError as exc:
        # AWS says InvalidArgument; kinesis-mock says ResourceNotFound (the stream and shard
        # were found before this is called)
        if error_code(exc) == "InvalidArgumentException" or is_not_found(exc):
            raise PositionError(f"sequence number {sequence_number} is not one of this "
                                "shard's") from None
        raise
    if record is None or record.sequence_number != sequence_number:
        raise PositionError(f"no record {sequence_number} in this shard now (trimmed by "
                            "retention, or never written)")
    return record


def last_sub_sequence(record: Record) -> int:
    """The sub-sequence number of the record's last user record (0 unless an aggregate)."""
    return _last_sub_sequence(record)
