"""The one page type of a shard's read, from the service's answer to the processor.

A GetRecords answer and a SubscribeToShard event carry the same things (records, lag, child
shards at the end), and what the pipeline hands the consumer is that page again with its
records expanded: one type for all of them means a field added for one stage is there for
every stage, and nothing copies a page field by field from one type into the next. A page
is built once by the parse and updated in place by the source that read it; the pipeline
builds one more, around the user records it expanded, on the consumer's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from operator import is_not, itemgetter
from typing import Generic, TypeVar

from kclpy.records import Record, Records, UserRecords, WireRecords

__all__ = ["ChildShard", "Page"]

#: what a page's records are: the Kinesis records as read (KPL aggregates whole), or
#: ``kclpy.records.Records``, the user records the pipeline expanded them into
R = TypeVar("R", bound=Sequence[Record])


@dataclass(frozen=True, slots=True)
class ChildShard:
    """A shard that continues a closed one; GetRecords names them once the parent is read."""

    shard_id: str
    parent_shards: tuple[str, ...]
    starting_hash_key: str
    ending_hash_key: str


@dataclass(slots=True)
class Page(Generic[R]):
    """One page of a shard: what the service answered, what the source made of it, and -
    once the pipeline expanded it - what the processor is handed."""

    #: in order: Kinesis records as read, or the user records expanded from them
    #: (de-aggregated, filtered, strictly after the resume point)
    records: R
    millis_behind_latest: int | None
    #: the shard (or the bounded range being read) has nothing after this page
    shard_end: bool = False
    #: the children named by the final page (empty before shard end)
    child_shards: Sequence[ChildShard] = ()
    #: millis_behind_latest == 0, or unknown and the page was empty
    caught_up: bool = False
    #: the page came back with no records and not behind: the tip, which is decided only
    #: by the source - never from ``millis_behind_latest`` alone, since kinesis-mock reports
    #: 0 on a page that ends inside the last PutRecords batch while records remain
    at_tip: bool = False
    #: a bounded read met a record that arrived at or after its end: the rest of the shard
    #: is for a later read (``records`` stop before that record)
    bound_reached: bool = False
    #: the shard itself has nothing after this page (no next iterator, no continuation),
    #: which a bounded read's ``shard_end`` alone does not say
    shard_closed: bool = False
    #: GetRecords: the iterator of the next call (None once the shard is closed)
    next_shard_iterator: str | None = None
    #: SubscribeToShard: where the next subscription continues (None at shard end)
    continuation_sequence_number: str | None = None
    #: bytes of the answer the page was parsed from (0 when none was parsed here)
    size_bytes: int = 0

    def within(self: Page[Sequence[Record]], until_ms: int | None,
               kinesis_ms: int | None = None) -> Page[Sequence[Record]]:
        """The page as a read bounded by ``until_ms`` (epoch ms) sees it: the read ends, as
        at a shard end, before the first record that arrived at or after the bound, or at
        the tip once Kinesis' time has passed the bound. The same for every source, so a
        bounded read (a recovery gap, a Spark batch) ends at the same record whichever mode
        read it.

        ``kinesis_ms`` is a lower bound of Kinesis' time when the page was asked for
        (:mod:`kclpy.retrieval.clock`). The tip only says that every record that had
        arrived by then was read: with the bound still in Kinesis' future, records that
        arrive later belong to the range, so the read stays open (the page stays at the
        tip, not at an end) and looks again. None (nothing known) keeps the range open.
        """
        if until_ms is None:
            return self
        kept = _arrived_before(self.records, until_ms)
        reached = len(kept) < len(self.records)
        passed = self.at_tip and kinesis_ms is not None and kinesis_ms >= until_ms
        if not (reached or passed):
            return self
        return replace(self, records=kept, shard_end=True, child_shards=(),
                       bound_reached=reached)


def _arrived_before(records: Sequence[Record], until_ms: int) -> Sequence[Record]:
    """The leading records that arrived before ``until_ms``: sequence numbers and arrival
    times grow together within a shard, so the first one at or after it ends the range.

    Every page of a bounded read (each Spark task's) passes through here, and a page that
    ends before the bound is the common case: a run of wire rows or of an aggregate's user
    records whose latest arrival is before it is kept whole, its arrivals read in C, and
    records are built only in the run that holds the bound."""
    start = 0
    if isinstance(records, Records | WireRecords | UserRecords):
        for part in records.parts if isinstance(records, Records) else (records,):
            latest = _latest_arrival_ms(part)
            if latest is not None and latest >= until_ms:
                break
            start += len(part)
        else:
            return records
    for index, record in enumerate(records[start:], start):
        arrived = record.timestamp_millis
        if arrived is not None and arrived >= until_ms:
            return records[:index]
    return records


def _latest_arrival_ms(part: Sequence[Record]) -> int | None:
    """The latest arrival in a run, as ``timestamp_millis`` rounds it (None: none has one).
    Rounding is monotonic, so no record of a run whose latest arrival is before a bound
    reaches it."""
    seconds: float | None
    if isinstance(part, WireRecords):
        seconds = max(filter(_known, map(_arrival_s, part.rows)), default=None)
    elif isinstance(part, UserRecords):
        seconds = part.arrival_s
    else:
        return max((ms for ms in (r.timestamp_millis for r in part) if ms is not None),
                   default=None)
    return None if seconds is None else round(seconds * 1000)


_arrival_s = itemgetter(3)
_known = partial(is_not, None)
