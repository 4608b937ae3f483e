"""Fleets in virtual time (tests/simulation/scale.py): a small size in the suite; the curves
up to 10,000 shards come from bench/scale_sim.py (docs/benchmarks.md)."""

from __future__ import annotations

from kclpy.leases import serializer as ser
from tests.simulation.scale import (
    Fleet,
    ScaleSpec,
    balanced_by_count,
    java2_per_shard_hour,
    run_scale,
)


def test_small_fleet_settles_within_two_failover_times_and_costs_no_more_than_java() -> None:
    """40 shards, 8 workers: a cold start, 2 of them killed, 2 joining. Each phase ends
    with every lease held by a live worker that knows it, lease counts within one of each
    other, within two failover times; no lease is ever held by two workers; the steady
    state costs no more requests or capacity per shard-hour than a Java KCL 2.x fleet."""
    spec = ScaleSpec(40, 8, failover_s=10.0, steady_s=60.0, seed=3)
    result = run_scale(spec)
    assert result.violations == []
    for phase in result.phases:
        assert phase.settled_after_s is not None, phase
        assert phase.settled_after_s <= 2 * spec.failover_s, phase
    assert result.phase("2 die").moved >= 10  # the dead workers' leases moved
    java_requests, java_capacity = java2_per_shard_hour(spec, result.item_bytes)
    # a one-minute window counts whole scans: 2 % for the one at its edge
    assert result.per_shard_hour(result.steady.total_requests) <= 1.02 * java_requests
    assert result.per_shard_hour(result.write_equivalents) <= 1.02 * java_capacity
    assert result.largest_scan_items == 40


def test_with_a_leader_only_it_scans_and_the_fleet_settles_within_two_failover_times() -> None:
    """The same fleet with ``--lease-assigner leader``: every phase settles within two
    failover times, nothing is held twice, only one worker ever scans the lease table (the
    others Query the owner index for their own keys), and the steady state costs less
    capacity per shard-hour than a Java KCL 2.x fleet."""
    spec = ScaleSpec(40, 8, failover_s=10.0, steady_s=60.0, seed=3)
    fleet = Fleet(spec, leader=True)
    result = run_scale(spec, fleet=fleet)
    assert result.violations == []
    for phase in result.phases:
        assert phase.settled_after_s is not None, phase
        assert phase.settled_after_s <= 2 * spec.failover_s, phase
    assert result.phase("cold start").moved == 0  # the first pass waits for the fleet's reports
    scanners = [w.worker_id for w in fleet.workers.values() if w.meter.requests["Scan"]]
    assert len(scanners) == 1
    # every worker holds leases: each Queries the owner index only every 1.5-4.5 failover
    # times (its new leases come with a notice on one it renews), not every half (720 an
    # hour)
    shortest_held_interval = 0.5 * 3 * spec.failover_s
    queries = result.per_worker_hour(result.steady.requests["Query"])
    assert 0 < queries <= 3600 / shortest_held_interval
    # the dead workers' leases went to holders, notified: the die phase above settled
    # within two failover times, where a holder's own Query may come three after
    assert result.phase("2 die").moved >= 10
    assert any(ser.ASSIGNMENT_NOTICE in item for item in fleet.items())
    _, java_capacity = java2_per_shard_hour(spec, result.item_bytes)
    assert result.per_shard_hour(result.write_equivalents) < java_capacity


def test_the_leader_killed_another_leads_and_every_lease_is_held_again() -> None:
    """SIGKILL the leader of a settled fleet: a survivor holds the lock within the failover
    time (its term expires after half of it, read every half), and within three failover
    times (the lock's expiry, then the new leader watching the leases for one failover time
    before judging any expired) the dead leader's leases are held by survivors, counts
    within one."""
    spec = ScaleSpec(30, 6, failover_s=10.0, seed=5)
    fleet = Fleet(spec, leader=True)
    for index in range(spec.workers):
        fleet.start_worker(f"w{index:03d}", fleet.rng.random())
    assert fleet.run_until(2 * spec.failover_s, settle=True) is not None
    leader = next(w for w in fleet.live() if w.coordinator.leads())
    fleet.kill(leader.worker_id)
    killed_at = fleet.now

    def led(fleet: Fleet) -> bool:
        return any(w.coordinator.leads() for w in fleet.live())

    fleet.settled = led
    took_over = fleet.run_until(killed_at + 3 * spec.failover_s, settle=True)
    assert took_over is not None
    assert took_over - killed_at <= spec.failover_s + spec.probe_s
    fleet.settled = balanced_by_count
    settled = fleet.run_until(killed_at + 5 * spec.failover_s, settle=True)
    assert settled is not None
    assert settled - killed_at <= 3 * spec.failover_s + spec.probe_s
    assert fleet.violations == []


def test_the_leader_killed_among_idle_workers_the_fleet_balances_within_two_failover_times(
) -> None:
    """100 shards, 200 workers (half of them hold nothing and show they live only by their
    30 s load reports), 40 killed with the leader among them: within two failover times
    every lease is held by a survivor, counts within one. The new leader saw every report
    at once; it hands the dead workers' leases first to the workers that reported last
    (the reporters' own stamps tell it who wrote after the deaths), not at random among
    the idle, where a fifth of them are dead and each lease given to one came back only
    once it stayed untaken (30 to 70 s)."""
    for seed in (0, 1):
        spec = ScaleSpec(100, 200, failover_s=10.0, seed=seed, kill_leader=True)
        result = run_scale(spec, fleet=Fleet(spec, leader=True))
        assert result.leader_killed
        assert result.violations == []
        died = result.phase("40 die")
        assert died.settled_after_s is not None
        assert died.settled_after_s <= 2 * spec.failover_s, died
