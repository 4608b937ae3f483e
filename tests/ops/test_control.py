"""Operator controls (``kclpy checkpoint set``, ``kclpy shard park`` / ``resume``) over real
HTTP: kinesis-mock for the stream, kclpy.local's DynamoDB server for the lease table, and
real Workers where the behaviour spans one."""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber

import kclpy
from kclpy import Worker
from kclpy.leases import park as parking
from kclpy.leases import serializer as ser
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.ops import control, serve_worker
from kclpy.ops.inspect import read_worker
from kclpy.ops.position import parse_position
from kclpy.position import TRIM_HORIZON, Position
from kclpy.recovery import queue as gaps
from kclpy.recovery import requests as asked
from kclpy.retrieval.parse import get_records
from tests.support.cli import endpoints, run_cli
from tests.support.e2e import worker_config
from tests.support.faultproxy import FaultProxy
from tests.support.scrape import scrape
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running

SHARD = "shardId-000000000000"


class Journal:
    """Everything processors of one test saw, in the order they saw it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[str, str, str]] = []

    def add(self, shard_id: str, kind: str, value: str) -> None:
        with self.lock:
            self.entries.append((shard_id, kind, value))

    def of(self, shard_id: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(kind, value) for s, kind, value in self.entries if s == shard_id]

    def recovered(self, shard_id: str) -> list[str]:
        return [value for kind, value in self.of(shard_id) if kind == "recovery"]

    def records_since_last_initialize(self, shard_id: str) -> list[str]:
        entries = self.of(shard_id)
        starts = [i for i, (kind, _) in enumerate(entries) if kind == "initialize"]
        tail = entries[starts[-1] + 1:] if starts else entries
        return [value for kind, value in tail if kind == "record"]


class JournalProcessor(kclpy.IRecordProcessor):
    """Checkpoints after every batch; notes initialize (with its checkpoint), records and
    lease_lost in one ordered journal."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.shard_id = ""

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        self.journal.add(self.shard_id, "initialize", str(initialize_input.sequence_number))

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        kind = "recovery" if process_records_input.is_recovery else "record"
        for record in process_records_input.records:
            self.journal.add(self.shard_id, kind, record.sequence_number)
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self.journal.add(self.shard_id, "lease_lost", "")

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        shutdown_requested_input.checkpointer.checkpoint()


@pytest.fixture
def stream(kinesis_mock: LocalEndpoint) -> str:
    name = unique_name("control")
    create_stream(kinesis_client(kinesis_mock.url), name, 1)
    return name


def lease_table(dynamodb_url: str, *leases: Lease) -> tuple[str, LeaseTable]:
    name = unique_name("control")
    table = LeaseTable(dynamodb_client(dynamodb_url), name)
    table.create_if_missing()
    for lease in leases:
        table.create(lease)
    return name, table


def current(table: LeaseTable, key: str = SHARD) -> Lease | None:
    """The lease, or None while the worker has not created its table yet."""
    try:
        return table.get(key)
    except ClientError:
        return None


def arrivals(kinesis: Any, stream: str, shard_id: str = SHARD) -> list[tuple[str, int]]:
    """(sequence number, arrival ms) of every record of the shard, oldest first."""
    iterator = kinesis.get_shard_iterator(StreamName=stream, ShardId=shard_id,
                                          ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    page = get_records(kinesis, iterator, 10_000)
    return [(r.sequence_number, r.timestamp_millis or 0) for r in page.records]


def checkpoint_set(capsys: pytest.CaptureFixture[str], kinesis: LocalEndpoint,
                   dynamodb: LocalEndpoint, app: str, stream: str, *extra: str
                   ) -> tuple[int, str, str]:
    return run_cli(capsys, "checkpoint", "set", "--application-name", app,
                   "--stream-name", stream, *extra, *endpoints(kinesis, dynamodb))


# -- checkpoint set, no worker running -------------------------------------------------------


def test_positions_parse_and_a_naive_time_is_utc() -> None:
    assert parse_position("TRIM_HORIZON").kind == "TRIM_HORIZON"
    sequence = "49590338271490256608559692538361571095921575989136588898"
    assert parse_position(sequence).sequence_number == sequence
    moment = parse_position("2026-11-26T10:00:00").time
    assert moment is not None and moment.utcoffset() is not None
    assert moment.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_position("yesterday")


@pytest.mark.integration
def test_set_to_a_sequence_number_is_conditional_and_dry_run_writes_nothing(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    written = put_plain(kinesis, stream, [f"r{i}".encode() for i in range(6)])
    sequences = [seq for _, seq in written]
    app, table = lease_table(moto_server.url, Lease(SHARD, lease_counter=7,
                                                    checkpoint=Position(sequences[5]),
                                                    owner_switches_since_checkpoint=2))
    code, out, _ = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                  "--shard-id", SHARD, "--to", sequences[2], "--dry-run",
                                  "--json")
    assert code == 0
    (planned,) = json.loads(out)["shards"]
    assert planned["to"] == {"checkpoint": sequences[2], "sub_sequence_number": 0}
    assert planned["written"] is False
    assert table.get(SHARD) == Lease(SHARD, lease_counter=7, checkpoint=Position(sequences[5]),
                                     owner_switches_since_checkpoint=2)

    code, out, _ = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                  "--shard-id", SHARD, "--to", sequences[2])
    assert code == 0, out
    assert "moved 1 checkpoint(s)" in out
    after = table.get(SHARD)
    assert after is not None
    assert (after.checkpoint, after.lease_counter, after.owner_switches_since_checkpoint) == (
        Position(sequences[2]), 8, 0)


@pytest.mark.integration
def test_a_time_resolves_to_the_last_record_before_it(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    for i in range(4):  # one request each, so arrival times can differ
        put_plain(kinesis, stream, [f"early-{i}".encode()])
    early = arrivals(kinesis, stream)[-1][1]

    def later_write() -> tuple[str, int] | None:
        """Write once more; the write if it arrived in a later millisecond than the rest."""
        put_plain(kinesis, stream, [b"late"])
        last = arrivals(kinesis, stream)[-1]
        return last if last[1] > early else None

    cut = wait_for(later_write, 10, "a record in a later millisecond")
    put_plain(kinesis, stream, [b"later"])
    everything = arrivals(kinesis, stream)
    first_at_or_after = next(seq for seq, ms in everything if ms >= cut[1])
    expected = everything[[seq for seq, _ in everything].index(first_at_or_after) - 1][0]
    app, table = lease_table(moto_server.url, Lease(SHARD, checkpoint=Position.trim_horizon()))
    when = datetime.fromtimestamp(cut[1] / 1000, timezone.utc).isoformat(
        timespec="milliseconds")
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--shard-id", SHARD, "--to", when)
    assert code == 0, err
    lease = table.get(SHARD)
    assert lease is not None and lease.checkpoint.sequence_number == expected
    # A time before every record is the shard's beginning.
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                  "--shard-id", SHARD, "--to", "2001-01-01T00:00:00Z")
    assert code == 0, err
    lease = table.get(SHARD)
    assert lease is not None and lease.checkpoint == Position.trim_horizon()


@pytest.mark.integration
@pytest.mark.parametrize("lagging", ["record", "TRIM_HORIZON"])
def test_a_replay_of_every_shard_never_moves_a_lagging_shard_forward(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, lagging: str) -> None:
    """``--all-shards --to TIME`` replays; a shard whose checkpoint is before TIME keeps it (it
    is only taken from its holder, so what it delivered is delivered again), while a shard
    past TIME moves back. Fails on the code before: the lagging shard moved forward to TIME,
    skipping records it never processed (simulator seed 244)."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("control")
    create_stream(kinesis, stream, 2)
    other = "shardId-000000000001"
    keys = [str(i) for i in range(10)]  # both shards get some (md5 of the keys)
    put_plain(kinesis, stream, [b"early"] * len(keys), keys)
    early = max(ms for shard in (SHARD, other) for _, ms in arrivals(kinesis, stream, shard))

    def later() -> int | None:
        """Write to both shards once more; the arrival if both got it after ``early``."""
        put_plain(kinesis, stream, [b"late"] * len(keys), keys)
        newest = min(arrivals(kinesis, stream, shard)[-1][1] for shard in (SHARD, other))
        return newest if newest > early else None

    cut_ms = wait_for(later, 10, "records in a later millisecond")
    behind = arrivals(kinesis, stream)[0][0]
    ahead = arrivals(kinesis, stream, other)[-1][0]
    checkpoint = Position(behind) if lagging == "record" else Position.trim_horizon()
    app, table = lease_table(
        moto_server.url, Lease(SHARD, lease_owner="worker-a", lease_counter=3,
                               checkpoint=checkpoint),
        Lease(other, lease_owner="worker-b", lease_counter=5, checkpoint=Position(ahead)))
    when = datetime.fromtimestamp(cut_ms / 1000, timezone.utc).isoformat(
        timespec="milliseconds")
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--all-shards", "--to", when, "--force", "--json")
    assert code == 0, err
    outcomes = {row["shard_id"]: row["outcome"] for row in json.loads(out)["shards"]}
    assert outcomes == {SHARD: "kept", other: "moved"}
    kept, moved = table.get(SHARD), table.get(other)
    assert kept is not None and moved is not None
    assert kept.checkpoint == checkpoint, "a lagging shard is never moved forward"
    assert (kept.lease_owner, kept.lease_counter > 3) == (None, True), "taken from its holder"
    assert moved.checkpoint < Position(ahead)


@pytest.mark.integration
def test_a_write_whose_answer_was_lost_after_it_landed_is_reported_written(
        capsys: pytest.CaptureFixture[str], embedded_endpoint: LocalEndpoint) -> None:
    """``shard resume`` lands, its answer is lost, and botocore's retry is refused by the
    counter the first attempt bumped: the command recognises its own write id in the item
    and says the shard resumed. Fails on the code before ("nothing written to it, run
    again" for a write that was made; simulator seeds 21 and 706)."""
    stream = unique_name("control")
    create_stream(kinesis_client(embedded_endpoint.url), stream, 1)
    with FaultProxy(embedded_endpoint.url, seed=5) as proxy:
        app, table = lease_table(proxy.url, Lease(SHARD, lease_counter=4))
        cli = ["--application-name", app, "--stream-name", stream, "--shard-id", SHARD,
               "--region", "us-east-1", "--kinesis-endpoint", embedded_endpoint.url,
               "--dynamodb-endpoint", proxy.url]
        code, _, err = run_cli(capsys, "shard", "park", *cli, "--reason", "poison")
        assert code == 0, err
        proxy.once("UpdateItem", "lose_response")
        code, out, err = run_cli(capsys, "shard", "resume", *cli)
        assert proxy.faults("lose_response") == 1
        assert code == 0, err
        assert f"resumed {SHARD}" in out
        lease = table.get(SHARD)
        assert lease is not None and lease.parked is None and lease.lease_counter == 6


def test_a_refused_retry_after_an_unanswered_attempt_says_the_write_may_have_landed() -> None:
    """The first attempt got no answer; before botocore's retry another writer changed the
    lease (its own write id in the item): whether the first attempt landed cannot be told,
    so the command must not say "nothing written". Fails on the code before (simulator seed
    458: a park landed between a resume and its retry)."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    table = LeaseTable(client, "app")
    changed = ser.lease_to_new_item(Lease(SHARD, lease_counter=6))
    changed[ser.WRITE_ID] = {"S": "another-writers-id"}
    with Stubber(client) as stub:
        stub.add_client_error("update_item", "ConditionalCheckFailedException",
                              http_status_code=400, response_meta={"RetryAttempts": 1})
        stub.add_response("get_item", {"Item": changed})
        with pytest.raises(control.Refused) as refused:
            control._write(table, Lease(SHARD, lease_counter=4),
                           UpdateBuilder().remove(ser.PARKED))
    assert "may have landed" in str(refused.value) and "nothing written" not in str(
        refused.value)


@pytest.mark.integration
def test_a_forced_move_of_a_lease_without_a_counter_is_written(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        embedded_endpoint: LocalEndpoint, stream: str) -> None:
    """A lease item written without ``leaseCounter`` (by hand or by a tool): the operator's
    write expects it still without one, as a take does, instead of ``leaseCounter = 0``,
    which no such item passes ("kept changing; nothing written" before)."""
    app, table = lease_table(embedded_endpoint.url)
    table.client.put_item(TableName=app, Item={
        "leaseKey": {"S": SHARD}, "checkpoint": {"S": "LATEST"},
        "checkpointSubSequenceNumber": {"N": "0"}})
    code, _, err = checkpoint_set(capsys, kinesis_mock, embedded_endpoint, app, stream,
                                  "--shard-id", SHARD, "--to", "TRIM_HORIZON", "--force")
    assert code == 0, err
    lease = table.get(SHARD)
    assert lease is not None and lease.checkpoint == Position.trim_horizon()
    assert not lease.counter_absent and lease.lease_counter == 1


@pytest.mark.integration
def test_a_held_lease_is_refused_naming_the_holder_and_nothing_is_written(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    app, table = lease_table(moto_server.url, Lease(SHARD, lease_owner="worker-a",
                                                    lease_counter=3, checkpoint=Position.latest()))
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                  "--all-shards", "--to", "TRIM_HORIZON")
    assert code == 1
    assert "worker-a" in err and "--force" in err
    assert table.get(SHARD) == Lease(SHARD, lease_owner="worker-a", lease_counter=3,
                                     checkpoint=Position.latest())


@pytest.mark.integration
@pytest.mark.parametrize(("args", "option"), [
    (["--shard-id", "shardId-000000000009", "--to", "TRIM_HORIZON"], "--shard-id"),
    (["--shard-id", SHARD, "--to", "12345678901234567890"], "--to"),
    (["--all-shards", "--to", "12345678901234567890"], "--to"),
])
def test_bad_targets_exit_2_naming_the_argument(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str, args: list[str], option: str) -> None:
    app, table = lease_table(moto_server.url, Lease(SHARD),
                             Lease("shardId-000000000009"))
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream, *args)
    assert code == 2, err
    assert f"error: {option}:" in err
    assert table.get(SHARD) == Lease(SHARD)


@pytest.mark.integration
def test_a_missing_table_or_stream_exits_2_naming_the_option(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, unique_name("none"),
                                  stream, "--shard-id", SHARD, "--to", "TRIM_HORIZON")
    assert (code, "error: --application-name:" in err) == (2, True), err
    app, _ = lease_table(moto_server.url, Lease(SHARD))
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, app,
                                  unique_name("none"), "--shard-id", SHARD, "--to",
                                  "TRIM_HORIZON")
    assert (code, "error: --stream-name:" in err) == (2, True), err
    code, _, err = run_cli(capsys, "shard", "park", "--application-name", app,
                           "--shard-id", "shardId-000000000042",
                           *endpoints(kinesis_mock, moto_server))
    assert (code, "error: --shard-id:" in err) == (2, True), err


def test_every_control_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["checkpoint", "set"], ["shard", "park"], ["shard", "resume"],
                    ["recovery", "add"], ["recovery", "list"], ["recovery", "cancel"]):
        code, out, _ = run_cli(capsys, *command, "--help")
        assert code == 0 and "--application-name" in out and "--shard-id" in out
    code, _, err = run_cli(capsys, "recovery", "add", "--application-name", "a",
                           "--stream-name", "s", "--shard-id", "x", "--from", "12x",
                           "--to", "1")
    assert (code, "argument --from:" in err) == (2, True), err


# -- with a running worker -------------------------------------------------------------------


@pytest.mark.integration
def test_forced_move_resumes_a_running_worker_right_after_the_new_position(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    first = [seq for _, seq in put_plain(kinesis, stream, [f"a{i}".encode() for i in range(8)])]
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    worker = Worker(config, lambda: JournalProcessor(journal))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    with running(worker):
        wait_for(lambda: (lease := current(table)) is not None
                 and lease.checkpoint == Position(first[-1]), 60, "all first records checkpointed")
        code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server,
                                        config.application_name, stream, "--shard-id", SHARD,
                                        "--to", first[2])
        assert code == 1 and config.worker_id in err
        code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server,
                                        config.application_name, stream, "--shard-id", SHARD,
                                        "--to", first[2], "--force")
        assert code == 0, err
        assert f"taken from {config.worker_id}" in out
        wait_for(lambda: ("initialize", first[2]) in journal.of(SHARD), 60,
                 "the shard taken again at the new checkpoint")
        second = [seq for _, seq in put_plain(kinesis, stream,
                                              [f"b{i}".encode() for i in range(5)])]
        wait_for(lambda: journal.records_since_last_initialize(SHARD)[-1:] == second[-1:],
                 60, "the new records processed")
    entries = journal.of(SHARD)
    assert ("lease_lost", "") in entries
    assert entries.index(("lease_lost", "")) < entries.index(("initialize", first[2]))
    # Nothing at or before the new position again, nothing after it skipped, in order.
    assert journal.records_since_last_initialize(SHARD) == first[3:] + second


@pytest.mark.integration
def test_a_parked_shard_is_left_alone_until_resumed_then_starts_at_its_checkpoint(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("control")
    create_stream(kinesis, stream, 2)
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    worker = Worker(config, lambda: JournalProcessor(journal))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    other = "shardId-000000000001"
    cli = ["--application-name", config.application_name, "--shard-id", SHARD,
           *endpoints(kinesis_mock, moto_server)]
    with running(worker):
        before = [seq for shard, seq in put_plain(kinesis, stream, [b"x"] * 40,
                                                  [str(i) for i in range(40)]) if shard == SHARD]
        wait_for(lambda: (lease := current(table)) is not None and lease.lease_owner
                 and lease.checkpoint.sequence_number == before[-1], 60, "the shard checkpointed")
        code, out, err = run_cli(capsys, "shard", "park", *cli, "--reason", "poison")
        assert code == 0, err
        wait_for(lambda: ("lease_lost", "") in journal.of(SHARD), 60, "lease_lost")
        while_parked = put_plain(kinesis, stream, [b"y"] * 40, [str(i) for i in range(40)])
        on_other = [seq for shard, seq in while_parked if shard == other]
        on_parked = [seq for shard, seq in while_parked if shard == SHARD]
        # The rest of the worker keeps going while nobody takes the parked shard.
        wait_for(lambda: journal.records_since_last_initialize(other)[-1:] == on_other[-1:],
                 60, "the other shard processed")
        parked = table.get(SHARD)
        assert parked is not None and parked.lease_owner is None and parked.parked
        code, out, _ = run_cli(capsys, "leases", "--application-name",
                               config.application_name, "--json",
                               *endpoints(kinesis_mock, moto_server))
        states = {item["leaseKey"]: item["state"] for item in json.loads(out)}
        assert states[SHARD] == "PARKED"
        code, out, err = run_cli(capsys, "shard", "resume", *cli)
        assert code == 0, err
        wait_for(lambda: journal.records_since_last_initialize(SHARD)[-1:] == on_parked[-1:],
                 60, "the resumed shard processed")
    entries = journal.of(SHARD)
    assert entries[-len(on_parked) - 1] == ("initialize", before[-1])
    assert journal.records_since_last_initialize(SHARD) == on_parked


# -- a failing shard: FAILED, and the park policy --------------------------------------------


class Breakable(JournalProcessor):
    """Raises on every batch while ``broken`` is set."""

    def __init__(self, journal: Journal, broken: threading.Event) -> None:
        super().__init__(journal)
        self.broken = broken

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        if self.broken.is_set() and self.shard_id == SHARD:
            raise ValueError("cannot parse record")
        super().process_records(process_records_input)


def shard_status(server: Any, shard_id: str) -> dict[str, Any] | None:
    view = read_worker(server.url)
    return view.shards.get(shard_id) if view.error is None else None


@pytest.mark.integration
def test_a_failing_shard_is_failed_with_its_error_then_processing_again(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    journal, broken = Journal(), threading.Event()
    broken.set()
    config = worker_config(kinesis_mock.url, moto_server.url, stream,
                           task_backoff_time_ms=50, max_task_backoff_time_ms=200)
    worker = Worker(config, lambda: Breakable(journal, broken))
    with serve_worker(worker, lag_window_s=None) as server, running(worker):
        put_plain(kinesis, stream, [b"bad"])
        failed = wait_for(lambda: (s := shard_status(server, SHARD)) is not None
                          and s["state"] == "FAILED" and s["failure"]["attempts"] >= 2 and s,
                          60, "the shard FAILED after two attempts")
        failure = failed["failure"]
        assert (failure["error_type"], failure["message"]) == ("ValueError",
                                                                "cannot parse record")
        assert failure["since_ms"] > 0
        samples = scrape(server)
        assert samples[("kclpy_shard_consumer_state",
                        (("shard_id", SHARD), ("state", "FAILED")))] == 1
        assert samples[("kclpy_shard_failure",
                        (("error_type", "ValueError"), ("shard_id", SHARD)))] == 1
        assert samples[("kclpy_shard_failure_attempts", (("shard_id", SHARD),))] >= 2
        assert samples[("kclpy_shard_failing_since_seconds",
                        (("shard_id", SHARD),))] == failure["since_ms"] / 1000
        code, out, err = run_cli(capsys, "status", "--application-name",
                                 config.application_name, "--stream-name", stream,
                                 "--window-seconds", "0.2", "--samples", "2",
                                 "--worker", server.url,
                                 *endpoints(kinesis_mock, moto_server))
        assert f"shard {SHARD} FAILED: ValueError: cannot parse record (" in out, err
        broken.clear()
        recovered = wait_for(lambda: (s := shard_status(server, SHARD)) is not None
                             and s["state"] == "PROCESSING" and s, 60, "PROCESSING again")
        assert recovered["failure"] is None
        samples = scrape(server)
        assert samples[("kclpy_shard_failure_attempts", (("shard_id", SHARD),))] == 0
        assert ("kclpy_shard_failure", (("error_type", "ValueError"),
                                        ("shard_id", SHARD))) not in samples


@pytest.mark.integration
def test_the_park_policy_parks_a_failing_shard_and_the_rest_keeps_running(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("control")
    create_stream(kinesis, stream, 2)
    other = "shardId-000000000001"
    journal, broken = Journal(), threading.Event()
    config = worker_config(kinesis_mock.url, moto_server.url, stream,
                           processor_error_policy="park", processor_error_attempts=3,
                           task_backoff_time_ms=50, max_task_backoff_time_ms=200)
    worker = Worker(config, lambda: Breakable(journal, broken))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    with serve_worker(worker, lag_window_s=None) as server, running(worker):
        good = [seq for shard, seq in put_plain(kinesis, stream, [b"ok"] * 40,
                                                [str(i) for i in range(40)]) if shard == SHARD]
        wait_for(lambda: (lease := current(table)) is not None
                 and lease.checkpoint.sequence_number == good[-1], 60, "the shard checkpointed")
        broken.set()
        written = put_plain(kinesis, stream, [b"x"] * 40, [str(i) for i in range(40)])
        on_parked = [seq for shard, seq in written if shard == SHARD]
        on_other = [seq for shard, seq in written if shard == other]
        def parked_lease() -> Lease | None:
            lease = current(table)
            return lease if lease is not None and lease.parked and not lease.lease_owner else None

        parked = wait_for(parked_lease, 60, "the shard parked")
        marker = json.loads(parked.parked or "")
        assert marker["attempts"] == 3 and "ValueError: cannot parse record" in marker["error"]
        assert parked.checkpoint.sequence_number == good[-1]
        wait_for(lambda: journal.records_since_last_initialize(other)[-1:] == on_other[-1:],
                 60, "the other shard processed")
        wait_for(lambda: scrape(server).get(("kclpy_shards_parked", ())) == 1, 60,
                 "kclpy_shards_parked")
        # the shard left the worker when it parked; the count of the park stays
        assert scrape(server)[("kclpy_shards_parked_by_policy_total",
                               (("shard_id", SHARD),))] == 1
        assert ("lease_lost", "") in journal.of(SHARD)
        code, out, _ = run_cli(capsys, "leases", "--application-name", config.application_name,
                               *endpoints(kinesis_mock, moto_server))
        assert code == 0 and "PARKED" in out and "cannot parse record" in out
        code, out, _ = run_cli(capsys, "status", "--application-name",
                               config.application_name, "--stream-name", stream,
                               "--window-seconds", "0.2", "--samples", "2", "--json",
                               *endpoints(kinesis_mock, moto_server))
        assert json.loads(out)["parked"][SHARD]["by"] == "worker"
        broken.clear()
        code, _, err = run_cli(capsys, "shard", "resume", "--application-name",
                               config.application_name, "--shard-id", SHARD,
                               *endpoints(kinesis_mock, moto_server))
        assert code == 0, err
        wait_for(lambda: journal.records_since_last_initialize(SHARD)[-1:] == on_parked[-1:],
                 60, "the resumed shard processed")
    assert journal.records_since_last_initialize(SHARD) == on_parked


# -- recovery add / list / cancel ------------------------------------------------------------


@pytest.mark.integration
def test_a_backfill_is_read_by_the_shards_holder_without_the_lease_changing_hands(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    """``kclpy recovery add`` (the CLI's main) while a worker holds the shard: the holder
    reads the range as recovery, each record once, beside its live reading, and keeps the
    lease throughout - one tenure, no lease_lost. A second backfill cancelled right away
    stops wherever the holder was in it (nothing of it twice)."""
    kinesis = kinesis_client(kinesis_mock.url)
    for i in range(8):  # one request each: arrival times grow record by record
        put_plain(kinesis, stream, [f"r{i}".encode()])
    everything = arrivals(kinesis, stream)
    sequences = [seq for seq, _ in everything]
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, recovery_max_rate=5)
    worker = Worker(config, lambda: JournalProcessor(journal))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    cli = ["--application-name", config.application_name, *endpoints(kinesis_mock, moto_server)]
    owners: set[str | None] = set()

    def settled() -> Lease | None:
        """The lease once no gap and no request is left; notes every owner seen."""
        lease = current(table)
        owners.add(None if lease is None else lease.lease_owner)
        return lease if lease is not None and not lease.recovery and not (
            lease.recovery_requests) else None

    with running(worker):
        wait_for(lambda: (lease := current(table)) is not None
                 and lease.checkpoint == Position(sequences[-1]), 60, "every record checkpointed")
        held = current(table)
        holder = None if held is None else held.lease_owner
        assert holder is not None
        code, out, err = run_cli(capsys, "recovery", "add", *cli, "--stream-name", stream,
                                 "--shard-id", SHARD, "--from", sequences[2],
                                 "--to", sequences[5], "--dry-run")
        assert code == 0 and out.startswith("would queue"), err
        lease = current(table)
        assert lease is not None and lease.recovery is None and not lease.recovery_requests
        code, out, err = run_cli(capsys, "recovery", "add", *cli, "--stream-name", stream,
                                 "--shard-id", SHARD, "--from", sequences[2],
                                 "--to", sequences[5], "--json")
        assert code == 0, err
        assert json.loads(out)["holder"] == holder
        code, out, _ = run_cli(capsys, "recovery", "list", *cli, "--json")
        (listed,) = json.loads(out)
        assert listed["owner"] == holder
        if listed["gaps"]:  # the worker may already have read the gap
            assert listed["gaps"][0]["first_sequence"] == sequences[2]
        wait_for(lambda: settled() and len(journal.recovered(SHARD)) >= 4, 60,
                 "the gap recovered")
        first_gap = journal.recovered(SHARD)
        # The whole shard again, requested as the command does (its range resolution
        # was exercised above and costs seconds on kinesis-mock), then cancelled.
        backfill = gaps.RecoveryRequest.gap(TRIM_HORIZON, 0, everything[-1][1] + 1,
                                            everything[0][1], sequences[0])
        lease = current(table)
        assert lease is not None
        assert control._request(table, lease, asked.adding(backfill, 0))[0] == holder
        code, out, err = run_cli(capsys, "recovery", "cancel", *cli, "--shard-id", SHARD,
                                 "--all")
        # Refused only when the holder had already recovered the whole range.
        assert code == 0 or "has no queued gap" in err, err
        wait_for(settled, 60, "the backfill cancelled or done")
    assert first_gap == sequences[2:6], "FROM..TO, nothing after TO"
    second = journal.recovered(SHARD)[len(first_gap):]
    assert second == sequences[:len(second)], "a prefix of the cancelled range, each once"
    if code != 0:
        assert second == sequences
    assert owners == {holder}, "the lease never left its holder"
    kinds = [kind for kind, _ in journal.of(SHARD)]
    assert kinds.count("initialize") == 1 and "lease_lost" not in kinds
    # Live reading went on from its own checkpoint: nothing live was read again.
    live = [value for kind, value in journal.of(SHARD) if kind == "record"]
    assert live == sequences


@pytest.mark.integration
def test_recovery_cancel_drops_a_queued_gap_and_bad_ranges_name_the_argument(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    sequences = [seq for _, seq in put_plain(kinesis, stream, [b"a", b"b", b"c"], ["k"] * 3)]
    app, table = lease_table(moto_server.url, Lease(SHARD, checkpoint=Position(sequences[-1])))
    cli = ["--application-name", app, "--shard-id", SHARD,
           *endpoints(kinesis_mock, moto_server)]
    code, _, err = run_cli(capsys, "recovery", "add", *cli, "--stream-name", stream,
                           "--from", sequences[2], "--to", sequences[0])
    assert (code, "error: --to:" in err) == (2, True), err
    code, _, err = run_cli(capsys, "recovery", "add", *cli, "--stream-name", stream,
                           "--from", "12345678901234567890", "--to", sequences[0])
    assert (code, "error: --from:" in err) == (2, True), err
    code, out, err = run_cli(capsys, "recovery", "add", *cli, "--stream-name", stream,
                             "--from", sequences[0], "--to", sequences[1], "--json")
    assert code == 0, err
    assert json.loads(out)["gap"]["after"] == "TRIM_HORIZON"
    code, out, _ = run_cli(capsys, "recovery", "list", *cli)
    assert out.splitlines()[-1] == f"1 gap(s) in {app}"
    ends = ["--ends", sequences[1]]
    code, _, err = run_cli(capsys, "recovery", "cancel", *cli, "--gap", "2", *ends)
    assert (code, "error: --gap:" in err) == (2, True), err
    code, out, err = run_cli(capsys, "recovery", "cancel", *cli, "--gap", "1", *ends)
    assert code == 0, err
    lease = table.get(SHARD)
    assert lease is not None and lease.recovery is None
    assert lease.checkpoint == Position(sequences[-1])


# -- data lost to retention ------------------------------------------------------------------


class Huge(JournalProcessor):
    """Raises with a 1 MB message (2-byte UTF-8 characters and control characters)."""

    MESSAGE = ("\u00e9" * 1000 + "\x00\n") * 500

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        raise ValueError(self.MESSAGE)


@pytest.mark.integration
def test_a_huge_exception_message_parks_the_shard_once(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, stream: str) -> None:
    """The park mark cuts the error to a bounded size, so the write fits DynamoDB's 400 KB
    item limit and the shard is parked once; before, the write was refused, the lease
    released unmarked, retaken, failed on and parked again, without end."""
    assert len(Huge.MESSAGE.encode()) > 1_000_000
    kinesis = kinesis_client(kinesis_mock.url)
    put_plain(kinesis, stream, [b"x"])
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream,
                           processor_error_policy="park", processor_error_attempts=2,
                           task_backoff_time_ms=10, max_task_backoff_time_ms=20)
    worker = Worker(config, lambda: Huge(journal))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    with serve_worker(worker, lag_window_s=None) as server, running(worker):
        def parked_lease() -> Lease | None:
            lease = current(table)
            return lease if lease is not None and lease.parked and not lease.lease_owner else None

        parked = wait_for(parked_lease, 60, "the shard parked")
        wait_for(lambda: scrape(server).get(("kclpy_shards_parked", ())) == 1, 60,
                 "kclpy_shards_parked")
        assert scrape(server)[("kclpy_shards_parked_by_policy_total",
                               (("shard_id", SHARD),))] == 1
    error = json.loads(parked.parked or "")["error"]
    assert error.startswith("ValueError: \u00e9\u00e9") and error.endswith(" more bytes]")
    assert len(error.encode()) < 5000
    assert [kind for kind, _ in journal.of(SHARD)].count("initialize") == 1


@pytest.mark.integration
@pytest.mark.parametrize("fail_on_data_loss", [False, True])
def test_a_checkpoint_past_retention_is_logged_counted_and_optionally_parks(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, stream: str,
        caplog: pytest.LogCaptureFixture, fail_on_data_loss: bool) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    written = [seq for _, seq in put_plain(kinesis, stream, [f"r{i}".encode() for i in range(5)])]
    # An emulator cannot expire records: a checkpoint of this shard (not below its starting
    # sequence number, which would be a stream created again) older than the oldest record
    # kept is what a trimmed one looks like.
    start = kinesis.list_shards(StreamName=stream)["Shards"][0]["SequenceNumberRange"][
        "StartingSequenceNumber"]
    assert int(start) < int(written[0])
    config = worker_config(kinesis_mock.url, moto_server.url, stream,
                           fail_on_data_loss=fail_on_data_loss)
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    table.create_if_missing()
    table.create(Lease(SHARD, checkpoint=Position(start)))
    journal = Journal()
    worker = Worker(config, lambda: JournalProcessor(journal))
    with serve_worker(worker, lag_window_s=None) as server, running(worker), \
            caplog.at_level(logging.ERROR, logger="kclpy.consumer"):
        if fail_on_data_loss:
            wait_for(lambda: (lease := current(table)) is not None and lease.parked
                     and not lease.lease_owner, 60, "the shard parked")
        else:
            wait_for(lambda: journal.records_since_last_initialize(SHARD) == written, 60,
                     "the records kept processed")
        samples = scrape(server)
    assert samples[("kclpy_data_lost_to_retention_total", (("shard_id", SHARD),))] == 1
    (error,) = [r.getMessage() for r in caplog.records
                if r.levelno == logging.ERROR and "are lost" in r.getMessage()]
    assert SHARD in error and f"after {start} up to {written[0]}" in error
    if fail_on_data_loss:
        assert not [kind for kind, _ in journal.of(SHARD) if kind == "record"]
        lease = current(table)
        assert lease is not None and lease.checkpoint.sequence_number == start
        assert "fail_on_data_loss" in (lease.parked or "")


@pytest.mark.integration
def test_an_exactly_once_applications_sql_position_moves_with_the_checkpoint(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str, tmp_path: Path) -> None:
    import sqlalchemy as sa

    from kclpy.state.sql import SQLStateStore, gap_name

    kinesis = kinesis_client(kinesis_mock.url)
    sequences = [seq for _, seq in put_plain(kinesis, stream, [f"r{i}".encode()
                                                               for i in range(4)])]
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = SQLStateStore(url)
    store.open(None)
    # a gap after r2 the store has progress of: the move to r0 reads it again live
    after_r2 = gap_name(Position(sequences[2]))
    with store.engine.begin() as conn:
        conn.execute(sa.insert(store.checkpoints).values(
            lease_key=SHARD, tenure=4, checkpoint=sequences[3], sub_sequence_number=0))
        conn.execute(sa.insert(store.gaps).values(
            lease_key=SHARD, gap=after_r2, checkpoint=sequences[3], sub_sequence_number=0))
    app, table = lease_table(moto_server.url, Lease(SHARD, lease_counter=6,
                                                    checkpoint=Position(sequences[3])))
    queued = gaps.RecoveryRequest.gap(sequences[2], 0, 2**42, None, None)
    held = table.get(SHARD)
    assert held is not None
    control._write(table, held, UpdateBuilder().set(ser.RECOVERY, ser.s(
        gaps.dumps((queued,)) or "")))
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--shard-id", SHARD, "--to", sequences[0],
                                    "--state-store", url)
    assert code == 0, err
    lease = table.get(SHARD)
    assert lease is not None
    assert (lease.checkpoint, lease.parked) == (Position(sequences[0]), None)
    assert lease.lease_counter == 9 and lease.recovery is None
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(store.checkpoints)).one()
        gap_rows = conn.execute(sa.select(store.gaps)).all()
    assert (row.checkpoint, row.sub_sequence_number, row.tenure) == (sequences[0], 0, 8)
    assert gap_rows == []
    code, _, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                  "--shard-id", SHARD, "--to", "TRIM_HORIZON",
                                  "--state-store", "nosuch://x")
    assert (code, "error: --state-store:" in err) == (2, True), err


@pytest.mark.integration
def test_replay_from_a_time_moves_every_shard_of_a_running_worker(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("control")
    create_stream(kinesis, stream, 2)
    shards = (SHARD, "shardId-000000000001")
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    worker = Worker(config, lambda: JournalProcessor(journal))
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    put_plain(kinesis, stream, [b"early"] * 20, [str(i) for i in range(20)])
    with running(worker):
        later = put_plain(kinesis, stream, [b"late"] * 20, [str(i) for i in range(20)])
        last = {key: [s for k, s in later if k == key][-1] for key in shards}
        wait_for(lambda: all((lease := current(table, key)) is not None
                             and lease.checkpoint.sequence_number == last[key] for key in shards),
                 60, "every record checkpointed")
        # Replay from the time the first later record of shard 0 arrived.
        first_late = next(s for k, s in later if k == SHARD)
        replay_ms = dict(arrivals(kinesis, stream))[first_late]
        expected = {key: [s for s, ms in arrivals(kinesis, stream, key) if ms >= replay_ms]
                    for key in shards}
        when = datetime.fromtimestamp(replay_ms / 1000, timezone.utc).isoformat(
            timespec="milliseconds")
        code, out, err = run_cli(capsys, "checkpoint", "set", "--application-name",
                                 config.application_name, "--stream-name", stream,
                                 "--all-shards", "--to", when, "--force",
                                 *endpoints(kinesis_mock, moto_server))
        assert code == 0, err
        wait_for(lambda: all(
            sum(kind == "initialize" for kind, _ in journal.of(key)) >= 2
            and journal.records_since_last_initialize(key) == expected[key]
            for key in shards), 60, "both shards replayed from the time")
    assert first_late in expected[SHARD]


# -- replay of a resharded stream; every shard's outcome --------------------------------------


def _later_write(kinesis: Any, stream: str, payload: bytes,
                 after_ms: int) -> tuple[str, int] | None:
    """Write ``payload`` once more; (sequence, arrival ms) if it arrived after ``after_ms``."""
    put_plain(kinesis, stream, [payload], ["k"])
    last = arrivals(kinesis, stream)[-1]
    return last if last[1] > after_ms else None


@pytest.mark.integration
def test_replay_from_a_time_recreates_a_cleaned_up_parent_and_its_children_wait_for_it(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str, tmp_path: Path) -> None:
    """``--all-shards --to TIME`` after a split whose parent lease cleanup deleted: the plan
    names the parent, creates its lease at the last record before TIME (parents, children
    and hash range as shard sync makes them) and moves the children to their beginning; a
    worker then reads the parent's records from TIME, and each child's only after them. A
    SQL state store's row of the deleted lease moves too, to the new lease's incarnation."""
    import sqlalchemy as sa

    from kclpy.state.sql import SQLStateStore

    kinesis = kinesis_client(kinesis_mock.url)
    put_plain(kinesis, stream, [b"p0"], ["k"])
    early = arrivals(kinesis, stream)[-1]
    cut = wait_for(lambda: _later_write(kinesis, stream, b"p1", early[1]), 10,
                   "a parent record in a later millisecond")
    put_plain(kinesis, stream, [b"p2"], ["k"])
    parent_records = [seq for seq, _ in arrivals(kinesis, stream)]
    replayed = parent_records[parent_records.index(cut[0]):]
    (parent,) = kinesis.list_shards(StreamName=stream)["Shards"]
    low, high = (int(parent["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(StreamName=stream, ShardToSplit=SHARD,
                        NewStartingHashKey=str((low + high) // 2))
    children = wait_for(lambda: [s["ShardId"] for s in kinesis.list_shards(
        StreamName=stream)["Shards"] if s.get("ParentShardId") == SHARD] or None, 30,
        "the children listed")
    assert len(children) == 2
    wait_for(lambda: kinesis.describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", 30, "the stream active")
    written = put_plain(kinesis, stream, [f"c{i}".encode() for i in range(12)])
    child_records = {child: [seq for shard, seq in written if shard == child]
                     for child in children}
    assert all(child_records.values())
    # The parent was processed to its end and its lease deleted by lease cleanup: only the
    # children's leases are left, each checkpointed at its last record.
    app, table = lease_table(moto_server.url, *(
        Lease(child, checkpoint=Position(child_records[child][-1]),
              parent_shard_ids=frozenset({SHARD})) for child in children))
    when = datetime.fromtimestamp(cut[1] / 1000, timezone.utc).isoformat(
        timespec="milliseconds")
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--all-shards", "--to", when, "--dry-run", "--json")
    assert code == 0, err
    planned = {m["shard_id"]: m for m in json.loads(out)["shards"]}
    assert planned[SHARD]["create"] is True and planned[SHARD]["outcome"] == "planned"
    assert table.get(SHARD) is None
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = SQLStateStore(url)
    store.open(None)
    with store.engine.begin() as conn:
        conn.execute(sa.insert(store.checkpoints).values(
            lease_key=SHARD, tenure=9, checkpoint=parent_records[-1], sub_sequence_number=0,
            incarnation="0:1:former"))
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--all-shards", "--to", when, "--json",
                                    "--state-store", url)
    assert code == 0, err
    outcomes = {m["shard_id"]: m["outcome"] for m in json.loads(out)["shards"]}
    assert outcomes == {SHARD: "created", **{child: "moved" for child in children}}
    recreated = table.get(SHARD)
    assert recreated is not None
    assert recreated.checkpoint == Position(parent_records[parent_records.index(cut[0]) - 1])
    assert recreated.child_shard_ids == frozenset(children)
    assert recreated.starting_hash_key == str(low) and recreated.lease_owner is None
    assert recreated.parked is None
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(store.checkpoints)).one()
    assert (row.checkpoint, row.incarnation) == (recreated.checkpoint.sequence_number,
                                                 recreated.incarnation)
    for child in children:
        lease = table.get(child)
        assert lease is not None and lease.checkpoint == Position.trim_horizon()

    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, application_name=app)
    with running(Worker(config, lambda: JournalProcessor(journal))):
        wait_for(lambda: all(journal.records_since_last_initialize(child)
                             == child_records[child] for child in children), 60,
                 "the children read again")
    with journal.lock:
        order = [(shard, value) for shard, kind, value in journal.entries if kind == "record"]
    assert [value for shard, value in order if shard == SHARD] == replayed
    last_of_parent = order.index((SHARD, replayed[-1]))
    for child in children:
        assert order.index((child, child_records[child][0])) > last_of_parent


@pytest.mark.integration
def test_a_lease_taken_between_plan_and_write_is_reported_with_every_other_shards_outcome(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker takes one lease after the plan was made: the other shards are still moved,
    the table (here JSON) names each shard's outcome and why, and the command exits 1."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("control")
    create_stream(kinesis, stream, 2)
    other = "shardId-000000000001"
    app, table = lease_table(moto_server.url, Lease(SHARD, checkpoint=Position.latest()),
                             Lease(other, checkpoint=Position.latest()))
    plan = control._plan_moves

    def plan_then_taken(*args: Any) -> list[control.Move]:
        moves = plan(*args)
        lease = table.get(SHARD)
        assert lease is not None
        table.take(lease, "worker-b")
        return moves

    monkeypatch.setattr(control, "_plan_moves", plan_then_taken)
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--all-shards", "--to", "TRIM_HORIZON", "--json")
    assert code == 1
    shards = {m["shard_id"]: m for m in json.loads(out)["shards"]}
    assert shards[other]["outcome"] == "moved" and shards[other]["error"] is None
    assert shards[SHARD]["outcome"] == "refused" and "worker-b" in shards[SHARD]["error"]
    assert "1 shard(s) not moved" in err and SHARD in err
    taken, moved = table.get(SHARD), table.get(other)
    assert taken is not None and taken.checkpoint == Position.latest()
    assert moved is not None and moved.checkpoint == Position.trim_horizon()


@pytest.mark.integration
def test_a_stream_created_again_has_its_current_incarnations_lease_picked(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    """A multi-stream table keeps the leases of a former stream of the same name (its
    identifier names another creation second) beside the current one's: the commands act
    on the current stream's lease, whose key sorts after the former's."""
    from kclpy.streams import StreamIdentifier

    kinesis = kinesis_client(kinesis_mock.url)
    summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
    current_id = StreamIdentifier.from_summary(summary)
    former_id = StreamIdentifier(current_id.account_id, current_id.name,
                                 current_id.creation_epoch - 3600)
    former, now = (Lease(f"{i}:{SHARD}", checkpoint=Position.trim_horizon(), stream=str(i))
                   for i in (former_id, current_id))
    assert former.lease_key < now.lease_key
    app, table = lease_table(moto_server.url, former, now)
    cli = ["--application-name", app, "--stream-name", stream, "--shard-id", SHARD,
           *endpoints(kinesis_mock, moto_server)]
    code, out, err = run_cli(capsys, "shard", "park", *cli)
    assert code == 0, err
    parked, left = table.get(now.lease_key), table.get(former.lease_key)
    assert parked is not None and parked.parked is not None
    assert left is not None and left.parked is None
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--all-shards", "--to", "LATEST", "--json")
    assert code == 0, err
    assert [m["lease_key"] for m in json.loads(out)["shards"]] == [now.lease_key]


@pytest.mark.integration
def test_a_backfill_ends_at_the_record_asked_for_not_at_its_millisecond(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    """``recovery add --to SEQ`` where records after SEQ arrived in the same millisecond:
    the worker replays FROM..SEQ and not one record more."""
    kinesis = kinesis_client(kinesis_mock.url)

    def batch_in_one_millisecond() -> list[str] | None:
        """Six records of one PutRecords request; their sequence numbers once the
        second to fifth arrived in one millisecond (kinesis-mock stamps a request at once)."""
        written = [seq for _, seq in put_plain(kinesis, stream, [b"x"] * 6, ["k"] * 6)]
        arrived = dict(arrivals(kinesis, stream))
        return written if len({arrived[seq] for seq in written[1:5]}) == 1 else None

    batch = wait_for(batch_in_one_millisecond, 10, "a batch stamped in one millisecond")
    everything = [seq for seq, _ in arrivals(kinesis, stream)]
    app, table = lease_table(moto_server.url, Lease(SHARD, checkpoint=Position(everything[-1])))
    code, out, err = run_cli(capsys, "recovery", "add", "--application-name", app,
                             "--stream-name", stream, "--shard-id", SHARD,
                             "--from", batch[1], "--to", batch[3], "--json",
                             *endpoints(kinesis_mock, moto_server))
    assert code == 0, err
    assert json.loads(out)["gap"]["last_sequence"] == batch[3]
    journal = Journal()
    config = worker_config(kinesis_mock.url, moto_server.url, stream, application_name=app)
    with running(Worker(config, lambda: JournalProcessor(journal))):
        wait_for(lambda: (lease := current(table)) is not None and lease.recovery is None
                 and len(journal.recovered(SHARD)) >= 3, 60, "the gap recovered")
    assert journal.recovered(SHARD) == batch[1:4]
    assert not [kind for kind, _ in journal.of(SHARD) if kind == "record"]


def test_a_gap_ending_at_a_record_merges_without_growing_or_losing_records() -> None:
    """Merging keeps the later end (an end at a record is before every record arrived in
    its millisecond), and a gap starting after a gap's last record is another gap."""
    bounded = gaps.RecoveryRequest.gap(TRIM_HORIZON, 0, 1001, 900, "10", last_sequence="30")
    timed = gaps.RecoveryRequest.gap("20", 0, 1001, 950, "25")
    (merged,) = gaps.add((bounded,), timed)
    assert (merged.start, merged.end_ms, merged.last_sequence) == (TRIM_HORIZON, 1001, None)
    longer = gaps.RecoveryRequest.gap("20", 0, 1001, 950, "25", last_sequence="40")
    (merged,) = gaps.add((bounded,), longer)
    assert (merged.end_ms, merged.last_sequence) == (1001, "40")
    after = gaps.RecoveryRequest.gap("35", 0, 2000, 1000, "36")
    assert gaps.add((bounded,), after) == (bounded, after)
    assert gaps.loads(gaps.dumps((bounded,))) == (bounded,)


@pytest.mark.integration
def test_a_shard_not_moved_keeps_its_descendants_where_they_are(
        moto_server: LocalEndpoint) -> None:
    """Writes go parents first, and the children of a parent whose write failed are not
    written: moved back without it, they would be read before the records it was to read
    again. A shard beside them is written."""
    from kclpy.ops.position import Target

    parent, child, grandchild, beside = (f"shardId-00000000000{i}" for i in range(4))
    leases = [Lease(parent, lease_owner="worker-b", checkpoint=Position.shard_end()),
              Lease(child, checkpoint=Position.latest(), parent_shard_ids=frozenset({parent})),
              Lease(grandchild, checkpoint=Position.latest(),
                    parent_shard_ids=frozenset({child})),
              Lease(beside, checkpoint=Position.latest())]
    _, table = lease_table(moto_server.url, *leases)
    back = Target(Position.trim_horizon(), "before the shard's oldest record")
    # planned while the parent was free; a worker took it since (no --force)
    moves = [control.Move(lease.copy(lease_owner=None), back, depth=depth)
             for lease, depth in zip(leases, (0, 1, 2, 0), strict=True)]
    control._write_moves(table, None, sorted(moves, key=lambda m: m.depth), force=False)
    outcome = {m.lease.shard_id: (m.outcome(False), m.failed) for m in moves}
    assert outcome[parent][0] == "refused" and "worker-b" in (outcome[parent][1] or "")
    assert outcome[child][0] == "refused" and parent in (outcome[child][1] or "")
    assert outcome[grandchild][0] == "refused" and child in (outcome[grandchild][1] or "")
    assert outcome[beside] == ("moved", None)
    assert [(lease.checkpoint if (lease := table.get(key)) else None)
            for key in (parent, child, grandchild, beside)] == [
        Position.shard_end(), Position.latest(), Position.latest(), Position.trim_horizon()]


def test_a_park_text_is_cut_on_a_character_boundary_counting_utf8_bytes() -> None:
    assert parking.bounded("abc", 3) == "abc"
    assert parking.bounded("\u00e9" * 3, 5) == "\u00e9\u00e9... [2 more bytes]"
    assert parking.bounded("a\U0001f600", 4) == "a... [4 more bytes]"


def test_a_park_mark_nested_too_deep_to_decode_is_shown_as_its_reason() -> None:
    nested = "[" * 100_000 + "]" * 100_000
    described = parking.describe(nested)
    assert described is not None and described["reason"].endswith(" more bytes]")
    assert parking.describe('{"reason": "maintenance"}') == {"reason": "maintenance"}


@pytest.mark.integration
def test_a_replay_reads_again_the_records_a_queued_gap_had_already_processed(
        capsys: pytest.CaptureFixture[str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, stream: str) -> None:
    """A lagging tenure left a gap after r1, recovered through r6, and checkpointed r10
    live. ``checkpoint set --to r3`` promises reading right after r3: before, the gap's
    progress sent live reading to the gap's end and the gap on after r6, and r4 to r6 were
    never read again."""
    kinesis = kinesis_client(kinesis_mock.url)
    put_plain(kinesis, stream, [f"r{i}".encode() for i in range(1, 11)])
    records = arrivals(kinesis, stream)
    seq = [s for s, _ in records]
    config = worker_config(kinesis_mock.url, moto_server.url, stream).replace(
        max_lag_ms=3_600_000)
    app, table = lease_table(moto_server.url, Lease(SHARD))
    config = config.replace(application_name=app)
    processed = gaps.RecoveryRequest.gap(seq[0], 0, records[-1][1] + 1, records[1][1],
                                         seq[1]).checkpointed(Position(seq[5]), records[5][1])
    lease = table.get(SHARD)
    assert lease is not None
    control._write(table, lease, UpdateBuilder().set(ser.CHECKPOINT, ser.s(seq[9])).set(
        ser.RECOVERY, ser.s(gaps.dumps((processed,)) or "")))
    code, out, err = checkpoint_set(capsys, kinesis_mock, moto_server, app, stream,
                                    "--shard-id", SHARD, "--to", seq[2])
    assert code == 0, err
    moved = table.get(SHARD)
    assert moved is not None and moved.recovery is None
    journal = Journal()
    with running(Worker(config, lambda: JournalProcessor(journal))):
        wait_for(lambda: set(seq[3:]) <= {v for k, v in journal.of(SHARD)
                                          if k in ("record", "recovery")},
                 60, "every record after r3 read again")
    assert [v for k, v in journal.of(SHARD) if k in ("record", "recovery")] == seq[3:]


def test_a_park_mark_says_what_it_was_told_and_nothing_else() -> None:
    """The park policy's mark says since when the shard failed; an operator's says nothing
    of it (an empty ``failingSinceMs`` would read as a failure at the epoch)."""
    by_policy = json.loads(parking.marker("processor_error_policy=park", "worker",
                                          error="ValueError: bad", attempts=3,
                                          since_ms=1_700_000_000_000))
    assert (by_policy["error"], by_policy["attempts"], by_policy["failingSinceMs"]) == (
        "ValueError: bad", 3, 1_700_000_000_000)
    by_operator = json.loads(parking.marker("maintenance", "ops"))
    assert set(by_operator) == {"reason", "by", "atMs"}


def test_a_finished_shard_is_not_parked_unless_a_recovery_of_it_is_still_queued(
        capsys: pytest.CaptureFixture[str], embedded_endpoint: LocalEndpoint) -> None:
    """Parking a shard that ended would only hide it from the inspector (no worker reads it
    again): refused, and nothing written. A shard that ended with a gap still queued is
    read by its holder for that gap, so it can be parked like any other."""
    queue = gaps.dumps((gaps.RecoveryRequest.gap(TRIM_HORIZON, 0, 1001, 900, "10"),))
    finished = Lease(SHARD, lease_counter=4, checkpoint=Position.shard_end())
    recovering = Lease("shardId-000000000001", lease_counter=4,
                       checkpoint=Position.shard_end(), recovery=queue)
    app, table = lease_table(embedded_endpoint.url, finished)
    item = ser.lease_to_new_item(recovering)  # a create writes no queue: only a holder does
    item[ser.RECOVERY] = {"S": queue or ""}
    table.client.put_item(TableName=app, Item=item)
    cli = ["--application-name", app, *endpoints(embedded_endpoint, embedded_endpoint)]
    code, _, err = run_cli(capsys, "shard", "park", *cli, "--shard-id", SHARD,
                           "--reason", "poison")
    assert (code, "nothing to park" in err) == (1, True), err
    assert table.get(SHARD) == finished
    code, _, err = run_cli(capsys, "shard", "park", *cli, "--shard-id", recovering.shard_id,
                           "--reason", "poison")
    assert code == 0, err
    parked = table.get(recovering.shard_id)
    assert parked is not None and parked.parked is not None


def test_park_and_resume_report_what_they_did_and_a_shard_not_parked_is_not_resumed(
        capsys: pytest.CaptureFixture[str], embedded_endpoint: LocalEndpoint) -> None:
    """``--json`` is what scripts read: a park says the shard is parked and whom it was
    taken from, a resume that it is not. A resume of a shard nobody parked writes nothing:
    its counter bump would cost the holder its lease for no reason."""
    app, table = lease_table(embedded_endpoint.url,
                             Lease(SHARD, lease_owner="worker-a", lease_counter=3))
    cli = ["--application-name", app, "--shard-id", SHARD, "--json",
           *endpoints(embedded_endpoint, embedded_endpoint)]
    code, out, err = run_cli(capsys, "shard", "resume", *cli)
    assert (code, "is not parked" in err) == (1, True), err
    assert table.get(SHARD) == Lease(SHARD, lease_owner="worker-a", lease_counter=3)
    code, out, err = run_cli(capsys, "shard", "park", *cli, "--reason", "poison")
    assert code == 0, err
    assert json.loads(out) == {"shard_id": SHARD, "parked": True,
                               "previous_owner": "worker-a"}
    code, out, err = run_cli(capsys, "shard", "resume", *cli)
    assert code == 0, err
    assert json.loads(out) == {"shard_id": SHARD, "parked": False}


def test_a_lease_deleted_before_the_operators_write_is_refused_naming_it() -> None:
    """The lease was read, then deleted (lease cleanup of a finished parent, or by hand)
    before the command read it again to write: refused, saying so."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    table = LeaseTable(client, "app")
    with Stubber(client) as stub:
        stub.add_response("get_item", {})
        with pytest.raises(control.Refused, match="deleted meanwhile"):
            control._write_fresh(table, Lease(SHARD, lease_counter=4),
                                 lambda _: UpdateBuilder().set(ser.PARKED, {"S": "x"}),
                                 take=True)


def test_a_lease_taken_before_the_operators_write_is_left_to_its_holder_without_force() -> None:
    """A lease read with no holder was taken by a worker before the command read it again
    to write: without ``--force`` the command refuses naming the holder and writes nothing
    (the holder would lose its lease to a change it was not asked to give way to)."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    table = LeaseTable(client, "app")
    taken = ser.lease_to_new_item(Lease(SHARD, lease_owner="worker-b", lease_counter=5))
    with Stubber(client) as stub:
        stub.add_response("get_item", {"Item": taken})
        with pytest.raises(control.Refused, match="held by worker-b now"):
            control._write_fresh(table, Lease(SHARD, lease_counter=4),
                                 lambda _: UpdateBuilder().set(ser.PARKED, {"S": "x"}),
                                 take=False)
        stub.assert_no_pending_responses()
