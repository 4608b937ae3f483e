"""The micro-batch path with lag recovery, end to end over real HTTP (kinesis-mock, the local
DynamoDB) in ``kclpy-worker --spark-batch`` processes writing through ``ParquetSink``: a
worker killed with SIGKILL while a gap is being recovered, the next one finishing it - every
record, of the gap and live, is in the Parquet output exactly once.

Most of the test's time is two JVMs starting on a loaded machine, so the second worker is
started while the first still runs: it waits for the one lease (the first worker holds as
many leases as the target, so there is nothing to balance) and takes it over once the first
is killed and the lease expires."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from kclpy.leases.serializer import RECOVERY
from kclpy.local import LocalEndpoint
from kclpy.recovery import queue as gaps
from tests.support.fleet import ROOT
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_LAG_MS = 1500


@contextmanager
def spark_workers(kinesis_url: str, dynamodb_url: str, stream: str, application: str,
                  workdir: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Starts ``--spark-batch`` worker processes by name (``start``); all are stopped on
    exit, and their logs shown when the test failed."""
    running: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "KCLPY_TEST_PARQUET": str(workdir / "out"),
               "KCLPY_TEST_BATCHES": str(workdir / "batches.jsonl"),
               "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        with (workdir / f"{name}.log").open("wb") as log:
            running[name] = subprocess.Popen([
                sys.executable, "-m", "kclpy", "--stream-name", stream,
                "--application-name", application, "--worker-id", name,
                "--spark-batch", "tests.support.spark_sink:write",
                "--region", "us-east-1", "--kinesis-endpoint", kinesis_url,
                "--dynamodb-endpoint", dynamodb_url, "--initial-position", "TRIM_HORIZON",
                "--failover-time-ms", "2000", "--idle-time-between-reads-ms", "100",
                "--shard-sync-interval-ms", "2000", "--max-lag-ms", str(MAX_LAG_MS),
                "--recovery-max-rate", "20",
            ], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return running[name]

    try:
        yield start
    except BaseException:
        for name in running:
            text = (workdir / f"{name}.log").read_text(encoding="utf-8", errors="replace")
            sys.stderr.write(f"--- {name} ---\n{text[-8000:]}\n")
        raise
    finally:
        # What the test checks is on disk by now, and a hard stop is what it exercises:
        # SIGKILL (the JVM of PySpark exits with its parent's pipe).
        for process in running.values():
            if process.poll() is None:
                process.kill()
            process.wait(60)


def committed(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "batches.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def parquet_rows(workdir: Path) -> collections.Counter[str]:
    """The rows of the committed batches: ``batch_id=N`` folders, each renamed into place
    whole. Not the whole output folder: its ``_staging`` holds the writes under way, whose
    Spark task folders come and go while they are listed (CI once failed listing one)."""
    files = sorted(str(path) for path in (workdir / "out").glob("batch_id=*/*.parquet"))
    if not files:
        return collections.Counter()
    table = pq.read_table(files, columns=["data"])
    return collections.Counter(bytes(value).decode() for value in table.column("data").to_pylist())


def queued_gaps(dynamodb_url: str, application: str) -> tuple[gaps.RecoveryRequest, ...]:
    client = dynamodb_client(dynamodb_url)
    try:
        items = client.scan(TableName=application, ConsistentRead=True)["Items"]
    except client.exceptions.ResourceNotFoundException:
        return ()
    return gaps.loads(items[0].get(RECOVERY, {}).get("S")) if items else ()


@pytest.mark.timeout(600)
def test_kill_9_while_a_gap_is_recovered_every_record_reaches_parquet_once(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-gap")
    create_stream(kinesis, stream, 1)
    backlog = [f"old-{n}" for n in range(300)]
    put_plain(kinesis, stream, [p.encode() for p in backlog])
    written = time.time()
    wait_for(lambda: time.time() > written + MAX_LAG_MS / 1000, 30, "the backlog to age",
             interval=0.1)
    application = unique_name("app")
    with spark_workers(kinesis_mock.url, moto_server.url, stream, application,
                       tmp_path) as start:
        first = start("a")
        wait_for(lambda: queued_gaps(moto_server.url, application), 180, "a queueing the gap")
        second = start("b")
        live = [f"live-{n}" for n in range(20)]
        put_plain(kinesis, stream, [p.encode() for p in live])
        wait_for(lambda: any(r["is_recovery"] for b in committed(tmp_path) for r in b["ranges"]),
                 180, "a committing part of the gap")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        assert queued_gaps(moto_server.url, application), "the gap was not finished by a"
        more = [f"live2-{n}" for n in range(20)]
        put_plain(kinesis, stream, [p.encode() for p in more])
        everything = set(backlog + live + more)
        wait_for(lambda: everything <= set(parquet_rows(tmp_path)), 240,
                 "every record in the Parquet output")
        wait_for(lambda: not queued_gaps(moto_server.url, application), 60, "the gap finished")
        assert second.poll() is None, "b stopped"
    rows = parquet_rows(tmp_path)
    assert rows == collections.Counter(everything), "each record exactly once"
