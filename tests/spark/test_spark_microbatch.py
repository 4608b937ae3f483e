"""A real Worker (kinesis-mock + moto's DynamoDB over HTTP) feeding Spark micro-batches that a
foreach_batch writes to Parquet, with a failure injected after a write; the exactly-once
Parquet sink on its own; and the CLI hook."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import pytest

from kclpy import KCLConfig
from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from kclpy.spark import BatchOptions, current_batch, run_worker
from kclpy.spark.batcher import BatchInfo, ShardRange
from kclpy.spark.runner import load_callable, run_spark_batch_worker
from kclpy.spark.sink import ParquetSink
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_aggregated,
    put_plain,
    unique_name,
    wait_for,
)


def produce(kinesis: Any, stream: str, tag: str, plain: int, aggregates: int,
            per_aggregate: int = 20) -> list[bytes]:
    payloads = [f"{tag}-plain-{n}".encode() for n in range(plain)]
    put_plain(kinesis, stream, payloads)
    aggregated = [f"{tag}-kpl-{n}".encode() for n in range(aggregates * per_aggregate)]
    put_aggregated(kinesis, stream, aggregated, per_aggregate)
    return payloads + aggregated


class FailingOnceSink:
    """kclpy's ParquetSink, failing once right after it committed the second batch."""

    def __init__(self, root: Path) -> None:
        self.sink = ParquetSink(root)
        self.committed = 0
        self.failures_left = 1
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, df: Any, batch_id: str) -> None:
        info = current_batch()
        assert info is not None
        self.sink(df, batch_id)
        with self.lock:
            self.calls.append((batch_id, info.attempt))
            if self.committed and self.failures_left:
                self.failures_left -= 1
                raise RuntimeError("injected: the sink failed after writing")
            self.committed += sum(r.count for r in info.ranges)


@pytest.mark.integration
@pytest.mark.slow
def test_worker_micro_batches_in_parquet_equal_the_produced_records(
        spark: Any, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-mb")
    create_stream(kinesis, stream, 2)
    expected = produce(kinesis, stream, "one", plain=200, aggregates=3)
    config = KCLConfig(
        application_name=unique_name("spark-app"), stream_name=stream, region="us-east-1",
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON", failover_time_ms=3000,
        idle_time_between_reads_ms=100, shard_sync_interval_ms=1000,
        parent_shard_poll_interval_ms=200, shutdown_grace_ms=10000, task_backoff_time_ms=50)
    options = BatchOptions(max_records=150, min_interval_s=0.1, max_interval_s=0.5,
                           retry_base_s=0.05, retry_cap_s=0.2)
    sink = FailingOnceSink(tmp_path / "out")
    workers: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run_worker(config, sink, spark=spark, options=options, on_started=workers.append)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=target, name="spark-worker", daemon=True)
    thread.start()
    try:
        wait_for(lambda: sink.committed >= len(expected), 180, "first wave committed")
        expected += produce(kinesis, stream, "two", plain=100, aggregates=2)
        wait_for(lambda: sink.committed >= len(expected), 180, "second wave committed")
    finally:
        wait_for(lambda: bool(workers), 30, "worker started")
        workers[0].shutdown()
        thread.join(120)
    assert not thread.is_alive(), "worker did not stop"
    assert not errors, errors

    assert sink.failures_left == 0, "the injected failure happened"
    failed_id = next(bid for bid, attempt in sink.calls if attempt == 1)
    assert [a for bid, a in sink.calls if bid == failed_id] == [0, 1]
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    seen = collections.Counter(bytes(r.data) for r in rows)
    assert seen == collections.Counter(expected)
    assert {r.stream for r in rows} == {stream}
    # every shard's lease checkpoint is the last record Spark received from it
    last: dict[str, tuple[int, int]] = {}
    for r in rows:
        last[r.shard_id] = max(last.get(r.shard_id, (0, 0)),
                               (int(r.sequence_number), r.sub_sequence_number))
    items = dynamodb_client(moto_server.url).scan(
        TableName=config.lease_table_name, ConsistentRead=True)["Items"]
    checkpoints = {i["leaseKey"]["S"]: (int(i["checkpoint"]["S"]),
                                        int(i["checkpointSubSequenceNumber"]["N"]))
                   for i in items}
    assert checkpoints == last


def test_parquet_sink_skips_a_committed_retry_and_drops_a_replayed_prefix(
        spark: Any, tmp_path: Path) -> None:
    from kclpy.records import Record
    from kclpy.spark.arrow import records_to_table

    def batch(shard_id: str, first: int, last: int) -> tuple[Any, BatchInfo]:
        # 57-digit sequence numbers, sub-records 0 and 1: beyond any Spark integer type
        base = 10**56
        records = [Record(sequence_number=str(base + n), sub_sequence_number=sub,
                          partition_key="pk", timestamp_millis=0,
                          data=f"{shard_id}-{n}-{sub}".encode())
                   for n in range(first, last + 1) for sub in (0, 1)]
        rng = ShardRange(shard_id, str(base + first), 0, str(base + last), 1, len(records))
        info = BatchInfo(f"id-{shard_id}-{first}-{last}", "s", (rng,), 0)
        return spark.createDataFrame(records_to_table("s", [(shard_id, records)])), info

    sink = ParquetSink(tmp_path / "out")
    df, info = batch("a", 1, 5)
    sink.write(df, info)
    sink.write(df, info)  # the retry of a batch that was committed
    # after a crash: a new worker (new sink) replays 3..5 of shard a in a different batch
    replay_sink = ParquetSink(tmp_path / "out")
    for df, info in (batch("a", 3, 8), batch("b", 1, 2)):
        replay_sink.write(df, info)

    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    data = sorted(bytes(r.data).decode() for r in rows)
    expected = sorted([f"a-{n}-{s}" for n in range(1, 9) for s in (0, 1)]
                      + [f"b-{n}-{s}" for n in (1, 2) for s in (0, 1)])
    assert data == expected


def test_parquet_sink_writes_a_recovered_gap_below_the_live_position_exactly_once(
        spark: Any, tmp_path: Path) -> None:
    """Lag recovery: live rows 900-902 are committed first, then the gap's 101-103; after
    a crash the gap is read again from its checkpoint (101-105) and live from its own
    (900-904). Every row reaches the files once."""
    from kclpy.records import Record
    from kclpy.spark.arrow import records_to_table

    def batch(first: int, last: int, recovery: bool) -> tuple[Any, BatchInfo]:
        records = [Record(sequence_number=str(10**56 + n), sub_sequence_number=0,
                          partition_key="pk", timestamp_millis=0, data=f"a-{n}".encode())
                   for n in range(first, last + 1)]
        rng = ShardRange("a", records[0].sequence_number, 0, records[-1].sequence_number, 0,
                         len(records), is_recovery=recovery)
        info = BatchInfo(f"id-{first}-{last}-{recovery}", "s", (rng,), 0)
        return spark.createDataFrame(records_to_table("s", [("a", records)])), info

    sink = ParquetSink(tmp_path / "out")
    for first, last, recovery in ((900, 902, False), (101, 103, True)):
        sink.write(*batch(first, last, recovery))
    restarted = ParquetSink(tmp_path / "out")
    for first, last, recovery in ((101, 105, True), (900, 904, False)):
        restarted.write(*batch(first, last, recovery))

    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    data = sorted(bytes(r.data).decode() for r in rows)
    assert data == sorted(f"a-{n}" for n in [*range(101, 106), *range(900, 905)])


def sample_foreach_batch(df: Any, batch_id: str) -> None:
    """A target for the spec loader."""


def test_spark_batch_spec_loads_or_names_the_flag() -> None:
    assert load_callable(f"{__name__}:sample_foreach_batch", "--spark-batch") is (
        sample_foreach_batch)
    config = KCLConfig(application_name="a", stream_name="s", region="us-east-1")
    for spec in ("no_colon", "no.such.module:f", f"{__name__}:missing", f"{__name__}:pytest"):
        with pytest.raises(ConfigError) as excinfo:
            run_spark_batch_worker(config, spec)
        assert excinfo.value.option == "--spark-batch"
    with pytest.raises(ConfigError) as excinfo:
        run_spark_batch_worker(config, f"{__name__}:sample_foreach_batch",
                               decode_spec="nowhere:decode")
    assert excinfo.value.option == "--spark-decode"
