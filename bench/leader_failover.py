"""Failover with one leader assigning (``--lease-assigner leader``) against the default
(``worker``: every worker scans and takes for itself), as a user would try it: real
``kclpy-worker`` processes on kinesis-mock and kclpy's local DynamoDB server (conditional
writes atomic), a producer writing to every shard every 0.1 s, one worker stopped at a time.

Per round and assigner: three workers (``--workers``) balance four shards (``--shards``)
at a 5 s failover time; one worker that is not the leader (with ``--victim leader``: the
leader) is stopped with SIGTERM, a fresh worker joins, then another is killed with
``kill -9``. For each shard the stopped worker held, the figure is the seconds from the
signal to its first record processed by another worker (``bench/failover.py``'s
measurement: the lease protocol's part, plus the new consumer's first GetShardIterator and
GetRecords on kinesis-mock).

    python bench/leader_failover.py [--rounds 3] [--failover-ms 5000] [--victim other]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from failover import Gaps, _measure  # noqa: E402

from kclpy.leases.load import LEADER_ITEM, LOAD_TABLE_SUFFIX, WORKER_ID  # noqa: E402
from kclpy.local import start_kinesis_mock, start_moto_server  # noqa: E402
from tests.support.fleet import Fleet, Producer, fleet  # noqa: E402
from tests.support.streams import (  # noqa: E402
    create_stream,
    dynamodb_client,
    kinesis_client,
    unique_name,
    wait_for,
)

ASSIGNERS = ("worker", "leader")


@dataclass
class Results:
    """Seconds from the signal to the first record processed elsewhere, per shard of the
    stopped worker, over every round."""

    sigterm: list[float] = field(default_factory=list)
    kill: list[float] = field(default_factory=list)
    #: how many of the stopped workers were leading
    leaders_stopped: int = 0


def _leader(group: Fleet) -> str | None:
    client = dynamodb_client(group.dynamodb_url)
    try:
        item = client.get_item(
            TableName=group.application + LOAD_TABLE_SUFFIX,
            Key={WORKER_ID: {"S": LEADER_ITEM}}, ConsistentRead=True).get("Item")
    except client.exceptions.ResourceNotFoundException:
        return None  # the default assigner (counting leases) keeps no load table
    return None if item is None else str(item["leader"]["S"])


def _victim(group: Fleet, names: set[str], victim: str) -> tuple[str, bool]:
    """A worker holding at least one lease: the leader with ``victim == "leader"`` (when
    there is one), else one that does not lead. Returns it and whether it leads."""
    leading = _leader(group)
    holders = sorted({owner for owner in group.owners().values() if owner in names})
    if victim == "leader" and leading in holders:
        return leading, True
    chosen = next(name for name in holders if name != leading)
    return chosen, False


def run_round(kinesis_url: str, dynamodb_url: str, assigner: str, *, failover_ms: int,
              shards: int, workers: int, victim: str, workdir: Path) -> tuple[Gaps, Gaps, int]:
    """One round: SIGTERM of one worker, a new one joins, ``kill -9`` of another."""
    kinesis = kinesis_client(kinesis_url)
    stream = unique_name("lfail")
    create_stream(kinesis, stream, shards)
    names = {f"w{i}" for i in range(workers)}
    leaders = 0
    with (
        fleet(kinesis_url, dynamodb_url, stream, unique_name("app"), workdir,
              failover_ms=failover_ms, extra_args=["--lease-assigner", assigner]) as group,
        Producer(kinesis, stream, "lf"),
    ):
        for name in sorted(names):
            group.start(name)
        wait_for(lambda: group.settled(names), 120, "a balanced fleet")
        stopped, led = _victim(group, names, victim)
        leaders += led
        terminated = _measure(group, stopped, signal.SIGTERM, names)
        names = (names - {stopped}) | {"w-new"}
        group.start("w-new")
        wait_for(lambda: group.settled(names), 120, "a balanced fleet again")
        stopped, led = _victim(group, names, victim)
        leaders += led
        killed = _measure(group, stopped, signal.SIGKILL, names)
    return terminated, killed, leaders


def _figures(values: list[float]) -> str:
    return (f"median {statistics.median(values):.2f} s, min {min(values):.2f} s, "
            f"max {max(values):.2f} s ({len(values)} shards)")


def main(argv: Sequence[str] | None = None) -> dict[str, Results]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--failover-ms", type=int, default=5000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--victim", choices=("other", "leader"), default="other")
    parser.add_argument("--assigners", nargs="+", choices=ASSIGNERS, default=list(ASSIGNERS))
    args = parser.parse_args(argv)
    # The workers talk to local emulators only: dummy credentials, never the caller's.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    results = {assigner: Results() for assigner in args.assigners}
    print(f"failover time {args.failover_ms} ms, {args.shards} shards, {args.workers} workers, "
          f"victim: {args.victim}")
    with start_kinesis_mock() as kinesis, start_moto_server() as dynamodb:
        for round_no in range(1, args.rounds + 1):
            for assigner in args.assigners:  # alternated, so drift hits both
                with tempfile.TemporaryDirectory() as tmp:
                    terminated, killed, leaders = run_round(
                        kinesis.url, dynamodb.url, assigner, failover_ms=args.failover_ms,
                        shards=args.shards, workers=args.workers, victim=args.victim,
                        workdir=Path(tmp))
                result = results[assigner]
                result.sigterm += terminated.processing.values()
                result.kill += killed.processing.values()
                result.leaders_stopped += leaders
                print(f" round {round_no} {assigner:6}: SIGTERM "
                      f"{' '.join(f'{v:.2f}' for v in sorted(terminated.processing.values()))}"
                      f" | kill -9 "
                      f"{' '.join(f'{v:.2f}' for v in sorted(killed.processing.values()))}")
                sys.stdout.flush()
    for assigner, result in results.items():
        print(f"{assigner}: SIGTERM {_figures(result.sigterm)}; kill -9 {_figures(result.kill)}; "
              f"{result.leaders_stopped} of {2 * args.rounds} stopped workers led")
    return results


if __name__ == "__main__":
    main()
