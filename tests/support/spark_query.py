"""A Spark driver in its own process, for tests that kill it or give it its own environment.

Run as ``python -m tests.support.spark_query`` with the environment of :func:`spark_env`.

Runs ``format("kinesis")`` with Trigger.AvailableNow into ``foreachBatch``, which writes
each batch's rows to ``OUT/batch-<id>-<pid>.json`` before returning. With ``--hold-batch N``
it then blocks in batch N, so that a test can kill -9 the driver after the batch was
planned (its offsets are in the checkpoint) and before it was committed. With
``--processing-time`` it runs micro-batches on that trigger until it is stopped, so that a
test can write records while the query runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any


def spark_env() -> dict[str, str]:
    """This process's environment for a driver process: Java (the bundled runtime where
    none is configured), this interpreter for Spark's Python workers, and this checkout of
    kclpy on ``PYTHONPATH``, which the workers inherit through the JVM."""
    import kclpy
    from kclpy.spark.java import ensure_java

    env = dict(os.environ)
    ensure_java(env)
    root = str(Path(kclpy.__file__).resolve().parent.parent)
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])))
    return env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-batch", type=int, default=None)
    parser.add_argument("--processing-time", default=None, metavar="INTERVAL",
                        help="micro-batches on this trigger (e.g. '500 milliseconds') until "
                             "stopped, instead of AvailableNow")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a source option (repeatable)")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    import kclpy.spark

    spark = (SparkSession.builder.master("local[2]").appName("kclpy-kill-test")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             # a loaded machine can take longer than the default 15 s to start a worker
             .config("spark.python.authenticate.socketTimeout", "120s").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    kclpy.spark.register(spark)
    out = Path(args.out)
    reader = (spark.readStream.format("kinesis").option("streamName", args.stream)
              .option("endpointUrl", args.endpoint).option("region", "us-east-1")
              .option("startingPosition", "TRIM_HORIZON").option("settleTime", "0"))
    for option in args.option:
        name, _, value = option.partition("=")
        reader = reader.option(name, value)

    def collect(df: Any, batch_id: int) -> None:
        rows = sorted([r.shard_id, r.sequence_number, r.sub_sequence_number, bytes(r.data).hex()]
                      for r in df.collect())
        path = out / f"batch-{batch_id}-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
        if batch_id == args.hold_batch:
            threading.Event().wait()  # until killed

    writer = (reader.load().writeStream.foreachBatch(collect)
              .option("checkpointLocation", args.checkpoint))
    if args.processing_time is None:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=args.processing_time)
    query = writer.start()
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
