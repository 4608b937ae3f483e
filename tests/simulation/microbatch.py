"""(grown world) The Spark micro-batch path in the simulator, with zombie writers.

A history whose plan's mode is :data:`MICROBATCH` runs every worker as ``kclpy-worker
--spark-batch`` runs it (``kclpy.spark.runner.run_worker``'s order: the batcher starts
before the worker and stops after it), its ``foreach_batch`` the real
:class:`~kclpy.spark.sink.ParquetSink` over one folder every worker shares. Nothing here
needs a JVM: the seam is ``DataFrameFactory.createDataFrame``, which gets the Arrow table the
batcher built and returns a :class:`TableFrame` - the rows' keys, and a ``write.parquet``
that writes them as a small JSON file. ``ParquetSink``'s filter of committed rows is a Spark
expression, so :class:`SimSink` replaces that one method by the same rule on the rows; the
sink's commit (its lock, the lease fence through ``BatchInfo.commit_fence``, the tenure
check, the overlap check, the rename) is kclpy's own code.

Zombie writers come from ``foreach_batch`` itself: during the faults a write sometimes runs
long in virtual time - past the failover time (the lease moves while it writes: a pause, a
handoff, a balancing take) and past the graceful handoff timeout (the handoff gives up while
the holder's drain, 60 s, still waits for the write). ``foreach_batch`` also fails now and
then before the sink is called and after its commit landed (the batcher retries with the
same batch id, which the sink must recognise).

Invariants (the end's checks read the committed folders on disk, what Spark would read):

- ``committed-once``: no record is in two committed rows (``liveness``, from the commits,
  checks that every record is in one);
- ``committed-in-order``: every committed row lies in one of its commit's shard ranges, each
  range's rows are in the shard's order, and without lag recovery (whose gaps are older than
  live records on purpose) each shard's rows are in the shard's order across commits too.

A commit is what the history counts as a delivery: ``nothing-lost`` (a checkpoint passes
only committed records) and ``liveness`` (every record committed, every checkpoint at the
end) judge the sink's output, not what the batcher was handed. The batcher's processors
never ask for a restart, so the plan's ``restart_p`` has no effect here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from kclpy.config import KCLConfig
from kclpy.position import Position
from kclpy.records import Record
from kclpy.spark import sink as sink_module
from kclpy.spark.batcher import BatchInfo, BatchOptions, MicroBatcher
from kclpy.spark.sink import RANGES_FILE, ParquetSink
from kclpy.worker import Worker
from tests.simulation import scheduler
from tests.simulation.scheduler import Node

if TYPE_CHECKING:
    from tests.simulation.history import Observer, Plan

#: the plan's mode of a micro-batch history
MICROBATCH = "microbatch"
#: the committed rows of a ``batch_id=`` folder (the stand-in for its Parquet files)
ROWS_FILE = "rows.json"
#: per ``foreach_batch`` call during the faults: the write runs long (a zombie writer)
LONG_WRITE_P = 0.08
#: ... fails before the sink is called, or after its commit landed
FAIL_P = 0.03
#: the batcher's options: batches every second or so, backpressure within a few pages; the
#: drain (60 s, the default) outlasts the graceful handoff timeout (10 s), as in production
OPTIONS = BatchOptions(max_records=50, max_interval_s=1.0, min_interval_s=0.3,
                       max_pending_per_shard=30, retry_base_s=0.2, retry_cap_s=2.0,
                       checkpoint_attempts=3)

#: every history's folders live under one folder per process, removed at its exit
_ROOT = tempfile.TemporaryDirectory(prefix="kclpy-sim-sink-")

Row = tuple[str, str, int]


def hosts_microbatch(seed: int) -> bool:
    """One seed in five of the grown world runs the micro-batch path. Decided by the seed
    alone, so no other history changed; none of the seeds ``FOUND_36`` held before is one."""
    return seed % 5 == 0


def _position(row: Row) -> Position:
    return Position(row[1], row[2])


class TableFrame:
    """What ``foreach_batch`` is handed instead of a Spark DataFrame: the batch's rows, as
    ``(shard_id, sequence_number, sub_sequence_number)``, in the table's order."""

    def __init__(self, world: MicroBatchWorld, rows: list[Row]) -> None:
        self.world = world
        self.rows = rows

    @property
    def write(self) -> TableFrame:
        return self

    def parquet(self, path: str) -> None:
        """Stage the rows (Spark's ``df.write.parquet``), taking as long in virtual time as
        the world draws: a long write is what makes a zombie."""
        self.world.writing()
        folder = Path(path)
        folder.mkdir(parents=True)
        (folder / ROWS_FILE).write_text(json.dumps(self.rows), encoding="utf-8")


class StandInSpark:
    """The batcher's ``DataFrameFactory``: the Arrow table's keys, no JVM."""

    def __init__(self, world: MicroBatchWorld) -> None:
        self.world = world

    def createDataFrame(self, data: pa.Table) -> TableFrame:
        columns = [data.column(name).to_pylist()
                   for name in ("shard_id", "sequence_number", "sub_sequence_number")]
        return TableFrame(self.world, list(zip(*columns, strict=True)))


class SimSink(ParquetSink):
    """``ParquetSink`` with its one Spark expression done on the stand-in's rows."""

    @staticmethod
    def _drop_committed(df: Any, info: BatchInfo,
                        committed: Mapping[str, Sequence[Any]]) -> Any:
        """The rows no committed range holds: the rule of ``ParquetSink._drop_committed``
        (a range whose first position is a sentinel holds everything up to its last)."""
        assert isinstance(df, TableFrame)
        inside: dict[str, list[tuple[Position, Position]]] = defaultdict(list)
        for r in info.ranges:
            low = Position(r.first_sequence_number, r.first_sub_sequence_number)
            high = Position(r.last_sequence_number, r.last_sub_sequence_number)
            inside[r.shard_id].extend((c.first, c.last) for c in committed.get(r.shard_id, ())
                                      if not (c.first > high or c.last < low))

        def written(row: Row) -> bool:
            position = _position(row)
            return any(position <= last and (not first.is_record or position >= first)
                       for first, last in inside.get(row[0], ()))

        return TableFrame(df.world, [row for row in df.rows if not written(row)])


class BatchingWorker(Worker):
    """A worker whose shards feed a :class:`MicroBatcher`, run in ``run_worker``'s order:
    the shards' drains on the way out go through the batcher, so it outlives the worker."""

    def __init__(self, config: KCLConfig, batcher: MicroBatcher, session: Any) -> None:
        super().__init__(config, batcher.processor_factory, session=session)
        self.batcher = batcher
        batcher.on_fatal = lambda exc: self.shutdown()

    def run(self, *, install_signal_handlers: bool | None = None) -> None:
        self.batcher.start()
        try:
            super().run(install_signal_handlers=install_signal_handlers)
        finally:
            self.batcher.stop()


class MicroBatchWorld:
    """One history's sink folder, its workers' sinks, and what they committed."""

    def __init__(self, plan: Plan, observer: Observer) -> None:
        self.plan = plan
        self.observer = observer
        self.root = Path(tempfile.mkdtemp(prefix=f"seed-{plan.seed}-", dir=_ROOT.name))
        self.sinks: list[SimSink] = []
        #: every commit as it landed: its folder, the node, the rows, the ranges
        self.commits: list[tuple[str, str, list[Row], list[dict[str, Any]]]] = []
        self._seen: set[str] = set()

    def worker(self, config: KCLConfig, node: Node, session: Any) -> BatchingWorker:
        """A worker of ``node`` with a batcher and a sink of its own (one per process)."""
        sink = SimSink(self.root)
        self.sinks.append(sink)

        def foreach_batch(df: Any, batch_id: str) -> None:
            self._maybe_fail("before the sink was called")
            sink(df, batch_id)
            self._landed(node, batch_id)
            self._maybe_fail("after the sink committed")

        batcher = MicroBatcher(StandInSpark(self), foreach_batch, stream=config.stream_label,
                               options=OPTIONS)
        return BatchingWorker(config, batcher, session)

    # -- foreach_batch's behaviour ---------------------------------------------------------

    def _faulty(self) -> bool:
        sim = scheduler.ACTIVE
        assert sim is not None
        return sim.now < self.plan.quiet

    def writing(self) -> None:
        """A staging write's duration: short, or (during the faults) past the failover time
        and up to twice the graceful handoff timeout, ending by the quiet phase as a pause
        does (seed 765: a write of 19 s from 2 s before it held the shard's reader back
        through it, and retention, 19 s, trimmed records nobody had read - as it would a
        real sink that slow, but no fault of a quiet fleet)."""
        sim = scheduler.ACTIVE
        assert sim is not None
        if self._faulty() and sim.rng.random() < LONG_WRITE_P:
            seconds = min(sim.rng.uniform(self.plan.failover_s, 20.0),
                          self.plan.quiet - sim.now)
            sim.log(f"sink: a write of {seconds:.1f}s (a zombie if its lease moves)")
        else:
            seconds = sim.rng.uniform(0.01, 0.2)
        sim.sleep(seconds)

    def _maybe_fail(self, when: str) -> None:
        sim = scheduler.ACTIVE
        assert sim is not None
        if self._faulty() and sim.rng.random() < FAIL_P:
            raise RuntimeError(f"simulated: foreach_batch failed {when}")

    def _landed(self, node: Node, batch_id: str) -> None:
        """The sink returned: its batch's folder is committed (by this call, or by an
        earlier attempt of the same batch). Nothing yields between the sink's rename and
        its return, so this is the moment the commit landed."""
        folder = self.root / f"batch_id={batch_id}"
        if folder.name in self._seen:
            return
        self._seen.add(folder.name)
        rows = [(str(s), str(q), int(u)) for s, q, u in
                json.loads((folder / ROWS_FILE).read_text(encoding="utf-8"))]
        ranges = json.loads((folder / RANGES_FILE).read_text(encoding="utf-8"))
        self.commits.append((folder.name, node.name, rows, ranges))
        by_shard: dict[str, list[Record]] = defaultdict(list)
        for shard, seq, sub in rows:
            by_shard[shard].append(Record(seq, "", None, sub, data=b""))
        for shard, records in by_shard.items():
            self.observer.delivered_batch(node.name, shard, records)

    # -- the end ---------------------------------------------------------------------------

    def check_end(self) -> None:
        """``committed-once`` and ``committed-in-order`` over the folder as Spark would read
        it; then the folder goes."""
        try:
            self._check_once()
            self._check_order()
        finally:
            self.close()

    def _committed_on_disk(self) -> list[tuple[str, list[Row]]]:
        return [(folder.name, [(str(s), str(q), int(u)) for s, q, u in json.loads(
                    (folder / ROWS_FILE).read_text(encoding="utf-8"))])
                for folder in sorted(self.root.glob("batch_id=*"))]

    def _check_once(self) -> None:
        on_disk = self._committed_on_disk()
        unseen = sorted({name for name, _ in on_disk} - self._seen)
        if unseen:
            self.observer.fail("committed-once", f"{unseen[0]} is committed but no "
                               "foreach_batch returned it")
        counts = Counter(row for _, rows in on_disk for row in rows)
        twice = sorted((row for row, n in counts.items() if n > 1), key=lambda r: (
            r[0], _position(r)))
        if twice:
            shard, seq, sub = twice[0]
            where = [name for name, rows in on_disk if twice[0] in rows]
            self.observer.fail("committed-once", f"{len(twice)} record(s) committed more "
                               f"than once: {shard} {seq}/{sub} {counts[twice[0]]} times "
                               f"(in {', '.join(where)})")

    def _check_order(self) -> None:
        last: dict[str, Position] = {}
        for folder, node, rows, ranges in self.commits:
            runs: dict[int, list[Position]] = defaultdict(list)
            bounds = [(r["shard_id"], Position(r["first_sequence_number"],
                                               int(r["first_sub_sequence_number"])),
                       Position(r["last_sequence_number"], int(r["last_sub_sequence_number"])))
                      for r in ranges]
            for row in rows:
                position = _position(row)
                index = next((i for i, (shard, low, high) in enumerate(bounds)
                              if shard == row[0] and low <= position <= high), None)
                if index is None:
                    self.observer.fail("committed-in-order", f"{node}'s commit {folder} "
                                       f"holds {row[0]} {row[1]}/{row[2]}, outside its ranges")
                    return
                runs[index].append(position)
                if not self.plan.recovery:
                    before = last.get(row[0])
                    if before is not None and position <= before:
                        self.observer.fail("committed-in-order", f"{node}'s commit {folder} "
                                           f"holds {row[0]} {row[1]}/{row[2]} after "
                                           f"{before} was committed")
                        return
                    last[row[0]] = position
            for index, positions in runs.items():
                if positions != sorted(set(positions)):
                    self.observer.fail("committed-in-order", f"{node}'s commit {folder}: the "
                                       f"rows of {bounds[index][0]}'s range are out of order")
                    return

    def close(self) -> None:
        """Let the sinks go: their staging locks, and the process's commit lock of this
        folder (it holds the history's scheduler)."""
        for sink in self.sinks:
            sink.close()
        lock = str((self.root / sink_module.COMMIT_LOCK).resolve())
        with sink_module._GUARD:
            sink_module._THREAD_LOCKS.pop(lock, None)
        shutil.rmtree(self.root, ignore_errors=True)
