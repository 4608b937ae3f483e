"""LeaseCoordinator: checkpoints through its fence, releases, its threads and its health,
driven by an injected clock (moto in-process; one section over moto's server). What the
taker and the renewer decide on their own is in test_taker.py and
test_renewer.py."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from typing import Any

import boto3
import pytest

from kclpy.errors import (
    KinesisClientLibDependencyException,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases.coordinator import CoordinatorSettings, LeaseCoordinator
from kclpy.leases.dynamo import LeaseTableThrottled
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
    owners,
    run_fleet,
    take_one,
)
from tests.support.waiting import wait_for

# -- checkpoints -------------------------------------------------------------------------------


def test_update_checkpoint_writes_and_counts_as_a_renewal(table: LeaseTable, clock: Clock) -> None:
    a, lost, token = take_one(table, clock)
    clock.advance(FAILOVER * 0.9)
    a.fence.update_checkpoint("s1", token, Position("4959000", 3))
    stored = fetch(table, "s1")
    assert stored.checkpoint == Position("4959000", 3)
    assert a.get_held("s1") == stored
    # the checkpoint refreshed the lease: a failing renewer does not drop it yet
    client = table.client
    assert isinstance(client, FlakyClient)
    client.fail["update_item"] = client_error("InternalServerError")
    clock.advance(FAILOVER * 0.9)
    a.run_renewer_once()
    assert lost.shards == []


def test_checkpoint_with_a_stale_token_or_an_unheld_lease_is_refused(
    table: LeaseTable, clock: Clock
) -> None:
    a, _, token = take_one(table, clock)
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", "another-tenure", Position("1"))
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("other-shard", token, Position("1"))
    assert fetch(table, "s1").checkpoint == Position.trim_horizon()
    a.release("s1")
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("1"))


def test_checkpoint_after_the_lease_was_taken_drops_it_and_notifies(
    table: LeaseTable, clock: Clock
) -> None:
    a, lost, token = take_one(table, clock)
    thief = table.take(fetch(table, "s1"), "B")
    table.update_checkpoint(thief, Position("777"))
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("123"))
    assert lost.shards == ["s1"]
    assert a.held_leases() == {}
    assert fetch(table, "s1").checkpoint.sequence_number == "777"


def test_a_retaken_lease_gets_a_new_token_and_old_checkpointers_are_fenced(
    table: LeaseTable, clock: Clock
) -> None:
    a, _, old_token = take_one(table, clock)
    a.release("s1")
    (again,) = a.run_taker_once()
    assert again.concurrency_token not in (None, old_token)
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", old_token, Position("5"))
    assert again.concurrency_token is not None
    a.fence.update_checkpoint("s1", again.concurrency_token, Position("5"))


def test_throttled_checkpoint_raises_throttling_exception_and_keeps_the_lease(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    a, lost, token = take_one(table, clock)
    client.fail["update_item"] = client_error("ProvisionedThroughputExceededException")
    with pytest.raises(ThrottlingException) as raised:
        a.fence.update_checkpoint("s1", token, Position("1"))
    assert isinstance(raised.value.__cause__, LeaseTableThrottled)
    assert lost.shards == []
    assert a.get_held("s1") is not None


def test_other_dynamodb_failures_raise_dependency_exception(
    table: LeaseTable, client: FlakyClient, clock: Clock
) -> None:
    a, lost, token = take_one(table, clock)
    client.fail["update_item"] = client_error("InternalServerError")
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.update_checkpoint("s1", token, Position("1"))
    assert lost.shards == []


def test_checkpoints_racing_renewals_always_use_the_freshest_counter(
    table: LeaseTable, clock: Clock
) -> None:
    a, lost, token = take_one(table, clock)
    rounds = 40
    errors: list[BaseException] = []

    def renew() -> None:
        try:
            for _ in range(rounds):
                a.run_renewer_once()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    renewer = threading.Thread(target=renew)
    renewer.start()
    for i in range(rounds):
        a.fence.update_checkpoint("s1", token, Position(str(1000 + i)))
    renewer.join()
    assert errors == []
    assert lost.shards == []
    stored = fetch(table, "s1")
    assert stored.lease_counter == 1 + 2 * rounds
    assert stored.checkpoint.sequence_number == str(1000 + rounds - 1)


# -- releasing and the threads -----------------------------------------------------------------


def test_release_lets_another_worker_take_the_lease_at_once(
    table: LeaseTable, clock: Clock
) -> None:
    create(table, "s1")
    a, a_lost = coordinator(table, "A", clock)
    a.run_taker_once()
    b, _ = coordinator(table, "B", clock)
    assert b.run_taker_once() == []
    a.release("s1")
    a.release("s1")
    assert a.held_leases() == {}
    assert a_lost.shards == []
    assert [lease.lease_key for lease in b.run_taker_once()] == ["s1"]


def test_release_of_a_lease_already_taken_only_forgets_it(table: LeaseTable, clock: Clock) -> None:
    a, _, _ = take_one(table, clock)
    table.take(fetch(table, "s1"), "B")
    a.release("s1")
    assert a.held_leases() == {}
    assert fetch(table, "s1").lease_owner == "B"


def test_started_threads_take_leases_and_stop_releases_them(table: LeaseTable) -> None:
    create(table, "s1", "s2")
    a, _ = coordinator(table, "A", time.monotonic, failover_time_s=0.3)
    a.start()
    try:
        wait_for(lambda: len(a.held_leases()) == 2)
        names = {thread.name for thread in threading.enumerate()}
        assert {"kclpy-lease-renewer-A", "kclpy-lease-taker-A"} <= names
    finally:
        a.stop(release=True)
    assert owners(table) == {"s1": None, "s2": None}
    names = {thread.name for thread in threading.enumerate()}
    assert "kclpy-lease-taker-A" not in names and "kclpy-lease-renewer-A" not in names


def test_stop_without_release_leaves_the_leases_to_expire(table: LeaseTable) -> None:
    create(table, "s1")
    a, _ = coordinator(table, "A", time.monotonic, taker_interval_s=3600)
    a.start()
    try:
        wait_for(lambda: a.get_held("s1") is not None)
    finally:
        a.stop(release=False)
    assert owners(table) == {"s1": "A"}


def test_a_coordinator_that_stopped_taking_takes_nothing_and_keeps_renewing(
    table: LeaseTable,
) -> None:
    """A worker shutting down stops its taker first (the Java KCL's ``stopLeaseTaker``):
    once ``stop_taking`` returns, the taker thread is gone, so a lease freed later (or one a
    shutdown's taker would have stolen) stays where it is, while the leases held are still
    renewed until they are released."""
    create(table, "s1")
    a, _ = coordinator(table, "A", time.monotonic, failover_time_s=3.0)
    a.start()
    try:
        wait_for(lambda: a.get_held("s1") is not None)
        a.stop_taking()
        assert "kclpy-lease-taker-A" not in {t.name for t in threading.enumerate()}
        create(table, "s2")
        a.wake_taker()
        counter = fetch(table, "s1").lease_counter
        wait_for(lambda: fetch(table, "s1").lease_counter > counter)  # renewed
        assert set(a.held_leases()) == {"s1"}
        assert fetch(table, "s2").lease_owner is None
    finally:
        a.stop(release=True)
    assert owners(table) == {"s1": None, "s2": None}


def test_wake_taker_runs_a_cycle_without_waiting_for_the_interval(client: Any) -> None:
    metrics = Metrics()
    table = LeaseTable(client, "app", metrics=metrics)
    table.create_if_missing()
    a, _ = coordinator(table, "A", time.monotonic, taker_interval_s=3600)
    a.start()
    try:
        scans = "kclpy_dynamodb_requests_total"
        wait_for(
            lambda: (metrics.registry.get_sample_value(scans, {"operation": "Scan"}) or 0) >= 1
        )
        create(table, "new")
        a.wake_taker()
        wait_for(lambda: a.get_held("new") is not None)
    finally:
        a.stop(release=True)


def test_invalid_settings_are_rejected(table: LeaseTable) -> None:
    with pytest.raises(ValueError, match="failover"):
        CoordinatorSettings(failover_time_s=0)
    with pytest.raises(ValueError, match="renewal_threads"):
        LeaseCoordinator(table, "A", CoordinatorSettings(renewal_threads=0))
    with pytest.raises(ValueError, match="graceful_handoff_timeout_s"):
        CoordinatorSettings(graceful_handoff_timeout_s=-1)
    c = LeaseCoordinator(table, "A", CoordinatorSettings(failover_time_s=9))
    assert (c.renewer_interval_s, c.taker.interval_s) == (4.5, None)


# -- over real HTTP (moto server) --------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url(moto_server: LocalEndpoint) -> str:
    return moto_server.url


@pytest.mark.integration
def test_over_http_three_workers_share_and_fence(moto_url: str) -> None:
    dynamodb = boto3.client("dynamodb", endpoint_url=moto_url, region_name=REGION)
    table = LeaseTable(dynamodb, f"app-{uuid.uuid4().hex}")
    table.create_if_missing()
    create(table, *(f"shardId-{i:012d}" for i in range(6)))
    clock = Clock()
    workers = [
        coordinator(table, name, clock, rng=random.Random(i)) for i, name in enumerate("ABC")
    ]
    history = run_fleet([c for c, _ in workers], clock, cycles=8)
    assert sorted(Counter(history[-1].values()).values()) == [2, 2, 2]
    assert history[-3] == history[-1]
    (a, _), (b, _), _ = workers
    shard, lease = next(iter(a.held_leases().items()))
    assert lease.concurrency_token is not None
    a.fence.update_checkpoint(shard, lease.concurrency_token, Position("12345"))
    with pytest.raises(ShutdownException):
        b.fence.update_checkpoint(shard, lease.concurrency_token, Position("99999"))
    assert fetch(table, shard).checkpoint.sequence_number == "12345"


def test_healthy_only_while_renewals_run() -> None:
    class Table:
        def list_leases(self) -> list[object]:
            return []

    now = [100.0]
    settings = CoordinatorSettings(failover_time_s=3.0, taker_interval_s=3600)
    coordinator = LeaseCoordinator(Table(), "w", settings,  # type: ignore[arg-type]
                                   clock=lambda: now[0])
    def healthy() -> bool:
        return coordinator.healthy

    assert not healthy(), "not started"
    coordinator.start()
    try:
        assert healthy()
        now[0] += 10.0  # no renewal cycle completed for longer than the failover time
        assert not healthy()
    finally:
        coordinator.stop(release=False)
    assert not healthy()


def test_a_stop_while_start_is_starting_the_threads_waits_for_them(
        table: LeaseTable, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewer's first pass can make a worker look healthy before ``start`` has started
    the taker thread; a ``stop`` from another thread then joined a thread not yet started
    (RuntimeError, seen in a clean-clone run of tests/ops/test_server.py). ``stop`` now waits for
    ``start`` to have started every thread, and stops them."""
    worker, _ = coordinator(table, "A", clock)
    in_start, go_on = threading.Event(), threading.Event()
    start = threading.Thread.start

    def held_taker_start(thread: threading.Thread) -> None:
        if thread.name.startswith("kclpy-lease-taker"):
            in_start.set()
            assert go_on.wait(10)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", held_taker_start)
    starting = threading.Thread(target=worker.start)
    start(starting)
    assert in_start.wait(10)
    stopped: list[BaseException | None] = []

    def stop() -> None:
        try:
            worker.stop(release=False)
            stopped.append(None)
        except BaseException as exc:  # whatever stop raised is the finding
            stopped.append(exc)

    stopping = threading.Thread(target=stop)
    start(stopping)
    go_on.set()
    starting.join(10)
    stopping.join(10)
    assert stopped == [None]
    assert worker._threads == [] and all(not t.is_alive() for t in threading.enumerate()
                                         if t.name.startswith("kclpy-lease-"))
