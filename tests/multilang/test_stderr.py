"""A MultiLang child's stderr is shown as it is written, even without a newline."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kclpy.multilang.process import ChildProcess
from kclpy.multilang.stderr import PartialLines
from tests.support.waiting import wait_for

NO_NEWLINE_CHILD = (
    "import sys\n"
    "sys.stderr.write('INFO:root:record processor initialised'); sys.stderr.flush()\n"
    "sys.stdin.read()\n"  # stays alive, silent, until its stdin is closed
    "sys.stderr.write(' and done')\n"
)


def test_whole_lines_come_out_at_once_and_a_partial_one_only_when_flushed() -> None:
    lines = PartialLines(max_bytes=1024)
    assert lines.feed(b"one\r\ntwo\nthr") == ["one", "two"]
    assert lines.pending
    assert lines.feed(b"ee") == []
    assert lines.flush() == ["three"]
    assert (lines.pending, lines.flush()) == (False, [])


def test_a_long_partial_line_comes_out_in_pieces_of_at_most_max_bytes() -> None:
    lines = PartialLines(max_bytes=4)
    assert lines.feed(b"abcdefghij") == ["abcd", "efgh"]
    assert lines.flush() == ["ij"]


def test_utf8_split_between_reads_is_decoded_whole() -> None:
    lines = PartialLines(max_bytes=1024)
    snowman = "☃".encode()
    assert lines.feed(b"x" + snowman[:1]) == []
    assert lines.feed(snowman[1:] + b"\n") == ["x☃"]
    lines.feed("é".encode()[:1])
    assert lines.flush() == ["\ufffd"], "a truncated character is replaced, not dropped"


def test_a_child_that_never_writes_a_newline_is_seen_while_it_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kclpy.multilang")
    child = ChildProcess([sys.executable, "-c", NO_NEWLINE_CHILD], cwd=tmp_path,
                         lease_key="shardId-000000000000")
    child.start()
    try:
        seen = wait_for(lambda: [getattr(r, "child_stderr", "") for r in caplog.records
                                 if getattr(r, "child_stderr", None)],
                        20, "a line of the child's stderr in the log")
        assert seen == ["INFO:root:record processor initialised"]
        assert child._proc is not None and child._proc.poll() is None, "still running"
    finally:
        assert child.stop(grace_s=10) == 0
    assert child.stderr_tail() == ["INFO:root:record processor initialised", " and done"]
