"""A scripted SubscribeToShard endpoint on loopback, HTTP/1.1 or HTTP/2 (h2c, spoken with
the ``h2`` library), that serves real event-stream frames: each subscription plays the next
step of a script - events, a mid-stream disconnect, an error answer, an exception event, a
shard end - and records the request it got.

kinesis-mock serves subscriptions too, but it cannot drop a connection halfway through a
frame, refuse with ``ResourceInUseException`` on cue, or end a shard with ``ChildShards``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import h2.config
import h2.connection
import h2.events

from kclpy.retrieval.subscription import encode_frame


@dataclass
class Event:
    records: Sequence[tuple[str, bytes]]  # (sequence number, data)
    continuation: str | None
    millis_behind: int = 0
    child_shards: Sequence[dict[str, Any]] = ()


@dataclass
class Step:
    """One connection's answer: ``events`` in order, then ``then``: ``end`` (close the
    stream cleanly, as when a subscription's five minutes are over), ``drop`` (cut the
    connection in the middle of a frame), ``error`` (an HTTP 400 error answer instead of
    events), ``exception`` (an exception event after the events) or ``corrupt`` (a frame
    whose checksum does not match after the events)."""

    events: Sequence[Event] = ()
    then: str = "end"
    error_code: str = "ResourceInUseException"


@dataclass
class Script:
    steps: list[Step]
    requests: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_step(self, request: dict[str, Any]) -> Step:
        with self._lock:
            self.requests.append(request)
            return self.steps.pop(0) if self.steps else Step(then="error")


def event_frame(event: Event) -> bytes:
    payload = json.dumps({
        "Records": [{"Data": base64.b64encode(data).decode(), "PartitionKey": "pk",
                     "SequenceNumber": seq, "ApproximateArrivalTimestamp": 1700000000.0}
                    for seq, data in event.records],
        "ContinuationSequenceNumber": event.continuation,
        "MillisBehindLatest": event.millis_behind,
        **({"ChildShards": list(event.child_shards)} if event.child_shards else {}),
    }).encode()
    return encode_frame({":message-type": "event", ":event-type": "SubscribeToShardEvent",
                         ":content-type": "application/json"}, payload)


def corrupt_frame() -> bytes:
    """An event frame with its last checksum byte flipped, as a damaged stream delivers."""
    frame = bytearray(event_frame(Event([("998", b"damaged")], "998")))
    frame[-1] ^= 0xFF
    return bytes(frame)


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            step = script.next_step(json.loads(body or b"{}"))
            if step.then == "error":
                answer = json.dumps({"__type": step.error_code, "message": "scripted"}).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.amazon.eventstream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in step.events:
                self._chunk(event_frame(event))
            if step.then == "drop":
                half = event_frame(Event([("999", b"never")], "999"))
                self._chunk(half[: len(half) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if step.then == "exception":
                self._chunk(encode_frame({":message-type": "exception",
                                          ":exception-type": step.error_code,
                                          ":content-type": "application/json"},
                                         b'{"message":"scripted"}'))
            if step.then == "corrupt":
                self._chunk(corrupt_frame())
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def _h2_connection(sock: socket.socket, script: Script,
                   tls: ssl.SSLContext | None = None) -> None:
    """One HTTP/2 connection: every request stream gets the script's next step."""
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError):
            sock.close()  # the client refused the certificate
            return
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    bodies: dict[int, bytes] = {}
    with sock:
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    bodies[event.stream_id] = b""
                elif isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    step = script.next_step(json.loads(bodies.pop(event.stream_id) or b"{}"))
                    if not _h2_answer(conn, sock, event.stream_id, step):
                        return
            sock.sendall(conn.data_to_send())


def _h2_answer(conn: h2.connection.H2Connection, sock: socket.socket, stream_id: int,
               step: Step) -> bool:
    """Play ``step`` on one stream; False when it cut the connection."""
    if step.then == "error":
        answer = json.dumps({"__type": step.error_code, "message": "scripted"}).encode()
        conn.send_headers(stream_id, [(":status", "400"),
                                      ("content-type", "application/x-amz-json-1.1")])
        conn.send_data(stream_id, answer, end_stream=True)
        return True
    conn.send_headers(stream_id, [(":status", "200"),
                                  ("content-type", "application/vnd.amazon.eventstream")])
    for event in step.events:
        conn.send_data(stream_id, event_frame(event))
    if step.then == "drop":
        half = event_frame(Event([("999", b"never")], "999"))
        conn.send_data(stream_id, half[: len(half) // 2])
        sock.sendall(conn.data_to_send())
        # Half-close, then wait for the client to hang up: a full close with the client's
        # frames still unread would reset the connection and throw away what was sent.
        sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
        return False
    if step.then == "exception":
        conn.send_data(stream_id, encode_frame({":message-type": "exception",
                                                ":exception-type": step.error_code,
                                                ":content-type": "application/json"},
                                               b'{"message":"scripted"}'))
    if step.then == "corrupt":
        conn.send_data(stream_id, corrupt_frame())
    conn.end_stream(stream_id)
    return True


@contextmanager
def _h2_server(script: Script, tls: ssl.SSLContext | None) -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_h2_connection, args=(sock, script, tls),
                             daemon=True).start()

    threading.Thread(target=accept, name="eventstream-h2", daemon=True).start()
    try:
        scheme = "https" if tls is not None else "http"
        yield f"{scheme}://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


@contextmanager
def eventstream_server(script: Script, *, http2: bool = False,
                       tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """Serve ``script`` on 127.0.0.1 (a free port); yield the endpoint URL. With ``tls`` (a
    server context offering h2 by ALPN) HTTP/2 goes over TLS instead of h2c."""
    if http2 or tls is not None:
        with _h2_server(script, tls) as url:
            yield url
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="eventstream-server",
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
