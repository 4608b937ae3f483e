"""One worker's side of the lease protocol: take, renew, hand off, fence, release, clean up.

Two background threads, as in the Java KCL 2.x ``DynamoDBLeaseCoordinator``:

- the *renewer* writes every held lease at least every ``failover_time_s / 2``; a checkpoint
  counts as that write, so a lease its processor checkpoints often is never renewed at all.
  A failed renewal is retried after a quarter of that interval, which gives more attempts
  before the failover time runs out than Java's ``failover / 3`` cadence. A failed
  condition means another worker took the lease, or asks for it back (a graceful handoff,
  below). A lease without a successful write for longer than the failover time is dropped
  without another attempt (the process was suspended, or DynamoDB unreachable): by then
  other workers may have taken it.
- the *taker* scans the table and takes or steals leases (rules in ``taker.py``). It scans
  as often as ``budget.py`` allows - what the renewals saved pay for - and in addition
  right when an overdue lease (its owner missed a renewal) reaches the failover time, so a
  dead worker's leases move about one failover time after its last renewal. The same scan
  finishes handoffs and deletes finished leases (``cleanup.py``).

*Graceful handoff* (the Java KCL 3.x ``checkpointOwner`` protocol, in ``handoff.py``): a
thief does not take a live worker's lease outright. It writes ``leaseOwner = thief,
checkpointOwner = owner``; the owner's next renewal finds that, keeps renewing (fenced on
``checkpointOwner``), tells its handoff listeners (the worker asks the processor to
``shutdown_requested``, where it may checkpoint) and finally removes ``checkpointOwner``
(``release``). Only then does the thief start, from the checkpoint the owner left. An owner
that does not let go within ``graceful_handoff_timeout_s`` lets go regardless; a thief whose
owner neither lets go nor renews takes the lease when it expires, and one whose owner keeps
renewing but never lets go (a Java 2.x worker does not know the attribute) takes it after
the timeout plus the failover time.

The renewer, the taker and checkpoint writes all change the same items, so each lease has a
lock under which its counter is read and written: whoever writes next always uses the counter
the previous write returned (``ALL_NEW``).

Times are measured on the injected monotonic ``clock``; a renewal counts from the moment it
was *sent*, which errs towards believing in our lease for less time, never more.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kclpy.errors import (
    KinesisClientLibDependencyException,
    LeaseLostError,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases import cleanup, handoff
from kclpy.leases.budget import ScanBudget
from kclpy.leases.fence import TABLE_ERRORS as _TABLE_ERRORS
from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.leases.taker import LeaseTaker
from kclpy.metrics import Metrics

log = logging.getLogger(__name__)

#: how far past an overdue lease's expiry the scan that takes it is made
_EXPIRY_MARGIN_S = 0.05


class LeaseCoordinator:
    """Takes, renews and releases this worker's leases. Every write only the holder may make
    goes through ``fence`` (``fence.py``), which is also the checkpointers' writer."""

    def __init__(
        self,
        table: LeaseTable,
        worker_id: str,
        *,
        failover_time_s: float = 10.0,
        max_leases_for_worker: int | None = None,
        max_leases_to_steal_at_one_time: int = 1,
        taker_interval_s: float | None = None,
        graceful_handoff: bool = True,
        graceful_handoff_timeout_s: float = 30.0,
        cleanup_leases: bool = True,
        min_scan_interval_s: float = 0.5,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        renewal_threads: int = 4,
        rng: random.Random | None = None,
    ) -> None:
        if failover_time_s <= 0:
            raise ValueError("failover_time_s must be positive")
        if renewal_threads < 1:
            raise ValueError("renewal_threads must be at least 1")
        if graceful_handoff_timeout_s < 0:
            raise ValueError("graceful_handoff_timeout_s must not be negative")
        self.table = table
        self.worker_id = worker_id
        self.failover_time_s = failover_time_s
        self.renewer_interval_s = failover_time_s / 2
        #: a fixed taker interval (None: as often as the scan budget allows)
        self.taker_interval_s = taker_interval_s
        self.graceful_handoff = graceful_handoff
        self.graceful_handoff_timeout_s = graceful_handoff_timeout_s
        self.cleanup_leases = cleanup_leases
        #: how often a pending handoff to this worker is polled between scans
        self.handoff_poll_s = max(0.1, self.renewer_interval_s / 4)
        self._metrics = metrics
        self._clock = clock
        self._renewal_threads = renewal_threads
        self._budget = ScanBudget(failover_time_s, clock=clock, min_interval_s=min_scan_interval_s)
        self._taker = LeaseTaker(
            worker_id,
            failover_time_s,
            max_leases_for_worker=max_leases_for_worker,
            max_leases_to_steal_at_one_time=max_leases_to_steal_at_one_time,
            rng=rng,
        )
        #: guards the dictionaries below (never held while calling DynamoDB)
        self._state = threading.Lock()
        self.held = HeldSet(
            worker_id, renewer_interval_s=self.renewer_interval_s, metrics=metrics,
            on_drop=self._remember_lost)
        self.fence = LeaseFence(table, self.held, failover_time_s=failover_time_s, clock=clock)
        #: handoffs to this worker not finished yet: lease key -> (clock() when asked,
        #: the lease counter then)
        self._pending: dict[str, tuple[float, int]] = {}
        #: lease key -> taker cycle in which it was lost; not stolen back in the next cycle
        self._lost_in_cycle: dict[str, int] = {}
        self._known_shards: frozenset[str] | None = None
        #: the leases of the last taker scan, for readers that must not wait for a cycle
        self._last_scan: list[Lease] = []
        self._last_scan_at: float | None = None
        #: clock() when the last scan was started, successful or not
        self._last_scan_attempt: float | None = None
        #: leases per live worker as of the last scan: what the scan budget is based on
        self._share = 0.0
        #: serialises taker cycles (background thread and run_taker_once callers)
        self._taker_lock = threading.Lock()
        self._taker_cycle = 0
        self._stopping = threading.Event()
        self._last_renewal_cycle = clock()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool: ThreadPoolExecutor | None = None
        #: set while the renewer keeps its schedule; fetchers and deliveries wait on it (see
        #: pace_retrieval)
        self.retrieval_gate = threading.Event()
        self.retrieval_gate.set()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the renewer and taker threads; the first taker cycle runs at once."""
        if self._threads:
            raise RuntimeError("LeaseCoordinator already started")
        self._stopping.clear()
        self._threads = [
            threading.Thread(
                target=self._renewer_loop, name=f"kclpy-lease-renewer-{self.worker_id}", daemon=True
            ),
            threading.Thread(
                target=self._taker_loop, name=f"kclpy-lease-taker-{self.worker_id}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop both threads; with ``release``, hand every held lease back at once so other
        workers need not wait for them to expire."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if release:
            self.release_all()
            self._give_up_pending()

    def _renewer_loop(self) -> None:
        wake_at = self._clock()
        while not self._stopping.is_set():
            self.pace_retrieval(self._clock() - wake_at)
            try:
                self.run_renewer_once(due_only=True)
                self._last_renewal_cycle = self._clock()
            except Exception:
                # A dead renewer would silently lose every lease; log and keep going.
                log.exception("worker %s: lease renewal cycle failed", self.worker_id)
            self.pace_retrieval(self._clock() - wake_at)
            wait = self._renewer_wait()
            wake_at = self._clock() + wait
            self._stopping.wait(wait)
        self.pace_retrieval(0.0)

    def pace_retrieval(self, late_by_s: float) -> None:
        """Pause or resume retrieval, given how far the renewer is behind its schedule.

        Renewing needs the interpreter like everything else; a worker catching up on
        hundreds of shards runs hundreds of fetch and delivery threads, and one thread in
        hundreds gets the interpreter lock too rarely to send its renewals before the
        leases expire (each expired lease is then taken again and its records delivered
        again). A renewer that woke up, or finished its cycle, more than a quarter of a
        renewal interval late was starved, not failing (errors do not delay it), so fetch threads
        and deliveries wait on :attr:`retrieval_gate` until a cycle runs on time again.
        """
        starved = late_by_s > self.renewer_interval_s / 4 and not self._stopping.is_set()
        if starved and self.retrieval_gate.is_set():
            self.retrieval_gate.clear()
            log.warning("worker %s: lease renewal ran %.1fs late; pausing retrieval until it "
                        "catches up", self.worker_id, late_by_s)
            if self._metrics is not None:
                self._metrics.retrieval_pauses.inc()
                self._metrics.retrieval_paused.set(1)
        elif not starved and not self.retrieval_gate.is_set():
            self.retrieval_gate.set()
            log.info("worker %s: lease renewal on time again; retrieval resumed", self.worker_id)
            if self._metrics is not None:
                self._metrics.retrieval_paused.set(0)

    def _renewer_wait(self) -> float:
        """Until the next renewal or handoff deadline; at most a quarter of the renewal
        interval, so the loop keeps proving it is alive (``healthy``) even with no leases,
        and notices soon when the process is too busy to run it (``pace_retrieval``)."""
        now = self._clock()
        deadlines = [now + self.renewer_interval_s / 4]
        for held in self.held.entries().values():
            deadlines.append(held.renew_due)
            if held.handoff_since is not None:
                deadlines.append(held.handoff_since + self.graceful_handoff_timeout_s)
        return max(0.01, min(deadlines) - now)

    def _taker_loop(self) -> None:
        woken = True  # the first scan runs at once
        next_poll: float | None = None
        while not self._stopping.is_set():
            try:
                next_scan = self._next_scan()
                if woken or self._clock() >= next_scan:
                    self.run_taker_once()
                    next_scan = self._next_scan()
                    next_poll = None
                elif next_poll is not None and self._clock() >= next_poll:
                    self.poll_handoffs()
                    next_poll = None
            except Exception:
                log.exception("worker %s: lease taker cycle failed", self.worker_id)
                next_scan = self._clock() + self._budget.max_interval_s
            with self._state:
                pending = bool(self._pending)
            if pending and next_poll is None:
                next_poll = self._clock() + self.handoff_poll_s
            # Wake at least every minimum interval: a changed number of held leases changes
            # the budget, and with it when the next scan is affordable (no request needed).
            wake_at = min(next_scan, self._clock() + self._budget.min_interval_s)
            if next_poll is not None:
                wake_at = min(wake_at, next_poll)
            woken = self._wake.wait(max(0.0, wake_at - self._clock()))
            if woken:
                self._wake.clear()

    def _next_scan(self) -> float:
        """When to scan next: when the budget affords it (or the fixed interval after the
        last scan), or earlier, right when an overdue lease expires."""
        now = self._clock()
        held = set(self.held.entries())
        with self._state:
            scanned = len(self._last_scan)
            last_attempt = self._last_scan_attempt
            share = self._share
        if self.taker_interval_s is not None:
            return (now if last_attempt is None else last_attempt) + self.taker_interval_s
        self._budget.observe(share=share, leases=scanned)
        regular = now + self._budget.next_scan_in()
        expiry = self._taker_expiry(held, now)
        if expiry is not None:
            return min(regular, expiry + _EXPIRY_MARGIN_S)
        return regular

    def _taker_expiry(self, held: set[str], now: float) -> float | None:
        """When the first overdue lease of the last scan expires (``LeaseTaker.next_expiry``);
        serialised with taker cycles, which update the taker's view."""
        with self._taker_lock:
            return self._taker.next_expiry(
                held=held, overdue_after=1.25 * self.renewer_interval_s, now=now
            )

    # -- configuration and queries -------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """The renewer is alive and completed a cycle within the failover time: this
        worker's leases are being renewed (what /healthz reports)."""
        if not self._threads or self._stopping.is_set():
            return False
        return self._clock() - self._last_renewal_cycle <= self.failover_time_s

    def add_lease_lost_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(shard_id)`` is called (from the renewer or a checkpointing thread, with no
        coordinator lock held) each time a held lease turns out to be lost."""
        self.held.add_lost_listener(fn)

    def add_handoff_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(shard_id)`` is called when another worker asks for a held lease. The
        listener lets the shard's processor finish (it may still checkpoint) and then calls
        ``release(shard_id)``. Without listeners the lease is released at once."""
        self.held.add_handoff_listener(fn)

    def set_known_shards(self, shard_ids: set[str] | None) -> None:
        """Only leases of these shards are taken; None allows every lease."""
        with self._state:
            self._known_shards = None if shard_ids is None else frozenset(shard_ids)

    def wake_taker(self) -> None:
        self._wake.set()

    def held_leases(self) -> dict[str, Lease]:
        """The leases held now; one not written for longer than the failover time is no
        longer ours even before the renewer has dropped it (the process was suspended)."""
        return self.held.leases(self._clock(), self.failover_time_s)

    def get_held(self, shard_id: str) -> Lease | None:
        return self.held.get(shard_id)

    def handing_off(self, shard_id: str) -> bool:
        """Another worker asked for this held lease and waits for it."""
        return self.held.handing_off(shard_id)

    def pending_handoffs(self) -> set[str]:
        """Leases handed to this worker whose previous owner has not let go yet."""
        with self._state:
            return set(self._pending)

    def get_lease(self, shard_id: str) -> Lease | None:
        """The lease as the table has it now (e.g. whether a parent reached SHARD_END)."""
        return self.table.get(shard_id)

    def all_leases(self) -> list[Lease]:
        """Every lease as of the last taker scan."""
        with self._state:
            return [lease.copy() for lease in self._last_scan]

    def recent_lease_keys(self, max_age_s: float) -> frozenset[str] | None:
        """The lease keys of the last scan if it is at most ``max_age_s`` old, so shard sync
        need not scan the table again; None otherwise."""
        with self._state:
            at = self._last_scan_at
            if at is None or self._clock() - at > max_age_s:
                return None
            return frozenset(lease.lease_key for lease in self._last_scan)

    # -- internals ------------------------------------------------------------------------

    def _remember_lost(self, lease_key: str) -> None:
        """A lease lost or handed off now is not stolen back in the next taker cycle."""
        with self._state:
            self._lost_in_cycle[lease_key] = self._taker_cycle

    def _install(self, lease: Lease, sent_at: float) -> None:
        """A lease taken or adopted: held from now, no longer a pending handoff."""
        self.held.install(lease, sent_at)
        with self._state:
            self._pending.pop(lease.lease_key, None)

    # -- renewer -------------------------------------------------------------------------

    def run_renewer_once(self, *, due_only: bool = False) -> None:
        """Renew every held lease (with ``due_only``, those whose renewal is due); the fence
        drops and reports the lost ones and announces the ones another worker asks for."""
        now = self._clock()
        keys = [
            key
            for key, held in self.held.entries().items()
            if not due_only
            or held.renew_due <= now
            or now - held.renewed_at > self.failover_time_s
            or (
                held.handoff_since is not None
                and now - held.handoff_since > self.graceful_handoff_timeout_s
            )
        ]
        if len(keys) <= 1 or self._renewal_threads == 1:
            for key in keys:
                self._renew(key)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._renewal_threads, thread_name_prefix=f"kclpy-renew-{self.worker_id}"
                )
            list(self._pool.map(self._renew, keys))

    def _renew(self, lease_key: str) -> None:
        """Renew one lease, or let go of one kept past the handoff timeout."""
        held = self.held.entry(lease_key)
        if held is None:
            return
        now = self._clock()
        if (
            held.handoff_since is not None
            and now - held.handoff_since > self.graceful_handoff_timeout_s
        ):
            log.warning("worker %s: lease %s not let go within the handoff timeout; letting go",
                        self.worker_id, lease_key)
            self.fence.release(lease_key)
            self.held.notify_lost(lease_key)
            return
        expired = now - held.renewed_at > self.failover_time_s
        if not expired:
            self._budget.spend_renewal()
        try:
            self.fence.write(lease_key, None, self.table.renew, what="renewal")
        except ShutdownException:
            if not expired:
                self._count_renew_failure()
            return
        except (ThrottlingException, KinesisClientLibDependencyException) as exc:
            self._count_renew_failure()
            with self.held.lock_for(lease_key):
                entry = self.held.entry(lease_key)
                if entry is not None:
                    entry.renew_due = now + self.renewer_interval_s / 4
            log.warning("worker %s: renewing %s failed: %r", self.worker_id, lease_key,
                        exc.__cause__ or exc)
            return
        if self._metrics is not None:
            self._metrics.lease_renewals.inc()

    def _count_renew_failure(self) -> None:
        if self._metrics is not None:
            self._metrics.lease_renew_failures.inc()

    # -- taker ---------------------------------------------------------------------------

    def run_taker_once(self) -> list[Lease]:
        """One taker cycle: scan, decide, take, finish handoffs, clean up. Returns the
        leases newly taken (copies)."""
        with self._taker_lock:
            with self._state:
                self._taker_cycle += 1
                self._last_scan_attempt = self._clock()
            self._budget.spend_scan()
            try:
                leases = self.table.list_leases(consistent=False)
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: lease scan failed, no leases taken: %r", self.worker_id, exc
                )
                return []
            now = self._clock()
            self._taker.observe(leases, now)
            with self._state:
                self._last_scan = leases
                self._last_scan_at = now
                known = self._known_shards
                cycle = self._taker_cycle
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
            held = set(self.held.entries())
            plan = self._taker.plan(held=held, known_shards=known, no_steal=no_steal, now=now)
            with self._state:
                self._share = plan.share
            taken += [fresh for lease in plan.take if (fresh := self._take(lease, stolen=False))]
            taken += [fresh for lease in plan.steal if (fresh := self.steal(lease))]
            if taken:
                log.info("worker %s took %s", self.worker_id, ", ".join(t.lease_key for t in taken))
            if self.cleanup_leases:
                self._clean_up(leases)
            return taken

    def steal(self, lease: Lease) -> Lease | None:
        """Take a lease from a live worker: with graceful handoff, ask its owner to let go
        (returns None; the lease arrives when the owner has finished), else take outright."""
        if not self.graceful_handoff:
            return self._take(lease, stolen=True)
        with self.held.lock_for(lease.lease_key):
            try:
                asked = self.table.set_checkpoint_owner(lease, self.worker_id)
            except LeaseLostError:
                log.info(
                    "worker %s: lease %s changed before a handoff could be asked",
                    self.worker_id,
                    lease.lease_key,
                )
                return None
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: asking for %s failed: %r", self.worker_id, lease.lease_key, exc
                )
                return None
            with self._state:
                self._pending[lease.lease_key] = (self._clock(), asked.lease_counter)
        log.info(
            "worker %s asked %s to hand off %s",
            self.worker_id,
            lease.lease_owner,
            lease.lease_key,
        )
        return None

    def poll_handoffs(self) -> list[Lease]:
        """Between scans, read each pending handoff's lease and finish the ones whose owner
        let go. Returns the leases adopted."""
        adopted = []
        for key in self.pending_handoffs():
            try:
                lease = self.table.get(key)
            except _TABLE_ERRORS as exc:
                log.warning("worker %s: reading %s failed: %r", self.worker_id, key, exc)
                continue
            now = self._clock()
            if lease is not None:
                with self._state:
                    self._taker.observe_one(lease, now)
            fresh = self._progress_handoff(key, lease, scanned_at=now if lease else None)
            if fresh is not None:
                adopted.append(fresh)
        return adopted

    def _progress_handoff(
        self, key: str, lease: Lease | None, *, scanned_at: float | None
    ) -> Lease | None:
        """Move one pending handoff on, given the lease as just read (``scanned_at`` when it
        came from a scan, so the taker's expiry view applies)."""
        with self._state:
            pending = self._pending.get(key)
        if pending is None:
            return None
        asked_at, asked_at_counter = pending
        expired = (
            scanned_at is not None
            and lease is not None
            and self._taker.is_expired(lease, scanned_at)
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
        log.warning(
            "worker %s: %s did not hand off %s; taking it",
            self.worker_id,
            lease.checkpoint_owner,
            key,
        )
        return self._take(lease, stolen=True)

    def _adopt(self, lease: Lease) -> Lease | None:
        with self.held.lock_for(lease.lease_key):
            sent_at = self._clock()
            try:
                fresh = self.table.adopt(lease)
            except LeaseLostError:
                return None
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: adopting %s failed: %r", self.worker_id, lease.lease_key, exc
                )
                return None
            fresh.concurrency_token = uuid.uuid4().hex
            self._install(fresh, sent_at)
        if self._metrics is not None:
            self._metrics.leases_stolen.inc()
        log.info("worker %s: handoff of %s complete", self.worker_id, lease.lease_key)
        return fresh.copy()

    def _take(self, lease: Lease, *, stolen: bool) -> Lease | None:
        with self.held.lock_for(lease.lease_key):
            sent_at = self._clock()
            try:
                fresh = self.table.take(lease, self.worker_id)
            except LeaseLostError:
                log.info(
                    "worker %s: lease %s changed before it could be taken",
                    self.worker_id,
                    lease.lease_key,
                )
                return None
            except _TABLE_ERRORS as exc:
                log.warning("worker %s: taking %s failed: %r", self.worker_id, lease.lease_key, exc)
                return None
            fresh.concurrency_token = uuid.uuid4().hex
            self._install(fresh, sent_at)
        if self._metrics is not None:
            (self._metrics.leases_stolen if stolen else self._metrics.leases_taken).inc()
        return fresh.copy()

    def _clean_up(self, leases: list[Lease]) -> None:
        """Delete the finished leases ``cleanup.py`` says this worker should delete."""
        for lease in cleanup.deletable(leases, self.worker_id):
            try:
                deleted = self.table.delete(lease)
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: deleting %s failed: %r", self.worker_id, lease.lease_key, exc
                )
                continue
            if deleted:
                log.info(
                    "worker %s deleted the lease of finished shard %s",
                    self.worker_id,
                    lease.lease_key,
                )

    # -- release ---------------------------------------------------------------------------

    def release(self, shard_id: str) -> None:
        """Give a held lease back so it can move at once (``LeaseFence.release``)."""
        self.fence.release(shard_id)

    def _give_up_pending(self) -> None:
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
            except (LeaseLostError, *_TABLE_ERRORS) as exc:
                log.info("worker %s: leaving %s to expire: %r", self.worker_id, key, exc)
        with self._state:
            self._pending.clear()

    def release_all(self) -> None:
        for key in self.held.entries():
            self.release(key)
