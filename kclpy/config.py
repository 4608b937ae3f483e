"""One configuration object, and the loaders that fill it: keywords, MultiLangDaemon
``.properties`` files, environment, command line.

Every option is declared once in ``OPTIONS`` with its CLI flag and properties key, so a bad
value is reported under the name the user actually wrote (``--failover-time-ms`` or
``failoverTimeMillis``) and the configuration reference in docs/ can be checked against it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kclpy.cloudwatch import LEVELS, parse_dimensions, parse_level
from kclpy.errors import ConfigError, closest
from kclpy.leases.assignment import assignment_strategy, assignment_strategy_names
from kclpy.position import AT_TIMESTAMP, INITIAL_POSITIONS, LATEST
from kclpy.retrieval.modes import retrieval_mode, retrieval_mode_names
from kclpy.retrieval.subscription import FANOUT_HTTP_VERSIONS
from kclpy.retry import READ_BACKOFF_BASE_MS, READ_BACKOFF_CAP_MS, RetryPolicy, read_policy
from kclpy.streams import StreamConfig, StreamTracker

log = logging.getLogger(__name__)

ERROR_POLICIES = ("retry", "skip", "shutdown", "park")
STRAY_STDOUT_POLICIES = ("restart", "skip")
#: who decides the assignment: every worker for itself (Java 2.x), or one elected leader
LEASE_ASSIGNERS = ("worker", "leader")


def default_worker_id() -> str:
    """Host, pid and a random suffix: unique even for two workers started in one process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class KCLConfig:
    """What a worker needs to know. Times are milliseconds, as in the Java KCL."""

    application_name: str
    stream_name: str | None = None
    stream_arn: str | None = None
    table_name: str | None = None
    worker_id: str = field(default_factory=default_worker_id)
    region: str | None = None
    kinesis_endpoint: str | None = None
    dynamodb_endpoint: str | None = None
    initial_position: str = LATEST
    initial_timestamp: datetime | None = None
    failover_time_ms: int = 10_000
    max_records: int = 10_000
    idle_time_between_reads_ms: int = 1_000
    shard_sync_interval_ms: int = 60_000
    max_initialization_attempts: int = 20
    initialization_backoff_ms: int = 1_000
    max_leases_for_worker: int | None = None
    max_leases_to_steal_at_one_time: int = 1
    parent_shard_poll_interval_ms: int = 10_000
    call_process_records_even_for_empty_record_list: bool = False
    cleanup_leases_upon_shard_completion: bool = True
    is_graceful_lease_handoff_enabled: bool = True
    graceful_lease_handoff_timeout_ms: int = 30_000
    shutdown_grace_ms: int = 10_000
    task_backoff_time_ms: int = 500
    max_task_backoff_time_ms: int = 30_000
    processor_error_policy: str = "retry"
    processor_error_attempts: int = 3
    fail_on_data_loss: bool = False
    prefetch_queue_size: int = 3
    max_pool_connections: int = 256
    stop_when_caught_up: bool = False
    executable_name: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    ops_allowed_hosts: str | None = None
    lag_window_s: int = 300
    lag_interval_s: int = 30
    #: may carry user information (a token): kept out of repr, as ``state_store``
    lag_webhook: str | None = field(default=None, repr=False)
    timeout_in_seconds: int = 300
    stray_stdout: str = "restart"
    #: a DynamoDB table name or a SQLAlchemy URL, which may carry a password: kept out of repr
    state_store: str | None = field(default=None, repr=False)
    transaction_max_records: int = 10_000
    retrieval_mode: str = "polling"
    consumer_name: str | None = None
    consumer_arn: str | None = None
    fanout_http_version: str = "auto"
    register_stream_consumer_retries: int = 10
    max_describe_stream_consumer_retries: int = 10
    retry_backoff_ms: int = 1000
    #: GetRecords / SubscribeToShard retries (throttles, 5xx, connections): capped full jitter
    get_records_backoff_base_ms: int = READ_BACKOFF_BASE_MS
    get_records_backoff_cap_ms: int = READ_BACKOFF_CAP_MS
    #: ListShards retries while throttled (shard sync)
    list_shards_backoff_base_ms: int = 200
    list_shards_backoff_cap_ms: int = 5_000
    max_list_shards_retry_attempts: int = 6
    metrics_level: str = "none"
    metrics_enabled_dimensions: str = "ALL"
    metrics_buffer_time_ms: int = 10_000
    metrics_max_queue_size: int = 10_000
    metrics_namespace: str | None = None
    cloudwatch_region: str | None = None
    cloudwatch_endpoint: str | None = None
    transaction_max_time_ms: int = 10_000
    #: lag recovery (kclpy.recovery): off while None
    max_lag_ms: int | None = None
    recovery_max_rate: int = 1_000
    #: the Java KCL's drop of KPL aggregates with sub-records outside the shard's range
    kpl_hash_range_filter: bool = False
    #: several streams with one lease table (Java's multi-stream lease keys, kclpy.streams);
    #: exclusive with ``stream_name`` / ``stream_arn``
    streams: tuple[StreamConfig, ...] = ()
    #: asked at start-up and every shard sync for the streams to consume (multi-stream keys
    #: even while it names one stream, as the Java KCL's MultiStreamTracker)
    stream_tracker: StreamTracker | None = field(default=None, repr=False)
    former_streams_lease_deletion_delay_ms: int = 3_600_000
    properties_dir: Path | None = None
    # -- lease assignment by load (kclpy.leases.load; docs/leases.md) --
    lease_assignment: str = "count"
    lease_assigner: str = "worker"
    rebalance_threshold_percentage: int = 10
    dampening_percentage: int = 60
    allow_throughput_overshoot: bool = True
    max_throughput_per_host_kbps: int | None = None
    variance_balancing_frequency: int = 3
    worker_metrics_ema_alpha: float = 0.5
    worker_metrics_reporter_freq_ms: int = 30_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad option by its keyword (built from Python:
        the name the caller wrote). The Worker asks again, as a config's fields can be set
        after it was made."""
        validate(self, {}, keywords=True)

    @property
    def fan_out(self) -> bool:
        """The retrieval mode reads through a registered stream consumer: the worker
        registers one, and ``--local`` serves Kinesis with kinesis-mock."""
        return retrieval_mode(self.retrieval_mode).needs_consumer

    @property
    def read_retries(self) -> RetryPolicy:
        """How every shard read of the worker retries GetRecords, iterators and
        subscriptions: :func:`kclpy.retry.read_policy` of the backoff options, the policy a
        Spark source builds from its own (``SourceOptions.read_retries``)."""
        return read_policy(self.get_records_backoff_base_ms, self.get_records_backoff_cap_ms)

    @property
    def list_shards_retries(self) -> RetryPolicy:
        """How a shard sync retries ListShards: ``listShardsBackoffTimeInMillis``, its cap
        and ``maxListShardsRetryAttempts``."""
        return RetryPolicy(self.list_shards_backoff_base_ms / 1000,
                           self.list_shards_backoff_cap_ms / 1000,
                           max_attempts=self.max_list_shards_retry_attempts)

    @property
    def lease_table_name(self) -> str:
        return self.table_name or self.application_name

    @property
    def multi_stream(self) -> bool:
        """Leases keyed the Java multi-stream way: several streams, or a tracker."""
        return self.stream_tracker is not None or len(self.streams) > 1

    def stream_configs(self) -> list[StreamConfig]:
        """The streams to consume now (a tracker is asked each time)."""
        if self.stream_tracker is not None:
            return list(self.stream_tracker.stream_configs())
        if self.streams:
            return list(self.streams)
        # the ARN wins over the name, as in Java: the stream is named after the ARN then
        return [StreamConfig(name=self.api_stream_name, arn=self.stream_arn,
                             initial_position=self.initial_position,
                             initial_timestamp=self.initial_timestamp)]

    @property
    def api_stream_name(self) -> str | None:
        """The name to send to Kinesis: none when an ARN is set (the ARN wins, as in Java)."""
        return None if self.stream_arn else self.stream_name

    @property
    def stream_label(self) -> str:
        """The stream's name for logs and metrics (the ARN's last part when only the ARN is
        set); the names joined by commas for several streams."""
        if self.stream_tracker is not None:
            return "(tracked streams)"
        if self.streams:
            return ",".join(stream.label for stream in self.streams)
        if self.stream_arn:
            return self.stream_arn.rsplit("/", 1)[-1]
        assert self.stream_name is not None
        return self.stream_name

    def replace(self, **changes: Any) -> KCLConfig:
        return dataclasses.replace(self, **changes)


# -- option table ---------------------------------------------------------------------------


#: what a rule of an option is given: the config, and ``label`` that names any option the
#: way the user wrote it; it returns what is wrong with its option's value, or None
Rule = Callable[["KCLConfig", Callable[[str], str]], "str | None"]


@dataclass(frozen=True)
class Option:
    """One option: its names, its kind (how text is converted), and every rule its value
    must meet - the range, the choices, and the cross-field rule - so that a bad value is
    refused, naming the option, before a worker starts any thread."""

    name: str
    flag: str
    properties_keys: tuple[str, ...]
    kind: str  # str, int, int0, bool, position, timestamp, port, url, fraction
    help: str
    #: the range of a whole number (inclusive); None: unbounded on that side
    least: int | None = None
    most: int | None = None
    #: the values a text option may take
    choices: tuple[str, ...] = ()
    #: a value never echoed in errors (it may carry credentials)
    secret: bool = False
    rule: Rule | None = None
    #: the values ``rule`` accepts (a retrieval mode in any case), for ``--help``; ``choices``
    #: are exact. A
    #: function when the values are a registry's, read when ``--help`` is built (after a
    #: value registered from outside joined it)
    rule_choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()

    @property
    def listed_choices(self) -> tuple[str, ...]:
        """The values ``--help`` lists for the option: its choices, exact or not."""
        rule_choices = self.rule_choices() if callable(self.rule_choices) else self.rule_choices
        return self.choices or rule_choices

    @property
    def default(self) -> Any:
        """The option's default: ``KCLConfig``'s own (None for a computed one)."""
        spec = KCLConfig.__dataclass_fields__[self.name]
        return None if spec.default is dataclasses.MISSING else spec.default

    @property
    def ceiling(self) -> int:
        """The largest whole number the option takes: its own ``most``, else the bound of
        its unit (``_MOST_BY_UNIT``)."""
        if self.most is not None:
            return self.most
        for suffix, most in _MOST_BY_UNIT:
            if self.name.endswith(suffix):
                return most
        return _MOST_COUNT

    def problem(self, config: KCLConfig, label: Callable[[str], str]) -> str | None:
        """What is wrong with this option's value in ``config``, or None."""
        value = getattr(config, self.name)
        if value is not None:
            wrong = self._value_problem(value)
            if wrong is not None:
                return wrong
        return self.rule(config, label) if self.rule is not None else None

    def _value_problem(self, value: Any) -> str | None:
        if self.kind == "fraction":
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value <= 1):
                return f"must be a number in (0, 1], got {value!r}"
        elif self.kind in _WHOLE_KINDS:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{value!r} is not a whole number"
            if self.least is not None and value < self.least:
                if self.kind == "port":
                    return f"{value!r} is not a port ({self.least}..{self.most})"
                return f"must be at least {self.least}, got {value}"
            if value > self.ceiling:
                if self.kind == "port":
                    return f"{value!r} is not a port ({self.least}..{self.most})"
                return f"must be at most {self.ceiling}, got {value}"
        elif self.kind == "bool" and not isinstance(value, bool):
            return f"{value!r} is not a boolean (true/false)"
        elif self.kind == "timestamp" and not isinstance(value, datetime):
            return f"{value!r} is not a timestamp"
        elif self.kind == "url" and not (isinstance(value, str)
                                         and re.match(r"^https?://[^\s/]+", value)):
            shown = "the value" if self.secret else repr(value)
            return f"{shown} is not an http(s) URL"
        if self.choices and value not in self.choices:
            return f"{value!r} is not one of {', '.join(self.choices)}"
        return None


_WHOLE_KINDS = ("int", "int0", "port")
#: the least value of each whole-number kind unless an option says otherwise
_LEAST = {"int": 1, "int0": 0, "port": 0}
#: the largest value of a whole-number option with no bound of its own, by its name's unit:
#: a time of about 3 years at most (longer than Kinesis keeps a record), since a wait beyond
#: ``threading.TIMEOUT_MAX`` (292 years) raises in the thread that waits - after start-up,
#: where no error names the option - and a wait may be a few times an option's value
_MOST_BY_UNIT = (("_ms", 10**11), ("_s", 10**8), ("_seconds", 10**8))
#: ... and a count at most the Java KCL's ``int``
_MOST_COUNT = 2**31 - 1


def _opt(name: str, kind: str, help: str, *keys: str, least: int | None = None,
         most: int | None = None, choices: tuple[str, ...] = (), secret: bool = False,
         rule: Rule | None = None,
         rule_choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()) -> Option:
    if least is None:
        least = _LEAST.get(kind)
    if kind == "port" and most is None:
        most = 65535
    return Option(name, "--" + name.replace("_", "-"), keys, kind, help, least=least,
                  most=most, choices=choices, secret=secret, rule=rule,
                  rule_choices=rule_choices)


# -- cross-field rules: each belongs to the option it names in its error ------------------


def _at_least_option(other: str, field_name: str) -> Rule:
    """A cap that must not be below its base (a backoff would refuse to start)."""

    def rule(config: KCLConfig, label: Callable[[str], str]) -> str | None:
        low, high = getattr(config, other), getattr(config, field_name)
        if isinstance(low, int) and isinstance(high, int) and high < low:
            return f"must be at least {label(other)} ({low}), got {high}"
        return None

    return rule


def _application_name(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if not config.application_name or not str(config.application_name).strip():
        return "is required"
    return None


def _several_streams(config: KCLConfig) -> bool:
    return bool(config.streams) or config.stream_tracker is not None


_ONE_OR_SEVERAL = ("names one stream; give several streams either all as streams (a "
                   "repeated flag) or with a tracker, not both")


def _stream_name(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if _several_streams(config):
        return _ONE_OR_SEVERAL if config.stream_name else None
    if not config.stream_name and not config.stream_arn:
        return f"is required (or {label('stream_arn')})"
    return None


def _stream_arn(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if config.stream_arn and _several_streams(config):
        return _ONE_OR_SEVERAL
    if config.stream_arn and not re.match(r"^arn:aws[\w-]*:kinesis:", config.stream_arn):
        return f"{config.stream_arn!r} is not a Kinesis stream ARN"
    return None


def _initial_timestamp(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if config.initial_position == AT_TIMESTAMP and config.initial_timestamp is None:
        return "is required with AT_TIMESTAMP"
    return None


#: botocore's own rule for a region name
_REGION = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?$")


def _region(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if config.region is not None and not _REGION.match(config.region):
        return f"{config.region!r} is not a region name"
    return None


def _retrieval_mode(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    """A mode of the registry (``retrieval/modes.py``), read when the config is checked so
    that a mode registered from outside before then is accepted. kclpy's own default is
    polling (API and CLI); Java's POLLING / FANOUT are the same names in another case."""
    try:
        retrieval_mode(str(config.retrieval_mode))
    except ConfigError as exc:
        hint = (" (DEFAULT, the Java daemon's rule, is resolved for .properties files only)"
                if str(config.retrieval_mode).upper() == "DEFAULT" else "")
        return f"{exc.message}{hint}"
    return None


def _lease_assignment(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    """A strategy of the registry (``leases/assignment.py``), read when the config is
    checked so that a strategy registered from outside before then is accepted."""
    try:
        assignment_strategy(str(config.lease_assignment))
    except ConfigError as exc:
        return exc.message
    return None


def _consumer_arn(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if config.consumer_arn and config.multi_stream:
        return (f"names the consumer of one stream; a multi-stream application registers "
                f"one per stream ({label('consumer_name')})")
    if config.consumer_arn and not re.match(r"^arn:aws[\w-]*:kinesis:.*/consumer/",
                                            config.consumer_arn):
        return f"{config.consumer_arn!r} is not a stream consumer ARN"
    return None


def _parsed_by(parse: Callable[[str], object], field_name: str) -> Rule:
    """The option's value is what ``parse`` accepts (its ValueError is the message)."""

    def rule(config: KCLConfig, label: Callable[[str], str]) -> str | None:
        try:
            parse(getattr(config, field_name))
        except ValueError as exc:
            return str(exc)
        return None

    return rule


def _lag_webhook(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    if config.lag_webhook is not None and config.metrics_port is None:
        return (f"needs {label('metrics_port')}: status changes come from the metrics "
                "endpoint's lag sampling")
    return None


def _state_store(config: KCLConfig, label: Callable[[str], str]) -> str | None:
    return None if config.state_store is None else _state_store_problem(config.state_store)


OPTIONS: tuple[Option, ...] = (
    _opt("stream_name", "str", "Kinesis stream to consume.", "streamName", rule=_stream_name),
    _opt("stream_arn", "str", "Stream ARN (instead of the name; cross-account).", "streamArn",
         rule=_stream_arn),
    _opt("application_name", "str", "Application name; default lease table name.",
         "applicationName", rule=_application_name),
    _opt("table_name", "str", "Lease table (default: the application name).", "tableName",
         "leaseTableName"),
    _opt("worker_id", "str", "This worker's id (default: host:pid:random).", "workerId"),
    _opt("region", "str", "AWS region (default: the boto3 chain).", "regionName",
         rule=_region),
    _opt("kinesis_endpoint", "url", "Kinesis endpoint URL (default: the boto3 chain).",
         "kinesisEndpoint"),
    _opt("dynamodb_endpoint", "url", "DynamoDB endpoint URL (default: the boto3 chain).",
         "dynamoDBEndpoint", "dynamodbEndpoint"),
    _opt("initial_position", "position", "Where a shard without checkpoint starts.",
         "initialPositionInStream", choices=INITIAL_POSITIONS),
    _opt("initial_timestamp", "timestamp",
         "Start time for AT_TIMESTAMP (ISO 8601 or epoch seconds).",
         "initialPositionInStreamExtended", "timestampAtInitialPositionInStream",
         rule=_initial_timestamp),
    _opt("failover_time_ms", "int", "A lease not renewed for this long may be taken.",
         "failoverTimeMillis"),
    _opt("max_records", "int", "GetRecords Limit (1..10000).", "maxRecords", most=10_000),
    _opt("idle_time_between_reads_ms", "int0",
         "Pause after an empty GetRecords on a caught-up shard.", "idleTimeBetweenReadsInMillis"),
    _opt("shard_sync_interval_ms", "int", "How often shards are listed and leases created.",
         "shardSyncIntervalMillis"),
    _opt("max_initialization_attempts", "int",
         "Start-up attempts (lease table, state store, streams, first shard sync) before the "
         "worker gives up.", "maxInitializationAttempts"),
    _opt("initialization_backoff_ms", "int0", "The wait between those start-up attempts.",
         "schedulerInitializationBackoffTimeMillis"),
    _opt("max_leases_for_worker", "int", "Most leases this worker holds (default: no limit).",
         "maxLeasesForWorker"),
    _opt("max_leases_to_steal_at_one_time", "int", "Leases stolen per balancing cycle.",
         "maxLeasesToStealAtOneTime"),
    _opt("parent_shard_poll_interval_ms", "int",
         "How often a child shard checks whether its parents are finished.",
         "parentShardPollIntervalMillis"),
    _opt("call_process_records_even_for_empty_record_list", "bool",
         "Call process_records with empty batches.", "callProcessRecordsEvenForEmptyRecordList"),
    _opt("cleanup_leases_upon_shard_completion", "bool",
         "Delete a finished parent's lease once its children have started.",
         "cleanupLeasesUponShardCompletion"),
    _opt("is_graceful_lease_handoff_enabled", "bool",
         "Steal with the Java KCL 3.x checkpointOwner handoff (the owner may checkpoint).",
         "isGracefulLeaseHandoffEnabled"),
    _opt("graceful_lease_handoff_timeout_ms", "int0",
         "How long a handed-off lease's owner may take before the thief takes it anyway.",
         "gracefulLeaseHandoffTimeoutMillis"),
    _opt("shutdown_grace_ms", "int0",
         "How long shutdown_requested may take before leases are released anyway.",
         "shutdownGraceMillis"),
    _opt("task_backoff_time_ms", "int", "First retry delay after a processor error.",
         "taskBackoffTimeMillis"),
    _opt("max_task_backoff_time_ms", "int", "Largest retry delay after processor errors.",
         "maxTaskBackoffTimeMillis",
         rule=_at_least_option("task_backoff_time_ms", "max_task_backoff_time_ms")),
    _opt("processor_error_policy", "policy",
         "What a process_records exception does: retry, skip, shutdown, or park (the shard "
         "is parked after processor_error_attempts failed attempts at one batch).",
         "processorErrorPolicy", choices=ERROR_POLICIES),
    _opt("processor_error_attempts", "int",
         "With processor_error_policy=park: failed attempts at one batch before the shard "
         "is parked.", "processorErrorAttempts"),
    _opt("fail_on_data_loss", "bool",
         "Park a shard whose checkpoint the stream's retention trimmed past, instead of "
         "logging the loss and reading on from the oldest record.", "failOnDataLoss"),
    _opt("prefetch_queue_size", "int",
         "Fetched batches buffered per shard (bounds memory).", "prefetchQueueSize"),
    # urllib3 fills a pool's queue to its size up front; no host has more ports than this
    _opt("max_pool_connections", "int", "botocore connection pool size (1..65535).",
         "maxPoolConnections", most=65535),
    _opt("stop_when_caught_up", "bool",
         "Shut down cleanly once every shard is caught up (drain and exit). In a fleet each "
         "worker stops once its own shards are drained and every other lease is seen "
         "renewed; the last one drains what the others released.", "stopWhenCaughtUp"),
    _opt("metrics_port", "port",
         "Serve /metrics, /healthz and /status on this port (default: off).", "metricsPort"),
    _opt("metrics_host", "str", "Address the metrics endpoint binds.", "metricsHost"),
    _opt("ops_allowed_hosts", "str",
         "Host names (comma-separated; * for any) the metrics endpoint answers besides its "
         "bind address, localhost and IP addresses; others get 421 (DNS rebinding).",
         "opsAllowedHosts"),
    _opt("lag_window_s", "int",
         "Window over which the metrics endpoint evaluates each shard's lag status.",
         "lagWindowSeconds"),
    _opt("lag_interval_s", "int",
         "How often the metrics endpoint samples each held shard's lag.",
         "lagIntervalSeconds"),
    _opt("lag_webhook", "url",
         "POST every lag status change to this http(s) URL as JSON (needs metrics_port).",
         "lagWebhook", secret=True, rule=_lag_webhook),
    _opt("executable_name", "str",
         "MultiLangDaemon child command (runs an amazon_kclpy application).", "executableName"),
    _opt("timeout_in_seconds", "int",
         "MultiLangDaemon: how long a child may take to answer one message.", "timeoutInSeconds"),
    _opt("stray_stdout", "stray",
         "MultiLangDaemon: a non-protocol line on a child's stdout restarts it, or is skipped.",
         "strayStdout", choices=STRAY_STDOUT_POLICIES),
    _opt("state_store", "str",
         "Exactly-once state: where a StatefulProcessor's state lives - a DynamoDB table name, "
         "or a SQLAlchemy database URL (sqlite:///state.db, postgresql+psycopg://...).",
         "stateStore", secret=True, rule=_state_store),
    _opt("retrieval_mode", "str",
         "How shards are read: polling (GetRecords) or fanout (enhanced fan-out, "
         "SubscribeToShard through a registered consumer).", "retrievalMode",
         rule=_retrieval_mode, rule_choices=retrieval_mode_names),
    _opt("consumer_name", "str",
         "Fan-out: the stream consumer to use or register (default: the application name).",
         "consumerName"),
    _opt("consumer_arn", "str",
         "Fan-out: an existing consumer's ARN; nothing is registered.", "consumerArn",
         rule=_consumer_arn),
    _opt("fanout_http_version", "str",
         "Fan-out: auto (HTTP/2 for https endpoints, HTTP/1.1 for http ones), 2 or 1.1.",
         "fanoutHttpVersion", choices=FANOUT_HTTP_VERSIONS),
    _opt("register_stream_consumer_retries", "int",
         "Fan-out: RegisterStreamConsumer attempts when throttled.",
         "registerStreamConsumerRetries"),
    _opt("max_describe_stream_consumer_retries", "int",
         "Fan-out: DescribeStreamConsumer attempts (throttling, and waiting for ACTIVE).",
         "maxDescribeStreamConsumerRetries"),
    _opt("retry_backoff_ms", "int",
         "Fan-out: the wait between those attempts.", "retryBackoffMillis"),
    _opt("get_records_backoff_base_ms", "int",
         "GetRecords and SubscribeToShard retries (throttles, 5xx, dropped connections): the "
         "first retry waits up to this, each further one up to twice as long.",
         "getRecordsBackoffBaseMillis"),
    _opt("get_records_backoff_cap_ms", "int",
         "The longest wait between those retries (at least the base).",
         "getRecordsBackoffCapMillis",
         rule=_at_least_option("get_records_backoff_base_ms", "get_records_backoff_cap_ms")),
    _opt("list_shards_backoff_base_ms", "int",
         "Shard sync: the first wait before a throttled ListShards is retried, doubling per "
         "retry (full jitter).", "listShardsBackoffTimeInMillis"),
    _opt("list_shards_backoff_cap_ms", "int",
         "Shard sync: the longest wait between ListShards retries (at least the base).",
         "listShardsBackoffCapMillis",
         rule=_at_least_option("list_shards_backoff_base_ms", "list_shards_backoff_cap_ms")),
    _opt("max_list_shards_retry_attempts", "int",
         "Shard sync: ListShards calls while throttled before the sync fails (it is tried "
         "again at the next interval).", "maxListShardsRetryAttempts"),
    _opt("metrics_level", "str",
         "CloudWatch: publish the Java KCL's metrics at this level.",
         "metricsLevel", rule=_parsed_by(parse_level, "metrics_level"),
         rule_choices=tuple(level.lower() for level in LEVELS)),
    _opt("metrics_enabled_dimensions", "str",
         "CloudWatch: dimensions to send (comma-separated, or ALL); Operation always is.",
         "metricsEnabledDimensions",
         rule=_parsed_by(parse_dimensions, "metrics_enabled_dimensions")),
    _opt("metrics_buffer_time_ms", "int",
         "CloudWatch: how long datapoints gather before a PutMetricData.",
         "metricsBufferTimeMillis"),
    _opt("metrics_max_queue_size", "int",
         "CloudWatch: distinct datums waiting at most; the oldest is dropped beyond it.",
         "metricsMaxQueueSize"),
    _opt("metrics_namespace", "str",
         "CloudWatch: the namespace (default: the application name, as the Java KCL).",
         "metricsNamespace"),
    _opt("cloudwatch_region", "str", "CloudWatch: region (default: --region).",
         "cloudWatchRegionName"),
    _opt("cloudwatch_endpoint", "url", "CloudWatch: endpoint URL (e.g. a local emulator).",
         "cloudWatchEndpoint"),
    _opt("transaction_max_records", "int",
         "Exactly-once state: records one transaction covers at most (it also ends with "
         "each batch).", "transactionMaxRecords"),
    _opt("transaction_max_time_ms", "int",
         "Exactly-once state: how long one transaction may stay open at most.",
         "transactionMaxTimeMillis"),
    _opt("max_lag_ms", "int",
         "Lag recovery: a shard starting further behind than this reads live from now minus "
         "this, and its gap is recovered separately (default: off).", "maxLagMillis"),
    _opt("recovery_max_rate", "int",
         "Lag recovery: records per second this worker's recovery reads take at most, shared "
         "fairly by its recovering shards.", "recoveryMaxRecordsPerSecond"),
    _opt("kpl_hash_range_filter", "bool",
         "Drop a KPL aggregate whose sub-records' hash keys fall outside the shard's range "
         "(the Java KCL's rule; loses aws-kinesis-agg aggregates, logged at WARNING); off, "
         "every sub-record is delivered.", "kplHashRangeFilter"),
    _opt("former_streams_lease_deletion_delay_ms", "int0",
         "Multi-stream: how long after a stream left the tracker (or was deleted) its leases "
         "are deleted.", "formerStreamsLeasesDeletionWaitMillis"),
)
#: lease assignment by load (kclpy.leases.load): the Java KCL 3.x keys with the same meaning
LOAD_OPTIONS: tuple[Option, ...] = (
    _opt("lease_assignment", "str",
         "How leases are spread: count (equal lease counts, the Java KCL 2.x rule) or load "
         "(equal measured load: CPU, else KB/s - as the Java KCL 3.x).", "leaseAssignment",
         rule=_lease_assignment, rule_choices=assignment_strategy_names),
    _opt("lease_assigner", "str",
         "Who assigns leases: worker (every worker scans the lease table and takes for "
         "itself, the Java KCL 2.x way) or leader (one elected worker scans and assigns, by "
         "count or load; the others find their leases through the lease table's owner "
         "index - the Java KCL 3.x way).", "leaseAssigner", choices=LEASE_ASSIGNERS),
    _opt("rebalance_threshold_percentage", "int0",
         "Load assignment: a worker more than this percentage above the fleet's average "
         "load gives leases to workers below it.", "reBalanceThresholdPercentage"),
    _opt("dampening_percentage", "int",
         "Load assignment: the percentage (1-100) of a worker's excess load moved per "
         "balancing round.", "dampeningPercentage", most=100),
    _opt("allow_throughput_overshoot", "bool",
         "Load assignment: when no lease fits a worker's share, take the smallest one "
         "whose move still lowers the busier worker.", "allowThroughputOvershoot"),
    _opt("max_throughput_per_host_kbps", "int",
         "Load assignment: KB/s beyond which a worker takes no more load from others "
         "(default: no cap).", "maxThroughputPerHostKBps"),
    _opt("variance_balancing_frequency", "int",
         "Load assignment: a worker balances load every this many x 2 x failover time.",
         "varianceBalancingFrequency"),
    _opt("worker_metrics_ema_alpha", "fraction",
         "Load assignment: weight (0-1] of the newest load sample in its moving average.",
         "workerMetricsEMAAlpha"),
    _opt("worker_metrics_reporter_freq_ms", "int",
         "Load assignment: how often a worker samples and publishes its load.",
         "workerMetricsReporterFreqInMillis"),
)
OPTIONS = OPTIONS + LOAD_OPTIONS
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}
OPTIONS_BY_KEY = {k.lower(): o for o in OPTIONS for k in o.properties_keys}
#: every properties key as written in the reference, for a misspelt key's suggestion
_PROPERTIES_KEYS = tuple(k for o in OPTIONS for k in o.properties_keys)

#: Keys of the Java MultiLangDaemon that mean nothing without a JVM: accepted, logged once.
_CREDENTIALS = "credentials come from the standard boto3 chain"
_POLLING = ("kclpy polls each shard on a fetch thread of its own and retries GetRecords with "
            "its own capped backoff")
_LEASES = "kclpy's lease coordinator does not use this tuning knob"
_KCL3 = "a KCL 3.x feature kclpy does not implement; the KCL 2.x lease protocol is used"
_ONE_REGION = "kclpy uses one region (regionName) for every client"

#: Keys of the Java MultiLangDaemon that mean nothing without a JVM: accepted, logged once.
#: Matched case-insensitively, as the Java daemon does.
JAVA_ONLY_KEYS: Mapping[str, str] = {
    "dynamoDBRegionName": _ONE_REGION,
    "processingLanguage": "no JVM is involved",
    "javaClassPath": "no JVM is involved",
    "maxActiveThreads": "kclpy runs one fetch and one delivery thread per held shard",
    "validateSequenceNumberBeforeCheckpointing": "kclpy always validates checkpoints locally",
    "userAgentAdditionalInfo": "not sent",
    "retryGetRecordsInSeconds": _POLLING,
    "maxGetRecordsThreadPool": _POLLING,
    "maxDescribeStreamSummaryRetries": "kclpy bounds DescribeStreamSummary by "
                                       "maxDescribeStreamConsumerRetries too",
    "billingMode": "the lease table is created PAY_PER_REQUEST",
    "initialLeaseTableReadCapacity": "the lease table is created PAY_PER_REQUEST",
    "initialLeaseTableWriteCapacity": "the lease table is created PAY_PER_REQUEST",
    "maxLeaseRenewalThreads": _LEASES,
    "shardPrioritization": _LEASES,
    "skipShardSyncAtWorkerInitializationIfLeasesExist": "kclpy always syncs at start-up",
    "skipShardSyncAtStartupIfLeasesExist": "kclpy always syncs at start-up",
    "logWarningForTaskAfterMillis": _LEASES,
    "ignoreUnexpectedChildShards": _LEASES,
    "enablePriorityLeaseAssignment": _LEASES,
    "logMetricsInterval": "the Java log metrics factory: kclpy publishes to CloudWatch or "
                          "Prometheus",
    "workerStateChangeListener": "no JVM is involved",
    "clientVersionConfig": _KCL3,
    "leaseAssignmentIntervalMillis": _KCL3,
    **{f"coordinatorState{k}": _KCL3 for k in (
        "TableName", "BillingMode", "ReadCapacity", "WriteCapacity",
        "PointInTimeRecoveryEnabled", "DeletionProtectionEnabled", "Tags")},
    **{f"workerMetrics{k}": _KCL3 for k in (
        "TableName", "BillingMode", "ReadCapacity", "WriteCapacity",
        "PointInTimeRecoveryEnabled", "DeletionProtectionEnabled", "Tags")},
    **{k: _KCL3 for k in (
        "inMemoryWorkerMetricsCaptureFrequencyMillis",
        "noOfPersistedMetricsPerWorkerMetrics", "disableWorkerMetrics",
        "staleWorkerMetricsEntryCleanupDuration")},
}
#: Key prefixes of the same kind: credential providers and SDK client builder settings.
JAVA_ONLY_PREFIXES: Mapping[str, str] = {
    "awscredentialsprovider": _CREDENTIALS,
    "kinesisclient.": "configure the Kinesis client through the boto3 chain",
    "dynamodbclient.": "configure the DynamoDB client through the boto3 chain",
    "cloudwatchclient.": "configure the CloudWatch client through the boto3 chain "
                         "(cloudWatchRegionName, cloudWatchEndpoint)",
}
_JAVA_ONLY_LOWER = {k.lower(): v for k, v in JAVA_ONLY_KEYS.items()}


def java_only_reason(key: str) -> str | None:
    """Why a Java-only key is ignored, or None when it is not one."""
    low = key.lower()
    if low in _JAVA_ONLY_LOWER:
        return _JAVA_ONLY_LOWER[low]
    for prefix, reason in JAVA_ONLY_PREFIXES.items():
        if low.startswith(prefix):
            return reason
    return None



# -- value conversion -----------------------------------------------------------------------

_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def parse_timestamp(text: str) -> datetime:
    """ISO 8601 (naive means UTC) or epoch seconds, as the Java daemon's timestamp key."""
    try:
        return datetime.fromtimestamp(float(text), tz=timezone.utc)
    except ValueError:
        pass
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _convert(option: Option, raw: Any, label: str) -> Any:
    if raw is None or isinstance(raw, (int, datetime)):
        return raw
    text = str(raw).strip()
    kind = option.kind
    try:
        if kind in ("int", "int0", "port"):
            return int(text)
        if kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if kind == "timestamp":
            return parse_timestamp(text)
        if kind == "fraction":
            return float(text)
    except ValueError:
        raise ConfigError(label, f"{text!r} is not a valid {_KIND_WORDS[kind]}") from None
    if kind == "position":
        return text.upper()
    return text


_KIND_WORDS = {"int": "whole number", "int0": "whole number", "port": "port number",
               "bool": "boolean (true/false)",
               "timestamp": "timestamp (ISO 8601 or epoch seconds)",
               "fraction": "number"}


# -- validation -----------------------------------------------------------------------------


def validate(config: KCLConfig, labels: Mapping[str, str], *, keywords: bool = False) -> None:
    """Raise ConfigError naming the first bad option, under the name the user used: its
    label (flag, properties key, environment variable) when given, else the keyword for a
    config built in Python (``keywords``) and the flag for one built by the CLI. Every rule
    is the option's own (``OPTIONS``); the streams given together are checked last."""

    def name(field_name: str) -> str:
        if field_name in labels:
            return labels[field_name]
        return field_name if keywords else OPTIONS_BY_NAME[field_name].flag

    for option in OPTIONS:
        problem = option.problem(config, name)
        if problem is not None:
            raise ConfigError(name(option.name), problem)
    if _several_streams(config):
        _validate_streams(config)


#: DynamoDB's rule for a table name
_TABLE_NAME = re.compile(r"^[A-Za-z0-9_.-]{3,255}$")
#: a SQLAlchemy URL: ``dialect[+driver]://...``
_DATABASE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+]*://")


def _state_store_problem(value: str) -> str | None:
    """A state store is a DynamoDB table name or a database URL; anything else (a URL with
    one slash too few, say) would otherwise be taken for a table name."""
    if _DATABASE_URL.match(value) or _TABLE_NAME.match(value):
        return None
    hint = ""
    if re.match(r"^[A-Za-z][A-Za-z0-9+]*:", value):
        scheme = value.split(":", 1)[0]
        hint = f" (a database URL starts with {scheme}://, e.g. sqlite:///state.db)"
    return (f"{_without_userinfo(value)!r} is neither a DynamoDB table name (3-255 of A-Z a-z "
            f"0-9 _ . -) nor a database URL{hint}")


def _without_userinfo(value: str) -> str:
    """``value`` as it may be echoed: a malformed URL may still hold a password, before its
    last ``@``, so everything between the scheme and that ``@`` is masked."""
    if "@" not in value:
        return value
    head, _, host = value.rpartition("@")
    scheme = re.match(r"^[A-Za-z][A-Za-z0-9+]*:/*", head)
    return f"{scheme.group() if scheme else ''}***@{host}"


def _validate_streams(config: KCLConfig) -> None:
    if config.stream_tracker is not None:
        if config.streams:
            raise ConfigError("stream_tracker", "give streams or a tracker, not both")
        if not isinstance(config.stream_tracker, StreamTracker):
            raise ConfigError("stream_tracker", "must have a stream_configs() method")
        return
    seen: set[str] = set()
    for stream in config.streams:
        if not isinstance(stream, StreamConfig):
            raise ConfigError("--stream-name", f"{stream!r} is not a kclpy.StreamConfig")
        if stream.label in seen:
            raise ConfigError("--stream-name", f"stream {stream.label} is given twice")
        seen.add(stream.label)


# -- loaders --------------------------------------------------------------------------------


def read_properties(path: Path) -> dict[str, str]:
    """Java .properties: ``key = value`` or ``key: value``, ``#``/``!`` comments,
    backslash continuation lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--properties", f"cannot read {path}: {exc.strerror}") from None
    result: dict[str, str] = {}
    pending = ""
    for raw_line in text.splitlines():
        line = pending + raw_line.strip()
        pending = ""
        if not line or line[0] in "#!":
            continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = line[:-1]
            continue
        match = re.match(r"^([^=:\s]+)\s*[=:\s]\s*(.*)$", line)
        if match is None:
            result[line] = ""
            continue
        result[match.group(1)] = match.group(2)
    return result


def from_properties(properties: Mapping[str, str], *, base_dir: Path | None = None,
                    warn: Callable[[str], None] | None = None,
                    retrieval_mode_set: bool = False) -> tuple[dict[str, Any],
                                                               dict[str, str]]:
    """Values and labels (field -> key as written) from MultiLangDaemon properties.

    Java-only keys are accepted with one log line saying how kclpy treats them; unknown keys
    are warned about once each. ``retrieval_mode_set``: a flag or the environment sets the
    retrieval mode, so the Java daemon's default for a file without ``retrievalMode`` (and
    its warning) does not apply.
    """
    say = warn or log.warning
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for key, raw in properties.items():
        option = OPTIONS_BY_KEY.get(key.lower())
        reason = java_only_reason(key)
        if option is None and reason is not None:
            log.info("properties key %s is accepted and ignored: %s", key, reason)
            continue
        if option is None:
            close = closest(key, _PROPERTIES_KEYS, ignore_case=True)
            say(f"unknown properties key {key!r} ignored"
                + (f" (did you mean {close!r}?)" if close else ""))
            continue
        if option.name == "initial_timestamp":
            if raw.strip().upper() in INITIAL_POSITIONS:
                values.setdefault("initial_position", raw.strip().upper())
                continue
            # The Java daemon's initialPositionInStreamExtended is a timestamp and means
            # AT_TIMESTAMP by itself.
            values["initial_position"] = AT_TIMESTAMP
            labels.setdefault("initial_position", key)
        values[option.name] = _convert(option, raw, key)
        labels[option.name] = key
    if not retrieval_mode_set:
        _java_default_retrieval(properties, values, labels)
    elif str(values.get("retrieval_mode", "")).upper() == "DEFAULT":
        # "whatever the default is": the mode set elsewhere is the more specific choice
        del values["retrieval_mode"]
        labels.pop("retrieval_mode", None)
    if base_dir is not None:
        values["properties_dir"] = base_dir
    return values, labels


#: the Java daemon's PollingConfigBean keys: any of them set makes DEFAULT mean polling
_POLLING_ONLY_KEYS = frozenset(k.lower() for k in (
    "retryGetRecordsInSeconds", "maxGetRecordsThreadPool", "idleTimeBetweenReadsInMillis",
    "millisBehindLatestThresholdForReducedTps", "maxRecords"))


def _java_default_retrieval(properties: Mapping[str, str], values: dict[str, Any],
                            labels: dict[str, str]) -> None:
    """``retrievalMode`` absent or ``DEFAULT`` means what the Java MultiLangDaemon makes of
    it: enhanced fan-out, unless a polling-only key is set (then polling, with the Java
    daemon's warning). kclpy's own default (API, flags) stays polling."""
    mode = values.get("retrieval_mode")
    if mode is not None and str(mode).upper() != "DEFAULT":
        return
    polling = sorted(k for k in properties if k.lower() in _POLLING_ONLY_KEYS)
    if polling:
        log.warning("polling properties are set (%s): reading with polling; add "
                    "retrievalMode = FANOUT to read with enhanced fan-out, as the Java "
                    "daemon's DEFAULT rule does", ", ".join(polling))
        values["retrieval_mode"] = "polling"
    else:
        # a WARNING: enhanced fan-out is billed per consumer-shard hour, and the user wrote
        # nothing that asked for it
        log.warning("retrievalMode not set: reading with enhanced fan-out (billed per "
                    "consumer-shard hour), as the Java MultiLangDaemon does; set "
                    "retrievalMode = POLLING to poll")
        values["retrieval_mode"] = "fanout"
    labels.setdefault("retrieval_mode", "retrievalMode")


def build_config(values: Mapping[str, Any], labels: Mapping[str, str]) -> KCLConfig:
    """Make a KCLConfig from loader output; errors name the option as the user wrote it."""
    known = {f.name for f in dataclasses.fields(KCLConfig)}
    kwargs = {k: v for k, v in values.items() if k in known and v is not None}
    kwargs.setdefault("application_name", "")
    config = object.__new__(KCLConfig)
    defaults = KCLConfig.__dataclass_fields__
    for name, spec in defaults.items():
        if name in kwargs:
            setattr(config, name, kwargs[name])
        elif spec.default is not dataclasses.MISSING:
            setattr(config, name, spec.default)
        elif spec.default_factory is not dataclasses.MISSING:
            setattr(config, name, spec.default_factory())
    validate(config, labels)
    return config


def convert_cli_value(name: str, raw: Any) -> Any:
    option = OPTIONS_BY_NAME[name]
    return _convert(option, raw, option.flag)


def from_environment(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any],
                                                                        dict[str, str]]:
    """``KCLPY_<OPTION>`` variables, e.g. ``KCLPY_STREAM_NAME``, below properties and flags."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for option in OPTIONS:
        var = environment_variable(option)
        if var in env:
            values[option.name] = _convert(option, env[var], var)
            labels[option.name] = var
    known = [*(environment_variable(option) for option in OPTIONS), *OTHER_VARIABLES]
    for var in sorted(env):
        if var.startswith(_PREFIX) and var not in known:
            close = closest(var, known)
            log.warning("environment variable %s is not a kclpy setting and is ignored%s",
                        var, f" (did you mean {close}?)" if close else "")
    return values, labels


_PREFIX = "KCLPY_"
#: set by ``--processes N`` in each worker process it starts (kclpy.supervisor)
SUPERVISED = "KCLPY_WORKER_PROCESS"
#: ``KCLPY_*`` variables kclpy reads that are not options, so never warned about
OTHER_VARIABLES = ("KCLPY_CACHE_DIR", SUPERVISED)


def environment_variable(option: Option) -> str:
    """The variable that sets ``option``: ``KCLPY_`` and its keyword in capitals."""
    return _PREFIX + option.name.upper()
