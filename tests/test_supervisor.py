"""The ``--processes N`` supervisor with stand-in children (small Python processes): worker
ids, metrics ports, signal forwarding, the kill after a stop timeout, restarts, exit codes;
and with real workers over real HTTP: an endpoint each, and no worker outliving a killed
supervisor. tests/system/test_fleet.py runs it with real workers too."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kclpy.local import LocalEndpoint
from kclpy.supervisor import Spawn, Supervisor, run_processes, strip_processes
from tests.support.fleet import ROOT, fleet
from tests.support.proctable import alive, pids_running
from tests.support.streams import create_stream, kinesis_client, unique_name
from tests.support.waiting import wait_for

#: A stand-in worker: records its argv, then behaves as its worker id's last part says.
CHILD = """
import pathlib, signal, sys, time
worker_id = sys.argv[sys.argv.index("--worker-id") + 1]
if "_stubborn" in worker_id:  # before it is seen running, so no SIGTERM comes earlier
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = pathlib.Path(sys.argv[1]) / worker_id
with record.open("a") as fh:
    fh.write(" ".join(sys.argv[2:]) + "\\n")
mode = worker_id.rsplit("-", 1)[0].rsplit("_", 1)[-1]
if mode == "crash" and len(record.read_text().splitlines()) < 3:
    sys.exit(3)
if mode in ("done", "crash"):
    sys.exit(0)
if mode == "badconfig":
    sys.exit(2)
if mode == "stubborn":
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


def spawner(workdir: Path) -> tuple[list[subprocess.Popen[bytes]], Spawn]:
    started: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        process = subprocess.Popen([sys.executable, "-c", CHILD, str(workdir), *argv])
        started.append(process)
        return process

    return started, spawn


def supervise(
    workdir: Path, worker_id: str, n: int, **options: Any
) -> tuple[Supervisor, list[subprocess.Popen[bytes]]]:
    started, spawn = spawner(workdir)
    supervisor = Supervisor(
        ["--stream-name", "s", "--processes", str(n)],
        n,
        worker_id=worker_id,
        spawn=spawn,
        backoff_s=0.05,
        poll_s=0.02,
        **options,
    )
    return supervisor, started


def run_in_thread(supervisor: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
    thread.start()
    return thread, result


def test_processes_is_removed_in_both_spellings() -> None:
    assert strip_processes(["--processes", "3", "--a", "1", "--processes=4", "--b"]) == [
        "--a",
        "1",
        "--b",
    ]


def test_children_get_the_same_arguments_and_their_own_worker_ids(tmp_path: Path) -> None:
    supervisor, _ = supervise(tmp_path, "app_done", 3)
    assert supervisor.run() == 0
    records = {path.name: path.read_text().split() for path in tmp_path.iterdir()}
    assert sorted(records) == ["app_done-0", "app_done-1", "app_done-2"]
    for worker_id, argv in records.items():
        assert argv == ["--stream-name", "s", "--worker-id", worker_id]


def test_each_child_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    supervisor, _ = supervise(tmp_path, "app_done", 3, metrics_port=9400)
    assert supervisor.run() == 0
    ports = {path.name: path.read_text().split()[-1] for path in tmp_path.iterdir()}
    assert ports == {"app_done-0": "9400", "app_done-1": "9401", "app_done-2": "9402"}


def test_metrics_ports_beyond_the_last_port_are_a_bad_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--processes", "3", "--stream-name", "s", "--application-name", "a",
            "--processor", "tests.support.fleet:FleetProcessor", "--metrics-port", "65534"]
    assert run_processes(argv, 3) == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_a_child_that_ignores_sigterm_is_killed_after_the_stop_timeout(tmp_path: Path) -> None:
    supervisor, started = supervise(tmp_path, "app_stubborn", 1, stop_timeout_s=0.5)
    thread, result = run_in_thread(supervisor)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 1, 10, "the child running")
    supervisor.stop(signal.SIGTERM)
    thread.join(30)
    assert result == [1]
    assert started[0].returncode == -signal.SIGKILL


def test_sigterm_reaches_every_child_and_a_clean_exit_is_0(tmp_path: Path) -> None:
    supervisor, started = supervise(tmp_path, "app_serve", 2)
    thread, result = run_in_thread(supervisor)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 10, "both children running")
    supervisor.stop(signal.SIGTERM)
    thread.join(10)
    assert result == [0]
    assert [p.returncode for p in started] == [0, 0]


def test_a_crashed_child_is_restarted_and_the_group_keeps_running(tmp_path: Path) -> None:
    supervisor, started = supervise(tmp_path, "app_crash", 1)
    assert supervisor.run() == 0, "the third run exits cleanly"
    assert [p.returncode for p in started] == [3, 3, 0]
    assert supervisor.children[0].restarts == 2


def test_a_child_with_a_bad_configuration_is_not_restarted(tmp_path: Path) -> None:
    supervisor, started = supervise(tmp_path, "app_badconfig", 2)
    assert supervisor.run() == 1
    assert len(started) == 2


def test_stopping_while_a_restart_is_pending_reports_the_failure(tmp_path: Path) -> None:
    started, spawn = spawner(tmp_path)
    supervisor = Supervisor(
        [],
        1,
        worker_id="app_crash",
        spawn=spawn,
        backoff_s=60,
        poll_s=0.02,
    )
    thread, result = run_in_thread(supervisor)
    wait_for(lambda: supervisor.children[0].restart_at is not None, 10, "a restart pending")
    supervisor.stop()
    thread.join(10)
    assert result == [1]
    assert len(started) == 1


def test_a_bad_configuration_exits_2_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_processes(["--processes", "2", "--application-name", "a"], 2) == 2
    assert "--stream-name" in capsys.readouterr().err


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` ports in a row that are free on 127.0.0.1 now, below the
    kernel's ephemeral range: a port in that range can be taken between this check and the
    worker's bind by an outgoing connection of a test running beside this one (the emulators'
    clients open many), and the worker then exits 2 on a busy --metrics-port (a clean-clone
    run saw P+1 taken that way)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(10_000, max(10_001, low - count))
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return first
    raise AssertionError(f"no {count} consecutive free ports")


def healthz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return int(answer.status)
    except (OSError, ValueError):
        return None


@pytest.mark.integration
def test_real_workers_each_get_an_endpoint_and_die_with_a_killed_supervisor(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    """``--processes 2 --metrics-port P``: both workers run (none crash-loops on a taken
    port) and answer on P and P+1. When the supervisor is killed with SIGKILL (nothing of it
    runs to forward a signal), the kernel's SIGTERM still ends both workers, gracefully:
    their leases are released and nothing of the group is left in the process table."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("procs")
    create_stream(kinesis, stream, 2)
    with fleet(kinesis_mock.url, moto_server.url, stream, unique_name("app"), tmp_path) as group:
        port = consecutive_free_ports(2)
        env = {**os.environ, "KCLPY_TEST_LEDGER": str(group.ledger.path)}
        command = [sys.executable, "-m", "kclpy", *group.args("ports"), "--processes", "2",
                   "--metrics-port", str(port)]
        with (tmp_path / "supervisor.log").open("wb") as log:
            supervisor = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: group.balanced_among({"ports-0", "ports-1"}), 60,
                     "both workers holding leases")
            wait_for(lambda: healthz(port) == 200 and healthz(port + 1) == 200, 30,
                     "an endpoint per worker")
            workers = [pid for pid in pids_running(group.application) if pid != supervisor.pid]
            assert len(workers) == 2, workers
            supervisor.kill()
            supervisor.wait(10)
            wait_for(lambda: not any(alive(pid) for pid in workers), 60,
                     "the workers ending with their supervisor")
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
        log_text = (tmp_path / "supervisor.log").read_text()
        assert "Address already in use" not in log_text
        assert all(owner is None for owner in group.owners().values()), "leases released"
        assert pids_running(group.application) == []
