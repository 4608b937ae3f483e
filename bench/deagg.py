"""KPL de-aggregation: kclpy against aws-kinesis-agg on the same aggregates.

Aggregates of 100 B user records, packed up to the KPL's default AggregationMaxSize
(51,200 bytes). The baseline is ``iter_deaggregate_records(..., data_format="Boto3")`` on
records as botocore returns them (payload already bytes). Both sides build every user
record: kclpy's batch builds its records as they are read, so each run lists it. Figures:
  * kclpy from bytes: the same input as the baseline (like for like);
  * kclpy from the wire: records still base64 text as the kclpy parser leaves them, so the
    base64 decode of the aggregates (which botocore did before the baseline's clock
    started) is inside kclpy's time;
  * kclpy with hash-range filtering on, for a range short of the whole key space by one key
    (nothing dropped, but every partition key hashed: the verdict cache starts cold each run);
  * a whole GetRecords page of these aggregates, parse + de-aggregation: kclpy's parser and
    deaggregate against botocore's parser and aws-kinesis-agg (what a boto3 consumer runs).
Run: python bench/deagg.py [--repetitions N]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
from typing import Any

import botocore.session
from _common import compare
from aws_kinesis_agg.aggregator import RecordAggregator
from aws_kinesis_agg.deaggregator import iter_deaggregate_records
from botocore.parsers import create_parser

from kclpy.records import Record
from kclpy.retrieval.kpl import deaggregate
from kclpy.retrieval.parse import parse_get_records

USER_RECORDS = 50_000
USER_SIZE = 100
KPL_MAX_SIZE = 51_200


def aggregates(seed: int = 11) -> list[bytes]:
    rnd = random.Random(seed)
    aggregator = RecordAggregator(max_size=KPL_MAX_SIZE)
    blobs = []
    for _ in range(USER_RECORDS):
        full = aggregator.add_user_record(f"user-{rnd.randrange(10_000)}",
                                          rnd.randbytes(USER_SIZE))
        if full is not None:
            blobs.append(full.get_contents()[2])
    last = aggregator.clear_and_get()
    if last is not None:
        blobs.append(last.get_contents()[2])
    return blobs


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--repetitions", type=int, default=15)
    repetitions = args.parse_args().repetitions

    first = 49_590_338_271_490_256_608_559_692_538_361_571_095_921_575_989_136_588_898
    inputs = [(str(first + i * 100_000), blob, base64.b64encode(blob).decode("ascii"))
              for i, blob in enumerate(aggregates())]
    arrival = 1_714_000_000_123

    # Fresh Record objects for every run: a Record caches its decoded bytes.
    def from_bytes() -> list[Record]:
        return [Record(seq, "aggregate", arrival, 0, blob) for seq, blob, _ in inputs]

    def from_wire() -> list[Record]:
        return [Record(seq, "aggregate", arrival, 0, None, b64) for seq, _, b64 in inputs]

    def boto3_records() -> list[dict[str, Any]]:
        return [{"SequenceNumber": seq, "ApproximateArrivalTimestamp": arrival, "Data": blob,
                 "PartitionKey": "aggregate"} for seq, blob, _ in inputs]

    def baseline(records: list[dict[str, Any]]) -> list[Any]:
        return list(iter_deaggregate_records(records, data_format="Boto3"))

    def kclpy(records: list[Record]) -> list[Record]:
        return list(deaggregate(records).records)

    def filtered(records: list[Record]) -> list[Record]:
        # The whole key space needs no hashing; one key less than that needs all of it.
        return list(deaggregate(records, 0, 2**128 - 2).records)

    page = json.dumps({
        "Records": [{"SequenceNumber": seq, "ApproximateArrivalTimestamp": arrival / 1000,
                     "Data": b64, "PartitionKey": "aggregate"} for seq, _, b64 in inputs],
        "NextShardIterator": "next", "MillisBehindLatest": 0,
    }).encode()
    output_shape = (botocore.session.get_session().get_service_model("kinesis")
                    .operation_model("GetRecords").output_shape)
    assert output_shape is not None
    parser = create_parser("json")

    def same_page() -> bytes:
        return page

    def kclpy_page(body: bytes) -> list[Record]:
        return list(deaggregate(parse_get_records(body).records).records)

    def boto3_page(body: bytes) -> list[Any]:
        parsed = parser.parse({"body": body, "headers": {}, "status_code": 200}, output_shape)
        return list(iter_deaggregate_records(parsed["Records"], data_format="Boto3"))

    assert len(kclpy_page(page)) == len(boto3_page(page)) == USER_RECORDS
    assert len(deaggregate(from_wire()).records) == USER_RECORDS
    assert len(baseline(boto3_records())) == USER_RECORDS
    label = f"{USER_RECORDS:,} x {USER_SIZE} B in {len(inputs)} aggregates"
    for name, ours in (
        ("kclpy from bytes", (from_bytes, kclpy)),
        ("kclpy from the wire (incl. base64)", (from_wire, kclpy)),
        ("kclpy from bytes, hash-range filter", (from_bytes, filtered)),
    ):
        figure = compare(f"{label}, {name}", USER_RECORDS, ours, (boto3_records, baseline),
                         repetitions)
        print(figure.line("user records", "aws-kinesis-agg"), flush=True)
    figure = compare(f"{label}, one GetRecords page, parse + de-aggregate", USER_RECORDS,
                     (same_page, kclpy_page), (same_page, boto3_page), repetitions)
    print(figure.line("user records", "botocore + aws-kinesis-agg"), flush=True)


if __name__ == "__main__":
    main()
