"""``kclpy.signals``: a stop signal's work runs on a thread of its own, so a signal that lands
while the main thread holds the lock that work needs cannot hang the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kclpy.signals import EXIT_FORCED, STOP_SIGNALS, on_stop_signals

ROOT = Path(__file__).resolve().parent.parent


def test_a_signal_landing_inside_the_lock_its_work_needs_does_not_hang() -> None:
    """The worker's main loop clears and waits on an Event five times a second, each time
    holding its non-reentrant lock for a few bytecodes; a handler that set that Event itself,
    run right then on the same thread, would wait for itself forever."""
    stop = threading.Event()
    with on_stop_signals(lambda signum: stop.set()):
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)

        def interrupted_inside_the_lock() -> None:
            with stop._cond:  # type: ignore[attr-defined]  # what Event.clear() holds
                handler(signal.SIGTERM, None)

        thread = threading.Thread(target=interrupted_inside_the_lock, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the handler waited for a lock its own thread holds"
        assert stop.wait(10), "the work was done once the lock was let go"


def test_each_stop_signal_calls_back_off_the_main_thread_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    calls: list[tuple[int, bool]] = []
    done = threading.Event()

    def record(signum: int) -> None:
        calls.append((signum, threading.current_thread() is threading.main_thread()))
        if len(calls) == len(STOP_SIGNALS):
            done.set()

    with on_stop_signals(record):
        for sig in STOP_SIGNALS:
            os.kill(os.getpid(), sig)
        assert done.wait(10)
    assert sorted(calls) == sorted((sig, False) for sig in STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_a_second_interrupt_exits_at_once_while_the_first_still_shuts_down() -> None:
    """The first Ctrl-C starts a graceful shutdown, which here never ends (a processor stuck in
    shutdown_requested); the second ends the process, saying what is read again."""
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, threading\n"
            "from kclpy.signals import on_stop_signals\n"
            "def stop(signum):\n"
            "    print('stopping', flush=True)\n"
            "    threading.Event().wait()\n"
            "with on_stop_signals(stop):\n"
            "    print('ready', flush=True)\n"
            "    threading.Event().wait()\n")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "stopping"
        child.send_signal(signal.SIGINT)
        code = child.wait(timeout=60)
    finally:
        child.kill()
    assert code == EXIT_FORCED == 130
    assert child.stderr is not None and "will be read again" in child.stderr.read()
