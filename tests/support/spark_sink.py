"""``--spark-batch tests.support.spark_sink:write`` for worker processes in tests: kclpy's
``ParquetSink`` under ``$KCLPY_TEST_PARQUET``, and one JSON line per committed batch (its
shard ranges) appended to ``$KCLPY_TEST_BATCHES``, so a test can see what was committed
before it kills the process."""

from __future__ import annotations

import json
import os
from typing import Any

from kclpy.spark.batcher import current_batch
from kclpy.spark.sink import ParquetSink

_SINKS: dict[str, ParquetSink] = {}


def write(df: Any, batch_id: str) -> None:
    root = os.environ["KCLPY_TEST_PARQUET"]
    sink = _SINKS.setdefault(root, ParquetSink(root))
    sink(df, batch_id)
    info = current_batch()
    assert info is not None
    line = json.dumps({"batch_id": batch_id, "ranges": [
        {"shard_id": r.shard_id, "is_recovery": r.is_recovery, "count": r.count}
        for r in info.ranges]}) + "\n"
    fd = os.open(os.environ["KCLPY_TEST_BATCHES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
