"""Mixed fleets: kclpy workers sharing a lease table with Java KCL 2.x workers.

A rolling migration runs both kinds of worker on one table for minutes or hours. The Java KCL
2.x knows nothing of graceful handoff (``checkpointOwner``): it renews on the counter alone and
keeps processing a lease a kclpy worker asked for. Where a Java worker may be involved, kclpy
therefore speaks the Java 2.x protocol, and keeps its graceful handoff between kclpy workers:

- *Who speaks graceful handoff* is read from the lease itself: every kclpy take and adoption
  writes ``kclpyHolder = <its worker id>``; a Java take changes ``leaseOwner`` and leaves
  ``kclpyHolder`` alone. The holder (``checkpointOwner`` during a handoff, else
  ``leaseOwner``) speaks the protocol exactly when ``kclpyHolder`` names it. Detected rather
  than configured, so that an operator rolling a fleet node by node changes nothing else, and
  a pure kclpy fleet keeps its handoffs without an option. A kclpy worker of an earlier
  version does not write the attribute and is treated as a Java worker: its leases are
  stolen outright, which is always safe (the counter fences its processor out).
- *Handoff requests nobody finishes* are undone (``StaleHandoffs``): a kclpy requester
  takes the lease outright after the handoff timeout plus the failover time, and a kclpy
  holder lets go within the handoff timeout; a lease still in the handoff state after the
  handoff timeout plus two failover times, and renewed all along, has a requester that
  stopped (a Java holder never lets go) or was overtaken (a Java worker took the lease
  during the handoff: its take leaves ``checkpointOwner`` behind). ``checkpointOwner`` is
  removed - in the first case ``leaseOwner`` is set back to the holder it names, in the
  second (that holder was a kclpy worker, which would have let go) ``leaseOwner`` keeps the
  lease - without bumping the counter, so the real holder's renewals carry on.
- *Finished leases* count as Java's taker counts them while a Java worker holds a live lease:
  towards the fleet's total and their owner's load (``Balancer.plan(java_peers=True)``),
  so that both kinds of worker compute the same target and ownership settles. They are
  also held as Java holds them: a kclpy worker that finishes a shard while Java workers
  share the table keeps its lease, renewed and without a consumer, until its own lease
  cleanup deletes it (``cleanup.py``: a held finished lease is deleted by its holder alone).
  Released, it would be free for Java's taker, which takes it and starts a consumer on a
  finished shard. A finished lease held by a live Java worker is left to that worker's own
  lease cleanup. In a pure kclpy fleet finished leases are released (nothing needs them
  held, and renewing them costs writes).
- *Free leases are not left to Java for long*: a Java worker takes a lease only at the
  second of its scans (two failover times apart) after the lease's last change, so a lease
  a kclpy worker released, or one a stopped Java worker left (Java 2.x never releases),
  could go without a consumer for four failover times. While Java workers share the table,
  a kclpy worker takes a lease free (unowned, or expired) for longer than one failover
  time even above its target (the balancer's "very old" rule, three failover times
  otherwise): an expired one right at its expiry, for which the taker scans anyway. A
  Java worker under its target later steals one back if need be, one per taker cycle.
  kclpy's release bumps the counter where Java's does not; that delays Java's taker by
  nothing: it counts a lease's failover time from the first of its scans that sees the
  lease's last value, and the holder's renewals (every half failover time) and last
  checkpoint come right before the release anyway. Only when no kclpy worker is left do
  Java's takers alone pick up a stopped kclpy worker's leases, on Java's own schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kclpy.leases.lease import Lease


def holder(lease: Lease) -> str | None:
    """The worker that processes the lease now: during a handoff the one asked to let go."""
    return lease.checkpoint_owner if lease.checkpoint_owner is not None else lease.lease_owner


def speaks_handoff(lease: Lease) -> bool:
    """Whether the lease's holder is a kclpy worker that honours ``checkpointOwner``."""
    owner = holder(lease)
    return owner is not None and lease.kclpy_holder == owner


def foreign_live(leases: Iterable[Lease], is_expired: Callable[[Lease], bool]) -> list[Lease]:
    """Leases held, and renewed, by a worker that does not speak graceful handoff (a Java
    KCL 2.x worker, or a kclpy worker of an earlier version)."""
    return [lease for lease in leases
            if holder(lease) is not None and not speaks_handoff(lease) and not is_expired(lease)]


@dataclass
class _Sighting:
    lease_owner: str | None
    checkpoint_owner: str
    since: float


class StaleHandoffs:
    """Finds handoff requests whose requester stopped: the same ``leaseOwner`` and
    ``checkpointOwner`` seen for longer than ``patience_s`` by this worker's clock."""

    def __init__(self, patience_s: float) -> None:
        self.patience_s = patience_s
        self._seen: dict[str, _Sighting] = {}

    def observe(
        self,
        leases: Iterable[Lease],
        now: float,
        *,
        is_expired: Callable[[Lease], bool],
        waiting_for: Iterable[str],
    ) -> list[Lease]:
        """Record one scan; return the leases to set back to their holder. An expired one is
        left to the ordinary take (which clears ``checkpointOwner``), and one this worker
        waits for is its own handoff, finished or taken by the taker."""
        own = set(waiting_for)
        seen: dict[str, _Sighting] = {}
        stale: list[Lease] = []
        for lease in leases:
            if lease.checkpoint_owner is None:
                continue
            before = self._seen.get(lease.lease_key)
            if (before is None or before.lease_owner != lease.lease_owner
                    or before.checkpoint_owner != lease.checkpoint_owner):
                before = _Sighting(lease.lease_owner, lease.checkpoint_owner, now)
            seen[lease.lease_key] = before
            if (now - before.since > self.patience_s and lease.lease_key not in own
                    and not is_expired(lease)):
                stale.append(lease)
        self._seen = seen
        return stale
