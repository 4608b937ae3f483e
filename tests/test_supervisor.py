"""The ``--processes N`` supervisor with stand-in children (small Python processes): worker
ids, signal forwarding, restarts, exit codes. test_fleet.py runs it with real workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kclpy.supervisor import Spawn, Supervisor, run_processes, strip_processes
from tests.support.streams import wait_for

#: A stand-in worker: records its argv, then behaves as its worker id's last part says.
CHILD = """
import pathlib, signal, sys, time
worker_id = sys.argv[sys.argv.index("--worker-id") + 1]
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
    workdir: Path, worker_id: str, n: int
) -> tuple[Supervisor, list[subprocess.Popen[bytes]]]:
    started, spawn = spawner(workdir)
    supervisor = Supervisor(
        ["--stream-name", "s", "--processes", str(n)],
        n,
        worker_id=worker_id,
        spawn=spawn,
        backoff_s=0.05,
        poll_s=0.02,
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
