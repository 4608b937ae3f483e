"""The recovery reads' budget: one token bucket over records for the whole worker, handed out
to its recovering shards in turn.

The bucket holds at most half a second of records, so no window of 10 s ever sees more than
10.5 s worth (within the 10 % the bound allows) however the reads bunch up. Shards take turns:
a shard that waits is served before any shard that asks after it, so a shard with a deep
backlog cannot starve one with a shallow one, and each gets an equal share while both read.
Tokens are Kinesis records, taken before each GetRecords (its ``Limit``); what a page did
not use is given back.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


class RecoveryRate:
    """Thread-safe; ``clock`` is injectable so the arithmetic can be tested without waiting."""

    def __init__(self, records_per_second: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if records_per_second < 1:
            raise ValueError("records_per_second must be at least 1")
        self._rate = float(records_per_second)
        self._burst = max(1, records_per_second // 2)
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = float(self._burst)
        self._refilled_at = clock()
        self._turns: collections.deque[str] = collections.deque()

    def reserve(self, lease_key: str, want: int) -> tuple[int, float]:
        """Records ``lease_key`` may read now: ``(granted, 0)``, or ``(0, seconds)`` to wait
        before asking again (its turn, or enough tokens, is not there yet)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self._burst),
                               self._tokens + (now - self._refilled_at) * self._rate)
            self._refilled_at = now
            if lease_key not in self._turns:
                self._turns.append(lease_key)
            need = min(max(1, want), self._burst)
            if self._turns[0] == lease_key and self._tokens >= need:
                self._turns.popleft()
                granted = min(want, int(self._tokens))
                self._tokens -= granted
                return granted, 0.0
            if self._turns[0] != lease_key:
                return 0, need / self._rate  # about when the shards ahead have had theirs
            return 0, max(need - self._tokens, 1.0) / self._rate

    def give_back(self, records: int) -> None:
        """Tokens granted but not used (a page shorter than its ``Limit``)."""
        with self._lock:
            self._tokens = min(float(self._burst), self._tokens + records)

    def leave(self, lease_key: str) -> None:
        """``lease_key`` stopped reading: it must not hold up the shards behind it."""
        with self._lock:
            if lease_key in self._turns:
                self._turns.remove(lease_key)

    def pacer(self, lease_key: str) -> ShardPacer:
        return ShardPacer(self, lease_key)


class ShardPacer:
    """One shard's side of the budget, as the polling source uses it before each GetRecords."""

    def __init__(self, rate: RecoveryRate, lease_key: str) -> None:
        self._rate = rate
        self._lease_key = lease_key

    def take(self, want: int, stop: threading.Event) -> int:
        """Block until records are granted (their number) or ``stop`` is set (0)."""
        while not stop.is_set():
            granted, wait_s = self._rate.reserve(self._lease_key, want)
            if granted:
                return granted
            stop.wait(wait_s)
        self._rate.leave(self._lease_key)
        return 0

    def give_back(self, records: int) -> None:
        if records > 0:
            self._rate.give_back(records)

    def leave(self) -> None:
        self._rate.leave(self._lease_key)
