"""The periodic progress line: what a worker did since the last one, at INFO.

A busy worker otherwise logs nothing between start-up and shutdown, and an operator reading
the log cannot tell a worker that processes thousands of records a second from one that is
stuck. The Java KCL logs its shard assignment and metrics periodically for the same reason;
this is that, in one line::

    progress: 12480 records (3.1 MB) in the last 30 s, 416.0 records/s; 4 shards held;
    largest MillisBehindLatest 1200 ms (shardId-000000000002)

It reads the worker's own figures (its totals of records and bytes processed, which keep
what shards that left processed, and ``Worker.status()``), so it costs nothing on the
record path and needs no hook in the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kclpy.metrics import BYTES_PROCESSED, RECORDS_PROCESSED, Metrics

log = logging.getLogger("kclpy.progress")


@dataclass(frozen=True)
class Totals:
    records: float
    bytes: float


def totals(metrics: Metrics) -> Totals:
    """Records and bytes processed since the worker started, over every shard it held."""
    return Totals(metrics.total(RECORDS_PROCESSED), metrics.total(BYTES_PROCESSED))


def progress_line(previous: Totals, current: Totals, elapsed_s: float,
                  status: Mapping[str, Any]) -> str:
    """The line for one interval; ``status`` is ``Worker.status()``."""
    records = current.records - previous.records
    size = current.bytes - previous.bytes
    rate = records / elapsed_s if elapsed_s > 0 else 0.0
    held = len(status.get("held_leases", ()))
    behind = [(shard.get("millis_behind_latest"), lease_key)
              for lease_key, shard in status.get("shards", {}).items()
              if shard.get("millis_behind_latest") is not None]
    if behind:
        most, lease_key = max(behind)
        lag = f"largest MillisBehindLatest {most} ms ({lease_key})"
    else:
        lag = "no MillisBehindLatest yet"
    return (f"progress: {records:.0f} records ({_size(size)}) in the last {elapsed_s:.0f} s, "
            f"{rate:.1f} records/s; {held} shard{'s' if held != 1 else ''} held; {lag}")


def _size(count: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


class ProgressReporter:
    """Logs :func:`progress_line` every ``interval_s`` from a daemon thread until stopped."""

    def __init__(self, metrics: Metrics, status: Callable[[], Mapping[str, Any]],
                 interval_s: float) -> None:
        self._metrics = metrics
        self._status = status
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kclpy-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        previous, since = totals(self._metrics), time.monotonic()
        while not self._stop.wait(self._interval_s):
            current, now = totals(self._metrics), time.monotonic()
            try:
                log.info("%s", progress_line(previous, current, now - since, self._status()))
            except Exception:  # a progress line must never take the worker down
                log.debug("progress line failed", exc_info=True)
            previous, since = current, now


@contextmanager
def reporting_progress(metrics: Metrics, status: Callable[[], Mapping[str, Any]],
                       interval_s: float) -> Iterator[None]:
    """Progress lines while the block runs; none when ``interval_s`` is 0."""
    if interval_s <= 0:
        yield
        return
    reporter = ProgressReporter(metrics, status, interval_s)
    reporter.start()
    try:
        yield
    finally:
        reporter.stop()
