"""SIGTERM and SIGINT handlers that hand the work to another thread.

A Python signal handler runs in the main thread between two of its bytecodes - possibly
inside ``with lock:`` of the very lock the handler needs. The worker's and the supervisor's
main loops wait on and clear an ``Event`` several times a second, each time holding its
non-reentrant lock for a few bytecodes; a handler that set that event there would wait
forever on a lock its own thread holds, and the process would never stop. So the handler
only starts a thread, and that thread does the work: it waits for the main thread to let
go of the lock like any other thread. A raw thread (``_thread``), since
``threading.Thread.start`` takes a lock of its own that the main thread holds whenever it
starts a thread (a worker starts one per shard it takes).
"""

from __future__ import annotations

import _thread
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

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
    handlers come back on the way out."""

    interrupted = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if signum == signal.SIGINT and interrupted:
            os.write(2, FORCED_EXIT_LINE.encode())
            os._exit(EXIT_FORCED)
        interrupted = interrupted or signum == signal.SIGINT
        _thread.start_new_thread(fn, (signum,))

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
