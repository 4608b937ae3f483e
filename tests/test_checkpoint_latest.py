"""A lease still at ``LATEST`` is resolved once, over real HTTP (kinesis-mock, the local
DynamoDB): the arrival time it was resolved to is kept in the lease item (``kclpyStartAt``)
before the shard is read, so a new owner after kill -9, a steal or a handoff, a restarted
processor, and a worker started again after an idle spell all read from there - records
delivered but not checkpointed, and records written while nobody read the shard, are never
skipped.
"""

from __future__ import annotations

import collections
import json
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kclpy
from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.multilang import multilang_processor_factory
from tests.multilang_apps.amazon_kclpy_dist import amazon_kclpy_root
from tests.support.e2e import lease_items, worker_config
from tests.support.fleet import fleet
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import (
    create_stream,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running

pytestmark = pytest.mark.integration

APPS = Path(__file__).parent / "multilang_apps"


class NeverCheckpoints(RecordingProcessor):
    """Records what it gets and never checkpoints, not even when asked to shut down: its
    shards' leases stay at ``LATEST`` for good."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, checkpoint_every_batch=False)

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self.ledger.event(self.shard_id, "shutdown_requested")


def config_for(kinesis_url: str, dynamodb_url: str, stream: str, application: str,
               worker_id: str, **overrides: Any) -> KCLConfig:
    """The end-to-end settings from LATEST, for one named worker of ``application``."""
    return worker_config(kinesis_url, dynamodb_url, stream, **{
        "application_name": application, "worker_id": worker_id, "initial_position": "LATEST",
        **overrides})


def all_pinned(items: Callable[[], dict[str, dict[str, Any]]],
               shards: int) -> dict[str, int] | None:
    """Lease key -> kept start, once every one of ``shards`` leases is at LATEST with one."""
    found = items()
    kept = {key: int(item["kclpyStartAt"]["N"]) for key, item in found.items()
            if item["checkpoint"]["S"] == "LATEST" and "kclpyStartAt" in item}
    return kept if len(kept) == shards else None


def shard_payloads(kinesis: Any, stream: str, tag: str, count: int) -> dict[str, set[bytes]]:
    """Put ``count`` records spread over the shards; shard id -> payloads."""
    payloads = [f"{tag}-{n}".encode() for n in range(count)]
    by_shard: dict[str, set[bytes]] = collections.defaultdict(set)
    for payload, (shard, _) in zip(payloads, put_plain(kinesis, stream, payloads), strict=True):
        by_shard[shard].add(payload)
    return by_shard


def test_kill_9_before_the_first_checkpoint_loses_nothing(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path) -> None:
    """A worker is killed holding its first batch, before any checkpoint; a record is then
    written while nobody reads the shard. The next owner gets both."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("latest-kill")
    create_stream(kinesis, stream, 1)
    application = unique_name("app")
    with fleet(kinesis_mock.url, moto_server.url, stream, application, tmp_path,
               extra_args=["--initial-position", "LATEST"]) as group:
        first = group.start("a")
        wait_for(lambda: all_pinned(group.lease_items, 1), 60, "the LATEST lease kept")
        group.hold_path("a").touch()
        put_plain(kinesis, stream, [b"r1"])
        wait_for(lambda: group.ledger.events("holding"), 60, "a holding r1, unchecked")
        first.signal(signal.SIGKILL)
        first.process.wait(30)
        put_plain(kinesis, stream, [b"r2"])
        second = group.start("b")
        wait_for(lambda: {"r1", "r2"} <= {r["data"] for r in group.ledger.records()
                                          if r["pid"] == second.pid},
                 90, "b processing r1 and r2")
        starts = [e["checkpoint"] for e in group.ledger.events("initialize")]
    assert starts == ["LATEST", "LATEST"], "b started from the lease a never checkpointed"


@pytest.mark.parametrize("graceful", [False, True], ids=["steal", "handoff"])
def test_a_lease_moved_before_its_first_checkpoint_is_read_again_from_its_start(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, graceful: bool) -> None:
    """Worker a holds both leases and delivers a batch of each without checkpointing; b
    then steals one (or has it handed off). b reads that shard from where a's LATEST was
    resolved: the batch a never checkpointed comes again, then what followed."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("latest-move")
    create_stream(kinesis, stream, 2)
    application = unique_name("app")
    ledger_a, ledger_b = Ledger(), Ledger()
    settings = {"is_graceful_lease_handoff_enabled": graceful}
    config_a = config_for(kinesis_mock.url, moto_server.url, stream, application, "a",
                          **settings)
    config_b = config_for(kinesis_mock.url, moto_server.url, stream, application, "b",
                          **settings)
    with running(Worker(config_a, lambda: NeverCheckpoints(ledger_a))):
        wait_for(lambda: all_pinned(lambda: lease_items(moto_server.url, application), 2),
                 60, "both LATEST leases kept")
        before = shard_payloads(kinesis, stream, "before", 20)
        wait_for(lambda: set().union(*before.values()) <= set(ledger_a.payloads()), 60,
                 "a processing the first batch of each shard")
        with running(Worker(config_b, lambda: NeverCheckpoints(ledger_b))):
            moved = wait_for(lambda: set(ledger_b.by_shard()) or {
                key for key, item in lease_items(moto_server.url, application).items()
                if item.get("leaseOwner", {}).get("S") == "b"}, 90, "b holding a lease")
            (shard,) = moved
            after = shard_payloads(kinesis, stream, "after", 20)
            wanted = before[shard] | after[shard]
            wait_for(lambda: wanted <= set(ledger_b.payloads()), 90,
                     f"b processing everything of {shard} since a's start")
    item = lease_items(moto_server.url, application)[shard]
    assert item["checkpoint"]["S"] == "LATEST"


def test_an_idle_shard_keeps_its_start_across_a_restart(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """A worker resolves LATEST on an idle shard and stops; a record written while no
    worker runs is processed by the next one, which starts from the kept point."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("latest-idle")
    create_stream(kinesis, stream, 1)
    application = unique_name("app")
    ledger = Ledger()
    config = config_for(kinesis_mock.url, moto_server.url, stream, application, "a")
    with running(Worker(config, lambda: RecordingProcessor(ledger))):
        kept = wait_for(lambda: all_pinned(lambda: lease_items(moto_server.url, application),
                                           1), 60, "the LATEST lease kept")
    put_plain(kinesis, stream, [b"while-down"])
    with running(Worker(config.replace(worker_id="b"), lambda: RecordingProcessor(ledger))):
        wait_for(lambda: b"while-down" in ledger.payloads(), 60, "the record written while down")
    assert ledger.payloads() == [b"while-down"]
    item = lease_items(moto_server.url, application)[next(iter(kept))]
    assert item["checkpoint"]["S"].isdigit()
    assert "kclpyStartAt" not in item, "the first checkpoint removes the kept start"


@pytest.mark.slow
def test_a_multilang_child_dying_on_its_first_batch_gets_it_again(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An amazon_kclpy application exits in the middle of its first batch, before any
    checkpoint: its restarted processor reads from where LATEST was resolved."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("latest-child")
    create_stream(kinesis, stream, 1)
    application = unique_name("app")
    output = tmp_path / "events.jsonl"
    metrics = Metrics()
    factory = multilang_processor_factory(
        f"{shlex.quote(sys.executable)} v2_app.py", cwd=APPS, metrics=metrics,
        env={"PYTHONPATH": str(amazon_kclpy_root()), "KCLPY_TEST_OUTPUT": str(output)})

    def seen() -> list[dict[str, Any]]:
        if not output.exists():
            return []
        return [json.loads(line) for line in output.read_text().splitlines()]

    config = config_for(kinesis_mock.url, moto_server.url, stream, application, "a")
    with running(Worker(config, factory, metrics=metrics)):
        wait_for(lambda: all_pinned(lambda: lease_items(moto_server.url, application), 1),
                 60, "the LATEST lease kept")
        put_plain(kinesis, stream, [b"first", b"crash-once", b"last"], ["k", "k", "k"])
        wait_for(lambda: "last" in {e.get("data") for e in seen()}, 90, "the batch again")
    records = [e["data"] for e in seen() if e["event"] == "record"]
    assert records == ["first", "crash-once", "first", "crash-once", "last"]
    starts = [e["sequence_number"] for e in seen() if e["event"] == "initialize"]
    assert starts == ["LATEST", "LATEST"]


def test_with_enhanced_fan_out_the_kept_start_opens_the_subscription(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """The kept start reaches SubscribeToShard (``AT_TIMESTAMP``) as it reaches GetRecords:
    the next worker's subscription reads from it, the record written while no worker ran
    included."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("latest-efo")
    create_stream(kinesis, stream, 1)
    application = unique_name("app")
    ledger = Ledger()
    config = config_for(kinesis_mock.url, moto_server.url, stream, application, "a",
                        retrieval_mode="FANOUT", retry_backoff_ms=200,
                        max_describe_stream_consumer_retries=50)
    with running(Worker(config, lambda: NeverCheckpoints(ledger))):
        wait_for(lambda: all_pinned(lambda: lease_items(moto_server.url, application), 1),
                 60, "the LATEST lease kept")
        put_plain(kinesis, stream, [b"while-up"])
        wait_for(lambda: b"while-up" in ledger.payloads(), 60, "the record read live")
    put_plain(kinesis, stream, [b"while-down"])
    with running(Worker(config.replace(worker_id="b"), lambda: NeverCheckpoints(ledger))):
        wait_for(lambda: b"while-down" in ledger.payloads(), 90, "the record written while down")
    assert ledger.payloads() == [b"while-up", b"while-up", b"while-down"], \
        "never checkpointed: b reads from the kept start again"
