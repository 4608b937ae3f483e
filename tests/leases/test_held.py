"""HeldSet (kclpy/leases/held.py): the leases a worker holds, their locks, and who is told when
one goes; first through the coordinator that owns it, then directly."""

from __future__ import annotations

from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from tests.support.determinism import Clock
from tests.support.leases import coordinator, create, fetch, sample


def test_held_leases_are_copies(table: LeaseTable, clock: Clock) -> None:
    create(table, "s1")
    a, _ = coordinator(table, "A", clock)
    a.run_taker_once()
    a.held_leases()["s1"].lease_counter = 999
    held = a.get_held("s1")
    assert held is not None
    held.concurrency_token = "forged"
    assert a.get_held("s1") == fetch(table, "s1")
    again = a.get_held("s1")
    assert again is not None and again.concurrency_token != "forged"
    assert a.get_held("nope") is None


# -- the set on its own: no table, no threads -------------------------------------------------

INTERVAL = 5.0


def lease(key: str, counter: int, token: str) -> Lease:
    return Lease(key, lease_owner="A", lease_counter=counter, concurrency_token=token)


def test_a_new_token_starts_a_tenure_at_its_counter_and_the_same_token_keeps_it() -> None:
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    held.install(lease("s1", 7, "first"), sent_at=100.0)
    entry = held.entry("s1")
    assert entry is not None
    assert (entry.tenure, entry.renewed_at, entry.renew_due) == (7, 100.0, 100.0 + INTERVAL)
    held.install(lease("s1", 9, "first"), sent_at=101.0)
    assert tenure(held, "s1") == 7
    held.install(lease("s1", 12, "second"), sent_at=102.0)
    assert tenure(held, "s1") == 12


def tenure(held: HeldSet, key: str) -> int:
    entry = held.entry(key)
    assert entry is not None
    return entry.tenure


def test_a_late_answer_does_not_bring_back_a_lease_that_expired_meanwhile() -> None:
    metrics = Metrics()
    held = HeldSet("A", renewer_interval_s=INTERVAL, metrics=metrics)
    held.install(lease("old", 1, "t"), sent_at=0.0)
    held.install(lease("young", 1, "t"), sent_at=8.0)
    entry = held.entry("old")
    assert entry is not None
    assert held.expire(now=10.5, failover_time_s=10.0) == ["old"]
    assert not held.refresh(entry, lease("old", 2, "t"), sent_at=10.6)
    assert held.get("old") is None and set(held.leases()) == {"young"}
    assert held.gone_why("old").startswith("expired on this worker (not renewed for 10.5s")
    assert sample(metrics, "kclpy_leases_lost_total") == 1
    assert sample(metrics, "kclpy_leases_expired_total") == 1
    assert sample(metrics, "kclpy_leases_held") == 1


def test_an_unobserved_write_proves_the_lease_held_but_keeps_the_renewal_due() -> None:
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    held.install(lease("s1", 1, "t"), sent_at=0.0)
    entry = held.entry("s1")
    assert entry is not None
    assert held.refresh(entry, lease("s1", 2, "t"), sent_at=3.0, observed=False)
    assert (entry.renewed_at, entry.renew_due) == (3.0, INTERVAL)
    assert held.refresh(entry, lease("s1", 3, "t"), sent_at=4.0)
    assert (entry.renewed_at, entry.renew_due) == (4.0, 4.0 + INTERVAL)
    assert entry.lease.lease_counter == 3


def test_a_write_that_returns_a_new_assignment_notice_tells_the_notice_hook() -> None:
    """A leader's notice rides on the holder's next write (``leader.py``): only a changed
    notice tells the hook, not one the lease already carried when taken."""
    heard: list[str] = []
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    held.set_notice_hook(lambda: heard.append("notice"))
    held.install(lease("s1", 1, "t").copy(assignment_notice="old"), sent_at=0.0)
    entry = held.entry("s1")
    assert entry is not None
    assert held.refresh(entry, lease("s1", 2, "t").copy(assignment_notice="old"), sent_at=1.0)
    assert heard == []
    assert held.refresh(entry, lease("s1", 3, "t").copy(assignment_notice="new"), sent_at=2.0)
    assert heard == ["notice"]
    assert held.refresh(entry, lease("s1", 4, "t").copy(assignment_notice="new"), sent_at=3.0)
    assert heard == ["notice"]


def test_a_lost_lease_tells_the_drop_hook_and_a_released_one_only_after_a_handoff() -> None:
    dropped: list[str] = []
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    held.set_drop_hook(dropped.append)
    held.install(lease("lost", 1, "t"), sent_at=0.0)
    held.install(lease("released", 1, "t"), sent_at=0.0)
    held.install(lease("handed", 1, "t"), sent_at=0.0, handoff_since=0.0)
    assert held.drop("lost", "taken by B")
    assert not held.drop("lost", "again")
    assert held.forget("released") is not None
    assert held.handing_off("handed")
    assert held.forget("handed") is not None
    assert held.forget("handed") is None
    assert dropped == ["lost", "handed"]
    assert held.gone_why("lost") == "taken by B"
    assert held.gone_why("released") == "released by this worker"
    assert held.gone_why("never") == "not held by this worker"
    held.install(lease("lost", 5, "new"), sent_at=1.0)
    assert held.gone_why("lost") == "not held by this worker", "taken again: nothing gone"


def test_a_lease_keeps_one_lock_for_life() -> None:
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    lock = held.lock_for("s1")
    held.install(lease("s1", 1, "t"), sent_at=0.0)
    held.forget("s1")
    assert held.lock_for("s1") is lock
    assert held.lock_for("s2") is not lock


def test_a_failing_listener_does_not_keep_the_others_from_being_told() -> None:
    told: list[tuple[str, str]] = []
    held = HeldSet("A", renewer_interval_s=INTERVAL)
    assert not held.notify_handoff("s1"), "nobody listens: the caller releases it itself"

    def broken(key: str) -> None:
        raise RuntimeError(key)

    held.add_lost_listener(broken)
    held.add_lost_listener(lambda key: told.append(("lost", key)))
    held.add_handoff_listener(broken)
    held.add_handoff_listener(lambda key: told.append(("handoff", key)))
    held.notify_lost("s1")
    assert held.notify_handoff("s2")
    assert told == [("lost", "s1"), ("handoff", "s2")]
