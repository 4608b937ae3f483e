"""One child process per shard, and the pipes to it.

stdout is the protocol channel and stderr is the application's log (shown as it is
written, partial lines included: ``stderr.py``), so both are drained by their own threads
all the time: a child that writes a lot to either must never block on a full pipe while the
worker is busy elsewhere. Writes to stdin are non-blocking with a deadline, because a child
that stops reading would otherwise hang the shard's delivery thread for ever on a large
``processRecords`` line.

What stdout holds that nobody asked for yet is bounded (``max_unread_bytes``): the protocol
lines are read only while an exchange waits for them, and a child that writes between
exchanges (logging to stdout, a line without an end) must not grow the worker without limit.
At the bound the reader stops reading, so the child blocks on its full pipe - as any writer
to a slow reader does, and as the Java daemon's on-demand reader makes it - until the next
exchange reads what was written. Only while a message is being sent (a blocked child cannot
read it) is output beyond the bound dropped, and only until its last byte is written: before
that the child cannot have read the message, so nothing it wrote can be the answer. From the
write of the last byte on, the answer may follow at once, so the reader waits instead.
Reaching the bound is logged (WARNING) and counted (``on_full``).

The child runs in its own session (process group), so that a stuck child and anything it
started can be killed together. It never outlives the worker: every child still running
when the interpreter exits is killed (``kill_all``, at exit), and on Linux the kernel kills it
when the thread that started it - its shard's delivery thread - or the whole worker dies
(``kclpy.lifetime``), SIGKILL included.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
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
from kclpy.lifetime import die_with_parent
from kclpy.multilang import stderr

log = logging.getLogger("kclpy.multilang")

#: longest piece of one stdout/stderr line handled at once; longer lines arrive in pieces,
#: so a child that never writes a newline cannot make the worker buffer without bound
MAX_LINE_BYTES = 64 * 1024
#: stdout bytes read from the child but not yet asked for, beyond which reading pauses
MAX_UNREAD_STDOUT_BYTES = 1024 * 1024
#: stderr lines kept for the log line that reports a failed child
STDERR_TAIL_LINES = 5

_EOF = None

#: every started child not yet ended, for ``kill_all``
_live: set[ChildProcess] = set()
_live_lock = threading.Lock()


def kill_all() -> int:
    """Kill every child this process started that is still running (with its process
    group); how many there were. Runs at interpreter exit, so a worker that stops while a
    child is still busy - in a shutdown handler slower than the shutdown grace - does not
    leave it running after its lease has moved on."""
    with _live_lock:
        children = list(_live)
    for child in children:
        child.kill()
    return len(children)


atexit.register(kill_all)


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

    def __init__(self, argv: Sequence[str], *, cwd: Path, lease_key: str,
                 env: Mapping[str, str] | None = None,
                 max_unread_bytes: int = MAX_UNREAD_STDOUT_BYTES,
                 on_full: Callable[[], None] | None = None) -> None:
        if max_unread_bytes < 1:
            raise ValueError("max_unread_bytes must be positive")
        self.argv = list(argv)
        self.lease_key = lease_key
        self._cwd = cwd
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: collections.deque[bytes | None] = collections.deque()
        self._unread = 0
        self._max_unread = max_unread_bytes
        self._on_full = on_full
        #: set once the child is being ended: the reader then drops what it reads
        self._discard = False
        #: the bound was reached (reported once until reading frees room again)
        self._full = False
        #: a message is being written to the child (``send_line``), and what was dropped
        self._sending = False
        #: the message's last byte is being or has been written: the child may answer now
        self._last_byte = False
        self._dropped = 0
        self._ready = threading.Condition()
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
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL))
        except OSError as exc:
            raise ChildStartError(f"could not start {self.argv!r} in {self._cwd}: {exc}") from exc
        with _live_lock:
            _live.add(self)
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        os.set_blocking(self._proc.stdin.fileno(), False)
        self._spawn(self._read_stdout, self._proc.stdout, "stdout")
        self._spawn(self._read_stderr, self._proc.stderr, "stderr")
        log.info("shard %s: started child pid %d: %s", self.lease_key, self._proc.pid,
                 shlex.join(self.argv), extra={"shard_id": self.lease_key})

    def _spawn(self, target: Callable[[IO[bytes]], None], stream: IO[bytes], name: str) -> None:
        thread = threading.Thread(target=target, args=(stream,), daemon=True,
                                  name=f"kclpy-multilang-{self.lease_key}-{name}")
        thread.start()
        self._threads.append(thread)

    # -- the pipes -----------------------------------------------------------------------

    @property
    def unread_bytes(self) -> int:
        """Bytes of stdout read from the child and not yet asked for (at most
        ``max_unread_bytes`` plus one piece of a line)."""
        with self._ready:
            return self._unread

    def _read_stdout(self, stream: IO[bytes]) -> None:
        try:
            while chunk := stream.readline(MAX_LINE_BYTES):
                self._queue_piece(chunk)
        except OSError:
            log.debug("shard %s: reading the child's stdout failed", self.lease_key,
                      exc_info=True)
        finally:
            with self._ready:
                self._lines.append(_EOF)
                self._ready.notify_all()

    def _queue_piece(self, piece: bytes) -> None:
        """Queue one piece of stdout; at the bound, wait for the next exchange to read some
        - or drop the piece while a message is being sent, see ``send_line``."""
        with self._ready:
            if self._unread >= self._max_unread and not self._discard:
                if not self._full:
                    self._full = True
                    log.warning("shard %s: child pid %s wrote %d bytes to stdout that were "
                                "not asked for; reading paused (the child blocks) until its "
                                "next message. stdout is the protocol channel: log to stderr",
                                self.lease_key, self.pid, self._unread,
                                extra={"shard_id": self.lease_key})
                    if self._on_full is not None:
                        self._on_full()
                while (self._unread >= self._max_unread and not self._discard
                       and not (self._sending and not self._last_byte)):
                    self._ready.wait()
                if self._unread >= self._max_unread and self._sending and not self._last_byte:
                    self._dropped += len(piece)
                    return
            if self._discard:
                return
            self._lines.append(piece)
            self._unread += len(piece)
            self._ready.notify_all()

    def _read_stderr(self, stream: IO[bytes]) -> None:
        """Log the child's stderr as it is written, partial lines after a quiet period
        (``stderr.py``)."""

        def emit(text: str) -> None:
            self._stderr_tail.append(text)
            log.info("shard %s: child stderr: %s", self.lease_key, text,
                     extra={"shard_id": self.lease_key, "child_stderr": text})

        try:
            stderr.pump(stream.fileno(), emit, max_bytes=MAX_LINE_BYTES)
        except (OSError, ValueError):
            log.debug("shard %s: reading the child's stderr failed", self.lease_key,
                      exc_info=True)

    def send_line(self, line: str, timeout_s: float) -> None:
        """Write ``line`` and a newline, all of it, within ``timeout_s``.

        A child paused on its full stdout does not read its stdin, so a message larger than
        the pipe would wait for it for ever. While a message is sent, output beyond the
        bound is therefore read and dropped until the message's last byte is written: the
        child cannot have read the message before, so what it wrote cannot be the answer to it,
        only more of what the protocol does not expect."""
        with self._ready:
            self._sending = True
            self._ready.notify_all()
        try:
            self._write_line(line, timeout_s)
        finally:
            with self._ready:
                self._sending = False
                self._last_byte = False
                self._ready.notify_all()
                if self._dropped:
                    log.warning("shard %s: dropped %d bytes the child wrote to stdout beyond "
                                "the %d unread while a message was sent to it", self.lease_key,
                                self._dropped, self._max_unread,
                                extra={"shard_id": self.lease_key})
                    self._dropped = 0

    def _write_line(self, line: str, timeout_s: float) -> None:
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
                last = len(data) == 1
                if last:
                    # From here on the child may have the whole message and answer it: the
                    # reader keeps what it reads (``_queue_piece``). The last byte goes alone,
                    # so that every write before it leaves the message unfinished.
                    with self._ready:
                        self._last_byte = True
                try:
                    written = os.write(fd, data if last else data[:-1])
                except BlockingIOError:
                    if last:
                        with self._ready:
                            self._last_byte = False
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
        with self._ready:
            if not self._ready.wait_for(lambda: bool(self._lines), max(timeout_s, 0.0)):
                raise ChildTimeoutError(f"sent nothing for {timeout_s:g}s")
            piece = self._lines.popleft()
            if piece is not None:
                self._unread -= len(piece)
                if self._unread < self._max_unread:
                    self._full = False
                self._ready.notify_all()
        if piece is _EOF:
            self._stdout_closed = True
            raise ChildExitedError(self._exit_description(None))
        return piece.decode("utf-8", errors="replace")

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
        self._stop_reading()
        try:
            code = proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("shard %s: child pid %d still running %gs after its last message; "
                        "killing its process group", self.lease_key, proc.pid, grace_s,
                        extra={"shard_id": self.lease_key})
            self.kill()
            return proc.returncode
        self._ended()
        return code

    def kill(self) -> None:
        """Kill the child and everything in its process group, now."""
        proc = self._proc
        if proc is None:
            return
        self._close_stdin()
        self._stop_reading()
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
            log.error("shard %s: child pid %d did not die after SIGKILL", self.lease_key,
                      proc.pid, extra={"shard_id": self.lease_key})
            return
        self._ended()

    def _stop_reading(self) -> None:
        """Nothing more is asked of the child: let a reader paused at the bound go on,
        dropping the rest, so it can reach the end of the pipe and finish."""
        with self._ready:
            self._discard = True
            self._lines.clear()
            self._unread = 0
            self._ready.notify_all()

    def _ended(self) -> None:
        with _live_lock:
            _live.discard(self)
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
