"""The lease model: one shard's ownership and progress, as the Java KCL 2.x/3.x stores it.

The attribute names (see ``serializer.py``) are fixed by the Java KCL so that an application
moving from it (or from amazon_kclpy) keeps its table and checkpoints. Unknown attributes
written by newer Java KCL versions are kept untouched because we never rewrite a whole item.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kclpy.position import Position


@dataclass
class Lease:
    """One shard's lease as the table stores it. ``lease_counter`` is the fencing token:
    every write is conditional on it, so a stale copy can never overwrite a newer one."""

    lease_key: str
    lease_owner: str | None = None
    lease_counter: int = 0
    #: the item's ``checkpoint`` and ``checkpointSubSequenceNumber`` attributes as one value
    #: (``serializer.py`` is the only code that reads or writes those attributes)
    checkpoint: Position = field(default_factory=Position.trim_horizon)
    #: ``pendingCheckpoint`` and ``pendingCheckpointSubSequenceNumber``, likewise
    pending_checkpoint: Position | None = None
    pending_checkpoint_state: bytes | None = None
    owner_switches_since_checkpoint: int = 0
    parent_shard_ids: frozenset[str] = field(default_factory=frozenset)
    child_shard_ids: frozenset[str] = field(default_factory=frozenset)
    starting_hash_key: str | None = None
    ending_hash_key: str | None = None
    #: Java KCL 3.x graceful handoff: while set, the *previous* owner named here may still
    #: checkpoint and ``lease_owner`` already names the worker the lease is handed to.
    checkpoint_owner: str | None = None
    #: kclpy's own lag recovery queue (``kclpy.recovery.queue``) as stored, a JSON string;
    #: Java KCL workers ignore the attribute. Written only through the fence.
    recovery: str | None = None
    #: operator requests to that queue (``kclpy.recovery.requests``) its holder has not
    #: folded in yet: added by ``kclpy recovery add`` / ``cancel`` without taking the lease
    recovery_requests: frozenset[str] = field(default_factory=frozenset)
    #: kclpy's own: where a lease still at ``LATEST`` or ``AT_TIMESTAMP`` reads from (epoch
    #: ms of arrival), fixed by the first worker that resolved it, so that every later owner
    #: and processor restart resumes there and not at the tip (docs/design.md). Java KCL
    #: workers ignore the attribute; a checkpoint removes it.
    start_at_ms: int | None = None
    #: kclpy's park marker (``kclpy.ops.control``), a JSON string saying who parked the
    #: shard, when and why: no kclpy worker takes a parked lease. Java KCL workers ignore it.
    parked: str | None = None
    #: multi-stream applications: the serialised stream identifier the key starts with
    #: (``account-id:stream-name:creation-epoch``, Java's ``streamName`` attribute)
    stream: str | None = None
    #: kclpy's identity of this lease item, written once when the item is created
    #: (``new_incarnation``): a lease deleted and created again, or a stream created again
    #: under the same name, gets a new one, so a store that keeps progress outside the lease
    #: table (the SQL state store) can tell. Java KCL workers ignore the attribute; None for
    #: items created without it (by Java, or by kclpy before it).
    incarnation: str | None = field(default=None, compare=False)
    #: kclpy's own ``kclpyStreamName``: the stream a single-stream lease was created for, so
    #: that a worker started on another stream with the same application name (table) is
    #: refused instead of taking the table's leases for a former stream of its own
    #: (``shard_sync.refuse_another_streams_table``). None on multi-stream leases (their key
    #: names the stream), on Java's and on kclpy's before it.
    stream_name: str | None = field(default=None, compare=False)
    #: kclpy's own: the kclpy worker that last took or adopted the lease. A Java KCL worker's
    #: take leaves it unchanged, so it equals the holder only while a kclpy worker holds the
    #: lease: how kclpy tells a holder that speaks the graceful handoff protocol
    #: (``mixed.py``). None on items no kclpy worker has taken.
    kclpy_holder: str | None = field(default=None, compare=False)
    #: kclpy's own: a token a leader writes on a lease its holder holds, after assigning that
    #: holder more leases (``--lease-assigner leader``). The holder's next renewal returns it
    #: changed and the holder then looks for its new leases at once, instead of querying the
    #: owner index every half failover time (``leader.py``). Java KCL workers ignore it.
    assignment_notice: str | None = field(default=None, compare=False)
    #: kclpy's own ``kclpyWrite``: the id of the holder's write (renewal, checkpoint, release,
    #: any write through ``LeaseFence``) that last changed the item. Each such write stamps a
    #: fresh random id; a writer whose answer was lost finds its own id here, at the counter
    #: its write set, and knows the write landed (``fence.py``). Java KCL workers ignore it.
    last_write: str | None = field(default=None, compare=False)
    #: kclpy's own ``kclpyFinishedParents``: the parent shards that were read to their end
    #: (their records delivered), each added by its parent's holder at that parent's shard
    #: end. Once a parent's lease is gone it is what tells a parent lease cleanup deleted
    #: after it finished from one a lease-table reset deleted unfinished (``shard_sync``).
    #: Java KCL workers ignore it; empty on items Java or an older kclpy made.
    finished_parents: frozenset[str] = field(default_factory=frozenset, compare=False)
    #: In memory only: the id the next holder's write of this copy stamps (``last_write``),
    #: chosen by the fence so that it knows the id even when the write gets no answer. None:
    #: the write draws a fresh one (``new_write_id``).
    write_id: str | None = field(default=None, compare=False)
    #: In memory only: the item has no ``leaseCounter`` (written by hand or by another tool;
    #: every KCL writes one). It reads as counter 0, and the first take expects the counter
    #: absent instead of 0, which no such item could ever match (``table._owner_update``).
    counter_absent: bool = field(default=False, compare=False)
    #: In memory only, never persisted: a fresh value each time this worker takes the lease,
    #: so a checkpointer created for an earlier tenure cannot write into a later one.
    concurrency_token: str | None = field(default=None, compare=False)

    @property
    def shard_id(self) -> str:
        """The Kinesis shard id: the key itself, or the key after the stream identifier."""
        if self.stream is not None and self.lease_key.startswith(self.stream + ":"):
            return self.lease_key[len(self.stream) + 1:]
        return self.lease_key

    def key_of(self, shard_id: str) -> str:
        """The lease key of another shard of the same stream (a parent or a child): parents
        and children are stored as bare shard ids, as Java stores them."""
        return shard_id if self.stream is None else f"{self.stream}:{shard_id}"

    @property
    def parent_lease_keys(self) -> frozenset[str]:
        return frozenset(self.key_of(p) for p in self.parent_shard_ids)

    @property
    def child_lease_keys(self) -> frozenset[str]:
        return frozenset(self.key_of(c) for c in self.child_shard_ids)

    @property
    def is_shard_end(self) -> bool:
        return self.checkpoint.is_shard_end

    @property
    def is_finished(self) -> bool:
        """Nothing left to read: the shard ended and no recovery of it is pending (queued,
        or asked for by an operator and not folded into the queue yet)."""
        return self.is_shard_end and not self.recovery and not self.recovery_requests

    @property
    def stream_epoch(self) -> float:
        """The creation time (seconds) of the stream this lease was made for, as its
        incarnation names it; 0 when it does not say (a lease the Java KCL made, or one made
        before the stream's time was known)."""
        return incarnation_epoch(self.incarnation) if self.incarnation else 0

    def copy(self, **changes: Any) -> Lease:
        """``dataclasses.replace``, without its ``getattr`` per field and its ``__init__``:
        the taker hands out a copy of every lease of the table several times a second
        (``all_leases``), and replace was about 7 % of the fleet simulator's CPU. A lease has
        no ``__post_init__`` and no attribute besides its fields, so the copy is the same."""
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"Lease has no field {sorted(unknown)[0]!r}")
        new = object.__new__(Lease)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_FIELDS = frozenset(f.name for f in dataclasses.fields(Lease))


def new_write_id() -> str:
    """A fresh ``Lease.write_id``: 96 random bits, so no other write - by this worker or any
    other - ever stamps the same one."""
    return secrets.token_hex(12)


def new_incarnation(stream_epoch: float | None, now: float | None = None) -> str:
    """A fresh ``Lease.incarnation``: ``<stream creation time>:<creation ms>:<random>``, the
    stream's creation time in seconds to the millisecond the endpoint gives (0 when
    unknown). Unique, but not ordered: the creation time is the creating worker's clock, and
    workers' clocks differ, so a later incarnation may carry an earlier time. Which
    incarnation is live is what the lease table holds (``Guard.current``)."""
    created_ms = round((time.time() if now is None else now) * 1000)
    epoch = f"{stream_epoch or 0:.3f}".rstrip("0").rstrip(".")
    return f"{epoch}:{created_ms}:{uuid.uuid4().hex[:12]}"


def same_stream(created: float, other: float) -> bool:
    """Whether two creation times of a stream name (seconds) are one stream: to the
    millisecond when both carry a fraction, else to the second - an incarnation written
    before 2026-11-27 (or at a whole second) holds whole seconds only, as Java's stream
    identifier does. Whole seconds do not tell a stream deleted and created again within
    one second (kinesis-mock does both in half a second, and numbers the new shard's
    records as the old one's)."""
    if created.is_integer() or other.is_integer():
        return int(created) == int(other)
    return abs(created - other) < 0.0005


def other_streams(created: float, other: float | None) -> bool:
    """Whether two creation times of a stream name are both known (0 or None: unknown) and
    name two streams (``same_stream``); unknown on either side never tells them apart."""
    if not created or not other:
        return False
    return not same_stream(created, other)


def incarnation_epoch(incarnation: str) -> float:
    """The stream creation time an incarnation names (seconds); 0 when unknown or
    unreadable. An infinite or NaN time (a hand-written ``1e999``) is unreadable: every
    comparison with it is meaningless, and ``same_stream`` would raise on int() of it."""
    epoch, _, _ = incarnation.partition(":")
    try:
        value = float(epoch)
    except ValueError:
        return 0
    return value if math.isfinite(value) else 0
