"""Every metric kclpy records, declared once, and the worker's metrics facade.

**Add a metric** with one declaration below (its kind, help, labels, whether it is per
shard, its Java CloudWatch datums if the Java KCL has a twin) and one call where the event
happens: ``scope.inc(METRIC)``, ``.set``, ``.observe`` or ``.call`` on the worker's
:class:`Metrics` or on a shard's scope (``metrics.shard(lease_key)``); list it in
docs/operations.md. **Add a backend** by implementing ``kclpy.telemetry.Backend`` and
passing it to ``Metrics(backends=[...])`` (or ``add_backend`` before the worker starts):
no call site changes.

Names and labels are documented in docs/operations.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, cast

from prometheus_client import CollectorRegistry

from kclpy.prometheus import PrometheusBackend
from kclpy.telemetry import (
    BYTES,
    DETAILED,
    MILLISECONDS,
    Backend,
    BackendScope,
    Dimensions,
    Handle,
    Java,
    JavaCall,
    Kind,
    Metric,
)

COUNTER, GAUGE, HISTOGRAM, CALL = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM, Kind.CALL

#: the Java KCL's CloudWatch operations
PROCESS_TASK = "ProcessTask"
RENEW_ALL_LEASES = "RenewAllLeases"
TAKE_LEASES = "TakeLeases"


def _shard(name: str, kind: Kind, help: str, *labels: str, **options: Any) -> Metric:
    return Metric(name, kind, help, labels, per_shard=True, **options)


def _worker(name: str, kind: Kind, help: str, *labels: str, **options: Any) -> Metric:
    return Metric(name, kind, help, labels, **options)


# -- processing ----------------------------------------------------------------------------
RECORDS_PROCESSED = _shard(
    "records_processed", COUNTER, "User records handed to the processor and returned from it.",
    java=(Java(PROCESS_TASK, "RecordsProcessed"),), worker_total=True)
BYTES_PROCESSED = _shard(
    "bytes_processed", COUNTER, "Payload bytes of the records processed.",
    java=(Java(PROCESS_TASK, "DataBytesProcessed", BYTES),), worker_total=True)
MILLIS_BEHIND_LATEST = _shard(
    "millis_behind_latest", GAUGE, "MillisBehindLatest of the last GetRecords per shard.")
PROCESS_RECORDS = _shard(
    "process_records_seconds", CALL, "Time spent in the processor's process_records.",
    java=(Java(PROCESS_TASK, "RecordProcessor.processRecords.Time", MILLISECONDS, scale=1000),
          JavaCall(PROCESS_TASK)))
#: the MillisBehindLatest of a processed batch, as the Java ProcessTask reports it
BATCH_MILLIS_BEHIND_LATEST = _shard(
    "batch_millis_behind_latest", GAUGE, "MillisBehindLatest of each processed batch.",
    prometheus=False,
    java=(Java(PROCESS_TASK, "MillisBehindLatest", MILLISECONDS),
          Java("ApplicationTracker", "MillisBehindLatest", MILLISECONDS, scoped=False)))
PROCESSOR_ERRORS = _shard(
    "processor_errors", COUNTER, "Exceptions raised by processor callbacks.", "callback")
# -- retrieval -----------------------------------------------------------------------------
GET_RECORDS = _shard(
    "get_records_seconds", CALL, "GetRecords call latency, successes and failures.",
    java=(JavaCall(PROCESS_TASK, "KinesisDataFetcher.getRecords", DETAILED),))
GET_RECORDS_ERRORS = _shard(
    "get_records_errors", COUNTER, "Failed GetRecords/GetShardIterator calls by kind.", "kind")
THROTTLES = _worker(
    "throttles", COUNTER, "Throttling responses (Kinesis and DynamoDB) by operation.",
    "operation")
ITERATOR_EXPIRATIONS = _shard(
    "iterator_expirations", COUNTER, "ExpiredIteratorException answers, each re-positioned.",
    java=(Java(PROCESS_TASK, "ExpiredIterator"),))
DEAGGREGATION_ERRORS = _shard(
    "deaggregation_errors", COUNTER,
    "KPL aggregates delivered raw instead of expanded, by reason: malformed (bad MD5, "
    "undecodable), key_limits (a key beyond Kinesis' limits), too_large (beyond what a KPL "
    "aggregate can hold).", "reason")
RECORDS_FILTERED = _shard(
    "records_filtered", COUNTER,
    "KPL sub-records dropped because their explicit hash key is outside the shard.")
CLOCK_SKEW = _worker(
    "clock_skew_seconds", GAUGE,
    "How far the local clock is ahead of Kinesis' (negative: behind), as Kinesis' answers "
    "show its time (Date header, arrivals); to within about half a second. Bounded reads "
    "and planned ends use Kinesis' time, never this clock's.")
PREFETCH_QUEUE_DEPTH = _shard(
    "prefetch_queue_depth", GAUGE, "Fetched batches waiting for the processor.")
# -- checkpoints ---------------------------------------------------------------------------
CHECKPOINTS = _shard("checkpoints", COUNTER, "Checkpoints written.")
CHECKPOINT_FAILURES = _shard(
    "checkpoint_failures", COUNTER, "Checkpoint attempts that failed, by exception name.",
    "kind")
# -- leases --------------------------------------------------------------------------------
LEASES_HELD = _worker("leases_held", GAUGE, "Leases this worker holds now.")
LEASES_TAKEN = _worker("leases_taken", COUNTER, "Leases taken (unowned or expired).")
LEASES_STOLEN = _worker(
    "leases_stolen", COUNTER, "Leases taken from a live worker to balance load.")
LEASES_LOST = _worker(
    "leases_lost", COUNTER, "Leases lost to another worker or to a failed renewal.")
LEASES_EXPIRED = _worker(
    "leases_expired", COUNTER,
    "Leases given up because no write of them succeeded within the failover time "
    "(a subset of kclpy_leases_lost).")
SHARDS_UNCONSUMED = _worker(
    "shards_held_unconsumed", GAUGE,
    "Leases held with no running consumer; /healthz fails once one lasts longer "
    "than the failover time.")
RENEW_LEASE = _worker(
    "lease_renewals", CALL, "Successful lease renewals.",
    failures=("lease_renew_failures", "Renewals that failed (condition or error)."),
    java=(JavaCall(RENEW_ALL_LEASES, "RenewLease", DETAILED),))
INITIALIZATION_FAILURES = _worker(
    "initialization_failures", COUNTER, "Start-up attempts that failed, by exception name.",
    "kind")
RETRIEVAL_PAUSES = _worker(
    "retrieval_pauses", COUNTER,
    "Times fetching and delivery paused because lease renewal ran late.")
RETRIEVAL_PAUSED = _worker(
    "retrieval_paused", GAUGE,
    "1 while fetching and delivery are paused for lease renewal to catch up.")
# the Java renewer's and taker's own figures (CloudWatch only)
RENEWAL_PASS = _worker(
    "renewal_pass", CALL, "One pass of the renewer.", prometheus=False,
    java=(JavaCall(RENEW_ALL_LEASES),))
RENEWAL_CURRENT_LEASES = _worker(
    "renewal_current_leases", GAUGE, "Leases held after a renewal pass.", prometheus=False,
    java=(Java(RENEW_ALL_LEASES, "CurrentLeases"),))
RENEWAL_LOST_LEASES = _worker(
    "renewal_lost_leases", GAUGE, "Leases lost in a renewal pass.", prometheus=False,
    java=(Java(RENEW_ALL_LEASES, "LostLeases"),))
TAKE_CYCLE = _worker(
    "take_cycle", CALL, "One cycle of the lease taker.", prometheus=False,
    java=(JavaCall(TAKE_LEASES),))
LIST_LEASES = _worker(
    "list_leases", CALL, "The taker's scan of the lease table.", prometheus=False,
    java=(JavaCall(TAKE_LEASES, "ListLeases", DETAILED),))
TAKEN_LEASES = _worker(
    "taken_leases", GAUGE, "Leases a taker cycle took.", prometheus=False,
    java=(Java(TAKE_LEASES, "TakenLeases"),))
NUM_WORKERS = _worker(
    "num_workers", GAUGE, "Live workers a taker cycle saw.", prometheus=False,
    java=(Java(TAKE_LEASES, "NumWorkers"),))
EXPIRED_LEASES = _worker(
    "expired_leases", GAUGE, "Expired leases a taker cycle saw.", prometheus=False,
    java=(Java(TAKE_LEASES, "ExpiredLeases"),))
TOTAL_LEASES = _worker(
    "total_leases", GAUGE, "Leases a taker cycle saw.", prometheus=False,
    java=(Java(TAKE_LEASES, "TotalLeases", level=DETAILED),))
NEEDED_LEASES = _worker(
    "needed_leases", GAUGE, "Leases a taker cycle wanted.", prometheus=False,
    java=(Java(TAKE_LEASES, "NeededLeases", level=DETAILED),))
# -- consumers -----------------------------------------------------------------------------
SHARD_CONSUMER_STATE = _shard(
    "shard_consumer_state", GAUGE, "1 for the state each shard consumer is in, 0 for the others.",
    "state")
# -- lag status (kclpy.ops.lag, evaluated by the ops endpoint's sampler) -------------------
SHARD_LAG_STATUS = _shard(
    "shard_lag_status", GAUGE,
    "1 for each held shard's current lag status (Burrow's rules), 0 for the others.", "status")
APPLICATION_LAG_STATUS = _worker(
    "application_lag_status", GAUGE,
    "1 for the application's lag status over this worker's shards, 0 for the others.",
    "status")
LAG_MAX_MILLIS = _worker(
    "lag_max_millis", GAUGE,
    "Largest age of the oldest unprocessed record over this worker's shards.")
LAG_TOTAL_RECORDS = _worker(
    "lag_total_records", GAUGE,
    "Kinesis records behind the checkpoints, summed over this worker's shards "
    "(a lower bound once a shard is more than the probe's limit behind).")
LAG_WEBHOOK_EVENTS = _worker(
    "lag_webhook_events", COUNTER,
    "Lag status changes sent to --lag-webhook, by outcome (sent, retried, failed, dropped).",
    "outcome")
OPS_REFUSED = _worker(
    "ops_requests_refused", COUNTER,
    "Connections to the ops endpoint closed without their answer, by reason: timeout (no "
    "whole request within the timeout), evicted (dropped for a newer connection), "
    "too_large, bad_request, misdirected (Host not served) or busy.", "reason")
# A loss or a park is an event to alert on after the shard left the worker (a parked shard
# leaves at once): these two are the worker's, labelled with the shard, so their series stay
# when the shard's own series go.
DATA_LOST_TO_RETENTION = _worker(
    "data_lost_to_retention", COUNTER,
    "Shards started from a checkpoint the stream's retention had trimmed past (the "
    "records between it and the oldest kept are lost), and unfinished shards whose lease "
    "shard sync deleted because the retention had removed the shard from the stream (the "
    "records after its checkpoint are lost); each logged at ERROR.", "shard_id")
SHARD_FAILURE_ATTEMPTS = _shard(
    "shard_failure_attempts", GAUGE,
    "Failed attempts at the current batch of a FAILED shard (0 once one succeeds).")
SHARD_FAILING_SINCE = _shard(
    "shard_failing_since_seconds", GAUGE,
    "Since when (epoch seconds) a FAILED shard's current batch has been failing "
    "(0 once one succeeds).")
SHARD_FAILURE = _shard(
    "shard_failure", GAUGE,
    "1 for the exception type process_records last raised on a FAILED shard's batch.",
    "error_type")
SHARDS_PARKED = _worker(
    "shards_parked", GAUGE,
    "Parked leases (kclpyParked) in the lease table as this worker last scanned it: "
    "no worker takes them until 'kclpy shard resume'.")
SHARDS_PARKED_BY_POLICY = _worker(
    "shards_parked_by_policy", COUNTER,
    "Shards this worker parked under processor_error_policy=park.", "shard_id")
# -- MultiLangDaemon children --------------------------------------------------------------
MULTILANG_CHILD_FAILURES = _shard(
    "multilang_child_failures", COUNTER,
    "MultiLangDaemon children killed because they exited, hung or broke the protocol.",
    "reason")
MULTILANG_STRAY_STDOUT_LINES = _shard(
    "multilang_stray_stdout_lines", COUNTER,
    "Lines on a child's stdout that were not protocol messages and were skipped.")
MULTILANG_STDOUT_FULL = _shard(
    "multilang_stdout_full", COUNTER,
    "Times a child's unread stdout reached its bound and reading paused.")
# -- Spark micro-batches (kclpy-worker --spark-batch): shown only once a worker feeds Spark
# (register_spark), so a plain worker shows no kclpy_spark_* series
SPARK = "spark"
SPARK_BATCHES = _worker(
    "spark_batches", COUNTER, "Micro-batches committed to Spark.", group=SPARK)
SPARK_RECORDS = _worker(
    "spark_records", COUNTER, "Records in committed micro-batches.", group=SPARK)
SPARK_FOREACH_BATCH_FAILURES = _worker(
    "spark_foreach_batch_failures", COUNTER, "foreach_batch calls that raised (each retried).",
    group=SPARK)
SPARK_LOST_CHECKPOINTS = _worker(
    "spark_lost_checkpoints", COUNTER,
    "Shard parts of a batch not checkpointed because the lease was lost.", group=SPARK)
DYNAMODB_REQUESTS = _worker(
    "dynamodb_requests", COUNTER, "DynamoDB requests by operation.", "operation")
# -- exactly-once state (kclpy.state) ------------------------------------------------------
STATE_COMMITS = _shard(
    "state_commits", COUNTER,
    "Transactions committed with their checkpoint by a stateful processor.")
STATE_RECORDS = _shard(
    "state_records", COUNTER, "Records whose effects were committed exactly once.")
STATE_CONFLICTS = _shard(
    "state_conflicts", COUNTER,
    "Commits refused because another writer changed a state key first (each "
    "transaction's records are then applied again).")
# -- enhanced fan-out (retrieval_mode=fanout) ----------------------------------------------
SUBSCRIPTIONS = _worker(
    "subscriptions", COUNTER,
    "SubscribeToShard subscriptions by outcome: opened (first of a shard), renewed "
    "(after the previous one ended or dropped), failed_<kind> (throttled, "
    "server_error, connection, in_use). The worker's, not a shard's: a failure that made "
    "the shard move on stays counted after it left.", "outcome")
SUBSCRIPTION_EVENTS = _shard(
    "subscription_events", COUNTER, "SubscribeToShard events received.")
SUBSCRIPTION_BYTES = _shard(
    "subscription_bytes", COUNTER, "Bytes of SubscribeToShard event payloads received.")
# -- lag recovery (kclpy.recovery, max_lag_ms) ---------------------------------------------
RECOVERY_RECORDS = _shard(
    "recovery_records", COUNTER,
    "Records of recovery gaps handed to the processor (flagged is_recovery).")
RECOVERY_REMAINING_MS = _shard(
    "recovery_remaining_ms", GAUGE,
    "Arrival time still to recover per shard: each queued gap's end minus its "
    "recovery checkpoint's arrival, summed.")
RECOVERY_SHARDS = _worker(
    "recovery_shards", GAUGE, "Held shards with recovery gaps queued.")
RECOVERY_TRIMMED = _shard(
    "recovery_trimmed", COUNTER,
    "Recovery gaps found partly past the stream's retention (logged at ERROR with "
    "the lost range; recovery went on with the rest).")
# -- the CloudWatch publisher's own figures (kclpy.cloudwatch) -----------------------------
CLOUDWATCH_DATUMS = _worker(
    "cloudwatch_datums", COUNTER,
    "CloudWatch datums by outcome: sent, dropped_queue_full (the oldest waiting datum "
    "gave way), dropped_failed (PutMetricData kept failing).", "outcome")
CLOUDWATCH_REQUEST_FAILURES = _worker(
    "cloudwatch_request_failures", COUNTER,
    "PutMetricData attempts that failed, by kind (throttled, error); retried with backoff.",
    "kind")

#: every metric above
CATALOGUE: tuple[Metric, ...] = tuple(
    value for value in dict(globals()).values() if isinstance(value, Metric))


class _Noop:
    """The handle of a metric no backend records, or of a closed scope."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, value: float) -> None:
        return None

    def call(self, seconds: float, ok: bool = True) -> None:
        return None


class _Fanout:
    """One event to every interested backend."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[Any]) -> None:
        self._handles = tuple(handles)

    def inc(self, amount: float = 1) -> None:
        for handle in self._handles:
            handle.inc(amount)

    def set(self, value: float) -> None:
        for handle in self._handles:
            handle.set(value)

    def observe(self, value: float) -> None:
        for handle in self._handles:
            handle.observe(value)

    def call(self, seconds: float, ok: bool = True) -> None:
        for handle in self._handles:
            handle.call(seconds, ok)


_NOOP = _Noop()


class Scope:
    """Where a call site records an event (the Java ``MetricsScope``): the worker's, or one
    shard's. Events go to every backend; a closed scope records nothing."""

    def __init__(self, dimensions: Dimensions, parts: Iterable[BackendScope], *,
                 closed: bool = False) -> None:
        self.dimensions = dimensions
        self._parts = tuple(parts)
        self.closed = closed
        # Most call sites record through ``inc``/``set``/``observe`` per event rather than
        # keeping a handle, and asking every backend for its handle each time (Prometheus'
        # ``labels``, a CloudWatch datum set) was a tenth of a busy worker's CPU. A handle
        # stays valid until its series is removed or the scope closes, so it is kept here by
        # metric name and label values until then. Misses and removals share a lock so that
        # a removal never leaves behind a handle bound just before it.
        self._bound: dict[tuple[str, tuple[str, ...]], tuple[Metric, Handle]] = {}
        self._bind_lock = threading.Lock()

    def bind(self, metric: Metric, *labels: str) -> Handle:
        """The handle a hot path keeps: with one backend interested, that backend's own."""
        if self.closed:
            return _NOOP
        key = (metric.name, labels)
        kept = self._bound.get(key)
        if kept is not None and kept[0] is metric:
            return kept[1]
        with self._bind_lock:
            # a scope closed meanwhile: its backends' scopes hand out nothing live, and a
            # closed scope never reads what is kept
            handle = self._bind_parts(metric, labels)
            self._bound[key] = (metric, handle)
            return handle

    def _bind_parts(self, metric: Metric, labels: tuple[str, ...]) -> Handle:
        handles = [h for part in self._parts
                   if (h := part.bind(metric, labels)) is not None]
        if not handles:
            return _NOOP
        return cast(Handle, handles[0]) if len(handles) == 1 else _Fanout(handles)

    def inc(self, metric: Metric, *labels: str, by: float = 1) -> None:
        self.bind(metric, *labels).inc(by)

    def set(self, metric: Metric, value: float, *labels: str) -> None:
        self.bind(metric, *labels).set(value)

    def observe(self, metric: Metric, value: float, *labels: str) -> None:
        self.bind(metric, *labels).observe(value)

    def call(self, metric: Metric, seconds: float, ok: bool = True, *labels: str) -> None:
        self.bind(metric, *labels).call(seconds, ok)

    def remove(self, metric: Metric, *labels: str) -> None:
        """Drop one series that no longer applies (the gauge of a state left behind)."""
        with self._bind_lock:
            self._bound.pop((metric.name, labels), None)
            for part in self._parts:
                part.remove(metric, labels)

    def close(self) -> None:
        with self._bind_lock:
            self.closed = True
            self._bound.clear()
        for part in self._parts:
            part.close()

    def _add(self, backend: Backend) -> None:
        with self._bind_lock:
            self._parts = (*self._parts, backend.scope(self.dimensions))
            self._bound.clear()


#: a scope that records nothing: for a part used without metrics, or a shard not held
NOWHERE = Scope(Dimensions(), (), closed=True)


class _Cell:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class WorkerTotals:
    """The in-process backend behind the worker's totals: each ``worker_total`` metric per
    lease key, kept after the shard leaves (Prometheus forgets it then), so the progress
    line's and the load meter's differences never go backwards. One pair of numbers per
    shard this worker ever processed; nothing of it is exported."""

    def __init__(self) -> None:
        self._cells: dict[tuple[str, str], _Cell] = {}
        self._lock = threading.Lock()

    def scope(self, dimensions: Dimensions) -> _TotalsScope:
        return _TotalsScope(self, dimensions.lease_key)

    def enable(self, group: str) -> None:
        return None

    def cell(self, metric: Metric, lease_key: str) -> _Cell:
        with self._lock:
            return self._cells.setdefault((metric.name, lease_key), _Cell())

    def by_lease(self, metric: Metric) -> dict[str, float]:
        with self._lock:
            return {key: cell.value for (name, key), cell in self._cells.items()
                    if name == metric.name}


class _TotalsScope:
    def __init__(self, totals: WorkerTotals, lease_key: str | None) -> None:
        self._totals = totals
        self._key = lease_key

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> _Cell | None:
        if not metric.worker_total or self._key is None:
            return None
        return self._totals.cell(metric, self._key)

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        return None

    def close(self) -> None:
        return None


class Metrics(Scope):
    """A worker's metrics (the Java ``MetricsFactory``): the worker's own scope, the scopes
    of its shards, and the backends every event goes to - Prometheus (``.registry`` is what
    /metrics serves), the worker's totals, and any given. Pass one ``Metrics()`` around.

    In a worker a shard has a scope only while the worker holds it (``open_shard`` to
    ``close_shard``); events of any other shard are dropped. Elsewhere (a part used on its
    own, a test) ``shard`` opens a scope on first use."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 backends: Iterable[Backend] = ()) -> None:
        self.prometheus = PrometheusBackend(CATALOGUE, registry)
        self.registry = self.prometheus.registry
        self.totals = WorkerTotals()
        self._backends: list[Backend] = [self.prometheus, self.totals, *backends]
        super().__init__(Dimensions(), (b.scope(Dimensions()) for b in self._backends))
        self._shards: dict[str, Scope] = {}
        self._shards_lock = threading.Lock()
        #: False in a worker: only the shards it opened have a scope
        self.implicit_shards = True

    def add_backend(self, backend: Backend) -> None:
        """Another backend, for every scope open now or later; handles bound before miss it,
        so add it before the worker starts its parts."""
        with self._shards_lock:
            self._backends.append(backend)
            for scope in (self, *self._shards.values()):
                scope._add(backend)

    def open_shard(self, lease_key: str, shard_id: str | None = None,
                   stream: str | None = None) -> Scope:
        """The scope of a shard the worker starts consuming (the one already open, if any)."""
        with self._shards_lock:
            scope = self._shards.get(lease_key)
            if scope is None:
                dimensions = Dimensions(lease_key, shard_id, stream)
                scope = self._shards[lease_key] = Scope(
                    dimensions, (b.scope(dimensions) for b in self._backends))
            return scope

    def shard(self, lease_key: str, shard_id: str | None = None,
              stream: str | None = None) -> Scope:
        """The scope of an open shard; a closed one, recording nothing, for a shard a worker
        does not hold."""
        with self._shards_lock:
            scope = self._shards.get(lease_key)
        if scope is not None:
            return scope
        if self.implicit_shards:
            return self.open_shard(lease_key, shard_id, stream)
        return NOWHERE

    def close_shard(self, lease_key: str) -> None:
        """The shard left the worker (lease lost, released, handed off, shard ended): its
        series disappear from Prometheus, its CloudWatch datums stop."""
        with self._shards_lock:
            # closed before the shard can be opened again: a new scope's handle bound to a
            # series the old one is about to remove would record into a child no longer in
            # the registry for as long as the new scope keeps it
            scope = self._shards.pop(lease_key, None)
            if scope is not None:
                scope.close()

    def open_shards(self) -> list[str]:
        with self._shards_lock:
            return sorted(self._shards)

    def total(self, metric: Metric) -> float:
        """A ``worker_total`` metric over every shard this worker processed."""
        return sum(self.totals.by_lease(metric).values())

    def cloudwatch_event(self, what: str, n: int) -> None:
        """The CloudWatch publisher's report of itself, counted here."""
        if what in ("throttled", "error"):
            self.inc(CLOUDWATCH_REQUEST_FAILURES, what, by=n)
        else:
            self.inc(CLOUDWATCH_DATUMS, what, by=n)

    def register_spark(self) -> None:
        """Show the ``kclpy_spark_*`` metrics: the worker feeds Spark micro-batches."""
        with self._shards_lock:
            backends = list(self._backends)
        for backend in backends:
            backend.enable(SPARK)

