"""The metrics interface: what a metric is, what a call site records, what a backend does.

The model is the Java KCL's ``MetricsFactory``/``MetricsScope``: a call site records each
event once, on a scope that carries the event's dimensions (the worker's scope, or one
shard's: its lease key, shard id and stream), naming a :class:`Metric` declared once in
``kclpy/metrics.py``. Every backend turns the event into its own form or ignores a metric
it has no use for: Prometheus (``kclpy/prometheus.py``), the Java KCL's CloudWatch metrics
(``kclpy/cloudwatch.py``), the worker's in-process totals, or one of your own. So adding a
backend touches no call site, and adding a metric touches its declaration and the one place
that records it.

An event is one of four operations, as the metric's kind allows:

- ``inc(n)``: a counter grows by n (a gauge may move by n too);
- ``set(v)``: a gauge's value now;
- ``observe(v)``: one observation of a distribution (seconds);
- ``call(seconds, ok)``: one call of an operation, its latency and whether it succeeded
  (the Java KCL's ``addSuccessAndLatency``).

A backend is asked for a handle per metric and label values (``bind``) and the event goes
to the handle; hot paths bind once and keep the handle, so an event costs a method call per
interested backend and nothing is looked up. A shard's scope is closed when the shard
leaves the worker: each backend drops what it keeps for that shard (Prometheus removes its
series) and later events of the scope go nowhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

#: the Java KCL's metrics levels (``metricsLevel``)
NONE, SUMMARY, DETAILED = 0, 1, 2
#: the CloudWatch units kclpy's Java-named datums use
COUNT, BYTES, MILLISECONDS = "Count", "Bytes", "Milliseconds"


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    #: a call's latency and outcome: ``call(seconds, ok)``
    CALL = "call"


@dataclass(frozen=True)
class Java:
    """One Java KCL CloudWatch datum an event's value becomes: ``value * scale`` under
    ``operation``/``name``. ``scoped`` False leaves the scope's dimensions off (the Java
    ``ApplicationTracker`` figures are the application's, not a shard's)."""

    operation: str
    name: str
    unit: str = COUNT
    level: int = SUMMARY
    scale: float = 1.0
    scoped: bool = True


@dataclass(frozen=True)
class JavaCall:
    """The Java ``addSuccessAndLatency`` pair a ``call`` event becomes: ``<prefix>.Success``
    (1 or 0) and ``<prefix>.Time`` (milliseconds), or plain ``Success``/``Time`` without a
    prefix."""

    operation: str
    prefix: str = ""
    level: int = SUMMARY


@dataclass(frozen=True)
class Metric:
    """One metric, declared once (``kclpy/metrics.py``) and recorded by name everywhere.

    ``name`` is its Prometheus name without the ``kclpy_`` prefix. ``per_shard`` metrics are
    recorded on a shard's scope, labelled ``shard_id`` (the lease key) in Prometheus before
    ``labels``, and disappear when the shard leaves the worker. ``prometheus`` False keeps a
    metric out of Prometheus (a Java-only CloudWatch figure). A ``CALL`` is a latency
    histogram in Prometheus, or with ``failures`` (name, help) two counters instead:
    ``name`` counting successes and ``failures`` the others. ``java`` are its CloudWatch
    datums. A metric with a ``group`` is shown only once the group is enabled (the Spark
    micro-batch figures). ``worker_total`` metrics are also summed per worker in process,
    shards that left included (the progress line and the load meter read those sums).
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    per_shard: bool = False
    prometheus: bool = True
    failures: tuple[str, str] | None = None
    java: tuple[Java | JavaCall, ...] = ()
    group: str | None = None
    worker_total: bool = False


@dataclass(frozen=True)
class Dimensions:
    """What a scope's events are about: the worker (every field None) or one shard, by its
    lease key (Prometheus' ``shard_id``), its bare shard id and its serialised stream
    identifier (CloudWatch's ``ShardId`` and, in a multi-stream application, ``StreamId``)."""

    lease_key: str | None = None
    shard_id: str | None = None
    stream: str | None = None


class Handle(Protocol):
    """Where a bound metric's events go; a call site uses the method of the metric's kind."""

    def inc(self, amount: float = 1) -> None: ...

    def set(self, value: float) -> None: ...

    def observe(self, value: float) -> None: ...

    def call(self, seconds: float, ok: bool = True) -> None: ...


class BackendScope(Protocol):
    """A backend's side of one scope."""

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> Any | None:
        """A handle with the method of the metric's kind for these label values, or None
        when this backend does not record the metric (or the scope is closed). The
        metrics ``Scope`` keeps the handle and asks again only after ``remove``
        of that series, so a handle must stay valid until then."""
        ...

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        """Forget one series of the scope that no longer applies (a gauge of a state left)."""
        ...

    def close(self) -> None:
        """The scope's shard left the worker: drop what is kept for it."""
        ...


class Backend(Protocol):
    """A place metrics go (the Java ``MetricsFactory``)."""

    def scope(self, dimensions: Dimensions) -> BackendScope: ...

    def enable(self, group: str) -> None:
        """Show the metrics of ``group`` from now on."""
        ...
