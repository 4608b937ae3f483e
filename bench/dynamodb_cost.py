"""DynamoDB requests per shard-hour at steady state: kclpy's workers, counted, beside the
Java KCL 2.x's, computed for the same shards, workers and failover time.

kclpy: ``--workers`` real ``Worker`` objects in this process share a stream of ``--shards``
open shards (on the replay endpoint of ``bench/replay.py``; no records, so nothing is ever
checkpointed) and a lease table on moto's server. Every HTTP request their DynamoDB
clients send is counted by a ``before-send`` handler registered on each worker's boto3
session (retries included). Counting starts once the leases are spread evenly over the
workers and have stayed put for two failover times, and lasts ``--seconds``; the count is
then scaled to an hour and divided by the number of shards.

Java KCL 2.x, for the same failover time F, S shards and W workers, from its defaults:
every held lease renewed every F / 3 (``leaseRenewalIntervalMillis``; Java subtracts 25 ms,
which would only add requests, so it is left out) and every worker scanning the lease table
once every 2 x (F + 25 ms) (``takerIntervalMillis``), one Scan page for fewer than ~2,500
leases:

    Java requests per shard-hour = 3600 / (F / 3)  +  W x 3600 / (2 x (F + 0.025)) / S

Left out on the Java side, in its favour: the scans of its shard-sync auditor (every two
minutes, on the leader) and of its leader decider. Checkpoints are left out on both sides
(the processors never checkpoint): each checkpoint is one UpdateItem in both, and kclpy
counts a checkpoint as that lease's renewal, which can only lower its figure.

Run: python bench/dynamodb_cost.py [--shards N] [--workers N] [--failover-ms N] [--seconds N]
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from consume import REGION, ReplayProcess, child_environment  # noqa: E402

_POLL_S = 0.2


class RequestCounter:
    """Counts the DynamoDB HTTP requests of every client created from the sessions it is
    attached to, per operation; ``snapshot`` reads it while workers keep running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def attach(self, session: Any) -> None:
        # Registered on the session before the worker creates its clients: a client copies
        # the session's handlers when it is created.
        session.events.register("before-send.dynamodb", self._count)

    def _count(self, event_name: str, **_: Any) -> None:
        with self._lock:
            self._counts[event_name.rsplit(".", 1)[-1]] += 1

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self._counts)


def java_per_shard_hour(shards: int, workers: int, failover_s: float) -> tuple[float, float]:
    """(renewals, scans) per shard-hour of Java KCL 2.x workers (see the module docstring)."""
    renewals = 3600 / (failover_s / 3)
    scans = workers * 3600 / (2 * (failover_s + 0.025)) / shards
    return renewals, scans


def main(argv: Sequence[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--shards", type=int, default=20)
    args.add_argument("--workers", type=int, default=2)
    args.add_argument("--failover-ms", type=int, default=5_000)
    args.add_argument("--seconds", type=float, default=60.0, help="length of the count")
    options = args.parse_args(argv)

    import boto3

    from kclpy import IRecordProcessor, KCLConfig
    from kclpy.local import start_moto_server
    from kclpy.processor import (
        InitializeInput,
        LeaseLostInput,
        ProcessRecordsInput,
        ShardEndedInput,
        ShutdownRequestedInput,
    )
    from kclpy.worker import Worker

    class Idle(IRecordProcessor):
        def initialize(self, initialize_input: InitializeInput) -> None:
            pass

        def process_records(self, process_records_input: ProcessRecordsInput) -> None:
            pass

        def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
            pass

        def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
            shard_ended_input.checkpointer.checkpoint()

        def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
            pass

    shards, workers_n = options.shards, options.workers
    failover_s = options.failover_ms / 1000
    env = child_environment()
    counter = RequestCounter()
    with start_moto_server() as moto, \
            ReplayProcess(sys.executable, [f"stream:{shards}:0:100"]) as replay:
        application = f"bench-dynamodb-{uuid.uuid4().hex[:12]}"
        workers = []
        for n in range(workers_n):
            session = boto3.session.Session(
                aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=REGION)
            counter.attach(session)
            config = KCLConfig(
                application_name=application, stream_name="stream", region=REGION,
                kinesis_endpoint=replay.url, dynamodb_endpoint=moto.url,
                initial_position="TRIM_HORIZON", failover_time_ms=options.failover_ms,
                worker_id=f"bench-worker-{n}")
            workers.append(Worker(config, Idle, session=session))
        threads = [threading.Thread(target=w.run, kwargs={"install_signal_handlers": False},
                                    name=f"bench-worker-{n}", daemon=True)
                   for n, w in enumerate(workers)]
        for thread in threads:
            thread.start()
        try:
            settled = _wait_balanced(workers, shards, failover_s, timeout_s=30 * failover_s)
            print(f"{shards} leases spread over {workers_n} worker(s) after {settled:.0f} s; "
                  f"counting for {options.seconds:.0f} s...", flush=True)
            before = counter.snapshot()
            held_before = _held(workers)
            time.sleep(options.seconds)
            after = counter.snapshot()
            held_after = _held(workers)
        finally:
            for worker in workers:
                worker.shutdown()
            for thread in threads:
                thread.join(60)
    if held_before != held_after:
        print(f"warning: leases moved during the count ({held_before} -> {held_after})")
    counted = after - before
    scale = 3600 / options.seconds / shards
    ours = sum(counted.values()) * scale
    renewals, scans = java_per_shard_hour(shards, workers_n, failover_s)
    java = renewals + scans
    detail = ", ".join(f"{op} {count * scale:,.0f}" for op, count in sorted(counted.items()))
    print(f"{shards} shards, {workers_n} worker(s), failover {failover_s:g} s: kclpy "
          f"{ours:,.0f} DynamoDB requests per shard-hour ({detail}); Java KCL 2.x "
          f"{java:,.0f} (UpdateItem {renewals:,.0f}, Scan {scans:,.0f}); "
          f"kclpy/Java {ours / java:.2f}", flush=True)


def _held(workers: Sequence[Any]) -> list[int]:
    return [len(w.coordinator.held_leases()) if w.coordinator else 0 for w in workers]


def _wait_balanced(workers: Sequence[Any], shards: int, failover_s: float,
                   timeout_s: float) -> float:
    """Seconds until every lease is held, evenly spread, unchanged for two failover times."""
    started = time.monotonic()
    fair = {shards // len(workers), -(-shards // len(workers))}
    stable_since: float | None = None
    last: list[int] = []
    while True:
        now = time.monotonic()
        if now - started > timeout_s:
            raise RuntimeError(f"leases never settled: {_held(workers)}")
        held = _held(workers)
        if sum(held) == shards and set(held) <= fair and held == last:
            stable_since = stable_since if stable_since is not None else now
            if now - stable_since >= 2 * failover_s:
                return now - started
        else:
            stable_since = None
        last = held
        time.sleep(_POLL_S)


if __name__ == "__main__":
    main()
