"""Child processes that cannot outlive the one that started them.

A worker's MultiLang children and a supervisor's workers are ended explicitly on every
orderly path. This covers the others - the parent killed with SIGKILL, an OOM kill, a crash
in native code - where no code of the parent runs any more: on Linux the kernel sends the
child a signal when its parent goes (``PR_SET_PDEATHSIG``).

The kernel's "parent" is the *thread* that forked the child, so a child started from a
short-lived thread is signalled when that thread ends. kclpy starts each MultiLang child on
its shard's delivery thread, which outlives the child on every path but a failure, and the
supervisor starts workers on its main thread; both are the lifetime wanted.

Elsewhere (macOS, the BSDs) there is no such call, and only the orderly paths apply.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


# Resolved once, in the parent: the function that runs between fork and exec must not load
# libraries or take locks another thread may have held at the fork.
_PRCTL = _load_prctl()


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child receive ``signum``
    when the starting thread (and so the process) ends; None where that is not possible.

    If the parent already ended between the fork and the call, the child is signalled at
    once, so the race cannot leave one behind."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def arrange() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return arrange
