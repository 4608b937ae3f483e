"""kclpy-worker: bad configurations exit 2 with one line naming the option; the README's main
job runs; SIGTERM shuts a worker process down cleanly and releases its leases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kclpy.cli import worker_main
from kclpy.local import LocalEndpoint, free_port
from tests.support.recording import read_file_ledger
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
GOOD = ["--stream-name", "s", "--application-name", "a",
        "--processor", "examples/printing_processor.py:PrintingProcessor"]


def _props(tmp_path: Path, text: str) -> str:
    path = tmp_path / "app.properties"
    path.write_text("streamName = s\napplicationName = a\n" + text)
    return str(path)


BAD_CONFIGS: list[tuple[str, list[str], str]] = [
    ("missing stream", ["--application-name", "a", "--processor", "x:Y"], "--stream-name"),
    ("missing application", ["--stream-name", "s", "--processor", "x:Y"], "--application-name"),
    ("missing processor", ["--stream-name", "s", "--application-name", "a"], "--processor"),
    ("failover not a number", [*GOOD, "--failover-time-ms", "ten"], "--failover-time-ms"),
    ("negative failover", [*GOOD, "--failover-time-ms", "-1"], "--failover-time-ms"),
    ("zero max records", [*GOOD, "--max-records", "0"], "--max-records"),
    ("zero max lag", [*GOOD, "--max-lag-ms", "0"], "--max-lag-ms"),
    ("recovery rate not a number", [*GOOD, "--recovery-max-rate", "fast"],
     "--recovery-max-rate"),
    ("too many max records", [*GOOD, "--max-records", "10001"], "--max-records"),
    ("negative idle time", [*GOOD, "--idle-time-between-reads-ms", "-5"],
     "--idle-time-between-reads-ms"),
    ("float sync interval", [*GOOD, "--shard-sync-interval-ms", "1.5"],
     "--shard-sync-interval-ms"),
    ("unknown position", [*GOOD, "--initial-position", "MIDDLE"], "--initial-position"),
    ("at timestamp without time", [*GOOD, "--initial-position", "AT_TIMESTAMP"],
     "--initial-timestamp"),
    ("bad timestamp", [*GOOD, "--initial-timestamp", "tomorrow"], "--initial-timestamp"),
    ("bad endpoint", [*GOOD, "--kinesis-endpoint", "localhost:4566"], "--kinesis-endpoint"),
    ("bad dynamodb endpoint", [*GOOD, "--dynamodb-endpoint", "ftp://x"], "--dynamodb-endpoint"),
    ("bad boolean", [*GOOD, "--cleanup-leases-upon-shard-completion", "maybe"],
     "--cleanup-leases-upon-shard-completion"),
    ("bad policy", [*GOOD, "--processor-error-policy", "ignore"], "--processor-error-policy"),
    ("zero steal", [*GOOD, "--max-leases-to-steal-at-one-time", "0"],
     "--max-leases-to-steal-at-one-time"),
    ("bad stream arn", [*GOOD, "--stream-arn", "arn:aws:s3:::bucket"], "--stream-arn"),
    ("processor not importable", ["--stream-name", "s", "--application-name", "a",
                                  "--processor", "no_such_module_xyz:Thing"], "--processor"),
    ("processor file missing", ["--stream-name", "s", "--application-name", "a",
                                "--processor", "nowhere/proc.py:Thing"], "--processor"),
    ("processor class missing", ["--stream-name", "s", "--application-name", "a",
                                 "--processor", "examples/printing_processor.py:Nope"],
     "--processor"),
    ("processor not a processor", ["--stream-name", "s", "--application-name", "a",
                                   "--processor", "json:JSONDecoder"], "--processor"),
    ("processor not a class", ["--stream-name", "s", "--application-name", "a",
                               "--processor", "json:loads"], "--processor"),
    ("processor spec malformed", ["--stream-name", "s", "--application-name", "a",
                                  "--processor", "examples.printing_processor"], "--processor"),
    ("processor abstract", ["--stream-name", "s", "--application-name", "a",
                            "--processor", "kclpy:IRecordProcessor"], "--processor"),
    ("invalid region", [*GOOD, "--region", "us east 1"], "--region"),
    ("unknown flag", [*GOOD, "--no-such-flag", "1"], "--no-such-flag"),
    ("spark decode without batch", [*GOOD, "--spark-decode", "x:y"], "--spark-decode"),
    ("spark batch with processor", [*GOOD, "--spark-batch", "x:y"], "--spark-batch"),
    ("spark batch not importable", ["--stream-name", "s", "--application-name", "a",
                                    "--spark-batch", "no_such_module_xyz:f"], "--spark-batch"),
    ("zero processes", [*GOOD, "--processes", "0"], "--processes"),
    ("processes not a number", [*GOOD, "--processes", "all"], "--processes"),
    ("port out of range", [*GOOD, "--metrics-port", "70000"], "--metrics-port"),
    ("port not a number", [*GOOD, "--metrics-port", "http"], "--metrics-port"),
    ("bad log level", [*GOOD, "--log-level", "LOUD"], "--log-level"),
    ("backoff cap below its base", [*GOOD, "--get-records-backoff-cap-ms", "50"],
     "--get-records-backoff-cap-ms"),
    ("backoff base above its cap", [*GOOD, "--get-records-backoff-base-ms", "9000"],
     "--get-records-backoff-cap-ms"),
    ("task backoff cap below its base", [*GOOD, "--max-task-backoff-time-ms", "100"],
     "--max-task-backoff-time-ms"),
    ("webhook without metrics port", [*GOOD, "--lag-webhook", "https://hooks.example/x"],
     "--lag-webhook"),
    ("bad cloudwatch endpoint", [*GOOD, "--cloudwatch-endpoint", "monitoring"],
     "--cloudwatch-endpoint"),
    ("a failover time no thread can wait", [*GOOD, "--failover-time-ms", "10" * 12],
     "--failover-time-ms"),
    ("a pool urllib3 would fill for ever", [*GOOD, "--max-pool-connections", "2147483647"],
     "--max-pool-connections"),
]

BAD_PROPERTIES: list[tuple[str, str, str]] = [
    ("properties failover", "failoverTimeMillis = soon\n", "failoverTimeMillis"),
    ("properties max lag", "maxLagMillis = -5\n", "maxLagMillis"),
    ("properties negative", "idleTimeBetweenReadsInMillis = -1\n",
     "idleTimeBetweenReadsInMillis"),
    ("properties position", "initialPositionInStream = NOW\n", "initialPositionInStream"),
    ("properties boolean", "callProcessRecordsEvenForEmptyRecordList = sometimes\n",
     "callProcessRecordsEvenForEmptyRecordList"),
    ("properties max records", "maxRecords = lots\n", "maxRecords"),
    ("properties lag window", "lagWindowSeconds = 99999999999\n", "lagWindowSeconds"),
    ("properties endpoint", "dynamoDBEndpoint = dynamodb\n", "dynamoDBEndpoint"),
    ("properties backoff cap", "getRecordsBackoffCapMillis = 50\n", "getRecordsBackoffCapMillis"),
    ("properties backoff base and cap",
     "getRecordsBackoffBaseMillis = 200\ngetRecordsBackoffCapMillis = 100\n",
     "getRecordsBackoffCapMillis"),
]


def _one_line_naming(err: str, option: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert option in lines[0], lines[0]


@pytest.mark.parametrize(("argv", "option"), [c[1:] for c in BAD_CONFIGS],
                         ids=[c[0] for c in BAD_CONFIGS])
def test_bad_flags_exit_2_naming_the_option(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code: int | str | None
    try:
        code = worker_main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    _one_line_naming(capsys.readouterr().err, option)


@pytest.mark.parametrize(("argv", "said"), [
    (["--stop-when", *GOOD], "(did you mean --stop-when-caught-up?)"),
    (["--stream-nme", "s", *GOOD[2:]], "(did you mean --stream-name?)"),
    (["--shard", "1", *GOOD], "unrecognized arguments: --shard 1"),
    (["--log-level", "debg", *GOOD], "invalid choice: 'DEBG' (choose from 'DEBUG', 'INFO', "
                                      "'WARNING', 'ERROR') (did you mean DEBUG?)"),
])
def test_a_prefix_or_misspelt_flag_is_refused_with_a_suggestion(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took ``--stop-when`` for ``--stop-when-caught-up`` and ``--shard`` for
    ``--shard-sync-interval-ms`` silently."""
    with pytest.raises(SystemExit) as exit_:
        worker_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.integration
def test_a_busy_metrics_port_exits_2_naming_the_option(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """EADDRINUSE used to end the run with a bare traceback and exit 1."""
    import socket

    monkeypatch.chdir(ROOT)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = worker_main(["--local", "--processor",
                            "examples/printing_processor.py:PrintingProcessor",
                            "--stop-when-caught-up", "--metrics-port", str(port)])
    assert code == 2
    _one_line_naming(capsys.readouterr().err, "--metrics-port")


@pytest.mark.parametrize(("text", "option"), [c[1:] for c in BAD_PROPERTIES],
                         ids=[c[0] for c in BAD_PROPERTIES])
def test_bad_properties_exit_2_naming_the_key(
        text: str, option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code = worker_main(["--properties", _props(tmp_path, text),
                        "--processor", "examples/printing_processor.py:PrintingProcessor"])
    assert code == 2
    _one_line_naming(capsys.readouterr().err, option)


def test_flags_win_over_properties(tmp_path: Path) -> None:
    from kclpy.arguments import parse_worker_args

    config, _ = parse_worker_args([
        "--properties", _props(tmp_path, "failoverTimeMillis = 20000\nmaxRecords = 7\n"),
        "--failover-time-ms", "30000", "--processor", "x:Y"])
    assert config.failover_time_ms == 30000
    assert config.max_records == 7
    assert config.stream_name == "s"


def test_processor_from_file_and_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from kclpy.cli import load_processor_class

    monkeypatch.chdir(ROOT)
    from_file = load_processor_class("examples/printing_processor.py:PrintingProcessor")
    from_module = load_processor_class("tests.support.recording:FileLedgerProcessor")
    assert from_file.__name__ == "PrintingProcessor"
    assert from_module.__name__ == "FileLedgerProcessor"


def _worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kclpy", *args]


@pytest.mark.integration
def test_readme_main_job_consumes_the_demo_stream() -> None:
    result = subprocess.run(
        _worker_command("--local", "--processor",
                        "examples/printing_processor.py:PrintingProcessor",
                        "--stop-when-caught-up"),
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "data=" in line]
    plain = [line for line in lines if '"kind": "plain"' in line]
    kpl = [line for line in lines if '"kind": "kpl"' in line]
    assert len(plain) == 10
    assert len(kpl) == 10
    assert {line.split()[1].split("/")[1] for line in kpl} == {"0", "1", "2", "3", "4"}


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly_and_releases_leases(
        signum: int, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        tmp_path: Path) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("sigterm")
    create_stream(kinesis, stream, 2)
    payloads = [f"t-{n}".encode() for n in range(100)]
    put_plain(kinesis, stream, payloads)
    ledger_path = tmp_path / "ledger.jsonl"
    application = unique_name("app")
    port = free_port()
    env = {**os.environ, "KCLPY_TEST_LEDGER": str(ledger_path)}
    process = subprocess.Popen(
        _worker_command(
            "--stream-name", stream, "--application-name", application,
            "--processor", "tests.support.recording:FileLedgerProcessor",
            "--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
            "--dynamodb-endpoint", moto_server.url, "--initial-position", "TRIM_HORIZON",
            "--idle-time-between-reads-ms", "100", "--failover-time-ms", "3000",
            "--metrics-port", str(port)),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sum("data" in e for e in read_file_ledger(str(ledger_path)))
                 >= len(payloads), 90, "records processed")
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as response:
            assert response.status == 200


        def processed() -> float:
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
                scraped = response.read().decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in scraped.splitlines()
                       if line.startswith("kclpy_records_processed_total{"))

        # The counter moves when process_records returns, just after the ledger is written.
        wait_for(lambda: processed() == len(payloads), 30, "records counted in /metrics")
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-3000:]
    events = [e.get("event") for e in read_file_ledger(str(ledger_path))]
    assert events.count("shutdown_requested") == 2
    dynamodb = dynamodb_client(moto_server.url)
    items = dynamodb.scan(TableName=application, ConsistentRead=True)["Items"]
    assert len(items) == 2
    assert all("leaseOwner" not in item for item in items)
    assert "AWS_SECRET_ACCESS_KEY" not in err and "testing" not in err.lower().split("kclpy")[0]


@pytest.mark.integration
def test_running_count_example_counts_the_demo_stream_once_per_record(tmp_path: Path) -> None:
    """examples/running_count.py with the SQL store on the embedded endpoint: every demo
    record (10 plain, 10 in KPL aggregates) counted once under its partition key."""
    url = f"sqlite:///{tmp_path / 'counts.db'}"
    command = _worker_command("--local", "--processor", "examples/running_count.py:RunningCount",
                              "--state-store", url, "--stop-when-caught-up")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = subprocess.run([sys.executable, "examples/running_count.py", url], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    counts = {line.split()[0]: int(line.split()[1]) for line in shown.splitlines()}
    assert sum(v for k, v in counts.items() if k.startswith("count/")) == 20, counts
    assert all(counts[k.replace("count/", "bytes/")] > 0 for k in counts if "count/" in k)


@pytest.mark.integration
def test_a_stream_created_again_is_counted_again_on_the_sql_store(tmp_path: Path) -> None:
    """The simulator's hole 4 (FOUND.md): the same command twice, each run on a fresh
    embedded stream (same name, same shard ids) and lease table. The store's position is of
    the first stream: the second run must not skip its records as committed, and says what
    it did."""
    url = f"sqlite:///{tmp_path / 'counts.db'}"
    command = _worker_command("--local", "--processor", "examples/running_count.py:RunningCount",
                              "--state-store", url, "--stop-when-caught-up")
    runs = [subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
            for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[1].stderr[-3000:]
    shown = subprocess.run([sys.executable, "examples/running_count.py", url], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    counts = {line.split()[0]: int(line.split()[1]) for line in shown.splitlines()}
    assert sum(v for k, v in counts.items() if k.startswith("count/")) == 40, counts
    assert "created again" in runs[1].stderr and "created again" not in runs[0].stderr


@pytest.mark.integration
def test_an_application_name_reused_for_another_stream_is_refused_and_changes_nothing(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """A first-day mistake: the same --application-name on another stream replaced the first
    stream's leases (their checkpoints lost) and --stop-when-caught-up never stopped."""
    kinesis = kinesis_client(kinesis_mock.url)
    first, second = unique_name("orders"), unique_name("payments")
    for stream in (first, second):
        create_stream(kinesis, stream, 1)
        put_plain(kinesis, stream, [b"r0", b"r1"])
    app = unique_name("shared-app")

    def run(stream: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _worker_command(
                "--stream-name", stream, "--application-name", app,
                "--processor", "examples/printing_processor.py:PrintingProcessor",
                "--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
                "--dynamodb-endpoint", moto_server.url, "--initial-position", "TRIM_HORIZON",
                "--idle-time-between-reads-ms", "100", "--stop-when-caught-up"),
            cwd=ROOT, capture_output=True, text=True, timeout=180)

    assert run(first).returncode == 0
    dynamodb = dynamodb_client(moto_server.url)
    before = dynamodb.scan(TableName=app, ConsistentRead=True)["Items"]
    refused = run(second)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--application-name" in errors[0] and first in errors[0]
    assert dynamodb.scan(TableName=app, ConsistentRead=True)["Items"] == before
    assert " data=r0" not in refused.stdout


@pytest.mark.integration
def test_running_count_example_with_the_dynamodb_store(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("counts")
    create_stream(kinesis, stream, 2)
    put_plain(kinesis, stream, [f"r{n}".encode() for n in range(30)])
    table = unique_name("running-counts")
    result = subprocess.run(
        _worker_command(
            "--stream-name", stream, "--application-name", unique_name("counts-app"),
            "--processor", "examples/running_count.py:RunningCount", "--state-store", table,
            "--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
            "--dynamodb-endpoint", moto_server.url, "--initial-position", "TRIM_HORIZON",
            "--idle-time-between-reads-ms", "100", "--stop-when-caught-up"),
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    items = dynamodb_client(moto_server.url).scan(TableName=table)["Items"]
    counts = {i["stateKey"]["S"]: int(i["stateValue"]["S"]) for i in items}
    assert sum(v for k, v in counts.items() if k.startswith("count/")) == 30, counts


PLANTED = '''
import pathlib
pathlib.Path(__file__).with_name("planted-ran").write_text("yes")
raise SystemExit("a planted moto.py ran instead of the installed moto")
'''


@pytest.mark.integration
@pytest.mark.parametrize("how", ["console script", "python -m kclpy"])
def test_a_module_planted_in_the_current_folder_never_shadows_an_installed_one(
        how: str, tmp_path: Path) -> None:
    """--local imports moto; a moto.py in the folder the worker starts from must not run in
    its place, while the user's own processor module there still loads."""
    (tmp_path / "moto.py").write_text(PLANTED)
    (tmp_path / "myproc.py").write_text((ROOT / "examples" / "printing_processor.py").read_text())
    script = Path(sys.executable).with_name("kclpy-worker")
    command = [str(script)] if how == "console script" else [sys.executable, "-m", "kclpy"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*command, "--local", "--processor", "myproc:PrintingProcessor",
         "--stop-when-caught-up"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert not (tmp_path / "planted-ran").exists(), result.stderr[-2000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert sum("data=" in line for line in result.stdout.splitlines()) == 20


def test_the_current_folder_goes_after_the_installed_packages(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kclpy.loading import current_folder_last

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), "/site-packages"])
    current_folder_last()
    assert sys.path == ["/site-packages", str(tmp_path)]
