"""Hostile producers: KPL aggregates built to make the worker copy what they multiply (one
long key shared by many sub-records, huge key tables, counts, deep or garbage protobuf)
must neither raise MemoryError nor kill the worker, and what leaves it (MultiLang lines,
Arrow batches) stays bounded.

Each page goes through the worker's record path (the read pipeline's de-aggregation, the
native processor's records, MultiLang's processRecords lines, the Spark source's Arrow
batches) in a child process whose address space is capped (``RLIMIT_AS``, set in the
child: tests/support/hostile_child.py). Memory is asserted by the cap: a path that copies a
shared key per record dies with MemoryError there, however large this machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kclpy.multilang.protocol import MAX_MESSAGE_BYTES
from kclpy.spark.arrow import MAX_BATCH_BYTES

pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="RLIMIT_AS caps the address space on Linux only")

ROOT = Path(__file__).resolve().parents[2]
#: the child's address space: pyarrow, protobuf and kclpy take about 1.5 GiB of it at start
CAP = 3 * 2**30

#: case -> (records delivered, aggregates delivered raw by reason)
HOSTILE = {
    "huge_key": (1, {"key_limits": 1}),
    "wide_key": (1, {"too_large": 1}),
    "too_many": (1, {"too_large": 1}),
    "huge_hash_key": (1, {"key_limits": 1}),
    "many_long_keys": (1, {"key_limits": 1}),
    "deep_nesting": (1, {"malformed": 1}),
    "huge_index": (1, {"malformed": 1}),
    "huge_length": (1, {"malformed": 1}),
    "repeated_data": (1, {}),
    # within every limit: three 1 MiB aggregates of 174,000 empty records, one 256-character
    # key, 131 MiB of keys once each record carries its own
    "legal_max": (3 * 174_000, {}),
}


def run_child(cases: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "tests.support.hostile_child", ",".join(cases), str(CAP)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)


def outcomes(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-4000:]}"
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {outcome["case"]: outcome for outcome in found}


def test_hostile_aggregates_are_delivered_without_exhausting_memory() -> None:
    results = outcomes(run_child(list(HOSTILE)))
    assert set(results) == set(HOSTILE)
    for case, (delivered, reasons) in HOSTILE.items():
        outcome = results[case]
        assert (outcome["delivered"], outcome["reasons"]) == (delivered, reasons), case
    # what legal input makes of its records stays within the caps
    assert 0 < results["legal_max"]["max_line_bytes"] <= MAX_MESSAGE_BYTES
    assert 0 < results["legal_max"]["max_batch_bytes"] <= MAX_BATCH_BYTES + 64


def test_random_aggregates_come_out_whole_or_raw_within_the_cap() -> None:
    """400 aggregates with tables, counts, indexes and keys drawn freely (keys up to twice
    Kinesis' limit, explicit hash keys of any length), some damaged: every record comes out
    as all its user records or as itself, as the slow account in tests/support says."""
    outcome = outcomes(run_child(["random"]))["random"]
    assert outcome["delivered"] == outcome["expected"]
    assert outcome["reasons"]["malformed"] and outcome["reasons"]["key_limits"]
    assert outcome["max_line_bytes"] <= MAX_MESSAGE_BYTES


def test_the_cap_is_real() -> None:
    """The child's cap makes an allocation beyond it fail, so the tests above would see any
    path that copies a multiplied key fail too."""
    done = run_child(["control"])
    assert done.returncode == 1
    assert "MemoryError" in done.stderr
