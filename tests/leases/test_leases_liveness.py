"""A held lease is always consumed, and a slow answer for one lease harms no other.

What a DynamoDB answer that arrives late (the write landed, its caller hears of it after the
failover time) must not do: bring back a lease the worker already gave up and whose processor
was told it is lost, leaving the shard held and never consumed again; hold up the renewal of
the worker's other leases; make the worker believe it is starved of CPU. And what a refused
checkpoint must say: "expired on this worker" or "taken by another worker".

The fence and renewer cases run on in-process moto with a hand-driven clock where they can;
the end-to-end cases run a real Worker over real HTTP (kinesis-mock and kclpy's own DynamoDB
server, whose conditional writes are atomic), with the answer held back by the test.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from kclpy import KCLConfig, Worker
from kclpy.errors import ShutdownException
from kclpy.leases.coordinator import CoordinatorSettings, LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import Position
from tests.support.determinism import Clock
from tests.support.late import LateAnswers, LateSession, checkpoint_write
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

FAILOVER = 10.0


def renewal_of(key: str) -> Any:
    def match(operation: str, params: dict[str, Any]) -> bool:
        names = params.get("ExpressionAttributeNames", {})
        return (operation == "UpdateItem" and params["Key"]["leaseKey"]["S"] == key
                and "checkpoint" not in names.values())
    return match


@pytest.fixture
def late() -> Iterator[LateAnswers]:
    with mock_aws():
        yield LateAnswers(boto3.client("dynamodb", region_name="us-east-1"))


def coordinator(late: Any, clock: Any, *keys: str,
                metrics: Metrics | None = None) -> tuple[LeaseCoordinator, list[str]]:
    table = LeaseTable(late, "app", max_attempts=1, sleep=lambda _: None)
    table.create_if_missing()
    for key in keys:
        assert table.create(Lease(key))
    worker = LeaseCoordinator(table, "A", CoordinatorSettings(failover_time_s=FAILOVER),
                              clock=clock, metrics=metrics)
    lost: list[str] = []
    worker.add_lease_lost_listener(lost.append)
    for key in keys:
        current = table.get(key)
        assert current is not None
        fresh = table.take(current, "A")
        fresh.concurrency_token = uuid.uuid4().hex
        worker.held.install(fresh, clock())
    return worker, lost


def test_a_late_renewal_cannot_bring_back_a_lease_given_up(late: LateAnswers) -> None:
    clock = Clock()
    worker, lost = coordinator(late, clock, "s1")
    late.hold(renewal_of("s1"))
    clock.advance(FAILOVER / 2)
    renewal = threading.Thread(target=worker.run_renewer_once)
    renewal.start()
    assert late.landed.wait(10)

    clock.advance(FAILOVER)  # the answer is still on its way past the failover time
    assert "s1" not in worker.held_leases()
    assert lost == ["s1"]

    late.release()
    renewal.join(10)
    assert not renewal.is_alive()
    assert worker.get_held("s1") is None, "the late answer brought the lease back"
    assert "s1" not in worker.held_leases()
    item = worker.table.get("s1")
    assert item is not None and item.lease_owner is None, "the landed write was not let go"


def test_a_checkpoint_refused_after_local_expiry_says_so(late: LateAnswers) -> None:
    clock = Clock()
    worker, _ = coordinator(late, clock, "s1")
    held = worker.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    clock.advance(FAILOVER + 1)
    worker.held_leases()
    with pytest.raises(ShutdownException, match="expired on this worker") as refused:
        worker.fence.update_checkpoint("s1", held.concurrency_token, Position("100"))
    assert "taken by another worker" not in str(refused.value)


def test_a_checkpoint_refused_after_a_steal_names_the_taker(late: LateAnswers) -> None:
    clock = Clock()
    worker, lost = coordinator(late, clock, "s1")
    held = worker.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    current = worker.table.get("s1")
    assert current is not None
    worker.table.take(current, "B")
    with pytest.raises(ShutdownException, match=r"taken by another worker.*owner now B"):
        worker.fence.update_checkpoint("s1", held.concurrency_token, Position("100"))
    assert lost == ["s1"]
    with pytest.raises(ShutdownException, match="taken by another worker"):
        worker.fence.update_checkpoint("s1", held.concurrency_token, Position("100"))


def test_a_slow_renewal_delays_neither_the_others_nor_the_loop(late: LateAnswers) -> None:
    """While s1's renewal answer is held back past the failover time, the renewer loop's
    step returns at once (so its punctuality still measures starvation alone), s2 is renewed
    every time it is due, and only s1 is given up."""
    clock = Clock()
    worker, lost = coordinator(late, clock, "s1", "s2")
    late.hold(renewal_of("s1"))
    clock.advance(FAILOVER / 2)

    def returns(step: Any) -> None:
        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the renewer waited for a held answer"

    returns(worker.renewer.dispatch_due)
    assert late.landed.wait(10)

    def s2_renewed() -> bool:
        s2 = worker.held.entry("s2")
        return (s2 is not None and s2.renewed_at == FAILOVER / 2
                and "s2" not in worker.renewer.renewing())

    # s2's renewal of that pass is not held back, but nothing waits for it: a renewal still
    # in flight (its new time written, its thread not yet finished) is skipped by the next
    # pass, so the loop below starts once it has ended
    wait_for(s2_renewed, timeout=30, message="s2's renewal dispatched beside the held one")
    for _ in range(3):
        clock.advance(FAILOVER / 2)
        returns(lambda: worker.run_renewer_once(due_only=True))
        s2 = worker.held.entry("s2")
        assert s2 is not None and s2.renewed_at == clock(), "s2 missed its renewal"
    assert set(worker.held_leases()) == {"s2"}
    assert lost == ["s1"]
    late.release()
    worker.renewer.close()  # s1's late renewal ends (and lets the lease go) before moto does
    item = worker.table.get("s1")
    assert item is not None and item.lease_owner is None


# -- end to end: a real Worker over real HTTP --------------------------------------------------


@pytest.mark.integration
def test_a_shard_whose_checkpoint_answer_comes_late_is_consumed_again(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """The main trigger of a shard held for good and never processed: the processor is in its
    own checkpoint when the worker gives the lease up; then the checkpoint lands."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("late")
    create_stream(kinesis, stream, 1)
    session = LateSession(region_name="us-east-1")
    config = KCLConfig(
        application_name=unique_name("app"), stream_name=stream, region="us-east-1",
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON", failover_time_ms=2000,
        idle_time_between_reads_ms=100, shard_sync_interval_ms=1000,
        parent_shard_poll_interval_ms=200, shutdown_grace_ms=5000, task_backoff_time_ms=50)
    ledger = Ledger()
    worker = Worker(config, lambda: RecordingProcessor(ledger), session=session)
    with running(worker):
        assert worker.wait_started(60)
        put_plain(kinesis, stream, [b"first"])
        wait_for(lambda: b"first" in ledger.payloads(), timeout=60, message="the first record")
        late = session.late[0]
        late.hold(checkpoint_write)
        put_plain(kinesis, stream, [b"second"])
        assert late.landed.wait(60), "the second batch was never checkpointed"
        coordinator = worker.coordinator
        assert coordinator is not None
        wait_for(lambda: not coordinator.held_leases(), timeout=30,
                 message="the lease given up while its checkpoint answer is on its way")
        consumer = worker.consumers()["shardId-000000000000"]
        # The consumer itself is still blocked in the checkpoint; the worker has told it.
        wait_for(consumer._lease_lost.is_set, timeout=30, message="the consumer told")
        late.release()

        put_plain(kinesis, stream, [b"third"])
        wait_for(lambda: b"third" in ledger.payloads(), timeout=60,
                 message="the shard consumed again after the late checkpoint answer")
        wait_for(lambda: worker.healthy, timeout=30, message="the worker healthy again")
    assert (worker.metrics.registry.get_sample_value("kclpy_leases_expired_total") or 0) >= 1


def test_a_held_shard_without_a_consumer_is_counted_and_fails_health(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop for a fault the worker cannot see: a held lease without a running
    consumer for longer than the failover time is a metric and makes the worker unhealthy."""
    now = [100.0]
    monkeypatch.setattr("kclpy.worker.time.monotonic", lambda: now[0])
    config = KCLConfig(application_name="app", stream_name="s", region="us-east-1",
                       failover_time_ms=1000)
    worker = Worker(config, lambda: RecordingProcessor(Ledger()))

    class Renewing:
        healthy = True

    worker.coordinator = Renewing()  # type: ignore[assignment]
    with worker._consumers_lock:
        worker._track_unconsumed({"shard-1": Lease("shard-1")})
    def healthy() -> bool:
        return worker.healthy

    assert worker.metrics.registry.get_sample_value("kclpy_shards_held_unconsumed") == 1
    assert healthy()  # not yet longer than the failover time
    now[0] += 1.5
    assert not healthy()
    with worker._consumers_lock:
        worker._track_unconsumed({})  # let go: nothing held is unconsumed
    assert worker.metrics.registry.get_sample_value("kclpy_shards_held_unconsumed") == 0
    assert healthy()
