"""The audit of a run: what was produced against what the processors journalled, and the
lease table as it was sampled during the run.

kclpy promises at-least-once delivery, in order per shard, with duplicates only in a window
after a failure. Each promise is checked from the ledger alone, not from what the test
thinks happened:

- *complete*: every produced id was processed at least once, at the shard and position the
  producer was told, and nothing was processed that nobody produced;
- *no skipping*: when a checkpoint at P was confirmed, every record of the shard at or before
  P had already been processed (a checkpoint never runs ahead of processing);
- *in order*: each processor instance (a session: one shard, one lease tenure) saw strictly
  increasing positions, all after the checkpoint it started from; every record of a parent
  shard was processed before the first record of its children;
- *duplicates only after a failure*: a record is processed again only by a new session whose
  owner changed, and every session that processes or checkpoints anything started from the
  latest checkpoint confirmed before it began - so what it repeats lies after the last
  checkpoint of the previous owner;
- *checkpoints only move forward*: in every sample of the lease table.

Journal row numbers are the global commit order (see ``tests.support.ledger``), so "before"
means a smaller row number, never a comparison of clocks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kclpy.position import Position
from tests.support.ledger import (
    CHECKPOINT,
    CHECKPOINT_FAILED,
    INITIALIZE,
    KPL,
    LEASE_LOST,
    RECORD,
    SHUTDOWN_REQUESTED,
    Entry,
    LeaseSample,
    Produced,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

_EXAMPLES_PER_KIND = 5


class LeaseSampler:
    """Scans the lease table on a background thread until stopped.

    It talks to DynamoDB directly, not through the fault proxy: the audit needs what the table
    holds, not the workers' view of it.
    """

    def __init__(self, client: DynamoDBClient, table: str, interval_s: float = 0.2) -> None:
        self._client = client
        self._table = table
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._samples: list[LeaseSample] = []
        self._thread = threading.Thread(target=self._run, name="lease-sampler", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> LeaseSampler:
        self._thread.start()
        return self

    def stop(self) -> list[LeaseSample]:
        """Stop sampling; the samples, in the order they were taken."""
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise AssertionError(f"lease sampler failed: {self.error!r}") from self.error
        return self.samples()

    def samples(self) -> list[LeaseSample]:
        with self._lock:
            return list(self._samples)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.sample_once()
                with self._lock:
                    self._samples.extend(batch)
                self._stop.wait(self._interval_s)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def sample_once(self) -> list[LeaseSample]:
        """One consistent scan of the whole table (none before the table exists)."""
        items: list[dict[str, Any]] = []
        request: dict[str, Any] = {"TableName": self._table, "ConsistentRead": True}
        try:
            while True:
                page = self._client.scan(**request)
                items.extend(page["Items"])
                if "LastEvaluatedKey" not in page:
                    break
                request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        except self._client.exceptions.ResourceNotFoundException:
            return []
        now = time.time()
        return [
            LeaseSample(
                at=now,
                shard=item["leaseKey"]["S"],
                checkpoint=item["checkpoint"]["S"],
                subseq=int(item.get("checkpointSubSequenceNumber", {}).get("N", "0")),
                owner=item.get("leaseOwner", {}).get("S"),
                counter=int(item["leaseCounter"]["N"]),
            )
            for item in items
        ]


@dataclass
class ShardFigures:
    produced: int = 0
    deliveries: int = 0
    duplicates: int = 0
    sessions: int = 0
    owner_changes: int = 0
    max_gap_s: float = 0.0


@dataclass
class AuditReport:
    """Violations (empty when every promise held) and the figures of the run."""

    violations: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    produced: int = 0
    produced_kpl: int = 0
    kinesis_records: int = 0
    deliveries: int = 0
    distinct: int = 0
    checkpoints: int = 0
    checkpoint_failures: int = 0
    lease_samples: int = 0
    shards: dict[str, ShardFigures] = field(default_factory=dict)

    @property
    def duplicates(self) -> int:
        return self.deliveries - self.distinct

    @property
    def ok(self) -> bool:
        return not self.violations

    def violate(self, kind: str, example: str) -> None:
        self.violations[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < _EXAMPLES_PER_KIND:
            examples.append(example)

    def describe_violations(self) -> str:
        return "\n".join(
            f"{kind}: {count}\n" + "\n".join(f"    {e}" for e in self.examples[kind])
            for kind, count in self.violations.most_common()
        )

    def figure_lines(self) -> list[str]:
        lines = [
            f"records produced: {self.produced} ({self.produced - self.produced_kpl} plain, "
            f"{self.produced_kpl} in KPL aggregates; {self.kinesis_records} Kinesis records)",
            f"deliveries: {self.deliveries}, distinct: {self.distinct}, "
            f"duplicates: {self.duplicates}",
            f"checkpoints confirmed: {self.checkpoints}, "
            f"checkpoint failures: {self.checkpoint_failures}, lease samples: {self.lease_samples}",
            "shard                   produced  dupes  sessions  owner changes  max gap",
        ]
        for shard, f in sorted(self.shards.items()):
            lines.append(
                f"{shard:<24}{f.produced:>8}{f.duplicates:>7}{f.sessions:>10}"
                f"{f.owner_changes:>15}{f.max_gap_s:>8.1f}s"
            )
        return lines


@dataclass
class _Session:
    id: str
    shard: str
    worker: str
    start: Position | None = None
    init_n: int = 0
    last: Position | None = None
    ended_n: int | None = None
    #: the start was behind a checkpoint confirmed before it was journalled: what the
    #: violation says if the session goes on to act on it (``_check_acting``)
    stale: str | None = None


def audit(
    produced: Sequence[Produced],
    journal: Sequence[Entry],
    samples: Sequence[LeaseSample],
    parents: Mapping[str, Sequence[str]],
) -> AuditReport:
    """Check a run; ``journal`` in row order, ``samples`` in the order they were taken,
    ``parents`` maps each shard to its parent shards (from ListShards)."""
    report = AuditReport()
    by_id = {p.id: p for p in produced}
    report.produced = len(by_id)
    report.produced_kpl = sum(p.kind == KPL for p in by_id.values())
    report.kinesis_records = len({(p.shard, p.seq) for p in by_id.values()})
    report.lease_samples = len(samples)
    for p in by_id.values():
        report.shards.setdefault(p.shard, ShardFigures()).produced += 1

    first: dict[str, Entry] = {}
    sessions: dict[str, _Session] = {}
    # the furthest checkpoint of each shard confirmed so far (in row order)
    confirmed: dict[str, Position] = {}
    coverage = _Coverage(by_id)
    for entry in journal:
        session = sessions.get(entry.session)
        if session is None:
            session = sessions[entry.session] = _Session(entry.session, entry.shard, entry.worker)
        if entry.event == INITIALIZE:
            _check_start(report, session, entry, confirmed.get(entry.shard))
        elif entry.event == RECORD:
            _check_acting(report, session)
            _check_delivery(report, session, entry, by_id, first, sessions)
        elif entry.event == CHECKPOINT:
            _check_acting(report, session)
            position = Position.of(entry.seq, entry.subseq)
            _check_checkpoint(report, entry, position, coverage, first)
            confirmed[entry.shard] = max(position, confirmed.get(entry.shard, position))
            report.checkpoints += 1
        elif entry.event == CHECKPOINT_FAILED:
            report.checkpoint_failures += 1
        elif entry.event in (LEASE_LOST, SHUTDOWN_REQUESTED):
            session.ended_n = entry.n

    report.distinct = len(first)
    for missing in sorted(set(by_id) - set(first)):
        report.violate("never processed", f"{missing} ({by_id[missing].shard})")
    for session in sessions.values():
        report.shards.setdefault(session.shard, ShardFigures()).sessions += 1
    _check_parents(report, parents, by_id, first)
    _check_samples(report, samples)
    _gaps(report, by_id, first)
    return report


def _check_start(
    report: AuditReport, session: _Session, entry: Entry, latest: Position | None
) -> None:
    """A new tenure resumes from the latest confirmed checkpoint, never from an older one.

    A checkpoint confirmed in an earlier row succeeded before that row, and so before this
    session's owner took the lease when the checkpoint is an earlier tenure's: had the lease
    been taken first, that checkpoint's conditional write would have failed. But it may be a
    later tenure's: an owner frozen between choosing the start and journalling it (the
    MultiLang initialize line is written after the child is spawned) loses the lease while
    frozen, and the next owner checkpoints before the frozen one's row. Such a zombie can
    neither deliver (its fence says the lease is gone) nor checkpoint, so a stale start is a
    violation once the session acts on it (``_check_acting``), not when it is journalled.
    """
    session.start = Position.of(entry.seq, entry.subseq)
    session.init_n = entry.n
    if latest is not None and session.start < latest:
        session.stale = (
            f"{entry.shard} session {entry.session[:8]} on {entry.worker} started at "
            f"{entry.seq}/{entry.subseq}, but {latest} was confirmed before (row {entry.n})"
        )


def _check_acting(report: AuditReport, session: _Session) -> None:
    """A session that processes or checkpoints after a stale start (``_check_start``)."""
    if session.stale is not None:
        report.violate("session started before the last checkpoint", session.stale)
        session.stale = None


def _check_delivery(
    report: AuditReport,
    session: _Session,
    entry: Entry,
    by_id: Mapping[str, Produced],
    first: dict[str, Entry],
    sessions: Mapping[str, _Session],
) -> None:
    assert entry.id is not None and entry.seq is not None and entry.subseq is not None
    report.deliveries += 1
    shard_figures = report.shards.setdefault(entry.shard, ShardFigures())
    shard_figures.deliveries += 1
    position = Position.of(entry.seq, entry.subseq)
    produced = by_id.get(entry.id)
    if produced is None:
        report.violate("processed but never produced", f"{entry.id} on {entry.shard}")
    elif (produced.shard, produced.position) != (entry.shard, position):
        report.violate(
            "processed at the wrong position",
            f"{entry.id}: produced at {produced.shard} {produced.position}, "
            f"processed at {entry.shard} {position}",
        )
    if session.last is not None and position <= session.last:
        report.violate(
            "out of order within a session",
            f"{entry.shard} session {session.id[:8]}: {position} after {session.last}",
        )
    elif session.last is None and session.start is not None and position <= session.start:
        report.violate(
            "processed at or before the session's start checkpoint",
            f"{entry.shard} session {session.id[:8]}: {position}, started at {session.start}",
        )
    session.last = position
    earlier = first.get(entry.id)
    if earlier is None:
        first[entry.id] = entry
        return
    shard_figures.duplicates += 1
    previous = sessions[earlier.session]
    if earlier.session == entry.session:
        report.violate(
            "processed twice by one processor",
            f"{entry.id} on {entry.shard} in session {entry.session[:8]}",
        )
    elif previous.worker == entry.worker and (
        previous.ended_n is None or previous.ended_n > session.init_n
    ):
        report.violate(
            "duplicate without an owner change",
            f"{entry.id} on {entry.shard}: sessions {previous.id[:8]} and {session.id[:8]} "
            f"of {entry.worker} overlap",
        )


class _Coverage:
    """Per shard, how far from the start every produced record has been processed.

    The journal is read in row order, so when a checkpoint row is reached, exactly the
    deliveries committed before it are known; the prefix only ever grows, which keeps the
    check linear in the number of records.
    """

    def __init__(self, by_id: Mapping[str, Produced]) -> None:
        self._records: dict[str, list[Produced]] = defaultdict(list)
        for produced in by_id.values():
            self._records[produced.shard].append(produced)
        for records in self._records.values():
            records.sort(key=lambda p: p.position)
        self._done: dict[str, int] = defaultdict(int)

    def first_unprocessed(self, shard: str, first: Mapping[str, Entry]) -> Produced | None:
        records = self._records.get(shard, [])
        done = self._done[shard]
        while done < len(records) and records[done].id in first:
            done += 1
        self._done[shard] = done
        return records[done] if done < len(records) else None


def _check_checkpoint(
    report: AuditReport,
    entry: Entry,
    position: Position,
    coverage: _Coverage,
    first: Mapping[str, Entry],
) -> None:
    """A confirmed checkpoint never runs ahead of processing: every record at or before it
    had been processed when it was confirmed.

    Whether checkpoints only move forward is checked on the lease samples, not here: a
    processor paused between its checkpoint call and its journal row confirms an old
    position late, after the next owner's rows.
    """
    pending = coverage.first_unprocessed(entry.shard, first)
    if pending is not None and pending.position <= position:
        report.violate(
            "checkpoint ahead of processing",
            f"{entry.shard} checkpoint {position} (row {entry.n}) covers {pending.id} at "
            f"{pending.position}, not processed before it",
        )


def _check_parents(
    report: AuditReport,
    parents: Mapping[str, Sequence[str]],
    by_id: Mapping[str, Produced],
    first: Mapping[str, Entry],
) -> None:
    first_rows: dict[str, list[int]] = defaultdict(list)
    for record_id, entry in first.items():
        if record_id in by_id:
            first_rows[entry.shard].append(entry.n)
    for child, parent_ids in parents.items():
        if not first_rows.get(child):
            continue
        child_start = min(first_rows[child])
        for parent in parent_ids:
            parent_end = max(first_rows.get(parent, [0]))
            if parent_end > child_start:
                report.violate(
                    "child processed before its parent finished",
                    f"{child} began at row {child_start}, {parent} ended at row {parent_end}",
                )


def _check_samples(report: AuditReport, samples: Sequence[LeaseSample]) -> None:
    last: dict[str, LeaseSample] = {}
    for sample in samples:
        previous = last.get(sample.shard)
        last[sample.shard] = sample
        if previous is None:
            continue
        if sample.position < previous.position:
            report.violate(
                "lease checkpoint moved backwards",
                f"{sample.shard}: {previous.checkpoint}/{previous.subseq} -> "
                f"{sample.checkpoint}/{sample.subseq}",
            )
        if sample.counter < previous.counter:
            report.violate(
                "lease counter went down",
                f"{sample.shard}: {previous.counter} -> {sample.counter}",
            )
        if sample.owner != previous.owner:
            report.shards.setdefault(sample.shard, ShardFigures()).owner_changes += 1


def _gaps(report: AuditReport, by_id: Mapping[str, Produced], first: Mapping[str, Entry]) -> None:
    """Per shard, the longest time a record waited for its first processing beyond both its
    own production and the previous record's processing: how long the shard stalled while
    it had work (a failover, a throttle), not how long it idled without any."""
    per_shard: dict[str, list[tuple[Position, float, float]]] = defaultdict(list)
    for record_id, entry in first.items():
        produced = by_id.get(record_id)
        if produced is not None:
            per_shard[produced.shard].append((produced.position, produced.at, entry.at))
    for shard, rows in per_shard.items():
        rows.sort()
        previous_at = float("-inf")
        worst = 0.0
        for _, produced_at, processed_at in rows:
            worst = max(worst, processed_at - max(previous_at, produced_at))
            previous_at = processed_at
        report.shards.setdefault(shard, ShardFigures()).max_gap_s = worst
