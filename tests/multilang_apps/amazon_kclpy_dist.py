"""The real amazon_kclpy package, fetched from PyPI at test time.

amazon-kclpy cannot be pip-installed here: its install step downloads the MultiLangDaemon
jars from Maven. Its Python package needs none of them, so the tests download the source
distribution with pip, unpack only ``amazon_kclpy/`` (without ``jars/``) and ``samples/``,
and put the result on the children's PYTHONPATH. The unpacked copy is cached under
``$KCLPY_CACHE_DIR`` (default ``~/.cache/kclpy``), so only the first run needs PyPI.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

#: the release the acceptance test is known to pass with; override to try another
VERSION = os.environ.get("KCLPY_AMAZON_KCLPY_VERSION", "3.2.0")
_WANTED = ("amazon_kclpy", "samples")


def cache_dir() -> Path:
    configured = os.environ.get("KCLPY_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kclpy"


def amazon_kclpy_root(version: str = VERSION) -> Path:
    """A folder holding ``amazon_kclpy/`` and ``samples/`` of amazon-kclpy ``version``."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"amazon_kclpy-{version}-src"
    marker = target / ".complete"
    if marker.exists():
        return target
    with locked(cache / ".amazon_kclpy.lock"):
        if not marker.exists():
            _unpack(_sdist(cache, version), target)
            marker.touch()
    return target


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Parallel test processes must not download and unpack into the same folder at once."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sdist(cache: Path, version: str) -> Path:
    existing = sorted(cache.glob(f"amazon[_-]kclpy-{version}.tar.gz"))
    if existing:
        return existing[0]
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", f"amazon-kclpy=={version}", "-d", tmp],
            capture_output=True, text=True, timeout=600, check=False)
        found = sorted(Path(tmp).glob("amazon[_-]kclpy-*.tar.gz"))
        if done.returncode != 0 or not found:
            raise RuntimeError(
                f"could not download the amazon-kclpy {version} sdist from PyPI "
                f"(pip exit code {done.returncode}): {done.stderr.strip()[-2000:]}")
        destination = cache / found[0].name
        shutil.move(str(found[0]), destination)
        return destination


def _unpack(sdist: Path, target: Path) -> None:
    """Extract the wanted folders member by member: no path from the archive is trusted."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpack-"))
    staging.chmod(0o755)
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive.getmembers():
                parts = PurePosixPath(member.name).parts
                if (len(parts) < 3 or parts[1] not in _WANTED or "jars" in parts
                        or ".." in parts or not member.isfile()):
                    continue
                source = archive.extractfile(member)
                if source is None:
                    continue
                destination = staging.joinpath(*parts[1:])
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(source.read())
                destination.chmod(0o755 if member.mode & 0o111 else 0o644)
        if not (staging / "amazon_kclpy" / "kcl.py").is_file():
            raise RuntimeError(f"{sdist} holds no amazon_kclpy package")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
