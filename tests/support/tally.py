"""A metrics backend for tests that read a shard's counters after the shard left.

A worker's Prometheus series of a shard are removed when the shard leaves it (lease lost,
handed off, shard ended, worker stopped), so a test that asks, once the worker is done,
how many records a finished parent recovered or how often a child failed reads them here:
``Tally`` adds up every counter event per metric, lease key and label values, and forgets
nothing. Plug it in as ``Metrics(backends=[tally])``; no call site knows it is there.
"""

from __future__ import annotations

import threading

from kclpy.telemetry import Dimensions, Kind, Metric

Key = tuple[str, str | None, tuple[str, ...]]


class Tally:
    def __init__(self) -> None:
        self._counts: dict[Key, float] = {}
        self._lock = threading.Lock()

    def scope(self, dimensions: Dimensions) -> _TallyScope:
        return _TallyScope(self, dimensions.lease_key)

    def enable(self, group: str) -> None:
        return None

    def add(self, key: Key, amount: float) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + amount

    def count(self, metric: Metric, lease_key: str | None = None, *labels: str) -> float:
        """What ``metric`` counted for this shard (None: the worker's own) and labels."""
        with self._lock:
            return self._counts.get((metric.name, lease_key, labels), 0.0)

    def counts(self, metric: Metric) -> dict[tuple[str | None, tuple[str, ...]], float]:
        """Every (lease key, label values) ``metric`` counted for, with its count."""
        with self._lock:
            return {(key, labels): value for (name, key, labels), value in self._counts.items()
                    if name == metric.name}


class _TallyScope:
    def __init__(self, tally: Tally, lease_key: str | None) -> None:
        self._tally = tally
        self._key = lease_key

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> _Count | None:
        if metric.kind is not Kind.COUNTER:
            return None
        return _Count(self._tally, (metric.name, self._key, labels))

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        return None

    def close(self) -> None:
        return None


class _Count:
    __slots__ = ("_key", "_tally")

    def __init__(self, tally: Tally, key: Key) -> None:
        self._tally, self._key = tally, key

    def inc(self, amount: float = 1) -> None:
        self._tally.add(self._key, amount)
