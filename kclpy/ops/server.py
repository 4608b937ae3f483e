"""The worker's operations endpoint: ``/metrics``, ``/healthz`` and ``/status`` over HTTP.

A ``ThreadingHTTPServer`` in a daemon thread, so a hung client never keeps the process
alive, bounded so that no client can tie the worker up:

- at most ``max_connections`` connections are served at once (a thread each); one more is
  answered ``503`` at once and closed, by the accepting thread, with no thread of its own;
- every connection has a socket timeout (``timeout_s``): a client that connects and sends
  nothing, or reads its answer slowly, is dropped after that long, and it carries one request
  (``Connection: close``), so an idle keep-alive connection holds nothing;
- ``/metrics`` and ``/status`` are rendered by one thread at a time, and scrapes that
  waited while a render they arrived before ran get that render's answer (never one older
  than their request). Rendering 500 shards' metrics is pure
  Python holding the GIL; N scrapes rendering at once made every other thread - the lease
  renewer among them - wait behind N of them for the GIL. One render at a time bounds the
  wait of the renewer to what one CPU-bound thread costs, whatever the number of scrapes
  (``bench/ops_scrape.py`` measures it; the bound, 0.5 s, is in docs/operations.md);
- a client that hangs up early is logged at DEBUG, not as an error.

It binds 127.0.0.1 unless told otherwise, because the metrics name streams, shards and
workers; exposing them is a choice.

Besides the worker's own ``status()``, ``/status`` carries the lag status of each held shard
(Burrow's rules, see ``kclpy.ops.lag``), sampled by a background thread every
``lag_interval_s`` over a ``lag_window_s`` window, and measured from each checkpoint the
same way ``kclpy status`` measures it, so both always agree on what "behind" means.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import exposition

from kclpy.errors import ConfigError
from kclpy.metrics import LAG_WEBHOOK_EVENTS
from kclpy.ops.lag import Lag, LagAlerts, LagProbe, LagTracker, Observation, report_to_json
from kclpy.ops.webhook import Webhook

if TYPE_CHECKING:
    from kclpy.worker import Worker

log = logging.getLogger(__name__)

_WAITING = "WAITING_ON_PARENTS"
#: connections served at once; Prometheus scrapes one target over one connection at a time
MAX_CONNECTIONS = 16
#: how long a connection may stay silent (sending its request, reading the answer)
TIMEOUT_S = 10.0
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
         b"Content-Length: 5\r\nConnection: close\r\nRetry-After: 1\r\n\r\nbusy\n")
_WARN_EVERY_S = 60.0
#: what a client that went away while it was answered raises; not a server error
_HUNG_UP = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class _Rendered:
    """The answers of the expensive paths, rendered by one thread at a time: concurrent
    scrapes wait on a lock (holding no GIL) instead of rendering side by side, and one that
    waited gets the answer of a render that began after it arrived, if there was one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: key -> (when its last render began, content type, body)
        self._answers: dict[tuple[str, str], tuple[float, str, bytes]] = {}

    def get(self, key: tuple[str, str], render: Callable[[], tuple[str, bytes]]
            ) -> tuple[str, bytes]:
        arrived = time.monotonic()
        with self._lock:
            last = self._answers.get(key)
            if last is not None and last[0] >= arrived:
                return last[1], last[2]
            began = time.monotonic()
            content_type, body = render()
            self._answers[key] = (began, content_type, body)
            return content_type, body


class _Yielding:
    """A registry whose families are collected with a GIL hand-over between two: another
    thread waiting for the GIL (the lease renewer) gets it after one family's rendering
    rather than after a switch interval lost to whichever thread the OS woke first."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        for family in self._registry.collect():
            yield family
            time.sleep(0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Several workers (or a quick restart) on one host must not fight over TIME_WAIT.
    allow_reuse_address = True
    # Connections waiting to be accepted; beyond them the kernel refuses.
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], worker: Worker,
                 tracker: LagTracker | None, clock: Callable[[], float], *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S) -> None:
        if max_connections < 1 or timeout_s <= 0:
            raise ValueError("need max_connections >= 1 and timeout_s > 0")
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.worker = worker
        self.tracker = tracker
        self.clock = clock
        self.timeout_s = timeout_s
        self.rendered = _Rendered()
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refused = 0
        self._warned_at: float | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection while a slot is free; else ``503`` and close, on
        this (the accepting) thread, so a flood of connections costs no threads."""
        if not self._slots.acquire(blocking=False):
            self._refused += 1
            now = time.monotonic()
            if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
                # once a minute at most: a flood must not turn into a flood of log lines
                log.warning("ops endpoint: %d connections already open; refused %d "
                            "connection(s), the last from %s", self.max_connections,
                            self._refused, client_address[0])
                self._warned_at, self._refused = now, 0
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                log.debug("ops endpoint: refusing %s failed", client_address, exc_info=True)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up or stalled is its own business: DEBUG, no traceback on
        stderr (socketserver's default)."""
        log.debug("ops endpoint: connection from %s ended early", client_address,
                  exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)

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
                self._send(200, *self.server.rendered.get(("/status", ""), self._status_json))
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
        except _HUNG_UP:
            log.debug("ops endpoint: the client of %s went away", path, exc_info=True)
        except Exception:
            log.exception("ops endpoint: %s failed", path)
            try:
                self._send(500, "text/plain; charset=utf-8", b"internal error\n")
            except _HUNG_UP:
                log.debug("ops endpoint: the client of %s went away", path)

    def _metrics(self) -> None:
        encoder, content_type = exposition.choose_encoder(self.headers.get("Accept", ""))
        registry = _Yielding(self.server.worker.metrics.registry)
        self._send(200, *self.server.rendered.get(
            ("/metrics", content_type), lambda: (content_type, encoder(registry))))

    def _status_json(self) -> tuple[str, bytes]:
        body = json.dumps(self._status(), indent=2, sort_keys=True, default=str)
        return "application/json", body.encode() + b"\n"

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
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

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
        for lease_key, shard in shards.items():
            checkpoint, sub = shard["checkpoint"], shard["checkpoint_sub_sequence_number"]
            now = self._clock()
            try:
                lag = self._measure(lease_key, checkpoint, sub)
            except Exception as exc:
                log.warning("shard %s: lag not measured this time: %s", lease_key, exc)
                continue
            writes = registry.get_sample_value("kclpy_checkpoints_total",
                                               {"shard_id": lease_key}) or 0.0
            self._tracker.record(lease_key, Observation(
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


def _bind_error(host: str, port: int, exc: OSError) -> ConfigError:
    """A port in use or not ours to bind is the port option's fault; an address this host
    does not have is the host option's: either is a configuration error (exit 2), said in
    one line, not a traceback."""
    option = "--metrics-port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else (
        "--metrics-host")
    return ConfigError(option, f"cannot serve on {host}:{port}: {exc.strerror or exc}")


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
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = TIMEOUT_S,
) -> RunningServer:
    """Serve ``worker``'s /metrics, /healthz and /status on ``host:port`` (0: any free port).

    ``lag_window_s=None`` turns lag sampling off, and with it the Kinesis calls it costs
    (per held shard and ``lag_interval_s``: one GetShardIterator and one GetRecords).
    ``max_connections`` and ``timeout_s`` bound what clients can cost (see the module
    docstring).
    Each sample also sets the lag status gauges, and ``lag_webhook`` (an http(s) URL) is
    POSTed every status change (``kclpy.ops.webhook``).
    """
    tracker = LagTracker(lag_window_s) if lag_window_s is not None else None
    try:
        httpd = _Server((host, port), worker, tracker, clock, max_connections=max_connections,
                        timeout_s=timeout_s)
    except OSError as exc:
        raise _bind_error(host, port, exc) from None
    sampler = None
    webhook = None
    if tracker is not None:
        if lag_webhook is not None:
            metrics = worker.metrics
            webhook = Webhook(lag_webhook,
                              on_result=lambda o: metrics.inc(LAG_WEBHOOK_EVENTS, o))
        alerts = LagAlerts(worker.metrics, worker.config.application_name,
                           webhook.send if webhook is not None else None)
        sampler = _LagSampler(worker, tracker, lag_interval_s, lag_records_limit, clock,
                              alerts)
    server = RunningServer(httpd, sampler, webhook)
    log.info("ops endpoint on %s (/metrics, /healthz, /status)", server.url)
    return server
