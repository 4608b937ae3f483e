"""The worker's operations endpoint: ``/metrics``, ``/healthz`` and ``/status`` over HTTP.

A plain ``ThreadingHTTPServer`` in a daemon thread: a scrape must never wait behind another
one, and a hung client must never keep the process alive. It binds 127.0.0.1 unless told
otherwise, because the metrics name streams, shards and workers; exposing them is a choice.

Besides the worker's own ``status()``, ``/status`` carries the lag status of each held shard
(Burrow's rules, see ``kclpy.ops.lag``), sampled by a background thread every
``lag_interval_s`` over a ``lag_window_s`` window, and measured from each checkpoint the
same way ``kclpy status`` measures it, so both always agree on what "behind" means.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import exposition

from kclpy.ops.lag import Lag, LagAlerts, LagProbe, LagTracker, Observation, report_to_json
from kclpy.ops.webhook import Webhook

if TYPE_CHECKING:
    from kclpy.worker import Worker

log = logging.getLogger(__name__)

_WAITING = "WAITING_ON_PARENTS"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Several workers (or a quick restart) on one host must not fight over TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], worker: Worker,
                 tracker: LagTracker | None, clock: Callable[[], float]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.worker = worker
        self.tracker = tracker
        self.clock = clock


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                healthy = self.server.worker.healthy
                self._send(200 if healthy else 503, "text/plain; charset=utf-8",
                           b"ok\n" if healthy else b"unhealthy: leases are not being renewed\n")
            elif path == "/status":
                body = json.dumps(self._status(), indent=2, sort_keys=True, default=str)
                self._send(200, "application/json", body.encode() + b"\n")
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
        except Exception:
            log.exception("ops endpoint: %s failed", path)
            self._send(500, "text/plain; charset=utf-8", b"internal error\n")

    def _metrics(self) -> None:
        encoder, content_type = exposition.choose_encoder(self.headers.get("Accept", ""))
        self._send(200, content_type, encoder(self.server.worker.metrics.registry))

    def _status(self) -> dict[str, Any]:
        status = dict(self.server.worker.status())
        status["healthy"] = self.server.worker.healthy
        tracker = self.server.tracker
        if tracker is not None:
            status["lag"] = report_to_json(tracker.evaluate(self.server.clock()),
                                           tracker.window_s)
        return status

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # http.server writes every request to stderr; scrapes every few seconds are noise.
        log.debug("ops endpoint %s: " + format, self.address_string(), *args)


class _LagSampler:
    """Observes every shard the worker holds every ``interval_s``; see the module docstring."""

    def __init__(self, worker: Worker, tracker: LagTracker, interval_s: float,
                 records_limit: int, clock: Callable[[], float],
                 alerts: LagAlerts | None = None) -> None:
        self._worker = worker
        self._alerts = alerts
        self._tracker = tracker
        self._interval_s = interval_s
        self._records_limit = records_limit
        self._clock = clock
        self._stop = threading.Event()
        self._probes: dict[str, LagProbe] = {}
        self._thread = threading.Thread(target=self._run, name="kclpy-ops-lag", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                self.sample_once()
            except Exception:
                log.exception("lag sampling failed; trying again in %gs", self._interval_s)
            if self._stop.wait(self._interval_s):
                return

    def sample_once(self) -> None:
        worker = self._worker
        if worker.kinesis is None:
            return  # not set up yet
        status = worker.status()
        registry = worker.metrics.registry
        shards: dict[str, Any] = status["shards"]
        for shard_id, shard in shards.items():
            checkpoint, sub = shard["checkpoint"], shard["checkpoint_sub_sequence_number"]
            now = self._clock()
            try:
                lag = self._measure(shard_id, checkpoint, sub)
            except Exception as exc:
                log.warning("shard %s: lag not measured this time: %s", shard_id, exc)
                continue
            writes = registry.get_sample_value("kclpy_checkpoints_total",
                                               {"shard_id": shard_id}) or 0.0
            self._tracker.record(shard_id, Observation(
                time=now, checkpoint=checkpoint, sub_sequence_number=sub, lag=lag,
                owner=status["worker_id"], checkpoint_writes=writes,
                waiting_on_parents=shard["state"] == _WAITING,
                recovering=bool(shard.get("recovery"))))
        self._tracker.retain(shards)
        if self._alerts is not None:
            self._alerts.publish(self._tracker.evaluate(self._clock()))

    def _measure(self, lease_key: str, checkpoint: str, sub: int) -> Lag:
        """Through the probe of the lease's stream (one per stream, made on first use)."""
        location = self._worker.shard_location(lease_key)
        if location is None:
            raise LookupError("its stream is no longer consumed")
        stream, shard_id = location
        probe = self._probes.get(stream.label)
        if probe is None:
            probe = self._probes[stream.label] = LagProbe(
                self._worker.kinesis, stream_name=None if stream.arn else stream.label,
                stream_arn=stream.arn, records_limit=self._records_limit)
        return probe.measure(shard_id, checkpoint, sub)


class RunningServer:
    """A started ops endpoint. ``stop()`` closes the socket and ends its threads."""

    def __init__(self, httpd: _Server, sampler: _LagSampler | None,
                 webhook: Webhook | None = None) -> None:
        self._httpd = httpd
        self._sampler = sampler
        self._webhook = webhook
        self._thread = threading.Thread(target=httpd.serve_forever, name="kclpy-ops-http",
                                        daemon=True)
        self.host = str(httpd.server_address[0])
        self.port = int(httpd.server_address[1])
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        self._thread.start()
        if self._sampler is not None:
            self._sampler.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        if self._sampler is not None:
            self._sampler.stop()
        if self._webhook is not None:
            self._webhook.stop()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_worker(
    worker: Worker,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lag_window_s: float | None = 300.0,
    lag_interval_s: float = 30.0,
    lag_records_limit: int = 1000,
    lag_webhook: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RunningServer:
    """Serve ``worker``'s /metrics, /healthz and /status on ``host:port`` (0: any free port).

    ``lag_window_s=None`` turns lag sampling off, and with it the Kinesis calls it costs
    (per held shard and ``lag_interval_s``: one GetShardIterator and one GetRecords).
    Each sample also sets the lag status gauges, and ``lag_webhook`` (an http(s) URL) is
    POSTed every status change (``kclpy.ops.webhook``).
    """
    tracker = LagTracker(lag_window_s) if lag_window_s is not None else None
    httpd = _Server((host, port), worker, tracker, clock)
    sampler = None
    webhook = None
    if tracker is not None:
        if lag_webhook is not None:
            events = worker.metrics.lag_webhook_events
            webhook = Webhook(lag_webhook, on_result=lambda o: events.labels(o).inc())
        alerts = LagAlerts(worker.metrics, worker.config.application_name,
                           webhook.send if webhook is not None else None)
        sampler = _LagSampler(worker, tracker, lag_interval_s, lag_records_limit, clock,
                              alerts)
    server = RunningServer(httpd, sampler, webhook)
    log.info("ops endpoint on %s (/metrics, /healthz, /status)", server.url)
    return server
