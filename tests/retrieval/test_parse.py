"""GetRecords parsing: hand-built bodies, and the botocore hook over real HTTP."""

from __future__ import annotations

import base64
import json
import queue
import socket
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError
from botocore.stub import Stubber
from moto.server import ThreadedMotoServer

from kclpy.records import Record, is_wire_record
from kclpy.retrieval import kpl, parse, receive
from kclpy.retrieval.page import ChildShard, Page
from kclpy.retrieval.parse import (
    get_records,
    install_fast_get_records,
    parse_get_records,
)
from tests.support.aggregates import sign
from tests.support.decoding import counting_decodes

SEQ = "49590338271490256608559692538361571095921575989136588898"


def body(**doc: Any) -> bytes:
    doc.setdefault("Records", [])
    return json.dumps(doc).encode()


def wire_record(data: bytes = b"payload", seq: str = SEQ, pk: str = "pk",
                **extra: Any) -> dict[str, Any]:
    return {"SequenceNumber": seq, "Data": base64.b64encode(data).decode(), "PartitionKey": pk,
            **extra}


# --- parse_get_records on hand-built bodies -------------------------------------------------


def test_record_with_every_field() -> None:
    raw = body(Records=[wire_record(b"\x00hello\xff", ApproximateArrivalTimestamp=1714000000.123,
                                    EncryptionType="KMS")],
               NextShardIterator="next-it", MillisBehindLatest=42)
    page = parse_get_records(raw)
    [record] = page.records
    assert record.sequence_number == SEQ
    assert record.partition_key == "pk"
    assert record.sub_sequence_number == 0
    assert record.explicit_hash_key is None
    assert record.timestamp_millis == 1_714_000_000_123
    assert record.binary_data == b"\x00hello\xff"
    assert (page.next_shard_iterator, page.millis_behind_latest) == ("next-it", 42)
    assert page.child_shards == []
    assert page.size_bytes == len(raw)


def test_data_stays_base64_until_read() -> None:
    page = parse_get_records(body(Records=[wire_record(b"lazy")]))
    record = page.records[0]
    with counting_decodes() as decoded:
        assert record.data == base64.b64encode(b"lazy").decode()
        assert record.size == 4
        assert decoded == []
        assert record.binary_data == b"lazy"
        assert decoded == [record.data]


@pytest.mark.parametrize(("text", "expected"), [
    ("aGVs\nbG8=", b"hello"), ("aGVs bG8=", b"hello"), ("aGVsbG8=\n", b"hello"),
    ("aGVsbG8", None),
])
def test_data_that_is_not_canonical_base64_decodes_as_botocore_decodes_it(
        text: str, expected: bytes | None) -> None:
    record = parse_get_records(body(Records=[{"SequenceNumber": SEQ, "Data": text,
                                              "PartitionKey": "pk"}])).records[0]
    if expected is None:
        with pytest.raises(ValueError):
            base64.b64decode(text)
        with pytest.raises(ValueError):
            record.binary_data  # noqa: B018
    else:
        assert base64.b64decode(text) == expected
        assert record.binary_data == expected


def test_optional_fields_missing() -> None:
    page = parse_get_records(body(Records=[wire_record()]))
    assert page.records[0].timestamp_millis is None
    assert page.next_shard_iterator is None
    assert page.millis_behind_latest is None
    assert page.child_shards == []


@pytest.mark.parametrize(("seconds", "millis"), [
    (1714000000.123, 1_714_000_000_123),
    (1.001, 1001),          # 1.001 * 1000 == 1000.9999999999999: truncation would give 1000
    (1714000000, 1_714_000_000_000),
    (0.0005, 0),
    (1714000000.9995, 1_714_000_001_000),
])
def test_arrival_timestamp_becomes_epoch_millis(seconds: float, millis: int) -> None:
    page = parse_get_records(body(Records=[wire_record(ApproximateArrivalTimestamp=seconds)]))
    assert page.records[0].timestamp_millis == millis


def test_shard_end_with_child_shards() -> None:
    children = [
        {"ShardId": "shardId-000000000001", "ParentShards": ["shardId-000000000000"],
         "HashKeyRange": {"StartingHashKey": "0",
                          "EndingHashKey": "170141183460469231731687303715884105727"}},
        {"ShardId": "shardId-000000000002",
         "ParentShards": ["shardId-000000000000", "shardId-000000000003"],
         "HashKeyRange": {"StartingHashKey": "170141183460469231731687303715884105728",
                          "EndingHashKey": "340282366920938463463374607431768211455"}},
    ]
    page = parse_get_records(body(NextShardIterator=None, MillisBehindLatest=0,
                                  ChildShards=children))
    assert page.next_shard_iterator is None
    assert page.records == []
    assert page.child_shards == [
        ChildShard("shardId-000000000001", ("shardId-000000000000",), "0",
                   "170141183460469231731687303715884105727"),
        ChildShard("shardId-000000000002", ("shardId-000000000000", "shardId-000000000003"),
                   "170141183460469231731687303715884105728",
                   "340282366920938463463374607431768211455"),
    ]


def test_records_keep_their_order() -> None:
    records = [wire_record(f"r{i}".encode(), seq=str(1000 + i), pk=f"k{i}") for i in range(50)]
    page = parse_get_records(body(Records=records))
    assert [r.sequence_number for r in page.records] == [str(1000 + i) for i in range(50)]
    assert [r.binary_data for r in page.records] == [f"r{i}".encode() for i in range(50)]



# --- pages of KPL aggregates: payloads decoded straight from the body -----------------------


def aggregate(*users: tuple[str, bytes]) -> bytes:
    message = kpl.AggregatedRecord()
    for index, (key, data) in enumerate(users):
        message.partition_key_table.append(key)
        message.records.add(partition_key_index=index, data=data)
    return sign(message.SerializeToString())


def compact(doc: dict[str, Any]) -> bytes:
    """JSON as Kinesis writes it: no spaces."""
    return json.dumps(doc, separators=(",", ":")).encode()


def fields(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    return [(r.binary_data, r.data, r.partition_key, r.sequence_number, r.sub_sequence_number,
             r.timestamp_millis, r.explicit_hash_key) for r in records]


# A partition key holding the text the parse looks for: JSON escapes its quotes, so it
# must not be taken for a payload.
TRICKY_KEY = '"Data":"84maw'
KPL_PAGE: dict[str, Any] = {
    "Records": [
        wire_record(aggregate(("a", b"one"), ("b", b"two")), seq="1", pk=TRICKY_KEY,
                    ApproximateArrivalTimestamp=1714000000.5),
        wire_record(b"plain, not aggregated", seq="2", ApproximateArrivalTimestamp=1714000001),
        wire_record(aggregate((TRICKY_KEY, b"\xff" * 300)), seq="3"),
        wire_record(b"", seq="4", ApproximateArrivalTimestamp=1714000002),
    ],
    "NextShardIterator": "next", "MillisBehindLatest": 7,
}


def test_a_page_of_aggregates_reads_as_the_plain_parse_reads_it() -> None:
    fast = parse_get_records(compact(KPL_PAGE))
    # json.dumps' spaces keep the page on the plain parse.
    plain = parse_get_records(body(**KPL_PAGE))
    assert not any(map(is_wire_record, fast.records))
    assert all(map(is_wire_record, plain.records))
    assert fields(fast.records) == fields(plain.records)
    assert (fast.next_shard_iterator, fast.millis_behind_latest) == ("next", 7)
    users = kpl.deaggregate(fast.records)
    assert users.corrupt == 0
    assert fields(users.records) == fields(kpl.deaggregate(plain.records).records)
    assert [r.binary_data for r in users.records] == [
        b"one", b"two", b"plain, not aggregated", b"\xff" * 300, b""]


def test_a_pooled_body_is_searched_in_its_buffer_and_other_views_are_parsed_plainly() -> None:
    raw = compact(KPL_PAGE)
    buffer = receive.POOL.take(len(raw))
    buffer[: len(raw)] = raw
    pooled = memoryview(buffer)[: len(raw)]
    assert receive.searchable(pooled) is buffer
    assert fields(parse_get_records(pooled).records) == fields(parse_get_records(raw).records)
    # A view that does not start at its object's start: searching the object would read
    # other bytes, so it is parsed the plain way.
    foreign = memoryview(bytearray(b"garbage" + raw))[7:]
    assert receive.searchable(foreign) is None
    page = parse_get_records(foreign)
    assert all(map(is_wire_record, page.records))
    assert fields(page.records) == fields(parse_get_records(raw).records)


def _escaped_slash(raw: bytes) -> bytes:
    # "/" may be written "\/" in JSON; the first aggregate's text holds one.
    text = base64.b64encode(aggregate(("k", b"\xff\xff\xff" * 40))).decode()
    assert "/" in text
    return raw.replace(text.encode(), text.replace("/", "\\/").encode())


@pytest.mark.parametrize("make", [
    # the payload is not plain base64 text
    _escaped_slash,
    # a "Data" key outside the records
    lambda raw: raw[:-1] + b',"Extra":{"Data":"84mawA=="}}',
    # a record's payload spelled with a space: the marker check notices it was not cut
    lambda raw: raw.replace(b'"Data":"cGxh', b'"Data": "cGxh'),
], ids=["escaped", "data-key-elsewhere", "spaced"])
def test_a_page_the_fast_parse_is_not_sure_of_is_parsed_plainly(make: Any) -> None:
    doc = dict(KPL_PAGE, Records=[
        wire_record(aggregate(("k", b"\xff\xff\xff" * 40)), seq="1"), *KPL_PAGE["Records"]])
    raw = make(compact(doc))
    page = parse_get_records(raw)
    assert all(map(is_wire_record, page.records))
    assert fields(page.records) == fields(parse_get_records(body(**doc)).records)


def test_a_garbled_page_of_aggregates_is_still_an_error() -> None:
    with pytest.raises(ResponseParserError):
        parse_get_records(compact(KPL_PAGE)[:-5])

@pytest.mark.parametrize("raw", [
    b"", b"not json", b"[]", b"null", b"{}", b'{"Records": 5}', b'{"Records": [{}]}',
    b'{"Records": [{"SequenceNumber": "1", "PartitionKey": "p"}]}',
    b'{"Records": [], "ChildShards": [{"ShardId": "s"}]}',
    b'{"Records": [], "NextShardIterator": "\xff"}',
])
def test_a_body_that_is_not_get_records_is_an_error(raw: bytes) -> None:
    # Never an empty page: that would read as "no records" or even as shard end.
    with pytest.raises(ResponseParserError):
        parse_get_records(raw)


def test_parse_error_does_not_carry_the_body() -> None:
    raw = b'{"Records": [{"Data": "c2VjcmV0", "PartitionKey": "secret-key\xff"}]}'
    with pytest.raises(ResponseParserError) as raised:
        parse_get_records(raw)
    assert "secret" not in str(raised.value)
    assert "c2VjcmV0" not in str(raised.value)


# --- botocore Stubber: no HTTP, so no body to parse ----------------------------------------


def test_stubbed_response_is_converted_from_botocore_shapes() -> None:
    client = boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    arrival = datetime(2024, 4, 24, 23, 6, 40, 123000, tzinfo=timezone.utc)
    with Stubber(client) as stubber:
        stubber.add_response("get_records", {
            "Records": [{"SequenceNumber": "7", "ApproximateArrivalTimestamp": arrival,
                         "Data": b"stubbed", "PartitionKey": "p"}],
            "NextShardIterator": "it-2", "MillisBehindLatest": 5,
            "ChildShards": [{"ShardId": "c", "ParentShards": ["a"],
                             "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": "9"}}],
        }, {"ShardIterator": "it-1", "Limit": 10})
        page = get_records(client, "it-1", 10)
    [record] = page.records
    assert (record.sequence_number, record.partition_key, record.binary_data) == (
        "7", "p", b"stubbed")
    assert record.timestamp_millis == 1_714_000_000_123
    assert (page.next_shard_iterator, page.millis_behind_latest) == ("it-2", 5)
    assert page.child_shards == [ChildShard("c", ("a",), "0", "9")]


# --- the hook over real HTTP: moto's server ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def kinesis(endpoint: str, **config: Any) -> Any:
    return boto3.client("kinesis", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(**config) if config else None)


@pytest.fixture(scope="module")
def stream(moto_endpoint: str) -> tuple[str, str]:
    """A one-shard stream with records of assorted sizes; (stream name, shard id)."""
    client = kinesis(moto_endpoint)
    client.create_stream(StreamName="parse-test", ShardCount=1)
    payloads = [b"", b"a", b"\x00\xff" * 3, bytes(range(256)), b"x" * 10_000,
                *(f"record-{i}".encode() for i in range(40))]
    for i, data in enumerate(payloads):
        client.put_record(StreamName="parse-test", Data=data, PartitionKey=f"pk-{i % 7}")
    shard_id = client.list_shards(StreamName="parse-test")["Shards"][0]["ShardId"]
    return "parse-test", shard_id


def iterator(client: Any, stream: tuple[str, str]) -> str:
    name, shard_id = stream
    it: str = client.get_shard_iterator(StreamName=name, ShardId=shard_id,
                                        ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    return it


@pytest.mark.integration
def test_hook_agrees_with_botocore_field_by_field(moto_endpoint: str,
                                                  stream: tuple[str, str]) -> None:
    fast, plain = kinesis(moto_endpoint), kinesis(moto_endpoint)
    page = get_records(fast, iterator(fast, stream), 1000)
    expected = plain.get_records(ShardIterator=iterator(plain, stream), Limit=1000)

    assert len(page.records) == len(expected["Records"]) == 45
    for ours, theirs in zip(page.records, expected["Records"], strict=True):
        assert ours.sequence_number == theirs["SequenceNumber"]
        assert ours.partition_key == theirs["PartitionKey"]
        assert ours.binary_data == theirs["Data"]
        assert ours.timestamp_millis == round(
            theirs["ApproximateArrivalTimestamp"].timestamp() * 1000)
    assert page.millis_behind_latest == expected["MillisBehindLatest"]
    assert page.next_shard_iterator is not None
    assert page.size_bytes > sum(len(r["Data"]) for r in expected["Records"])
    # Both next iterators point at the same position: reading on from either gives nothing.
    assert get_records(fast, page.next_shard_iterator, 1000).records == []


@pytest.mark.integration
def test_limit_and_paging_through_the_hook(moto_endpoint: str, stream: tuple[str, str]) -> None:
    client = kinesis(moto_endpoint)
    it: str | None = iterator(client, stream)
    seen: list[str] = []
    while it is not None:
        page = get_records(client, it, 10)
        assert len(page.records) <= 10
        if not page.records:
            break
        seen += [r.sequence_number for r in page.records]
        it = page.next_shard_iterator
    assert len(seen) == 45
    assert seen == sorted(seen, key=int)


@pytest.mark.integration
def test_install_is_idempotent_and_leaves_botocore_metadata(
        moto_endpoint: str, stream: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = parse.parse_get_records

    def counting(raw: bytes) -> Page[Sequence[Record]]:
        calls.append(len(raw))
        return real(raw)

    monkeypatch.setattr(parse, "parse_get_records", counting)
    client = kinesis(moto_endpoint)
    install_fast_get_records(client)
    install_fast_get_records(client)
    response = client.get_records(ShardIterator=iterator(client, stream), Limit=5)
    assert len(calls) == 1
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert "Records" not in response
    page = get_records(client, iterator(client, stream), 5)
    assert len(calls) == 2
    assert len(page.records) == 5


@pytest.mark.integration
def test_service_error_through_the_hook_is_botocores_client_error(
        moto_endpoint: str) -> None:
    client = kinesis(moto_endpoint)
    client.create_stream(StreamName="short-lived", ShardCount=1)
    shard_id = client.list_shards(StreamName="short-lived")["Shards"][0]["ShardId"]
    it = iterator(client, ("short-lived", shard_id))
    client.delete_stream(StreamName="short-lived")
    install_fast_get_records(client)
    with pytest.raises(ClientError) as raised:
        get_records(client, it, 10)
    assert raised.value.response["Error"]["Code"] == "ResourceNotFoundException"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


# --- the hook over real HTTP: a scripted endpoint for what moto cannot answer --------------


class ScriptedKinesis:
    """A loopback HTTP endpoint answering each request with the next scripted response."""

    def __init__(self) -> None:
        self.responses: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self.requests: list[dict[str, Any]] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                script.requests.append(json.loads(self.rfile.read(length)))
                status, payload = script.responses.get_nowait()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("x-amzn-RequestId", f"req-{len(script.requests)}")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, status: int, payload: dict[str, Any] | bytes) -> None:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.responses.put((status, raw))


@pytest.fixture
def scripted() -> Iterator[ScriptedKinesis]:
    endpoint = ScriptedKinesis()
    yield endpoint
    endpoint.server.shutdown()
    endpoint.server.server_close()


@pytest.mark.integration
def test_expired_iterator_keeps_its_error_code(scripted: ScriptedKinesis) -> None:
    scripted.answer(400, {"__type": "ExpiredIteratorException",
                          "message": "Iterator expired. The iterator was created at time X"})
    client = kinesis(scripted.endpoint, retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(ClientError) as raised:
        get_records(client, "old-iterator", 100)
    error = raised.value.response["Error"]
    assert error["Code"] == "ExpiredIteratorException"
    assert error["Message"].startswith("Iterator expired")
    assert raised.value.response["ResponseMetadata"]["RequestId"] == "req-1"
    assert scripted.requests == [{"ShardIterator": "old-iterator", "Limit": 100}]


@pytest.mark.integration
def test_botocore_still_retries_throttling(scripted: ScriptedKinesis) -> None:
    throttle = {"__type": "ProvisionedThroughputExceededException", "message": "Rate exceeded"}
    scripted.answer(400, throttle)
    scripted.answer(200, {"Records": [wire_record(b"after retry")], "NextShardIterator": "n",
                          "MillisBehindLatest": 0})
    client = kinesis(scripted.endpoint, retries={"mode": "standard", "total_max_attempts": 2})
    page = get_records(client, "it", 10)
    assert [r.binary_data for r in page.records] == [b"after retry"]
    assert len(scripted.requests) == 2


@pytest.mark.integration
def test_throttling_beyond_botocores_retries_propagates(scripted: ScriptedKinesis) -> None:
    scripted.answer(400, {"__type": "ProvisionedThroughputExceededException",
                          "message": "Rate exceeded"})
    client = kinesis(scripted.endpoint, retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(ClientError) as raised:
        get_records(client, "it", 10)
    assert raised.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"


@pytest.mark.integration
def test_shard_end_over_http(scripted: ScriptedKinesis) -> None:
    scripted.answer(200, {
        "Records": [wire_record(b"last", ApproximateArrivalTimestamp=1714000000.5)],
        "MillisBehindLatest": 0, "NextShardIterator": None,
        "ChildShards": [{"ShardId": "shardId-000000000001",
                         "ParentShards": ["shardId-000000000000"],
                         "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": "99"}}],
    })
    page = get_records(kinesis(scripted.endpoint), "it", 10)
    assert page.next_shard_iterator is None
    assert page.child_shards == [
        ChildShard("shardId-000000000001", ("shardId-000000000000",), "0", "99")]
    assert page.records[0].timestamp_millis == 1_714_000_000_500


@pytest.mark.integration
def test_garbled_success_body_raises(scripted: ScriptedKinesis) -> None:
    scripted.answer(200, b"<html>proxy error</html>")
    with pytest.raises(ResponseParserError):
        get_records(kinesis(scripted.endpoint), "it", 10)
