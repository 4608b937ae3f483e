"""Which streams an application consumes, and how each is named in the lease table.

One application may read many streams with one lease table, as the Java KCL 2.3+ does with a
``MultiStreamTracker``. A stream is then identified the way Java serialises its
``StreamIdentifier`` - ``account-id:stream-name:creation-epoch`` - so that a stream deleted
and created again under the same name is a different stream with fresh leases, and its
leases are keyed ``account-id:stream-name:creation-epoch:shard-id`` (Java's
``MultiStreamLease``), with the identifier and the bare shard id stored beside the key in
the ``streamName`` and ``shardId`` attributes. An application of one configured stream keeps
the bare shard id as its lease key, which is what a single-stream Java KCL table holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from kclpy.errors import ConfigError
from kclpy.position import AT_TIMESTAMP, INITIAL_POSITIONS

_ARN = re.compile(
    r"^arn:(?P<partition>aws[\w-]*):kinesis:(?P<region>[\w-]+):(?P<account>\d+):"
    r"stream/(?P<name>[^/:]+)$")
_SERIALIZED = re.compile(r"^(?P<account>\d+):(?P<name>[^:]+):(?P<epoch>\d+)$")


@dataclass(frozen=True)
class StreamConfig:
    """One stream of a multi-stream application (Java ``StreamConfig``).

    ``initial_position`` (and ``initial_timestamp`` for ``AT_TIMESTAMP``) apply to the
    stream's shards that have no lease yet; None takes the application's. A stream that may
    not exist yet - a tracker announcing a stream a producer creates later - sets
    ``may_be_created_later``: it is then waited for instead of failing the start-up.
    """

    name: str | None = None
    arn: str | None = None
    initial_position: str | None = None
    initial_timestamp: datetime | None = None
    may_be_created_later: bool = False

    def __post_init__(self) -> None:
        if not self.name and not self.arn:
            raise ConfigError("--stream-name", "a stream needs a name or an ARN")
        if self.arn is not None and not _ARN.match(self.arn):
            raise ConfigError("--stream-arn", f"{self.arn!r} is not a Kinesis stream ARN")
        if self.initial_position is not None and self.initial_position not in INITIAL_POSITIONS:
            raise ConfigError("--initial-position",
                              f"{self.initial_position!r} is not one of "
                              f"{', '.join(INITIAL_POSITIONS)}")
        if self.initial_position == AT_TIMESTAMP and self.initial_timestamp is None:
            raise ConfigError("--initial-timestamp",
                              f"stream {self.label}: is required with AT_TIMESTAMP")

    @property
    def label(self) -> str:
        """The stream's name (from the ARN when only the ARN is given)."""
        if self.name:
            return self.name
        match = _ARN.match(str(self.arn))
        assert match is not None
        return match["name"]

    @property
    def api_params(self) -> dict[str, str]:
        """How Kinesis calls name the stream: by ARN when there is one (cross-account)."""
        return {"StreamARN": self.arn} if self.arn else {"StreamName": self.label}


@runtime_checkable
class StreamTracker(Protocol):
    """Tells a worker which streams to consume (the Java ``MultiStreamTracker`` idea).

    ``stream_configs`` is asked at start-up and then at every shard sync; a stream that
    appears starts being consumed, one that disappears stops being consumed and its leases
    are deleted ``former_stream_lease_deletion_delay_ms`` later. Called on the worker's
    thread: it should answer quickly (cache a slow source).
    """

    def stream_configs(self) -> Sequence[StreamConfig]: ...


@dataclass(frozen=True)
class StreamIdentifier:
    """``account-id:stream-name:creation-epoch``, the Java KCL's serialised stream id."""

    account_id: str
    name: str
    creation_epoch: int

    def serialize(self) -> str:
        return f"{self.account_id}:{self.name}:{self.creation_epoch}"

    def __str__(self) -> str:
        return self.serialize()

    @classmethod
    def parse(cls, text: str) -> StreamIdentifier:
        match = _SERIALIZED.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not account-id:stream-name:creation-epoch")
        return cls(match["account"], match["name"], int(match["epoch"]))

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> StreamIdentifier:
        """From a DescribeStreamSummary ``StreamDescriptionSummary``: the account is read
        from the stream's ARN, the epoch is the creation time in whole seconds (as Java)."""
        match = _ARN.match(str(summary.get("StreamARN", "")))
        if match is None:
            raise ValueError(f"unexpected stream ARN {summary.get('StreamARN')!r}")
        created = summary["StreamCreationTimestamp"]
        epoch = int(created.timestamp() if isinstance(created, datetime) else float(created))
        return cls(match["account"], match["name"], epoch)


def multi_stream_lease_key(stream: str, shard_id: str) -> str:
    """Java's ``MultiStreamLease`` key for a shard of a serialised stream identifier."""
    return f"{stream}:{shard_id}"


def stream_of_lease_key(lease_key: str) -> str | None:
    """The serialised stream identifier a multi-stream lease key starts with; None for a
    single-stream key (a bare shard id has no colon)."""
    stream, sep, _ = lease_key.rpartition(":")
    return stream if sep and _SERIALIZED.match(stream) else None
