"""LeaseRenewer (kclpy/leases/renewer.py): when each held lease is written again, what a failed
or refused renewal means, and how a renewer that wakes late paces retrieval; driven through
the coordinator with an injected clock (in-process moto; one test over moto's server)."""

from __future__ import annotations

import uuid
from typing import Any

import boto3
import pytest

from kclpy.errors import ShutdownException
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import Position
from tests.support.determinism import Clock
from tests.support.leases import (
    FAILOVER,
    REGION,
    FlakyClient,
    client_error,
    coordinator,
    create,
    fetch,
    sample,
    take_one,
)
from tests.support.waiting import wait_for

# -- renewal failures --------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 4])
def test_a_renewal_that_finds_the_lease_taken_drops_it_and_notifies(
    table: LeaseTable, clock: Clock, threads: int
) -> None:
    create(table, "s1", "s2", "s3", "s4")
    metrics = Metrics()
    a, lost = coordinator(table, "A", clock, metrics=metrics, renewal_threads=threads)
    a.run_taker_once()
    table.take(fetch(table, "s3"), "thief")
    before = {key: lease.lease_counter for key, lease in a.held_leases().items()}
    a.run_renewer_once()
    assert lost.shards == ["s3"]
    assert sorted(a.held_leases()) == ["s1", "s2", "s4"]
    assert all(fetch(table, k).lease_counter == before[k] + 1 for k in ("s1", "s2", "s4"))
    assert sample(metrics, "kclpy_leases_lost_total") == 1
    assert sample(metrics, "kclpy_lease_renew_failures_total") == 1
    assert sample(metrics, "kclpy_lease_renewals_total") == 3
    assert sample(metrics, "kclpy_leases_held") == 3
    a.stop(release=False)


def test_a_lease_unrenewable_for_longer_than_failover_is_dropped(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    create(table, "s1")
    a, lost = coordinator(table, "A", clock)
    a.run_taker_once()
    client.fail["update_item"] = client_error("InternalServerError")
    clock.advance(FAILOVER / 3)
    a.run_renewer_once()
    clock.advance(FAILOVER / 3)
    a.run_renewer_once()
    assert lost.shards == []
    assert a.get_held("s1") is not None
    clock.advance(FAILOVER / 3 + 0.01)
    a.run_renewer_once()
    assert lost.shards == ["s1"]
    assert a.held_leases() == {}


def test_throttled_renewals_are_failures_not_losses(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    create(table, "s1")
    a, lost = coordinator(table, "A", clock)
    a.run_taker_once()
    client.fail["update_item"] = client_error("ThrottlingException")
    a.run_renewer_once()
    del client.fail["update_item"]
    clock.advance(FAILOVER / 2)
    a.run_renewer_once()
    clock.advance(FAILOVER / 2 + 1)
    a.run_renewer_once()
    assert lost.shards == []
    assert fetch(table, "s1").lease_owner == "A"


# -- the renewal schedule and the suspended worker ----------------------------------------------


def updates(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value(
        "kclpy_dynamodb_requests_total", {"operation": "UpdateItem"}
    ) or 0.0


def test_a_lease_is_renewed_every_half_failover_and_a_checkpoint_counts(client: Any) -> None:
    metrics = Metrics()
    table = LeaseTable(client, "app", metrics=metrics)
    table.create_if_missing()
    clock = Clock()
    a, lost, token = take_one(table, clock)
    written = updates(metrics)
    clock.advance(FAILOVER / 2 - 0.01)
    a.run_renewer_once(due_only=True)
    assert updates(metrics) == written, "not due yet"
    clock.advance(0.01)
    a.run_renewer_once(due_only=True)
    assert updates(metrics) == written + 1
    clock.advance(FAILOVER / 4)
    a.fence.update_checkpoint("s1", token, Position("100"))
    clock.advance(FAILOVER / 2 - 0.01)
    a.run_renewer_once(due_only=True)
    assert updates(metrics) == written + 2, "the checkpoint postponed the renewal"
    clock.advance(0.01)
    a.run_renewer_once(due_only=True)
    assert updates(metrics) == written + 3
    assert lost.shards == []


def test_a_failed_renewal_is_retried_after_a_quarter_interval(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    a, lost, _ = take_one(table, clock)
    counter = fetch(table, "s1").lease_counter
    client.fail["update_item"] = client_error("InternalServerError")
    clock.advance(FAILOVER / 2)
    a.run_renewer_once(due_only=True)
    del client.fail["update_item"]
    clock.advance(FAILOVER / 8 - 0.01)
    a.run_renewer_once(due_only=True)
    assert fetch(table, "s1").lease_counter == counter
    clock.advance(0.01)
    a.run_renewer_once(due_only=True)
    assert fetch(table, "s1").lease_counter == counter + 1
    assert lost.shards == []


def test_a_worker_suspended_past_the_failover_time_holds_nothing_and_writes_nothing(
    client: Any,
) -> None:
    metrics = Metrics()
    table = LeaseTable(client, "app", metrics=metrics)
    table.create_if_missing()
    clock = Clock()
    a, lost, token = take_one(table, clock)
    clock.advance(FAILOVER + 0.01)  # SIGSTOP ... SIGCONT
    assert a.held_leases() == {}, "not renewed for the failover time: no longer ours"
    written = updates(metrics)
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("100"))
    assert updates(metrics) == written, "the stale checkpoint was refused without a write"
    assert lost.shards == ["s1"]
    a.run_renewer_once()
    assert updates(metrics) == written, "nor is the lease renewed"
    assert fetch(table, "s1").checkpoint == Position.trim_horizon()


def test_shard_sync_can_reuse_the_takers_scan(table: LeaseTable, clock: Clock) -> None:
    create(table, "s1")
    a, _ = coordinator(table, "A", clock)
    assert a.recent_lease_keys(60) is None, "no scan yet"
    a.run_taker_once()
    assert a.recent_lease_keys(60) == frozenset({"s1"})
    clock.advance(61)
    assert a.recent_lease_keys(60) is None


# -- pacing retrieval ------------------------------------------------------------------------


def test_a_late_renewer_shuts_the_retrieval_gate_until_it_is_on_time(
        table: LeaseTable, clock: Clock) -> None:
    metrics = Metrics()
    c, _ = coordinator(table, "w1", clock, metrics=metrics)
    quarter = c.renewer_interval_s / 4
    c.pace_retrieval(quarter)
    assert c.retrieval_gate.is_set()
    c.pace_retrieval(quarter + 0.1)
    assert not c.retrieval_gate.is_set()
    c.pace_retrieval(quarter + 5)
    assert sample(metrics, "kclpy_retrieval_pauses_total") == 1
    assert sample(metrics, "kclpy_retrieval_paused") == 1
    c.pace_retrieval(0.1)
    assert c.retrieval_gate.is_set() and sample(metrics, "kclpy_retrieval_paused") == 0


def test_the_renewer_pauses_retrieval_when_it_wakes_late_and_keeps_its_leases(
        table: LeaseTable, clock: Clock) -> None:
    late_renewer_pauses_retrieval(table, clock)


@pytest.mark.integration
def test_over_http_a_late_renewer_pauses_retrieval_and_keeps_its_leases(
        moto_server: LocalEndpoint) -> None:
    dynamodb = boto3.client("dynamodb", endpoint_url=moto_server.url, region_name=REGION)
    table = LeaseTable(dynamodb, f"app-{uuid.uuid4().hex}")
    table.create_if_missing()
    late_renewer_pauses_retrieval(table, Clock())


def late_renewer_pauses_retrieval(table: LeaseTable, clock: Clock) -> None:
    """A renewer that oversleeps (here: its clock jumps while it waits, as when the
    process is too busy to run it) shuts the gate, still renews, and opens the gate again
    once a cycle starts on time."""
    metrics = Metrics()
    create(table, "shard-1")
    c, lost = coordinator(table, "w1", clock, metrics=metrics, failover_time_s=2.0)
    c.run_taker_once()
    c.start()
    try:
        counter = fetch(table, "shard-1").lease_counter
        clock.advance(c.renewer_interval_s * 1.75)
        wait_for(lambda: sample(metrics, "kclpy_retrieval_pauses_total") == 1)
        wait_for(lambda: fetch(table, "shard-1").lease_counter > counter)
        wait_for(c.retrieval_gate.is_set)
        assert lost.shards == [] and c.get_held("shard-1") is not None
    finally:
        c.stop()
    assert c.retrieval_gate.is_set()


# -- how long the renewer sleeps -------------------------------------------------------------


def test_the_renewer_sleeps_until_the_first_renewal_due_and_never_more_than_a_quarter_interval(
    table: LeaseTable, clock: Clock
) -> None:
    quarter = FAILOVER / 2 / 4
    a, _ = coordinator(table, "A", clock)
    assert a.renewer.next_wait() == quarter, "no lease: it still wakes to prove it is alive"
    create(table, "s1")
    a.run_taker_once()
    assert a.renewer.next_wait() == quarter
    clock.advance(FAILOVER / 2 - 0.5)
    assert a.renewer.next_wait() == pytest.approx(0.5), "s1 is due in half a second"
    clock.advance(2.0)
    assert a.renewer.next_wait() == 0.01, "overdue: at once, but never a busy loop"
    a.run_renewer_once(due_only=True)
    assert a.renewer.next_wait() == quarter
