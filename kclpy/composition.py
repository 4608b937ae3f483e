"""A worker's parts, built from its config: the one place that turns options into objects.

The Worker runs the loop (consumers started and retired, shard sync, shutdown); what it runs
is built here: the AWS clients, the CloudWatch publisher, the lease table, load balancing and
the leader, the streams, the lease coordinator, the exactly-once state store, and for every
held lease the readers of its shard (the retrieval mode's live source, lag recovery's reads,
Kinesis' clock). A retrieval mode or a store is looked up here in its registry, and a
metrics backend added here: none of them changes the loop.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import boto3
import botocore.config
from botocore.exceptions import InvalidRegionError, NoRegionError

from kclpy.cloudwatch import (
    NONE,
    CloudWatchBackend,
    CloudWatchPublisher,
    parse_dimensions,
    parse_level,
)
from kclpy.config import KCLConfig
from kclpy.consumer import ConsumerSettings, FetcherLike
from kclpy.errors import ConfigError, KCLError
from kclpy.leases.assignment import assignment_strategy
from kclpy.leases.coordinator import CoordinatorSettings, LeaseAssignment, LeaseCoordinator
from kclpy.leases.leader import LeaderLock, LeaderMode
from kclpy.leases.lease import Lease
from kclpy.leases.load import LoadBalancing, load_balancing
from kclpy.leases.streams import ActiveStream, StreamSet
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.processor import IRecordProcessor
from kclpy.records import Record
from kclpy.recovery.detect import first_record
from kclpy.recovery.rate import RecoveryRate
from kclpy.recovery.shard import ShardRecovery
from kclpy.retrieval.clock import kinesis_clock
from kclpy.retrieval.modes import POLLING, RetrievalContext, retrieval_mode
from kclpy.retrieval.pipeline import Batching, ShardPipeline
from kclpy.retrieval.polling import Pacer
from kclpy.retrieval.registration import ConsumerRegistration, RegistrationSettings
from kclpy.retrieval.source import PageSource, ShardAddress, reading_start
from kclpy.retry import Backoff
from kclpy.state import open_store
from kclpy.state.processor import StatefulProcessor, exactly_once_factory
from kclpy.state.store import StateStore
from kclpy.streams import StreamConfig

log = logging.getLogger(__name__)


def consumer_settings(config: KCLConfig) -> ConsumerSettings:
    """The options every shard consumer of the worker shares, as plain values."""
    return ConsumerSettings(
        parent_shard_poll_interval_s=config.parent_shard_poll_interval_ms / 1000,
        task_backoff_s=config.task_backoff_time_ms / 1000,
        max_task_backoff_s=config.max_task_backoff_time_ms / 1000,
        processor_error_policy=config.processor_error_policy,
        processor_error_attempts=config.processor_error_attempts,
        fail_on_data_loss=config.fail_on_data_loss,
        call_process_records_even_for_empty_record_list=(
            config.call_process_records_even_for_empty_record_list),
    )


def coordinator_settings(config: KCLConfig) -> CoordinatorSettings:
    """The lease coordinator's options, as plain values (the threads' pacing keeps its
    defaults: no option sets it)."""
    return CoordinatorSettings(
        failover_time_s=config.failover_time_ms / 1000,
        max_leases_for_worker=config.max_leases_for_worker,
        max_leases_to_steal_at_one_time=config.max_leases_to_steal_at_one_time,
        graceful_handoff=config.is_graceful_lease_handoff_enabled,
        graceful_handoff_timeout_s=config.graceful_lease_handoff_timeout_ms / 1000,
        cleanup_leases=config.cleanup_leases_upon_shard_completion,
    )


def record_processors(
    config: KCLConfig,
    processor_factory: Callable[[], IRecordProcessor] | Callable[[], StatefulProcessor],
    state_store: StateStore | None,
    metrics: Metrics,
) -> tuple[StateStore | None, Callable[[], IRecordProcessor]]:
    """The state store (the one given, else the one ``state_store`` names) and what makes
    each shard's record processor: the user's factory, or with a store its
    StatefulProcessors wrapped for exactly-once state."""
    if state_store is None and config.state_store:
        state_store = open_store(config.state_store)
    if state_store is None:
        return None, cast("Callable[[], IRecordProcessor]", processor_factory)
    return state_store, exactly_once_factory(
        processor_factory, state_store, max_records=config.transaction_max_records,
        max_seconds=config.transaction_max_time_ms / 1000, metrics=metrics)


@dataclass
class WorkerParts:
    """What one run of a worker is made of, built together by ``build_parts``."""

    kinesis: Any
    dynamodb: Any
    lease_table: LeaseTable
    #: load reports and balancing, with ``--lease-assignment load`` (or a leader)
    load: LoadBalancing | None
    #: the streams consumed now, each with its shard sync (kclpy.leases.streams)
    streams: StreamSet
    coordinator: LeaseCoordinator
    #: each held lease's readers
    retrieval: Retrieval
    cloudwatch: CloudWatchPublisher | None

    def close(self, worker_id: str) -> None:
        """Once the leases are released: the load report withdrawn (no leader plans with a
        stopped worker) and the last CloudWatch datums sent."""
        if self.load is not None:
            self.load.table.withdraw(worker_id)
        if self.cloudwatch is not None:
            self.cloudwatch.stop()


def build_parts(config: KCLConfig, metrics: Metrics, session: boto3.session.Session | None,
                state_store: StateStore | None) -> WorkerParts:
    """Every part of a worker, nothing started but CloudWatch's publisher (stopped again
    when a later part cannot be built). Raises ConfigError for a region boto3 cannot use."""
    session = session or boto3.session.Session(region_name=config.region)
    kinesis, dynamodb = _clients(config, session)
    cloudwatch = _start_cloudwatch(config, session, metrics)
    try:
        lease_table = LeaseTable(dynamodb, config.lease_table_name, metrics=metrics)
        load = load_balancing(config, dynamodb, metrics)
        leader: LeaderMode | None = None
        if config.lease_assigner == "leader":
            assert load is not None
            leader = LeaderMode(
                LeaderLock(load.table, config.worker_id,
                           failover_time_s=config.failover_time_ms / 1000,
                           clock=time.monotonic),
                load)
        assignment = LeaseAssignment(
            assignment_strategy(config.lease_assignment), load, leader)
        register = functools.partial(_register_consumer, config, kinesis)
        streams = StreamSet(kinesis, lease_table, config, metrics,
                            register=register if config.fan_out else None)
        coordinator = LeaseCoordinator(
            lease_table, config.worker_id, coordinator_settings(config), metrics=metrics,
            assignment=assignment)
        coordinator.set_consumable(lambda key: streams.for_lease_key(key) is not None)
    except BaseException:
        if cloudwatch is not None:
            cloudwatch.stop()
        raise
    retrieval = Retrieval(config, kinesis, streams, coordinator, metrics, state_store)
    return WorkerParts(kinesis, dynamodb, lease_table, load, streams, coordinator, retrieval,
                       cloudwatch)


def _clients(config: KCLConfig, session: boto3.session.Session) -> tuple[Any, Any]:
    # Retrieval and shard sync retry with their own capped, jittered backoff and count
    # every throttle; a second retry layer in botocore would hide them and multiply waits.
    kinesis_cfg = botocore.config.Config(
        max_pool_connections=config.max_pool_connections,
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=10, read_timeout=30)
    dynamodb_cfg = botocore.config.Config(
        max_pool_connections=config.max_pool_connections,
        retries={"mode": "standard", "total_max_attempts": 3},
        connect_timeout=10, read_timeout=30)
    try:
        kinesis = session.client(
            "kinesis", endpoint_url=config.kinesis_endpoint, config=kinesis_cfg)
        dynamodb = session.client(
            "dynamodb", endpoint_url=config.dynamodb_endpoint, config=dynamodb_cfg)
    except NoRegionError:
        raise ConfigError("--region", "no region configured (set --region, "
                          "regionName or AWS_DEFAULT_REGION)") from None
    except InvalidRegionError as exc:
        raise ConfigError("--region", str(exc)) from None
    return kinesis, dynamodb


def _start_cloudwatch(config: KCLConfig, session: boto3.session.Session,
                      metrics: Metrics) -> CloudWatchPublisher | None:
    """The Java KCL's CloudWatch metrics, when ``metrics_level`` asks for them: a backend
    added before any part binds its metrics."""
    level = parse_level(config.metrics_level)
    if level == NONE:
        return None
    client = session.client(
        "cloudwatch", region_name=config.cloudwatch_region or config.region,
        endpoint_url=config.cloudwatch_endpoint,
        config=botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 1},
                                      connect_timeout=10, read_timeout=30))
    publisher = CloudWatchPublisher(
        client, config.metrics_namespace or config.application_name, level=level,
        enabled_dimensions=parse_dimensions(config.metrics_enabled_dimensions),
        buffer_time_s=config.metrics_buffer_time_ms / 1000,
        max_queue_size=config.metrics_max_queue_size, on_event=metrics.cloudwatch_event)
    publisher.start()
    metrics.add_backend(CloudWatchBackend(publisher, config.worker_id, level))
    return publisher


def _register_consumer(config: KCLConfig, kinesis: Any, stream: StreamConfig,
                       stream_arn: str) -> str:
    """Enhanced fan-out: the application's consumer of the stream, registered if missing
    (one per stream; ``consumer_arn`` names an existing one of a single stream)."""
    arn = config.consumer_arn or ConsumerRegistration(
        kinesis, config.consumer_name or config.application_name, stream_arn=stream_arn,
        settings=RegistrationSettings(
            register_retries=config.register_stream_consumer_retries,
            describe_retries=config.max_describe_stream_consumer_retries,
            backoff_s=config.retry_backoff_ms / 1000)).get_or_create()
    log.info("worker %s reads %s with enhanced fan-out through %s", config.worker_id,
             stream.label, arn)
    return arn


class Retrieval:
    """How this worker reads its shards: the live reader of the retrieval mode (looked up
    in ``retrieval/modes.py``'s registry), and lag recovery's polling readers (probes and
    bounded, paced gap reads), over one pipeline."""

    def __init__(self, config: KCLConfig, kinesis: Any, streams: StreamSet,
                 coordinator: LeaseCoordinator, metrics: Metrics,
                 state_store: StateStore | None) -> None:
        self._config = config
        self._kinesis = kinesis
        self._streams = streams
        self._coordinator = coordinator
        self._metrics = metrics
        self._state_store = state_store
        #: lag recovery: the records per second all recovery reads of this worker share
        self._recovery_rate = RecoveryRate(config.recovery_max_rate)
        #: the one read policy of the worker's live and recovery reads; each source gets a
        #: backoff of it, its own attempt count
        self._read_retries = config.read_retries

    def readers(self, lease: Lease, token: str) -> ShardReading:
        """The readers of one tenure of ``lease`` (``kclpy.consumer.ShardReaders``)."""
        return ShardReading(self, lease, token)

    def stream(self, lease: Lease) -> ActiveStream:
        stream = self._streams.for_lease(lease)
        if stream is None:
            raise KCLError(f"lease {lease.lease_key} is of a stream this worker does not consume")
        return stream

    def initial_timestamp(self, lease: Lease) -> datetime | None:
        """Where an ``AT_TIMESTAMP`` lease of this stream starts: its own, else the worker's."""
        return self.stream(lease).config.initial_timestamp or self._config.initial_timestamp

    def live(self, lease: Lease, checkpoint: Position) -> FetcherLike:
        """The shard's live reader: a pipeline fed by the retrieval mode's page source."""
        start = reading_start(checkpoint, self.initial_timestamp(lease))
        cfg = self._config
        mode = retrieval_mode(cfg.retrieval_mode)
        consumer_arn = self.stream(lease).consumer_arn
        if mode.needs_consumer:
            assert consumer_arn is not None, "such streams are opened with their consumer"
        source = mode.source(RetrievalContext(
            self._kinesis, self._address(lease), self._metrics, self._read_backoff(),
            consumer_arn=consumer_arn, max_records=cfg.max_records,
            idle_time_s=cfg.idle_time_between_reads_ms / 1000,
            shard_end_probe_s=cfg.shard_sync_interval_ms / 1000,
            http_version=cfg.fanout_http_version))
        return self._pipeline(lease, source, start, live=True)

    def reader(self, lease: Lease, start: Position, *, until_ms: int | None = None,
               pacer: Pacer | None = None, max_records: int | None = None) -> ShardPipeline:
        """One of lag recovery's readers of the shard (a probe, or a gap's bounded, paced
        read): always polling, whatever the retrieval mode."""
        cfg = self._config
        source = POLLING.source(RetrievalContext(
            self._kinesis, self._address(lease), self._metrics, self._read_backoff(),
            max_records=max_records or cfg.max_records,
            idle_time_s=cfg.idle_time_between_reads_ms / 1000, until_ms=until_ms,
            pacer=pacer))
        return self._pipeline(lease, source, start, live=False)

    def oldest_record(self, lease: Lease) -> Record | None:
        """The shard's oldest record now: a checkpoint before it was trimmed past."""
        return first_record(self.reader(lease, Position.trim_horizon(), max_records=1))

    def recovery(self, lease: Lease, token: str) -> ShardRecovery:
        """Always, even with max_lag_ms off: gaps already queued are recovered, and an
        operator may queue one at any time (``kclpy recovery add``)."""

        def reader(start: Position, until_ms: int | None, pacer: Pacer | None,
                   max_records: int | None) -> ShardPipeline:
            return self.reader(lease, start, until_ms=until_ms, pacer=pacer,
                               max_records=max_records)

        store, fence = self._state_store, self._coordinator.fence
        return ShardRecovery(
            lease, token=token, fence=fence,
            reader_factory=reader, rate=self._recovery_rate,
            max_lag_ms=self._config.max_lag_ms, metrics=self._metrics,
            kinesis_clock=kinesis_clock(self._kinesis), store=store)

    def now(self) -> float:
        """Kinesis' now, where a ``LATEST`` lease starts."""
        return kinesis_clock(self._kinesis).planned_now()

    def _address(self, lease: Lease) -> ShardAddress:
        stream = self.stream(lease)
        return ShardAddress(lease.shard_id, None if stream.config.arn else stream.label,
                            stream.config.arn, stream.identifier)

    def _pipeline(self, lease: Lease, source: PageSource, start: Position, *,
                  live: bool) -> ShardPipeline:
        cfg = self._config
        hash_range = None
        if lease.starting_hash_key is not None and lease.ending_hash_key is not None:
            hash_range = (int(lease.starting_hash_key), int(lease.ending_hash_key))
        batching = Batching(
            hash_range=hash_range, filter_outside_hash_range=cfg.kpl_hash_range_filter,
            deliver_empty=cfg.call_process_records_even_for_empty_record_list and live)
        return ShardPipeline(
            source, start, queue_size=cfg.prefetch_queue_size, batching=batching,
            gate=self._coordinator.retrieval_gate, metrics=self._metrics)

    def _read_backoff(self) -> Backoff:
        """Each source's own backoff for GetRecords, iterators and subscriptions."""
        return self._read_retries.backoff()


class ShardReading:
    """``kclpy.consumer.ShardReaders`` for one tenure of a lease."""

    def __init__(self, retrieval: Retrieval, lease: Lease, token: str) -> None:
        self._retrieval = retrieval
        self._lease = lease
        self._token = token
        self.initial_timestamp = retrieval.initial_timestamp(lease)

    def live(self, start: Position) -> FetcherLike:
        return self._retrieval.live(self._lease, start)

    def recovery(self) -> ShardRecovery:
        return self._retrieval.recovery(self._lease, self._token)

    def oldest_record(self) -> Record | None:
        return self._retrieval.oldest_record(self._lease)

    def now(self) -> float:
        return self._retrieval.now()
