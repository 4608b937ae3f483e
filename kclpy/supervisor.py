"""``kclpy-worker --processes N``: N worker processes on one host, one command.

A worker is one Python process, so it uses one core for the processor's work; the lease
protocol already spreads shards over every worker of an application, so using N cores is a
matter of starting N workers that share the lease table. The supervisor does only that:

- it starts ``python -m kclpy <the same arguments>`` N times, each with its own worker id
  (``<worker id>-<i>``: the configured id, or the generated default, plus the index), so
  their leases never look like one worker's;
- with ``--metrics-port P``, child ``i`` serves its ops endpoint on ``P + i``: every worker
  is scraped on its own port (one port for all would leave all but the first crash-looping
  on "address already in use");
- SIGTERM and SIGINT are forwarded to every child; each shuts down gracefully (processors
  get ``shutdown_requested``, leases are released) and the supervisor waits for all. A child
  still running ``stop_timeout_s`` after the signal is killed (SIGKILL), so a hung worker
  cannot keep the group, or its leases' processors, alive for ever;
- the children get SIGTERM when the supervisor itself dies without forwarding anything
  (SIGKILL, OOM: ``kclpy.lifetime``), and shut down as they would on an operator's SIGTERM;
- a child that dies while the group is running (a crash, an OOM kill, ``kill -9``) is
  restarted with capped exponential backoff. Its leases are taken over by its siblings
  after the failover time as with any dead worker, and balanced back once it returns, so
  a restart costs no more than the crash did. Stopping the whole group instead would turn
  one bad process into a full outage. A child that exits 0 on its own (e.g.
  ``--stop-when-caught-up``) or 2 (bad configuration: it would fail again) is not restarted;
- a secret option given as a flag (``--lag-webhook``, ``--state-store``) reaches the
  children in their environment, not on their command lines, which every local user can
  read (``kclpy.arguments.SECRET_FLAG_ENV``).

Exit code: 0 when every child's last run exited 0, else 1.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kclpy.arguments import parse_worker_args, secrets_out_of_argv
from kclpy.config import SUPERVISED, KCLConfig
from kclpy.errors import ConfigError
from kclpy.lifetime import die_with_parent
from kclpy.redaction import redact
from kclpy.retry import NO_JITTER, RetryPolicy
from kclpy.signals import on_stop_signals

log = logging.getLogger(__name__)

#: how a child is started: (argv for ``python -m kclpy``) -> the running process
Spawn = Callable[[list[str]], "subprocess.Popen[bytes]"]

#: a child that ran at least this long before dying starts again without delay
_STABLE_AFTER_S = 60.0
_CONFIG_ERROR = 2
#: how long a stopped child may take beyond its shutdown grace (releasing its leases,
#: ending its MultiLang children) before it is killed
_STOP_MARGIN_S = 20.0
_HIGHEST_PORT = 65535


#: ``-P`` (Python 3.11+): ``-m`` does not put the current folder first on the path, where a
#: module planted there would shadow an installed one before kclpy moves it last
#: (``kclpy.loading.current_folder_last``)
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def _spawn_worker(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *_SAFE_PATH, "-m", "kclpy", *argv],
                            env={**os.environ, SUPERVISED: "1"},
                            preexec_fn=die_with_parent(signal.SIGTERM))


def strip_processes(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--processes N`` / ``--processes=N`` (the children are workers)."""
    result: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            result.append(arg)
    return result


def child_metrics_port(port: int | None, index: int) -> list[str]:
    """The ``--metrics-port`` of child ``index``: ``port + index`` (port 0 stays 0, a free
    port each), nothing without a port. Last on the command line, so it wins over the
    shared flag, and flags win over the properties file and the environment."""
    if port is None:
        return []
    return ["--metrics-port", str(port + index if port else 0)]


@dataclass
class _Child:
    index: int
    argv: list[str]
    worker_id: str
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    #: when a crashed child starts again (None: not waiting to restart)
    restart_at: float | None = None
    restarts: int = 0
    last_code: int | None = None
    #: set once the child is done for good: the exit code of its last run
    final: int | None = None
    #: clock() after which a child asked to stop is killed (None: not asked yet)
    kill_at: float | None = None


class Supervisor:
    """Runs N children until they have all exited; see the module docstring.

    Only the thread in ``run`` touches the children; ``stop`` (from a signal handler or
    any thread) just records the signal and wakes it, so a signal arriving while ``run``
    is busy can never deadlock it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        n: int,
        *,
        worker_id: str,
        metrics_port: int | None = None,
        stop_timeout_s: float = 30.0,
        spawn: Spawn = _spawn_worker,
        clock: Callable[[], float] = time.monotonic,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        poll_s: float = 0.2,
    ) -> None:
        if n < 1:
            raise ValueError("n must be at least 1")
        base = strip_processes(argv)
        self.children = [
            _Child(i, [*base, "--worker-id", f"{worker_id}-{i}",
                       *child_metrics_port(metrics_port, i)], f"{worker_id}-{i}")
            for i in range(n)]
        self._stop_timeout_s = stop_timeout_s
        self._spawn = spawn
        self._clock = clock
        #: one child: nothing to spread, so no jitter
        self._restarts = RetryPolicy(backoff_s, max_backoff_s, jitter=NO_JITTER)
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._pending_signal: int | None = None

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Forward ``signum`` to every running child and stop restarting them."""
        self._pending_signal = signum
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        for child in self.children:
            self._start(child)
        while True:
            self._forward_signal()
            self._kill_overdue()
            self._reap()
            if all(child.final is not None for child in self.children):
                break
            self._restart_due()
            self._wake.wait(self._poll_s)
            self._wake.clear()
        codes = [child.final for child in self.children]
        log.info("all %d worker processes exited: %s", len(codes), codes)
        return 0 if all(code == 0 for code in codes) else 1

    def _forward_signal(self) -> None:
        signum, self._pending_signal = self._pending_signal, None
        if signum is None:
            return
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)
                if child.kill_at is None:
                    child.kill_at = self._clock() + self._stop_timeout_s

    def _kill_overdue(self) -> None:
        now = self._clock()
        for child in self.children:
            process = child.process
            if (process is None or child.kill_at is None or now < child.kill_at
                    or process.poll() is not None):
                continue
            log.error("worker process %d (pid %d) still running %.0fs after it was asked to "
                      "stop; killing it", child.index, process.pid, self._stop_timeout_s)
            process.kill()
            child.kill_at = None

    def _start(self, child: _Child) -> None:
        child.process = self._spawn(child.argv)
        child.started_at = self._clock()
        child.restart_at = None
        log.info("worker process %d started (pid %d, worker id %s)", child.index,
                 child.process.pid, child.worker_id)

    def _reap(self) -> None:
        for child in self.children:
            process = child.process
            if process is None or child.final is not None:
                continue
            code = process.poll()
            if code is None:
                continue
            child.process = None
            child.last_code = code
            if self._stopping.is_set() or code in (0, _CONFIG_ERROR):
                child.final = code
                continue
            ran_for = self._clock() - child.started_at
            if ran_for >= _STABLE_AFTER_S:
                child.restarts = 0
            delay = self._restarts.delay(child.restarts)
            child.restarts += 1
            child.restart_at = self._clock() + delay
            log.error(
                "worker process %d (pid %d) died with %d after %.1fs; restarting in %.1fs",
                child.index,
                process.pid,
                code,
                ran_for,
                delay,
            )

    def _restart_due(self) -> None:
        for child in self.children:
            if child.restart_at is None:
                continue
            if self._stopping.is_set():
                child.final = child.last_code
                child.restart_at = None
            elif self._clock() >= child.restart_at:
                self._start(child)

    def forwarding_signals(self) -> AbstractContextManager[None]:
        """While inside, SIGTERM and SIGINT go to every child (main thread only)."""
        return on_stop_signals(self.stop)


def run_processes(argv: list[str], n: int, config: KCLConfig | None = None, *,
                  spawn: Spawn = _spawn_worker) -> int:
    """What ``kclpy-worker --processes N`` runs: N workers with ``argv`` (``--processes``
    removed), signals forwarded, restarted when they die. Returns the exit code: 0 when every
    worker's last run exited 0, 1 otherwise, 2 for a bad configuration (checked once here,
    before any process starts). ``config``: ``argv`` already parsed, by the CLI; parsing it
    again would log each of its warnings (an unknown key, say) twice."""
    child_argv, secrets = secrets_out_of_argv(strip_processes(argv))
    # inherited by every child, and read there with the flags' precedence
    os.environ.update(secrets)
    try:
        if config is None:
            config, _ = parse_worker_args(child_argv)
        port = config.metrics_port
        if port and port + n - 1 > _HIGHEST_PORT:
            raise ConfigError("--metrics-port", f"{port} + {n} processes needs ports up to "
                              f"{port + n - 1}, beyond {_HIGHEST_PORT}")
    except ConfigError as exc:
        print(f"kclpy-worker: error: {redact(str(exc))}", file=sys.stderr)
        return _CONFIG_ERROR
    if port:
        log.info("worker processes serve /metrics, /healthz and /status on %s ports %d-%d",
                 config.metrics_host, port, port + n - 1)
    supervisor = Supervisor(child_argv, n, worker_id=config.worker_id, metrics_port=port,
                            stop_timeout_s=config.shutdown_grace_ms / 1000 + _STOP_MARGIN_S,
                            spawn=spawn)
    with supervisor.forwarding_signals():
        return supervisor.run()
