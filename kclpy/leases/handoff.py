"""Graceful lease handoff, the Java KCL 3.x ``checkpointOwner`` protocol: the decisions.

The states of one lease, as the table shows them:

==============================  =====================================================
``leaseOwner=A``                A holds it.
``leaseOwner=B``,               B asked for it (``LeaseTable.set_checkpoint_owner``; the
``checkpointOwner=A``           counter is not bumped, as in Java). A still holds it: it
                                renews and checkpoints fenced on ``checkpointOwner=A``,
                                while its processor runs ``shutdown_requested``.
``leaseOwner=B``                A let go (``LeaseTable.evict`` removed
                                ``checkpointOwner``). B adopts it with a fenced write and
                                starts from A's last checkpoint.
==============================  =====================================================

A lease parked while it is handed off (A's ``park`` processor-error policy marks it through
A's fence, as the handing-off holder) is never adopted: A's release removes both names,
cancelling the handoff (the lease ends unowned and parked, as an operator's park leaves it),
and B forgets a parked lease whatever state it is in (``next_step``).

A finds out it was asked when its next fenced write (renewal or checkpoint) fails and the
item it gets back names it as ``checkpointOwner`` with an unchanged counter; it then repeats
the write as the handing-off holder. B finds out A let go by reading the lease (its scans,
and a cheap read of just that lease in between).

B never writes while ``checkpointOwner`` is set, except to take a lease that has expired (A
died: nobody renews it) or that A kept past the handoff timeout plus the failover time (A
ignores the protocol, as a Java 2.x worker does). Either take bumps the counter, so A's
next write fails and A's processor is fenced out.
"""

from __future__ import annotations

import enum

from kclpy.leases.lease import Lease


class Step(enum.Enum):
    """What a worker waiting for a handed-off lease does next."""

    #: the previous owner still holds it
    WAIT = "wait"
    #: the previous owner let go: start the new tenure
    ADOPT = "adopt"
    #: the previous owner is dead or does not let go: take it outright
    TAKE = "take"
    #: the lease went elsewhere or is gone: stop waiting
    FORGET = "forget"


def is_request_to_hand_off(held: Lease, current: Lease | None, worker_id: str) -> bool:
    """Does ``current`` (the item after a failed write of ``held``) ask this worker to hand
    the lease off? Only if nothing else changed: same counter, this worker named as
    ``checkpointOwner``, another worker as ``leaseOwner``."""
    return (
        current is not None
        and held.checkpoint_owner is None
        and current.checkpoint_owner == worker_id
        and current.lease_owner is not None
        and current.lease_owner != worker_id
        and current.lease_counter == held.lease_counter
    )


def request_landed(asked: Lease, current: Lease | None, worker_id: str) -> bool:
    """After asking for ``asked`` failed (its condition refused, or no answer came): did the
    request land anyway? It did when ``current`` (read just after) names this worker as
    ``leaseOwner`` and the owner asked (or nobody, once it let go) as ``checkpointOwner`` -
    only this worker's own request writes that (the counter may have moved since: the
    handing-off owner renews). The usual way there: the first attempt was
    written but its answer lost, and the SDK's retry was refused by the condition the first
    attempt had just changed. Forgetting it would leave the lease to nobody until it expired
    (the handoff timeout plus the failover time)."""
    return (
        current is not None
        and current.lease_owner == worker_id
        and current.checkpoint_owner in (asked.lease_owner, None)
    )


def as_handing_off(held: Lease, current: Lease, worker_id: str) -> Lease:
    """The held lease in the handing-off state: writes are fenced on ``checkpointOwner``."""
    return held.copy(lease_owner=current.lease_owner, checkpoint_owner=worker_id)


def next_step(
    lease: Lease | None, worker_id: str, *, asked_at_counter: int, expired: bool, overdue: bool
) -> Step:
    """For a lease handed to ``worker_id``, read just now. ``asked_at_counter``: its counter
    when the handoff was asked (asking does not bump it, so a read still at that counter
    naming another owner is older than the request - reads may be eventually consistent);
    ``expired``: its counter stood still for longer than the failover time; ``overdue``:
    the handoff has waited longer than the handoff timeout plus the failover time.

    A parked lease (``kclpyParked``: the holder's ``park`` processor-error policy marked it
    while handing it off, or an operator parked it) is forgotten whatever the rest says:
    nobody may start a consumer on it until an operator resumes it, so there is nothing to
    wait for. Its holder's release cancels the handoff (``LeaseTable.evict``); a holder that
    died before releasing leaves the request behind, which the requester must not complete
    by a take either."""
    if lease is None or lease.parked is not None:
        return Step.FORGET
    if lease.lease_owner != worker_id:
        return Step.WAIT if lease.lease_counter <= asked_at_counter else Step.FORGET
    if lease.checkpoint_owner is None:
        return Step.ADOPT
    if expired or overdue:
        return Step.TAKE
    return Step.WAIT
