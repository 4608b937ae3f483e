"""One SparkSession for every Spark test (starting one costs seconds and a JVM's memory).

Spark starts its Python workers from the JVM, which inherits this process's environment at
the moment the session starts: that is when the workers learn which interpreter to run
(``PYSPARK_PYTHON``), where kclpy is (``PYTHONPATH``, for a checkout that is not installed)
and the fake credentials of tests/conftest.py. Hence the environment is set before the
session starts (after the session-wide AWS environment) and put back after it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark(aws_test_environment: None) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    import kclpy.spark
    from kclpy.spark.java import ensure_java

    # The bundled runtime even where a system Java exists: the Spark tests prove that
    # `pip install kinesis-kclpy[spark]` is all a machine without Java needs.
    saved_java = {name: os.environ.get(name) for name in ("JAVA_HOME", "PATH")}
    ensure_java(prefer_bundled=True)

    root = str(Path(kclpy.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    wanted = {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": root if not path else os.pathsep.join([root, path]),
    }
    saved: dict[str, str | None] = {name: os.environ.get(name) for name in wanted}
    saved.update(saved_java)
    os.environ.update(wanted)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("kclpy-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.pollingDelay", "100ms")
        # a loaded machine (CI, 2 cores) can take longer than the default 15 s to start a
        # Python worker, which then fails the query
        .config("spark.python.authenticate.socketTimeout", "120s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    kclpy.spark.register(session)
    try:
        yield session
    finally:
        session.stop()
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous

