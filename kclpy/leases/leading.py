"""The taker's cycle with a leader (``--lease-assigner leader``, decisions in ``leader.py``).

Every worker reports its load, keeps the election going (``LeaderLock``) and finds the
leases assigned to it through the owner index; the worker that leads also scans the lease
table, asks ``leader.plan`` (whose moves are the assignment strategy's, ``assignment.py``)
and writes the decisions: assignments of free leases, handoff requests for moved ones, and
notices to their new holders. A stopping worker leaves the fleet first and hands the leases
it releases straight to a live worker. Taking, stealing and handoffs themselves are every
taker's (``taker.TakerCore``); the worker-decides cycle is ``taker.LeaseTaker``.
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable

from botocore.exceptions import ClientError

from kclpy.errors import LeaseLostError
from kclpy.leases import leader, mixed
from kclpy.leases.assignment import COUNT, AssignmentStrategy
from kclpy.leases.balancing import Balancer
from kclpy.leases.budget import ScanBudget
from kclpy.leases.dynamo import TABLE_ERRORS
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.leases.taker import EXPIRY_MARGIN_S, TakerCore, TakerSettings
from kclpy.metrics import Metrics
from kclpy.retry import spread

log = logging.getLogger(__name__)

#: leases of one holder a leader tries to write an assignment notice on
_NOTICE_TRIES = 2


class LeaderTaker(TakerCore):
    """One worker's taker under an elected leader, leading or not."""

    def __init__(
        self,
        table: LeaseTable,
        held: HeldSet,
        balancer: Balancer,
        budget: ScanBudget,
        settings: TakerSettings,
        *,
        clock: Callable[[], float],
        mode: leader.LeaderMode,
        metrics: Metrics | None = None,
        strategy: AssignmentStrategy = COUNT,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(table, held, balancer, budget, settings, clock=clock,
                         metrics=metrics, strategy=strategy)
        #: the election, the reports, and when this worker next scans as leader, balances,
        #: and looks for its leases
        self._leader = mode
        self._rng = rng if rng is not None else random.Random()
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
        #: a scan asked for by a worker that does not lead (``survey``), and clock() of
        #: the last one
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

    def run_once(self) -> list[Lease]:
        """Report this worker's load, keep the election going, scan and assign when leading
        and due, and take what the owner index says is assigned to this worker."""
        return self._run_led(self._leader)

    def next_scan(self) -> float:
        """When the lock, the discovery of this worker's leases or (leading) the next pass
        is due, or right when an overdue lease expires."""
        return self._next_led(self._leader, self._clock())

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
                due.append(expiry + EXPIRY_MARGIN_S)
        return min(due)

    def _run_led(self, mode: leader.LeaderMode) -> list[Lease]:
        """Report this worker's load, keep the election going, scan and assign when leading
        and due, and take what the owner index says is assigned to this worker."""
        with self._cycle_lock:
            self._begin_cycle()
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
        self._next_pass = sent_at + self._scan_interval_s(mode)
        try:
            leases = self.table.list_leases(consistent=False)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: leader's lease scan failed: %r", self.worker_id, exc)
            self._balancer.scan_failed(sent_at)
            return []
        now, known = self._scanned(leases)
        # Pending handoffs move on from the scan, as the default assigner's do: the taker
        # loop polls them only when no cycle comes first, and the leader's cycle comes
        # every tenth of the failover time (simulator seed 604: a lease handed to a worker
        # that then took the lead sat let go and unadopted until its records aged out)
        taken = self._progress_handoffs(leases, now)
        self._java_side(leases, now)
        reports = mode.reports.fleet()
        if reports is None:
            return taken

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
        # the strategy's balancing round (None: every pass interval, though the leader
        # scans more often); a lease it moved stays put for two rounds, so its load is never
        # judged on a report from before it moved
        interval = self._strategy.balance_interval_s(settings)
        if interval is None:
            interval = mode.pass_interval_s
        balance = self._next_round is None or now >= self._next_round
        if balance:
            self._next_round = now + interval
        hold = 2 * interval
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
            no_move=self._recent_moves.keys(now, hold), strategy=self._strategy,
            settings=settings, rng=self._rng,
            dead=set(self._dead), known_kbps=mode.reports.known_kbps, recency=recency)
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
                                                 + EXPIRY_MARGIN_S)
                given.setdefault(owner, []).append(lease.lease_key)
        for lease, owner in decided.move if balance else ():
            if self._stopping.is_set():
                return taken
            self._recent_moves.add(lease.lease_key, now)
            if owner == self.worker_id:
                fresh = self.steal(lease)
                taken += [fresh] if fresh is not None else []
            elif (self._hand(lease, owner) if self.graceful_handoff and mixed.speaks_handoff(lease)
                  and not self._given_up(lease) else self._assign(lease, owner)):
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

    def _scan_interval_s(self, mode: leader.LeaderMode) -> float:
        """How often the leader scans: a tenth of the failover time, never more often than
        the default assigner's workers may (the scan budget's minimum interval). The
        leader judges a lease's expiry from its first sight of the lease's last counter (a
        live holder's lease is never taken before the failover time), so a holder that
        dies right after a write loses its leases the failover time plus up to one scan
        interval later. At a third of the failover time (the pass interval, at which it
        still balances) that put ``kill -9`` of a busy holder past the failover time + 2 s
        (5 + 1.7 s to the assignment at 5 s, then the notice, the take and the consumer's
        start), where the default assigner's survivors, each scanning at the budget's
        pace, lose about half a second. Only the leader scans, so the fleet pays one
        worker's scans where the default assigner pays every worker's."""
        return max(self._budget.min_interval_s, mode.lock.failover_time_s / 10)

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

    def _given_up(self, lease: Lease) -> bool:
        """Whether the table names this worker for a lease it does not hold (it gave the
        lease up, its renewal late): a handoff request would wait for a holder that is not
        there to release it, until the stale-handoff timeout (simulator seed 246: a merge
        child left unread for 10 s). Assigned instead, fenced on the counter the scan saw:
        a late renewal of this worker's that landed before the scan is in that counter (its
        answer then finds the lease given up and lets it go), one that lands after is
        refused by the assignment's."""
        return lease.lease_owner == self.worker_id and lease.lease_key not in self.held.entries()

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
        if self._left:
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

    def leads(self) -> bool | None:
        return self._leader.lock.is_leader()

    def resign(self) -> None:
        """A stopping worker gives up the leader lock (``LeaderLock.resign``)."""
        self._leader.lock.resign()
