"""Exactly-once state: a stateful processor's writes committed with its checkpoint in one
transaction fenced by the lease, on every store. In-process moto over the real fence; one
worker test over real HTTP (kinesis-mock and moto's server) with a zombie and a retried
batch. What is the SQL store's alone is in test_sql.py; the transaction handle and the
stores' shared cache in test_transaction.py and test_store.py."""

from __future__ import annotations

import argparse
import collections
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.exceptions import ReadTimeoutError
from moto import mock_aws

import kclpy
from kclpy.checkpoint import Checkpointer
from kclpy.errors import ShutdownException, ThrottlingException, TransactionRejected
from kclpy.leases.lease import Lease, incarnation_epoch, new_incarnation
from kclpy.leases.serializer import UpdateBuilder
from kclpy.leases.shard_sync import ShardSyncer, SyncedStream
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.ops import control
from kclpy.position import TRIM_HORIZON, Position
from kclpy.processor import InitializeInput, ProcessRecordsInput
from kclpy.records import Record
from kclpy.recovery import queue as gaps
from kclpy.recovery import requests as asked
from kclpy.recovery.rate import RecoveryRate
from kclpy.recovery.shard import ShardRecovery
from kclpy.retrieval.clock import kinesis_clock
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.polling import Pacer, PollingSource
from kclpy.retrieval.source import ShardAddress
from kclpy.state import open_store
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.processor import MAX_CONFLICTS, ExactlyOnceProcessor, StatefulProcessor
from kclpy.state.sql import SQLStateStore
from kclpy.state.store import StateStore, keeps_own_position
from kclpy.state.transaction import StateTransaction, TransactionTooLarge, Versioned
from tests.support import skew
from tests.support.determinism import Clock
from tests.support.e2e import worker_config
from tests.support.faultproxy import FaultProxy
from tests.support.state import (
    Counter,
    Ops,
    Shard,
    rec,
    runner,
    stored_state,
    toy_extensions,
)
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_aggregated,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running

REGION = "us-east-1"
FAILOVER = 10.0


@pytest.fixture
def dynamodb() -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("dynamodb", region_name=REGION)


@pytest.fixture
def table(dynamodb: Any) -> LeaseTable:
    lease_table = LeaseTable(dynamodb, "app", sleep=lambda _: None)
    lease_table.create_if_missing()
    for key in ("s1", "s2"):
        assert lease_table.create(Lease(key))
    return lease_table


@pytest.fixture(params=["dynamodb", "sqlite", "postgresql", "dict"])
def new_store(request: pytest.FixtureRequest, dynamodb: Any, tmp_path: Path
              ) -> Callable[[], StateStore]:
    """Another worker's view of the one store under test (its own cache). ``dict`` is
    examples/toy_extensions.py's store, opened through kclpy's registry like any other."""
    if request.param == "dynamodb":
        return lambda: DynamoDBStateStore("app-state", client=dynamodb)
    if request.param == "dict":
        toy_extensions()
        spec = f"toy://{unique_name('state')}"
        return lambda: open_store(spec)
    url = (f"sqlite:///{tmp_path / 'state.db'}" if request.param == "sqlite"
           else request.getfixturevalue("postgres_url"))
    prefix = unique_name("state").replace("-", "_")

    def sql() -> StateStore:
        store = SQLStateStore(url, prefix=prefix)
        store.open(None)
        return store

    return sql


@pytest.fixture
def store(new_store: Callable[[], StateStore]) -> StateStore:
    return new_store()


# -- committing through the fence --------------------------------------------------------------

def test_state_and_checkpoint_commit_together(table: LeaseTable, store: StateStore) -> None:
    shard = Shard(table, "s1", "A", Clock())
    adapter = runner(store)
    shard.deliver(adapter, [rec(10, "k1:5"), rec(11, "k2:7"), rec(12, "k1:1")])
    assert stored_state(store) == {"count/k1": 2, "sum/k1": 6, "count/k2": 1, "sum/k2": 7}
    lease = table.get("s1")
    assert lease is not None and lease.checkpoint.sequence_number == "12"


def test_a_zombies_transaction_is_rejected_state_included_and_the_new_owner_applies_once(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    clock = Clock()
    zombie = Shard(table, "s1", "A", clock)
    zombie_run = runner(zombie_store := new_store())
    zombie.deliver(zombie_run, [rec(10, "k:1")])
    thief = Shard(table, "s1", "B", clock)  # took the lease while A was frozen
    batch = [rec(10, "k:1"), rec(11, "k:2"), rec(12, "k:3")]
    thief.deliver(runner(new_store(), start=thief.start), batch)
    with pytest.raises(ShutdownException):
        zombie.deliver(zombie_run, [rec(11, "k:2"), rec(12, "k:3")])
    assert stored_state(zombie_store) == {"count/k": 3, "sum/k": 6}, "the zombie's 2nd: nothing"
    lease = table.get("s1")
    assert lease is not None and (lease.lease_owner, lease.checkpoint) == ("B", Position("12"))


def test_a_batch_retried_after_a_crash_is_applied_once(table: LeaseTable, store: StateStore
                                                      ) -> None:
    shard = Shard(table, "s1", "A", Clock())
    adapter = runner(store, Counter(fail_once_at=5), max_records=2)
    batch = [rec(10 + i, f"k:{i}") for i in range(6)]
    with pytest.raises(RuntimeError):
        shard.deliver(adapter, batch)  # 10-11 and 12-13 committed; 14 applied, then the crash
    assert stored_state(store) == {"count/k": 4, "sum/k": 6}
    shard.deliver(adapter, batch)  # the consumer delivers the same batch again
    assert stored_state(store) == {"count/k": 6, "sum/k": 15}


def test_more_distinct_keys_than_one_transaction_holds_split_at_record_boundaries(
        table: LeaseTable, dynamodb: Any) -> None:
    shard = Shard(table, "s1", "A", Clock())
    metrics = Metrics()
    store = DynamoDBStateStore("app-state", client=dynamodb)
    adapter = runner(store, metrics=metrics)
    # each record writes two keys: 99 writes fit 49 records, so 250 records need 6 commits
    shard.deliver(adapter, [rec(100 + i, f"key{i}:{i}") for i in range(250)])
    state = stored_state(store)
    assert len(state) == 500
    assert all(state[f"count/key{i}"] == 1 and state[f"sum/key{i}"] == i for i in range(250))
    commits = metrics.registry.get_sample_value("kclpy_state_commits_total", {"shard_id": "s1"})
    assert commits == 6
    lease = table.get("s1")
    assert lease is not None and lease.checkpoint.sequence_number == "349"


def test_a_record_that_alone_exceeds_a_transaction_is_refused(
        table: LeaseTable, store: StateStore) -> None:
    class Wide(StatefulProcessor):
        def apply(self, record: Record, txn: StateTransaction) -> None:
            for i in range(store.limits.items + 1):
                txn.put(f"wide/{i}", i)

    shard = Shard(table, "s1", "A", Clock())
    with pytest.raises(TransactionTooLarge):
        shard.deliver(runner(store, Wide()), [rec(10, "x:0")])
    assert stored_state(store) == {}
    lease = table.get("s1")
    assert lease is not None
    assert lease.checkpoint == Position.trim_horizon(), "the record is not skipped"


def test_two_shards_updating_one_key_never_lose_an_update(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    clock = Clock()
    store_a, store_b = new_store(), new_store()  # two workers' caches
    metrics = Metrics()
    a, b = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    run_a = runner(store_a, metrics=metrics)
    run_b = ExactlyOnceProcessor(Counter(), store_b, metrics=metrics)
    run_b.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    for i in range(5):  # alternate, so each cache is stale half of the time
        a.deliver(run_a, [rec(10 + i, "shared:1")])
        b.deliver(run_b, [rec(10 + i, "shared:10")])
    assert stored_state(store_a) == {"count/shared": 10, "sum/shared": 55}
    conflicts = sum(metrics.registry.get_sample_value(
        "kclpy_state_conflicts_total", {"shard_id": s}) or 0 for s in ("s1", "s2"))
    assert conflicts >= 4


class HotKeys:
    """The store under test, with other shards committing to every key a transaction of more
    than ``fits`` records touches before it lands: such a transaction always loses the race."""

    def __init__(self, store: StateStore, fits: int) -> None:
        self._store, self._fits = store, fits
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def commit(self, writer: Any, lease_key: str, token: str, position: Position,
               txn: StateTransaction, gap: Position | None = None) -> None:
        if len(txn.writes) > 2 * self._fits:  # Counter writes two keys per record
            self.refused += 1
            raise TransactionRejected("another shard wrote these keys first", [])
        self._store.commit(writer, lease_key, token, position, txn, gap)


def test_a_transaction_that_keeps_losing_races_commits_in_smaller_ones(
        table: LeaseTable, store: StateStore) -> None:
    """Fails on the code before (the whole batch was applied again eleven times, then failed):
    halving after each conflict commits every record once, checkpoints in order."""
    shard = Shard(table, "s1", "A", Clock())
    hot = HotKeys(store, fits=3)
    metrics = Metrics()
    adapter = ExactlyOnceProcessor(Counter(), hot, metrics=metrics, sleep=lambda _: None)
    adapter.initialize(InitializeInput("s1", "TRIM_HORIZON", 0))
    shard.deliver(adapter, [rec(100 + i, f"k{i}:{i}") for i in range(40)])
    state = stored_state(store)
    assert all((state[f"count/k{i}"], state[f"sum/k{i}"]) == (1, i) for i in range(40))
    assert hot.refused > 0
    commits = metrics.registry.get_sample_value("kclpy_state_commits_total", {"shard_id": "s1"})
    assert commits is not None and commits >= 40 / 3
    lease = table.get("s1")
    assert lease is not None and lease.checkpoint.sequence_number == "139"


def test_a_transaction_refused_every_time_still_fails_its_batch(
        table: LeaseTable, store: StateStore) -> None:
    """Halving ends at one record: a writer that wins every race fails the batch (delivered
    again by the consumer) after MAX_CONFLICTS + 1 attempts in a row, nothing applied."""
    shard = Shard(table, "s1", "A", Clock())
    hot = HotKeys(store, fits=0)
    adapter = ExactlyOnceProcessor(Counter(), hot, sleep=lambda _: None)
    adapter.initialize(InitializeInput("s1", "TRIM_HORIZON", 0))
    with pytest.raises(TransactionRejected):
        shard.deliver(adapter, [rec(100 + i, f"k{i}:{i}") for i in range(8)])
    assert hot.refused == MAX_CONFLICTS + 1
    assert stored_state(store) == {}


# -- a real worker over HTTP -------------------------------------------------------------------

class PlainCounter(kclpy.RecordProcessor):
    """The at-least-once way: an UpdateItem per record, a checkpoint per batch."""

    def __init__(self, dynamodb: Any, table: str, crash: threading.Event) -> None:
        self.dynamodb, self.table, self.crash = dynamodb, table, crash

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        pass

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for i, record in enumerate(process_records_input.records):
            key = record.binary_data.decode().split(":")[0]
            self.dynamodb.update_item(
                TableName=self.table, Key={"stateKey": {"S": f"count/{key}"}},
                UpdateExpression="ADD n :one", ExpressionAttributeValues={":one": {"N": "1"}})
            if i == 3 and not self.crash.is_set():
                self.crash.set()
                raise RuntimeError("crash before the checkpoint")
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        pass


def http_config(kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, app: str, stream: str,
                **overrides: Any) -> kclpy.KCLConfig:
    """The end-to-end settings with a shorter failover, small batches (more commits) and
    the default shutdown grace."""
    return worker_config(kinesis_mock.url, moto_server.url, stream, **{
        "application_name": app, "failover_time_ms": 2000, "max_records": 25,
        "shutdown_grace_ms": 10_000, **overrides})


def http_stream(kinesis_mock: LocalEndpoint) -> tuple[str, collections.Counter[str]]:
    """A 2-shard stream of ``key:number`` records, 60 of them KPL-aggregated; the count per
    key that was written."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("eo")
    create_stream(kinesis, stream, 2)
    keys = [f"k{i % 7}" for i in range(120)]
    put_plain(kinesis, stream, [f"{k}:1".encode() for k in keys])
    put_aggregated(kinesis, stream, [f"kpl{i % 3}:2".encode() for i in range(60)], 20)
    return stream, collections.Counter(keys) + collections.Counter(
        f"kpl{i % 3}" for i in range(60))


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["dynamodb", "postgresql"])
def test_over_http_counts_are_exact_through_a_crash_and_a_zombie(
        kind: str, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        request: pytest.FixtureRequest) -> None:
    stream, expected = http_stream(kinesis_mock)
    app = unique_name("eo-app")
    prefix = app.replace("-", "_")

    def store() -> StateStore:
        if kind == "dynamodb":
            return DynamoDBStateStore(f"{app}-state")
        return SQLStateStore(request.getfixturevalue("postgres_url"), prefix=prefix)

    def counts() -> dict[str, int]:
        reader = store()
        reader.open(dynamodb_client(moto_server.url))
        return {key.split("/", 1)[1]: value for key, value in stored_state(reader).items()
                if key.startswith("count/")}

    # a crash in a batch, then the first worker frozen (a zombie) mid-stream
    first = kclpy.Worker(
        http_config(kinesis_mock, moto_server, app, stream, transaction_max_records=10),
        lambda: Counter(fail_once_at=7), state_store=store())
    with running(first):
        wait_for(lambda: first.metrics.registry.get_sample_value(
            "kclpy_state_records_total", {"shard_id": "shardId-000000000000"}), 60, "commits")
        assert first.coordinator is not None
        first.coordinator.stop(release=False)  # frozen: no renewals, leases left to expire
        second = kclpy.Worker(http_config(kinesis_mock, moto_server, app, stream), Counter,
                              state_store=store())
        with running(second):
            wait_for(lambda: counts() == dict(expected), 90, "every record counted")
    assert counts() == dict(expected)


@pytest.mark.integration
def test_over_http_the_plain_processor_counts_a_crashed_batch_twice(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """What the mode removes: the same crash, at-least-once, counts records again."""
    stream, expected = http_stream(kinesis_mock)
    dynamodb = dynamodb_client(moto_server.url)
    app = unique_name("plain-app")
    plain_table = f"{app}-plain"
    DynamoDBStateStore(plain_table, client=dynamodb)  # creates the table

    def counts() -> dict[str, int]:
        items = dynamodb.scan(TableName=plain_table, ConsistentRead=True)["Items"]
        return {item["stateKey"]["S"].split("/", 1)[1]: int(item["n"]["N"]) for item in items}

    crash = threading.Event()
    # a failover time long enough that no renewal is late: a lease lost and taken back re-reads
    # from its checkpoint, and only the crash's duplicates are counted here (2 s was lost
    # under a loaded machine and counted more)
    plain = kclpy.Worker(http_config(kinesis_mock, moto_server, app, stream,
                                     failover_time_ms=10_000),
                         lambda: PlainCounter(dynamodb, plain_table, crash))
    with running(plain):
        wait_for(lambda: sum(counts().values()) >= sum(expected.values()), 90,
                 "every record counted at least once")
    duplicates = sum(counts().values()) - sum(expected.values())
    assert duplicates == 4, counts()


# -- every key read is checked at commit, absent keys included (the simulator's hole 3) -----------

class Sweeper(StatefulProcessor):
    """Shard 1's rule: when ``k`` is absent, delete it (a no-op) and record that it was.
    ``meanwhile`` runs between the read and the commit: another shard's transaction."""

    def __init__(self, meanwhile: Callable[[], None] | None) -> None:
        self.meanwhile = meanwhile

    def apply(self, record: Record, txn: StateTransaction) -> None:
        if txn.get("k") is None:
            if self.meanwhile is not None:
                meanwhile, self.meanwhile = self.meanwhile, None
                meanwhile()
            txn.delete("k")
            txn.put("m", "k was absent")


class Creator(StatefulProcessor):
    """Shard 2's rule: unless ``m`` says ``k`` was found absent, create ``k``."""

    def apply(self, record: Record, txn: StateTransaction) -> None:
        if txn.get("m") is None:
            txn.put("k", 1)


def write_skew(table: LeaseTable, new_store: Callable[[], StateStore], stale_cache: bool
               ) -> dict[str, Any]:
    """Shard 1 reads ``k`` absent (from its store, or from a stale cache entry), shard 2
    creates ``k`` before shard 1 commits its delete: the final state."""
    clock = Clock()
    store_1, store_2 = new_store(), new_store()
    one, two = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    creator = ExactlyOnceProcessor(Creator(), store_2)
    creator.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    if stale_cache:
        assert store_1.read("k") == Versioned(None, 0)
        two.deliver(creator, [rec(10, "create")])
        sweeper = runner(store_1, Sweeper(None))
    else:
        sweeper = runner(store_1, Sweeper(lambda: two.deliver(creator, [rec(10, "create")])))
    one.deliver(sweeper, [rec(10, "sweep")])
    return stored_state(store_1)


#: the outcomes of the two transactions run one after the other, in either order
SERIAL_OUTCOMES = [{"m": "k was absent"}, {"k": 1}]


def over_http(endpoint: LocalEndpoint, prefix: str) -> tuple[LeaseTable, Callable[[], StateStore]]:
    """A lease table with shards s1 and s2 on kclpy.local's DynamoDB (its conditions, atomic,
    over real HTTP, not moto's in-process ones) and stores of its state table."""
    client = dynamodb_client(endpoint.url)
    lease_table = LeaseTable(client, unique_name(prefix), sleep=lambda _: None)
    lease_table.create_if_missing()
    for key in ("s1", "s2"):
        assert lease_table.create(Lease(key))
    state_table = f"{lease_table.table_name}-state"
    return lease_table, lambda: DynamoDBStateStore(state_table, client=client)


@pytest.mark.parametrize("stale_cache", [False, True], ids=["read", "stale-cache"])
def test_a_delete_of_a_key_read_as_absent_is_checked_at_commit(
        table: LeaseTable, new_store: Callable[[], StateStore], stale_cache: bool) -> None:
    assert write_skew(table, new_store, stale_cache) in SERIAL_OUTCOMES


@pytest.mark.integration
def test_over_http_a_delete_of_a_key_read_as_absent_is_checked_at_commit(
        embedded_endpoint: LocalEndpoint) -> None:
    """The same on kclpy.local's DynamoDB (conditional writes atomic) over real HTTP."""
    lease_table, new_store = over_http(embedded_endpoint, "skew")
    assert write_skew(lease_table, new_store, stale_cache=False) in SERIAL_OUTCOMES


# -- exactly-once state with lag recovery (the simulator's hole 2) --------------------------------

SHARD = "shardId-000000000000"


class Stream:
    """A one-shard stream in in-process moto, its lease held through a real fence, and the
    shard's lag recovery reading it as the worker's would."""

    def __init__(self, table: LeaseTable, checkpoint: str = "TRIM_HORIZON") -> None:
        self.kinesis = boto3.client("kinesis", region_name=REGION)
        self.kinesis.create_stream(StreamName="lagging", ShardCount=1)
        clock = kinesis_clock(self.kinesis, skew.AgedKinesisClock)
        assert isinstance(clock, skew.AgedKinesisClock)
        self.kinesis_clock = clock
        self.table = table
        assert table.create(Lease(SHARD, checkpoint=Position(checkpoint)))
        self.metrics = Metrics()

    def put(self, payloads: list[str]) -> list[str]:
        return [self.kinesis.put_record(StreamName="lagging", Data=p.encode(),
                                        PartitionKey="pk")["SequenceNumber"]
                for p in payloads]

    def reader(self, start: Position, until_ms: int | None, pacer: Pacer | None,
               max_records: int | None) -> ShardPipeline:
        source = PollingSource(self.kinesis, ShardAddress(SHARD, stream_name="lagging"),
                               max_records=max_records or 7, idle_time_s=0, pacer=pacer,
                               until_ms=until_ms, metrics=self.metrics)
        return ShardPipeline(source, start, metrics=self.metrics)

    def take(self, worker: str, clock: Clock, store: StateStore | None = None, *,
             max_lag_ms: int | None = 1000) -> tuple[Shard, ShardRecovery]:
        """A tenure: the lease taken, and its recovery as the consumer makes it (with the
        worker's state store, when given, as the composition passes it)."""
        shard = Shard(self.table, SHARD, worker, clock)
        lease = self.table.get(SHARD)
        assert lease is not None
        hour_later = time.time() + 3600
        # An hour later for Kinesis too (an emulator cannot age records): a gap's reader
        # ends at the tip only once Kinesis' time is past the gap's end.
        self.kinesis_clock.move_to(hour_later)
        return shard, ShardRecovery(
            lease, token=shard.checkpointer._token, fence=shard.fence,
            reader_factory=self.reader, rate=RecoveryRate(100_000), max_lag_ms=max_lag_ms,
            metrics=self.metrics, wall_clock=lambda: hour_later, store=store)

    def lease(self) -> Lease:
        lease = self.table.get(SHARD)
        assert lease is not None
        return lease


def recover(recovery: ShardRecovery, processor: ExactlyOnceProcessor, *,
            batches: int | None = None) -> None:
    """Deliver recovery batches as the consumer's delivery thread does (all of them, or
    ``batches``), each with its gap's checkpointer."""
    delivered = 0

    def step() -> bool:
        nonlocal delivered
        batch = recovery.poll()
        if batch is not None:
            result, checkpointer = batch
            checkpointer.mark_delivered(result.records[-1])
            processor.process_records(ProcessRecordsInput(
                SHARD, result.records, checkpointer, None, is_recovery=True))
            delivered += 1
        return not recovery.active or (batches is not None and delivered >= batches)

    wait_for(step, 30, "recovery batches delivered", interval=0)


def counts(store: StateStore) -> dict[str, int]:
    return {key: value for key, value in stored_state(store).items() if key.startswith("count/")}


def test_every_record_of_a_gap_is_applied_once_beside_the_live_position(
        table: LeaseTable, store: StateStore) -> None:
    stream = Stream(table)
    last = int(stream.put([f"old{i % 3}:1" for i in range(30)])[-1])
    shard, recovery = stream.take("A", Clock())
    assert recovery.begin(Position.trim_horizon()) is not None  # the gap: all 30 records
    processor = runner(store, start=shard.start)
    live = [str(last + 1000), str(last + 2000)]  # what live reading delivers after the gap
    shard.deliver(processor, [Record(live[0], "pk", None, 0, b"new:1"),
                              Record(live[1], "pk", None, 0, b"new:1")])
    recover(recovery, processor)
    assert counts(store) == {"count/old0": 10, "count/old1": 10, "count/old2": 10,
                             "count/new": 2}
    lease = stream.lease()
    assert lease.recovery is None, "the gap, checkpointed through its end, is removed"
    assert lease.checkpoint == Position(live[1]), (
        "a gap's commits never move the live checkpoint")
    if isinstance(store, SQLStateStore):
        assert store.begin_tenure(shard.fence, SHARD, shard.checkpointer._token) == Position(
            live[1]), "nor the store's live position"


def test_a_gap_finished_before_any_live_record_is_not_found_again_by_the_next_owner(
        table: LeaseTable, store: StateStore) -> None:
    """Found by the chaos variant: the live reader had nothing to commit (the producer was
    idle), so the live checkpoint still named the finished gap's start, and the next owner
    found the same gap again and applied it twice. Finishing the gap moves such a live
    checkpoint to the gap's last record: everything up to there is processed."""
    stream = Stream(table)
    last = stream.put([f"old{i % 3}:1" for i in range(30)])[-1]
    clock = Clock()
    first, recovery = stream.take("A", clock)
    assert recovery.begin(Position.trim_horizon()) is not None
    recover(recovery, runner(store, start=first.start))
    recovery.stop()
    lease = stream.lease()
    assert (lease.checkpoint.sequence_number, lease.recovery) == (last, None)
    second, recovery = stream.take("B", clock)
    assert recovery.begin(Position.of(*second.start)) is None, "no gap left to find"
    assert counts(store) == {"count/old0": 10, "count/old1": 10, "count/old2": 10}


def lease_table_throttled(*args: Any) -> None:
    raise ThrottlingException("the lease table is throttled")


def test_a_gap_found_by_the_next_owner_starts_after_what_the_sql_store_committed_live(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore]) -> None:
    """Found by the chaos variant on PostgreSQL: a live commit landed in the store and its
    lease write did not (the lease was taken meanwhile). The next owner, behind, must queue
    its gap after the store's live position, not the lease's older one: the records in
    between were applied live, and a gap has no way to skip them."""
    stream = Stream(table)
    sequence = stream.put([f"old{i % 3}:1" for i in range(30)])
    clock = Clock()
    first, _ = stream.take("A", clock)
    first.fence.update_checkpoint = lease_table_throttled  # type: ignore[method-assign, assignment]
    records = [Record(seq, "pk", None, 0, f"old{i % 3}:1".encode())
               for i, seq in enumerate(sequence[:12])]
    first.deliver(runner(new_sql_store(), start=first.start), records)
    assert stream.lease().checkpoint == Position.trim_horizon()
    second, _ = stream.take("B", clock)
    store = new_sql_store()
    stream.kinesis_clock.move_to(time.time() + 3600)
    recovery = ShardRecovery(
        Lease(SHARD), token=second.checkpointer._token, fence=second.fence,
        reader_factory=stream.reader, rate=RecoveryRate(100_000), max_lag_ms=1000,
        metrics=stream.metrics, wall_clock=lambda: time.time() + 3600,
        store=store)
    assert recovery.begin(Position.of(*second.start)) is not None
    recover(recovery, runner(store, start=second.start))
    assert counts(store) == {"count/old0": 10, "count/old1": 10, "count/old2": 10}


def test_a_closed_shards_gap_is_applied_and_the_lease_finished(
        table: LeaseTable, store: StateStore) -> None:
    stream = Stream(table)
    stream.put([f"old{i % 3}:1" for i in range(30)])
    first, queueing = stream.take("A", Clock())
    assert queueing.begin(Position.trim_horizon()) is not None
    queueing.stop()
    first.fence.update_checkpoint(SHARD, first.checkpointer._token, Position.shard_end())
    shard, recovery = stream.take("B", Clock())  # a closed lease is taken for its gap
    assert shard.start == ("SHARD_END", 0)
    recover(recovery, runner(store, start=shard.start))
    assert counts(store) == {"count/old0": 10, "count/old1": 10, "count/old2": 10}
    assert stream.lease().is_finished


def test_a_gap_being_recovered_when_the_lease_table_is_reset_is_lost_by_no_store(
        table: LeaseTable, store: StateStore) -> None:
    """Simulator seed 186: the lease item, and the gap queue in it, deleted while a gap was
    half recovered and live reading had committed past it; the lease created again at
    TRIM_HORIZON. The SQL store resumes live from its own position and queues the gap again
    from its own progress: every record applied once. The DynamoDB store's positions went
    with the lease item: the shard is read again from TRIM_HORIZON, nothing lost, and the
    records applied before the reset are applied again (docs/reliability.md)."""
    stream = Stream(table)
    table.delete(stream.lease())
    assert table.create(Lease(SHARD, incarnation=new_incarnation(100, now=1000.0)))
    last = int(stream.put([f"old{i}:1" for i in range(30)])[-1])
    clock = Clock()
    first, recovery = stream.take("A", clock, store)
    assert recovery.begin(Position.trim_horizon()) is not None  # the gap: all 30 records
    processor = ExactlyOnceProcessor(Counter(), store)
    processor.initialize(InitializeInput(SHARD, "TRIM_HORIZON", 0))
    live = [str(last + 1000), str(last + 2000)]  # what live reading delivers after the gap
    first.deliver(processor, [Record(live[0], "pk", None, 0, b"new:1"),
                              Record(live[1], "pk", None, 0, b"new:1")])
    recover(recovery, processor, batches=2)  # 14 of the gap's 30 records
    recovery.stop()

    assert table.delete(stream.lease())  # the reset, and shard sync creating it again
    assert table.create(Lease(SHARD, incarnation=new_incarnation(100, now=2000.0)))
    second, recovery = stream.take("B", clock, store)
    recovery.begin(Position.trim_horizon())
    processor = ExactlyOnceProcessor(Counter(), store)
    processor.initialize(InitializeInput(SHARD, "TRIM_HORIZON", 0))
    recover(recovery, processor)

    applied = {key: value for key, value in counts(store).items() if key != "count/new"}
    twice = set() if isinstance(store, SQLStateStore) else {f"count/old{i}" for i in range(14)}
    assert applied == {f"count/old{i}": 2 if f"count/old{i}" in twice else 1
                       for i in range(30)}
    assert stream.lease().recovery is None
    if keeps_own_position(store):  # a store keeping no position has no gaps of its own
        assert store.stored_gaps(SHARD) == {}


def test_a_gap_the_sql_store_learnt_of_but_whose_queue_write_failed_is_applied_once(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore],
        caplog: pytest.LogCaptureFixture) -> None:
    """The store learns of a gap before the queue holding it is written: a worker that dies
    between the two leaves a row whose gap was never queued. The next tenure queues it
    again and its live reading starts after it, not inside it: every record once."""
    stream = Stream(table)
    stream.put([f"old{i}:1" for i in range(30)])
    clock = Clock()
    first, recovery = stream.take("A", clock, new_sql_store())
    fence_write = first.fence.write

    def dies_before_queueing(key: str, token: str | None, write: Callable[[Lease], Lease], *,
                             what: str, transaction: bool = False) -> Lease:
        if what == "recovery checkpoint":
            raise ThrottlingException("the worker died before this write")
        return fence_write(key, token, write, what=what, transaction=transaction)

    first.fence.write = dies_before_queueing  # type: ignore[method-assign, assignment]
    with pytest.raises(ThrottlingException):
        recovery.begin(Position.trim_horizon())
    assert stream.lease().recovery is None
    store = new_sql_store()
    [remembered] = store.stored_gaps(SHARD).values()
    assert remembered is not None

    second, recovery = stream.take("B", clock, store)
    with caplog.at_level("WARNING"):
        live_start = recovery.begin(Position.trim_horizon())
    assert "queued again" in caplog.text
    [queued] = gaps.loads(stream.lease().recovery)
    assert queued.start == TRIM_HORIZON and queued.end_ms >= remembered.end_ms
    assert live_start is not None and live_start.timestamp() * 1000 >= queued.end_ms
    processor = ExactlyOnceProcessor(Counter(), store)
    processor.initialize(InitializeInput(SHARD, "TRIM_HORIZON", 0))
    recover(recovery, processor)
    assert counts(store) == {f"count/old{i}": 1 for i in range(30)}


def test_a_gap_half_recovered_by_a_failed_worker_is_finished_once_by_the_next(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    stream = Stream(table)
    stream.put([f"old{i % 3}:1" for i in range(30)])
    clock = Clock()
    first, recovery = stream.take("A", clock)
    assert recovery.begin(Position.trim_horizon()) is not None
    lease_update = first.fence.update

    def throttled(key: str, token: str | None, changes: UpdateBuilder, *, what: str) -> Lease:
        if what == "recovery checkpoint":
            raise ThrottlingException("the lease table is throttled")
        return lease_update(key, token, changes, what=what)

    # On the SQL store the gap's commits land and the lease item's copy of its progress
    # does not: the next owner reads the gap again from the lease's older checkpoint.
    first.fence.update = throttled  # type: ignore[method-assign, assignment]
    recover(recovery, runner(new_store(), start=first.start), batches=2)
    recovery.stop()
    second, recovery = stream.take("B", clock)
    store = new_store()
    recover(recovery, runner(store, start=second.start))
    assert counts(store) == {"count/old0": 10, "count/old1": 10, "count/old2": 10}
    assert stream.lease().recovery is None


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["dynamodb", "postgresql"])
def test_over_http_a_lagging_shards_gap_and_live_records_are_each_applied_once(
        kind: str, kinesis_mock: LocalEndpoint, embedded_endpoint: LocalEndpoint,
        request: pytest.FixtureRequest) -> None:
    """A worker with both options over real HTTP (kinesis-mock, kclpy.local's DynamoDB):
    the backlog older than max_lag_ms is recovered as a gap while live records flow, and
    the state counts every record once."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("eo-lag")
    create_stream(kinesis, stream, 1)
    backlog = [f"old{i % 5}:1" for i in range(200)]
    put_plain(kinesis, stream, [p.encode() for p in backlog])
    max_lag_ms = 1500
    written = time.time()
    wait_for(lambda: time.time() > written + max_lag_ms / 1000, 30, "the backlog to age",
             interval=0.1)
    app = unique_name("eo-lag-app")
    store: StateStore = (DynamoDBStateStore(f"{app}-state") if kind == "dynamodb" else
                         SQLStateStore(request.getfixturevalue("postgres_url"),
                                       prefix=app.replace("-", "_")))
    config = http_config(kinesis_mock, embedded_endpoint, app, stream, max_lag_ms=max_lag_ms,
                         recovery_max_rate=400)
    worker = kclpy.Worker(config, Counter, state_store=store)
    live = [f"new{i % 3}:1" for i in range(30)]
    expected = collections.Counter(p.split(":")[0] for p in backlog + live)
    dynamodb = dynamodb_client(embedded_endpoint.url)

    def lease() -> dict[str, Any]:
        return dynamodb.get_item(TableName=config.lease_table_name, ConsistentRead=True,
                                 Key={"leaseKey": {"S": SHARD}}).get("Item", {})

    with running(worker):
        assert worker.wait_started(60)
        wait_for(lambda: "kclpyRecovery" in lease(), 60, "the gap queued")
        put_plain(kinesis, stream, [p.encode() for p in live])
        wait_for(lambda: {k.split("/")[1]: v for k, v in counts(store).items()}
                 == dict(expected), 120, "every record applied")
        wait_for(lambda: "kclpyRecovery" not in lease(), 30, "the finished gap removed")
    assert {k.split("/")[1]: v for k, v in counts(store).items()} == dict(expected)
    assert int(lease()["checkpoint"]["S"]) > 0, "the live checkpoint is a live record's"


# -- a lease created with the stream's incarnation (the simulator's hole 4) -----------------------


def test_leases_are_created_with_an_incarnation_naming_the_streams_epoch(
        table: LeaseTable) -> None:
    kinesis = boto3.client("kinesis", region_name=REGION)
    kinesis.create_stream(StreamName="born", ShardCount=1)
    ShardSyncer(kinesis, table, SyncedStream("born", epoch=1_700_000_000),
                initial_position="TRIM_HORIZON").sync()
    lease = table.get(SHARD)
    assert lease is not None and lease.incarnation is not None
    assert incarnation_epoch(lease.incarnation) == 1_700_000_000
    item = table.client.get_item(TableName=table.table_name, Key={"leaseKey": {"S": SHARD}})
    assert item["Item"]["kclpyIncarnation"]["S"] == lease.incarnation


# -- incarnations stamped by skewed clocks (simulator seed 139) -------------------------------


def live_again(table: LeaseTable, store: StateStore, worker: str, clock: Clock,
               created_at: float, records: list[Record]) -> Shard:
    """s1's lease deleted and created again by a worker whose clock reads ``created_at``,
    taken by ``worker`` and its shard read from its start through ``records``."""
    lease = table.get("s1")
    assert lease is not None and table.delete(lease)
    assert table.create(Lease("s1", incarnation=new_incarnation(100, now=created_at)))
    shard = Shard(table, "s1", worker, clock)
    shard.deliver(runner(store, start=shard.start), records)
    return shard


def test_a_lease_created_again_by_a_worker_whose_clock_is_behind_is_not_refused(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    """Each incarnation of s1 is stamped by its creator's clock, and the last creator's is
    behind the one before: its holder still commits (each record once), and the previous
    incarnation's holder, whose stamp sorts as newer, is refused."""
    clock = Clock()
    first = Shard(table, "s1", "A", clock)
    first.deliver(runner(new_store(), start=first.start), [rec(10, "k:1")])
    ahead = live_again(table, new_store(), "B", clock, 2000.0, [rec(10, "k:1"), rec(11, "k:1")])
    store = new_store()
    live_again(table, store, "C", clock, 1500.0,
               [rec(10, "k:1"), rec(11, "k:1"), rec(12, "k:1")])
    lease = table.get("s1")
    assert lease is not None and (lease.lease_owner, lease.checkpoint) == ("C", Position("12"))
    with pytest.raises(ShutdownException):  # the deleted incarnation's holder, as a new tenure
        ahead.deliver(runner(new_store(), start=ahead.start), [rec(12, "k:1"), rec(13, "k:1")])
    counted = 3 if isinstance(store, SQLStateStore) else 6  # SQL: the store's position
    assert stored_state(store) == {"count/k": counted, "sum/k": counted}


# -- a key deleted and created again is not its former life (review: lost update) -------------


def test_a_key_deleted_and_created_again_does_not_pass_a_stale_cache_of_its_former_life(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    """Worker A commits ``k=1`` (version 1); worker B, on another shard, deletes ``k`` and
    creates ``k=100`` - version 1 again; A adds 1 to its cached 1. Serially that is 101: A's
    commit must be refused, its record applied again to 100, never ``k=2``."""
    lost_update(table, new_store)


@pytest.mark.integration
def test_over_http_a_key_created_again_does_not_pass_a_stale_cache_of_its_former_life(
        embedded_endpoint: LocalEndpoint) -> None:
    """The same on kclpy.local's DynamoDB over real HTTP (its conditions, not moto's)."""
    lease_table, new_store = over_http(embedded_endpoint, "aba")
    lost_update(lease_table, new_store)


def lost_update(table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    """The interleaving of the test above, asserted."""
    clock = Clock()
    store_a, store_b = new_store(), new_store()  # two workers' caches
    a, b = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    run_a = runner(store_a, Ops())
    run_b = ExactlyOnceProcessor(Ops(), store_b)
    run_b.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    a.deliver(run_a, [rec(10, "add:1")])
    assert store_a.read("k").version == 1
    b.deliver(run_b, [rec(10, "del")])  # two commits: the delete, then the new key
    b.deliver(run_b, [rec(11, "set:100")])
    assert store_b.read("k").version == 1, "the new key's version starts over"
    a.deliver(run_a, [rec(11, "add:1")])
    assert stored_state(store_a) == {"k": 101}
    assert store_a.read("k") == new_store().read("k"), "A's cache holds what is stored"


def test_a_delete_on_a_stale_cache_of_a_key_created_again_is_refused(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    """The same for a delete: A deletes ``k`` when it is 1, and must not take its cached
    version 1 of the former key for the key B created again as 100."""
    clock = Clock()
    store_a, store_b = new_store(), new_store()
    a, b = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    run_a = runner(store_a, Ops())
    run_b = ExactlyOnceProcessor(Ops(), store_b)
    run_b.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    a.deliver(run_a, [rec(10, "set:1")])
    b.deliver(run_b, [rec(10, "del")])
    b.deliver(run_b, [rec(11, "set:100")])
    a.deliver(run_a, [rec(11, "del-if:1")])
    assert stored_state(store_a) == {"k": 100}


# -- a key only read is checked at commit (review: write skew through a read-only key) -------


class OnCall(StatefulProcessor):
    """While ``watched`` is 0 or absent, set ``mine`` to 1: two shards guard each other's
    key, so at most one of the two may ever be 1. ``meanwhile`` runs between the read and
    the commit."""

    def __init__(self, watched: str, mine: str, meanwhile: Callable[[], None] | None = None
                 ) -> None:
        self.watched, self.mine, self.meanwhile = watched, mine, meanwhile

    def apply(self, record: Record, txn: StateTransaction) -> None:
        if record.binary_data == b"seed":
            txn.put("x", 0)
            txn.put("y", 0)
            return
        watched = txn.get(self.watched)
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        if watched in (0, None):
            txn.put(self.mine, 1)


@pytest.mark.parametrize("seeded", [True, False], ids=["present", "absent"])
@pytest.mark.parametrize("stale_cache", [False, True], ids=["read", "stale-cache"])
def test_a_key_only_read_and_changed_by_another_shard_refuses_the_commit(
        table: LeaseTable, new_store: Callable[[], StateStore], stale_cache: bool,
        seeded: bool) -> None:
    """Shard 1 reads ``x`` (never writes it) and sets ``y``; shard 2 reads ``y`` and sets
    ``x``, committing in between. Serially one of the two finds the other's 1; without a
    check of the key only read both write 1 (write skew). ``absent``: ``x`` and ``y`` were
    never written, so the key only read is checked for staying absent (a mutant that
    skipped that check alone passed every other state test)."""
    only_read_skew(table, new_store, stale_cache, seeded)


@pytest.mark.integration
@pytest.mark.parametrize("seeded", [True, False], ids=["present", "absent"])
def test_over_http_a_key_only_read_and_changed_by_another_shard_refuses_the_commit(
        embedded_endpoint: LocalEndpoint, seeded: bool) -> None:
    """The same on kclpy.local's DynamoDB over real HTTP (its ``ConditionCheck``, not
    moto's)."""
    lease_table, new_store = over_http(embedded_endpoint, "oncall")
    only_read_skew(lease_table, new_store, stale_cache=False, seeded=seeded)


def only_read_skew(table: LeaseTable, new_store: Callable[[], StateStore], stale_cache: bool,
                   seeded: bool) -> None:
    """The interleaving of the tests above, asserted."""
    clock = Clock()
    store_1, store_2 = new_store(), new_store()
    one, two = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    other = ExactlyOnceProcessor(OnCall("y", "x"), store_2)
    other.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    guard = OnCall("x", "y")
    run_1 = runner(store_1, guard)
    if seeded:
        one.deliver(run_1, [rec(10, "seed")])
    start = 0 if seeded else None
    assert (store_1.read("x").value, store_2.read("y").value) == (start, start)
    if stale_cache:
        two.deliver(other, [rec(10, "guard")])  # store_1 still caches x as it was
    else:
        guard.meanwhile = lambda: two.deliver(other, [rec(10, "guard")])
    one.deliver(run_1, [rec(11, "guard")])
    serial = ([{"x": 1, "y": 0}, {"x": 0, "y": 1}] if seeded else [{"x": 1}, {"y": 1}])
    assert stored_state(store_1) in serial


def test_a_key_written_before_keys_had_an_incarnation_is_read_updated_and_checked(
        table: LeaseTable, new_store: Callable[[], StateStore]) -> None:
    """Stored data of an earlier kclpy (no incarnation) stays readable and updatable in
    place, and its missing incarnation is checked like any other: the key deleted and
    created again by this version is another life."""
    clock = Clock()
    store_a, store_b = new_store(), new_store()
    legacy_put(store_a, "k", 7, 1)
    assert store_a.read("k") == Versioned(7, 1)
    a, b = Shard(table, "s1", "A", clock), Shard(table, "s2", "B", clock)
    run_a = runner(store_a, Ops())
    run_b = ExactlyOnceProcessor(Ops(), store_b)
    run_b.initialize(InitializeInput("s2", "TRIM_HORIZON", 0))
    a.deliver(run_a, [rec(10, "add:1")])
    assert new_store().read("k") == Versioned(8, 2)
    legacy_put(store_a, "k", 1, 1)  # another legacy life at version 1, cached by A
    store_a.forget(["k"])
    assert store_a.read("k") == Versioned(1, 1)
    b.deliver(run_b, [rec(10, "del")])
    b.deliver(run_b, [rec(11, "set:100")])
    a.deliver(run_a, [rec(11, "add:1")])
    assert stored_state(store_a) == {"k": 101}


def legacy_put(store: StateStore, key: str, value: Any, version: int) -> None:
    """``key`` stored as kclpy stored it before keys had an incarnation."""
    if isinstance(store, SQLStateStore):
        with store.engine.begin() as conn:
            conn.execute(sa.delete(store.state).where(store.state.c.state_key == key))
            conn.execute(sa.insert(store.state).values(
                state_key=key, state_value=json.dumps(value), version=version))
        return
    if isinstance(store, toy_extensions().DictStateStore):
        store.table[key] = Versioned(value, version)
        return
    assert isinstance(store, DynamoDBStateStore)
    store.table.client.put_item(TableName=store.table_name, Item={
        "stateKey": {"S": key}, "stateValue": {"S": json.dumps(value)},
        "stateVersion": {"N": str(version)}})


# -- a commit whose answer was lost -----------------------------------------------------------


def checkpoints_after_writes(client: Any, table: LeaseTable, lease_key: str) -> list[Position]:
    """The lease's checkpoint as read after each TransactWriteItems and UpdateItem the
    client makes, growing as they are made: how a test sees a checkpoint move back."""
    checkpoints: list[Position] = []

    def seen(**_: Any) -> None:
        lease = table.get(lease_key)
        assert lease is not None
        checkpoints.append(lease.checkpoint)

    client.meta.events.register("after-call.dynamodb.TransactWriteItems", seen)
    client.meta.events.register("after-call.dynamodb.UpdateItem", seen)
    return checkpoints


@pytest.mark.integration
def test_over_http_a_commit_whose_answers_were_lost_is_not_applied_again(
        embedded_endpoint: LocalEndpoint) -> None:
    """A commit lands and the answer of every botocore attempt is lost (kclpy.local's
    DynamoDB behind the fault proxy): the batch fails and is delivered again to the same
    processor, whose cache and committed position never saw the commit land. It reads back
    what the store holds and applies nothing twice; the lease's checkpoint never moves
    back. Before, the retry's commit was repeated over the landed one, refused by its own
    state writes, and half the batch applied again to the state that held it (count 8,
    checkpoint 4 -> 2 -> 4)."""
    with FaultProxy(embedded_endpoint.url, seed=5) as proxy:
        client = dynamodb_client(proxy.url)
        lease_table = LeaseTable(client, unique_name("lost"), max_attempts=3,
                                 sleep=lambda _: None)
        lease_table.create_if_missing()
        assert lease_table.create(Lease("s1"))
        store = DynamoDBStateStore(f"{lease_table.table_name}-state", client=client)
        checkpoints = checkpoints_after_writes(client, lease_table, "s1")
        shard = Shard(lease_table, "s1", "A", Clock())
        processor = runner(store)
        batch = [rec(seq, "a:1") for seq in range(1, 5)]
        for _ in range(3):
            proxy.once("TransactWriteItems", "lose_response")
        with pytest.raises(kclpy.KinesisClientLibDependencyException):
            shard.deliver(processor, batch)
        shard.deliver(processor, batch)
        shard.deliver(processor, [rec(5, "a:1")])
        assert proxy.faults("lose_response") == 3
        assert stored_state(store) == {"count/a": 5, "sum/a": 5}
    assert checkpoints == sorted(checkpoints), f"moved back: {checkpoints}"
    assert checkpoints[-1] == Position("5")


@pytest.mark.integration
@pytest.mark.parametrize("lagging", [False, True], ids=["live", "gap"])
def test_over_http_a_workers_commit_whose_answers_were_lost_is_applied_once(
        lagging: bool, kinesis_mock: LocalEndpoint, embedded_endpoint: LocalEndpoint) -> None:
    """The same through a whole Worker, its DynamoDB behind the fault proxy: the first
    commit - of live records, or of a lagging shard's gap - lands and every answer to it is
    lost; the consumer delivers the batch again and the state counts each record once."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("eo-lost")
    create_stream(kinesis, stream, 1)
    payloads = [b"a:1"] * 20
    put_plain(kinesis, stream, payloads)
    max_lag_ms = 1500
    if lagging:
        written = time.time()
        wait_for(lambda: time.time() > written + max_lag_ms / 1000, 30, "the records to age",
                 interval=0.1)
    app = unique_name("eo-lost-app")
    with FaultProxy(embedded_endpoint.url, seed=5) as proxy:
        for _ in range(3):
            proxy.once("TransactWriteItems", "lose_response")
        config = http_config(kinesis_mock, embedded_endpoint, app, stream,
                             dynamodb_endpoint=proxy.url, state_store=f"{app}-state",
                             **({"max_lag_ms": max_lag_ms} if lagging else {}))
        worker = kclpy.Worker(config, Counter)
        store = DynamoDBStateStore(f"{app}-state", client=dynamodb_client(embedded_endpoint.url))
        dynamodb = dynamodb_client(embedded_endpoint.url)

        def lease() -> dict[str, Any]:
            return dynamodb.get_item(TableName=config.lease_table_name, ConsistentRead=True,
                                     Key={"leaseKey": {"S": SHARD}}).get("Item", {})

        with running(worker):
            wait_for(lambda: proxy.faults("lose_response") == 3, 60, "the answers lost")
            # a live record after them: applied once the failed batch was delivered again
            put_plain(kinesis, stream, [b"b:1"])
            wait_for(lambda: stored_state(store).get("count/b") == 1, 60,
                     "the later record applied")
            wait_for(lambda: "kclpyRecovery" not in lease(), 60, "no gap left")
    assert stored_state(store) == {"count/a": 20, "sum/a": 20, "count/b": 1, "sum/b": 1}


def restarted_before_its_commit_landed(
        table: LeaseTable, dynamodb: Any
) -> tuple[DynamoDBStateStore, Shard, ExactlyOnceProcessor, list[Position]]:
    """A processor whose commit of records 1-3 went out and whose answer was lost, replaced
    in the same tenure (``ProcessorRestartRequired``) by a successor made from the lease's
    checkpoint, which does not show the commit yet; then the commit lands. The store, the
    shard, the successor (a commit per record) and the lease's checkpoints from then on."""
    store = DynamoDBStateStore("state", client=dynamodb)
    shard = Shard(table, "s1", "A", Clock())
    first = runner(store)
    real = dynamodb.transact_write_items
    on_its_way: list[dict[str, Any]] = []

    def answer_lost(**kwargs: Any) -> Any:
        if not on_its_way:
            on_its_way.append(kwargs)  # sent; it lands when the test says so
            raise ReadTimeoutError(endpoint_url="dynamodb")
        return real(**kwargs)

    dynamodb.transact_write_items = answer_lost
    with pytest.raises(kclpy.KinesisClientLibDependencyException):
        shard.deliver(first, [rec(1, "a:1"), rec(2, "a:1"), rec(3, "a:1")])
    # the consumer's restart: the old checkpointer retired, the successor made from the
    # lease's checkpoint as it reads it now
    last = shard.checkpointer.retire("the processor was restarted")
    durable = table.get("s1")
    assert durable is not None and durable.checkpoint == Position.trim_horizon()
    shard.checkpointer = Checkpointer("s1", shard.fence, shard.checkpointer._token,
                                      max(durable.checkpoint, last))
    successor = runner(store, max_records=1)
    real(**on_its_way[0])  # the first processor's commit lands
    return store, shard, successor, checkpoints_after_writes(dynamodb, table, "s1")


def test_a_commit_landing_after_its_processor_was_restarted_is_not_applied_again(
        table: LeaseTable, dynamodb: Any) -> None:
    """A commit of records 1-3 is on its way when its answer is lost; the processor is then
    replaced in the same tenure (``ProcessorRestartRequired``) and its successor starts
    from the lease's checkpoint, which does not show the commit yet. The commit lands; the
    successor's first commit is refused by the fence (an earlier transaction of the tenure
    landed) although the successor never had a commit in doubt. It reads back what landed
    and applies none of those records again, and its lease checkpoint never moves back
    behind the landed one. Before, the refusal was taken for a key conflict: the records
    were applied a second time (count 7 for 4 records) and the checkpoint went 3 -> 1 -> 2;
    without the checkpointer catching up with the lease it still went 3 -> 2."""
    store, shard, successor, checkpoints = restarted_before_its_commit_landed(table, dynamodb)
    shard.deliver(successor, [rec(1, "a:1"), rec(2, "a:1")])
    shard.deliver(successor, [rec(3, "a:1"), rec(4, "a:1")])
    assert stored_state(store) == {"count/a": 4, "sum/a": 4}
    assert checkpoints == sorted(checkpoints), f"moved back: {checkpoints}"
    assert checkpoints[-1] == Position("4")


def test_a_gap_an_operator_cancelled_while_nobody_held_the_lease_stays_cancelled(
        table: LeaseTable, tmp_path: Path) -> None:
    """``kclpy recovery cancel`` of a lease nobody holds writes the queue directly; the SQL
    store still held the gap's row (it keeps every queued gap, to survive a lease-table
    reset), and the next tenure took the row for a gap a reset had lost and queued it
    again: the cancelled records were applied after all. Given the workers'
    ``--state-store``, the command parks the lease with the queue write, drops the row and
    unparks it."""
    spec = f"sqlite:///{tmp_path / 'state.db'}"

    def new_store() -> SQLStateStore:
        store = SQLStateStore(spec)
        store.open(None)
        return store

    stream = Stream(table)
    last = int(stream.put([f"old{i}:1" for i in range(30)])[-1])
    clock = Clock()
    first, recovery = stream.take("A", clock, new_store())
    assert recovery.begin(Position.trim_horizon()) is not None
    processor = runner(new_store(), start=first.start)
    live = Record(str(last + 1000), "pk", None, 0, b"new:1")  # read live after the gap
    first.deliver(processor, [live])
    recover(recovery, processor, batches=1)
    recovery.stop()
    table.evict(stream.lease())  # the worker stopped: nobody holds the lease
    (listed,) = gaps.loads(stream.lease().recovery)
    args = argparse.Namespace(
        shard_id=SHARD, gap=1, all=False, json=False, stream_name=None, stream_arn=None,
        table_name=table.table_name, application_name=None, state_store=spec,
        ends=asked.end_text(listed.end_ms, listed.last_sequence))
    assert control.recovery_cancel(args, None, table, io.StringIO()) == 0
    assert stream.lease().recovery is None
    assert stream.lease().parked is None, "unparked once the store forgot the gap"

    store = new_store()
    second, recovery = stream.take("B", clock, store)
    assert recovery.begin(Position.of(live.sequence_number, 0)) is None
    assert stream.lease().recovery is None, "the cancelled gap was queued again"
    assert store.stored_gaps(SHARD) == {}


def test_a_gap_queued_at_the_live_checkpoint_is_not_read_live_too_once_max_lag_ms_is_off(
        table: LeaseTable, store: StateStore) -> None:
    """A gap queued at the live checkpoint (live reading committed nothing after it: an idle
    stream, or a worker that died right away) is still recovered by a worker whose
    ``max_lag_ms`` is off. Its live reading must start at the gap's end as it does with the
    option on (simulator seed 292); ``begin`` returned None instead, so live reading started
    at the checkpoint and read every record of the gap as well - each applied twice under
    exactly-once, once per line."""
    stream = Stream(table)
    stream.put([f"old{i}:1" for i in range(30)])
    clock = Clock()
    first, recovery = stream.take("A", clock, store)
    assert recovery.begin(Position.trim_horizon()) is not None
    recover(recovery, runner(store, start=first.start), batches=1)
    recovery.stop()
    [queued] = gaps.loads(stream.lease().recovery)
    assert queued.started, "half recovered"

    second, recovery = stream.take("B", clock, store, max_lag_ms=None)
    live_start = recovery.begin(Position.trim_horizon())
    assert live_start is not None, "live reading from the checkpoint reads the gap again"
    assert live_start.timestamp() * 1000 == queued.end_ms


def test_a_landed_commit_found_while_the_lease_table_fails_reads_is_still_read_back(
        table: LeaseTable, dynamodb: Any) -> None:
    """As above, but the read back after the fence's refusal (``EarlierTransactionLanded``)
    fails (the lease table answers its reads with errors for a while). The refusal had
    taken the landed commit up into the held lease, so the batch's next attempt was not
    refused again, and with nothing marked in doubt it was not read back either: records
    1-3 were applied a second time over the landed ones (count 7 for 4 records). The line
    stays in doubt until a commit of it lands."""
    store, shard, successor, checkpoints = restarted_before_its_commit_landed(table, dynamodb)
    read_back = shard.fence.durable_checkpoint

    def read_fails(lease_key: str, concurrency_token: str) -> Position | None:
        raise kclpy.KinesisClientLibDependencyException(f"shard {lease_key}: read failed")

    shard.fence.durable_checkpoint = read_fails  # type: ignore[method-assign]
    with pytest.raises(kclpy.KinesisClientLibDependencyException):
        shard.deliver(successor, [rec(1, "a:1"), rec(2, "a:1")])
    shard.fence.durable_checkpoint = read_back  # type: ignore[method-assign]
    shard.deliver(successor, [rec(1, "a:1"), rec(2, "a:1")])  # the batch delivered again
    shard.deliver(successor, [rec(3, "a:1"), rec(4, "a:1")])
    assert stored_state(store) == {"count/a": 4, "sum/a": 4}
    assert checkpoints == sorted(checkpoints), f"moved back: {checkpoints}"
    assert checkpoints[-1] == Position("4")
