"""A fault-injecting HTTP proxy between AWS clients and a local emulator.

No emulator throttles, fails or drops connections, yet those are exactly the paths where a
KCL loses or duplicates records. Placed between boto3 and kinesis-mock or moto's server, this
proxy answers chosen operations the way AWS does when it throttles or fails, with the status,
body and headers botocore uses to classify the error, so the code under test takes the same
retry and backoff paths it would take against AWS. Everything else is forwarded unchanged.

Operations are named by the suffix of ``X-Amz-Target`` (``Kinesis_20131202.GetRecords`` ->
``GetRecords``); a rule for ``"*"`` applies to operations without a rule of their own.

Streamed answers (SubscribeToShard's event stream, which has no length and lasts up to five
minutes) are relayed as they arrive, never buffered whole, and can be cut part way: after a
number of event-stream frames, in the middle of the next one, or after a time, as when a
subscription's connection breaks; or ended early and cleanly at a frame boundary, as the
service ends every subscription after five minutes; or ended at such a point with an
exception event (``InternalFailureException``, ``KMSThrottlingException``, ...), as the service
ends a subscription that failed part way.

Answers can also be held back (:meth:`FaultProxy.hold_answers`): the request is forwarded and
applied upstream at once, and only its answer is late, as when AWS retries a throttled write
inside the service or an answer crosses a latency spike. A writer whose deadline depends on
when it learns of its write (a lease renewal, a checkpoint) sees the write land long before
it can tell.

A proxy made with ``record_calls=True`` also keeps every request's service, operation and
parameters (:meth:`FaultProxy.calls`): what a client behind it asked AWS for, whichever
process it runs in, which is how tests/system/test_iam.py holds the documented IAM policies to what
each role really calls.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import random
import re
import select
import socket
import struct
import threading
import time
import uuid
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

from botocore.parsers import RpcV2CBORParser

from kclpy.retrieval.subscription import encode_frame

log = logging.getLogger(__name__)

FaultKind = Literal["throttle", "error_5xx", "drop", "lose_response", "cut_body", "in_use",
                    "cut_stream", "end_stream"]
"""``drop`` closes the connection before forwarding, so the request never reaches upstream;
``lose_response`` forwards it, lets upstream apply it, then closes the connection instead of
answering (the ambiguous outcome conditional writes must survive); ``cut_body`` (one-shot
only) forwards it and announces the whole answer, then sends half its body and closes;
``in_use`` answers ``ResourceInUseException`` (a subscription to the shard is still open);
``cut_stream`` forwards it and relays a streamed answer up to a cut point drawn from the
rule's ``stream_cut_frames`` and ``stream_cut_s``, then sends half of the next frame and
closes the connection; ``end_stream`` ends the streamed answer cleanly at that point
instead, withholding the frame that was next."""

Responder = Callable[[dict[str, Any]], tuple[int, dict[str, Any]] | None]
"""Gets the request's JSON body; returns ``(status, body)`` to answer, or None to forward."""

ALL = "*"

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

# AWS throttles Kinesis data-plane calls with ProvisionedThroughputExceededException and its
# control-plane calls (ListShards, DescribeStream, ...) with LimitExceededException.
_KINESIS_DATA_PLANE = frozenset({"GetRecords", "GetShardIterator", "PutRecord", "PutRecords"})
_DYNAMODB_PREFIX = "com.amazonaws.dynamodb.v20120810#"
_EVENT_STREAM = "application/vnd.amazon.eventstream"
_CBOR = "application/cbor"
_RPC_V2_PATH = re.compile(r"^/service/(?P<target>[^/]+)/operation/(?P<operation>[^/?]+)")
_CLOUDWATCH_TARGET = "GraniteServiceVersion20100801"
#: an event-stream frame's prelude: total length, headers length, prelude CRC
_PRELUDE = 12
#: larger than any frame Kinesis sends (a 10 MB page); a bigger length means a foreign body
_MAX_FRAME = 16 * 1024 * 1024
#: whole frames relayed before a cut, when a rule does not say
DEFAULT_CUT_FRAMES = (0, 8)


@dataclass(frozen=True)
class StreamCut:
    """Where a streamed answer is cut: once ``after_frames`` whole event-stream frames were
    relayed and the next one is in, or ``after_s`` seconds after it began, whichever comes
    first (None: never on that count); ``clean`` ends the answer properly instead of
    breaking the connection."""

    after_frames: int | None = None
    after_s: float | None = None
    clean: bool = False
    #: end with an exception event of this type (then cleanly), as the service reports a
    #: failure inside a subscription
    exception: str | None = None

    def __post_init__(self) -> None:
        if self.after_frames is None and self.after_s is None:
            raise ValueError("a stream cut needs after_frames, after_s or both")
        if (self.after_frames or 0) < 0 or (self.after_s or 0.0) < 0:
            raise ValueError(f"a stream cut point must not be negative: {self}")


@dataclass(frozen=True)
class _Rule:
    throttle_rate: float
    error_5xx_rate: float
    drop_rate: float
    lose_response_rate: float
    latency_s: float
    respond: Responder | None
    in_use_rate: float = 0.0
    cut_stream_rate: float = 0.0
    end_stream_rate: float = 0.0
    stream_cut_frames: tuple[int, int] | None = DEFAULT_CUT_FRAMES
    stream_cut_s: tuple[float, float] | None = None
    stream_exception_rate: float = 0.0
    stream_exceptions: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Hold:
    """Which share of an operation's forwarded requests get their answer held, and how long."""

    rate: float
    hold_s: tuple[float, float]


@dataclass(frozen=True)
class _Request:
    operation: str
    service: str
    content_type: str
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.body or b"{}")
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    def parameters(self) -> dict[str, Any]:
        """The request's parameters, from its JSON or (CloudWatch's protocol) CBOR body."""
        if self.content_type != _CBOR or not self.body:
            return self.json()
        parsed = RpcV2CBORParser().parse_data_item(io.BytesIO(self.body))
        return parsed if isinstance(parsed, dict) else {}


@dataclass(frozen=True)
class Call:
    """One request a recording proxy received: ``service`` as IAM names it (``kinesis``,
    ``dynamodb``, ``cloudwatch``), the operation and its parameters."""

    service: str
    operation: str
    parameters: dict[str, Any]


_OneShot = FaultKind | tuple[int, dict[str, Any]] | StreamCut
"""A fault, a canned ``(status, body)`` answer, or a stream cut, for one request."""
_Action = _OneShot | None
"""What to do with one request; None forwards it."""


class FaultProxy:
    """Reverse proxy on a free loopback port; rules can be changed while a test runs.

    Randomised faults come from one ``random.Random(seed)``, so a single-threaded test sees
    the same faults on every run.
    """

    def __init__(self, upstream_url: str, *, seed: int = 0, record_calls: bool = False) -> None:
        upstream = urlsplit(upstream_url)
        if upstream.scheme != "http" or upstream.hostname is None:
            raise ValueError(f"upstream must be a plain http:// URL, not {upstream_url!r}")
        self.upstream_host = upstream.hostname
        self.upstream_port = upstream.port or 80
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._exception_turn = 0
        self._rules: dict[str, _Rule] = {}
        self._pending: dict[str, deque[_OneShot]] = {}
        self._requests: Counter[str] = Counter()
        self._calls: list[Call] | None = [] if record_calls else None
        self._faults: Counter[tuple[str, str]] = Counter()
        self._holds: dict[str, _Hold] = {}
        self._held: list[tuple[str, float]] = []
        self._holding = 0
        self._stopping = threading.Event()
        self._server = _ProxyServer(self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> FaultProxy:
        """Begin serving; connections made before this wait in the listen backlog."""
        with self._lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError("a FaultProxy can be started once")
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"faultproxy-{self.url}",
                daemon=True,
            )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and cut every open client connection; idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        self._stopping.set()
        if thread is not None:
            self._server.shutdown()
            thread.join()
        self._server.server_close()
        self._server.close_client_connections()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def set_rule(
        self,
        operation: str,
        *,
        throttle_rate: float = 0.0,
        error_5xx_rate: float = 0.0,
        latency_s: float = 0.0,
        drop_rate: float = 0.0,
        lose_response_rate: float = 0.0,
        respond: Responder | None = None,
        in_use_rate: float = 0.0,
        cut_stream_rate: float = 0.0,
        end_stream_rate: float = 0.0,
        stream_cut_frames: tuple[int, int] | None = DEFAULT_CUT_FRAMES,
        stream_cut_s: tuple[float, float] | None = None,
        stream_exception_rate: float = 0.0,
        stream_exceptions: tuple[str, ...] = (),
    ) -> None:
        """Replace the rule for ``operation`` (or ``"*"``).

        Each request draws once: the fault rates are disjoint slices of [0, 1), so
        ``throttle_rate=0.3`` throttles 30% of requests whatever the other rates are, and the
        rates may not add up to more than 1. ``latency_s`` delays every matching request,
        faulted or not. ``respond`` sees the requests no fault was drawn for.

        A request drawn for ``cut_stream`` or ``end_stream`` then draws its cut point from
        the same generator: a number of whole frames from ``stream_cut_frames`` (bounds
        included) and a time from ``stream_cut_s`` (None: not on that count). One drawn for
        ``stream_exception_rate`` is ended there with an exception event whose type is the
        next of ``stream_exceptions`` in turn (counted as ``exception_event`` and
        ``exception_event:<type>``).
        """
        rates = (throttle_rate, error_5xx_rate, drop_rate, lose_response_rate, in_use_rate,
                 cut_stream_rate, end_stream_rate, stream_exception_rate)
        if stream_exception_rate and not stream_exceptions:
            raise ValueError("stream_exception_rate needs the stream_exceptions to draw from")
        if any(not 0.0 <= rate <= 1.0 for rate in rates) or sum(rates) > 1.0:
            raise ValueError(f"fault rates must be within [0, 1] and sum to at most 1: {rates}")
        if latency_s < 0:
            raise ValueError(f"latency_s must not be negative: {latency_s}")
        if stream_cut_frames is None and stream_cut_s is None:
            raise ValueError("stream cuts need stream_cut_frames, stream_cut_s or both")
        for bounds in (stream_cut_frames, stream_cut_s):
            if bounds is not None and not 0 <= bounds[0] <= bounds[1]:
                raise ValueError(f"a cut range must be (low, high) with 0 <= low <= high: "
                                 f"{bounds}")
        rule = _Rule(
            throttle_rate, error_5xx_rate, drop_rate, lose_response_rate, latency_s, respond,
            in_use_rate, cut_stream_rate, end_stream_rate, stream_cut_frames, stream_cut_s,
            stream_exception_rate, tuple(stream_exceptions),
        )
        with self._lock:
            self._rules[operation] = rule

    def hold_answers(self, operation: str, rate: float,
                     hold_s: tuple[float, float] = (0.0, 0.0)) -> None:
        """Hold back the answers of ``rate`` of the requests for ``operation`` (or ``"*"``)
        that are forwarded, each for a time drawn from ``hold_s`` (bounds included) after
        upstream answered; ``rate=0`` stops holding new ones.

        The request reaches upstream at once, so a write lands while its writer still waits:
        the answer it gets is the one upstream gave, only late. Requests a rule faults
        (throttled, dropped, lost answers, ...) or a ``respond`` hook answers are not held;
        the draws come from the proxy's seeded generator, after the rule's own draw, and only
        while a hold applies to the operation, so setting none leaves the other faults'
        sequence as it was. Independent of :meth:`set_rule` and kept by :meth:`clear`.
        """
        low, high = hold_s
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"hold rate must be within [0, 1]: {rate}")
        if not 0.0 <= low <= high:
            raise ValueError(f"hold_s must be (low, high) with 0 <= low <= high: {hold_s}")
        with self._lock:
            if rate == 0.0:
                self._holds.pop(operation, None)
            else:
                self._holds[operation] = _Hold(rate, (low, high))

    def holds(self, operation: str = ALL) -> list[float]:
        """How long each held answer of ``operation`` (default: any) was held, in the order
        they were drawn; ``faults("hold_answer")`` counts them too."""
        with self._lock:
            return [s for op, s in self._held if operation in (ALL, op)]

    def holding(self) -> int:
        """Answers being held back right now."""
        with self._lock:
            return self._holding

    def clear(self) -> None:
        """Forget every rule and pending one-shot fault; the counters keep counting."""
        with self._lock:
            self._rules.clear()
            self._pending.clear()

    def once(self, operation: str, kind: FaultKind) -> None:
        """Inject ``kind`` into the next request for ``operation`` (or ``"*"``), ahead of rules."""
        self._enqueue(operation, kind)

    def inject_once(self, operation: str, response: tuple[int, dict[str, Any]]) -> None:
        """Answer the next request for ``operation`` with ``(status, JSON body)``."""
        self._enqueue(operation, response)

    def cut_stream_once(self, operation: str, cut: StreamCut) -> None:
        """Forward the next request for ``operation`` and cut its streamed answer at ``cut``."""
        self._enqueue(operation, cut)

    def requests(self, operation: str) -> int:
        """Requests received for ``operation`` (``"*"``: all), faulted or forwarded."""
        with self._lock:
            if operation == ALL:
                return sum(self._requests.values())
            return self._requests[operation]

    def calls(self) -> list[Call]:
        """Every request received so far, in order (faulted ones too: a client that was
        refused still asked); only for a proxy made with ``record_calls=True``."""
        with self._lock:
            if self._calls is None:
                raise RuntimeError("this FaultProxy was made without record_calls=True")
            return list(self._calls)

    def faults(self, kind: str, operation: str = ALL) -> int:
        """Faults of ``kind`` injected into ``operation`` (default: any operation).

        Kinds: the :data:`FaultKind` values, ``"latency"`` for delayed requests, ``"inject"``
        for :meth:`inject_once` answers and ``"respond"`` for answers from a ``respond`` hook.
        ``"hold_answer"`` counts the answers :meth:`hold_answers` held back.
        ``cut_stream`` and ``end_stream`` count the cuts made, not the ones drawn: an answer
        with a length, or a stream that upstream ended before the cut point, is relayed whole
        and not counted.
        """
        with self._lock:
            if operation == ALL:
                return sum(n for (k, _), n in self._faults.items() if k == kind)
            return self._faults[(kind, operation)]

    def _enqueue(self, operation: str, action: _OneShot) -> None:
        with self._lock:
            self._pending.setdefault(operation, deque()).append(action)

    def _decide(self, request: _Request) -> tuple[float, _Action, Responder | None]:
        """Count the request and pick what happens to it: (latency, action, responder)."""
        operation = request.operation
        with self._lock:
            self._requests[operation] += 1
            if self._calls is not None:
                self._calls.append(Call(request.service, operation, request.parameters()))
            rule = self._rules.get(operation) or self._rules.get(ALL)
            for key in (operation, ALL):
                pending = self._pending.get(key)
                if pending:
                    action = pending.popleft()
                    if action in ("cut_stream", "end_stream"):
                        action = self._draw_cut(rule, clean=action == "end_stream")
                    self._count(action, operation)
                    return 0.0, action, None
            if rule is None:
                return 0.0, None, None
            if rule.latency_s > 0:
                self._faults[("latency", operation)] += 1
            slices: tuple[tuple[FaultKind, float], ...] = (
                ("drop", rule.drop_rate),
                ("throttle", rule.throttle_rate),
                ("error_5xx", rule.error_5xx_rate),
                ("lose_response", rule.lose_response_rate),
                ("in_use", rule.in_use_rate),
                ("cut_stream", rule.cut_stream_rate),
                ("end_stream", rule.end_stream_rate),
            )
            draw = self._random.random()
            if draw >= 1.0 - rule.stream_exception_rate:
                cut = self._draw_cut(rule, clean=True)
                # In turn rather than drawn: a few events cover every type.
                name = rule.stream_exceptions[self._exception_turn % len(rule.stream_exceptions)]
                self._exception_turn += 1
                return rule.latency_s, StreamCut(cut.after_frames, cut.after_s, True,
                                                 name), None
            for kind, rate in slices:
                if draw < rate:
                    if kind in ("cut_stream", "end_stream"):
                        cut = self._draw_cut(rule, clean=kind == "end_stream")
                        return rule.latency_s, cut, None
                    self._count(kind, operation)
                    return rule.latency_s, kind, None
                draw -= rate
            return rule.latency_s, None, rule.respond

    def _draw_cut(self, rule: _Rule | None, *, clean: bool) -> StreamCut:
        """A cut point from the rule's ranges (the defaults without a rule); the lock is held."""
        frames = DEFAULT_CUT_FRAMES if rule is None else rule.stream_cut_frames
        span = None if rule is None else rule.stream_cut_s
        return StreamCut(
            None if frames is None else self._random.randint(*frames),
            None if span is None else self._random.uniform(*span),
            clean,
        )

    def _count(self, action: _OneShot, operation: str) -> None:
        """Count what was decided; stream cuts count later, when they are made."""
        if isinstance(action, StreamCut):
            return
        kind = action if isinstance(action, str) else "inject"
        self._faults[(kind, operation)] += 1

    def _count_cut(self, cut: StreamCut, operation: str) -> None:
        with self._lock:
            if cut.exception is not None:
                self._faults[("exception_event", operation)] += 1
                self._faults[(f"exception_event:{cut.exception}", operation)] += 1
                return
            self._faults[("end_stream" if cut.clean else "cut_stream", operation)] += 1

    def _count_respond(self, operation: str) -> None:
        with self._lock:
            self._faults[("respond", operation)] += 1

    def _draw_hold(self, operation: str) -> float | None:
        """How long to hold the answer of a request about to be forwarded; None: not held."""
        with self._lock:
            hold = self._holds.get(operation) or self._holds.get(ALL)
            if hold is None or self._random.random() >= hold.rate:
                return None
            held_s = self._random.uniform(*hold.hold_s)
            self._held.append((operation, held_s))
            self._faults[("hold_answer", operation)] += 1
            return held_s

    def _hold(self, held_s: float) -> None:
        """Wait out a held answer; stopping the proxy ends the wait."""
        with self._lock:
            self._holding += 1
        try:
            self._stopping.wait(held_s)
        finally:
            with self._lock:
                self._holding -= 1

    def _server_error_status(self) -> int:
        with self._lock:
            return self._random.choice((500, 503))


def error_body(service: str, operation: str, status: int) -> dict[str, str]:
    """The JSON error body AWS sends with ``status``: 400 means throttled, else 500 or 503.

    botocore takes the error code from ``__type`` (after any ``#``) and treats the code as a
    throttle or not; for 500 and 503 the status alone makes it retry.
    """
    if status == 400:
        if service == "dynamodb":
            code = "ThrottlingException"
        elif operation in _KINESIS_DATA_PLANE:
            code = "ProvisionedThroughputExceededException"
        else:
            # SubscribeToShard included: AWS refuses subscriptions beyond its rate with it
            code = "LimitExceededException"
    elif status == 503:
        code = "ServiceUnavailable"
    else:
        code = "InternalServerError" if service == "dynamodb" else "InternalFailure"
    if service == "dynamodb":
        return {"__type": _DYNAMODB_PREFIX + code, "message": f"{code} (injected)"}
    return {"__type": code, "message": f"{code} (injected)"}


def in_use_body(shard_id: object) -> dict[str, str]:
    """The answer to a SubscribeToShard while the consumer's previous subscription to the
    shard is still open."""
    return {"__type": "ResourceInUseException",
            "message": f"Another active subscription exists on shard {shard_id} (injected)"}


def _frame_size(pending: bytes | bytearray) -> int | None:
    """The total length of the event-stream frame ``pending`` starts with: None until its
    prelude is in, or when the prelude does not look like one."""
    if len(pending) < _PRELUDE:
        return None
    total, headers = struct.unpack_from("!II", pending)
    if not _PRELUDE + 4 <= total <= _MAX_FRAME or headers > total:
        return None
    return int(total)


class _HangUpWatch:
    """Shuts the upstream connection as soon as the client hangs up on a streamed answer.

    The relay would learn of it only at its next write, a second or more later on an idle
    subscription (kinesis-mock sends an event a second, AWS fewer); until then upstream
    would see the subscription still open, and refuse the shard's next owner with
    ResourceInUseException for longer than it would behind no proxy.
    """

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self._client = client
        self._upstream = upstream
        self._done = threading.Event()
        self.hung_up = False
        self._thread = threading.Thread(target=self._run, name="faultproxy-hang-up",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self._client], [], [], 0.1)
                if not readable:
                    continue
                if self._client.recv(1, socket.MSG_PEEK):
                    return  # the client is talking, not hanging up
            except (OSError, ValueError):
                pass  # a reset or closed client connection is a hang-up too
            self.hung_up = True
            if self._upstream is not None:
                with contextlib.suppress(OSError):
                    self._upstream.shutdown(socket.SHUT_RDWR)
            return


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, proxy: FaultProxy) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.proxy = proxy
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients hanging up mid-answer is routine in fault tests: log, don't print."""
        log.debug("FaultProxy: request from %s failed", client_address, exc_info=True)

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def close_client_connections(self) -> None:
        """Wake handler threads parked on idle keep-alive connections so they exit."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, each answer waits for the
    # client's delayed ACK (about 40 ms), which would dominate every request's latency.
    disable_nagle_algorithm = True
    server: _ProxyServer
    _upstream: http.client.HTTPConnection | None = None

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, open_=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, open_=False)
            if self._upstream is not None:
                self._upstream.close()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_POST(self) -> None:
        self._handle()

    do_GET = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_POST

    def _handle(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._answer_json(501, {"message": "FaultProxy needs Content-Length request bodies"})
            self.close_connection = True
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = _parse_request(
            self.headers.get("X-Amz-Target", ""), self.headers.get("Content-Type", ""), body,
            self.path,
        )
        proxy = self.server.proxy
        latency, action, responder = proxy._decide(request)
        if latency:
            time.sleep(latency)
        if action == "drop":
            self.close_connection = True
            return
        if action == "throttle":
            self._answer_error(request, 400, error_body(request.service, request.operation, 400))
            return
        if action == "error_5xx":
            status = proxy._server_error_status()
            self._answer_error(
                request, status, error_body(request.service, request.operation, status)
            )
            return
        if action == "in_use":
            self._answer_error(request, 400, in_use_body(request.json().get("ShardId")))
            return
        if isinstance(action, tuple):
            self._answer_error(request, *action)
            return
        if responder is not None:
            answer = responder(request.json())
            if answer is not None:
                proxy._count_respond(request.operation)
                self._answer_error(request, *answer)
                return
        held_s = None if action is not None else proxy._draw_hold(request.operation)
        self._forward(request, lose_response=action == "lose_response",
                      cut_body=action == "cut_body",
                      cut=action if isinstance(action, StreamCut) else None, held_s=held_s)

    def _forward(self, request: _Request, *, lose_response: bool, cut_body: bool,
                 cut: StreamCut | None, held_s: float | None = None) -> None:
        try:
            response = self._send_upstream(request.body)
        except OSError as exc:
            self._answer_json(502, {"message": f"FaultProxy: upstream unreachable: {exc}"})
            return
        if lose_response:
            response.read()
            self.close_connection = True
            return
        if held_s is not None:
            # upstream has answered, so the request took effect; only its answer is late
            self.server.proxy._hold(held_s)
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if response.getheader("Content-Length") is not None or self.command == "HEAD":
            payload = response.read()
            self.end_headers()
            if cut_body:
                # The full Content-Length was announced; half the body, then the connection
                # goes, as when a connection breaks mid-transfer.
                self.wfile.write(payload[: len(payload) // 2])
                self.close_connection = True
                return
            self.wfile.write(payload)
            return
        # A response without a length (an event stream such as SubscribeToShard) is relayed
        # chunk by chunk as it arrives rather than buffered until upstream ends it.
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        upstream = self._upstream
        watch = _HangUpWatch(self.connection, None if upstream is None else upstream.sock)
        try:
            if cut is None:
                while chunk := response.read1(65536):
                    self._write_chunk(chunk)
                self._write_chunk(b"")
            else:
                self._relay_until(response, cut, request.operation)
        finally:
            watch.stop()
            # After a cut the upstream connection carries a timeout, after a hang-up it is
            # shut: not reused. Closing it is what makes kinesis-mock let a subscription go.
            if cut is not None or watch.hung_up:
                self._drop_upstream()

    def _relay_until(self, response: http.client.HTTPResponse, cut: StreamCut,
                     operation: str) -> None:
        """Relay whole frames until ``cut.after_frames`` went and the next one is in, or
        until ``cut.after_s`` passed, then cut (and count it); relay the rest when upstream
        ends the answer first.

        Frames are counted only in an event stream; any other body is relayed as it comes
        and cut by time alone.
        """
        framed = response.getheader("Content-Type", "").split(";")[0].strip() == _EVENT_STREAM
        deadline = None if cut.after_s is None else time.monotonic() + cut.after_s
        upstream = self._upstream
        pending = bytearray()
        sent = 0
        while True:
            while framed and (size := _frame_size(pending)) is not None and size <= len(pending):
                if cut.after_frames is not None and sent >= cut.after_frames:
                    self._end(bytes(pending[: size // 2]), cut, operation)
                    return
                self._write_chunk(bytes(pending[:size]))
                del pending[:size]
                sent += 1
            if framed and len(pending) >= _PRELUDE and _frame_size(pending) is None:
                framed = False  # not framed as an event stream after all
            if not framed and pending:
                self._write_chunk(bytes(pending))
                pending.clear()
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or upstream is None or upstream.sock is None:
                    self._end(bytes(pending), cut, operation)
                    return
                upstream.sock.settimeout(remaining)
            try:
                chunk = response.read1(65536)
            except TimeoutError:
                self._end(bytes(pending), cut, operation)
                return
            if not chunk:
                if pending:
                    self._write_chunk(bytes(pending))
                self._write_chunk(b"")
                return
            pending += chunk

    def _end(self, partial: bytes, cut: StreamCut, operation: str) -> None:
        """Count the cut, then make it: a client that reads the end of the answer finds the
        cut already counted."""
        self.server.proxy._count_cut(cut, operation)
        self._cut(partial, cut.clean, cut.exception)

    def _cut(self, partial: bytes, clean: bool, exception: str | None = None) -> None:
        """End the answer here: cleanly with the final chunk (``partial``, an unfinished
        frame, is withheld), after an exception event of type ``exception`` if given, or by
        closing the connection after ``partial``, the part of a frame whose end the client
        will never see."""
        if exception is not None:
            self._write_chunk(encode_frame(
                {":message-type": "exception", ":exception-type": exception,
                 ":content-type": "application/json"},
                json.dumps({"message": f"FaultProxy: {exception}"}).encode()))
        if clean:
            self._write_chunk(b"")
            return
        if partial:
            self._write_chunk(partial)
        self.close_connection = True

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _send_upstream(self, body: bytes) -> http.client.HTTPResponse:
        """One upstream keep-alive connection per client connection; if upstream closed an
        idle one meanwhile, the request is sent again once on a fresh connection."""
        reused = self._upstream is not None
        try:
            return self._exchange(body)
        except ConnectionError:
            if not reused:
                raise
            return self._exchange(body)

    def _exchange(self, body: bytes) -> http.client.HTTPResponse:
        if self._upstream is None:
            proxy = self.server.proxy
            self._upstream = http.client.HTTPConnection(
                proxy.upstream_host, proxy.upstream_port, timeout=300
            )
        connection = self._upstream
        try:
            # The Host header is forwarded as the client signed it, not rewritten.
            connection.putrequest(
                self.command, self.path, skip_host=True, skip_accept_encoding=True
            )
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    connection.putheader(name, value)
            connection.endheaders(body)
            return connection.getresponse()
        except OSError:
            connection.close()
            self._upstream = None
            raise

    def _answer_error(self, request: _Request, status: int, body: dict[str, Any]) -> None:
        """Answer as the service would: its JSON content type, request id and error type, and
        for DynamoDB the body checksum that botocore verifies on every DynamoDB response."""
        payload = json.dumps(body).encode()
        headers = {
            "Content-Type": request.content_type or "application/x-amz-json-1.1",
            "x-amzn-RequestId": str(uuid.uuid4()),
            "x-amzn-ErrorType": str(body.get("__type", "")).rsplit("#", 1)[-1],
        }
        if request.service == "dynamodb":
            headers["x-amz-crc32"] = str(zlib.crc32(payload))
        self._answer(status, payload, headers)

    def _answer_json(self, status: int, body: dict[str, Any]) -> None:
        self._answer(status, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _answer(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
        self.send_response_only(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _parse_request(target: str, content_type: str, body: bytes, path: str = "/") -> _Request:
    """The operation is named in ``X-Amz-Target`` (``Kinesis_20131202.GetRecords``), or with
    the RPC v2 CBOR protocol CloudWatch can speak, in the path
    (``/service/GraniteServiceVersion20100801/operation/PutMetricData``)."""
    rpc = _RPC_V2_PATH.match(path)
    if not target and rpc:
        prefix, operation = rpc["target"], rpc["operation"]
    else:
        prefix, _, operation = target.rpartition(".")
    if prefix.startswith("DynamoDB"):
        service = "dynamodb"
    elif prefix == _CLOUDWATCH_TARGET:
        service = "cloudwatch"
    else:
        service = "kinesis"
    return _Request(operation=operation, service=service, content_type=content_type, body=body)
