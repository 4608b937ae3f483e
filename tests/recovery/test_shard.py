"""One shard's recovery (kclpy/recovery/shard.py): its queue kept in the lease item through
every write and fenced like the checkpoint, the gap found when the shard starts too far
behind, recovered, reported when trimmed, and left to the next owner when unfinished
(in-process moto for Kinesis and DynamoDB; one fleet killed with -9 over real HTTP)."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from moto import mock_aws

from kclpy.checkpoint import Checkpointer
from kclpy.consumer import ShardConsumer
from kclpy.errors import ProcessorRestartRequired, ShutdownException
from kclpy.leases.cleanup import deletable
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import RECOVERY, UpdateBuilder
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import TRIM_HORIZON, Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.recovery import queue as gaps
from kclpy.recovery.queue import RecoveryRequest
from kclpy.recovery.rate import RecoveryRate
from kclpy.recovery.shard import ShardRecovery
from kclpy.retrieval.clock import kinesis_clock
from kclpy.retrieval.pipeline import FetchError, ShardPipeline
from kclpy.retrieval.polling import Pacer, PollingSource
from kclpy.retrieval.source import ShardAddress
from tests.support import skew
from tests.support.determinism import Clock
from tests.support.fleet import Fleet, fleet
from tests.support.recovery import Claimed, Holder, age, gap, recovery_for
from tests.support.scripted import SETTINGS, Host, Readers, Result, ScriptedFetcher
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for

REGION = "us-east-1"


# -- the lease attribute (in-process moto) --------------------------------------------------


@pytest.fixture
def aws() -> Iterator[None]:
    with mock_aws():
        yield


@pytest.fixture
def table(aws: None) -> LeaseTable:
    table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app", max_attempts=3,
                       sleep=lambda _: None)
    table.create_if_missing()
    assert table.create(Lease("s1"))
    return table


def stored_queue(table: LeaseTable) -> tuple[RecoveryRequest, ...]:
    lease = table.get("s1")
    assert lease is not None
    return gaps.loads(lease.recovery)


def test_every_lease_write_keeps_the_queue(table: LeaseTable) -> None:
    clock = Clock()
    a, b = Holder(table, "A", clock), Holder(table, "B", clock)
    token = a.take("s1")
    queue = (gap("100", 5000, 4000),)
    recovery = recovery_for(a, token)
    with recovery._lock:
        recovery._store(lambda _: queue)
    a.fence.update_checkpoint("s1", token, Position("200"))  # checkpoint
    a.fence.update("s1", token, UpdateBuilder(), what="renewal")  # renewal
    a.fence.release("s1")  # release
    b.take("s1")  # take
    steal = Holder(table, "C", clock)
    steal.take("s1")  # steal: a take of an owned lease
    assert not table.create(Lease("s1"))  # create of an existing lease leaves it alone
    lease = table.get("s1")
    assert lease is not None and lease.lease_owner == "C" and lease.checkpoint == Position("200")
    assert gaps.loads(lease.recovery) == queue


def test_a_worker_that_lost_the_lease_cannot_write_the_queue(table: LeaseTable) -> None:
    clock = Clock()
    zombie, thief = Holder(table, "A", clock), Holder(table, "B", clock)
    token = zombie.take("s1")
    thief.take("s1")
    recovery = recovery_for(zombie, token)
    with pytest.raises(ShutdownException), recovery._lock:
        recovery._store(lambda _: (gap("100", 5000, 4000),))
    assert stored_queue(table) == ()


def test_the_new_owner_reads_the_queue_and_its_checkpoints_move_only_the_gap(
        table: LeaseTable) -> None:
    clock = Clock()
    a, b = Holder(table, "A", clock), Holder(table, "B", clock)
    token = a.take("s1")
    first = recovery_for(a, token)
    with first._lock:
        first._store(lambda _: (gap("100", 5000, 4000), gap("900", 9000, 8000)))
    token_b = b.take("s1")
    lease = b.held.get("s1")
    assert lease is not None
    second = recovery_for(b, token_b, lease.recovery)
    second.checkpoint(Position("100", 0), Position("150"))
    lease = table.get("s1")
    assert lease is not None and lease.checkpoint == Position.trim_horizon()
    assert [(r.start, r.done) for r in gaps.loads(lease.recovery)] == [("100", "150"),
                                                                        ("900", "900")]
    assert [g["checkpoint"] for g in second.status()] == ["150", "900"]


def test_a_closed_shard_with_gaps_queued_is_not_finished() -> None:
    closed = Lease("p", checkpoint=Position.shard_end(), child_shard_ids=frozenset({"c"}))
    child = Lease("c", checkpoint=Position("500"), parent_shard_ids=frozenset({"p"}))
    assert closed.is_finished and deletable([closed, child], "A") == [closed]
    pending = closed.copy(recovery=gaps.dumps((gap("100", 5000, 4000),)))
    assert not pending.is_finished and deletable([pending, child], "A") == []


# -- a shard's recovery against in-process moto (Kinesis and DynamoDB) ----------------------

@dataclass
class Shard:
    kinesis: Any
    stream: str
    table: LeaseTable
    holder: Holder
    token: str
    #: the wall clock just before the fixture's records were written: each arrived after it
    writing_at: float
    metrics: Metrics = field(default_factory=Metrics)

    def reader(self, start: Position, until_ms: int | None, pacer: Pacer | None,
               max_records: int | None) -> ShardPipeline:
        source = PollingSource(
            self.kinesis, ShardAddress("shardId-000000000000", stream_name=self.stream),
            max_records=max_records or 100, idle_time_s=0, pacer=pacer, until_ms=until_ms,
            metrics=self.metrics)
        return ShardPipeline(source, start, metrics=self.metrics)

    def recovery(self, *, wall_clock: Any = time.time, stored: str | None = None,
                 store: Claimed | None = None) -> ShardRecovery:
        """The shard's recovery at the time ``wall_clock`` tells: Kinesis' time as well as
        the local one (an emulator cannot age records, so both clocks move on instead;
        moto's own Date headers tell the real time and are not taken in)."""
        clock = kinesis_clock(self.kinesis, skew.AgedKinesisClock)
        assert isinstance(clock, skew.AgedKinesisClock)
        clock.move_to(wall_clock())
        return ShardRecovery(Lease("shardId-000000000000", recovery=stored), token=self.token,
                             fence=self.holder.fence, reader_factory=self.reader,
                             rate=RecoveryRate(10_000), max_lag_ms=1000, metrics=self.metrics,
                             wall_clock=wall_clock, kinesis_clock=clock,
                             store=store)  # type: ignore[arg-type]

    def queue(self) -> tuple[RecoveryRequest, ...]:
        lease = self.table.get("shardId-000000000000")
        assert lease is not None
        return gaps.loads(lease.recovery)


@pytest.fixture
def shard(aws: None) -> Shard:
    kinesis = boto3.client("kinesis", region_name=REGION)
    kinesis.create_stream(StreamName="s", ShardCount=1)
    writing_at = time.time()
    for n in range(30):
        kinesis.put_record(StreamName="s", Data=f"old-{n}".encode(), PartitionKey="k")
    table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app", max_attempts=3,
                       sleep=lambda _: None)
    table.create_if_missing()
    assert table.create(Lease("shardId-000000000000"))
    holder = Holder(table, "A", Clock())
    return Shard(kinesis, "s", table, holder, holder.take("shardId-000000000000"), writing_at)


def recover_all(recovery: ShardRecovery) -> list[str]:
    """Poll as the delivery thread does, checkpointing each batch; the payloads."""
    payloads: list[str] = []

    def step() -> bool:
        batch = recovery.poll()
        if batch is not None:
            result, checkpointer = batch
            checkpointer.mark_delivered(result.records[-1])  # as the consumer does
            payloads.extend(r.binary_data.decode() for r in result.records)
            checkpointer.checkpoint()
        return not recovery.active

    wait_for(step, 10, "the gap recovered")
    return payloads


def read_to_end(recovery: ShardRecovery,
                batches: list[tuple[Any, Checkpointer]] | None = None,
                ) -> list[tuple[Any, Checkpointer]]:
    """Poll until the gap's reader is done, marking each batch delivered as the consumer
    does but checkpointing nothing; the batches (appended to ``batches`` as they come)."""
    got = [] if batches is None else batches

    def step() -> bool:
        batch = recovery.poll()
        if batch is not None:
            batch[1].mark_delivered(batch[0].records[-1])
            got.append(batch)
        return not recovery.active

    wait_for(step, 10, "the gap read to its end")
    return got


def test_a_shard_behind_queues_its_gap_before_live_reading_and_recovers_it(shard: Shard) -> None:
    hour_later = time.time() + 3600
    recovery = shard.recovery(wall_clock=lambda: hour_later)
    live_from = recovery.begin(Position.trim_horizon())
    assert live_from is not None
    assert live_from.timestamp() == pytest.approx(hour_later - 1, abs=0.01)
    [queued] = shard.queue()
    assert (queued.start, queued.end_ms) == (TRIM_HORIZON, round(hour_later * 1000) - 1000)
    assert recover_all(recovery) == [f"old-{n}" for n in range(30)]
    assert shard.queue() == ()
    assert shard.metrics.registry.get_sample_value(
        "kclpy_recovery_records_total", {"shard_id": "shardId-000000000000"}) == 30
    assert shard.metrics.registry.get_sample_value("kclpy_recovery_shards") == 0


def test_live_reading_starts_after_a_queued_gap_that_ends_later_than_its_own_start(
        shard: Shard) -> None:
    """A previous holder queued the gap up to a later time than this tenure's live start (its
    clock, or Kinesis' time then, was later): live reading starts at the queued gap's end,
    not at its own, or the records in between would be both in the gap and read live -
    applied twice with exactly-once state. Fails on the code before (simulator seed 464:
    live from 09.921 s beside a queued gap up to 12.984 s)."""
    hour_later = time.time() + 3600
    earlier_holder = shard.recovery(wall_clock=lambda: hour_later + 10)
    assert earlier_holder.begin(Position.trim_horizon()) is not None
    [queued] = shard.queue()
    recovery = shard.recovery(wall_clock=lambda: hour_later, stored=gaps.dumps((queued,)))
    live_from = recovery.begin(Position.trim_horizon())
    assert live_from is not None
    assert round(live_from.timestamp() * 1000) == queued.end_ms, "live starts where the gap ends"
    assert [(q.start, q.end_ms) for q in shard.queue()] == [(TRIM_HORIZON, queued.end_ms)]
    assert recover_all(recovery) == [f"old-{n}" for n in range(30)]


def test_a_tenure_not_behind_still_starts_live_after_a_gap_queued_at_its_checkpoint(
        shard: Shard) -> None:
    """This tenure is within ``max_lag_ms`` of the records after its checkpoint, but a
    previous holder queued a gap from that checkpoint: its records are the gap's, and live
    reading starts at the gap's end. Fails on the code before (live from the checkpoint
    beside the gap: simulator seed 292, a record applied twice)."""
    hour_later = time.time() + 3600
    assert shard.recovery(wall_clock=lambda: hour_later).begin(Position.trim_horizon())
    [queued] = shard.queue()
    recovery = shard.recovery(wall_clock=lambda: shard.writing_at, stored=gaps.dumps((queued,)))
    live_from = recovery.begin(Position.trim_horizon())
    assert live_from is not None, "live reading from the checkpoint would read the gap again"
    assert round(live_from.timestamp() * 1000) == queued.end_ms
    assert recover_all(recovery) == [f"old-{n}" for n in range(30)]


def test_a_recovered_gap_is_not_logged_as_the_shard_ending(
        shard: Shard, caplog: pytest.LogCaptureFixture) -> None:
    hour_later = time.time() + 3600
    recovery = shard.recovery(wall_clock=lambda: hour_later)
    assert recovery.begin(Position.trim_horizon()) is not None
    with caplog.at_level("INFO", logger="kclpy.retrieval.polling"):
        assert len(recover_all(recovery)) == 30
    assert "the recovery gap was read to its end" in caplog.text
    assert "reached its end" not in caplog.text


def test_a_gap_after_the_state_stores_position_moves_the_live_checkpoint_past_it(
        shard: Shard) -> None:
    """A lease created again (at TRIM_HORIZON) while the SQL store kept the shard's position:
    the gap starts after the store's position, and once every record after it is processed
    the live checkpoint must not stay behind it (simulator seed 844), or the next owner would
    read the gap again."""
    iterator = shard.kinesis.get_shard_iterator(
        StreamName="s", ShardId="shardId-000000000000",
        ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    sequence = [r["SequenceNumber"] for r in
                shard.kinesis.get_records(ShardIterator=iterator)["Records"]]
    recovery = shard.recovery(wall_clock=lambda: time.time() + 3600,
                              store=Claimed(Position.of(sequence[9], 0)))
    assert recovery.begin(Position.trim_horizon()) is not None
    [queued] = shard.queue()
    assert queued.start == sequence[9]
    assert recover_all(recovery) == [f"old-{n}" for n in range(10, 30)]
    lease = shard.table.get("shardId-000000000000")
    assert lease is not None
    assert (lease.checkpoint, lease.recovery) == (Position(sequence[29]), None)


def test_a_shard_within_max_lag_reads_live_from_its_checkpoint(shard: Shard) -> None:
    # the wall clock stops where the records started to be written: the shard is within its
    # lag bound however long a loaded machine takes to write them (taking the time after
    # the writes and the lease table's creation failed at load average 26: the first record
    # was then more than max_lag_ms older) or to get here
    recovery = shard.recovery(wall_clock=lambda: shard.writing_at)
    assert recovery.begin(Position.trim_horizon()) is None
    assert shard.queue() == () and not recovery.active


def test_a_gap_not_checkpointed_to_its_end_stays_queued_for_the_next_owner(
        shard: Shard) -> None:
    recovery = shard.recovery(wall_clock=lambda: time.time() + 3600)
    recovery.begin(Position.trim_horizon())
    seen = [r.binary_data.decode() for result, _ in read_to_end(recovery)
            for r in result.records]
    assert len(seen) == 30
    [left] = shard.queue()
    assert not left.started


def test_the_shard_end_checkpoint_of_the_gaps_processor_finishes_the_gaps_it_was_handed(
        shard: Shard) -> None:
    """A finished shard's gaps' processor that checkpointed none of the gap's batches ends
    with ``shard_ended`` and a SHARD_END checkpoint through ``finisher``: the gap read to its
    end goes in one write, and the item says so (``durable_read``)."""
    recovery = shard.recovery(wall_clock=lambda: time.time() + 3600)
    recovery.begin(Position.trim_horizon())
    assert sum(len(result.records) for result, _ in read_to_end(recovery)) == 30
    assert (len(shard.queue()), recovery.read_unfinished) == (1, True)
    final = Checkpointer("shardId-000000000000", recovery.finisher(), shard.token,
                         Position.trim_horizon())
    final.mark_shard_end()
    final.checkpoint()
    assert (shard.queue(), recovery.read_unfinished) == ((), False)
    durable = recovery.finisher().durable_checkpoint("shardId-000000000000", shard.token)
    assert durable == Position.shard_end()


def test_a_gap_read_to_its_end_is_finished_by_a_later_checkpoint_through_its_end(
        shard: Shard) -> None:
    """The Spark batcher checkpoints a batch only once Spark has it, after the gap reader
    reached the gap's end: that checkpoint still finishes the gap."""
    recovery = shard.recovery(wall_clock=lambda: time.time() + 3600)
    recovery.begin(Position.trim_horizon())
    batches = read_to_end(recovery)
    assert shard.queue(), "not checkpointed yet: still queued"
    result, checkpointer = batches[-1]
    checkpointer.checkpoint(result.records[-1])
    assert shard.queue() == ()


def test_a_gap_whose_records_were_all_trimmed_is_reported(
        shard: Shard, caplog: pytest.LogCaptureFixture) -> None:
    """Retention trimmed the whole shard: nothing is left to read, and the loss is still
    reported, not closed in silence."""
    shard.kinesis.create_stream(StreamName="empty", ShardCount=1)
    empty = dataclasses.replace(shard, stream="empty")
    # (ending now: a gap reader ends at the tip once Kinesis' time is past its end)
    trimmed = RecoveryRequest.gap("0", 0, round(time.time() * 1000), 1, "5")
    recovery = empty.recovery(stored=gaps.dumps((trimmed,)))
    with caplog.at_level(logging.ERROR, logger="kclpy.recovery.shard"):
        assert recover_all(recovery) == []
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "from 5 up to its end" in error.getMessage()
    assert "keeps no record" in error.getMessage()
    assert empty.metrics.registry.get_sample_value(
        "kclpy_recovery_trimmed_total", {"shard_id": "shardId-000000000000"}) == 1


def test_a_gap_partly_past_retention_is_reported_and_the_rest_recovered(
        shard: Shard, caplog: pytest.LogCaptureFixture) -> None:
    records = shard.kinesis.get_records(ShardIterator=shard.kinesis.get_shard_iterator(
        StreamName="s", ShardId="shardId-000000000000",
        ShardIteratorType="TRIM_HORIZON")["ShardIterator"])["Records"]
    oldest = int(records[0]["SequenceNumber"])
    assert oldest > 0
    # A gap whose first record came before the oldest record the shard still keeps.
    # (ending now: a gap reader ends at the tip once Kinesis' time is past its end)
    trimmed = RecoveryRequest.gap("0", 0, round(time.time() * 1000), 1, "0")
    recovery = shard.recovery(stored=gaps.dumps((trimmed,)))
    with caplog.at_level(logging.ERROR, logger="kclpy.recovery.shard"):
        assert recover_all(recovery) == [f"old-{n}" for n in range(30)]
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "from 0 up to " + str(oldest) in error.getMessage()
    assert shard.metrics.registry.get_sample_value(
        "kclpy_recovery_trimmed_total", {"shard_id": "shardId-000000000000"}) == 1


class LeaseTableReader:
    """The consumer's leases, read from a lease table (the coordinator's ``get_lease``)."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table

    def get_lease(self, lease_key: str) -> Lease | None:
        return self.table.get(lease_key)


class Restarting(IRecordProcessor):
    """Checkpoints every batch; with ``restart_on_live``, its first live batch raises
    ``ProcessorRestartRequired`` (a MultiLang child that died) after noting the lease's
    checkpoint then."""

    def __init__(self, table: LeaseTable, *, restart_on_live: bool = False) -> None:
        self.table = table
        self.restart_on_live = restart_on_live
        self.started_after: Position | None = None
        self.records: list[tuple[bool, str]] = []
        self.durable_at_restart: Position | None = None

    def initialize(self, i: InitializeInput) -> None:
        self.started_after = Position.of(i.sequence_number, i.sub_sequence_number)

    def process_records(self, p: ProcessRecordsInput) -> None:
        if self.restart_on_live and not p.is_recovery:
            lease = self.table.get("shardId-000000000000")
            assert lease is not None
            self.durable_at_restart = lease.checkpoint
            raise ProcessorRestartRequired("child died")
        self.records.extend((p.is_recovery, r.sequence_number) for r in p.records)
        p.checkpointer.checkpoint()

    def lease_lost(self, i: LeaseLostInput) -> None:
        pass

    def shard_ended(self, i: ShardEndedInput) -> None:
        i.checkpointer.checkpoint()

    def shutdown_requested(self, i: ShutdownRequestedInput) -> None:
        pass


class LiveAfterTheGaps(ScriptedFetcher):
    """The live reader: its pages come only once no gap is being recovered, so the live
    batch that restarts the processor comes after the gap was finished."""

    def __init__(self, pages: list[Result], start_after: tuple[str, int],
                 recovering: Callable[[], bool]) -> None:
        super().__init__(pages, start_after)
        self.recovering = recovering
        self.idle = threading.Event()

    def get(self, timeout: float | None = None) -> Result | None:
        if self.recovering():
            self.idle.wait(timeout or 0)  # a live reader with nothing new yet
            return None
        return super().get(timeout)


def test_a_restart_after_a_finished_gap_resumes_from_the_durable_checkpoint(
        shard: Shard) -> None:
    """The gap's end moved the live checkpoint (live reading had committed nothing): a
    processor restarted after that (a MultiLang child that died) resumes from the lease's
    checkpoint, not from the checkpoint its predecessor's checkpointer knew (where the gap
    started), which would queue the whole gap and deliver it again."""
    key = "shardId-000000000000"
    held = shard.holder.held.entry(key)
    assert held is not None
    hour_later = time.time() + 3600
    made: list[ShardRecovery] = []

    def recovery() -> ShardRecovery:
        made.append(shard.recovery(wall_clock=lambda: hour_later))
        return made[-1]

    def recovering() -> bool:
        return bool(made) and made[0].active

    live_sequence = "9" * 60
    pages = [Result([Record(sequence_number=live_sequence, partition_key="k",
                            timestamp_millis=round(hour_later * 1000), data=b"live")]),
             Result([], shard_end=True)]
    fetchers: list[LiveAfterTheGaps] = []

    def live(start: Position) -> LiveAfterTheGaps:
        fetchers.append(LiveAfterTheGaps(
            pages, (start.checkpoint, start.sub_sequence_number), recovering))
        return fetchers[-1]

    first = Restarting(shard.table, restart_on_live=True)
    second = Restarting(shard.table)
    processors = iter([first, second])
    consumer = ShardConsumer(
        held.lease.copy(), concurrency_token=shard.token,
        processor_factory=lambda: next(processors), fence=shard.holder.fence,
        readers=Readers(live, make_recovery=recovery),
        host=Host(LeaseTableReader(shard.table)), settings=SETTINGS,
        metrics=shard.metrics, rng=random.Random(1))
    consumer.start()
    assert consumer.join(30) and consumer.error is None and consumer.shard_ended
    gap_records = [seq for is_recovery, seq in first.records if is_recovery]
    assert len(gap_records) == 30, "the first processor recovered the whole gap"
    last_of_gap = Position(gap_records[-1])
    assert first.durable_at_restart == last_of_gap, "the gap's end moved the live checkpoint"
    assert second.records == [(False, live_sequence)], \
        "nothing at or before the durable checkpoint is delivered again"
    assert second.started_after == last_of_gap
    assert shard.queue() == ()


class KeepsTheGapCheckpointer(Restarting):
    """Checkpoints each recovery batch and keeps its checkpointer (as a background thread
    would); its second recovery batch raises ``ProcessorRestartRequired``."""

    def __init__(self, table: LeaseTable) -> None:
        super().__init__(table)
        self.kept: list[Checkpointer] = []

    def process_records(self, p: ProcessRecordsInput) -> None:
        if p.is_recovery:
            self.kept.append(p.checkpointer)
            if len(self.kept) == 2:
                raise ProcessorRestartRequired("child died")
        super().process_records(p)


class CallsTheKeptOne(Restarting):
    """The successor: in ``initialize``, before any batch, it checkpoints through the gap
    checkpointer its predecessor kept (no arguments: the last record handed to it)."""

    def __init__(self, table: LeaseTable, predecessor: KeepsTheGapCheckpointer) -> None:
        super().__init__(table)
        self.predecessor = predecessor
        self.refused: list[str] = []

    def initialize(self, i: InitializeInput) -> None:
        super().initialize(i)
        try:
            self.predecessor.kept[-1].checkpoint()
        except ShutdownException as exc:
            self.refused.append(exc.name)


def test_a_gap_checkpointer_from_before_a_restart_cannot_skip_the_failed_batch(
        shard: Shard) -> None:
    """The replaced processor's gap checkpointer was handed the batch that failed: a
    checkpoint through it would move the gap's checkpoint over that batch before the gap is
    read again, and nobody would ever process those records. It is refused; the successor
    gets the gap again from its checkpoint."""
    key = "shardId-000000000000"
    held = shard.holder.held.entry(key)
    assert held is not None
    hour_later = time.time() + 3600
    made: list[ShardRecovery] = []
    # records are aged by moving both clocks on, as Shard.recovery does
    clock = kinesis_clock(shard.kinesis, skew.AgedKinesisClock)
    assert isinstance(clock, skew.AgedKinesisClock)
    clock.move_to(hour_later)

    def pages_of_ten(start: Position, until_ms: int | None, pacer: Pacer | None,
                     max_records: int | None) -> ShardPipeline:
        return shard.reader(start, until_ms, pacer, max_records or 10)

    def recovery() -> ShardRecovery:
        made.append(ShardRecovery(
            Lease(key), token=shard.token, fence=shard.holder.fence,
            reader_factory=pages_of_ten, rate=RecoveryRate(10_000), max_lag_ms=1000,
            metrics=shard.metrics, wall_clock=lambda: hour_later, kinesis_clock=clock))
        return made[-1]

    def live(start: Position) -> LiveAfterTheGaps:
        return LiveAfterTheGaps([Result([], shard_end=True)],
                                (start.checkpoint, start.sub_sequence_number),
                                lambda: bool(made) and made[0].active)

    first = KeepsTheGapCheckpointer(shard.table)
    second = CallsTheKeptOne(shard.table, first)
    processors = iter([first, second])
    consumer = ShardConsumer(
        held.lease.copy(), concurrency_token=shard.token,
        processor_factory=lambda: next(processors), fence=shard.holder.fence,
        readers=Readers(live, make_recovery=recovery),
        host=Host(LeaseTableReader(shard.table)), settings=SETTINGS, metrics=shard.metrics,
        rng=random.Random(1))
    consumer.start()
    assert consumer.join(30) and consumer.error is None and consumer.shard_ended
    assert len(first.records) == 10, "the first processor checkpointed one batch of ten"
    successor = [seq for is_recovery, seq in second.records if is_recovery]
    assert len(successor) == 20 and int(successor[0]) > int(first.records[-1][1]), \
        "the successor gets every gap record after the gap's checkpoint"
    assert second.refused == ["ShutdownException"]
    assert shard.queue() == ()


class ChecksLateAtBegin(ShardRecovery):
    """A shard's recovery that first runs ``late`` whenever its gaps are read again
    (``begin``): the moment a failed processor's background thread checkpoints in, as the
    consumer reacts to its restart request."""

    def __init__(self, lease: Lease, late: Callable[[], None], **options: Any) -> None:
        super().__init__(lease, **options)
        self._late = late

    def begin(self, live: Position) -> datetime | None:
        self._late()
        return super().begin(live)


def test_a_restart_while_a_closed_shards_gaps_are_recovered_loses_no_gap_record(
        shard: Shard) -> None:
    """A closed shard's lease taken for its gap of 30 records, read ten at a time: the
    processor fails the gap's second batch (``ProcessorRestartRequired``), and a checkpoint
    through the gap checkpointer it was handed comes in late - after the failure, as the
    gap is read again. On the code before the drain neither retired that checkpointer nor
    replaced the processor: the late checkpoint moved the gap's checkpoint over the failed
    batch, and 20 of the 30 records were processed before the gap was gone. It is refused;
    a new processor gets the gap again from its checkpoint."""
    key = "shardId-000000000000"
    hour_later = time.time() + 3600
    clock = kinesis_clock(shard.kinesis, skew.AgedKinesisClock)
    assert isinstance(clock, skew.AgedKinesisClock)
    clock.move_to(hour_later)
    options: dict[str, Any] = dict(
        token=shard.token, fence=shard.holder.fence, rate=RecoveryRate(10_000),
        max_lag_ms=1000, metrics=shard.metrics, wall_clock=lambda: hour_later,
        kinesis_clock=clock)

    def pages_of_ten(start: Position, until_ms: int | None, pacer: Pacer | None,
                     max_records: int | None) -> ShardPipeline:
        return shard.reader(start, until_ms, pacer, max_records or 10)

    queueing = ShardRecovery(Lease(key), reader_factory=pages_of_ten, **options)
    assert queueing.begin(Position.trim_horizon()) is not None, "the gap of 30 queued"
    shard.holder.fence.update_checkpoint(key, shard.token, Position.shard_end())
    held = shard.holder.held.entry(key)
    assert held is not None and held.lease.is_shard_end and held.lease.recovery
    first = KeepsTheGapCheckpointer(shard.table)
    second = Restarting(shard.table)
    processors = iter([first, second])
    refused: list[str] = []

    def late() -> None:
        if len(first.kept) == 2 and not refused:
            try:
                first.kept[-1].checkpoint()
            except ShutdownException as exc:
                refused.append(exc.name)
            else:
                refused.append("accepted")

    consumer = ShardConsumer(
        held.lease.copy(), concurrency_token=shard.token,
        processor_factory=lambda: next(processors), fence=shard.holder.fence,
        readers=Readers(lambda start: ScriptedFetcher([], (start.checkpoint, 0)),
                        make_recovery=lambda: ChecksLateAtBegin(
                            held.lease.copy(), late, reader_factory=pages_of_ten, **options)),
        host=Host(LeaseTableReader(shard.table)), settings=SETTINGS, metrics=shard.metrics,
        rng=random.Random(1))
    consumer.start()
    assert consumer.join(30) and consumer.error is None and consumer.shard_ended
    assert refused == ["ShutdownException"]
    processed = [seq for p in (first, second) for is_recovery, seq in p.records if is_recovery]
    assert len(processed) == 30 == len(set(processed)), "every gap record processed once"
    assert shard.queue() == ()


class TakenBeforeNextUse:
    """A lock that runs ``hook`` (once) just before it is next taken."""

    def __init__(self, lock: AbstractContextManager[Any]) -> None:
        self.lock = lock
        self.hook: Callable[[], None] | None = None

    def __enter__(self) -> Any:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.lock.__exit__(*exc)


def test_a_checkpoint_through_a_gaps_end_as_its_reader_stops_finishes_the_gap(
        shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    """A processor that checkpoints from its own thread (the Spark batcher, once its batch
    is committed) covers the gap's last record just as the gap is closed: after the reader
    stopped and the checkpointer was looked at, before the queue's lock is taken. On the
    code before, that checkpoint found no end to finish the gap with (the reader had
    forgotten it, and it was not kept yet) and the close found the checkpoint short of the
    end: the gap stayed queued, checkpointed to its end, until the next tenure read it."""
    hour_later = time.time() + 3600
    batches: list[tuple[Any, Checkpointer]] = []
    lock: TakenBeforeNextUse | None = None

    def checkpoint_the_end() -> None:
        result, checkpointer = batches[-1]
        checkpointer.checkpoint(result.records[-1])

    def arming(start: Position, until_ms: int | None, pacer: Pacer | None,
               max_records: int | None) -> ShardPipeline:
        reader = shard.reader(start, until_ms, pacer, max_records)
        stop = reader.stop

        def stopped() -> None:
            stop()
            assert lock is not None
            lock.hook = checkpoint_the_end

        monkeypatch.setattr(reader, "stop", stopped)
        return reader

    recovery = shard.recovery(wall_clock=lambda: hour_later)
    monkeypatch.setattr(recovery, "_readers", arming)
    lock = TakenBeforeNextUse(recovery._lock)
    monkeypatch.setattr(recovery, "_lock", lock)
    assert recovery.begin(Position.trim_horizon()) is not None
    read_to_end(recovery, batches)
    assert sum(len(result.records) for result, _ in batches) == 30
    assert shard.queue() == (), "finished by the checkpoint through its end"


def stored_gaps(group: Fleet) -> tuple[RecoveryRequest, ...]:
    items = group.lease_items()
    item = items.get("shardId-000000000000", {})
    return gaps.loads(item.get(RECOVERY, {}).get("S"))


def recovering_from(worker_log: str) -> list[str]:
    """The gap starts a worker's log says it recovered from, in order."""
    return re.findall(r"recovering the gap after (\w+)/\d+ up to", worker_log)


@pytest.mark.integration
def test_kill_9_mid_recovery_then_a_second_outage_both_gaps_are_recovered_by_the_next_owner(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("lag")
    create_stream(kinesis, stream, 1)
    max_lag_ms = 1500
    first_backlog = [f"old1-{n}" for n in range(400)]
    put_plain(kinesis, stream, [p.encode() for p in first_backlog])
    age(max_lag_ms)
    options = ["--max-lag-ms", str(max_lag_ms), "--recovery-max-rate", "100"]
    with fleet(kinesis_mock.url, moto_server.url, stream, unique_name("app"), tmp_path,
               extra_args=options) as group:
        a = group.start("a")
        wait_for(lambda: any(g.started for g in stored_gaps(group)), 60,
                 "the first gap partly recovered by a")
        live = [f"live-{n}" for n in range(20)]
        put_plain(kinesis, stream, [p.encode() for p in live])
        wait_for(lambda: group.lease_items()["shardId-000000000000"]["checkpoint"]["S"].isdigit(),
                 30, "a's live checkpoint")
        a.signal(signal.SIGKILL)
        a.process.wait(10)
        [interrupted] = stored_gaps(group)
        assert interrupted.started and interrupted.start == TRIM_HORIZON
        # The second outage: records written while no worker runs.
        second_backlog = [f"old2-{n}" for n in range(200)]
        put_plain(kinesis, stream, [p.encode() for p in second_backlog])
        age(max_lag_ms)
        b = group.start("b")
        everything = set(first_backlog + live + second_backlog)
        wait_for(lambda: group.ledger.processed_all(everything), 120, "every record processed")
        wait_for(lambda: not stored_gaps(group), 30, "both gaps finished")
    starts = recovering_from(b.log_tail(200_000))
    assert starts[0] == interrupted.done, "b resumes the first gap from a's recovery checkpoint"
    assert len(set(starts)) == 2 and starts[1].isdigit(), "the second outage is a second gap"
    by_b = [int(r["seq"]) for r in group.ledger.records()
            if r["pid"] == b.pid and r["data"].startswith("old1-")]
    assert by_b and min(by_b) > int(interrupted.done), "nothing before the checkpoint re-read"


def test_a_local_clock_ahead_of_kinesis_neither_ends_a_gap_nor_starts_live_in_its_future(
        table: LeaseTable) -> None:
    """The local clock is 5 s ahead of Kinesis' and max_lag_ms is 1 s: the gap's end and
    live reading's start were planned on the local clock, 4 s into Kinesis' future, and the
    gap's reader ended at the tip: a record arriving in those 4 s belonged to neither
    (10 of 40 in the review). Planned on Kinesis' time as its answers show it (Date
    header), the gap ends, and live reading starts, where Kinesis' time was: a record
    that arrives after the gap was read is live's."""
    k = skew.KINESIS_MS
    client = boto3.client("kinesis", region_name=REGION)
    holder = Holder(table, "A", Clock())
    token = holder.take("s1")
    with Stubber(client) as stubber:
        # the probe: the first record after the checkpoint, 3 s old in Kinesis' time
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-0"))
        stubber.add_response("get_records", skew.answer(
            k, Records=[skew.record(0, k - 3000)], NextShardIterator="it-1",
            MillisBehindLatest=2000))
        # the look at the oldest record kept (retention), then the gap's reader: both
        # records, then the tip
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-t"))
        stubber.add_response("get_records", skew.page(k, 9, skew.record(0, k - 3000)))
        stubber.add_response("get_shard_iterator", skew.answer(k, ShardIterator="it-2"))
        stubber.add_response("get_records", skew.page(
            k, 3, skew.record(0, k - 3000), skew.record(1, k - 1000)))
        stubber.add_response("get_records", skew.page(k, 4))

        def reader(start: Position, until_ms: int | None, pacer: Pacer | None,
                   max_records: int | None) -> ShardPipeline:
            source = PollingSource(client, ShardAddress("s1", stream_name="s"),
                                   max_records=max_records or 100, idle_time_s=0,
                                   pacer=pacer, until_ms=until_ms)
            return ShardPipeline(source, start)

        recovery = ShardRecovery(
            Lease("s1"), token=token, fence=holder.fence, reader_factory=reader,
            rate=RecoveryRate(10_000), max_lag_ms=1000, metrics=Metrics(),
            wall_clock=lambda: (k + skew.SKEW_MS) / 1000,
            kinesis_clock=kinesis_clock(client))
        live_from = recovery.begin(Position.trim_horizon())
        assert live_from is not None
        live_ms = round(live_from.timestamp() * 1000)
        [queued] = stored_queue(table)
        assert queued.end_ms == live_ms, "the gap and live reading meet"
        assert recover_all(recovery) == ["r0", "r1"]
        stubber.assert_no_pending_responses()
    # A record that arrives now, half a second later in Kinesis' time, after the gap was
    # read to its end: live reading starts at or before its arrival, so it is read.
    assert live_ms <= k + 500, (
        f"live reading starts {live_ms - k} ms into Kinesis' future: records arriving "
        "before then belong to no read")


# -- a shard that left the stream -----------------------------------------------------------


class NotFoundLive(ScriptedFetcher):
    """The live reader of a shard Kinesis no longer finds: its fetch thread stopped on the
    not-found answer."""

    def get(self, timeout: float | None = None) -> Result | None:
        cause = ClientError({"Error": {"Code": "ResourceNotFoundException",
                                       "Message": "no such shard"}}, "GetShardIterator")
        raise FetchError("shardId-000000000000", cause)


def end_gone_shard(shard: Shard, gone: Shard) -> ShardConsumer:
    """The holder's consumer of ``shard``'s lease, with lag recovery reading ``gone`` (a
    stream Kinesis does not find, as it no longer finds a shard past the retention) and the
    listings confirming that the shard left the stream; run to its end."""
    key = "shardId-000000000000"
    held = shard.holder.held.entry(key)
    assert held is not None
    consumer = ShardConsumer(
        held.lease.copy(), concurrency_token=shard.token,
        processor_factory=lambda: Restarting(shard.table), fence=shard.holder.fence,
        readers=Readers(lambda start: NotFoundLive(
            [], (start.checkpoint, start.sub_sequence_number)),
            make_recovery=lambda: gone.recovery(stored=held.lease.recovery)),
        host=Host(LeaseTableReader(shard.table),
                  left_stream=lambda lease_key: frozenset({"shardId-000000000001"})),
        settings=SETTINGS, metrics=shard.metrics, rng=random.Random(1))
    consumer.start()
    assert consumer.join(30)
    return consumer


def test_a_shard_that_left_the_stream_is_ended_by_its_holder_with_lag_recovery_on(
        shard: Shard) -> None:
    """With max_lag_ms set, a new tenure first looks at the record after its checkpoint;
    Kinesis' not-found answer to that look failed the consumer before its processor was
    initialized, so the holder never ended the shard that left the stream and its children
    waited for the next shard sync, as without the holder's ending at all."""
    gone = dataclasses.replace(shard, stream="gone")
    consumer = end_gone_shard(shard, gone)
    assert consumer.error is None and consumer.shard_ended
    lease = shard.table.get("shardId-000000000000")
    assert lease is not None and lease.is_finished
    assert shard.metrics.registry.get_sample_value(
        "kclpy_data_lost_to_retention_total", {"shard_id": "shardId-000000000000"}) == 1


@pytest.mark.parametrize("finished", [False, True], ids=["read-live", "taken-for-its-gaps"])
def test_a_shard_that_left_the_stream_with_gaps_queued_ends_finished_and_reports_them(
        shard: Shard, caplog: pytest.LogCaptureFixture, finished: bool) -> None:
    """The gaps' records left the stream with the shard.

    Read live: the holder wrote SHARD_END, then its recovery of the queued gap failed on
    the same not-found answer; the consumer failed with the lease at SHARD_END and the gap
    queued. Taken for its gaps (a lease already at SHARD_END, whose closed shard then aged
    out): every read of the gap is answered not found; the holder gave the gap up and let
    the lease go with it still queued. Either way no shard sync deletes the lease (it is at
    SHARD_END) and no cleanup either (a gap is queued): every holder after took it and
    failed or gave up, and the gap's loss was never reported. The holder now confirms by
    the listings that the shard left the stream, then drops and reports the gaps: the lease
    ends finished, for lease cleanup."""
    key = "shardId-000000000000"
    if finished:
        shard.holder.fence.update_checkpoint(key, shard.token, Position.shard_end())
    writing = shard.recovery()
    with writing._lock:
        writing._store(lambda _: (gap("100", 5000, 4000),))
    gone = dataclasses.replace(shard, stream="gone")
    with caplog.at_level(logging.ERROR, logger="kclpy"):
        consumer = end_gone_shard(shard, gone)
    assert consumer.error is None and consumer.shard_ended
    lease = shard.table.get(key)
    assert lease is not None and lease.is_finished and not gaps.loads(lease.recovery)
    assert shard.metrics.registry.get_sample_value(
        "kclpy_recovery_trimmed_total", {"shard_id": key}) == 1
    [gap_lost] = [r.getMessage() for r in caplog.records
                  if r.levelno == logging.ERROR and "recovery gap" in r.getMessage()]
    assert "after 100" in gap_lost and "left the stream" in gap_lost
