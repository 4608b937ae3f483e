"""Spark micro-batch ingest: records to a DataFrame through Arrow vs through Python rows.

Both sides start from the same lazy kclpy Records (base64 payloads, as parsed off the wire)
and end when Spark has evaluated every row (a ``noop`` write), in one SparkSession:
  * kclpy: ``records_to_table`` then ``spark.createDataFrame(table)`` (what the batcher does);
  * rows: a tuple per record with the same schema, ``spark.createDataFrame(rows, schema)``
    (Spark pickles and converts the rows one by one).
Run: python bench/spark_ingest.py [--records N] [--size BYTES] [--repetitions N]
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import sys
from datetime import datetime, timezone
from typing import Any

from _common import compare

from kclpy.records import Record
from kclpy.spark.arrow import records_to_table


def make_records(count: int, size: int, seed: int = 7) -> list[Record]:
    rnd = random.Random(seed)
    first = 49_590_338_271_490_256_608_559_692_538_361_571_095_921_575_989_136_588_898
    return [
        Record(sequence_number=str(first + i * 100_000), sub_sequence_number=0,
               partition_key=f"partition-{rnd.randrange(1_000_000)}",
               timestamp_millis=1_714_000_000_000 + i,
               b64=base64.b64encode(rnd.randbytes(size)).decode("ascii"))
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=200, help="payload bytes per record")
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    from pyspark.sql.types import (
        BinaryType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    spark = (SparkSession.builder.master("local[2]").appName("kclpy-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    schema = StructType([
        StructField("stream", StringType()), StructField("shard_id", StringType()),
        StructField("sequence_number", StringType()),
        StructField("sub_sequence_number", LongType()),
        StructField("partition_key", StringType()),
        StructField("approximate_arrival_timestamp", TimestampType()),
        StructField("data", BinaryType()),
    ])

    def fresh() -> list[Record]:
        # New Records each time: the lazy base64 decode must be paid by every run.
        return make_records(args.records, args.size)

    def evaluate(df: Any) -> None:
        df.write.format("noop").mode("overwrite").save()

    def arrow_path(records: list[Record]) -> None:
        evaluate(spark.createDataFrame(records_to_table("bench", [("shardId-0", records)])))

    def rows_path(records: list[Record]) -> None:
        rows = [("bench", "shardId-0", r.sequence_number, r.sub_sequence_number, r.partition_key,
                 datetime.fromtimestamp(r.timestamp_millis / 1000, timezone.utc)
                 if r.timestamp_millis is not None else None, r.binary_data)
                for r in records]
        evaluate(spark.createDataFrame(rows, schema))

    figure = compare(f"{args.records:,} records of {args.size} B to a Spark DataFrame",
                     args.records, (fresh, arrow_path), (fresh, rows_path), args.repetitions)
    print(f"pyspark {spark.version}, {args.repetitions} repetitions, medians")
    print(figure.line("records", "Python rows"))
    spark.stop()


if __name__ == "__main__":
    main()
