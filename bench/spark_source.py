"""Records per CPU second of the two Spark paths, beside the worker alone, at saturation.

Every contender reads the same streams on the replay endpoint (``--shards`` shards,
``--records`` records in all, read from TRIM_HORIZON to the end: a backlog, so nothing
waits for data) in a process of its own, one after the other:
  * worker: a kclpy ``Worker`` whose processor reads every payload (``bench/consume.py``);
  * source: ``spark.readStream.format("kinesis")`` with Trigger.AvailableNow,
    ``maxRecordsPerBatch=--rows-per-batch`` and ``metadataPath``, counted in ``foreachBatch``;
  * microbatch: ``kclpy.spark.run_worker`` with ``BatchOptions(max_records=--rows-per-batch)``,
    counted in ``foreach_batch``;
  * floor: no Kinesis at all: a Python data source whose ``read`` yields one prebuilt Arrow
    batch of the same columns over and over, counted by ``df.count()``. What Spark itself
    costs per row on this path, whatever a source does.
Spark runs ``local[1]``: one executor core.

**The clock.** CPU seconds (user + system, every thread) of the contender's whole process
tree: for Spark, the driver's Python, the JVM, the planning runner and the executors' Python
workers; the replay endpoint and moto's DynamoDB run in processes of their own and are not
counted. For Spark it is read at the end of every batch; the steady rate counts the rows
of every batch after the first over the CPU they took, and start-up is what the first batch
cost beyond its rows at that rate (session, JVM, Python workers, planning). For the worker,
the steady rate counts the CPU after its processor's first record. Records per CPU second is
records per second per core at saturation (a backlog keeps every path busy). Wall rates are
printed too; on a shared machine they are noisier.

**The physical limit.** From each path's steady rate on a stream of plain 1 KiB records and
on one of 200 B user records in KPL aggregates: how many shards at Kinesis' full write rate
(1 MiB/s and 1,000 records/s per shard) one core keeps up with, and how many it can read
at the full read rate (2 MiB/s per shard) while catching up. With a JDK's ``javac``, the Java
KCL (``bench/java_native.py``'s Java ``Scheduler`` and processor, one-shard streams of the
same records) makes a column of its own.

Run: PYTHONPATH=. python bench/spark_source.py [--records 1000000] [--shards 4]
     [--rows-per-batch 100000] [--streams plain,kpl] [--runs worker,source,microbatch,floor]
     [--limit-records 300000] [--smoke] [--executor-only [--profile]]
(``--smoke``: 20,000 records and no limit section, to try the harness in a minute or two;
``--executor-only``: a task's read in this process, no Spark, to profile the Python side.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from consume import ReplayProcess, child_environment, run_child  # noqa: E402
from replay import FIRST_ARRIVAL_MS  # noqa: E402

REGION = "us-east-1"
#: payload bytes of the main streams' records (plain records, and KPL user records)
RECORD_SIZE = 200
#: the physical limit's streams: plain records of 1 KiB, KPL user records of 200 B
LIMIT_STREAMS = {"limit-1k": (1024, False), "limit-kpl": (RECORD_SIZE, True)}
#: Kinesis' per-shard limits: writes 1 MiB/s and 1,000 records/s, reads 2 MiB/s
WRITE_BYTES_S = 2**20
WRITE_RECORDS_S = 1_000
READ_BYTES_S = 2 * 2**20


@dataclass
class Point:
    """Rows delivered so far and the process tree's clocks at that moment."""

    rows: int
    wall_s: float
    cpu_s: float


@dataclass
class Rates:
    """A contender's figures on one stream."""

    rows: int
    #: rows per CPU second after the first batch (the worker: after its first record)
    steady_per_cpu_s: float
    #: rows per wall second over the same span
    steady_per_s: float
    #: CPU seconds before the steady span beyond what its rows cost at the steady rate
    startup_cpu_s: float
    #: wall seconds until the steady span began
    startup_wall_s: float
    #: CPU seconds per kind of process over the whole run (Spark contenders)
    breakdown: dict[str, float]


def rates_from(points: Sequence[Point], breakdown: dict[str, float]) -> Rates:
    """Figures from the points taken at the end of each batch (the first point is the start
    of the clock)."""
    if len(points) < 3:
        raise RuntimeError("too few batches to tell start-up from the steady rate: "
                           "lower --rows-per-batch or raise --records")
    start, first, last = points[0], points[1], points[-1]
    rows = last.rows - first.rows
    cpu = last.cpu_s - first.cpu_s
    per_cpu = rows / cpu
    return Rates(last.rows, per_cpu, rows / (last.wall_s - first.wall_s),
                 (first.cpu_s - start.cpu_s) - first.rows / per_cpu,
                 first.wall_s - start.wall_s, breakdown)


# -- the process tree's clocks -----------------------------------------------------------------

def _role(cmdline: str, name: str) -> str:
    if "python_streaming_source_runner" in cmdline:
        return "planning runner (Python)"
    if "pyspark.daemon" in cmdline or "pyspark/daemon.py" in cmdline or "worker.py" in cmdline:
        return "executors (Python workers)"
    if name == "java":
        return "JVM"
    return "other"


def tree_cpu() -> tuple[float, dict[str, float]]:
    """CPU seconds of this process and its descendants: live processes' own time plus the
    time of the children they reaped (a reaped process is in its parent's figures, never in
    two places); and the same split by role."""
    import psutil

    me = psutil.Process()
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    roles = {"driver (Python)": total}
    for process in me.children(recursive=True):
        try:
            times = process.cpu_times()
            cmdline = " ".join(process.cmdline())
            name = process.name()
        except psutil.Error:
            continue
        cpu = times.user + times.system + times.children_user + times.children_system
        total += cpu
        role = _role(cmdline, name)
        roles[role] = roles.get(role, 0.0) + cpu
    return total, roles


class Points:
    """The clocks at the start and at the end of each batch."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.points = [Point(0, 0.0, tree_cpu()[0])]
        self.rows = 0

    def batch(self, rows: int) -> None:
        self.rows += rows
        self.points.append(Point(self.rows, time.perf_counter() - self.started, tree_cpu()[0]))


# -- the Spark contenders, each in a process of its own ----------------------------------------

def spark_session() -> Any:
    from pyspark.sql import SparkSession

    from kclpy.spark.java import ensure_java

    ensure_java()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[1]").appName("bench-spark-source")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               # a loaded machine can take longer than the default 15 s to start a worker
               .config("spark.python.authenticate.socketTimeout", "120s")
               .config("spark.sql.shuffle.partitions", "1").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def run_source(url: str, stream: str, expect: int, rows_per_batch: int) -> Rates:
    import kclpy.spark

    points = Points()
    spark = spark_session()
    kclpy.spark.register(spark)

    def count(df: Any, batch_id: int) -> None:
        points.batch(df.count())

    work = Path(tempfile.mkdtemp(prefix="bench-spark-source-"))
    try:
        query = (spark.readStream.format("kinesis").option("streamName", stream)
                 .option("endpointUrl", url).option("region", REGION)
                 .option("startingPosition", "TRIM_HORIZON").option("settleTime", "0")
                 .option("maxRecordsPerBatch", str(rows_per_batch))
                 .option("metadataPath", str(work / "ends")).load()
                 .writeStream.foreachBatch(count)
                 .option("checkpointLocation", str(work / "checkpoint"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        breakdown = tree_cpu()[1]
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    if points.rows != expect:
        raise RuntimeError(f"the source delivered {points.rows} of {expect} rows")
    return rates_from(points.points, breakdown)


def run_microbatch(url: str, dynamodb: str, stream: str, expect: int,
                   rows_per_batch: int) -> Rates:
    from kclpy import KCLConfig
    from kclpy.spark import BatchOptions, run_worker

    points = Points()
    spark = spark_session()
    done = threading.Event()
    holder: list[Any] = []
    breakdown: dict[str, float] = {}

    def count(df: Any, batch_id: str) -> None:
        points.batch(df.count())
        if points.rows >= expect and not done.is_set():
            breakdown.update(tree_cpu()[1])
            done.set()

    config = KCLConfig(application_name=f"bench-spark-{uuid.uuid4().hex[:12]}",
                       stream_name=stream, region=REGION, kinesis_endpoint=url,
                       dynamodb_endpoint=dynamodb, initial_position="TRIM_HORIZON")

    def stop_when_done() -> None:
        done.wait(1800)
        holder[0].shutdown()

    threading.Thread(target=stop_when_done, daemon=True).start()
    run_worker(config, count, spark=spark,
               options=BatchOptions(max_records=rows_per_batch, min_interval_s=0,
                                    max_interval_s=1),
               on_started=holder.append)
    spark.stop()
    if points.rows < expect:
        raise RuntimeError(f"the micro-batch path delivered {points.rows} of {expect} rows")
    return rates_from(points.points, breakdown)


def run_floor(expect: int, rows_per_batch: int, kpl: bool) -> Rates:
    """Spark's own cost per row on the Python data source path: a source that reads nothing
    and yields the same prebuilt Arrow batch (the source's columns, 200 B payloads) until it
    has yielded ``rows_per_batch`` rows, counted like the others."""
    import pyarrow as pa
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from kclpy.records import Record
    from kclpy.spark.arrow import SPARK_SCHEMA_DDL, records_to_batch

    page = [Record(sequence_number=str(10**55 + i), partition_key=f"pk-{i % 1000}",
                   timestamp_millis=1_700_000_000_000 + i,
                   sub_sequence_number=i % 244 if kpl else 0,
                   data=bytes(RECORD_SIZE)) for i in range(min(10_000, rows_per_batch))]
    batch = records_to_batch("bench", "shardId-000000000000", page)

    class Floor(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench-floor"

        def schema(self) -> str:
            return SPARK_SCHEMA_DDL

        def reader(self, schema: Any) -> DataSourceReader:
            return FloorReader()

    class FloorReader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(0)]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            for _ in range(rows_per_batch // batch.num_rows):
                yield batch

    points = Points()
    spark = spark_session()
    spark.dataSource.register(Floor)
    while points.rows < expect:
        points.batch(spark.read.format("bench-floor").load().count())
    breakdown = tree_cpu()[1]
    spark.stop()
    return rates_from(points.points, breakdown)


def child(options: argparse.Namespace) -> Rates:
    if options.child == "source":
        return run_source(options.kinesis, options.stream, options.expect,
                          options.rows_per_batch)
    if options.child == "microbatch":
        return run_microbatch(options.kinesis, options.dynamodb, options.stream,
                              options.expect, options.rows_per_batch)
    return run_floor(options.expect, options.rows_per_batch, options.kpl)


def run_spark_child(kind: str, kinesis: str, dynamodb: str, stream: str, expect: int,
                    rows_per_batch: int, kpl: bool) -> Rates:
    env = child_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH.parent),
                                                      env.get("PYTHONPATH")]))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--kinesis",
            kinesis, "--dynamodb", dynamodb, "--stream", stream, "--expect", str(expect),
            "--rows-per-batch", str(rows_per_batch)]
    if kpl:
        argv.append("--kpl")
    for attempt in range(3):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600,
                              check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return Rates(**json.loads(lines[-1]))
        # On a machine loaded many times over, a Python process Spark starts can miss the
        # JVM's fixed wait for it to connect back: that run measured nothing, so run again.
        if "failed to connect back" not in done.stderr or attempt == 2:
            break
        print(f"{kind}: a Python worker did not connect back in time; running again",
              file=sys.stderr, flush=True)
    raise RuntimeError(f"{kind} failed (exit {done.returncode}): "
                       f"{done.stderr.strip()[-2000:]}")


def run_worker_child(kinesis: str, dynamodb: str, stream: str, expect: int,
                     kpl: bool) -> Rates:
    measured = run_child(sys.executable, "kclpy", kinesis, dynamodb, stream, expect, kpl)
    steady_cpu = measured.cpu_s - measured.first_record_cpu_s
    return Rates(measured.records, measured.records / steady_cpu,
                 measured.records / measured.wall_s, measured.first_record_cpu_s,
                 0.0, {})


def run_contender(kind: str, kinesis: str, dynamodb: str, stream: str, expect: int,
                  rows_per_batch: int, kpl: bool) -> Rates:
    if kind == "worker":
        return run_worker_child(kinesis, dynamodb, stream, expect, kpl)
    return run_spark_child(kind, kinesis, dynamodb, stream, expect, rows_per_batch, kpl)


# -- the executor's own Python work, without Spark ------------------------------------------------

def executor_only(records: int, kpl: bool, profile: bool) -> float:
    """Rows per CPU second of ``KinesisStreamReader.read`` on one shard part of ``records``
    records (the whole shard, ended by an arrival time as planned batches are), called in
    this process with no Spark around it: what a task costs in Python, before Spark's
    Arrow hand-off. ``profile`` prints cProfile's top functions on a CPU clock."""
    import cProfile
    import pstats

    from kclpy.position import Position
    from kclpy.spark.options import SourceOptions
    from kclpy.spark.reading import StreamRef, list_shards
    from kclpy.spark.source import KinesisPartition, KinesisStreamReader

    os.environ.update({k: v for k, v in child_environment().items() if k.startswith("AWS_")})
    spec = f"s:1:{records}:{RECORD_SIZE}{':kpl' if kpl else ''}"
    with ReplayProcess(sys.executable, [spec]) as replay:
        options = SourceOptions.parse({"streamName": "s", "endpointUrl": replay.url,
                                       "region": REGION})
        reader = KinesisStreamReader(options)
        stream = StreamRef("s")
        shard = list_shards(options.client(), stream)[0]

        def part(until_ms: int) -> KinesisPartition:
            return KinesisPartition(stream, shard, shard.shard_id,
                                    Position.trim_horizon().encode(),
                                    Position.at_timestamp(until_ms).encode())

        # a first small part: imports, the client and the first connection outside the clock
        sum(batch.num_rows for batch in reader.read(part(FIRST_ARRIVAL_MS + 100)))
        profiler = cProfile.Profile(time.process_time)
        started = time.process_time()
        if profile:
            profiler.enable()
        rows = sum(batch.num_rows for batch in reader.read(part(int(time.time() * 1000))))
        profiler.disable()
        cpu = time.process_time() - started
    if profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    return rows / cpu


# -- the Java KCL's column of the limit table ----------------------------------------------------

def java_rates(records: int, javac: str, dynamodb: str) -> dict[str, float]:
    """The Java KCL's warm records per CPU second on one-shard streams shaped like the limit
    streams (``bench/java_native.py``'s JVM with no flags)."""
    import java_native

    from tests.support import java_kcl

    found: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as workdir:
        jars = java_kcl.classpath()
        java_native.compile_processor(javac, jars, Path(workdir) / "classes")
        runner = java_native.Runner(java_kcl.java(),
                                    os.pathsep.join([str(Path(workdir) / "classes"), jars]),
                                    Path(workdir))
        for name, (size, kpl) in LIMIT_STREAMS.items():
            spec = f"{name}:1:{records}:{size}{':kpl' if kpl else ''}"
            with ReplayProcess(sys.executable, [spec], start_timeout_s=1800) as replay:
                settings = java_native.Settings(replay.url, dynamodb, 10_000, 25, 1800)
                run, spawned = java_native.run_side("java-default", name, records, settings,
                                                    runner)
            rate = java_native.figures(run, spawned).records_per_cpu_s
            if rate is not None:
                found[name] = rate
    return found


def kpl_bytes_per_record(size: int, sample: int = 20_000) -> float:
    """What a user record of ``size`` bytes takes of a shard's byte limits once the KPL has
    aggregated it as the replay endpoint does (its share of the aggregate, partition key
    and framing included), measured on full aggregates."""
    import random

    from aws_kinesis_agg.aggregator import RecordAggregator
    from replay import KPL_AGGREGATE_BYTES

    rnd = random.Random(7)
    aggregator = RecordAggregator(max_size=KPL_AGGREGATE_BYTES)
    total = users = pending = 0
    for _ in range(sample):
        pending += 1
        full = aggregator.add_user_record(f"user-{rnd.randrange(10_000)}",
                                          rnd.randbytes(size))
        if full is not None:
            key, _, blob = full.get_contents()
            total += len(key) + len(blob)
            # the record that did not fit starts the next aggregate
            users += pending - 1
            pending = 1
    return total / users


def shards_per_core(records_per_cpu_s: float, size: int, kpl: bool) -> tuple[float, float]:
    """Shards one core keeps up with at Kinesis' full write rate, and reads at its full read
    rate, for records of ``size`` payload bytes."""
    if kpl:
        # aggregates: the byte limit binds long before 1,000 (aggregate) records/s
        per_record = kpl_bytes_per_record(size)
        write_records_s = WRITE_BYTES_S / per_record
        read_records_s = READ_BYTES_S / per_record
    else:
        write_records_s = min(WRITE_RECORDS_S, WRITE_BYTES_S / size)
        read_records_s = READ_BYTES_S / size
    return records_per_cpu_s / write_records_s, records_per_cpu_s / read_records_s


# -- the parent ----------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000,
                        help="records per stream (user records on the KPL stream)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rows-per-batch", type=int, default=100_000)
    parser.add_argument("--streams", default="plain,kpl",
                        help="the main streams (none: the limit section only)")
    parser.add_argument("--runs", default="worker,source,microbatch,floor")
    parser.add_argument("--limit-records", type=int, default=300_000,
                        help="records per limit stream (0: no limit section)")
    parser.add_argument("--javac", help="a JDK's javac for the Java KCL's column "
                                        "(default: $JAVA_HOME/bin/javac, PATH)")
    parser.add_argument("--executor-only", action="store_true",
                        help="only the executor's read in this process, no Spark "
                             "(--records on one shard, plain and KPL)")
    parser.add_argument("--profile", action="store_true",
                        help="with --executor-only: cProfile's top functions")
    parser.add_argument("--smoke", action="store_true",
                        help="20,000 records in batches of 4,000, no limit section")
    parser.add_argument("--child", choices=("source", "microbatch", "floor"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--kinesis", help=argparse.SUPPRESS)
    parser.add_argument("--dynamodb", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kpl", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(asdict(child(options))), flush=True)
        return 0
    if options.executor_only:
        for name in ("plain", "kpl"):
            rate = executor_only(options.records, name == "kpl", options.profile)
            print(f"{name}: {rate:,.0f} rows per CPU s in the executor's read, no Spark",
                  flush=True)
        return 0
    if options.smoke:
        options.records, options.rows_per_batch, options.limit_records = 20_000, 4_000, 0

    from kclpy.local import start_moto_server

    per_shard = options.records // options.shards
    total = per_shard * options.shards
    kinds = [k for k in options.runs.split(",") if k]
    streams = [s for s in options.streams.split(",") if s and s != "none"]
    specs = {name: f"{name}:{options.shards}:{per_shard}:{RECORD_SIZE}"
                   f"{':kpl' if name == 'kpl' else ''}" for name in streams}
    print(f"{total:,} records of {RECORD_SIZE} B per stream over {options.shards} shards, "
          f"batches of {options.rows_per_batch:,} rows, Spark local[1]", flush=True)
    measured: dict[tuple[str, str], Rates] = {}
    with start_moto_server() as moto:
        if streams:
            with ReplayProcess(sys.executable, list(specs.values()),
                               start_timeout_s=1800) as replay:
                for name in streams:
                    # the floor reads no stream: once is enough
                    for kind in (k for k in kinds if k != "floor" or name == streams[0]):
                        rates = run_contender(kind, replay.url, moto.url, name, total,
                                              options.rows_per_batch, name == "kpl")
                        measured[(name, kind)] = rates
                        print(json.dumps({"stream": name, "path": kind, **asdict(rates)}),
                              flush=True)
            print_table(measured, streams, kinds)
        if options.limit_records:
            limit(options, moto.url)
    return 0


def print_table(measured: dict[tuple[str, str], Rates], streams: list[str],
                kinds: list[str]) -> None:
    print("\n| Stream | Path | Records/s per core, steady | of the worker's | Start-up CPU s "
          "| Start-up wall s | Records/s, wall |")
    print("|---|---|---|---|---|---|---|")
    for name in streams:
        worker = measured.get((name, "worker"))
        for kind in kinds:
            if (name, kind) not in measured:
                continue
            rates = measured[(name, kind)]
            ratio = ("-" if worker is None or kind == "worker"
                     else f"{rates.steady_per_cpu_s / worker.steady_per_cpu_s:.0%}")
            print(f"| {name} | {kind} | {rates.steady_per_cpu_s:,.0f} | {ratio} | "
                  f"{rates.startup_cpu_s:.1f} | {rates.startup_wall_s:.1f} | "
                  f"{rates.steady_per_s:,.0f} |", flush=True)
    print("\nCPU seconds by process over the whole run:")
    for (name, kind), rates in measured.items():
        if rates.breakdown:
            split = ", ".join(f"{role} {cpu:.1f}" for role, cpu in
                              sorted(rates.breakdown.items(), key=lambda kv: -kv[1]))
            print(f"  {name} {kind}: {split}", flush=True)


def limit(options: argparse.Namespace, dynamodb: str) -> None:
    import java_native

    records = options.limit_records
    per_shard = records // options.shards
    kinds = [k for k in options.runs.split(",") if k in ("worker", "microbatch", "source")]
    found: dict[tuple[str, str], float] = {}
    for name, (size, kpl) in LIMIT_STREAMS.items():
        spec = f"{name}:{options.shards}:{per_shard}:{size}{':kpl' if kpl else ''}"
        with ReplayProcess(sys.executable, [spec], start_timeout_s=1800) as replay:
            for kind in kinds:
                rates = run_contender(kind, replay.url, dynamodb, name,
                                      per_shard * options.shards,
                                      max(1, per_shard * options.shards // 10), kpl)
                found[(name, kind)] = rates.steady_per_cpu_s
                print(json.dumps({"stream": name, "path": kind, **asdict(rates)}), flush=True)
    javac = java_native.find_javac(options.javac)
    if javac is None:
        print("no JDK javac found: the Java KCL's column is left out (--javac PATH)")
    else:
        kinds.append("java")
        try:
            for name, rate in java_rates(records, javac, dynamodb).items():
                found[(name, "java")] = rate
        except RuntimeError as exc:
            print(f"the Java KCL's column failed: {exc}", flush=True)
    print(f"\n| Shards one core keeps up with | {' | '.join(kinds)} |")
    print(f"|---|{'---|' * len(kinds)}")
    for name, (size, kpl) in LIMIT_STREAMS.items():
        what = f"{size} B user records in KPL aggregates" if kpl else f"plain {size} B records"
        cells = [[f"{v:,.1f}" for v in shards_per_core(found[(name, k)], size, kpl)]
                 if (name, k) in found else ["-", "-"] for k in kinds]
        print(f"| {what}, written at 1 MiB/s per shard | "
              f"{' | '.join(c[0] for c in cells)} |")
        print(f"| {what}, read at 2 MiB/s per shard (catching up) | "
              f"{' | '.join(c[1] for c in cells)} |")
        steady = [f"{found[(name, k)]:,.0f}" if (name, k) in found else "-" for k in kinds]
        print(f"| (records/s per core, steady) | {' | '.join(steady)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
