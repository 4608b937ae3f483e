"""Exactly-once state against the plain at-least-once processor writing the same state:
records/s and DynamoDB requests (and write units) per 1,000 records, in the same run.

Both sides run over real HTTP against moto's server and apply the same records in batches
of ``--batch`` (a GetRecords page): every record adds 1 to ``count/<key>`` and its number to
``sum/<key>``, keys cycling over ``--keys``. The stateful side is kclpy's
``ExactlyOnceProcessor`` at its default N / T with a ``DynamoDBStateStore``, its commits
going through the real lease fence; the plain side sends one ``UpdateItem ... ADD`` per state
change and checkpoints once per batch, as an at-least-once processor would. Every HTTP
request of each side's DynamoDB client is counted by a ``before-send`` handler. Write units
follow DynamoDB's pricing: an item written in a transaction costs 2, an ordinary one 1 (items
up to 1 KB). The target: no more requests than the plain processor.

    python bench/exactly_once.py [--records 10000] [--batch 500] [--keys 100]
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import _common  # noqa: F401  (puts the repository root on sys.path)
import boto3

from kclpy.checkpoint import Checkpointer
from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import start_moto_server
from kclpy.metrics import Metrics
from kclpy.processor import InitializeInput, ProcessRecordsInput
from kclpy.records import Record, Records
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.processor import ExactlyOnceProcessor, StatefulProcessor
from kclpy.state.transaction import StateTransaction

FAILOVER_S = 60.0


class Counting(StatefulProcessor):
    def apply(self, record: Record, txn: StateTransaction) -> None:
        key, number = record.binary_data.decode().split(":")
        txn.update(f"count/{key}", lambda n: n + 1, 0)
        txn.update(f"sum/{key}", lambda n: n + int(number), 0)


@dataclass
class Side:
    name: str
    seconds: float
    requests: Counter[str]
    write_units: int

    def per_thousand(self, records: int) -> float:
        return sum(self.requests.values()) * 1000 / records

    def line(self, records: int) -> str:
        operations = ", ".join(f"{op} {n}" for op, n in self.requests.most_common())
        return (f"{self.name:>13}: {records / self.seconds:8,.0f} records/s, "
                f"{self.per_thousand(records):7.1f} requests per 1,000 records ({operations}), "
                f"{self.write_units * 1000 / records:7.1f} write units per 1,000 records")


WRITES = ("Put", "Update", "Delete")


def client(url: str, counts: Counter[str]) -> Any:
    """A DynamoDB client whose requests (per operation, retries included) and write units
    (``counts["units"]``, by DynamoDB's pricing) are counted into ``counts``."""
    dynamodb = boto3.session.Session().client(
        "dynamodb", endpoint_url=url, region_name="us-east-1",
        aws_access_key_id="bench", aws_secret_access_key="bench")

    def count(request: Any, **_: Any) -> None:
        counts[request.headers["X-Amz-Target"].decode().split(".")[-1]] += 1

    def units(params: dict[str, Any], model: Any, **_: Any) -> None:
        if model.name == "TransactWriteItems":
            counts["units"] += 2 * sum(1 for item in params["TransactItems"]
                                       if any(kind in item for kind in WRITES))
        elif model.name in ("UpdateItem", "PutItem", "DeleteItem"):
            counts["units"] += 1

    dynamodb.meta.events.register("before-send.dynamodb", count)
    dynamodb.meta.events.register("before-parameter-build.dynamodb", units)
    return dynamodb


def batches(records: int, batch: int, keys: int) -> list[list[Record]]:
    made = [Record(str(10_000 + i), f"pk{i % keys}", None, 0, f"k{i % keys}:{i}".encode())
            for i in range(records)]
    return [made[i:i + batch] for i in range(0, records, batch)]


def held_lease(table: LeaseTable, key: str) -> tuple[LeaseFence, Checkpointer]:
    held = HeldSet("bench", renewer_interval_s=FAILOVER_S / 2)
    fence = LeaseFence(table, held, failover_time_s=FAILOVER_S, clock=time.monotonic)
    lease = table.get(key)
    assert lease is not None
    taken = table.take(lease, "bench")
    taken.concurrency_token = uuid.uuid4().hex
    held.install(taken, time.monotonic())
    return fence, Checkpointer(key, fence, taken.concurrency_token, taken.checkpoint)


def run_stateful(url: str, pages: list[list[Record]]) -> Side:
    counts: Counter[str] = Counter()
    dynamodb = client(url, counts)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    table = LeaseTable(dynamodb, name)
    table.create_if_missing()
    table.create(Lease("s"))
    store = DynamoDBStateStore(f"{name}-state", client=dynamodb)
    _, checkpointer = held_lease(table, "s")
    adapter = ExactlyOnceProcessor(Counting(), store, metrics=Metrics())
    adapter.initialize(InitializeInput("s", "TRIM_HORIZON", 0))
    counts.clear()
    started = time.perf_counter()
    for page in pages:
        checkpointer.mark_delivered(page[-1])
        adapter.process_records(ProcessRecordsInput("s", Records([page]), checkpointer, None))
    seconds = time.perf_counter() - started
    return _side("exactly-once", seconds, counts)


def run_plain(url: str, pages: list[list[Record]]) -> Side:
    counts: Counter[str] = Counter()
    dynamodb = client(url, counts)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    table = LeaseTable(dynamodb, name)
    table.create_if_missing()
    table.create(Lease("s"))
    DynamoDBStateStore(f"{name}-state", client=dynamodb)
    _, checkpointer = held_lease(table, "s")
    counts.clear()
    started = time.perf_counter()
    for page in pages:
        checkpointer.mark_delivered(page[-1])
        for record in page:
            key, number = record.binary_data.decode().split(":")
            for state_key, add in ((f"count/{key}", 1), (f"sum/{key}", int(number))):
                dynamodb.update_item(
                    TableName=f"{name}-state", Key={"stateKey": {"S": state_key}},
                    UpdateExpression="ADD n :v", ExpressionAttributeValues={":v": {"N": str(add)}})
        checkpointer.checkpoint()
    seconds = time.perf_counter() - started
    return _side("plain", seconds, counts)


def _side(name: str, seconds: float, counts: Counter[str]) -> Side:
    units = counts.pop("units", 0)
    return Side(name, seconds, counts, units)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/exactly_once.py")
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--keys", type=int, default=100)
    args = parser.parse_args(argv)
    pages = batches(args.records, args.batch, args.keys)
    with start_moto_server() as moto:
        stateful = run_stateful(moto.url, pages)
        plain = run_plain(moto.url, pages)
    print(f"{args.records:,} records in batches of {args.batch}, {args.keys} keys "
          f"(2 state items each), moto server over HTTP")
    print(stateful.line(args.records))
    print(plain.line(args.records))
    print(f"requests exactly-once / plain: "
          f"{stateful.per_thousand(args.records) / plain.per_thousand(args.records):.3f}; "
          f"records/s exactly-once / plain: {plain.seconds / stateful.seconds:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
