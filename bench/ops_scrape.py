"""How much scrapes of a 500-shard worker's ``/metrics`` delay its other threads.

The lease renewer is a thread of the worker like the ops endpoint's; what a scrape can cost
it is the wait for the GIL while scrapes render (pure Python). This measures exactly that
wait: a probe thread sleeps 5 ms in a loop and records how late it wakes up - the time it
needed to get the GIL back - first with the endpoint idle, then while 16 clients (in another
process, so their own work does not compete for this one's GIL) scrape ``/metrics`` as fast
as they can. It prints the probe's lateness (median, 99th percentile, worst) for both, their
ratio, and the scrapes served.

    python bench/ops_scrape.py [--seconds 10] [--scrapers 16] [--shards 500]

Run it with ``PYTHONPATH`` pointing at another checkout to measure that one's endpoint: the
script uses only ``serve_worker``'s long-standing arguments.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import _common  # noqa: F401  (puts the checkout on sys.path)

from kclpy.metrics import (
    BYTES_PROCESSED,
    CHECKPOINTS,
    GET_RECORDS,
    MILLIS_BEHIND_LATEST,
    PROCESS_RECORDS,
    RECORDS_PROCESSED,
    SHARD_CONSUMER_STATE,
    Metrics,
)
from kclpy.ops import serve_worker

_PROBE_S = 0.005

_CLIENT = """
import sys, threading, time, urllib.request
url, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
done = [0]
lock = threading.Lock()
deadline = time.monotonic() + seconds
def scrape():
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                answer.read()
        except OSError:
            continue
        with lock:
            done[0] += 1
workers = [threading.Thread(target=scrape) for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(done[0])
"""


class _Worker:
    """What serve_worker reads: a registry with the per-shard series of ``shards``."""

    def __init__(self, shards: int) -> None:
        self.metrics = Metrics()
        self.healthy = True
        self.kinesis = None
        for n in range(shards):
            shard = f"shardId-{n:012d}"
            scope = self.metrics.shard(shard)
            scope.inc(RECORDS_PROCESSED, by=n)
            scope.inc(BYTES_PROCESSED, by=n * 100)
            scope.call(PROCESS_RECORDS, 0.01)
            scope.call(GET_RECORDS, 0.02)
            scope.set(MILLIS_BEHIND_LATEST, n)
            scope.inc(CHECKPOINTS)
            for state in ("WAITING_ON_PARENTS", "INITIALIZING", "PROCESSING",
                          "SHUTTING_DOWN", "DONE"):
                scope.set(SHARD_CONSUMER_STATE, state == "PROCESSING", state)

    def status(self) -> dict[str, Any]:
        return {"worker_id": "bench", "shards": {}}


def _probe(seconds: float) -> list[float]:
    """How late (seconds) each of the probe's 5 ms sleeps ended, for ``seconds``."""
    late: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        time.sleep(_PROBE_S)
        late.append(time.perf_counter() - started - _PROBE_S)
    return late


def _summary(late: list[float]) -> tuple[float, float, float]:
    ordered = sorted(late)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered), p99, ordered[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--scrapers", type=int, default=16)
    parser.add_argument("--shards", type=int, default=500)
    args = parser.parse_args()
    worker = _Worker(args.shards)
    with serve_worker(worker, lag_window_s=None) as server:  # type: ignore[arg-type]
        url = server.url + "/metrics"
        with urllib.request.urlopen(url, timeout=30) as answer:
            size = len(answer.read())
        idle = _summary(_probe(args.seconds))
        client = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, url, str(args.seconds), str(args.scrapers)],
            stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # let the clients connect: measure the steady state
        result: list[list[float]] = []
        probe = threading.Thread(target=lambda: result.append(_probe(args.seconds - 1)))
        probe.start()
        probe.join()
        out, _ = client.communicate(timeout=args.seconds * 10 + 60)
    scraped = _summary(result[0])
    print(f"/metrics of {args.shards} shards: {size / 1e3:,.0f} kB")
    print(f"probe lateness idle:  median {idle[0] * 1e3:.2f} ms, p99 {idle[1] * 1e3:.2f} ms, "
          f"max {idle[2] * 1e3:.2f} ms")
    print(f"probe lateness with {args.scrapers} scrapers: median {scraped[0] * 1e3:.2f} ms, "
          f"p99 {scraped[1] * 1e3:.2f} ms, max {scraped[2] * 1e3:.2f} ms")
    print(f"ratio scraped/idle: median {scraped[0] / max(idle[0], 1e-6):.1f}x, "
          f"p99 {scraped[1] / max(idle[1], 1e-6):.1f}x")
    print(f"scrapes served: {int(out.strip() or 0)} in {args.seconds:g} s")


if __name__ == "__main__":
    main()
