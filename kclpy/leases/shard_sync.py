"""Shard sync: one lease per shard that needs processing, created before anyone needs it.

Which shards get a lease, and where a new lease starts (the Java KCL
``HierarchicalShardSyncer`` rules, applied to every generation of the shard tree at once):

- A shard that descends from a *handled* shard - one that has a lease, is an ancestor of a
  shard that has one, or gets one in this same sync - gets a lease at ``TRIM_HORIZON``
  (``AT_TIMESTAMP`` when that is the initial position, as Java does), so nothing written
  after its parent closed is skipped. Its consumer waits for the parents to finish first.
- Otherwise, with ``TRIM_HORIZON`` or ``AT_TIMESTAMP`` every shard gets a lease at the
  initial position; with ``LATEST`` only open shards do (at ``LATEST``) and closed roots are
  ignored, since their data is older than "now".
- An ancestor that a leased shard vouches for never gets a lease: its data was processed
  already (its lease may have been cleaned up) or deliberately skipped. A lease vouches for
  the parents its ``kclpyFinishedParents`` names (each parent's holder adds its shard there
  at its shard end, before its lease can be cleaned up); a lease without that attribute
  (made by the Java KCL, by an older kclpy, or by shard sync on an endpoint without
  ``ChildShards``) vouches for every parent once it has progressed past its start, and for
  none before: lease cleanup deletes a parent only after every child progressed, so a
  parent missing beside an unprogressed child was deleted unfinished (a lease table reset
  while the fleet ran). A parent vouched for vouches for all of its own ancestors. The Java
  KCL counts every ancestor of a leased shard as handled, so a merge parent a reset deleted
  before it finished is never read again once its child has a lease: its records after its
  checkpoint are lost (simulator seed 400). kclpy creates it again like any unhandled shard;
  its child may then be processed before it (the child's consumer, as Java's, takes a parent
  without a lease for finished), so order across that merge is not kept, but no record is
  lost.

A stream deleted and created again under the same name, with the lease table kept, lists
shard ids its former incarnation had leases for; those leases would hide the new shards (a
``SHARD_END`` lease is never read again, a sequence-number checkpoint points into a stream
that is gone). A lease is of a former incarnation when kclpy made it for a stream created at
another second (a lease's incarnation names its stream's creation second), when it is at
``SHARD_END`` while its shard is open (a closed shard never reopens), or when its checkpoint
lies before the shard's first sequence number (every record of a shard is at or after it).
Such a lease is deleted (read again and conditional on its counter, so a lease that moved
meanwhile is left alone) and created anew like any lease of a new shard, at the initial
position, with a WARNING. Leases that were never checkpointed need no replacing: they start
where a new lease would.

A shard whose data the stream's retention trimmed away leaves ``ListShards``; a closed
shard does so once its last record is older than the retention period. If its lease was not
at ``SHARD_END`` by then (the application was stopped, or the shard stalled, for longer than
the retention period), no worker would ever take it (only listed shards are taken) and its
children would wait for it for ever. Such a lease is *aged out*: not at ``SHARD_END``, not
parked, its shard absent from the listing, and its shard named as a parent by a listed shard
(or by the lease of another aged-out shard). It is deleted, as the Java KCL's lease cleanup
deletes a "garbage" lease, and its children start: what it still held is lost to retention,
which is logged at ERROR and counted in ``kclpy_data_lost_to_retention_total``. Never on one
listing alone: the lease is read again, then the stream is listed again, and only a shard
still absent and still named is deleted (conditional on the counter just read), ancestors
first. A child that a ListShards answer does not show yet (its lease made from
``ChildShards``) is never named by a listed shard, and a stream deleted (not listed) or
created again (its listed shards name only its own parents) gives no such evidence.

Java creates only the first generation below the handled shards and leaves the rest to the
``ChildShards`` that GetRecords returns at shard end. Creating every generation in one pass
gives the same result and also works on emulators that never return ``ChildShards``
(moto, kinesalite). Leases are created parents first, so a sync that fails half way never
leaves a child whose missing parent would later look like an already-processed ancestor.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kclpy.consumer import report_lost_to_retention
from kclpy.errors import ConfigError, LeaseLostError
from kclpy.leases.cleanup import has_progressed
from kclpy.leases.lease import Lease, new_incarnation, other_streams
from kclpy.leases.table import LeaseTable
from kclpy.metrics import NOWHERE, THROTTLES, Metrics
from kclpy.position import (
    AT_TIMESTAMP,
    INITIAL_POSITIONS,
    LATEST,
    TRIM_HORIZON,
    Position,
)
from kclpy.retry import GaveUp, RetryPolicy, is_throttle, retrying
from kclpy.streams import multi_stream_lease_key

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    shard_id: str
    parent_shard_id: str | None
    adjacent_parent_shard_id: str | None
    starting_hash_key: str
    ending_hash_key: str
    starting_sequence_number: str
    ending_sequence_number: str | None

    @classmethod
    def from_response(cls, shard: Mapping[str, Any]) -> Shard:
        """From one entry of a ListShards ``Shards`` list."""
        hash_range = shard["HashKeyRange"]
        sequence_range = shard["SequenceNumberRange"]
        return cls(
            shard_id=shard["ShardId"],
            parent_shard_id=shard.get("ParentShardId"),
            adjacent_parent_shard_id=shard.get("AdjacentParentShardId"),
            starting_hash_key=hash_range["StartingHashKey"],
            ending_hash_key=hash_range["EndingHashKey"],
            starting_sequence_number=sequence_range["StartingSequenceNumber"],
            ending_sequence_number=sequence_range.get("EndingSequenceNumber"),
        )

    @property
    def is_open(self) -> bool:
        return self.ending_sequence_number is None

    @property
    def parent_ids(self) -> tuple[str, ...]:
        return tuple(p for p in (self.parent_shard_id, self.adjacent_parent_shard_id) if p)


class ChildShardLike(Protocol):
    """A child shard as GetRecords names it at shard end (``kclpy.retrieval`` parses it)."""

    @property
    def shard_id(self) -> str: ...

    @property
    def parent_shards(self) -> Sequence[str]: ...

    @property
    def starting_hash_key(self) -> str | None: ...

    @property
    def ending_hash_key(self) -> str | None: ...


#: the reason ``former_incarnation`` gives for a finished lease of a listed open shard: it
#: needs a second listing, taken after the lease was read, to tell a shard that closed
#: between the listing and the read (a split or merge just then) from a former stream's
SHARD_END_BUT_OPEN = "it is at SHARD_END but the shard is open"


def former_incarnation(lease: Lease, shard: Shard,
                       stream_epoch: float | None = None) -> str | None:
    """Why ``lease`` cannot be a lease of the listed ``shard`` (it is of a former stream of
    the same name), or None: created by kclpy for a stream created at another time than
    the listed one (``stream_epoch``, seconds; the lease's incarnation holds its own,
    compared as ``same_stream`` says),
    a checkpoint before the shard's first sequence number, or a finished lease of an open
    shard (see ``SHARD_END_BUT_OPEN``). The sequence numbers alone do not always tell: an
    endpoint may number a new stream's shard below the old one's checkpoint. An end beyond
    the shard's ending sequence number is not used: moto lists a closed shard ending at 0
    while its records go on."""
    created = lease.stream_epoch
    if other_streams(created, stream_epoch):
        return (f"it was created for a stream created at epoch {created}, and this one was "
                f"created at {stream_epoch}")
    if lease.is_shard_end and shard.is_open:
        return SHARD_END_BUT_OPEN
    checkpoint = lease.checkpoint.sequence_number
    if lease.checkpoint.is_record and int(checkpoint) < int(shard.starting_sequence_number):
        return (f"its checkpoint {checkpoint} is before the shard's first sequence number "
                f"{shard.starting_sequence_number}")
    return None


def _depths(by_id: Mapping[str, Shard]) -> dict[str, int]:
    """Generation of each listed shard (0 for shards without listed parents); iterative
    because a long-lived stream may have been resharded many times."""
    depth: dict[str, int] = {}
    for start in by_id:
        stack = [start]
        while stack:
            shard_id = stack[-1]
            if shard_id in depth:
                stack.pop()
                continue
            parents = [p for p in by_id[shard_id].parent_ids if p in by_id]
            pending = [p for p in parents if p not in depth]
            if pending:
                stack.extend(pending)
                continue
            depth[shard_id] = 1 + max((depth[p] for p in parents), default=-1)
            stack.pop()
    return depth


def aged_out(shards: Iterable[Shard], leases: Iterable[Lease],
             lease_key: Callable[[str], str]) -> dict[str, Lease]:
    """The leases of shards the stream's retention removed before they were finished
    (module docstring), by lease key, ancestors before descendants; with them the finished
    leases of those shards' unlisted ancestors, which lease cleanup would otherwise keep for
    ever (it deletes a finished lease only once every child's lease has progressed, and
    these children's leases are about to go).

    ``leases`` may hold other streams' leases: only those whose key ``lease_key`` gives to
    a shard named as a parent are considered. Evidence comes from the listing alone: a
    listed shard naming an unlisted parent (or an aged-out lease naming one) says that
    parent existed in this stream and is gone, and a closed shard leaves ``ListShards`` only
    when its records are past the retention period."""
    listed = {lease_key(shard.shard_id) for shard in shards}
    by_key = {lease.lease_key: lease for lease in leases}

    def unlisted(key: str) -> Lease | None:
        lease = by_key.get(key)
        # A parked lease stays the operator's decision.
        return None if key in listed or lease is None or lease.parked else lease

    #: lease keys of the parents named by listed shards, then by aged-out leases
    named = [lease_key(parent) for shard in shards for parent in shard.parent_ids]
    found: dict[str, Lease] = {}
    while named:
        key = named.pop()
        lease = unlisted(key)
        if key in found or lease is None or lease.is_shard_end:
            # A finished lease that only listed shards name blocks nobody: lease cleanup
            # deletes it once its children progressed.
            continue
        found[key] = lease
        named.extend(lease.parent_lease_keys)
    above = [parent for lease in found.values() for parent in lease.parent_lease_keys]
    while above:
        key = above.pop()
        lease = unlisted(key)
        if key in found or lease is None:
            continue
        found[key] = lease
        above.extend(lease.parent_lease_keys)
    return {key: found[key] for key in _ancestors_first(found)}


def _ancestors_first(leases: Mapping[str, Lease]) -> list[str]:
    """The keys of ``leases``, each after every one of its ancestors among them."""
    order: list[str] = []
    placed: set[str] = set()
    for start in sorted(leases):
        stack = [start]
        while stack:
            key = stack[-1]
            if key in placed:
                stack.pop()
                continue
            pending = [p for p in sorted(leases[key].parent_lease_keys)
                       if p in leases and p not in placed and p not in stack]
            if pending:
                stack.extend(pending)
                continue
            placed.add(key)
            order.append(key)
            stack.pop()
    return order


def _new_lease(shard: Shard, checkpoint: str, stream: str | None) -> Lease:
    return Lease(
        lease_key=shard.shard_id if stream is None else multi_stream_lease_key(
            stream, shard.shard_id),
        checkpoint=Position(checkpoint),
        parent_shard_ids=frozenset(shard.parent_ids),
        starting_hash_key=shard.starting_hash_key,
        ending_hash_key=shard.ending_hash_key,
        stream=stream,
    )


def refuse_another_streams_table(leases: Iterable[Lease], stream: str, table: str) -> None:
    """Refuse, before anything is written, a single-stream table whose leases kclpy made for
    another stream: an application name reused for another stream. Its leases would look
    like a former incarnation of this stream, be replaced (their checkpoints lost) and left
    unrenewed. A lease without the name (Java's, or kclpy's before it wrote the name) cannot
    tell; a stream deleted and created again under the same name passes, and its former
    leases are replaced as before."""
    others = sorted({lease.stream_name for lease in leases
                     if lease.stream_name is not None and lease.stream_name != stream})
    if others:
        raise ConfigError(
            "application_name",
            f"the lease table {table!r} holds the leases of stream {others[0]!r}, not of "
            f"{stream!r}: another application uses this name; give this one its own "
            "application name (or --table-name)")


def shard_ids_of(lease_keys: Iterable[str], stream: str | None) -> set[str]:
    """The shards of ``stream`` (a serialised identifier, None for a single-stream table)
    among lease keys of a table that may hold other streams' leases too."""
    if stream is None:
        return set(lease_keys)
    prefix = stream + ":"
    return {key[len(prefix):] for key in lease_keys if key.startswith(prefix)}


def _lease_key(shard_id: str, stream: str | None) -> str:
    return shard_id if stream is None else multi_stream_lease_key(stream, shard_id)


def _epoch_of(stream: str) -> int | None:
    """The creation epoch of a serialised stream identifier (``account:name:epoch``)."""
    epoch = stream.rpartition(":")[2]
    return int(epoch) if epoch.isdigit() else None


def vouched_parents(shard: Shard, lease: Lease | None) -> tuple[str, ...]:
    """The parents of ``shard`` that its lease shows finished, whether or not they still
    have leases (module docstring). ``lease`` None (its content not known, only its key; or
    the shard has no lease and was itself vouched for by a child): every parent."""
    if lease is None:
        return shard.parent_ids
    if lease.finished_parents:
        return tuple(p for p in shard.parent_ids if p in lease.finished_parents)
    return shard.parent_ids if has_progressed(lease) else ()


def _relies_on_parents(planned: Iterable[Lease], shards: Iterable[Shard]) -> bool:
    """Whether a planned lease has a listed parent that is not planned too: the plan counted
    that parent as handled on the view of the table it was given (``ShardSyncer.sync``)."""
    planned_ids = {lease.lease_key.rpartition(":")[2]: lease for lease in planned}
    listed = {shard.shard_id for shard in shards}
    return any(parent in listed and parent not in planned_ids
               for lease in planned_ids.values() for parent in lease.parent_shard_ids)


def plan_new_leases(
    shards: Iterable[Shard], existing_lease_keys: Collection[str], initial_position: str,
    stream: str | None = None, leases: Mapping[str, Lease] | None = None,
) -> list[Lease]:
    """The leases a sync must create (rules in the module docstring), parents first.
    ``leases`` (by lease key) are the existing leases themselves: without them a leased
    shard vouches for all its ancestors, as in the Java KCL."""
    by_id = {shard.shard_id: shard for shard in shards}
    handled = shard_ids_of(existing_lease_keys, stream)
    leased = frozenset(handled)
    stack = [key for key in handled if key in by_id]
    while stack:
        shard_id = stack.pop()
        lease = (None if leases is None or shard_id not in leased
                 else leases.get(_lease_key(shard_id, stream)))
        for parent in vouched_parents(by_id[shard_id], lease):
            if parent in by_id and parent not in handled:
                handled.add(parent)
                stack.append(parent)
    depth = _depths(by_id)
    ordered = sorted(
        by_id.values(),
        key=lambda s: (depth[s.shard_id], int(s.starting_sequence_number), s.shard_id),
    )
    descendant_start = AT_TIMESTAMP if initial_position == AT_TIMESTAMP else TRIM_HORIZON
    planned: list[Lease] = []
    for shard in ordered:
        if shard.shard_id in handled:
            continue
        if any(parent in handled for parent in shard.parent_ids):
            checkpoint = descendant_start
        elif initial_position != LATEST:
            checkpoint = initial_position
        elif shard.is_open:
            checkpoint = LATEST
        else:
            continue
        planned.append(_new_lease(shard, checkpoint, stream))
        handled.add(shard.shard_id)
    return planned


@dataclass(frozen=True)
class SyncedStream:
    """The stream a ``ShardSyncer`` keeps leases for, as both sides name it: Kinesis (by
    ARN when there is one, else by name) and the lease table (single-stream leases carry its
    name, multi-stream keys start with its identifier, each new lease's incarnation its
    creation time). The four are one stream's: they come from one look-up of it
    (``leases/streams.py``) or from one operator's flags, and never vary apart."""

    name: str | None = None
    arn: str | None = None
    #: the serialised stream identifier multi-stream lease keys start with
    #: (``kclpy.streams``); None: single-stream keys, the bare shard id
    identifier: str | None = None
    #: the stream's creation time (seconds, to the millisecond when known); None: the
    #: identifier's epoch, if there is one
    epoch: float | None = None

    def __post_init__(self) -> None:
        if self.name is None and self.arn is None:
            raise ConfigError("stream_name", "a stream name or ARN is required")


#: how ListShards is retried unless the caller says otherwise: the defaults of
#: ``listShardsBackoffTimeInMillis``, its cap and ``maxListShardsRetryAttempts``
LIST_SHARDS_RETRIES = RetryPolicy(0.2, 5.0, max_attempts=6)


class ShardSyncer:
    """Lists the stream's shards and creates the leases that are missing. Safe to run on
    every worker at once: creation is conditional on absence. A ``stream`` with an
    identifier keys the leases the multi-stream way (``kclpy.streams``)."""

    def __init__(
        self,
        kinesis: KinesisClient,
        table: LeaseTable,
        stream: SyncedStream,
        *,
        initial_position: str = LATEST,
        metrics: Metrics | None = None,
        page_size: int | None = None,
        retries: RetryPolicy = LIST_SHARDS_RETRIES,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if initial_position not in INITIAL_POSITIONS:
            raise ConfigError(
                "initial_position",
                f"{initial_position!r} is not one of {', '.join(INITIAL_POSITIONS)}",
            )
        self._kinesis = kinesis
        self._table = table
        self._stream: dict[str, str] = (
            {"StreamARN": stream.arn}
            if stream.arn is not None
            else {"StreamName": str(stream.name)}
        )
        self.initial_position = initial_position
        #: the serialised stream identifier of multi-stream lease keys (None: single-stream)
        self.stream = stream.identifier
        #: the name written on single-stream leases (``Lease.stream_name``)
        self.stream_label = (str(stream.name) if stream.arn is None
                             else stream.arn.rpartition("/")[2])
        #: the stream's creation time (seconds, to the millisecond when known), written into
        #: each new lease's incarnation
        self.stream_epoch = (
            stream.epoch if stream.epoch is not None or stream.identifier is None
            else _epoch_of(stream.identifier))
        self._metrics = metrics if metrics is not None else NOWHERE
        self._page: dict[str, int] = {} if page_size is None else {"MaxResults": page_size}
        self._retries = retries
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._known: frozenset[str] = frozenset()

    @property
    def _single_stream_name(self) -> str | None:
        return self.stream_label if self.stream is None else None

    @property
    def known_shard_ids(self) -> frozenset[str]:
        """Shards of the last listing, plus children created since (empty before a sync)."""
        return self._known

    @property
    def known_lease_keys(self) -> frozenset[str]:
        """The lease keys of ``known_shard_ids``."""
        return frozenset(self.lease_key(shard_id) for shard_id in self._known)

    def lease_key(self, shard_id: str) -> str:
        return shard_id if self.stream is None else multi_stream_lease_key(self.stream, shard_id)

    def _list_page(self, params: dict[str, Any]) -> dict[str, Any]:
        def throttled(exc: BaseException) -> bool:
            if not is_throttle(exc):
                return False
            self._metrics.inc(THROTTLES, "ListShards")
            return True

        try:
            return retrying(lambda: dict(self._kinesis.list_shards(**params)), self._retries,
                            retry_on=throttled, wait=self._sleep, rng=self._rng)
        except GaveUp as gave_up:
            raise gave_up.last from None

    def list_shards(self) -> list[Shard]:
        """Every shard of the stream, following NextToken the way AWS requires: the stream
        is named on the first call only."""
        response = self._list_page({**self._stream, **self._page})
        shards = [Shard.from_response(s) for s in response.get("Shards", [])]
        while token := response.get("NextToken"):
            response = self._list_page({"NextToken": token, **self._page})
            shards.extend(Shard.from_response(s) for s in response.get("Shards", []))
        return shards

    def sync(self, existing: Collection[str] | None = None,
             leases: Iterable[Lease] | None = None) -> list[Lease]:
        """Create the leases that are missing; returns those this call created.

        ``leases`` (the same scan's leases) lets a lease of a former stream of the same name
        be found and replaced (module docstring); without ``existing`` the table is scanned
        for both.

        ``existing`` are the lease keys of a recent scan (the lease taker's, up to two
        failover times old), which saves scanning the table again as long as the sync has
        nothing to create. A stale view may lack leases created since, which is harmless
        (creation is conditional), but it may also show leases a lease-table reset deleted
        since, unfinished: counted as handled, a merge's parents were left without leases
        and the sync created their child's lease alone, their records never read (simulator
        seed 260, with a leader, whose pass's scan is the only one the sync gets). So a sync
        that would create a lease below a listed shard it does not create (one the view says
        is handled) plans again on a scan of its own first: new child shards are rare, a
        reset rarer, and the plan then judges the table as it is.
        """
        shards = self.list_shards()
        self._known = frozenset(shard.shard_id for shard in shards)
        fresh = existing is None
        if existing is None:
            leases = self._table.list_leases()
            existing = {lease.lease_key for lease in leases}
        leases = None if leases is None else list(leases)
        planned = self._plan(shards, existing, leases)
        if not fresh and _relies_on_parents(planned, shards):
            leases = self._table.list_leases()
            planned = self._plan(shards, {lease.lease_key for lease in leases}, leases)
        created = [
            lease
            for lease in (new.copy(incarnation=new_incarnation(self.stream_epoch),
                                   stream_name=self._single_stream_name)
                          for new in planned)
            if self._table.create(lease)
        ]
        if created:
            log.info(
                "shard sync created leases: %s",
                ", ".join(f"{lease.lease_key}@{lease.checkpoint}" for lease in created),
            )
        if leases is not None:
            # After the creations: a child missing a lease was just given one at
            # TRIM_HORIZON, as a descendant of the lease about to go.
            self._delete_aged_out(shards, leases)
        return created

    def _plan(self, shards: Sequence[Shard], existing: Collection[str],
              leases: list[Lease] | None) -> list[Lease]:
        """The leases to create on this view of the table, once the leases of a former
        stream of the same name that hide listed shards are deleted (they are planned anew)."""
        if leases is not None:
            if self.stream is None:
                refuse_another_streams_table(leases, self.stream_label, self._table.table_name)
            existing = set(existing) - self._retire_former(shards, leases)
        known = None if leases is None else {
            lease.lease_key: lease for lease in leases if lease.lease_key in existing}
        return plan_new_leases(shards, existing, self.initial_position, self.stream, known)

    def _delete_aged_out(self, shards: Sequence[Shard], leases: Iterable[Lease]) -> None:
        """Delete the leases of shards the retention removed unfinished (``aged_out``), so
        their children start; the records they still held are lost, logged and counted.

        A lease is judged on two listings and a read between them: the sync's listing
        names it, the lease is read again (a lease finished or parked meanwhile is kept),
        and a listing made after that read must still name it. Deleting is conditional
        on the counter read, so a write in between keeps the lease until the next sync.
        A lease whose aged-out parent's lease is still there waits for it: deleting from
        the top down keeps the descendants naming the rest. Relies on ``list_shards``
        returning every page or raising: a listing cut short without an error, twice in a
        row, would look like shards gone."""
        candidates = aged_out(shards, leases, self.lease_key)
        if not candidates:
            return
        fresh = {key: lease for key in candidates
                 if (lease := self._table.get(key)) is not None}
        confirmed = aged_out(self.list_shards(), fresh.values(), self.lease_key)
        #: confirmed and not deleted (yet): their descendants wait
        remaining = set(confirmed)
        for key, lease in confirmed.items():
            if any(parent in remaining for parent in lease.parent_lease_keys):
                continue  # its aged-out parent could not be deleted: next sync
            if not self._table.delete(lease):
                continue
            remaining.discard(key)
            if lease.is_shard_end:
                log.info("deleted the lease of finished shard %s, an ancestor of shards "
                         "the stream's retention removed unfinished", key)
                continue
            children = {self.lease_key(s.shard_id) for s in shards
                        if lease.shard_id in s.parent_ids} | {
                child for child, aged in confirmed.items() if key in aged.parent_lease_keys}
            report_lost_to_retention(self._metrics, key, lease.checkpoint, children,
                                     "Its lease is deleted")

    def left_unfinished(self, lease_key: str) -> frozenset[str] | None:
        """The lease keys of the children of ``lease_key``'s shard when that shard left the
        stream before its lease was finished, judged as ``_delete_aged_out`` judges it (a
        listing, a read of the lease, a second listing; the lease named by a listed child
        in both); None when it did not, or when only its aged-out children could tell.

        Asked by the lease's holder once Kinesis answered that the shard is not found, so
        that it ends the shard at once instead of leaving it to the next shard sync: its
        children lose their oldest records to the same retention while they wait. The
        listings, not that answer, are the evidence: a stream deleted or created again
        answers not found too, and never lists a child naming the shard."""
        lease = self._table.get(lease_key)
        if lease is None or lease_key not in aged_out(self.list_shards(), [lease],
                                                      self.lease_key):
            return None
        shards = self.list_shards()
        if lease_key not in aged_out(shards, [lease], self.lease_key):
            return None
        return frozenset(self.lease_key(s.shard_id) for s in shards
                         if lease.shard_id in s.parent_ids)

    def _retire_former(self, shards: Iterable[Shard], leases: Iterable[Lease]) -> set[str]:
        """Delete the leases of a former stream of the same name that hide listed shards;
        the keys deleted (to be created anew)."""
        by_key = {self.lease_key(shard.shard_id): shard for shard in shards}
        deleted: set[str] = set()
        relisted: dict[str, Shard] | None = None
        for seen in leases:
            shard = by_key.get(seen.lease_key)
            if shard is None or former_incarnation(seen, shard, self.stream_epoch) is None:
                continue
            lease = self._table.get(seen.lease_key)
            why = None if lease is None else former_incarnation(lease, shard, self.stream_epoch)
            if why == SHARD_END_BUT_OPEN:
                # Listed after the lease was read: a shard that closed meanwhile shows closed.
                if relisted is None:
                    relisted = {self.lease_key(s.shard_id): s for s in self.list_shards()}
                again = relisted.get(seen.lease_key)
                if again is None or not again.is_open:
                    continue
            if lease is None or why is None or not self._table.delete(lease):
                continue
            log.warning("shard sync: the stream was deleted and created again: lease %s is of "
                        "its former shard of that id (%s); replaced by a new lease at the "
                        "initial position", lease.lease_key, why)
            deleted.add(lease.lease_key)
        return deleted

    def create_child_leases(self, children: Iterable[ChildShardLike],
                            finished_lease_key: str | None = None) -> None:
        """Leases for the children GetRecords reported at a parent's shard end, at
        TRIM_HORIZON with their parents recorded, and the children recorded in each parent's
        ``childShardIds`` (as Java does; lease cleanup then knows every child before it
        judges a parent finished). Idempotent: a lease that exists is left as it is,
        whoever created it, except that the parent read to its end (``finished_lease_key``,
        the caller's lease) is added to every child's ``finished_parents``, which outlives
        the parent's lease (module docstring)."""
        children = list(children)
        finished = None if finished_lease_key is None else (
            finished_lease_key if self.stream is None
            else finished_lease_key.removeprefix(self.stream + ":"))
        for child in children:
            if not child.parent_shards:
                raise ValueError(f"child shard {child.shard_id} names no parent shard")
            lease = Lease(
                lease_key=self.lease_key(child.shard_id),
                checkpoint=Position.trim_horizon(),
                parent_shard_ids=frozenset(child.parent_shards),
                starting_hash_key=child.starting_hash_key,
                ending_hash_key=child.ending_hash_key,
                stream=self.stream,
                incarnation=new_incarnation(self.stream_epoch),
                stream_name=self._single_stream_name,
                finished_parents=frozenset() if finished is None else frozenset({finished}),
            )
            if self._table.create(lease):
                log.info(
                    "created lease for child shard %s of %s",
                    lease.lease_key,
                    ", ".join(sorted(lease.parent_lease_keys)),
                )
            elif finished is not None:
                try:
                    self._table.add_finished_parent(lease.lease_key, finished)
                except LeaseLostError:
                    # Deleted since the create found it: finished and cleaned up, or a
                    # reset; either way nothing vouches for a parent through it any more.
                    log.debug("child lease %s is gone; %s not recorded in it",
                              lease.lease_key, finished)
            self._known = self._known | {child.shard_id}
        by_parent: dict[str, set[str]] = {}
        for child in children:
            for parent in child.parent_shards:
                by_parent.setdefault(parent, set()).add(child.shard_id)
        for parent, ids in sorted(by_parent.items()):
            try:
                self._table.update_child_shard_ids(self.lease_key(parent), ids)
            except LeaseLostError:
                # The parent has no lease (a LATEST application never leased it, or it was
                # cleaned up already): nothing to record.
                log.debug("no lease for parent %s; its children are not recorded", parent)
