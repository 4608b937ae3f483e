"""The fault proxy forwards faithfully, and each injected fault reaches botocore as AWS's would."""

from __future__ import annotations

import http.client
import json
import random
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from botocore.config import Config
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError

from kclpy.local import LocalEndpoint, free_port
from kclpy.records import Record
from kclpy.retrieval.fanout import classify_subscribe
from kclpy.retrieval.page import Page
from kclpy.retrieval.registration import ConsumerRegistration, RegistrationSettings
from kclpy.retrieval.subscription import subscribe
from kclpy.retry import CONNECTION
from tests.support.eventstream_server import Event, event_frame
from tests.support.faultproxy import FaultProxy, StreamCut
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for

NO_RETRIES = Config(retries={"total_max_attempts": 1, "mode": "standard"})
ONE_RETRY = Config(retries={"total_max_attempts": 2, "mode": "standard"})


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    client_port: int


@dataclass
class Upstream:
    """A loopback HTTP/1.1 server that records what arrives and answers what a test asks."""

    url: str
    seen: list[Seen] = field(default_factory=list)
    hang_up_after_answer: bool = False
    release_second_chunk: threading.Event = field(default_factory=threading.Event)
    second_chunk_released: bool = False
    #: event-stream frames served on /events (whole) and /events-slow (the first, then the
    #: rest once release_second_chunk is set)
    frames: list[bytes] = field(default_factory=list)
    #: /events-slow: the proxy closed the connection while upstream was still streaming
    hung_up_on: threading.Event = field(default_factory=threading.Event)


def _recording_handler(upstream: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            upstream.seen.append(
                Seen(
                    self.command,
                    self.path,
                    list(self.headers.items()),
                    body,
                    self.client_address[1],
                )
            )
            if self.path == "/stream":
                self._stream()
                return
            if self.path.startswith("/events"):
                self._events(slow=self.path == "/events-slow")
                return
            payload = b'{"echo":' + json.dumps(body.decode("latin-1")).encode() + b"}"
            self.send_response_only(201, "Made")
            self.send_header("Content-Type", "application/x-amz-json-1.1")
            self.send_header("X-Upstream", "recorded")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            self.close_connection = upstream.hang_up_after_answer

        def _stream(self) -> None:
            self.send_response_only(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"5\r\nfirst\r\n")
            self.wfile.flush()
            upstream.second_chunk_released = upstream.release_second_chunk.wait(10)
            self.wfile.write(b"6\r\nsecond\r\n0\r\n\r\n")

        def _events(self, *, slow: bool) -> None:
            """The frames in writes of 50 bytes, so frames and chunks do not line up."""
            self.send_response_only(200)
            self.send_header("Content-Type", "application/vnd.amazon.eventstream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            frames = upstream.frames
            if slow:
                self._chunk(frames[0])
                self.connection.settimeout(10)
                try:
                    if self.connection.recv(1) == b"":
                        upstream.hung_up_on.set()
                        return
                except (TimeoutError, OSError):
                    return
                frames = frames[1:]
            data = b"".join(frames)
            for start in range(0, len(data), 50):
                self._chunk(data[start : start + 50])
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    return Handler


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    state = Upstream(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _recording_handler(state)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def proxy(upstream: Upstream) -> Iterator[FaultProxy]:
    with FaultProxy(upstream.url, seed=3) as running:
        yield running


def _post(
    connection: http.client.HTTPConnection,
    operation: str,
    body: bytes = b"{}",
    path: str = "/",
    service: str = "Kinesis_20131202",
) -> http.client.HTTPResponse:
    connection.request(
        "POST",
        path,
        body=body,
        headers={
            "X-Amz-Target": f"{service}.{operation}",
            "Content-Type": "application/x-amz-json-1.1",
        },
    )
    return connection.getresponse()


def _connect(proxy: FaultProxy) -> http.client.HTTPConnection:
    port = int(proxy.url.rsplit(":", 1)[1])
    return http.client.HTTPConnection("127.0.0.1", port, timeout=10)


def test_forwards_request_and_response_unchanged(proxy: FaultProxy, upstream: Upstream) -> None:
    body = bytes(range(256))
    connection = _connect(proxy)
    connection.putrequest("POST", "/some/path?q=1", skip_host=True, skip_accept_encoding=True)
    sent = [
        ("Host", "signed-host.example:1234"),
        ("X-Amz-Target", "Kinesis_20131202.PutRecord"),
        ("Authorization", "AWS4-HMAC-SHA256 Credential=testing/20240101/us-east-1/kinesis"),
        ("X-Custom", "kept"),
        ("Content-Length", str(len(body))),
    ]
    for name, value in sent:
        connection.putheader(name, value)
    connection.putheader("Connection", "keep-alive")
    connection.endheaders(body)
    response = connection.getresponse()

    assert (response.status, response.reason) == (201, "Made")
    assert response.getheader("X-Upstream") == "recorded"
    assert json.loads(response.read()) == {"echo": body.decode("latin-1")}
    [seen] = upstream.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/some/path?q=1", body)
    assert seen.headers == sent, "headers arrive in order, hop-by-hop ones removed"
    assert proxy.requests("PutRecord") == 1


def test_keeps_one_upstream_connection_per_client_connection(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    first, second = _connect(proxy), _connect(proxy)
    for connection in (first, second, first, second, first):
        assert _post(connection, "ListShards").read()

    ports = [seen.client_port for seen in upstream.seen]
    assert len(ports) == 5
    assert len(set(ports)) == 2
    assert ports[0] == ports[2] == ports[4]


def test_replaces_an_upstream_connection_closed_while_idle(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.hang_up_after_answer = True
    connection = _connect(proxy)
    bodies = [_post(connection, "GetRecords").read() for _ in range(3)]

    assert bodies == [b'{"echo":"{}"}'] * 3
    assert len(upstream.seen) == 3


def test_relays_an_unframed_response_while_upstream_is_still_sending(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    response = _post(_connect(proxy), "SubscribeToShard", path="/stream")
    first = response.read1()
    upstream.release_second_chunk.set()
    rest = response.read()

    assert first + rest == b"firstsecond"
    assert first == b"first", "the first chunk arrived before upstream sent the second"
    assert upstream.second_chunk_released


def test_answers_502_when_upstream_is_unreachable() -> None:
    with FaultProxy(f"http://127.0.0.1:{free_port()}") as proxy:
        response = _post(_connect(proxy), "ListShards")
        assert response.status == 502
        assert "unreachable" in json.loads(response.read())["message"]


def test_random_faults_follow_the_seed(upstream: Upstream) -> None:
    expected_draws = random.Random(11)
    expected = [expected_draws.random() < 0.4 for _ in range(40)]

    def statuses() -> list[int]:
        with FaultProxy(upstream.url, seed=11) as proxy:
            proxy.set_rule("GetRecords", throttle_rate=0.4)
            connection = _connect(proxy)
            result = []
            for _ in range(40):
                response = _post(connection, "GetRecords")
                response.read()
                result.append(response.status)
            assert proxy.faults("throttle") == sum(expected)
            return result

    assert statuses() == [400 if throttled else 201 for throttled in expected]
    assert statuses() == [400 if throttled else 201 for throttled in expected]
    assert 0 < sum(expected) < 40


def test_rule_for_an_operation_overrides_the_wildcard(proxy: FaultProxy) -> None:
    proxy.set_rule("*", throttle_rate=1.0)
    proxy.set_rule("ListShards")
    connection = _connect(proxy)

    assert _post(connection, "ListShards").read() and proxy.faults("throttle") == 0
    throttled = _post(connection, "DescribeStream")
    assert throttled.status == 400
    assert json.loads(throttled.read())["__type"] == "LimitExceededException"

    proxy.clear()
    assert _post(connection, "DescribeStream").status == 201
    assert proxy.faults("throttle", "DescribeStream") == 1
    assert proxy.requests("*") == 3


def test_one_shot_faults_apply_once_in_order(proxy: FaultProxy) -> None:
    proxy.once("GetRecords", "throttle")
    proxy.inject_once("GetRecords", (400, {"__type": "ExpiredIteratorException"}))
    proxy.once("*", "error_5xx")
    connection = _connect(proxy)

    first = _post(connection, "GetRecords")
    assert json.loads(first.read())["__type"] == "ProvisionedThroughputExceededException"
    second = _post(connection, "GetRecords")
    assert json.loads(second.read()) == {"__type": "ExpiredIteratorException"}
    third = _post(connection, "PutRecords")
    assert third.status in (500, 503)
    third.read()
    assert _post(connection, "GetRecords").status == 201
    assert (proxy.faults("throttle"), proxy.faults("inject"), proxy.faults("error_5xx")) == (
        1,
        1,
        1,
    )


def test_cut_body_announces_the_whole_answer_and_sends_half(proxy: FaultProxy) -> None:
    proxy.once("GetRecords", "cut_body")
    body = b"x" * 1000
    connection = _connect(proxy)

    cut = _post(connection, "GetRecords", body)
    announced = int(cut.getheader("Content-Length") or 0)
    with pytest.raises(http.client.IncompleteRead) as raised:
        cut.read()
    assert len(raised.value.partial) == announced // 2
    assert proxy.faults("cut_body") == 1
    whole = _post(_connect(proxy), "GetRecords", body)
    assert len(whole.read()) == int(whole.getheader("Content-Length") or 0) == announced


def _frames(count: int) -> list[bytes]:
    return [event_frame(Event([(str(100 + n), b"r%d" % n)], str(100 + n))) for n in range(count)]


def _whole_frames(body: bytes) -> tuple[int, int]:
    """How many whole event-stream frames ``body`` starts with, and the bytes left over."""
    count = 0
    while len(body) >= 4 and int.from_bytes(body[:4], "big") <= len(body):
        body = body[int.from_bytes(body[:4], "big") :]
        count += 1
    return count, len(body)


def _subscribe_raw(proxy: FaultProxy, path: str = "/events") -> http.client.HTTPResponse:
    return _post(_connect(proxy), "SubscribeToShard", path=path)


def test_a_cut_stream_relays_whole_frames_then_half_of_the_next_and_hangs_up(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.frames = _frames(5)
    proxy.cut_stream_once("SubscribeToShard", StreamCut(after_frames=2))

    cut = _subscribe_raw(proxy)
    with pytest.raises(http.client.IncompleteRead) as raised:
        cut.read()
    partial = raised.value.partial
    assert partial.startswith(upstream.frames[0] + upstream.frames[1])
    assert _whole_frames(partial) == (2, len(upstream.frames[2]) // 2)
    assert proxy.faults("cut_stream", "SubscribeToShard") == 1

    whole = _subscribe_raw(proxy).read()
    assert whole == b"".join(upstream.frames), "no cut was asked for the second subscription"
    assert proxy.faults("cut_stream") == 1


def test_an_ended_stream_closes_cleanly_at_a_frame_boundary(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.frames = _frames(5)
    proxy.cut_stream_once("SubscribeToShard", StreamCut(after_frames=3, clean=True))
    connection = _connect(proxy)

    ended = _post(connection, "SubscribeToShard", path="/events")
    assert ended.read() == b"".join(upstream.frames[:3])
    assert proxy.faults("end_stream") == 1 and proxy.faults("cut_stream") == 0
    again = _post(connection, "SubscribeToShard", path="/events")
    assert again.read() == b"".join(upstream.frames), "the client connection stays usable"


def test_a_stream_ended_by_an_exception_event_carries_its_type(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.frames = _frames(5)
    proxy.cut_stream_once("SubscribeToShard", StreamCut(after_frames=2, clean=True,
                                                        exception="KMSThrottlingException"))
    body = _subscribe_raw(proxy).read()
    assert body.startswith(upstream.frames[0] + upstream.frames[1])
    buffer = EventStreamBuffer()
    buffer.add_data(body)
    messages: list[Any] = list(buffer)
    assert len(messages) == 3
    assert messages[-1].headers[":message-type"] == "exception"
    assert messages[-1].headers[":exception-type"] == "KMSThrottlingException"
    assert proxy.faults("exception_event:KMSThrottlingException", "SubscribeToShard") == 1
    assert proxy.faults("end_stream") == 0


def test_exception_events_are_drawn_from_the_rule(proxy: FaultProxy, upstream: Upstream) -> None:
    upstream.frames = _frames(2)
    names = ("InternalFailureException", "ResourceInUseException")
    proxy.set_rule("SubscribeToShard", stream_exception_rate=1.0, stream_exceptions=names,
                   stream_cut_frames=(1, 1))
    for _ in range(6):
        _subscribe_raw(proxy).read()
    assert proxy.faults("exception_event", "SubscribeToShard") == 6
    assert sum(proxy.faults(f"exception_event:{n}", "SubscribeToShard") for n in names) == 6
    with pytest.raises(ValueError, match="stream_exceptions"):
        proxy.set_rule("SubscribeToShard", stream_exception_rate=0.5)


def test_a_timed_cut_hangs_up_on_both_sides_while_upstream_is_idle(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.frames = _frames(3)
    proxy.cut_stream_once("SubscribeToShard", StreamCut(after_s=0.2))

    response = _subscribe_raw(proxy, "/events-slow")
    with pytest.raises(http.client.IncompleteRead) as raised:
        response.read()
    assert raised.value.partial == upstream.frames[0]
    assert not upstream.release_second_chunk.is_set(), "cut while upstream sent nothing"
    assert upstream.hung_up_on.wait(10), "the upstream connection was closed at the cut"
    assert proxy.faults("cut_stream") == 1


def test_a_client_hanging_up_on_a_stream_closes_the_upstream_connection_at_once(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    """Upstream sends nothing after the first frame, so only a proxy watching the client
    (not one waiting for upstream's next bytes to write) learns of the hang-up."""
    upstream.frames = _frames(2)
    connection = _connect(proxy)
    response = _post(connection, "SubscribeToShard", path="/events-slow")
    assert response.read1() == upstream.frames[0]

    response.close()
    connection.close()
    assert upstream.hung_up_on.wait(5), "upstream still sees the subscription open"
    assert not upstream.release_second_chunk.is_set()


def test_an_answer_that_ends_before_the_cut_point_is_relayed_whole_and_not_counted(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    upstream.frames = _frames(2)
    proxy.cut_stream_once("SubscribeToShard", StreamCut(after_frames=5))

    assert _subscribe_raw(proxy).read() == b"".join(upstream.frames)
    assert proxy.faults("cut_stream") == 0


def test_stream_cuts_and_refusals_follow_the_seed(upstream: Upstream) -> None:
    upstream.frames = _frames(6)
    whole = b"".join(upstream.frames)
    plan = random.Random(5)
    expected: list[str] = []
    for _ in range(30):
        draw = plan.random()
        if draw < 0.2:
            expected.append("in_use")
        elif draw < 0.6:
            expected.append(f"cut after {plan.randint(0, 4)}")
        elif draw < 0.8:
            expected.append(f"end after {plan.randint(0, 4)}")
        else:
            expected.append("whole")

    def outcomes() -> list[str]:
        seen = []
        with FaultProxy(upstream.url, seed=5) as proxy:
            proxy.set_rule("SubscribeToShard", in_use_rate=0.2, cut_stream_rate=0.4,
                           end_stream_rate=0.2, stream_cut_frames=(0, 4))
            for _ in range(30):
                response = _subscribe_raw(proxy)
                if response.status == 400:
                    error = json.loads(response.read())
                    assert error["__type"] == "ResourceInUseException"
                    seen.append("in_use")
                    continue
                try:
                    body = response.read()
                except http.client.IncompleteRead as cut:
                    seen.append(f"cut after {_whole_frames(cut.partial)[0]}")
                    continue
                seen.append("whole" if body == whole else f"end after {_whole_frames(body)[0]}")
            assert proxy.faults("in_use") == expected.count("in_use")
            assert proxy.faults("cut_stream") == sum(e.startswith("cut") for e in expected)
            assert proxy.faults("end_stream") == sum(e.startswith("end") for e in expected)
        return seen

    assert outcomes() == expected
    assert outcomes() == expected
    assert {e.split(" after ")[0] for e in expected} == {"in_use", "cut", "end", "whole"}


def test_a_held_answer_comes_after_the_request_reached_upstream(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    proxy.hold_answers("UpdateItem", 1.0, (0.4, 0.4))
    answers: list[bytes] = []
    sender = threading.Thread(target=lambda: answers.append(
        _post(_connect(proxy), "UpdateItem", b'{"k": 1}', service="DynamoDB_20120810").read()))
    sender.start()

    wait_for(lambda: proxy.holding() == 1, 10, "the answer to be held")
    assert [seen.body for seen in upstream.seen] == [b'{"k": 1}'], "the write landed"
    assert not answers, "while its answer is still held back"
    sender.join(10)
    assert answers == [b'{"echo":"{\\"k\\": 1}"}'], "the answer upstream gave, late"
    assert proxy.holding() == 0
    assert proxy.holds("UpdateItem") == [0.4] and proxy.faults("hold_answer") == 1


def test_held_answers_follow_the_seed_after_the_rules_own_draw(upstream: Upstream) -> None:
    plan = random.Random(7)
    expected: list[float | str] = []
    for _ in range(40):
        if plan.random() < 0.25:
            expected.append("throttle")
        elif plan.random() < 0.5:
            expected.append(plan.uniform(0.0, 0.01))

    with FaultProxy(upstream.url, seed=7) as proxy:
        proxy.set_rule("UpdateItem", throttle_rate=0.25)
        proxy.hold_answers("*", 0.5, (0.0, 0.01))
        connection = _connect(proxy)
        statuses = []
        for _ in range(40):
            response = _post(connection, "UpdateItem", service="DynamoDB_20120810")
            response.read()
            statuses.append(response.status)
        assert proxy.holds() == [e for e in expected if not isinstance(e, str)]
        assert proxy.holds("TransactWriteItems") == []
        assert statuses.count(400) == expected.count("throttle") == proxy.faults("throttle")
        assert len(upstream.seen) == 40 - expected.count("throttle"), "held answers forwarded"

        proxy.hold_answers("*", 0.0)
        proxy.clear()
        held = proxy.faults("hold_answer", "UpdateItem")
        assert _post(connection, "UpdateItem", service="DynamoDB_20120810").read()
        assert proxy.faults("hold_answer") == held > 0, "rate 0 holds nothing more"


def test_rejects_impossible_holds(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="hold rate"):
        proxy.hold_answers("UpdateItem", 1.5, (0.1, 0.2))
    with pytest.raises(ValueError, match="hold_s"):
        proxy.hold_answers("UpdateItem", 0.1, (0.3, 0.2))
    with pytest.raises(ValueError, match="hold_s"):
        proxy.hold_answers("UpdateItem", 0.1, (-0.1, 0.2))


def test_dynamodb_errors_carry_the_dynamodb_type_prefix_and_checksum(proxy: FaultProxy) -> None:
    proxy.once("UpdateItem", "throttle")
    response = _post(_connect(proxy), "UpdateItem", service="DynamoDB_20120810")
    payload = response.read()

    assert response.status == 400
    assert json.loads(payload)["__type"] == ("com.amazonaws.dynamodb.v20120810#ThrottlingException")
    assert response.getheader("x-amzn-ErrorType") == "ThrottlingException"
    assert response.getheader("x-amz-crc32") == str(zlib.crc32(payload))


def test_rejects_impossible_rules(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="sum to at most 1"):
        proxy.set_rule("GetRecords", throttle_rate=0.6, drop_rate=0.5)
    with pytest.raises(ValueError, match="within"):
        proxy.set_rule("GetRecords", error_5xx_rate=-0.1)
    with pytest.raises(ValueError, match="latency_s"):
        proxy.set_rule("GetRecords", latency_s=-1.0)
    with pytest.raises(ValueError, match="sum to at most 1"):
        proxy.set_rule("SubscribeToShard", cut_stream_rate=0.7, in_use_rate=0.4)
    with pytest.raises(ValueError, match="cut range"):
        proxy.set_rule("SubscribeToShard", cut_stream_rate=0.5, stream_cut_s=(2.0, 1.0))
    with pytest.raises(ValueError, match="stream_cut_frames, stream_cut_s or both"):
        proxy.set_rule("SubscribeToShard", stream_cut_frames=None)
    with pytest.raises(ValueError, match="after_frames, after_s or both"):
        StreamCut()


# Through the proxy to the emulators, as botocore sees it.


@pytest.fixture
def kinesis_proxy(kinesis_mock: LocalEndpoint) -> Iterator[FaultProxy]:
    with FaultProxy(kinesis_mock.url, seed=1) as running:
        yield running


@pytest.fixture
def dynamodb_proxy(moto_server: LocalEndpoint) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.url, seed=1) as running:
        yield running


def _stream_with_records(proxy: FaultProxy, payloads: list[bytes]) -> tuple[str, str]:
    """A one-shard stream holding ``payloads``; returns (stream, TRIM_HORIZON iterator)."""
    kinesis = kinesis_client(proxy.url)
    stream = unique_name("proxy")
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, payloads)
    iterator = kinesis.get_shard_iterator(
        StreamName=stream, ShardId="shardId-000000000000", ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    return stream, iterator


def _table(proxy: FaultProxy) -> str:
    dynamodb = dynamodb_client(proxy.url)
    table = unique_name("proxy")
    dynamodb.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    return table


@pytest.mark.integration
def test_clean_rule_forwards_kinesis_traffic(kinesis_proxy: FaultProxy) -> None:
    kinesis_proxy.set_rule("*")
    payloads = [b"\x00binary\xff", b"second", b"third"]
    _, iterator = _stream_with_records(kinesis_proxy, payloads)

    records = kinesis_client(kinesis_proxy.url).get_records(ShardIterator=iterator)["Records"]

    assert [record["Data"] for record in records] == payloads
    assert kinesis_proxy.requests("CreateStream") == 1
    assert kinesis_proxy.requests("PutRecords") == 1
    assert kinesis_proxy.requests("GetRecords") == 1
    assert sum(kinesis_proxy.faults(kind) for kind in ("throttle", "drop", "error_5xx")) == 0


@pytest.mark.integration
def test_kinesis_throttle_is_the_retryable_throughput_error(kinesis_proxy: FaultProxy) -> None:
    _, iterator = _stream_with_records(kinesis_proxy, [b"a", b"b"])

    kinesis_proxy.once("GetRecords", "throttle")
    with pytest.raises(ClientError) as raised:
        kinesis_client(kinesis_proxy.url, NO_RETRIES).get_records(ShardIterator=iterator)
    assert raised.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400

    kinesis_proxy.once("GetRecords", "throttle")
    retried = kinesis_client(kinesis_proxy.url, ONE_RETRY).get_records(ShardIterator=iterator)
    assert [record["Data"] for record in retried["Records"]] == [b"a", b"b"]
    assert retried["ResponseMetadata"]["RetryAttempts"] == 1
    assert kinesis_proxy.faults("throttle", "GetRecords") == 2


@pytest.mark.integration
def test_kinesis_control_plane_throttle_is_limit_exceeded(kinesis_proxy: FaultProxy) -> None:
    stream, _ = _stream_with_records(kinesis_proxy, [b"a"])
    kinesis_proxy.set_rule("ListShards", throttle_rate=1.0)

    with pytest.raises(ClientError) as raised:
        kinesis_client(kinesis_proxy.url, NO_RETRIES).list_shards(StreamName=stream)
    assert raised.value.response["Error"]["Code"] == "LimitExceededException"


@pytest.mark.integration
def test_dynamodb_throttle_is_retried_and_otherwise_surfaces(dynamodb_proxy: FaultProxy) -> None:
    table = _table(dynamodb_proxy)
    item = {"k": {"S": "one"}, "v": {"N": "1"}}

    dynamodb_proxy.once("PutItem", "throttle")
    with pytest.raises(ClientError) as raised:
        dynamodb_client(dynamodb_proxy.url, NO_RETRIES).put_item(TableName=table, Item=item)
    assert raised.value.response["Error"]["Code"] == "ThrottlingException"

    dynamodb_proxy.once("PutItem", "throttle")
    retried = dynamodb_client(dynamodb_proxy.url, ONE_RETRY).put_item(TableName=table, Item=item)
    assert retried["ResponseMetadata"]["RetryAttempts"] == 1
    stored = dynamodb_client(dynamodb_proxy.url).get_item(TableName=table, Key={"k": {"S": "one"}})
    assert stored["Item"] == item


@pytest.mark.integration
def test_server_errors_surface_with_their_status(kinesis_proxy: FaultProxy) -> None:
    kinesis_proxy.set_rule("ListStreams", error_5xx_rate=1.0)
    client = kinesis_client(kinesis_proxy.url, NO_RETRIES)

    for _ in range(4):
        with pytest.raises(ClientError) as raised:
            client.list_streams()
        error = raised.value.response
        expected_code = {500: "InternalFailure", 503: "ServiceUnavailable"}
        status = error["ResponseMetadata"]["HTTPStatusCode"]
        assert error["Error"]["Code"] == expected_code[status]
    assert kinesis_proxy.faults("error_5xx") == 4


@pytest.mark.integration
def test_dropped_request_never_reaches_upstream(dynamodb_proxy: FaultProxy) -> None:
    table = _table(dynamodb_proxy)
    dynamodb_proxy.once("PutItem", "drop")

    with pytest.raises(ConnectionClosedError):
        dynamodb_client(dynamodb_proxy.url, NO_RETRIES).put_item(
            TableName=table, Item={"k": {"S": "dropped"}}
        )
    stored = dynamodb_client(dynamodb_proxy.url).get_item(
        TableName=table, Key={"k": {"S": "dropped"}}
    )
    assert "Item" not in stored


@pytest.mark.integration
def test_lost_response_leaves_the_write_applied(dynamodb_proxy: FaultProxy) -> None:
    table = _table(dynamodb_proxy)
    dynamodb_proxy.once("PutItem", "lose_response")

    with pytest.raises(ClientError) as raised:
        dynamodb_client(dynamodb_proxy.url, ONE_RETRY).put_item(
            TableName=table,
            Item={"k": {"S": "once"}},
            ConditionExpression="attribute_not_exists(k)",
        )
    assert raised.value.response["Error"]["Code"] == "ConditionalCheckFailedException", (
        "the retry found the write the lost response had already applied"
    )
    assert dynamodb_proxy.requests("PutItem") == 2
    assert dynamodb_proxy.faults("lose_response") == 1


@pytest.mark.integration
def test_latency_delays_the_answer_past_a_short_read_timeout(kinesis_proxy: FaultProxy) -> None:
    kinesis_proxy.set_rule("ListStreams", latency_s=1.0)
    impatient = Config(read_timeout=0.2, retries={"total_max_attempts": 1, "mode": "standard"})

    with pytest.raises(ReadTimeoutError):
        kinesis_client(kinesis_proxy.url, impatient).list_streams()
    assert kinesis_proxy.faults("latency", "ListStreams") == 1


@pytest.mark.integration
def test_respond_hook_answers_from_the_request_body(kinesis_proxy: FaultProxy) -> None:
    _, iterator = _stream_with_records(kinesis_proxy, [b"a"])
    expired: list[str] = []

    def expire_first_iterator(request: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        if expired:
            return None
        expired.append(request["ShardIterator"])
        return 400, {"__type": "ExpiredIteratorException", "message": "Iterator expired"}

    kinesis_proxy.set_rule("GetRecords", respond=expire_first_iterator)
    client = kinesis_client(kinesis_proxy.url, NO_RETRIES)

    with pytest.raises(client.exceptions.ExpiredIteratorException):
        client.get_records(ShardIterator=iterator)
    assert expired == [iterator]
    assert [r["Data"] for r in client.get_records(ShardIterator=iterator)["Records"]] == [b"a"]
    assert kinesis_proxy.faults("respond") == 1


@pytest.mark.integration
def test_a_held_update_lands_and_botocore_learns_of_it_late(dynamodb_proxy: FaultProxy) -> None:
    """A client whose deadline is shorter than the hold gives up on a write that landed."""
    table = _table(dynamodb_proxy)
    dynamodb_proxy.hold_answers("UpdateItem", 1.0, (2.0, 2.0))
    impatient = Config(read_timeout=0.5, retries={"total_max_attempts": 1, "mode": "standard"})
    key = {"k": {"S": "late"}}

    with pytest.raises(ReadTimeoutError):
        dynamodb_client(dynamodb_proxy.url, impatient).update_item(
            TableName=table, Key=key, UpdateExpression="SET v = :v",
            ExpressionAttributeValues={":v": {"N": "1"}})
    dynamodb_proxy.hold_answers("UpdateItem", 0.0)
    client = dynamodb_client(dynamodb_proxy.url)
    wait_for(lambda: client.get_item(TableName=table, Key=key, ConsistentRead=True)
             .get("Item", {}).get("v") == {"N": "1"}, 10, "the update to have landed")
    assert dynamodb_proxy.holds() == [2.0]


def _read_when_free(
    client: Any, arn: str, shard: str, position: dict[str, Any]
) -> list[Page[Sequence[Record]]]:
    """A subscription's events, read to its end. kinesis-mock refuses a consumer's second
    subscription to a shard (with an exception event) until it noticed that the first one's
    connection closed, a few seconds later."""
    read: list[list[Page[Sequence[Record]]]] = []

    def attempt() -> bool:
        try:
            read.append(list(subscribe(client, arn, shard, position)))
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ResourceInUseException":
                raise
            return False
        return True

    wait_for(attempt, 30, "kinesis-mock to let the previous subscription go", interval=0.2)
    return read[0]


@pytest.mark.integration
def test_subscription_faults_reach_kclpy_as_the_services_would(kinesis_proxy: FaultProxy) -> None:
    stream, _ = _stream_with_records(kinesis_proxy, [b"a", b"b"])
    client = kinesis_client(kinesis_proxy.url, NO_RETRIES)
    arn = ConsumerRegistration(
        client, "proxy-test", stream_name=stream,
        settings=RegistrationSettings(describe_retries=50, backoff_s=0.2),
    ).get_or_create()
    shard, start = "shardId-000000000000", {"Type": "TRIM_HORIZON"}

    refusals = {}
    for kind in ("in_use", "throttle", "error_5xx"):
        kinesis_proxy.once("SubscribeToShard", kind)
        with pytest.raises(ClientError) as raised:
            subscribe(client, arn, shard, start)
        refusals[kind] = raised.value.response["Error"]["Code"]
    assert refusals["in_use"] == "ResourceInUseException"
    assert refusals["throttle"] == "LimitExceededException"
    assert refusals["error_5xx"] in ("InternalFailure", "ServiceUnavailable")

    kinesis_proxy.cut_stream_once("SubscribeToShard", StreamCut(after_frames=1))
    events = subscribe(client, arn, shard, start)
    first = next(events)
    assert [r.binary_data for r in first.records] == [b"a", b"b"]
    with pytest.raises(Exception) as broken:
        next(events)
    assert classify_subscribe(broken.value) == CONNECTION, broken.value

    # A rule, not a one-shot: kinesis-mock's own refusals until it let the cut subscription
    # go are streamed answers too (one exception event), relayed whole as they end first.
    kinesis_proxy.set_rule("SubscribeToShard", end_stream_rate=1.0, stream_cut_frames=(1, 1))
    after = {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": first.continuation_sequence_number}
    ended = _read_when_free(client, arn, shard, after)
    assert len(ended) == 1 and not ended[0].records
    assert (kinesis_proxy.faults("cut_stream"), kinesis_proxy.faults("end_stream")) == (1, 1)
    assert kinesis_proxy.faults("in_use") == kinesis_proxy.faults("throttle") == 1
