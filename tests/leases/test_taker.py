"""LeaseTaker (kclpy/leases/taker.py): which leases a worker takes, when a dead worker's lease
counts as expired (by the taker's own clock), and how many it steals; driven through the
coordinator with an injected clock (in-process moto), then directly."""

from __future__ import annotations

import random
import re
from collections import Counter

from kclpy.leases.coordinator import LeaseAssignment, LeaseCoordinator
from kclpy.leases.leader import LeaderLock, LeaderMode
from kclpy.leases.load import LoadBalancing, LoadMeter, LoadSettings, LoadTable
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.position import Position
from tests.support.determinism import Clock
from tests.support.leases import (
    FAILOVER,
    FlakyClient,
    Lost,
    client_error,
    coordinator,
    create,
    fetch,
    owners,
    run_fleet,
    sample,
)

# -- taking ----------------------------------------------------------------------------------


def test_a_lone_worker_takes_every_lease_with_a_fresh_token_each(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, "s1", "s2", "s3")
    metrics = Metrics()
    a, _ = coordinator(table, "A", clock, metrics=metrics)
    taken = a.run_taker_once()
    assert sorted(lease.lease_key for lease in taken) == ["s1", "s2", "s3"]
    tokens = {lease.concurrency_token for lease in taken}
    assert len(tokens) == 3
    assert all(token is not None and re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens)
    assert owners(table) == {"s1": "A", "s2": "A", "s3": "A"}
    assert a.held_leases() == {lease.lease_key: lease for lease in taken}
    assert sample(metrics, "kclpy_leases_taken_total") == 3
    assert sample(metrics, "kclpy_leases_held") == 3


def test_shard_end_and_unknown_shards_are_not_taken(table: LeaseTable, clock: Clock) -> None:
    create(table, "done", checkpoint=Position.shard_end())
    create(table, "s1", "s2")
    a, _ = coordinator(table, "A", clock)
    a.set_known_lease_keys({"done", "s1"})
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s1"]
    a.set_known_lease_keys(None)
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s2"]
    assert owners(table)["done"] is None


def test_a_known_lease_of_a_stream_no_longer_consumed_is_not_taken(
    table: LeaseTable, clock: Clock
) -> None:
    """A stream dropped from the tracker leaves the known shards only at the end of the
    shard sync that dropped it; the taker asks the worker's streams before each take."""
    create(table, "s1", "s2")
    a, _ = coordinator(table, "A", clock)
    a.set_known_lease_keys({"s1", "s2"})
    a.set_consumable(lambda key: key != "s2")
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s1"]
    assert owners(table) == {"s1": "A", "s2": None}


def test_all_leases_is_the_last_scan_and_get_lease_reads_fresh(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, "s1")
    a, _ = coordinator(table, "A", clock)
    assert a.all_leases() == []
    a.run_taker_once()
    assert [(lease.lease_key, lease.lease_owner) for lease in a.all_leases()] == [("s1", None)]
    fresh = a.get_lease("s1")
    assert fresh is not None and fresh.lease_owner == "A"
    assert a.get_lease("missing") is None


# -- expiry, judged by each worker's own clock -----------------------------------------------


def test_a_dead_workers_lease_is_taken_only_after_failover_on_the_takers_clock(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, "s1")
    a, a_lost = coordinator(table, "A", clock)
    a.run_taker_once()
    b_clock = Clock(start=5000.0)  # clocks of different hosts are never compared
    b, _ = coordinator(table, "B", b_clock)
    assert b.run_taker_once() == []  # A is alive and at target: nothing to steal
    b_clock.advance(FAILOVER)
    assert b.run_taker_once() == []  # unchanged for exactly the failover time: not yet
    b_clock.advance(0.01)
    assert [lease.lease_key for lease in b.run_taker_once()] == ["s1"]
    assert owners(table) == {"s1": "B"}
    a.run_renewer_once()
    assert a_lost.shards == ["s1"]
    assert a.held_leases() == {}


def test_renewals_keep_a_lease_alive_for_other_workers(table: LeaseTable, clock: Clock) -> None:
    create(table, "s1")
    a, a_lost = coordinator(table, "A", clock)
    a.run_taker_once()
    b, _ = coordinator(table, "B", clock)
    for _ in range(12):
        assert b.run_taker_once() == []
        clock.advance(FAILOVER / 3)
        a.run_renewer_once()
    assert owners(table) == {"s1": "A"}
    assert a_lost.shards == []


# -- balancing between workers -----------------------------------------------------------------


def test_two_workers_converge_to_an_even_split_without_ping_pong(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, *(f"s{i}" for i in range(7)))
    metrics_a, metrics_b = Metrics(), Metrics()
    a, a_lost = coordinator(table, "A", clock, metrics=metrics_a, rng=random.Random(1))
    b, b_lost = coordinator(table, "B", clock, metrics=metrics_b, rng=random.Random(2))
    history = run_fleet([a, b], clock, cycles=8)
    final = Counter(history[-1].values())
    assert sorted(final.values()) == [3, 4]
    assert history[-4] == history[-1]
    # every move was a steal by B from A, one per cycle; nothing ever went back
    assert sample(metrics_b, "kclpy_leases_stolen_total") == len(a_lost.shards) == 3
    assert b_lost.shards == []
    assert sample(metrics_a, "kclpy_leases_stolen_total") == 0
    assert set(a.held_leases()) | set(b.held_leases()) == {f"s{i}" for i in range(7)}
    assert not set(a.held_leases()) & set(b.held_leases())


def test_steals_at_most_the_configured_number_per_cycle(table: LeaseTable, clock: Clock) -> None:
    create(table, *(f"s{i}" for i in range(6)))
    a, _ = coordinator(table, "A", clock)
    a.run_taker_once()
    b, _ = coordinator(table, "B", clock, max_leases_to_steal_at_one_time=2)
    stolen = b.run_taker_once()
    assert len(stolen) == 2
    assert Counter(owners(table).values()) == {"A": 4, "B": 2}


def _lose_s1_to_b(table: LeaseTable, clock: Clock) -> tuple[LeaseCoordinator, Lost]:
    """A holds s1, then B steals it; C holds w. Returns A after its renewer noticed."""
    create(table, "s1", "s2", "w")
    a, lost = coordinator(table, "A", clock)
    a.set_known_lease_keys({"s1"})
    a.run_taker_once()
    a.set_known_lease_keys(None)
    table.take(fetch(table, "s2"), "B")
    table.take(fetch(table, "s1"), "B")
    table.take(fetch(table, "w"), "C")
    a.run_renewer_once()
    assert lost.shards == ["s1"]
    return a, lost


def test_a_lease_stolen_from_a_worker_is_not_stolen_back_in_the_next_cycle(
    table: LeaseTable, clock: Clock
) -> None:
    a, _ = _lose_s1_to_b(table, clock)
    # 3 leases, 3 workers: target 1; B holds 2; deterministic choice would be s1 first
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s2"]


def test_a_worker_without_that_memory_would_have_taken_it_back(
    table: LeaseTable, clock: Clock
) -> None:
    _lose_s1_to_b(table, clock)
    fresh_a, _ = coordinator(table, "A", clock)
    assert [lease.lease_key for lease in fresh_a.run_taker_once()] == ["s1"]


def test_the_memory_of_a_stolen_lease_lasts_one_cycle(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    a, _ = _lose_s1_to_b(table, clock)
    client.fail["scan"] = client_error("InternalServerError")
    assert a.run_taker_once() == []
    del client.fail["scan"]
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s1"]


# -- what the last scan says, and when the next comes ------------------------------------------


def test_a_failed_scan_takes_nothing_keeps_what_is_held_and_the_next_cycle_takes(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    create(table, "s1")
    a, a_lost = coordinator(table, "A", clock)
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s1"]
    create(table, "s2")
    client.fail["scan"] = client_error("InternalServerError")
    assert a.run_taker_once() == []
    assert set(a.held_leases()) == {"s1"} and a_lost.shards == []
    del client.fail["scan"]
    assert [lease.lease_key for lease in a.run_taker_once()] == ["s2"]


def test_the_last_scan_tells_leases_nobody_runs_from_those_another_worker_runs(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, "free", "b-live", "b-dead")
    b, _ = coordinator(table, "B", clock, max_leases_for_worker=2)
    b.run_taker_once()
    assert set(b.held_leases()) == {"b-live", "b-dead"}
    b.release("b-dead")
    table.take(fetch(table, "b-dead"), "B")  # owned by B, and never renewed again
    a, _ = coordinator(table, "A", clock)
    a.set_known_lease_keys(set())  # A only watches: it takes no lease of a shard it does not know
    assert a.idle_leases() == [] and a.run_elsewhere() == frozenset(), "no scan yet"
    a.run_taker_once()
    assert {lease.lease_key for lease in a.idle_leases()} == {"free"}
    assert a.run_elsewhere() == frozenset(), "not seen renewed yet: maybe a crashed run's"
    clock.advance(FAILOVER / 2)
    b.run_renewer_once()  # renews b-live only: b-dead is not held by B's coordinator
    clock.advance(FAILOVER / 2 + 0.01)
    a.run_taker_once()
    assert a.run_elsewhere() == frozenset({"b-live"})
    assert {lease.lease_key for lease in a.idle_leases()} == {"free", "b-dead"}


def test_with_a_fixed_interval_the_next_scan_is_that_long_after_the_last_attempt(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    a, _ = coordinator(table, "A", clock, taker_interval_s=7.0)
    assert a.taker.next_scan() == clock() + 7.0, "never scanned: from now"
    client.fail["scan"] = client_error("InternalServerError")
    started = clock()
    a.run_taker_once()
    clock.advance(3.0)
    assert a.taker.next_scan() == started + 7.0, "a failed scan counts as an attempt"


def test_a_leader_never_takes_a_lease_it_does_not_consume(
    table: LeaseTable, clock: Clock
) -> None:
    """A leader's own take goes through the same check as a scanning taker's: a lease of a
    stream it no longer consumes is left for another worker, not taken and released at
    once (which also left it unclaimed, and the leader judging its assignee dead)."""
    create(table, "s1", "s2")
    load_table = LoadTable(table.client, "app-load", clock=clock, sleep=lambda _: None)
    load_table.create_if_missing()
    reports = LoadBalancing(LoadMeter("A", dict, clock=clock, cpu_seconds=lambda: 0.0),
                            load_table, LoadSettings(), clock=clock, wall_clock=clock)
    mode = LeaderMode(LeaderLock(load_table, "A", failover_time_s=FAILOVER, clock=clock),
                      reports)
    a, _ = coordinator(table, "A", clock, assignment=LeaseAssignment(leader=mode))
    a.set_consumable(lambda key: key != "s2")
    for _ in range(3):
        a.run_taker_once()
        clock.advance(FAILOVER)
    assert owners(table) == {"s1": "A", "s2": None}
