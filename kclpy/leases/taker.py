"""Getting leases: the taker cycle - scan, take, steal, finish handoffs, clean up.

It scans the table as often as ``budget.py`` allows (what the renewals saved pay for), and
in addition right when an overdue lease (its owner missed a renewal) reaches the failover
time, so a dead worker's leases move about one failover time after its last renewal.
Which free leases to take is decided by ``balancing.py`` and which live ones to steal by
the assignment strategy (``assignment.py``); this module carries the decisions out and
remembers what it is waiting for. :class:`TakerCore` is what every taker does (take, steal,
handoffs, scans, cleanup); :class:`LeaseTaker` is the worker-decides cycle on it, and
``leading.py``'s ``LeaderTaker`` the cycle with a leader (``--lease-assigner leader``).

*Graceful handoff* (the Java KCL 3.x ``checkpointOwner`` protocol, decisions in
``handoff.py``): with it on, a steal does not take a live worker's lease outright. It writes
``leaseOwner = thief, checkpointOwner = owner``; the owner keeps renewing (fenced on
``checkpointOwner``), lets its processor finish in ``shutdown_requested`` and then removes
``checkpointOwner`` (a release through its fence). Only then does the thief adopt the lease,
from the checkpoint the owner left. A thief whose owner neither lets go nor renews takes the
lease when it expires; one whose owner keeps renewing but never lets go (a Java 2.x worker
does not know the attribute) takes it after the handoff timeout plus the failover time.
A lease whose holder does not speak the protocol (``mixed.py``: a Java KCL 2.x worker) is
never asked: it is stolen outright, as Java 2.x steals.
Pending handoffs are polled between scans with a cheap read of just that lease.

Takes and adoptions write under the lease's lock of the held set, so they never interleave
with a write of the same lease through the fence.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kclpy.errors import LeaseLostError
from kclpy.leases import cleanup, handoff, mixed
from kclpy.leases.assignment import COUNT, AssignmentStrategy, TakerView
from kclpy.leases.balancing import Balancer
from kclpy.leases.budget import ScanBudget
from kclpy.leases.dynamo import TABLE_ERRORS
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.load import LoadBalancing
from kclpy.leases.table import LeaseTable
from kclpy.metrics import (
    EXPIRED_LEASES,
    LEASES_STOLEN,
    LEASES_TAKEN,
    LIST_LEASES,
    NEEDED_LEASES,
    NOWHERE,
    NUM_WORKERS,
    TAKE_CYCLE,
    TAKEN_LEASES,
    TOTAL_LEASES,
    Metrics,
)

log = logging.getLogger(__name__)


#: how far past an overdue lease's expiry the scan that takes it is made
EXPIRY_MARGIN_S = 0.05


@dataclass(frozen=True)
class TakerSettings:
    """The taker's options, as plain values."""

    failover_time_s: float
    graceful_handoff: bool
    graceful_handoff_timeout_s: float
    cleanup_leases: bool
    #: a fixed taker interval (None: as often as the scan budget allows)
    interval_s: float | None = None


class TakerCore(abc.ABC):
    """What every taker does, whoever decides: take, steal, finish handoffs, scan, clean
    up. Cycles are serialised; its queries are thread-safe."""

    def __init__(
        self,
        table: LeaseTable,
        held: HeldSet,
        balancer: Balancer,
        budget: ScanBudget,
        settings: TakerSettings,
        *,
        clock: Callable[[], float],
        metrics: Metrics | None = None,
        strategy: AssignmentStrategy = COUNT,
    ) -> None:
        self.table = table
        self.held = held
        self.worker_id = held.worker_id
        self.failover_time_s = settings.failover_time_s
        self.graceful_handoff = settings.graceful_handoff
        self.graceful_handoff_timeout_s = settings.graceful_handoff_timeout_s
        self.cleanup_leases = settings.cleanup_leases
        #: a fixed taker interval (None: as often as the scan budget allows)
        self.interval_s = settings.interval_s
        self._balancer = balancer
        #: which live leases move (``leaseAssignment``)
        self._strategy = strategy
        self._budget = budget
        self._clock = clock
        self._metrics = metrics if metrics is not None else NOWHERE
        #: guards the fields below (never held while calling DynamoDB)
        self._state = threading.Lock()
        #: handoffs to this worker not finished yet: lease key -> (clock() when asked,
        #: the lease counter then)
        self._pending: dict[str, tuple[float, int]] = {}
        #: lease key -> taker cycle in which it was lost; not stolen back in the next cycle
        self._lost_in_cycle: dict[str, int] = {}
        self._known_lease_keys: frozenset[str] | None = None
        #: the last scan found a live lease of a worker that does not speak graceful handoff
        self._java_peers = False
        #: the leases of the last scan, for readers that must not wait for a cycle
        self._last_scan: list[Lease] = []
        self._last_scan_at: float | None = None
        #: clock() when the last scan was started, successful or not
        self._last_scan_attempt: float | None = None
        #: serialises cycles (the background thread and direct callers)
        self._cycle_lock = threading.Lock()
        self._cycle = 0
        self._stale_handoffs = mixed.StaleHandoffs(
            settings.graceful_handoff_timeout_s + 2 * settings.failover_time_s)
        #: set when the worker shuts down: a led cycle under way writes nothing more
        self._stopping = threading.Event()
        #: whether this worker can consume a lease key (``set_consumable``)
        self._consumable: Callable[[str], bool] | None = None

    @abc.abstractmethod
    def run_once(self) -> list[Lease]:
        """One cycle; returns the leases newly taken (copies)."""

    @abc.abstractmethod
    def next_scan(self) -> float:
        """When the next cycle is due (this worker's clock)."""

    def _begin_cycle(self) -> None:
        with self._state:
            self._cycle += 1
            self._last_scan_attempt = self._clock()

    # -- the fleet's side of the decision (a leader's, ``leading.py``) ----------------------

    @abc.abstractmethod
    def leads(self) -> bool | None:
        """Whether this worker leads; None when every worker decides for itself."""

    @abc.abstractmethod
    def survey(self) -> bool:
        """Ask for a scan of the whole table soon by a worker that does not scan by itself;
        whether this asks anew (the cycle should be woken)."""

    @abc.abstractmethod
    def heard_notice(self) -> None:
        """A renewal returned a leader's assignment notice."""

    @abc.abstractmethod
    def leave(self) -> None:
        """At shutdown, once the last cycle ended, before the leases are released."""

    @abc.abstractmethod
    def hand_over(self, lease_key: str) -> str | None:
        """For a stopping worker that released ``lease_key``: the worker it was handed to
        (None: left to whoever takes it)."""

    @abc.abstractmethod
    def resign(self) -> None:
        """A stopping worker gives up its part in the decision."""

    # -- stealing and handoffs --------------------------------------------------------------

    def steal(self, lease: Lease) -> Lease | None:
        """Take a lease from a live worker: with graceful handoff, ask its owner to let go
        (returns None; the lease arrives when the owner has finished), else take outright.
        Nothing is asked for a lease this worker would not consume (``_consumes``)."""
        if not self.graceful_handoff or not mixed.speaks_handoff(lease):
            return self._take(lease, stolen=True)
        if not self._consumes(lease):
            return None
        with self.held.lock_for(lease.lease_key):
            try:
                asked_at_counter = self.table.set_checkpoint_owner(
                    lease, self.worker_id).lease_counter
            except (LeaseLostError, *TABLE_ERRORS) as exc:
                if not self._request_landed(lease):
                    log.info("worker %s: no handoff of %s asked: %r",
                             self.worker_id, lease.lease_key, exc)
                    return None
                asked_at_counter = lease.lease_counter
            with self._state:
                self._pending[lease.lease_key] = (self._clock(), asked_at_counter)
        log.info("worker %s asked %s to hand off %s",
                 self.worker_id, lease.lease_owner, lease.lease_key)
        return None

    def _request_landed(self, lease: Lease) -> bool:
        """Asking for ``lease`` failed: read it to learn whether the request was written
        all the same (``handoff.request_landed``)."""
        try:
            current = self.table.get(lease.lease_key)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: reading %s after asking for it failed: %r",
                        self.worker_id, lease.lease_key, exc)
            return False
        return handoff.request_landed(lease, current, self.worker_id)

    def poll_handoffs(self) -> list[Lease]:
        """Between scans, read each pending handoff's lease and finish the ones whose owner
        let go. Returns the leases adopted."""
        adopted = []
        for key in self.pending_handoffs():
            try:
                lease = self.table.get(key)
            except TABLE_ERRORS as exc:
                log.warning("worker %s: reading %s failed: %r", self.worker_id, key, exc)
                continue
            now = self._clock()
            if lease is not None:
                with self._cycle_lock:
                    self._balancer.observe_one(lease, now)
            fresh = self._progress_handoff(key, lease, scanned_at=now if lease else None)
            if fresh is not None:
                adopted.append(fresh)
        return adopted

    def give_up_pending(self) -> None:
        """For a stopping worker: a lease handed to it and already let go is released, so
        nobody waits for it to expire. One its previous owner still holds is left alone: it
        expires once that owner lets go, a failover time later."""
        for key in self.pending_handoffs():
            try:
                lease = self.table.get(key)
                if (
                    lease is not None
                    and lease.lease_owner == self.worker_id
                    and lease.checkpoint_owner is None
                ):
                    self.table.evict(lease)
            except (LeaseLostError, *TABLE_ERRORS) as exc:
                log.info("worker %s: leaving %s to expire: %r", self.worker_id, key, exc)
        with self._state:
            self._pending.clear()

    def remember_lost(self, lease_key: str) -> None:
        """A lease lost or handed off now is not stolen back in the next cycle (the held
        set's drop hook)."""
        with self._state:
            self._lost_in_cycle[lease_key] = self._cycle

    # -- queries ---------------------------------------------------------------------------

    def set_known_lease_keys(self, lease_keys: set[str] | None) -> None:
        with self._state:
            self._known_lease_keys = None if lease_keys is None else frozenset(lease_keys)

    def set_consumable(self, fn: Callable[[str], bool] | None) -> None:
        """Which lease keys this worker takes (its streams'). With a leader it alone
        decides: only the leader syncs shards, so the others learn of a new child shard
        when it is assigned to them. Without one the known shards decide, and this only
        closes their window (``_consumes``)."""
        self._consumable = fn

    def _consumes(self, lease: Lease) -> bool:
        """The last check before any tenure starts (``_start_tenure``: a take, a steal, a
        leader's own take, an adoption or a take after a handoff timed out) or a handoff is
        asked for. The known shards drop a stream that left the tracker only once shard
        sync has listed every stream still consumed (slow under load); a take in that
        window got the dropped stream's lease and the worker released it at once, with no
        processor - and a leader then counted the live worker it had assigned the lease to
        as dead for not claiming it."""
        consumable = self._consumable
        return consumable is None or consumable(lease.lease_key)

    def pending_handoffs(self) -> set[str]:
        with self._state:
            return set(self._pending)

    def java_peers(self) -> bool:
        """The last scan found a live lease held by a Java KCL 2.x worker (``mixed.py``)."""
        with self._state:
            return self._java_peers

    def all_leases(self) -> list[Lease]:
        with self._state:
            return [lease.copy() for lease in self._last_scan]

    def idle_leases(self) -> list[Lease]:
        """Leases of the last scan that no worker runs: free, or not renewed for longer than
        the failover time as far as this worker has watched them."""
        with self._state:
            at = self._last_scan_at
            if at is None:
                return []
            return [lease.copy() for lease in self._last_scan
                    if self._balancer.is_expired(lease, at)]

    def run_elsewhere(self) -> frozenset[str]:
        """Keys of the last scan's leases that another worker is seen to run: owned, not
        expired, and renewed while this worker watched."""
        with self._state:
            at = self._last_scan_at
            if at is None:
                return frozenset()
            return frozenset(
                lease.lease_key for lease in self._last_scan
                if lease.lease_owner != self._balancer.worker_id
                and not self._balancer.is_expired(lease, at)
                and self._balancer.seen_renewed(lease.lease_key))

    def recent_lease_keys(self, max_age_s: float) -> frozenset[str] | None:
        with self._state:
            at = self._last_scan_at
            if at is None or self._clock() - at > max_age_s:
                return None
            return frozenset(lease.lease_key for lease in self._last_scan)

    # -- internals ---------------------------------------------------------------------------

    def _progress_handoffs(self, scanned: Sequence[Lease], now: float) -> list[Lease]:
        """Move every pending handoff on from a scan taken at ``now``: the leases adopted.
        Both deciders do it from their own scans; the taker loop's poll of pending handoffs
        runs only when no cycle comes first."""
        by_key = {lease.lease_key: lease for lease in scanned}
        return [fresh for key in sorted(self.pending_handoffs())
                if (fresh := self._progress_handoff(key, by_key.get(key), scanned_at=now))]

    def _progress_handoff(
        self, key: str, lease: Lease | None, *, scanned_at: float | None
    ) -> Lease | None:
        """Move one pending handoff on, given the lease as just read (``scanned_at`` when it
        came from a scan, so the balancer's expiry view applies)."""
        with self._state:
            pending = self._pending.get(key)
        if pending is None:
            return None
        asked_at, asked_at_counter = pending
        expired = (
            scanned_at is not None
            and lease is not None
            and self._balancer.is_expired(lease, scanned_at)
        )
        waited = self._clock() - asked_at
        step = handoff.next_step(
            lease,
            self.worker_id,
            asked_at_counter=asked_at_counter,
            expired=expired,
            overdue=waited > self.graceful_handoff_timeout_s + self.failover_time_s,
        )
        if step is handoff.Step.WAIT:
            return None
        if step is handoff.Step.FORGET:
            with self._state:
                self._pending.pop(key, None)
            return None
        assert lease is not None
        if step is handoff.Step.ADOPT:
            return self._adopt(lease)
        log.warning("worker %s: %s did not hand off %s; taking it",
                    self.worker_id, lease.checkpoint_owner, key)
        return self._take(lease, stolen=True)

    def _adopt(self, lease: Lease) -> Lease | None:
        fresh = self._start_tenure(lease, self.table.adopt, "adopting")
        if fresh is not None:
            self._metrics.inc(LEASES_STOLEN)
            log.info("worker %s: handoff of %s complete", self.worker_id, lease.lease_key)
        return fresh

    def _take(self, lease: Lease, *, stolen: bool) -> Lease | None:
        fresh = self._start_tenure(
            lease, lambda read: self.table.take(read, self.worker_id), "taking")
        if fresh is not None:
            self._metrics.inc(LEASES_STOLEN if stolen else LEASES_TAKEN)
        return fresh

    def _start_tenure(self, lease: Lease, write: Callable[[Lease], Lease],
                      what: str) -> Lease | None:
        """Every way this worker starts holding a lease (a take, an adoption) goes through
        here, so none can skip ``_consumes``: a lease of a stream this worker no longer
        consumes is not written at all (a pending handoff of it is dropped). The fresh
        lease, or None when it is not consumed or changed before it could be written."""
        if not self._consumes(lease):
            with self._state:
                self._pending.pop(lease.lease_key, None)
            return None
        with self.held.lock_for(lease.lease_key):
            sent_at = self._clock()
            try:
                fresh = write(lease)
            except LeaseLostError:
                log.info("worker %s: lease %s changed before %s it",
                         self.worker_id, lease.lease_key, what)
                return None
            except TABLE_ERRORS as exc:
                log.warning("worker %s: %s %s failed: %r", self.worker_id, what,
                            lease.lease_key, exc)
                return None
            fresh.concurrency_token = uuid.uuid4().hex
            self._install(fresh, sent_at)
        return fresh.copy()

    def _install(self, lease: Lease, sent_at: float) -> None:
        """A lease taken or adopted: held from now (a new tenure), no longer pending."""
        self.held.install(lease, sent_at)
        with self._state:
            self._pending.pop(lease.lease_key, None)

    def _scanned(self, leases: list[Lease]) -> tuple[float, frozenset[str] | None]:
        """What both passes (scanning and leading) do first with a fresh scan: the balancer
        learns which leases changed (expiry is judged from it), and the scan is kept for shard
        sync and the status page. Returns the scan's time and the shards this worker knows."""
        now = self._clock()
        self._balancer.observe(leases, now)
        with self._state:
            self._last_scan = leases
            self._last_scan_at = now
            return now, self._known_lease_keys

    def _java_side(self, leases: list[Lease], now: float) -> bool:
        """``_mixed_fleet`` for a pass, remembered for the consumers (``java_peers``): True
        while live Java KCL 2.x workers share the table. Called after the scanning pass has
        progressed its handoffs, whose pending set the stale-handoff check reads."""
        java_peers = bool(self._mixed_fleet(leases, now))
        with self._state:
            self._java_peers = java_peers
        return java_peers

    def _mixed_fleet(self, leases: list[Lease], now: float) -> list[Lease]:
        """The Java KCL 2.x side of a scan (``mixed.py``): undo the handoff requests nobody
        will finish, and return the leases live workers that do not speak graceful handoff
        hold (the balancer then counts finished leases as Java does)."""
        def expired(lease: Lease) -> bool:
            return self._balancer.is_expired(lease, now)

        for lease in self._stale_handoffs.observe(
                leases, now, is_expired=expired, waiting_for=self.pending_handoffs()):
            restore = not mixed.speaks_handoff(lease)
            try:
                self.table.abandon_handoff(lease, restore_holder=restore)
            except (LeaseLostError, *TABLE_ERRORS) as exc:
                log.info("worker %s: clearing the stale handoff of %s failed: %r",
                         self.worker_id, lease.lease_key, exc)
                continue
            log.warning("worker %s: nobody finished the handoff of %s (leaseOwner %s, "
                        "checkpointOwner %s); cleared it, the lease stays with %s",
                        self.worker_id, lease.lease_key, lease.lease_owner,
                        lease.checkpoint_owner,
                        lease.checkpoint_owner if restore else lease.lease_owner)
        return mixed.foreign_live(leases, expired)

    def _clean_up(self, leases: list[Lease], now: float) -> None:
        """Delete the finished leases ``cleanup.py`` says this worker should delete: never
        one another live worker holds (its holder deletes it), and one this worker holds
        (``mixed.py``: kept until deleted while Java workers share the table) through the
        held set, so that its renewals stop first."""
        keep = {lease.lease_key for lease in leases
                if mixed.holder(lease) not in (None, self.worker_id)
                and not self._balancer.is_expired(lease, now)}
        held = set(self.held.entries())
        for lease in cleanup.deletable(leases, self.worker_id, keep - held, held):
            try:
                deleted = (self._delete_held(lease.lease_key) if lease.lease_key in held
                           else self.table.delete_finished(lease))
            except TABLE_ERRORS as exc:
                log.warning("worker %s: deleting %s failed: %r",
                            self.worker_id, lease.lease_key, exc)
                continue
            if deleted:
                log.info("worker %s deleted the lease of finished shard %s",
                         self.worker_id, lease.lease_key)

    def _delete_held(self, key: str) -> bool:
        """Stop holding a finished lease and delete it, conditional on the counter this
        worker last wrote and on the item being finished still (the lease's lock held, so no
        renewal of it runs meanwhile). A lease that is not finished any more - an operator's
        request came in since the scan, in the held copy or only in the item - stays held,
        for the consumer that reads what was asked."""
        with self.held.lock_for(key):
            entry = self.held.entry(key)
            if entry is None or not entry.lease.is_finished:
                return False
            if not self.table.delete_finished(entry.lease):
                return False
            self.held.forget(key)
            return True

    def stop_taking(self) -> None:
        """The worker shuts down: a led cycle under way (a leader's pass makes many writes,
        each as slow as its answer) stops before its next write, so the shutdown does not
        wait for it while the leases it took have no consumer."""
        self._stopping.set()


class LeaseTaker(TakerCore):
    """The worker-decides taker: each worker scans the table and decides alone (the Java
    KCL 2.x way), free leases by ``balancing.py``'s count rules and steals by the
    assignment strategy."""

    def __init__(
        self,
        table: LeaseTable,
        held: HeldSet,
        balancer: Balancer,
        budget: ScanBudget,
        settings: TakerSettings,
        *,
        clock: Callable[[], float],
        metrics: Metrics | None = None,
        strategy: AssignmentStrategy = COUNT,
        load: LoadBalancing | None = None,
    ) -> None:
        super().__init__(table, held, balancer, budget, settings, clock=clock,
                         metrics=metrics, strategy=strategy)
        #: this worker's load reports, for a strategy that ``uses_load``
        self._load = load
        #: leases per live worker as of the last scan: what the scan budget is based on
        self._share = 0.0

    # Every worker decides for itself: no leader to lead, ask, hear, leave or hand over to.

    def leads(self) -> bool | None:
        return None

    def survey(self) -> bool:
        return False

    def heard_notice(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def hand_over(self, lease_key: str) -> str | None:
        return None

    def resign(self) -> None:
        pass

    def run_once(self) -> list[Lease]:
        """One cycle: scan, decide, take, finish handoffs, clean up. Returns the leases newly
        taken (copies)."""
        with self._cycle_lock:
            self._begin_cycle()
            self._budget.spend_scan()
            started = time.perf_counter()
            sent_at = self._clock()
            try:
                leases = self.table.list_leases(consistent=False)
            except TABLE_ERRORS as exc:
                log.warning("worker %s: lease scan failed, no leases taken: %r",
                            self.worker_id, exc)
                self._balancer.scan_failed(sent_at)
                elapsed = time.perf_counter() - started
                self._metrics.call(LIST_LEASES, elapsed, False)
                self._metrics.call(TAKE_CYCLE, elapsed, False)
                return []
            self._metrics.call(LIST_LEASES, time.perf_counter() - started, True)
            now, known = self._scanned(leases)
            with self._state:
                cycle = self._cycle
                self._lost_in_cycle = {
                    key: lost for key, lost in self._lost_in_cycle.items() if cycle - lost <= 1
                }
                no_steal = set(self._lost_in_cycle)
            taken = self._progress_handoffs(leases, now)
            java_peers = self._java_side(leases, now)
            held = set(self.held.entries())
            plan = self._balancer.plan(held=held, known_lease_keys=known, no_steal=no_steal,
                                       now=now, java_peers=java_peers)
            with self._state:
                self._share = plan.share
            taken += [fresh for lease in plan.take
                      if (fresh := self._take(lease, stolen=False))]
            steals = self._strategy.steals(TakerView(
                leases, held, live=lambda lease: not self._balancer.is_expired(lease, now),
                no_steal=no_steal, busy=bool(plan.take or self.pending_handoffs()),
                count_steals=plan.steal, load=self._load))
            taken += [fresh for lease in steals if (fresh := self.steal(lease))]
            if taken:
                log.info("worker %s took %s", self.worker_id, ", ".join(t.lease_key for t in taken))
            if self.cleanup_leases:
                self._clean_up(leases, now)
            self._metrics.set(TAKEN_LEASES, len(taken))
            self._metrics.set(NUM_WORKERS, plan.workers)
            self._metrics.set(EXPIRED_LEASES, plan.expired)
            self._metrics.set(TOTAL_LEASES, plan.total)
            self._metrics.set(NEEDED_LEASES, plan.needed)
            self._metrics.call(TAKE_CYCLE, time.perf_counter() - started, True)
            return taken

    def next_scan(self) -> float:
        """When to scan next: when the budget affords it (or the fixed interval after the
        last scan), or earlier, right when an overdue lease expires."""
        now = self._clock()
        held = set(self.held.entries())
        with self._state:
            scanned = len(self._last_scan)
            last_attempt = self._last_scan_attempt
            share = self._share
        if self.interval_s is not None:
            return (now if last_attempt is None else last_attempt) + self.interval_s
        self._budget.observe(share=share, leases=scanned)
        regular = now + self._budget.next_scan_in()
        with self._cycle_lock:  # the balancer's view changes in cycles only
            expiry = self._balancer.next_expiry(
                held=held, overdue_after=1.25 * self.failover_time_s / 2, now=now)
        if expiry is not None:
            return min(regular, expiry + EXPIRY_MARGIN_S)
        return regular
