"""Time from PutRecord to the processor, records written at a low rate: polling (defaults, and
a 200 ms idle time), enhanced fan-out, and the endpoint's own push delay measured alone (a
bare subscription loop with no worker), side by side in one run on the same stream.

Two endpoints, one after the other: the replay endpoint in live mode (``bench/replay.py``,
which pushes a put record to waiting subscriptions at once, as AWS does about 70 ms after the
write) and kinesis-mock, which pushes on a one-second tick whatever is written. Everything
runs in this process with moto's server for the lease tables, so one monotonic clock times
the write (when PutRecord was called) and the delivery (when the processor, or the bare loop,
saw the record). Each contender is its own application (its
own lease table, and for fan-out its own registered consumer) reading the same one-shard
stream from LATEST; the producer waits until every contender is reading before it writes
``--records`` records, one every ``--interval-ms``.

botocore's own ``subscribe_to_shard`` cannot be the bare loop here: it insists on the
``initial-response`` event that kinesis-mock does not send. The bare loop is kclpy's
``subscribe`` (signing by botocore, frames by botocore's decoder) iterated directly.

    python bench/latency.py [--records 60] [--interval-ms 250] [--endpoint both]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import _common  # noqa: F401  (puts the repository root on sys.path)
import replay

from kclpy import IRecordProcessor, KCLConfig
from kclpy.local import start_kinesis_mock, start_moto_server
from kclpy.processor import (
    InitializeInput,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.retrieval.registration import ConsumerRegistration, RegistrationSettings
from kclpy.retrieval.subscription import subscribe
from kclpy.worker import Worker
from tests.support.streams import create_stream, kinesis_client, wait_for

REGION = "us-east-1"
SHARD = "shardId-000000000000"
BARE = "bare subscription loop"


@dataclass
class Arrivals:
    """When each payload was seen, by one contender."""

    name: str
    seen: dict[bytes, float] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def saw(self, payloads: Sequence[bytes]) -> None:
        now = time.monotonic()
        with self.lock:
            for payload in payloads:
                self.seen.setdefault(payload, now)


def processor_for(arrivals: Arrivals) -> Callable[[], IRecordProcessor]:
    class Timing(IRecordProcessor):
        def initialize(self, initialize_input: InitializeInput) -> None:
            arrivals.ready.set()

        def process_records(self, process_records_input: ProcessRecordsInput) -> None:
            arrivals.saw([r.binary_data for r in process_records_input.records])

        def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
            pass

        def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
            shard_ended_input.checkpointer.checkpoint()

        def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput
                               ) -> None:
            pass

    return Timing


def bare_loop(kinesis: object, stream: str, arrivals: Arrivals, stop: threading.Event) -> None:
    arn = ConsumerRegistration(kinesis, f"bare-{uuid.uuid4().hex[:6]}", stream_name=stream,
                               settings=RegistrationSettings(backoff_s=0.2, describe_retries=50)
                               ).get_or_create()
    position = {"Type": "LATEST"}
    with contextlib.suppress(Exception):  # the endpoints go away under it at the end
        while not stop.is_set():
            for event in subscribe(kinesis, arn, SHARD, position, http_version="1.1"):
                arrivals.ready.set()
                arrivals.saw([r.binary_data for r in event.records])
                if event.continuation_sequence_number:
                    position = {"Type": "AFTER_SEQUENCE_NUMBER",
                                "SequenceNumber": event.continuation_sequence_number}
                if stop.is_set():
                    return


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(kinesis_url: str, dynamodb_url: str, stream: str, records: int,
            interval_ms: int) -> dict[str, list[float]]:
    """Every contender reading ``stream`` at once; milliseconds from each PutRecord being
    called to each contender seeing the record."""
    kinesis = kinesis_client(kinesis_url)

    def config(**overrides: object) -> KCLConfig:
        values: dict[str, object] = {
            "application_name": f"latency-{uuid.uuid4().hex[:8]}", "stream_name": stream,
            "region": REGION, "kinesis_endpoint": kinesis_url,
            "dynamodb_endpoint": dynamodb_url, "initial_position": "LATEST",
            "retry_backoff_ms": 200, "max_describe_stream_consumer_retries": 50}
        values.update(overrides)
        return KCLConfig(**values)  # type: ignore[arg-type]

    contenders = {
        "polling, defaults (1 s idle)": config(),
        "polling, 200 ms idle": config(idle_time_between_reads_ms=200),
        "fan-out": config(retrieval_mode="fanout"),
    }
    results = {name: Arrivals(name) for name in [*contenders, BARE]}
    workers = [Worker(cfg, processor_for(results[name])) for name, cfg in contenders.items()]
    threads = [threading.Thread(target=w.run, kwargs={"install_signal_handlers": False},
                                daemon=True) for w in workers]
    stop = threading.Event()
    threads.append(threading.Thread(target=bare_loop,
                                    args=(kinesis, stream, results[BARE], stop), daemon=True))
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not all(a.ready.is_set() for a in results.values()):
        if time.monotonic() > deadline:
            raise SystemExit("not reading after 120 s: " + ", ".join(
                name for name, a in results.items() if not a.ready.is_set()))
        time.sleep(0.1)
    time.sleep(2.0)  # the first reads of LATEST iterators and subscriptions settle
    written: dict[bytes, float] = {}
    for n in range(records):
        payload = f"latency-{n}".encode()
        # From the call, not its return: an endpoint that pushes at once delivers the
        # record to a subscriber before the PutRecord answer is back.
        written[payload] = time.monotonic()
        kinesis.put_record(StreamName=stream, Data=payload, PartitionKey="pk")
        time.sleep(interval_ms / 1000)
    wait_for(lambda: all(len(a.seen) >= len(written) for a in results.values()), 60,
             "every contender saw every record")
    stop.set()
    for worker in workers:
        worker.shutdown()
    for thread in threads[:-1]:
        thread.join(60)
    return {name: [(arrivals.seen[p] - t) * 1000 for p, t in written.items()]
            for name, arrivals in results.items()}


def report(endpoint: str, delays: dict[str, list[float]], records: int,
           interval_ms: int) -> None:
    print(f"{records} records, one every {interval_ms} ms, on {endpoint} (1 shard); "
          "milliseconds from calling PutRecord to the processor")
    medians = {name: statistics.median(values) for name, values in delays.items()}
    for name, values in delays.items():
        print(f"{name:>30}: p50 {medians[name]:6.0f}  p90 {percentile(values, 0.9):6.0f}  "
              f"p99 {percentile(values, 0.99):6.0f}")
    fanout, bare = medians["fan-out"], medians[BARE]
    print(f"fan-out median - bare loop median: {fanout - bare:+.0f} ms; "
          f"default polling / fan-out (medians): "
          f"{medians['polling, defaults (1 s idle)'] / fanout:.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=60)
    parser.add_argument("--interval-ms", type=int, default=250)
    parser.add_argument("--endpoint", choices=("kinesis-mock", "replay", "both"),
                        default="both")
    options = parser.parse_args(argv)
    # local endpoints only: throwaway credentials, so nothing real is ever used to sign
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION=REGION)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    with start_moto_server() as moto:
        if options.endpoint in ("replay", "both"):
            stream = f"latency-{uuid.uuid4().hex[:8]}"
            with replay.ReplayServer([replay.build_stream(
                    0, replay.StreamSpec(stream, 1, 0, 100))]) as server:
                delays = measure(server.url, moto.url, stream, options.records,
                                 options.interval_ms)
            report("the replay endpoint in live mode (pushes at once)", delays,
                   options.records, options.interval_ms)
        if options.endpoint in ("kinesis-mock", "both"):
            with start_kinesis_mock() as kinesis_mock:
                stream = f"latency-{uuid.uuid4().hex[:8]}"
                create_stream(kinesis_client(kinesis_mock.url), stream, 1)
                delays = measure(kinesis_mock.url, moto.url, stream, options.records,
                                 options.interval_ms)
            report("kinesis-mock (pushes on a 1 s tick)", delays, options.records,
                   options.interval_ms)


if __name__ == "__main__":
    main()
