"""One worker's side of the lease protocol, put together and scheduled.

As in the Java KCL 2.x ``DynamoDBLeaseCoordinator``, two background threads drive it:

- the *renewer* thread runs ``renewer.py``'s cycle whenever a renewal or a handoff deadline
  is due, and at least every quarter of a renewal interval: it is how the worker proves it
  is alive (``healthy``) and notices when it is starved (``pace_retrieval``);
- the *taker* thread runs ``taker.py``'s cycle when the scan budget allows or an overdue
  lease expires, and polls pending handoffs in between.

Everything that writes a held lease - renewals, checkpoints, releases, a stateful
processor's commits, recovery progress - goes through ``fence`` (``fence.py``) over the
``held`` set (``held.py``); the worker hands ``fence`` to its checkpointers. This module
owns only the scheduling and the small facade the worker uses.

Times are measured on the injected monotonic ``clock``; a renewal counts from the moment it
was *sent*, which errs towards believing in our lease for less time, never more.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kclpy.leases.assignment import COUNT, AssignmentStrategy
from kclpy.leases.balancing import Balancer
from kclpy.leases.budget import ScanBudget
from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldLease, HeldSet
from kclpy.leases.leader import LeaderMode
from kclpy.leases.leading import LeaderTaker
from kclpy.leases.lease import Lease
from kclpy.leases.load import LoadBalancing
from kclpy.leases.renewer import LeaseRenewer
from kclpy.leases.table import LeaseTable
from kclpy.leases.taker import LeaseTaker, TakerCore, TakerSettings
from kclpy.metrics import NOWHERE, RETRIEVAL_PAUSED, RETRIEVAL_PAUSES, Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseAssignment:
    """How this worker's leases are assigned: by which rule (``leaseAssignment``), with
    which load reports, and who decides (``leaseAssigner``: a leader, else every worker
    for itself)."""

    strategy: AssignmentStrategy = COUNT
    #: this worker's load reports (a strategy that ``uses_load`` reads them; a leader's
    #: are its own ``LeaderMode.reports``)
    load: LoadBalancing | None = None
    #: the election and its reports; None: every worker decides for itself
    leader: LeaderMode | None = None

    def __post_init__(self) -> None:
        if self.strategy.uses_load and self.load is None and self.leader is None:
            raise ValueError(f"the {self.strategy.name} assignment reads load reports: "
                             "none were given")


@dataclass(frozen=True)
class CoordinatorSettings:
    """How this worker takes part in the lease protocol, as plain values: the Java KCL's
    lease-management options (failover time, how many leases to hold and steal, graceful
    handoff, lease cleanup) and the pacing of the coordinator's two threads. They are read
    together from ``KCLConfig`` in ``composition.py`` and handed on as one set, so a fleet
    simulator or a test varies one of them without restating the others; the coordinator
    deals out each part's share (balancer, scan budget, renewer, taker)."""

    failover_time_s: float = 10.0
    max_leases_for_worker: int | None = None
    max_leases_to_steal_at_one_time: int = 1
    graceful_handoff: bool = True
    graceful_handoff_timeout_s: float = 30.0
    cleanup_leases: bool = True
    #: a fixed taker interval (None: as often as the scan budget allows)
    taker_interval_s: float | None = None
    #: the shortest time between two scans, however much the budget allows
    min_scan_interval_s: float = 0.5
    renewal_threads: int = 16

    def __post_init__(self) -> None:
        if self.failover_time_s <= 0:
            raise ValueError("failover_time_s must be positive")
        if self.graceful_handoff_timeout_s < 0:
            raise ValueError("graceful_handoff_timeout_s must not be negative")


class LeaseCoordinator:
    """Takes, renews and releases this worker's leases on two threads."""

    def __init__(
        self,
        table: LeaseTable,
        worker_id: str,
        settings: CoordinatorSettings = CoordinatorSettings(),
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        assignment: LeaseAssignment | None = None,
    ) -> None:
        failover_time_s = settings.failover_time_s
        self.table = table
        self.worker_id = worker_id
        self.failover_time_s = failover_time_s
        self.renewer_interval_s = failover_time_s / 2
        #: how often a pending handoff to this worker is polled between scans
        self.handoff_poll_s = max(0.1, self.renewer_interval_s / 4)
        self._metrics = metrics if metrics is not None else NOWHERE
        self._clock = clock
        self._budget = ScanBudget(failover_time_s, clock=clock,
                                  min_interval_s=settings.min_scan_interval_s)
        balancer = Balancer(
            worker_id, failover_time_s, max_leases_for_worker=settings.max_leases_for_worker,
            max_leases_to_steal_at_one_time=settings.max_leases_to_steal_at_one_time, rng=rng)
        self.held = HeldSet(worker_id, renewer_interval_s=self.renewer_interval_s, metrics=metrics)
        self.fence = LeaseFence(table, self.held, failover_time_s=failover_time_s, clock=clock)
        self.renewer = LeaseRenewer(
            self.fence, failover_time_s=failover_time_s,
            graceful_handoff_timeout_s=settings.graceful_handoff_timeout_s,
            budget=self._budget, clock=clock, metrics=metrics, threads=settings.renewal_threads)
        taking = TakerSettings(
            failover_time_s=failover_time_s, graceful_handoff=settings.graceful_handoff,
            graceful_handoff_timeout_s=settings.graceful_handoff_timeout_s,
            cleanup_leases=settings.cleanup_leases, interval_s=settings.taker_interval_s)
        assignment = assignment or LeaseAssignment()
        self.taker: TakerCore
        if assignment.leader is None:
            self.taker = LeaseTaker(
                table, self.held, balancer, self._budget, taking, clock=clock,
                metrics=metrics, strategy=assignment.strategy, load=assignment.load)
        else:
            self.taker = LeaderTaker(
                table, self.held, balancer, self._budget, taking, clock=clock,
                mode=assignment.leader, metrics=metrics, strategy=assignment.strategy,
                rng=random.Random(rng.getrandbits(64)) if rng is not None else None)
        self.held.set_drop_hook(self.taker.remember_lost)
        self.held.set_notice_hook(self._assignment_noticed)
        self._stopping = threading.Event()
        #: set once the worker shuts down: the taker thread ends, the renewer goes on
        self._taking_stopped = threading.Event()
        self._releases_lock = threading.Lock()
        #: the background release writes of ``release_soon``
        self._releases: ThreadPoolExecutor | None = None
        self._last_renewal_cycle = clock()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._taker_thread: threading.Thread | None = None
        #: held while ``start`` starts the threads: a ``stop`` from another thread (the
        #: renewer's first pass may already make the worker look healthy) must not find a
        #: thread created and not yet started
        self._lifecycle = threading.Lock()
        #: set while the renewer keeps its schedule; fetchers and deliveries wait on it (see
        #: pace_retrieval)
        self.retrieval_gate = threading.Event()
        self.retrieval_gate.set()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the renewer and taker threads; the first taker cycle runs at once."""
        with self._lifecycle:
            if self._threads:
                raise RuntimeError("LeaseCoordinator already started")
            self._stopping.clear()
            self._taking_stopped.clear()
            self._taker_thread = threading.Thread(
                target=self._taker_loop, name=f"kclpy-lease-taker-{self.worker_id}",
                daemon=True)
            self._threads = [
                threading.Thread(target=self._renewer_loop,
                                 name=f"kclpy-lease-renewer-{self.worker_id}", daemon=True),
                self._taker_thread,
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop both threads; with ``release``, hand every held lease back at once so other
        workers need not wait for them to expire."""
        self._stopping.set()
        self._wake.set()
        with self._lifecycle:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        self.renewer.close()
        with self._releases_lock:
            releases, self._releases = self._releases, None
        if releases is not None:
            releases.shutdown(wait=True)
        if release:
            self.release_all()
            self.taker.give_up_pending()
            self.taker.resign()

    def stop_taking(self, timeout: float | None = None) -> bool:
        """Take, steal and adopt no lease from now on, as the Java KCL's ``stopLeaseTaker``
        at the start of a graceful shutdown; the held leases are still renewed until they
        are released. Waits up to ``timeout`` (None: for as long as it takes) for a taker
        cycle under way to end, and says whether it has: only then does the caller know
        every lease it will ever hold. One taken while the processors wind down would be
        held with no consumer until the worker stops, and moved away from a worker that was
        consuming it. Once it has ended, a worker with a leader leaves the fleet
        (``LeaseTaker.leave``), and each lease it releases from then on is handed straight
        to a live worker (``LeaseTaker.hand_over``)."""
        self._taking_stopped.set()
        self.taker.stop_taking()
        self._wake.set()
        if self._taker_thread is not None:
            self._taker_thread.join(timeout)
            if self._taker_thread.is_alive():
                return False
        self.taker.leave()
        return True

    def _renewer_loop(self) -> None:
        wake_at = self._clock()
        while not self._stopping.is_set():
            # Renewals run on their own threads, so how late this loop wakes measures
            # starvation alone, never a slow DynamoDB answer or a lease lock it waits for.
            self.pace_retrieval(self._clock() - wake_at)
            try:
                self.renewer.dispatch_due()
                self._last_renewal_cycle = self._clock()
            except Exception:
                # A dead renewer would silently lose every lease; log and keep going.
                log.exception("worker %s: lease renewal cycle failed", self.worker_id)
            wait = self.renewer.next_wait()
            wake_at = self._clock() + wait
            self._stopping.wait(wait)
        self.pace_retrieval(0.0)

    def pace_retrieval(self, late_by_s: float) -> None:
        """Pause or resume retrieval, given how far the renewer is behind its schedule.

        Renewing needs the interpreter like everything else; a worker catching up on
        hundreds of shards runs hundreds of fetch and delivery threads, and one thread in
        hundreds gets the interpreter lock too rarely to send its renewals before the
        leases expire (each expired lease is then taken again and its records delivered
        again). A renewer loop that woke up more than a quarter of a renewal interval late
        was starved (it never waits for DynamoDB or a lease's lock), so fetch threads
        and deliveries wait on :attr:`retrieval_gate` until a cycle runs on time again.
        """
        starved = late_by_s > self.renewer_interval_s / 4 and not self._stopping.is_set()
        if starved and self.retrieval_gate.is_set():
            self.retrieval_gate.clear()
            log.warning("worker %s: lease renewal ran %.1fs late; pausing retrieval until it "
                        "catches up", self.worker_id, late_by_s)
            self._metrics.inc(RETRIEVAL_PAUSES)
            self._metrics.set(RETRIEVAL_PAUSED, 1)
        elif not starved and not self.retrieval_gate.is_set():
            self.retrieval_gate.set()
            log.info("worker %s: lease renewal on time again; retrieval resumed", self.worker_id)
            self._metrics.set(RETRIEVAL_PAUSED, 0)

    def _taker_loop(self) -> None:
        woken = True  # the first scan runs at once
        next_poll: float | None = None
        while not self._stopping.is_set() and not self._taking_stopped.is_set():
            try:
                next_scan = self.taker.next_scan()
                if woken or self._clock() >= next_scan:
                    self.taker.run_once()
                    next_scan = self.taker.next_scan()
                    next_poll = None
                elif next_poll is not None and self._clock() >= next_poll:
                    self.taker.poll_handoffs()
                    next_poll = None
            except Exception:
                log.exception("worker %s: lease taker cycle failed", self.worker_id)
                next_scan = self._clock() + self._budget.max_interval_s
            if self.taker.pending_handoffs() and next_poll is None:
                next_poll = self._clock() + self.handoff_poll_s
            # Wake at least every minimum interval: a changed number of held leases changes
            # the budget, and with it when the next scan is affordable (no request needed).
            wake_at = min(next_scan, self._clock() + self._budget.min_interval_s)
            if next_poll is not None:
                wake_at = min(wake_at, next_poll)
            woken = self._wake.wait(max(0.0, wake_at - self._clock()))
            if woken:
                self._wake.clear()

    # -- the facade the worker and tests use -----------------------------------------------

    @property
    def healthy(self) -> bool:
        """The renewer is alive and completed a cycle within the failover time: this
        worker's leases are being renewed (what /healthz reports)."""
        if not self._threads or self._stopping.is_set():
            return False
        return self._clock() - self._last_renewal_cycle <= self.failover_time_s

    def run_renewer_once(self, *, due_only: bool = False) -> None:
        self.renewer.run_once(due_only=due_only)

    def leads(self) -> bool | None:
        """With a leader (``leader.py``): whether this worker is it; None when every worker
        scans for itself."""
        return self.taker.leads()

    def survey(self) -> None:
        """With a leader, on a worker that does not lead: scan the lease table soon, so that
        ``all_leases`` and ``run_elsewhere`` see the whole table (``LeaseTaker.survey``)."""
        if self.taker.survey():
            self.wake_taker()

    def run_taker_once(self) -> list[Lease]:
        return self.taker.run_once()

    def poll_handoffs(self) -> list[Lease]:
        return self.taker.poll_handoffs()

    def steal(self, lease: Lease) -> Lease | None:
        return self.taker.steal(lease)

    def add_lease_lost_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(lease_key)`` is called (from the renewer or a checkpointing thread, with no
        coordinator lock held) each time a held lease turns out to be lost."""
        self.held.add_lost_listener(fn)

    def add_handoff_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(lease_key)`` is called when another worker asks for a held lease. The
        listener lets the shard's processor finish (it may still checkpoint) and then calls
        ``release(lease_key)``. Without listeners the lease is released at once."""
        self.held.add_handoff_listener(fn)

    def set_known_lease_keys(self, lease_keys: set[str] | None) -> None:
        """Only the leases with these keys are taken; None allows every lease."""
        self.taker.set_known_lease_keys(lease_keys)

    def set_consumable(self, fn: Callable[[str], bool] | None) -> None:
        """With a leader: which assigned leases this worker takes (``LeaseTaker``)."""
        self.taker.set_consumable(fn)

    def _assignment_noticed(self) -> None:
        """A renewal returned a leader's notice: the taker looks for the new leases now, not
        at its next scheduled cycle (a holder's own Query may be minutes away)."""
        self.taker.heard_notice()
        self._wake.set()

    def wake_taker(self) -> None:
        self._wake.set()

    def held_leases(self) -> dict[str, Lease]:
        """The leases held now. One not written for longer than the failover time is given
        up here and its lost listeners told, even before the renewer gets to it (the
        process was suspended, or its write is slow): a write that lands later cannot bring
        it back (``HeldSet.refresh``)."""
        now = self._clock()
        for key in self.held.expire(now, self.failover_time_s):
            self.held.notify_lost(key)
        return self.held.leases()

    def get_held(self, lease_key: str) -> Lease | None:
        return self.held.get(lease_key)

    def handing_off(self, lease_key: str) -> bool:
        """Another worker asked for this held lease and waits for it."""
        return self.held.handing_off(lease_key)

    def pending_handoffs(self) -> set[str]:
        """Leases handed to this worker whose previous owner has not let go yet."""
        return self.taker.pending_handoffs()

    def java_peers(self) -> bool:
        """A Java KCL 2.x worker holds a live lease in the table (as of the last scan)."""
        return self.taker.java_peers()

    def get_lease(self, lease_key: str) -> Lease | None:
        """The lease as the table has it now (e.g. whether a parent reached SHARD_END)."""
        return self.table.get(lease_key)

    def all_leases(self) -> list[Lease]:
        """Every lease as of the last taker scan."""
        return self.taker.all_leases()

    def idle_leases(self) -> list[Lease]:
        """Leases of the last scan no worker runs (free or expired): safe to delete."""
        return self.taker.idle_leases()

    def run_elsewhere(self) -> frozenset[str]:
        """Keys of leases another worker is seen renewing (``LeaseTaker.run_elsewhere``)."""
        return self.taker.run_elsewhere()

    def recent_lease_keys(self, max_age_s: float) -> frozenset[str] | None:
        """The lease keys of the last scan if it is at most ``max_age_s`` old, so shard sync
        need not scan the table again; None otherwise."""
        return self.taker.recent_lease_keys(max_age_s)

    def release(self, lease_key: str) -> None:
        """Give a held lease back so it can move at once (``LeaseFence.release``)."""
        held = self.fence.give_up(lease_key)
        if held is not None:
            self._write_release(held)

    def release_soon(self, lease_key: str) -> None:
        """Give a held lease up now and write its release in the background. The worker
        loop releases this way: the write waits for the lease's lock, which a slow
        checkpoint or renewal of it may hold for up to the failover time, and every other
        shard's consumer would wait with it."""
        held = self.fence.give_up(lease_key)
        if held is None:
            return
        with self._releases_lock:
            if self._releases is None:
                self._releases = ThreadPoolExecutor(
                    4, thread_name_prefix=f"kclpy-release-{self.worker_id}")
            self._releases.submit(self._write_release, held)

    def _write_release(self, held: HeldLease) -> None:
        """Write a release; once the worker stops taking (it shuts down), with a leader,
        hand the lease straight to a live worker (``LeaseTaker.hand_over``)."""
        self.fence.write_release(held)
        if self._taking_stopped.is_set():
            self.taker.hand_over(held.lease.lease_key)

    def release_all(self) -> None:
        for key in self.held.entries():
            self.release(key)
