"""``spark.readStream.format("kinesis")``: a Kinesis source on PySpark's Python Data Source API.

Spark asks the driver-side reader for an end offset per micro-batch (``latestOffset``), then
runs one task per shard that moved (``partitions``/``read``) on the executors, which read
the shard between the two offsets with GetRecords themselves. No jar, no JVM code.

Design points, each forced by how Spark drives a Python source:

- The records are read once, by the executors. The driver plans without reading them: a
  batch ends at an arrival time a settle margin (``settleTime``) before planning, so the
  batch is every record of the shard that had arrived by then, whenever (and however often)
  an executor reads it (:mod:`kclpy.spark.reading`). To know whether a shard has anything
  new, the driver probes it with ``GetRecords(Limit=1)``, at most once per
  ``minFetchPeriod`` per shard, and lists shards at most once per ``shardFetchInterval``.
- A budget (rows, bytes, time per trigger) cannot be turned into an end without reading,
  so such a batch ends at the budget itself (an ``UPTO`` position, fixed when planned: the
  same records whenever it is read); the executor that reads it records the position it
  reached in ``metadataPath`` (:mod:`kclpy.spark.metadata`), where the driver finds the
  next batch's start. Without ``metadataPath`` the driver finds it by reading those
  records again, which rows and bytes allow (they stop at the same record every time) and
  a time budget does not (so it needs ``metadataPath``).
- The reader object is pickled to the executors, so it holds only options: boto3 clients
  are made inside each call and never stored, and ``__getstate__`` drops the driver's
  caches in case Spark pickles a driver-side instance.
- Spark 4.2 passes ``latestOffset(start, limit)`` and supports
  ``SupportsTriggerAvailableNow``; 4.0/4.1 call ``latestOffset()`` without arguments. One
  signature with defaults serves both: without a start, the reader continues from the last
  offset it produced or was shown (Spark re-announces the latest offset on restart through
  an empty ``partitions(offset, offset)`` call), with no row limit, because on 4.0/4.1 a
  limit would also cut Spark's own ``AvailableNow`` wrapper short.
- Enhanced fan-out (``consumerName``/``consumerArn``): the driver registers the consumer
  once per stream and puts its ARN in each partition; the executor subscribes instead of
  polling, bounded by the same planned end, and closes the subscription when done. The
  driver's probes stay ``GetRecords(Limit=1)``.
- Parents before children: a shard whose parent is in the offset and not yet at SHARD_END
  is not read, so a child's first batch comes after its parents' last one.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from kclpy.position import AFTER, AT_TIMESTAMP, LATEST, SHARD_END, Position
from kclpy.retrieval.clock import SKEW_MARGIN_MS, kinesis_clock
from kclpy.retrieval.registration import ConsumerRegistration
from kclpy.spark.arrow import SPARK_SCHEMA_DDL, records_to_batches
from kclpy.spark.metadata import ConflictingEndError, MetadataStore, open_store
from kclpy.spark.offsets import (
    OffsetEntry,
    UptoEnd,
    decode_entry,
    decode_offset,
    encode_offset,
)
from kclpy.spark.options import SourceOptions
from kclpy.spark.planning import (
    Limits,
    ShardNode,
    Target,
    live_entries,
    plan_batch,
    probe_keys,
    starts,
)
from kclpy.spark.reading import (
    BudgetedRead,
    DataLossError,
    Probe,
    ShardInfo,
    ShardReader,
    StreamRef,
    TaskRetrieval,
    list_shards,
    probe,
    read_range,
)

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["KinesisDataSource", "KinesisStreamReader", "SourceOptions", "register"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Shard:
    """A shard of one of the source's streams: where to read it, and its place among the
    offset's shards (its key is its shard id, or ``<stream>/<shard id>`` when the source
    reads several streams)."""

    stream: StreamRef
    info: ShardInfo
    node: ShardNode


@dataclass
class _ShardProbe:
    """The driver's view of one shard after one position: its probing reader (which keeps
    its iterator between probes) and what the last probe found."""

    position: Position
    reader: ShardReader
    found: Probe
    probed_at: float


class KinesisPartition(InputPartition):
    """One shard's part of a batch: read after ``start`` through ``end`` (encoded positions;
    an ``UPTO`` end carries its own start). ``key``: the shard's key in the offset."""

    def __init__(self, stream: StreamRef, shard: ShardInfo, key: str, start: str,
                 end: str, consumer_arn: str | None = None, mode: str = "polling") -> None:
        super().__init__(shard.shard_id)
        self.stream = stream
        self.shard = shard
        self.key = key
        self.start = start
        self.end = end
        #: enhanced fan-out: the stream's registered consumer the executor subscribes with
        self.consumer_arn = consumer_arn
        #: the retrieval mode's name, looked up in the executor's registry
        self.mode = mode


class KinesisDataSource(DataSource):
    """Register with :func:`register`; read with ``spark.readStream.format("kinesis")``."""

    @classmethod
    def name(cls) -> str:
        return "kinesis"

    def schema(self) -> str:
        # Spark asks for the schema in ``.load()``: checking the options here makes a bad
        # one fail there, before any query starts.
        SourceOptions.parse(self.options)
        return SPARK_SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KinesisStreamReader(SourceOptions.parse(self.options))


def register(spark: SparkSession) -> None:
    """Make ``format("kinesis")`` available in this session (Spark >= 4.0)."""
    spark.dataSource.register(KinesisDataSource)


class KinesisStreamReader(DataSourceStreamReader):
    """The driver side plans batches; ``read`` runs on the executors."""

    def __init__(self, options: SourceOptions, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self._clock = clock
        self._reset()

    def _reset(self) -> None:
        # Driver-side caches, rebuilt on demand (never pickled, see __getstate__).
        self._shards: dict[str, _Shard] = {}
        self._listed_at: float | None = None
        self._cursor: dict[str, OffsetEntry] | None = None
        self._target: Target | None = None
        self._probes: dict[str, _ShardProbe] = {}
        #: budgeted ends (encoded, with their shard key) -> the position they reached
        self._resolved: dict[tuple[str, str], Position] = {}
        #: which shard the last batch's row budget favoured, so that shards take turns
        self._turn = 0
        self._client: KinesisClient | None = None
        #: enhanced fan-out: each stream's consumer ARN (by stream label), registered once
        self._consumers: dict[str, str] = {}
        #: positions found trimmed or shards found expired by the driver, with
        #: failOnDataLoss=false (an executor that finds one logs it)
        self.data_loss_events = 0
        self._skew_logged = False

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._clock = time.time
        self._reset()

    # -- driver ---------------------------------------------------------------------------

    def _kinesis(self) -> KinesisClient:
        if self._client is None:
            self._client = self.options.client(pool=32, agent="kclpy-spark-driver")
        # Every answer from here on shows Kinesis' time (ListShards before a LATEST start).
        kinesis_clock(self._client)
        return self._client

    def _now_ms(self) -> int:
        """The local clock, but never later than Kinesis' time as its answers to this
        driver allow it to be (``KinesisClock.plan_ms``). Batch ends, a ``LATEST`` start
        and the ``AvailableNow`` target are arrival times, which Kinesis' clock stamps:
        one planned on a local clock ahead of Kinesis' would be in Kinesis' future, and
        the records that arrived before it after its batch was read would belong to no
        batch. (The executors' reads wait for Kinesis' time to pass an end anyway;
        planning on it keeps them from waiting.)"""
        clock = kinesis_clock(self._kinesis())
        local = round(self._clock() * 1000)
        ahead = clock.ahead_ms(local)
        if ahead > SKEW_MARGIN_MS and not self._skew_logged:
            self._skew_logged = True
            log.warning("kinesis source: the driver's clock is %d ms or more ahead of Kinesis' "
                        "(settleTime=%d ms): batches end on Kinesis' time instead", ahead,
                        self.options.settle_ms)
        return clock.plan_ms(local)

    def _list(self, force: bool = False) -> dict[str, _Shard]:
        """The streams' shards by offset key, from ListShards at most once per
        ``shardFetchInterval``."""
        now = self._clock()
        if (force or self._listed_at is None
                or now - self._listed_at >= self.options.shard_fetch_interval_ms / 1000):
            several = len(self.options.streams) > 1
            shards: dict[str, _Shard] = {}
            for stream in self.options.streams:
                def key(shard_id: str, label: str = stream.label) -> str:
                    return f"{label}/{shard_id}" if several else shard_id

                for info in list_shards(self._kinesis(), stream, self.options.read_retries):
                    node = ShardNode(key(info.shard_id),
                                     tuple(key(p) for p in info.parent_shard_ids), info.closed)
                    shards[node.key] = _Shard(stream, info, node)
            self._shards = shards
            self._listed_at = now
        return self._shards

    def _reader(self, shard: _Shard, start: Position,
                until_ms: int | None = None) -> ShardReader:
        return ShardReader(self._kinesis(), shard.stream, shard.info, start,
                           deaggregate=self.options.deaggregate,
                           limit=self.options.max_records_per_fetch, until_ms=until_ms,
                           fail_on_data_loss=self.options.fail_on_data_loss,
                           retries=self.options.read_retries)

    def initialOffset(self) -> dict[str, Any]:
        # (Listed first: the answer shows Kinesis' time for a LATEST start.)
        shards = list(self._list(force=True).values())
        kind = self.options.starting_position
        positions: dict[str, OffsetEntry]
        if kind == LATEST:
            # Everything that arrived before now is "consumed": no read needed to find it.
            at = Position.at_timestamp(self._now_ms())
            positions = {s.node.key: at for s in shards}
        elif kind == AT_TIMESTAMP:
            assert self.options.starting_timestamp_ms is not None
            at = Position.at_timestamp(self.options.starting_timestamp_ms)
            positions = {s.node.key: at for s in shards}
        else:
            positions = {s.node.key: Position.trim_horizon() for s in shards}
        self._cursor = positions
        return encode_offset(positions)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the target: every record that arrived before now, on the shards there are
        now. Waits ``settleTime`` once, so that the last batch can end at the target."""
        shards = frozenset(self._list(force=True))
        self._target = Target(self._now_ms(), shards)
        log.info("kinesis source: AvailableNow target: arrivals before %d on %d shards",
                 self._target.until_ms, len(shards))
        time.sleep(self.options.settle_ms / 1000)

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        n = self.options.max_records_per_batch
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        """The end of the next batch: every record that had arrived ``settleTime`` ago, on
        the shards a probe found something new on, cut by the budgets if there are any
        (``limit`` rows over all shards, ``maxFetchRecordsPerShard``, ``fetchBufferSize``,
        ``maxFetchDuration``).

        Without ``start`` (Spark 4.0/4.1) it continues from the reader's own cursor, with no
        budget. The calls here gather what AWS knows; :mod:`kclpy.spark.planning` decides.
        """
        limits: Limits | None = None
        if start is None:
            given = dict(self._cursor) if self._cursor is not None else decode_offset(
                self.initialOffset())
        else:
            given = decode_offset(start)
            rows = getattr(limit, "max_rows", None)
            if rows is not None or self.options.budgeted:
                options = self.options
                limits = Limits(rows, options.max_fetch_records_per_shard,
                                options.fetch_buffer_bytes, options.max_fetch_duration_ms)
        nodes = {key: shard.node for key, shard in self._list().items()}
        given, gone = live_entries(given, nodes)
        for key, position in gone.items():
            self._lost(f"shard {key} is gone (expired) before it was read to "
                       f"its end: records after {position.encode()} are lost")
        # A budgeted end stands for the position its executor reached: plan from that one.
        positions = starts(self._resolve_all(given), nodes)
        # (Kinesis' time before the probes, whose answers would move it.)
        now_ms = self._now_ms()
        found = self._probe_all(positions, probe_keys(given, positions, nodes, self._target))
        plan = plan_batch(given, positions, nodes, found, now_ms=now_ms,
                          settle_ms=self.options.settle_ms, target=self._target,
                          limits=limits, turn=self._turn, plan_id=uuid.uuid4().hex[:12])
        self._turn = plan.turn
        self._cursor = plan.offset
        return encode_offset(plan.offset)

    def _store(self) -> MetadataStore | None:
        return open_store(self.options)

    def _resolve_all(self, given: Mapping[str, OffsetEntry]) -> dict[str, Position]:
        """The offset's positions with every budgeted end replaced by where it stopped."""
        todo = [(s, e) for s, e in given.items()
                if isinstance(e, UptoEnd) and (s, e.encode()) not in self._resolved]
        for (key, end), reached in zip(todo, _parallel(
                [partial(self._resolve, s, e) for s, e in todo]), strict=True):
            self._resolved[(key, end.encode())] = reached
        return {key: self._resolved[(key, entry.encode())]
                if isinstance(entry, UptoEnd) else entry for key, entry in given.items()}

    def _resolve(self, key: str, end: UptoEnd) -> Position:
        """Where a budgeted end stopped: as its executor recorded it, or, when no executor
        did (no ``metadataPath``, or no task of the batch ran), by reading it here without
        its time budget (and recording that, for any later attempt at the batch)."""
        store = self._store()
        if store is not None:
            recorded = store.get(key, end)
            if recorded is not None:
                return recorded
        shard = self._shards.get(key) or self._list(force=True).get(key)
        if shard is None:
            raise DataLossError(f"shard {key} is gone (expired): where its part "
                                f"{end.encode()} of the last batch ended cannot be found")
        reading = BudgetedRead(self._reader(shard, end.start, until_ms=end.until_ms), end,
                               timed=False)
        for _ in reading:
            pass
        assert reading.reached is not None
        log.info("kinesis source: %s: no recorded end for %s; read to %s", key,
                 end.encode(), reading.reached.encode())
        return reading.reached if store is None else store.put(key, end,
                                                                reading.reached)

    def _lost(self, message: str) -> None:
        if self.options.fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip it")
        self.data_loss_events += 1
        log.warning("kinesis source: data loss (%d so far): %s; skipped (failOnDataLoss=false)",
                    self.data_loss_events, message)

    def _probe_all(self, positions: Mapping[str, Position],
                   ready: Sequence[str]) -> dict[str, Probe]:
        """What each ready shard holds after its position, probing each shard at most once
        per ``minFetchPeriod`` (a shard already known to hold something is not probed)."""
        now = self._clock()
        period = self.options.min_fetch_period_ms / 1000
        result: dict[str, Probe] = {}
        due: list[str] = []
        wait = 0.0
        for key in ready:
            cached = self._probes.get(key)
            if cached is not None and cached.position == positions[key] and (
                    cached.found.first_arrival_ms is not None or cached.found.shard_end):
                result[key] = cached.found
            elif cached is not None and now - cached.probed_at < period:
                if cached.position == positions[key]:
                    result[key] = cached.found
                elif self._target is not None:
                    # AvailableNow ends at the first batch with nothing new, so a shard
                    # at a new position must be probed: after its interval, not never.
                    wait = max(wait, period - (now - cached.probed_at))
                    due.append(key)
                else:
                    result[key] = Probe()
            else:
                due.append(key)
        if wait > 0:
            time.sleep(wait)
            now = self._clock()

        def one(key: str) -> tuple[_ShardProbe, int]:
            cached = self._probes.get(key)
            position = positions[key]
            if cached is None or cached.position != position:
                reader = self._reader(self._shards[key], position)
            else:
                reader = cached.reader
            lost = reader.data_loss_events
            found = probe(reader)
            return _ShardProbe(position, reader, found, now), reader.data_loss_events - lost

        for key, (fresh, lost) in zip(due, _parallel([partial(one, s) for s in due]),
                                           strict=True):
            self.data_loss_events += lost
            self._probes[key] = fresh
            result[key] = fresh.found
        return result

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, finish = decode_offset(start), decode_offset(end)
        self._cursor = dict(finish)
        parts: list[InputPartition] = []
        for key, stop in sorted(finish.items()):
            given = begin.get(key, Position.trim_horizon())
            if stop == given or given.is_shard_end:
                continue
            if isinstance(stop, UptoEnd):
                first = stop.start
            else:
                first = self._resolve_all({key: given})[key]
                if stop == first or first.is_shard_end or stop.kind not in (
                        AFTER, SHARD_END, AT_TIMESTAMP):
                    continue
                if first.kind == AFTER and stop.kind == AFTER and stop.extended <= first.extended:
                    continue
                if (first.kind == AT_TIMESTAMP and stop.kind == AT_TIMESTAMP
                        and (stop.timestamp_ms or 0) <= (first.timestamp_ms or 0)):
                    continue
            shard = self._shards.get(key) or self._list(force=True).get(key)
            if shard is None:
                self._lost(f"shard {key} is gone "
                           f"(expired): its part of the batch, after {first.encode()} "
                           f"through {stop.encode()}, cannot be read")
                continue
            parts.append(KinesisPartition(shard.stream, shard.info, key, first.encode(),
                                          stop.encode(), self._consumer(shard.stream),
                                          self.options.retrieval_mode))
        return parts

    def _consumer(self, stream: StreamRef) -> str | None:
        """The consumer ARN executors subscribe with (None: they poll): ``consumerArn`` as
        given, or ``consumerName``'s, registered by the driver when missing (once per
        stream and reader; kclpy never deregisters it, a consumer outlives a query)."""
        options = self.options
        if options.consumer_name is None:
            return options.consumer_arn
        arn = self._consumers.get(stream.label)
        if arn is None:
            registration = ConsumerRegistration(self._kinesis(), options.consumer_name,
                                                stream_name=stream.stream_name,
                                                stream_arn=stream.stream_arn)
            arn = self._consumers[stream.label] = registration.get_or_create()
            log.info("kinesis source: %s is read through enhanced fan-out consumer %s",
                     stream.label, arn)
        return arn

    def commit(self, end: dict[str, Any]) -> None:
        """Kinesis holds no consumer state and the offset log is the checkpoint; what goes
        are the recorded ends no batch can start from any more."""
        store = self._store()
        committed = decode_offset(end)
        for key, position in committed.items():
            if isinstance(position, UptoEnd) and store is not None:
                store.forget_older(key, position)
        keep = {(s, p.encode()) for s, p in committed.items() if isinstance(p, UptoEnd)}
        self._resolved = {k: v for k, v in self._resolved.items() if k in keep}

    # -- executors --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KinesisPartition)
        client = self.options.client(pool=4, agent="kclpy-spark-executor")
        start, end = Position.decode(partition.start), decode_entry(partition.end)
        label, shard_id = partition.stream.label, partition.shard.shard_id
        if isinstance(end, UptoEnd):
            store = self._store()
            recorded = None if store is None else store.get(partition.key, end)
            if recorded is None:
                budgeted = self._task_reader(client, partition, start, end)
                reading = BudgetedRead(budgeted, end)
                try:
                    for records in reading:
                        yield from records_to_batches(label, shard_id, records)
                finally:
                    budgeted.close()
                assert reading.reached is not None
                if store is not None:
                    winner = store.put(partition.key, end, reading.reached)
                    if winner != reading.reached:
                        raise ConflictingEndError(
                            f"shard {partition.key}: another attempt at {end.encode()} "
                            f"ended at {winner.encode()}, this one at "
                            f"{reading.reached.encode()}; Spark's retry reads to the former")
                return
            if recorded == start:
                return
            stop = recorded
        else:
            stop = end
        until_ms = stop.timestamp_ms if stop.kind == AT_TIMESTAMP else None
        reader = self._task_reader(client, partition, start, stop, until_ms)
        try:
            for records in read_range(reader, stop):
                yield from records_to_batches(label, shard_id, records)
        finally:
            reader.close()

    def _task_reader(self, client: KinesisClient, partition: KinesisPartition,
                     start: Position, end: OffsetEntry,
                     until_ms: int | None = None) -> ShardReader:
        # A fan-out read to a shard's end looks for it at the first idle event: kinesis-mock
        # never ends a subscription on a closed shard.
        return ShardReader(client, partition.stream, partition.shard, start,
                           deaggregate=self.options.deaggregate,
                           limit=self.options.max_records_per_fetch,
                           until_ms=end.until_ms if isinstance(end, UptoEnd) else until_ms,
                           fail_on_data_loss=self.options.fail_on_data_loss,
                           retries=self.options.read_retries,
                           retrieval=TaskRetrieval(
                               partition.mode, partition.consumer_arn,
                               shard_end_probe_s=0.0 if end.is_shard_end else 30.0))


def _parallel(calls: Sequence[Callable[[], _T]]) -> list[_T]:
    """Run per-shard calls on a short-lived pool (never kept: the reader must pickle)."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=min(16, len(calls))) as pool:
        return list(pool.map(lambda call: call(), calls))


try:
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # Spark 4.0/4.1: Spark's own AvailableNow wrapper drives latestOffset()
    pass
else:
    # A virtual subclass: the class itself stays importable on Spark versions without it.
    SupportsTriggerAvailableNow.register(KinesisStreamReader)
