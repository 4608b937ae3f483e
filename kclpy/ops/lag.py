"""Lag status with Burrow's rules: is each shard keeping up, without a threshold to tune.

A fixed "N records behind" alarm is wrong for every stream but one, so, like LinkedIn's
Burrow for Kafka, the status comes from how checkpoints and lag *move* over a sliding window
of observations. Rules for one shard, checked in Burrow's order (the first that holds wins):

1. OK      the lag was zero in some observation of the window (or is zero now);
2. REWIND  the checkpoint moved backwards between two observations;
3. STOP    no checkpoint was written for longer than the window while behind;
4. STALL   checkpoints were written in the window but never moved while behind;
5. WARN    checkpoints moved but the lag never decreased and ended higher than it started;
6. OK      otherwise.

The application is ERROR if any shard is STOP, STALL or REWIND, WARN if any is WARN.

Differences from Burrow, each because a Kinesis lease is not a Kafka offset commit:

- Burrow's window is the last N commits; a lease has no commit time, so the window here is
  the last ``window_s`` seconds of periodic observations, and a checkpoint is "written" when
  an observation sees it differ from the previous one (see :func:`checkpoint_written`).
- Burrow's STOP compares the time since the last commit with the span of its window; here
  it is the time since the last write seen (or since observing began) against ``window_s``,
  so STOP needs a full window of observations - it is never guessed from one sample.
- Burrow warns when lag is flat; here the lag must also end higher, because a consumer that
  exactly matches the producer's rate is not falling behind.
- A shard waiting for its parents to finish is OK: it must not checkpoint yet.
- A shard in lag recovery (``max_lag_ms``) is OK unless it rewinds: its live checkpoint
  stays where the gap starts until the first live batch, and the gap is read at a bounded
  rate on purpose, so neither a quiet checkpoint nor a slow one means it is stuck.

Lag is measured from the checkpoint against the tip of the shard by :class:`LagProbe`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kclpy.metrics import (
    APPLICATION_LAG_STATUS,
    LAG_MAX_MILLIS,
    LAG_TOTAL_RECORDS,
    SHARD_LAG_STATUS,
)
from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON, Position
from kclpy.retrieval.polling import one_off_pages
from kclpy.retrieval.source import ShardAddress

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

    from kclpy.metrics import Metrics

log = logging.getLogger(__name__)


class ShardStatus(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    STALL = "STALL"
    STOP = "STOP"
    REWIND = "REWIND"


class AppStatus(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    ERROR = "ERROR"

    @property
    def exit_code(self) -> int:
        """What ``kclpy status`` exits with, so that it can be a monitor's check."""
        return {AppStatus.OK: 0, AppStatus.WARN: 1, AppStatus.ERROR: 2}[self]


_ERRORS = frozenset({ShardStatus.STOP, ShardStatus.STALL, ShardStatus.REWIND})


def application_status(statuses: Iterable[ShardStatus]) -> AppStatus:
    """ERROR if any shard is STOP, STALL or REWIND; WARN if any is WARN; OK otherwise."""
    seen = set(statuses)
    if seen & _ERRORS:
        return AppStatus.ERROR
    if ShardStatus.WARN in seen:
        return AppStatus.WARN
    return AppStatus.OK


@dataclass(frozen=True)
class Lag:
    """How far a checkpoint is behind the tip of its shard.

    ``records`` counts Kinesis records (a KPL aggregate is one) and is a lower bound unless
    ``records_exact``; ``millis`` is the age of the oldest record after the checkpoint.
    """

    records: int
    records_exact: bool
    millis: int

    @property
    def is_zero(self) -> bool:
        return self.records == 0 and self.records_exact

    def describe(self) -> str:
        records = f"{self.records}" if self.records_exact else f"at least {self.records}"
        return f"{records} records / {self.millis / 1000:.1f}s behind"


NO_LAG = Lag(records=0, records_exact=True, millis=0)


@dataclass(frozen=True)
class Observation:
    """One look at a shard: its lease and its lag, at ``time`` (seconds, any monotonic
    clock). ``written`` is filled in by :class:`LagTracker` from the previous observation."""

    time: float
    checkpoint: str | None
    sub_sequence_number: int
    lag: Lag
    written: bool = False
    lease_counter: int | None = None
    owner: str | None = None
    owner_switches: int | None = None
    #: checkpoints this worker has written so far (its ``kclpy_checkpoints_total``), when
    #: the observer is the worker itself; None from the lease table alone
    checkpoint_writes: float | None = None
    #: the shard may not checkpoint yet because a parent shard is still being read
    waiting_on_parents: bool = False
    #: lag recovery gaps of the shard are queued (the worker's own view)
    recovering: bool = False

    @property
    def position(self) -> tuple[int, int]:
        """The checkpoint's place in the shard, the sentinels before every record counted as
        one (an operator's move between them is no progress and no rewind)."""
        return Position.of(self.checkpoint, self.sub_sequence_number).extended


def checkpoint_written(previous: Observation, current: Observation) -> bool:
    """Whether a checkpoint was written between two observations of one shard.

    Seen for sure when the checkpoint value changed, when the worker's own checkpoint
    counter grew, or when ``ownerSwitchesSinceCheckpoint`` went back to zero (only a
    checkpoint resets it). A checkpoint re-written at the same value is otherwise invisible
    in the lease table, because a renewal bumps ``leaseCounter`` exactly as it does.
    """
    if (previous.checkpoint, previous.sub_sequence_number) != (
            current.checkpoint, current.sub_sequence_number):
        return True
    if previous.checkpoint_writes is not None and current.checkpoint_writes is not None \
            and current.checkpoint_writes > previous.checkpoint_writes:
        return True
    return bool(previous.owner_switches and current.owner_switches == 0)


@dataclass(frozen=True)
class ShardEvaluation:
    status: ShardStatus
    reason: str
    #: how much of the window has been observed, 0..1 (Burrow's "complete")
    complete: float
    latest: Observation | None


class ShardWindow:
    """The observations of one shard within the sliding window, and their evaluation.

    Keeps one observation from before the window as an anchor, so that a checkpoint that
    moved (or rewound) right at the window's start is still seen as a move.
    """

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._observations: deque[Observation] = deque()
        self._first_seen: float | None = None
        self._last_write: float | None = None

    def add(self, observation: Observation) -> None:
        if self._first_seen is None:
            self._first_seen = observation.time
        if observation.written:
            self._last_write = observation.time
        self._observations.append(observation)
        start = observation.time - self.window_s
        while len(self._observations) > 1 and self._observations[1].time < start:
            self._observations.popleft()

    @property
    def latest(self) -> Observation | None:
        return self._observations[-1] if self._observations else None

    def evaluate(self, now: float) -> ShardEvaluation:
        """Burrow's rules (module docstring) over the window that ends at ``now``."""
        if not self._observations or self._first_seen is None:
            return ShardEvaluation(ShardStatus.OK, "not observed yet", 0.0, None)
        start = now - self.window_s
        anchored = list(self._observations)
        first = next((i for i, o in enumerate(anchored) if o.time >= start), len(anchored) - 1)
        window = anchored[first:]
        scope = anchored[max(0, first - 1):]  # the window and the observation before it
        latest = window[-1]
        complete = max(0.0, min(1.0, (now - self._first_seen) / self.window_s))

        def result(status: ShardStatus, reason: str) -> ShardEvaluation:
            return ShardEvaluation(status, reason, complete, latest)

        if latest.checkpoint == SHARD_END:
            return result(ShardStatus.OK, "shard finished (SHARD_END)")
        if latest.waiting_on_parents:
            return result(ShardStatus.OK, "waiting for its parent shards to finish")
        if any(o.lag.is_zero for o in window):
            return result(ShardStatus.OK, "caught up within the window")
        for before, after in itertools.pairwise(scope):
            if after.position < before.position:
                return result(ShardStatus.REWIND, f"checkpoint moved backwards from "
                              f"{_where(before)} to {_where(after)}")
        if latest.recovering:
            return result(ShardStatus.OK, "in lag recovery: live reading runs near the tip "
                          "while the gap is recovered at its bounded rate")
        quiet_since = self._last_write if self._last_write is not None else self._first_seen
        if now - quiet_since >= self.window_s:
            return result(ShardStatus.STOP, f"no checkpoint for {now - quiet_since:.0f}s "
                          f"(window {self.window_s:g}s) while {latest.lag.describe()}; "
                          f"{_owner_note(scope)}")
        moved = len({o.position for o in scope}) > 1
        if any(o.written for o in window) and not moved:
            return result(ShardStatus.STALL, f"checkpoints written but not moving from "
                          f"{_where(latest)} while {latest.lag.describe()}")
        lags = [o.lag.millis for o in window]
        if moved and lags[-1] > lags[0] and all(
                b >= a for a, b in itertools.pairwise(lags)):
            return result(ShardStatus.WARN, f"checkpoints move but the lag grew from "
                          f"{lags[0] / 1000:.1f}s to {lags[-1] / 1000:.1f}s")
        if latest.owner is None and latest.lease_counter is not None:
            # nobody consumes it, even before a whole window says STOP
            return result(ShardStatus.WARN, f"no worker holds the lease while "
                          f"{latest.lag.describe()} ({complete:.0%} of the window observed)")
        if complete < 1.0:
            return result(ShardStatus.OK, f"consuming ({complete:.0%} of the window observed)")
        return result(ShardStatus.OK, "consuming")


def _where(observation: Observation) -> str:
    if observation.checkpoint is None:
        return "no checkpoint"
    if observation.sub_sequence_number:
        return f"{observation.checkpoint}/{observation.sub_sequence_number}"
    return observation.checkpoint


def _owner_note(observations: Sequence[Observation]) -> str:
    """Why nobody checkpoints: separates a dead worker from a processor that does not call
    checkpoint, which is the first thing an operator needs to know."""
    latest = observations[-1]
    if latest.owner is None:
        return "no worker holds the lease"
    counters = {o.lease_counter for o in observations if o.lease_counter is not None}
    if latest.checkpoint_writes is not None or len(counters) > 1:
        return f"{latest.owner} holds the lease but its processor does not checkpoint"
    return f"the lease of {latest.owner} is not being renewed (is the worker alive?)"


class LagTracker:
    """One :class:`ShardWindow` per shard, fed with observations as they are made. A shard
    is named by ``key``: its lease key in a worker (``/status``), its bare shard id in the
    inspector, which reads one stream.

    Thread-safe: the worker's sampler thread records while HTTP threads evaluate.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._windows: dict[str, ShardWindow] = {}
        self._lock = threading.Lock()

    def record(self, key: str, observation: Observation) -> Observation:
        """Add an observation; returns it with ``written`` set from the previous one."""
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = ShardWindow(self.window_s)
            previous = window.latest
            written = previous is not None and checkpoint_written(previous, observation)
            observation = dataclasses.replace(observation, written=written)
            window.add(observation)
            return observation

    def retain(self, keys: Iterable[str]) -> None:
        """Forget shards no longer observed (a lease lost or a shard gone)."""
        keep = set(keys)
        with self._lock:
            for key in set(self._windows) - keep:
                del self._windows[key]

    def evaluate(self, now: float) -> dict[str, ShardEvaluation]:
        with self._lock:
            return {s: w.evaluate(now) for s, w in sorted(self._windows.items())}


class LagProbe:
    """Measures a checkpoint's lag with the Kinesis API, as cheaply as it can be had.

    Kinesis has no "latest offset" to subtract from, so the probe reads from the checkpoint
    (through retrieval's polling source, each call tried once): one GetShardIterator
    (AFTER_SEQUENCE_NUMBER) and GetRecords with ``Limit=records_limit``, following the
    iterator for at most ``max_pages`` pages while the pages are empty but behind (AWS can
    answer empty pages before old data). Records behind is the number of records returned,
    exact when the last page reached the tip (MillisBehindLatest 0) and otherwise a lower
    bound. Seconds behind is the age of the first record after the checkpoint (0 when there
    is none), else the page's MillisBehindLatest.

    Cost per shard and probe: 1 GetShardIterator and usually 1 GetRecords, against the
    shard's limits of 5 calls/s and 2 MB/s shared with the consumers, transferring at most
    ``records_limit`` records. A checkpoint inside a KPL aggregate counts the aggregate as
    done, so lag is under-counted by at most that aggregate's remaining user records.
    """

    def __init__(
        self,
        kinesis: KinesisClient,
        *,
        stream_name: str | None = None,
        stream_arn: str | None = None,
        records_limit: int = 1000,
        max_pages: int = 3,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if stream_name is None and stream_arn is None:
            raise ValueError("a LagProbe needs stream_name or stream_arn")
        if not 1 <= records_limit <= 10000:
            raise ValueError("records_limit must be between 1 and 10000")
        self._kinesis = kinesis
        self._stream_name = stream_name
        self._stream_arn = stream_arn
        self.records_limit = records_limit
        self._max_pages = max_pages
        self._wall_clock = wall_clock

    def measure(self, shard_id: str, checkpoint: str | None, sub_sequence_number: int) -> Lag:
        """The lag of ``checkpoint`` on ``shard_id``. LATEST is taken as caught up (the
        consumer starts at the tip) and AT_TIMESTAMP as TRIM_HORIZON, an upper bound,
        because the lease does not record the timestamp."""
        if checkpoint in (SHARD_END, LATEST):
            return NO_LAG
        address = ShardAddress(shard_id, self._stream_name, self._stream_arn)
        if checkpoint in (None, TRIM_HORIZON, AT_TIMESTAMP):
            pages = one_off_pages(self._kinesis, address, Position.trim_horizon(),
                                  limit=self.records_limit)
        else:
            # after the checkpoint's Kinesis record: an aggregate it is inside counts as done
            pages = one_off_pages(self._kinesis, address, Position(checkpoint),
                                  after=checkpoint, limit=self.records_limit)
        for read, page in enumerate(pages, 1):
            count, behind = len(page.records), page.millis_behind_latest
            if count or behind == 0 or page.shard_closed or read >= self._max_pages:
                break
        pages.close()
        # Emulators may leave MillisBehindLatest out; a short page then means the tip.
        at_tip = (page.shard_closed or behind == 0
                  or (behind is None and count < self.records_limit))
        exact = at_tip and count < self.records_limit
        first_arrival = page.records[0].timestamp_millis if count else None
        if first_arrival is not None:
            millis = max(0, round(self._wall_clock() * 1000) - first_arrival)
        elif count == 0 and exact:
            millis = 0
        else:
            millis = behind or 0
        return Lag(records=count, records_exact=exact, millis=millis)


def evaluation_to_json(key: str, evaluation: ShardEvaluation) -> dict[str, Any]:
    """The JSON shape both /status and ``kclpy status --json`` use for one shard; its
    ``shard_id`` field is the tracker's ``key`` (the lease key in /status)."""
    latest = evaluation.latest
    result: dict[str, Any] = {
        "shard_id": key,
        "status": evaluation.status.value,
        "reason": evaluation.reason,
        "complete": round(evaluation.complete, 3),
    }
    if latest is not None:
        result.update({
            "owner": latest.owner,
            "checkpoint": latest.checkpoint,
            "checkpoint_sub_sequence_number": latest.sub_sequence_number,
            "lease_counter": latest.lease_counter,
            "records_behind": latest.lag.records,
            "records_behind_exact": latest.lag.records_exact,
            "millis_behind": latest.lag.millis,
        })
    return result


def report_to_json(evaluations: Mapping[str, ShardEvaluation], window_s: float
                   ) -> dict[str, Any]:
    return {
        "status": application_status(e.status for e in evaluations.values()).value,
        "window_seconds": window_s,
        "shards": [evaluation_to_json(s, e) for s, e in sorted(evaluations.items())],
    }


#: every label value of the status gauges: Burrow's statuses (ERR is an application's)
STATUS_LABELS = ("OK", "WARN", "ERR", "STOP", "STALL", "REWIND")


def _app_label(status: AppStatus) -> str:
    return "ERR" if status is AppStatus.ERROR else status.value


class LagAlerts:
    """Publishes a worker's evaluations (by lease key) as enum gauges and tells ``notify``
    of every status that changed (a shard's, or the application's with the document's
    ``shard_id`` None)."""

    def __init__(self, metrics: Metrics, application: str,
                 notify: Callable[[dict[str, Any]], None] | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._metrics = metrics
        self._application = application
        self._notify = notify
        self._wall_clock = wall_clock
        self._shards: dict[str, str] = {}
        self._app: str | None = None

    def publish(self, evaluations: Mapping[str, ShardEvaluation]) -> None:
        metrics = self._metrics
        for lease_key in set(self._shards) - set(evaluations):
            for label in STATUS_LABELS:
                metrics.shard(lease_key).remove(SHARD_LAG_STATUS, label)
            del self._shards[lease_key]
        for lease_key, evaluation in sorted(evaluations.items()):
            status = evaluation.status.value
            for label in STATUS_LABELS:
                metrics.shard(lease_key).set(SHARD_LAG_STATUS, 1 if label == status else 0,
                                             label)
            previous = self._shards.get(lease_key)
            self._shards[lease_key] = status
            if previous != status and (previous is not None or status != "OK"):
                self._changed(lease_key, status, previous, evaluation)
        app = _app_label(application_status(e.status for e in evaluations.values()))
        for label in STATUS_LABELS:
            metrics.set(APPLICATION_LAG_STATUS, 1 if label == app else 0, label)
        if app != self._app and (self._app is not None or app != "OK"):
            worst = [f"{s}: {e.status.value}" for s, e in sorted(evaluations.items())
                     if e.status is not ShardStatus.OK]
            self._changed(None, app, self._app, None,
                          "; ".join(worst) or "every shard OK")
        self._app = app
        latest = [e.latest for e in evaluations.values() if e.latest is not None]
        metrics.set(LAG_MAX_MILLIS, max((o.lag.millis for o in latest), default=0))
        metrics.set(LAG_TOTAL_RECORDS, sum(o.lag.records for o in latest))

    def _changed(self, lease_key: str | None, status: str, previous: str | None,
                 evaluation: ShardEvaluation | None, reason: str | None = None) -> None:
        log.info("lag status of %s: %s -> %s", lease_key or "the application",
                 previous or "none", status)
        if self._notify is None:
            return
        document: dict[str, Any] = {
            "application": self._application, "shard_id": lease_key, "status": status,
            "previous_status": previous,
            "reason": reason if evaluation is None else evaluation.reason,
            "time_ms": round(self._wall_clock() * 1000),
        }
        if evaluation is not None and evaluation.latest is not None:
            document["millis_behind"] = evaluation.latest.lag.millis
            document["records_behind"] = evaluation.latest.lag.records
        self._notify(document)
