"""Which leases a worker should take: the Java KCL 2.x ``DynamoDBLeaseTaker`` rules.

No worker talks to another; each one scans the table and decides alone, so every rule here
must converge when all workers apply it at once:

- *Expiry by the observer's own clock.* A lease is expired when its ``leaseCounter`` has not
  moved for longer than the failover time since this worker first saw that value (or when it
  has no owner). Clocks of different hosts are never compared.
- *Target.* ``ceil(eligible leases / live workers)``, where live workers are the owners of
  unexpired leases plus this worker (``1`` when there are at least as many workers as
  leases), capped by ``max_leases_for_worker``.
- *Very old first.* Leases free for longer than ``very_old_multiplier`` failover times are
  taken before anything else, up to ``max_leases_for_worker`` but regardless of the target:
  nobody else is taking them.
- *Then free leases* (unowned or expired), longest-free first, up to the target. A lease
  still named after this worker that it does not hold (left by an earlier run with the same
  worker id) counts as its own until it expires, as in Java: taking it back at once would
  make two processes misconfigured with one worker id take it from each other for ever.
- *Steal only when nothing is free*, from the most loaded worker: ``min(needed, its excess)``
  when it holds more than the target, or one lease when it holds exactly the target and we
  need more than one; never more than ``max_leases_to_steal_at_one_time``.

Differences from Java, each cheap and deliberate:

- Leases checkpointed at ``SHARD_END`` are never taken and do not count towards any
  worker's load, unless a lag recovery of the shard is still queued in them (or a Java
  worker shares the table: ``java_peers``, see ``mixed.py``). Nothing else
  needs them: a child only reads its parent's checkpoint, and a child lease missing after a
  crash is recreated by shard sync. Java takes them and renews them until they are cleaned
  up, paying DynamoDB writes for finished shards.
- Leases of shards outside the known set (``set_known_lease_keys``) are never taken or counted.
- Parked leases (``kclpyParked``, set by ``kclpy shard park`` or the ``park`` processor
  error policy) are never taken or counted until ``kclpy shard resume`` clears the mark.
- Java treats a lease it sees for the first time unowned as free since the epoch, hence
  "very old" at once; here it is free since first sight, so only leases that stay free
  longer than the very-old threshold bypass the target.
- A lease stolen from this worker is not stolen back in the taker cycle that follows
  (the coordinator passes those keys as ``no_steal``), so a transient view cannot start a
  ping-pong.
- A lease being handed off (``checkpointOwner`` set) is never a steal candidate: it is
  already moving, and counts for the worker it moves to.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kclpy.leases import mixed
from kclpy.leases.lease import Lease


@dataclass(frozen=True)
class TakePlan:
    """Leases to try to take in one taker cycle."""

    #: unowned or expired leases, best first
    take: tuple[Lease, ...] = ()
    #: leases of a live, more loaded worker
    steal: tuple[Lease, ...] = ()
    #: leases per live worker (the fleet's average load, this worker included)
    share: float = 0.0
    #: what the decision saw, as the Java taker reports it (TakeLeases metrics): live
    #: workers, leases to spread, unowned or expired ones, and how many more this one needs
    workers: int = 0
    total: int = 0
    expired: int = 0
    needed: int = 0


class Balancer:
    """The taker's memory of the table (what it saw and when) and its decision rules.

    Not thread-safe: the coordinator calls it from its taker cycle only.
    """

    def __init__(
        self,
        worker_id: str,
        failover_time_s: float,
        *,
        max_leases_for_worker: int | None = None,
        max_leases_to_steal_at_one_time: int = 1,
        very_old_multiplier: float = 3.0,
        rng: random.Random | None = None,
    ) -> None:
        if max_leases_for_worker is not None and max_leases_for_worker < 1:
            raise ValueError("max_leases_for_worker must be at least 1")
        if max_leases_to_steal_at_one_time < 1:
            raise ValueError("max_leases_to_steal_at_one_time must be at least 1")
        self.worker_id = worker_id
        self.failover_time_s = failover_time_s
        self.max_leases_for_worker = max_leases_for_worker
        self.max_leases_to_steal_at_one_time = max_leases_to_steal_at_one_time
        self.very_old_multiplier = very_old_multiplier
        self._rng = rng if rng is not None else random.Random()
        #: lease key -> (counter, when this worker first saw that counter)
        self._seen: dict[str, tuple[int, float]] = {}
        self._leases: dict[str, Lease] = {}
        #: leases whose counter this worker has seen move
        self._renewed: set[str] = set()
        #: lease owner -> when this worker first saw it own a lease (since it last did)
        self._owners_since: dict[str, float] = {}
        #: when the last full scan was observed (``next_expiry``)
        self._scanned_at = -math.inf

    def observe(self, leases: Iterable[Lease], now: float) -> None:
        """Record one full scan, taken at ``now`` (after the scan returned)."""
        fresh = {lease.lease_key: lease for lease in leases}
        for lease in fresh.values():
            self._see(lease, now)
        for key in self._seen.keys() - fresh.keys():
            del self._seen[key]
            self._renewed.discard(key)
        self._leases = fresh
        self._scanned_at = now
        owners = {lease.lease_owner for lease in fresh.values() if lease.lease_owner}
        self._owners_since = {owner: self._owners_since.get(owner, now) for owner in owners}

    def observe_one(self, lease: Lease, now: float) -> None:
        """Record a single read (a handoff poll between scans): it counts towards expiry
        like a scan does, so a dead owner's lease is not judged on scans alone."""
        self._see(lease, now)
        self._leases[lease.lease_key] = lease
        if lease.lease_owner:
            self._owners_since.setdefault(lease.lease_owner, now)

    def _see(self, lease: Lease, now: float) -> None:
        seen = self._seen.get(lease.lease_key)
        if seen is None or seen[0] != lease.lease_counter:
            self._seen[lease.lease_key] = (lease.lease_counter, now)
            if seen is not None:
                self._renewed.add(lease.lease_key)

    def scan_failed(self, sent_at: float) -> None:
        """A full scan sent at ``sent_at`` failed. An overdue lease that expired before it is
        no longer due (``next_expiry``): a scan was tried for it, and while the table keeps
        failing every cycle would otherwise scan again at once; the regular scans go on."""
        self._scanned_at = max(self._scanned_at, sent_at)

    def unchanged_for(self, lease_key: str, now: float) -> float:
        """How long the lease's counter has stood still, as far as this worker has seen."""
        return now - self._seen[lease_key][1]

    def seen_renewed(self, lease_key: str) -> bool:
        """The lease's counter moved while this worker watched the table: its owner was
        alive then. A lease left over by a crashed run looks live until it expires; this
        tells the two apart without waiting for the failover time."""
        return lease_key in self._renewed

    def is_expired(self, lease: Lease, now: float) -> bool:
        return (
            lease.lease_owner is None
            or self.unchanged_for(lease.lease_key, now) > self.failover_time_s
        )

    def next_expiry(
        self, *, held: AbstractSet[str], overdue_after: float, now: float
    ) -> float | None:
        """When the first *overdue* lease will expire: one owned by another worker (or left
        over under this worker's name) whose counter has stood still for longer than
        ``overdue_after`` and that no full scan has seen expired yet. Its owner missed a
        renewal, so it is probably dead; a scan right at its expiry takes it over without
        waiting for the regular scan. The moment may have passed already (the caller scans
        at once): judged "not expired yet" on the clock of the call, a lease dropped out as
        soon as it expired, so a cycle woken right after the expiry found nothing due and
        waited for the regular scan (with a leader, up to a pass interval, a third of the
        failover time, late). None when no lease is overdue."""
        soonest: float | None = None
        for key, lease in self._leases.items():
            if (lease.lease_owner is None or key in held or lease.is_finished
                    or lease.parked is not None):
                continue
            at = self._seen[key][1] + self.failover_time_s
            if self.unchanged_for(key, now) > overdue_after and at > self._scanned_at:
                soonest = at if soonest is None else min(soonest, at)
        return soonest

    def plan(
        self,
        *,
        held: AbstractSet[str],
        known_lease_keys: AbstractSet[str] | None,
        no_steal: Collection[str],
        now: float,
        java_peers: bool = False,
    ) -> TakePlan:
        """Decide what to take, given the leases this worker holds now. With ``java_peers``
        (a Java KCL 2.x worker shares the table), finished leases count as Java's taker
        counts them - towards the total and their live owner's load - so both compute the
        same target (they are still never taken); and a lease free (released, or expired:
        its owner stopped renewing) for longer than one failover time counts as very old: a
        Java worker under target may leave it free for up to four failover times (it takes a
        lease only at the second of its scans, two failover times apart, after the lease's
        last change). Such leases are taken above the target only as far as the other kclpy
        workers' room below theirs does not cover them (``_kclpy_room``)."""
        eligible = sorted(
            (
                lease
                for lease in self._leases.values()
                if not lease.is_finished
                and lease.parked is None  # an operator or the park policy set it aside
                and (known_lease_keys is None or lease.lease_key in known_lease_keys)
            ),
            key=lambda lease: lease.lease_key,
        )
        if not eligible:
            return TakePlan()
        available: list[Lease] = []
        counts: Counter[str] = Counter()
        mine = 0
        for lease in eligible:
            owner = lease.lease_owner
            if lease.lease_key in held:
                mine += 1
            elif owner is None or self.is_expired(lease, now):
                available.append(lease)
            elif owner == self.worker_id:
                mine += 1
            else:
                counts[owner] += 1
        finished = 0
        if java_peers:
            for lease in self._leases.values():
                if (not lease.is_finished or lease.parked is not None
                        or (known_lease_keys is not None
                            and lease.lease_key not in known_lease_keys)):
                    continue
                finished += 1
                owner = lease.lease_owner
                if owner is not None and not self.is_expired(lease, now):
                    if owner == self.worker_id or lease.lease_key in held:
                        mine += 1
                    else:
                        counts[owner] += 1
        total = len(eligible) + finished
        workers = len(counts) + 1
        share = total / workers
        target = 1 if workers >= total else math.ceil(total / workers)
        limit = self.max_leases_for_worker
        if limit is not None:
            target = min(target, limit)

        def made(take: Sequence[Lease] = (), steal: Sequence[Lease] = ()) -> TakePlan:
            return TakePlan(tuple(take), tuple(steal), share, workers, total,
                            len(available), max(0, target - mine))

        # Shuffle before the stable sort so that equally old leases come in a different
        # order on every worker, and workers do not all race for the same one.
        self._rng.shuffle(available)
        available.sort(key=lambda lease: self.unchanged_for(lease.lease_key, now), reverse=True)
        very_old_after = self.very_old_multiplier * self.failover_time_s
        very_old = [
            lease
            for lease in available
            if self.unchanged_for(lease.lease_key, now) > (
                self.failover_time_s if java_peers else very_old_after)
        ]
        if very_old:
            room = len(very_old) if limit is None else max(0, limit - mine)
            if java_peers:
                room = min(room, max(target - mine, len(very_old) - self._kclpy_room(
                    counts, target, now)))
            return made(take=very_old[:room])

        needed = target - mine
        if needed <= 0:
            return made()
        if available:
            return made(take=available[:needed])
        steals = self._choose_steals(eligible, counts, needed, target, no_steal)
        return made(steal=steals)

    def _kclpy_room(self, counts: Counter[str], target: int, now: float) -> int:
        """How many leases the other live kclpy workers (``mixed.speaks_handoff``) can still
        take below their target. They take a free lease at the same scan as this worker (an
        expired one right at its expiry), so with Java peers this worker takes above its
        target only what they cannot: taking more would make one of them steal it back.

        Only workers this one has seen own leases for a failover time count: a worker that
        started since may not have watched an expiring lease long enough to judge it expired,
        and would take it up to a failover time late (the rolling migration's new node, which
        starts as the old one's leases fall free). Taking such a lease above target costs
        at most one graceful handoff later."""
        kclpy = {lease.lease_owner for lease in self._leases.values()
                 if mixed.speaks_handoff(lease)}
        return sum(max(0, target - count) for owner, count in counts.items()
                   if owner in kclpy and owner != self.worker_id
                   and now - self._owners_since.get(owner, now) >= self.failover_time_s)

    def _choose_steals(
        self,
        eligible: list[Lease],
        counts: Counter[str],
        needed: int,
        target: int,
        no_steal: Collection[str],
    ) -> list[Lease]:
        if not counts:
            return []
        most = max(counts.values())
        victim = self._rng.choice(sorted(w for w, c in counts.items() if c == most))
        if most < target:
            return []
        count = min(needed, most - target)
        if count == 0 and needed > 1:
            count = 1
        count = min(count, self.max_leases_to_steal_at_one_time)
        if count <= 0:
            return []
        candidates = [
            lease
            for lease in eligible
            if lease.lease_owner == victim
            and lease.checkpoint_owner is None
            and lease.lease_key not in no_steal
        ]
        self._rng.shuffle(candidates)
        return candidates[:count]
