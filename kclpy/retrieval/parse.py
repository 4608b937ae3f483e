"""GetRecords responses parsed by kclpy instead of botocore's generic parser.

botocore's JSON parser walks the output shape for every field of every record, turns each
``Data`` into bytes and each timestamp into a ``datetime``: about 60k records/s, which would
make the parse, not the network, the consumer's bottleneck. Here a successful GetRecords body
goes through one ``orjson.loads`` and becomes rows that :class:`~kclpy.records.WireRecords` turns
into records, in C, as they are read; each keeps its payload as base64 text until read. A
page of KPL aggregates is the exception: their payloads are decoded straight from the body,
since de-aggregation reads every one of them at once (:func:`_parse_aggregates`).

Only the parse moves: the request still goes through the botocore client, so signing,
credentials, endpoints, retries and error parsing stay botocore's. A ``before-parse`` handler
takes the body of an HTTP 200 answer, parses it, hands botocore an empty body (so its parser
does no work) and passes the page through ``customized_response_dict``, which botocore merges
into the dict that ``client.get_records`` returns.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import datetime
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

import orjson
from botocore.parsers import ResponseParserError
from pybase64 import b64decode

from kclpy.records import Record, WireRecords, make_bytes_record
from kclpy.retrieval import receive
from kclpy.retrieval.kpl import MAGIC
from kclpy.retrieval.page import ChildShard, Page

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

__all__ = [
    "get_records",
    "install_fast_get_records",
    "parse_get_records",
    "parse_subscribe_event",
]

_EVENT = "before-parse.kinesis.GetRecords"
_HANDLER_ID = "kclpy.retrieval.parse.fast_get_records"
# Private key under which the handler passes the page through botocore's response dict.
_PAGE_KEY = "_kclpy_get_records_page"
_wire_fields = itemgetter("Data", "PartitionKey", "SequenceNumber", "ApproximateArrivalTimestamp")
#: how a record's payload starts in the compact JSON that Kinesis writes
_DATA = b'"Data":"'
#: the first five base64 characters of every KPL aggregate (its magic's; the sixth also
#: depends on the next byte)
_AGGREGATE_TEXT = base64.b64encode(MAGIC)[:5]
_marker, _partition_key, _sequence_number, _arrival = (itemgetter(i) for i in range(4))


def parse_get_records(body: bytes | memoryview) -> Page[Sequence[Record]]:
    """Parse the JSON body of a successful GetRecords answer.

    Records are not de-aggregated and their data is not base64-decoded here: both happen
    later, and only for what is read. ``ApproximateArrivalTimestamp`` (epoch seconds on the
    wire) reads as int epoch milliseconds, as amazon_kclpy reports it.

    Raises botocore's ``ResponseParserError`` if the body is not a GetRecords document, so a
    garbled answer is an error the fetcher retries, never an empty page that reads as
    "no records" or, worse, as shard end.
    """
    doc, page = _parse_page(body, "GetRecords")
    page.next_shard_iterator = doc.get("NextShardIterator")
    return page


def parse_subscribe_event(payload: bytes) -> Page[Sequence[Record]]:
    """Parse a ``SubscribeToShardEvent`` payload (enhanced fan-out) exactly as a GetRecords
    body: its records, lag and child shards are the same JSON. The page's
    ``continuation_sequence_number`` is the event's (None at shard end); its
    ``next_shard_iterator`` is left None, since a subscription has none."""
    doc, page = _parse_page(payload, "SubscribeToShardEvent")
    continuation = doc.get("ContinuationSequenceNumber")
    page.continuation_sequence_number = None if continuation is None else str(continuation)
    return page


def _parse_page(body: bytes | memoryview, what: str
                ) -> tuple[dict[str, Any], Page[Sequence[Record]]]:
    try:
        parsed = _parse_aggregates(body)
        if parsed is None:
            # orjson: about 1.5x json.loads on these documents, and json.loads is most of
            # the parse for large payloads.
            doc = orjson.loads(body)
            records: Sequence[Record] = WireRecords(_rows(doc["Records"]))
        else:
            doc, records = parsed
        child_shards = [
            ChildShard(
                shard_id=c["ShardId"],
                parent_shards=tuple(c["ParentShards"]),
                starting_hash_key=c["HashKeyRange"]["StartingHashKey"],
                ending_hash_key=c["HashKeyRange"]["EndingHashKey"],
            )
            for c in doc.get("ChildShards") or ()
        ]
        return doc, Page(
            records=records,
            millis_behind_latest=doc.get("MillisBehindLatest"),
            child_shards=child_shards,
            size_bytes=len(body),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        # str(e), not repr: a UnicodeDecodeError's repr carries the whole body, records and all.
        raise ResponseParserError(f"not a {what} document: {type(e).__name__}: {e}") from e


def _rows(raw_records: list[dict[str, Any]]) -> list[Any]:
    try:
        # Every record's fields in the order of a wire row, picked in C: no Python call per
        # record (records are built from the rows as they are read).
        return list(map(_wire_fields, raw_records))
    except KeyError:
        # ApproximateArrivalTimestamp is optional in the API (AWS always sends it).
        return [(r["Data"], r["PartitionKey"], r["SequenceNumber"],
                 r.get("ApproximateArrivalTimestamp")) for r in raw_records]


def _parse_aggregates(body: bytes | memoryview) -> tuple[dict[str, Any], list[Record]] | None:
    """A page whose first record is a KPL aggregate, parsed without its payloads' text; None
    for any other page, or whenever this parse is not sure to give what orjson gives.

    Why: an aggregate is about 68 KB of base64 text, which orjson scans and copies into a
    ``str`` that de-aggregation decodes at once and drops: that was a quarter of the CPU of
    a worker reading KPL records. Here the text of every payload is found with ``find``
    (memchr speed) and base64-decoded straight from the body, and orjson parses the rest of
    the document, each payload replaced by a marker (``"#0"``, ``"#1"``, ...).

    Exact, or not taken: inside a JSON string a ``"`` is always escaped, so ``"Data":"``
    in the body can only be a key and the next ``"`` ends its value; every payload must be
    strict base64 (no escape, no other character, as Kinesis writes it) and record ``i``
    of the parsed rest must hold marker ``i``, so no payload is assigned to another record.
    Anything else (another spelling, a ``"Data"`` key elsewhere) takes the plain parse.
    The records hold their payloads as bytes, which is how de-aggregation reads them.
    """
    text = receive.searchable(body)
    size = len(body)
    first = -1 if text is None else text.find(_DATA, 0, size)
    if text is None or first < 0 or not text.startswith(_AGGREGATE_TEXT, first + len(_DATA)):
        return None
    find = text.find
    view = memoryview(text)
    pieces: list[bytes | memoryview] = []
    payloads: list[bytes] = []
    done = 0
    at = first
    try:
        while at >= 0:
            start = at + len(_DATA)
            end = find(b'"', start, size)
            if end < 0:
                return None
            pieces += (view[done:start], b"#%d" % len(payloads))
            payloads.append(b64decode(view[start:end], None, True))
            done = end
            at = find(_DATA, end, size)
        pieces.append(view[done:size])
        rest = b"".join(pieces)
    except ValueError:
        return None
    finally:
        # The body's buffer goes back to the pool after the parse: no view may outlive it.
        pieces.clear()
        view.release()
    try:
        doc = orjson.loads(rest)
        rows = _rows(doc["Records"])
    except (ValueError, KeyError, TypeError):
        # The plain parse says what is wrong with the body.
        return None
    if list(map(_marker, rows)) != [f"#{i}" for i in range(len(payloads))]:
        return None
    # The marker check has shown that rows and payloads line up, one for one.
    records = list(map(make_bytes_record, zip(
        payloads, map(_partition_key, rows), map(_sequence_number, rows), repeat(0),
        map(_arrival, rows), repeat(None))))
    return doc, records


def _before_parse(
    response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any
) -> None:
    # Errors keep botocore's parse: ClientError codes, modelled error fields and the retry
    # handler's view of them stay exactly as without this hook.
    if response_dict["status_code"] != 200:
        return
    body = response_dict["body"]
    try:
        customized_response_dict[_PAGE_KEY] = parse_get_records(body)
    finally:
        # The parsed page holds copies of every value, never the body itself.
        receive.release(body)
    # An empty body is what botocore's JSON parser turns into {} without any work.
    response_dict["body"] = b""


def install_fast_get_records(client: KinesisClient) -> None:
    """Make ``client.get_records`` hand successful bodies to :func:`parse_get_records`.

    Idempotent. After it, the dict ``client.get_records(...)`` returns holds only
    ``ResponseMetadata`` and the private page (read it with :func:`get_records`), not the
    usual ``Records``/``NextShardIterator`` keys. Errors are unchanged. Large bodies are
    received into reused buffers (:mod:`kclpy.retrieval.receive`).
    """
    client.meta.events.register(_EVENT, _before_parse, unique_id=_HANDLER_ID)
    receive.install(client)


def get_records(client: KinesisClient, shard_iterator: str, limit: int
                ) -> Page[Sequence[Record]]:
    """Call GetRecords through ``client`` and return the parsed page.

    Installs the hook if needed. botocore's exceptions (``ClientError`` for throttling,
    ``ExpiredIteratorException`` and the rest, connection errors after botocore's own
    retries) propagate unchanged. When no HTTP body was parsed (botocore's Stubber), the
    page is built from botocore's parsed dict and ``size_bytes`` is 0.
    """
    install_fast_get_records(client)
    response = cast(dict[str, Any], client.get_records(ShardIterator=shard_iterator, Limit=limit))
    page = response.get(_PAGE_KEY)
    if isinstance(page, Page):
        return page
    # No HTTP answer was parsed: botocore's Stubber (or another before-send handler)
    # supplied a ready-made response dict.
    return _page_from_botocore(response)


def _page_from_botocore(response: dict[str, Any]) -> Page[Sequence[Record]]:
    records = [
        Record(
            sequence_number=r["SequenceNumber"],
            partition_key=r["PartitionKey"],
            timestamp_millis=_datetime_millis(r.get("ApproximateArrivalTimestamp")),
            data=r["Data"],
        )
        for r in response["Records"]
    ]
    child_shards = [
        ChildShard(
            shard_id=c["ShardId"],
            parent_shards=tuple(c["ParentShards"]),
            starting_hash_key=c["HashKeyRange"]["StartingHashKey"],
            ending_hash_key=c["HashKeyRange"]["EndingHashKey"],
        )
        for c in response.get("ChildShards", ())
    ]
    return Page(
        records=records,
        millis_behind_latest=response.get("MillisBehindLatest"),
        child_shards=child_shards,
        next_shard_iterator=response.get("NextShardIterator"),
    )


def _datetime_millis(value: datetime | None) -> int | None:
    return None if value is None else round(value.timestamp() * 1000)
