"""The streams a worker consumes right now, each with its shard sync, and the streams it
stopped consuming whose leases wait to be deleted.

In a multi-stream application (``KCLConfig.multi_stream``) streams come from the
configuration or a ``StreamTracker`` asked at every shard sync. A stream that appears is
described once (``DescribeStreamSummary``) for its identifier - account, name, creation
epoch - which prefixes its lease keys. A stream that leaves the tracker, or whose shards can
no longer be listed because it was deleted, becomes *former*: its leases are no longer
taken, held ones are handed back once their processors finished, and after
``former_streams_lease_deletion_delay_ms`` (the Java ``FormerStreamsLeasesDeletionStrategy``
with its wait period) its leases that nobody runs are deleted. A stream that comes back
before that is simply consumed again, from its checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from kclpy.config import KCLConfig
from kclpy.errors import ConfigError, closest
from kclpy.leases.lease import Lease
from kclpy.leases.shard_sync import ShardSyncer, SyncedStream
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.retry import is_not_found
from kclpy.streams import StreamConfig, StreamIdentifier, stream_of_lease_key

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

log = logging.getLogger(__name__)


#: ListStreams pages read at most for a misspelt stream name's suggestion (100 names each)
_SUGGESTION_PAGES = 10


def _suggest_stream(kinesis: KinesisClient, name: str | None) -> str:
    """" (did you mean X?)" for a stream name that does not exist, when the account has a
    stream named almost so. Only a help: a caller not allowed to list streams, or any other
    failure, gets no suggestion, never a different error."""
    if not name:
        return ""
    names: list[str] = []
    try:
        pages = kinesis.get_paginator("list_streams").paginate()
        for number, page in enumerate(pages):
            names.extend(page.get("StreamNames", ()))
            if number + 1 >= _SUGGESTION_PAGES:
                break
    except Exception:
        log.debug("no stream name suggestion: ListStreams failed", exc_info=True)
        return ""
    close = closest(name, names)
    return f" (did you mean {close}?)" if close else ""


@dataclass
class ActiveStream:
    """A stream being consumed."""

    config: StreamConfig
    #: the serialised identifier its lease keys start with; None for a single-stream table
    identifier: str | None
    syncer: ShardSyncer
    #: enhanced fan-out: the registered consumer its subscriptions go through
    consumer_arn: str | None = None

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def initial_position(self) -> str:
        return self.syncer.initial_position


@dataclass
class FormerStream:
    """A stream no longer consumed; its leases are deleted ``delete_at`` (monotonic)."""

    identifier: str
    label: str
    delete_at: float
    reason: str


@dataclass
class StreamSet:
    """The worker's streams. Not thread-safe: the worker's loop owns it; consumer threads
    only look streams up (dictionary reads)."""

    kinesis: KinesisClient
    table: LeaseTable
    config: KCLConfig
    metrics: Metrics | None = None
    #: fan-out: registers (or finds) the application's consumer of a stream (given with its
    #: ARN), returns the consumer's ARN
    register: Callable[[StreamConfig, str], str] | None = None
    clock: Callable[[], float] = time.monotonic
    active: dict[str, ActiveStream] = field(default_factory=dict)
    former: dict[str, FormerStream] = field(default_factory=dict)
    _warned_single: bool = False

    # -- streams in and out ------------------------------------------------------------------

    def refresh(self, *, starting: bool = False) -> None:
        """Open the streams the configuration (or its tracker) names that are not open yet;
        those that left it become former. At start-up a missing stream is an error naming
        it, unless it may be created later; afterwards it is tried again at the next sync."""
        wanted = {stream.label: stream for stream in self.config.stream_configs()}
        for label, stream in wanted.items():
            if label not in self._labels():
                self._open(stream, starting=starting)
        for key, active in list(self.active.items()):
            if active.label not in wanted:
                self._retire(key, "it left the stream tracker")

    def _labels(self) -> set[str]:
        return {active.label for active in self.active.values()}

    def _open(self, stream: StreamConfig, *, starting: bool) -> None:
        identifier = None
        try:
            # One look-up per stream opened: a missing stream is told apart from a failed
            # shard sync, multi-stream keys need its epoch, and fan-out its ARN.
            summary = self.kinesis.describe_stream_summary(**stream.api_params)[
                "StreamDescriptionSummary"]
            if self.config.multi_stream:
                identifier = StreamIdentifier.from_summary(summary).serialize()
            consumer_arn = (self.register(stream, summary["StreamARN"])
                            if self.register is not None else None)
        except ClientError as exc:
            if not is_not_found(exc):
                raise
            if starting and not stream.may_be_created_later:
                hint = _suggest_stream(self.kinesis, stream.name) if not stream.arn else ""
                raise ConfigError("--stream-name" if stream.name else "--stream-arn",
                                  f"stream {stream.label} does not exist{hint}") from None
            log.info("stream %s does not exist (yet); looking again at the next shard sync",
                     stream.label)
            return
        cfg = self.config
        syncer = ShardSyncer(
            self.kinesis, self.table,
            SyncedStream(name=None if stream.arn else stream.label, arn=stream.arn,
                         identifier=identifier, epoch=_created_at(summary)),
            initial_position=stream.initial_position or cfg.initial_position,
            metrics=self.metrics, retries=cfg.list_shards_retries)
        key = identifier or stream.label
        self.active[key] = ActiveStream(stream, identifier, syncer, consumer_arn)
        if self.former.pop(key, None) is not None:
            log.info("stream %s is back; its leases are kept", stream.label)
        # A single stream opened at start-up is named by the worker's own start line, which
        # follows once the lease table is there; said here too, it read as started twice.
        say = log.debug if starting and not self.config.multi_stream else log.info
        say("consuming stream %s%s", stream.label, f" ({identifier})" if identifier else "")

    def _retire(self, key: str, reason: str) -> None:
        active = self.active.pop(key)
        delay_s = self.config.former_streams_lease_deletion_delay_ms / 1000
        if active.identifier is None:
            return
        self.former[key] = FormerStream(active.identifier, active.label,
                                        self.clock() + delay_s, reason)
        log.warning("stream %s is no longer consumed (%s); its leases are deleted in %.0f s "
                    "unless it comes back", active.label, reason, delay_s)

    # -- shard sync --------------------------------------------------------------------------

    def sync(self, existing: Collection[str] | None,
             leases: Iterable[Lease] | None = None) -> list[Lease]:
        """Shard sync of every active stream; a stream deleted in Kinesis becomes former
        (multi-stream) or fails the sync (a single-stream application has nothing else).
        ``leases``, the scan ``existing`` came from, lets each sync replace the leases of a
        stream that was deleted and created again under the same name."""
        if self.config.multi_stream and existing and not self._warned_single:
            single = sorted(k for k in existing if stream_of_lease_key(k) is None)
            if single:
                self._warned_single = True
                log.warning("the lease table holds %d single-stream lease(s) (%s, ...): a "
                            "multi-stream application keys leases by stream and does not "
                            "read them; their checkpoints are not used", len(single), single[0])
        created: list[Lease] = []
        for key, active in list(self.active.items()):
            try:
                created.extend(active.syncer.sync(existing, leases))
            except ClientError as exc:
                if not is_not_found(exc) or not self.config.multi_stream:
                    raise
                self._retire(key, "it was deleted")
        return created

    def known_lease_keys(self) -> set[str]:
        """Leases the worker may take: the known shards of the active streams."""
        keys: set[str] = set()
        for active in list(self.active.values()):  # also read from consumer threads
            keys |= active.syncer.known_lease_keys
        return keys

    # -- lookups -----------------------------------------------------------------------------

    def for_lease_key(self, lease_key: str, stream: str | None = None) -> ActiveStream | None:
        """The active stream a lease belongs to; None when its stream is not consumed."""
        if not self.config.multi_stream:
            return next(iter(self.active.values()), None)
        return self.active.get(stream or stream_of_lease_key(lease_key) or "")

    def for_lease(self, lease: Lease) -> ActiveStream | None:
        return self.for_lease_key(lease.lease_key, lease.stream)

    # -- deferred deletion -------------------------------------------------------------------

    def delete_due(self, idle: Iterable[Lease], scanned: Iterable[Lease]) -> list[Lease]:
        """Delete the idle leases (nobody runs them) of former streams whose wait is over;
        a former stream is forgotten once the table holds none of its leases."""
        now = self.clock()
        due = {f.identifier for f in self.former.values() if f.delete_at <= now}
        if not due:
            return []
        deleted = []
        for lease in idle:
            if self._stream_of(lease) in due and self.table.delete(lease):
                deleted.append(lease)
        gone = {lease.lease_key for lease in deleted}
        left = {self._stream_of(lease) for lease in scanned if lease.lease_key not in gone}
        for key, former in list(self.former.items()):
            if former.identifier in due and former.identifier not in left:
                del self.former[key]
                log.info("every lease of former stream %s is deleted", former.label)
        if deleted:
            log.info("deleted %d lease(s) of former streams: %s", len(deleted),
                     ", ".join(lease.lease_key for lease in deleted))
        return deleted

    @staticmethod
    def _stream_of(lease: Lease) -> str | None:
        return lease.stream or stream_of_lease_key(lease.lease_key)


def _created_at(summary: Mapping[str, Any]) -> float | None:
    """A DescribeStreamSummary's creation time in seconds, to the millisecond (a stream
    deleted and created again within one second is another stream: ``same_stream``); None
    when the endpoint leaves it out."""
    created = summary.get("StreamCreationTimestamp")
    if isinstance(created, datetime):
        return round(created.timestamp(), 3)
    return round(float(created), 3) if isinstance(created, (int, float, str)) else None
