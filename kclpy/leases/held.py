"""The leases this worker holds: their latest copy, their locks, and who to tell when one goes.

Everything that writes a held lease - renewals, checkpoints, releases, a feature's own fenced
write - reads and replaces the entry here under that lease's lock, so whoever writes next
always conditions on the counter the previous write returned. The set itself never calls
DynamoDB; ``fence.py`` does, and ``renewer.py`` / the coordinator decide when.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kclpy.leases.lease import Lease
from kclpy.metrics import LEASES_EXPIRED, LEASES_HELD, LEASES_LOST, NOWHERE, Metrics

log = logging.getLogger(__name__)

Listener = Callable[[str], None]


@dataclass
class HeldLease:
    """One held lease and the clock readings that decide when it must be written again."""

    lease: Lease
    #: clock() when the last successful write (take, renewal, checkpoint) was sent
    renewed_at: float
    #: clock() when the renewer should next write this lease
    renew_due: float
    #: the lease counter this tenure started at (take or adopt). Every earlier tenure, by
    #: this or any other worker, held smaller counters: what an external store compares to
    #: tell a zombie's commit from the current holder's.
    tenure: int
    #: clock() when another worker asked for this lease (graceful handoff), or None
    handoff_since: float | None = None
    #: the writes of this lease sent since the last one known to have landed whose answer
    #: never came (an error after the request left: it may have landed), by write id
    #: (``Lease.write_id``), each with the clock() reading when it was sent. The fence
    #: recognises one of them in the item when a later write is refused by the counter it
    #: moved, and dates the lease from its sending, never later (``LeaseFence._attempt``).
    unanswered: dict[str, float] = field(default_factory=dict)
    #: those of ``unanswered`` that committed other items with the lease item (a state
    #: transaction): a later transaction is never repeated over one of them that landed,
    #: since its own items were built on the state as it was before that one
    unanswered_transactions: set[str] = field(default_factory=set)


class HeldSet:
    """The held leases of one worker. Thread-safe; its own lock is never held while calling
    out (DynamoDB, listeners)."""

    def __init__(
        self,
        worker_id: str,
        *,
        renewer_interval_s: float,
        metrics: Metrics | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._on_drop: Listener | None = None
        self._on_notice: Callable[[], None] | None = None
        self.renewer_interval_s = renewer_interval_s
        self._metrics = metrics if metrics is not None else NOWHERE
        self._state = threading.Lock()
        self._held: dict[str, HeldLease] = {}
        #: one lock per lease key, never removed, so a lease is never guarded by two locks
        self._locks: dict[str, threading.Lock] = {}
        self._lost_listeners: list[Listener] = []
        self._handoff_listeners: list[Listener] = []
        #: why each lease this worker no longer holds was given up, so that a write refused
        #: for it says "expired here" or "taken by another worker", not just "not held"
        self._gone: dict[str, str] = {}

    def set_notice_hook(self, fn: Callable[[], None]) -> None:
        """``fn()`` is called when a write's answer shows a leader's new assignment notice on a
        held lease (``Lease.assignment_notice``): the taker then looks for its new leases."""
        self._on_notice = fn

    def set_drop_hook(self, fn: Listener) -> None:
        """``fn(key)`` is called at once (the lease's lock held) when a lease is lost or
        handed off: the taker's memory of what it must not steal straight back."""
        self._on_drop = fn

    # -- locks and entries -----------------------------------------------------------------

    def lock_for(self, lease_key: str) -> threading.Lock:
        """The lock under which ``lease_key``'s entry is read, written to DynamoDB and replaced."""
        with self._state:
            return self._locks.setdefault(lease_key, threading.Lock())

    def entry(self, lease_key: str) -> HeldLease | None:
        """The live entry (mutable: change it only with the lease's lock held)."""
        with self._state:
            return self._held.get(lease_key)

    def entries(self) -> dict[str, HeldLease]:
        with self._state:
            return dict(self._held)

    def install(self, lease: Lease, sent_at: float, handoff_since: float | None = None) -> None:
        """Record ``lease`` as written at ``sent_at``. A lease with a new concurrency token
        starts a new tenure at its counter; the same token keeps the tenure it had."""
        with self._state:
            previous = self._held.get(lease.lease_key)
            tenure = lease.lease_counter
            if previous is not None and previous.lease.concurrency_token == lease.concurrency_token:
                tenure = previous.tenure
            self._held[lease.lease_key] = HeldLease(
                lease, sent_at, sent_at + self.renewer_interval_s, tenure, handoff_since
            )
            self._gone.pop(lease.lease_key, None)
            count = len(self._held)
        self._publish(count)

    def refresh(self, entry: HeldLease, lease: Lease, sent_at: float, *,
                observed: bool = True) -> bool:
        """Record a holder's write of ``entry``'s lease that was sent at ``sent_at``. False,
        and nothing recorded, when the worker gave the lease up while the write was on its
        way (``expire``): a late answer must not bring back a lease whose processor was
        already told it is lost - the shard would then stay held and never be consumed.

        A write whose answer did not carry the item (``observed`` False: a transaction)
        proves the lease held but leaves the next renewal due when it was: the renewal's
        answer is how the holder sees what others added to the item (an operator's
        recovery requests), so a shard that only commits transactions is still renewed."""
        with self._state:
            if self._held.get(lease.lease_key) is not entry:
                return False
            noticed = (lease.assignment_notice is not None
                       and lease.assignment_notice != entry.lease.assignment_notice)
            entry.lease = lease
            entry.renewed_at = sent_at
            # a write from the counter these were sent at landed: none of them can land now
            entry.unanswered.clear()
            entry.unanswered_transactions.clear()
            if observed:
                entry.renew_due = sent_at + self.renewer_interval_s
            on_notice = self._on_notice if noticed else None
        if on_notice is not None:
            on_notice()
        return True

    def expire(self, now: float, failover_time_s: float) -> list[str]:
        """Give up every lease not written for longer than the failover time, without
        waiting for its lock: a write still on its way then finds it gone (``refresh``).
        By then another worker may have taken it, so this worker must stop acting as its
        holder whether or not that write lands. Returns the keys given up; the caller tells
        the lost listeners."""
        expired: list[str] = []
        with self._state:
            for key, held in list(self._held.items()):
                if now - held.renewed_at > failover_time_s:
                    del self._held[key]
                    self._gone[key] = (f"expired on this worker (not renewed for "
                                       f"{now - held.renewed_at:.1f}s, longer than the "
                                       f"failover time)")
                    expired.append(key)
            count = len(self._held)
        for key in expired:
            log.warning("worker %s gave up lease %s: %s", self.worker_id, key, self._gone[key])
            self._metrics.inc(LEASES_LOST)
            self._metrics.inc(LEASES_EXPIRED)
        if expired:
            self._publish(count)
        return expired

    def gone_why(self, lease_key: str) -> str:
        """Why ``lease_key`` is not held (for the error a refused write raises)."""
        with self._state:
            return self._gone.get(lease_key, "not held by this worker")

    def drop(self, lease_key: str, why: str, entry: HeldLease | None = None) -> bool:
        """Forget a lost lease (its lock held; notify after releasing it). False if it was
        not held - or, given ``entry`` (the tenure the failed write was made for), if the
        lease is held in another entry now: the background release of a tenure given up
        must not drop the tenure that took the lease again before that release was written."""
        with self._state:
            current = self._held.get(lease_key)
            if current is None or (entry is not None and current is not entry):
                return False
            del self._held[lease_key]
            self._gone[lease_key] = why
            count = len(self._held)
        if self._on_drop is not None:
            self._on_drop(lease_key)
        log.warning("worker %s lost lease %s: %s", self.worker_id, lease_key, why)
        self._metrics.inc(LEASES_LOST)
        self._publish(count)
        return True

    def forget(self, lease_key: str) -> HeldLease | None:
        """Forget a lease this worker gives up on purpose (its lock held)."""
        with self._state:
            held = self._held.pop(lease_key, None)
            if held is not None:
                self._gone[lease_key] = "released by this worker"
            count = len(self._held)
        if held is None:
            return None
        if held.handoff_since is not None and self._on_drop is not None:
            self._on_drop(lease_key)  # it goes to the worker that asked: not to be taken back
        self._publish(count)
        return held

    def _publish(self, count: int) -> None:
        self._metrics.set(LEASES_HELD, count)

    # -- queries (copies) --------------------------------------------------------------------

    def leases(self) -> dict[str, Lease]:
        """Copies of the leases held; ``expire`` first gives up those not written within the
        failover time."""
        with self._state:
            return {key: held.lease.copy() for key, held in self._held.items()}

    def get(self, lease_key: str) -> Lease | None:
        with self._state:
            held = self._held.get(lease_key)
            return None if held is None else held.lease.copy()

    def handing_off(self, lease_key: str) -> bool:
        """Another worker asked for this held lease and waits for it."""
        with self._state:
            held = self._held.get(lease_key)
            return held is not None and held.handoff_since is not None

    def __len__(self) -> int:
        with self._state:
            return len(self._held)

    # -- listeners ---------------------------------------------------------------------------

    def add_lost_listener(self, fn: Listener) -> None:
        with self._state:
            self._lost_listeners.append(fn)

    def add_handoff_listener(self, fn: Listener) -> None:
        with self._state:
            self._handoff_listeners.append(fn)

    def notify_lost(self, lease_key: str) -> None:
        with self._state:
            listeners = list(self._lost_listeners)
        _call_each(listeners, lease_key)

    def notify_handoff(self, lease_key: str) -> bool:
        """Tell the handoff listeners; False when there are none (the caller then releases
        the lease itself, since nobody is there to wind its processor down)."""
        with self._state:
            listeners = list(self._handoff_listeners)
        _call_each(listeners, lease_key)
        return bool(listeners)


def _call_each(listeners: Iterable[Listener], lease_key: str) -> None:
    for fn in listeners:
        try:
            fn(lease_key)
        except Exception:
            log.exception("lease listener failed for %s", lease_key)
