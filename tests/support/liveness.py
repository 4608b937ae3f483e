"""Liveness under slow DynamoDB answers: bursts of held answers, and a watch for stalled shards.

A lease renewal or checkpoint whose answer comes back around the failover time is the case
where a worker can give a lease up while its write still lands, and then hold it again
without consuming it: the shard stops for good, the lease is renewed, ``/healthz`` stays
green and no other worker takes it. Nothing is lost in the ledger until records arrive on
that shard, and a run that waits for them only times out; so the chaos run watches every
worker's ``/status`` while it goes, and names the stalled shard as soon as it is one.

:class:`HoldBursts` puts the held answers in seeded bursts (the fault proxy's
``hold_answers``): between them the fleet recovers, so a run sees the fault start and stop
several times. :class:`StallWatch` reads ``/status`` of every running worker about twice a
second; a shard that a worker lists in ``held_leases`` with no consumer, or with its
consumer ``DONE``, for longer than the failover time is a stall. Either passes within one
reconcile pass in a healthy worker (a shard that ended is released, a consumer that ended
otherwise is replaced or its lease let go). A shard whose lease checkpoint is ``SHARD_END``
needs no consumer any more and is never a stall, however long its release takes.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support.faultproxy import FaultProxy

#: a consumer in this state runs no more
DONE = "DONE"
#: how often the watch reads every worker's /status, in seconds
POLL_S = 0.5
_HTTP_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Burst:
    """Seconds after the window began: when held answers start, and when they stop."""

    start_s: float
    end_s: float


def plan_bursts(rng: random.Random, window_s: float, count: int, length_s: float) -> list[Burst]:
    """``count`` bursts of ``length_s`` in ``window_s``, one in each equal slice of it, each
    at a seeded place in its slice (its start when the slice is no longer than a burst)."""
    if count <= 0:
        return []
    slice_s = window_s / count
    length = min(length_s, slice_s)
    return [Burst(start, start + length)
            for start in (n * slice_s + rng.uniform(0.0, slice_s - length)
                          for n in range(count))]


class HoldBursts:
    """Holds back the answers of ``operations`` during each burst, on a thread of its own:
    ``rate`` of them, each for a time drawn (by the proxy's seeded generator) from
    ``hold_s``."""

    def __init__(self, proxy: FaultProxy, operations: Sequence[str], rate: float,
                 hold_s: tuple[float, float], bursts: Sequence[Burst],
                 say: Callable[[str], None]) -> None:
        self._proxy = proxy
        self._operations = tuple(operations)
        self._rate = rate
        self._hold_s = hold_s
        self.bursts = list(bursts)
        self._say = say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-hold-bursts", daemon=True)

    def start(self) -> HoldBursts:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the current burst, if any; no burst starts after this."""
        self._stop.set()
        self._thread.join(30)
        self._set(0.0)

    def _set(self, rate: float) -> None:
        for operation in self._operations:
            self._proxy.hold_answers(operation, rate, self._hold_s)

    def _run(self) -> None:
        begin = time.monotonic()
        for burst in self.bursts:
            if self._stop.wait(max(0.0, begin + burst.start_s - time.monotonic())):
                return
            self._set(self._rate)
            self._say(f"{burst.start_s:5.1f} s  holding {self._rate:.0%} of "
                      f"{', '.join(self._operations)} answers for {self._hold_s[0]:.1f}-"
                      f"{self._hold_s[1]:.1f} s until {burst.end_s:.1f} s")
            if self._stop.wait(max(0.0, begin + burst.end_s - time.monotonic())):
                return
            self._set(0.0)


@dataclass(frozen=True)
class Stall:
    """A shard a worker held with no running consumer for ``span_s`` (and counting)."""

    worker: str
    shard: str
    #: the consumer's state in /status, None when the worker had none for the shard
    state: str | None
    span_s: float
    #: what the worker's /healthz answered when the stall was found
    healthz: int | None
    #: how many of the worker's answers in a row showed it, and the wall-clock time
    #: (``time.time()``) of the first: a span over few answers is a worker that did not
    #: answer in between, which the logs of that time explain
    answers: int = field(default=1, compare=False)
    since: float = field(default=0.0, compare=False)

    def describe(self) -> str:
        consumer = "no consumer" if self.state is None else f"its consumer {self.state}"
        first = time.strftime("%H:%M:%S", time.localtime(self.since))
        return (f"{self.worker} held {self.shard} with {consumer} for {self.span_s:.1f} s "
                f"(/healthz {self.healthz}; in {self.answers} answers in a row from "
                f"{first}.{int(self.since % 1 * 1000):03d})")


@dataclass(frozen=True)
class Watched:
    """A worker the watch reads: its id and the port of its /status."""

    worker: str
    port: int


class StallWatch:
    """Reads /status of the workers ``targets()`` names, about twice a second; a worker that
    does not answer (starting, frozen, killed) is skipped, and what was seen of it is kept
    until it answers again, unless it left ``targets()`` (frozen or gone)."""

    def __init__(self, targets: Callable[[], list[Watched]], failover_s: float,
                 finished: Callable[[], set[str]] = set) -> None:
        self._targets = targets
        self._failover_s = failover_s
        #: the shards whose lease checkpoint is SHARD_END (read from the lease table)
        self._finished = finished
        self._lock = threading.Lock()
        #: (worker, shard) -> when first seen held without a running consumer (monotonic
        #: and wall clock), its state, and in how many answers in a row
        self._since: dict[tuple[str, str], tuple[float, float, str | None, int]] = {}
        self._stalls: dict[tuple[str, str], Stall] = {}
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> list[Stall]:
        self._stop.set()
        self._thread.join(30)
        return self.stalls()

    def stalls(self) -> list[Stall]:
        """Every stall found so far, the longest span seen of each."""
        with self._lock:
            return sorted(self._stalls.values(), key=lambda s: (s.worker, s.shard))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll_once()

    def poll_once(self) -> None:
        targets = self._targets()
        watched = {t.worker for t in targets}
        with self._lock:
            for key in [k for k in self._since if k[0] not in watched]:
                del self._since[key]
        for target in targets:
            status = _get_json(target.port, "/status")
            if status is not None:
                self.observe(target, status, time.monotonic())
        self.polls += 1

    def observe(self, target: Watched, status: dict[str, Any], now: float) -> None:
        """Take in one /status answer of ``target``, read at ``now`` (monotonic seconds)."""
        shards: dict[str, Any] = status.get("shards", {})
        idle: dict[str, str | None] = {}
        finished = self._finished()
        for shard in status.get("held_leases", []):
            if shard in finished:
                continue
            state = shards.get(shard, {}).get("state")
            if state is None or state == DONE:
                idle[shard] = state
        found = []
        with self._lock:
            for key in [k for k in self._since if k[0] == target.worker and k[1] not in idle]:
                del self._since[key]
            for shard, state in idle.items():
                first, wall, _, answers = self._since.get(
                    (target.worker, shard), (now, time.time(), state, 0))
                self._since[(target.worker, shard)] = (first, wall, state, answers + 1)
                if now - first > self._failover_s:
                    found.append((shard, state, now - first, answers + 1, wall))
        for shard, state, span, answers, wall in found:
            stall = Stall(target.worker, shard, state, span, _get_status(target.port, "/healthz"),
                          answers, wall)
            with self._lock:
                self._stalls[(target.worker, shard)] = stall


def _get(port: int, path: str) -> tuple[int, bytes] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}",
                                    timeout=_HTTP_TIMEOUT_S) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, ValueError):
        return None


def _get_json(port: int, path: str) -> dict[str, Any] | None:
    answer = _get(port, path)
    if answer is None or answer[0] != 200:
        return None
    try:
        parsed = json.loads(answer[1])
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _get_status(port: int, path: str) -> int | None:
    answer = _get(port, path)
    return None if answer is None else answer[0]
