"""Acceptance: amazon-kclpy's own sample application, unmodified, consumed by kclpy with no Java;
and a crashing amazon_kclpy application restarted from its checkpoint without losing records.

The amazon-kclpy sdist is downloaded from PyPI (see multilang_apps/amazon_kclpy_dist.py); its
``samples/sample_kclpy_app.py`` is copied byte for byte next to a ``.properties`` file made
from its own ``samples/sample.properties`` (pointed at the local endpoints), and a real
Worker runs it through the multilang processor factory against kinesis-mock (Kinesis) and
moto's server (DynamoDB). The sample reports every record on stderr, which reaches the
worker's log; it checkpoints after its first batch and again when shutdown is requested.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import shlex
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from kclpy import KCLConfig, Worker
from kclpy.arguments import parse_worker_args
from kclpy.config import read_properties
from kclpy.local import LocalEndpoint
from kclpy.metrics import MULTILANG_CHILD_FAILURES, Metrics
from kclpy.multilang import multilang_processor_factory
from tests.multilang_apps.amazon_kclpy_dist import amazon_kclpy_root
from tests.support.tally import Tally
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APPS = Path(__file__).parents[1] / "multilang_apps"
SHARDS = 2
RECORDS = 60
REGION = "us-east-1"
REPORT = re.compile(r"Sequence Number: (\d+), Subsequence Number: (\d+)")


def _client(service: str, url: str) -> Any:
    session: Any = boto3.session.Session(region_name=REGION)
    return session.client(service, endpoint_url=url)


def _create_stream(kinesis: Any, name: str) -> None:
    kinesis.create_stream(StreamName=name, ShardCount=SHARDS)
    wait_for(lambda: kinesis.describe_stream_summary(StreamName=name)[
        "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", 60, "the stream")


def _produce(kinesis: Any, stream: str) -> dict[str, list[str]]:
    """Put RECORDS records over many partition keys; the sequence numbers per shard."""
    produced: dict[str, list[str]] = collections.defaultdict(list)
    for number in range(RECORDS):
        answer = kinesis.put_record(StreamName=stream, Data=f"record-{number}".encode(),
                                    PartitionKey=f"key-{number}")
        produced[answer["ShardId"]].append(answer["SequenceNumber"])
    return produced


def _run_until(worker: Worker, condition: Any, what: str) -> None:
    """Run the worker in a thread until ``condition`` holds, then shut it down gracefully."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run, name="multilang-acceptance-worker", daemon=True)
    thread.start()
    try:
        wait_for(condition, 120, what)
    finally:
        worker.shutdown()
        thread.join(90)
    assert not thread.is_alive(), "the worker did not stop"
    assert not errors, errors


def _failures(tally: Tally) -> dict[tuple[str, str], float]:
    """Children killed, by shard and reason, counted after the shards left the stopped
    worker (their Prometheus series left with them)."""
    return {(str(key), reason): value
            for (key, (reason,)), value in tally.counts(MULTILANG_CHILD_FAILURES).items()}


def _write_application(folder: Path, sample_dir: Path, overrides: dict[str, str]) -> Path:
    """What a user moving from amazon_kclpy has: the application next to its properties
    file, whose keys are the sample's own plus the local endpoints."""
    app = folder / "sample_kclpy_app.py"
    app.write_bytes((sample_dir / "sample_kclpy_app.py").read_bytes())
    properties = dict(read_properties(sample_dir / "sample.properties"))
    # The sample names an ARN in a region that does not exist; the name is what counts here.
    properties.pop("streamArn", None)
    properties.update(overrides)
    path = folder / "app.properties"
    path.write_text("".join(f"{key} = {value}\n" for key, value in properties.items()))
    return path


#: a polling key makes the Java daemon's DEFAULT rule poll; without one it reads with fan-out
RETRIEVAL = {"polling": {"idleTimeBetweenReadsInMillis": "100"},
             "fanout": {"retryBackoffMillis": "200", "maxDescribeStreamConsumerRetries": "50"}}


@pytest.mark.parametrize("retrieval", list(RETRIEVAL))
def test_the_unmodified_amazon_kclpy_sample_processes_every_record_and_checkpoints(
        retrieval: str, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    caplog.set_level(logging.INFO, logger="kclpy.multilang")
    root = amazon_kclpy_root()
    stream = f"kclpysample-{uuid.uuid4().hex[:8]}"
    kinesis = _client("kinesis", kinesis_mock.url)
    _create_stream(kinesis, stream)
    produced = _produce(kinesis, stream)
    assert len(produced) == SHARDS, "the partition keys should cover both shards"

    properties = _write_application(tmp_path, root / "samples", {
        "executableName": f"{shlex.quote(sys.executable)} sample_kclpy_app.py",
        "streamName": stream,
        "applicationName": f"PythonKCLSample-{uuid.uuid4().hex[:8]}",
        "regionName": REGION,
        "kinesisEndpoint": kinesis_mock.url,
        "dynamoDBEndpoint": moto_server.url,
        "initialPositionInStream": "TRIM_HORIZON",
        **RETRIEVAL[retrieval],
        "shardSyncIntervalMillis": "1000",
        "failoverTimeMillis": "5000",
        "shutdownGraceMillis": "30000",
    })
    config, _ = parse_worker_args(["--properties", str(properties)])
    assert config.executable_name is not None and config.properties_dir == tmp_path.resolve()
    assert config.retrieval_mode == retrieval, "the Java daemon's DEFAULT rule"
    tally = Tally()
    metrics = Metrics(backends=[tally])
    factory = multilang_processor_factory(
        config.executable_name, cwd=config.properties_dir, metrics=metrics,
        env={"PYTHONPATH": str(root)})

    def processed() -> float:
        return sum(metrics.registry.get_sample_value(
            "kclpy_records_processed_total", {"shard_id": shard}) or 0.0 for shard in produced)

    _run_until(Worker(config, factory, metrics=metrics), lambda: processed() >= RECORDS,
               "every record acknowledged")

    # every record produced was reported by the sample, on the shard it was produced to
    reported: dict[str, set[str]] = collections.defaultdict(set)
    stderr: dict[str, list[str]] = collections.defaultdict(list)
    for record in caplog.records:
        text = getattr(record, "child_stderr", None)
        if text is not None:
            stderr[str(getattr(record, "shard_id", ""))].append(text)
    for shard, texts in stderr.items():
        reported[shard] = {seq for seq, _ in REPORT.findall("".join(texts))}
    for shard, sequence_numbers in produced.items():
        assert reported[shard] == set(sequence_numbers), shard

    # its checkpoints landed in the lease table: the last checkpoint on shutdown covers all
    dynamodb = _client("dynamodb", moto_server.url)
    items = dynamodb.scan(TableName=config.lease_table_name, ConsistentRead=True)["Items"]
    checkpoints = {item["leaseKey"]["S"]: item["checkpoint"]["S"] for item in items}
    assert checkpoints == {shard: max(seqs, key=int) for shard, seqs in produced.items()}
    assert _failures(tally) == {}, "no child had to be restarted"


def test_a_crashed_child_restarts_from_the_last_checkpoint_and_nothing_is_lost(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A v2 application exits in the middle of a batch, after checkpointing part of it: the
    shard's processor restarts from that checkpoint, the rest of the batch is delivered again,
    and the other shard never notices."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    stream = f"crash-{uuid.uuid4().hex[:8]}"
    kinesis = _client("kinesis", kinesis_mock.url)
    _create_stream(kinesis, stream)
    victim_payloads = ["v-0", "checkpoint", "v-2", "crash-once", "v-4"]
    victim: dict[str, str] = {}
    for payload in victim_payloads:
        answer = kinesis.put_record(StreamName=stream, Data=payload.encode(),
                                    PartitionKey="victim")
        victim[payload] = answer["SequenceNumber"]
        victim_shard = answer["ShardId"]
    others = {}
    for number in range(30):
        answer = kinesis.put_record(StreamName=stream, Data=f"o-{number}".encode(),
                                    PartitionKey=f"key-{number}")
        others[f"o-{number}"] = answer["ShardId"]
    bystander = {payload for payload, shard in others.items() if shard != victim_shard}
    assert bystander, "the partition keys should cover both shards"

    output = tmp_path / "events.jsonl"
    tally = Tally()
    metrics = Metrics(backends=[tally])
    factory = multilang_processor_factory(
        f"{shlex.quote(sys.executable)} v2_app.py", cwd=APPS, metrics=metrics,
        env={"PYTHONPATH": str(amazon_kclpy_root()), "KCLPY_TEST_OUTPUT": str(output)})
    config = KCLConfig(
        application_name=f"crash-{uuid.uuid4().hex[:8]}", stream_name=stream, region=REGION,
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON", idle_time_between_reads_ms=100,
        shard_sync_interval_ms=1000, failover_time_ms=5000, task_backoff_time_ms=50)

    def seen() -> list[dict[str, Any]]:
        if not output.exists():
            return []
        return [json.loads(line) for line in output.read_text().splitlines()]

    everything = set(victim_payloads) | set(others)
    _run_until(Worker(config, factory, metrics=metrics),
               lambda: everything <= {e.get("data") for e in seen()}, "every record processed")

    events = seen()
    assert _failures(tally) == {(victim_shard, "exited"): 1.0}
    starts = [e["sequence_number"] for e in events
              if e["event"] == "initialize" and e["shard_id"] == victim_shard]
    assert starts == ["TRIM_HORIZON", victim["checkpoint"]]
    records = [e for e in events if e["event"] == "record"]
    assert [e["data"] for e in records if e["data"] in victim] == [
        "v-0", "checkpoint", "v-2", "crash-once", "v-2", "crash-once", "v-4"]
    unaffected = [e["data"] for e in records if e["data"] in bystander]
    assert sorted(unaffected) == sorted(bystander), "the other shard: each record once"
