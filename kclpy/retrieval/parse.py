"""GetRecords responses parsed by kclpy instead of botocore's generic parser.

botocore's JSON parser walks the output shape for every field of every record, turns each
``Data`` into bytes and each timestamp into a ``datetime``: about 60k records/s, which would
make the parse, not the network, the consumer's bottleneck. Here a successful GetRecords body
goes through one ``orjson.loads`` and becomes rows that :class:`~kclpy.records.WireRecords` turns
into records, in C, as they are read; each keeps its payload as base64 text until read.

Only the parse moves: the request still goes through the botocore client, so signing,
credentials, endpoints, retries and error parsing stay botocore's. A ``before-parse`` handler
takes the body of an HTTP 200 answer, parses it, hands botocore an empty body (so its parser
does no work) and passes the page through ``customized_response_dict``, which botocore merges
into the dict that ``client.get_records`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

import orjson
from botocore.parsers import ResponseParserError

from kclpy.records import Record, WireRecords
from kclpy.retrieval import receive
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


def parse_get_records(body: bytes) -> Page[Sequence[Record]]:
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


def _parse_page(body: bytes, what: str) -> tuple[dict[str, Any], Page[Sequence[Record]]]:
    try:
        # orjson: about 1.5x json.loads on these documents, and json.loads is most of the
        # parse for large payloads.
        doc = orjson.loads(body)
        raw_records = doc["Records"]
        try:
            # Every record's fields in the order of a wire row, picked in C: no Python call
            # per record (records are built from the rows as they are read).
            records = WireRecords(list(map(_wire_fields, raw_records)))
        except KeyError:
            # ApproximateArrivalTimestamp is optional in the API (AWS always sends it).
            records = WireRecords([
                (r["Data"], r["PartitionKey"], r["SequenceNumber"],
                 r.get("ApproximateArrivalTimestamp"))
                for r in raw_records
            ])
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
