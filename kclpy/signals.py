"""SIGTERM and SIGINT handled by a watcher thread, never by the main thread.

A Python-level signal handler runs in the main thread, and only when that thread next runs
bytecode. Two ways that fails a process that must stop:

- the handler may land inside ``with lock:`` of the very lock its work needs (the worker's
  and the supervisor's main loops clear and wait on an ``Event`` several times a second,
  each time holding its non-reentrant lock for a few bytecodes): it would wait forever on a
  lock its own thread holds;
- the main thread may not run bytecode at all for a long time: a signal whose C-level
  handler runs on another thread, or lands between the main thread's check for pending
  signals and its next blocking lock wait, is noticed only when that wait ends - never, for
  a main thread waiting without a timeout (CI saw a second Ctrl-C lost this way).

So the Python-level handler does nothing; ``signal.set_wakeup_fd`` makes the C-level
handler write the signal's number to a pipe, on whatever thread it runs, and a raw thread
(``_thread``: ``threading.Thread.start`` takes a lock the main thread holds whenever it
starts a thread, as a worker does per shard it takes) reads the pipe and starts each
signal's work on a thread of its own, or ends the process on a second Ctrl-C.
"""

from __future__ import annotations

import _thread
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

#: the signals that ask a kclpy process to stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: a second Ctrl-C ends the process at once, as uvicorn and gunicorn do: no processor is
#: called again and no lease is released, so the records since each shard's last checkpoint
#: are read again by the next owner once the leases expire (a failover time)
EXIT_FORCED = 128 + signal.SIGINT
FORCED_EXIT_LINE = ("kclpy: second interrupt: exiting now; records since each shard's last "
                    "checkpoint will be read again\n")


@contextmanager
def on_stop_signals(fn: Callable[[int], None]) -> Iterator[None]:
    """While inside (main thread only), SIGTERM and SIGINT call ``fn(signum)`` on a thread of
    their own, except a second SIGINT, which exits at once (``EXIT_FORCED``); the previous
    handlers and wakeup fd come back on the way out (an asyncio loop of the main thread,
    which uses the wakeup fd too, hears no signal while inside)."""

    read_fd, write_fd = os.pipe()
    previous_fd: int | None = None
    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    watching = False
    try:
        os.set_blocking(write_fd, False)
        # The wakeup fd is ours before any handler is, and is given back after them all: a
        # stop signal between the two calls then meets either the handler it replaced or
        # the pipe, never our handler (which does nothing) with the pipe not (yet) set.
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, _written_to_the_pipe)
        _thread.start_new_thread(_watch, (read_fd, fn))
        watching = True
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if previous_fd is not None:
            signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        if not watching:
            os.close(read_fd)


def _written_to_the_pipe(signum: int, frame: FrameType | None) -> None:
    """Installed only so that the C-level handler runs and writes to the wakeup fd: the
    watcher thread does the work."""


def _watch(read_fd: int, fn: Callable[[int], None]) -> None:
    """Until the write end closes (on leaving ``on_stop_signals``); the wakeup fd also gets
    the number of any other signal with a Python-level handler, which is not ours."""
    interrupted = False
    try:
        while chunk := os.read(read_fd, 64):
            for signum in chunk:
                if signum not in STOP_SIGNALS:
                    continue
                if signum == signal.SIGINT and interrupted:
                    os.write(2, FORCED_EXIT_LINE.encode())
                    os._exit(EXIT_FORCED)
                interrupted = interrupted or signum == signal.SIGINT
                _thread.start_new_thread(fn, (signum,))
    finally:
        os.close(read_fd)
