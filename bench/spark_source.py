"""The ``format("kinesis")`` source against the micro-batch path, on the replay endpoint.

Both read the same stream (``--shards`` shards, plain records of 200 bytes) to its end and
hand every record to Spark, which counts them in ``foreachBatch``:
  * source: ``spark.readStream.format("kinesis")`` with Trigger.AvailableNow, Spark
    ``local[N]`` for N executor cores; with ``--rows-per-batch`` also with that
    ``maxRecordsPerBatch``, once with ``metadataPath`` (executors record where each batch
    stopped) and once without (the driver reads each batch again to find out);
  * micro-batch: ``kclpy.spark.run_worker`` (one kclpy worker reads, leases in moto's
    DynamoDB) until every record reached ``foreachBatch``.
Each run is its own process. Kinesis traffic goes through a counting proxy, which tells the
source's driver and executor calls apart by their User-Agent tag: records fetched per row.
Driver CPU is the CPU of the Python process Spark runs the source's planning in
(``python_streaming_source_runner``), sampled while the query runs.

Run: PYTHONPATH=. python bench/spark_source.py [--shards 32] [--records 96000]
     [--rows-per-batch 9600] [--runs source:1,source:2,rows:2,rows-recorded:2,microbatch:1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from consume import ReplayProcess, child_environment  # noqa: E402

REGION = "us-east-1"
RECORD_SIZE = 200


@dataclass
class Run:
    rows: int
    wall_s: float
    #: CPU of the source's planning process (None for the micro-batch path)
    driver_cpu_s: float | None


class RunnerCpu:
    """Samples the CPU time of the Python processes whose command line names ``marker``."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RunnerCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import psutil

        while not self._stop.wait(0.1):
            for process in psutil.Process().children(recursive=True):
                try:
                    if self._marker in " ".join(process.cmdline()):
                        times = process.cpu_times()
                        self._last[process.pid] = times.user + times.system
                except psutil.Error:
                    continue

    @property
    def seconds(self) -> float:
        return sum(self._last.values())


def spark_session(cores: int) -> Any:
    from pyspark.sql import SparkSession

    from kclpy.spark.java import ensure_java

    ensure_java()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master(f"local[{cores}]").appName("bench-spark-source")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               # a loaded machine can take longer than the default 15 s to start a worker
               .config("spark.python.authenticate.socketTimeout", "120s")
               .config("spark.sql.shuffle.partitions", str(cores)).getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def run_source(url: str, stream: str, cores: int, expect: int,
               options: dict[str, str]) -> Run:
    import kclpy.spark

    spark = spark_session(cores)
    kclpy.spark.register(spark)
    counted = [0]

    def count(df: Any, batch_id: int) -> None:
        counted[0] += df.count()

    reader = (spark.readStream.format("kinesis").option("streamName", stream)
              .option("endpointUrl", url).option("region", REGION)
              .option("startingPosition", "TRIM_HORIZON").option("settleTime", "0"))
    for name, value in options.items():
        reader = reader.option(name, value)
    checkpoint = Path("/tmp") / f"bench-spark-source-{uuid.uuid4().hex}"
    with RunnerCpu("python_streaming_source_runner") as cpu:
        started = time.perf_counter()
        query = (reader.load().writeStream.foreachBatch(count)
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        wall = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    spark.stop()
    if counted[0] != expect:
        raise RuntimeError(f"the source delivered {counted[0]} of {expect} rows")
    return Run(counted[0], wall, cpu.seconds)


def run_microbatch(url: str, dynamodb: str, stream: str, cores: int, expect: int) -> Run:
    from kclpy import KCLConfig
    from kclpy.spark import BatchOptions, run_worker

    spark = spark_session(cores)
    counted = [0]
    done = threading.Event()
    holder: list[Any] = []

    def count(df: Any, batch_id: str) -> None:
        counted[0] += df.count()
        if counted[0] >= expect:
            done.set()

    config = KCLConfig(application_name=f"bench-spark-{uuid.uuid4().hex[:12]}",
                       stream_name=stream, region=REGION, kinesis_endpoint=url,
                       dynamodb_endpoint=dynamodb, initial_position="TRIM_HORIZON")
    started = time.perf_counter()

    def stop_when_done() -> None:
        done.wait(900)
        holder[0].shutdown()

    threading.Thread(target=stop_when_done, daemon=True).start()
    run_worker(config, count, spark=spark,
               options=BatchOptions(max_records=100_000, min_interval_s=1, max_interval_s=2),
               on_started=holder.append)
    wall = time.perf_counter() - started
    spark.stop()
    if counted[0] < expect:
        raise RuntimeError(f"the micro-batch path delivered {counted[0]} of {expect} rows")
    return Run(counted[0], wall, None)


def child(options: argparse.Namespace) -> Run:
    if options.child != "microbatch":
        extra: dict[str, str] = {}
        if options.child in ("rows", "rows-recorded"):
            extra["maxRecordsPerBatch"] = str(options.rows_per_batch)
        if options.child == "rows-recorded":
            extra["metadataPath"] = str(Path("/tmp") / f"bench-spark-ends-{uuid.uuid4().hex}")
        return run_source(options.kinesis, options.stream, options.cores, options.expect,
                          extra)
    return run_microbatch(options.kinesis, options.dynamodb, options.stream, options.cores,
                          options.expect)


def run_child(kind: str, cores: int, kinesis: str, dynamodb: str, stream: str,
              expect: int, rows_per_batch: int) -> Run:
    env = child_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH.parent),
                                                      env.get("PYTHONPATH")]))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--cores",
            str(cores), "--kinesis", kinesis, "--dynamodb", dynamodb, "--stream", stream,
            "--expect", str(expect), "--rows-per-batch", str(rows_per_batch)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800,
                          check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return Run(**json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--records", type=int, default=96_000, help="records in the stream")
    parser.add_argument("--rows-per-batch", type=int, default=None,
                        help="maxRecordsPerBatch of the rows and rows-recorded runs "
                             "(default: a tenth of the records)")
    parser.add_argument("--runs", default="source:1,source:2,rows:2,rows-recorded:2,"
                        "microbatch:1,microbatch:2",
                        help="which runs, as path:cores (paths: source, rows, rows-recorded, "
                             "microbatch)")
    parser.add_argument("--child", choices=("source", "rows", "rows-recorded", "microbatch"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kinesis", help=argparse.SUPPRESS)
    parser.add_argument("--dynamodb", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(asdict(child(options))), flush=True)
        return

    from kclpy.local import start_moto_server
    from tests.support.counting import CountingProxy

    per_shard = options.records // options.shards
    total = per_shard * options.shards
    rows_per_batch = options.rows_per_batch or max(1, total // 10)
    runs = [(kind, int(cores)) for kind, _, cores in
            (run.partition(":") for run in options.runs.split(","))]
    stream = "bench"
    print(f"{total:,} records of {RECORD_SIZE} B over {options.shards} shards "
          "on the replay endpoint", flush=True)
    with start_moto_server() as moto, ReplayProcess(
            sys.executable, [f"{stream}:{options.shards}:{per_shard}:{RECORD_SIZE}"]) as replay, \
            CountingProxy(replay.url) as proxy:
        print("| Path | Executor cores | Rows/s | Records fetched per row (driver + executors) "
              "| Driver CPU s per million rows |")
        print("|---|---|---|---|---|")
        for kind, cores in runs:
            proxy.reset()
            run = run_child(kind, cores, proxy.url, moto.url, stream, total, rows_per_batch)
            records = dict(proxy.records)
            fetched = sum(records.values()) / run.rows
            split = (f"{fetched:.3f} ({records.get('kclpy-spark-driver', 0) / run.rows:.3f} + "
                     f"{records.get('kclpy-spark-executor', 0) / run.rows:.3f})"
                     if kind != "microbatch" else f"{fetched:.3f} (one worker)")
            cpu = ("-" if run.driver_cpu_s is None
                   else f"{run.driver_cpu_s / run.rows * 1e6:.2f}")
            label = {"rows": f"source, maxRecordsPerBatch={rows_per_batch:,}",
                     "rows-recorded": f"source, maxRecordsPerBatch={rows_per_batch:,}, "
                                      "metadataPath"}.get(kind, kind)
            print(f"| {label} | {cores} | {run.rows / run.wall_s:,.0f} | {split} | {cpu} |",
                  flush=True)


if __name__ == "__main__":
    main()
