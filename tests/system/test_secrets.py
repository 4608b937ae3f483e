"""Credentials never leak: with a canary secret key and session token in the environment and
everything logged at DEBUG, neither appears in a worker's output or in what its ops endpoint
serves.

The canaries are unique per run and look like nothing else in the output, so a single
occurrence anywhere is a leak. Each test shows it could have caught one: the worker process
really logged at DEBUG, and the in-process worker's credential chain really resolved the
canaries.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

from kclpy import KCLConfig, Worker, redaction
from kclpy.arguments import SECRET_FLAG_ENV, parse_worker_args, secrets_out_of_argv
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint, free_port
from kclpy.ops import serve_worker
from kclpy.supervisor import run_processes
from tests.support.ledger import LEDGER_ENV, RECORD, WORKER_ENV, Ledger
from tests.support.recording import Ledger as MemoryLedger
from tests.support.recording import RecordingProcessor
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.workers import running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


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


# -- every command, every output, every kind of secret ----------------------------------------


@pytest.fixture
def secrets(canaries: tuple[str, str]) -> dict[str, str]:
    """Every kind of secret a user gives kclpy, each a canary: the AWS credentials, a
    webhook's user information and a database password."""
    secret, token = canaries
    tag = uuid.uuid4().hex
    return {"secret key": secret, "session token": token,
            "webhook password": f"hook-pw-{tag}", "database password": f"db-pw-{tag}"}


def secret_environment(secrets: dict[str, str], webhook_port: int) -> dict[str, str]:
    """How the docs say to give secrets: in the environment, never as flags."""
    return {**os.environ, "AWS_ACCESS_KEY_ID": "AKIDCANARY",
            "AWS_SECRET_ACCESS_KEY": secrets["secret key"],
            "AWS_SESSION_TOKEN": secrets["session token"],
            "KCLPY_LAG_WEBHOOK": f"http://hook:{secrets['webhook password']}@127.0.0.1:"
                                 f"{webhook_port}/hook"}


def assert_no_secret(secrets: dict[str, str], **outputs: str) -> None:
    for where, text in outputs.items():
        for what, value in secrets.items():
            assert value not in text, f"the {what} is in the {where}"


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.integration
def test_kclpy_worker_local_at_debug_prints_no_secret(secrets: dict[str, str],
                                                      tmp_path: Path) -> None:
    """The whole local run (start-up, the demo stream consumed, the lag webhook's failed
    POSTs to a closed port, shutdown) at DEBUG, its ops endpoint on."""
    result = run(["-m", "kclpy", "--local", "--processor",
                  "examples/printing_processor.py:PrintingProcessor", "--stop-when-caught-up",
                  "--log-level", "DEBUG", "--metrics-port", "0"],
                 secret_environment(secrets, free_port()))
    assert result.returncode == 0, result.stderr[-3000:]
    assert " DEBUG " in result.stderr and "data=" in result.stdout
    assert_no_secret(secrets, stdout=result.stdout, stderr=result.stderr)


@pytest.mark.integration
def test_a_database_url_with_a_password_is_in_no_error(secrets: dict[str, str]) -> None:
    """A store that cannot be reached, and one whose URL is malformed: each error names the
    store, never its password."""
    env = secret_environment(secrets, free_port())
    password = secrets["database password"]
    unreachable = run(
        ["-m", "kclpy", "--local", "--processor", "examples/running_count.py:RunningCount",
         "--log-level", "DEBUG", "--max-initialization-attempts", "1", "--metrics-port", "0"],
        {**env, "KCLPY_STATE_STORE":
            f"postgresql+psycopg://kclpy:{password}@127.0.0.1:{free_port()}/db"})
    malformed = run(["-m", "kclpy", "--local", "--processor", "x:Y", "--metrics-port", "0"],
                    {**env, "KCLPY_STATE_STORE": f"postgresql:/kclpy:{password}@host/db"})
    assert unreachable.returncode == 1 and "cannot connect to the state store" in (
        unreachable.stderr), unreachable.stderr[-3000:]
    assert malformed.returncode == 2 and "KCLPY_STATE_STORE" in malformed.stderr
    for name, result in {"unreachable": unreachable, "malformed": malformed}.items():
        assert_no_secret(secrets, **{f"{name} stdout": result.stdout,
                                     f"{name} stderr": result.stderr})


@pytest.mark.integration
def test_the_operator_commands_at_debug_print_no_secret(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, secrets: dict[str, str],
) -> None:  # fmt: skip
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("inspect-secrets")
    create_stream(kinesis, stream, 1)
    LeaseTable(dynamodb_client(moto_server.url), stream).create_if_missing()
    env = secret_environment(secrets, free_port())
    where = ["--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
             "--dynamodb-endpoint", moto_server.url, "--log-level", "DEBUG"]
    leases = run(["-m", "kclpy.ops.commands", "leases", "--application-name", stream, *where],
                 env)
    status = run(["-m", "kclpy.ops.commands", "status", "--stream-name", stream,
                  "--application-name", stream, "--samples", "2", "--window-seconds", "0.1",
                  *where], env)
    # both ran to the end, their logging live and their credentials the canaries
    assert leases.returncode == 0 and "0 lease(s)" in leases.stdout, leases.stderr[-3000:]
    assert status.returncode == 0 and stream in status.stdout, status.stderr[-3000:]
    for result in (leases, status):
        assert "Found credentials in environment variables" in result.stderr
    assert_no_secret(secrets, **{"leases stdout": leases.stdout, "leases stderr": leases.stderr,
                                 "status stdout": status.stdout, "status stderr": status.stderr})


# -- the second line: redaction where kclpy configures logging ------------------------------


@pytest.mark.parametrize("logger_name", ["hpack.hpack", "botocore.endpoint", "kclpy.worker"])
def test_the_commands_log_handlers_mask_credentials_from_any_logger(
        logger_name: str, canaries: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a library logger let down to DEBUG (as a user's own logging set-up may) writes
    no credential: the mask is on the handler, which every record passes."""
    secret, token = canaries
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    redaction.add_secrets([secret])
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(redaction.RedactingFilter())
    logger = logging.getLogger(logger_name)
    level = logger.level
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "handlers", [handler])
    redaction.add_secrets([os.environ["AWS_SESSION_TOKEN"]])
    logger.setLevel(logging.DEBUG)
    try:
        log_credentials(logger, secret, token)
    finally:
        logger.setLevel(level)
    text = out.getvalue()
    assert "Decoded" in text and "hooks.example" in text and "RuntimeError" in text
    for value in (secret, token, "not-a-known-token-value", "pw-never-seen-before"):
        assert value not in text


def log_credentials(logger: logging.Logger, secret: str, token: str) -> None:
    """What botocore and hpack write at DEBUG, and an error quoting a credential."""
    logger.debug("Decoded %s, consumed %d bytes", ("x-amz-security-token", token), 300)
    logger.debug("headers: {'X-Amz-Security-Token': b'%s', 'Authorization': 'AWS4 Sig'}",
                 "not-a-known-token-value")
    logger.debug("posting to https://user:%s@hooks.example/x", "pw-never-seen-before")
    try:
        raise RuntimeError(f"signing failed with {secret}")
    except RuntimeError:
        logger.debug("failed", exc_info=True)


def test_configuration_repr_shows_no_secret() -> None:
    config = KCLConfig(stream_name="s", application_name="a", metrics_port=0,
                       lag_webhook="https://user:hook-secret@hooks.example/x",
                       state_store="postgresql+psycopg://u:db-secret@db.example/kclpy")
    assert "hook-secret" not in repr(config) and "db-secret" not in repr(config)


def test_processes_children_get_secret_flags_in_their_environment_not_argv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A child's argv is readable by every local user (``/proc/<pid>/cmdline``); what a
    flag gave still reaches the child, with the flag's precedence."""
    webhook = "https://user:hook-secret@hooks.example/x"
    store = "postgresql+psycopg://u:db-secret@db.example/kclpy"
    spawned: list[tuple[list[str], dict[str, str]]] = []

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        spawned.append((argv, dict(os.environ)))
        return subprocess.Popen([sys.executable, "-c", "pass"])

    for name in list(os.environ):
        if name.startswith(SECRET_FLAG_ENV):
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the supervisor sets its children's
    argv = ["--stream-name", "s", "--application-name", "a", "--processor", "x:Y",
            "--metrics-port", "0", f"--lag-webhook={webhook}", "--state-store", store]
    assert run_processes([*argv, "--processes", "2"], 2, spawn=spawn) == 0
    assert len(spawned) == 2
    for child_argv, child_env in spawned:
        assert not any("secret" in arg for arg in child_argv), child_argv
        monkeypatch.setattr(os, "environ", child_env)
        config, _ = parse_worker_args(child_argv)
        assert (config.lag_webhook, config.state_store) == (webhook, store)


def test_a_secret_handed_to_a_child_keeps_the_flags_precedence_over_the_properties_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Moved from argv to the environment, the flag's value must still win over the
    properties file, as it did on the parent's command line."""
    properties = tmp_path / "app.properties"
    properties.write_text("streamName = s\napplicationName = a\nmetricsPort = 0\n"
                          "lagWebhook = https://hooks.example/from-file\n", encoding="utf-8")
    argv = ["--properties", str(properties), "--processor", "x:Y",
            "--lag-webhook", "https://hooks.example/from-flag"]
    child_argv, handed = secrets_out_of_argv(argv)
    for name, value in handed.items():
        monkeypatch.setenv(name, value)
    config, _ = parse_worker_args(child_argv)
    assert "--lag-webhook" not in child_argv
    assert config.lag_webhook == "https://hooks.example/from-flag"
