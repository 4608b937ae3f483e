"""An ordinary kclpy record processor that runs an amazon_kclpy application as a child process.

The worker creates one ``MultiLangRecordProcessor`` per held shard through
``multilang_processor_factory``, exactly as it would a native processor; each one starts its
own child and translates every callback into the MultiLangDaemon exchange the Java daemon
performs (see ``protocol``). Checkpoint requests from the child go to the shard's real
Checkpointer, so fencing and validation are the same as for a native processor.

A child that dies, hangs or breaks the protocol is killed and the callback raises
``MultiLangChildError`` (a ``ProcessorRestartRequired``): the consumer replaces the processor
and replays from the last checkpoint, so nothing is lost and the other shards carry on. The
Java daemon exits the whole JVM in these cases instead.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, NoReturn

from kclpy.checkpoint import Checkpointer
from kclpy.errors import (
    CheckpointError,
    ConfigError,
    InvalidStateException,
    ProcessorRestartRequired,
)
from kclpy.metrics import (
    MULTILANG_CHILD_FAILURES,
    MULTILANG_STDOUT_FULL,
    MULTILANG_STRAY_STDOUT_LINES,
    NOWHERE,
    Metrics,
    Scope,
)
from kclpy.multilang import protocol
from kclpy.multilang.process import MAX_UNREAD_STDOUT_BYTES, ChildFailure, ChildProcess
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)

log = logging.getLogger("kclpy.multilang")

#: What a line on the child's stdout that is not a protocol message does: ``restart`` treats
#: it as a broken child; ``skip`` logs and ignores it, as the Java daemon does.
StrayStdoutPolicy = Literal["restart", "skip"]
STRAY_STDOUT_POLICIES: tuple[StrayStdoutPolicy, ...] = ("restart", "skip")

#: characters of an offending stdout line quoted in the log
_QUOTE_CHARS = 200
#: what the operator can do about a failure, appended to its log line
_HINTS = {
    "timeout": " (if its batches legitimately take longer, raise timeoutInSeconds)",
    "protocol": " (stdout is the protocol channel: the application must log to stderr)",
}

__all__ = [
    "MultiLangChildError",
    "MultiLangRecordProcessor",
    "ProcessorRestartRequired",
    "StrayStdoutPolicy",
    "multilang_processor_factory",
    "resolve_command",
]


class MultiLangChildError(ProcessorRestartRequired):
    """The shard's child process failed and was killed. ``reason`` is one of ``start_failed``,
    ``exited``, ``timeout``, ``protocol`` (the metric label)."""

    def __init__(self, lease_key: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.lease_key = lease_key
        self.reason = reason


class MultiLangRecordProcessor(IRecordProcessor):
    """Serves one shard through one child process running ``argv`` in ``cwd``.

    ``response_timeout_s`` bounds each wait for the child: for its next message after a
    message was sent to it (a checkpoint reply starts a new wait, so a long batch that keeps
    checkpointing is fine). ``exit_timeout_s`` is how long the child may take to exit after
    its last message before its process group is killed. ``max_unread_stdout_bytes`` bounds
    what the child may write to stdout ahead of being asked (``process``);
    ``max_message_bytes`` the JSON of one ``processRecords`` line (``process_records``).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        metrics: Metrics | None = None,
        response_timeout_s: float = 60.0,
        exit_timeout_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        stray_stdout: StrayStdoutPolicy = "restart",
        max_unread_stdout_bytes: int = MAX_UNREAD_STDOUT_BYTES,
        max_message_bytes: int = protocol.MAX_MESSAGE_BYTES,
    ) -> None:
        if not argv:
            raise ValueError("argv must name a program")
        if stray_stdout not in STRAY_STDOUT_POLICIES:
            raise ValueError(f"stray_stdout must be one of {STRAY_STDOUT_POLICIES}")
        self._argv = list(argv)
        self._cwd = cwd
        self._metrics = metrics
        self._m: Scope = NOWHERE
        self._response_timeout_s = response_timeout_s
        self._exit_timeout_s = exit_timeout_s
        self._env = env
        self._stray_stdout = stray_stdout
        self._max_unread = max_unread_stdout_bytes
        self._max_message_bytes = max_message_bytes
        self._lease_key = "?"
        self._child: ChildProcess | None = None
        self._failure: MultiLangChildError | None = None

    @property
    def child_pid(self) -> int | None:
        """The running child's pid, None when there is none (for operators and tests)."""
        return None if self._child is None else self._child.pid

    # -- IRecordProcessor ----------------------------------------------------------------

    def initialize(self, initialize_input: InitializeInput) -> None:
        if self._child is not None:
            self._stop_child()
        self._lease_key = initialize_input.shard_id
        if self._metrics is not None:
            self._m = self._metrics.shard(self._lease_key)
        self._failure = None
        self._start_child(initialize_input.sequence_number,
                          initialize_input.sub_sequence_number)

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        """Sends the batch as ``processRecords`` lines of at most ``max_message_bytes``, one
        after the other, each acknowledged before the next is sent.

        While the child handles a line, the checkpointer's last record delivered is that
        line's last: a ``checkpoint()`` without arguments covers what the child was given,
        never the rest of the batch, and a position beyond it is refused as one beyond what
        was delivered. The consumer's own mark (the batch's last record) is where the last
        line leaves it."""
        checkpointer = process_records_input.checkpointer
        lines = protocol.split_process_records(process_records_input.records,
                                               process_records_input.millis_behind_latest,
                                               self._max_message_bytes)
        for line, last in lines:
            if last is not None:
                checkpointer.mark_delivered(last)
            self._exchange(line, protocol.PROCESS_RECORDS, checkpointer)

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        if self._child is None:
            return
        try:
            self._exchange(protocol.encode_lease_lost(), protocol.LEASE_LOST, None,
                           consequence="the lease is lost already, so nothing restarts")
        except MultiLangChildError:
            return
        self._stop_child()

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        """Keeps the child when it did not checkpoint SHARD_END: the consumer calls
        shard_ended again until it does, and the same child should get that call."""
        checkpointer = shard_ended_input.checkpointer
        if self._child is None:
            # The previous attempt killed the child; every record was acknowledged by then,
            # so a fresh child resuming from the last checkpoint can end the shard.
            last = checkpointer.position
            self._start_child(last.checkpoint, last.sub_sequence_number)
        self._exchange(protocol.encode_shard_ended(), protocol.SHARD_ENDED, checkpointer)
        if checkpointer.position.is_shard_end:
            self._stop_child()

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        """After shutdownRequested the Java daemon's child gets leaseLost (the consumer shuts
        down with reason REQUESTED), so v1/v2 processors see ``shutdown("ZOMBIE")`` last; kclpy
        calls nothing after shutdown_requested, so both messages are sent here."""
        if self._child is None:
            return
        self._exchange(protocol.encode_shutdown_requested(), protocol.SHUTDOWN_REQUESTED,
                       shutdown_requested_input.checkpointer,
                       consequence="the shard is being handed over from its last checkpoint")
        self._exchange(protocol.encode_lease_lost(), protocol.LEASE_LOST, None,
                       consequence="the shard is being handed over from its last checkpoint")
        self._stop_child()

    def close(self) -> None:
        """Kill the child now, if there is one; for a caller that abandons this processor
        without a final callback."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    # -- the exchange --------------------------------------------------------------------

    def _start_child(self, sequence_number: str | None, sub_sequence_number: int | None) -> None:
        child = ChildProcess(self._argv, cwd=self._cwd, lease_key=self._lease_key, env=self._env,
                             max_unread_bytes=self._max_unread, on_full=self._stdout_full)
        self._child = child
        try:
            child.start()
        except ChildFailure as exc:
            self._fail(child, exc.reason, str(exc), protocol.INITIALIZE)
        self._exchange(
            protocol.encode_initialize(self._lease_key, sequence_number, sub_sequence_number),
            protocol.INITIALIZE, None)

    def _stdout_full(self) -> None:
        self._m.inc(MULTILANG_STDOUT_FULL)

    def _exchange(self, line: str, action: str, checkpointer: Checkpointer | None, *,
                  consequence: str = "the shard restarts from its last checkpoint") -> None:
        """Send ``line`` and serve the child's checkpoint requests until it acknowledges
        ``action``. Any failure kills the child and raises MultiLangChildError."""
        child = self._child
        if child is None:
            if self._failure is not None:
                raise self._failure
            raise MultiLangChildError(self._lease_key, "exited",
                                      f"shard {self._lease_key}: no child process for {action}")
        try:
            child.send_line(line, self._response_timeout_s)
            deadline = time.monotonic() + self._response_timeout_s
            while True:
                message = self._next_message(child, deadline)
                if isinstance(message, protocol.CheckpointRequest):
                    reply = self._checkpoint(message, checkpointer, action)
                    child.send_line(reply, self._response_timeout_s)
                    deadline = time.monotonic() + self._response_timeout_s
                    continue
                if message.response_for != action:
                    raise protocol.ProtocolError(
                        f"acknowledged {message.response_for!r} while {action!r} was pending",
                        repr(message))
                return
        except ChildFailure as exc:
            self._fail(child, exc.reason, str(exc), action, consequence)
        except protocol.ProtocolError as exc:
            quoted = exc.line.strip()[:_QUOTE_CHARS]
            self._fail(child, "protocol", f"broke the protocol ({exc}): {quoted!r}", action,
                       consequence)

    def _next_message(self, child: ChildProcess, deadline: float) -> protocol.ChildMessage:
        while True:
            line = child.read_line(deadline - time.monotonic())
            try:
                message = protocol.decode_child_line(line)
            except protocol.StrayLine:
                if self._stray_stdout == "restart":
                    raise
                log.warning("shard %s: child wrote a line that is not a protocol message to "
                            "stdout; skipped: %r", self._lease_key, line.strip()[:_QUOTE_CHARS],
                            extra={"shard_id": self._lease_key})
                self._m.inc(MULTILANG_STRAY_STDOUT_LINES)
                continue
            if message is not None:
                return message

    def _checkpoint(self, request: protocol.CheckpointRequest,
                    checkpointer: Checkpointer | None, action: str) -> str:
        """Checkpoint as asked and build the reply; a failure travels to the child by its Java
        exception name, where amazon_kclpy raises it as ``CheckpointError``."""
        error: str | None = None
        if checkpointer is None:
            # As the Java daemon: no checkpointer exists during initialize and leaseLost.
            error = InvalidStateException.name
            log.error("shard %s: child asked to checkpoint during %s, where it is not possible",
                      self._lease_key, action, extra={"shard_id": self._lease_key})
        else:
            try:
                checkpointer.checkpoint(request.sequence_number, request.sub_sequence_number)
            except CheckpointError as exc:
                error = exc.name
                log.warning("shard %s: checkpoint at %s/%s failed: %s", self._lease_key,
                            request.sequence_number, request.sub_sequence_number, exc,
                            extra={"shard_id": self._lease_key})
            except Exception as exc:
                # The Java daemon answers any throwable with its class name; the child decides.
                error = type(exc).__name__
                log.exception("shard %s: checkpoint at %s/%s failed unexpectedly",
                              self._lease_key, request.sequence_number,
                              request.sub_sequence_number, extra={"shard_id": self._lease_key})
        return protocol.encode_checkpoint_reply(request.sequence_number,
                                                request.sub_sequence_number, error)

    def _fail(self, child: ChildProcess, reason: str, detail: str, action: str,
              consequence: str = "the shard restarts from its last checkpoint") -> NoReturn:
        if self._child is child:
            self._child = None
        child.kill()
        tail = child.stderr_tail()
        stderr = f"; its last stderr lines: {' | '.join(tail)}" if tail else ""
        hint = _HINTS.get(reason, "")
        log.error("shard %s: child pid %s %s while handling %s; killed it, %s%s%s",
                  self._lease_key, child.pid, detail, action, consequence, hint, stderr,
                  extra={"shard_id": self._lease_key, "reason": reason})
        self._m.inc(MULTILANG_CHILD_FAILURES, reason)
        self._failure = MultiLangChildError(
            self._lease_key, reason,
            f"shard {self._lease_key}: child process {detail} while handling {action}")
        raise self._failure

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        code = child.stop(self._exit_timeout_s)
        log.info("shard %s: child pid %s ended with exit code %s", self._lease_key, child.pid,
                 code, extra={"shard_id": self._lease_key})


def resolve_command(executable: str, cwd: Path) -> list[str]:
    """``executableName`` as an argv: split like a POSIX shell would (no shell runs it), the
    program looked up relative to ``cwd`` (the properties file's folder) before ``PATH``.

    A ``.py`` program that is not executable is run with this interpreter, so a sample whose
    file mode got lost in a copy still starts. Raises ConfigError naming ``executableName``.
    """
    try:
        argv = shlex.split(executable)
    except ValueError as exc:
        raise ConfigError("executableName", f"{executable!r} cannot be split: {exc}") from None
    if not argv:
        raise ConfigError("executableName", "is empty")
    program = argv[0]
    path = Path(program).expanduser()
    if not path.is_absolute():
        has_dir = os.sep in program or (os.altsep is not None and os.altsep in program)
        if not has_dir and not (cwd / path).is_file():
            if shutil.which(program) is None:
                raise ConfigError("executableName", f"{program!r} is neither a file in {cwd} "
                                  "nor a command on PATH")
            return argv
        path = cwd / path
    if not path.is_file():
        raise ConfigError("executableName", f"{str(path)!r} does not exist")
    if not os.access(path, os.X_OK):
        if path.suffix == ".py":
            return [sys.executable, str(path), *argv[1:]]
        raise ConfigError("executableName", f"{str(path)!r} is not executable")
    return [str(path), *argv[1:]]


def multilang_processor_factory(
    executable: str,
    *,
    cwd: Path,
    metrics: Metrics | None,
    response_timeout_s: float = 60.0,
    exit_timeout_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    stray_stdout: StrayStdoutPolicy = "restart",
) -> Callable[[], IRecordProcessor]:
    """A processor factory for the Worker that runs ``executable`` (``executableName``) per
    shard. The command is resolved now, so a typo fails at start-up rather than per shard.

    ``env`` is added to the inherited environment of every child.
    """
    base = cwd.resolve()
    argv = resolve_command(executable, base)
    if response_timeout_s <= 0:
        raise ConfigError("timeoutInSeconds", f"must be positive, got {response_timeout_s}")
    if stray_stdout not in STRAY_STDOUT_POLICIES:
        raise ConfigError("stray_stdout", f"{stray_stdout!r} is not one of "
                          f"{', '.join(STRAY_STDOUT_POLICIES)}")
    log.info("multilang: every shard runs %s in %s", shlex.join(argv), base)

    def factory() -> IRecordProcessor:
        return MultiLangRecordProcessor(
            argv, cwd=base, metrics=metrics, response_timeout_s=response_timeout_s,
            exit_timeout_s=exit_timeout_s, env=env, stray_stdout=stray_stdout)

    return factory
