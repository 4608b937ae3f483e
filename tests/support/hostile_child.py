"""The child of tests/system/test_fuzz_hostile_kpl.py: one hostile page through the worker's record
path under a cap on its address space, and a one-line JSON account of what came out.

Run as ``python -m tests.support.hostile_child <case>[,<case>...] <cap bytes>``: one JSON
line per case, each case a page of its own. The cap is set before the first page is built,
so a path that copies what a producer multiplies dies here with MemoryError (exit code 1
and a traceback) instead of passing because the machine is large. The case ``control``
asks for more than any cap the test sets, to show that the cap bites.
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from collections.abc import Callable

import pytest

from kclpy.metrics import Metrics
from kclpy.multilang.protocol import split_process_records
from kclpy.records import Record
from kclpy.retrieval.kpl import CORRUPT_REASONS, MAX_SUB_RECORDS
from kclpy.spark.arrow import records_to_batches
from tests.support.aggregates import expected_outcome, sign, sub_records_of
from tests.support.fakeshard import (
    SHARD,
    FakeShard,
    drain,
    make,
    route_get_records,
    sample,
    seq,
)
from tests.support.protowire import field, varint

EMPTY_SUB = field(3, field(1, 0) + field(3, b""))


def shared_key(key: str, count: int) -> bytes:
    """``count`` empty sub-records under one key: the cheapest way to multiply a key."""
    return sign(field(1, key.encode()) + EMPTY_SUB * count)


def record(index: int, data: bytes) -> Record:
    return Record(sequence_number=seq(index), partition_key=f"outer-{index}",
                  timestamp_millis=int(time.time() * 1000), data=data)


def random_aggregate(rng: random.Random) -> bytes:
    """Tables, counts, indexes and keys drawn freely, keys in ASCII up to twice Kinesis'
    limit, explicit hash keys of any length, now and then a damaged byte."""
    keys = ["".join(rng.choices("abcxyz-", k=rng.choice([0, 1, 12, 256, 257, 600])))
            for _ in range(rng.randint(0, 4))]
    ehks = [rng.choice(["", "0", "12" * rng.randint(1, 30), "x1", str(2**128 - 1)])
            for _ in range(rng.randint(0, 2))]
    body = b"".join(field(1, key.encode()) for key in keys)
    body += b"".join(field(2, key.encode()) for key in ehks)
    for _ in range(rng.choice([0, 1, 3, 50, 2_000])):
        sub = field(1, rng.randint(0, len(keys)))
        if ehks and rng.random() < 0.3:
            sub += field(2, rng.randint(0, len(ehks)))
        sub += field(3, rng.randbytes(rng.choice([0, 1, 40])))
        body += field(3, sub)
    if body and rng.random() < 0.2:
        at = rng.randrange(len(body))
        body = body[:at] + bytes([body[at] ^ rng.randint(1, 255)]) + body[at + 1:]
    return sign(body)


def page_of(case: str) -> list[bytes]:
    cases: dict[str, Callable[[], list[bytes]]] = {
        # the reviewer's record: one 500,000-character key, 85,000 empty sub-records
        "huge_key": lambda: [shared_key("k" * 500_000, 85_000)],
        # within Kinesis' key limit, as large as a KPL aggregate gets: three 1 MiB ones
        "legal_max": lambda: [shared_key("k" * 256, 174_000)] * 3,
        # a legal 1,024-byte key (256 four-byte characters): expands 170 times
        "wide_key": lambda: [shared_key("\U0001f600" * 256, 170_000)],
        "too_many": lambda: [shared_key("k", MAX_SUB_RECORDS + 1)],
        "huge_hash_key": lambda: [sign(field(1, b"k") + field(2, b"1" * 1_000_000)
                                       + field(3, field(1, 0) + field(2, 0) + field(3, b"")))],
        "many_long_keys": lambda: [sign(b"".join(field(1, b"%05d" % i + b"k" * 295)
                                                 for i in range(30_000)) + EMPTY_SUB)],
        # unknown groups nested far beyond any parser's depth limit, in a sub-record
        "deep_nesting": lambda: [sign(field(1, b"k") + field(3, field(1, 0) + field(3, b"")
                                                             + b"\x4b" * 200_000))],
        "huge_index": lambda: [sign(field(1, b"k") + field(3, field(1, 2**64 - 1)
                                                          + field(3, b"")))],
        "huge_length": lambda: [sign(field(1, b"k") + b"\x1a" + varint(2**62) + b"\x08\x00")],
        "repeated_data": lambda: [sign(field(1, b"k") + field(3, field(1, 0)
                                                             + field(3, b"x") * 200_000))],
        "random": lambda: [random_aggregate(random.Random(seed)) for seed in range(400)],
    }
    return cases[case]()


def main(cases: list[str], cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    patch = pytest.MonkeyPatch()
    route_get_records(patch)
    for case in cases:
        if case == "control":
            print(len(bytearray(cap)))
        run(case)


def run(case: str) -> None:
    blobs = page_of(case)
    records = [record(i, blob) for i, blob in enumerate(blobs)]
    expected = 0
    for blob in blobs:
        outcome = expected_outcome(blob, None, None) if case == "random" else None
        expected += len(sub_records_of(blob)) if outcome == "expand" else 1
    metrics = Metrics()
    pipeline = make(FakeShard(records, page_size=len(records)), metrics=metrics)
    delivered = 0
    previous = (-1, -1)
    line_bytes = batch_bytes = 0
    for result in drain(pipeline, limit=10):
        # the native processor's view: every record built once, in order
        for user in result.records:
            position = user.extended_sequence_number
            assert position > previous, f"{position} after {previous}"
            previous = position
            delivered += 1
        for line, _ in split_process_records(result.records, result.millis_behind_latest):
            line_bytes = max(line_bytes, len(line))
        for batch in records_to_batches("stream", SHARD, result.records):
            batch_bytes = max(batch_bytes, batch.nbytes)
    reasons = {reason: sample(metrics, "kclpy_deaggregation_errors_total", shard_id=SHARD,
                              reason=reason) for reason in CORRUPT_REASONS}
    print(json.dumps({"case": case, "delivered": delivered,
                      "expected": expected if case == "random" else None,
                      "reasons": {k: int(v) for k, v in reasons.items() if v},
                      "max_line_bytes": line_bytes, "max_batch_bytes": batch_bytes}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]))
