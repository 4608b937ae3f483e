"""Failover gaps of a worker fleet: seconds from ``kill -9`` / SIGTERM of one worker to the
first record processed again on each shard it held, next to the configured failover time.

Real processes over real HTTP, as the fleet tests run them: kinesis-mock for Kinesis,
moto's server for DynamoDB (handing moto one request at a time, so conditional writes are
atomic), ``kclpy-worker`` processes recording every record they process with a wall-clock
time (same host, so comparable with the time the signal was sent). A producer writes to
every shard every 0.1 s, so a shard's gap is how long nobody read it.

Two figures per shard: "started", when a survivor's processor was initialized for it (the
lease protocol's part), and "first record", when the first record was processed there (plus
the new consumer's GetShardIterator and first GetRecords, which kinesis-mock serves slowly
on a busy machine: 0.2 s to 2 s here, tens of milliseconds on AWS).

A third figure, "join": seconds from starting a new worker next to the survivors until the
fleet is balanced again with every processor started on its lease's owner; the new worker
gets its share from live workers by graceful handoff.

    python bench/failover.py [--failover-ms 3000 10000] [--rounds 3] [--shards 8] [--workers 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _common  # noqa: F401  (puts the repository root on sys.path)

from kclpy.local import start_kinesis_mock, start_moto_server
from tests.support.fleet import Fleet, Producer, fleet
from tests.support.streams import create_stream, kinesis_client, unique_name, wait_for


def _held_by(group: Fleet, name: str) -> set[str]:
    return {key for key, owner in group.owners().items() if owner == name}


@dataclass
class Gaps:
    """Seconds from the event, per orphaned shard: to its processor's ``initialize`` on a
    survivor (the lease was taken), and to its first record processed there."""

    started: dict[str, float]
    processing: dict[str, float]


def _gaps(group: Fleet, shards: set[str], since_line: int, event_t: float, gone: int) -> Gaps:
    started: dict[str, float] = {}
    processing: dict[str, float] = {}
    for line in group.ledger.lines()[since_line:]:
        if line["pid"] == gone or line["shard"] not in shards:
            continue
        if line.get("event") == "initialize":
            started.setdefault(line["shard"], line["t"] - event_t)
        elif "data" in line:
            processing.setdefault(line["shard"], line["t"] - event_t)
    return Gaps(started, processing)


def _measure(group: Fleet, victim: str, signum: int, names: set[str]) -> Gaps:
    worker = next(w for w in group.workers if w.name == victim)
    shards = _held_by(group, victim)
    since = len(group.ledger.lines())
    event_t = time.time()
    worker.signal(signum)
    worker.process.wait(60)
    wait_for(
        lambda: set(_gaps(group, shards, since, event_t, worker.pid).processing) == shards,
        120,
        "every orphaned shard processing again",
    )
    gaps = _gaps(group, shards, since, event_t, worker.pid)
    wait_for(lambda: group.balanced_among(names - {victim}), 120, "a balanced fleet")
    return gaps


def run_round(
    kinesis_url: str, dynamodb_url: str, failover_ms: int, shards: int, workers: int, workdir: Path
) -> tuple[Gaps, Gaps, float]:
    kinesis = kinesis_client(kinesis_url)
    stream = unique_name("failover")
    create_stream(kinesis, stream, shards)
    names = {f"w{i}" for i in range(workers)}
    with (
        fleet(
            kinesis_url, dynamodb_url, stream, unique_name("app"), workdir, failover_ms=failover_ms
        ) as group,
        Producer(kinesis, stream, "bench"),
    ):
        for name in sorted(names):
            group.start(name)
        wait_for(lambda: group.balanced_among(names), 120, "a balanced fleet")
        killed = _measure(group, "w0", signal.SIGKILL, names)
        names -= {"w0"}
        joined_at = time.monotonic()
        group.start("w-new")
        names |= {"w-new"}
        wait_for(lambda: group.settled(names), 120, "a balanced fleet again")
        # a new worker gets its share by graceful handoff from the live ones
        join_s = time.monotonic() - joined_at
        terminated = _measure(group, "w1", signal.SIGTERM, names)
    return killed, terminated, join_s


def _line(label: str, gaps: Gaps) -> str:
    def values(by_shard: dict[str, float]) -> str:
        return " ".join(f"{v:.2f}" for v in sorted(by_shard.values()))

    return (
        f"  {label:8} started {values(gaps.started)} | first record {values(gaps.processing)}"
        f"  (max {max(gaps.processing.values()):.2f} s)"
    )


def _summary(label: str, gaps: list[Gaps], failover_s: float | None) -> str:
    started = [v for g in gaps for v in g.started.values()]
    processing = [v for g in gaps for v in g.processing.values()]
    over = "" if failover_s is None else f" = failover + {max(processing) - failover_s:.2f} s"
    return (
        f" {label}: started median {statistics.median(started):.2f} s, max {max(started):.2f} s;"
        f" first record median {statistics.median(processing):.2f} s,"
        f" max {max(processing):.2f} s{over}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failover-ms", type=int, nargs="+", default=[3000, 10000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    # Killed, still stop the worker processes and emulators (the context managers do).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    # The workers talk to local emulators only: dummy credentials, never the caller's.
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    with start_kinesis_mock() as kinesis, start_moto_server() as dynamodb:
        for failover_ms in args.failover_ms:
            print(f"failover time {failover_ms} ms, {args.shards} shards, {args.workers} workers")
            all_killed: list[Gaps] = []
            all_terminated: list[Gaps] = []
            joins: list[float] = []
            for round_no in range(1, args.rounds + 1):
                with tempfile.TemporaryDirectory() as tmp:
                    killed, terminated, join_s = run_round(
                        kinesis.url, dynamodb.url, failover_ms, args.shards, args.workers, Path(tmp)
                    )
                print(f" round {round_no}")
                print(_line("kill -9", killed))
                print(_line("SIGTERM", terminated))
                print(f"  join     a new worker started to a settled fleet: {join_s:.2f} s")
                all_killed.append(killed)
                all_terminated.append(terminated)
                joins.append(join_s)
                sys.stdout.flush()
            print(_summary("kill -9", all_killed, failover_ms / 1000))
            print(_summary("SIGTERM", all_terminated, None))
            print(f" join (graceful handoff): median {statistics.median(joins):.2f} s,"
                  f" max {max(joins):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
