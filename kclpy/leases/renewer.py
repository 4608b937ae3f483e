"""Keeping held leases alive: the renewal cycle, as the Java KCL 2.x ``DynamoDBLeaseRenewer``.

Every held lease is written at least every ``failover_time_s / 2``; a checkpoint counts as
that write (the held set records it), so a lease its processor checkpoints often is never
renewed at all. A failed renewal is retried after a quarter of that interval, which gives
more attempts before the failover time runs out than Java's ``failover / 3`` cadence.
Each renewal is a write through the fence: a failed condition means another worker took the
lease (the fence drops it and tells the listeners) or asks for it back (a graceful handoff:
the fence announces it and the renewal is repeated as the handing-off holder). A lease
without a successful write for longer than the failover time is dropped without another
attempt: by then other workers may have taken it. One kept past the handoff timeout is let
go regardless.

Each lease's renewal runs on its own: the cycle starts the due renewals on a pool and does not
wait for them, and a lease whose renewal (or checkpoint) is still on its way is not started
again. One slow answer (a throttled retry, a latency spike) therefore delays only its own
lease - never the renewal of the others, nor the loop whose punctuality tells the worker it
is starved of CPU (``coordinator.pace_retrieval``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kclpy.errors import KinesisClientLibDependencyException, ShutdownException, ThrottlingException
from kclpy.leases.budget import ScanBudget
from kclpy.leases.fence import LeaseFence
from kclpy.metrics import (
    NOWHERE,
    RENEW_LEASE,
    RENEWAL_CURRENT_LEASES,
    RENEWAL_LOST_LEASES,
    RENEWAL_PASS,
    Metrics,
)

log = logging.getLogger(__name__)


class LeaseRenewer:
    """Renews the leases of one worker's held set through its fence."""

    def __init__(
        self,
        fence: LeaseFence,
        *,
        failover_time_s: float,
        graceful_handoff_timeout_s: float,
        budget: ScanBudget,
        clock: Callable[[], float],
        metrics: Metrics | None = None,
        threads: int = 16,
    ) -> None:
        if threads < 1:
            raise ValueError("renewal_threads must be at least 1")
        self.fence = fence
        self.held = fence.held
        self.worker_id = fence.worker_id
        self.failover_time_s = failover_time_s
        self.interval_s = failover_time_s / 2
        self.graceful_handoff_timeout_s = graceful_handoff_timeout_s
        self._budget = budget
        self._clock = clock
        self._metrics = metrics if metrics is not None else NOWHERE
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._flight = threading.Lock()
        #: leases whose renewal was started and has not finished
        self._in_flight: set[str] = set()

    def run_once(self, *, due_only: bool = False) -> None:
        """Renew every held lease (with ``due_only``, those whose renewal is due, overdue or
        past the handoff timeout) and wait for those renewals."""
        for future in self._start(due_only):
            future.result()

    def dispatch_due(self) -> None:
        """Start the renewals that are due without waiting for them (the renewer loop)."""
        self._start(True)

    def _start(self, due_only: bool) -> list[Future[None]]:
        now = self._clock()
        with self._flight:
            keys = [
                key
                for key, held in self.held.entries().items()
                if key not in self._in_flight and (
                    not due_only
                    or held.renew_due <= now
                    or now - held.renewed_at > self.failover_time_s
                    or (
                        held.handoff_since is not None
                        and now - held.handoff_since > self.graceful_handoff_timeout_s
                    ))
            ]
            self._in_flight.update(keys)
        if not keys:
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._threads, thread_name_prefix=f"kclpy-renew-{self.worker_id}")
        renewal_pass = _Pass(len(keys), len(self.held), self._report)
        return [self._pool.submit(self._renew_one, key, renewal_pass) for key in keys]

    def _renew_one(self, lease_key: str, renewal_pass: _Pass) -> None:
        try:
            self._renew(lease_key)
        except Exception:
            # A renewal thread that died silently would lose its lease; log and go on.
            log.exception("worker %s: renewing %s failed", self.worker_id, lease_key)
        finally:
            with self._flight:
                self._in_flight.discard(lease_key)
            renewal_pass.done(len(self.held))

    def _report(self, held_before: int, held: int, seconds: float) -> None:
        """The Java renewer's ``RenewAllLeases`` figures for one pass, once its last
        renewal is over."""
        self._metrics.set(RENEWAL_CURRENT_LEASES, held)
        self._metrics.set(RENEWAL_LOST_LEASES, max(0, held_before - held))
        self._metrics.call(RENEWAL_PASS, seconds, True)

    def renewing(self) -> frozenset[str]:
        """The leases whose renewal was started and has not ended: the next pass skips them."""
        with self._flight:
            return frozenset(self._in_flight)

    def next_wait(self) -> float:
        """Until the next renewal or handoff deadline; at most a quarter of the renewal
        interval, so the loop keeps proving it is alive (the coordinator's ``healthy``) even
        with no leases, and notices soon when the process is too busy to run it."""
        now = self._clock()
        deadlines = [now + self.interval_s / 4]
        in_flight = self.renewing()
        for key, held in self.held.entries().items():
            if key in in_flight:
                continue  # its renewal is on its way; when it ends, its due time is new
            deadlines.append(held.renew_due)
            if held.handoff_since is not None:
                deadlines.append(held.handoff_since + self.graceful_handoff_timeout_s)
        return max(0.01, min(deadlines) - now)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

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
        started = time.perf_counter()
        try:
            self.fence.write(lease_key, None, self.fence.table.renew, what="renewal")
        except ShutdownException:
            if not expired:
                self._count_failure(time.perf_counter() - started)
            return
        except (ThrottlingException, KinesisClientLibDependencyException) as exc:
            self._count_failure(time.perf_counter() - started)
            with self.held.lock_for(lease_key):
                entry = self.held.entry(lease_key)
                if entry is not None:
                    entry.renew_due = now + self.interval_s / 4
            log.warning("worker %s: renewing %s failed: %r", self.worker_id, lease_key,
                        exc.__cause__ or exc)
            return
        self._metrics.call(RENEW_LEASE, time.perf_counter() - started, True)

    def _count_failure(self, seconds: float) -> None:
        self._metrics.call(RENEW_LEASE, seconds, False)


class _Pass:
    """The renewals one cycle started, reported together when the last one ends."""

    def __init__(self, count: int, held_before: int,
                 report: Callable[[int, int, float], None]) -> None:
        self._left = count
        self._held_before = held_before
        self._report = report
        self._started = time.perf_counter()
        self._lock = threading.Lock()

    def done(self, held_now: int) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._report(self._held_before, held_now, time.perf_counter() - self._started)
