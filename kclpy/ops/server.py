"""The worker's operations endpoint: ``/metrics``, ``/healthz`` and ``/status`` over HTTP.

One accepting thread, bounded so that no client can tie the worker up (the numbers are in
docs/operations.md, "The worker's HTTP endpoint"):

- it reads every request head itself, non-blocking, so a connection that sends its request
  slowly costs a socket and a bounded buffer, never a thread. A request head must be
  complete within ``timeout_s`` of the accept, however it is dribbled (the bound is on the
  whole request, not on each read); at most ``max_pending`` connections may be sending
  theirs, and past that the oldest is dropped for the newest (a probe sends its request in
  one packet, a dribbler does not);
- ``/healthz`` and every refusal (400, 405, 408, 421, 431, 503) are answered by that
  thread in one non-blocking send, so the liveness probe is answered whatever the other
  clients do;
- ``/metrics`` and ``/status`` are answered by a thread each, ``max_connections`` at once
  (one more is answered ``503``); sending the answer must end within ``timeout_s`` too,
  and each connection carries one request (``Connection: close``);
- ``Host`` must name this endpoint (:class:`HostCheck`, against DNS rebinding), else ``421``;
- ``/metrics`` and ``/status`` are rendered by one thread at a time, and scrapes that
  waited while a render they arrived before ran get that render's answer (never one older
  than their request). Rendering 500 shards' metrics is pure
  Python holding the GIL; N scrapes rendering at once made every other thread - the lease
  renewer among them - wait behind N of them for the GIL. One render at a time bounds the
  wait of the renewer to what one CPU-bound thread costs, whatever the number of scrapes
  (``bench/ops_scrape.py`` measures it; the bound, 0.5 s, is in docs/operations.md);
- ``/status`` shows a failing shard's exception message bounded and with its control
  characters escaped; the whole text is in the worker's log;
- a client that hangs up early is logged at DEBUG, not as an error.

It binds 127.0.0.1 unless told otherwise, because the metrics name streams, shards and
workers; exposing them is a choice.

Besides the worker's own ``status()``, ``/status`` carries the lag status of each held shard
(Burrow's rules, see ``kclpy.ops.lag``), sampled by a background thread every
``lag_interval_s`` over a ``lag_window_s`` window, and measured from each checkpoint the
same way ``kclpy status`` measures it, so both always agree on what "behind" means.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import exposition

from kclpy.errors import ConfigError
from kclpy.metrics import LAG_WEBHOOK_EVENTS, OPS_REFUSED
from kclpy.ops.lag import Lag, LagAlerts, LagProbe, LagTracker, Observation, report_to_json
from kclpy.ops.text import safe_text
from kclpy.ops.webhook import Webhook

if TYPE_CHECKING:
    from kclpy.worker import Worker

log = logging.getLogger(__name__)

_WAITING = "WAITING_ON_PARENTS"
#: answers of /metrics and /status rendered and sent at once (a thread each); Prometheus
#: scrapes one target over one connection at a time
MAX_CONNECTIONS = 16
#: how long a connection may take to send its whole request head, and again to take its
#: whole answer
TIMEOUT_S = 10.0
#: connections still sending their request head; past this the oldest is dropped
MAX_PENDING = 256
#: the longest request head (request line and headers) read; a longer one is answered 431
MAX_HEAD_BYTES = 16 * 1024
#: characters of a failing shard's exception message that /status shows
STATUS_MESSAGE_CHARS = 200
_MAX_HEADERS = 100
_BACKLOG = 64
_READ_BYTES = 4096
_WARN_EVERY_S = 60.0


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


@dataclass
class _Pending:
    """A connection still sending its request head: who, until when, what came so far."""

    peer: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    #: lower-cased names; a repeated header keeps its last value (Host may not repeat)
    headers: dict[str, str]


def _parse(head: bytes) -> _Request | None:
    """The request line and headers of ``head``; None when it is not plain HTTP/1.x."""
    lines = [line.removesuffix("\r") for line in head.decode("latin-1").split("\n")]
    parts = lines[0].split(" ")
    if (len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/")
            or parts[2] not in ("HTTP/1.0", "HTTP/1.1")):
        return None
    headers: dict[str, str] = {}
    for count, line in enumerate(lines[1:]):
        if not line:
            break
        name, colon, value = line.partition(":")
        # a folded line, a header without a name, or a space before the colon: a request
        # smuggling shape that no scraper or probe sends
        if (count >= _MAX_HEADERS or not colon or not name or name != name.strip()
                or line[0] in " \t" or (name.lower() == "host" and "host" in headers)):
            return None
        headers[name.lower()] = value.strip()
    return _Request(parts[0], parts[1], headers)


class HostCheck:
    """Which ``Host`` headers the endpoint answers, against DNS rebinding: a web page whose
    name an attacker re-points at this address reaches the endpoint from a browser with that
    name in ``Host``. An IP address cannot be re-pointed, so the bind address (for a wildcard
    bind: any IP address) is answered, ``localhost`` too, and other names only when listed
    (``ops_allowed_hosts``; ``*`` answers any)."""

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()) -> None:
        self._names = {_host_name(name) for name in allowed if name.strip()} | {"localhost"}
        bound = _host_name(bind_host)
        self._any = "*" in self._names
        self._any_address = bound in ("", "0.0.0.0", "::")  # noqa: S104 (a comparison)
        self._names.add(bound)
        if bound in ("localhost", "127.0.0.1", "::1"):
            self._names |= {"127.0.0.1", "::1"}

    def allows(self, host: str | None) -> bool:
        if self._any:
            return True
        if not host:
            return False
        try:
            parts = urllib.parse.urlsplit("//" + host)
            name, _ = parts.hostname, parts.port  # a port that is not a number raises
        except ValueError:
            return False
        if name is None:
            return False
        name = _host_name(name)
        if name in self._names:
            return True
        if not self._any_address:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _host_name(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def _answer(code: int, body: bytes, extra: str = "") -> bytes:
    """A whole small answer, sent by the accepting thread without blocking."""
    reason = HTTPStatus(code).phrase
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n"
            f"{extra}\r\n").encode("latin-1") + body


_BUSY = _answer(503, b"busy\n", "Retry-After: 1\r\n")


class _Server:
    """One accepting thread reads every request head itself, non-blocking: a connection
    costs a socket and at most ``MAX_HEAD_BYTES`` until its head is complete, and no thread.
    ``/healthz`` and the refusals are answered there too, in one non-blocking send (a few
    hundred bytes fit any socket buffer). Only ``/metrics`` and ``/status`` get a thread,
    ``max_connections`` at most. So however many clients dribble, the probe is answered."""

    def __init__(self, address: tuple[str, int], worker: Worker,
                 tracker: LagTracker | None, clock: Callable[[], float], *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S,
                 max_pending: int = MAX_PENDING,
                 allowed_hosts: Iterable[str] = ()) -> None:
        if max_connections < 1 or timeout_s <= 0 or max_pending < 1:
            raise ValueError("need max_connections >= 1, max_pending >= 1 and timeout_s > 0")
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            # Several workers (or a quick restart) on one host must not fight over TIME_WAIT.
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(_BACKLOG)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self.worker = worker
        self.tracker = tracker
        self.clock = clock
        self.timeout_s = timeout_s
        self.rendered = _Rendered()
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.hosts = HostCheck(address[0], allowed_hosts)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._refused = 0
        self._warned_at: float | None = None

    # -- the accepting thread ------------------------------------------------------------

    def serve_forever(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                oldest = next(iter(self._pending.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - now)
                for key, _ in self._selector.select(timeout):
                    conn = cast(socket.socket, key.fileobj)
                    if conn is self.socket:
                        self._accept()
                    elif conn is not self._wake_r and conn in self._pending:
                        self._read(conn)
        finally:
            for conn in list(self._pending):
                self._forget(conn)
            self._selector.close()

    def _expire(self, now: float) -> None:
        """Every deadline is ``timeout_s`` after its accept, so the oldest ends first."""
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return
            log.debug("ops endpoint: %s sent no whole request in %gs; closed", pending.peer,
                      self.timeout_s)
            self._refuse(conn, "timeout", _answer(408, b"request timeout\n"))

    def _accept(self) -> None:
        for _ in range(_BACKLOG):
            try:
                conn, peer = self.socket.accept()
            except BlockingIOError:
                return
            except OSError:
                # out of file descriptors: the oldest half-sent request makes room
                log.debug("ops endpoint: accept failed", exc_info=True)
                if not self._pending:
                    return
                self._refuse(next(iter(self._pending)), "evicted", b"")
                continue
            conn.setblocking(False)
            if len(self._pending) >= self.max_pending:
                self._refuse(next(iter(self._pending)), "evicted", _BUSY)
            self._pending[conn] = _Pending(peer, time.monotonic() + self.timeout_s)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            data = conn.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._forget(conn)
            return
        searched = max(0, len(pending.head) - 3)
        pending.head += data
        end = _head_end(pending.head, searched)
        if end < 0:
            if len(pending.head) > MAX_HEAD_BYTES:
                self._refuse(conn, "too_large",
                             _answer(431, b"request header fields too large\n"))
            return
        self._forget(conn, close=False)
        self._dispatch(conn, pending.peer, bytes(pending.head[:end]))

    def _dispatch(self, conn: socket.socket, peer: Any, head: bytes) -> None:
        request = _parse(head)
        if request is None:
            self._refuse(conn, "bad_request", _answer(400, b"bad request\n"))
        elif not self.hosts.allows(request.headers.get("host")):
            self._refuse(conn, "misdirected", _answer(
                421, b"this host name is not served here (ops_allowed_hosts)\n"))
        elif request.method != "GET":
            self._refuse(conn, "bad_request",
                         _answer(405, b"method not allowed\n", "Allow: GET\r\n"))
        else:
            path = request.path.split("?", 1)[0]
            if path == "/healthz":
                healthy = self.worker.healthy
                self._send_now(conn, _answer(
                    200 if healthy else 503,
                    b"ok\n" if healthy else b"unhealthy: leases are not being renewed\n"))
            elif not self._serves(path):
                self._send_now(conn, _answer(404, b"not found\n"))
            elif not self._slots.acquire(blocking=False):
                self._busy(peer)
                self._refuse(conn, "busy", _BUSY)
            else:
                try:
                    threading.Thread(target=self._answer_thread, name="kclpy-ops-answer",
                                     args=(conn, path, request.headers.get("accept", "")),
                                     daemon=True).start()
                except BaseException:
                    self._slots.release()
                    conn.close()
                    raise

    def _busy(self, peer: Any) -> None:
        self._refused += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
            # once a minute at most: a flood must not turn into a flood of log lines
            log.warning("ops endpoint: %d answers already being rendered; refused %d "
                        "request(s), the last from %s", self.max_connections, self._refused,
                        peer[0])
            self._warned_at, self._refused = now, 0

    def _refuse(self, conn: socket.socket, reason: str, answer: bytes) -> None:
        self.worker.metrics.inc(OPS_REFUSED, reason)
        self._forget(conn, close=False)
        self._send_now(conn, answer)

    @staticmethod
    def _send_now(conn: socket.socket, answer: bytes) -> None:
        try:
            if answer:
                conn.send(answer)
        except OSError:
            log.debug("ops endpoint: answering a refused connection failed", exc_info=True)
        finally:
            conn.close()

    def _forget(self, conn: socket.socket, *, close: bool = True) -> None:
        if self._pending.pop(conn, None) is not None:
            self._selector.unregister(conn)
        if close:
            conn.close()

    # -- an answering thread -------------------------------------------------------------

    def _answer_thread(self, conn: socket.socket, path: str, accept: str) -> None:
        """Renders and sends one answer; the whole send is bounded by ``timeout_s`` (a
        socket timeout bounds all of ``sendall``, not each write)."""
        try:
            conn.settimeout(self.timeout_s)
            try:
                status, content_type, body = self._render(path, accept)
            except Exception:
                log.exception("ops endpoint: %s failed", path)
                status, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
            conn.sendall(
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: "
                f"{content_type}\r\nContent-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                "Connection: close\r\n\r\n".encode("latin-1") + body)
        except OSError:
            log.debug("ops endpoint: the client of %s went away", path, exc_info=True)
        finally:
            conn.close()
            self._slots.release()

    def _serves(self, path: str) -> bool:
        """Whether ``path`` gets an answering thread (else 404 from the accepting thread):
        a server of other pages on the same plumbing (``kclpy monitor``) says its own."""
        return path in ("/metrics", "/status")

    def _render(self, path: str, accept: str) -> tuple[int, str, bytes]:
        """The answer to a GET of a served ``path``: status, content type, body."""
        if path == "/metrics":
            return (200, *self._metrics(accept))
        return (200, *self.rendered.get(("/status", ""), self._status_json))

    def _metrics(self, accept: str) -> tuple[str, bytes]:
        encoder, content_type = exposition.choose_encoder(accept)
        registry = _Yielding(self.worker.metrics.registry)
        return self.rendered.get(("/metrics", content_type),
                                 lambda: (content_type, encoder(registry)))

    def _status_json(self) -> tuple[str, bytes]:
        body = json.dumps(self._status(), indent=2, sort_keys=True, default=str)
        return "application/json", body.encode() + b"\n"

    def _status(self) -> dict[str, Any]:
        status = dict(self.worker.status())
        status["shards"] = {key: _without_raw_errors(shard)
                            for key, shard in status.get("shards", {}).items()}
        status["healthy"] = self.worker.healthy
        tracker = self.tracker
        if tracker is not None:
            status["lag"] = report_to_json(tracker.evaluate(self.clock()), tracker.window_s)
        return status

    # -- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ends ``serve_forever`` (its thread is then joined by the caller)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def server_close(self) -> None:
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()


def _head_end(head: bytearray, start: int) -> int:
    """Where the blank line ending the head is, or -1; bare LF line ends are accepted."""
    crlf = head.find(b"\r\n\r\n", start)
    lf = head.find(b"\n\n", start)
    ends = [i for i in (crlf, lf) if i >= 0]
    return min(ends) if ends else -1


def _without_raw_errors(shard: Any) -> Any:
    """A shard's status with its failure's message bounded and its control characters
    escaped: the text of a processor's exception is the processor's (it may quote a record),
    and ``/status`` is unauthenticated and read in terminals."""
    failure = shard.get("failure") if isinstance(shard, dict) else None
    if not isinstance(failure, dict) or "message" not in failure:
        return shard
    return {**shard, "failure": {**failure, "message": safe_text(str(failure["message"]),
                                                                 STATUS_MESSAGE_CHARS)}}


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
        self._thread.join()
        self._httpd.server_close()
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
    max_pending: int = MAX_PENDING,
    allowed_hosts: Iterable[str] = (),
) -> RunningServer:
    """Serve ``worker``'s /metrics, /healthz and /status on ``host:port`` (0: any free port).

    ``lag_window_s=None`` turns lag sampling off, and with it the Kinesis calls it costs
    (per held shard and ``lag_interval_s``: one GetShardIterator and one GetRecords).
    ``max_connections``, ``timeout_s`` and ``max_pending`` bound what clients can cost,
    and ``allowed_hosts`` names the host names answered besides the bind address (see the
    module docstring).
    Each sample also sets the lag status gauges, and ``lag_webhook`` (an http(s) URL) is
    POSTed every status change (``kclpy.ops.webhook``).
    """
    tracker = LagTracker(lag_window_s) if lag_window_s is not None else None
    try:
        httpd = _Server((host, port), worker, tracker, clock, max_connections=max_connections,
                        timeout_s=timeout_s, max_pending=max_pending,
                        allowed_hosts=allowed_hosts)
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
