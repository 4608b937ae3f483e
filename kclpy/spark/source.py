"""``spark.readStream.format("kinesis")``: a Kinesis source on PySpark's Python Data Source API.

Spark asks the driver-side reader for an end offset per micro-batch (``latestOffset``), then
runs one task per shard that moved (``partitions``/``read``) on the executors, which read
the shard between the two offsets with GetRecords themselves. No jar, no JVM code.

Design points, each forced by how Spark drives a Python source:

- Offsets are per-shard positions (:mod:`kclpy.spark.offsets`). The driver finds the end of
  a batch by reading forward from the start (Kinesis has no "where does the data end" call),
  bounded by the read limit; executors read the same range again. Reading twice is the cost
  of executors doing the work in parallel; ``maxFetchRecordsPerShard`` bounds the driver's
  share per batch.
- The reader object is pickled to the executors, so it holds only options: boto3 clients
  are made inside each call and never stored, and ``__getstate__`` drops the driver's
  caches in case Spark pickles a driver-side instance.
- Spark 4.2 passes ``latestOffset(start, limit)`` and supports
  ``SupportsTriggerAvailableNow``; 4.0/4.1 call ``latestOffset()`` without arguments. One
  signature with defaults serves both: without a start, the reader continues from the last
  offset it produced or was shown (Spark re-announces the latest offset on restart through
  an empty ``partitions(offset, offset)`` call), and reads to the tip, because on 4.0/4.1 a
  limit would also cut Spark's own ``AvailableNow`` wrapper short.
- Parents before children: a shard whose parent is in the offset and not yet at SHARD_END
  is not read, so a child's first batch comes after its parents' last one. New shards are
  found with ListShards at every ``latestOffset``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import botocore.config
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from kclpy.config import parse_timestamp
from kclpy.errors import ConfigError
from kclpy.spark.arrow import SPARK_SCHEMA_DDL, records_to_batch
from kclpy.spark.offsets import (
    AFTER,
    AT_TIMESTAMP,
    ShardPosition,
    decode_offset,
    encode_offset,
)
from kclpy.spark.reading import (
    ShardInfo,
    ShardReader,
    StreamRef,
    advance,
    list_shards,
    read_range,
    tip,
)

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["KinesisDataSource", "KinesisStreamReader", "SourceOptions", "register"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_POSITIONS = {"TRIM_HORIZON": "TRIM_HORIZON", "EARLIEST": "TRIM_HORIZON", "LATEST": "LATEST",
              "AT_TIMESTAMP": "AT_TIMESTAMP"}


@dataclass(frozen=True)
class SourceOptions:
    """The reader's whole configuration: plain values, so it pickles to the executors."""

    stream: StreamRef
    region: str | None = None
    endpoint_url: str | None = None
    starting_position: str = "LATEST"
    starting_timestamp_ms: int | None = None
    max_records_per_batch: int | None = None
    max_fetch_records_per_shard: int = 100_000
    max_records_per_fetch: int = 10_000
    deaggregate: bool = True
    #: how far back the driver looks for a shard's newest record (LATEST, AvailableNow);
    #: must exceed any clock skew between the driver and Kinesis
    tip_window_s: float = 60.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """From ``.option(...)`` values (names case-insensitive); ConfigError names the option."""
        opts = {str(k).lower(): str(v) for k, v in options.items()}

        def integer(name: str, default: int | None, low: int, high: int) -> int | None:
            raw = opts.get(name.lower())
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(name, f"{raw!r} is not an integer") from None
            if not low <= value <= high:
                raise ConfigError(name, f"must be between {low} and {high}, got {value}")
            return value

        name, arn = opts.get("streamname"), opts.get("streamarn")
        if not name and not arn:
            raise ConfigError("streamName", "streamName or streamArn is required")
        raw_position = opts.get("startingposition", "LATEST").strip().upper()
        position = _POSITIONS.get(raw_position)
        if position is None:
            raise ConfigError("startingPosition",
                              f"{raw_position!r} is not TRIM_HORIZON, LATEST or AT_TIMESTAMP")
        timestamp_ms = None
        if position == "AT_TIMESTAMP":
            raw_ts = opts.get("timestamp")
            if not raw_ts:
                raise ConfigError("timestamp", "required with startingPosition AT_TIMESTAMP")
            try:
                timestamp_ms = round(parse_timestamp(raw_ts).timestamp() * 1000)
            except ValueError:
                raise ConfigError("timestamp", f"{raw_ts!r} is not ISO 8601 or epoch "
                                  "seconds") from None
        deagg = opts.get("deaggregate", "true").strip().lower()
        if deagg not in ("true", "false"):
            raise ConfigError("deaggregate", f"{deagg!r} is not true or false")
        max_shard = integer("maxFetchRecordsPerShard", 100_000, 1, 2**31)
        per_fetch = integer("maxRecordsPerFetch", 10_000, 1, 10_000)
        assert max_shard is not None and per_fetch is not None
        return cls(
            stream=StreamRef(name or None, arn or None),
            region=opts.get("region") or None,
            endpoint_url=opts.get("endpointurl") or None,
            starting_position=position,
            starting_timestamp_ms=timestamp_ms,
            max_records_per_batch=integer("maxRecordsPerBatch", None, 1, 2**31),
            max_fetch_records_per_shard=max_shard,
            max_records_per_fetch=per_fetch,
            deaggregate=deagg == "true",
        )

    def client(self, pool: int = 10) -> KinesisClient:
        # One attempt per botocore call: retrieval retries with its own jittered backoff.
        config = botocore.config.Config(
            max_pool_connections=pool, retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=10, read_timeout=30)
        return boto3.session.Session(region_name=self.region).client(
            "kinesis", endpoint_url=self.endpoint_url, config=config)


class KinesisPartition(InputPartition):
    """One shard's part of a batch: read after ``start`` through ``end`` (encoded positions)."""

    def __init__(self, shard: ShardInfo, start: str, end: str) -> None:
        super().__init__(shard.shard_id)
        self.shard = shard
        self.start = start
        self.end = end


class KinesisDataSource(DataSource):
    """Register with :func:`register`; read with ``spark.readStream.format("kinesis")``."""

    @classmethod
    def name(cls) -> str:
        return "kinesis"

    def schema(self) -> str:
        return SPARK_SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KinesisStreamReader(SourceOptions.parse(self.options))


def register(spark: SparkSession) -> None:
    """Make ``format("kinesis")`` available in this session (Spark >= 4.0)."""
    spark.dataSource.register(KinesisDataSource)


class KinesisStreamReader(DataSourceStreamReader):
    """The driver side plans batches; ``read`` runs on the executors."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        # Driver-side caches, rebuilt on demand (never pickled, see __getstate__).
        self._shards: dict[str, ShardInfo] = {}
        self._cursor: dict[str, ShardPosition] | None = None
        self._target: dict[str, ShardPosition] | None = None
        self._client: KinesisClient | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._shards = {}
        self._cursor = None
        self._target = None
        self._client = None

    # -- driver ---------------------------------------------------------------------------

    def _kinesis(self) -> KinesisClient:
        if self._client is None:
            self._client = self.options.client(pool=32)
        return self._client

    def _list(self) -> dict[str, ShardInfo]:
        self._shards = {s.shard_id: s for s in list_shards(self._kinesis(), self.options.stream)}
        return self._shards

    def _reader(self, shard: ShardInfo, start: ShardPosition) -> ShardReader:
        return ShardReader(self._kinesis(), self.options.stream, shard, start,
                           deaggregate=self.options.deaggregate,
                           limit=self.options.max_records_per_fetch)

    def _tips(self, shards: Sequence[ShardInfo]) -> dict[str, ShardPosition]:
        window_ms = round((time.time() - self.options.tip_window_s) * 1000)
        start = ShardPosition.at_timestamp(window_ms)

        def one(shard: ShardInfo) -> ShardPosition:
            return tip(self._reader(shard, start), window_ms)

        tips = _parallel([partial(one, s) for s in shards])
        return {s.shard_id: t for s, t in zip(shards, tips, strict=True)}

    def initialOffset(self) -> dict[str, Any]:
        shards = list(self._list().values())
        kind = self.options.starting_position
        if kind == "LATEST":
            positions = self._tips(shards)
        elif kind == AT_TIMESTAMP:
            assert self.options.starting_timestamp_ms is not None
            at = ShardPosition.at_timestamp(self.options.starting_timestamp_ms)
            positions = {s.shard_id: at for s in shards}
        else:
            positions = {s.shard_id: ShardPosition.trim_horizon() for s in shards}
        self._cursor = positions
        return encode_offset(positions)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the target: every shard's tip now. Shards created later are not read in this
        run, and no shard is read beyond its target."""
        self._target = self._tips(list(self._list().values()))
        log.info("kinesis source: AvailableNow target %s", encode_offset(self._target))

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        n = self.options.max_records_per_batch
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        """The end of the next batch: ``start`` moved forward by up to ``limit`` rows.

        Without ``start`` (Spark 4.0/4.1) it continues from the reader's own cursor and
        reads every shard to its tip.
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
                if not positions[shard_id].is_shard_end:
                    log.warning("kinesis source: shard %s is gone from the stream (expired) "
                                "before it was read to its end", shard_id)
                del positions[shard_id]
        # Children of a split or merge; absent from an offset means TRIM_HORIZON anyway,
        # listing them makes the offset show every shard the query knows.
        for shard_id in shards:
            positions.setdefault(shard_id, ShardPosition.trim_horizon())
        ready = [s for s in sorted(positions) if self._readable(s, positions)]
        self._advance(positions, ready, budget, per_shard)
        self._cursor = positions
        return encode_offset(positions)

    def _readable(self, shard_id: str, positions: Mapping[str, ShardPosition]) -> bool:
        position = positions[shard_id]
        if position.is_shard_end:
            return False
        if self._target is not None:
            bound = self._target.get(shard_id)
            if bound is None or (bound.kind == AFTER and position.kind == AFTER
                                 and position.extended >= bound.extended):
                return False
        info = self._shards[shard_id]
        return all(p not in positions or positions[p].is_shard_end
                   for p in info.parent_shard_ids)

    def _advance(self, positions: dict[str, ShardPosition], ready: list[str],
                 budget: int | None, per_shard: int | None) -> None:
        """Move the ready shards forward in place: an equal share of ``budget`` each, then
        what shards that ran dry left over, to those that did not."""
        caps: dict[str, int | None] = {s: per_shard for s in ready}
        if budget is not None and ready:
            share, extra = divmod(budget, len(ready))
            for i, shard_id in enumerate(ready):
                cap = share + (1 if i < extra else 0)
                caps[shard_id] = cap if per_shard is None else min(cap, per_shard)
        results = self._advance_all(positions, caps)
        if budget is None:
            return
        left = budget - sum(n for n, _ in results.values())
        for shard_id in ready:
            count, dry = results[shard_id]
            if left <= 0:
                break
            if dry or positions[shard_id].is_shard_end:
                continue
            cap = left if per_shard is None else min(left, per_shard - count)
            if cap <= 0:
                continue
            more = self._advance_all(positions, {shard_id: cap})[shard_id][0]
            left -= more

    def _advance_all(self, positions: dict[str, ShardPosition],
                     caps: Mapping[str, int | None]) -> dict[str, tuple[int, bool]]:
        """Advance shards in parallel; per shard (records passed, ran dry before its cap)."""
        ids = list(caps)

        def one(shard_id: str) -> tuple[ShardPosition, int]:
            bound = self._target.get(shard_id) if self._target is not None else None
            reader = self._reader(self._shards[shard_id], positions[shard_id])
            return advance(reader, positions[shard_id], caps[shard_id], bound)

        outcomes = _parallel([partial(one, s) for s in ids])
        results = {}
        for shard_id, (position, count) in zip(ids, outcomes, strict=True):
            positions[shard_id] = position
            cap = caps[shard_id]
            results[shard_id] = (count, cap is None or count < cap)
        return results

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, finish = decode_offset(start), decode_offset(end)
        self._cursor = dict(finish)
        parts: list[InputPartition] = []
        for shard_id, stop in sorted(finish.items()):
            first = begin.get(shard_id, ShardPosition.trim_horizon())
            if stop == first or stop.kind not in (AFTER, "SHARD_END"):
                continue
            if first.kind == AFTER and stop.kind == AFTER and stop.extended <= first.extended:
                continue
            shard = self._shards.get(shard_id) or self._list().get(shard_id)
            if shard is None:
                log.warning("kinesis source: shard %s is gone; its batch part is skipped",
                            shard_id)
                continue
            parts.append(KinesisPartition(shard, first.encode(), stop.encode()))
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: Kinesis keeps no consumer state; the offset log is the checkpoint."""

    # -- executors --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KinesisPartition)
        client = self.options.client(pool=2)
        try:
            reader = ShardReader(client, self.options.stream, partition.shard,
                                 ShardPosition.decode(partition.start),
                                 deaggregate=self.options.deaggregate,
                                 limit=self.options.max_records_per_fetch)
            label = self.options.stream.label
            for records in read_range(reader, ShardPosition.decode(partition.end)):
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
