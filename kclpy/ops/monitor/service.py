"""The monitor's loop: every application sampled each interval, the results published.

One thread samples the applications one after the other, every ``interval_s``; the last
:class:`~kclpy.ops.monitor.watch.AppView` of each is what the HTTP API, the page and
``/metrics`` show (they read a snapshot, never AWS). A status change is POSTed to the lag
webhook with the document a worker sends (``kclpy.ops.lag.LagAlerts``), plus ``stream``:
one change, one POST, through ``kclpy.ops.webhook`` (queued, retried, credentials never
logged).

An application whose sample fails (access denied, its table deleted, AWS unreachable) keeps
its last evaluation, with the error beside it, and is tried again next interval; the
others go on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kclpy.leases import serializer as ser
from kclpy.ops.lag import AppStatus, ShardStatus
from kclpy.ops.monitor.watch import ApplicationWatch, AppView, StreamUnknown, app_label
from kclpy.ops.webhook import Webhook
from kclpy.prometheus import PREFIX
from kclpy.retry import error_code, is_not_found

log = logging.getLogger("kclpy.monitor")

#: the label values of the two status enums, as the worker's gauges have them
_APP_LABELS = tuple(app_label(status) for status in AppStatus)
_SHARD_LABELS = tuple(status.value for status in ShardStatus)
#: how often ``--all-applications`` lists the account's tables again
DISCOVERY_INTERVAL_S = 300.0

#: every series the monitor exports, by name (the docs' alert rules and Grafana panel may
#: use these and no others)
METRICS: dict[str, str] = {
    "shard_lag_status": "1 for each shard's lag status (Burrow's rules), 0 for the others; "
                        "every lease of the table, held or not.",
    "application_lag_status": "1 for the application's lag status, 0 for the others (ERR "
                              "also when no worker is alive or a shard fell behind the "
                              "retention).",
    "monitor_shard_lag_records": "Kinesis records behind the shard's checkpoint (a lower "
                                 "bound past the probe's limit).",
    "monitor_shard_lag_seconds": "Age of the oldest record after the shard's checkpoint.",
    "monitor_shards_parked": "Parked leases of the stream (no worker takes them).",
    "monitor_shards_behind_retention": "Unfinished leases whose records the stream's "
                                       "retention removed or is about to remove.",
    "monitor_live_workers": "Workers that renewed a lease within the failover time.",
    "monitor_open_leases": "Unfinished, unparked leases: shards some worker should be "
                           "reading.",
    "monitor_evaluation_timestamp_seconds": "When the application was last evaluated "
                                            "(epoch seconds).",
    "monitor_sample_failures": "Samples of the application that failed (AWS errors).",
    "lag_webhook_events": "Status changes sent to --lag-webhook, by outcome (sent, "
                          "retried, failed, dropped).",
    "ops_requests_refused": "Connections to the monitor closed without their answer, by "
                            "reason (as the worker's endpoint counts them).",
}


def exported_names() -> set[str]:
    """Every sample name the monitor's ``/metrics`` can show."""
    names = {PREFIX + name for name in METRICS}
    return names | {name + suffix for name in names for suffix in ("_total", "_created")}


def is_lease_table(description: Mapping[str, Any]) -> bool:
    """A DescribeTable ``Table`` of a KCL 2.x lease table: hash key ``leaseKey`` (S)
    alone. The KCL 3.x worker metrics and coordinator tables have other keys."""
    keys = description.get("KeySchema", [])
    types = {a["AttributeName"]: a["AttributeType"]
             for a in description.get("AttributeDefinitions", [])}
    return ([(k["AttributeName"], k["KeyType"]) for k in keys] == [(ser.LEASE_KEY, "HASH")]
            and types.get(ser.LEASE_KEY) == "S")


class TableDiscovery:
    """The account's lease tables, for ``--all-applications``: ListTables, and
    DescribeTable once per table name seen (a table's key schema cannot change)."""

    def __init__(self, dynamodb: Any) -> None:
        self._dynamodb = dynamodb
        self._verdicts: dict[str, bool] = {}

    def lease_tables(self) -> list[str]:
        names: list[str] = []
        request: dict[str, Any] = {}
        while True:
            page = self._dynamodb.list_tables(**request)
            names += page.get("TableNames", [])
            if not page.get("LastEvaluatedTableName"):
                break
            request["ExclusiveStartTableName"] = page["LastEvaluatedTableName"]
        for name in names:
            if name not in self._verdicts:
                try:
                    table = self._dynamodb.describe_table(TableName=name)["Table"]
                except ClientError as exc:
                    if not is_not_found(exc):
                        raise
                    continue
                self._verdicts[name] = is_lease_table(table)
        return sorted(name for name in names if self._verdicts.get(name))


class _Notifier:
    """Status changes as the worker's ``LagAlerts`` tells them: a shard's or the
    application's status that changed, never a first status that is OK."""

    def __init__(self, send: Callable[[dict[str, Any]], None],
                 wall_clock: Callable[[], float]) -> None:
        self._send = send
        self._wall_clock = wall_clock
        self._shards: dict[tuple[str, str], str] = {}
        self._apps: dict[str, str] = {}

    def publish(self, view: AppView) -> None:
        for shard in view.shards:
            if shard.status == "-":
                continue
            key = (view.name, shard.lease_key)
            previous = self._shards.get(key)
            self._shards[key] = shard.status
            if previous != shard.status and (previous is not None or shard.status != "OK"):
                self._changed(view, shard.lease_key, shard.status, previous, shard.reason,
                              shard.stream, shard.millis_behind, shard.records_behind)
        keys = {(view.name, shard.lease_key) for shard in view.shards}
        for key in [k for k in self._shards if k[0] == view.name and k not in keys]:
            del self._shards[key]
        previous = self._apps.get(view.name)
        self._apps[view.name] = view.status
        if previous != view.status and (previous is not None or view.status != "OK"):
            self._changed(view, None, view.status, previous,
                          "; ".join(view.reasons) or "every shard OK", None, None, None)

    def _changed(self, view: AppView, lease_key: str | None, status: str,
                 previous: str | None, reason: str, stream: str | None,
                 millis: int | None, records: int | None) -> None:
        log.info("lag status of %s %s: %s -> %s", view.name, lease_key or "(application)",
                 previous or "none", status)
        document: dict[str, Any] = {
            "application": view.name, "shard_id": lease_key, "status": status,
            "previous_status": previous, "reason": reason,
            "time_ms": round(self._wall_clock() * 1000), "stream": stream,
        }
        if millis is not None:
            document["millis_behind"] = millis
            document["records_behind"] = records
        self._send(document)


class _Collector(Collector):
    """The monitor's series, made from the views at each scrape."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[Any]:
        views = self._monitor.views()
        failures = self._monitor.failures()

        def gauge(name: str, labels: Sequence[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, METRICS[name], labels=list(labels))

        shard_status = gauge("shard_lag_status", ("application", "stream", "shard_id",
                                                  "status"))
        app_status = gauge("application_lag_status", ("application", "status"))
        records = gauge("monitor_shard_lag_records", ("application", "stream", "shard_id"))
        seconds = gauge("monitor_shard_lag_seconds", ("application", "stream", "shard_id"))
        parked = gauge("monitor_shards_parked", ("application", "stream"))
        behind = gauge("monitor_shards_behind_retention", ("application", "stream"))
        live = gauge("monitor_live_workers", ("application",))
        open_leases = gauge("monitor_open_leases", ("application",))
        evaluated = gauge("monitor_evaluation_timestamp_seconds", ("application",))
        failed = CounterMetricFamily(PREFIX + "monitor_sample_failures",
                                     METRICS["monitor_sample_failures"],
                                     labels=["application"])
        for view in views:
            app = view.name
            for label in _APP_LABELS:
                app_status.add_metric([app, label], 1.0 if view.status == label else 0.0)
            live.add_metric([app], len(view.live_workers))
            open_leases.add_metric([app], sum(1 for s in view.shards
                                              if not s.finished and s.parked is None))
            evaluated.add_metric([app], view.evaluated_ms / 1000)
            failed.add_metric([app], failures.get(app, 0))
            for stream in view.streams:
                parked.add_metric([app, stream], len(view.parked(stream)))
                behind.add_metric([app, stream], sum(
                    1 for s in view.shards if s.stream == stream and s.behind_retention))
            for shard in view.shards:
                where = [app, shard.stream, shard.shard_id]
                for label in _SHARD_LABELS:
                    shard_status.add_metric([*where, label],
                                            1.0 if shard.status == label else 0.0)
                if shard.records_behind is not None:
                    records.add_metric(where, shard.records_behind)
                if shard.millis_behind is not None:
                    seconds.add_metric(where, shard.millis_behind / 1000)
        yield from (shard_status, app_status, records, seconds, parked, behind, live,
                    open_leases, evaluated, failed)


class Monitor:
    """Samples ``watches`` (or, with ``discover``, every lease table it finds) every
    ``interval_s`` on its own thread; ``views`` is the last evaluation of each."""

    def __init__(self, watches: Sequence[ApplicationWatch], *, interval_s: float,
                 make_watch: Callable[[str], ApplicationWatch] | None = None,
                 discovery: TableDiscovery | None = None,
                 notify: Callable[[dict[str, Any]], None] | None = None,
                 lag_webhook: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self._watches = {watch.name: watch for watch in watches}
        self._make_watch = make_watch
        self._discovery = discovery
        self._discovered_at: float | None = None
        self._clock = clock
        self._views: dict[str, AppView] = {}
        self._failures: dict[str, int] = {}
        self._lock = threading.Lock()
        self._round_done: float | None = None
        self._rounds = 0
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.webhook_events = Counter(PREFIX + "lag_webhook_events",
                                      METRICS["lag_webhook_events"], ["outcome"],
                                      registry=self.registry)
        self.webhook: Webhook | None = None
        if lag_webhook is not None:
            events = self.webhook_events
            self.webhook = Webhook(lag_webhook, on_result=lambda o: events.labels(o).inc())
            notify = self.webhook.send
        self._notifier = _Notifier(notify, wall_clock) if notify is not None else None

    # -- reading the state -------------------------------------------------------------

    def views(self) -> list[AppView]:
        with self._lock:
            return [self._views[name] for name in sorted(self._views)]

    def view(self, name: str) -> AppView | None:
        with self._lock:
            return self._views.get(name)

    def applications(self) -> list[str]:
        with self._lock:
            return sorted(set(self._watches) | set(self._views))

    def failures(self) -> dict[str, int]:
        with self._lock:
            return dict(self._failures)

    @property
    def healthy(self) -> bool:
        """A round of samples ended within three intervals (or none was due yet)."""
        with self._lock:
            done = self._round_done
        return done is None or self._clock() - done < 3 * self.interval_s

    def wait_rounds(self, rounds: int, timeout_s: float) -> bool:
        """Wait until ``rounds`` rounds have ended since the monitor started."""
        with self._changed:
            return self._changed.wait_for(lambda: self._rounds >= rounds, timeout_s)

    @property
    def rounds(self) -> int:
        with self._lock:
            return self._rounds

    # -- sampling ----------------------------------------------------------------------

    def run_once(self) -> None:
        """One round: every application sampled once, in name order."""
        self._discover()
        for name in sorted(self._watches):
            try:
                view = self._watches[name].sample()
            except (ClientError, BotoCoreError, StreamUnknown) as exc:
                self._failed(name, exc)
                continue
            with self._lock:
                self._views[name] = view
            if self._notifier is not None:
                self._notifier.publish(view)
        with self._changed:
            self._round_done = self._clock()
            self._rounds += 1
            self._changed.notify_all()

    def _discover(self) -> None:
        if self._discovery is None or self._make_watch is None:
            return
        now = self._clock()
        if self._discovered_at is not None and now - self._discovered_at < \
                DISCOVERY_INTERVAL_S:
            return
        try:
            names = self._discovery.lease_tables()
        except (ClientError, BotoCoreError) as exc:
            log.warning("listing the lease tables failed: %s", type(exc).__name__)
            return
        self._discovered_at = now
        for name in names:
            if name not in self._watches:
                log.info("watching %s", name)
                self._watches[name] = self._make_watch(name)
        with self._lock:
            for gone in set(self._watches) - set(names):
                log.info("lease table %s is gone: no longer watched", gone)
                del self._watches[gone]
                self._views.pop(gone, None)

    def _failed(self, name: str, exc: Exception) -> None:
        # the message, not the traceback: an AWS error repeats every interval
        message = str(exc) if isinstance(exc, StreamUnknown) else (
            f"{type(exc).__name__}: {error_code(exc) if isinstance(exc, ClientError) else exc}")
        log.warning("sampling %s failed: %s", name, message)
        with self._lock:
            self._failures[name] = self._failures.get(name, 0) + 1
            view = self._views.get(name)
            if view is not None:
                self._views[name] = dataclasses.replace(view, error=message)
            else:
                self._views[name] = AppView(
                    name=name, table=self._watches[name].table_name, status="-",
                    reasons=(), window_s=self._watches[name].window_s, complete=0.0,
                    streams=(), shards=(), owners=(), live_workers=(), unleased_shards=(),
                    evaluated_ms=0, error=message)

    def _run(self) -> None:
        next_round = self._clock()
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("a monitor round failed; the next one runs in %gs",
                              self.interval_s)
            next_round += self.interval_s
            now = self._clock()
            if next_round < now:
                log.warning("a round took longer than --interval-s (%gs): the next starts "
                            "now", self.interval_s)
                next_round = now
            self._stop.wait(next_round - now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kclpy-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        if self.webhook is not None:
            self.webhook.stop()
