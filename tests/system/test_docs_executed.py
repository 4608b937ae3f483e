"""The README's and docs' commands and snippets, taken from the pages themselves and run
against local endpoints, so a page and the software cannot disagree unnoticed (as FastAPI
runs its documentation's examples).

What runs as written: the README's main job, its processor with its ``kclpy-worker`` command
and its one-line Python equivalent, both snippets of docs/processor.md with the command shown
beside the second, and docs/operations.md's ``serve_worker`` snippet. Settings a page leaves
to the environment (endpoint, where a new shard starts, stopping once caught up) come from
environment variables, so the command lines stay exactly as printed. Every other command line
in the pages is parsed by the real argument parsers, and every Python block is compiled and
its imports run. The alert rules of docs/operations.md are tested in test_docs_alerts.py.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kclpy
from kclpy.local import ProcessEndpoint, start_moto_server
from tests.support.streams import dynamodb_client, kinesis_client, put_plain
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "localstack" / "README.md"]
_CONSOLE_SCRIPT = "import sys\nfrom {module} import main\nsys.exit(main())\n"


def code_blocks(page: Path, language: str | None = None) -> list[str]:
    blocks = re.findall(r"```(\w*)\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    return [body for lang, body in blocks if language is None or lang == language]


def section(page: Path, title: str) -> str:
    return page.read_text(encoding="utf-8").split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def console(tmp_path: Path, name: str, module: str) -> list[str]:
    """How a console script runs: its own folder, not the current one, first on sys.path."""
    folder = tmp_path / "console"
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text(_CONSOLE_SCRIPT.format(module=module), encoding="utf-8")
    return [sys.executable, str(script)]


def command_argv(tmp_path: Path, command: str) -> list[str]:
    words = shlex.split(command)
    scripts = {"kclpy-worker": "kclpy.cli", "kclpy": "kclpy.ops.commands"}
    return console(tmp_path, words[0], scripts[words[0]]) + words[1:]


def environment(endpoint: str | None = None, **settings: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **settings}
    if endpoint is not None:
        env["AWS_ENDPOINT_URL"] = endpoint
    return env


@pytest.fixture(scope="module")
def endpoint() -> Iterator[ProcessEndpoint]:
    """A moto server of this module's own: the pages' names (orders, order-audit, counts)
    are used as written, without meeting another test's streams and tables."""
    with start_moto_server() as server:
        kinesis = kinesis_client(server.url)
        kinesis.create_stream(StreamName="orders", ShardCount=1)
        wait_for(lambda: kinesis.describe_stream_summary(StreamName="orders")[
            "StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE", timeout=30)
        yield server


# -- README ---------------------------------------------------------------------------------


def test_readme_main_job_runs_as_written(tmp_path: Path) -> None:
    first = re.findall(r"```sh\n(.+?)\n```", section(ROOT / "README.md", "Set up"),
                       re.DOTALL)[0]
    install, _, run = first.partition(" && ")
    extras = re.fullmatch(r"pip install '\.\[(\w+)\]'", install)
    assert extras is not None, install
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "moto[server]" in setup["options.extras_require"][extras.group(1)]
    assert "moto" not in setup["options"]["install_requires"]
    result = subprocess.run(command_argv(tmp_path, run), cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len([line for line in result.stdout.splitlines() if "data=" in line]) == 20


@pytest.mark.integration
def test_readme_processor_runs_with_its_command_and_its_python_line(
        tmp_path: Path, endpoint: ProcessEndpoint) -> None:
    use = section(ROOT / "README.md", "Use")
    processor = code_blocks(ROOT / "README.md", "python")[0]
    command = re.findall(r"```sh\n(.+?)\n```", use, re.DOTALL)[0]
    python_line = re.search(r"or from Python: `(.+?)`", use)
    assert python_line is not None
    app = tmp_path / "app"
    (app / "mypkg").mkdir(parents=True)
    (app / "mypkg" / "__init__.py").write_text("", encoding="utf-8")
    (app / "mypkg" / "audit.py").write_text(processor, encoding="utf-8")
    kinesis = kinesis_client(endpoint.url)
    put_plain(kinesis, "orders", [b"readme-cli-1", b"readme-cli-2"])

    env = environment(endpoint.url, KCLPY_INITIAL_POSITION="TRIM_HORIZON",
                      KCLPY_STOP_WHEN_CAUGHT_UP="true")
    result = subprocess.run(command_argv(tmp_path, command), cwd=app, env=env,
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "b'readme-cli-1'" in result.stdout and "b'readme-cli-2'" in result.stdout

    # the Python line goes on from the command's checkpoints, until SIGTERM
    put_plain(kinesis, "orders", [b"readme-python-1"])
    script = app / "run.py"
    script.write_text(processor + "\n" + python_line.group(1) + "\n", encoding="utf-8")
    process = subprocess.Popen([sys.executable, str(script)], cwd=app, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        seen: list[str] = []
        for line in process.stdout:
            seen.append(line)
            if "readme-python-1" in line:
                break
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert seen and "b'readme-python-1'" in seen[-1]
    assert process.returncode == 0, errors[-3000:]
    assert "readme-cli" not in "".join(seen)


# -- docs/processor.md -----------------------------------------------------------------------


@pytest.mark.integration
def test_processor_guide_counter_runs(endpoint: ProcessEndpoint) -> None:
    handled: list[tuple[str, bytes]] = []
    namespace: dict[str, Any] = {"handle": lambda key, data: handled.append((key, data))}
    exec(compile(code_blocks(ROOT / "docs" / "processor.md", "python")[0], "processor.md",
                 "exec"), namespace)
    put_plain(kinesis_client(endpoint.url), "orders", [b"guide-counter"])
    config = kclpy.KCLConfig(
        application_name="guide-counter", stream_name="orders", region="us-east-1",
        kinesis_endpoint=endpoint.url, dynamodb_endpoint=endpoint.url,
        initial_position="TRIM_HORIZON", stop_when_caught_up=True)
    kclpy.Worker(config, namespace["Counter"]).run(install_signal_handlers=False)
    assert b"guide-counter" in [data for _, data in handled]


@pytest.mark.integration
def test_processor_guide_stateful_snippet_runs_with_its_command(
        tmp_path: Path, endpoint: ProcessEndpoint) -> None:
    page = ROOT / "docs" / "processor.md"
    snippet = next(block for block in code_blocks(page, "python") if "RunningCount" in block)
    command = re.search(r"or `(kclpy-worker [^`]*RunningCount[^`]*)`",
                        page.read_text(encoding="utf-8"))
    assert command is not None
    app = tmp_path / "app"
    (app / "mypkg").mkdir(parents=True)
    (app / "mypkg" / "__init__.py").write_text(snippet, encoding="utf-8")
    put_plain(kinesis_client(endpoint.url), "orders", [b"x"], ["guide"])
    env = environment(endpoint.url, KCLPY_INITIAL_POSITION="TRIM_HORIZON",
                      KCLPY_STOP_WHEN_CAUGHT_UP="true")
    result = subprocess.run(command_argv(tmp_path, command.group(1)), cwd=app, env=env,
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    items = dynamodb_client(endpoint.url).scan(TableName="counts-state")["Items"]
    assert any("count/guide" in json.dumps(item) for item in items), items


# -- docs/operations.md ---------------------------------------------------------------------


@pytest.mark.integration
def test_operations_serve_worker_snippet_runs(endpoint: ProcessEndpoint,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    snippet = next(block for block in code_blocks(ROOT / "docs" / "operations.md", "python")
                   if "serve_worker" in block)
    config = kclpy.KCLConfig(
        application_name="guide-ops", stream_name="orders", region="us-east-1",
        kinesis_endpoint=endpoint.url, dynamodb_endpoint=endpoint.url,
        initial_position="TRIM_HORIZON", stop_when_caught_up=True)
    worker = kclpy.Worker(config, lambda: _Quiet())
    done = threading.Event()

    def run_snippet() -> None:
        exec(snippet.replace("port=9464", "port=0"), {"worker": worker})
        done.set()

    thread = threading.Thread(target=run_snippet)
    thread.start()
    thread.join(240)
    assert done.is_set()
    assert capsys.readouterr().out.startswith("http://127.0.0.1:")


class _Quiet(kclpy.IRecordProcessor):
    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        return None

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        return None

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput
                           ) -> None:
        shutdown_requested_input.checkpointer.checkpoint()


# -- every other block --------------------------------------------------------------------------


def command_lines() -> list[tuple[str, str]]:
    """Every ``kclpy-worker`` / ``kclpy`` command line of every page's shell and plain blocks
    (continuations joined, ``$`` prompts and ``[optional]`` parts removed)."""
    found = []
    for page in PAGES:
        for block in code_blocks(page, "sh") + code_blocks(page, ""):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\[[^\]]*\]", "", line.removeprefix("$ ")).strip()
                for part in line.split(" && "):
                    words = part.split()
                    if words and words[0] in ("kclpy-worker", "kclpy"):
                        found.append((page.name, part))
    return found


@pytest.mark.parametrize(("page", "command"), command_lines())
def test_every_documented_command_line_parses(page: str, command: str) -> None:
    from kclpy.arguments import worker_parser
    from kclpy.ops.commands import build_parser

    words = shlex.split(re.sub(r"\s[A-Z_]+=\S+", "", command))
    parser = worker_parser() if words[0] == "kclpy-worker" else build_parser()
    try:
        parser.parse_args(words[1:])
    except SystemExit as exc:
        pytest.fail(f"{page}: `{command}` does not parse (exit {exc.code})")


def python_blocks() -> list[tuple[str, int, str]]:
    return [(page.name, n, block) for page in PAGES
            for n, block in enumerate(code_blocks(page, "python"))]


@pytest.mark.parametrize(("page", "index", "block"), python_blocks(),
                         ids=[f"{page}-{index}" for page, index, _ in python_blocks()])
def test_every_python_block_compiles_and_its_imports_run(page: str, index: int,
                                                         block: str) -> None:
    code = compile(block, f"{page}[{index}]", "exec")
    assert code is not None
    imports = "\n".join(line for line in block.splitlines()
                        if re.match(r"^(import|from) \S+", line))
    if "pyspark" in imports or "kclpy.spark" in imports:
        pytest.importorskip("pyspark")
    exec(compile(imports, f"{page}[{index}] imports", "exec"), {})


def test_the_grafana_dashboards_inputs_are_used() -> None:
    text = (ROOT / "docs" / "grafana-dashboard.json").read_text(encoding="utf-8")
    dashboard = json.loads(text)
    for source in dashboard["__inputs"]:
        assert text.count("${" + source["name"] + "}") >= 1, source["name"]
