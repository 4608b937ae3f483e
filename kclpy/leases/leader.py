"""Lease assignment by one elected leader (``--lease-assigner leader``), the Java KCL 3.x
shape.

With the default (``worker``) every worker scans the whole lease table at every taker
cycle and decides alone what to take, as the Java KCL 2.x does: the bill grows with
workers x shards. Here:

- *One leader*, elected through a lock item in kclpy's own worker-load table
  (``<lease table>-kclpyWorkerLoad``, key ``__kclpyLeader__``; never in the lease table, where
  a Java KCL 2.x worker would take it for a lease). The leader bumps the lock's ``term``
  every sixth of the failover time, with the fleet's size. Any other worker that sees the
  term stand still for longer than half the failover time, judged on its own clock as
  lease expiry is, takes the lock over with a write conditional on that term. The others
  read the lock every half failover time, spread over the fleet (about eight reads per
  half failover time whatever its size, each read of a new term followed by one more once
  it could have expired), so a dead leader is replaced within about one failover time.
  Two workers cannot both win a term; a leader that stopped bumping stops believing it
  leads once its term could have expired, before anyone else can take over. Two leaders
  for a moment would cost moves, never a lease: every assignment is a write fenced on the
  lease counter.
- *Only the leader scans* the lease table, every tenth of the failover time (at most every
  half second; ``LeaderTaker._scan_interval_s``) and right when an overdue lease expires.
  It assigns free and expired leases to live workers, and moves
  leases from workers above their share to workers below it as the assignment strategy
  says (``plan``; ``assignment.py``): by lease count (exact: counts end within one of
  each other, nothing flaps since one decider sees one view), or with
  ``--lease-assignment load`` by the load every worker reports (``choose_steals``' rules,
  damped by ``dampeningPercentage``, each lease moved at most once per two balancing
  rounds; by count a round is every third of the failover time). A free lease is assigned
  with a write that names the new owner and bumps the counter (``LeaseTable.assign``); a
  live lease is moved with the graceful handoff request (``leaseOwner`` = new,
  ``checkpointOwner`` = old), so its holder lets its processor finish and checkpoint
  first, as when a worker steals in kclpy's protocol.
- *Live workers* are those whose report in the load table keeps changing (its sequence
  number, on the leader's clock), less those owning a lease that expired after their last
  report (they stopped renewing: dead) or leaving one assigned to them untaken
  (``LeaderMode.claim_within_s`` after the write). Each worker reports every
  ``workerMetricsReporterFreqInMillis`` in both modes. While some are known dead, free
  leases go first to the workers that reported last (``plan``'s ``recency``): an idle
  worker that died with them looks alive until its report goes stale.
- *Every worker finds its leases* through the owner index (``LeaseOwnerToLeaseKeyIndex``, the
  Java KCL 3.x's own: leaseOwner -> leaseKey, keys only), with a Query that costs what its
  own keys weigh. A new key is read (GetItem) and taken with a write fenced on the counter
  the leader left (so its tenure starts on its own clock); one still being handed off
  waits as a steal's handoff waits (``taker.py``). A worker that holds nothing Queries
  every half failover time. One that holds leases is *notified*: after a pass gives it
  leases, the leader writes a token on one of the leases it holds
  (``Lease.assignment_notice``, fenced on the holder, not on the counter), the holder's
  next renewal returns it changed, and the holder Queries at once; otherwise it Queries
  only every 1.5-4.5 failover times (``LeaderMode.held_discovery_interval_s``, spread).
  Holders' Queries were most of the bill that grows with the workers (360 of the 1,286
  requests per shard-hour at 100 shards x 50 workers), and a notice costs one write per
  worker given leases, nothing once the fleet is settled. While the index is still being
  built (on AWS minutes after the first worker added it) its Query is refused, and a
  worker reads its keys from a scan instead (``index_unreadable``).
- *A stopping worker leaves first*: once its taker has stopped it withdraws its report and,
  leading, resigns the lock; then it hands each lease it releases straight to the
  reporting worker that owns the fewest, with a notice, as a pass would
  (``LeaderTaker.hand_over``). Still counted as live, it was given its own leases back.

The pure decision is :func:`plan` (the moves are the assignment strategy's,
``assignment.py``); :class:`LeaderLock` is the election; ``leading.py``'s ``LeaderTaker``
carries both out.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from kclpy.leases.assignment import AssignmentStrategy, FleetView
from kclpy.leases.dynamo import CONDITION_FAILED, TABLE_ERRORS
from kclpy.leases.lease import Lease, other_streams
from kclpy.leases.load import (
    LEADER_ITEM,
    WORKER_ID,
    LoadBalancing,
    LoadSettings,
    LoadTable,
    WorkerLoad,
)
from kclpy.retry import error_code, spread

log = logging.getLogger(__name__)

LEADER = "leader"
TERM = "term"
#: the fleet's size as the leader last counted it, written with each renewal
WORKERS = "workers"
#: the balancing knobs of a plan whose caller gives none (a strategy by count reads none)
DEFAULT_SETTINGS = LoadSettings()
#: how many lock reads the whole fleet makes per check interval, whatever its size
_READERS = 8


#: what DynamoDB says to a Query of an index it is still building (``CREATING``: minutes
#: after ``UpdateTable`` added it to a table with items), and of one it does not have
_INDEX_UNREADABLE = ("Cannot read from backfilling global secondary index",
                     "The table does not have the specified index")


def index_unreadable(exc: ClientError) -> bool:
    """A Query of the owner index was refused because the index cannot be read yet (still
    backfilling, or not added: a fleet's first start raced or was throttled adding it). A
    worker then reads its keys from a scan instead (``LeaderTaker._owned_keys``): waiting for
    the index would leave every lease the leader assigns it untaken for as long as the
    build takes, and the leader would take them all itself one claim timeout at a time."""
    message = str(exc.response.get("Error", {}).get("Message", ""))
    return error_code(exc) == "ValidationException" and message.startswith(_INDEX_UNREADABLE)


class LeaderLock:
    """The leader election on one worker. Not thread-safe: the taker's cycle calls it."""

    def __init__(self, table: LoadTable, worker_id: str, *, failover_time_s: float,
                 clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.table = table
        self._rng = rng if rng is not None else random.Random()
        #: the live workers of the leader's last pass (written into the lock when leading)
        self.fleet_size = 1
        #: the fleet's size as the lock says (spreads the other workers' reads)
        self._readers = 1
        #: the next read confirms a term the last one saw for the first time
        self._confirming = False
        #: a regular read has been scheduled (the first falls anywhere in its period)
        self._phased = False
        self.worker_id = worker_id
        self.failover_time_s = failover_time_s
        self._clock = clock
        #: the lock as last read: (leader, term, this worker's clock when that term was
        #: first seen)
        self._seen: tuple[str | None, int, float] | None = None
        #: the term this worker holds, and when the write that won or renewed it was sent
        self._term: int | None = None
        self._renewed_at = 0.0
        self._next_tick: float | None = None
        #: the last term won was taken from another leader (not created on a cold start)
        self.took_over = False

    @property
    def expiry_s(self) -> float:
        """How long a term may stand still before another worker takes the lock over."""
        return self.failover_time_s / 2

    @property
    def heartbeat_s(self) -> float:
        return self.expiry_s / 3

    @property
    def check_s(self) -> float:
        return self.failover_time_s / 2

    def is_leader(self) -> bool:
        return self._term is not None and self._clock() - self._renewed_at < self.expiry_s

    def next_tick(self) -> float:
        return self._clock() if self._next_tick is None else self._next_tick

    def tick(self) -> bool:
        """Renew the lock when leading, else read it and take it over when it expired.
        Returns whether this worker leads now."""
        now = self._clock()
        if self._next_tick is not None and now < self._next_tick:
            return self.is_leader()
        changed = False
        try:
            if self._term is not None:
                self._renew(now)
            if self._term is None:
                changed = self._check(now)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: leader lock: %r", self.worker_id, exc)
        if self._term is not None:
            self._next_tick = now + self.heartbeat_s
        elif changed and not self._confirming:
            # a term seen for the first time: read again once it could have expired
            self._confirming = True
            self._next_tick = now + spread(self.expiry_s, 1.05, 1.2, self._rng)
        else:
            self._confirming = False
            # Of a fleet of N, each worker reads every N / 8 check intervals (at a random
            # phase), so the fleet reads the lock about eight times per interval whatever
            # its size, each read of a new term followed by one more: a dead leader's last
            # term is seen soon after it stopped, and confirmed half a failover time
            # later, and the bill does not grow with the workers. The first of these reads
            # falls anywhere in its period: drawn as the later ones are, a fleet started at
            # once would not look at the lock for half a period (a minute at 200 workers).
            readers = max(1.0, self._readers / _READERS)
            low, high = (0.5, 1.5) if self._phased else (0.0, 1.0)
            self._phased = True
            self._next_tick = now + spread(self.check_s * readers, low, high, self._rng)
        return self.is_leader()

    def _write(self, operation: str, fn: Callable[..., Any], **kw: Any) -> bool:
        try:
            self.table.call(operation, fn, TableName=self.table.table_name, **kw)
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return False
            raise
        return True

    def _renew(self, now: float) -> None:
        assert self._term is not None
        ok = self._write(
            "UpdateItem", self.table.client.update_item, Key={WORKER_ID: {"S": LEADER_ITEM}},
            UpdateExpression="SET #t = :n, #w = :w",
            ConditionExpression="#l = :me AND #t = :t",
            ExpressionAttributeNames={"#t": TERM, "#l": LEADER, "#w": WORKERS},
            ExpressionAttributeValues={":n": {"N": str(self._term + 1)},
                                       ":me": {"S": self.worker_id},
                                       ":t": {"N": str(self._term)},
                                       ":w": {"N": str(self.fleet_size)}})
        if ok:
            self._term += 1
            self._renewed_at = now
            self._seen = (self.worker_id, self._term, now)
        else:
            log.warning("worker %s: lost the leader lock", self.worker_id)
            self._term = None

    def _check(self, now: float) -> bool:
        """Read the lock, take it over when it expired; whether its term was new to this
        worker."""
        answer = self.table.call(
            "GetItem", self.table.client.get_item, TableName=self.table.table_name,
            Key={WORKER_ID: {"S": LEADER_ITEM}}, ConsistentRead=True)
        item = answer.get("Item")
        if item is None:
            if self._write("PutItem", self.table.client.put_item,
                           Item={WORKER_ID: {"S": LEADER_ITEM}, LEADER: {"S": self.worker_id},
                                 TERM: {"N": "1"}},
                           ConditionExpression="attribute_not_exists(#k)",
                           ExpressionAttributeNames={"#k": WORKER_ID}):
                self._won(1, now)
            return False
        leader, term = item.get(LEADER, {}).get("S"), int(item.get(TERM, {}).get("N", "0"))
        self._readers = int(item.get(WORKERS, {}).get("N", "1"))
        changed = self._seen is None or self._seen[:2] != (leader, term)
        if changed:
            self._seen = (leader, term, now)
        assert self._seen is not None
        if now - self._seen[2] <= self.expiry_s and leader != self.worker_id:
            return changed
        # expired (or still naming this worker from an earlier run): take it over
        if self._write(
                "UpdateItem", self.table.client.update_item,
                Key={WORKER_ID: {"S": LEADER_ITEM}},
                UpdateExpression="SET #l = :me, #t = :n", ConditionExpression="#t = :t",
                ExpressionAttributeNames={"#t": TERM, "#l": LEADER},
                ExpressionAttributeValues={":n": {"N": str(term + 1)},
                                           ":me": {"S": self.worker_id},
                                           ":t": {"N": str(term)}}):
            self._won(term + 1, now)
        return False

    def _won(self, term: int, now: float) -> None:
        log.info("worker %s leads lease assignment (term %d)", self.worker_id, term)
        self._term = term
        self._renewed_at = now
        self._seen = (self.worker_id, term, now)
        self.took_over = term > 1

    def resign(self) -> None:
        """A stopping leader deletes the lock so another worker takes over at its next check
        instead of one failover time later."""
        if self._term is None:
            return
        term, self._term = self._term, None
        try:
            self._write("DeleteItem", self.table.client.delete_item,
                        Key={WORKER_ID: {"S": LEADER_ITEM}},
                        ConditionExpression="#l = :me AND #t = :t",
                        ExpressionAttributeNames={"#t": TERM, "#l": LEADER},
                        ExpressionAttributeValues={":me": {"S": self.worker_id},
                                                   ":t": {"N": str(term)}})
        except TABLE_ERRORS as exc:
            log.info("worker %s: giving up the leader lock failed: %r", self.worker_id, exc)


@dataclass
class LeaderMode:
    """What ``--lease-assigner leader`` gives a worker's taker."""

    lock: LeaderLock
    #: the worker's load reports: liveness whatever the assignment strategy, and the load
    #: itself for one that ``uses_load``
    reports: LoadBalancing

    @property
    def pass_interval_s(self) -> float:
        return self.lock.failover_time_s / 3

    @property
    def discovery_interval_s(self) -> float:
        return self.lock.failover_time_s / 2

    @property
    def held_discovery_interval_s(self) -> float:
        """How often a worker that holds leases queries the owner index regardless of notices:
        for an assignment whose notice it missed (it lost the noticed lease before renewing
        it; a leader of an older kclpy writes none). Such an assignment is free again
        anyway once it stayed untaken for the failover time."""
        return 3 * self.lock.failover_time_s

    @property
    def claim_within_s(self) -> float:
        """How long after the leader wrote an assignment the assignee may leave it untaken
        before it is judged dead: its Query interval, and a sixth of the failover time for
        that Query, the read and the take."""
        return self.discovery_interval_s + self.lock.failover_time_s / 6


@dataclass(frozen=True)
class Assignment:
    """One leader pass's decisions."""

    #: free or expired leases -> the worker to own them
    assign: tuple[tuple[Lease, str], ...] = ()
    #: live leases -> the worker to hand them to
    move: tuple[tuple[Lease, str], ...] = ()
    #: live workers the pass spread leases over
    workers: int = 0


def unclaimed(lease: Lease) -> bool:
    """Assigned by a leader and not taken yet: ``leaseOwner`` names a worker that never
    wrote the lease as its holder (a take or an adoption writes ``kclpyHolder``)."""
    return (lease.lease_owner is not None and lease.checkpoint_owner is None
            and lease.kclpy_holder != lease.lease_owner)


def known_below(known: AbstractSet[str] | None,
                leases: Iterable[Lease]) -> AbstractSet[str] | None:
    """``known`` (the lease keys of the shards this worker's last shard sync listed) and
    every lease in ``leases`` that descends from one of them. Only the leader syncs shards,
    so a worker that has just taken over plans with the listing of its last own sync -
    from start-up, perhaps - in which the children the previous leader created since do
    not appear: each of them was left unassigned until the new leader's first sync, up to
    a shard sync interval (simulator seed 403: a merge child unassigned for 5 s, then taken
    too late to read it before the stream's retention removed it). A lease below a known
    shard is a shard of the same stream that a sync created from the table's parents - unless
    its incarnation names another stream than its parent's lease does: a stream deleted and
    created again under the same name lists the former shard ids, and the former stream's
    children of them would be held waiting for the new shards to end."""
    if known is None:
        return None
    leases = list(leases)
    epochs = {lease.lease_key: lease.stream_epoch for lease in leases}
    below = set(known)
    rest = [lease for lease in leases if lease.lease_key not in below]
    grew = True
    while grew:
        grew = False
        for lease in list(rest):
            epoch = epochs[lease.lease_key]
            # a parent without a lease in the scan counts as of the same stream
            if any(not other_streams(epoch, epochs.get(parent))
                   for parent in lease.parent_lease_keys & below):
                below.add(lease.lease_key)
                rest.remove(lease)
                grew = True
    return below


def held_leases(leases: Iterable[Lease], *,
                is_expired: Callable[[Lease], bool]) -> dict[str, list[Lease]]:
    """Worker -> the live leases it holds (took, and is not handing off): those a notice to
    it can be written on (``LeaseTable.notify_holder``)."""
    held: dict[str, list[Lease]] = {}
    for lease in leases:
        owner = lease.lease_owner
        if (owner is not None and lease.kclpy_holder == owner and lease.checkpoint_owner is None
                and not is_expired(lease)):
            held.setdefault(owner, []).append(lease)
    return held


def live_workers(
    reports: Mapping[str, WorkerLoad],
    reported_at: Callable[[str], float],
    leases: Iterable[Lease],
    expired_at: Callable[[Lease], float | None],
    dead: dict[str, float],
    *,
    unchanged_for: Callable[[Lease], float],
    claim_within_s: float,
    holders: AbstractSet[str] = frozenset(),
    noticed: AbstractSet[str] = frozenset(),
) -> dict[str, WorkerLoad]:
    """The fresh reporters, less the dead: those owning a lease that expired after their
    last report (``expired_at``: when a lease expired on the leader's clock, None while it
    has not), and those that left a lease assigned to them ``unclaimed`` for longer than
    ``claim_within_s`` (a worker without leases shows it is alive only by its reports,
    which stay fresh for a while after it died). ``dead`` remembers them (worker -> its
    report when judged) until they report again, since their leases are soon assigned
    away.

    An assignment to one of ``holders`` (workers renewing a lease: they show they live)
    whose key is not in ``noticed`` (the leases this leader assigned with a notice) says
    nothing: such a worker queries for its leases only every
    ``LeaderMode.held_discovery_interval_s``; the lease is free again once it expires."""
    for lease in leases:
        holder = lease.checkpoint_owner or lease.lease_owner
        if holder is None or holder not in reports:
            continue
        at = expired_at(lease)
        stopped = at is not None and reported_at(holder) < at
        claimed_late = (unclaimed(lease) and unchanged_for(lease) > claim_within_s
                        and (holder not in holders or lease.lease_key in noticed))
        if stopped or claimed_late:
            dead[holder] = reported_at(holder)
    for worker in list(dead):
        if worker not in reports or reported_at(worker) > dead[worker]:
            del dead[worker]
    return {w: r for w, r in reports.items() if w not in dead}


def plan(
    leases: Iterable[Lease],
    live: Mapping[str, WorkerLoad],
    *,
    is_expired: Callable[[Lease], bool],
    known_lease_keys: AbstractSet[str] | None,
    no_move: Collection[str],
    strategy: AssignmentStrategy,
    rng: random.Random,
    settings: LoadSettings = DEFAULT_SETTINGS,
    dead: Collection[str] = (),
    known_kbps: Mapping[str, float] | None = None,
    recency: Mapping[str, tuple[float, float]] | None = None,
) -> Assignment:
    """Who should own what: free and expired leases, and those assigned to a worker judged
    ``dead`` that never took them (``unclaimed``), go to the live workers with the fewest
    leases; then the assignment ``strategy`` moves live leases (``AssignmentStrategy.moves``:
    by count, counts end within one of each other; by load, on every report first projected
    onto the leases just scanned and assigned - ``assignment.project`` - with
    ``settings``). A lease being handed off counts for the worker it moves to and never
    moves again, nor does one in ``no_move``; a lease whose owner is not live but renews it
    (a Java KCL worker, a worker whose reports stopped) is left alone and counted for
    nobody.

    Among workers with as few leases, a free lease goes first to the one with the highest
    ``recency`` (worker -> how lately it showed it lives, compared as tuples; absent: the
    oldest), else at random: when workers were just found dead, the live ones that hold
    nothing look alike (their reports stay fresh for a while after they die), and a lease
    handed to a dead one comes back only once it stayed untaken."""
    if not live:
        return Assignment()
    owned: dict[str, list[Lease]] = {worker: [] for worker in live}
    free: list[Lease] = []
    for lease in sorted(leases, key=lambda lease: lease.lease_key):
        if (lease.is_finished or lease.parked is not None
                or (known_lease_keys is not None and lease.lease_key not in known_lease_keys)):
            continue
        if (lease.lease_owner is None or is_expired(lease)
                or (lease.lease_owner in dead and unclaimed(lease))):
            free.append(lease)
        elif lease.lease_owner in owned:
            owned[lease.lease_owner].append(lease)
    counts = {worker: len(keys) for worker, keys in owned.items()}
    order = {worker: rng.random() for worker in live}
    never = (-math.inf, -math.inf)
    rank = {worker: tuple(-at for at in (recency or {}).get(worker, never)) for worker in live}
    heap = [(count, rank[worker], order[worker], worker) for worker, count in counts.items()]
    heapq.heapify(heap)
    assign: list[tuple[Lease, str]] = []
    for lease in free:
        count, lately, tie, worker = heapq.heappop(heap)
        assign.append((lease, worker))
        counts[worker] = count + 1
        heapq.heappush(heap, (count + 1, lately, tie, worker))
    movable = {worker: [lease for lease in keys
                        if lease.checkpoint_owner is None and lease.lease_key not in no_move]
               for worker, keys in owned.items()}
    move = strategy.moves(FleetView(
        live, owned, assign, counts, movable, order, settings, known_kbps))
    return Assignment(tuple(assign), tuple(move), len(live))


class RecentMoves:
    """Leases the leader moved lately: not moved again until their new holder has reported
    their load twice (two balancing rounds), so a lease's load is never judged on a report
    from before it moved."""

    def __init__(self) -> None:
        self._moved: dict[str, float] = {}

    def add(self, lease_key: str, now: float) -> None:
        self._moved[lease_key] = now

    def keys(self, now: float, hold_s: float) -> frozenset[str]:
        self._moved = {k: at for k, at in self._moved.items() if now - at < hold_s}
        return frozenset(self._moved)
