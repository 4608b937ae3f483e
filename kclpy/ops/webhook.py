"""Lag status changes POSTed to a webhook (``--lag-webhook URL``), Burrow's notifier idea.

Delivery never blocks the caller: events go into a bounded queue that one background thread
drains, POSTing each as JSON and retrying a failed POST with capped, jittered exponential
backoff. When the queue is full (the receiver has been down for long) the oldest event is
dropped and counted, since the newest status is the one an on-call engineer needs.

The URL may carry credentials (``https://user:secret@host/...`` or a token in the query
string). They are used, never shown: user information becomes a basic ``Authorization``
header, and every log line names the URL without user information and without its query.
They go to the URL's own origin only: a redirect is never followed (a POST that a 301 or
302 turns into a GET would lose the event anyway), so neither the header nor the query can
reach another host or go from https to plain http. A 3xx answer is a failed POST.

The receiver is not trusted to speak HTTP: a garbage status line, a cut answer or a reset
is a failed POST like any other (retried, counted), and whatever else goes wrong with one
event is logged and counted, never the end of the delivery thread.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import queue
import random
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from kclpy.retry import EQUAL, GaveUp, RetryPolicy, RetryStopped, retrying

log = logging.getLogger(__name__)

#: events waiting for delivery before the oldest is dropped
QUEUE_SIZE = 1000


def redacted(url: str) -> str:
    """``url`` as it may be logged: no user information, no query, no fragment."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Every 3xx stays an error (``HTTPError``) instead of being followed."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        return None


class _Deadline:
    """Cuts the sockets of one POST once its whole time is up. A socket timeout bounds each
    read only: a receiver dribbling its answer a byte at a time would hold the delivery
    thread, and every alert queued behind it, for as long as it liked."""

    def __init__(self, seconds: float) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._expired = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self._expired
        if expired:
            self._cut()

    def _cut(self) -> None:
        with self._lock:
            self._expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib's, redirects refused, with every connection it opens watched (proxies
        from the environment still apply)."""
        deadline = self

        class Connection(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        class SecureConnection(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        class Handler(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Connection, req)

        class SecureHandler(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(SecureConnection, req,
                                    context=self._context)  # type: ignore[attr-defined]

        return urllib.request.build_opener(_NoRedirects, Handler, SecureHandler)


#: what a POST to a broken, hostile or vanished receiver raises: each is a failed attempt
_RECEIVER_ERRORS = (OSError, http.client.HTTPException, ValueError)


def _request(url: str, document: Mapping[str, Any], timeout_s: float) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"lag webhook {redacted(url)}: not an http(s) URL")
    headers = {"Content-Type": "application/json", "User-Agent": "kclpy-lag-webhook"}
    netloc = parts.netloc
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
        netloc = netloc.rsplit("@", 1)[1]
    target = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    body = json.dumps(document).encode()
    request = urllib.request.Request(  # noqa: S310 (http or https, checked above)
        target, data=body, headers=headers, method="POST")
    # The answer's status is all that counts; its body is not read, so a receiver cannot
    # make the worker hold an endless or cut one; the whole POST ends within timeout_s.
    with _Deadline(timeout_s) as deadline, deadline.opener().open(request, timeout=timeout_s):
        pass


class Webhook:
    """POSTs events to ``url`` from its own thread; ``send`` returns at once."""

    def __init__(self, url: str, *, max_attempts: int = 8, backoff_s: float = 0.5,
                 max_backoff_s: float = 60.0, timeout_s: float = 10.0,
                 rng: random.Random | None = None,
                 on_result: Callable[[str], None] | None = None) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"lag webhook {redacted(url)}: not an http(s) URL")
        self.url = url
        self._retries = RetryPolicy(backoff_s, max_backoff_s, max_attempts=max_attempts,
                                    jitter=EQUAL)
        self._timeout_s = timeout_s
        self._rng = rng or random.Random()
        #: told "sent", "retried", "failed" or "dropped" for each outcome (metrics)
        self._on_result = on_result or (lambda _: None)
        self._queue: queue.Queue[Mapping[str, Any]] = queue.Queue(QUEUE_SIZE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kclpy-lag-webhook",
                                        daemon=True)
        self._thread.start()

    def send(self, document: Mapping[str, Any]) -> None:
        """Queue ``document`` for delivery; never blocks."""
        while True:
            try:
                self._queue.put_nowait(document)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    continue
                self._on_result("dropped")
                log.warning("lag webhook %s: queue full, the oldest event was dropped",
                            redacted(self.url))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after at most ``timeout_s``: the event being retried is given up."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                document = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._deliver(document)
            except Exception as exc:
                # Not a receiver error (those are retried): a bug must cost this event
                # only, never every later alert.
                self._on_result("failed")
                log.error("lag webhook %s: an event could not be delivered (%s); "
                          "delivering the next ones", redacted(self.url), type(exc).__name__)

    def _deliver(self, document: Mapping[str, Any]) -> None:
        def retry_later(exc: BaseException, attempts: int, delay: float) -> None:
            # The exception's text may repeat the URL; only its kind is logged.
            reason = getattr(exc, "code", None) or type(exc).__name__
            self._on_result("retried")
            log.warning("lag webhook %s: POST failed (%s); retrying in %.1fs",
                        redacted(self.url), reason, delay)

        try:
            retrying(lambda: _request(self.url, document, self._timeout_s), self._retries,
                     retry_on=lambda exc: isinstance(exc, _RECEIVER_ERRORS),
                     wait=self._stop.wait, rng=self._rng, on_retry=retry_later)
        except RetryStopped:
            return
        except GaveUp as gave_up:
            self._on_result("failed")
            log.error("lag webhook %s: gave up on an event after %d attempts",
                      redacted(self.url), gave_up.attempts)
            return
        self._on_result("sent")
