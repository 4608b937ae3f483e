"""``kclpy.signals``: a stop signal's work runs on a thread of its own, so a signal that lands
while the main thread holds the lock that work needs cannot hang the process."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kclpy.signals import EXIT_FORCED, STOP_SIGNALS, on_stop_signals

ROOT = Path(__file__).resolve().parent.parent


def line_of(child: subprocess.Popen[str]) -> str:
    """The child's next line, or a failure instead of a test hanging on a child that never
    writes it."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], 60)
    assert ready, "the child wrote no line in 60 s"
    return child.stdout.readline().strip()


def test_a_signal_landing_inside_the_lock_its_work_needs_does_not_hang() -> None:
    """The worker's main loop clears and waits on an Event five times a second, each time
    holding its non-reentrant lock for a few bytecodes; work done by a handler run right
    then on the same thread would wait for itself forever."""
    stop = threading.Event()
    with on_stop_signals(lambda signum: stop.set()):
        with stop._cond:  # type: ignore[attr-defined]  # what Event.clear() holds
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass  # bytecodes, at which the main thread runs its Python-level handler
            assert not stop.is_set()
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


@pytest.mark.parametrize("main_thread", ["waiting", "masking both signals"])
def test_a_second_interrupt_exits_at_once_while_the_first_still_shuts_down(
        main_thread: str) -> None:
    """The first Ctrl-C starts a graceful shutdown, which here never ends (a processor stuck in
    shutdown_requested); the second ends the process, saying what is read again. Also while
    the main thread runs no bytecode, so never a Python-level handler: masking both signals,
    it makes the kernel give them to another thread, as it may to a main thread blocked in a
    wait without a timeout (or a signal may land just before such a wait)."""
    mask = ("    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)\n"
            if main_thread == "masking both signals" else "")
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import signal, threading\n"
            "from kclpy.signals import STOP_SIGNALS, on_stop_signals\n"
            "def stop(signum):\n"
            "    print('stopping', signum, flush=True)\n"
            "    threading.Event().wait()\n"
            "with on_stop_signals(stop):\n"
            f"{mask}"
            "    print('ready', flush=True)\n"
            "    threading.Event().wait()\n")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert line_of(child) == "ready"
        child.send_signal(signal.SIGINT)
        assert line_of(child).split() == ["stopping", str(int(signal.SIGINT))]
        child.send_signal(signal.SIGINT)
        code = child.wait(timeout=60)
    finally:
        child.kill()
    assert code == EXIT_FORCED == 130
    assert child.stderr is not None and "will be read again" in child.stderr.read()


def test_a_stop_signal_while_the_handlers_come_and_go_is_heard(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM right after any one of the installing and restoring calls (a pod stopped as
    it starts, a host program's SIGTERM as the worker stops) is heard by the work or by the
    handler it replaced: with the Python-level handler ours but the wakeup fd not (yet, or no
    longer), the handler did nothing and the signal was gone."""
    heard_by_old: list[int] = []
    heard_by_fn: list[int] = []
    fn_called = threading.Condition()
    #: signals that only the work can have heard
    for_fn = 0

    def old(signum: int, frame: object) -> None:
        heard_by_old.append(signum)

    def fn(signum: int) -> None:
        with fn_called:
            heard_by_fn.append(signum)
            fn_called.notify_all()

    def then_a_sigterm(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal for_fn
            result = real(*args, **kwargs)
            before = len(heard_by_old)
            signal.raise_signal(signal.SIGTERM)  # its Python-level handler runs before this returns
            if len(heard_by_old) == before:
                for_fn += 1
            return result
        return call

    previous = signal.signal(signal.SIGTERM, old)
    try:
        monkeypatch.setattr(signal, "signal", then_a_sigterm(signal.signal))
        monkeypatch.setattr(signal, "set_wakeup_fd", then_a_sigterm(signal.set_wakeup_fd))
        with on_stop_signals(fn):
            pass
        monkeypatch.undo()
        assert for_fn > 0
        with fn_called:
            assert fn_called.wait_for(lambda: len(heard_by_fn) >= for_fn, 10), (
                f"{for_fn - len(heard_by_fn)} of {for_fn} SIGTERMs were heard by nobody")
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_installing_off_the_main_thread_fails_without_leaking_the_pipe() -> None:
    """Python lets only the main thread install signal handlers; an embedding program that
    asks for them from another thread gets the error, and keeps no descriptor per try."""
    before = set(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []

    def install() -> None:
        try:
            with on_stop_signals(lambda signum: None):
                pass
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert set(os.listdir("/proc/self/fd")) == before
