"""One worker's side of the lease protocol: take, renew, fence checkpoints, release.

Two background threads, as in the Java KCL 2.x ``DynamoDBLeaseCoordinator``:

- the *renewer*, every ``failover_time_s / 3``, bumps the counter of every held lease
  (conditional on counter and owner). A failed condition means another worker took the
  lease: it is dropped at once and the lease-lost listeners are called. A lease whose last
  successful renewal is older than the failover time (DynamoDB unreachable, process
  suspended) is dropped too, because by then other workers may have taken it.
- the *taker*, every ``2 * failover_time_s + 0.05`` s (Java's interval) or sooner after
  ``wake_taker()``, scans the table and takes or steals leases (rules in ``taker.py``).

Request cost per held lease and hour is therefore ``3600 / (failover / 3)`` renewals plus a
share of the scans, as in Java.

The renewer, the taker and checkpoint writes all change the same items, so each lease has a
lock under which its counter is read and written: whoever writes next always uses the counter
the previous write returned (``ALL_NEW``). A checkpoint write counts as a renewal.

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
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from kclpy.errors import (
    KinesisClientLibDependencyException,
    LeaseLostError,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable, LeaseTableThrottled
from kclpy.leases.taker import LeaseTaker
from kclpy.metrics import Metrics

log = logging.getLogger(__name__)

#: failures of a lease-table request that say nothing about who owns the lease
_TABLE_ERRORS = (LeaseTableThrottled, ClientError, BotoCoreError)


@dataclass
class _Held:
    lease: Lease
    #: clock() when the last successful renewal (or take, or checkpoint) was sent
    renewed_at: float


class LeaseCoordinator:
    """Takes, renews and releases this worker's leases; implements ``CheckpointWriter``."""

    def __init__(
        self,
        table: LeaseTable,
        worker_id: str,
        *,
        failover_time_s: float = 10.0,
        max_leases_for_worker: int | None = None,
        max_leases_to_steal_at_one_time: int = 1,
        taker_interval_s: float | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        renewal_threads: int = 4,
        rng: random.Random | None = None,
    ) -> None:
        if failover_time_s <= 0:
            raise ValueError("failover_time_s must be positive")
        if renewal_threads < 1:
            raise ValueError("renewal_threads must be at least 1")
        self.table = table
        self.worker_id = worker_id
        self.failover_time_s = failover_time_s
        self.renewer_interval_s = failover_time_s / 3
        self.taker_interval_s = (
            taker_interval_s if taker_interval_s is not None else 2 * failover_time_s + 0.05
        )
        self._metrics = metrics
        self._clock = clock
        self._renewal_threads = renewal_threads
        self._taker = LeaseTaker(
            worker_id,
            failover_time_s,
            max_leases_for_worker=max_leases_for_worker,
            max_leases_to_steal_at_one_time=max_leases_to_steal_at_one_time,
            rng=rng,
        )
        #: guards the dictionaries below (never held while calling DynamoDB)
        self._state = threading.Lock()
        self._held: dict[str, _Held] = {}
        #: one lock per lease key, never removed, so a lease is never guarded by two locks
        self._lease_locks: dict[str, threading.Lock] = {}
        #: lease key -> taker cycle in which it was lost; not stolen back in the next cycle
        self._lost_in_cycle: dict[str, int] = {}
        self._known_shards: frozenset[str] | None = None
        #: the leases of the last taker scan, for readers that must not wait for a cycle
        self._last_scan: list[Lease] = []
        self._listeners: list[Callable[[str], None]] = []
        #: serialises taker cycles (background thread and run_taker_once callers)
        self._taker_lock = threading.Lock()
        self._taker_cycle = 0
        self._stopping = threading.Event()
        self._last_renewal_cycle = clock()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool: ThreadPoolExecutor | None = None

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

    def _renewer_loop(self) -> None:
        while not self._stopping.wait(self.renewer_interval_s):
            try:
                self.run_renewer_once()
                self._last_renewal_cycle = self._clock()
            except Exception:
                # A dead renewer would silently lose every lease; log and keep going.
                log.exception("worker %s: lease renewal cycle failed", self.worker_id)

    def _taker_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.run_taker_once()
            except Exception:
                log.exception("worker %s: lease taker cycle failed", self.worker_id)
            self._wake.wait(self.taker_interval_s)
            self._wake.clear()

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
        with self._state:
            self._listeners.append(fn)

    def set_known_shards(self, shard_ids: set[str] | None) -> None:
        """Only leases of these shards are taken; None allows every lease."""
        with self._state:
            self._known_shards = None if shard_ids is None else frozenset(shard_ids)

    def wake_taker(self) -> None:
        self._wake.set()

    def held_leases(self) -> dict[str, Lease]:
        with self._state:
            return {key: held.lease.copy() for key, held in self._held.items()}

    def get_held(self, shard_id: str) -> Lease | None:
        with self._state:
            held = self._held.get(shard_id)
            return None if held is None else held.lease.copy()

    def get_lease(self, shard_id: str) -> Lease | None:
        """The lease as the table has it now (e.g. whether a parent reached SHARD_END)."""
        return self.table.get(shard_id)

    def all_leases(self) -> list[Lease]:
        """Every lease as of the last taker scan."""
        with self._state:
            return [lease.copy() for lease in self._last_scan]

    # -- internals shared by renewer, taker and checkpoints --------------------------------

    def _lock_for(self, lease_key: str) -> threading.Lock:
        with self._state:
            return self._lease_locks.setdefault(lease_key, threading.Lock())

    def _drop(self, lease_key: str, why: str) -> None:
        """Forget a lost lease. Call with the lease's lock held; notify after releasing it."""
        with self._state:
            if self._held.pop(lease_key, None) is None:
                return
            self._lost_in_cycle[lease_key] = self._taker_cycle
            held_count = len(self._held)
        log.warning("worker %s lost lease %s: %s", self.worker_id, lease_key, why)
        if self._metrics is not None:
            self._metrics.leases_lost.inc()
            self._metrics.leases_held.set(held_count)

    def _notify_lost(self, lease_key: str) -> None:
        with self._state:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(lease_key)
            except Exception:
                log.exception("lease-lost listener failed for %s", lease_key)

    def _install(self, lease: Lease, renewed_at: float) -> None:
        with self._state:
            self._held[lease.lease_key] = _Held(lease, renewed_at)
            held_count = len(self._held)
        if self._metrics is not None:
            self._metrics.leases_held.set(held_count)

    # -- renewer -------------------------------------------------------------------------

    def run_renewer_once(self) -> None:
        """Renew every held lease once; drop (and report) the ones that are lost."""
        with self._state:
            keys = list(self._held)
        if len(keys) <= 1 or self._renewal_threads == 1:
            lost = [key for key in keys if self._renew(key)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._renewal_threads, thread_name_prefix=f"kclpy-renew-{self.worker_id}"
                )
            lost = [
                key
                for key, gone in zip(keys, self._pool.map(self._renew, keys), strict=True)
                if gone
            ]
        for key in lost:
            self._notify_lost(key)

    def _renew(self, lease_key: str) -> bool:
        """Renew one lease; True if it was dropped as lost."""
        with self._lock_for(lease_key):
            with self._state:
                held = self._held.get(lease_key)
            if held is None:
                return False
            sent_at = self._clock()
            try:
                fresh = self.table.renew(held.lease)
            except LeaseLostError:
                self._count_renew_failure()
                self._drop(lease_key, "renewal found it changed (taken by another worker)")
                return True
            except _TABLE_ERRORS as exc:
                self._count_renew_failure()
                silent_for = self._clock() - held.renewed_at
                if silent_for > self.failover_time_s:
                    self._drop(lease_key, f"not renewed for {silent_for:.1f}s ({exc!r})")
                    return True
                log.warning("worker %s: renewing %s failed: %r", self.worker_id, lease_key, exc)
                return False
            self._install(fresh, sent_at)
        if self._metrics is not None:
            self._metrics.lease_renewals.inc()
        return False

    def _count_renew_failure(self) -> None:
        if self._metrics is not None:
            self._metrics.lease_renew_failures.inc()

    # -- taker ---------------------------------------------------------------------------

    def run_taker_once(self) -> list[Lease]:
        """One taker cycle: scan, decide, take. Returns the leases newly taken (copies)."""
        with self._taker_lock:
            with self._state:
                self._taker_cycle += 1
            try:
                leases = self.table.list_leases()
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: lease scan failed, no leases taken: %r", self.worker_id, exc
                )
                return []
            now = self._clock()
            self._taker.observe(leases, now)
            with self._state:
                self._last_scan = leases
                held = set(self._held)
                known = self._known_shards
                cycle = self._taker_cycle
                self._lost_in_cycle = {
                    key: lost for key, lost in self._lost_in_cycle.items() if cycle - lost <= 1
                }
                no_steal = set(self._lost_in_cycle)
            plan = self._taker.plan(held=held, known_shards=known, no_steal=no_steal, now=now)
            taken = [fresh for lease in plan.take if (fresh := self._take(lease, stolen=False))]
            taken += [fresh for lease in plan.steal if (fresh := self.steal(lease))]
            if taken:
                log.info("worker %s took %s", self.worker_id, ", ".join(t.lease_key for t in taken))
            return taken

    def steal(self, lease: Lease) -> Lease | None:
        """Take a lease from a live worker. The seam for a graceful (Java 3.x
        ``checkpointOwner``) handoff: override to ask the owner instead of taking outright."""
        return self._take(lease, stolen=True)

    def _take(self, lease: Lease, *, stolen: bool) -> Lease | None:
        with self._lock_for(lease.lease_key):
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

    # -- checkpoints (CheckpointWriter) --------------------------------------------------

    def update_checkpoint(
        self, shard_id: str, concurrency_token: str, checkpoint: str, sub_sequence_number: int
    ) -> None:
        """Write a checkpoint, fenced twice: locally by the concurrency token of the tenure
        the checkpointer belongs to, and in DynamoDB by counter and owner."""
        lost = False
        with self._lock_for(shard_id):
            with self._state:
                held = self._held.get(shard_id)
            if held is None or held.lease.concurrency_token != concurrency_token:
                raise ShutdownException(
                    f"shard {shard_id}: lease not held by this checkpointer's tenure"
                )
            sent_at = self._clock()
            try:
                fresh = self.table.update_checkpoint(held.lease, checkpoint, sub_sequence_number)
            except LeaseLostError:
                self._drop(shard_id, "checkpoint found it changed (taken by another worker)")
                lost = True
            except LeaseTableThrottled as exc:
                raise ThrottlingException(f"shard {shard_id}: {exc}") from exc
            except (ClientError, BotoCoreError) as exc:
                raise KinesisClientLibDependencyException(
                    f"shard {shard_id}: checkpoint write failed: {exc}"
                ) from exc
            else:
                self._install(fresh, sent_at)
        if lost:
            self._notify_lost(shard_id)
            raise ShutdownException(f"shard {shard_id}: lease was taken by another worker")

    # -- release ---------------------------------------------------------------------------

    def release(self, shard_id: str) -> None:
        """Give a held lease back (no owner) so any worker may take it at once. Listeners are
        not called: the caller chose this. Failures are logged; the lease then simply
        expires."""
        with self._lock_for(shard_id):
            with self._state:
                held = self._held.pop(shard_id, None)
                held_count = len(self._held)
            if held is None:
                return
            if self._metrics is not None:
                self._metrics.leases_held.set(held_count)
            try:
                self.table.evict(held.lease)
            except LeaseLostError:
                log.info("worker %s: lease %s was already taken", self.worker_id, shard_id)
            except _TABLE_ERRORS as exc:
                log.warning(
                    "worker %s: releasing %s failed, it will expire instead: %r",
                    self.worker_id,
                    shard_id,
                    exc,
                )

    def release_all(self) -> None:
        with self._state:
            keys = list(self._held)
        for key in keys:
            self.release(key)
