"""Kinesis' own clock, as its answers show it: what a bounded read compares its end with.

A bounded read (a recovery gap, a Spark batch's part) ends before an arrival time, and its
records' arrival times are stamped by Kinesis' clock. Reaching the tip of a shard says that
every record that had arrived *by Kinesis' time then* was read, not that every record before
the bound was: when the bound is still in Kinesis' future, records arriving later belong to
the range too. A bound computed from a local clock that runs ahead of Kinesis' is such a
bound, and reading to the tip used to end it, skipping what arrived after, silently.

So kclpy measures Kinesis' time instead of trusting the local one. Every Kinesis answer
carries the service's ``Date`` header (one-second precision); a page's last record's
``ApproximateArrivalTimestamp`` plus its ``MillisBehindLatest`` is a time the service had
reached too (both are at most its time when it answered, on AWS and on kinesis-mock, whose
MillisBehindLatest is the tip's arrival minus the last record's). Each observation is a
*lower bound* of Kinesis' time when the answer came back; carried forward with the local
monotonic clock (clock rates agree; only their settings differ), the highest of them is a
lower bound of Kinesis' time now (:meth:`KinesisClock.now_ms`). A bounded read at the tip
ends only when that lower bound, taken before the GetRecords was sent, has passed its bound
(``Page.within``): then every record that arrived before the bound was already stored when
the tip was read. An idle shard still ends, once Kinesis' time (``Date``, carried forward)
passes the bound; the read polls the tip until then.

Planners use the same clock for the ends they choose (the Spark source's batch ends, lag
recovery's gap ends): the local clock, but never later than the latest time Kinesis'
answers allow (``plan_ms``), so a bound is not in Kinesis' future by more than the ``Date``
header's precision in the first place and the read seldom has to wait. A local clock found
surely ahead of Kinesis' by more than ``SKEW_MARGIN_MS`` is logged once at WARNING per
client; the worker's sources publish the estimated skew as ``kclpy_clock_skew_seconds``.

One clock per botocore client (one endpoint), fed by an ``after-call`` handler on every
Kinesis call of that client: GetShardIterator and ListShards teach it as GetRecords does.
Only an endpoint whose answers carry a ``Date`` header is trusted to show its time at the
tip (``shown_ms``): records alone only say when the last one arrived, which on an idle
shard would keep a bounded read open for good. An endpoint without one (not HTTP/1.1: a
stand-in, the simulator, botocore's Stubber unless the test gives one) keeps the local
clock, as before. A fan-out read keeps its range open through its first event, whose
subscription answer is the first to show the time on a fresh client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from kclpy.records import Record

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

__all__ = ["SKEW_MARGIN_MS", "KinesisClock", "kinesis_clock"]

log = logging.getLogger(__name__)

#: a local clock this much ahead of Kinesis' (beyond the ``Date`` header's one-second
#: precision) is reported: below it, a planned bound's settle margin covers it anyway
SKEW_MARGIN_MS = 1000
#: the ``Date`` header is whole seconds, truncated: Kinesis' time was below ``Date + 1 s``
DATE_PRECISION_MS = 1000

_EVENT = "after-call.kinesis"
_HANDLER_ID = "kclpy.retrieval.clock.observe"


class KinesisClock:
    """A lower bound of Kinesis' time now, from what its answers showed (thread-safe).

    ``monotonic`` carries observations forward; ``wall`` is the local clock, used to say
    how far it is from Kinesis' (``skew_ms``) and, bounded by Kinesis' time, to plan on
    (``planned_now``)."""

    def __init__(self, *, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = lambda: time.time()) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self._lock = threading.Lock()
        #: max over observations of (Kinesis' time at least) - (monotonic ms then)
        self._low: float | None = None
        #: min over ``Date`` observations of (Kinesis' time at most) - (monotonic ms then)
        self._high: float | None = None
        self._warned = False

    def observe(self, at_least_ms: int, at_most_ms: int | None = None) -> None:
        """Kinesis' time, as an answer just received showed it, was at least
        ``at_least_ms`` (and below ``at_most_ms`` when the answer says so)."""
        now = self._monotonic() * 1000
        with self._lock:
            low = at_least_ms - now
            if self._low is None or low > self._low:
                self._low = low
            if at_most_ms is not None:
                high = at_most_ms - now
                if self._high is None or high < self._high:
                    self._high = high
        self._check_skew()

    def observe_date(self, date: str) -> None:
        """An HTTP ``Date`` header of a Kinesis answer (whole seconds, truncated)."""
        try:
            seconds = parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, IndexError):
            return
        at_least = round(seconds * 1000)
        self.observe(at_least, at_least + DATE_PRECISION_MS)

    def observe_page(self, records: Sequence[Record], millis_behind_latest: int | None) -> None:
        """A page's last record arrived, and the page was ``millis_behind_latest`` behind
        the tip: Kinesis' time had reached the sum when it answered."""
        if not records:
            return
        arrived = records[-1].timestamp_millis
        if arrived is not None:
            self.observe(arrived + (millis_behind_latest or 0))

    def now_ms(self) -> int | None:
        """Kinesis' time now is at least this (epoch ms); None: nothing observed yet."""
        with self._lock:
            low = self._low
        return None if low is None else int(low + self._monotonic() * 1000)

    def shown_ms(self) -> int | None:
        """``now_ms`` once an answer carried Kinesis' time (a ``Date`` header); None while
        none did. What a bounded read compares its bound with at the tip: records alone
        only show when the last of them arrived, which on an idle shard stays behind any
        bound for good, so an endpoint that never sends its time (a stand-in, the
        simulator's) keeps the local clock, as before."""
        with self._lock:
            if self._high is None:
                return None
        return self.now_ms()

    def plan_ms(self, local_ms: int) -> int:
        """A time to plan a bound on (a batch's end, a gap's end, a ``LATEST`` start): the
        local clock, but never later than the latest time Kinesis' answers allow it to be
        now. A bound planned so is at most the ``Date`` header's precision ahead of
        Kinesis' time, which a settle margin covers; the read's own check of Kinesis' time
        at the tip (``Page.within``) covers the rest."""
        with self._lock:
            high = self._high
        if high is None:
            return local_ms
        return min(local_ms, int(high + self._monotonic() * 1000))

    def planned_now(self) -> float:
        """Now, in epoch seconds, to start a ``LATEST`` lease at: the local clock planned
        on Kinesis' time (``plan_ms``), so a host clock running ahead cannot start the lease
        past records that arrive meanwhile."""
        return self.plan_ms(round(self._wall() * 1000)) / 1000

    def skew_ms(self) -> int | None:
        """How far the local clock is ahead of Kinesis' (negative: behind), best estimate:
        the middle of what the observations allow. None: nothing observed yet."""
        with self._lock:
            low, high = self._low, self._high
        if low is None:
            return None
        mono = self._monotonic() * 1000
        kinesis = low if high is None or high < low else (low + high) / 2
        return round(self._wall() * 1000 - (kinesis + mono))

    def ahead_ms(self, local_ms: int | None = None) -> int:
        """How far the local clock (``local_ms``, else ``wall``) is surely ahead of Kinesis'
        (0 when not surely): beyond the highest time Kinesis' answers allow."""
        with self._lock:
            high = self._high if self._high is not None else self._low
        if high is None:
            return 0
        local = self._wall() * 1000 if local_ms is None else local_ms
        return max(0, round(local - (high + self._monotonic() * 1000)))

    def _check_skew(self) -> None:
        if self._warned:
            return
        ahead = self.ahead_ms()
        if ahead > SKEW_MARGIN_MS:
            self._warned = True
            log.warning(
                "the local clock is %d ms or more ahead of Kinesis' (as its answers show "
                "it): bounded reads and planned ends use Kinesis' time, but fix the clock "
                "(NTP); timestamps computed locally (AT_TIMESTAMP starts) are off by as much",
                ahead)


_ATTRIBUTE = "_kclpy_kinesis_clock"
_clocks_lock = threading.Lock()


def kinesis_clock(client: KinesisClient,
                  make: Callable[[], KinesisClock] = KinesisClock) -> KinesisClock:
    """The clock of ``client``'s endpoint, taught by every Kinesis answer from now on
    (installed once per client, made by ``make``: idempotent). Kept on the client, as the
    other per-client installs are; a stand-in client without botocore's events gets a
    clock that only pages teach."""
    with _clocks_lock:
        clock: KinesisClock | None = getattr(client, _ATTRIBUTE, None)
        if clock is None:
            clock = make()
            setattr(client, _ATTRIBUTE, clock)
            events = getattr(getattr(client, "meta", None), "events", None)
            if events is not None:
                events.register(_EVENT, _observer(clock), unique_id=_HANDLER_ID)
        return clock


def _observer(clock: KinesisClock) -> Callable[..., None]:
    def after_call(http_response: Any = None, parsed: Any = None, **_: Any) -> None:
        date = _date(http_response, parsed)
        if date:
            clock.observe_date(date)

    return after_call


def _date(http_response: Any, parsed: Any) -> str | None:
    """The ``Date`` header of an answer: from the HTTP response, or from the parsed dict's
    ``ResponseMetadata`` (what botocore's Stubber hands back)."""
    headers = getattr(http_response, "headers", None)
    if isinstance(headers, Mapping):
        date = headers.get("Date") or headers.get("date")
        if date:
            return str(date)
    if isinstance(parsed, Mapping):
        meta = parsed.get("ResponseMetadata")
        if isinstance(meta, Mapping):
            found = meta.get("HTTPHeaders", {}).get("date")
            return None if found is None else str(found)
    return None
