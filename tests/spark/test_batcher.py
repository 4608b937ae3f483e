"""The micro-batcher without Spark or AWS: real Checkpointers over a recording writer, a fake
SparkSession that hands the Arrow table straight to foreach_batch, processors driven by hand
the way a shard consumer drives them."""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kclpy.checkpoint import Checkpointer
from kclpy.errors import LeaseBusy, ShutdownException, ThrottlingException
from kclpy.leases.fence import Guard
from kclpy.leases.lease import Lease
from kclpy.position import Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.spark import BatchOptions, MicroBatcher, current_batch
from kclpy.spark.batcher import ShardRange, batch_id_for
from tests.support.checkpoints import CheckpointWriterBase

FAST = BatchOptions(min_interval_s=0.0, max_interval_s=0.05, retry_base_s=0.001,
                    retry_cap_s=0.01)


class Writer(CheckpointWriterBase):
    """The lease table's checkpoint write, recorded; shards in ``lost`` refuse like a
    lost lease, shards in ``throttled`` refuse ``n`` times like a throttled table. Its
    ``guard`` is the fence's as the batcher asks it: it holds the lease's lock (in
    ``lease_locks``, where a test can hold one as a slow renewal would; ``waiting[key]`` is
    set when a guard starts waiting for it, and one told not to wait raises ``LeaseBusy``),
    refused for a shard in ``lost`` or ``fenced`` (a lease this tenure no longer holds),
    else the tenure in ``tenures``; ``guarded`` counts the calls."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, int]] = []
        self.lost: set[str] = set()
        self.fenced: set[str] = set()
        self.tenures: dict[str, int] = {}
        self.guarded: list[str] = []
        self.lock = threading.Lock()
        self.throttled: dict[str, int] = {}
        self.lease_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self.waiting: defaultdict[str, threading.Event] = defaultdict(threading.Event)

    @contextmanager
    def guard(self, lease_key: str, concurrency_token: str | None, *,
              what: str, wait: bool = True) -> Iterator[Guard]:
        with self.lock:
            lease_lock, waiting = self.lease_locks[lease_key], self.waiting[lease_key]
        if not lease_lock.acquire(blocking=False):
            if not wait:
                raise LeaseBusy(f"{lease_key} is being written")
            waiting.set()
            lease_lock.acquire()
        try:
            with self.lock:
                self.guarded.append(lease_key)
                if lease_key in self.lost or lease_key in self.fenced:
                    raise ShutdownException(f"{lease_key} is owned by someone else")
                tenure = self.tenures.get(lease_key, 1)
            yield Guard(Lease(lease_key), tenure, lambda: None)
        finally:
            lease_lock.release()

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        with self.lock:
            if lease_key in self.lost:
                raise ShutdownException(f"{lease_key} is owned by someone else")
            if self.throttled.get(lease_key, 0) > 0:
                self.throttled[lease_key] -= 1
                raise ThrottlingException("slow down")
            self.writes.append((lease_key, position.checkpoint, position.sub_sequence_number))

    def of(self, shard_id: str) -> list[tuple[str, int]]:
        with self.lock:
            return [(c, s) for sid, c, s in self.writes if sid == shard_id]


class FakeSpark:
    def createDataFrame(self, data: Any) -> Any:
        assert isinstance(data, pa.Table)
        return data


class Sink:
    """foreach_batch that keeps each table, or raises while ``failures`` is positive."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.tables: list[pa.Table] = []
        self.ids: list[str] = []
        self.failures = 0
        self.writes_seen_during_call: list[int] = []

    def __call__(self, df: pa.Table, batch_id: str) -> None:
        self.writes_seen_during_call.append(len(self.writer.writes))
        self.ids.append(batch_id)
        info = current_batch()
        assert info is not None and info.batch_id == batch_id
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("sink down")
        self.tables.append(df)


def records(shard: int, start: int, n: int, *, subs: int = 1) -> list[Record]:
    out = []
    for i in range(start, start + n):
        for sub in range(subs):
            out.append(Record(sequence_number=str(1000 * (shard + 1) + i),
                              sub_sequence_number=sub, partition_key=f"pk-{shard}-{i}",
                              timestamp_millis=1_700_000_000_000 + i,
                              data=f"s{shard}-r{i}-{sub}".encode()))
    return out


class Shard:
    """One shard as a consumer would drive its processor."""

    def __init__(self, batcher: MicroBatcher, writer: Writer, shard_id: str,
                 stream: str | None = None) -> None:
        self.shard_id = shard_id
        self.processor: IRecordProcessor = batcher.processor_factory()
        self.checkpointer = Checkpointer(shard_id, writer, "token", Position.trim_horizon())
        self.processor.initialize(InitializeInput(shard_id, "TRIM_HORIZON", 0, stream))

    def deliver(self, batch: list[Record]) -> None:
        self.checkpointer.mark_delivered(batch[-1])
        self.processor.process_records(
            ProcessRecordsInput(self.shard_id, batch, self.checkpointer, None))

    def deliver_in_thread(self, batch: list[Record]) -> threading.Thread:
        thread = threading.Thread(target=self.deliver, args=(batch,), daemon=True)
        thread.start()
        return thread


class NotingCondition(threading.Condition):
    """The batcher's condition, noting each thread that waits on it: a ``process_records``
    caller noted waiting has found its shard over the bound under the lock, and only a
    commit that brings the shard back under it (and notifies) lets it return."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: set[int] = set()
        self.noted = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        with self.noted:
            self.waited.add(threading.get_ident())
            self.noted.notify_all()
        return super().wait(timeout)

    def wait_for_waiter(self, thread: threading.Thread) -> bool:
        with self.noted:
            return self.noted.wait_for(lambda: thread.ident in self.waited, timeout=10)


def blocking(batcher: MicroBatcher) -> NotingCondition:
    """Put a ``NotingCondition`` in the batcher before any shard uses it."""
    cond = NotingCondition()
    batcher._cond = cond
    return cond


@pytest.fixture
def writer() -> Writer:
    return Writer()


@pytest.fixture
def sink(writer: Writer) -> Sink:
    return Sink(writer)


def make(sink: Sink, options: BatchOptions = FAST, **kwargs: Any) -> MicroBatcher:
    return MicroBatcher(FakeSpark(), sink, stream="orders", options=options, **kwargs)


def test_one_batch_covers_every_shard_and_checkpoints_after_foreach_batch(
        writer: Writer, sink: Sink) -> None:
    batcher = make(sink)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    a.deliver(records(0, 0, 3))
    b.deliver(records(1, 0, 2, subs=2))

    info = batcher.run_once()

    assert info is not None
    (table,) = sink.tables
    assert table.schema.names == ["stream", "shard_id", "sequence_number",
                                  "sub_sequence_number", "partition_key",
                                  "approximate_arrival_timestamp", "data"]
    assert table.num_rows == 7
    rows = sorted(zip(table.column("shard_id").to_pylist(), table.column("data").to_pylist(),
                      strict=True))
    assert rows == sorted([("shard-a", f"s0-r{i}-0".encode()) for i in range(3)]
                          + [("shard-b", f"s1-r{i}-{s}".encode())
                             for i in range(2) for s in range(2)])
    assert set(table.column("stream").to_pylist()) == {"orders"}
    # nothing was checkpointed while foreach_batch ran; afterwards, the last record of each
    assert sink.writes_seen_during_call == [0]
    assert writer.of("shard-a") == [("1002", 0)]
    assert writer.of("shard-b") == [("2001", 1)]
    assert {r.shard_id: r.count for r in info.ranges} == {"shard-a": 3, "shard-b": 4}


def test_a_multi_stream_batch_names_each_rows_own_stream(writer: Writer, sink: Sink) -> None:
    batcher = MicroBatcher(FakeSpark(), sink, stream="orders,payments", options=FAST)
    orders = Shard(batcher, writer, "1:orders:5:shardId-0", stream="orders")
    payments = Shard(batcher, writer, "1:payments:6:shardId-0", stream="payments")
    orders.deliver(records(0, 0, 2))
    payments.deliver(records(1, 0, 3))

    assert batcher.run_once() is not None

    (table,) = sink.tables
    rows = Counter(zip(table.column("stream").to_pylist(), table.column("shard_id").to_pylist(),
                       strict=True))
    assert rows == {("orders", "1:orders:5:shardId-0"): 2,
                    ("payments", "1:payments:6:shardId-0"): 3}


def test_failing_foreach_batch_is_retried_with_the_same_id_and_checkpoints_only_after(
        writer: Writer, sink: Sink) -> None:
    batcher = make(sink)
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 5))
    sink.failures = 2

    batcher.run_once()

    assert len(set(sink.ids)) == 1 and len(sink.ids) == 3
    assert sink.writes_seen_during_call == [0, 0, 0]
    assert batcher.stats.foreach_batch_failures == 2
    assert sink.tables[0].num_rows == 5
    assert writer.of("shard-a") == [("1004", 0)]


def test_stop_during_retries_checkpoints_nothing(writer: Writer, sink: Sink) -> None:
    batcher = make(sink, BatchOptions(retry_base_s=0.05, retry_cap_s=0.05))
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    sink.failures = 10**9
    runner = threading.Thread(target=batcher.run_once, daemon=True)
    runner.start()
    while len(sink.ids) < 2:
        threading.Event().wait(0.01)
    batcher.stop()
    runner.join(10)
    assert not runner.is_alive()
    assert writer.writes == []
    assert sink.tables == []


def test_batch_id_depends_only_on_the_ranges() -> None:
    r1 = ShardRange("a", "1", 0, "5", 2, 7)
    r2 = ShardRange("b", "10", 0, "10", 0, 1)
    assert batch_id_for("s", [r1, r2]) == batch_id_for("s", [r2, r1])
    assert batch_id_for("s", [r1, r2]) != batch_id_for("s", [r1])
    assert batch_id_for("s", [r1]) != batch_id_for("other", [r1])
    assert batch_id_for("s", [r1]) != batch_id_for("s", [ShardRange("a", "1", 0, "5", 3, 8)])


def test_max_records_cuts_batches_and_checkpoints_each_prefix(writer: Writer,
                                                                sink: Sink) -> None:
    batcher = make(sink, BatchOptions(max_records=4, min_interval_s=0.0, max_interval_s=1.0))
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 10))

    while batcher.run_once() is not None:
        pass

    assert [t.num_rows for t in sink.tables] == [4, 4, 2]
    assert writer.of("shard-a") == [("1003", 0), ("1007", 0), ("1009", 0)]
    seen = [d for t in sink.tables for d in t.column("data").to_pylist()]
    assert seen == [f"s0-r{i}-0".encode() for i in range(10)]


def test_process_records_blocks_until_the_backlog_is_committed(writer: Writer,
                                                               sink: Sink) -> None:
    batcher = make(sink, BatchOptions(max_pending_per_shard=5, min_interval_s=0.0,
                                      max_interval_s=1.0))
    cond = blocking(batcher)
    a = Shard(batcher, writer, "shard-a")
    blocked = a.deliver_in_thread(records(0, 0, 8))
    assert cond.wait_for_waiter(blocked), "process_records never waited with 8 > 5 pending"
    assert blocked.is_alive(), "process_records returned with 8 > 5 records pending"

    batcher.run_once()

    blocked.join(10)
    assert not blocked.is_alive()
    assert writer.of("shard-a") == [("1007", 0)]
    # under the bound, process_records returns at once
    a.deliver(records(0, 8, 3))


def test_lease_lost_in_flight_skips_that_shards_checkpoint_only(writer: Writer,
                                                                sink: Sink) -> None:
    """The fence still let the batch through before foreach_batch; the checkpoint after it
    finds the lease gone."""
    batcher = make(sink, BatchOptions(max_pending_per_shard=2, min_interval_s=0.0,
                                      max_interval_s=1.0))
    cond = blocking(batcher)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    blocked = a.deliver_in_thread(records(0, 0, 4))
    # its 4 records are offered before the batch is cut
    assert cond.wait_for_waiter(blocked)
    b.deliver(records(1, 0, 1))
    original = sink.__call__

    def lose_during_call(df: pa.Table, batch_id: str) -> None:
        writer.lost.add("shard-a")
        original(df, batch_id)

    batcher._foreach_batch = lose_during_call

    batcher.run_once()

    assert sum(t.num_rows for t in sink.tables) == 5
    assert batcher.stats.lost_checkpoints == 1
    assert writer.of("shard-a") == []
    assert writer.of("shard-b") == [("2000", 0)]
    blocked.join(10)
    assert not blocked.is_alive(), "a shard whose lease is gone must not stay blocked"
    # the consumer goes on to lease_lost; later records of the old lease are not batched
    a.processor.lease_lost(LeaseLostInput("shard-a"))
    a.deliver(records(0, 4, 2))
    assert batcher.run_once() is None


def test_lease_lost_drops_pending_records(writer: Writer, sink: Sink) -> None:
    batcher = make(sink)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    a.deliver(records(0, 0, 3))
    b.deliver(records(1, 0, 3))
    a.processor.lease_lost(LeaseLostInput("shard-a"))

    batcher.run_once()

    assert set(sink.tables[0].column("shard_id").to_pylist()) == {"shard-b"}
    assert writer.of("shard-a") == []


def test_throttled_checkpoint_is_retried(writer: Writer, sink: Sink) -> None:
    batcher = make(sink)
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    writer.throttled["shard-a"] = 2

    batcher.run_once()

    assert writer.of("shard-a") == [("1001", 0)]
    assert batcher.stats.failed_checkpoints == 0


def test_a_checkpoint_throttled_past_its_attempts_is_given_up_after_exactly_them(
        writer: Writer, sink: Sink) -> None:
    batcher = make(sink, BatchOptions(min_interval_s=0.0, max_interval_s=0.05,
                                      retry_base_s=0.001, retry_cap_s=0.01,
                                      checkpoint_attempts=3))
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    writer.throttled["shard-a"] = 10

    batcher.run_once()

    assert writer.throttled["shard-a"] == 7, "three attempts, no more"
    assert writer.of("shard-a") == []
    assert batcher.stats.failed_checkpoints == 1 and batcher.stats.lost_checkpoints == 0


def test_shard_end_commits_the_shards_records_before_shard_end(writer: Writer,
                                                                sink: Sink) -> None:
    batcher = make(sink)
    batcher.start()
    try:
        a = Shard(batcher, writer, "shard-a")
        a.deliver(records(0, 0, 3))
        a.checkpointer.mark_shard_end()
        a.processor.shard_ended(ShardEndedInput("shard-a", a.checkpointer))
    finally:
        batcher.stop(10)
    assert writer.of("shard-a") == [("1002", 0), ("SHARD_END", 0)]
    assert sum(t.num_rows for t in sink.tables) == 3


def test_shutdown_requested_drains_what_the_shard_delivered(writer: Writer,
                                                             sink: Sink) -> None:
    # a long max interval: only the drain can make the batch due
    batcher = make(sink, BatchOptions(min_interval_s=0.0, max_interval_s=3600.0))
    batcher.start()
    try:
        a = Shard(batcher, writer, "shard-a")
        a.deliver(records(0, 0, 4))
        a.processor.shutdown_requested(ShutdownRequestedInput("shard-a", a.checkpointer))
    finally:
        batcher.stop(10)
    assert writer.of("shard-a") == [("1003", 0)]


def test_background_loop_batches_without_help(writer: Writer, sink: Sink) -> None:
    batcher = make(sink)
    batcher.start()
    try:
        a = Shard(batcher, writer, "shard-a")
        a.deliver(records(0, 0, 3))
        done = threading.Event()
        for _ in range(500):
            if writer.of("shard-a"):
                done.set()
                break
            threading.Event().wait(0.01)
    finally:
        batcher.stop(10)
    assert done.is_set()
    assert writer.of("shard-a") == [("1002", 0)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trigger_waits_for_max_interval_and_respects_min_interval(writer: Writer,
                                                                   sink: Sink) -> None:
    clock = Clock()
    batcher = make(sink, BatchOptions(max_records=10, min_interval_s=2.0, max_interval_s=5.0),
                   clock=clock)
    a = Shard(batcher, writer, "shard-a")
    assert batcher._due_in(clock.now) is None
    a.deliver(records(0, 0, 3))
    assert batcher._due_in(clock.now) == pytest.approx(5.0)
    clock.now += 5.0
    assert (batcher._due_in(clock.now) or 0) <= 0
    batcher.run_once()
    # a full batch is due at once, but not sooner than min_interval after the last start
    a.deliver(records(0, 3, 10))
    assert batcher._due_in(clock.now) == pytest.approx(2.0)
    clock.now += 2.0
    assert (batcher._due_in(clock.now) or 0) <= 0


def test_decoder_adds_columns(writer: Writer, sink: Sink) -> None:
    def decode(data: pa.BinaryArray) -> pa.Table:
        return pa.table({"text": [d.decode() for d in data.to_pylist()]})

    batcher = make(sink, decode=decode)
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    batcher.run_once()
    assert sink.tables[0].column("text").to_pylist() == ["s0-r0-0", "s0-r1-0"]


def test_failing_decoder_holds_the_batch_back_like_a_failing_sink(writer: Writer,
                                                                  sink: Sink) -> None:
    calls = []

    def decode(data: pa.BinaryArray) -> pa.Table:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bad payload")
        return pa.table({"n": list(range(len(data)))})

    batcher = make(sink, decode=decode)
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    batcher.run_once()
    assert len(calls) == 2
    assert writer.of("shard-a") == [("1001", 0)]


def test_ensure_java_uses_the_bundled_runtime_only_when_no_java_is_configured(
        tmp_path: Path) -> None:
    import subprocess

    from kclpy.spark.java import ensure_java

    bare = {"PATH": str(tmp_path)}
    home = ensure_java(bare)
    assert home is not None and bare["JAVA_HOME"] == home
    version = subprocess.run([os.path.join(home, "bin", "java"), "-version"],
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "version" in version.stderr
    configured = {"PATH": str(tmp_path), "JAVA_HOME": "/opt/my-java"}
    assert ensure_java(configured) is None
    assert configured["JAVA_HOME"] == "/opt/my-java"


def test_a_recovered_gap_and_live_records_are_separate_parts_each_checkpointed_its_own_way(
        writer: Writer, sink: Sink) -> None:
    """Lag recovery hands the processor live batches and gap batches, each with its own
    checkpointer: the batcher keeps them apart, so the gap's checkpointer moves only over
    gap records and the live one only over live records, and the ranges say which is which."""
    batcher = make(sink)
    shard = Shard(batcher, writer, "shard-a")
    gap_writer = Writer()
    gap = Checkpointer("shard-a", gap_writer, "token", Position("1000"))
    live = records(0, 900, 3)
    recovered = records(0, 101, 3)
    shard.deliver(live)
    gap.mark_delivered(recovered[-1])
    assert shard.processor is not None
    shard.processor.process_records(
        ProcessRecordsInput("shard-a", recovered, gap, None, is_recovery=True))

    info = batcher.run_once()

    assert info is not None
    assert [(r.first_sequence_number, r.last_sequence_number, r.is_recovery)
            for r in info.ranges] == [("1900", "1902", False), ("1101", "1103", True)]
    assert writer.of("shard-a") == [("1902", 0)]
    assert gap_writer.of("shard-a") == [("1103", 0)]
    (table,) = sink.tables
    assert table.num_rows == 6


def test_the_batch_id_tells_a_recovered_range_from_a_live_one() -> None:
    live = ShardRange("a", "1", 0, "5", 0, 5)
    recovered = ShardRange("a", "1", 0, "5", 0, 5, is_recovery=True)
    assert batch_id_for("s", [live]) != batch_id_for("s", [recovered])
    other = ShardRange("a", "10", 0, "12", 0, 3)
    assert batch_id_for("s", [other, recovered]) == batch_id_for("s", [recovered, other])


def test_a_part_whose_lease_the_fence_refuses_is_not_handed_to_foreach_batch(
        writer: Writer, sink: Sink) -> None:
    """The lease of shard-a moved before the batch started: its records are the new
    owner's to write. The batch holds shard-b's alone, and shard-a's are not batched again."""
    batcher = make(sink)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    a.deliver(records(0, 0, 3))
    b.deliver(records(1, 0, 2))
    writer.fenced.add("shard-a")

    info = batcher.run_once()

    assert info is not None
    assert [r.shard_id for r in info.ranges] == ["shard-b"]
    (table,) = sink.tables
    assert set(table.column("shard_id").to_pylist()) == {"shard-b"}
    assert writer.of("shard-a") == [] and writer.of("shard-b") == [("2001", 0)]
    assert batcher.stats.fenced_parts == 1
    a.deliver(records(0, 3, 1))
    assert batcher.run_once() is None


def test_a_sink_that_raises_fenced_out_gets_the_batch_again_without_those_parts(
        writer: Writer, sink: Sink) -> None:
    """A sink's commit found shard-a committed by a later tenure (FencedOut): nothing was
    committed, so the batcher calls again at once with shard-b's part only, under its own id,
    and checkpoints shard-b alone."""
    from kclpy.spark.batcher import FencedOut

    batcher = make(sink)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    a.deliver(records(0, 0, 3))
    b.deliver(records(1, 0, 2))
    calls: list[tuple[str, ...]] = []

    def foreach_batch(df: pa.Table, batch_id: str) -> None:
        info = current_batch()
        assert info is not None
        calls.append(tuple(sorted(r.shard_id for r in info.ranges)))
        if len(calls) == 1:
            raise FencedOut({"shard-a"}, "a later tenure committed")
        sink(df, batch_id)

    batcher._foreach_batch = foreach_batch

    info = batcher.run_once()

    assert calls == [("shard-a", "shard-b"), ("shard-b",)]
    assert info is not None and info.attempt == 0
    assert batcher.stats.foreach_batch_failures == 0
    assert writer.of("shard-a") == [] and writer.of("shard-b") == [("2001", 0)]


def test_the_commit_fence_yields_each_leases_tenure_and_refuses_a_lost_one(
        writer: Writer) -> None:
    """``BatchInfo.commit_fence`` guards each lease once (a live part and a gap's share it),
    yields its tenure, and raises FencedOut naming the leases no longer held."""
    from kclpy.spark.batcher import FencedOut

    seen: list[dict[str, int]] = []
    lost: list[frozenset[str]] = []

    def foreach_batch(df: pa.Table, batch_id: str) -> None:
        info = current_batch()
        assert info is not None and info.commit_fence is not None
        with info.commit_fence() as guards:
            seen.append({key: guard.tenure for key, guard in guards.items()})
        writer.fenced.add("shard-b")
        try:
            with info.commit_fence():
                raise AssertionError("entered the commit fence of a lost lease")
        except FencedOut as exc:
            lost.append(exc.lease_keys)

    batcher = MicroBatcher(FakeSpark(), foreach_batch, stream="orders", options=FAST)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    writer.tenures.update({"shard-a": 7, "shard-b": 9})
    gap = Checkpointer("shard-a", writer, "token", Position("1000"))
    recovered = records(0, 101, 2)
    gap.mark_delivered(recovered[-1])
    a.deliver(records(0, 900, 2))
    a.processor.process_records(
        ProcessRecordsInput("shard-a", recovered, gap, None, is_recovery=True))
    b.deliver(records(1, 0, 1))

    assert batcher.run_once() is not None

    assert seen == [{"shard-a": 7, "shard-b": 9}]
    assert lost == [frozenset({"shard-b"})]


def test_the_commit_fence_holds_no_lease_while_it_waits_for_another_leases_write(
        writer: Writer) -> None:
    """A commit waiting for one lease's lock (a renewal of it waiting for a slow DynamoDB
    answer) holds no other lease's lock meanwhile, so their renewals go on; once the slow
    write is over, it holds every lease for the commit. On the fence that kept shard-a's
    lock while it waited for shard-b's, shard-a's renewal waited 5 s and the lease expired
    (simulator seeds 665 and 380)."""
    renewing, answered = threading.Event(), threading.Event()
    committed: list[dict[str, int]] = []

    def slow_renewal_of_shard_b() -> None:
        with writer.lease_locks["shard-b"]:
            renewing.set()
            answered.wait(10)

    def foreach_batch(df: pa.Table, batch_id: str) -> None:
        info = current_batch()
        assert info is not None and info.commit_fence is not None
        threading.Thread(target=slow_renewal_of_shard_b, daemon=True).start()
        assert renewing.wait(10)
        with info.commit_fence() as guards:
            committed.append({key: guard.tenure for key, guard in guards.items()})

    batcher = MicroBatcher(FakeSpark(), foreach_batch, stream="orders", options=FAST)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    writer.tenures.update({"shard-a": 3, "shard-b": 4})
    a.deliver(records(0, 0, 1))
    b.deliver(records(1, 0, 1))
    commit = threading.Thread(target=batcher.run_once, daemon=True)
    commit.start()
    try:
        assert writer.waiting["shard-b"].wait(10), "the commit never waited for shard-b"
        # shard-a's renewal, due now: it takes the lock unless the commit sits on it
        shard_a_free = writer.lease_locks["shard-a"].acquire(blocking=False)
        if shard_a_free:
            writer.lease_locks["shard-a"].release()
    finally:
        answered.set()
    commit.join(10)

    assert not commit.is_alive()
    assert shard_a_free, "the commit held shard-a's lock while it waited for shard-b's"
    assert committed == [{"shard-a": 3, "shard-b": 4}]


def test_a_parents_recovered_gap_batches_after_shard_end_are_committed(
        writer: Writer, sink: Sink) -> None:
    """After shard_ended, the consumer hands what lag recovery still has queued for the
    parent to a processor of its own, started at SHARD_END: each such batch is committed and
    checkpointed through the gap's checkpointer before process_records returns, not dropped
    for the next owner, and that processor's own shard_ended (its final callback, its
    checkpointer at SHARD_END already) has nothing left to do. On the code before, that
    shard_ended failed: it expected the live shard's entry."""
    batcher = make(sink)
    batcher.start()
    try:
        a = Shard(batcher, writer, "shard-a")
        a.deliver(records(0, 900, 2))
        a.checkpointer.mark_shard_end()
        a.processor.shard_ended(ShardEndedInput("shard-a", a.checkpointer))
        gaps = batcher.processor_factory()
        gaps.initialize(InitializeInput("shard-a", "SHARD_END", 0))
        gap_writer = Writer()
        gap = Checkpointer("shard-a", gap_writer, "token", Position("1000"))
        for start in (101, 104):
            recovered = records(0, start, 3)
            gap.mark_delivered(recovered[-1])
            gaps.process_records(
                ProcessRecordsInput("shard-a", recovered, gap, None, is_recovery=True))
            assert gap_writer.of("shard-a")[-1] == (recovered[-1].sequence_number, 0)
        gaps.shard_ended(ShardEndedInput(
            "shard-a", Checkpointer("shard-a", writer, "token", Position.shard_end())))
    finally:
        batcher.stop(10)
    assert writer.of("shard-a") == [("1901", 0), ("SHARD_END", 0)]
    assert gap_writer.of("shard-a") == [("1103", 0), ("1106", 0)]
    assert sum(t.num_rows for t in sink.tables) == 8
    assert batcher._shards == []


def test_a_finished_parent_taken_for_its_queued_gaps_commits_them_before_it_lets_go(
        writer: Writer, sink: Sink) -> None:
    """A lease already at SHARD_END is taken only to recover the gaps still queued for it;
    the consumer starts its processor at SHARD_END, hands the gaps over and lets the lease
    go. Each gap batch is committed and checkpointed before process_records returns:
    offered to the batch loop instead, it found the lease gone before foreach_batch, and
    every next owner did the same (simulator seed 1345)."""
    batcher = make(sink, BatchOptions(max_records=100, max_interval_s=3600,
                                      min_interval_s=3600))
    batcher.start()
    try:
        processor = batcher.processor_factory()
        processor.initialize(InitializeInput("shard-a", "SHARD_END", 0))
        gap_writer = Writer()
        gap = Checkpointer("shard-a", gap_writer, "token", Position("1000"))
        recovered = records(0, 101, 3)
        gap.mark_delivered(recovered[-1])
        processor.process_records(
            ProcessRecordsInput("shard-a", recovered, gap, None, is_recovery=True))
        assert gap_writer.of("shard-a") == [("1103", 0)]
    finally:
        batcher.stop(10)
    assert sum(t.num_rows for t in sink.tables) == 3
    assert batcher._shards == []


def test_a_batch_that_fails_then_loses_a_part_starts_over_as_a_new_batch(
        writer: Writer, sink: Sink) -> None:
    """The attempt a sink is told counts the failures of one batch: a failure counts, a
    refused part makes the rest a new batch (a new id, attempt 0, called at once)."""
    from kclpy.spark.batcher import FencedOut

    batcher = make(sink)
    a, b = Shard(batcher, writer, "shard-a"), Shard(batcher, writer, "shard-b")
    a.deliver(records(0, 0, 3))
    b.deliver(records(1, 0, 2))
    calls: list[tuple[str, int]] = []

    def foreach_batch(df: pa.Table, batch_id: str) -> None:
        info = current_batch()
        assert info is not None
        calls.append((batch_id, info.attempt))
        if len(calls) == 1:
            raise RuntimeError("sink down")
        if len(calls) == 2:
            raise FencedOut({"shard-a"}, "a later tenure committed")
        sink(df, batch_id)

    batcher._foreach_batch = foreach_batch

    info = batcher.run_once()

    assert [attempt for _, attempt in calls] == [0, 1, 0]
    assert calls[0][0] == calls[1][0] != calls[2][0]
    assert info is not None and info.batch_id == calls[2][0]
    assert batcher.stats.foreach_batch_failures == 1 and batcher.stats.fenced_parts == 1
    assert writer.of("shard-a") == [] and writer.of("shard-b") == [("2001", 0)]


def test_a_fenced_out_naming_none_of_the_batchs_leases_is_retried_like_a_failure(
        writer: Writer, sink: Sink) -> None:
    """A sink's FencedOut that names no lease of the batch drops nothing: it is an ordinary
    failure, retried with the same id after a backoff (never a tight loop of re-calls)."""
    from kclpy.spark.batcher import FencedOut

    batcher = make(sink)
    a = Shard(batcher, writer, "shard-a")
    a.deliver(records(0, 0, 2))
    ids: list[str] = []

    def foreach_batch(df: pa.Table, batch_id: str) -> None:
        ids.append(batch_id)
        if len(ids) == 1:
            raise FencedOut({"shard-z"}, "not this batch's")
        sink(df, batch_id)

    batcher._foreach_batch = foreach_batch

    assert batcher.run_once() is not None

    assert len(ids) == 2 and ids[0] == ids[1]
    assert batcher.stats.foreach_batch_failures == 1 and batcher.stats.fenced_parts == 0
    assert writer.of("shard-a") == [("1001", 0)]
