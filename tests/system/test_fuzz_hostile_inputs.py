"""Hostile input from the two places a worker reads what others wrote: a MultiLang child's
stdout (an untrusted executable) and the lease table's items (any writer with access to the
table: a hand edit, another library, a bug). Every line and every item has a defined
outcome - a protocol failure (the child is killed and counted, the shard restarts), a line
skipped, an unreadable item or value, or the value kept as it is - and none exhausts the
worker's memory or escapes as another exception.

The lines and items go through the worker's own paths in a child process whose address
space is capped (``RLIMIT_AS``, set in the child: tests/support/hostile_inputs_child.py):
MultiLang lines come from a real MultiLang child process, read and decoded by
``MultiLangRecordProcessor``; lease items are parsed by ``lease_from_item`` and what a
holder reads out of them (recovery queue and requests, park mark, incarnation). The taker's
scan over a table holding absurd items among good ones runs against moto here.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kclpy.errors import LeaseLostError
from kclpy.leases.table import LeaseTable
from tests.support import hostile_inputs_child as child
from tests.support.determinism import Clock
from tests.support.leases import coordinator

capped = pytest.mark.skipif(sys.platform != "linux",
                            reason="RLIMIT_AS caps the address space on Linux only")

ROOT = Path(__file__).resolve().parents[2]
#: the child's address space: kclpy and its imports map about 600 MB of it at start
CAP = 2**30

PROTOCOL = "protocol"
#: MultiLang case -> (how the exchange ended, stray stdout lines counted)
MULTILANG: dict[str, tuple[str, int]] = {
    # a 20 MiB line arrives in 64 KiB pieces, none of them a message: skipped one by one
    # (stray_stdout="skip"), the acknowledgement after them is read
    "huge_line": ("ok", 321),
    "no_newline": ("ok", 320),
    "deep_array": (PROTOCOL, 0),
    "deep_object": (PROTOCOL, 0),
    "deep_whole": (PROTOCOL, 0),
    "array": (PROTOCOL, 0),
    "number": (PROTOCOL, 0),
    "string": (PROTOCOL, 0),
    "null": (PROTOCOL, 0),
    "no_action": (PROTOCOL, 0),
    "action_not_string": (PROTOCOL, 0),
    "unknown_action": (PROTOCOL, 0),
    "status_for_nothing": (PROTOCOL, 0),
    "status_for_other": (PROTOCOL, 0),
    "checkpoint_5000_digits": (PROTOCOL, 0),
    # a well-formed request for a position never delivered: refused to the child, which
    # then acknowledges
    "checkpoint_huge_int": ("ok", 0),
    "checkpoint_negative": ("ok", 0),
    "checkpoint_60k_string": ("ok", 0),
    "checkpoint_float": (PROTOCOL, 0),
    "checkpoint_overflow": (PROTOCOL, 0),
    "checkpoint_nan": (PROTOCOL, 0),
    "checkpoint_object": (PROTOCOL, 0),
    "checkpoint_bool": (PROTOCOL, 0),
    "checkpoint_10m_string": (PROTOCOL, 0),
    # without a sequence number the sub-sequence number is not used: the last delivered
    "checkpoint_huge_sub": ("ok", 0),
    "invalid_utf8": ("ok", 1),
    "invalid_utf8_in_value": ("ok", 0),
    "nul_after": (PROTOCOL, 0),
    "nul_in_string": (PROTOCOL, 0),
    "blank_lines": ("ok", 0),
    "stray_lines": ("ok", 100_000),
}

UNREADABLE = "unreadable"
#: lease case -> the item's outcome, or the fields of the lease read from it that it sets
LEASES: dict[str, str | dict[str, Any]] = {
    "counter_400_digits": {"counter": str(10**400)[:12]},
    "counter_5000_digits": UNREADABLE,
    "counter_1m_digits": UNREADABLE,
    "counter_negative": {"counter": "-7"},
    "counter_1e309": UNREADABLE,
    "counter_nan": UNREADABLE,
    # a counter of another type could match no conditional write: refused (absent reads as 0)
    "counter_as_s": UNREADABLE,
    "counter_as_m": UNREADABLE,
    "counter_as_l": UNREADABLE,
    "counter_as_b": UNREADABLE,
    # any other attribute of another type than its own is read as absent
    "checkpoint_400k_digits": UNREADABLE,
    "checkpoint_5000_digits": UNREADABLE,
    "checkpoint_not_digits": UNREADABLE,
    "checkpoint_other_digits": UNREADABLE,
    "checkpoint_as_n": {},
    "sub_400_digits": {"checkpoint_digits": 2},
    "sub_negative": UNREADABLE,
    "pending_not_digits": UNREADABLE,
    "switches_400_digits": {},
    "parents_100k": {"parents": 100_000},
    "parents_as_l": {},
    "parents_as_b": {},
    "owner_as_m": {},
    "start_at_1e309": UNREADABLE,
    "incarnation_infinite": {},
    "incarnation_nan": {},
    "recovery_1m_requests": {"recovery": 1_000_000},
    "recovery_infinite": {"recovery": UNREADABLE},
    "recovery_400_digits": {"recovery": 1},
    "recovery_5000_digits": {"recovery": UNREADABLE},
    "recovery_deep": {"recovery": UNREADABLE},
    "recovery_not_object": {"recovery": UNREADABLE},
    "requests_deep": {"requests": [0, 2]},
    "requests_absurd": {"requests": [0, 4]},
    # a plain or undecodable mark is its own reason, bounded
    "parked_400k": {"parked": 4133},
    "parked_deep": {"parked": 5771},
    "no_key": UNREADABLE,
    "key_as_n": UNREADABLE,
    "key_400k": {},
}
#: what a lease read from a hostile item holds where its case sets nothing
PLAIN = {"counter": "0", "checkpoint_digits": len("TRIM_HORIZON"), "parents": 0,
         "recovery": 0, "requests": [0, 0], "parked": None, "incarnation_epoch": 0}


def run_child(mode: str, cases: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "tests.support.hostile_inputs_child", mode, ",".join(cases),
         str(CAP)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        check=False)


def outcomes(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-4000:]}"
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {outcome.pop("case"): outcome for outcome in found}


def test_every_case_has_an_expected_outcome() -> None:
    assert set(MULTILANG) == set(child.MULTILANG)
    assert set(LEASES) == set(child.LEASES)


@capped
def test_hostile_multilang_lines_fail_the_child_or_are_skipped_within_the_cap() -> None:
    results = outcomes(run_child("multilang", list(MULTILANG)))
    assert {case: (r["outcome"], r["stray"]) for case, r in results.items()} == MULTILANG
    # the one checkpoint written is the last record delivered; no hostile position was
    assert {case: r["checkpoints"] for case, r in results.items() if r["checkpoints"]} == {
        "checkpoint_huge_sub": ["49600000000000000000000000000000000000000000000000000001"]}


@capped
def test_hostile_lease_items_are_unreadable_or_read_as_written_within_the_cap() -> None:
    results = outcomes(run_child("leases", list(LEASES)))
    expected = {case: {"outcome": UNREADABLE} if want == UNREADABLE
                else {"outcome": "lease", **PLAIN, **(want if isinstance(want, dict) else {})}
                for case, want in LEASES.items()}
    assert results == expected


@capped
@pytest.mark.parametrize("mode", ["multilang", "leases"])
def test_the_cap_is_real(mode: str) -> None:
    """An allocation beyond the child's cap fails there, so the tests above would see any
    path that copies or parses a hostile input without bound fail too."""
    done = run_child(mode, ["control"])
    assert done.returncode == 1
    assert "MemoryError" in done.stderr


def test_the_taker_takes_the_good_leases_and_skips_the_absurd_items(
        table: LeaseTable, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    """Items no lease can be read from, among good leases, in the table a worker scans:
    each is skipped with a warning naming its attributes, the good leases are taken, and
    items read as leases with absurd values are taken as they are."""
    good = [f"shardId-{i:012d}" for i in range(3)]
    for key in good:
        table.client.put_item(TableName=table.table_name,
                              Item={"leaseKey": {"S": key}, "leaseCounter": {"N": "1"}})
    # cases DynamoDB stores (at most 400 KB an item, numbers of 38 digits, finite; the key
    # is the table's string hash key), each with the leaseCounter every KCL writes (an item
    # without one, or with one of another type: the next test)

    stored = sorted({"checkpoint_not_digits", "checkpoint_5000_digits", "sub_negative",
                     "counter_negative", "incarnation_infinite", "recovery_infinite",
                     "recovery_deep"})
    for index, case in enumerate(stored):
        table.client.put_item(TableName=table.table_name, Item={
            "leaseKey": {"S": f"hostile-{index}"}, "leaseCounter": {"N": "1"},
            **child.LEASES[case]()})
    unreadable = {f"hostile-{i}" for i, case in enumerate(stored) if LEASES[case] == UNREADABLE}
    worker, _ = coordinator(table, "A", clock, max_leases_for_worker=100)
    with caplog.at_level(logging.WARNING, logger="kclpy"):
        taken = {lease.lease_key for lease in worker.run_taker_once()}
    readable = {f"hostile-{i}" for i in range(len(stored))} - unreadable
    assert len(unreadable) == 3 and len(readable) == 4
    assert taken == set(good) | readable
    skipped = [r for r in caplog.records if r.getMessage().startswith("skipping malformed")]
    assert len(skipped) == len(unreadable)


def test_an_item_without_a_lease_counter_is_taken_and_one_of_another_type_is_skipped(
        table: LeaseTable, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    """An item written by hand or by another tool without ``leaseCounter`` was read as
    counter 0, and every take, conditional on a counter of 0, failed on it: the shard stayed
    unconsumed with nothing said. It is taken now (its counter then exists); an item whose
    counter is a string can be taken by no conditional write and is skipped with a warning
    naming it, as every item no lease can be read from."""
    table.client.put_item(TableName=table.table_name,
                          Item={"leaseKey": {"S": "no-counter"}, "checkpoint": {"S": "LATEST"}})
    table.client.put_item(TableName=table.table_name,
                          Item={"leaseKey": {"S": "string-counter"},
                                "leaseCounter": {"S": "3"}})
    stale = table.get("no-counter")
    assert stale is not None and stale.counter_absent and stale.lease_counter == 0
    worker, _ = coordinator(table, "A", clock, max_leases_for_worker=10)
    with caplog.at_level(logging.WARNING, logger="kclpy"):
        taken = {lease.lease_key for lease in worker.run_taker_once()}
    assert taken == {"no-counter"}
    item = table.get("no-counter")
    assert item is not None and item.lease_owner == "A" and item.lease_counter == 1
    skipped = [r.getMessage() for r in caplog.records
               if r.getMessage().startswith("skipping malformed")]
    assert skipped == [f"skipping malformed item in {table.table_name}: "
                       "['leaseCounter', 'leaseKey']"]
    # the copy read before A's take is fenced out like any stale copy, and once the item is
    # deleted a take of it does not create it again
    with pytest.raises(LeaseLostError):
        table.take(stale, "B")
    table.client.delete_item(TableName=table.table_name, Key={"leaseKey": {"S": "no-counter"}})
    with pytest.raises(LeaseLostError):
        table.take(stale, "B")
    assert table.get("no-counter") is None
