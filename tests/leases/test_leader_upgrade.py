"""A rolling upgrade to ``--lease-assigner leader``: a fleet of default-assigner workers is
replaced one by one by leader-mode workers, in process, on kclpy's local endpoint (moto
handed one request at a time, so conditional writes are atomic). During the upgrade both
kinds share the table: the leader counts only workers that report (a default-assigner
worker that balances by count publishes nothing, so the leader leaves its leases alone, as
a Java KCL 2.x worker's), the default-assigner workers keep scanning and stealing, and
every write of either kind is fenced on the lease counter (docs/leases.md)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Set
from contextlib import ExitStack
from typing import Any

import pytest

import kclpy
from kclpy import KCLConfig, Worker
from kclpy.errors import CheckpointError
from kclpy.leases.serializer import KCLPY_HOLDER
from kclpy.local import LocalEndpoint
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)
from tests.support.workers import running

pytestmark = pytest.mark.integration

SHARDS = 4


class Journal:
    """What every processor did, in one order: (event, worker, shard, payloads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[str, str, str, list[bytes]]] = []

    def add(self, event: str, worker: str, shard: str, payloads: list[bytes] | None = None) -> None:
        with self.lock:
            self.entries.append((event, worker, shard, payloads or []))

    def payloads(self) -> Counter[bytes]:
        with self.lock:
            return Counter(p for _, _, _, batch in self.entries for p in batch)

    def overlaps(self) -> list[str]:
        """Each moment a shard was processed by two workers at once: a processor started,
        or handled a batch, while another worker's processor of that shard had started
        and not ended (shut down, lost or ended its shard)."""
        active: dict[str, set[str]] = {}
        found = []
        with self.lock:
            entries = list(self.entries)
        for index, (event, worker, shard, _) in enumerate(entries):
            running_here = active.setdefault(shard, set())
            if event == "end":
                running_here.discard(worker)
                continue
            if event == "start":
                running_here.add(worker)
            if running_here - {worker}:
                found.append(f"entry {index}: {event} of {shard} by {worker} while "
                             f"{sorted(running_here - {worker})} ran it")
        return found


class JournalProcessor(kclpy.IRecordProcessor):
    """Checkpoints after every batch and when asked to shut down."""

    def __init__(self, journal: Journal, worker: str) -> None:
        self.journal = journal
        self.worker = worker
        self.shard_id = ""

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        self.journal.add("start", self.worker, self.shard_id)

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        self.journal.add("batch", self.worker, self.shard_id,
                         [record.binary_data for record in process_records_input.records])
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self.journal.add("end", self.worker, self.shard_id)

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()
        self.journal.add("end", self.worker, self.shard_id)

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        # a lease that moved on meanwhile: its new owner starts from the last checkpoint
        with contextlib.suppress(CheckpointError):
            shutdown_requested_input.checkpointer.checkpoint()
        self.journal.add("end", self.worker, self.shard_id)


def test_a_rolling_upgrade_to_a_leader_loses_nothing_and_never_runs_a_shard_twice(
        embedded_endpoint: LocalEndpoint) -> None:
    """Three default-assigner workers on four shards are replaced one at a time by
    leader-mode workers, records put before and after each step: every record is
    processed, no shard is ever processed by two workers at once (each processor's start
    and batches against the other workers' processors of the shard), and in the end every
    lease is held (taken, not only assigned) by one of the new workers, all three of
    which report to the leader."""
    url = embedded_endpoint.url
    kinesis, dynamodb = kinesis_client(url), dynamodb_client(url)
    stream, app = unique_name("upgrade"), unique_name("upgrade-app")
    create_stream(kinesis, stream, SHARDS)
    journal = Journal()
    sent: list[bytes] = []

    def put(tag: str) -> None:
        batch = [f"{tag}-{n}".encode() for n in range(40)]
        put_plain(kinesis, stream, batch)
        sent.extend(batch)

    def worker(name: str, assigner: str) -> Worker:
        return Worker(KCLConfig(
            application_name=app, stream_name=stream, region="us-east-1", worker_id=name,
            kinesis_endpoint=url, dynamodb_endpoint=url, initial_position="TRIM_HORIZON",
            failover_time_ms=3000, idle_time_between_reads_ms=100,
            worker_metrics_reporter_freq_ms=500, lease_assigner=assigner),
            lambda: JournalProcessor(journal, name))

    def leases() -> dict[str, dict[str, Any]]:
        try:
            items = dynamodb.scan(TableName=app, ConsistentRead=True)["Items"]
        except dynamodb.exceptions.ResourceNotFoundException:
            return {}  # not created yet
        return {item["leaseKey"]["S"]: item for item in items}

    def all_held_by(names: Set[str]) -> bool:
        items = leases()
        return len(items) == SHARDS and all(
            item.get("leaseOwner", {}).get("S") in names
            and item.get(KCLPY_HOLDER, {}).get("S") == item["leaseOwner"]["S"]
            and "checkpointOwner" not in item for item in items.values())

    def caught_up() -> bool:
        return set(journal.payloads()) >= set(sent)

    with ExitStack() as fleet:
        old = {name: fleet.enter_context(running(worker(name, "worker")))
               for name in ("old1", "old2", "old3")}
        put("before")
        wait_for(lambda: all_held_by(set(old)), 60, "the old fleet holding every lease")
        wait_for(caught_up, 60, "the old fleet processing what was put")
        live = set(old)
        for step in (1, 2, 3):
            old.pop(f"old{step}").shutdown()
            live = (live - {f"old{step}"}) | {f"new{step}"}
            fleet.enter_context(running(worker(f"new{step}", "leader")))
            put(f"step{step}")
            wait_for(functools.partial(all_held_by, frozenset(live)), 90,
                     f"every lease held after step {step}")
            wait_for(caught_up, 60, f"every record processed after step {step}")
        put("after")
        wait_for(caught_up, 60, "every record processed by the new fleet")
        reports = {item["workerId"]["S"] for item in dynamodb.scan(
            TableName=app + "-kclpyWorkerLoad", ConsistentRead=True)["Items"]}
        assert {"new1", "new2", "new3"} <= reports
    assert set(journal.payloads()) == set(sent)
    assert journal.overlaps() == []
