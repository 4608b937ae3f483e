"""GetRecords parse: kclpy's parser against botocore's on the same response bytes.

Figures, each kclpy vs botocore's generic JSON parser (what ``client.get_records`` runs):
  * records materialised, payload not touched (the lazy Record at work);
  * records materialised and every payload read through ``binary_data`` (a processor
    that reads every record; botocore has already decoded them).
Run: python bench/parse.py [--repetitions N]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
from typing import Any

import botocore.session
from _common import compare
from botocore.parsers import create_parser

from kclpy.records import Record
from kclpy.retrieval.parse import parse_get_records


def response_body(records: int, size: int, seed: int = 7) -> bytes:
    """A GetRecords body shaped like AWS's: 56-digit sequence numbers, epoch-second floats
    with millisecond precision, base64 data, a long next iterator."""
    rnd = random.Random(seed)
    first = 49_590_338_271_490_256_608_559_692_538_361_571_095_921_575_989_136_588_898
    return json.dumps({
        "Records": [
            {
                "SequenceNumber": str(first + i * 100_000),
                "ApproximateArrivalTimestamp": round(1_714_000_000.0 + i * 0.001, 3),
                "Data": base64.b64encode(rnd.randbytes(size)).decode("ascii"),
                "PartitionKey": f"partition-{rnd.randrange(1_000_000)}",
            }
            for i in range(records)
        ],
        "NextShardIterator": base64.b64encode(rnd.randbytes(200)).decode("ascii"),
        "MillisBehindLatest": 0,
    }).encode()


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--repetitions", type=int, default=15)
    repetitions = args.parse_args().repetitions

    output_shape = (botocore.session.get_session().get_service_model("kinesis")
                    .operation_model("GetRecords").output_shape)
    assert output_shape is not None
    parser = create_parser("json")

    def botocore_parse(body: bytes) -> Any:
        response = {"body": body, "headers": {}, "status_code": 200}
        return parser.parse(response, output_shape)

    def botocore_read(body: bytes) -> None:
        for record in botocore_parse(body)["Records"]:
            record["Data"]

    def kclpy_parse(body: bytes) -> list[Record]:
        # The page builds its records as they are read; listing it builds every one, as
        # botocore's parse does.
        return list(parse_get_records(body).records)

    def kclpy_read(body: bytes) -> None:
        for record in parse_get_records(body).records:
            record.binary_data  # noqa: B018 - the read is the point

    for count, size, label in ((10_000, 100, "10,000 x 100 B"), (1_000, 10_240, "1,000 x 10 KB")):
        body = response_body(count, size)

        def same_body(body: bytes = body) -> bytes:
            return body

        for name, ours, theirs in (
            ("parse, data untouched", kclpy_parse, botocore_parse),
            ("parse + binary_data", kclpy_read, botocore_read),
        ):
            figure = compare(f"{label} ({len(body) / 1e6:.1f} MB), {name}", count,
                             (same_body, ours), (same_body, theirs), repetitions)
            print(figure.line("records", "botocore"), flush=True)


if __name__ == "__main__":
    main()
