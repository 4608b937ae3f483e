"""Kinesis as a Structured Streaming source: Spark's executors read the shards themselves.

No jar and no worker: ``kclpy.spark.register(spark)`` adds ``format("kinesis")`` (Spark >= 4.0),
positions live in the query's checkpoint location, and the Parquet file sink makes the output
exactly once. kclpy must be importable on the executors (it is a Python data source).

Try it without AWS (embedded endpoint, demo stream; reads what is there, then stops):

    python examples/spark_structured_streaming.py --local --output /tmp/kclpy-ss

Against a stream, continuously, one batch every 10 seconds:

    python examples/spark_structured_streaming.py --stream-name orders --region eu-west-1 \
        --output s3a://bucket/orders --checkpoint s3a://bucket/checkpoints/orders
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as f

    import kclpy.spark
except ModuleNotFoundError as missing:
    sys.exit(f"this example needs the spark extra ({missing.name} is not installed): "
             "pip install 'kinesis-kclpy[spark]'")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-name")
    parser.add_argument("--region", default=os.environ.get("AWS_DEFAULT_REGION"))
    parser.add_argument("--output", default="spark-output/structured")
    parser.add_argument("--checkpoint")
    parser.add_argument("--local", action="store_true",
                        help="embedded local endpoint with a demo stream; availableNow")
    args = parser.parse_args()

    endpoint_url = None
    if args.local:
        try:
            from kclpy.local import start_embedded
            from kclpy.local.demo import local_session, seed_demo_stream
        except ImportError:
            parser.error("--local needs the embedded endpoint: pip install 'kinesis-kclpy[local]'")

        endpoint = start_embedded()
        endpoint_url = endpoint.url
        args.stream_name = args.stream_name or "kclpy-demo"
        args.region = args.region or "us-east-1"
        seed_demo_stream(local_session(args.region), endpoint.url, args.stream_name)
        # Spark's Python workers inherit this environment: the endpoint accepts any keys.
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "kclpy-local")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "kclpy-local")
    if not args.stream_name:
        parser.error("--stream-name is required (or --local)")
    # The executors' Python must be this one (it has kclpy and its dependencies); from a
    # checkout that is not installed, they find kclpy through PYTHONPATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(kclpy.__file__)))

    # no Java installed: use the runtime the kinesis-kclpy[spark] extra brings (a set-up Java wins)
    kclpy.spark.ensure_java()
    spark = SparkSession.builder.appName("kclpy-structured-streaming").getOrCreate()
    kclpy.spark.register(spark)
    reader = (spark.readStream.format("kinesis")
              .option("streamName", args.stream_name)
              .option("startingPosition", "TRIM_HORIZON")
              .option("maxRecordsPerBatch", "100000")
              .option("maxFetchRecordsPerShard", "20000"))
    if args.region:
        reader = reader.option("region", args.region)
    if endpoint_url:
        reader = reader.option("endpointUrl", endpoint_url)
    records = reader.load().withColumn("text", f.col("data").cast("string"))

    writer = (records.writeStream.format("parquet")
              .option("path", args.output)
              .option("checkpointLocation", args.checkpoint or f"{args.output}/_checkpoint"))
    if args.local:
        query = writer.trigger(availableNow=True).start()
    else:
        query = writer.trigger(processingTime="10 seconds").start()
    query.awaitTermination()
    print(f"wrote {args.output}; read it with spark.read.parquet({args.output!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
