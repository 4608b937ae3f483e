"""Kinesis to Parquet through Spark micro-batches, exactly once, fed by a kclpy worker.

The worker holds the shard leases and checkpoints in DynamoDB; every trigger, the records of
all its shards become one DataFrame (through Arrow) for ``foreach_batch``, and the shards are
checkpointed once it returned. ``ParquetSink`` commits each batch by an atomic rename and
drops replayed records, so the output holds every record exactly once (docs/spark.md).

Try it without AWS (embedded endpoint, demo stream; stops once everything is read):

    python examples/spark_microbatch.py --local --output /tmp/kclpy-orders

Against a stream, from Python:

    python examples/spark_microbatch.py --stream-name orders --application-name orders-parquet \
        --region eu-west-1 --output /data/orders

or with the worker CLI (the output folder comes from KCLPY_SPARK_OUTPUT):

    KCLPY_SPARK_OUTPUT=/data/orders kclpy-worker --stream-name orders \
        --application-name orders-parquet --spark-batch examples/spark_microbatch.py:foreach_batch \
        --spark-decode examples/spark_microbatch.py:decode_json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import pyarrow as pa

    from kclpy.spark import BatchOptions, ParquetSink, run_worker
except ModuleNotFoundError as missing:
    sys.exit(f"this example needs the spark extra ({missing.name} is not installed): "
             "pip install 'kinesis-kclpy[spark]'")

from kclpy import KCLConfig

#: the ``--spark-batch`` target: a ParquetSink is a ``foreach_batch(df, batch_id)``
foreach_batch = ParquetSink(os.environ.get("KCLPY_SPARK_OUTPUT", "spark-output"))


def decode_json(data: pa.BinaryArray) -> pa.Table:
    """Extra columns from JSON payloads (``--spark-decode``); a payload that is not a JSON
    object gets nulls rather than failing the batch, which would otherwise be retried for
    ever."""
    rows = []
    for payload in data.to_pylist():
        try:
            value = json.loads(payload)
        except ValueError:
            value = None
        rows.append({"json": json.dumps(value) if isinstance(value, dict) else None})
    return pa.Table.from_pylist(rows, schema=pa.schema([("json", pa.string())]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-name")
    parser.add_argument("--application-name", default="kclpy-spark-example")
    parser.add_argument("--region", default=os.environ.get("AWS_DEFAULT_REGION"))
    parser.add_argument("--output", default="spark-output")
    parser.add_argument("--local", action="store_true",
                        help="embedded local endpoint with a demo stream; stop when caught up")
    args = parser.parse_args()

    kinesis_endpoint = dynamodb_endpoint = None
    if args.local:
        try:
            from kclpy.local import start_embedded
            from kclpy.local.demo import local_session, seed_demo_stream
        except ImportError:
            parser.error("--local needs the embedded endpoint: pip install 'kinesis-kclpy[local]'")

        endpoint = start_embedded()
        kinesis_endpoint = dynamodb_endpoint = endpoint.url
        args.stream_name = args.stream_name or "kclpy-demo"
        args.region = args.region or "us-east-1"
        seed_demo_stream(local_session(args.region), endpoint.url, args.stream_name)
        # the worker resolves credentials through the standard chain; the endpoint takes any
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "kclpy-local")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "kclpy-local")
    if not args.stream_name:
        parser.error("--stream-name is required (or --local)")

    config = KCLConfig(
        application_name=args.application_name, stream_name=args.stream_name,
        region=args.region, kinesis_endpoint=kinesis_endpoint,
        dynamodb_endpoint=dynamodb_endpoint, initial_position="TRIM_HORIZON",
        stop_when_caught_up=args.local,
        # on shutdown each shard waits for its records' batch to commit: allow a Spark job
        shutdown_grace_ms=120_000)
    sink = ParquetSink(args.output)
    options = BatchOptions(max_records=50_000, min_interval_s=1.0, max_interval_s=5.0)
    run_worker(config, sink, options=options, decode=decode_json)
    print(f"wrote {args.output}; read it with spark.read.parquet({args.output!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
