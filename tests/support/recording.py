"""A processor that records what it sees, for end-to-end tests.

In-process it appends to a shared ``Ledger``; in a worker subprocess it appends JSON lines to
the file named by ``KCLPY_TEST_LEDGER`` (one line per record, flushed), so a test can read
what a killed process had processed.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import kclpy


@dataclass
class Ledger:
    records: list[tuple[str, str, int, bytes]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, shard_id: str, record: kclpy.Record) -> None:
        with self.lock:
            self.records.append(
                (shard_id, record.sequence_number, record.sub_sequence_number, record.binary_data)
            )

    def event(self, shard_id: str, name: str) -> None:
        with self.lock:
            self.events.append((shard_id, name))

    def payloads(self) -> list[bytes]:
        with self.lock:
            return [r[3] for r in self.records]

    def by_shard(self) -> dict[str, list[tuple[int, int, bytes]]]:
        with self.lock:
            result: dict[str, list[tuple[int, int, bytes]]] = {}
            for shard_id, seq, sub, data in self.records:
                result.setdefault(shard_id, []).append((int(seq), sub, data))
            return result


class RecordingProcessor(kclpy.IRecordProcessor):
    """Checkpoints after every batch, at SHARD_END, and on shutdown."""

    def __init__(self, ledger: Ledger, *, checkpoint_every_batch: bool = True) -> None:
        self.ledger = ledger
        self.checkpoint_every_batch = checkpoint_every_batch
        self.shard_id = ""

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        self.ledger.event(self.shard_id, f"initialize:{initialize_input.sequence_number}")

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            self.ledger.add(self.shard_id, record)
        if self.checkpoint_every_batch:
            process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self.ledger.event(self.shard_id, "lease_lost")

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self.ledger.event(self.shard_id, "shard_ended")
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self.ledger.event(self.shard_id, "shutdown_requested")
        shutdown_requested_input.checkpointer.checkpoint()


class FileLedgerProcessor(kclpy.IRecordProcessor):
    """For worker subprocesses: ``--processor tests/support/recording.py:FileLedgerProcessor``."""

    def __init__(self) -> None:
        self.path = os.environ["KCLPY_TEST_LEDGER"]
        self.shard_id = ""

    def _write(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        self._write(
            {
                "event": "initialize",
                "shard": self.shard_id,
                "checkpoint": initialize_input.sequence_number,
                "pid": os.getpid(),
            }
        )

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            self._write(
                {
                    "shard": self.shard_id,
                    "seq": record.sequence_number,
                    "sub": record.sub_sequence_number,
                    "data": record.binary_data.decode(),
                    "pid": os.getpid(),
                }
            )
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self._write({"event": "lease_lost", "shard": self.shard_id, "pid": os.getpid()})

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()
        self._write({"event": "shard_ended", "shard": self.shard_id, "pid": os.getpid()})

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        shutdown_requested_input.checkpointer.checkpoint()
        self._write({"event": "shutdown_requested", "shard": self.shard_id, "pid": os.getpid()})


def read_file_ledger(path: str) -> list[dict[str, Any]]:
    """The whole lines of the ledger: a worker may be writing the last one while it is read
    (CI once read half a line), and that line is read whole at the next look."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.endswith("\n") and line.strip()]
