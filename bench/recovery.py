"""Lag recovery: how soon a far-behind shard reads live again, and how well recovery keeps
to its rate bound.

A one-shard stream holds a backlog (``--records``, 100 B records, one a millisecond, the last
one arriving as the replay endpoint starts; ``bench/replay.py`` in its own process) that a
worker starts at TRIM_HORIZON. Two workers, each its own application (lease table on moto's
server), one after the other in this process:

* **recovery**: ``max_lag_ms`` and ``recovery_max_rate`` set. Timed from the moment it holds
  the lease (its lease coordinator polled every 5 ms) to the first live record handed to its
  processor; then its recovery batches are counted by arrival second for ``--measure-s``:
  the largest count over any 10 s window and the mean, against the configured rate.
* **plain**: the same worker without lag recovery, timed from holding the lease to handing
  its processor the first record the recovery worker read live - what it must read through
  to get there is the backlog recovery jumped over. The replay endpoint serves it as fast as
  the client parses; Kinesis would not (2 MiB/s per shard), so the floor that limit puts on
  the same read is printed beside it.

Wall-clock times (these are latencies, not CPU): the machine's noise moves both sides.

    python bench/recovery.py [--records 1000000] [--max-lag-ms 300000] [--rate 20000]
                             [--measure-s 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import _common  # noqa: F401  (puts the repository root on sys.path)
from consume import ReplayProcess

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

REGION = "us-east-1"
STREAM = "recovery"
#: what one shard serves a polling application at most
KINESIS_READ_BYTES_PER_S = 2 * 1024 * 1024
#: recovery's bound holds over any window of this length (the lag-recovery rate promise)
WINDOW_S = 10


@dataclass
class Observed:
    """What one worker's processor saw, stamped with ``time.monotonic()``."""

    first_live_at: float | None = None
    first_live_sequence: int | None = None
    #: the first record at or after ``wanted`` (the plain run's target)
    wanted: int | None = None
    reached_at: float | None = None
    recovered_per_second: Counter[int] = field(default_factory=Counter)
    recovered: int = 0
    #: payload bytes handed out before ``wanted`` was reached
    bytes_before: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


class Probe(IRecordProcessor):
    def __init__(self, observed: Observed) -> None:
        self.observed = observed

    def initialize(self, initialize_input: InitializeInput) -> None:
        pass

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        now = time.monotonic()
        records = process_records_input.records
        if not records:
            return
        o = self.observed
        with o.lock:
            if process_records_input.is_recovery:
                o.recovered += len(records)
                o.recovered_per_second[int(now)] += len(records)
            elif o.first_live_at is None:
                o.first_live_at = now
                o.first_live_sequence = int(records[0].sequence_number)
            if o.wanted is not None and o.reached_at is None:
                o.bytes_before += sum(len(r.binary_data) for r in records
                                      if int(r.sequence_number) < o.wanted)
                if int(records[-1].sequence_number) >= o.wanted:
                    o.reached_at = now
                    o.done.set()

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        pass


def lease_taken_at(worker: Worker, stop: threading.Event) -> float | None:
    """When the worker first holds a lease (polled every 5 ms), or None if stopped first."""
    while not stop.is_set():
        coordinator = worker.coordinator
        if coordinator is not None and coordinator.held_leases():
            return time.monotonic()
        time.sleep(0.005)
    return None


def run_worker(config: KCLConfig, observed: Observed, until: threading.Event,
               timeout_s: float) -> float:
    """Run a worker until ``until`` is set; returns when it took its lease."""
    worker = Worker(config, lambda: Probe(observed))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except BaseException as exc:  # reported below, on the benchmark's thread
            failed.append(exc)
            until.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    stop = threading.Event()
    taken = lease_taken_at(worker, stop) if worker.wait_started(60) else None
    try:
        if taken is None or failed:
            raise RuntimeError(f"the worker did not take its lease: {failed}")
        if not until.wait(timeout_s) or failed:
            raise RuntimeError(f"gave up after {timeout_s:.0f} s: {failed}")
        return taken
    finally:
        stop.set()
        worker.shutdown()
        thread.join(60)


def config_for(replay_url: str, dynamodb_url: str, **overrides: object) -> KCLConfig:
    return KCLConfig(
        application_name=f"bench-recovery-{uuid.uuid4().hex[:8]}", stream_name=STREAM,
        region=REGION, kinesis_endpoint=replay_url, dynamodb_endpoint=dynamodb_url,
        initial_position="TRIM_HORIZON", idle_time_between_reads_ms=200,
        **overrides)  # type: ignore[arg-type]


def windows(per_second: Counter[int], width: int) -> list[float]:
    """Records per second over every full ``width``-second window of the counted span."""
    if not per_second:
        return []
    first, last = min(per_second), max(per_second)
    return [sum(per_second[s] for s in range(start, start + width)) / width
            for start in range(first, last - width + 2)]


def main(argv: Sequence[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--records", type=int, default=1_000_000)
    args.add_argument("--max-lag-ms", type=int, default=300_000)
    args.add_argument("--rate", type=int, default=20_000, help="recovery_max_rate")
    args.add_argument("--measure-s", type=float, default=30.0,
                      help="how long recovery is counted after the first live record")
    options = args.parse_args(argv)
    if options.measure_s < WINDOW_S:
        args.error(f"--measure-s must be at least {WINDOW_S}")

    # The local endpoints take any credentials; none may come from the environment.
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION=REGION)
    print(f"building {options.records:,} records on the replay endpoint...", flush=True)
    started = time.monotonic()
    with start_moto_server() as moto, ReplayProcess(
            sys.executable, [f"{STREAM}:1:{options.records}:100"],
            ["--last-arrival-ms", "now"]) as replay:
        built_s = time.monotonic() - started
        print(f"built in {built_s:.0f} s; the backlog spans "
              f"{options.records / 1000:,.0f} s of arrivals", flush=True)

        recovering = Observed()
        measured = threading.Event()

        def stop_after_measuring() -> None:
            while recovering.first_live_at is None:
                if measured.wait(0.05):
                    return
            measured.wait(options.measure_s)
            measured.set()

        timer = threading.Thread(target=stop_after_measuring, daemon=True)
        timer.start()
        taken = run_worker(config_for(replay.url, moto.url, max_lag_ms=options.max_lag_ms,
                                      recovery_max_rate=options.rate),
                           recovering, measured, options.measure_s + 120)
        assert recovering.first_live_at is not None
        assert recovering.first_live_sequence is not None
        to_live = recovering.first_live_at - taken

        plain = Observed(wanted=recovering.first_live_sequence)
        plain_taken = run_worker(config_for(replay.url, moto.url), plain, plain.done, 600)
        assert plain.reached_at is not None
        to_same = plain.reached_at - plain_taken

    spans = windows(recovering.recovered_per_second, WINDOW_S)
    mean = (recovering.recovered / (max(recovering.recovered_per_second)
                                    - min(recovering.recovered_per_second) + 1)
            if recovering.recovered_per_second else 0.0)
    print(f"lease taken -> first live record: with lag recovery {to_live * 1000:,.0f} ms; "
          f"plain worker to the same record {to_same:,.2f} s "
          f"({to_same / to_live:,.0f}x longer); on Kinesis, whose shards serve 2 MiB/s to a "
          f"polling application, the {plain.bytes_before / 1e6:,.0f} MB it read first take at "
          f"least {plain.bytes_before / KINESIS_READ_BYTES_PER_S:,.0f} s")
    print(f"recovery: {recovering.recovered:,} records in {options.measure_s:.0f} s; "
          f"largest {WINDOW_S} s window {max(spans, default=0):,.0f}/s, mean {mean:,.0f}/s, "
          f"bound {options.rate:,}/s "
          f"(largest window at {max(spans, default=0) / options.rate:.0%} of the bound)")


if __name__ == "__main__":
    main()
