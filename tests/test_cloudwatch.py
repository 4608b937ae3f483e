"""The Java KCL's CloudWatch metrics: levels, dimensions, local aggregation, the bounded
queue, batching, throttling and errors (botocore's Stubber), and a worker at DETAILED over
real HTTP (kinesis-mock and moto's server) whose metrics are read back with GetMetricData."""

from __future__ import annotations

import datetime
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

import kclpy
from kclpy.cloudwatch import (
    COUNT,
    DETAILED,
    MILLISECONDS,
    SUMMARY,
    CloudWatchBackend,
    CloudWatchPublisher,
    parse_dimensions,
    parse_level,
)
from kclpy.config import KCLConfig, build_config, from_properties
from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from kclpy.local.endpoints import start_moto_server
from kclpy.metrics import Metrics
from kclpy.telemetry import Java, Kind, Metric
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name, wait_for
from tests.support.workers import running


class Recorder:
    """A CloudWatch client that keeps every PutMetricData request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def put_metric_data(self, **request: Any) -> None:
        self.requests.append(request)

    def datums(self) -> list[dict[str, Any]]:
        return [d for r in self.requests for d in r["MetricData"]]


def publisher(client: Any, **kwargs: Any) -> CloudWatchPublisher:
    kwargs.setdefault("sleep", lambda _: None)
    return CloudWatchPublisher(client, "app", **kwargs)


def dims(datum: dict[str, Any]) -> dict[str, str]:
    return {d["Name"]: d["Value"] for d in datum["Dimensions"]}


def test_points_are_aggregated_per_name_and_dimensions_into_statistic_sets() -> None:
    client = Recorder()
    cw = publisher(client)
    for value in (5, 15, 10):
        cw.record("ProcessTask", "RecordsProcessed", value, COUNT, SUMMARY, {"ShardId": "s0"})
    cw.record("ProcessTask", "RecordsProcessed", 7, COUNT, SUMMARY, {"ShardId": "s1"})
    assert cw.flush() == 2
    by_shard = {dims(d)["ShardId"]: d for d in client.datums()}
    assert by_shard["s0"]["StatisticValues"] == {
        "SampleCount": 3, "Sum": 30, "Minimum": 5, "Maximum": 15}
    assert dims(by_shard["s1"]) == {"Operation": "ProcessTask", "ShardId": "s1"}
    assert {r["Namespace"] for r in client.requests} == {"app"}
    assert cw.flush() == 0, "a flush sends what gathered since the last one"


def test_level_and_enabled_dimensions_filter_as_in_java() -> None:
    client = Recorder()
    cw = publisher(client, level=SUMMARY, enabled_dimensions=parse_dimensions("ShardId"))
    cw.record("RenewAllLeases", "RenewLease.Time", 3.0, MILLISECONDS, DETAILED,
              {"WorkerIdentifier": "w1"})
    cw.record("RenewAllLeases", "CurrentLeases", 4, COUNT, SUMMARY, {"WorkerIdentifier": "w1"})
    cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": "s0"})
    cw.flush()
    sent = {d["MetricName"]: dims(d) for d in client.datums()}
    assert sent == {"CurrentLeases": {"Operation": "RenewAllLeases"},
                    "RecordsProcessed": {"Operation": "ProcessTask", "ShardId": "s0"}}


def test_a_full_queue_drops_the_oldest_datum_and_counts_it() -> None:
    client, metrics = Recorder(), Metrics()
    cw = publisher(client, max_queue_size=3, on_event=metrics.cloudwatch_event)
    for shard in ("s0", "s1", "s2", "s3", "s4"):
        cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": shard})
    cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": "s4"})
    cw.flush()
    assert sorted(dims(d)["ShardId"] for d in client.datums()) == ["s2", "s3", "s4"]
    assert metrics.registry.get_sample_value(
        "kclpy_cloudwatch_datums_total", {"outcome": "dropped_queue_full"}) == 2
    assert metrics.registry.get_sample_value(
        "kclpy_cloudwatch_datums_total", {"outcome": "sent"}) == 3


def test_datums_go_out_twenty_a_request() -> None:
    client = Recorder()
    cw = publisher(client)
    for shard in range(45):
        cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": f"s{shard}"})
    assert cw.flush() == 45
    assert [len(r["MetricData"]) for r in client.requests] == [20, 20, 5]


def stubbed() -> tuple[Any, Stubber]:
    client = boto3.client("cloudwatch", region_name="us-east-1")
    return client, Stubber(client)


#: a per-shard counter with a label and a Java datum (no such metric is declared yet: the
#: backend must not depend on which ones are)
FETCH_ERRORS = Metric("test_fetch_errors", Kind.COUNTER, "Fetch errors by kind.", ("kind",),
                      per_shard=True, java=(Java("ProcessTask", "FetchErrors"),))


def statistics(total: float, count: int, low: float, high: float) -> dict[str, float]:
    return {"SampleCount": count, "Sum": total, "Minimum": low, "Maximum": high}


def test_a_labelled_counter_becomes_one_datum_per_label_set_with_its_labels_as_dimensions(
        ) -> None:
    """Before labels were dimensions, the three events became one datum (Sum 4) with
    neither label value in it."""
    client, stub = stubbed()
    shard = [{"Name": "Operation", "Value": "ProcessTask"},
             {"Name": "ShardId", "Value": "shardId-1"}]
    stub.add_response("put_metric_data", {}, {"Namespace": "app", "MetricData": [
        {"MetricName": "FetchErrors", "Unit": COUNT, "Timestamp": ANY,
         "Dimensions": [*shard, {"Name": "kind", "Value": "throttled"}],
         "StatisticValues": statistics(3, 2, 1, 2)},
        {"MetricName": "FetchErrors", "Unit": COUNT, "Timestamp": ANY,
         "Dimensions": [*shard, {"Name": "kind", "Value": "expired"}],
         "StatisticValues": statistics(1, 1, 1, 1)}]})
    cw = publisher(client)
    metrics = Metrics(backends=[CloudWatchBackend(cw, "w1", SUMMARY)])
    scope = metrics.shard("shardId-1", "shardId-1")
    scope.inc(FETCH_ERRORS, "throttled")
    scope.inc(FETCH_ERRORS, "expired")
    scope.inc(FETCH_ERRORS, "throttled", by=2)
    with stub:
        assert cw.flush() == 2
    stub.assert_no_pending_responses()


def test_labels_stay_dimensions_whatever_metrics_enabled_dimensions_leaves_off() -> None:
    client = Recorder()
    cw = publisher(client, enabled_dimensions=parse_dimensions("Operation"))
    Metrics(backends=[CloudWatchBackend(cw, "w1", SUMMARY)]).shard("s0", "s0").inc(
        FETCH_ERRORS, "expired")
    cw.flush()
    assert [dims(d) for d in client.datums()] == [{"Operation": "ProcessTask", "kind": "expired"}]


def test_label_dimensions_are_kept_within_cloudwatchs_limits() -> None:
    """CloudWatch refuses a request with a datum of more than 30 dimensions, or a blank or
    longer than 1024 or non-ASCII value; one such label would lose the request's other
    datums. botocore checks the lower bounds of a request (the Stubber goes through it)."""
    many = tuple(f"l{n:02}" for n in range(40))
    wide = Metric("test_wide", Kind.COUNTER, "Forty labels.", ("blank", "empty", "long", "odd",
                                                               "ShardId", *many),
                  per_shard=True, java=(Java("ProcessTask", "Wide"),))
    client, stub = stubbed()
    expected = [("Operation", "ProcessTask"), ("ShardId", "shardId-1"), ("long", "x" * 1024),
                ("odd", "na?ve?"), *((name, name.upper()) for name in many[:26])]
    stub.add_response("put_metric_data", {}, {"Namespace": "app", "MetricData": [
        {"MetricName": "Wide", "Unit": COUNT, "Timestamp": ANY,
         "Dimensions": [{"Name": n, "Value": v} for n, v in expected],
         "StatisticValues": statistics(1, 1, 1, 1)}]})
    cw = publisher(client)
    metrics = Metrics(backends=[CloudWatchBackend(cw, "w1", SUMMARY)])
    metrics.shard("shardId-1", "shardId-1").inc(
        wide, "  ", "", "x" * 2000, "na\u00efve\n", "not-the-shard",
        *(name.upper() for name in many))
    with stub:
        assert cw.flush() == 1
    stub.assert_no_pending_responses()


def test_throttling_is_retried_with_backoff_and_then_sent() -> None:
    client, stub = stubbed()
    stub.add_client_error("put_metric_data", "Throttling", http_status_code=400)
    stub.add_client_error("put_metric_data", "InternalFailure", http_status_code=500)
    stub.add_client_error("put_metric_data", "TooManyRequests", http_status_code=429)
    stub.add_response("put_metric_data", {}, {"Namespace": "app", "MetricData": ANY})
    metrics, waits = Metrics(), list[float]()
    cw = publisher(client, on_event=metrics.cloudwatch_event, sleep=waits.append)
    cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": "s0"})
    with stub:
        assert cw.flush() == 1
    stub.assert_no_pending_responses()
    assert len(waits) == 3 and all(0 <= w <= 5.0 for w in waits)
    failures = {kind: metrics.registry.get_sample_value(
        "kclpy_cloudwatch_request_failures_total", {"kind": kind})
        for kind in ("throttled", "error")}
    assert failures == {"throttled": 2, "error": 1}


def test_a_request_failing_every_attempt_drops_its_datums_and_counts_them(
        caplog: pytest.LogCaptureFixture) -> None:
    client, stub = stubbed()
    for _ in range(4):
        stub.add_client_error("put_metric_data", "ServiceUnavailable", http_status_code=503)
    metrics = Metrics()
    cw = publisher(client, on_event=metrics.cloudwatch_event)
    cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": "s0"})
    with stub, caplog.at_level("WARNING", logger="kclpy.cloudwatch"):
        assert cw.flush() == 0
    assert metrics.registry.get_sample_value(
        "kclpy_cloudwatch_datums_total", {"outcome": "dropped_failed"}) == 1
    # the warning says where the datums were going and why they did not get there
    assert client.meta.endpoint_url in caplog.text and "ServiceUnavailable" in caplog.text


def test_a_refused_request_is_not_retried() -> None:
    """A success waits behind the refusal: a retry would take it and send the datum. (With
    only the refusal queued, a retry's UnStubbedResponseError was swallowed by the retry
    loop and the test passed with retries forced on.)"""
    client, stub = stubbed()
    stub.add_client_error("put_metric_data", "AccessDenied", http_status_code=403)
    stub.add_response("put_metric_data", {}, {"Namespace": "app", "MetricData": ANY})
    waits: list[float] = []
    cw = publisher(client, sleep=waits.append)
    cw.record("ProcessTask", "RecordsProcessed", 1, COUNT, SUMMARY, {"ShardId": "s0"})
    with stub:
        assert cw.flush() == 0
    assert waits == []
    with pytest.raises(AssertionError):
        stub.assert_no_pending_responses()  # the success is still queued: never asked for


def test_levels_and_dimensions_are_validated_naming_the_option() -> None:
    assert (parse_level("Detailed"), parse_level("NONE")) == (DETAILED, 0)
    assert parse_dimensions("ALL") == parse_dimensions("ShardId,StreamId,WorkerIdentifier")
    base: dict[str, Any] = {"application_name": "a", "stream_name": "s"}
    with pytest.raises(ConfigError, match="metrics_level: 'verbose' is not one of"):
        KCLConfig(**base, metrics_level="verbose")
    values, labels = from_properties({"applicationName": "a", "streamName": "s",
                                      "metricsEnabledDimensions": "Operation,Shard"})
    with pytest.raises(ConfigError, match="metricsEnabledDimensions: unknown dimension"):
        build_config(values, labels)


@pytest.mark.integration
def test_a_worker_at_detailed_publishes_the_java_metrics_readable_with_get_metric_data(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("cw")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"r{n}".encode() for n in range(25)])
    app = unique_name("cw-app")
    # CloudWatch gets a server of its own: moto's GetMetricData drops the namespace filter
    # when a query names dimensions, so another test's RecordsProcessed for the same shard id
    # in the same minute was summed in (CI: 25 + 56)
    with start_moto_server() as cw_server:
        read_detailed_metrics(kinesis_mock, moto_server, cw_server, stream, app)


def read_detailed_metrics(kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
                          cw_server: LocalEndpoint, stream: str, app: str) -> None:
    config = KCLConfig(
        application_name=app, stream_name=stream, region="us-east-1", worker_id="cw-worker",
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        cloudwatch_endpoint=cw_server.url, initial_position="TRIM_HORIZON",
        metrics_level="detailed", metrics_buffer_time_ms=500, idle_time_between_reads_ms=100,
        # long enough that no renewal is late on a loaded machine: a lease lost and taken
        # back re-reads the shard, and RecordsProcessed then counts past the 25 written
        failover_time_ms=10_000)

    ledger = Ledger()
    worker = kclpy.Worker(config, lambda: RecordingProcessor(ledger))
    registry = worker.metrics.registry
    with running(worker):
        wait_for(lambda: registry.get_sample_value(
            "kclpy_records_processed_total", {"shard_id": "shardId-000000000000"}) == 25
            and registry.get_sample_value("kclpy_lease_renewals_total"), 60,
            "every record processed and a lease renewed")
    # the worker's shutdown sent what was left
    cloudwatch = boto3.client("cloudwatch", endpoint_url=cw_server.url, region_name="us-east-1")
    metrics = cloudwatch.list_metrics(Namespace=app)["Metrics"]
    named = {(m["MetricName"], tuple(sorted((d["Name"], d["Value"]) for d in m["Dimensions"])))
             for m in metrics}
    shard = (("Operation", "ProcessTask"), ("ShardId", "shardId-000000000000"))
    worker_dims = (("Operation", "RenewAllLeases"), ("WorkerIdentifier", "cw-worker"))
    for expected in (("RecordsProcessed", shard), ("DataBytesProcessed", shard),
                     ("MillisBehindLatest", shard), ("RecordProcessor.processRecords.Time", shard),
                     ("KinesisDataFetcher.getRecords.Success", shard),
                     ("CurrentLeases", worker_dims),
                     ("NumWorkers", (("Operation", "TakeLeases"),
                                     ("WorkerIdentifier", "cw-worker")))):
        assert expected in named, (expected, sorted(named))
    now = datetime.datetime.now(datetime.timezone.utc)
    result = cloudwatch.get_metric_data(
        MetricDataQueries=[{"Id": "records", "MetricStat": {"Metric": {
            "Namespace": app, "MetricName": "RecordsProcessed",
            "Dimensions": [{"Name": n, "Value": v} for n, v in shard]},
            "Period": 60, "Stat": "Sum"}}],
        StartTime=now - datetime.timedelta(minutes=10), EndTime=now + datetime.timedelta(minutes=1))
    assert sum(result["MetricDataResults"][0]["Values"]) == 25
