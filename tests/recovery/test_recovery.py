"""Lag recovery as a whole: a lagging shard end to end over real HTTP (kinesis-mock and
moto's server) - live records flow at once while the gap is recovered, flagged, within its
rate - and the consumer's side, live and recovery batches on one delivery thread. Each
module's own tests: test_queue.py, test_rate.py, test_detect.py,
test_shard.py, test_requests.py."""

from __future__ import annotations

import logging
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

import kclpy
from kclpy import KCLConfig, Worker
from kclpy.consumer import ConsumerSettings, ShardConsumer
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import RECOVERY
from kclpy.local import LocalEndpoint
from kclpy.metrics import RECOVERY_RECORDS, Metrics
from kclpy.position import SHARD_END, TRIM_HORIZON, Position
from kclpy.recovery import queue as gaps
from kclpy.recovery.shard import ShardRecovery
from tests.support.e2e import lease_items, worker_config
from tests.support.recovery import age
from tests.support.scripted import (
    SETTINGS,
    FakeRecovery,
    Host,
    Leases,
    Readers,
    Result,
    RewindingRecovery,
    ScriptedFetcher,
    Writer,
    rec,
)
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.tally import Tally
from tests.support.waiting import wait_for
from tests.support.workers import running as running_worker

REGION = "us-east-1"
FAILOVER = 10.0


# -- over real HTTP: kinesis-mock and moto's server ------------------------------------------

@dataclass
class Delivery:
    data: bytes
    sequence_number: str
    is_recovery: bool
    at: float


@dataclass
class Deliveries:
    items: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: kclpy.Record, is_recovery: bool) -> None:
        with self.lock:
            self.items.append(Delivery(record.binary_data, record.sequence_number, is_recovery,
                                       time.monotonic()))

    def snapshot(self) -> list[Delivery]:
        with self.lock:
            return list(self.items)

    def payloads(self) -> set[bytes]:
        return {d.data for d in self.snapshot()}


class FlagRecorder(kclpy.IRecordProcessor):
    """Records each record with its batch's ``is_recovery``; checkpoints every batch with
    the checkpointer that came with it."""

    def __init__(self, deliveries: Deliveries) -> None:
        self.deliveries = deliveries

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        pass

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            self.deliveries.add(record, process_records_input.is_recovery)
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        shutdown_requested_input.checkpointer.checkpoint()


def running(config: KCLConfig, deliveries: Deliveries, metrics: Metrics | None = None
            ) -> AbstractContextManager[Worker]:
    return running_worker(Worker(config, lambda: FlagRecorder(deliveries), metrics=metrics))


def lease_item(dynamodb_url: str, table: str) -> dict[str, Any]:
    items = dynamodb_client(dynamodb_url).scan(TableName=table, ConsistentRead=True)["Items"]
    assert len(items) <= 1
    return items[0] if items else {}


@pytest.mark.integration
def test_a_lagging_shard_reads_live_at_once_while_its_gap_is_recovered(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        caplog: pytest.LogCaptureFixture) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("lag")
    create_stream(kinesis, stream, 1)
    backlog = [f"old-{n}".encode() for n in range(600)]
    put_plain(kinesis, stream, backlog)
    max_lag_ms, rate = 1500, 100
    age(max_lag_ms)
    deliveries = Deliveries()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, max_lag_ms=max_lag_ms,
                         recovery_max_rate=rate)
    caplog.set_level(logging.INFO, logger="kclpy.recovery")
    with running(config, deliveries) as worker:
        assert worker.wait_started(30)
        queued = wait_for(lambda: lease_item(moto_server.url, config.lease_table_name).get(
            RECOVERY), 30, "the gap queued in the lease item")
        assert [r.start for r in gaps.loads(queued["S"])] == [TRIM_HORIZON]
        live = [f"new-{n}".encode() for n in range(50)]
        put_plain(kinesis, stream, live)
        wait_for(lambda: set(live) <= deliveries.payloads(), 30, "live records delivered")
        still_recovering = [g for s in worker.status()["shards"].values()
                            for g in s["recovery"]]
        wait_for(lambda: set(backlog) <= deliveries.payloads(), 60, "the gap recovered")
        wait_for(lambda: RECOVERY not in lease_item(moto_server.url, config.lease_table_name),
                 30, "the finished gap removed from the lease item")
        delivered = worker.metrics.registry.get_sample_value(
            "kclpy_recovery_records_total", {"shard_id": "shardId-000000000000"})
        assert delivered == len(backlog)
    seen = deliveries.snapshot()
    assert sorted(d.data for d in seen) == sorted(backlog + live), (
        "every record delivered once: recovery and live reading meet without gap or overlap")
    flags = {d.data: d.is_recovery for d in seen}
    assert all(flags[p] for p in backlog), "the gap's records come flagged is_recovery"
    assert not any(flags[p] for p in live), "live records are not flagged"
    assert still_recovering, "live records arrived while the gap was still being recovered"
    recovered = [d for d in seen if d.is_recovery]
    assert [int(d.sequence_number) for d in recovered] == sorted(
        int(d.sequence_number) for d in recovered), "a gap is recovered in order"
    span = recovered[-1].at - recovered[0].at
    assert len(recovered) <= rate * span + rate, "the recovery rate stays within its bound"


@pytest.mark.integration
def test_a_worker_whose_clock_is_ahead_of_kinesis_skips_no_record_of_a_lagging_shard(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The worker's clock is 20 s ahead of Kinesis' (skewed in this process; kinesis-mock
    stamps arrivals with its own), max_lag_ms is 1 s. The gap's end and live reading's
    start were 19 s into Kinesis' future and the gap's reader ended at the tip: records
    written after that, within those 19 s, were delivered by neither (10 of 40 in the
    review, with 5 s). Every record is delivered, once, and the skew is reported."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("skew")
    create_stream(kinesis, stream, 1)
    backlog = [f"old-{n}".encode() for n in range(30)]
    put_plain(kinesis, stream, backlog)
    max_lag_ms = 1000
    age(max_lag_ms)
    real_time = time.time

    def skewed() -> float:
        return real_time() + 20.0

    # The process' clock, and the recovery's own default (bound when the module was
    # imported, in kclpy versions before this test).
    monkeypatch.setattr(time, "time", skewed)
    defaults = ShardRecovery.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "wall_clock", skewed)
    deliveries = Deliveries()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, max_lag_ms=max_lag_ms)
    caplog.set_level(logging.WARNING, logger="kclpy")
    with running(config, deliveries) as worker:
        assert worker.wait_started(30)
        # the gap may be queued, read and removed between two looks at the lease item: the
        # recovery's own counter says the backlog came through it
        wait_for(lambda: set(backlog) <= deliveries.payloads(), 30, "the gap recovered")
        assert worker.metrics.registry.get_sample_value(
            "kclpy_recovery_records_total", {"shard_id": "shardId-000000000000"}), \
            "the backlog was read as a recovery gap"
        wait_for(lambda: RECOVERY not in lease_item(moto_server.url, config.lease_table_name),
                 30, "the gap read to its end and removed")
        # Written after the gap's reader reached the tip and ended: live reading's.
        live = [f"new-{n}".encode() for n in range(40)]
        put_plain(kinesis, stream, live)
        wait_for(lambda: set(backlog + live) <= deliveries.payloads(), 30,
                 "every record delivered")
        skew = worker.metrics.registry.get_sample_value("kclpy_clock_skew_seconds")
    seen = sorted(d.data for d in deliveries.snapshot())
    assert seen == sorted(backlog + live), "every record delivered once"
    assert skew is not None and skew > 3, "the skew is published"
    assert "ahead of Kinesis'" in caplog.text, "the skew is logged"


# -- the consumer's side: live and recovery batches on one delivery thread ------------------

class FlagLog(kclpy.IRecordProcessor):
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.log.append(("init", initialize_input.sequence_number))

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        self.log.append(("recovery" if process_records_input.is_recovery else "live",
                         [r.sequence_number for r in process_records_input.records]))
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self.log.append(("lease_lost",))

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self.log.append(("shard_ended",))
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self.log.append(("shutdown_requested",))


#: every consumer ``run`` made, latest last (a processor reaches its consumer here)
consumers: list[ShardConsumer] = []


def run(lease: Lease, live: list[Result], recovery: FakeRecovery,
        processors: Callable[[], kclpy.IRecordProcessor], *,
        settings: ConsumerSettings = SETTINGS, wait: bool = True,
        ) -> tuple[ShardConsumer, Writer, list[datetime | None]]:
    """A consumer of ``lease`` reading ``live`` and ``recovery``, run to its end (unless not
    ``wait``); a consumer that does not end within 10 s is told its lease is lost, so that
    a test of a loop fails instead of leaving it spinning."""
    writer = Writer()
    starts: list[datetime | None] = []

    def fetcher_factory(start: Position) -> ScriptedFetcher:
        starts.append(start.moment)
        return ScriptedFetcher(live, (start.checkpoint, start.sub_sequence_number))

    consumer = ShardConsumer(
        lease, concurrency_token="t", processor_factory=processors, fence=writer,
        readers=Readers(fetcher_factory, make_recovery=lambda: recovery),
        host=Host(Leases()), settings=settings, metrics=Metrics(), rng=random.Random(1))
    consumers.append(consumer)
    consumer.start()
    if wait:
        ended = consumer.join(10)
        if not ended:
            consumer.notify_lease_lost()
            consumer.join(10)
        assert ended, "the consumer did not end"
        assert consumer.error is None
    return consumer, writer, starts


def consume(lease: Lease, live: list[Result], recovery: FakeRecovery
            ) -> tuple[FlagLog, Writer, list[datetime | None]]:
    processor = FlagLog()
    _, writer, starts = run(lease, live, recovery, lambda: processor)
    return processor, writer, starts


LIVE_FROM = datetime(2030, 1, 1, tzinfo=timezone.utc)


def test_recovery_batches_are_flagged_and_checkpoint_the_gap_not_the_live_shard() -> None:
    recovery = FakeRecovery([Result([rec(1), rec(2)]), Result([rec(3)])], start_at=LIVE_FROM)
    live = [Result([rec(100)]), Result([rec(101)]), Result([], shard_end=True)]
    processor, writer, starts = consume(Lease("shard-1", checkpoint=Position.trim_horizon()), live,
                                        recovery)
    assert recovery.begun == [(TRIM_HORIZON, 0)] and starts == [LIVE_FROM]
    recovered = [seqs for kind, *rest in processor.log if kind == "recovery" for seqs in rest]
    lived = [seqs for kind, *rest in processor.log if kind == "live" for seqs in rest]
    assert recovered == [["1", "2"], ["3"]] and lived == [["100"], ["101"]]
    assert recovery.writer.writes == [("2", 0), ("3", 0)]
    assert writer.writes == [("100", 0), ("101", 0), (SHARD_END, 0)]
    assert recovery.stopped


def test_a_gap_left_at_shard_end_is_recovered_before_the_lease_goes() -> None:
    """Live reading reached the shard's end with gap batches still queued: the live
    processor ends the shard at once (the children may start meanwhile), and what is left
    of the gap goes to a processor started at SHARD_END, whose final callback is
    ``shard_ended`` too. A processor gets nothing after its final callback."""
    recovery = FakeRecovery([Result([rec(1)]), Result([rec(2)]), Result([rec(3)])])
    live = [Result([], shard_end=True)]
    processor, writer, _ = consume(Lease("shard-1", checkpoint=Position("50")), live, recovery)
    assert processor.log == [("init", "50"), ("recovery", ["1"]), ("shard_ended",),
                             ("init", SHARD_END), ("recovery", ["2"]), ("recovery", ["3"]),
                             ("shard_ended",)]
    assert recovery.writer.writes == [("1", 0), ("2", 0), ("3", 0)]
    assert writer.writes == [(SHARD_END, 0)], "the children may start meanwhile"


def test_a_closed_shard_with_a_gap_queued_is_recovered_without_live_reading() -> None:
    """The gaps' processor ends with ``shard_ended``: its checkpointer is at SHARD_END
    already, so its ``checkpoint()`` writes nothing. On the code before it got no final
    callback, and a MultiLang child was left running for every such tenure."""
    recovery = FakeRecovery([Result([rec(1)]), Result([rec(2)])])
    processor, writer, starts = consume(Lease("shard-1", checkpoint=Position.shard_end()), [],
                                        recovery)
    assert processor.log == [("init", SHARD_END), ("recovery", ["1"]), ("recovery", ["2"]),
                             ("shard_ended",)]
    assert starts == [] and recovery.begun == [] and writer.writes == []
    assert recovery.writer.writes == [("1", 0), ("2", 0)]


class ChecksAtItsEnd(FlagLog):
    """Checkpoints only in ``shard_ended`` (the amazon_kclpy habit of checkpointing every N
    seconds and always at the end), and only from its ``at``-th call on."""

    def __init__(self, at: int = 1) -> None:
        super().__init__()
        self.at = at

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        self.log.append(("recovery", [r.sequence_number for r in process_records_input.records]))

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self.log.append(("shard_ended",))
        if self.log.count(("shard_ended",)) >= self.at:
            shard_ended_input.checkpointer.checkpoint()


@pytest.mark.parametrize("at", [1, 3], ids=["at-once", "on-the-third-call"])
def test_a_closed_shards_gaps_checkpointed_only_in_shard_ended_are_finished(at: int) -> None:
    """The gaps' processor checkpoints nothing until its ``shard_ended``: that SHARD_END
    checkpoint finishes every gap it was handed; until it comes, ``shard_ended`` is called
    again, as the live one is. On the code before the gap stayed queued, and every next
    tenure took the lease and read the whole gap again at once (a review measured a retake
    every 0.6 s, for ever)."""
    recovery = FakeRecovery([Result([rec(1)]), Result([rec(2)])])
    processor = ChecksAtItsEnd(at)
    consumer, writer, _ = run(Lease("shard-1", checkpoint=Position.shard_end()), [], recovery,
                              lambda: processor)
    assert processor.log == [("init", SHARD_END), ("recovery", ["1"]), ("recovery", ["2"]),
                             *[("shard_ended",)] * at]
    assert recovery.finishing.writes == [(SHARD_END, 0)]
    assert recovery.writer.writes == [] and writer.writes == []
    assert consumer.shard_ended and consumer.error is None


class StopsOnTheFirstGapBatch(FlagLog):
    """Its consumer is told ``stop`` (``notify_lease_lost`` or ``request_shutdown``) while it
    processes the first gap batch."""

    def __init__(self, stop: str) -> None:
        super().__init__()
        self.stop = stop

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        super().process_records(process_records_input)
        getattr(consumers[-1], self.stop)()


@pytest.mark.parametrize(("stop", "final"), [("notify_lease_lost", "lease_lost"),
                                             ("request_shutdown", "shutdown_requested")])
def test_a_closed_shards_gaps_processor_gets_a_final_callback_when_the_tenure_ends(
        stop: str, final: str) -> None:
    """The lease is lost, or the worker shuts down, while a closed shard's gaps are
    recovered: the gaps' processor is told, as a live one would be. On the code before the
    drain returned without a final callback."""
    recovery = FakeRecovery([Result([rec(1)]), Result([rec(2)])])
    processor = StopsOnTheFirstGapBatch(stop)
    run(Lease("shard-1", checkpoint=Position.shard_end()), [], recovery, lambda: processor)
    assert processor.log == [("init", SHARD_END), ("recovery", ["1"]), (final,)]
    assert recovery.writer.writes == [("1", 0)]


class EndsForGood(FlagLog):
    """As a MultiLang processor, whose final callback stops its child: every call after its
    final one (``shard_ended`` that checkpointed SHARD_END, ``lease_lost``,
    ``shutdown_requested``) asks for a restart."""

    def __init__(self, made: list[EndsForGood]) -> None:
        super().__init__()
        self.ended = False
        made.append(self)

    def _refused_after_the_end(self, call: str) -> None:
        if self.ended:
            self.log.append(("refused", call))
            raise kclpy.ProcessorRestartRequired(f"{call} after the final callback")

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        self._refused_after_the_end("process_records")
        super().process_records(process_records_input)

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self._refused_after_the_end("lease_lost")
        super().lease_lost(lease_lost_input)
        self.ended = True

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self._refused_after_the_end("shard_ended")
        super().shard_ended(shard_ended_input)
        self.ended = shard_ended_input.checkpointer.position.is_shard_end

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self._refused_after_the_end("shutdown_requested")
        super().shutdown_requested(shutdown_requested_input)
        self.ended = True


def test_gaps_left_at_shard_end_never_reach_a_processor_after_its_final_callback() -> None:
    """A MultiLang processor stops its child in ``shard_ended``; on the code before, the
    consumer then handed it the gap batches still queued, each answered with a restart
    request, and the consumer only read the gap again: the same batch, the same refusal, for
    ever (329 GetShardIterator calls in 5 s, the lease held at SHARD_END, the gap never
    delivered). The gaps go to a new processor; the gap is read again once, at the switch."""
    recovery = RewindingRecovery([Result([rec(1)]), Result([rec(2)]), Result([rec(3)])])
    made: list[EndsForGood] = []
    _, writer, _ = run(Lease("shard-1", checkpoint=Position("50")),
                       [Result([], shard_end=True)], recovery, lambda: EndsForGood(made))
    assert [p.log for p in made] == [
        [("init", "50"), ("recovery", ["1"]), ("shard_ended",)],
        [("init", SHARD_END), ("recovery", ["2"]), ("recovery", ["3"]), ("shard_ended",)]]
    assert recovery.begun == [("50", 0), (SHARD_END, 0)]
    assert recovery.writer.writes == [("1", 0), ("2", 0), ("3", 0)]
    assert writer.writes == [(SHARD_END, 0)]


class RestartOnce(FlagLog):
    """Asks for a restart the first time it is handed recovery record 2."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        numbers = [r.sequence_number for r in process_records_input.records]
        if "2" in numbers and not self.failed:
            self.failed = True
            self.log.append(("restart", numbers))
            raise kclpy.ProcessorRestartRequired("state lost")
        super().process_records(process_records_input)


def test_a_restart_asked_while_a_closed_shard_drains_re_reads_from_the_gaps_checkpoint(
        ) -> None:
    recovery = RewindingRecovery([Result([rec(1)]), Result([rec(2)]), Result([rec(3)])])
    processor = RestartOnce()
    _, writer, _ = run(Lease("shard-1", checkpoint=Position("50")),
                       [Result([], shard_end=True)], recovery, lambda: processor)
    handed = [tuple(rest[0]) for kind, *rest in processor.log if kind in ("recovery", "restart")]
    assert handed == [("1",), ("2",), ("2",), ("3",)], "record 2 is handed again, nothing lost"
    assert [entry for entry in processor.log if entry[0] in ("init", "shard_ended")] == [
        ("init", "50"), ("shard_ended",), ("init", SHARD_END), ("init", SHARD_END),
        ("shard_ended",)], "a new processor for the gaps, and another after the restart"
    assert recovery.begun == [("50", 0), (SHARD_END, 0), (SHARD_END, 0)]
    assert recovery.writer.writes == [("1", 0), ("2", 0), ("3", 0)]
    assert writer.writes == [(SHARD_END, 0)]


class AlwaysRestarts(FlagLog):
    """Asks for a restart on every gap batch."""

    def __init__(self, made: list[AlwaysRestarts]) -> None:
        super().__init__()
        made.append(self)

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        raise kclpy.ProcessorRestartRequired("child died")


def test_a_gaps_processor_that_keeps_failing_is_restarted_with_the_task_backoff() -> None:
    """Each restart asked for while a closed shard's gaps are recovered gets a new processor
    after the task backoff, as in the live loop, and the consumer still stops when asked.
    On the code before the same processor got the batch again at once: a busy loop of reads
    of the gap."""
    recovery = RewindingRecovery([Result([rec(1)])])
    made: list[AlwaysRestarts] = []
    backoff = ConsumerSettings(**{**SETTINGS.__dict__, "task_backoff_s": 0.1,
                                  "max_task_backoff_s": 0.1})
    consumer, _, _ = run(Lease("shard-1", checkpoint=Position.shard_end()), [], recovery,
                         lambda: AlwaysRestarts(made), settings=backoff, wait=False)
    time.sleep(1)
    consumer.request_shutdown()
    assert consumer.join(10) and consumer.error is None
    # equal jitter: each backoff is 0.05 s to 0.1 s; each new processor reads the gap again
    assert 2 <= len(made) <= 21
    assert len(made) - 1 <= len(recovery.begun) <= len(made)
    assert all(p.log == [("init", SHARD_END)] for p in made)
    assert recovery.writer.writes == []


@pytest.mark.integration
def test_a_gap_of_a_shard_that_is_split_is_recovered_from_the_closed_parent(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("lag-split")
    create_stream(kinesis, stream, 1)
    backlog = [f"old-{n}".encode() for n in range(300)]
    put_plain(kinesis, stream, backlog)
    max_lag_ms = 1500
    age(max_lag_ms)
    deliveries = Deliveries()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, max_lag_ms=max_lag_ms,
                         recovery_max_rate=60, parent_shard_poll_interval_ms=200)
    parent = "shardId-000000000000"
    # the finished parent leaves the worker, and its series the registry, before the end
    tally = Tally()
    with running(config, deliveries, Metrics(backends=[tally])) as worker:
        assert worker.wait_started(30)
        wait_for(lambda: RECOVERY in lease_items(moto_server.url, config.lease_table_name).get(
            parent, {}), 30, "the parent's gap queued")
        (shard,) = kinesis.list_shards(StreamName=stream)["Shards"]
        low, high = (int(shard["HashKeyRange"][k]) for k in ("StartingHashKey",
                                                              "EndingHashKey"))
        kinesis.split_shard(StreamName=stream, ShardToSplit=parent,
                            NewStartingHashKey=str((low + high) // 2))
        wait_for(lambda: kinesis.describe_stream_summary(StreamName=stream)[
            "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", 30, "split done")
        after = [f"child-{n}".encode() for n in range(40)]
        put_plain(kinesis, stream, after)
        wait_for(lambda: set(after) <= deliveries.payloads(), 60,
                 "the children read while the parent's gap is still recovered")
        items = lease_items(moto_server.url, config.lease_table_name)
        assert items[parent]["checkpoint"]["S"] == SHARD_END
        assert RECOVERY in items[parent], "the closed parent keeps its queue meanwhile"
        assert not set(backlog) <= deliveries.payloads()
        wait_for(lambda: set(backlog) <= deliveries.payloads(), 60, "the gap recovered")
        wait_for(lambda: parent not in lease_items(moto_server.url, config.lease_table_name),
                 60, "the finished parent's lease cleaned up")
        assert tally.count(RECOVERY_RECORDS, parent) == len(backlog)
    seen = deliveries.snapshot()
    assert sorted(d.data for d in seen) == sorted(backlog + after), "each record once"
    assert all(d.is_recovery for d in seen if d.data in set(backlog))


@pytest.mark.integration
def test_the_recovery_benchmark_runs_on_a_small_backlog() -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "recovery.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--records", "20000", "--max-lag-ms", "5000",
         "--rate", "1000", "--measure-s", "10"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    live = re.search(r"with lag recovery ([\d,]+) ms; plain worker to the same record "
                     r"([\d.,]+) s", done.stdout)
    rate = re.search(r"recovery: ([\d,]+) records in 10 s; largest 10 s window ([\d,]+)/s, "
                     r"mean ([\d,]+)/s, bound 1,000/s", done.stdout)
    assert live is not None and rate is not None, done.stdout
    recovered, largest = (int(rate[n].replace(",", "")) for n in (1, 2))
    assert recovered > 0 and largest <= 1100, "recovery read within its bound"


def test_lag_recovery_is_off_unless_asked_and_configured_by_flag_or_properties_key(
        tmp_path: Path) -> None:
    from kclpy.arguments import parse_worker_args

    base = ["--stream-name", "s", "--application-name", "a", "--processor", "x:Y"]
    default, _ = parse_worker_args(base)
    assert (default.max_lag_ms, default.recovery_max_rate) == (None, 1000)
    flags, _ = parse_worker_args([*base, "--max-lag-ms", "60000", "--recovery-max-rate", "50"])
    assert (flags.max_lag_ms, flags.recovery_max_rate) == (60000, 50)
    properties = tmp_path / "app.properties"
    properties.write_text("maxLagMillis = 30000\nrecoveryMaxRecordsPerSecond = 70\n")
    loaded, _ = parse_worker_args([*base, "--properties", str(properties)])
    assert (loaded.max_lag_ms, loaded.recovery_max_rate) == (30000, 70)
