"""Enhanced fan-out retrieval over real HTTP against kinesis-mock (HTTP/1.1; it omits the
``initial-response`` event AWS sends first): the consumer is registered once, every record
(plain and KPL) reaches the processor once and in order through the same path as polling,
a restarted worker resumes from its checkpoint, and a split and a merge end the parents
before their children, as polling does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kclpy.arguments import parse_worker_args
from kclpy.config import KCLConfig, build_config, from_properties
from kclpy.errors import ConfigError
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.retrieval.fanout import FanOutSource, classify_subscribe
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.registration import list_consumers
from kclpy.retrieval.source import ShardAddress
from kclpy.retry import CONNECTION, IN_USE, THROTTLED, Backoff
from tests.support.e2e import (
    EndToEnd,
    assert_exactly_once,
    assert_in_order,
    produce_mixed,
    running,
    stream_active,
)
from tests.support.eventstream_server import Event, Script, Step, eventstream_server
from tests.support.faultproxy import FaultProxy
from tests.support.recording import Ledger
from tests.support.streams import session
from tests.support.tls import loopback_certificate
from tests.support.waiting import wait_for


def fanout_config(e2e: EndToEnd, stream: str, **overrides: Any) -> KCLConfig:
    return e2e.config(stream, retrieval_mode="FANOUT", retry_backoff_ms=200,
                      max_describe_stream_consumer_retries=50, **overrides)


def fanout_pipeline(client: Any, *, metrics: Metrics,
                    sleep: Callable[[float], None] | None = None,
                    **options: Any) -> ShardPipeline:
    """A pipeline of shard 0 of stream ``s`` from TRIM_HORIZON, fed by a fan-out source
    through a made-up consumer; ``options`` are the source's."""
    source = FanOutSource(
        client, ShardAddress("shardId-000000000000", stream_name="s"),
        "arn:aws:kinesis:us-east-1:1:stream/s/consumer/a:1", metrics=metrics, **options)
    return ShardPipeline(source, Position("TRIM_HORIZON"), metrics=metrics, sleep=sleep)


def test_retrieval_modes_are_checked_naming_the_option() -> None:
    base: dict[str, Any] = {"application_name": "a", "stream_name": "s"}
    assert KCLConfig(**base, retrieval_mode="FANOUT").fan_out
    assert not KCLConfig(**base).fan_out
    with pytest.raises(ConfigError, match=r"retrieval_mode: 'DEFAULT'.*properties files"):
        KCLConfig(**base, retrieval_mode="DEFAULT")
    with pytest.raises(ConfigError, match="consumer_arn"):
        KCLConfig(**base, consumer_arn="arn:aws:kinesis:us-east-1:1:stream/s")


@pytest.mark.parametrize(("written", "mode"), [
    ({}, "fanout"), ({"retrievalMode": "DEFAULT"}, "fanout"),
    ({"idleTimeBetweenReadsInMillis": "200"}, "polling"), ({"maxRecords": "500"}, "polling"),
    ({"retrievalMode": "POLLING"}, "polling"),
    ({"retrievalMode": "FANOUT", "maxRecords": "500"}, "fanout")])
def test_properties_files_get_the_java_daemons_retrieval_mode(
        written: dict[str, str], mode: str) -> None:
    values, labels = from_properties({"applicationName": "a", "streamName": "s", **written})
    config = build_config(values, labels)
    assert config.retrieval_mode.lower() == mode


@pytest.mark.parametrize("written", [{}, {"retrievalMode": "DEFAULT"}])
@pytest.mark.parametrize("where", ["flag", "environment"])
def test_a_retrieval_mode_set_by_flag_or_environment_wins_over_the_java_default(
        written: dict[str, str], where: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Java daemon's fan-out default is what a file without a retrieval mode implies, not
    a setting: a flag or ``KCLPY_RETRIEVAL_MODE`` says polling, and the worker polls, without
    the warning that it reads with fan-out."""
    properties = tmp_path / "app.properties"
    properties.write_text("".join(f"{k} = {v}\n" for k, v in
                                  {"applicationName": "a", "streamName": "s",
                                   "executableName": "app.py", **written}.items()))
    argv = ["--properties", str(properties)]
    if where == "flag":
        argv += ["--retrieval-mode", "polling"]
    else:
        monkeypatch.setenv("KCLPY_RETRIEVAL_MODE", "polling")
    with caplog.at_level(logging.WARNING):
        config, _ = parse_worker_args(argv)
    assert config.retrieval_mode.lower() == "polling"
    assert not [r for r in caplog.records if "fan-out" in r.getMessage()]


def test_subscription_failures_are_classified_for_backoff() -> None:
    from botocore.exceptions import ClientError
    from urllib3.exceptions import ProtocolError

    def error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": ""}}, "SubscribeToShard")

    assert classify_subscribe(error("ResourceInUseException")) == IN_USE
    assert classify_subscribe(error("LimitExceededException")) == THROTTLED
    assert classify_subscribe(ProtocolError("connection broken")) == CONNECTION
    assert classify_subscribe(error("ResourceNotFoundException")) is None


@pytest.mark.parametrize("transport", ["http1.1", "h2c"])
def test_exception_events_and_damaged_frames_are_retried_and_counted(transport: str) -> None:
    """The exception events a SubscribeToShard stream carries for transient trouble
    (``InternalFailureException``, ``KMSThrottlingException``, ``ResourceInUseException``)
    and a frame whose checksum does not match are retried as the Java KCL does: each costs
    one new subscription after the last record handled, is counted by kind, and the fetch
    thread goes on to the shard's end with every record once, in order."""
    script = Script([
        Step([Event([("100", b"a")], "100")], then="exception",
             error_code="InternalFailureException"),
        Step([Event([("101", b"b")], "101")], then="exception",
             error_code="KMSThrottlingException"),
        Step([Event([("102", b"c")], "102")], then="exception",
             error_code="ResourceInUseException"),
        Step([Event([("103", b"d")], "103")], then="corrupt"),
        Step([Event([("104", b"e")], None)]),
    ])
    metrics = Metrics()
    with eventstream_server(script, http2=transport == "h2c") as url:
        client = session().client("kinesis", endpoint_url=url)
        fetcher = fanout_pipeline(
            client, metrics=metrics, backoff=Backoff(0.01, 0.05), shard_end_probe_s=3600,
            http_version="1.1" if transport == "http1.1" else "2")
        fetcher.start()
        try:
            delivered: list[bytes] = []
            while True:
                result = fetcher.get(timeout=30)
                assert result is not None, "the fetch thread stopped before the shard's end"
                delivered.extend(r.binary_data for r in result.records)
                if result.shard_end:
                    break
        finally:
            fetcher.stop()
    assert delivered == [b"a", b"b", b"c", b"d", b"e"]
    assert [r["StartingPosition"].get("SequenceNumber") for r in script.requests] == [
        None, "100", "101", "102", "103"]

    def count(outcome: str) -> float | None:
        return metrics.registry.get_sample_value(
            "kclpy_subscriptions_total", {"outcome": outcome})

    assert (count("failed_server_error"), count("failed_throttled"), count("failed_in_use")
            ) == (2, 1, 1)


@pytest.mark.integration
def test_fan_out_delivers_every_record_once_in_order_and_resumes_from_checkpoints(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("efo", 3)
    first = produce_mixed(kinesis, stream, "a", plain=150, aggregates=6, per_aggregate=20)
    config = fanout_config(e2e, stream)
    with running(config, ledger) as worker:
        wait_for(lambda: len(ledger.records) >= len(first), 120, "all records processed")
        live = produce_mixed(kinesis, stream, "live", plain=30, aggregates=1, per_aggregate=10)
        wait_for(lambda: len(ledger.records) >= len(first) + len(live), 60,
                 "records written while subscribed")
        shards = worker.status()["shards"]
        assert {s["retrieval"]["mode"] for s in shards.values()} == {"fanout"}
        assert all(s["retrieval"]["subscription_age_s"] is not None for s in shards.values())
        registry = worker.metrics.registry
        assert registry.get_sample_value(
            "kclpy_subscriptions_total", {"outcome": "opened"}) == len(shards)
        for shard_id in shards:
            assert (registry.get_sample_value(
                "kclpy_subscription_events_total", {"shard_id": shard_id}) or 0) > 0
    later = produce_mixed(kinesis, stream, "later", plain=60, aggregates=2, per_aggregate=10)
    with running(config.replace(worker_id="second-worker"), ledger):
        wait_for(lambda: len(ledger.records) >= len(first + live + later), 120,
                 "the restarted worker caught up")
    assert_exactly_once(ledger, first + live + later)
    assert_in_order(ledger)
    assert {r[2] for r in ledger.records if r[3].startswith(b"a-kpl-")} == set(range(20))
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"]
    consumers = list_consumers(kinesis, arn)
    assert [c["ConsumerName"] for c in consumers] == [config.application_name], \
        "one consumer, named after the application, shared by both workers"


@pytest.mark.integration
def test_fan_out_ends_split_and_merged_parents_before_their_children(
        e2e: EndToEnd, ledger: Ledger) -> None:
    kinesis = e2e.kinesis
    stream = e2e.stream("efo-reshard", 2)
    expected = produce_mixed(kinesis, stream, "before", plain=80, aggregates=2, per_aggregate=10)
    with running(fanout_config(e2e, stream), ledger):
        wait_for(lambda: len(ledger.records) >= len(expected), 60, "processing started")
        shards = kinesis.list_shards(StreamName=stream)["Shards"]
        low, high = (int(shards[0]["HashKeyRange"][k]) for k in ("StartingHashKey",
                                                                "EndingHashKey"))
        kinesis.split_shard(StreamName=stream, ShardToSplit=shards[0]["ShardId"],
                            NewStartingHashKey=str((low + high) // 2))
        wait_for(lambda: stream_active(kinesis, stream), 30, "split done")
        expected += produce_mixed(kinesis, stream, "split", plain=80, aggregates=2,
                                  per_aggregate=10)
        wait_for(lambda: len(ledger.records) >= len(expected), 120, "all processed")
    assert_exactly_once(ledger, expected)
    assert_in_order(ledger)
    ended = {shard for shard, name in ledger.events if name == "shard_ended"}
    assert ended == {shards[0]["ShardId"]}
    order = [r[0] for r in ledger.records]
    parent_last = max(i for i, s in enumerate(order) if s == shards[0]["ShardId"])
    children = {s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]
                if s.get("ParentShardId") == shards[0]["ShardId"]}
    assert len(children) == 2
    assert all(i > parent_last for i, s in enumerate(order) if s in children)


def test_start_up_looks_each_stream_up_once_and_registers_by_its_arn(
        e2e: EndToEnd, ledger: Ledger) -> None:
    """The stream's DescribeStreamSummary at start-up also gives registration its ARN, so a
    fleet starting together does not spend a second call per worker on it (the operation
    allows 20 a second per account)."""
    kinesis = e2e.kinesis
    stream = e2e.stream("efo-lookup", 1)
    expected = produce_mixed(kinesis, stream, "l", plain=10, aggregates=1, per_aggregate=5)
    with FaultProxy(e2e.kinesis_url) as proxy:
        config = fanout_config(e2e, stream).replace(
            kinesis_endpoint=proxy.url)
        with running(config, ledger):
            wait_for(lambda: len(ledger.records) >= len(expected), 60, "all records processed")
        assert proxy.requests("DescribeStreamSummary") == 1
        assert proxy.requests("RegisterStreamConsumer") == 1
    assert_exactly_once(ledger, expected)


@pytest.mark.parametrize("transport", ["http1.1", "h2c", "h2-tls"])
def test_a_subscription_survives_drops_refusals_and_throttles_and_ends_at_shard_end(
        transport: str, tmp_path: Path) -> None:
    """Against a scripted endpoint, over HTTP/1.1, h2c and HTTP/2 over TLS (a throw-away CA
    given as the client's ``verify``, as ``AWS_CA_BUNDLE`` would): a connection cut
    mid-frame, an error answer (ResourceInUseException), an exception event
    (LimitExceededException), then the shard's end with its children. Every record arrives
    once, in order, and each new subscription starts after the last event's continuation."""
    child = {"ShardId": "shardId-000000000001", "ParentShards": ["shardId-000000000000"],
             "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": "10"}}
    script = Script([
        Step([Event([("100", b"a"), ("101", b"b")], "101"), Event([("102", b"c")], "102")],
             then="drop"),
        Step(then="error", error_code="ResourceInUseException"),
        Step([Event([("103", b"d")], "103")], then="exception",
             error_code="LimitExceededException"),
        Step([Event([], "103"), Event([("104", b"e")], None, child_shards=[child])]),
    ])
    metrics = Metrics()
    certificate = loopback_certificate(tmp_path)
    tls = certificate.server_context() if transport == "h2-tls" else None
    with eventstream_server(script, http2=transport != "http1.1", tls=tls) as url:
        client = session().client("kinesis", endpoint_url=url,
                                  verify=str(certificate.cert_path) if tls else None)
        fetcher = fanout_pipeline(
            client, metrics=metrics, sleep=lambda _: None, shard_end_probe_s=3600,
            http_version="1.1" if transport == "http1.1" else "auto" if tls else "2")
        results = [fetcher.fetch_once() for _ in range(6)]
    delivered = [r for result in results if result is not None for r in result.records]
    assert [r.binary_data for r in delivered] == [b"a", b"b", b"c", b"d", b"e"]
    ended = [result for result in results if result is not None and result.shard_end]
    assert len(ended) == 1 and [c.shard_id for c in ended[0].child_shards] == [
        "shardId-000000000001"]
    assert [r["StartingPosition"] for r in script.requests] == [
        {"Type": "TRIM_HORIZON"},
        {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": "102"},
        {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": "102"},
        {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": "103"},
    ]
    outcomes = {outcome: metrics.registry.get_sample_value(
        "kclpy_subscriptions_total", {"outcome": outcome})
        for outcome in ("opened", "renewed", "failed_connection", "failed_in_use",
                        "failed_throttled")}
    assert outcomes == {"opened": 1, "renewed": 2, "failed_connection": 1, "failed_in_use": 1,
                        "failed_throttled": 1}


def test_an_untrusted_certificate_is_a_counted_connection_failure_naming_the_cause(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint's certificate is not in the trust store the client was given: every
    attempt fails the TLS handshake, is counted and logged with its cause, and is retried
    with backoff (a rotated certificate or trust store heals without a restart)."""
    script = Script([Step([Event([("100", b"never")], None)])] * 5)
    server_cert = loopback_certificate(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    untrusted_ca = loopback_certificate(other)
    metrics = Metrics()
    with eventstream_server(script, tls=server_cert.server_context()) as url:
        client = session().client("kinesis", endpoint_url=url,
                                  verify=str(untrusted_ca.cert_path))
        fetcher = fanout_pipeline(client, metrics=metrics, backoff=Backoff(0.01, 0.05),
                                  shard_end_probe_s=3600)
        fetcher.start()
        try:
            wait_for(lambda: (metrics.registry.get_sample_value(
                "kclpy_subscriptions_total", {"outcome": "failed_connection"}) or 0) >= 2,
                30, "handshake failures counted")
        finally:
            fetcher.stop()
    assert script.requests == [], "no request got past the handshake"
    assert any("CERTIFICATE_VERIFY_FAILED" in r.getMessage() for r in caplog.records
               if "SubscribeToShard" in r.getMessage())
