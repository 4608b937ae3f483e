"""Fleets in virtual time (tests/simulation/scale.py): a small size in the suite; the curves
up to 10,000 shards come from bench/scale_sim.py (docs/benchmarks.md)."""

from __future__ import annotations

from tests.simulation.scale import ScaleSpec, java2_per_shard_hour, run_scale


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
