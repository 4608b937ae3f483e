"""Where a KPL user record's CPU goes in kclpy, step by step, next to the whole baseline.

The stream of ``bench/consume.py`` (1,000,000 user records of 100 B in aggregates of up to
51,200 bytes, 10,000 partition keys), as GetRecords bodies built by ``bench/replay.py``.
Each step runs over every aggregate of the stream, page by page, in the order kclpy runs
them, and keeps what the next step needs only for the page at hand, as the consumer does:
the data is as cold and the memory as fresh as in the worker. What is left out is
everything around the steps: HTTP, threads, queues, leases, start-up. The baseline, on the
same bodies, is the bare boto3 loop's work minus HTTP: botocore's parser, aws-kinesis-agg's
``iter_deaggregate_records(..., data_format="Boto3")`` and a ``binascii`` decode per user
record. Figures are medians of ``--repetitions`` runs, in ns per user record; the baseline
and each page's JSON parse and record loop are timed in CPU time, the per-aggregate steps in
wall time (each lasts microseconds; reading the process's CPU clock is a system call).

Run: python bench/kpl_steps.py [--records N] [--repetitions N]
"""

from __future__ import annotations

import argparse
import binascii
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import botocore.session
from aws_kinesis_agg.deaggregator import iter_deaggregate_records
from botocore.parsers import create_parser

from bench import replay
from kclpy.records import UserRecords
from kclpy.retrieval import kpl
from kclpy.retrieval.parse import parse_get_records

STEPS = ("parse of the page, payloads decoded", "MD5", "protobuf parse (KPL schema)",
         "encode again and compare", "protobuf parse (columns)", "payloads as bytes objects",
         "partition-key table as str", "partition key per user record",
         "build each record and read binary_data")


def bodies(records: int) -> list[bytes]:
    stream = replay.build_stream(0, replay.StreamSpec("kpl", 1, records, 100, kpl=True))
    shard = stream.shards[0]
    pages, offset = [], 0
    while offset < len(shard.fragments):
        pages.append(replay.page(stream, shard, offset, replay.MAX_LIMIT))
        offset = replay._next_offset(shard, offset, replay.MAX_LIMIT)
    return pages


def kclpy_steps(pages: list[bytes]) -> tuple[dict[str, float], int]:
    """Seconds per step over all pages, and the user records seen."""
    spent: dict[str, float] = defaultdict(float)
    # Wall time per step: the steps last microseconds, and a process-CPU reading is a
    # system call that would cost as much as some of them.
    clock = time.perf_counter
    users = 0
    for body in pages:
        t = time.process_time()
        # A page of aggregates is parsed with its payloads decoded from the body at once
        # (kclpy.retrieval.parse._parse_aggregates): no base64 step of its own.
        blobs = [record.binary_data for record in parse_get_records(body).records]
        spent[STEPS[0]] += time.process_time() - t
        batch = []
        for blob in blobs:
            t1 = clock()
            view = memoryview(blob)[4:-16]
            assert kpl._md5(view).digest() == blob[-16:]
            t2 = clock()
            aggregate = kpl._parse_aggregate(view)
            t3 = clock()
            assert kpl._canonical(aggregate, blob)
            t4 = clock()
            columns = kpl._parse_columns(view)
            t5 = clock()
            data = columns.records.data[:]
            t6 = clock()
            table = columns.partition_key_table[:]
            t7 = clock()
            keys = list(map(table.__getitem__, columns.records.partition_key_index[:]))
            t8 = clock()
            batch.append(UserRecords("1", None, data, keys))
            # The per-aggregate steps; the first and last are timed per page.
            for step, (start, end) in zip(STEPS[1:-1], ((t1, t2), (t2, t3), (t3, t4), (t4, t5),
                                                        (t5, t6), (t6, t7), (t7, t8)),
                                          strict=True):
                spent[step] += end - start
        t = time.process_time()
        for part in batch:
            for record in part:
                len(record.binary_data)
        spent[STEPS[-1]] += time.process_time() - t
        users += sum(map(len, batch))
    return spent, users


def baseline(pages: list[bytes]) -> float:
    """Seconds for botocore + aws-kinesis-agg + binascii over all pages."""
    shape = (botocore.session.get_session().get_service_model("kinesis")
             .operation_model("GetRecords").output_shape)
    assert shape is not None
    parser = create_parser("json")
    start = time.process_time()
    for body in pages:
        parsed: Any = parser.parse({"body": body, "headers": {}, "status_code": 200}, shape)
        for user in iter_deaggregate_records(parsed["Records"], data_format="Boto3"):
            len(binascii.a2b_base64(user["kinesis"]["data"]))
    return time.process_time() - start


def median_ns(runs: list[float], users: int) -> float:
    return statistics.median(runs) / users * 1e9


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--records", type=int, default=1_000_000)
    args.add_argument("--repetitions", type=int, default=3)
    options = args.parse_args()
    pages = bodies(options.records)
    per_step: dict[str, list[float]] = defaultdict(list)
    base: list[float] = []
    users = 0
    for _ in range(options.repetitions):
        spent, users = kclpy_steps(pages)
        for step in STEPS:
            per_step[step].append(spent[step])
        base.append(baseline(pages))
    total = 0.0
    for step in STEPS:
        ns = median_ns(per_step[step], users)
        total += ns
        print(f"{step}: {ns:.0f} ns per user record", flush=True)
    theirs = median_ns(base, users)
    print(f"kclpy's steps together: {total:.0f} ns per user record; baseline (botocore parse, "
          f"aws-kinesis-agg, binascii) {theirs:.0f}; a quarter of it is {theirs / 4:.0f}; "
          f"ratio {theirs / total:.1f}x ({users:,} user records in {len(pages)} pages, "
          f"median of {options.repetitions})", flush=True)


if __name__ == "__main__":
    main()
