"""SubscribeToShard (enhanced fan-out): one subscription's events, read as they arrive,
over HTTP/2 (AWS) or HTTP/1.1 (local emulators).

botocore signs and sends the request, but it cannot read this answer everywhere: it insists
that the first event be an ``initial-response``, which AWS sends and kinesis-mock (the
emulator LocalStack uses) does not. So a ``before-send`` handler sends the signed request
itself, over a connection of its own, and hands botocore a stand-in answer holding only an
``initial-response``; the real body is passed through the parsed response under a private
key and read here, frame by frame, with botocore's event-stream decoder. Error answers
(HTTP status other than 200) are given to botocore whole, so they raise the usual
``ClientError`` (``ResourceInUseException``, ``LimitExceededException``, ...).

Each event's payload is parsed by the same parser as a GetRecords page
(``parse.parse_subscribe_event``), so records reach the processor by the same path whatever
the retrieval mode. Nothing is read ahead: the next frame is read only when the caller asks
for the next event, so a caller that stops asking (its queue is full) stops the stream at
the TCP window, which is the flow control of this HTTP/1.1 path.
"""

from __future__ import annotations

import binascii
import os
import ssl
import struct
import threading
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import httpx
import urllib3
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError

from kclpy.records import Record
from kclpy.retrieval.page import Page
from kclpy.retrieval.parse import parse_subscribe_event

#: how a subscription is sent: HTTP/2 to https endpoints and HTTP/1.1 to http ones, or one
#: of the two for every endpoint (``--fanout-http-version``)
FANOUT_HTTP_VERSIONS = ("auto", "2", "1.1")
_EVENT = "before-send.kinesis.SubscribeToShard"
_PARSE_EVENT = "before-parse.kinesis.SubscribeToShard"
_HANDLER_ID = "kclpy.retrieval.subscription"
#: private key under which the real body travels through botocore's parsed response
_STREAM_KEY = "_kclpy_subscription_body"
#: bytes read from the socket at a time; a frame can be up to about 10 MB
_CHUNK = 64 * 1024
#: HTTP/1.1 connection headers HTTP/2 forbids
_CONNECTION_HEADERS = {"connection", "transfer-encoding", "keep-alive", "upgrade",
                       "proxy-connection", "expect"}


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (struct.pack("!B", len(raw_name)) + raw_name + b"\x07"
            + struct.pack("!H", len(raw_value)) + raw_value)


def encode_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message (prelude, headers, payload, CRCs). Public because the
    endpoints that stand in for Kinesis in tests and benchmarks must write exactly what
    this client reads."""
    encoded = b"".join(_header(k, v) for k, v in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    prelude += struct.pack("!I", binascii.crc32(prelude))
    body = prelude + encoded + payload
    return body + struct.pack("!I", binascii.crc32(body))


_INITIAL_RESPONSE = encode_frame({":message-type": "event", ":event-type": "initial-response",
                                  ":content-type": "application/json"}, b"{}")


class _Sender:
    """Sends signed SubscribeToShard requests on connections of its own (a subscription
    holds its stream for up to five minutes): over HTTP/2 with httpx and h2 - what AWS
    documents for SubscribeToShard, and the only protocol the Java SDK uses for it - or over
    HTTP/1.1 with urllib3. ``http_version`` "auto" takes HTTP/2 for https endpoints (ALPN
    falls back to HTTP/1.1 if the endpoint does not offer it) and HTTP/1.1 for plain http
    ones (local emulators); "2" forces HTTP/2 (h2c with prior knowledge on http), "1.1"
    forces HTTP/1.1."""

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float,
                 http_version: str, verify: bool | str = True) -> None:
        if http_version not in FANOUT_HTTP_VERSIONS:
            raise ValueError(f"http_version must be one of {', '.join(FANOUT_HTTP_VERSIONS)}")
        self._tls = _tls_context(verify)
        self._pool = (
            urllib3.PoolManager(maxsize=max_connections, block=False, ssl_context=self._tls)
            if verify is not False else
            urllib3.PoolManager(maxsize=max_connections, block=False, ssl_context=self._tls,
                                cert_reqs="CERT_NONE", assert_hostname=False))
        self._timeout = urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s)
        self._version = http_version
        self._h2_timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._h2: dict[bool, httpx.Client] = {}
        self._lock = threading.Lock()

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        secure = request.url.startswith("https:")
        if self._version == "2" or (self._version == "auto" and secure):
            return self._send_h2(request, tls=secure)
        raw = self._pool.urlopen(
            request.method, request.url, body=request.body, headers=dict(request.headers),
            preload_content=False, retries=False, redirect=False, timeout=self._timeout)
        if raw.status != 200:
            body = raw.read()
            raw.release_conn()
            return AWSResponse(request.url, raw.status, _headers(raw), _Buffered(body))
        return AWSResponse(request.url, 200, _headers(raw), _StandIn(raw))

    def _send_h2(self, request: AWSPreparedRequest, *, tls: bool) -> AWSResponse:
        client = self._h2_client(tls)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in _CONNECTION_HEADERS}
        body = request.body
        sent = client.build_request(request.method, request.url, headers=headers,
                                    content=body if isinstance(body, (bytes, str)) else b"")
        response = client.send(sent, stream=True)
        if response.status_code != 200:
            body = response.read()
            response.close()
            return AWSResponse(request.url, response.status_code, _headers(response),
                               _Buffered(body))
        return AWSResponse(request.url, 200, _headers(response), _StandIn(_H2Body(response)))

    def _h2_client(self, tls: bool) -> httpx.Client:
        """One client per scheme: with TLS, HTTP/2 is negotiated (ALPN); without, it is
        spoken from the first byte (h2c)."""
        with self._lock:
            client = self._h2.get(tls)
            if client is None:
                client = httpx.Client(http1=tls, http2=True, timeout=self._h2_timeout,
                                      verify=self._tls)
                self._h2[tls] = client
            return client


def _tls_context(verify: bool | str) -> ssl.SSLContext:
    """The TLS settings of the botocore client the subscriptions go out from: ``verify``
    False (no checks), True (the default trust store), or a CA bundle file or directory (as
    ``verify=`` or ``AWS_CA_BUNDLE`` gave botocore)."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if isinstance(verify, str):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    return ssl.create_default_context()


def _client_verify(client: Any) -> bool | str:
    """What the client verifies TLS with. botocore resolves ``verify=`` and
    ``AWS_CA_BUNDLE`` into its HTTP session and exposes nothing public for it, so it is
    read from there; a client without that session verifies with the defaults."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    verify = getattr(session, "_verify", True)
    return verify if isinstance(verify, (bool, str)) else True


class _H2Body:
    """An httpx streaming response, read like urllib3's: ``stream`` yields raw bytes as
    they come (httpcore opens the HTTP/2 flow-control window as they are read, so an
    unread stream is held back by the peer), ``close`` ends the stream."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    def stream(self, amt: int, decode_content: bool = False) -> Iterator[bytes]:
        # No chunk size: httpx would hold bytes back until a whole chunk gathered, and an
        # event would wait for the ones after it.
        yield from self._response.iter_raw()

    def close(self) -> None:
        self._response.close()


def _headers(raw: Any) -> Any:
    """urllib3's header dict, as botocore's own HTTP session hands it to ``AWSResponse``."""
    return raw.headers


class _Buffered:
    """A body read whole, as botocore's parsers read one: an error answer."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, *_: Any, **__: Any) -> Iterator[bytes]:
        yield self._body

    def read(self, *_: Any, **__: Any) -> bytes:
        return self._body

    def close(self) -> None:
        """Nothing open: the body was read whole."""


class _StandIn(_Buffered):
    """The body botocore parses instead of a subscription's: an ``initial-response``
    alone. It carries the real body along for the ``before-parse`` handler."""

    def __init__(self, real: Any) -> None:
        super().__init__(_INITIAL_RESPONSE)
        self.real = real


def _before_parse(response_dict: dict[str, Any], customized_response_dict: dict[str, Any],
                  **_: Any) -> None:
    body = response_dict.get("body")
    if isinstance(body, _StandIn):
        customized_response_dict[_STREAM_KEY] = body.real


_installed_lock = threading.Lock()


def install(client: Any, *, http_version: str = "auto", max_connections: int = 10,
            connect_timeout_s: float = 10.0, read_timeout_s: float = 30.0) -> None:
    """Make ``client.subscribe_to_shard`` usable with :func:`subscribe`. Idempotent: the
    first call's settings stay."""
    with _installed_lock:
        if getattr(client, "_kclpy_subscriptions", False):
            return
        client._kclpy_subscriptions = True
        events = client.meta.events
        events.register(
            _EVENT, _Sender(max_connections, connect_timeout_s, read_timeout_s, http_version,
                            _client_verify(client)),
            unique_id=_HANDLER_ID)
        events.register(_PARSE_EVENT, _before_parse, unique_id=_HANDLER_ID + ".parse")


def subscribe(client: Any, consumer_arn: str, shard_id: str,
              starting_position: dict[str, Any], *, http_version: str = "auto"
              ) -> Generator[Page[Sequence[Record]], None, None]:
    """Open a subscription and yield its events, as pages, until the service ends it (about five
    minutes) or the connection drops. Errors sent as event-stream exceptions raise
    ``ClientError`` with their type as the code, as an error answer would."""
    install(client, http_version=http_version)
    response = client.subscribe_to_shard(
        ConsumerARN=consumer_arn, ShardId=shard_id, StartingPosition=starting_position)
    real = response.get(_STREAM_KEY)
    if real is None:
        raise RuntimeError("SubscribeToShard was not sent through kclpy's handler")
    return _events(real)


def _events(raw: Any) -> Generator[Page[Sequence[Record]], None, None]:
    buffer = EventStreamBuffer()
    try:
        for chunk in raw.stream(_CHUNK, decode_content=False):
            buffer.add_data(chunk)
            message: Any
            for message in buffer:
                headers: dict[str, Any] = message.headers
                kind = headers.get(":message-type")
                if kind == "event":
                    if headers.get(":event-type") == "SubscribeToShardEvent":
                        yield parse_subscribe_event(message.payload)
                    continue  # initial-response, or an event type this client does not know
                code = str(headers.get(":exception-type") or headers.get(":error-code")
                           or "InternalFailure")
                detail = message.payload.decode("utf-8", errors="replace")
                error: Any = {"Error": {"Code": code, "Message": detail},
                              "ResponseMetadata": {"HTTPStatusCode": 500 if kind == "error"
                                                   else 400}}
                raise ClientError(error, "SubscribeToShard")
    finally:
        raw.close()  # an unfinished stream cannot go back to the pool
