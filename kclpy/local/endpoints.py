"""AWS-compatible endpoints on loopback ports: moto embedded in this process, or an emulator
run as a child process that is owned, watched and reaped by the object that started it.

Every endpoint is proven ready by answering a real API call over HTTP, not by a port being
open: emulators open their sockets well before they can serve requests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from werkzeug.serving import BaseWSGIServer

from kclpy.errors import KCLError
from kclpy.local.moto_app import make_moto_server
from kclpy.retry import GaveUp, RetryPolicy, retrying

LOOPBACK = "127.0.0.1"

# Emulators accept any credentials; passing these explicitly keeps the probes from ever
# resolving (or sending anywhere) whatever real credentials the environment holds.
_DUMMY_KEY_ID = "kclpy-local"
_DUMMY_SECRET = "kclpy-local"  # noqa: S105
_PROBE_REGION = "us-east-1"
_PROBE_CONFIG = Config(
    connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1, "mode": "standard"}
)
_POLL_INTERVAL_S = 0.1
_TERMINATE_GRACE_S = 5.0
# A free port can be taken by someone else between our probe and the child's bind; a child
# that dies before answering is therefore started again on fresh ports a couple of times.
_START_ATTEMPTS = 3
# at once: a lost race for a port is not a load that waiting would ease
_RESTARTS = RetryPolicy(0.0, 0.0, max_attempts=_START_ATTEMPTS)
# Where this kclpy is imported from: a child running one of its modules must import the same
# copy, even when that is a source checkout on the parent's sys.path rather than installed.
_IMPORT_ROOT = str(Path(__file__).resolve().parents[2])

_E = TypeVar("_E", bound="LocalEndpoint")


class LocalEndpointError(KCLError, RuntimeError):
    """A local endpoint could not be installed or started; the message carries the evidence."""


class LocalEndpoint:
    """An AWS-compatible HTTP endpoint reachable at ``url``.

    Constructed directly, it only names an endpoint someone else runs (LocalStack, a shared
    emulator), so :meth:`stop` has nothing to release. The ``start_*`` functions return
    subclasses that own what they started and release exactly that.
    """

    url: str

    def __init__(self, url: str) -> None:
        self.url = url
        self._stop_lock = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        """Release what this endpoint started; calling it again, from any thread, is a no-op."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._release()

    def _release(self) -> None:
        """Hook for subclasses; an endpoint run by someone else has nothing to release."""

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class EmbeddedEndpoint(LocalEndpoint):
    """moto's Kinesis and DynamoDB served from a thread of this process.

    moto keeps its state in process-wide backends, so every embedded endpoint of one process
    sees the same streams and tables, and ``moto.mock_aws`` leaving a block resets them.
    """

    def __init__(self, server: BaseWSGIServer, thread: threading.Thread,
                 host: str = LOOPBACK) -> None:
        super().__init__(f"http://{url_host(host)}:{server.server_port}")
        self._server = server
        self._thread = thread

    def _release(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class ProcessEndpoint(LocalEndpoint):
    """An emulator running as a child process, alone in its own process group.

    Its output goes to ``log_path`` (a file, so a chatty child can never block on a full
    pipe). Stopping it, or the interpreter exiting, terminates that group and removes the
    child's private working directory, log included.
    """

    def __init__(
        self, url: str, process: subprocess.Popen[bytes], workdir: Path, log_path: Path
    ) -> None:
        super().__init__(url)
        self.process = process
        self.pid = process.pid
        self.log_path = log_path
        self._finalizer = weakref.finalize(self, _terminate_group, process, workdir)

    def log_tail(self, max_bytes: int = 4096) -> str:
        """The end of the child's output, for error messages; empty once stopped."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - max_bytes))
                return log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _release(self) -> None:
        self._finalizer()


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports; held open together so none is handed out twice."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def url_host(host: str) -> str:
    """The host of a URL that reaches a server bound to ``host`` from this machine: loopback
    for the wildcard addresses."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104
        return LOOPBACK
    return f"[{host}]" if ":" in host else host


def start_embedded(host: str = LOOPBACK, port: int = 0) -> EmbeddedEndpoint:
    """Serve moto's AWS backends (Kinesis, DynamoDB, CloudWatch, ...) on ``host``:``port``
    (0: a free port) from a thread of this process.

    This is what moto's ThreadedMotoServer does, except that conditional writes are atomic
    (see :mod:`kclpy.local.moto_app`), stopping also closes the listening socket
    (ThreadedMotoServer leaves the port bound until the process exits) and per-request access
    logging is off.
    """
    server = make_moto_server(host, port)
    # A short poll interval only bounds how long stop() waits for the serving loop to notice.
    serve = functools.partial(server.serve_forever, poll_interval=0.05)
    thread = threading.Thread(target=serve, name=f"kclpy-moto-{server.server_port}", daemon=True)
    thread.start()
    return EmbeddedEndpoint(server, thread, host)


def start_moto_server() -> ProcessEndpoint:
    """Run moto as a child process serving Kinesis and DynamoDB, conditional writes atomic.

    It is ``python -m kclpy.local.moto_server``, not ``python -m moto.server``, whose
    concurrent requests can let two conditional writes to one item both succeed.
    """

    def prepare(workdir: Path) -> tuple[list[str], dict[str, str], int]:
        port = free_port()
        argv = [
            sys.executable, "-m", "kclpy.local.moto_server", "--host", LOOPBACK, "--port", str(port)
        ]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_IMPORT_ROOT, env.get("PYTHONPATH")]))
        return argv, env, port

    return launch("moto-server", prepare, services=("kinesis", "dynamodb"), ready_timeout_s=30.0)


Prepare = Callable[[Path], tuple[Sequence[str], Mapping[str, str], int]]
"""Given the child's private working directory: its argv, environment and plain HTTP port."""


def launch(
    name: str, prepare: Prepare, *, services: Sequence[str], ready_timeout_s: float,
    host: str = LOOPBACK,
) -> ProcessEndpoint:
    """Start a child in its own session and return it once every service in ``services``
    answers over HTTP; a child that dies first is retried on fresh ports (see _START_ATTEMPTS).
    ``host`` is the address the child binds, which its URL reaches.
    """
    def start() -> ProcessEndpoint:
        endpoint = _spawn(name, prepare, host)
        try:
            _wait_until_ready(endpoint, name, services, ready_timeout_s)
        except BaseException:
            endpoint.stop()
            raise
        return endpoint

    try:
        return retrying(start, _RESTARTS, retry_on=lambda exc: isinstance(exc, _ExitedEarly))
    except GaveUp as gave_up:
        raise gave_up.last from None


def _spawn(name: str, prepare: Prepare, host: str) -> ProcessEndpoint:
    workdir = Path(tempfile.mkdtemp(prefix=f"kclpy-{name}-"))
    log_path = workdir / f"{name}.log"
    try:
        argv, env, port = prepare(workdir)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=workdir,
                start_new_session=True,
            )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return ProcessEndpoint(f"http://{url_host(host)}:{port}", process, workdir, log_path)


class _ExitedEarly(LocalEndpointError):
    """The child died before it answered: a port lost to a race, or a broken setup."""


def _wait_until_ready(
    endpoint: ProcessEndpoint, name: str, services: Sequence[str], timeout_s: float
) -> None:
    probes = [_probe(service, endpoint.url) for service in services]
    deadline = time.monotonic() + timeout_s
    while True:
        returncode = endpoint.process.poll()
        if returncode is not None:
            raise _ExitedEarly(
                f"{name} exited with code {returncode} before answering on {endpoint.url}; "
                f"its last output:\n{endpoint.log_tail()}"
            )
        if all(_answers(probe) for probe in probes):
            return
        if time.monotonic() >= deadline:
            raise LocalEndpointError(
                f"{name} (pid {endpoint.pid}) did not answer on {endpoint.url} within "
                f"{timeout_s:.0f} s; its last output:\n{endpoint.log_tail()}"
            )
        time.sleep(_POLL_INTERVAL_S)


def _answers(probe: Callable[[], object]) -> bool:
    try:
        probe()
    except (BotoCoreError, ClientError):
        return False
    return True


def _probe(service: str, url: str) -> Callable[[], object]:
    """A cheap read-only call that only a fully started service can answer."""
    session = boto3.session.Session(
        aws_access_key_id=_DUMMY_KEY_ID,
        aws_secret_access_key=_DUMMY_SECRET,
        region_name=_PROBE_REGION,
    )
    if service == "kinesis":
        kinesis = session.client("kinesis", endpoint_url=url, config=_PROBE_CONFIG)
        return lambda: kinesis.list_streams(Limit=1)
    if service == "dynamodb":
        dynamodb = session.client("dynamodb", endpoint_url=url, config=_PROBE_CONFIG)
        return lambda: dynamodb.list_tables(Limit=1)
    raise ValueError(f"no readiness probe for service {service!r}")


def _terminate_group(process: subprocess.Popen[bytes], workdir: Path) -> None:
    """SIGTERM the child's process group, SIGKILL it if the child outlives the grace period.

    The group is signalled only while its leader is unreaped (alive or a zombie), so its id
    cannot yet belong to anyone else's processes.
    """
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=_TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)
