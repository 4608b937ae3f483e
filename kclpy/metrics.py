"""Prometheus collectors, one registry per worker, and the sink of the Java KCL's CloudWatch
metrics (``kclpy/cloudwatch.py``), which the same call sites feed.

One registry per worker (not the global default) so that several workers in one process —
tests, or an application that consumes two streams — never mix their figures. Every name is
prefixed ``kclpy_``; names and labels are documented in docs/operations.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kclpy.cloudwatch import MetricsSink, NullSink

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """All collectors of one worker. Pass ``Metrics()`` around; read ``.registry`` to serve."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # processing
        self.records_processed = Counter(
            "kclpy_records_processed", "User records handed to the processor and returned from it.",
            ["shard_id"], registry=r)
        self.bytes_processed = Counter(
            "kclpy_bytes_processed", "Payload bytes of the records processed.",
            ["shard_id"], registry=r)
        self.millis_behind_latest = Gauge(
            "kclpy_millis_behind_latest", "MillisBehindLatest of the last GetRecords per shard.",
            ["shard_id"], registry=r)
        self.process_records_seconds = Histogram(
            "kclpy_process_records_seconds", "Time spent in the processor's process_records.",
            ["shard_id"], buckets=_LATENCY_BUCKETS, registry=r)
        self.processor_errors = Counter(
            "kclpy_processor_errors", "Exceptions raised by processor callbacks.",
            ["shard_id", "callback"], registry=r)
        # retrieval
        self.get_records_seconds = Histogram(
            "kclpy_get_records_seconds", "GetRecords call latency, successes and failures.",
            ["shard_id"], buckets=_LATENCY_BUCKETS, registry=r)
        self.get_records_errors = Counter(
            "kclpy_get_records_errors", "Failed GetRecords/GetShardIterator calls by kind.",
            ["shard_id", "kind"], registry=r)
        self.throttles = Counter(
            "kclpy_throttles", "Throttling responses (Kinesis and DynamoDB) by operation.",
            ["operation"], registry=r)
        self.iterator_expirations = Counter(
            "kclpy_iterator_expirations", "ExpiredIteratorException answers, each re-positioned.",
            ["shard_id"], registry=r)
        self.deaggregation_errors = Counter(
            "kclpy_deaggregation_errors",
            "KPL aggregates that failed their MD5 or did not decode; each was delivered raw.",
            ["shard_id"], registry=r)
        self.records_filtered = Counter(
            "kclpy_records_filtered",
            "KPL sub-records dropped because their explicit hash key is outside the shard.",
            ["shard_id"], registry=r)
        self.prefetch_queue_depth = Gauge(
            "kclpy_prefetch_queue_depth", "Fetched batches waiting for the processor.",
            ["shard_id"], registry=r)
        # checkpoints
        self.checkpoints = Counter(
            "kclpy_checkpoints", "Checkpoints written.", ["shard_id"], registry=r)
        self.checkpoint_failures = Counter(
            "kclpy_checkpoint_failures", "Checkpoint attempts that failed, by exception name.",
            ["shard_id", "kind"], registry=r)
        # leases
        self.leases_held = Gauge(
            "kclpy_leases_held", "Leases this worker holds now.", registry=r)
        self.leases_taken = Counter(
            "kclpy_leases_taken", "Leases taken (unowned or expired).", registry=r)
        self.leases_stolen = Counter(
            "kclpy_leases_stolen", "Leases taken from a live worker to balance load.", registry=r)
        self.leases_lost = Counter(
            "kclpy_leases_lost", "Leases lost to another worker or to a failed renewal.",
            registry=r)
        self.leases_expired = Counter(
            "kclpy_leases_expired",
            "Leases given up because no write of them succeeded within the failover time "
            "(a subset of kclpy_leases_lost).", registry=r)
        self.shards_unconsumed = Gauge(
            "kclpy_shards_held_unconsumed",
            "Leases held with no running consumer; /healthz fails once one lasts longer "
            "than the failover time.", registry=r)
        self.lease_renew_failures = Counter(
            "kclpy_lease_renew_failures", "Renewals that failed (condition or error).", registry=r)
        self.lease_renewals = Counter(
            "kclpy_lease_renewals", "Successful lease renewals.", registry=r)
        self.initialization_failures = Counter(
            "kclpy_initialization_failures",
            "Start-up attempts that failed, by exception name.",
            ["kind"], registry=r)
        self.retrieval_pauses = Counter(
            "kclpy_retrieval_pauses",
            "Times fetching and delivery paused because lease renewal ran late.", registry=r)
        self.retrieval_paused = Gauge(
            "kclpy_retrieval_paused",
            "1 while fetching and delivery are paused for lease renewal to catch up.",
            registry=r)
        # consumers
        self.shard_consumer_state = Gauge(
            "kclpy_shard_consumer_state",
            "1 for the state each shard consumer is in, 0 for the others.",
            ["shard_id", "state"], registry=r)
        # lag status (kclpy.ops.lag, evaluated by the ops endpoint's sampler)
        self.shard_lag_status = Gauge(
            "kclpy_shard_lag_status",
            "1 for each held shard's current lag status (Burrow's rules), 0 for the others.",
            ["shard_id", "status"], registry=r)
        self.application_lag_status = Gauge(
            "kclpy_application_lag_status",
            "1 for the application's lag status over this worker's shards, 0 for the others.",
            ["status"], registry=r)
        self.lag_max_millis = Gauge(
            "kclpy_lag_max_millis",
            "Largest age of the oldest unprocessed record over this worker's shards.",
            registry=r)
        self.lag_total_records = Gauge(
            "kclpy_lag_total_records",
            "Kinesis records behind the checkpoints, summed over this worker's shards "
            "(a lower bound once a shard is more than the probe's limit behind).", registry=r)
        self.lag_webhook_events = Counter(
            "kclpy_lag_webhook_events",
            "Lag status changes sent to --lag-webhook, by outcome (sent, retried, failed, "
            "dropped).", ["outcome"], registry=r)
        self.data_lost_to_retention = Counter(
            "kclpy_data_lost_to_retention",
            "Shards started from a checkpoint the stream's retention had trimmed past (the "
            "records between it and the oldest kept are lost; logged at ERROR).",
            ["shard_id"], registry=r)
        self.shard_failure_attempts = Gauge(
            "kclpy_shard_failure_attempts",
            "Failed attempts at the current batch of a FAILED shard (0 once one succeeds).",
            ["shard_id"], registry=r)
        self.shard_failing_since = Gauge(
            "kclpy_shard_failing_since_seconds",
            "Since when (epoch seconds) a FAILED shard's current batch has been failing "
            "(0 once one succeeds).", ["shard_id"], registry=r)
        self.shard_failure = Gauge(
            "kclpy_shard_failure",
            "1 for the exception type process_records last raised on a FAILED shard's batch.",
            ["shard_id", "error_type"], registry=r)
        self.shards_parked = Gauge(
            "kclpy_shards_parked",
            "Parked leases (kclpyParked) in the lease table as this worker last scanned it: "
            "no worker takes them until 'kclpy shard resume'.", registry=r)
        self.shards_parked_by_policy = Counter(
            "kclpy_shards_parked_by_policy",
            "Shards this worker parked under processor_error_policy=park.",
            ["shard_id"], registry=r)
        # MultiLangDaemon children
        self.multilang_child_failures = Counter(
            "kclpy_multilang_child_failures",
            "MultiLangDaemon children killed because they exited, hung or broke the protocol.",
            ["shard_id", "reason"], registry=r)
        self.multilang_stray_stdout_lines = Counter(
            "kclpy_multilang_stray_stdout_lines",
            "Lines on a child's stdout that were not protocol messages and were skipped.",
            ["shard_id"], registry=r)
        self.multilang_stdout_full = Counter(
            "kclpy_multilang_stdout_full",
            "Times a child's unread stdout reached its bound and reading paused.",
            ["shard_id"], registry=r)
        # Spark micro-batches (kclpy-worker --spark-batch): on the registry only once a
        # worker feeds Spark (register_spark), so a plain worker shows no kclpy_spark_* series
        self.spark_batches = Counter(
            "kclpy_spark_batches", "Micro-batches committed to Spark.", registry=None)
        self.spark_records = Counter(
            "kclpy_spark_records", "Records in committed micro-batches.", registry=None)
        self.spark_foreach_batch_failures = Counter(
            "kclpy_spark_foreach_batch_failures",
            "foreach_batch calls that raised (each retried).", registry=None)
        self.spark_lost_checkpoints = Counter(
            "kclpy_spark_lost_checkpoints",
            "Shard parts of a batch not checkpointed because the lease was lost.",
            registry=None)
        self._spark_registered = False
        self.dynamodb_requests = Counter(
            "kclpy_dynamodb_requests", "DynamoDB requests by operation.", ["operation"], registry=r)
        # Exactly-once state (kclpy.state)
        self.state_commits = Counter(
            "kclpy_state_commits",
            "Transactions committed with their checkpoint by a stateful processor.",
            ["shard_id"], registry=r)
        self.state_records = Counter(
            "kclpy_state_records", "Records whose effects were committed exactly once.",
            ["shard_id"], registry=r)
        self.state_conflicts = Counter(
            "kclpy_state_conflicts",
            "Commits refused because another writer changed a state key first (each "
            "transaction's records are then applied again).", ["shard_id"], registry=r)
        # Enhanced fan-out (retrieval_mode=fanout)
        self.subscriptions = Counter(
            "kclpy_subscriptions",
            "SubscribeToShard subscriptions by outcome: opened (first of a shard), renewed "
            "(after the previous one ended or dropped), failed_<kind> (throttled, "
            "server_error, connection, in_use).", ["shard_id", "outcome"], registry=r)
        self.subscription_events = Counter(
            "kclpy_subscription_events", "SubscribeToShard events received.", ["shard_id"],
            registry=r)
        self.subscription_bytes = Counter(
            "kclpy_subscription_bytes", "Bytes of SubscribeToShard event payloads received.",
            ["shard_id"], registry=r)
        # Lag recovery (kclpy.recovery, max_lag_ms)
        self.recovery_records = Counter(
            "kclpy_recovery_records",
            "Records of recovery gaps handed to the processor (flagged is_recovery).",
            ["shard_id"], registry=r)
        self.recovery_remaining_ms = Gauge(
            "kclpy_recovery_remaining_ms",
            "Arrival time still to recover per shard: each queued gap's end minus its "
            "recovery checkpoint's arrival, summed.", ["shard_id"], registry=r)
        self.recovery_shards = Gauge(
            "kclpy_recovery_shards", "Held shards with recovery gaps queued.", registry=r)
        self.recovery_trimmed = Counter(
            "kclpy_recovery_trimmed",
            "Recovery gaps found partly past the stream's retention (logged at ERROR with "
            "the lost range; recovery went on with the rest).", ["shard_id"], registry=r)
        # The Java KCL's CloudWatch metrics (kclpy.cloudwatch): off unless configured
        self.cloudwatch: MetricsSink = NullSink()
        self.cloudwatch_datums = Counter(
            "kclpy_cloudwatch_datums",
            "CloudWatch datums by outcome: sent, dropped_queue_full (the oldest waiting datum "
            "gave way), dropped_failed (PutMetricData kept failing).", ["outcome"], registry=r)
        self.cloudwatch_request_failures = Counter(
            "kclpy_cloudwatch_request_failures",
            "PutMetricData attempts that failed, by kind (throttled, error); retried with backoff.",
            ["kind"], registry=r)

    def cloudwatch_event(self, what: str, n: int) -> None:
        """The CloudWatch publisher's report of itself, counted here."""
        if what in ("throttled", "error"):
            self.cloudwatch_request_failures.labels(what).inc(n)
        else:
            self.cloudwatch_datums.labels(what).inc(n)

    def register_spark(self) -> None:
        """Put the ``kclpy_spark_*`` collectors on the registry (once): the worker feeds
        Spark micro-batches."""
        if self._spark_registered:
            return
        self._spark_registered = True
        for collector in (self.spark_batches, self.spark_records,
                          self.spark_foreach_batch_failures, self.spark_lost_checkpoints):
            self.registry.register(collector)
