"""Credentials never leak: with a canary secret key and session token in the environment and
everything logged at DEBUG, neither appears in a worker's output or in what its ops endpoint
serves.

The canaries are unique per run and look like nothing else in the output, so a single
occurrence anywhere is a leak. Each test shows it could have caught one: the worker process
really logged at DEBUG, and the in-process worker's credential chain really resolved the
canaries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint, free_port
from kclpy.ops import serve_worker
from tests.support.ledger import LEDGER_ENV, RECORD, WORKER_ENV, Ledger
from tests.support.recording import Ledger as MemoryLedger
from tests.support.recording import RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def canaries() -> tuple[str, str]:
    """(secret access key, session token), both unlike anything else in any output."""
    tag = uuid.uuid4().hex
    return f"canary-secret-{tag}", f"canary-token-{tag}"


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_debug_logs_and_status_of_a_worker_process_hold_no_credentials(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path,
    canaries: tuple[str, str],
) -> None:  # fmt: skip
    secret, token = canaries
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("secrets")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"s-{n}".encode() for n in range(20)])
    ledger_path = tmp_path / "ledger.db"
    output = tmp_path / "worker.log"
    worker_id = "secrets-worker"
    port = free_port()
    env = {
        **os.environ,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_SESSION_TOKEN": token,
        LEDGER_ENV: str(ledger_path),
        WORKER_ENV: worker_id,
    }
    with Ledger(ledger_path) as ledger, output.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "kclpy",
                "--stream-name", stream,
                "--application-name", unique_name("secrets-app"),
                "--processor", "tests.support.ledger:LedgerProcessor",
                "--worker-id", worker_id,
                "--region", "us-east-1",
                "--kinesis-endpoint", kinesis_mock.url,
                "--dynamodb-endpoint", moto_server.url,
                "--initial-position", "TRIM_HORIZON",
                "--idle-time-between-reads-ms", "100",
                "--log-level", "DEBUG",
                "--metrics-port", str(port),
            ],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for(lambda: ledger.count(RECORD) >= 20, 90, "records processed")
            pages = {p: fetch(f"http://127.0.0.1:{port}{p}") for p in ("/status", "/metrics")}
            process.send_signal(signal.SIGTERM)
            code = process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = output.read_text(encoding="utf-8", errors="replace")
    assert code == 0, text[-3000:]
    assert " DEBUG " in text and "kclpy." in text, "the worker did not log at DEBUG"
    assert worker_id in pages["/status"]
    for path, body in pages.items():
        assert secret not in body and token not in body, f"{path} leaks a credential"
    leaks = [line[:300] for line in text.splitlines() if secret in line or token in line]
    assert not leaks, f"{len(leaks)} log lines carry a credential, e.g.:\n" + "\n".join(leaks[:3])


def test_status_and_metrics_hold_no_credentials(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, canaries: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    secret, token = canaries
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("status")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [f"s-{n}".encode() for n in range(10)])
    memory = MemoryLedger()
    config = KCLConfig(
        application_name=unique_name("status-app"),
        stream_name=stream,
        region="us-east-1",
        kinesis_endpoint=kinesis_mock.url,
        dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON",
        idle_time_between_reads_ms=100,
    )
    worker = Worker(config, lambda: RecordingProcessor(memory))
    caplog.set_level("DEBUG")
    with running(worker), serve_worker(worker, lag_window_s=None) as server:
        wait_for(lambda: len(memory.records) >= 10, 60, "records processed")
        credentials = boto3.session.Session().get_credentials()
        assert credentials is not None
        assert (credentials.secret_key, credentials.token) == (secret, token)
        pages = {path: fetch(server.url + path) for path in ("/status", "/metrics", "/healthz")}
    assert stream in pages["/status"] and "kclpy_records_processed" in pages["/metrics"]
    for path, body in pages.items():
        assert secret not in body and token not in body, f"{path} leaks a credential"
    kclpy_log = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("kclpy"))
    assert kclpy_log and secret not in kclpy_log and token not in kclpy_log
