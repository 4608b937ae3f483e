"""Worker fleets as separate OS processes, for the many-worker tests and bench/failover.py.

``FleetProcessor`` runs inside each ``kclpy-worker`` process and appends one JSON line per
record and per event to the file named by ``KCLPY_TEST_LEDGER`` (one ``write`` per batch on
an ``O_APPEND`` descriptor, so the lines of concurrent processes never interleave and the
file's order is the order things happened). ``FleetLedger`` reads it back. ``Fleet`` starts
and signals the worker processes; ``LeaseSampler`` reads the lease table in a loop to check
that no checkpoint ever moves backwards.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kclpy
from kclpy.errors import CheckpointError
from kclpy.leases.load import LoadSettings
from kclpy.position import Position
from tests.support.ledger import WORKER_ENV
from tests.support.streams import dynamodb_client, put_plain

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

ROOT = Path(__file__).resolve().parent.parent.parent


class FleetProcessor(kclpy.IRecordProcessor):
    """Records everything; checkpoints after every batch and in shutdown_requested, and
    records whether each checkpoint was accepted.

    While the file named by ``KCLPY_TEST_HOLD`` exists, process_records blocks after
    recording a batch and before checkpointing it, so a test can freeze one worker mid-batch.
    """

    def __init__(self) -> None:
        self.path = os.environ["KCLPY_TEST_LEDGER"]
        self.hold = os.environ.get("KCLPY_TEST_HOLD")
        self.shard_id = ""

    def _write(self, *entries: dict[str, Any]) -> None:
        now = time.time()
        pid = os.getpid()
        text = "".join(
            json.dumps({**entry, "shard": self.shard_id, "pid": pid, "t": now}) + "\n"
            for entry in entries
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def _checkpoint(self, checkpointer: kclpy.Checkpointer, during: str) -> None:
        # The outcome line is written once the call returns, which can be long after the
        # write reached DynamoDB: a worker stopped (SIGSTOP) in between reports it only when
        # resumed. This line says when the attempt began, so a test can tell a checkpoint
        # under way when the worker froze from one made after it was resumed.
        self._write({"event": "checkpointing", "during": during})
        try:
            checkpointer.checkpoint()
        except CheckpointError as exc:
            self._write({"event": "checkpoint", "during": during, "ok": False, "error": exc.name})
            return
        checkpoint, sub = checkpointer.last_checkpoint
        self._write(
            {"event": "checkpoint", "during": during, "ok": True, "seq": checkpoint, "sub": sub}
        )

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        self._write({"event": "initialize", "checkpoint": initialize_input.sequence_number})

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        self._write(
            *(
                {
                    "seq": record.sequence_number,
                    "sub": record.sub_sequence_number,
                    "data": record.binary_data.decode(),
                }
                for record in process_records_input.records
            )
        )
        if self.hold is not None and os.path.exists(self.hold):
            self._write({"event": "holding"})
            while os.path.exists(self.hold):
                time.sleep(0.01)
        self._checkpoint(process_records_input.checkpointer, "process_records")

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self._write({"event": "lease_lost"})

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self._checkpoint(shard_ended_input.checkpointer, "shard_ended")
        self._write({"event": "shard_ended"})

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self._write({"event": "shutdown_requested"})
        self._checkpoint(shutdown_requested_input.checkpointer, "shutdown_requested")


@dataclass
class FleetLedger:
    """The lines every FleetProcessor of one test wrote, in the order they were written."""

    path: Path

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def records(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if "data" in line]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("event") == name]

    def payloads(self) -> Counter[str]:
        return Counter(line["data"] for line in self.records())

    def processed_all(self, expected: set[str]) -> bool:
        return expected <= set(self.payloads())

    def repeats(self, most: int = 5) -> str:
        """The payloads delivered more than once (``most`` of them), each delivery as
        process, shard and sequence number, and every lifecycle event of those processes'
        tenures of those shards: what tells a re-read (one sequence number, several
        tenures) from a record written twice (several sequence numbers), and which tenure
        could not checkpoint (accepted checkpoints are left out). For a failed "duplicates
        nothing"."""
        lines = self.lines()
        counts = Counter(line["data"] for line in lines if "data" in line)
        repeated = sorted(payload for payload, n in counts.items() if n > 1)
        shown = set(repeated[:most])
        deliveries = [line for line in lines if line.get("data") in shown]
        tenures = {(line["pid"], line["shard"]) for line in deliveries}
        out = [f"{len(repeated)} payload(s) delivered more than once; the first {len(shown)}:"]
        for line in lines:
            if line.get("data") in shown:
                out.append(f"  {line['t']:.3f} pid {line['pid']} {line['shard']} "
                           f"seq {line['seq']}/{line['sub']}: {line['data']}")
            elif ("event" in line and (line["pid"], line["shard"]) in tenures
                  and not (line["event"] == "checkpoint" and line["ok"])):
                detail = {k: v for k, v in line.items() if k not in ("t", "pid", "shard")}
                out.append(f"  {line['t']:.3f} pid {line['pid']} {line['shard']}: {detail}")
        return "\n".join(out)


@dataclass
class Worker:
    """One ``kclpy-worker`` process."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def warnings(self) -> list[str]:
        """The WARNING and ERROR lines of this worker's log (a lease given up, a late
        renewal), which a check made after the fleet stopped does not otherwise show."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]

    def log_tail(self, max_bytes: int = 6000) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text[-max_bytes:]


@dataclass
class Fleet:
    """Starts workers of one application on one stream; stops them all on exit."""

    kinesis_url: str
    dynamodb_url: str
    stream: str
    application: str
    workdir: Path
    failover_ms: int = 2000
    extra_args: list[str] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    #: what each worker process runs (``python -m MODULE``) and with which processor
    module: str = "kclpy"
    processor: str = "tests.support.fleet:FleetProcessor"
    #: more environment for every worker (the SQLite ledger's path, say)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ledger(self) -> FleetLedger:
        return FleetLedger(self.workdir / "ledger.jsonl")

    def hold_path(self, name: str) -> Path:
        """While this file exists, worker ``name`` blocks between a batch and its checkpoint."""
        return self.workdir / f"{name}.hold"

    def args(self, worker_id: str) -> list[str]:
        return [
            "--stream-name", self.stream,
            "--application-name", self.application,
            "--processor", self.processor,
            "--worker-id", worker_id,
            "--region", "us-east-1",
            "--kinesis-endpoint", self.kinesis_url,
            "--dynamodb-endpoint", self.dynamodb_url,
            "--initial-position", "TRIM_HORIZON",
            "--failover-time-ms", str(self.failover_ms),
            "--idle-time-between-reads-ms", "100",
            "--shard-sync-interval-ms", "2000",
            "--parent-shard-poll-interval-ms", "200",
            "--task-backoff-time-ms", "50",
            "--shutdown-grace-ms", "5000",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, name: str) -> Worker:
        log_path = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "KCLPY_TEST_LEDGER": str(self.ledger.path),
            "KCLPY_TEST_HOLD": str(self.hold_path(name)),
            WORKER_ENV: name,
            **self.env,
        }
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args(name)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        worker = Worker(name, process, log_path)
        self.workers.append(worker)
        return worker

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every live worker (a stopped one is resumed first); their exit codes."""
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.signal(signal.SIGCONT)
                worker.signal(signal.SIGTERM)
        codes = {}
        for worker in self.workers:
            try:
                codes[worker.name] = worker.process.wait(60)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                codes[worker.name] = worker.process.wait()
        return codes

    def duplicates_report(self) -> str:
        """``FleetLedger.repeats`` and every worker's warnings (pid and name), for a failed
        "duplicates nothing" check."""
        parts = [self.ledger.repeats()]
        for worker in self.workers:
            parts.append(f"--- {worker.name} (pid {worker.pid}) warnings ---")
            parts.extend(worker.warnings()[-30:])
        return "\n".join(parts)

    def owners(self) -> dict[str, str | None]:
        """Lease key -> owner, as the table says now (SHARD_END leases left out)."""
        return {
            key: item.get("leaseOwner", {}).get("S")
            for key, item in self.lease_items().items()
            if item["checkpoint"]["S"] != "SHARD_END"
        }

    @functools.cached_property
    def _dynamodb(self) -> DynamoDBClient:
        """One client for every look at the table: making a client costs about as much CPU
        as a scan, and a test polling for a state that lasts half a second (a handoff)
        would miss it between two slow looks."""
        return dynamodb_client(self.dynamodb_url)

    def lease_items(self) -> dict[str, dict[str, Any]]:
        client = self._dynamodb
        try:
            items = client.scan(TableName=self.application, ConsistentRead=True)["Items"]
        except client.exceptions.ResourceNotFoundException:
            return {}
        return {item["leaseKey"]["S"]: dict(item) for item in items}

    def balanced_among(self, names: set[str]) -> dict[str, int] | None:
        """Lease counts per worker when every open lease is owned by one of ``names``, the
        counts differ by at most one, and no handoff is under way; else None."""
        items = self.lease_items()
        open_items = [i for i in items.values() if i["checkpoint"]["S"] != "SHARD_END"]
        if not open_items or any("checkpointOwner" in i for i in open_items):
            return None
        counts = Counter(i.get("leaseOwner", {}).get("S") for i in open_items)
        if set(counts) != names or max(counts.values()) - min(counts.values()) > 1:
            return None
        return {str(k): v for k, v in counts.items()}

    def settled(self, names: set[str]) -> dict[str, int] | None:
        """``balanced_among(names)``, and every lease's processor started on its owner (the
        last ``initialize`` of each shard came from the owner's process); else None."""
        counts = self.balanced_among(names)
        if counts is None:
            return None
        pids = {worker.name: worker.pid for worker in self.workers}
        started = {e["shard"]: e["pid"] for e in self.ledger.events("initialize")}
        for key, owner in self.owners().items():
            if owner is None or started.get(key) != pids.get(owner):
                return None
        return counts


def load_flags(settings: LoadSettings, failover_s: float) -> list[str]:
    """The ``kclpy-worker`` flags that make a worker balance by load with ``settings``
    (its ``--failover-time-ms`` being ``failover_s``), so a test predicts with the settings
    its worker processes run with (tests/leases/test_load.py parses them back). A round is
    ``varianceBalancingFrequency`` x 2 x failover: ``balance_interval_s`` must be a
    multiple of twice the failover time."""
    frequency = round(settings.balance_interval_s / (2 * failover_s))
    if frequency < 1 or frequency * 2 * failover_s != settings.balance_interval_s:
        raise ValueError(f"a balancing round of {settings.balance_interval_s:g} s is not a "
                         f"multiple of 2 x the failover time ({failover_s:g} s)")
    flags = [
        "--lease-assignment", "load",
        "--rebalance-threshold-percentage", str(round(settings.threshold * 100)),
        "--dampening-percentage", str(round(settings.dampening * 100)),
        "--allow-throughput-overshoot", str(settings.allow_overshoot).lower(),
        "--variance-balancing-frequency", str(frequency),
        "--worker-metrics-reporter-freq-ms", str(round(settings.report_interval_s * 1000)),
        "--worker-metrics-ema-alpha", str(settings.ema_alpha),
    ]  # fmt: skip
    if settings.max_kbps is not None:
        flags += ["--max-throughput-per-host-kbps", str(round(settings.max_kbps))]
    return flags


@contextmanager
def fleet(
    kinesis_url: str, dynamodb_url: str, stream: str, application: str, workdir: Path, **kw: Any
) -> Iterator[Fleet]:
    """A Fleet whose workers are all stopped (and their logs shown on failure) on exit."""
    group = Fleet(kinesis_url, dynamodb_url, stream, application, workdir, **kw)
    try:
        yield group
    except BaseException:
        for worker in group.workers:
            sys.stderr.write(f"--- {worker.name} (pid {worker.pid}) ---\n{worker.log_tail()}\n")
        raise
    finally:
        group.stop_all()


class Producer:
    """Puts numbered records on a background thread until stopped; every record's payload
    is unique (``<tag>-<n>``) and spread over all shards by its number."""

    def __init__(self, kinesis: Any, stream: str, tag: str, per_batch: int = 16) -> None:
        self._kinesis = kinesis
        self._stream = stream
        self._tag = tag
        self._per_batch = per_batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{tag}", daemon=True)
        self.sent: list[str] = []
        self.error: BaseException | None = None

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                payloads = [f"{self._tag}-{n + i}" for i in range(self._per_batch)]
                put_plain(
                    self._kinesis,
                    self._stream,
                    [p.encode() for p in payloads],
                    partition_keys=[str(n + i) for i in range(self._per_batch)],
                )
                self.sent.extend(payloads)
                n += self._per_batch
                self._stop.wait(0.1)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise AssertionError(f"producer failed: {self.error!r}") from self.error
        return list(self.sent)


class LeaseSampler:
    """Reads the lease table in a loop; ``regressions()`` lists every time a shard's stored
    checkpoint was seen lower than in an earlier sample."""

    def __init__(self, dynamodb_url: str, table: str) -> None:
        self._client = dynamodb_client(dynamodb_url)
        self._table = table
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-sampler", daemon=True)
        self._last: dict[str, Position] = {}
        self.samples = 0
        self.backwards: list[tuple[str, Position, Position]] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items = self._client.scan(TableName=self._table, ConsistentRead=True)["Items"]
            except self._client.exceptions.ResourceNotFoundException:
                items = []
            for item in items:
                key = item["leaseKey"]["S"]
                sub = int(item.get("checkpointSubSequenceNumber", {}).get("N", "0"))
                position = Position.of(item["checkpoint"]["S"], sub)
                previous = self._last.get(key)
                if previous is not None and position < previous:
                    self.backwards.append((key, previous, position))
                self._last[key] = max(position, previous or position)
            self.samples += 1
            self._stop.wait(0.05)

    def __enter__(self) -> LeaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
