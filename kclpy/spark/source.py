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
  Only a row limit makes the driver read: a batch that ends after N records can only be
  found by counting them.
- The reader object is pickled to the executors, so it holds only options: boto3 clients
  are made inside each call and never stored, and ``__getstate__`` drops the driver's
  caches in case Spark pickles a driver-side instance.
- Spark 4.2 passes ``latestOffset(start, limit)`` and supports
  ``SupportsTriggerAvailableNow``; 4.0/4.1 call ``latestOffset()`` without arguments. One
  signature with defaults serves both: without a start, the reader continues from the last
  offset it produced or was shown (Spark re-announces the latest offset on restart through
  an empty ``partitions(offset, offset)`` call), with no row limit, because on 4.0/4.1 a
  limit would also cut Spark's own ``AvailableNow`` wrapper short.
- Parents before children: a shard whose parent is in the offset and not yet at SHARD_END
  is not read, so a child's first batch comes after its parents' last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from kclpy.spark.arrow import SPARK_SCHEMA_DDL, records_to_batch
from kclpy.spark.offsets import (
    AFTER,
    AT_TIMESTAMP,
    SHARD_END,
    ShardPosition,
    decode_offset,
    encode_offset,
)
from kclpy.spark.options import SourceOptions
from kclpy.spark.reading import (
    DataLossError,
    Probe,
    ShardInfo,
    ShardReader,
    StreamRef,
    advance_counted,
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
    """A shard of one of the source's streams. Its key in an offset is its shard id, or
    ``<stream>/<shard id>`` when the source reads several streams."""

    stream: StreamRef
    info: ShardInfo
    key: str
    #: the keys of its parents (same stream)
    parents: tuple[str, ...]


@dataclass
class _ShardProbe:
    """The driver's view of one shard after one position: its probing reader (which keeps
    its iterator between probes) and what the last probe found."""

    position: ShardPosition
    #: None when no probe was made: a row-limited batch stopped short of the shard's end,
    #: so more is known to be there
    reader: ShardReader | None
    found: Probe
    probed_at: float


class KinesisPartition(InputPartition):
    """One shard's part of a batch: read after ``start`` through ``end`` (encoded positions).
    ``count``: the user records the driver counted in it, when it did (cuts ``Limit``)."""

    def __init__(self, stream: StreamRef, shard: ShardInfo, start: str, end: str,
                 count: int | None = None) -> None:
        super().__init__(shard.shard_id)
        self.stream = stream
        self.shard = shard
        self.start = start
        self.end = end
        self.count = count


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
        self._cursor: dict[str, ShardPosition] | None = None
        self._target_ms: int | None = None
        self._target_shards: frozenset[str] | None = None
        self._probes: dict[str, _ShardProbe] = {}
        self._counts: dict[tuple[str, str, str], int] = {}
        self._client: KinesisClient | None = None
        #: positions found trimmed or shards found expired by the driver, with
        #: failOnDataLoss=false (an executor that finds one logs it)
        self.data_loss_events = 0

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
        return self._client

    def _now_ms(self) -> int:
        return round(self._clock() * 1000)

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

                for info in list_shards(self._kinesis(), stream):
                    shards[key(info.shard_id)] = _Shard(
                        stream, info, key(info.shard_id),
                        tuple(key(p) for p in info.parent_shard_ids))
            self._shards = shards
            self._listed_at = now
        return self._shards

    def _reader(self, shard: _Shard, start: ShardPosition,
                until_ms: int | None = None) -> ShardReader:
        return ShardReader(self._kinesis(), shard.stream, shard.info, start,
                           deaggregate=self.options.deaggregate,
                           limit=self.options.max_records_per_fetch, until_ms=until_ms,
                           fail_on_data_loss=self.options.fail_on_data_loss)

    def initialOffset(self) -> dict[str, Any]:
        shards = list(self._list(force=True).values())
        kind = self.options.starting_position
        if kind == "LATEST":
            # Everything that arrived before now is "consumed": no read needed to find it.
            at = ShardPosition.at_timestamp(self._now_ms())
            positions = {s.key: at for s in shards}
        elif kind == AT_TIMESTAMP:
            assert self.options.starting_timestamp_ms is not None
            at = ShardPosition.at_timestamp(self.options.starting_timestamp_ms)
            positions = {s.key: at for s in shards}
        else:
            positions = {s.key: ShardPosition.trim_horizon() for s in shards}
        self._cursor = positions
        return encode_offset(positions)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the target: every record that arrived before now, on the shards there are
        now. Waits ``settleTime`` once, so that the last batch can end at the target."""
        self._target_ms = self._now_ms()
        self._target_shards = frozenset(self._list(force=True))
        log.info("kinesis source: AvailableNow target: arrivals before %d on %d shards",
                 self._target_ms, len(self._target_shards))
        time.sleep(self.options.settle_ms / 1000)

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        n = self.options.max_records_per_batch
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        """The end of the next batch: every record that had arrived ``settleTime`` ago, on
        the shards a probe found something new on, cut by ``limit`` rows if there is one.

        Without ``start`` (Spark 4.0/4.1) it continues from the reader's own cursor, with no
        row limit.
        """
        if start is None:
            positions = dict(self._cursor) if self._cursor is not None else decode_offset(
                self.initialOffset())
            budget: int | None = None
            per_shard: int | None = None
        else:
            positions = decode_offset(start)
            budget = getattr(limit, "max_rows", None)
            per_shard = self.options.max_fetch_records_per_shard
        shards = self._list()
        for shard_id in list(positions):
            if shard_id not in shards:
                position = positions.pop(shard_id)
                if not position.is_shard_end:
                    self._lost(f"shard {shard_id} is gone (expired) before it was read to "
                               f"its end: records after {position.encode()} are lost")
        # Children of a split or merge; absent from an offset means TRIM_HORIZON anyway,
        # listing them makes the offset show every shard the query knows.
        for shard_id in shards:
            positions.setdefault(shard_id, ShardPosition.trim_horizon())
        until_ms = self._now_ms() - self.options.settle_ms
        if self._target_ms is not None:
            until_ms = min(until_ms, self._target_ms)
        ready = [s for s in sorted(positions) if self._readable(s, positions)]
        found = self._probe_all(positions, ready)
        moving = []
        for shard_id in ready:
            seen = found[shard_id]
            if seen.shard_end:
                positions[shard_id] = ShardPosition.shard_end()
            elif seen.undecided or (seen.first_arrival_ms is not None
                                    and seen.first_arrival_ms < until_ms):
                moving.append(shard_id)
        until = ShardPosition.at_timestamp(until_ms)
        if budget is None and per_shard is None:
            for shard_id in moving:
                positions[shard_id] = until
        else:
            self._advance_counted(positions, moving, budget, per_shard, until)
        self._cursor = positions
        return encode_offset(positions)

    def _lost(self, message: str) -> None:
        if self.options.fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip it")
        self.data_loss_events += 1
        log.warning("kinesis source: data loss (%d so far): %s; skipped (failOnDataLoss=false)",
                    self.data_loss_events, message)

    def _readable(self, shard_id: str, positions: Mapping[str, ShardPosition]) -> bool:
        position = positions[shard_id]
        if position.is_shard_end:
            return False
        if self._target_shards is not None and shard_id not in self._target_shards:
            return False
        shard = self._shards[shard_id]
        if (self._target_ms is not None and position.kind == AT_TIMESTAMP
                and (position.timestamp_ms or 0) >= self._target_ms and not shard.info.closed):
            # Read to the AvailableNow target; an open shard has nothing more for this run
            # (a closed one is probed once more to find its end, which frees its children).
            return False
        return all(p not in positions or positions[p].is_shard_end for p in shard.parents)

    def _probe_all(self, positions: Mapping[str, ShardPosition],
                   ready: Sequence[str]) -> dict[str, Probe]:
        """What each ready shard holds after its position, probing each shard at most once
        per ``minFetchPeriod`` (a shard already known to hold something is not probed)."""
        now = self._clock()
        period = self.options.min_fetch_period_ms / 1000
        result: dict[str, Probe] = {}
        due: list[str] = []
        wait = 0.0
        for shard_id in ready:
            cached = self._probes.get(shard_id)
            if cached is not None and cached.position == positions[shard_id] and (
                    cached.found.first_arrival_ms is not None or cached.found.shard_end):
                result[shard_id] = cached.found
            elif cached is not None and now - cached.probed_at < period:
                if cached.position == positions[shard_id]:
                    result[shard_id] = cached.found
                elif self._target_ms is not None:
                    # AvailableNow ends at the first batch with nothing new, so a shard
                    # at a new position must be probed: after its interval, not never.
                    wait = max(wait, period - (now - cached.probed_at))
                    due.append(shard_id)
                else:
                    result[shard_id] = Probe()
            else:
                due.append(shard_id)
        if wait > 0:
            time.sleep(wait)
            now = self._clock()

        def one(shard_id: str) -> tuple[_ShardProbe, int]:
            cached = self._probes.get(shard_id)
            position = positions[shard_id]
            if cached is None or cached.position != position or cached.reader is None:
                reader = self._reader(self._shards[shard_id], position)
            else:
                reader = cached.reader
            lost = reader.data_loss_events
            found = probe(reader)
            return _ShardProbe(position, reader, found, now), reader.data_loss_events - lost

        for shard_id, (fresh, lost) in zip(due, _parallel([partial(one, s) for s in due]),
                                           strict=True):
            self.data_loss_events += lost
            self._probes[shard_id] = fresh
            result[shard_id] = fresh.found
        return result

    def _advance_counted(self, positions: dict[str, ShardPosition], moving: list[str],
                         budget: int | None, per_shard: int | None,
                         until: ShardPosition) -> None:
        """Cut the moving shards' batches by rows: an equal share of ``budget`` each, then
        what shards that ran dry left over, to those that did not. The driver reads these
        records (only the ones the batch needs: ``Limit`` is cut to the share) to find
        where each batch ends."""
        starts = {s: positions[s] for s in moving}
        caps: dict[str, int] = {}
        for i, shard_id in enumerate(moving):
            cap = per_shard if per_shard is not None else 2**31
            if budget is not None:
                share, extra = divmod(budget, len(moving))
                cap = min(cap, share + (1 if i < extra else 0))
            caps[shard_id] = cap
        counts = self._count_all(positions, caps, until)
        if budget is not None:
            left = budget - sum(counts.values())
            for shard_id in moving:
                if left <= 0:
                    break
                if positions[shard_id] in (until, ShardPosition.shard_end()):
                    continue
                cap = left if per_shard is None else min(left, per_shard - counts[shard_id])
                if cap <= 0:
                    continue
                more = self._count_all(positions, {shard_id: cap}, until)[shard_id]
                counts[shard_id] += more
                left -= more
        now = self._clock()
        for shard_id in moving:
            end = positions[shard_id]
            self._counts[(shard_id, starts[shard_id].encode(), end.encode())] = counts[shard_id]
            if end.kind == AFTER:
                # Cut by the limit before the time bound: the next batch need not wait for a
                # probe to know this shard has more (if the cut fell on its last settled
                # record, that batch's part is merely empty).
                assert until.timestamp_ms is not None
                self._probes[shard_id] = _ShardProbe(
                    end, None, Probe(first_arrival_ms=until.timestamp_ms - 1), now)

    def _count_all(self, positions: dict[str, ShardPosition], caps: Mapping[str, int],
                   until: ShardPosition) -> dict[str, int]:
        ids = [s for s in caps if caps[s] > 0]

        def one(shard_id: str) -> tuple[ShardPosition, int]:
            reader = self._reader(self._shards[shard_id], positions[shard_id],
                                  until_ms=until.timestamp_ms)
            return advance_counted(reader, positions[shard_id], caps[shard_id], until)

        counts = dict.fromkeys(caps, 0)
        for shard_id, (position, count) in zip(ids, _parallel([partial(one, s) for s in ids]),
                                               strict=True):
            positions[shard_id] = position
            counts[shard_id] = count
        return counts

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, finish = decode_offset(start), decode_offset(end)
        self._cursor = dict(finish)
        parts: list[InputPartition] = []
        for shard_id, stop in sorted(finish.items()):
            first = begin.get(shard_id, ShardPosition.trim_horizon())
            if stop == first or first.is_shard_end or stop.kind not in (
                    AFTER, SHARD_END, AT_TIMESTAMP):
                continue
            if first.kind == AFTER and stop.kind == AFTER and stop.extended <= first.extended:
                continue
            if (first.kind == AT_TIMESTAMP and stop.kind == AT_TIMESTAMP
                    and (stop.timestamp_ms or 0) <= (first.timestamp_ms or 0)):
                continue
            shard = self._shards.get(shard_id) or self._list(force=True).get(shard_id)
            if shard is None:
                self._lost(f"shard {shard_id} is gone "
                           f"(expired): its part of the batch, after {first.encode()} "
                           f"through {stop.encode()}, cannot be read")
                continue
            count = self._counts.get((shard_id, first.encode(), stop.encode()))
            parts.append(KinesisPartition(shard.stream, shard.info, first.encode(),
                                          stop.encode(), count))
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to keep: Kinesis holds no consumer state; the offset log is the checkpoint."""
        self._counts.clear()

    # -- executors --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KinesisPartition)
        client = self.options.client(pool=2, agent="kclpy-spark-executor")
        end = ShardPosition.decode(partition.end)
        try:
            reader = ShardReader(client, partition.stream, partition.shard,
                                 ShardPosition.decode(partition.start),
                                 deaggregate=self.options.deaggregate,
                                 limit=self.options.max_records_per_fetch,
                                 until_ms=end.timestamp_ms if end.kind == AT_TIMESTAMP else None,
                                 fail_on_data_loss=self.options.fail_on_data_loss)
            label = partition.stream.label
            for records in read_range(reader, end, count=partition.count):
                yield records_to_batch(label, partition.shard.shard_id, records)
        finally:
            client.close()


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
