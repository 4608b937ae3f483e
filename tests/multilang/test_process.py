"""A MultiLang child's lifetime and memory, with real child processes, checked in the
process table: no child outlives the consumer that failed, the worker that stopped (even
with the child busy past the shutdown grace) or was killed; and a child that floods its
stdout holds the worker to a bounded amount of memory without losing a byte."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kclpy.consumer import ConsumerSettings, ShardConsumer
from kclpy.leases.lease import Lease
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.multilang import MultiLangRecordProcessor
from kclpy.multilang.process import ChildProcess
from kclpy.processor import IRecordProcessor
from tests.support.fleet import ROOT
from tests.support.proctable import alive, pids_running
from tests.support.scripted import Host, Leases, Readers, ScriptedFetcher, Writer
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for

APPS = Path(__file__).parents[1] / "multilang_apps"
SETTINGS = ConsumerSettings(parent_shard_poll_interval_s=0.01, task_backoff_s=0.001,
                            max_task_backoff_s=0.002, poll_timeout_s=0.01)


def child_program(tmp_path: Path) -> Path:
    """The hand-written protocol child, copied under ``tmp_path`` so that the process table
    finds this test's children by their command line and nobody else's."""
    program = tmp_path / "raw_child.py"
    shutil.copy(APPS / "raw_child.py", program)
    return program


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_failed_consumer_ends_its_child(tmp_path: Path) -> None:
    """The fetch thread stopped on an error, which ends the consumer: the child is told
    (leaseLost) and ends, instead of living on with every retake adding another."""
    program = child_program(tmp_path)
    made: list[MultiLangRecordProcessor] = []

    def factory() -> IRecordProcessor:
        processor = MultiLangRecordProcessor(
            [sys.executable, str(program)], cwd=tmp_path, exit_timeout_s=5,
            env={"KCLPY_TEST_OUTPUT": str(tmp_path / "events.jsonl")})
        made.append(processor)
        return processor

    class Broken(ScriptedFetcher):
        def get(self, timeout: float | None = None) -> None:
            wait_for(lambda: pids_running(str(program)), 20, "the child running")
            raise RuntimeError("fetching stopped")

    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w"), concurrency_token="t",
        processor_factory=factory, fence=Writer(),
        readers=Readers(lambda _start: Broken([], ("TRIM_HORIZON", 0))), host=Host(Leases()),
        settings=SETTINGS, metrics=Metrics())
    consumer.start()
    try:
        assert consumer.join(30)
        assert isinstance(consumer.error, RuntimeError)
        assert pids_running(str(program)) == []
        assert '"leaseLost"' in (tmp_path / "events.jsonl").read_text()
    finally:
        for processor in made:
            processor.close()


def test_a_child_flooding_stdout_is_bounded_and_nothing_is_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """64 MiB written without a newline, nobody asking: the worker holds at most the bound
    (the child blocks on its pipe), says so once with a WARNING and a count, and every byte
    still arrives, in order, once asked for."""
    flood = 64 * 1024 * 1024
    code = (f"import sys; sys.stdout.write('x' * {flood}); sys.stdout.write('\\nend\\n'); "
            "sys.stdout.flush()")
    full: list[int] = []
    child = ChildProcess([sys.executable, "-c", code], cwd=tmp_path, lease_key="shard-1",
                         max_unread_bytes=1024 * 1024, on_full=lambda: full.append(1))
    before = rss_bytes()
    with caplog.at_level(logging.WARNING, logger="kclpy.multilang"):
        child.start()
        try:
            wait_for(lambda: full, 30, "the bound reached")
            assert child.pid is not None and alive(child.pid), "blocked, not gone"
            assert child.unread_bytes <= 1024 * 1024 + 64 * 1024
            grown = rss_bytes() - before
            assert grown < 32 * 1024 * 1024, f"the worker grew by {grown} bytes"
            received = 0
            while True:
                piece = child.read_line(30)
                if piece == "end\n":
                    break
                assert set(piece) <= {"x", "\n"}
                received += len(piece)
            assert received == flood + 1
        finally:
            child.kill()
    assert len(full) >= 1
    assert any("not asked for" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_a_message_larger_than_the_pipe_reaches_a_child_blocked_on_its_stdout(
        tmp_path: Path) -> None:
    """The child floods stdout (8 MiB of lines) and only then reads its stdin: a 1 MiB
    message still gets through (what the child wrote beyond the bound while it was sent is
    dropped, so it can move on to read it), and its answer arrives."""
    code = ("import sys\n"
            "for _ in range(128): sys.stdout.write('j' * 65535 + '\\n')\n"
            "sys.stdout.flush()\n"
            "line = sys.stdin.readline()\n"
            "sys.stdout.write('got %d\\n' % len(line)); sys.stdout.flush()\n")
    full: list[int] = []
    child = ChildProcess([sys.executable, "-c", code], cwd=tmp_path, lease_key="shard-1",
                         max_unread_bytes=256 * 1024, on_full=lambda: full.append(1))
    child.start()
    try:
        wait_for(lambda: full, 30, "the bound reached")
        child.send_line("m" * (1024 * 1024), 60)
        while (line := child.read_line(60)).startswith("j"):
            assert child.unread_bytes <= 256 * 1024 + 64 * 1024
        assert line == f"got {1024 * 1024 + 1}\n"
    finally:
        child.kill()



def _stdout_reader_settled(lease_key: str) -> bool:
    """The child's stdout reader has decided what to do with what it read last: it ended (it
    read the end of stdout) or it waits to queue a piece (``_queue_piece``)."""
    name = f"kclpy-multilang-{lease_key}-stdout"
    thread = next((t for t in threading.enumerate() if t.name == name), None)
    if thread is None or thread.ident is None:
        return True
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] == "wait" and "_queue_piece" in names


def test_an_answer_written_as_soon_as_the_message_lands_is_kept_over_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The child's stdout is at the bound and it answers the moment the last byte of a
    message reaches it, while the worker is still in its send: the answer is kept, not dropped
    with the unasked output written before the message (CI lost it so once). The send is held
    after its last write until the child has answered and exited and the reader has decided
    about the answer, which makes that moment certain."""
    code = ("import sys\n"
            "for _ in range(65): sys.stdout.write('j' * 4095 + '\\n')\n"
            "sys.stdout.flush()\n"
            "sys.stderr.write('flooded\\n'); sys.stderr.flush()\n"
            "line = sys.stdin.readline()\n"
            "sys.stdout.write('got %d\\n' % len(line)); sys.stdout.flush()\n")
    caplog.set_level(logging.INFO, logger="kclpy.multilang")
    full: list[int] = []
    child = ChildProcess([sys.executable, "-c", code], cwd=tmp_path, lease_key="shard-1",
                         max_unread_bytes=64 * 4096, on_full=lambda: full.append(1))
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        written = real_write(fd, data)
        if bytes(data[:written]).endswith(b"hello\n") or bytes(data[:written]) == b"\n":
            pid = child.pid
            assert pid is not None
            wait_for(lambda: not alive(pid), 30, "the child's answer and exit")
            wait_for(lambda: _stdout_reader_settled("shard-1"), 30, "the reader's decision")
        return written

    child.start()
    try:
        wait_for(lambda: full and "flooded" in caplog.text, 30, "the bound reached, flood done")
        monkeypatch.setattr(os, "write", write)
        child.send_line("hello", 30)
        monkeypatch.undo()
        while (line := child.read_line(30)).startswith("j"):
            pass
        assert line == "got 6\n"
    finally:
        child.kill()

@pytest.mark.integration
@pytest.mark.parametrize(("ending", "hang_in"), [(signal.SIGTERM, "shutdownRequested"),
                                                (signal.SIGKILL, "processRecords")],
                         ids=["sigterm-busy-in-shutdown", "sigkill-busy-in-a-batch"])
def test_no_child_outlives_its_worker(
        ending: signal.Signals, hang_in: str, kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, tmp_path: Path) -> None:
    """A worker (``kclpy-worker`` in MultiLangDaemon mode) stopped with SIGTERM while its
    child hangs in shutdownRequested (slower than the 1 s shutdown grace, ignoring SIGTERM),
    or killed with SIGKILL while its child is busy in a batch: the child is gone from the
    process table once the worker is."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("mlife")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"r-%d" % i for i in range(5)])
    program = child_program(tmp_path)
    events = tmp_path / "events.jsonl"
    properties = tmp_path / "app.properties"
    properties.write_text(f"executableName = {sys.executable} {program}\n")
    env = {**os.environ, "KCLPY_TEST_OUTPUT": str(events),
           "KCLPY_TEST_HANG": hang_in}
    command = [sys.executable, "-m", "kclpy", "--properties", str(properties),
               "--stream-name", stream, "--application-name", unique_name("app"),
               "--region", "us-east-1", "--kinesis-endpoint", kinesis_mock.url,
               "--dynamodb-endpoint", moto_server.url, "--initial-position", "TRIM_HORIZON",
               "--shutdown-grace-ms", "1000", "--failover-time-ms", "3000"]
    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: events.exists() and '"processRecords"' in events.read_text(), 60,
                 "the child processing records")
        children = pids_running(str(program))
        assert len(children) == 1, children
        worker.send_signal(ending)
        worker.wait(60)
        wait_for(lambda: not alive(children[0]), 30, "the child ending with its worker")
    finally:
        if worker.poll() is None:
            worker.kill()
        for pid in pids_running(str(program)):
            os.kill(pid, signal.SIGKILL)
    if ending == signal.SIGTERM:
        output = (tmp_path / "worker.log").read_text()
        assert '"shutdownRequested"' in events.read_text(), output[-3000:]
        # killed once the grace ran out, before the leases were released, not at exit
        killed = output.find("killed 1 MultiLang child(ren) still running")
        assert 0 <= killed < output.find(" stopped"), output[-3000:]
