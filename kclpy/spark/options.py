"""The source's ``.option(...)`` names and values, checked when ``.load()`` runs.

A misspelt option that silently keeps its default is the worst kind of error for a stream
reader: ``startingPositon=TRIM_HORIZON`` would read from LATEST and return nothing, with no
error anywhere. So every name must be known (an unknown one is an error naming it and the
closest known name), and the names users of the Databricks and awslabs Kinesis sources
already type are accepted where they mean the same thing (:data:`ALIASES`, the table in
docs/spark.md). Names are case-insensitive, as Spark's options are.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import boto3
import botocore.config
import botocore.session
from botocore.credentials import (
    AssumeRoleCredentialFetcher,
    CredentialProvider,
    DeferredRefreshableCredentials,
)

from kclpy.config import parse_timestamp
from kclpy.errors import ConfigError, closest
from kclpy.position import AT_TIMESTAMP, LATEST, TRIM_HORIZON
from kclpy.retrieval.modes import FAN_OUT, POLLING, retrieval_mode
from kclpy.retry import READ_BACKOFF_BASE_MS, READ_BACKOFF_CAP_MS, RetryPolicy, read_policy
from kclpy.spark.metadata import parse_location
from kclpy.spark.reading import TASK_READ_ATTEMPTS, StreamRef

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

__all__ = ["ALIASES", "ALIAS_UNITS", "OPTIONS", "SourceOptions"]

#: canonical name -> default as written in docs/spark.md (None: no default)
OPTIONS: dict[str, str | None] = {
    "streamName": None,
    "streamArn": None,
    "region": None,
    "endpointUrl": None,
    "startingPosition": LATEST,
    "timestamp": None,
    "maxRecordsPerBatch": None,
    "maxFetchRecordsPerShard": None,
    "fetchBufferSize": None,
    "maxFetchDuration": None,
    "metadataPath": None,
    "metadataEndpointUrl": None,
    "maxRecordsPerFetch": "10000",
    "deaggregate": "true",
    "minFetchPeriod": "1s",
    "shardFetchInterval": "5s",
    "settleTime": "1s",
    "failOnDataLoss": "true",
    "getRecordsBackoffBase": "100ms",
    "getRecordsBackoffCap": "5s",
    "roleArn": None,
    "roleSessionName": "kclpy-spark",
    "roleExternalId": None,
    "stsEndpoint": None,
    "consumerMode": "polling",
    "consumerName": None,
    "consumerArn": None,
}

#: other sources' names -> kclpy's (Databricks ``kinesis``, awslabs ``aws-kinesis``, qubole)
ALIASES: dict[str, str] = {
    "kinesis.streamName": "streamName",
    "kinesis.region": "region",
    "endpoint": "endpointUrl",
    "kinesis.endpointUrl": "endpointUrl",
    "initialPosition": "startingPosition",
    "kinesis.startingPosition": "startingPosition",
    "kinesis.maxFetchRecordsPerShard": "maxFetchRecordsPerShard",
    "kinesis.executor.maxFetchRecordsPerShard": "maxFetchRecordsPerShard",
    "kinesis.getRecords.numberOfRecordsPerFetch": "maxRecordsPerFetch",
    "kinesis.executor.maxRecordPerRead": "maxRecordsPerFetch",
    "kinesis.describeShardInterval": "shardFetchInterval",
    "kinesis.client.describeShardInterval": "shardFetchInterval",
    "kinesis.failOnDataLoss": "failOnDataLoss",
    "kinesis.stsRoleArn": "roleArn",
    "awsSTSRoleARN": "roleArn",
    "kinesis.stsSessionName": "roleSessionName",
    "awsSTSSessionName": "roleSessionName",
    "kinesis.stsEndpointUrl": "stsEndpoint",
    "kinesis.maxFetchTimePerShardSec": "maxFetchDuration",
    "kinesis.executor.maxFetchTimeInMs": "maxFetchDuration",
    "kinesis.metadataPath": "metadataPath",
    "kinesis.consumerType": "consumerMode",
    "kinesis.consumerName": "consumerName",
}

#: the unit a bare number has under an alias that names its unit (awslabs counts seconds)
ALIAS_UNITS: dict[str, str] = {
    "kinesis.maxfetchtimepershardsec": "s",
    "kinesis.executor.maxfetchtimeinms": "ms",
}

#: other sources' options kclpy's source does not have: named, so the error says why
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(["awsAccessKey", "awsSecretKey", "awsAccessKeyId", "kinesis.awsAccessKeyId",
                     "kinesis.awsSecretKey", "kinesis.credentialProviderClass",
                     "awsUseInstanceProfile"],
                    "credentials come from the standard AWS chain (or roleArn), never options"),
    "requireConsumerDeregistration": "kclpy never deregisters a consumer by itself: a "
                                     "consumer outlives any one query (kclpy "
                                     "deregister-consumer removes it)",
    **dict.fromkeys(["kinesis.metadataCommitterType", "kinesis.dynamodb.tableName"],
                    "the store of the ends executors reach is named by metadataPath alone: "
                    "dynamodb://<table>, s3://<bucket>/<prefix> or a shared directory"),
    "maxFetchRate": "reads are paced per shard by minFetchPeriod and bounded per batch by "
                    "fetchBufferSize, maxFetchRecordsPerShard and maxFetchDuration",
    "shardsPerTask": "each shard with new records is one task",
}
_UNSUPPORTED_LOWER = {name.lower(): reason for name, reason in UNSUPPORTED.items()}

_CONSUMER_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,128}$")
_CONSUMER_ARN = re.compile(r"^arn:aws[a-z-]*:kinesis:[a-z0-9-]+:\d{12}:stream/[\w.-]+/consumer/"
                           r"[\w.-]+:\d+$")
_POSITIONS = {TRIM_HORIZON: TRIM_HORIZON, "EARLIEST": TRIM_HORIZON, LATEST: LATEST,
              AT_TIMESTAMP: AT_TIMESTAMP}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|seconds?|m|min|minutes?)?\s*$",
                       re.IGNORECASE)
_UNIT_MS = {"ms": 1, "s": 1000, "sec": 1000, "second": 1000, "seconds": 1000,
            "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000}
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")
_SESSION_NAME = re.compile(r"^[\w+=,.@-]{2,64}$")
_EXTERNAL_ID = re.compile(r"^[\w+=,.@:/-]{2,1224}$")
_URL = re.compile(r"^https?://[^/\s]+")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|k|mb|m|gb|g|tb|t)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3,
               "gb": 1024**3, "t": 1024**4, "tb": 1024**4}
_LOWER = {name.lower(): name for name in OPTIONS}
_ALIAS_LOWER = {alias.lower(): name for alias, name in ALIASES.items()}


def _canonical(raw: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """canonical name -> (the name as the user wrote it, value); unknown names rejected."""
    out: dict[str, tuple[str, str]] = {}
    for key, value in raw.items():
        written = str(key)
        low = written.lower()
        name = _LOWER.get(low) or _ALIAS_LOWER.get(low)
        if name is None and low in _UNSUPPORTED_LOWER:
            raise ConfigError(written, f"not supported: {_UNSUPPORTED_LOWER[low]}")
        if name is None:
            close = closest(written, [*OPTIONS, *ALIASES], ignore_case=True)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(written, f"unknown option {written!r}{hint}")
        if name in out:
            raise ConfigError(written, f"given twice (also as {out[name][0]!r})")
        out[name] = (written, str(value))
    return out


def _consumer(text: Callable[[str], str | None], written: Callable[[str], str],
              streams: int) -> tuple[str, str | None, str | None]:
    """consumerMode, consumerName and consumerArn, checked together: a mode that reads
    through a consumer needs exactly one of the two, and any other mode neither. The mode
    is the worker's (``retrieval/modes.py``'s registry, which also knows Databricks'
    ``efo`` and awslabs' ``kinesis.consumerType`` words ``GetRecords`` and
    ``SubscribeToShard``); without one, a consumer given means enhanced fan-out."""
    raw_mode = text("consumerMode")
    name, arn = text("consumerName") or None, text("consumerArn") or None
    if raw_mode is not None:
        mode = retrieval_mode(raw_mode, written("consumerMode"))
    else:
        mode = FAN_OUT if name or arn else POLLING
    if name is not None and arn is not None:
        raise ConfigError(written("consumerArn"), "give consumerName or consumerArn, not both")
    if not mode.needs_consumer and (name or arn):
        raise ConfigError(written("consumerName" if name else "consumerArn"),
                          f"only meaningful with enhanced fan-out, not {raw_mode!r}")
    if mode.needs_consumer and name is None and arn is None:
        raise ConfigError("consumerName", f"{written('consumerMode')}={raw_mode} needs "
                          "consumerName (registered when missing) or consumerArn")
    if name is not None and not _CONSUMER_NAME.match(name):
        raise ConfigError(written("consumerName"),
                          "1 to 128 letters, digits or _.- characters")
    if arn is not None:
        if not _CONSUMER_ARN.match(arn):
            raise ConfigError(written("consumerArn"), f"{arn!r} is not a stream consumer ARN "
                              "(arn:aws:kinesis:<region>:<account>:stream/<stream>/consumer/"
                              "<name>:<timestamp>)")
        if streams > 1:
            raise ConfigError(written("consumerArn"), "a consumer belongs to one stream: with "
                              "several streams give consumerName")
    return mode.name, name, arn


def _duration_ms(written: str, raw: str) -> int:
    match = _DURATION.match(raw)
    if match is None:
        raise ConfigError(written, f"{raw!r} is not a duration (e.g. 500ms, 1s, 2m)")
    unit = (match.group(2) or "ms").lower()
    return round(float(match.group(1)) * _UNIT_MS[unit])


@dataclass(frozen=True)
class SourceOptions:
    """The reader's whole configuration: plain values, so it pickles to the executors."""

    streams: tuple[StreamRef, ...]
    region: str | None = None
    endpoint_url: str | None = None
    starting_position: str = LATEST
    starting_timestamp_ms: int | None = None
    max_records_per_batch: int | None = None
    max_fetch_records_per_shard: int | None = None
    #: payload bytes per batch over all shards, split evenly among the shards that move: a
    #: stopping condition (each shard stops after the record that reaches its share)
    fetch_buffer_bytes: int | None = None
    #: how long an executor reads one shard for one batch
    max_fetch_duration_ms: int | None = None
    #: where executors record the end a budgeted batch reached, which the driver and every
    #: executor reach: a directory, s3://bucket/prefix or dynamodb://table/prefix
    #: (kclpy.spark.metadata)
    metadata_path: str | None = None
    #: the S3 or DynamoDB endpoint of metadata_path's store (None: the standard chain's)
    metadata_endpoint_url: str | None = None
    max_records_per_fetch: int = 10_000
    deaggregate: bool = True
    #: shortest time between two driver probes of one shard
    min_fetch_period_ms: int = 1000
    #: shortest time between two ListShards
    shard_fetch_interval_ms: int = 5000
    #: how long before planning a batch ends: records younger than this wait for the next
    #: batch, so a batch never ends where records may still be arriving
    settle_ms: int = 1000
    fail_on_data_loss: bool = True
    #: a task's read retries (GetRecords, iterators, subscriptions): the worker's backoff
    #: (kclpy.retry.read_policy), capped in attempts
    read_backoff_base_ms: int = READ_BACKOFF_BASE_MS
    read_backoff_cap_ms: int = READ_BACKOFF_CAP_MS
    #: an IAM role to assume (through STS, from the standard credential chain) for every
    #: Kinesis call, on the driver and on each executor
    role_arn: str | None = None
    role_session_name: str = "kclpy-spark"
    role_external_id: str | None = None
    sts_endpoint: str | None = None
    #: how executors read (a name of ``retrieval/modes.py``'s registry: each executor looks
    #: it up, so a mode registered from outside must be registered there too)
    retrieval_mode: str = "polling"
    #: enhanced fan-out: executors read through this consumer's SubscribeToShard (the
    #: driver registers it once, when missing) ...
    consumer_name: str | None = None
    #: ... or through this registered consumer (one stream only)
    consumer_arn: str | None = None

    @property
    def read_retries(self) -> RetryPolicy:
        """How a task's read retries: as a worker's (``KCLConfig.read_retries``), but
        :data:`TASK_READ_ATTEMPTS` times at most, since a task that still fails is better
        retried by Spark than stuck here."""
        return read_policy(self.read_backoff_base_ms, self.read_backoff_cap_ms,
                           max_attempts=TASK_READ_ATTEMPTS)

    @property
    def fan_out(self) -> bool:
        """Executors read through a registered stream consumer (enhanced fan-out)."""
        return retrieval_mode(self.retrieval_mode, "consumerMode").needs_consumer

    @property
    def budgeted(self) -> bool:
        """Batches end where an executor stops (rows, bytes or time), not at a time alone."""
        return (self.max_records_per_batch is not None
                or self.max_fetch_records_per_shard is not None
                or self.fetch_buffer_bytes is not None
                or self.max_fetch_duration_ms is not None)

    @property
    def stream(self) -> StreamRef:
        """The first (usually the only) stream."""
        return self.streams[0]

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """From ``.option(...)`` values; ConfigError names the option as the user wrote it."""
        opts = _canonical(options)

        def text(name: str) -> str | None:
            got = opts.get(name)
            return got[1].strip() if got else None

        def written(name: str) -> str:
            got = opts.get(name)
            return got[0] if got else name

        def integer(name: str, default: int | None, low: int, high: int) -> int | None:
            raw = text(name)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(written(name), f"{raw!r} is not an integer") from None
            if not low <= value <= high:
                raise ConfigError(written(name),
                                  f"must be between {low} and {high}, got {value}")
            return value

        def boolean(name: str, default: bool) -> bool:
            raw = text(name)
            if raw is None:
                return default
            if raw.lower() not in ("true", "false"):
                raise ConfigError(written(name), f"{raw!r} is not true or false")
            return raw.lower() == "true"

        def duration(name: str, default_ms: int, low_ms: int) -> int:
            raw = text(name)
            if raw is None:
                return default_ms
            unit = ALIAS_UNITS.get(written(name).lower())
            if unit is not None and raw.replace(".", "", 1).isdigit():
                raw += unit
            value = _duration_ms(written(name), raw)
            if value < low_ms:
                raise ConfigError(written(name), f"must be at least {low_ms} ms, got {raw!r}")
            return value

        name, arn = text("streamName"), text("streamArn")
        if not name and not arn:
            raise ConfigError("streamName", "streamName or streamArn is required")
        if name and arn:
            raise ConfigError(written("streamArn"), "give streamName or streamArn, not both")
        # Several streams: a comma-separated list, as Databricks' source takes them.
        listed = [part.strip() for part in (name or arn or "").split(",")]
        option = "streamName" if name else "streamArn"
        if any(not part for part in listed) or len(set(listed)) != len(listed):
            raise ConfigError(written(option), "an empty or repeated stream in the list")
        streams = tuple(StreamRef(part, None) if name else StreamRef(None, part)
                        for part in listed)
        labels = [stream.label for stream in streams]
        if len(set(labels)) != len(labels):
            raise ConfigError(written(option), "two streams of the same name")
        raw_position = text("startingPosition") or LATEST
        kind, _, inline_ts = raw_position.partition(" ")  # awslabs: "AT_TIMESTAMP <time>"
        position = _POSITIONS.get(kind.upper())
        if position is None or (inline_ts and position != AT_TIMESTAMP):
            raise ConfigError(written("startingPosition"),
                              f"{raw_position!r} is not TRIM_HORIZON, LATEST or AT_TIMESTAMP")
        if inline_ts and "timestamp" in opts:
            raise ConfigError(written("timestamp"), "the time is in startingPosition already")
        timestamp_ms = None
        if position == AT_TIMESTAMP:
            raw_ts = inline_ts.strip() or text("timestamp")
            if not raw_ts:
                raise ConfigError("timestamp", "required with startingPosition AT_TIMESTAMP")
            try:
                timestamp_ms = round(parse_timestamp(raw_ts).timestamp() * 1000)
            except ValueError:
                raise ConfigError(written("timestamp"), f"{raw_ts!r} is not ISO 8601 or epoch "
                                  "seconds") from None
        elif "timestamp" in opts:
            raise ConfigError(written("timestamp"),
                              "only meaningful with startingPosition AT_TIMESTAMP")
        per_fetch = integer("maxRecordsPerFetch", 10_000, 1, 10_000)
        assert per_fetch is not None
        endpoint, sts = text("endpointUrl") or None, text("stsEndpoint") or None
        metadata_endpoint = text("metadataEndpointUrl") or None
        for option, url in (("endpointUrl", endpoint), ("stsEndpoint", sts),
                            ("metadataEndpointUrl", metadata_endpoint)):
            if url is not None and not _URL.match(url):
                raise ConfigError(written(option), f"{url!r} is not an http(s) URL")
        role = text("roleArn") or None
        if role is not None and not _ROLE_ARN.match(role):
            raise ConfigError(written("roleArn"), f"{role!r} is not an IAM role ARN "
                              "(arn:aws:iam::<account>:role/<name>)")
        session_name = text("roleSessionName") or "kclpy-spark"
        if not _SESSION_NAME.match(session_name):
            raise ConfigError(written("roleSessionName"),
                              "2 to 64 letters, digits or +=,.@_- characters")
        external_id = text("roleExternalId") or None
        if external_id is not None and not _EXTERNAL_ID.match(external_id):
            raise ConfigError(written("roleExternalId"),
                              "2 to 1224 letters, digits or +=,.@:/_- characters")
        for option in ("roleSessionName", "roleExternalId", "stsEndpoint"):
            if option in opts and role is None:
                raise ConfigError(written(option), "only meaningful with roleArn")
        fetch_duration = duration("maxFetchDuration", 0, 1) if "maxFetchDuration" in opts \
            else None
        buffer_bytes = None
        if "fetchBufferSize" in opts:
            raw_size = text("fetchBufferSize") or ""
            size = _BYTES.match(raw_size)
            if size is None:
                raise ConfigError(written("fetchBufferSize"),
                                  f"{raw_size!r} is not a size (e.g. 10mb, 2gb, 500000)")
            buffer_bytes = round(float(size.group(1)) * _UNIT_BYTES[(size.group(2) or "b")
                                                                     .lower()])
            if buffer_bytes < 1:
                raise ConfigError(written("fetchBufferSize"), "must be at least 1 byte")
        metadata = text("metadataPath") or None
        try:
            scheme = None if metadata is None else parse_location(metadata).scheme
        except ValueError as exc:
            raise ConfigError(written("metadataPath"), str(exc)) from None
        if metadata_endpoint is not None and not scheme:
            raise ConfigError(written("metadataEndpointUrl"), "only meaningful with a "
                              "metadataPath of s3:// or dynamodb://")
        if fetch_duration is not None and metadata is None:
            raise ConfigError(written("maxFetchDuration"),
                              "needs metadataPath: where a batch cut by time ended is known "
                              "only to the executor that read it, and a re-run of the batch "
                              "must end at the same record")
        mode, consumer_name, consumer_arn = _consumer(text, written, len(streams))
        backoff_base = duration("getRecordsBackoffBase", READ_BACKOFF_BASE_MS, 1)
        backoff_cap = duration("getRecordsBackoffCap", READ_BACKOFF_CAP_MS, 1)
        if backoff_cap < backoff_base:
            raise ConfigError(written("getRecordsBackoffCap"),
                              f"must be at least getRecordsBackoffBase ({backoff_base} ms)")
        return cls(
            streams=streams,
            region=text("region") or None,
            endpoint_url=endpoint,
            starting_position=position,
            starting_timestamp_ms=timestamp_ms,
            max_records_per_batch=integer("maxRecordsPerBatch", None, 1, 2**31),
            max_fetch_records_per_shard=integer("maxFetchRecordsPerShard", None, 1, 2**31),
            fetch_buffer_bytes=buffer_bytes,
            max_fetch_duration_ms=fetch_duration,
            metadata_path=metadata,
            metadata_endpoint_url=metadata_endpoint,
            max_records_per_fetch=per_fetch,
            deaggregate=boolean("deaggregate", True),
            min_fetch_period_ms=duration("minFetchPeriod", 1000, 0),
            shard_fetch_interval_ms=duration("shardFetchInterval", 5000, 0),
            settle_ms=duration("settleTime", 1000, 0),
            fail_on_data_loss=boolean("failOnDataLoss", True),
            read_backoff_base_ms=backoff_base,
            read_backoff_cap_ms=backoff_cap,
            role_arn=role,
            role_session_name=session_name,
            role_external_id=external_id,
            sts_endpoint=sts,
            retrieval_mode=mode,
            consumer_name=consumer_name,
            consumer_arn=consumer_arn,
        )

    def client(self, pool: int = 10, agent: str = "kclpy-spark") -> KinesisClient:
        """A Kinesis client; one attempt per botocore call, since reading retries with
        kclpy's own jittered backoff. ``agent`` tells driver and executor calls apart in a
        proxy's counts (and in CloudTrail).

        One per process for the same options: making one loads the service model again
        (about 0.1 s of CPU, a second on a loaded machine), more than reading a small
        batch's part costs, and Spark reuses its Python workers from task to task. Clients
        are thread-safe, and never pickled (the reader holds options only)."""
        key = (self, pool, agent)
        with _CLIENTS_LOCK:
            cached = _CLIENTS.get(key)
            if cached is None:
                config = botocore.config.Config(
                    max_pool_connections=pool,
                    retries={"mode": "standard", "total_max_attempts": 1},
                    connect_timeout=10, read_timeout=30, user_agent_extra=agent)
                session = self.session()
                session.events.register("creating-serializer.kinesis", _millisecond_timestamps)
                cached = session.client("kinesis", endpoint_url=self.endpoint_url,
                                        config=config)
                _CLIENTS[key] = cached
            return cached

    def session(self) -> boto3.session.Session:
        """The standard credential chain, or a role assumed from it with credentials that
        botocore refreshes before they expire (a driver outlives an STS session): for
        Kinesis and for metadataPath's store alike."""
        if self.role_arn is None:
            return boto3.session.Session(region_name=self.region)
        base = botocore.session.Session()
        extra: dict[str, str] = {"RoleSessionName": self.role_session_name}
        if self.role_external_id is not None:
            extra["ExternalId"] = self.role_external_id
        region, sts_endpoint = self.region, self.sts_endpoint

        def sts_client(service: str, **kwargs: Any) -> Any:
            return base.create_client(service, region_name=region, endpoint_url=sts_endpoint,
                                      **kwargs)

        fetcher = AssumeRoleCredentialFetcher(
            client_creator=sts_client, source_credentials=base.get_credentials(),
            role_arn=self.role_arn, extra_args=extra)
        assumed = botocore.session.Session()
        assumed.get_component("credential_provider").insert_before(
            "env", _AssumedRole(fetcher))
        return boto3.session.Session(botocore_session=assumed, region_name=self.region)


_CLIENTS: dict[tuple[SourceOptions, int, str], KinesisClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _millisecond_timestamps(serializer_kwargs: dict[str, Any], **_: Any) -> None:
    """Send ``AT_TIMESTAMP`` iterators' times to the millisecond, as the API takes them.

    botocore truncates a JSON-protocol timestamp to the whole second unless a service asks
    for more, so an iterator for ``LATEST`` resolved at 12:00:00.700 starts at 12:00:00.000
    and every record of that second before it must be fetched and dropped (by the driver's
    probe as much as by each executor). botocore versions before this event existed keep
    the second: the reader drops the early records itself, which is correct, only dearer.
    """
    serializer_kwargs["timestamp_precision"] = "millisecond"


class _AssumedRole(CredentialProvider):
    """First in the chain of the session the source's clients are made from: the role."""

    METHOD = "assume-role"

    def __init__(self, fetcher: AssumeRoleCredentialFetcher) -> None:
        super().__init__()
        self._fetcher = fetcher

    def load(self) -> DeferredRefreshableCredentials:
        return DeferredRefreshableCredentials(refresh_using=self._fetcher.fetch_credentials,
                                              method=self.METHOD)
