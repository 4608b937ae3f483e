"""One child process per shard, and the pipes to it.

stdout is the protocol channel and stderr is the application's log (shown as it is
written, partial lines included: ``stderr.py``), so both are drained by their own threads
all the time: a child that writes a lot to either must never block on a full pipe while the
worker is busy elsewhere. Writes to stdin are non-blocking with a deadline, because a child
that stops reading would otherwise hang the shard's delivery thread for ever on a large
``processRecords`` line.

The child runs in its own session (process group), so that a stuck child and anything it
started can be killed together.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from kclpy.errors import KCLError
from kclpy.multilang import stderr

log = logging.getLogger("kclpy.multilang")

#: longest piece of one stdout/stderr line handled at once; longer lines arrive in pieces,
#: so a child that never writes a newline cannot make the worker buffer without bound
MAX_LINE_BYTES = 64 * 1024
#: stderr lines kept for the log line that reports a failed child
STDERR_TAIL_LINES = 5

_EOF = None


class ChildFailure(KCLError):
    """The child cannot be talked to any more. ``reason`` is the metric label."""

    reason = "failed"


class ChildStartError(ChildFailure):
    reason = "start_failed"


class ChildExitedError(ChildFailure):
    reason = "exited"


class ChildTimeoutError(ChildFailure):
    reason = "timeout"


class ChildProcess:
    """A started child with line-oriented access to its stdin and stdout."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, shard_id: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.shard_id = shard_id
        self._cwd = cwd
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout_closed = False
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        env = None
        if self._env is not None:
            env = dict(os.environ)
            env.update(self._env)
        try:
            self._proc = subprocess.Popen(
                self.argv, cwd=self._cwd, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise ChildStartError(f"could not start {self.argv!r} in {self._cwd}: {exc}") from exc
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        os.set_blocking(self._proc.stdin.fileno(), False)
        self._spawn(self._read_stdout, self._proc.stdout, "stdout")
        self._spawn(self._read_stderr, self._proc.stderr, "stderr")
        log.info("shard %s: started child pid %d: %s", self.shard_id, self._proc.pid,
                 shlex.join(self.argv), extra={"shard_id": self.shard_id})

    def _spawn(self, target: Callable[[IO[bytes]], None], stream: IO[bytes], name: str) -> None:
        thread = threading.Thread(target=target, args=(stream,), daemon=True,
                                  name=f"kclpy-multilang-{self.shard_id}-{name}")
        thread.start()
        self._threads.append(thread)

    # -- the pipes -----------------------------------------------------------------------

    def _read_stdout(self, stream: IO[bytes]) -> None:
        try:
            while chunk := stream.readline(MAX_LINE_BYTES):
                self._lines.put(chunk.decode("utf-8", errors="replace"))
        except OSError:
            log.debug("shard %s: reading the child's stdout failed", self.shard_id,
                      exc_info=True)
        finally:
            self._lines.put(_EOF)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        """Log the child's stderr as it is written, partial lines after a quiet period
        (``stderr.py``)."""

        def emit(text: str) -> None:
            self._stderr_tail.append(text)
            log.info("shard %s: child stderr: %s", self.shard_id, text,
                     extra={"shard_id": self.shard_id, "child_stderr": text})

        try:
            stderr.pump(stream.fileno(), emit, max_bytes=MAX_LINE_BYTES)
        except (OSError, ValueError):
            log.debug("shard %s: reading the child's stderr failed", self.shard_id,
                      exc_info=True)

    def send_line(self, line: str, timeout_s: float) -> None:
        """Write ``line`` and a newline, all of it, within ``timeout_s``."""
        proc = self._running()
        assert proc.stdin is not None
        data = memoryview((line + "\n").encode("utf-8"))
        deadline = time.monotonic() + timeout_s
        fd = proc.stdin.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_WRITE)
            while data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ChildTimeoutError(
                        f"did not read its stdin for {timeout_s:g}s "
                        f"({len(data)} bytes of a message left to write)")
                if not selector.select(remaining):
                    continue
                try:
                    written = os.write(fd, data)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    # BrokenPipeError in practice: the child closed stdin or exited.
                    raise ChildExitedError(self._exit_description(exc)) from exc
                data = data[written:]

    def read_line(self, timeout_s: float) -> str:
        """The next line of stdout, newline included. ChildExitedError once stdout ended,
        ChildTimeoutError if nothing arrives within ``timeout_s``."""
        if self._stdout_closed:
            raise ChildExitedError(self._exit_description(None))
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise ChildTimeoutError(f"sent nothing for {timeout_s:g}s") from None
        if line is _EOF:
            self._stdout_closed = True
            raise ChildExitedError(self._exit_description(None))
        return line

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise ChildExitedError("was never started")
        return self._proc

    def _exit_description(self, cause: OSError | None) -> str:
        proc = self._running()
        try:
            # stdout closes as the child exits; give the exit a moment to be reaped so the
            # log line can carry the exit code.
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            what = "closed its stdout" if cause is None else f"stopped reading stdin ({cause})"
            return f"{what} but is still running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def stderr_tail(self) -> list[str]:
        """The last lines the child wrote to stderr, for the log line reporting its failure."""
        return list(self._stderr_tail)

    # -- ending ----------------------------------------------------------------------------

    def stop(self, grace_s: float) -> int | None:
        """End the child as the Java daemon does: close its stdin (amazon_kclpy's loop exits
        at end of input), wait up to ``grace_s``, then kill its process group. Returns the
        exit code (negative: killed by that signal)."""
        proc = self._proc
        if proc is None:
            return None
        self._close_stdin()
        try:
            code = proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("shard %s: child pid %d still running %gs after its last message; "
                        "killing its process group", self.shard_id, proc.pid, grace_s,
                        extra={"shard_id": self.shard_id})
            self.kill()
            return proc.returncode
        self._join_readers()
        return code

    def kill(self) -> None:
        """Kill the child and everything in its process group, now."""
        proc = self._proc
        if proc is None:
            return
        self._close_stdin()
        if proc.poll() is None:
            # Only while the leader is unreaped is its pid (= the group id) certainly still
            # ours; after that the id could name someone else's group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.error("shard %s: child pid %d did not die after SIGKILL", self.shard_id,
                      proc.pid, extra={"shard_id": self.shard_id})
            return
        self._join_readers()

    def _close_stdin(self) -> None:
        proc = self._proc
        if proc is not None and proc.stdin is not None and not proc.stdin.closed:
            # Closing flushes nothing (writes go straight to the fd), but a dead reader may
            # still make close() report the broken pipe; the pipe is gone either way.
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def _join_readers(self) -> None:
        # A grandchild that inherited stdout/stderr can keep the pipes open after the child
        # is gone; the daemon reader threads are then left to finish on their own.
        for thread in self._threads:
            thread.join(timeout=1.0)
        proc = self._proc
        if proc is None or any(thread.is_alive() for thread in self._threads):
            return
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
