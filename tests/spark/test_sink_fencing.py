"""Two workers writing one shard into one ``ParquetSink`` folder: a zombie whose
``foreach_batch`` was still running when its lease moved, and the lease's new owner, which
reads the same records again. Real lease coordinators (moto in-process, injected clocks), the
real lease fence, real Spark; each worker's write is held at a chosen point with events, so
the interleaving is forced, never waited for. Every row must be committed exactly once.

Also: a sink removes the staging folders a killed writer left behind, and only those."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from kclpy.checkpoint import Checkpointer
from kclpy.leases.coordinator import CoordinatorSettings, LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.position import Position
from kclpy.processor import InitializeInput, ProcessRecordsInput, ShutdownRequestedInput
from kclpy.records import Record
from kclpy.spark import BatchOptions, MicroBatcher
from kclpy.spark.arrow import records_to_table
from kclpy.spark.batcher import BatchInfo, ShardRange
from kclpy.spark.sink import ParquetSink
from tests.support.determinism import Clock, FirstChoiceRandom

FAILOVER = 10.0
#: far below the drain timeout, as the defaults are (30 s against 60 s)
HANDOFF_TIMEOUT = 2.0
OPTIONS = BatchOptions(min_interval_s=0.0, max_interval_s=3600.0, retry_base_s=0.01,
                       retry_cap_s=0.05, drain_timeout_s=3600.0)
#: how long a test waits for a thread it released before failing (liveness, not timing)
LIVE = 120.0


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        lease_table = LeaseTable(client, "app", sleep=lambda _: None)
        lease_table.create_if_missing()
        yield lease_table


def coordinator(table: LeaseTable, name: str, clock: Clock) -> tuple[LeaseCoordinator,
                                                                     list[str], list[str]]:
    """A coordinator, the leases it was told it lost and those it was asked to hand off."""
    settings = CoordinatorSettings(failover_time_s=FAILOVER,
                                   graceful_handoff_timeout_s=HANDOFF_TIMEOUT, renewal_threads=1)
    c = LeaseCoordinator(table, name, settings, clock=clock, rng=FirstChoiceRandom())
    lost: list[str] = []
    asked: list[str] = []
    c.add_lease_lost_listener(lost.append)
    c.add_handoff_listener(asked.append)
    return c, lost, asked


def records(start: int, n: int) -> list[Record]:
    return [Record(sequence_number=str(1000 + i), sub_sequence_number=0,
                   partition_key=f"pk-{i}", timestamp_millis=1_700_000_000_000 + i,
                   data=f"r{i}".encode())
            for i in range(start, start + n)]


class Held:
    """A point a worker's write stops at: ``reached`` is set there, and it goes on once the
    test sets ``go``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def stop_here(self) -> None:
        self.reached.set()
        assert self.go.wait(LIVE), "the test never let the held write go on"


class _HeldWriter:
    def __init__(self, df: Any, held: Held) -> None:
        self._df = df
        self._held = held

    def parquet(self, path: str) -> None:
        self._df.write.parquet(path)
        self._held.stop_here()


class _HeldFrame:
    """A DataFrame whose ``write.parquet`` writes, then stops at ``held`` - the sink has
    staged its files and not committed them yet. Anything else is the DataFrame's own (a
    filtered frame is a plain one: only the first staging of a batch is held)."""

    def __init__(self, df: Any, held: Held) -> None:
        self._df = df
        self._held = held

    @property
    def write(self) -> _HeldWriter:
        return _HeldWriter(self._df, self._held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._df, name)


class HoldingSpark:
    """The session as the batcher sees it; with ``held``, its next DataFrame's write stops
    there once."""

    def __init__(self, spark: Any, held: Held | None = None) -> None:
        self._spark = spark
        self.held = held

    def createDataFrame(self, data: Any) -> Any:
        df = self._spark.createDataFrame(data)
        held, self.held = self.held, None
        return df if held is None else _HeldFrame(df, held)


class Worker:
    """One worker's side of the shard: its batcher, its own sink over the shared folder (as
    another process would have), and the processor a consumer of its tenure drives."""

    def __init__(self, spark: Any, root: Path, coordinator: LeaseCoordinator, lease_key: str,
                 held: Held | None = None) -> None:
        lease = coordinator.get_held(lease_key)
        assert lease is not None and lease.concurrency_token is not None
        self.sink = ParquetSink(root)
        self.batcher = MicroBatcher(HoldingSpark(spark, held), self.sink, stream="orders",
                                    options=OPTIONS)
        self.lease_key = lease_key
        self.checkpointer = Checkpointer(lease_key, coordinator.fence, lease.concurrency_token,
                                         Position.trim_horizon())
        self.processor = self.batcher.processor_factory()
        self.processor.initialize(InitializeInput(lease_key, "TRIM_HORIZON", 0, "orders"))

    def deliver(self, batch: list[Record]) -> None:
        self.checkpointer.mark_delivered(batch[-1])
        self.processor.process_records(
            ProcessRecordsInput(self.lease_key, batch, self.checkpointer, None))

    def run_once_in_thread(self) -> tuple[threading.Thread, list[BatchInfo | None]]:
        result: list[BatchInfo | None] = []
        thread = threading.Thread(target=lambda: result.append(self.batcher.run_once()),
                                  daemon=True)
        thread.start()
        return thread, result


def committed_rows(spark: Any, root: Path) -> Counter[tuple[str, str]]:
    rows = spark.read.parquet(str(root)).select("shard_id", "sequence_number").collect()
    return Counter((row.shard_id, row.sequence_number) for row in rows)


def take_after_expiry(table: LeaseTable, lease_key: str) -> tuple[LeaseCoordinator, Clock,
                                                                  LeaseCoordinator]:
    """A took ``lease_key``; B, whose clock runs on while A's stands still (A is paused, or
    its renewals do not reach the table), sees it expire and takes it. A's own fence still
    lets A write: a zombie that does not know yet."""
    assert table.create(Lease(lease_key))
    a, _, _ = coordinator(table, "A", Clock())
    assert [lease.lease_key for lease in a.run_taker_once()] == [lease_key]
    clock_b = Clock()
    b, _, _ = coordinator(table, "B", clock_b)
    assert b.run_taker_once() == []
    clock_b.advance(FAILOVER + 1)
    assert [lease.lease_key for lease in b.run_taker_once()] == [lease_key]
    return a, clock_b, b


@pytest.mark.slow
def test_a_zombie_whose_write_was_under_way_when_its_lease_moved_commits_nothing(
        spark: Any, table: LeaseTable, tmp_path: Path) -> None:
    """A staged records 0-9 and stops before its commit; meanwhile its lease expires from
    B's point of view, B takes it and commits 0-14. A's own fence still lets it write (its
    clock stands still): the sink's commit must still refuse it, since B's later tenure
    committed that shard."""
    root = tmp_path / "out"
    held = Held()
    assert table.create(Lease("shard-0"))
    a, _, _ = coordinator(table, "A", Clock())
    a.run_taker_once()
    zombie = Worker(spark, root, a, "shard-0", held)
    zombie.deliver(records(0, 10))
    thread, result = zombie.run_once_in_thread()
    assert held.reached.wait(LIVE)

    clock_b = Clock()
    b, _, _ = coordinator(table, "B", clock_b)
    assert b.run_taker_once() == []
    clock_b.advance(FAILOVER + 1)
    assert [lease.lease_key for lease in b.run_taker_once()] == ["shard-0"]
    owner = Worker(spark, root, b, "shard-0")
    owner.deliver(records(0, 15))
    assert owner.batcher.run_once() is not None

    held.go.set()
    thread.join(LIVE)
    assert not thread.is_alive()

    rows = committed_rows(spark, root)
    assert rows == Counter({("shard-0", str(1000 + i)): 1 for i in range(15)})
    assert result == [None], "the zombie's batch was not committed"
    assert zombie.batcher.stats.fenced_parts == 1
    stored = table.get("shard-0")
    assert stored is not None and stored.checkpoint == Position("1014")


@pytest.mark.slow
def test_a_new_owner_whose_rows_a_zombie_committed_meanwhile_writes_them_again_without_them(
        spark: Any, table: LeaseTable, tmp_path: Path) -> None:
    """The other order: B (the new owner) staged 0-14 and stops before its commit; the
    zombie A, whose fence still lets it write and whose tenure nobody committed past yet,
    commits 0-9. B's commit finds a range committed since it filtered its rows, overlapping
    them: it writes its rows again without 0-9, and commits 10-14 only."""
    root = tmp_path / "out"
    held = Held()
    a, _, b = take_after_expiry(table, "shard-0")
    zombie = Worker(spark, root, a, "shard-0")
    owner = Worker(spark, root, b, "shard-0", held)
    owner.deliver(records(0, 15))
    thread, result = owner.run_once_in_thread()
    assert held.reached.wait(LIVE)

    zombie.deliver(records(0, 10))
    assert zombie.batcher.run_once() is not None

    held.go.set()
    thread.join(LIVE)
    assert not thread.is_alive()

    rows = committed_rows(spark, root)
    assert rows == Counter({("shard-0", str(1000 + i)): 1 for i in range(15)})
    assert result and result[0] is not None
    stored = table.get("shard-0")
    assert stored is not None and stored.checkpoint == Position("1014")


@pytest.mark.slow
def test_a_write_that_outlasts_the_handoff_timeout_is_not_committed_and_the_drain_ends(
        spark: Any, table: LeaseTable, tmp_path: Path) -> None:
    """A is asked to hand a lease to B; its shard's batch is being written, and its drain
    (``shutdown_requested``) waits for it with a drain timeout far beyond the handoff
    timeout. The handoff gives up (A lets go), B adopts the lease and commits the same
    records. Once A's write goes on, its commit is refused, nothing of it is committed, and
    A's drain ends then - not at its own timeout."""
    root = tmp_path / "out"
    for key in ("shard-0", "shard-1"):
        assert table.create(Lease(key))
    clock = Clock()
    a, a_lost, a_asked = coordinator(table, "A", clock)
    assert len(a.run_taker_once()) == 2
    b, _, _ = coordinator(table, "B", clock)
    assert b.run_taker_once() == []
    (key,) = [k for k in ("shard-0", "shard-1") if (table.get(k) or Lease(k)).checkpoint_owner]

    held = Held()
    old = Worker(spark, root, a, key, held)
    old.deliver(records(0, 10))
    thread, result = old.run_once_in_thread()
    assert held.reached.wait(LIVE)

    a.run_renewer_once()
    assert a_asked == [key]
    drain = threading.Thread(target=old.processor.shutdown_requested,
                             args=(ShutdownRequestedInput(key, old.checkpointer),),
                             daemon=True)
    drain.start()
    while key not in a_lost:
        clock.advance(FAILOVER / 4)
        a.run_renewer_once(due_only=True)
    assert [lease.lease_key for lease in b.poll_handoffs()] == [key]
    new = Worker(spark, root, b, key)
    new.deliver(records(0, 15))
    assert new.batcher.run_once() is not None

    held.go.set()
    thread.join(LIVE)
    drain.join(LIVE)
    assert not thread.is_alive() and not drain.is_alive()

    rows = committed_rows(spark, root)
    assert rows == Counter({(key, str(1000 + i)): 1 for i in range(15)})
    assert result == [None]
    stored = table.get(key)
    assert stored is not None and stored.checkpoint == Position("1014")


@pytest.mark.slow
def test_a_sink_removes_the_staging_a_killed_writer_left_and_keeps_a_live_ones(
        spark: Any, tmp_path: Path) -> None:
    """A writer killed part way leaves ``_staging/<its id>/`` and an unlocked lock file; a
    writer of an earlier kclpy left ``_staging/<batch id>-<uuid>``. A new sink removes
    both when it starts writing, and leaves alone the staging of a sink alive in another
    process (its lock is held)."""
    root = tmp_path / "out"
    staging = root / "_staging"
    dead = staging / "deadbeef" / "kclpy-0-1"
    dead.mkdir(parents=True)
    (dead / "part-0.parquet").write_bytes(b"half")
    (staging / "deadbeef.lock").touch()
    old_style = staging / "kclpy-0123-4567"
    old_style.mkdir()
    live = staging / "cafe" / "kclpy-2-3"
    live.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys; f = open(sys.argv[1], 'a+b'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); sys.stdin.read()", str(staging / "cafe.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        sink = ParquetSink(root)
        df = spark.createDataFrame(records_to_table("s", [("shard-0", records(0, 1))]))
        sink.write(df, BatchInfo("b1", "s", (ShardRange("shard-0", "1000", 0, "1000", 0, 1),),
                                 0))
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(LIVE)
    assert not dead.parent.exists() and not (staging / "deadbeef.lock").exists()
    assert not old_style.exists()
    assert live.exists()
    assert committed_rows(spark, root) == Counter({("shard-0", "1000"): 1})
