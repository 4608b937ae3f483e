"""The metrics interface (kclpy/telemetry.py, kclpy/metrics.py): one call per event, the
backends behind it, and a shard's series gone when the shard leaves the worker.

A third backend, kept in memory here and plugged in without touching any call site, sees
exactly what Prometheus sees during a real consume run; a handed-off shard disappears from
the old owner's /metrics over HTTP.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest

from kclpy import KCLConfig, Worker
from kclpy.cloudwatch import CloudWatchBackend
from kclpy.leases.load import LoadMeter, processed_by_lease
from kclpy.local import LocalEndpoint
from kclpy.metrics import (
    BATCH_MILLIS_BEHIND_LATEST,
    CATALOGUE,
    CHECKPOINTS,
    GET_RECORDS,
    LEASES_TAKEN,
    PROCESS_RECORDS,
    PROCESSOR_ERRORS,
    RECORDS_PROCESSED,
    RENEW_LEASE,
    SHARD_FAILURE,
    Metrics,
    Scope,
)
from kclpy.ops.server import serve_worker
from kclpy.progress import totals
from kclpy.telemetry import COUNT, DETAILED, MILLISECONDS, SUMMARY, Dimensions, Kind, Metric
from tests.support.datums import DatumSink
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)
from tests.support.workers import running

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Mirror:
    """A backend that keeps, in memory, what Prometheus would show for every event it is
    given: counter sums, gauge values, histogram counts and sums, series made on bind and
    removed with their shard. Nothing in kclpy knows it exists."""

    def __init__(self) -> None:
        self.series: Series = {}
        self.lock = threading.Lock()
        self.enabled: set[str] = set()
        #: lease key -> its series as they were when its scope closed
        self.closed: dict[str, list[Series]] = {}

    def scope(self, dimensions: Dimensions) -> _MirrorScope:
        return _MirrorScope(self, dimensions.lease_key)

    def enable(self, group: str) -> None:
        self.enabled.add(group)


class _MirrorScope:
    def __init__(self, mirror: Mirror, lease_key: str | None) -> None:
        self.mirror = mirror
        self.key = lease_key
        self.made: set[tuple[str, frozenset[tuple[str, str]]]] = set()
        self.is_closed = False

    def _names(self, metric: Metric, labels: tuple[str, ...]
               ) -> list[tuple[str, frozenset[tuple[str, str]]]]:
        names = (("shard_id",) if metric.per_shard else ()) + metric.labels
        values = ((self.key,) if metric.per_shard else ()) + labels
        tags = frozenset(zip(names, (str(v) for v in values), strict=True))
        base = "kclpy_" + metric.name
        if metric.kind is Kind.COUNTER:
            return [(base + "_total", tags)]
        if metric.kind is Kind.GAUGE:
            return [(base, tags)]
        if metric.kind is Kind.CALL and metric.failures is not None:
            return [(base + "_total", tags), ("kclpy_" + metric.failures[0] + "_total", tags)]
        return [(base + "_count", tags), (base + "_sum", tags)]

    def bind(self, metric: Metric, labels: tuple[str, ...]) -> _MirrorHandle | None:
        if not metric.prometheus or (metric.group and metric.group not in self.mirror.enabled):
            return None
        with self.mirror.lock:
            if self.is_closed and metric.per_shard:
                return None
            names = self._names(metric, labels)
            for name in names:
                self.mirror.series.setdefault(name, 0.0)
                if metric.per_shard:
                    self.made.add(name)
        return _MirrorHandle(self.mirror, metric, names)

    def remove(self, metric: Metric, labels: tuple[str, ...]) -> None:
        with self.mirror.lock:
            for name in self._names(metric, labels):
                self.mirror.series.pop(name, None)
                self.made.discard(name)

    def close(self) -> None:
        with self.mirror.lock:
            self.is_closed = True
            assert self.key is not None
            self.mirror.closed.setdefault(self.key, []).append(
                {name: self.mirror.series[name] for name in self.made})
            for name in self.made:
                del self.mirror.series[name]
            self.made.clear()


class _MirrorHandle:
    def __init__(self, mirror: Mirror, metric: Metric,
                 names: list[tuple[str, frozenset[tuple[str, str]]]]) -> None:
        self.mirror, self.metric, self.names = mirror, metric, names

    def _add(self, name: tuple[str, frozenset[tuple[str, str]]], value: float) -> None:
        with self.mirror.lock:
            if name in self.mirror.series:  # a series removed meanwhile stays removed
                self.mirror.series[name] += value

    def inc(self, amount: float = 1) -> None:
        self._add(self.names[0], amount)

    def set(self, value: float) -> None:
        with self.mirror.lock:
            if self.names[0] in self.mirror.series:
                self.mirror.series[self.names[0]] = value

    def observe(self, value: float) -> None:
        self._add(self.names[0], 1)
        self._add(self.names[1], value)

    def call(self, seconds: float, ok: bool = True) -> None:
        if self.metric.failures is not None:
            self._add(self.names[0 if ok else 1], 1)
        else:
            self.observe(seconds)


def prometheus_series(metrics: Metrics) -> Series:
    """What a scrape shows, as the mirror keeps it (no buckets, no ``_created``)."""
    found: Series = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def same_as_prometheus(metrics: Metrics, mirror: Mirror) -> bool:
    """Prometheus and the mirror agree; unlabelled series Prometheus shows from the start
    count as 0 in the mirror until an event makes them."""
    shown = prometheus_series(metrics)
    with mirror.lock:
        kept = dict(mirror.series)
    for name, value in shown.items():
        if name not in kept and not name[1] and value == 0:
            kept[name] = 0.0
    return all(abs(kept.get(name, -1.0) - value) < 1e-6 for name, value in shown.items()) \
        and kept.keys() == shown.keys()


# -- the interface, in process -------------------------------------------------------------


def test_a_closed_shard_loses_its_series_and_nothing_late_brings_them_back() -> None:
    metrics = Metrics()
    shard = metrics.shard("shard-1")
    bound = shard.bind(RECORDS_PROCESSED)
    bound.inc(5)
    shard.inc(PROCESSOR_ERRORS, "initialize")
    metrics.inc(LEASES_TAKEN)
    metrics.close_shard("shard-1")
    bound.inc(5)  # a thread still finishing
    shard.inc(CHECKPOINTS)
    shown = prometheus_series(metrics)
    assert not any(("shard_id", "shard-1") in labels for _, labels in shown), shown
    assert shown[("kclpy_leases_taken_total", frozenset())] == 1
    # what the shard processed stays in the worker's totals, the late work too
    assert totals(metrics).records == 10
    assert processed_by_lease(metrics) == {"shard-1": (10.0, 0.0)}


def test_a_shard_opened_again_while_its_old_scope_closes_keeps_its_series() -> None:
    """A scope keeps its bound handles: a new scope of the same shard that bound a series
    the closing one then removed would record into a child gone from the registry."""
    metrics = Metrics()
    metrics.implicit_shards = False
    old = metrics.open_shard("shard-1")
    old.inc(CHECKPOINTS)
    closing, go_on = threading.Event(), threading.Event()
    close = old.close

    def close_slowly() -> None:
        closing.set()
        assert go_on.wait(10)
        close()

    old.close = close_slowly  # type: ignore[method-assign]
    leaving = threading.Thread(target=metrics.close_shard, args=("shard-1",))
    leaving.start()
    assert closing.wait(10)
    opened: list[Scope] = []

    def open_again() -> None:
        opened.append(metrics.open_shard("shard-1"))
        opened[0].inc(CHECKPOINTS)

    coming = threading.Thread(target=open_again)
    coming.start()
    coming.join(0.5)  # gives the unserialised open its chance to bind before the removal
    go_on.set()
    leaving.join(10)
    coming.join(10)
    opened[0].inc(CHECKPOINTS)
    series = ("kclpy_checkpoints_total", frozenset({("shard_id", "shard-1")}))
    assert prometheus_series(metrics).get(series) == 2


def test_a_worker_records_only_the_shards_it_opened() -> None:
    metrics = Metrics()
    metrics.implicit_shards = False
    metrics.shard("not-held").inc(CHECKPOINTS)
    metrics.open_shard("held").inc(CHECKPOINTS)
    shown = prometheus_series(metrics)
    assert shown[("kclpy_checkpoints_total", frozenset({("shard_id", "held")}))] == 1
    assert not any(("shard_id", "not-held") in labels for _, labels in shown)
    assert metrics.open_shards() == ["held"]


def test_a_scope_binds_each_series_once_and_again_only_after_its_removal() -> None:
    mirror = Mirror()
    metrics = Metrics(backends=[mirror])
    shard = metrics.shard("shard-1")
    assert shard.bind(PROCESSOR_ERRORS, "initialize") is shard.bind(PROCESSOR_ERRORS,
                                                                    "initialize")
    shard.set(SHARD_FAILURE, 1, "ValueError")
    shard.remove(SHARD_FAILURE, "ValueError")
    shard.set(SHARD_FAILURE, 1, "ValueError")  # the same state entered again
    series = ("kclpy_shard_failure", frozenset({("shard_id", "shard-1"),
                                                ("error_type", "ValueError")}))
    assert prometheus_series(metrics)[series] == 1
    assert mirror.series[series] == 1


def test_a_backend_added_after_a_bind_sees_the_next_events_of_the_same_series() -> None:
    metrics = Metrics()
    metrics.inc(LEASES_TAKEN)
    mirror = Mirror()
    metrics.add_backend(mirror)
    metrics.inc(LEASES_TAKEN)
    assert mirror.series[("kclpy_leases_taken_total", frozenset())] == 1
    assert prometheus_series(metrics)[("kclpy_leases_taken_total", frozenset())] == 2


def test_cloudwatch_datums_come_from_the_same_events_at_the_configured_level() -> None:
    sink = DatumSink()
    metrics = Metrics(backends=[CloudWatchBackend(sink, "w1", SUMMARY)])
    shard = metrics.shard("acct:s:1:shardId-1", "shardId-1", "acct:s:1")
    shard.call(PROCESS_RECORDS, 0.25, True)
    shard.call(GET_RECORDS, 0.1, True)  # DETAILED: not at SUMMARY
    shard.set(BATCH_MILLIS_BEHIND_LATEST, 40)
    metrics.call(RENEW_LEASE, 0.01, False)  # DETAILED too
    dims = {"ShardId": "shardId-1", "StreamId": "acct:s:1"}
    assert sink.datums == [
        ("ProcessTask", "RecordProcessor.processRecords.Time", 250.0, MILLISECONDS, SUMMARY,
         dims),
        ("ProcessTask", "Success", 1, COUNT, SUMMARY, dims),
        ("ProcessTask", "Time", 250.0, MILLISECONDS, SUMMARY, dims),
        ("ProcessTask", "MillisBehindLatest", 40, MILLISECONDS, SUMMARY, dims),
        ("ApplicationTracker", "MillisBehindLatest", 40, MILLISECONDS, SUMMARY, None),
    ]
    sink.datums.clear()
    detailed = Metrics(backends=[CloudWatchBackend(sink, "w1", DETAILED)])
    detailed.call(RENEW_LEASE, 0.01, False)
    assert sink.datums == [
        ("RenewAllLeases", "RenewLease.Success", 0, COUNT, DETAILED, {"WorkerIdentifier": "w1"}),
        ("RenewAllLeases", "RenewLease.Time", 10.0, MILLISECONDS, DETAILED,
         {"WorkerIdentifier": "w1"})]
    assert detailed.registry.get_sample_value("kclpy_lease_renew_failures_total") == 1


def test_every_metric_is_declared_once_under_its_own_name() -> None:
    names = [m.name for m in CATALOGUE] + [m.failures[0] for m in CATALOGUE if m.failures]
    assert len(names) == len(set(names))


def test_the_mirror_follows_prometheus_through_every_event_kind() -> None:
    mirror = Mirror()
    metrics = Metrics(backends=[mirror])
    shard = metrics.shard("s")
    shard.bind(RECORDS_PROCESSED).inc(3)
    shard.call(PROCESS_RECORDS, 0.5)
    shard.inc(PROCESSOR_ERRORS, "initialize")
    metrics.call(RENEW_LEASE, 0.1, False)
    assert same_as_prometheus(metrics, mirror)
    metrics.close_shard("s")
    assert same_as_prometheus(metrics, mirror)
    assert mirror.closed["s"][0][
        ("kclpy_records_processed_total", frozenset({("shard_id", "s")}))] == 3


# -- a real worker -------------------------------------------------------------------------


def config(endpoint: LocalEndpoint, stream: str, application: str, worker_id: str
           ) -> KCLConfig:
    return KCLConfig(
        application_name=application, stream_name=stream, region="us-east-1",
        worker_id=worker_id, kinesis_endpoint=endpoint.url, dynamodb_endpoint=endpoint.url,
        initial_position="TRIM_HORIZON", failover_time_ms=3000,
        idle_time_between_reads_ms=500, shutdown_grace_ms=2000)


@pytest.fixture
def stream(embedded_endpoint: LocalEndpoint) -> Iterator[str]:
    name = unique_name("metrics")
    create_stream(kinesis_client(embedded_endpoint.url), name, 2)
    yield name


@pytest.mark.integration
def test_a_third_backend_sees_exactly_what_prometheus_sees_during_a_consume_run(
        embedded_endpoint: LocalEndpoint, stream: str) -> None:
    put_plain(kinesis_client(embedded_endpoint.url), stream,
              [f"r{n}".encode() for n in range(200)])
    mirror = Mirror()
    metrics = Metrics(backends=[mirror])
    ledger = Ledger()
    worker = Worker(config(embedded_endpoint, stream, unique_name("app"), "w"),
                    lambda: RecordingProcessor(ledger), metrics=metrics)
    with running(worker):
        wait_for(lambda: totals(metrics).records >= 200, 60, "every record processed")
        # the worker keeps polling and renewing: compare between two events
        wait_for(lambda: same_as_prometheus(metrics, mirror), 30,
                 "the mirror and Prometheus agree while the worker runs")
        held = metrics.open_shards()
        assert len(held) == 2
        shown = prometheus_series(metrics)
        assert sum(v for (name, _), v in shown.items()
                   if name == "kclpy_records_processed_total") == 200
    # shut down: every shard left, so no per-shard series anywhere, and the totals stay
    assert same_as_prometheus(metrics, mirror)
    assert not any(dict(labels).get("shard_id") for _, labels in prometheus_series(metrics))
    assert sorted(mirror.closed) == held
    assert sum(v for key in held for final in mirror.closed[key]
               for (name, _), v in final.items()
               if name == "kclpy_records_processed_total") == 200
    assert totals(metrics).records == 200


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text: str = answer.read().decode()
    return text


@pytest.mark.integration
def test_a_handed_off_shard_leaves_the_old_owners_metrics_over_http(
        embedded_endpoint: LocalEndpoint, stream: str) -> None:
    put_plain(kinesis_client(embedded_endpoint.url), stream,
              [f"r{n}".encode() for n in range(100)])
    application = unique_name("app")
    ledger = Ledger()
    first = Worker(config(embedded_endpoint, stream, application, "a"),
                   lambda: RecordingProcessor(ledger))
    server = serve_worker(first, lag_window_s=None)
    try:
        with running(first):
            wait_for(lambda: totals(first.metrics).records >= 100
                     and len(first.status()["held_leases"]) == 2, 60,
                     "a holding both shards, every record processed")
            before = scrape(server.url)
            shards = sorted(first.status()["held_leases"])
            assert all(f'shard_id="{s}"' in before for s in shards)
            second = Worker(config(embedded_endpoint, stream, application, "b"),
                            lambda: RecordingProcessor(ledger))
            with running(second):
                wait_for(lambda: len(first.status()["held_leases"]) == 1
                         and len(second.status()["held_leases"]) == 1
                         and len(first.metrics.open_shards()) == 1, 60,
                         "one shard handed off to b")
                kept = first.status()["held_leases"][0]
                moved = next(s for s in shards if s != kept)
                after = scrape(server.url)
                assert f'shard_id="{moved}"' not in after, "the moved shard's series stayed"
                assert f'kclpy_records_processed_total{{shard_id="{kept}"}}' in after
                assert "kclpy_leases_held 1.0" in after
                # nothing a's processors did is forgotten by its own totals
                assert totals(first.metrics).records >= 100
    finally:
        server.stop()


@pytest.mark.integration
def test_a_shard_retaken_by_the_same_worker_restarts_its_series_not_the_workers_totals(
        embedded_endpoint: LocalEndpoint) -> None:
    """Prometheus may restart a counter whose series was removed and made again (``rate()``
    takes a restart in its stride); what the worker adds up itself - the progress line's
    totals and the load meter's per-lease counters - must not go backwards."""
    kinesis = kinesis_client(embedded_endpoint.url)
    stream = unique_name("retake")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"a{n}".encode() for n in range(30)])
    cfg = config(embedded_endpoint, stream, unique_name("app"), "w")
    ledger = Ledger()
    metrics = Metrics()
    ticks = iter(range(10))
    # one tick per sample and a whole weight on the last interval: its rate is its records
    meter = LoadMeter("w", lambda: processed_by_lease(metrics), clock=lambda: next(ticks),
                      ema_alpha=1.0)

    def counted() -> bool:
        return totals(metrics).records == len(ledger.records)

    with running(Worker(cfg, lambda: RecordingProcessor(ledger), metrics=metrics)):
        wait_for(lambda: len(ledger.records) >= 30 and counted(), 60, "the first 30 processed")
        [key] = metrics.open_shards()
        before = totals(metrics)
        assert meter.sample({key}).records_per_s == before.records
        table = dynamodb_client(embedded_endpoint.url)
        item = table.get_item(TableName=cfg.lease_table_name, Key={"leaseKey": {"S": key}},
                              ConsistentRead=True)["Item"]
        table.update_item(
            TableName=cfg.lease_table_name, Key={"leaseKey": {"S": key}},
            UpdateExpression="SET leaseOwner = :thief, leaseCounter = leaseCounter + :one",
            ConditionExpression="leaseCounter = :c",
            ExpressionAttributeValues={":thief": {"S": "thief"}, ":one": {"N": "1"},
                                       ":c": item["leaseCounter"]})
        wait_for(lambda: (key, "lease_lost") in ledger.events, 30, "the lease lost")
        # the thief never renews: after the failover time the worker takes the shard back
        wait_for(lambda: ledger.events.count((key, "lease_lost")) == 1
                 and sum(1 for k, e in ledger.events
                         if k == key and e.startswith("initialize")) == 2, 60,
                 "the shard retaken by the same worker")
        processed_once = len(ledger.records)
        put_plain(kinesis, stream, [f"b{n}".encode() for n in range(20)])
        wait_for(lambda: len(ledger.records) >= processed_once + 20 and counted(), 60,
                 "the next 20 processed")
        after = totals(metrics)
        series = metrics.registry.get_sample_value("kclpy_records_processed_total",
                                                   {"shard_id": key})
        assert series is not None and series < after.records, "one series across two tenures"
        assert after.records == len(ledger.records) > before.records
        assert processed_by_lease(metrics) == {key: (after.records, after.bytes)}
        assert meter.sample({key}).records_per_s == after.records - before.records
