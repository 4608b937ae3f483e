"""The Java KCL's CloudWatch metrics, so dashboards and alarms built on a Java fleet keep working.

A metrics backend (``kclpy/telemetry.py``): each event of a metric declared with Java datums
(``kclpy/metrics.py``) becomes those datums. Every datapoint carries a Java metric name,
unit and level, an ``Operation`` and the dimensions the Java KCL gives it (``ShardId``,
``StreamId``, ``WorkerIdentifier``). Points below ``metricsLevel`` are dropped at once;
dimensions outside ``metricsEnabledDimensions`` are left off (``Operation`` always stays).
A labelled metric's labels are dimensions too, named as the labels, after the Java ones:
summing its label sets into one datum would make a datum no query can take apart, so each
label set is a datum (and a CloudWatch metric) of its own. CloudWatch refuses a whole
request for one datum beyond its limits, so every datum is kept within them: 30 dimensions
at most (the first ones kept), names cut to 255 characters, values to 1024 printable ASCII
characters (others become ``?``), and a dimension whose value is empty or blank is left off.
Points with the same name, unit and dimensions are aggregated locally into one statistic set
(sum, minimum, maximum, count), as the Java KCL's accumulating queue does, and a publisher
thread sends what gathered every ``metricsBufferTimeMillis`` with ``PutMetricData``, 20
datums a request.

Nothing here may slow processing down: ``record`` takes a lock for a dictionary update and
never waits for CloudWatch. When ``metricsMaxQueueSize`` distinct datums are waiting, the
oldest is dropped (the Java KCL drops the newest; the oldest is the stalest) and counted.
Throttled or failed requests are retried with capped full-jitter backoff a few times, then
their datums are dropped and counted: metrics are never worth blocking a worker for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from kclpy.retry import THROTTLED, GaveUp, RetryPolicy, classify, retrying
from kclpy.telemetry import (
    BYTES,
    COUNT,
    DETAILED,
    MILLISECONDS,
    NONE,
    SUMMARY,
    Dimensions,
    Java,
    JavaCall,
    Metric,
)

log = logging.getLogger(__name__)

__all__ = ["BYTES", "COUNT", "DETAILED", "MILLISECONDS", "NONE", "SUMMARY",
           "CloudWatchBackend", "CloudWatchPublisher", "parse_dimensions", "parse_level"]

LEVELS = {"NONE": NONE, "SUMMARY": SUMMARY, "DETAILED": DETAILED}
#: dimension names the Java KCL knows; ``ALL`` in ``metricsEnabledDimensions`` means all
DIMENSIONS = ("Operation", "ShardId", "StreamId", "WorkerIdentifier")
OPERATION = "Operation"

#: datums per PutMetricData request, as the Java KCL sends them
BATCH = 20
#: CloudWatch's limits on a datum's dimensions
MAX_DIMENSIONS = 30
MAX_DIMENSION_NAME = 255
MAX_DIMENSION_VALUE = 1024
#: attempts per request before its datums are given up
RETRIES = RetryPolicy(0.2, 5.0, max_attempts=4)


class MetricsSink(Protocol):
    """Where kclpy's parts record Java-named datapoints."""

    def record(self, operation: str, name: str, value: float, unit: str, level: int,
               dimensions: Mapping[str, str] | None = None) -> None: ...


def parse_level(text: str) -> int:
    """``none`` / ``summary`` / ``detailed`` in any case, as the Java keys are written."""
    try:
        return LEVELS[text.strip().upper()]
    except KeyError:
        raise ValueError(f"{text!r} is not one of none, summary, detailed") from None


def parse_dimensions(text: str) -> frozenset[str]:
    """``metricsEnabledDimensions``: a comma-separated list or ``ALL``; ``Operation`` is
    always enabled, as in Java."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if "ALL" in names:
        return frozenset(DIMENSIONS)
    unknown = names - set(DIMENSIONS)
    if unknown:
        raise ValueError(f"unknown dimension(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(DIMENSIONS)}, ALL")
    return frozenset(names | {OPERATION})


@dataclass
class _Stats:
    unit: str
    sum: float
    minimum: float
    maximum: float
    count: int = 1

    def add(self, value: float) -> None:
        self.sum += value
        self.minimum = min(self.minimum, value)
        self.maximum = max(self.maximum, value)
        self.count += 1


Key = tuple[str, str, tuple[tuple[str, str], ...]]


class CloudWatchPublisher:
    """A ``MetricsSink`` that publishes to CloudWatch from its own thread. Thread-safe."""

    def __init__(
        self,
        client: Any,
        namespace: str,
        *,
        level: int = DETAILED,
        enabled_dimensions: frozenset[str] = frozenset(DIMENSIONS),
        buffer_time_s: float = 10.0,
        max_queue_size: int = 10_000,
        on_event: Callable[[str, int], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if max_queue_size < 1 or buffer_time_s <= 0:
            raise ValueError("max_queue_size must be >= 1 and buffer_time_s > 0")
        self._client = client
        self.namespace = namespace
        self.level = level
        self.enabled_dimensions = enabled_dimensions | {OPERATION}
        self._buffer_time_s = buffer_time_s
        self._max = max_queue_size
        self._on_event = on_event
        self._sleep = sleep
        self._lock = threading.Lock()
        self._queue: OrderedDict[Key, _Stats] = OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- MetricsSink -----------------------------------------------------------------------

    def record(self, operation: str, name: str, value: float, unit: str, level: int,
               dimensions: Mapping[str, str] | None = None) -> None:
        if level > self.level or self.level == NONE:
            return
        dims = {OPERATION: operation}
        if dimensions:
            for k, v in dimensions.items():
                # metricsEnabledDimensions names the Java dimensions; labels always go
                if k in DIMENSIONS and k not in self.enabled_dimensions:
                    continue
                text = _dimension_value(v)
                if text is not None and len(dims) < MAX_DIMENSIONS:
                    dims.setdefault(k[:MAX_DIMENSION_NAME], text)
        key: Key = (name, unit, tuple(dims.items()))
        dropped = False
        with self._lock:
            stats = self._queue.get(key)
            if stats is not None:
                stats.add(value)
            else:
                if len(self._queue) >= self._max:
                    self._queue.popitem(last=False)
                    dropped = True
                self._queue[key] = _Stats(unit, value, value, value)
        if dropped:
            self._event("dropped_queue_full", 1)

    # -- publishing ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kclpy-cloudwatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and send what is left, once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def flush(self) -> int:
        """Send every datum waiting now; the number sent."""
        with self._lock:
            drained = list(self._queue.items())
            self._queue.clear()
        timestamp = datetime.now(timezone.utc)
        sent = 0
        for start in range(0, len(drained), BATCH):
            batch = [_datum(key, stats, timestamp) for key, stats in drained[start:start + BATCH]]
            if self._put(batch):
                sent += len(batch)
            else:
                self._event("dropped_failed", len(batch))
        if sent:
            self._event("sent", sent)
        return sent

    def _run(self) -> None:
        while not self._stop.wait(self._buffer_time_s):
            try:
                self.flush()
            except Exception:  # the publisher must outlive any surprise; the next flush retries
                log.exception("CloudWatch metrics flush failed")

    def _put(self, batch: list[dict[str, Any]]) -> bool:
        """One PutMetricData, retried on throttling, 5xx and connection errors (the same
        classification and full-jitter backoff as every other AWS call of kclpy)."""
        def put() -> bool:
            self._client.put_metric_data(Namespace=self.namespace, MetricData=batch)
            return True

        def retryable(exc: BaseException) -> bool:
            if not isinstance(exc, (ClientError, BotoCoreError)):
                return False
            kind = classify(exc)
            self._event("throttled" if kind == THROTTLED else "error", 1)
            if kind is not None:
                log.debug("PutMetricData failed (%s): %s", kind, exc)
            return kind is not None

        try:
            return retrying(put, RETRIES, retry_on=retryable, wait=self._sleep)
        except GaveUp as gave_up:
            log.warning("CloudWatch: %d datums dropped after %d attempts to %s (last: %s)",
                        len(batch), gave_up.attempts,
                        getattr(getattr(self._client, "meta", None), "endpoint_url",
                                "CloudWatch"), gave_up.last)
        except (ClientError, BotoCoreError) as exc:
            log.warning("CloudWatch refused %d datums: %s", len(batch), exc)
        return False

    def _event(self, what: str, n: int) -> None:
        if self._on_event is not None:
            self._on_event(what, n)


def _dimension_value(text: str) -> str | None:
    """``text`` as CloudWatch takes a dimension value, or None when nothing of it would be
    left: CloudWatch refuses an empty or blank value, and anything but printable ASCII."""
    if not (text.isascii() and text.isprintable()):
        text = "".join(c if c.isascii() and c.isprintable() else "?" for c in text)
    text = text[:MAX_DIMENSION_VALUE]
    return text if text.strip() else None


def _datum(key: Key, stats: _Stats, timestamp: datetime) -> dict[str, Any]:
    name, unit, dims = key
    return {
        "MetricName": name,
        "Dimensions": [{"Name": k, "Value": v} for k, v in dims],
        "Timestamp": timestamp,
        "Unit": unit,
        "StatisticValues": {"SampleCount": stats.count, "Sum": stats.sum,
                            "Minimum": stats.minimum, "Maximum": stats.maximum},
    }


class CloudWatchBackend:
    """The metrics backend that turns events into the Java KCL's datums, sent by ``sink``
    (a :class:`CloudWatchPublisher`). A shard's datums carry ``ShardId`` (and ``StreamId``
    in a multi-stream application), the worker's ``WorkerIdentifier``, and a labelled
    metric's datums its labels as well; a closed shard's scope needs nothing removed, its
    datums simply stop."""

    def __init__(self, sink: MetricsSink, worker_id: str, level: int) -> None:
        self._sink = sink
        self._worker = {"WorkerIdentifier": worker_id}
        self._level = level

    def scope(self, dimensions: Dimensions) -> _CloudWatchScope:
        if dimensions.lease_key is None:
            return _CloudWatchScope(self, self._worker)
        dims = {"ShardId": dimensions.shard_id or dimensions.lease_key}
        if dimensions.stream is not None:
            dims["StreamId"] = dimensions.stream
        return _CloudWatchScope(self, dims)

    def enable(self, group: str) -> None:
        return None


class _CloudWatchScope:
    def __init__(self, backend: CloudWatchBackend, dimensions: Mapping[str, str]) -> None:
        self._backend = backend
        self._dimensions = dimensions

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> _Datums | None:
        """Only the datums the level asks for: a DETAILED one at SUMMARY costs nothing."""
        level = self._backend._level
        faces = tuple(f for f in metric.java if f.level <= level)
        if not faces:
            return None
        return _Datums(self._backend._sink, faces, self._dimensions,
                       dict(zip(metric.labels, labels, strict=True)))

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        return None

    def close(self) -> None:
        return None


class _Datums:
    """One metric's datums in one scope, for one set of label values: the scope's
    dimensions, then the labels (a label named as one of the scope's dimensions gives way
    to it). An unscoped datum (the application's) keeps its labels."""

    __slots__ = ("_calls", "_record", "_values")

    def __init__(self, sink: MetricsSink, faces: tuple[Java | JavaCall, ...],
                 dimensions: Mapping[str, str], labels: Mapping[str, str]) -> None:
        self._record = sink.record
        scoped = dict(dimensions)
        for name, value in labels.items():
            scoped.setdefault(name, value)
        unscoped = dict(labels) or None
        self._values = tuple(
            (f.operation, f.name, f.unit, f.level, f.scale, scoped if f.scoped else unscoped)
            for f in faces if isinstance(f, Java))
        self._calls = tuple(
            (f.operation, f"{f.prefix}." if f.prefix else "", f.level, scoped)
            for f in faces if isinstance(f, JavaCall))

    def inc(self, amount: float = 1) -> None:
        for operation, name, unit, level, scale, dims in self._values:
            self._record(operation, name, amount * scale, unit, level, dims)

    set = observe = inc

    def call(self, seconds: float, ok: bool = True) -> None:
        self.inc(seconds)
        for operation, lead, level, dims in self._calls:
            self._record(operation, f"{lead}Success", 1 if ok else 0, COUNT, level, dims)
            self._record(operation, f"{lead}Time", seconds * 1000, MILLISECONDS, level, dims)
