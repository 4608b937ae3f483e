"""A Kinesis endpoint on loopback that replays GetRecords pages built in advance.

The emulators are far slower than any client (kinesis-mock serves about 5k records/s), so a
benchmark against them would measure the emulator. This server answers ListShards,
DescribeStream, DescribeStreamSummary, GetShardIterator and GetRecords in the Kinesis JSON
protocol from bytes serialised before the first request: answering a GetRecords is a
dictionary lookup and a socket write, so the client's CPU is what a benchmark sees. Run it
in its own process so that none of its CPU is counted with the client's.

Enhanced fan-out too: Register/Describe/List/DeregisterStreamConsumer (a consumer is ACTIVE
at once) and SubscribeToShard over HTTP/1.1 as AWS answers it - an ``initial-response``
event, then ``SubscribeToShardEvent`` frames (up to 2 MiB of records each, a shard's push
rate for one second; their JSON the same bytes as the pages'), an empty event every 5 s at
the tip, the stream ended cleanly after ``--subscription-s`` (AWS: 5 minutes). Frames are
written as the client reads them, so a client that stops reading holds the stream back at
the TCP window.

Live mode: PutRecord and PutRecords append to a shard (arrival: now); the new records are
pushed at once to subscriptions waiting at the tip and served to GetRecords, as an AWS
endpoint would - the low-latency pusher kinesis-mock (a one-second tick) is not.

What it serves: streams of open shards, each holding a fixed list of records (plain, or KPL
aggregates of user records made by aws-kinesis-agg, the KPL's format). Pages follow
Kinesis's rules: at most ``Limit`` records and at most 10 MiB of payload, a next iterator
even at the tip (the shards are open), ``MillisBehindLatest`` from the arrival times and 0
once a page reaches the tip. Iterators never expire and nothing is ever throttled: the
point is the client's cost, not its resilience (the fetcher's tests cover that).

Run: python bench/replay.py --stream NAME:SHARDS:RECORDS_PER_SHARD:SIZE[:kpl] [...]
(prints its URL on the first line of stdout once every page is built, then serves until
killed). For KPL streams RECORDS_PER_SHARD counts user records.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import hashlib
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aws_kinesis_agg.aggregator import RecordAggregator

from kclpy.retrieval.subscription import encode_frame

HOST = "127.0.0.1"
ACCOUNT = "123456789012"
REGION = "us-east-1"
#: GetRecords' own maximum; every client benchmarked asks for it, so those pages are prebuilt
MAX_LIMIT = 10_000
#: Kinesis returns at most 10 MiB of record data per GetRecords
MAX_PAGE_BYTES = 10 * 1024 * 1024
#: record data in one SubscribeToShard event at most: what a shard pushes to one consumer
#: in a second (2 MB/s), so no event holds more
MAX_EVENT_BYTES = 2 * 1024 * 1024
#: the KPL's default AggregationMaxSize
KPL_AGGREGATE_BYTES = 51_200
#: a realistic first sequence number (56 digits, as AWS's)
FIRST_SEQUENCE = 49_590_338_271_490_256_608_559_692_538_361_571_095_921_575_989_136_588_898
#: arrival time of a shard's first record, epoch milliseconds; one record per millisecond
FIRST_ARRIVAL_MS = 1_714_000_000_000
_MAX_HASH_KEY = 2**128 - 1
_JSON = b"application/x-amz-json-1.1"


@dataclass(frozen=True)
class StreamSpec:
    """One stream to serve: ``shards`` open shards of ``records`` records each (user records
    for KPL streams) of ``size`` bytes."""

    name: str
    shards: int
    records: int
    size: int
    kpl: bool = False

    @classmethod
    def parse(cls, text: str) -> StreamSpec:
        """From ``NAME:SHARDS:RECORDS:SIZE[:kpl]``."""
        parts = text.split(":")
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "kpl"):
            raise ValueError(f"expected NAME:SHARDS:RECORDS:SIZE[:kpl], got {text!r}")
        return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), len(parts) == 5)

    def __str__(self) -> str:
        kind = ":kpl" if self.kpl else ""
        return f"{self.name}:{self.shards}:{self.records}:{self.size}{kind}"


class KinesisError(Exception):
    """Answered as HTTP 400 with Kinesis's error document."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Shard:
    index: int
    shard_id: str
    starting_hash_key: int
    ending_hash_key: int
    #: per Kinesis record: sequence number, arrival (epoch ms), payload bytes, JSON object
    sequence_numbers: list[int] = field(default_factory=list)
    arrivals_ms: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fragments: list[bytes] = field(default_factory=list)
    #: (offset, limit) -> the whole GetRecords answer body
    pages: dict[tuple[int, int], bytes] = field(default_factory=dict)
    #: offset -> a SubscribeToShard event frame from there, and where it ends
    events: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    #: records were put since start: answers at the tip are no longer kept
    live: bool = False

    def description(self) -> dict[str, Any]:
        """The shard as ListShards and DescribeStream list it."""
        return {
            "ShardId": self.shard_id,
            "HashKeyRange": {"StartingHashKey": str(self.starting_hash_key),
                             "EndingHashKey": str(self.ending_hash_key)},
            "SequenceNumberRange": {"StartingSequenceNumber": str(FIRST_SEQUENCE)},
        }


@dataclass
class Stream:
    index: int
    spec: StreamSpec
    shards: list[Shard]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def arn(self) -> str:
        return f"arn:aws:kinesis:{REGION}:{ACCOUNT}:stream/{self.name}"


def _payloads(spec: StreamSpec, rnd: random.Random) -> list[tuple[str, bytes]]:
    """One shard's Kinesis records as (partition key, payload): user records as they are,
    or packed into KPL aggregates as the KPL would (10,000 distinct partition keys)."""
    if not spec.kpl:
        return [(f"partition-{rnd.randrange(10_000)}", rnd.randbytes(spec.size))
                for _ in range(spec.records)]
    aggregator = RecordAggregator(max_size=KPL_AGGREGATE_BYTES)
    out: list[tuple[str, bytes]] = []
    for _ in range(spec.records):
        full = aggregator.add_user_record(f"user-{rnd.randrange(10_000)}",
                                          rnd.randbytes(spec.size))
        if full is not None:
            key, _, blob = full.get_contents()
            out.append((key, blob))
    last = aggregator.clear_and_get()
    if last is not None:
        key, _, blob = last.get_contents()
        out.append((key, blob))
    return out


def build_stream(index: int, spec: StreamSpec, seed: int = 7,
                 last_arrival_ms: int | None = None) -> Stream:
    """Generate and serialise every record of the stream (deterministic for a seed). Arrivals
    are one millisecond apart, from ``FIRST_ARRIVAL_MS``, or ending at ``last_arrival_ms``
    (a backlog that ends now, for readers that position by arrival time)."""
    rnd = random.Random(f"{seed}:{spec}")
    width = (_MAX_HASH_KEY + 1) // max(spec.shards, 1)
    shards = []
    for n in range(spec.shards):
        last = n == spec.shards - 1
        shard = Shard(n, f"shardId-{n:012d}", n * width,
                      _MAX_HASH_KEY if last else (n + 1) * width - 1)
        payloads = _payloads(spec, rnd)
        first_arrival = (FIRST_ARRIVAL_MS if last_arrival_ms is None
                         else last_arrival_ms - max(len(payloads) - 1, 0))
        for i, (key, payload) in enumerate(payloads):
            sequence = FIRST_SEQUENCE + i * 100_000
            arrival = first_arrival + i
            shard.sequence_numbers.append(sequence)
            shard.arrivals_ms.append(arrival)
            shard.sizes.append(len(payload))
            shard.fragments.append(json.dumps({
                "SequenceNumber": str(sequence),
                "ApproximateArrivalTimestamp": arrival / 1000,
                "Data": base64.b64encode(payload).decode("ascii"),
                "PartitionKey": key,
            }, separators=(",", ":")).encode())
        shards.append(shard)
    stream = Stream(index, spec, shards)
    # Every client benchmarked reads from TRIM_HORIZON with the largest Limit: that chain of
    # pages, tip included, is ready before the first request.
    for shard in shards:
        offset = 0
        while True:
            page(stream, shard, offset, MAX_LIMIT)
            if offset >= len(shard.fragments):
                break
            offset = _next_offset(shard, offset, MAX_LIMIT)
    return stream


def _next_offset(shard: Shard, offset: int, limit: int,
                 max_bytes: int = MAX_PAGE_BYTES) -> int:
    """Where the page that starts at ``offset`` ends: ``limit`` records or ``max_bytes`` of
    data, whichever comes first (always at least one record, as Kinesis does)."""
    end = min(len(shard.fragments), offset + limit)
    total = 0
    for i in range(offset, end):
        total += shard.sizes[i]
        if total > max_bytes and i > offset:
            return i
    return end


def _offset(shard: Shard, kind: Any, sequence: Any, timestamp: Any) -> int:
    """Where an iterator or a subscription of ``kind`` starts in the shard."""
    try:
        if kind == "TRIM_HORIZON":
            return 0
        if kind == "LATEST":
            return len(shard.fragments)
        if kind == "AT_SEQUENCE_NUMBER":
            return bisect.bisect_left(shard.sequence_numbers, int(sequence))
        if kind == "AFTER_SEQUENCE_NUMBER":
            return bisect.bisect_right(shard.sequence_numbers, int(sequence))
        if kind == "AT_TIMESTAMP":
            return bisect.bisect_left(shard.arrivals_ms, round(float(timestamp) * 1000))
    except (ValueError, TypeError):
        raise KinesisError("InvalidArgumentException",
                           f"{kind} needs a valid position") from None
    raise KinesisError("InvalidArgumentException", f"Invalid ShardIteratorType: {kind}")


def iterator_token(stream: Stream, shard: Shard, offset: int) -> str:
    """Opaque to clients, like Kinesis's: it names the position, never a state to keep."""
    raw = f"kclpy-replay:{stream.index}:{shard.index}:{offset}".encode()
    return base64.b64encode(raw).decode("ascii")


def page(stream: Stream, shard: Shard, offset: int, limit: int) -> bytes:
    """The GetRecords answer for a position: built on first use, then served as is."""
    body = shard.pages.get((offset, limit))
    if body is not None:
        return body
    end = _next_offset(shard, offset, limit)
    at_tip = end >= len(shard.fragments)
    behind = 0 if at_tip else max(1, shard.arrivals_ms[-1] - shard.arrivals_ms[end - 1])
    body = b"".join((
        b'{"Records":[', b",".join(shard.fragments[offset:end]),
        b'],"NextShardIterator":"', iterator_token(stream, shard, end).encode(),
        b'","MillisBehindLatest":', str(behind).encode(), b"}",
    ))
    if not (at_tip and shard.live):
        shard.pages[(offset, limit)] = body
    return body


def continuation_at(shard: Shard, offset: int) -> str:
    """The sequence number a subscription continues after to read from ``offset``."""
    return str(shard.sequence_numbers[offset - 1] if offset else FIRST_SEQUENCE - 1)


def event(shard: Shard, offset: int) -> tuple[bytes, int]:
    """The SubscribeToShard event frame of the records from ``offset`` (at most
    ``MAX_EVENT_BYTES`` of them; none at the tip), and the offset after them."""
    cached = shard.events.get(offset)
    if cached is not None:
        return cached
    end = _next_offset(shard, offset, MAX_LIMIT, MAX_EVENT_BYTES)
    at_tip = end >= len(shard.fragments)
    behind = 0 if at_tip else max(1, shard.arrivals_ms[-1] - shard.arrivals_ms[end - 1])
    payload = b"".join((
        b'{"Records":[', b",".join(shard.fragments[offset:end]),
        b'],"ContinuationSequenceNumber":"', continuation_at(shard, end).encode(),
        b'","MillisBehindLatest":', str(behind).encode(), b"}",
    ))
    answer = (encode_frame({":message-type": "event", ":event-type": "SubscribeToShardEvent",
                            ":content-type": "application/json"}, payload), end)
    if not (at_tip and shard.live):
        shard.events[offset] = answer
    return answer


INITIAL_RESPONSE = encode_frame({":message-type": "event", ":event-type": "initial-response",
                                 ":content-type": "application/json"}, b"{}")


class Replay:
    """The Kinesis operations over a set of prebuilt streams; no I/O here."""

    def __init__(self, streams: Sequence[Stream]) -> None:
        self.streams = list(streams)
        self._by_name = {s.name: s for s in self.streams}
        self._by_arn = {s.arn: s for s in self.streams}
        self._operations: dict[str, Callable[[dict[str, Any]], bytes]] = {
            "GetRecords": self.get_records,
            "GetShardIterator": self.get_shard_iterator,
            "ListShards": self.list_shards,
            "DescribeStream": self.describe_stream,
            "DescribeStreamSummary": self.describe_stream_summary,
            "RegisterStreamConsumer": self.register_stream_consumer,
            "DescribeStreamConsumer": self.describe_stream_consumer,
            "ListStreamConsumers": self.list_stream_consumers,
            "DeregisterStreamConsumer": self.deregister_stream_consumer,
            "PutRecord": self.put_record,
            "PutRecords": self.put_records,
        }
        #: consumer ARN -> (stream, name, creation time in epoch seconds)
        self.consumers: dict[str, tuple[Stream, str, float]] = {}
        #: called after records are put (the server wakes the subscriptions at the tip)
        self.on_put: Callable[[], None] = lambda: None
        #: how long a subscription lasts before it is ended cleanly (AWS: 5 minutes)
        self.subscription_s = 300.0

    def handle(self, target: str, body: bytes) -> tuple[int, bytes]:
        """(HTTP status, body) for one request; ``target`` is the X-Amz-Target header."""
        prefix, _, operation = target.partition(".")
        handler = self._operations.get(operation) if prefix == "Kinesis_20131202" else None
        try:
            if handler is None:
                raise KinesisError("UnknownOperationException",
                                   f"operation {target or '(none)'} is not served here")
            try:
                params = json.loads(body or b"{}")
            except ValueError:
                raise KinesisError("SerializationException", "body is not JSON") from None
            return 200, handler(params)
        except KinesisError as e:
            return 400, json.dumps({"__type": e.code, "message": e.message}).encode()

    # -- lookups -------------------------------------------------------------------------

    def _stream(self, params: dict[str, Any]) -> Stream:
        arn, name = params.get("StreamARN"), params.get("StreamName")
        if arn is None and name is None:
            raise KinesisError("InvalidArgumentException", "StreamName or StreamARN is required")
        stream = self._by_arn.get(arn) if arn is not None else self._by_name.get(name or "")
        if stream is None or (name is not None and stream.name != name):
            raise KinesisError("ResourceNotFoundException",
                               f"Stream {name or arn} under account {ACCOUNT} not found.")
        return stream

    def _shard(self, stream: Stream, shard_id: Any) -> Shard:
        for shard in stream.shards:
            if shard.shard_id == shard_id:
                return shard
        raise KinesisError("ResourceNotFoundException",
                           f"Shard {shard_id} in stream {stream.name} under account {ACCOUNT} "
                           "does not exist")

    def _position(self, token: Any) -> tuple[Stream, Shard, int]:
        try:
            text = base64.b64decode(str(token), validate=True).decode()
            magic, stream_index, shard_index, offset = text.split(":")
            if magic != "kclpy-replay":
                raise ValueError(magic)
            stream = self.streams[int(stream_index)]
            shard = stream.shards[int(shard_index)]
            position = int(offset)
            if not 0 <= position <= len(shard.fragments):
                raise ValueError(offset)
        except (ValueError, IndexError):
            raise KinesisError("InvalidArgumentException", "Invalid ShardIterator.") from None
        return stream, shard, position

    # -- operations ------------------------------------------------------------------------

    def get_records(self, params: dict[str, Any]) -> bytes:
        stream, shard, offset = self._position(params.get("ShardIterator"))
        limit = params.get("Limit", MAX_LIMIT)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise KinesisError("ValidationException",
                               f"1 validation error detected: Value '{limit}' at 'limit' failed "
                               f"to satisfy constraint: Member must have value between 1 and "
                               f"{MAX_LIMIT}")
        return page(stream, shard, offset, limit)

    def get_shard_iterator(self, params: dict[str, Any]) -> bytes:
        stream = self._stream(params)
        shard = self._shard(stream, params.get("ShardId"))
        offset = _offset(shard, params.get("ShardIteratorType"),
                         params.get("StartingSequenceNumber"), params.get("Timestamp"))
        return json.dumps({"ShardIterator": iterator_token(stream, shard, offset)}).encode()

    # -- enhanced fan-out ------------------------------------------------------------------

    def _consumer(self, params: dict[str, Any]) -> tuple[str, Stream, str, float]:
        arn = params.get("ConsumerARN")
        if arn is None:
            stream = self._stream(params)
            name = params.get("ConsumerName")
            arn = next((a for a, (s, n, _) in self.consumers.items()
                        if s is stream and n == name), None)
        if arn not in self.consumers:
            raise KinesisError("ResourceNotFoundException", f"consumer {arn} not found")
        stream, name, created = self.consumers[arn]
        return arn, stream, name, created

    @staticmethod
    def _consumer_json(arn: str, stream: Stream, name: str, created: float,
                       *, described: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"ConsumerName": name, "ConsumerARN": arn,
                                "ConsumerStatus": "ACTIVE",
                                "ConsumerCreationTimestamp": created}
        if described:
            body["StreamARN"] = stream.arn
        return body

    def register_stream_consumer(self, params: dict[str, Any]) -> bytes:
        stream = self._stream({"StreamARN": params.get("StreamARN")})
        name = str(params.get("ConsumerName") or "")
        if any(s is stream and n == name for s, n, _ in self.consumers.values()):
            raise KinesisError("ResourceInUseException", f"consumer {name} exists")
        created = time.time()
        arn = f"{stream.arn}/consumer/{name}:{int(created)}"
        self.consumers[arn] = (stream, name, created)
        return json.dumps({"Consumer": self._consumer_json(arn, stream, name, created)}).encode()

    def describe_stream_consumer(self, params: dict[str, Any]) -> bytes:
        arn, stream, name, created = self._consumer(params)
        return json.dumps({"ConsumerDescription": self._consumer_json(
            arn, stream, name, created, described=True)}).encode()

    def list_stream_consumers(self, params: dict[str, Any]) -> bytes:
        stream = self._stream({"StreamARN": params.get("StreamARN")})
        return json.dumps({"Consumers": [self._consumer_json(a, s, n, c)
                                         for a, (s, n, c) in self.consumers.items()
                                         if s is stream]}).encode()

    def deregister_stream_consumer(self, params: dict[str, Any]) -> bytes:
        arn, *_ = self._consumer(params)
        del self.consumers[arn]
        return b"{}"

    def subscription(self, params: dict[str, Any]) -> tuple[Shard, int]:
        """The shard and offset a SubscribeToShard starts at (errors as KinesisError)."""
        _, stream, _, _ = self._consumer({"ConsumerARN": params.get("ConsumerARN")})
        shard = self._shard(stream, params.get("ShardId"))
        position = params.get("StartingPosition") or {}
        return shard, _offset(shard, position.get("Type"), position.get("SequenceNumber"),
                              position.get("Timestamp"))

    # -- live mode ---------------------------------------------------------------------------

    def put_record(self, params: dict[str, Any]) -> bytes:
        stream = self._stream(params)
        shard, sequence = self._append(stream, params)
        self.on_put()
        return json.dumps({"ShardId": shard.shard_id, "SequenceNumber": str(sequence)}
                          ).encode()

    def put_records(self, params: dict[str, Any]) -> bytes:
        stream = self._stream(params)
        results = []
        for entry in params.get("Records") or []:
            shard, sequence = self._append(stream, entry)
            results.append({"ShardId": shard.shard_id, "SequenceNumber": str(sequence)})
        self.on_put()
        return json.dumps({"FailedRecordCount": 0, "Records": results}).encode()

    def _append(self, stream: Stream, entry: dict[str, Any]) -> tuple[Shard, int]:
        """One record at the end of its shard (by explicit hash key, or the MD5 of the
        partition key as Kinesis routes), arriving now."""
        try:
            key = str(entry["PartitionKey"])
            data = str(entry["Data"])
            explicit = entry.get("ExplicitHashKey")
            hash_key = int(explicit) if explicit is not None else int.from_bytes(
                hashlib.md5(key.encode(), usedforsecurity=False).digest(), "big")
        except (KeyError, ValueError):
            raise KinesisError("ValidationException", "a record needs Data and a "
                               "PartitionKey") from None
        shard = next(s for s in stream.shards
                     if s.starting_hash_key <= hash_key <= s.ending_hash_key)
        if not shard.live:
            # Answers built while this was the tip would end before the new records.
            shard.live = True
            shard.pages.clear()
            shard.events.clear()
        offset = len(shard.sequence_numbers)
        sequence = (shard.sequence_numbers[-1] if offset else FIRST_SEQUENCE) + 100_000
        arrival = round(time.time() * 1000)
        shard.sequence_numbers.append(sequence)
        shard.arrivals_ms.append(arrival)
        shard.sizes.append(len(base64.b64decode(data)))
        shard.fragments.append(json.dumps({
            "SequenceNumber": str(sequence), "ApproximateArrivalTimestamp": arrival / 1000,
            "Data": data, "PartitionKey": key}, separators=(",", ":")).encode())
        return shard, sequence

    def list_shards(self, params: dict[str, Any]) -> bytes:
        token = params.get("NextToken")
        if token is not None:
            if "StreamName" in params or "StreamARN" in params:
                raise KinesisError("InvalidArgumentException",
                                   "NextToken and StreamName cannot be provided together.")
            try:
                stream_index, start = base64.b64decode(str(token)).decode().split(":")
                stream = self.streams[int(stream_index)]
                first = int(start)
            except (ValueError, IndexError):
                raise KinesisError("InvalidArgumentException", "Invalid NextToken.") from None
        else:
            stream = self._stream(params)
            first = 0
            after = params.get("ExclusiveStartShardId")
            if after is not None:
                first = bisect.bisect_right([s.shard_id for s in stream.shards], after)
        limit = params.get("MaxResults", 1000)
        if not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise KinesisError("InvalidArgumentException", f"Invalid MaxResults: {limit}")
        shards = stream.shards[first:first + limit]
        answer: dict[str, Any] = {"Shards": [s.description() for s in shards]}
        if first + limit < len(stream.shards):
            answer["NextToken"] = base64.b64encode(
                f"{stream.index}:{first + limit}".encode()).decode()
        return json.dumps(answer).encode()

    def describe_stream(self, params: dict[str, Any]) -> bytes:
        stream = self._stream(params)
        limit = params.get("Limit", 100)
        after = params.get("ExclusiveStartShardId")
        first = 0 if after is None else bisect.bisect_right(
            [s.shard_id for s in stream.shards], after)
        shards = stream.shards[first:first + limit]
        return json.dumps({"StreamDescription": {
            **self._summary(stream),
            "Shards": [s.description() for s in shards],
            "HasMoreShards": first + limit < len(stream.shards),
        }}).encode()

    def describe_stream_summary(self, params: dict[str, Any]) -> bytes:
        stream = self._stream(params)
        return json.dumps({"StreamDescriptionSummary": {
            **self._summary(stream),
            "OpenShardCount": len(stream.shards),
            "ConsumerCount": 0,
            "StreamModeDetails": {"StreamMode": "PROVISIONED"},
        }}).encode()

    def _summary(self, stream: Stream) -> dict[str, Any]:
        return {
            "StreamName": stream.name,
            "StreamARN": stream.arn,
            "StreamStatus": "ACTIVE",
            "RetentionPeriodHours": 24,
            "StreamCreationTimestamp": FIRST_ARRIVAL_MS / 1000 - 3600,
            "EnhancedMonitoring": [{"ShardLevelMetrics": []}],
            "EncryptionType": "NONE",
        }


# -- HTTP/1.1 over asyncio: just enough for botocore, urllib3 and aiohttp ---------------------

#: the X-Amz-Target of the one streamed operation
_SUBSCRIBE = b"Kinesis_20131202.SubscribeToShard"
#: at the tip, an empty event this often, as AWS keeps an idle subscription going
HEARTBEAT_S = 5.0


class _Wakeup:
    """``Replay.on_put`` on the server's loop: wakes every subscription waiting at a tip."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self) -> None:
        fired, self.event = self.event, asyncio.Event()
        fired.set()


def _answer(writer: asyncio.StreamWriter, status: int, answer: bytes, request_id: int,
            close: bool) -> None:
    writer.write(b"".join((
        b"HTTP/1.1 200 OK\r\n" if status == 200 else b"HTTP/1.1 400 Bad Request\r\n",
        b"Content-Type: ", _JSON, b"\r\nContent-Length: ", str(len(answer)).encode(),
        b"\r\nx-amzn-RequestId: replay-", str(request_id).encode(),
        b"\r\nConnection: close\r\n\r\n" if close else b"\r\n\r\n",
    )))
    writer.write(answer)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%b\r\n" % (len(data), data))


async def _subscription(replay: Replay, body: bytes, writer: asyncio.StreamWriter,
                        request_id: int) -> None:
    """One SubscribeToShard: events as the client reads them, until ``subscription_s``."""
    try:
        shard, offset = replay.subscription(json.loads(body or b"{}"))
    except (ValueError, KinesisError) as exc:
        code, message = ((exc.code, exc.message) if isinstance(exc, KinesisError)
                         else ("SerializationException", "body is not JSON"))
        _answer(writer, 400, json.dumps({"__type": code, "message": message}).encode(),
                request_id, close=True)
        await writer.drain()
        return
    wakeup = replay.on_put if isinstance(replay.on_put, _Wakeup) else None
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.amazon.eventstream\r\n"
                 b"Transfer-Encoding: chunked\r\nx-amzn-RequestId: replay-%d\r\n"
                 b"Connection: close\r\n\r\n" % request_id)
    _chunk(writer, INITIAL_RESPONSE)
    loop = asyncio.get_running_loop()
    ends = loop.time() + replay.subscription_s
    while (left := ends - loop.time()) > 0:
        if offset >= len(shard.fragments) and wakeup is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.event.wait(), min(HEARTBEAT_S, left))
        elif offset >= len(shard.fragments):
            await asyncio.sleep(min(HEARTBEAT_S, left))
        frame, offset = event(shard, offset)
        _chunk(writer, frame)
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _serve_connection(replay: Replay, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
    request_id = 0
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            length = 0
            target = ""
            close = False
            subscribe = False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"x-amz-target":
                    target = value.strip().decode("latin-1")
                    subscribe = value.strip() == _SUBSCRIBE
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
                elif name == b"expect" and value.strip().lower() == b"100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await reader.readexactly(length) if length else b""
            request_id += 1
            if subscribe:
                await _subscription(replay, body, writer, request_id)
                return
            status, answer = replay.handle(target, body)
            _answer(writer, status, answer, request_id, close)
            await writer.drain()
            if close:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


class ReplayServer:
    """The server on an event loop in a daemon thread of this process (tests, tools)."""

    def __init__(self, streams: Sequence[Stream], port: int = 0) -> None:
        self.replay = Replay(streams)
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> ReplayServer:
        self._server = self._loop.run_until_complete(self._listen())
        self.url = f"http://{HOST}:{self._server.sockets[0].getsockname()[1]}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="kclpy-replay",
                                        daemon=True)
        self._thread.start()
        return self

    async def _listen(self) -> asyncio.base_events.Server:
        self.replay.on_put = _Wakeup()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # stop() ends idle keep-alive connections by cancelling them. A connection task
            # that ends cancelled makes asyncio's streams log a CancelledError traceback
            # (Python 3.11), so it ends normally instead.
            with contextlib.suppress(asyncio.CancelledError):
                await _serve_connection(self.replay, reader, writer)

        # A large stream limit: only request heads go through readuntil.
        return await asyncio.start_server(handler, HOST, self._port, backlog=1024)

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return

        async def close(server: asyncio.base_events.Server) -> None:
            # Connections kept alive by clients still wait for their next request: end them
            # here, or they would be cut off by the loop closing under them.
            server.close()
            connections = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in connections:
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(self._server), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._server = None

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _arrival(value: str) -> int | str:
    return value if value == "now" else int(value)


def main(argv: Sequence[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--stream", action="append", type=StreamSpec.parse, required=True,
                      help="NAME:SHARDS:RECORDS_PER_SHARD:SIZE[:kpl]; repeat for more streams")
    args.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args.add_argument("--seed", type=int, default=7)
    args.add_argument("--last-arrival-ms", type=_arrival,
                      help="epoch ms at which each shard's last record arrived, or 'now' for "
                           "the moment this process starts building (default: a fixed time in "
                           "the past)")
    args.add_argument("--subscription-s", type=float, default=300.0,
                      help="SubscribeToShard subscriptions end after this (AWS: 300)")
    options = args.parse_args(argv)
    # 'now' is read here, after the interpreter started and imported: a reader whose lag
    # bound is a few seconds must find the newest record inside it however slow that was.
    last_arrival_ms = (round(time.time() * 1000) if options.last_arrival_ms == "now"
                       else options.last_arrival_ms)
    streams = [build_stream(i, spec, options.seed, last_arrival_ms)
               for i, spec in enumerate(options.stream)]
    replay = Replay(streams)
    replay.subscription_s = options.subscription_s

    async def serve() -> None:
        replay.on_put = _Wakeup()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _serve_connection(replay, reader, writer)

        server = await asyncio.start_server(handler, HOST, options.port, backlog=1024)
        print(f"http://{HOST}:{server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
