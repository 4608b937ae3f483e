"""The mechanisms of fleet-simulator seeds that stopped reproducing without a fix
(``tests/simulation/FOUND.md``): a seed whose history changed when the schedule did proves
nothing either way, so each mechanism is pinned here on its own.

Seed 400 (``liveness``, SQL store): the lease table was reset while the fleet ran, and
``shardId-000000000001``'s lease - created again by shard sync - reached its end and created
its merge child's lease before any sync created ``shardId-000000000000``'s again. Shard sync
counted every ancestor of a leased shard as handled (as the Java KCL does, since lease cleanup
deletes finished parents), so the records written to ``shardId-000000000000`` after the
reset were never delivered. A child's lease now vouches only for the parents its
``kclpyFinishedParents`` names (or, without that attribute, for all of them once it has
progressed: lease cleanup waits for that), and shard sync creates the others again.

Seed 186 (``liveness`` and ``exactly-once``, SQL store + lag recovery): traced on the code
before shard sync had its own thread, where it still breaks. The worker holding
``sim-other``'s ``shardId-000000000000`` had queued a gap after ``TRIM_HORIZON`` and read
live past it; the gap was recovered through record 18 when the lease table was reset. The
gap queue lives in the lease item (``kclpyRecovery``) and went with it; the lease created
again resumed, as it must, from the SQL store's live position (record 71), and nothing
queued the rest of the gap again although the store's ``_gaps`` table still held its row:
records 19 to the gap's end were never delivered. Now the SQL store records each gap, with
its end, before the queue holding it is written, and a tenure that begins queues again every
gap the store holds that its lease's queue lacks, from the store's progress to that end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from moto import mock_aws

from kclpy.leases.lease import Lease, new_incarnation
from kclpy.leases.shard_sync import Shard, ShardSyncer, SyncedStream, plan_new_leases
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.position import LATEST, TRIM_HORIZON, Position
from kclpy.processor import InitializeInput, ProcessRecordsInput
from kclpy.recovery import queue as gaps
from kclpy.recovery.queue import RecoveryRequest
from kclpy.retrieval.page import ChildShard
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.polling import Pacer, PollingSource
from kclpy.retrieval.source import ShardAddress
from kclpy.state.processor import ExactlyOnceProcessor
from kclpy.state.sql import SQLStateStore
from tests.support.determinism import Clock
from tests.support.recovery import Holder, recovery_for
from tests.support.state import Counter, stored_state
from tests.support.waiting import wait_for

MAX_HASH = str(2**128 - 1)
HALF = str(2**127)
ZERO, ONE, MERGED = "shardId-000000000000", "shardId-000000000001", "shardId-000000000002"
SHARD = ZERO


def merge() -> list[Shard]:
    """Shards 0 and 1 merged into 2; 0 and 1 closed but still listed (within retention)."""
    return [
        Shard(ZERO, None, None, "0", str(2**127 - 1), "100", "199"),
        Shard(ONE, None, None, HALF, MAX_HASH, "100", "199"),
        Shard(MERGED, ZERO, ONE, "0", MAX_HASH, "300", None),
    ]


def child(checkpoint: Position, finished: frozenset[str] = frozenset()) -> Lease:
    return Lease(MERGED, checkpoint=checkpoint, parent_shard_ids=frozenset({ZERO, ONE}),
                 finished_parents=finished)


def plan(leases: list[Lease], position: str = TRIM_HORIZON) -> list[str]:
    by_key = {lease.lease_key: lease for lease in leases}
    return [lease.lease_key for lease in plan_new_leases(merge(), set(by_key), position,
                                                         leases=by_key)]


def test_a_parent_a_lease_table_reset_deleted_is_created_again_below_a_leased_child() -> None:
    """The lease table after the reset, as seed 400 left it: shard 1 read to its end, the
    child's lease made from its ``ChildShards`` and not yet read, shard 0 without a lease."""
    after_the_reset = [Lease(ONE, checkpoint=Position.shard_end()),
                       child(Position.trim_horizon(), frozenset({ONE}))]
    assert plan(after_the_reset) == [ZERO]


def test_a_parent_missing_beside_a_child_that_started_without_it_is_created_again() -> None:
    """The child's consumer takes a parent without a lease for finished (as Java's does), so
    the child may have progressed before the sync ran: what it records still says that only
    shard 1 was read to its end, after lease cleanup deleted shard 1's lease too."""
    assert plan([child(Position("350"), frozenset({ONE}))]) == [ZERO]


def test_a_lease_without_the_record_vouches_for_its_parents_once_it_progressed() -> None:
    """A child the Java KCL (or an older kclpy) made and processed: its parents were cleaned
    up after it progressed, as Java's cleanup does, and are never read again."""
    assert plan([child(Position("350"))]) == []
    assert plan([child(Position.shard_end())]) == []


def test_an_unprogressed_child_without_the_record_still_skips_closed_roots_at_latest() -> None:
    """A parent no child vouches for is planned like any shard: at LATEST a closed root is
    not read, as a fresh application would not read it."""
    assert plan([child(Position.latest())], LATEST) == []
    assert plan([child(Position.trim_horizon())], TRIM_HORIZON) == [ZERO, ONE]


def test_only_the_lease_keys_known_keeps_the_java_rule() -> None:
    """A sync handed lease keys without the leases cannot tell, and creates nothing above a
    leased shard."""
    assert plan_new_leases(merge(), {MERGED}, TRIM_HORIZON) == []


class Listing:
    """ListShards of a fixed shard list, as AWS answers it (one page)."""

    def __init__(self, shards: list[Shard]) -> None:
        self._shards = shards

    def list_shards(self, **params: Any) -> dict[str, Any]:
        return {"Shards": [{
            "ShardId": shard.shard_id,
            **({"ParentShardId": shard.parent_shard_id} if shard.parent_shard_id else {}),
            **({"AdjacentParentShardId": shard.adjacent_parent_shard_id}
               if shard.adjacent_parent_shard_id else {}),
            "HashKeyRange": {"StartingHashKey": shard.starting_hash_key,
                             "EndingHashKey": shard.ending_hash_key},
            "SequenceNumberRange": {
                "StartingSequenceNumber": shard.starting_sequence_number,
                **({"EndingSequenceNumber": shard.ending_sequence_number}
                   if shard.ending_sequence_number else {})},
        } for shard in self._shards]}


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[LeaseTable]:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_DYNAMODB", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        leases = LeaseTable(boto3.client("dynamodb", region_name="us-east-1"), "app")
        leases.create_if_missing()
        yield leases


def test_a_reset_parent_is_read_again_and_a_finished_one_is_not(table: LeaseTable) -> None:
    """The whole path over the lease table: each parent's shard end records it in the child's
    lease (created or already there), a reset's deletion of an unfinished parent is undone by
    the next sync, and the deletion of both parents once finished is not."""
    syncer = ShardSyncer(Listing(merge()), table, SyncedStream("s"),  # type: ignore[arg-type]
                         initial_position=TRIM_HORIZON)
    assert [lease.lease_key for lease in syncer.sync()] == [ZERO, ONE, MERGED]
    reported = ChildShard(MERGED, (ZERO, ONE), "0", MAX_HASH)

    syncer.create_child_leases([reported], ONE)
    parent = table.get(ZERO)
    assert parent is not None and table.delete(parent)  # the reset, shard 0 unfinished
    assert [lease.lease_key for lease in syncer.sync()] == [ZERO]
    syncer.create_child_leases([reported], ZERO)
    merged = table.get(MERGED)
    assert merged is not None and merged.finished_parents == {ZERO, ONE}

    table.update_checkpoint(table.take(merged, "w1"), Position("350"))
    for key in (ZERO, ONE):  # lease cleanup, after the child progressed
        finished = table.get(key)
        assert finished is not None and table.delete(finished)
    assert syncer.sync() == []


class CountingTable:
    """The lease table, counting the full scans shard sync makes of it."""

    def __init__(self, table: LeaseTable) -> None:
        self._table = table
        self.scans = 0

    def list_leases(self, *args: Any, **kwargs: Any) -> list[Lease]:
        self.scans += 1
        return self._table.list_leases(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)


def test_a_sync_on_a_scan_from_before_a_reset_creates_the_parents_too(table: LeaseTable) -> None:
    """Seed 260's mechanism: a sync handed the keys of a scan made before a lease-table reset
    (with a leader only the leader syncs, on its last pass's scan, up to two failover times
    old) while two shards merged after the reset. The scan still showed both parents' leases,
    so they counted as handled and the sync created the child's lease alone: nothing read the
    parents' records after their checkpoints, and the child's consumer took the parents
    without leases for finished. A sync that would create leases reads the table first."""
    before_the_reset = [Lease(ZERO, checkpoint=Position("150")),
                        Lease(ONE, checkpoint=Position("120"))]
    counting = CountingTable(table)
    syncer = ShardSyncer(Listing(merge()), counting,  # type: ignore[arg-type]
                         SyncedStream("s"), initial_position=TRIM_HORIZON)
    created = syncer.sync({lease.lease_key for lease in before_the_reset}, before_the_reset)
    assert [lease.lease_key for lease in created] == [ZERO, ONE, MERGED]
    assert all(lease.checkpoint == Position.trim_horizon() for lease in created)
    assert counting.scans == 1
    assert syncer.sync({lease.lease_key for lease in created}, created) == []
    assert counting.scans == 1, "a sync with nothing to create trusts the scan it is handed"


def test_a_sync_that_relies_on_no_parent_trusts_the_scan_it_is_handed(table: LeaseTable) -> None:
    """Only a lease planned below a listed shard the view counts as handled depends on the
    view being current; one created with its parents (a scan showing the table empty) does
    not, and costs no scan of its own."""
    counting = CountingTable(table)
    syncer = ShardSyncer(Listing(merge()), counting,  # type: ignore[arg-type]
                         SyncedStream("s"), initial_position=TRIM_HORIZON)
    assert [lease.lease_key for lease in syncer.sync(set(), [])] == [ZERO, ONE, MERGED]
    assert counting.scans == 0


def test_a_gap_the_sql_store_holds_unfinished_is_queued_again_under_a_lease_created_again(
        table: LeaseTable, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The store as seed 186's reset left it: 30 records, the live position at record 25
    (read live past the gap), the gap after TRIM_HORIZON ending at record 19, recovered
    through record 9; the lease created again, at TRIM_HORIZON with no queue. The gap is
    queued again from the store's progress to its stored end, and records 10 to 19 - only
    they - are applied, once."""
    kinesis = boto3.client("kinesis", region_name="us-east-1")
    kinesis.create_stream(StreamName="s", ShardCount=1)
    writing_at = time.time()
    sequence = [kinesis.put_record(StreamName="s", Data=f"r{n}:1".encode(),
                                   PartitionKey="k")["SequenceNumber"] for n in range(30)]
    arrived = kinesis.get_records(ShardIterator=kinesis.get_shard_iterator(
        StreamName="s", ShardId=SHARD, ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    )["Records"][19]["ApproximateArrivalTimestamp"]
    end_ms = round(arrived.timestamp() * 1000) + 1
    queued = RecoveryRequest.gap(TRIM_HORIZON, 0, end_ms, None, sequence[0],
                                 last_sequence=sequence[19])
    store = SQLStateStore(f"sqlite:///{tmp_path / 'state.db'}")
    store.open(None)
    with store.engine.begin() as conn:
        conn.execute(sa.insert(store.checkpoints).values(
            lease_key="s1", tenure=3, checkpoint=sequence[25], sub_sequence_number=0,
            incarnation=new_incarnation(100, now=1000.0)))
        conn.execute(sa.insert(store.gaps).values(
            lease_key="s1", gap=f"{TRIM_HORIZON}/0", checkpoint=sequence[9],
            sub_sequence_number=0, gap_end=json.dumps(queued.to_json())))
    assert table.create(Lease("s1", incarnation=new_incarnation(100, now=2000.0)))
    holder = Holder(table, "B", Clock())
    token = holder.take("s1")
    metrics = Metrics()

    def reader(start: Position, until_ms: int | None, pacer: Pacer | None,
               max_records: int | None) -> ShardPipeline:
        source = PollingSource(kinesis, ShardAddress(SHARD, stream_name="s"),
                               max_records=max_records or 4, idle_time_s=0, pacer=pacer,
                               until_ms=until_ms, metrics=metrics)
        return ShardPipeline(source, start, metrics=metrics)

    # the wall clock of the writes: the records after the store's position are not behind
    recovery = recovery_for(holder, token, reader_factory=reader, store=store,
                            wall_clock=lambda: writing_at)

    with caplog.at_level("INFO"):
        assert recovery.begin(Position.trim_horizon()) is None
    assert "lease was created again" in caplog.text  # resumed from the store's record 25
    assert caplog.text.count("queued again") == 1
    lease = table.get("s1")
    assert lease is not None
    [again] = gaps.loads(lease.recovery)
    assert again == queued.checkpointed(Position(sequence[9]), None)

    processor = ExactlyOnceProcessor(Counter(), store, metrics=metrics)
    processor.initialize(InitializeInput("s1", TRIM_HORIZON, 0))

    def step() -> bool:
        batch = recovery.poll()
        if batch is not None:
            result, checkpointer = batch
            checkpointer.mark_delivered(result.records[-1])
            processor.process_records(ProcessRecordsInput(
                "s1", result.records, checkpointer, None, is_recovery=True))
        return not recovery.active

    wait_for(step, 30, "the gap queued again recovered", interval=0)
    assert stored_state(store) == {**{f"count/r{n}": 1 for n in range(10, 20)},
                                   **{f"sum/r{n}": 1 for n in range(10, 20)}}
    lease = table.get("s1")
    assert lease is not None and lease.recovery is None
    assert store.stored_gaps("s1") == {}, "a finished gap leaves the store too"
