"""Getting leases: the taker cycle - scan, take, steal, finish handoffs, clean up.

It scans the table as often as ``budget.py`` allows (what the renewals saved pay for), and
in addition right when an overdue lease (its owner missed a renewal) reaches the failover
time, so a dead worker's leases move about one failover time after its last renewal.
Which leases to take or steal is decided by ``balancing.py``; this module carries the
decision out and remembers what it is waiting for.

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

import logging
import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

from botocore.exceptions import ClientError

from kclpy.errors import LeaseLostError
from kclpy.leases import cleanup, handoff, leader, mixed
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
from kclpy.retry import spread

log = logging.getLogger(__name__)


#: how far past an overdue lease's expiry the scan that takes it is made
_EXPIRY_MARGIN_S = 0.05
#: leases of one holder a leader tries to write an assignment notice on
_NOTICE_TRIES = 2


class LeaseTaker:
    """One worker's taker. Cycles are serialised; its queries are thread-safe."""

    def __init__(
        self,
        table: LeaseTable,
        held: HeldSet,
        balancer: Balancer,
        budget: ScanBudget,
        *,
        failover_time_s: float,
        graceful_handoff: bool,
        graceful_handoff_timeout_s: float,
        cleanup_leases: bool,
        clock: Callable[[], float],
        metrics: Metrics | None = None,
        interval_s: float | None = None,
        load: LoadBalancing | None = None,
        leader_mode: leader.LeaderMode | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.table = table
        self.held = held
        self.worker_id = held.worker_id
        self.failover_time_s = failover_time_s
        self.graceful_handoff = graceful_handoff
        self.graceful_handoff_timeout_s = graceful_handoff_timeout_s
        self.cleanup_leases = cleanup_leases
        #: a fixed taker interval (None: as often as the scan budget allows)
        self.interval_s = interval_s
        self._balancer = balancer
        #: with ``--lease-assignment load``: the load reports and the steals by load
        self._load = load
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
        #: leases per live worker as of the last scan: what the scan budget is based on
        self._share = 0.0
        #: serialises cycles (the background thread and direct callers)
        self._cycle_lock = threading.Lock()
        self._cycle = 0
        self._stale_handoffs = mixed.StaleHandoffs(
            graceful_handoff_timeout_s + 2 * failover_time_s)
        #: with ``--lease-assigner leader`` (``leader.py``): the election, the reports, and
        #: when this worker next scans as leader, balances by load, and looks for its leases
        self._leader = leader_mode
        # only a leader draws (made only then: a simulated history seeds every generator
        # from its own, so one more would change every history)
        self._rng = (rng if rng is not None or leader_mode is None
                     else random.Random())
        self._next_pass: float | None = None
        self._next_round: float | None = None
        #: clock() of this worker's last owner index Query, whether it held a lease then,
        #: and whether a leader's assignment notice arrived since (``heard_notice``)
        self._last_discovery: float | None = None
        self._held_at_discovery = False
        #: how long after the last Query a worker that holds leases Queries again, drawn
        #: at each Query (``LeaderMode.held_discovery_interval_s``, spread)
        self._held_discovery_s = 0.0
        self._notice_heard = False
        self._recent_moves = leader.RecentMoves()
        #: set when the worker shuts down: a led cycle under way writes nothing more
        self._stopping = threading.Event()
        #: whether this worker can consume a lease key (``set_consumable``)
        self._consumable: Callable[[str], bool] | None = None
        #: workers the leader judged dead -> their report then (``leader.live_workers``)
        self._dead: dict[str, float] = {}
        #: lease key -> when the leader judges its assignee dead if it is still untaken then
        #: (a pass is made right then, as at an overdue lease's expiry)
        self._claims: dict[str, float] = {}
        #: lease keys the leader assigned to a holder it then notified (``_notify``); the
        #: others assigned to holders are judged by their expiry (``leader.live_workers``)
        self._noticed: set[str] = set()
        #: whether this worker led at its last cycle
        self._led = False
        #: with a leader: a scan asked for by a worker that does not lead (``survey``), and
        #: clock() of the last one
        self._survey_asked = False
        self._last_survey: float | None = None
        #: the last Query of the owner index was refused (``_owned_keys``)
        self._index_unreadable = False
        #: stopping (``leave``, ``hand_over``): whether the report and the lock were given
        #: up, the fleet as read once (live worker -> the leases it owns, and those it
        #: holds), and how many released leases went to each worker
        self._left = False
        self._leaving_view: tuple[dict[str, int], dict[str, list[Lease]]] | None = None
        self._handed: dict[str, int] = {}

    # -- the cycle -------------------------------------------------------------------------

    def run_once(self) -> list[Lease]:
        """One cycle: scan, decide, take, finish handoffs, clean up. Returns the leases newly
        taken (copies). With a leader, the led cycle instead (``_run_led``)."""
        if self._leader is not None:
            return self._run_led(self._leader)
        with self._cycle_lock:
            with self._state:
                self._cycle += 1
                self._last_scan_attempt = self._clock()
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
            by_key = {lease.lease_key: lease for lease in leases}
            taken = [
                fresh
                for key in sorted(self.pending_handoffs())
                if (fresh := self._progress_handoff(key, by_key.get(key), scanned_at=now))
            ]
            java_peers = self._java_side(leases, now)
            held = set(self.held.entries())
            plan = self._balancer.plan(held=held, known_lease_keys=known, no_steal=no_steal,
                                       now=now, java_peers=java_peers)
            with self._state:
                self._share = plan.share
            taken += [fresh for lease in plan.take
                      if (fresh := self._take(lease, stolen=False))]
            steals = plan.steal if self._load is None else self._load.steals(
                leases, held=held, live=lambda lease: not self._balancer.is_expired(lease, now),
                no_steal=no_steal, busy=bool(plan.take or self.pending_handoffs()),
                count_steals=plan.steal)
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
        last scan), or earlier, right when an overdue lease expires. With a leader: when
        the lock, the discovery of this worker's leases or (leading) the next pass is due."""
        now = self._clock()
        held = set(self.held.entries())
        if self._leader is not None:
            return self._next_led(self._leader, now)
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
            return min(regular, expiry + _EXPIRY_MARGIN_S)
        return regular

    # -- led by one worker (``leader.py``) ------------------------------------------------

    def _next_led(self, mode: leader.LeaderMode, now: float) -> float:
        due = [mode.lock.next_tick(), self._next_discovery(mode, now)]
        if self._survey_asked and not mode.lock.is_leader():
            due.append(self._next_survey(mode, now))
        if mode.lock.is_leader():
            due.append(now if self._next_pass is None else self._next_pass)
            if self._claims:
                due.append(min(self._claims.values()))
            with self._cycle_lock:
                expiry = self._balancer.next_expiry(
                    held=frozenset(), overdue_after=1.25 * self.failover_time_s / 2, now=now)
            if expiry is not None:
                due.append(expiry + _EXPIRY_MARGIN_S)
        return min(due)

    def _run_led(self, mode: leader.LeaderMode) -> list[Lease]:
        """Report this worker's load, keep the election going, scan and assign when leading
        and due, and take what the owner index says is assigned to this worker."""
        with self._cycle_lock:
            with self._state:
                self._cycle += 1
                self._last_scan_attempt = self._clock()
            mode.reports.report_if_due(set(self.held.entries()))
            leads = mode.lock.tick()
            now = self._clock()
            if leads and not self._led:
                # On a cold start the first leader lets the fleet's first reports arrive;
                # one that took over scans at once: it judges expiry only on what it saw.
                self._next_pass = now + (0.0 if mode.lock.took_over else mode.pass_interval_s)
            self._led = leads
            taken: list[Lease] = []
            expiry = self._balancer.next_expiry(
                held=frozenset(), overdue_after=1.25 * self.failover_time_s / 2, now=now)
            if self._stopping.is_set():
                return []
            claim = min(self._claims.values(), default=None)
            if leads and (self._next_pass is None or now >= self._next_pass
                          or (expiry is not None and now >= expiry)
                          or (claim is not None and now >= claim)):
                taken += self._lead(mode)
            now = self._clock()
            if now >= self._next_discovery(mode, now):
                # spread, so that the workers of a fleet started at once do not Query in step
                held_discovery_s = spread(mode.held_discovery_interval_s, 0.5, 1.5, self._rng)
                with self._state:
                    self._notice_heard = False
                    self._last_discovery = now
                    self._held_at_discovery = len(self.held) > 0
                    self._held_discovery_s = held_discovery_s
                taken += self._discover()
            if not leads and self._survey_asked and now >= self._next_survey(mode, now):
                self._survey()
            if taken:
                log.info("worker %s took %s", self.worker_id, ", ".join(t.lease_key for t in taken))
            return taken

    def _lead(self, mode: leader.LeaderMode) -> list[Lease]:
        """One leader pass: scan, decide (``leader.plan``), write the decisions."""
        sent_at = self._clock()
        self._next_pass = sent_at + mode.pass_interval_s
        try:
            leases = self.table.list_leases(consistent=False)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: leader's lease scan failed: %r", self.worker_id, exc)
            self._balancer.scan_failed(sent_at)
            return []
        now, known = self._scanned(leases)
        self._java_side(leases, now)
        reports = mode.reports.fleet()
        if reports is None:
            return []

        def expired_at(lease: Lease) -> float | None:
            if lease.lease_owner is None or not self._balancer.is_expired(lease, now):
                return None
            return now - self._balancer.unchanged_for(lease.lease_key, now) + self.failover_time_s

        held_by = leader.held_leases(
            leases, is_expired=lambda lease: self._balancer.is_expired(lease, now))
        self._noticed &= {lease.lease_key for lease in leases if leader.unclaimed(lease)}
        live = leader.live_workers(
            reports, mode.reports.reported_at, leases, expired_at, self._dead,
            unchanged_for=lambda lease: self._balancer.unchanged_for(lease.lease_key, now),
            claim_within_s=mode.claim_within_s, holders=held_by.keys(),
            noticed=self._noticed)
        self._claims = {lease.lease_key: self._claims[lease.lease_key] for lease in leases
                        if lease.lease_key in self._claims and leader.unclaimed(lease)
                        and self._claims[lease.lease_key] > now}
        mode.lock.fleet_size = len(live)
        settings = mode.reports.settings
        balance = not mode.by_load or self._next_round is None or now >= self._next_round
        if mode.by_load and balance:
            self._next_round = now + settings.balance_interval_s
        hold = 2 * (settings.balance_interval_s if mode.by_load else mode.pass_interval_s)
        # Workers were just found dead: others may have died with them unseen (an idle
        # worker shows it lives only by its reports, which stay fresh for a while), so free
        # leases go first to those that reported last - on this worker's clock (a report it
        # saw change), then on the reporter's own (a leader that just took over saw every
        # report at once). Clocks only order the candidates; liveness stays as judged.
        recency = {worker: (mode.reports.reported_at(worker),
                            -math.inf if report.written_at is None else report.written_at)
                   for worker, report in live.items()} if self._dead else None
        decided = leader.plan(
            leases, live, is_expired=lambda lease: self._balancer.is_expired(lease, now),
            known_lease_keys=leader.known_below(known, leases),
            no_move=self._recent_moves.keys(now, hold),
            settings=settings if mode.by_load else None, rng=self._rng or random.Random(),
            dead=set(self._dead), known_kbps=mode.reports.known_kbps, recency=recency)
        taken: list[Lease] = []
        #: worker -> the leases this pass gave it
        given: dict[str, list[str]] = {}
        for lease, owner in decided.assign:
            if self._stopping.is_set():
                return taken
            if owner == self.worker_id:
                fresh = self._take(lease, stolen=False)
                taken += [fresh] if fresh is not None else []
            elif self._assign(lease, owner):
                self._claims[lease.lease_key] = (self._clock() + mode.claim_within_s
                                                 + _EXPIRY_MARGIN_S)
                given.setdefault(owner, []).append(lease.lease_key)
        for lease, owner in decided.move if balance else ():
            if self._stopping.is_set():
                return taken
            self._recent_moves.add(lease.lease_key, now)
            if owner == self.worker_id:
                fresh = self.steal(lease)
                taken += [fresh] if fresh is not None else []
            elif (self._hand(lease, owner) if self.graceful_handoff and mixed.speaks_handoff(lease)
                  else self._assign(lease, owner)):
                given.setdefault(owner, []).append(lease.lease_key)
        moved = {lease.lease_key for lease, _ in decided.move} if balance else set()
        for owner, keys in given.items():
            if self._stopping.is_set():
                return taken
            if self._notify(owner, [lease for lease in held_by.get(owner, ())
                                    if lease.lease_key not in moved]):
                self._noticed.update(keys)
        if decided.assign or (balance and decided.move):
            log.info("worker %s (leader) assigned %d and moved %d lease(s) over %d worker(s)",
                     self.worker_id, len(decided.assign), len(decided.move) if balance else 0,
                     decided.workers)
        if self.cleanup_leases:
            self._clean_up(leases, now)
        return taken

    def survey(self) -> bool:
        """Ask for a scan of the lease table at the next led cycle (at most one every
        leader pass interval) although this worker does not lead: ``--stop-when-caught-up``
        judges from the whole table whether every other lease is run elsewhere, which only
        the leader scans otherwise. A worker asks only once its own shards are drained, so
        a fleet that runs on pays nothing for it. Returns whether this asks anew (the
        cycle should be woken)."""
        asked, self._survey_asked = self._survey_asked, True
        return not asked

    def _next_survey(self, mode: leader.LeaderMode, now: float) -> float:
        return now if self._last_survey is None else self._last_survey + mode.pass_interval_s

    def _survey(self) -> None:
        self._survey_asked = False
        self._last_survey = self._clock()
        try:
            leases = self.table.list_leases(consistent=False)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: lease scan failed: %r", self.worker_id, exc)
            self._balancer.scan_failed(self._last_survey)
            return
        self._scanned(leases)

    def _assign(self, lease: Lease, owner: str) -> bool:
        """Write the assignment; whether it was written. The lease's new counter is
        observed as written, so that how long it stays untaken counts from the write
        (``leader.live_workers``), not from the next scan."""
        try:
            assigned = self.table.assign(lease, owner)
        except (LeaseLostError, *TABLE_ERRORS) as exc:
            log.info("worker %s: assigning %s to %s failed: %r",
                     self.worker_id, lease.lease_key, owner, exc)
            return False
        self._balancer.observe_one(assigned, self._clock())
        return True

    def _hand(self, lease: Lease, owner: str) -> bool:
        """Ask the lease's holder to hand it to ``owner``; whether the request was written.
        The request is fenced on the counter the scan saw, which a holder that checkpoints
        every batch bumps several times a second: refused so, the lease is read again and,
        still held by the same worker with no handoff under way, asked for once more on
        its current counter. Without that second try a busy lease could not be moved for
        pass after pass (a joining worker waited 30 s for one lease, twelve refusals)."""
        try:
            self.table.set_checkpoint_owner(lease, owner)
            return True
        except LeaseLostError:
            pass
        except TABLE_ERRORS as exc:
            log.info("worker %s: moving %s to %s failed: %r",
                     self.worker_id, lease.lease_key, owner, exc)
            return False
        try:
            current = self.table.get(lease.lease_key)
            if (current is None or current.lease_owner != lease.lease_owner
                    or current.kclpy_holder != lease.lease_owner
                    or current.checkpoint_owner is not None or current.parked is not None
                    or current.is_finished):
                log.info("worker %s: %s moved on before it could be moved to %s",
                         self.worker_id, lease.lease_key, owner)
                return False
            self.table.set_checkpoint_owner(current, owner)
        except (LeaseLostError, *TABLE_ERRORS) as exc:
            log.info("worker %s: moving %s to %s failed: %r",
                     self.worker_id, lease.lease_key, owner, exc)
            return False
        return True

    def _notify(self, holder: str, held: list[Lease]) -> bool:
        """Tell a worker that holds leases that it was given more: a notice on one of the
        leases it holds, which its next renewal returns (``LeaseTable.notify_holder``).
        Whether one was written; a worker that holds none queries the owner index every
        half failover time and needs none."""
        notice = uuid.uuid4().hex[:16]
        for lease in held[:_NOTICE_TRIES]:
            try:
                if self.table.notify_holder(lease, holder, notice):
                    return True
            except TABLE_ERRORS as exc:
                log.info("worker %s: notifying %s on %s failed: %r",
                         self.worker_id, holder, lease.lease_key, exc)
        return False

    def leave(self) -> None:
        """With a leader, once this worker's last taker cycle has ended at shutdown: its
        report goes and, leading, it gives up the lock, before its leases are released.
        Counted as live while it releases them, it would be the worker with the fewest
        leases, and a leader would assign it the very leases it lets go, which it never
        takes: they came back only once it was judged dead (``claim_within_s``), five to
        seven seconds at 5 s failover where the default assigner needs half a second."""
        mode = self._leader
        if mode is None or self._left:
            return
        self._left = True
        mode.reports.table.withdraw(self.worker_id)
        mode.lock.resign()
        # What a leader assigned it and it never took (its taker stopped first) would wait
        # for the leader to judge it gone, or to expire: handed over as its own releases are
        try:
            keys = self._owned_keys()
        except TABLE_ERRORS as exc:
            log.info("worker %s: looking for leases assigned to it failed: %r",
                     self.worker_id, exc)
            return
        for key in sorted(set(keys) - set(self.held.entries()) - self.pending_handoffs()):
            self.hand_over(key)

    def hand_over(self, lease_key: str) -> str | None:
        """With a leader, for a stopping worker that just released ``lease_key`` (or was
        assigned it and never took it): assign it to the live worker that owns the fewest
        leases (``_successor``) and notify that worker on a lease it holds, as a leader's
        pass would, instead of leaving it to the leader's next pass and the notice after
        it. The assignment is the leader's own
        write (fenced on the counter the release left), so a leader that got there first
        wins and nothing is assigned twice; the leader may move it again later. Returns
        the worker it went to (None: left to the leader)."""
        mode = self._leader
        if mode is None:
            return None
        try:
            lease = self.table.get(lease_key)
        except TABLE_ERRORS as exc:
            log.info("worker %s: reading %s to hand it over failed: %r",
                     self.worker_id, lease_key, exc)
            return None
        if (lease is None or lease.is_finished or lease.parked is not None
                or not (lease.lease_owner is None
                        or (lease.lease_owner == self.worker_id and leader.unclaimed(lease)))):
            return None  # finished, parked, or on its way to someone else
        successor = self._successor(mode)
        if successor is None:
            return None
        target, held = successor
        if not self._assign(lease, target):
            with self._state:
                self._handed[target] -= 1
            return None
        self._notify(target, held)
        log.info("worker %s handed %s over to %s", self.worker_id, lease_key, target)
        return target

    def _successor(self, mode: leader.LeaderMode) -> tuple[str, list[Lease]] | None:
        """Who gets a lease a stopping worker lets go, and the leases it holds (where the
        notice goes): of the workers that report, the one that owns the fewest leases,
        counting those already handed to it. The reports and the lease table are read
        once per shutdown (a scan, as a leader's pass makes). A report not rewritten for
        three report intervals is left out, judged on this host's wall clock: a preference
        only - a lease handed to a worker that died is assigned again by the leader once
        it stays untaken (``leader.live_workers``)."""
        with self._state:
            view = self._leaving_view
        if view is None:
            try:
                reports = mode.reports.table.read_all()
                leases = self.table.list_leases(consistent=False)
            except TABLE_ERRORS as exc:
                log.info("worker %s: reading the fleet to hand its leases over failed: %r",
                         self.worker_id, exc)
                return None
            stale_before = time.time() - 3 * mode.reports.settings.report_interval_s
            live = {report.worker_id for report in reports
                    if report.worker_id != self.worker_id
                    and (report.written_at is None or report.written_at >= stale_before)}
            owned = Counter(lease.lease_owner for lease in leases if not lease.is_finished)
            held = leader.held_leases(leases, is_expired=lambda lease: False)
            view = ({worker: owned[worker] for worker in live},
                    {worker: held.get(worker, []) for worker in live})
            with self._state:
                self._leaving_view = view
        counts, held_by = view
        if not counts:
            return None
        with self._state:  # chosen and counted at once: releases are written in parallel
            target = min(counts, key=lambda w: (counts[w] + self._handed.get(w, 0), w))
            self._handed[target] = self._handed.get(target, 0) + 1
        return target, held_by[target]

    def heard_notice(self) -> None:
        """A renewal returned a leader's new assignment notice: look for this worker's new
        leases at the next cycle (the coordinator wakes it)."""
        with self._state:
            self._notice_heard = True

    def _next_discovery(self, mode: leader.LeaderMode, now: float) -> float:
        """When this worker next queries the owner index for its leases: at once after a
        notice, every half failover time while it holds nothing (or did not at its last
        Query: the leader may have judged it idle then), else about every
        ``LeaderMode.held_discovery_interval_s``."""
        with self._state:
            if self._notice_heard or self._last_discovery is None:
                return now
            last, held_then = self._last_discovery, self._held_at_discovery
            held_discovery_s = self._held_discovery_s
        holds = held_then and len(self.held) > 0
        return last + (held_discovery_s if holds else mode.discovery_interval_s)

    def _owned_keys(self) -> list[str]:
        """The keys the owner index names this worker for; while the index cannot be read
        (``leader.index_unreadable``: on AWS a new index backfills for minutes), those a
        scan of the table does, at the price of the scans every worker makes without a
        leader, until the index answers."""
        try:
            keys = self.table.keys_owned_by(self.worker_id)
        except ClientError as exc:
            if not leader.index_unreadable(exc):
                raise
            if not self._index_unreadable:
                log.warning("worker %s: the owner index cannot be read yet (%s); looking for "
                            "its leases by scanning the lease table until it can",
                            self.worker_id, exc)
            self._index_unreadable = True
            return [lease.lease_key for lease in self.table.list_leases(consistent=False)
                    if lease.lease_owner == self.worker_id]
        if self._index_unreadable:
            log.info("worker %s: the owner index answers; no more scans for its leases",
                     self.worker_id)
        self._index_unreadable = False
        return keys

    def _discover(self) -> list[Lease]:
        """Take the leases the owner index names this worker for and it does not hold: read
        each (the index lags the table) and take it fenced on its counter, or wait for its
        previous holder to let go as a steal's handoff waits."""
        try:
            keys = self._owned_keys()
        except TABLE_ERRORS as exc:
            log.warning("worker %s: querying its leases failed: %r", self.worker_id, exc)
            return []
        new = set(keys) - set(self.held.entries()) - self.pending_handoffs()
        consumable = self._consumable
        if consumable is not None:
            # a lease of a stream this worker does not consume (yet) is left to expire and
            # go to one that does
            new = {key for key in new if consumable(key)}
        taken: list[Lease] = []
        for key in sorted(new):
            if self._stopping.is_set():
                break
            try:
                lease = self.table.get(key)
            except TABLE_ERRORS as exc:
                log.warning("worker %s: reading %s failed: %r", self.worker_id, key, exc)
                continue
            if lease is None or lease.lease_owner != self.worker_id or lease.parked is not None:
                continue  # a parked lease is nobody's until it is resumed (handoff.next_step)
            self._balancer.observe_one(lease, self._clock())
            if lease.checkpoint_owner is None:
                fresh = self._take(lease, stolen=False)
                taken += [fresh] if fresh is not None else []
            else:
                with self._state:
                    self._pending[key] = (self._clock(), lease.lease_counter)
        return taken

    def stop_taking(self) -> None:
        """The worker shuts down: a led cycle under way (a leader's pass makes many writes,
        each as slow as its answer) stops before its next write, so the shutdown does not
        wait for it while the leases it took have no consumer."""
        self._stopping.set()

    def leads(self) -> bool | None:
        return None if self._leader is None else self._leader.lock.is_leader()

    def resign(self) -> None:
        """A stopping worker gives up the leader lock (``LeaderLock.resign``)."""
        if self._leader is not None:
            self._leader.lock.resign()

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
                           else self.table.delete(lease))
            except TABLE_ERRORS as exc:
                log.warning("worker %s: deleting %s failed: %r",
                            self.worker_id, lease.lease_key, exc)
                continue
            if deleted:
                log.info("worker %s deleted the lease of finished shard %s",
                         self.worker_id, lease.lease_key)

    def _delete_held(self, key: str) -> bool:
        """Stop holding a finished lease and delete it, conditional on the counter this
        worker last wrote. A delete that fails leaves it to expire, as a failed release."""
        with self.held.lock_for(key):
            entry = self.held.forget(key)
            return entry is not None and self.table.delete(entry.lease)
