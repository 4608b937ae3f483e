"""The taker's rules, without DynamoDB: expiry by own clock, targets, stealing, convergence."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, MutableSequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kclpy.leases.balancing import Balancer
from kclpy.leases.lease import Lease
from kclpy.position import Position

FAILOVER = 10.0


class FirstChoiceRandom(random.Random):
    """Deterministic order: shuffles nothing and always chooses the first candidate."""

    def shuffle(self, x: MutableSequence[Any]) -> None:  # type: ignore[override]
        return None

    def choice(self, seq: Any) -> Any:
        return seq[0]


def taker(worker: str = "me", **kwargs: Any) -> Balancer:
    kwargs.setdefault("rng", FirstChoiceRandom())
    return Balancer(worker, FAILOVER, **kwargs)


def owned(owner: str | None, *keys: str, counter: int = 1) -> list[Lease]:
    return [Lease(key, lease_owner=owner, lease_counter=counter) for key in keys]


def plan_for(
    t: Balancer,
    now: float,
    *,
    held: Iterable[str] = (),
    known: set[str] | None = None,
    no_steal: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    plan = t.plan(held=set(held), known_lease_keys=known, no_steal=set(no_steal), now=now)
    return [lease.lease_key for lease in plan.take], [lease.lease_key for lease in plan.steal]


# -- expiry --------------------------------------------------------------------------------


def test_owned_lease_expires_only_after_its_counter_stood_still_for_failover() -> None:
    t = taker()
    t.observe(owned("other", "a", counter=5), now=100.0)
    assert not t.is_expired(Lease("a", lease_owner="other", lease_counter=5), 100.0 + FAILOVER)
    assert t.is_expired(Lease("a", lease_owner="other", lease_counter=5), 100.1 + FAILOVER)


def test_a_moving_counter_restarts_the_expiry_clock() -> None:
    t = taker()
    t.observe(owned("other", "a", counter=5), now=0.0)
    t.observe(owned("other", "a", counter=6), now=9.0)
    t.observe(owned("other", "a", counter=6), now=15.0)
    assert t.unchanged_for("a", 15.0) == 6.0
    assert plan_for(t, 15.0) == ([], [])
    assert plan_for(t, 19.5) == (["a"], [])


def test_only_a_counter_seen_moving_proves_its_owner_alive() -> None:
    """What a crashed run left behind looks like a live lease until it expires; a drain
    (``stop_when_caught_up``) must not leave such a lease to a dead owner."""
    t = taker()
    t.observe(owned("other", "a", "b", counter=5), now=0.0)
    assert not t.seen_renewed("a") and not t.seen_renewed("b")
    t.observe(owned("other", "a", counter=6) + owned("other", "b", counter=5), now=2.0)
    assert t.seen_renewed("a") and not t.seen_renewed("b")
    t.observe(owned("other", "c"), now=3.0)
    assert not t.seen_renewed("c")


def test_unowned_leases_are_free_at_once() -> None:
    t = taker()
    t.observe(owned(None, "a", "b"), now=0.0)
    assert plan_for(t, 0.0) == (["a", "b"], [])


def test_leases_that_vanished_are_forgotten() -> None:
    t = taker()
    t.observe(owned("other", "a", "b"), now=0.0)
    t.observe(owned("other", "a"), now=1.0)
    assert plan_for(t, 1.0 + FAILOVER + 1) == (["a"], [])
    t.observe(owned("other", "a", "b"), now=50.0)
    assert t.unchanged_for("b", 50.0) == 0.0


# -- targets -------------------------------------------------------------------------------


def test_alone_a_worker_takes_everything() -> None:
    t = taker()
    t.observe(owned(None, *"abcdefg"), now=0.0)
    assert plan_for(t, 0.0)[0] == list("abcdefg")


def test_target_is_the_ceiling_of_leases_per_live_worker() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b") + owned("w2", "c") + owned(None, "d", "e", "f", "g"), now=0.0)
    # 7 leases, live workers w1, w2, me -> target 3
    assert len(plan_for(t, 1.0)[0]) == 3


def test_expired_owners_are_not_live_workers() -> None:
    t = taker()
    t.observe(owned("dead", "a", "b", "c", "d"), now=0.0)
    # while "dead" looks alive the target is 2 and it may only be stolen from...
    assert plan_for(t, 1.0) == ([], ["a"])
    # ...once expired this worker is alone and takes all four
    assert plan_for(t, FAILOVER + 1)[0] == ["a", "b", "c", "d"]


def test_max_leases_for_worker_caps_the_target() -> None:
    t = taker(max_leases_for_worker=2)
    t.observe(owned(None, *"abcde"), now=0.0)
    assert plan_for(t, 0.0)[0] == ["a", "b"]
    assert plan_for(t, 0.0, held=["a", "b"]) == ([], [])


def test_held_leases_count_towards_the_target() -> None:
    t = taker()
    t.observe(owned("me", "a", "b") + owned("w2", "c") + owned(None, "d"), now=0.0)
    # 4 leases, 2 live workers: target 2, and I hold 2
    assert plan_for(t, 0.0, held=["a", "b"]) == ([], [])


def test_leases_named_after_me_but_not_held_count_as_mine_until_they_expire() -> None:
    t = taker()
    t.observe(owned("me", "a", "b") + owned("w2", "c") + owned(None, "d"), now=0.0)
    # 4 leases, 2 live workers: target 2, and "a", "b" already count as mine
    assert plan_for(t, 1.0) == ([], [])
    t.observe(owned("me", "a", "b") + owned("w2", "c", counter=2) + owned(None, "d"), now=11.0)
    assert plan_for(t, 11.0) == (["a", "b"], [])


def test_longest_free_leases_come_first() -> None:
    t = taker()
    t.observe(owned("dead", "old") + owned("w2", "x", "y"), now=0.0)
    later = owned("dead", "old") + owned("w2", "x", "y", counter=2) + owned(None, "new")
    t.observe(later, now=11.0)
    # 4 eligible leases, live workers w2 and me -> target 2; "old" has been free longer
    assert plan_for(t, 12.0)[0] == ["old", "new"]


def test_very_old_leases_are_taken_regardless_of_target_up_to_the_maximum() -> None:
    def scan(counter: int) -> list[Lease]:
        live = owned("w2", "a", "b", counter=counter) + owned("w3", "c", "d", counter=counter)
        return live + owned("me", "h", "i", counter=counter) + owned(None, "e", "f", "g")

    now = 3 * FAILOVER + 1
    for limit, expected in ((5, ["e", "f", "g"]), (3, ["e"])):
        t = taker(max_leases_for_worker=limit)
        t.observe(scan(1), now=0.0)
        t.observe(scan(2), now=now)
        # 9 leases, 3 live workers: target 3 and I hold 2, so the target alone would take
        # one; leases free for over 3 failover times are taken up to the maximum instead
        assert plan_for(t, now, held=["h", "i"]) == (expected, [])


def test_shard_end_and_unknown_leases_are_never_taken_nor_counted() -> None:
    t = taker()
    finished = [Lease("done", lease_counter=1, checkpoint=Position.shard_end())]
    busy = [Lease("busy-done", lease_owner="w2", checkpoint=Position.shard_end())]
    t.observe(finished + busy + owned(None, "a", "b", "gone"), now=0.0)
    assert plan_for(t, 0.0, known={"a", "b", "done", "busy-done"}) == (["a", "b"], [])


PARKED = '{"reason":"maintenance","by":"ops"}'


def test_a_parked_lease_is_never_taken_stolen_counted_nor_awaited() -> None:
    """An operator or the park policy set it aside: nobody takes it, free or expired, and it
    neither raises its owner's load nor makes this worker wait for its expiry."""
    t = taker()
    t.observe([Lease("parked-free", lease_counter=1, parked=PARKED),
               Lease("parked-owned", lease_owner="w2", lease_counter=1, parked=PARKED),
               *owned(None, "a")], now=0.0)
    assert plan_for(t, 0.0) == (["a"], [])
    assert plan_for(t, 100.0) == (["a"], []), "expired, still parked"
    assert t.next_expiry(held=set(), overdue_after=6.0, now=7.0) is None


def test_with_java_peers_a_finished_parked_lease_counts_towards_nobodys_load() -> None:
    """Java's taker counts finished leases; a parked one is kclpy's alone to ignore, so it
    does not make its owner look live and loaded."""
    t = taker()
    t.observe([Lease("done", lease_owner="w2", lease_counter=1,
                     checkpoint=Position.shard_end(), parked=PARKED),
               *owned(None, "a", "b", "c")], now=0.0)
    plan = t.plan(held=set(), known_lease_keys=None, no_steal=set(), now=0.0, java_peers=True)
    assert [lease.lease_key for lease in plan.take] == ["a", "b", "c"]


def test_with_java_peers_a_finished_lease_of_an_unknown_shard_counts_towards_nobodys_load(
) -> None:
    """A finished lease of a shard this worker does not consume (another stream's) is not
    in the total Java's taker and this one share."""
    t = taker()
    t.observe([Lease("elsewhere", lease_owner="w2", lease_counter=1,
                     checkpoint=Position.shard_end()), *owned(None, "a", "b", "c")], now=0.0)
    plan = t.plan(held=set(), known_lease_keys={"a", "b", "c"}, no_steal=set(), now=0.0,
                  java_peers=True)
    assert [lease.lease_key for lease in plan.take] == ["a", "b", "c"]


# -- stealing ------------------------------------------------------------------------------


def test_steals_from_the_most_loaded_worker_above_target() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b", "c", "d") + owned("w2", "e", "f"), now=0.0)
    # 6 leases, 3 workers: target 2; w1 holds 2 over target; one at a time
    assert plan_for(t, 1.0) == ([], ["a"])


def test_steal_count_is_min_of_need_excess_and_limit() -> None:
    leases = owned("w1", *"abcdefgh")
    t = taker(max_leases_to_steal_at_one_time=3)
    t.observe(leases, now=0.0)
    # 8 leases, 2 workers: target 4, need 4, w1 excess 4 -> limit 3
    assert plan_for(t, 1.0)[1] == ["a", "b", "c"]
    t = taker(max_leases_to_steal_at_one_time=10)
    t.observe(owned("w1", *"abcde") + owned("w2", "f", "g", "h", "i"), now=0.0)
    # 9 leases, 3 workers: target 3, need 3, w1 excess 2
    assert plan_for(t, 1.0)[1] == ["a", "b"]


def test_no_steal_from_a_worker_exactly_at_target_when_one_short() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b") + owned("me", "c"), now=0.0)
    # 3 leases, 2 workers: target 2, w1 at target, I need only one more
    assert plan_for(t, 1.0, held=["c"]) == ([], [])


def test_steals_one_from_a_worker_at_target_when_two_short() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b") + owned("w2", "c", "d") + owned("w3", "e"), now=0.0)
    # 5 leases, 4 workers: target 2; w1 at target; I need 2 -> steal 1
    assert plan_for(t, 1.0) == ([], ["a"])


def test_a_lease_just_lost_is_not_stolen_back() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b") + owned("w2", "c"), now=0.0)
    # 3 leases, 3 workers: target 1; w1 over target; "a" was stolen from me last cycle
    assert plan_for(t, 1.0, no_steal=["a"]) == ([], ["b"])
    assert plan_for(t, 1.0, no_steal=["a", "b"]) == ([], [])


def test_does_not_steal_when_free_leases_exist() -> None:
    t = taker()
    t.observe(owned("w1", "a", "b", "c") + owned(None, "d"), now=0.0)
    assert plan_for(t, 1.0) == (["d"], [])


# -- a fleet converges ---------------------------------------------------------------------


def simulate(workers: int, leases: int, rounds: int, seed: int) -> list[Counter[str | None]]:
    """Every worker scans, plans and takes in turn, then renews what it holds; the table is
    a dict with DynamoDB's conditional-write semantics. Returns ownership after each round."""
    rng = random.Random(seed)
    table = {f"s{i}": Lease(f"s{i}") for i in range(leases)}
    names = [f"w{i}" for i in range(workers)]
    takers = {name: Balancer(name, FAILOVER, rng=random.Random(rng.random())) for name in names}
    history: list[Counter[str | None]] = []
    now = 0.0
    for _ in range(rounds):
        now += 2 * FAILOVER
        for name in rng.sample(names, len(names)):
            t = takers[name]
            t.observe([lease.copy() for lease in table.values()], now)
            held = {key for key, lease in table.items() if lease.lease_owner == name}
            plan = t.plan(held=held, known_lease_keys=None, no_steal=(), now=now)
            for lease in plan.take + plan.steal:
                current = table[lease.lease_key]
                if current.lease_counter == lease.lease_counter:
                    table[lease.lease_key] = current.copy(
                        lease_owner=name, lease_counter=current.lease_counter + 1
                    )
            # renewals between taker cycles: every owner is alive
            for key, lease in table.items():
                if lease.lease_owner is not None:
                    table[key] = lease.copy(lease_counter=lease.lease_counter + 1)
        history.append(Counter(lease.lease_owner for lease in table.values()))
    return history


@settings(deadline=None, max_examples=60)
@given(
    workers=st.integers(min_value=1, max_value=6),
    leases=st.integers(min_value=1, max_value=24),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_a_fleet_converges_to_a_balanced_stable_split(workers: int, leases: int, seed: int) -> None:
    rounds = leases + 10
    history = simulate(workers, leases, rounds, seed)
    final = history[-1]
    assert final[None] == 0
    counts = [final.get(f"w{i}", 0) for i in range(workers)]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == leases
    # stable: nothing moved in the last rounds (no ping-pong)
    assert history[-3] == history[-2] == history[-1]


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_leases_for_worker"):
        Balancer("w", FAILOVER, max_leases_for_worker=0)
    with pytest.raises(ValueError, match="max_leases_to_steal_at_one_time"):
        Balancer("w", FAILOVER, max_leases_to_steal_at_one_time=0)


def test_an_overdue_lease_is_reported_with_the_time_it_will_expire() -> None:
    t = taker("me")
    t.observe([*owned("dead", "d1", counter=4), *owned("live", "l1", counter=7)], now=100.0)
    held: set[str] = set()
    assert t.next_expiry(held=held, overdue_after=6.0, now=105.0) is None, "not overdue yet"
    t.observe([*owned("dead", "d1", counter=4), *owned("live", "l1", counter=8)], now=107.0)
    assert t.next_expiry(held=held, overdue_after=6.0, now=107.0) == 100.0 + FAILOVER
    assert t.next_expiry(held={"d1"}, overdue_after=6.0, now=107.0) is None, "held: not others'"
    t.observe([*owned("dead", "d1", counter=4), *owned("live", "l1", counter=8)], now=111.0)
    assert t.next_expiry(held=held, overdue_after=6.0, now=111.0) is None, "expired already"
    assert t.is_expired(owned("dead", "d1", counter=4)[0], 111.0)


def test_an_overdue_lease_stays_due_after_its_expiry_until_a_scan_sees_it_expired() -> None:
    """The cycle that wakes for an overdue lease's expiry wakes after it (a margin, a busy
    thread): judged on that clock the lease had already expired, it was no longer reported,
    nothing scanned, and the lease waited for the regular scan - with a leader, up to a
    pass interval (bench/leader_failover.py's logs: a pass 0.1 s before the expiry, the
    next 1.6 s after it)."""
    t = taker("me")
    t.observe([*owned("dead", "d1", counter=4)], now=100.0)
    t.observe([*owned("dead", "d1", counter=4)], now=107.0)
    assert t.next_expiry(held=set(), overdue_after=6.0, now=110.05) == 100.0 + FAILOVER
    t.observe([*owned("dead", "d1", counter=4)], now=110.06)
    assert t.next_expiry(held=set(), overdue_after=6.0, now=110.06) is None, "scanned expired"


def test_a_failed_scan_after_its_expiry_leaves_an_overdue_lease_to_the_regular_scans() -> None:
    """While the table fails, a lease still due would make every cycle scan again at once."""
    t = taker("me")
    t.observe([*owned("dead", "d1", counter=4)], now=100.0)
    t.observe([*owned("dead", "d1", counter=4)], now=107.0)
    t.scan_failed(109.0)
    assert t.next_expiry(held=set(), overdue_after=6.0, now=109.5) == 100.0 + FAILOVER
    t.scan_failed(110.05)
    assert t.next_expiry(held=set(), overdue_after=6.0, now=110.1) is None


def test_a_lease_being_handed_off_is_never_stolen() -> None:
    leases = [
        *owned("busy", "b1", "b2", "b3"),
        Lease("b4", lease_owner="busy", lease_counter=1, checkpoint_owner="other"),
    ]
    t = taker("me", max_leases_to_steal_at_one_time=4)
    t.observe(leases, now=0.0)
    plan = t.plan(held=set(), known_lease_keys=None, no_steal=(), now=0.0)
    assert plan.steal and all(lease.lease_key != "b4" for lease in plan.steal)
