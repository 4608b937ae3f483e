"""The Prometheus backend: one collector per metric, in one registry per worker.

One registry per worker (not the global default), so that several workers in one process -
tests, or an application that consumes two streams - never mix their figures. Names are the
metric's with the ``kclpy_`` prefix; per-shard metrics carry the ``shard_id`` label (the
lease key) first. A shard's series are removed when its scope closes, that is when the shard
leaves the worker: a worker that moved through thousands of shards does not serve them all
for ever, and a scrape shows the shards it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kclpy.telemetry import Dimensions, Kind, Metric

PREFIX = "kclpy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_Collector = Counter | Gauge | Histogram


class _Latency:
    """A ``call`` as a latency observation, successes and failures alike."""

    __slots__ = ("_observe",)

    def __init__(self, child: Histogram) -> None:
        self._observe = child.observe

    def call(self, seconds: float, ok: bool = True) -> None:
        self._observe(seconds)


class _Outcomes:
    """A ``call`` as one of two counters, successes or failures."""

    __slots__ = ("_failed", "_ok")

    def __init__(self, ok: Counter, failed: Counter) -> None:
        self._ok, self._failed = ok, failed

    def call(self, seconds: float, ok: bool = True) -> None:
        (self._ok if ok else self._failed).inc()


class PrometheusBackend:
    """Every metric with a Prometheus face, registered up front (a metric of a group once
    the group is enabled), so unlabelled counters show 0 from the start."""

    def __init__(self, metrics: Iterable[Metric],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collectors: dict[str, tuple[_Collector, Counter | None]] = {}
        self._groups: dict[str, list[_Collector]] = {}
        self._lock = threading.Lock()
        for metric in metrics:
            if metric.prometheus:
                self._declare(metric)

    def _declare(self, metric: Metric) -> None:
        registry = self.registry if metric.group is None else None
        labels = (("shard_id",) if metric.per_shard else ()) + metric.labels
        name = PREFIX + metric.name
        failed: Counter | None = None
        collector: _Collector
        if metric.kind is Kind.COUNTER:
            collector = Counter(name, metric.help, labels, registry=registry)
        elif metric.kind is Kind.GAUGE:
            collector = Gauge(name, metric.help, labels, registry=registry)
        elif metric.kind is Kind.CALL and metric.failures is not None:
            collector = Counter(name, metric.help, labels, registry=registry)
            failed = Counter(PREFIX + metric.failures[0], metric.failures[1], labels,
                             registry=registry)
        else:
            collector = Histogram(name, metric.help, labels, buckets=LATENCY_BUCKETS,
                                  registry=registry)
        self._collectors[metric.name] = (collector, failed)
        if metric.group is not None:
            self._groups.setdefault(metric.group, []).extend(
                c for c in (collector, failed) if c is not None)

    def enable(self, group: str) -> None:
        with self._lock:
            collectors = self._groups.pop(group, [])
        for collector in collectors:
            self.registry.register(collector)

    def collectors(self) -> list[Counter | Gauge | Histogram]:
        """Every collector, shown or not yet (docs and tests list them)."""
        return [c for pair in self._collectors.values() for c in pair if c is not None]

    def scope(self, dimensions: Dimensions) -> _PrometheusScope:
        return _PrometheusScope(self, dimensions.lease_key)

    def _child(self, metric: Metric, values: tuple[str, ...]) -> Any | None:
        entry = self._collectors.get(metric.name)
        if entry is None:
            return None
        collector, failed = entry
        if metric.kind is Kind.CALL:
            if failed is not None:
                return _Outcomes(_labelled(collector, values), _labelled(failed, values))
            return _Latency(_labelled(collector, values))
        return _labelled(collector, values)

    def _remove(self, metric: Metric, values: tuple[str, ...]) -> None:
        entry = self._collectors.get(metric.name)
        if entry is None or not values:
            return
        for collector in entry:
            if collector is not None:
                collector.remove(*values)


def _labelled(collector: Any, values: tuple[str, ...]) -> Any:
    return collector.labels(*values) if values else collector


class _PrometheusScope:
    """One scope's series. A shard's scope remembers the label values it created, so that
    closing it removes exactly those; a handle bound before the close updates a child no
    longer in the registry, so nothing a late thread records brings a series back."""

    def __init__(self, backend: PrometheusBackend, lease_key: str | None) -> None:
        self._backend = backend
        self._key = lease_key
        self._lock = threading.Lock()
        self._closed = False
        self._series: set[tuple[Metric, tuple[str, ...]]] = set()

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> Any | None:
        if not metric.per_shard:
            return self._backend._child(metric, labels)
        if self._key is None:
            raise ValueError(f"{metric.name} is a per-shard metric: record it on a shard")
        values = (self._key, *labels)
        with self._lock:
            if self._closed:
                return None
            self._series.add((metric, values))
            return self._backend._child(metric, values)

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        if metric.per_shard and self._key is None:
            return
        values = (self._key, *labels) if metric.per_shard and self._key is not None else labels
        with self._lock:
            self._series.discard((metric, values))
            self._backend._remove(metric, values)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            series, self._series = self._series, set()
        for metric, values in series:
            self._backend._remove(metric, values)
