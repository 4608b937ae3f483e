"""``--spark-batch`` workers are workers: their ``--metrics-port`` serves /metrics, /healthz
and /status, as any worker's does (it used to serve nothing); ``kclpy_spark_*`` series only
where Spark is fed; a decoder returning the wrong type is told what to return."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import pyarrow as pa
import pytest
from prometheus_client import generate_latest

from kclpy import KCLConfig
from kclpy.local import LocalEndpoint, free_port
from kclpy.metrics import Metrics
from kclpy.spark import BatchOptions, run_worker
from kclpy.spark.runner import _checked
from kclpy.worker import WorkerFatalError
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name


class NoSpark:
    """Stands in for a SparkSession: an empty stream never makes a batch."""

    def createDataFrame(self, table: Any) -> Any:
        raise AssertionError("no batch was expected")


def test_a_spark_batch_worker_serves_its_metrics_port(embedded_endpoint: LocalEndpoint) -> None:
    stream = unique_name("spark-metrics")
    create_stream(kinesis_client(embedded_endpoint.url), stream, 1)
    port = free_port()
    config = KCLConfig(application_name=unique_name("spark-metrics-app"), stream_name=stream,
                       region="us-east-1", kinesis_endpoint=embedded_endpoint.url,
                       dynamodb_endpoint=embedded_endpoint.url, metrics_port=port)
    pages: dict[str, str] = {}

    def probe(worker: Any) -> None:
        def run() -> None:
            try:
                if worker.wait_started(60):
                    for path in ("/metrics", "/healthz", "/status"):
                        with urllib.request.urlopen(
                                f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                            pages[path] = response.read().decode()
            finally:
                worker.shutdown()

        threading.Thread(target=run, daemon=True).start()

    run_worker(config, lambda df, batch_id: None, spark=NoSpark(), on_started=probe)
    assert "kclpy_leases_held" in pages["/metrics"]
    assert set(pages) == {"/metrics", "/healthz", "/status"}
    assert stream in pages["/status"]


def test_kclpy_spark_series_appear_only_on_workers_that_feed_spark() -> None:
    plain = Metrics()
    assert "kclpy_spark_" not in generate_latest(plain.registry).decode()
    spark = Metrics()
    spark.register_spark()
    spark.register_spark()
    assert "kclpy_spark_batches_total 0.0" in generate_latest(spark.registry).decode()


def test_a_decoder_returning_dicts_is_told_what_to_return() -> None:
    data = pa.array([b'{"a": 1}'], type=pa.binary())
    with pytest.raises(TypeError, match=r"returned a dict; it must return a pyarrow.Table"):
        _checked(lambda column: {"a": 1})(data)
    table = pa.table({"a": [1]})
    assert _checked(lambda column: table)(data) is table


def test_stop_when_caught_up_with_records_left_uncommitted_is_not_a_success(
        embedded_endpoint: LocalEndpoint) -> None:
    stream = unique_name("spark-undrained")
    kinesis = kinesis_client(embedded_endpoint.url)
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"a", b"b", b"c"])
    config = KCLConfig(application_name=unique_name("spark-undrained-app"),
                       stream_name=stream, region="us-east-1",
                       kinesis_endpoint=embedded_endpoint.url,
                       dynamodb_endpoint=embedded_endpoint.url,
                       initial_position="TRIM_HORIZON", stop_when_caught_up=True)

    def failing(column: pa.BinaryArray) -> pa.Table:
        raise ValueError("injected: the decoder always fails")

    options = BatchOptions(min_interval_s=0, max_interval_s=0.1, retry_base_s=0.05,
                           retry_cap_s=0.1, drain_timeout_s=1)
    with pytest.raises(WorkerFatalError, match=r"stopped with 3 record\(s\) not committed"):
        run_worker(config, lambda df, batch_id: None, spark=NoSpark(), decode=failing,
                   options=options)
