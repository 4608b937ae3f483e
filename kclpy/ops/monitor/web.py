"""The monitor's HTTP endpoint, on the worker's ops server plumbing (``kclpy.ops.server``):
the same bounds on slow and numerous clients, the same ``Host`` check against DNS
rebinding (the page is made for browsers), one request per connection.

Paths:

- ``/`` the page (``kclpy.ops.monitor.page``);
- ``/metrics`` Prometheus;
- ``/healthz`` 200 while rounds of samples keep ending, else 503;
- ``/v1/applications``, ``/v1/applications/{app}/status`` (the application and its shards
  that are not OK, as Burrow's ``/status`` lists only the partitions in trouble) and
  ``/v1/applications/{app}/shards`` (every shard). Every answer is a JSON object with
  ``error`` and ``message``, as Burrow's are; an application not watched is a 404.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any, cast

from prometheus_client import Counter, exposition

from kclpy.ops.monitor.page import render
from kclpy.ops.monitor.service import METRICS, Monitor
from kclpy.ops.monitor.watch import AppView, ShardView
from kclpy.ops.server import RunningServer, _Server
from kclpy.prometheus import PREFIX
from kclpy.telemetry import Metric

_JSON = "application/json"


def shard_to_json(shard: ShardView) -> dict[str, Any]:
    """A shard as ``evaluation_to_json`` shows it in a worker's ``/status``, plus what only
    the monitor knows (stream, lineage, checkpoint age, marks, the lag's history)."""
    return {
        "shard_id": shard.shard_id, "lease_key": shard.lease_key, "stream": shard.stream,
        "status": shard.status, "reason": shard.reason, "complete": round(shard.complete, 3),
        "owner": shard.owner, "checkpoint": shard.checkpoint,
        "lease_counter": shard.lease_counter, "records_behind": shard.records_behind,
        "records_behind_exact": shard.records_exact, "millis_behind": shard.millis_behind,
        "parents": list(shard.parents), "children": list(shard.children),
        "checkpoint_age_s": None if shard.checkpoint_age_s is None
        else round(shard.checkpoint_age_s, 1),
        "parked": dict(shard.parked) if shard.parked is not None else None,
        "recovering": shard.recovering, "waiting_on_parents": shard.waiting_on_parents,
        "finished": shard.finished, "behind_retention": shard.behind_retention,
        "history": [{"seconds_ago": round(ago, 1), "millis_behind": millis,
                     "records_behind": records} for ago, millis, records in shard.history],
    }


def app_to_json(view: AppView, *, every_shard: bool) -> dict[str, Any]:
    shards = [s for s in view.shards
              if every_shard or s.status not in ("OK", "-") or s.behind_retention]
    worst = max(view.shards, key=lambda s: s.millis_behind or 0, default=None)
    return {
        "application": view.name, "table": view.table, "status": view.status,
        "reasons": list(view.reasons), "window_seconds": view.window_s,
        "complete": round(view.complete, 3), "streams": list(view.streams),
        "owners": list(view.owners), "live_workers": list(view.live_workers),
        "parked": [s.lease_key for s in view.parked()],
        "unleased_shards": list(view.unleased_shards),
        "total_records_behind": sum(s.records_behind or 0 for s in view.shards),
        "max_lag": None if worst is None or not worst.millis_behind else shard_to_json(worst),
        "evaluated_ms": view.evaluated_ms, "error": view.error,
        "shards": [shard_to_json(s) for s in shards],
    }


class _Refusals:
    """What the ops server counts its refusals with (``metrics.inc(OPS_REFUSED, reason)``
    on a worker), counted in the monitor's registry."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter

    def inc(self, metric: Metric, *labels: str) -> None:
        self._counter.labels(*labels).inc()


class _Face:
    """The two things the ops server asks of its worker: whether it is healthy, and where
    to count refused connections."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor
        self.metrics = _Refusals(Counter(
            PREFIX + "ops_requests_refused", METRICS["ops_requests_refused"], ["reason"],
            registry=monitor.registry))

    @property
    def healthy(self) -> bool:
        return self._monitor.healthy


class MonitorServer(_Server):
    """The ops server with the monitor's paths."""

    def __init__(self, address: tuple[str, int], monitor: Monitor, *,
                 allowed_hosts: Iterable[str] = (),
                 wall_clock: Any = time.time) -> None:
        super().__init__(address, cast(Any, _Face(monitor)), None, time.monotonic,
                         allowed_hosts=allowed_hosts)
        self.monitor = monitor
        self._wall_clock = wall_clock

    def _serves(self, path: str) -> bool:
        return path in ("/", "/metrics") or path.startswith("/v1/")

    def _render(self, path: str, accept: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            encoder, content_type = exposition.choose_encoder(accept)
            return 200, content_type, encoder(self.monitor.registry)
        if path == "/":
            page = render(self.monitor.views(), self.monitor.interval_s,
                          round(self._wall_clock() * 1000))
            return 200, "text/html; charset=utf-8", page.encode()
        code, document = self.api(path)
        return code, _JSON, json.dumps(document, indent=2).encode() + b"\n"

    def api(self, path: str) -> tuple[int, dict[str, Any]]:
        """The answer to a ``/v1/...`` path: its status code and document."""
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts == ["v1", "applications"]:
            return 200, {"error": False, "message": "application list returned",
                         "applications": self.monitor.applications()}
        if len(parts) == 4 and parts[:2] == ["v1", "applications"] and parts[3] in (
                "status", "shards"):
            view = self.monitor.view(parts[2])
            if view is None:
                known = parts[2] in self.monitor.applications()
                return (503 if known else 404), {
                    "error": True, "message": "application not evaluated yet" if known
                    else "application not found"}
            every = parts[3] == "shards"
            return 200, {"error": False,
                         "message": f"application {'shards' if every else 'status'} returned",
                         "status": app_to_json(view, every_shard=every)}
        return 404, {"error": True, "message": "no such path"}


def serve_monitor(monitor: Monitor, host: str = "127.0.0.1", port: int = 0, *,
                  allowed_hosts: Iterable[str] = ()) -> RunningServer:
    """Serve ``monitor`` on ``host:port`` (0: a free port); ``stop()`` ends it. Raises
    OSError when the address cannot be bound."""
    httpd = MonitorServer((host, port), monitor, allowed_hosts=allowed_hosts)
    return RunningServer(httpd, None)
