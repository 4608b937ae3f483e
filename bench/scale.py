"""One worker holding 200 shards: resident memory per held shard, and records/s.

Every figure comes from a real ``Worker`` in a process of its own (lease table on moto's
server, shards on the replay endpoint of ``bench/replay.py``), whose resident set size is
sampled from ``/proc/self/statm`` every 50 ms:

  * idle: the worker on a stream without shards (clients, lease table, threads of the
    coordinator; no consumer): the baseline every other figure is measured above;
  * at the tip: 200 shards with 100 records each, read to the end; RSS once every shard has
    been caught up for a while, i.e. what a held shard costs when it keeps up with its
    stream (two threads, the fetcher and consumer objects, an HTTP connection, metrics);
  * catching up: 200 shards x 2,000 records, a processor that reads every payload; records/s
    from the moment every shard is held and may start (processors' ``initialize`` holds
    them until then) to the last record delivered, and the peak RSS meanwhile;
  * backlog held: the same shards and a processor that blocks on its first batch, so every
    fetcher fills its prefetch queue and stops; RSS then, for two values of
    ``--max-records``. A shard then holds at most (``--prefetch-queue-size`` + 2) batches
    (the queue, the batch the fetcher waits to queue, the batch in the processor) of at
    most ``--max-records`` records each: that bound, not the backlog, is what caps memory.

With ``--retrieval-mode fanout`` every worker reads with enhanced fan-out (one subscription
per shard; the replay endpoint pushes events of up to 2 MiB, a shard's fan-out rate for a
second) and the backlog figure is taken once: a blocked processor leaves at most
(``--prefetch-queue-size`` + 2) events per shard in memory - the queue, the event the
fetcher waits to queue, the batch in the processor - because the fetcher reads nothing more
from the subscription while its queue is full (the TCP window stops the endpoint).

Run: python bench/scale.py [--shards N] [--records N] [--retrieval-mode polling|fanout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from consume import REGION, ReplayProcess, child_environment  # noqa: E402
from replay import MAX_EVENT_BYTES  # noqa: E402

if TYPE_CHECKING:
    from kclpy.worker import Worker

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1024 * 1024
RECORD_SIZE = 100
TIP_RECORDS = 100
_SAMPLE_S = 0.05


def rss() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class Sampler:
    """Samples RSS on a thread; keeps the peak and the last value."""

    def __init__(self) -> None:
        self.peak = rss()
        self.last = self.peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.last = rss()
            self.peak = max(self.peak, self.last)

    def settled(self, seconds: float) -> int:
        """The median RSS over the next ``seconds``."""
        samples = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            samples.append(rss())
            time.sleep(_SAMPLE_S)
        return int(statistics.median(samples))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Report:
    """What a worker process reports about itself."""

    mode: str
    shards_held: int
    #: RSS when the figure was taken (settled), and the peak over the whole run
    rss: int
    rss_peak: int
    records: int
    #: wall seconds from the moment every shard may start reading to the last record
    #: delivered (0 where no records are read)
    read_s: float
    #: CPU seconds of the process over the same span
    cpu_s: float
    #: leases the worker lost while running (each makes its shard's records come again)
    leases_lost: int
    #: times retrieval paused so that lease renewal could catch up
    retrieval_pauses: int = 0


def run_worker(mode: str, kinesis_url: str, dynamodb_url: str, stream: str, shards: int,
               expect: int, max_records: int, queue_size: int,
               timeout_s: float = 300.0, retrieval_mode: str = "polling") -> Report:
    """A Worker in this process, run until the figure of ``mode`` is taken."""
    from kclpy import IRecordProcessor, KCLConfig
    from kclpy.processor import (
        InitializeInput,
        LeaseLostInput,
        ProcessRecordsInput,
        ShardEndedInput,
        ShutdownRequestedInput,
    )
    from kclpy.worker import Worker

    lock = threading.Lock()
    release = threading.Event()
    go = threading.Event()
    all_seen = threading.Event()
    state: dict[str, float] = {"records": 0, "initialized": 0, "last": 0.0, "cpu_last": 0.0}

    class Processor(IRecordProcessor):
        def initialize(self, initialize_input: InitializeInput) -> None:
            # A consumer starts its fetcher once initialize returns: holding every shard
            # here until all are held makes the catch-up start at once on every shard, so
            # records/s is not diluted by the time the lease taker takes to take them all.
            with lock:
                state["initialized"] += 1
            if mode == "catch-up":
                go.wait()

        def process_records(self, process_records_input: ProcessRecordsInput) -> None:
            if mode == "backlog":
                release.wait()
                return
            records = process_records_input.records
            for record in records:
                len(record.binary_data)
            with lock:
                state["records"] += len(records)
                if state["records"] >= expect:
                    state["last"], state["cpu_last"] = time.perf_counter(), time.process_time()
                    all_seen.set()

        def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
            pass

        def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
            shard_ended_input.checkpointer.checkpoint()

        def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
            pass

    sampler = Sampler()
    config = KCLConfig(
        application_name=f"bench-scale-{uuid.uuid4().hex[:12]}", stream_name=stream,
        region=REGION, kinesis_endpoint=kinesis_url, dynamodb_endpoint=dynamodb_url,
        initial_position="TRIM_HORIZON", max_records=max_records,
        prefetch_queue_size=queue_size, retrieval_mode=retrieval_mode)
    worker = Worker(config, Processor)
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False},
                              name="bench-worker", daemon=True)
    runner.start()
    deadline = time.monotonic() + timeout_s
    try:
        if not worker.wait_started(timeout_s):
            raise RuntimeError("the worker did not start")
        if mode == "idle":
            time.sleep(3.0)
            figure = sampler.settled(2.0)
        elif mode == "backlog":
            # Every shard consuming, then time for every fetcher to fill its queue and block.
            _wait(lambda: len(worker.consumers()) >= shards, deadline)
            time.sleep(3.0)
            figure = sampler.settled(2.0)
        else:
            _wait(lambda: state["initialized"] >= shards, deadline)
            started, cpu_started = time.perf_counter(), time.process_time()
            go.set()
            if not all_seen.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"saw {state['records']} of {expect} records")
            _wait(lambda: _all_caught_up(worker, shards), deadline)
            time.sleep(2.0)
            figure = sampler.settled(2.0)
        held = len(worker.consumers())
        lost = int(worker.metrics.registry.get_sample_value("kclpy_leases_lost_total") or 0)
        pauses = int(
            worker.metrics.registry.get_sample_value("kclpy_retrieval_pauses_total") or 0)
    finally:
        release.set()
        go.set()
        worker.shutdown()
        runner.join(60)
        sampler.stop()
    if mode in ("idle", "backlog"):
        return Report(mode, held, figure, sampler.peak, int(state["records"]), 0.0, 0.0, lost)
    return Report(mode, held, figure, sampler.peak, int(state["records"]),
                  state["last"] - started, state["cpu_last"] - cpu_started, lost, pauses)


def _all_caught_up(worker: Worker, shards: int) -> bool:
    consumers = worker.consumers()
    return len(consumers) >= shards and all(c.caught_up for c in consumers.values())


def _wait(condition: Callable[[], bool], deadline: float) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.1)


def run_child(mode: str, kinesis_url: str, dynamodb_url: str, stream: str, shards: int,
              expect: int, max_records: int = 10_000, queue_size: int = 3,
              retrieval_mode: str = "polling") -> Report:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--kinesis",
            kinesis_url, "--dynamodb", dynamodb_url, "--stream", stream, "--shards",
            str(shards), "--expect", str(expect), "--max-records", str(max_records),
            "--prefetch-queue-size", str(queue_size), "--retrieval-mode", retrieval_mode]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_environment(),
                          timeout=900, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return Report(**json.loads(lines[-1]))


def main(argv: Sequence[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--shards", type=int, default=200)
    args.add_argument("--records", type=int, default=2_000,
                      help="records per shard for the catching-up figures")
    args.add_argument("--retrieval-mode", choices=("polling", "fanout"), default="polling")
    args.add_argument("--child", help=argparse.SUPPRESS)
    args.add_argument("--kinesis", help=argparse.SUPPRESS)
    args.add_argument("--dynamodb", help=argparse.SUPPRESS)
    args.add_argument("--stream", help=argparse.SUPPRESS)
    args.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    args.add_argument("--max-records", type=int, default=10_000, help=argparse.SUPPRESS)
    args.add_argument("--prefetch-queue-size", type=int, default=3, help=argparse.SUPPRESS)
    options = args.parse_args(argv)
    if options.child:
        report = run_worker(options.child, options.kinesis, options.dynamodb, options.stream,
                            options.shards, options.expect, options.max_records,
                            options.prefetch_queue_size,
                            retrieval_mode=options.retrieval_mode)
        print(json.dumps(asdict(report)), flush=True)
        return

    from kclpy.local import start_moto_server

    n = options.shards
    streams = [f"idle:0:0:{RECORD_SIZE}", f"tip:{n}:{TIP_RECORDS}:{RECORD_SIZE}",
               f"backlog:{n}:{options.records}:{RECORD_SIZE}"]
    print(f"building {n} shards x {options.records:,} records on the replay endpoint...",
          flush=True)
    with start_moto_server() as moto, ReplayProcess(sys.executable, streams) as replay:
        def child(mode: str, stream: str, expect: int, max_records: int = 10_000) -> Report:
            return run_child(mode, replay.url, moto.url, stream, n, expect, max_records,
                             retrieval_mode=options.retrieval_mode)

        if options.retrieval_mode == "fanout":
            print("enhanced fan-out: one subscription per shard", flush=True)

        idle = child("idle", "idle", 0)
        print(f"idle worker (no shards): RSS {idle.rss / MB:.1f} MB", flush=True)

        tip = child("tip", "tip", n * TIP_RECORDS)
        per_shard = (tip.rss - idle.rss) / tip.shards_held / MB
        print(f"{tip.shards_held} shards held, caught up: RSS {tip.rss / MB:.1f} MB, "
              f"{per_shard:.2f} MB per held shard above the idle worker (target <= 2 MB)",
              flush=True)

        total = n * options.records
        busy = child("catch-up", "backlog", total)
        print(f"{busy.shards_held} shards x {options.records:,} x {RECORD_SIZE} B, catching up: "
              f"{busy.records / busy.read_s:,.0f} records/s "
              f"({busy.cpu_s / busy.records * 1e6:.2f} CPU s per million records), "
              f"peak RSS {busy.rss_peak / MB:.1f} MB = "
              f"{(busy.rss_peak - idle.rss) / busy.shards_held / MB:.2f} MB per held shard; "
              f"{busy.leases_lost} lease(s) lost meanwhile "
              f"({busy.retrieval_pauses} pause(s) for lease renewal), "
              f"{busy.records - total:,} record(s) delivered again", flush=True)

        if options.retrieval_mode == "fanout":
            held = child("backlog", "backlog", total)
            per_event = min(options.records,
                            MAX_EVENT_BYTES // (RECORD_SIZE + 1) + 1)
            bound = (3 + 2) * per_event
            print(f"{held.shards_held} shards, processor blocked, fan-out, "
                  f"--prefetch-queue-size 3 (at most 5 events of up to 2 MiB, here "
                  f"{bound:,} records = {bound * RECORD_SIZE / MB:.1f} MB of payload, held "
                  f"per shard; {options.records:,} in the backlog): RSS "
                  f"{held.rss / MB:.1f} MB = "
                  f"{(held.rss - idle.rss) / held.shards_held / MB:.2f} MB per held shard",
                  flush=True)
            return
        for max_records in (400, 100):
            held = child("backlog", "backlog", total, max_records)
            bound = (3 + 2) * max_records
            print(f"{held.shards_held} shards, processor blocked, --max-records {max_records} "
                  f"--prefetch-queue-size 3 (at most {bound:,} records held per shard): RSS "
                  f"{held.rss / MB:.1f} MB = "
                  f"{(held.rss - idle.rss) / held.shards_held / MB:.2f} MB per held shard",
                  flush=True)


if __name__ == "__main__":
    main()
