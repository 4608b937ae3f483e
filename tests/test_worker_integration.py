"""The worker end to end over real HTTP: kinesis-mock for Kinesis, moto's server for DynamoDB.

Each test runs a real Worker (in a thread, or as a ``kclpy-worker`` process) against loopback
endpoints started by the session fixtures, and checks what the processor saw against what was
produced: every record, in order per shard, exactly once where the protocol promises it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from kclpy import Worker
from kclpy.cli import worker_main
from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from tests.support.e2e import (
    EndToEnd,
    assert_exactly_once,
    assert_in_order,
    produce_mixed,
    running,
    stream_active,
    worker_config,
)
from tests.support.faultproxy import FaultProxy
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import (
    dynamodb_client,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running as running_worker

pytestmark = pytest.mark.integration


def test_four_shards_plain_and_kpl_exactly_once_in_order(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("e2e", 4)
    expected = produce_mixed(kinesis, stream, "a", plain=200, aggregates=10, per_aggregate=20)
    config = e2e.config(stream)
    with running(config, ledger) as worker:
        wait_for(lambda: len(ledger.records) >= len(expected), 120, "all records processed")
        assert set(worker.status()["held_leases"]) == set(ledger.by_shard()) | set(
            worker.status()["held_leases"])
    assert_exactly_once(ledger, expected)
    assert_in_order(ledger)
    assert len(ledger.by_shard()) == 4
    items = e2e.lease_items(config.lease_table_name)
    assert len(items) == 4
    for item in items.values():
        assert "leaseOwner" not in item, "leases are released on shutdown"
        assert item["checkpoint"]["S"].isdigit()
    kpl = [r for r in ledger.records if r[3].startswith(b"a-kpl-")]
    assert {r[2] for r in kpl} == set(range(20)), "sub-sequence numbers of KPL records"


def test_stopped_mid_stream_and_restarted_resumes_from_checkpoint(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("restart", 2)
    first = produce_mixed(kinesis, stream, "one", plain=150, aggregates=5, per_aggregate=10)
    config = e2e.config(stream)
    with running(config, ledger):
        wait_for(lambda: len(ledger.records) >= len(first) // 2, 120, "half processed")
        second = produce_mixed(kinesis, stream, "two", plain=100, aggregates=5, per_aggregate=10)
    stopped_at = len(ledger.records)
    third = produce_mixed(kinesis, stream, "three", plain=50, aggregates=2, per_aggregate=10)
    expected = first + second + third
    with running(config.replace(worker_id="second-worker"), ledger):
        wait_for(lambda: len(ledger.records) >= len(expected), 120, "all processed")
    assert_exactly_once(ledger, expected)
    assert_in_order(ledger)
    assert stopped_at < len(expected)
    initialized = [name for _, name in ledger.events if name.startswith("initialize:")]
    assert any(name.split(":", 1)[1].isdigit() for name in initialized), \
        "the second worker resumed from a sequence-number checkpoint"


def test_split_and_merge_parents_before_children(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("reshard", 2)
    expected = produce_mixed(kinesis, stream, "before", plain=100, aggregates=2, per_aggregate=10)
    config = e2e.config(stream)
    with running(config, ledger):
        wait_for(lambda: len(ledger.records) >= 20, 60, "processing started")
        shards = kinesis.list_shards(StreamName=stream)["Shards"]
        first = shards[0]
        low, high = (int(first["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
        kinesis.split_shard(StreamName=stream, ShardToSplit=first["ShardId"],
                            NewStartingHashKey=str((low + high) // 2))
        wait_for(lambda: stream_active(kinesis, stream), 30, "split done")
        expected += produce_mixed(kinesis, stream, "split", plain=100, aggregates=2,
                                  per_aggregate=10)
        open_shards = sorted(
            (s for s in kinesis.list_shards(StreamName=stream)["Shards"]
             if "EndingSequenceNumber" not in s["SequenceNumberRange"]),
            key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))
        kinesis.merge_shards(StreamName=stream, ShardToMerge=open_shards[1]["ShardId"],
                             AdjacentShardToMerge=open_shards[2]["ShardId"])
        wait_for(lambda: stream_active(kinesis, stream), 30, "merge done")
        expected += produce_mixed(kinesis, stream, "merge", plain=100, aggregates=2,
                                  per_aggregate=10)
        wait_for(lambda: len(ledger.records) >= len(expected), 180, "all processed")
    assert_exactly_once(ledger, expected)
    assert_in_order(ledger)
    all_shards = kinesis.list_shards(StreamName=stream)["Shards"]
    order = {i: r[0] for i, r in enumerate(ledger.records)}
    for shard in all_shards:
        parents = [shard.get("ParentShardId"), shard.get("AdjacentParentShardId")]
        child_first = min((i for i, s in order.items() if s == shard["ShardId"]), default=None)
        for parent in filter(None, parents):
            parent_last = max((i for i, s in order.items() if s == parent), default=None)
            if child_first is not None and parent_last is not None:
                assert parent_last < child_first, f"{shard['ShardId']} began before {parent} ended"
    assert len(all_shards) == 5
    ended = {shard for shard, name in ledger.events if name == "shard_ended"}
    assert len(ended) == 3, "two split/merged parents and the merged-away sibling ended"


def test_throttling_and_iterator_expiry_are_survived_without_loss(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("faults", 2)
    expected = produce_mixed(kinesis, stream, "f", plain=300, aggregates=4, per_aggregate=10)
    with FaultProxy(e2e.kinesis_url, seed=7) as proxy:
        proxy.set_rule("GetRecords", throttle_rate=0.3)
        proxy.set_rule("GetShardIterator", throttle_rate=0.2)
        for _ in range(2):
            proxy.inject_once("GetRecords", (400, {
                "__type": "ExpiredIteratorException", "message": "Iterator expired"}))
        config = worker_config(proxy.url, e2e.dynamodb_url, stream, max_records=50)
        with running(config, ledger) as worker:
            wait_for(lambda: len(ledger.records) >= len(expected), 120, "all processed")
            metrics = worker.metrics.registry
            throttles = metrics.get_sample_value(
                "kclpy_throttles_total", {"operation": "GetRecords"}) or 0
            expirations = sum(
                metrics.get_sample_value("kclpy_iterator_expirations_total",
                                         {"shard_id": s}) or 0
                for s in ledger.by_shard())
        assert proxy.faults("throttle") > 0
    assert throttles > 0
    assert expirations == 2
    assert_exactly_once(ledger, expected)
    assert_in_order(ledger)


def test_lost_lease_calls_lease_lost_and_fences_checkpoints(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("lost", 1)
    expected = produce_mixed(kinesis, stream, "l", plain=50, aggregates=0, per_aggregate=1)
    config = e2e.config(stream)
    dynamodb = dynamodb_client(e2e.dynamodb_url)
    with running(config, ledger) as worker:
        wait_for(lambda: len(ledger.records) >= len(expected), 60, "processed")
        shard_id = next(iter(ledger.by_shard()))
        item = e2e.lease_items(config.lease_table_name)[shard_id]
        counter = item["leaseCounter"]["N"]
        dynamodb.update_item(
            TableName=config.lease_table_name, Key={"leaseKey": {"S": shard_id}},
            UpdateExpression="SET leaseOwner = :thief, leaseCounter = leaseCounter + :one",
            ConditionExpression="leaseCounter = :c",
            ExpressionAttributeValues={":thief": {"S": "thief"}, ":one": {"N": "1"},
                                       ":c": {"N": counter}})
        wait_for(lambda: (shard_id, "lease_lost") in ledger.events, 30, "lease_lost called")
        lost = worker.metrics.registry.get_sample_value("kclpy_leases_lost_total")
        assert lost is not None and lost >= 1
        # The thief never renews: after the failover time the worker takes the shard back
        # (on a loaded machine it may already have, so the thief's ownership is not read here).
        wait_for(lambda: e2e.lease_items(config.lease_table_name)[shard_id]
                 .get("leaseOwner", {}).get("S") == config.worker_id, 30, "lease retaken")
        more = produce_mixed(kinesis, stream, "m", plain=20, aggregates=0, per_aggregate=1)
        wait_for(lambda: len(ledger.records) >= len(expected) + len(more), 60, "more processed")
    assert_exactly_once(ledger, expected + more)


def test_endpoints_from_the_boto3_environment_chain(
        e2e: EndToEnd, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("envchain", 1)
    expected = produce_mixed(kinesis, stream, "env", plain=20, aggregates=1, per_aggregate=5)
    monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", e2e.kinesis_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", e2e.dynamodb_url)
    config = e2e.config(stream).replace(
        kinesis_endpoint=None, dynamodb_endpoint=None, stop_when_caught_up=True)
    worker = Worker(config, lambda: RecordingProcessor(ledger))
    worker.run(install_signal_handlers=False)
    assert_exactly_once(ledger, expected)
    assert worker.kinesis.meta.endpoint_url == e2e.kinesis_url
    assert worker.dynamodb.meta.endpoint_url == e2e.dynamodb_url


def initialization_failures(worker: Worker) -> float:
    """Failed start-up attempts, whatever exception class botocore raised for them."""
    return sum(sample.value for family in worker.metrics.registry.collect()
               for sample in family.samples
               if sample.name == "kclpy_initialization_failures_total")


def test_start_up_into_dynamodb_errors_is_retried_and_then_consumes(
        e2e: EndToEnd, ledger: Ledger) -> None:
    """Two start-up attempts fail (botocore's three tries of DescribeTable each get a 5xx);
    the third succeeds and the worker consumes as if nothing happened."""
    kinesis = e2e.kinesis
    stream = e2e.stream("startup", 1)
    expected = produce_mixed(kinesis, stream, "s", plain=20, aggregates=1, per_aggregate=5)
    with FaultProxy(e2e.dynamodb_url) as proxy:
        for _ in range(2 * 3):
            proxy.once("DescribeTable", "error_5xx")
        config = worker_config(e2e.kinesis_url, proxy.url, stream,
                             max_initialization_attempts=3, initialization_backoff_ms=50)
        with running(config, ledger) as worker:
            wait_for(lambda: len(ledger.records) >= len(expected), 60, "all processed")
            failures = initialization_failures(worker)
        assert proxy.faults("error_5xx", "DescribeTable") == 6
    assert failures == 2
    assert_exactly_once(ledger, expected)


@contextmanager
def dynamodb_failing(e2e: EndToEnd, **overrides: Any) -> Iterator[tuple[FaultProxy, Worker]]:
    """A worker of a fresh one-shard stream whose every DescribeTable answers a 5xx."""
    stream = e2e.stream("startup", 1)
    with FaultProxy(e2e.dynamodb_url) as proxy:
        proxy.set_rule("DescribeTable", error_5xx_rate=1.0)
        yield proxy, Worker(worker_config(e2e.kinesis_url, proxy.url, stream, **overrides),
                            lambda: RecordingProcessor(Ledger()))


def test_start_up_gives_up_after_its_attempts_and_a_config_error_at_once(e2e: EndToEnd) -> None:
    with dynamodb_failing(e2e, max_initialization_attempts=2,
                          initialization_backoff_ms=10) as (proxy, worker):
        with pytest.raises(ClientError, match=r"InternalServerError|ServiceUnavailable"):
            worker.run(install_signal_handlers=False)
        assert proxy.requests("DescribeTable") == 2 * 3
    assert not worker.wait_started(0)
    assert initialization_failures(worker) == 2

    missing = Worker(e2e.config(unique_name("absent"),
                                 initialization_backoff_ms=60_000),
                     lambda: RecordingProcessor(Ledger()))
    with pytest.raises(ConfigError, match=r"^stream_name: "):
        missing.run(install_signal_handlers=False)
    assert initialization_failures(missing) == 0


def test_shutdown_during_start_up_backoff_ends_the_worker_cleanly(e2e: EndToEnd) -> None:
    """A SIGTERM while the worker waits to retry its start-up stops it without waiting
    for the backoff (an hour here) and without taking a lease."""
    with dynamodb_failing(e2e,
                          initialization_backoff_ms=3_600_000) as (_, worker):
        with running_worker(worker):
            wait_for(lambda: initialization_failures(worker), 30, "a failed start-up attempt")
        assert not worker.wait_started(0)
        assert worker.coordinator is not None and not worker.coordinator.held_leases()


def test_kclpy_worker_exits_2_naming_a_stream_that_does_not_exist(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).parents[1])
    code = worker_main([
        "--stream-name", unique_name("absent"), "--application-name", unique_name("app"),
        "--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
        "--dynamodb-endpoint", moto_server.url,
        "--processor", "examples/printing_processor.py:PrintingProcessor"])
    assert code == 2
    assert "--stream-name" in capsys.readouterr().err
