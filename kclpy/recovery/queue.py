"""A shard's recovery queue: the gaps still to read, in order, as the lease item stores them.

A gap starts right after a position (a checkpoint: sequence and sub-sequence number, or
``TRIM_HORIZON``) and ends before a time: it holds the records that arrived before
``end_ms``. An operator's gap (``kclpy recovery add --to SEQ``) also ends at a record,
``last_sequence``: a millisecond holds many records, and the ones after that record are not
the operator's to replay. The live reader of the same shard starts ``AT_TIMESTAMP``
``end_ms`` (a gap the lag detector found), which Kinesis defines as the first record that
arrived at or after it, so recovery and live reading meet without a gap and without an
overlap.

Each gap carries its own checkpoint (``done``), so recovery resumes where it stopped, with
any owner. A new gap is merged with any gap it overlaps (its first record arrived before the
other's end), never replacing it: two outages leave two gaps, or one gap covering both, but
never lose one. Gaps that only touch in time stay two: a record that arrived in the very
millisecond an earlier gap ends belongs to live reading, which may have processed it and
more of that millisecond (a KPL aggregate's records share one arrival) before the next lag
began; one merged gap would start at the earlier gap's checkpoint and read those again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON, Position


@dataclass(frozen=True)
class RecoveryRequest:
    """One gap: records after ``start`` that arrived before ``end_ms``, done through ``done``."""

    #: the live checkpoint the gap starts after (a sequence number or ``TRIM_HORIZON``)
    start: str
    start_sub: int
    #: arrival (epoch ms) of the records where the gap ends: they belong to live reading
    end_ms: int
    #: the gap's first record when it was found: its arrival orders and merges gaps, its
    #: sequence number tells recovery whether the gap's beginning was trimmed meanwhile
    first_ms: int | None
    first_sequence: str | None
    #: the recovery checkpoint: every record of the gap up to here was processed
    done: str
    done_sub: int
    #: arrival of the record at ``done`` (None before the first recovery checkpoint)
    done_ms: int | None = None
    #: the gap's last record (every user record of it), when it ends at a record as well
    #: as before ``end_ms`` (an operator's gap); None: every record before ``end_ms``
    last_sequence: str | None = None

    @classmethod
    def gap(cls, start: str, start_sub: int, end_ms: int, first_ms: int | None,
            first_sequence: str | None, last_sequence: str | None = None) -> RecoveryRequest:
        return cls(start, start_sub, end_ms, first_ms, first_sequence, start, start_sub,
                   last_sequence=last_sequence)

    @property
    def start_position(self) -> Position:
        """Where the gap starts (after), its key in the queue."""
        return Position.of(self.start, self.start_sub)

    @property
    def done_position(self) -> Position:
        return Position.of(self.done, self.done_sub)

    @property
    def started(self) -> bool:
        """Recovery checkpointed inside the gap at least once."""
        return (self.done, self.done_sub) != (self.start, self.start_sub)

    def remaining_ms(self) -> int:
        """How much arrival time of the gap is still ahead of its recovery checkpoint."""
        since = self.done_ms if self.done_ms is not None else self.first_ms
        return max(0, self.end_ms - since) if since is not None else 0

    def checkpointed(self, done: Position, arrival_ms: int | None) -> RecoveryRequest:
        return replace(self, done=done.checkpoint, done_sub=done.sub_sequence_number,
                       done_ms=arrival_ms)

    def overlaps_next(self, later: RecoveryRequest) -> bool:
        """``later`` (which does not start before this gap) begins inside this gap, or right
        after the record it ends at, so the two are one."""
        if later.start_position == self.start_position:
            return True
        if self.last_sequence is not None:
            # ends at a record: ``later`` must start at or before it (a start is a
            # checkpoint, so starting after the last record itself is touching)
            return later.start != TRIM_HORIZON and int(later.start) <= int(self.last_sequence)
        return later.first_ms is not None and later.first_ms < self.end_ms

    def merged(self, later: RecoveryRequest) -> RecoveryRequest:
        """One gap covering both. The earlier start wins with its own checkpoint: everything
        between it and that checkpoint was processed. With the same start, the checkpoint
        further on wins."""
        head = self
        if later.start_position == self.start_position and (
                later.done_position > self.done_position):
            head = later
        end = max(self, later, key=_end)
        return replace(head, end_ms=end.end_ms, last_sequence=end.last_sequence)

    def ends_within(self, end_ms: int, last_sequence: str | None) -> bool:
        """The gap ends where ``end_ms`` / ``last_sequence`` (a gap's end: an operator's
        look at it) ends, or before: it holds none of the records after that end."""
        return _end(self) <= _end_of(end_ms, last_sequence)

    def to_json(self) -> dict[str, object]:
        value: dict[str, object] = {
            "start": self.start, "startSub": self.start_sub, "endMs": self.end_ms,
            "firstMs": self.first_ms, "firstSequence": self.first_sequence,
            "done": self.done, "doneSub": self.done_sub, "doneMs": self.done_ms}
        if self.last_sequence is not None:
            value["lastSequence"] = self.last_sequence
        return value

    @classmethod
    def from_json(cls, value: dict[str, object]) -> RecoveryRequest:
        return cls(start=str(value["start"]), start_sub=_int(value["startSub"]),
                   end_ms=_int(value["endMs"]), first_ms=_opt_int(value.get("firstMs")),
                   first_sequence=_opt_str(value.get("firstSequence")),
                   done=str(value["done"]), done_sub=_int(value["doneSub"]),
                   done_ms=_opt_int(value.get("doneMs")),
                   last_sequence=_opt_str(value.get("lastSequence")))


def _end(request: RecoveryRequest) -> tuple[int, int, int]:
    return _end_of(request.end_ms, request.last_sequence)


def _end_of(end_ms: int, last_sequence: str | None) -> tuple[int, int, int]:
    """Orders gaps' ends: by ``end_ms``; at the same ``end_ms`` a gap ending at a record
    (which arrived before ``end_ms``) ends before one that takes every record arrived
    before it, and of two ending at records the later record ends later."""
    if last_sequence is None:
        return end_ms, 1, 0
    return end_ms, 0, int(last_sequence)


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _opt_int(value: object) -> int | None:
    return None if value is None else _int(value)


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def add(queue: tuple[RecoveryRequest, ...], request: RecoveryRequest
        ) -> tuple[RecoveryRequest, ...]:
    """``queue`` with ``request`` in its place, every overlapping pair merged."""
    ordered = sorted((*queue, request), key=lambda r: r.start_position)
    result: list[RecoveryRequest] = []
    for item in ordered:
        if result and result[-1].overlaps_next(item):
            result[-1] = result[-1].merged(item)
        else:
            result.append(item)
    return tuple(result)


def replayed_from(queue: tuple[RecoveryRequest, ...], position: Position
                  ) -> tuple[RecoveryRequest, ...]:
    """What is left of ``queue`` once the live checkpoint is moved to ``position`` by an
    operator (``kclpy checkpoint set``), whose promise is that reading resumes right after
    it: each gap keeps only the records up to ``position`` it has not processed yet.

    Live reading reads every record after ``position`` again, so a gap that starts at or
    after it, or whose own checkpoint is at or past it, is dropped; a gap that straddles it
    ends there (at that record, or for a time, at that time). Left as it was, a gap's
    progress sent the next tenure's live reading to the gap's end and the gap on after its
    own checkpoint: the records in between were never read again. ``TRIM_HORIZON`` drops
    every gap; ``LATEST`` and ``SHARD_END`` keep the queue (no record before the tip is
    read live, and nothing processed is read again).
    """
    if position.sentinel == TRIM_HORIZON:
        return ()
    if position.sentinel in (LATEST, SHARD_END):
        return queue
    kept: list[RecoveryRequest] = []
    for gap in queue:
        if position.sentinel == AT_TIMESTAMP:
            at = position.timestamp_ms
            if at is None:
                kept.append(gap)
            elif not ((gap.first_ms is not None and gap.first_ms >= at)
                      or (gap.done_ms is not None and gap.done_ms >= at)):
                kept.append(replace(gap, end_ms=min(gap.end_ms, at)))
            continue
        if gap.start_position >= position or gap.done_position >= position:
            continue
        last = position.sequence_number
        if gap.last_sequence is not None and int(gap.last_sequence) < int(last):
            last = gap.last_sequence
        kept.append(replace(gap, last_sequence=last))
    return tuple(kept)


def dumps(queue: tuple[RecoveryRequest, ...]) -> str | None:
    """The lease attribute's value; None for an empty queue (the attribute is removed)."""
    if not queue:
        return None
    return json.dumps({"v": 1, "requests": [r.to_json() for r in queue]},
                      separators=(",", ":"))


def loads(text: str | None) -> tuple[RecoveryRequest, ...]:
    """The queue a lease item stores; an unreadable value raises ValueError, because
    dropping it silently would abandon its gaps."""
    if not text:
        return ()
    try:
        value = json.loads(text)
        requests = value["requests"]
        return tuple(RecoveryRequest.from_json(r) for r in requests)
    except (TypeError, KeyError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: JSON nested too deep to decode is as unreadable as a typo
        raise ValueError(f"unreadable recovery queue {text[:80]!r}: {exc!r}") from None
