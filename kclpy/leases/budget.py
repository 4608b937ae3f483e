"""How often a worker may scan the lease table: as often as the Java KCL's bill allows.

A worker notices a dead worker's leases, released leases and finished handoffs only by
scanning the table, so the scan interval bounds how fast failover can be (see
docs/leases.md). The Java KCL 2.x scans every ``2 * failover + 50 ms`` and renews every held
lease every ``failover / 3``. kclpy renews less (every ``failover / 2``, and not at all when a
checkpoint wrote the lease in that time) and spends exactly what that saves on scanning more
often, so that a fleet's DynamoDB bill is never above a Java fleet's for the same failover
time.

Every worker is credited with what a Java worker holding the fleet's average load
(``share`` = leases / live workers) would spend, whatever it holds itself: credited that
way, every worker scans about as often as the others - a survivor that happens to hold few
leases is not the slow one that leaves a dead worker's shards waiting - while the fleet's
total credit is exactly the Java fleet's bill.

The bookkeeping is a pair of token buckets, one per thing DynamoDB charges for:

- *requests*: credit accrues at the rate a Java worker holding ``share`` leases would send
  requests (``3 / failover`` renewals per lease per second plus its scans); every renewal
  and every scan page this worker sends is paid from it;
- *capacity*, in write-unit equivalents (a read unit costs a fifth of a write unit, on
  demand and provisioned alike): a renewal is one write unit; a scan reads every lease item
  (eventually consistent, as Java scans, half a read unit per 4 KB).

A scan is due once both buckets hold its price, never sooner than ``min_interval_s`` and
never later than Java's own interval. The buckets hold at most ``burst_scans`` scans'
worth, so credit saved while idle cannot be spent in a burst later.

Checkpoints, takes, steals and releases are not counted: they are the same requests the
Java KCL makes for the same events.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

#: Java KCL 2.x renews every held lease every failover / 3 (minus 25 ms; ignored, in Java's
#: favour).
JAVA_RENEWALS_PER_FAILOVER = 3.0
#: the average size of a lease item in KB (measured on Java and kclpy items: 300-400 bytes)
LEASE_ITEM_KB = 0.4
#: a read unit's price in write units (DynamoDB on-demand and provisioned pricing)
READ_UNIT_IN_WRITE_UNITS = 0.2
#: one Scan page holds at most 1 MB
_PAGE_KB = 1024.0


def java_taker_interval(failover_s: float) -> float:
    """Java's ``takerIntervalMillis``: ``(failover + epsilon) * 2`` with a 25 ms epsilon."""
    return 2 * (failover_s + 0.025)


def scan_pages(leases: int) -> int:
    """Scan requests for one full scan of ``leases`` items."""
    return max(1, math.ceil(leases * LEASE_ITEM_KB / _PAGE_KB))


def scan_units(leases: int) -> float:
    """Capacity of one eventually consistent full scan, in write-unit equivalents: half a
    read unit per started 4 KB."""
    return math.ceil(max(1.0, leases * LEASE_ITEM_KB / 4.0)) * 0.5 * READ_UNIT_IN_WRITE_UNITS


class ScanBudget:
    """Decides when the next scan is affordable. Thread-safe: the renewer spends from it
    while the taker asks it when to scan."""

    def __init__(
        self,
        failover_s: float,
        *,
        clock: Callable[[], float],
        min_interval_s: float = 0.5,
        burst_scans: float = 3.0,
    ) -> None:
        self.failover_s = failover_s
        self.max_interval_s = java_taker_interval(failover_s)
        self.min_interval_s = min(min_interval_s, self.max_interval_s)
        self._burst = burst_scans
        self._clock = clock
        self._lock = threading.Lock()
        self._at = clock()
        self._share = 0.0
        self._leases = 0
        # Start with one scan's worth: the first scan of a worker is never delayed.
        self._requests = float(scan_pages(0))
        self._units = scan_units(0)
        self._last_scan: float | None = None

    def _accrue(self, now: float) -> None:
        """Credit what a Java worker holding ``_share`` leases would have spent since ``_at``."""
        elapsed = max(0.0, now - self._at)
        self._at = now
        renewals = self._share * JAVA_RENEWALS_PER_FAILOVER / self.failover_s
        pages, units = scan_pages(self._leases), scan_units(self._leases)
        self._requests = min(
            self._requests + elapsed * (renewals + pages / self.max_interval_s),
            self._burst * pages,
        )
        self._units = min(
            self._units + elapsed * (renewals + units / self.max_interval_s),
            self._burst * units,
        )

    def observe(self, *, share: float, leases: int) -> None:
        """The current load: leases per live worker, and leases in the table."""
        with self._lock:
            self._accrue(self._clock())
            self._share = share
            self._leases = leases

    def spend_renewal(self) -> None:
        """One renewal request was sent (successful or not)."""
        with self._lock:
            self._accrue(self._clock())
            self._requests -= 1.0
            self._units -= 1.0

    def spend_scan(self) -> None:
        """One full scan of the table was made."""
        with self._lock:
            now = self._clock()
            self._accrue(now)
            self._requests -= scan_pages(self._leases)
            self._units -= scan_units(self._leases)
            self._last_scan = now

    def next_scan_in(self) -> float:
        """Seconds until the next scan is affordable, within [min, Java's] interval since
        the last scan."""
        with self._lock:
            now = self._clock()
            self._accrue(now)
            renewals = self._share * JAVA_RENEWALS_PER_FAILOVER / self.failover_s
            pages, units = scan_pages(self._leases), scan_units(self._leases)
            waits = [0.0]
            for short, rate in (
                (pages - self._requests, renewals + pages / self.max_interval_s),
                (units - self._units, renewals + units / self.max_interval_s),
            ):
                if short > 0:
                    waits.append(short / rate)
            wait = max(waits)
            if self._last_scan is not None:
                since = now - self._last_scan
                wait = min(max(wait, self.min_interval_s - since), self.max_interval_s - since)
            return max(0.0, wait)
