"""Lag you can alert on: the status enum gauges, the webhook (over real HTTP, with a receiver
started here), and the alert rules docs/operations.md gives."""

from __future__ import annotations

import base64
import contextlib
import logging
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client import CollectorRegistry

from kclpy import Worker
from kclpy.config import build_config
from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.ops import serve_worker
from kclpy.ops.lag import NO_LAG, Lag, LagAlerts, Observation, ShardEvaluation, ShardStatus
from kclpy.ops.monitor import exported_names
from kclpy.ops.webhook import Webhook, redacted
from tests.support.e2e import worker_config
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.scrape import scrape
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.webhooks import Receiver, receiving
from tests.support.workers import running

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook receiver whose first POST fails (500): the webhook must retry it."""
    with receiving(fail=1) as server:
        yield server


def evaluation(status: ShardStatus, lag: Lag = NO_LAG) -> ShardEvaluation:
    return ShardEvaluation(status, f"because {status.value}", 1.0,
                           Observation(time=0.0, checkpoint="1", sub_sequence_number=0,
                                       lag=lag))


def gauge(metrics: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_status_gauges_and_one_event_per_change() -> None:
    metrics = Metrics(CollectorRegistry())
    events: list[dict[str, Any]] = []
    alerts = LagAlerts(metrics, "app", events.append, wall_clock=lambda: 1.5)
    alerts.publish({"s-0": evaluation(ShardStatus.OK), "s-1": evaluation(ShardStatus.OK)})
    assert events == []  # starting OK is no change worth a page
    assert gauge(metrics, "kclpy_application_lag_status", {"status": "OK"}) == 1
    behind = Lag(records=7, records_exact=True, millis=9000)
    alerts.publish({"s-0": evaluation(ShardStatus.OK),
                    "s-1": evaluation(ShardStatus.STOP, behind)})
    assert gauge(metrics, "kclpy_shard_lag_status", {"shard_id": "s-1", "status": "STOP"}) == 1
    assert gauge(metrics, "kclpy_shard_lag_status", {"shard_id": "s-1", "status": "OK"}) == 0
    assert gauge(metrics, "kclpy_application_lag_status", {"status": "ERR"}) == 1
    assert gauge(metrics, "kclpy_lag_max_millis", {}) == 9000
    assert gauge(metrics, "kclpy_lag_total_records", {}) == 7
    assert [(e["shard_id"], e["previous_status"], e["status"]) for e in events] == [
        ("s-1", "OK", "STOP"), (None, "OK", "ERR")]
    assert events[0] == {"application": "app", "shard_id": "s-1", "status": "STOP",
                         "previous_status": "OK", "reason": "because STOP", "time_ms": 1500,
                         "millis_behind": 9000, "records_behind": 7}
    alerts.publish({"s-0": evaluation(ShardStatus.OK), "s-1": evaluation(ShardStatus.STOP)})
    assert len(events) == 2  # unchanged: nothing sent
    alerts.publish({"s-0": evaluation(ShardStatus.OK)})  # s-1 moved to another worker
    assert gauge(metrics, "kclpy_shard_lag_status", {"shard_id": "s-1", "status": "STOP"}) is None
    assert events[-1]["status"] == "OK" and events[-1]["shard_id"] is None


def test_the_webhook_retries_authenticates_and_never_logs_the_credentials(
        receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://alice:s3cret@127.0.0.1:{receiver.port}/hooks/kclpy?token=t0ken"
    assert redacted(url) == f"http://127.0.0.1:{receiver.port}/hooks/kclpy"
    outcomes: list[str] = []
    hook = Webhook(url, backoff_s=0.01, max_backoff_s=0.05, on_result=outcomes.append)
    caplog.set_level(logging.DEBUG)
    try:
        hook.send({"status": "STOP"})
        wait_for(lambda: receiver.posts, 10, "the event delivered")
    finally:
        hook.stop()
    ((headers, document),) = receiver.posts
    assert document == {"status": "STOP"}
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert outcomes == ["retried", "sent"]
    assert "s3cret" not in caplog.text and "t0ken" not in caplog.text
    assert "retrying" in caplog.text
    with pytest.raises(ValueError, match="not an http") as info:
        Webhook("file://u:s3cret@host/etc/passwd")
    assert "s3cret" not in str(info.value)


@pytest.mark.integration
def test_a_worker_posts_its_lag_status_changes_and_exports_the_gauges(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, receiver: Receiver) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("alerts")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"r{i}".encode() for i in range(20)])
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    ledger = Ledger()
    worker = Worker(config, lambda: RecordingProcessor(ledger, checkpoint_every_batch=False))
    url = f"http://127.0.0.1:{receiver.port}/lag"
    with serve_worker(worker, lag_window_s=1.0, lag_interval_s=0.2, lag_webhook=url) as server, \
            running(worker):
        wait_for(lambda: any(d["status"] == "STOP" for d in receiver.documents()), 60,
                 "a STOP posted")
        samples = scrape(server)
    shard_documents = [d for d in receiver.documents() if d["shard_id"] is not None]
    stop_at = next(i for i, d in enumerate(shard_documents) if d["status"] == "STOP")
    stop = shard_documents[stop_at]
    assert stop["application"] == config.application_name
    assert stop["shard_id"] == "shardId-000000000000"
    # The status posted before it; with none posted, OK (a first OK is not posted) or, when
    # the first evaluation already saw the shard stopped (a busy machine), None.
    assert stop["previous_status"] in (
        {shard_documents[stop_at - 1]["status"]} if stop_at else {"OK", None})
    assert "no checkpoint" in stop["reason"]
    assert any(d["shard_id"] is None and d["status"] == "ERR" for d in receiver.documents())
    assert samples[("kclpy_shard_lag_status",
                    (("shard_id", "shardId-000000000000"), ("status", "STOP")))] == 1
    assert samples[("kclpy_application_lag_status", (("status", "ERR"),))] == 1
    assert samples[("kclpy_lag_webhook_events_total", (("outcome", "sent"),))] >= 1


def test_the_alert_rules_in_operations_md_parse_and_name_real_metrics() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    rules = [rule for block in blocks for group in (yaml.safe_load(block) or {}).get(
        "groups", []) for rule in group["rules"]]
    assert rules, "no alert rules found"
    registry = Metrics(CollectorRegistry()).registry
    known = {sample_name for metric in registry.collect()
             for sample_name in (metric.name, metric.name + "_total",
                                 metric.name + "_count", metric.name + "_sum",
                                 metric.name + "_bucket")}
    # the rules over kclpy monitor's metrics read the monitor's series
    known |= exported_names()
    names = {rule["alert"] for rule in rules}
    for wanted in ("KclpyShardLagStatus", "KclpyApplicationLagError", "KclpyShardParked",
                   "KclpyShardFailed"):
        assert wanted in names
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        metrics = set(re.findall(r"\bkclpy_[a-z_]+", str(rule["expr"])))
        assert metrics and metrics <= known, (rule["alert"], metrics - known)


def test_the_lag_flags_are_validated_and_a_bad_webhook_url_is_not_echoed() -> None:
    base = {"stream_name": "s", "application_name": "a"}
    config = build_config({**base, "lag_window_s": 60, "lag_interval_s": 5, "metrics_port": 0,
                           "lag_webhook": "https://u:p@hooks.example/x"}, {})
    assert (config.lag_window_s, config.lag_interval_s) == (60, 5)
    with pytest.raises(ConfigError) as info:
        build_config({**base, "metrics_port": 0, "lag_webhook": "ftp://u:s3cret@host/x"}, {})
    assert info.value.option == "--lag-webhook" and "s3cret" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_config({**base, "lag_interval_s": 0}, {})
    assert info.value.option == "--lag-interval-s"


class ScriptedReceiver:
    """A hand-written HTTP peer on a free loopback port: connection ``i`` gets ``script[i]``
    (the last entry once the script is used up), raw bytes sent as they are, or ``None``:
    closed with a reset and no answer. Keeps the head of each request it read."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                self.heads.append(data.split(b"\r\n\r\n", 1)[0])
                answer = self.script[min(len(self.heads), len(self.script)) - 1]
                if answer is None:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    conn.sendall(answer)

    def close(self) -> None:
        self.listener.close()


def test_the_webhook_survives_a_receiver_that_does_not_speak_http() -> None:
    """A garbage status line, a reset, a close without an answer, then a cut body: each a
    failed POST that is retried (the cut body's 200 is a delivery), and the next event is
    delivered too: the delivery thread is still there."""
    ok = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"
    receiver = ScriptedReceiver([
        b"HELLO\x00\xff garbage\r\n\r\n", None, b"",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\ncut", ok])
    outcomes: list[str] = []
    hook = Webhook(f"http://127.0.0.1:{receiver.port}/hook", backoff_s=0.01,
                   max_backoff_s=0.05, on_result=outcomes.append)
    try:
        hook.send({"status": "STOP"})
        wait_for(lambda: outcomes == ["retried"] * 3 + ["sent"], 30, "the first delivery")
        hook.send({"status": "OK"})
        wait_for(lambda: len(outcomes) == 5, 30, "the second delivery")
    finally:
        hook.stop()
        receiver.close()
    assert outcomes == ["retried"] * 3 + ["sent", "sent"]
    assert len(receiver.heads) == 5


def test_the_webhook_follows_no_redirect_so_its_credentials_stay_at_their_origin() -> None:
    """A 302 to another origin (and a 307 that would keep the POST): neither is followed,
    so the other origin sees no request and no Authorization; each is a failed POST."""
    elsewhere = ScriptedReceiver([b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"])
    for code in (b"302 Found", b"307 Temporary Redirect"):
        redirecting = ScriptedReceiver([
            b"HTTP/1.1 " + code + b"\r\nLocation: http://localhost:%d/steal\r\n"
            b"Content-Length: 0\r\n\r\n" % elsewhere.port])
        outcomes: list[str] = []
        hook = Webhook(f"http://alice:s3cret@127.0.0.1:{redirecting.port}/hook",
                       max_attempts=2, backoff_s=0.01, on_result=outcomes.append)
        try:
            hook.send({"status": "STOP"})
            wait_for(lambda seen=outcomes: seen == ["retried", "failed"], 30,  # type: ignore[misc]
                     "the event given up")
        finally:
            hook.stop()
            redirecting.close()
        assert all(b"Authorization: Basic" in head for head in redirecting.heads)
    elsewhere.close()
    assert elsewhere.heads == []


def test_a_receiver_dribbling_its_answer_is_cut_at_the_webhooks_deadline() -> None:
    """A status line sent a byte at a time, each byte well within the socket timeout: the
    POST is cut once its whole time is up (a failed attempt), and the retry is delivered."""
    outcomes: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]
        hook = Webhook(f"http://127.0.0.1:{port}/hook", timeout_s=0.5, max_attempts=2,
                       backoff_s=0.01, on_result=outcomes.append)
        try:
            hook.send({"status": "STOP"})
            dribbled, _ = listener.accept()
            with dribbled:
                assert b"POST /hook" in dribbled.recv(65536)
                dribbled.sendall(b"HTTP/1.1")

                def one_more_byte() -> bool:
                    with contextlib.suppress(OSError):
                        dribbled.send(b" ")
                    return "retried" in outcomes

                wait_for(one_more_byte, 30, "the dribbled answer cut")
            answered, _ = listener.accept()
            with answered:
                answered.recv(65536)
                answered.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            wait_for(lambda: outcomes == ["retried", "sent"], 30, "the retry delivered")
        finally:
            hook.stop()
