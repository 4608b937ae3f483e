"""Spark: micro-batches from a kclpy worker, and a ``format("kinesis")`` streaming source.

Two ways in (docs/spark.md compares them):

- :func:`run_worker` / :class:`MicroBatcher`: a kclpy worker (leases, checkpoints in
  DynamoDB) hands the records of all its shards to ``foreach_batch(df, batch_id)`` and
  checkpoints once that returned. One machine reads; Spark processes.
- :func:`register` then ``spark.readStream.format("kinesis")``: Spark's executors read the
  shards themselves; positions live in the query's checkpoint location. Needs Spark >= 4.0.

Call :func:`ensure_java` before building a ``SparkSession`` yourself: on a machine without
Java it points Spark at the runtime the ``spark`` extra installs (``run_worker`` does it).
"""

from kclpy.spark.arrow import (
    SCHEMA,
    SPARK_SCHEMA_DDL,
    Decoder,
    records_to_batch,
    records_to_batches,
    records_to_table,
)
from kclpy.spark.batcher import (
    BatcherStats,
    BatchInfo,
    BatchOptions,
    ForeachBatch,
    MicroBatcher,
    ShardRange,
    current_batch,
)
from kclpy.spark.java import ensure_java
from kclpy.spark.runner import run_spark_batch_worker, run_worker
from kclpy.spark.sink import ParquetSink
from kclpy.spark.source import KinesisDataSource, register

__all__ = [
    "SCHEMA",
    "SPARK_SCHEMA_DDL",
    "BatchInfo",
    "BatchOptions",
    "BatcherStats",
    "Decoder",
    "ForeachBatch",
    "KinesisDataSource",
    "MicroBatcher",
    "ParquetSink",
    "ShardRange",
    "current_batch",
    "ensure_java",
    "records_to_batch",
    "records_to_batches",
    "records_to_table",
    "register",
    "run_spark_batch_worker",
    "run_worker",
]
