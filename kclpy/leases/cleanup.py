"""Which finished leases can be deleted: the Java KCL's ``cleanupLeasesUponShardCompletion``.

A parent's lease must outlive its shard for two reasons: its children wait until it is
checkpointed at ``SHARD_END`` before they start, and shard sync must see it (or a
descendant) so that it never creates a lease for an already processed shard. Both needs end
when every child has made progress. A lease is therefore deleted when:

- it is checkpointed at ``SHARD_END`` and no lag recovery of it is queued or asked for
  (the delete is conditional on that, on the item: an operator's request to a held
  lease leaves the counter alone, ``LeaseTable.delete_finished``);
- it has children - those named in its ``childShardIds`` and every lease naming it as a
  parent - and each child's lease exists and is checkpointed past its start (at a sequence
  number or at ``SHARD_END``), as Java checks;
- none of its own parents still has a lease, so deletion runs from the top of the shard
  tree down (Java's rule too). A child lease is never deleted before its parent; a missing
  child lease therefore always means "not created yet", and shard sync, which never
  leases an ancestor a progressed (or ``kclpyFinishedParents``) child vouches for, can
  never recreate what was deleted. Shard sync's
  deletion of the leases of shards the retention removed unfinished
  (``shard_sync.aged_out``) keeps to this too: it deletes their unlisted ancestors'
  leases, finished or not, first.

In a pure kclpy fleet nobody holds a finished lease (``taker.py``), so deletion cannot be
left to its owner as in Java. Every worker evaluates these rules on each scan it makes anyway
(no extra reads); the worker holding the first (by key) owned child lease deletes, because
its progress is what made the parent deletable. When no child is owned (every child finished
and was released) any worker may delete; the delete is conditional on the lease counter, so
racing workers cost a failed request once in a shard's lifetime, never a wrong deletion.
A finished lease that is held - by a Java KCL 2.x worker, or by a kclpy worker in a fleet
with Java workers (``mixed.py``) - is deleted by its holder alone, as Java's lease cleanup
does: a delete by anyone else would race the holder's renewals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from kclpy.leases.lease import Lease
from kclpy.position import AT_TIMESTAMP, LATEST, TRIM_HORIZON

_NOT_STARTED = frozenset({TRIM_HORIZON, LATEST, AT_TIMESTAMP})


def has_progressed(lease: Lease) -> bool:
    """Checkpointed at a sequence number or at SHARD_END, not at a starting position."""
    return lease.checkpoint.sequence_number not in _NOT_STARTED


def deletable(
    leases: Iterable[Lease],
    worker_id: str,
    keep: AbstractSet[str] = frozenset(),
    held: AbstractSet[str] = frozenset(),
) -> list[Lease]:
    """The finished leases this worker should delete now, by the rules above; never those
    in ``keep`` (finished leases another live worker holds: its own cleanup deletes them),
    and those in ``held`` (this worker holds them) whichever worker holds their children."""
    by_key = {lease.lease_key: lease for lease in leases}
    children: defaultdict[str, set[str]] = defaultdict(set)
    for lease in by_key.values():
        children[lease.lease_key].update(lease.child_lease_keys)
        for parent in lease.parent_lease_keys:
            children[parent].add(lease.lease_key)
    result = []
    for key, lease in sorted(by_key.items()):
        kids = children[key]
        if not lease.is_finished or not kids or key in keep:
            continue
        if any(parent in by_key for parent in lease.parent_lease_keys):
            continue
        if not all(kid in by_key and has_progressed(by_key[kid]) for kid in kids):
            continue
        owners = [by_key[kid].lease_owner for kid in sorted(kids) if by_key[kid].lease_owner]
        if owners and owners[0] != worker_id and key not in held:
            continue
        result.append(lease)
    return result
