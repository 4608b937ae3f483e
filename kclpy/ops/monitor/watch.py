"""One application seen from outside: its lease table and its streams, sampled and judged.

Each ``sample`` reads what ``kclpy status`` reads - the lease table (one strongly consistent
Scan: an eventually consistent page could show a checkpoint older than the previous page
did, which the rules would call a REWIND), ListShards per stream, and at each unfinished
lease's checkpoint the :class:`~kclpy.ops.lag.LagProbe` (GetShardIterator + GetRecords) -
and records one :class:`~kclpy.ops.lag.Observation` per lease into a
:class:`~kclpy.ops.lag.LagTracker`, so the shard rules are Burrow's rules of
``kclpy.ops.lag`` unchanged. Unlike a worker's ``/status``, every lease is observed, held or
not: a parked shard, a shard of a dead fleet and one nobody took are the ones to see.

What a shard's rules cannot see is judged for the application:

- **no live worker**: no lease's ``leaseCounter`` moved for a failover time (a live worker
  renews each of its leases every half failover time), while unfinished, unparked leases
  exist. Before a failover time has been observed every owner counts as live: one look
  cannot tell a dead worker from a renewal that has not come yet;
- **behind retention**: an unfinished lease whose shard the stream no longer lists (its
  records are gone), or whose oldest unprocessed record is older than
  ``RETENTION_EDGE`` of the stream's retention (they are about to go).

Nothing here writes: no lease is taken, created or changed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kclpy.errors import KCLError
from kclpy.leases import park as parking
from kclpy.leases.lease import Lease
from kclpy.leases.shard_sync import LIST_SHARDS_RETRIES, ShardSyncer, SyncedStream
from kclpy.leases.table import LeaseTable
from kclpy.ops.lag import (
    AppStatus,
    LagProbe,
    LagTracker,
    Observation,
    ShardEvaluation,
    ShardStatus,
    application_status,
)
from kclpy.streams import StreamIdentifier

#: an oldest unprocessed record older than this share of the retention is at its edge
RETENTION_EDGE = 0.9
#: how often the stream's retention period is read again (DescribeStreamSummary)
RETENTION_REFRESH_S = 600.0


@dataclass(frozen=True)
class StreamRef:
    """A stream an application consumes, as its leases name it."""

    #: the stream's name (the last part of its ARN)
    label: str
    arn: str | None = None
    #: the multi-stream lease keys' prefix (``account:name:epoch``); None for a
    #: single-stream table, whose keys are bare shard ids
    identifier: str | None = None


@dataclass(frozen=True)
class ShardView:
    """One lease as the monitor last judged it: what the page, the API and the metrics
    show of a shard."""

    lease_key: str
    shard_id: str
    stream: str
    status: str
    reason: str
    complete: float
    owner: str | None
    checkpoint: str | None
    lease_counter: int
    records_behind: int | None
    records_exact: bool
    millis_behind: int | None
    parents: tuple[str, ...]
    children: tuple[str, ...]
    #: seconds since the monitor saw the checkpoint change; None before it saw a change
    checkpoint_age_s: float | None
    #: seconds the monitor has watched this lease (the age is at least this when None)
    observed_s: float
    parked: Mapping[str, Any] | None = None
    recovering: bool = False
    waiting_on_parents: bool = False
    finished: bool = False
    behind_retention: bool = False
    #: (seconds before the evaluation, millis behind, records behind) over the window
    history: tuple[tuple[float, int, int], ...] = ()


@dataclass(frozen=True)
class AppView:
    """One application's last evaluation."""

    name: str
    table: str
    status: str
    reasons: tuple[str, ...]
    window_s: float
    complete: float
    streams: tuple[str, ...]
    shards: tuple[ShardView, ...]
    owners: tuple[str, ...]
    live_workers: tuple[str, ...]
    unleased_shards: tuple[str, ...]
    evaluated_ms: int
    #: why the last sample failed (the evaluation shown is then the one before it)
    error: str | None = None

    def parked(self, stream: str | None = None) -> list[ShardView]:
        return [s for s in self.shards if s.parked is not None
                and (stream is None or s.stream == stream)]


def app_label(status: AppStatus) -> str:
    """The application status as the worker's gauge and webhook spell it (ERROR is ERR)."""
    return "ERR" if status is AppStatus.ERROR else status.value


@dataclass
class _Seen:
    """What earlier samples showed of one lease, for what a single look cannot tell."""

    first: float
    counter: int
    counter_moved: float
    position: tuple[str | None, int]
    checkpoint_moved: float | None = None
    history: deque[tuple[float, int, int]] = field(default_factory=deque)


class ApplicationWatch:
    """Samples one application; ``sample`` returns its :class:`AppView`.

    ``stream_name`` / ``stream_arn`` name the stream of a single-stream table whose leases
    do not (tables written by the Java KCL or an older kclpy), and pick one stream of a
    multi-stream table."""

    def __init__(self, name: str, kinesis: Any, dynamodb: Any, *, window_s: float,
                 failover_s: float, records_limit: int = 1000,
                 stream_name: str | None = None, stream_arn: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.table_name = name
        self._kinesis = kinesis
        self._table = LeaseTable(dynamodb, self.table_name, max_attempts=2)
        self.window_s = window_s
        self.failover_s = failover_s
        self._records_limit = records_limit
        self._stream_hint = stream_arn.rsplit("/", 1)[-1] if stream_arn else stream_name
        self._stream_arn = stream_arn
        self._clock = clock
        self._wall_clock = wall_clock
        self._tracker = LagTracker(window_s)
        self._seen: dict[str, _Seen] = {}
        self._started: float | None = None
        self._probes: dict[StreamRef, LagProbe] = {}
        self._syncers: dict[StreamRef, ShardSyncer] = {}
        self._retention: dict[StreamRef, tuple[float, float]] = {}

    # -- reading -----------------------------------------------------------------------

    def _streams(self, leases: Sequence[Lease]) -> dict[StreamRef, list[Lease]]:
        """The leases by the stream they belong to (one stream in a single-stream table)."""
        groups: dict[StreamRef, list[Lease]] = {}
        newest: dict[str, str] = {}
        multi = [lease for lease in leases if lease.stream is not None]
        for lease in multi:
            stream = str(lease.stream)
            label = _name_of(stream)
            # a stream deleted and created again keeps its old incarnation's leases until
            # they are cleaned up: the newest incarnation is the one consumed
            if label not in newest or _epoch_of(stream) > _epoch_of(newest[label]):
                newest[label] = stream
        for lease in leases:
            if lease.stream is not None:
                label = _name_of(lease.stream)
                if lease.stream != newest[label]:
                    continue
                ref = StreamRef(label, None, lease.stream)
            else:
                named = lease.stream_name or self._stream_hint
                if named is None:
                    raise StreamUnknown(self.table_name)
                ref = StreamRef(named, self._stream_arn if named == self._stream_hint
                                else None)
            if self._stream_hint is not None and ref.label != self._stream_hint:
                continue
            groups.setdefault(ref, []).append(lease)
        return groups

    def _probe(self, stream: StreamRef) -> LagProbe:
        probe = self._probes.get(stream)
        if probe is None:
            probe = self._probes[stream] = LagProbe(
                self._kinesis, stream_name=None if stream.arn else stream.label,
                stream_arn=stream.arn, records_limit=self._records_limit,
                wall_clock=self._wall_clock)
        return probe

    def _syncer(self, stream: StreamRef) -> ShardSyncer:
        syncer = self._syncers.get(stream)
        if syncer is None:
            syncer = self._syncers[stream] = ShardSyncer(
                self._kinesis, self._table,
                SyncedStream(None if stream.arn else stream.label, stream.arn),
                retries=replace(LIST_SHARDS_RETRIES, max_attempts=2))
        return syncer

    def _retention_ms(self, stream: StreamRef, now: float) -> float:
        known = self._retention.get(stream)
        if known is None or now - known[0] >= RETENTION_REFRESH_S:
            params = {"StreamARN": stream.arn} if stream.arn else {"StreamName": stream.label}
            summary = self._kinesis.describe_stream_summary(**params)
            hours = float(summary["StreamDescriptionSummary"]["RetentionPeriodHours"])
            known = self._retention[stream] = (now, hours * 3_600_000)
        return known[1]

    # -- one look ----------------------------------------------------------------------

    def sample(self) -> AppView:
        """Read the table and the streams once, record, and judge the window."""
        now = self._clock()
        if self._started is None:
            self._started = now
        leases = self._table.list_leases(consistent=True)
        by_key = {lease.lease_key: lease for lease in leases}
        groups = self._streams(leases)
        behind: set[str] = set()
        unleased: list[str] = []
        observed: list[str] = []
        for stream, members in sorted(groups.items(), key=lambda g: g[0].label):
            shards = {shard.shard_id: shard for shard in self._syncer(stream).list_shards()}
            mine = {lease.shard_id for lease in members}
            unleased += sorted(f"{stream.label}/{s}" for s, shard in shards.items()
                               if s not in mine and shard.is_open)
            retention_ms: float | None = None
            for lease in members:
                if lease.shard_id not in shards:
                    if not lease.is_finished:
                        behind.add(lease.lease_key)
                    continue
                waiting = any(by_key.get(lease.key_of(p)) is not None
                              and not by_key[lease.key_of(p)].is_shard_end
                              for p in lease.parent_shard_ids)
                checkpoint = lease.checkpoint
                lag = self._probe(stream).measure(lease.shard_id, checkpoint.sequence_number,
                                                  checkpoint.sub_sequence_number)
                if lag.millis and not lease.is_shard_end:
                    if retention_ms is None:
                        retention_ms = self._retention_ms(stream, now)
                    if lag.millis >= RETENTION_EDGE * retention_ms:
                        behind.add(lease.lease_key)
                self._tracker.record(lease.lease_key, Observation(
                    time=now, checkpoint=checkpoint.sequence_number,
                    sub_sequence_number=checkpoint.sub_sequence_number, lag=lag,
                    lease_counter=lease.lease_counter, owner=lease.lease_owner,
                    owner_switches=lease.owner_switches_since_checkpoint,
                    waiting_on_parents=waiting, recovering=bool(lease.recovery)))
                observed.append(lease.lease_key)
        self._tracker.retain(observed)
        self._remember(leases, now)
        evaluations = self._tracker.evaluate(now)
        return self._view(groups, evaluations, behind, unleased, now)

    def _remember(self, leases: Sequence[Lease], now: float) -> None:
        for lease in leases:
            position = (lease.checkpoint.sequence_number, lease.checkpoint.sub_sequence_number)
            seen = self._seen.get(lease.lease_key)
            if seen is None:
                self._seen[lease.lease_key] = _Seen(now, lease.lease_counter, now, position)
                continue
            if lease.lease_counter != seen.counter:
                seen.counter, seen.counter_moved = lease.lease_counter, now
            if position != seen.position:
                seen.position, seen.checkpoint_moved = position, now
        for key in set(self._seen) - {lease.lease_key for lease in leases}:
            del self._seen[key]

    def _view(self, groups: Mapping[StreamRef, Sequence[Lease]],
              evaluations: Mapping[str, ShardEvaluation], behind: set[str],
              unleased: Sequence[str], now: float) -> AppView:
        shards: list[ShardView] = []
        owners: set[str] = set()
        live: set[str] = set()
        watched_long = self._started is not None and now - self._started >= self.failover_s
        for stream, members in groups.items():
            for lease in members:
                seen = self._seen[lease.lease_key]
                if lease.lease_owner:
                    owners.add(lease.lease_owner)
                    if not watched_long or now - seen.counter_moved < self.failover_s:
                        live.add(lease.lease_owner)
                shards.append(self._shard(stream, lease, evaluations.get(lease.lease_key),
                                          seen, lease.lease_key in behind, now))
        status = application_status(
            ShardStatus(s.status) for s in shards if s.status in _SHARD_STATUSES)
        reasons = [f"{s.lease_key}: {s.status} ({s.reason})" for s in shards
                   if s.status not in ("OK", "-")]
        working = [s for s in shards if not s.finished and s.parked is None]
        if working and not live and watched_long:
            status = AppStatus.ERROR
            reasons.insert(0, f"no live worker: no lease renewed for "
                              f"{self.failover_s:g}s or longer")
        expired = [s.lease_key for s in shards if s.behind_retention]
        if expired:
            status = AppStatus.ERROR
            reasons.insert(0, "behind the stream's retention (records lost or about to be): "
                           + ", ".join(expired))
        complete = min((e.complete for e in evaluations.values()), default=0.0)
        return AppView(
            name=self.name, table=self.table_name, status=app_label(status),
            reasons=tuple(reasons), window_s=self.window_s, complete=complete,
            streams=tuple(sorted(stream.label for stream in groups)),
            shards=tuple(sorted(shards, key=lambda s: (s.stream, s.shard_id))),
            owners=tuple(sorted(owners)), live_workers=tuple(sorted(live)),
            unleased_shards=tuple(unleased), evaluated_ms=round(self._wall_clock() * 1000))

    def _shard(self, stream: StreamRef, lease: Lease, evaluation: ShardEvaluation | None,
               seen: _Seen, behind: bool, now: float) -> ShardView:
        latest = evaluation.latest if evaluation is not None else None
        if latest is not None:
            seen.history.append((now, latest.lag.millis, latest.lag.records))
        while seen.history and seen.history[0][0] < now - self.window_s:
            seen.history.popleft()
        if evaluation is None:
            status, reason, complete = "-", "the stream no longer lists the shard", 0.0
        else:
            status, reason = evaluation.status.value, evaluation.reason
            complete = evaluation.complete
        return ShardView(
            lease_key=lease.lease_key, shard_id=lease.shard_id, stream=stream.label,
            status=status, reason=reason, complete=complete, owner=lease.lease_owner,
            checkpoint=lease.checkpoint.sequence_number, lease_counter=lease.lease_counter,
            records_behind=None if latest is None else latest.lag.records,
            records_exact=latest is not None and latest.lag.records_exact,
            millis_behind=None if latest is None else latest.lag.millis,
            parents=tuple(sorted(lease.parent_shard_ids)),
            children=tuple(sorted(lease.child_shard_ids)),
            checkpoint_age_s=None if seen.checkpoint_moved is None
            else now - seen.checkpoint_moved,
            observed_s=now - seen.first,
            parked=parking.describe(lease.parked), recovering=bool(lease.recovery),
            waiting_on_parents=latest is not None and latest.waiting_on_parents,
            finished=lease.is_finished, behind_retention=behind,
            history=tuple((now - t, millis, records) for t, millis, records in seen.history))


class StreamUnknown(KCLError):
    """A single-stream lease table whose leases do not say which stream they are of."""

    def __init__(self, table: str) -> None:
        super().__init__(f"the leases of {table} do not name their stream (a table written "
                         "by the Java KCL or an older kclpy): pass --stream-name or "
                         "--stream-arn")


_SHARD_STATUSES = frozenset(status.value for status in ShardStatus)


def _name_of(identifier: str) -> str:
    try:
        return StreamIdentifier.parse(identifier).name
    except ValueError:
        return identifier


def _epoch_of(identifier: str) -> int:
    try:
        return StreamIdentifier.parse(identifier).creation_epoch
    except ValueError:
        return 0
