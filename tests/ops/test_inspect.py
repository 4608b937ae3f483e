"""The ``kclpy`` inspector against real endpoints: moto's server for the lease table,
kinesis-mock for the stream, and a real Worker whose processor stops checkpointing."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kclpy
from kclpy import StreamConfig, Worker
from kclpy.leases import park as parking
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.ops import inspect as inspect_module
from kclpy.ops import serve_worker
from kclpy.ops.commands import parse_args
from kclpy.ops.inspect import run_status
from kclpy.ops.text import TerminalText
from kclpy.position import Position
from tests.support.cli import endpoints, run_cli
from tests.support.e2e import worker_config
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.recovery import age
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running

ROOT = Path(__file__).resolve().parents[2]


# -- kclpy leases ------------------------------------------------------------------------


@pytest.fixture
def lease_table(moto_server: LocalEndpoint) -> str:
    """A table as a Java KCL 2.x fleet leaves it: a finished parent, two children (one
    owned, one free), and an attribute kclpy does not model."""
    name = unique_name("leases")
    client = dynamodb_client(moto_server.url)
    table = LeaseTable(client, name)
    table.create_if_missing()
    table.create(Lease("shardId-000000000000", checkpoint=Position.shard_end(),
                       child_shard_ids=frozenset({"shardId-000000000001",
                                                  "shardId-000000000002"})))
    table.create(Lease("shardId-000000000001", lease_owner="worker-a", lease_counter=41,
                       checkpoint=Position(
                           "49590338271490256608559692538361571095921575989136588898", 3),
                       owner_switches_since_checkpoint=2,
                       parent_shard_ids=frozenset({"shardId-000000000000"})))
    table.create(Lease("shardId-000000000002", checkpoint=Position.trim_horizon(),
                       parent_shard_ids=frozenset({"shardId-000000000000"})))
    client.update_item(TableName=name, Key={"leaseKey": {"S": "shardId-000000000001"}},
                       UpdateExpression="SET throughputKBps = :t",
                       ExpressionAttributeValues={":t": {"N": "12.5"}})
    return name


@pytest.mark.integration
def test_leases_json_is_keyed_by_the_tables_attribute_names(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, lease_table: str) -> None:
    code, out, _ = run_cli(capsys, "leases", "--application-name", lease_table, "--json",
                           *endpoints(kinesis_mock, moto_server))
    assert code == 0
    leases = json.loads(out)
    assert [lease["leaseKey"] for lease in leases] == [
        "shardId-000000000000", "shardId-000000000001", "shardId-000000000002"]
    parent, owned, free = leases
    assert parent["checkpoint"] == "SHARD_END"
    assert parent["childShardIds"] == ["shardId-000000000001", "shardId-000000000002"]
    assert owned == {
        "leaseKey": "shardId-000000000001", "leaseOwner": "worker-a", "leaseCounter": 41,
        "checkpoint": "49590338271490256608559692538361571095921575989136588898",
        "checkpointSubSequenceNumber": 3, "ownerSwitchesSinceCheckpoint": 2,
        "parentShardId": ["shardId-000000000000"], "throughputKBps": 12.5,
        "state": "HELD",
    }
    assert "leaseOwner" not in free
    assert [parent["state"], free["state"]] == ["FINISHED", "FREE"]


@pytest.mark.integration
def test_leases_table_shows_owner_checkpoint_and_lineage(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, lease_table: str) -> None:
    code, out, _ = run_cli(capsys, "leases", "--application-name", "whatever",
                           "--table-name", lease_table, *endpoints(kinesis_mock, moto_server))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STREAM", "SHARD", "STATE", "OWNER", "COUNTER", "CHECKPOINT",
                                "SUB", "SWITCHES", "PARENTS", "CHILDREN"]
    assert lines[1].split() == ["-", "shardId-000000000000", "FINISHED", "-", "0", "SHARD_END",
                                "0", "0", "-", "shardId-000000000001,shardId-000000000002"]
    assert lines[2].split() == [
        "-", "shardId-000000000001", "HELD", "worker-a", "41",
        "49590338271490256608559692538361571095921575989136588898", "3", "2",
        "shardId-000000000000", "-"]
    assert lines[3].split()[:6] == ["-", "shardId-000000000002", "FREE", "-", "0",
                                    "TRIM_HORIZON"]
    assert lines[-1] == f"3 lease(s) in {lease_table}"


@pytest.mark.integration
@pytest.mark.parametrize("use_table_name", [False, True])
def test_a_missing_table_names_the_option(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, use_table_name: bool) -> None:
    name = unique_name("absent")
    naming = ["--table-name", name] if use_table_name else []
    code, out, err = run_cli(capsys, "leases", "--application-name", name, *naming,
                             *endpoints(kinesis_mock, moto_server))
    option = "--table-name" if use_table_name else "--application-name"
    assert (code, out) == (2, "")
    assert err == f"kclpy leases: error: {option}: lease table {name!r} does not exist\n"


# -- bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "option"), [
    (["status", "--application-name", "a"], "--stream-name"),
    (["status", "--application-name", "a", "--stream-name", "s", "--samples", "1"],
     "--samples"),
    (["status", "--application-name", "a", "--stream-name", "s", "--window-seconds", "-3"],
     "--window-seconds"),
    (["status", "--application-name", "a", "--stream-name", "s", "--records-limit", "10001"],
     "--records-limit"),
    (["status", "--application-name", "a", "--stream-name", "s", "--count", "2"], "--count"),
    (["leases"], "--application-name"),
    (["leases", "--application-name", "a", "--kinesis-endpoint", "localhost:4566"],
     "--kinesis-endpoint"),
    (["nonsense"], "nonsense"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_option(
        capsys: pytest.CaptureFixture[str], argv: list[str], option: str) -> None:
    """Exit 2, except for ``status``, a check whose 2 means ERROR: its usage errors are
    UNKNOWN (3)."""
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (3 if argv[0] == "status" else 2, "")
    assert len(err.splitlines()) == 1 and option in err


def test_no_region_names_the_region_option(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    code, _, err = run_cli(capsys, "leases", "--application-name", "a")
    assert code == 2
    assert err.startswith("kclpy leases: error: --region: ") and len(err.splitlines()) == 1


@pytest.mark.integration
def test_status_of_a_missing_stream_names_the_option(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, lease_table: str) -> None:
    code, _, err = run_cli(capsys, "status", "--application-name", lease_table,
                           "--stream-name", unique_name("absent"), "--window-seconds", "0.1",
                           "--samples", "2", *endpoints(kinesis_mock, moto_server))
    assert code == 3
    assert "--stream-name: stream" in err and len(err.splitlines()) == 1


@pytest.mark.integration
def test_unreachable_endpoint_is_status_unknown(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "status", "--application-name", "a", "--stream-name", "s",
                           "--region", "us-east-1", "--kinesis-endpoint", "http://127.0.0.1:9",
                           "--dynamodb-endpoint", "http://127.0.0.1:9",
                           "--window-seconds", "0.1", "--samples", "2")
    assert code == 3
    assert err.startswith("kclpy status: error: ")


# -- kclpy status against a real worker ------------------------------------------------


class FakeClock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Gate:
    """Which shards' processors checkpoint; a test flips it while the worker runs."""

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.lock = threading.Lock()

    def checkpointing(self, shard_id: str) -> bool:
        with self.lock:
            return shard_id not in self.paused


class PausableProcessor(kclpy.IRecordProcessor):
    """Records everything; checkpoints after every call unless its shard is paused. Called
    with empty batches too, so that it catches up on its checkpoint as soon as it resumes."""

    def __init__(self, ledger: Ledger, gate: Gate) -> None:
        self.ledger = ledger
        self.gate = gate
        self.shard_id = ""

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            self.ledger.add(self.shard_id, record)
        if self.gate.checkpointing(self.shard_id):
            process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput
                           ) -> None:
        pass


def checkpoints(moto_server: LocalEndpoint, table: str) -> dict[str, str]:
    items = dynamodb_client(moto_server.url).scan(TableName=table, ConsistentRead=True)["Items"]
    return {item["leaseKey"]["S"]: item["checkpoint"]["S"] for item in items}


def last_per_shard(written: list[tuple[str, str]]) -> dict[str, str]:
    return {shard: sequence for shard, sequence in written}


@pytest.mark.integration
def test_status_reports_stop_while_a_processor_does_not_checkpoint_and_ok_after(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("status")
    create_stream(kinesis, stream, 2)
    config = worker_config(kinesis_mock.url, moto_server.url, stream,
                           call_process_records_even_for_empty_record_list=True)
    table = config.lease_table_name
    ledger, gate = Ledger(), Gate()
    worker = Worker(config, lambda: PausableProcessor(ledger, gate))
    status_args = ["status", "--application-name", config.application_name,
                   "--stream-name", stream, "--window-seconds", "2", "--samples", "3",
                   *endpoints(kinesis_mock, moto_server)]
    with running(worker):
        assert worker.wait_started(30)
        first = last_per_shard(put_plain(kinesis, stream, [f"a{n}".encode() for n in range(20)]))
        wait_for(lambda: checkpoints(moto_server, table) == first, 60, "first checkpoints")
        stopped, steady = sorted(first)
        with gate.lock:
            gate.paused.add(stopped)
        written = put_plain(kinesis, stream, [f"b{n}".encode() for n in range(30)])
        unchecked = sum(1 for shard, _ in written if shard == stopped)
        second = last_per_shard(written)
        wait_for(lambda: len(ledger.records) == 50, 60, "every record processed")
        wait_for(lambda: checkpoints(moto_server, table)[steady] == second[steady], 30,
                 "the steady shard checkpointed")

        code, out, err = run_cli(capsys, *status_args, "--json")
        assert (code, err) == (2, "")
        report = json.loads(out)
        assert report["status"] == "ERROR"
        assert (report["application"], report["stream"]) == (config.application_name, stream)
        by_shard = {shard["shard_id"]: shard for shard in report["shards"]}
        assert set(by_shard) == {stopped, steady}
        assert by_shard[stopped]["status"] == "STOP"
        assert "no checkpoint for" in by_shard[stopped]["reason"]
        assert by_shard[stopped]["checkpoint"] == first[stopped]
        assert by_shard[stopped]["owner"] == config.worker_id
        assert (by_shard[stopped]["records_behind"], by_shard[stopped]["records_behind_exact"]
                ) == (unchecked, True)
        assert by_shard[stopped]["millis_behind"] > 0
        assert by_shard[stopped]["complete"] == 1.0
        assert by_shard[steady]["status"] == "OK"
        assert by_shard[steady]["records_behind"] == 0

        with gate.lock:
            gate.paused.clear()
        wait_for(lambda: checkpoints(moto_server, table) == second, 30, "caught up again")
        result = subprocess.run(
            [sys.executable, "-m", "kclpy.ops.commands", *status_args], cwd=ROOT,
            capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{config.application_name} on {stream}: OK (window 2s, 3 samples)"
    assert lines[1].split()[:2] == ["SHARD", "STATUS"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {stopped, steady}
    for shard, row in rows.items():
        assert row[1:5] == ["OK", config.worker_id, second[shard], "0"]


@pytest.mark.integration
def test_watch_prints_the_sliding_window_after_every_sample(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("watch")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"x", b"y", b"z"])
    name = unique_name("watch")
    table = LeaseTable(dynamodb_client(moto_server.url), name)
    table.create_if_missing()
    shard_id = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
    table.create(Lease(shard_id, checkpoint=Position.trim_horizon()))
    clock = FakeClock()
    args = parse_args(["status", "--application-name", name, "--stream-name", stream,
                       "--watch", "--count", "3", "--window-seconds", "60", "--samples", "3",
                       "--json", *endpoints(kinesis_mock, moto_server)])
    out = io.StringIO()
    code = run_status(args, out, clock=clock.time, sleep=clock.sleep)
    assert clock.slept == [30.0, 30.0], "one sample every window / (samples - 1) seconds"
    reports = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(reports) == 3
    shards = [report["shards"][0] for report in reports]
    assert [s["records_behind"] for s in shards] == [3, 3, 3]
    assert [s["complete"] for s in shards] == [0.0, 0.5, 1.0]
    # before a whole window: not yet STOP, but not "OK consuming" either, nobody consumes it
    assert [s["status"] for s in shards[:2]] == ["WARN", "WARN"]
    assert all(s["reason"].startswith("no worker holds the lease") for s in shards[:2])
    # Nobody holds the lease and it never moves: a whole window without checkpoint.
    assert shards[-1]["status"] == "STOP"
    assert "no checkpoint for 60s" in shards[-1]["reason"]
    assert "no worker holds the lease" in shards[-1]["reason"]
    assert code == 2


@pytest.mark.integration
def test_status_lists_unleased_shards_and_unlisted_leases_without_judging_them(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("partial")
    create_stream(kinesis, stream, 2)
    written = put_plain(kinesis, stream, [b"p", b"q", b"r"], partition_keys=["k"] * 3)
    leased = written[0][0]
    (unleased,) = {s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]
                   } - {leased}
    name = unique_name("partial")
    table = LeaseTable(dynamodb_client(moto_server.url), name)
    table.create_if_missing()
    table.create(Lease(leased, lease_owner="w-7", checkpoint=Position.trim_horizon()))
    table.create(Lease("shardId-000000000999", checkpoint=Position.shard_end()))
    clock = FakeClock()
    args = parse_args(["status", "--application-name", name, "--stream-name", stream,
                       "--window-seconds", "10", "--samples", "2", "--records-limit", "2",
                       *endpoints(kinesis_mock, moto_server)])
    out = io.StringIO()
    code = run_status(args, out, clock=clock.time, sleep=clock.sleep)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"{name} on {stream}: ERROR (window 10s, 2 samples)"
    assert lines[2].split()[:5] == [leased, "STOP", "w-7", "TRIM_HORIZON", "2+"]
    assert lines[3:] == [f"open shards without a lease: {unleased}",
                         "leases of shards the stream no longer lists: shardId-000000000999"]
    assert code == 2


# -- what the workers say, and multi-stream tables ------------------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.integration
def test_status_with_workers_shows_retrieval_mode_subscription_age_and_recovery_queue(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("inspect-efo")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"old-{n}".encode() for n in range(300)])
    age(1500)
    config = worker_config(kinesis_mock.url, moto_server.url, stream, retrieval_mode="fanout",
                           retry_backoff_ms=200, max_describe_stream_consumer_retries=50,
                           max_lag_ms=1500, recovery_max_rate=10)
    worker = Worker(config, lambda: RecordingProcessor(Ledger()))

    def fanout_and_recovering() -> bool:
        shards = worker.status()["shards"].values()
        return any(s["retrieval"].get("subscription_age_s") is not None and s["recovery"]
                   for s in shards)

    with serve_worker(worker, lag_window_s=None) as server, running(worker):
        wait_for(fanout_and_recovering, 60, "a fan-out subscription and a queued gap")
        gone = f"http://127.0.0.1:{closed_port()}"
        argv = ["status", "--application-name", config.application_name,
                "--stream-name", stream, "--window-seconds", "0.2", "--samples", "2",
                "--worker", server.url, "--worker", gone,
                *endpoints(kinesis_mock, moto_server)]
        report_out, text_out = io.StringIO(), io.StringIO()
        run_status(parse_args([*argv, "--json"]), report_out)
        run_status(parse_args(argv), text_out)
    report = json.loads(report_out.getvalue())
    (shard,) = report["shards"]
    assert shard["worker"] == config.worker_id
    assert shard["retrieval"]["mode"] == "fanout"
    assert shard["retrieval"]["subscription_age_s"] >= 0
    (gap,) = shard["recovery"]
    assert gap["after"] == "TRIM_HORIZON" and gap["remaining_ms"] > 0
    assert [(w["url"], w["reachable"]) for w in report["workers"]] == [
        (server.url, True), (gone, False)]
    lines = text_out.getvalue().splitlines()
    assert lines[1].split()[-4:] == ["MODE", "SUB", "AGE", "RECOVERY"]
    assert "fanout" in lines[2].split() and "gap(s)," in lines[2]
    assert lines[-1].startswith(f"worker {gone} unreachable:")


def test_a_bad_worker_url_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "status", "--application-name", "a", "--stream-name", "s",
                           "--worker", "localhost:9000")
    assert code == 3  # status: a usage error is UNKNOWN
    assert "--worker" in err and err.count("\n") == 1


@pytest.mark.integration
def test_a_multi_stream_table_is_shown_and_inspected_one_stream_at_a_time(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    names = [unique_name("insp-ms") for _ in range(2)]
    for name, shards in zip(names, (1, 2), strict=True):
        create_stream(kinesis, name, shards)
        put_plain(kinesis, name, [f"{name}-{n}".encode() for n in range(6)])
    ledger = Ledger()
    config = worker_config(kinesis_mock.url, moto_server.url, "", stream_name=None,
                           streams=tuple(StreamConfig(name) for name in names))
    with running(Worker(config, lambda: RecordingProcessor(ledger))):
        wait_for(lambda: len(ledger.records) >= 12, 60, "both streams processed")
    code, out, _ = run_cli(capsys, "leases", "--application-name", config.application_name,
                           *endpoints(kinesis_mock, moto_server))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:-1]]
    assert sorted(row[0] for row in rows) == sorted([names[0], names[1], names[1]])
    assert all(row[1].startswith("shardId-") for row in rows), "bare shard ids"
    code, out, _ = run_cli(capsys, "leases", "--application-name", config.application_name,
                           "--stream-name", names[1], *endpoints(kinesis_mock, moto_server))
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == [names[1], names[1]]
    args = parse_args(["status", "--application-name", config.application_name,
                       "--stream-name", names[1], "--window-seconds", "10", "--samples", "2",
                       "--json", *endpoints(kinesis_mock, moto_server)])
    clock, report_out = FakeClock(), io.StringIO()
    run_status(args, report_out, clock=clock.time, sleep=clock.sleep)
    report = json.loads(report_out.getvalue())
    assert len(report["shards"]) == 2 and report["status"] == "OK"
    assert report["unleased_shards"] == [] and report["unlisted_leases"] == []


@pytest.mark.parametrize(("argv", "code"), [
    (["status", "--application-name", "a"], 3),
    (["status", "--application-name", "a", "--stream-name", "s", "--count", "2"], 3),
    (["status", "--application-name", "a", "--stream-name", "s", "--windw-seconds", "5"], 3),
    (["leases"], 2),
])
def test_a_usage_error_of_status_is_unknown_not_error(
        argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    """``kclpy status`` is a check (Nagios, Sensu): its ERROR is exit 2, so a typo in its
    command line must say UNKNOWN (3); the other commands keep exit 2 for usage errors."""
    got, _, err = run_cli(capsys, *argv)
    assert got == code, err
    assert err.count("\n") == 1 and "error:" in err


def test_status_on_a_terminal_says_what_it_samples_before_it_waits(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Silent for the whole window (30 s by default), it looked hung."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run_cli(capsys, "status", "--application-name", "a", "--stream-name", "s",
                           "--window-seconds", "0.1", "--samples", "2", "--region", "us-east-1",
                           "--kinesis-endpoint", "http://127.0.0.1:9",
                           "--dynamodb-endpoint", "http://127.0.0.1:9")
    assert code == 3
    assert err.splitlines()[0] == ("sampling 2 times over 0.1 s (--window-seconds, --samples) "
                                   "before the first status ...")


# -- what others wrote reaches the terminal escaped ---------------------------------------

#: a title change, a screen clear, a colour, a cursor move up and a line break: each would
#: act on the operator's terminal if printed raw
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\x1b[1A\nforged\u202e"


def assert_escaped(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "forged" not in {line.strip() for line in text.splitlines()}
    assert "\\x1b]0;owned\\x07" in text


@pytest.mark.integration
def test_leases_escape_control_characters_of_worker_ids_and_park_reasons(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    name = unique_name("hostile")
    client = dynamodb_client(moto_server.url)
    table = LeaseTable(client, name)
    table.create_if_missing()
    table.create(Lease("shardId-000000000000", lease_owner=f"worker{HOSTILE}",
                       checkpoint=Position.trim_horizon()))
    table.create(Lease("shardId-000000000001", checkpoint=Position.trim_horizon()))
    mark = parking.marker(f"reason{HOSTILE}", f"op{HOSTILE}", error=f"key{HOSTILE}")
    client.update_item(TableName=name, Key={"leaseKey": {"S": "shardId-000000000001"}},
                       UpdateExpression="SET kclpyParked = :p",
                       ExpressionAttributeValues={":p": {"S": mark}})
    code, out, _ = run_cli(capsys, "leases", "--application-name", name,
                           *endpoints(kinesis_mock, moto_server))
    assert code == 0
    assert out.count("\\x1b]0;owned\\x07") == 3  # the owner, the reason and the error
    assert_escaped(out)


def test_status_escapes_control_characters_of_every_reported_field() -> None:
    """A status report's fields come from the lease table, the workers' /status documents
    and the records' producers (a failure message quotes a partition key)."""
    report = {
        "application": "app", "stream": "s", "status": "ERR", "window_seconds": 60,
        "samples": 2, "unleased_shards": [f"shard{HOSTILE}"],
        "unlisted_leases": [f"lease{HOSTILE}"],
        "shards": [{"shard_id": f"id{HOSTILE}", "status": "STALL", "owner": f"w{HOSTILE}",
                    "checkpoint": "1", "reason": f"r{HOSTILE}",
                    "failure": {"error_type": "ValueError", "attempts": 3, "since_ms": 0,
                                "message": f"bad partition key {HOSTILE}"}}],
        "parked": {f"p{HOSTILE}": {"reason": f"r{HOSTILE}", "by": f"by{HOSTILE}",
                                  "error": f"e{HOSTILE}"}},
        "workers": [{"url": "http://127.0.0.1:1", "reachable": False,
                     "error": f"e{HOSTILE}"}],
    }
    out = io.StringIO()
    inspect_module._print_status(report, out, as_json=False, watching=False)
    assert_escaped(out.getvalue())
    # one escaped copy per field, none dropped
    assert out.getvalue().count("\\x1b]0;owned\\x07") == 12


def test_the_inspector_output_stream_escapes_what_a_command_writes() -> None:
    out = io.StringIO()
    TerminalText(out).write(f"line{HOSTILE}\n")
    assert out.getvalue().endswith("\n") and "\x1b" not in out.getvalue()
