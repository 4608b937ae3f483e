"""End to end: CPU seconds per million records consumed, kclpy's Worker against a bare boto3
loop and async-kinesis, all reading the same stream from the same replay endpoint.

Each contender runs in its own process and measures its own CPU (user + system of every
thread, ``time.process_time()``) from the moment it starts working (imports done) to the
moment its processor has seen the last record: client creation, stream discovery, the lease table
and lease taking (kclpy) are inside the clock. The replay endpoint (``bench/replay.py``) and
DynamoDB (moto's server) run in processes of their own, so their CPU is not counted.

Contenders, each handing every user record's payload (bytes) to a processor that reads its
length:
  * kclpy: a real ``Worker`` (lease table on moto, TRIM_HORIZON, default settings), its
    processor counting in ``process_records``;
  * boto3: ``list_shards``, then per shard ``get_shard_iterator`` and ``get_records`` until
    caught up, de-aggregating with aws-kinesis-agg's ``iter_deaggregate_records`` (Boto3
    format) on the KPL stream, whose user records carry their payload base64-encoded again
    (decoded with ``binascii``); no lease, no checkpoint, no thread: the least a boto3
    consumer can do;
  * async-kinesis: its ``Consumer`` with ``MemoryCheckPointer``, TRIM_HORIZON and
    ``shard_fetch_rate=5`` (Kinesis's 5 GetRecords per second per shard instead of its
    default of 1), a processor that hands over the payload as bytes; on the KPL stream its
    ``KPLAggregator`` parse. Needs ``pip install async-kinesis`` (the ``bench`` extra), in
    this interpreter or the one ``--async-kinesis-python`` names.

Streams: 100 B records (plain), and the same number of 100 B user records in KPL aggregates
of up to 51,200 bytes (the KPL's default). A contender whose processor saw a different
number of records than the stream holds is reported as failed, not timed.

Each stream gets two lines: CPU from start to the last record, and CPU after the processor's
first record (start-up excluded: clients, discovery, leases and the first page).

With ``--retrieval-mode fanout`` the contenders read with enhanced fan-out instead: kclpy's
Worker (consumer registered, one subscription per shard) against botocore's own
``subscribe_to_shard`` iterated bare (``consume_boto3_subscribe``), the replay endpoint
serving events built from the same bytes as its pages.

Run: python bench/consume.py [--records N] [--shards N] [--repetitions N]
                             [--retrieval-mode polling|fanout]
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

REGION = "us-east-1"
RECORD_SIZE = 100
CONTENDERS = ("kclpy", "boto3", "async-kinesis")
#: --retrieval-mode fanout: kclpy subscribing, against botocore's subscribe_to_shard loop
FANOUT_CONTENDERS = ("kclpy", "boto3-subscribe")
_START_TIMEOUT_S = 120.0


@dataclass
class Measurement:
    """What a contender's process reports about its own run."""

    #: user + system CPU seconds of the process, from start of work to the last record
    cpu_s: float
    #: wall seconds over the same span
    wall_s: float
    #: user records the processor saw, and their payload bytes
    records: int
    bytes: int
    #: CPU seconds until the processor saw its first record: start-up, and the first page
    first_record_cpu_s: float


class _Clock:
    """CPU and wall time since construction. ``process_time`` is user + system time of the
    whole process, every thread included, at nanosecond resolution (``os.times`` ticks in
    10 ms steps)."""

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._wall = time.perf_counter()

    def read(self) -> tuple[float, float]:
        return time.process_time() - self._cpu, time.perf_counter() - self._wall


class Tally:
    """Counts what processors saw; stops the clock once ``expect`` records have been seen.

    Thread-safe: kclpy calls processors from one thread per shard. Counting per batch under
    a lock costs nothing per record.
    """

    def __init__(self, expect: int, clock: _Clock) -> None:
        self.expect = expect
        self._clock = clock
        self._lock = threading.Lock()
        self.records = 0
        self.bytes = 0
        self.first: tuple[float, float] | None = None
        self.elapsed: tuple[float, float] | None = None
        self.done = threading.Event()

    def add(self, records: int, size: int) -> None:
        with self._lock:
            if self.first is None and records:
                self.first = self._clock.read()
            self.records += records
            self.bytes += size
            if self.records >= self.expect and self.elapsed is None:
                self.elapsed = self._clock.read()
                self.done.set()

    def measurement(self) -> Measurement:
        if self.elapsed is None or self.first is None:
            raise RuntimeError(f"saw {self.records} of {self.expect} records")
        cpu, wall = self.elapsed
        return Measurement(cpu, wall, self.records, self.bytes, self.first[0])


# -- the contenders, each run inside its own process -------------------------------------------

def consume_kclpy(kinesis_url: str, dynamodb_url: str, stream: str, expect: int,
                  kpl: bool, timeout_s: float = 600.0,
                  retrieval_mode: str = "polling") -> Measurement:
    """A real Worker until its processors have seen ``expect`` records; then it shuts down
    (outside the clock). ``kpl`` changes nothing: kclpy de-aggregates whatever it reads.
    With ``retrieval_mode="fanout"`` it registers its consumer and subscribes."""
    from kclpy import IRecordProcessor, KCLConfig
    from kclpy.processor import (
        InitializeInput,
        LeaseLostInput,
        ProcessRecordsInput,
        ShardEndedInput,
        ShutdownRequestedInput,
    )
    from kclpy.worker import Worker

    class Counting(IRecordProcessor):
        def __init__(self, tally: Tally) -> None:
            self._tally = tally

        def initialize(self, initialize_input: InitializeInput) -> None:
            pass

        def process_records(self, process_records_input: ProcessRecordsInput) -> None:
            records = process_records_input.records
            size = 0
            for record in records:
                size += len(record.binary_data)
            self._tally.add(len(records), size)

        def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
            pass

        def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
            shard_ended_input.checkpointer.checkpoint()

        def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
            pass

    clock = _Clock()
    tally = Tally(expect, clock)
    config = KCLConfig(
        application_name=f"bench-consume-{uuid.uuid4().hex[:12]}", stream_name=stream,
        region=REGION, kinesis_endpoint=kinesis_url, dynamodb_endpoint=dynamodb_url,
        initial_position="TRIM_HORIZON", retrieval_mode=retrieval_mode)
    worker = Worker(config, lambda: Counting(tally))
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False},
                              name="bench-worker", daemon=True)
    runner.start()
    finished = tally.done.wait(timeout_s)
    worker.shutdown()
    runner.join(60)
    if not finished:
        raise RuntimeError(f"kclpy saw {tally.records} of {expect} records in {timeout_s}s")
    return tally.measurement()


def count_boto3(records: list[dict[str, Any]], kpl: bool) -> tuple[int, int]:
    """User records and payload bytes of botocore's records, de-aggregated on a KPL
    stream: Boto3 records in, Lambda-style records out ({"kinesis": {"data": ...}}), the
    payload of a sub-record base64-encoded again (as Lambda delivers it); binascii is the
    cheapest way back to bytes that the standard library has."""
    from aws_kinesis_agg.deaggregator import iter_deaggregate_records

    count = size = 0
    if kpl:
        for user in iter_deaggregate_records(records, data_format="Boto3"):
            kinesis = user["kinesis"]
            data = kinesis["data"]
            if kinesis.get("aggregated"):
                data = binascii.a2b_base64(data)
            size += len(data)
            count += 1
    else:
        for record in records:
            size += len(record["Data"])
            count += 1
    return count, size


def consume_boto3(kinesis_url: str, stream: str, expect: int, kpl: bool) -> Measurement:
    """GetShardIterator + GetRecords until caught up, shard after shard."""
    import boto3

    clock = _Clock()
    tally = Tally(expect, clock)
    client = boto3.client("kinesis", endpoint_url=kinesis_url, region_name=REGION)
    shards = client.list_shards(StreamName=stream)["Shards"]
    for shard in shards:
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"],
            ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
        while True:
            response = client.get_records(ShardIterator=iterator, Limit=10_000)
            tally.add(*count_boto3(response["Records"], kpl))
            iterator = response["NextShardIterator"]
            if not response["Records"] and response.get("MillisBehindLatest") == 0:
                break
    return tally.measurement()


def consume_boto3_subscribe(kinesis_url: str, stream: str, expect: int,
                            kpl: bool) -> Measurement:
    """botocore's own ``subscribe_to_shard`` (the replay endpoint sends the
    ``initial-response`` it insists on), shard after shard from TRIM_HORIZON, each shard's
    subscriptions renewed after their continuation until it is read; a consumer registered
    first, inside the clock as kclpy's registration is."""
    import boto3

    clock = _Clock()
    tally = Tally(expect, clock)
    client = boto3.client("kinesis", endpoint_url=kinesis_url, region_name=REGION)
    arn = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"]
    consumer = client.register_stream_consumer(
        StreamARN=arn, ConsumerName=f"bare-{uuid.uuid4().hex[:12]}")["Consumer"]["ConsumerARN"]
    for shard in client.list_shards(StreamName=stream)["Shards"]:
        position: dict[str, str] = {"Type": "TRIM_HORIZON"}
        caught_up = False
        while not caught_up:
            answer = client.subscribe_to_shard(ConsumerARN=consumer, ShardId=shard["ShardId"],
                                               StartingPosition=position)
            for item in answer["EventStream"]:
                event = item["SubscribeToShardEvent"]
                tally.add(*count_boto3(event["Records"], kpl))
                position = {"Type": "AFTER_SEQUENCE_NUMBER",
                            "SequenceNumber": event["ContinuationSequenceNumber"]}
                if event["MillisBehindLatest"] == 0 and not event["Records"]:
                    caught_up = True
                    break
            answer["EventStream"].close()
    return tally.measurement()


def consume_async_kinesis(kinesis_url: str, stream: str, expect: int,
                          kpl: bool) -> Measurement:
    """async-kinesis's Consumer, iterated until ``expect`` items came out of it."""
    from kinesis import Consumer, MemoryCheckPointer
    from kinesis.aggregators import KPLAggregator, SimpleAggregator
    from kinesis.processors import Processor

    class RawProcessor(Processor, SimpleAggregator):
        def deserialize(self, data: bytes) -> bytes:
            return data

    class RawKPLProcessor(Processor, KPLAggregator):
        def deserialize(self, data: bytes) -> bytes:
            return data

    async def run(tally: Tally) -> None:
        consumer = Consumer(
            stream, endpoint_url=kinesis_url, region_name=REGION,
            iterator_type="TRIM_HORIZON", checkpointer=MemoryCheckPointer(name="bench"),
            processor=RawKPLProcessor() if kpl else RawProcessor(), record_limit=10_000,
            shard_fetch_rate=5)
        async with consumer:
            async for item in consumer:
                tally.add(1, len(item))
                if tally.done.is_set():
                    break

    clock = _Clock()
    tally = Tally(expect, clock)
    asyncio.run(run(tally))
    return tally.measurement()


# -- the parent: endpoints, child processes, medians -----------------------------------------

def child_environment() -> dict[str, str]:
    """Dummy credentials and no profile or endpoint override: nothing can reach real AWS."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_ENDPOINT_URL") and k not in ("AWS_PROFILE",
                                                                 "AWS_DEFAULT_PROFILE")}
    env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION=REGION, AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    return env


def run_child(python: str, contender: str, kinesis_url: str, dynamodb_url: str, stream: str,
              expect: int, kpl: bool, retrieval_mode: str = "polling") -> Measurement:
    argv = [python, str(Path(__file__).resolve()), "--child", contender, "--kinesis",
            kinesis_url, "--dynamodb", dynamodb_url, "--stream", stream, "--expect",
            str(expect), "--retrieval-mode", retrieval_mode]
    if kpl:
        argv.append("--kpl")
    done = subprocess.run(argv, capture_output=True, text=True, env=child_environment(),
                          timeout=900, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{contender} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return Measurement(**json.loads(lines[-1]))


class ReplayProcess:
    """``bench/replay.py`` as a child process; its URL is the first line it prints."""

    def __init__(self, python: str, streams: Sequence[str],
                 options: Sequence[str] = (), start_timeout_s: float = _START_TIMEOUT_S) -> None:
        argv = [python, str(BENCH / "replay.py"), *options]
        for spec in streams:
            argv += ["--stream", spec]
        self._process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        stdout = self._process.stdout
        assert stdout is not None
        box: list[str] = []
        # A thread, so that a replay that never prints cannot hang the benchmark.
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if not box or not box[0].startswith("http://"):
            self.stop()
            raise RuntimeError("the replay endpoint did not start")
        self.url = box[0].strip()

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ReplayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def has_module(python: str, module: str) -> bool:
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                           check=False)
    return probe.returncode == 0


def per_million(cpu_s: float, records: int) -> float:
    return cpu_s / records * 1e6


def contenders_for(options: argparse.Namespace) -> list[str]:
    """Who runs, each with at least one run: a contender left without runs would have no
    median to print (``--async-kinesis-repetitions 0`` once crashed the summary)."""
    if options.retrieval_mode == "fanout":
        return list(FANOUT_CONTENDERS)
    if options.async_kinesis_repetitions <= 0:
        print("async-kinesis: --async-kinesis-repetitions 0; left out", flush=True)
        return [c for c in CONTENDERS if c != "async-kinesis"]
    if not has_module(options.async_kinesis_python, "kinesis"):
        print("async-kinesis: not installed in "
              f"{options.async_kinesis_python} (pip install async-kinesis); left out",
              flush=True)
        return [c for c in CONTENDERS if c != "async-kinesis"]
    return list(CONTENDERS)


def main(argv: Sequence[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--records", type=int, default=1_000_000,
                      help="user records per stream (split evenly over the shards)")
    args.add_argument("--shards", type=int, default=1)
    args.add_argument("--repetitions", type=int, default=3)
    args.add_argument("--async-kinesis-repetitions", type=int, default=1,
                      help="async-kinesis takes about ten times as long as the others")
    args.add_argument("--async-kinesis-python", default=sys.executable,
                      help="an interpreter with async-kinesis installed")
    args.add_argument("--retrieval-mode", choices=("polling", "fanout"), default="polling",
                      help="fanout: kclpy with enhanced fan-out against a bare botocore "
                           "subscribe_to_shard loop")
    args.add_argument("--child", choices=CONTENDERS + FANOUT_CONTENDERS[1:],
                      help=argparse.SUPPRESS)
    args.add_argument("--kinesis", help=argparse.SUPPRESS)
    args.add_argument("--dynamodb", help=argparse.SUPPRESS)
    args.add_argument("--stream", help=argparse.SUPPRESS)
    args.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    args.add_argument("--kpl", action="store_true", help=argparse.SUPPRESS)
    options = args.parse_args(argv)
    if options.child:
        print(json.dumps(asdict(child(options))), flush=True)
        return

    from kclpy.local import start_moto_server

    per_shard = options.records // options.shards
    total = per_shard * options.shards
    streams = {"plain": f"plain:{options.shards}:{per_shard}:{RECORD_SIZE}",
               "kpl": f"kpl:{options.shards}:{per_shard}:{RECORD_SIZE}:kpl"}
    pythons = {"kclpy": sys.executable, "boto3": sys.executable,
               "boto3-subscribe": sys.executable,
               "async-kinesis": options.async_kinesis_python}
    fanout = options.retrieval_mode == "fanout"
    contenders = contenders_for(options)
    print(f"building {total:,} records per stream on the replay endpoint...", flush=True)
    with start_moto_server() as moto, ReplayProcess(sys.executable, list(streams.values())) \
            as replay:
        for stream in streams:
            kpl = stream == "kpl"
            runs: dict[str, list[float]] = {c: [] for c in contenders}
            steady: dict[str, list[float]] = {c: [] for c in contenders}
            walls: dict[str, list[float]] = {c: [] for c in contenders}
            starts: dict[str, list[float]] = {c: [] for c in contenders}
            for repetition in range(options.repetitions):
                for contender in contenders:
                    if (contender == "async-kinesis"
                            and repetition >= options.async_kinesis_repetitions):
                        continue
                    m = run_child(pythons[contender], contender, replay.url, moto.url, stream,
                                  total, kpl, options.retrieval_mode)
                    if m.records != total:
                        raise RuntimeError(f"{contender} saw {m.records} of {total} records")
                    runs[contender].append(per_million(m.cpu_s, m.records))
                    steady[contender].append(
                        per_million(m.cpu_s - m.first_record_cpu_s, m.records))
                    walls[contender].append(m.records / m.wall_s)
                    starts[contender].append(m.first_record_cpu_s)
            label = (f"{total:,} x {RECORD_SIZE} B user records, "
                     + ("KPL-aggregated" if kpl else "plain")
                     + f", {options.shards} shard(s)"
                     + (", enhanced fan-out" if fanout else ""))
            print(summary(label, runs, walls, starts), flush=True)
            print(summary(f"{label}, start-up excluded (CPU after the first record)", steady,
                          walls, starts), flush=True)


def summary(label: str, runs: dict[str, list[float]], walls: dict[str, list[float]],
            starts: dict[str, list[float]]) -> str:
    """One line: each contender's median CPU per million records, ratios to kclpy's."""
    def detail(contender: str) -> str:
        return (f"first record after {statistics.median(starts[contender]):.2f} CPU s, "
                f"{statistics.median(walls[contender]):,.0f} records/s wall")

    ours = statistics.median(runs["kclpy"])
    parts = [f"kclpy {ours:.2f} CPU s per million records ({detail('kclpy')})"]
    for contender in runs:
        if contender != "kclpy":
            theirs = statistics.median(runs[contender])
            parts.append(f"{contender} {theirs:.2f} ({detail(contender)}), "
                         f"ratio {theirs / ours:.1f}x")
    return f"{label}: " + "; ".join(parts)


def child(options: argparse.Namespace) -> Measurement:
    runners: dict[str, Callable[[], Measurement]] = {
        "kclpy": lambda: consume_kclpy(options.kinesis, options.dynamodb, options.stream,
                                       options.expect, options.kpl,
                                       retrieval_mode=options.retrieval_mode),
        "boto3-subscribe": lambda: consume_boto3_subscribe(options.kinesis, options.stream,
                                                           options.expect, options.kpl),
        "boto3": lambda: consume_boto3(options.kinesis, options.stream, options.expect,
                                       options.kpl),
        "async-kinesis": lambda: consume_async_kinesis(options.kinesis, options.stream,
                                                       options.expect, options.kpl),
    }
    return runners[options.child]()


if __name__ == "__main__":
    main()
