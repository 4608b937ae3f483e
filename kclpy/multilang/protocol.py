"""The MultiLangDaemon JSON-lines protocol, as the Java daemon writes it and amazon_kclpy reads it.

Each message is one JSON object on one line. The shapes copy the Java daemon's
(``software.amazon.kinesis.multilang.messages``) field for field, nulls included, because
amazon_kclpy's decoder indexes the fields directly: an ``initialize`` without
``sequenceNumber`` or a record without ``action: "record"`` crashes the child instead of
being tolerated.

The child answers every message with ``{"action": "status", "responseFor": <action>}`` and,
while handling ``processRecords``, ``shardEnded`` or ``shutdownRequested``, may first send any
number of ``{"action": "checkpoint", ...}`` requests, each answered with a ``checkpoint``
message whose ``error`` is the Java exception name (or null).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kclpy.errors import KCLError
from kclpy.records import Record

INITIALIZE = "initialize"
PROCESS_RECORDS = "processRecords"
LEASE_LOST = "leaseLost"
SHARD_ENDED = "shardEnded"
SHUTDOWN_REQUESTED = "shutdownRequested"
CHECKPOINT = "checkpoint"
STATUS = "status"
RECORD = "record"

#: The most JSON one ``processRecords`` line may hold, partition keys and all (a record larger
#: than that travels alone). The Java daemon sends a GetRecords page as one line; a page of
#: 10 MiB of tiny KPL user records would make a line of 700 MiB, and one per shard at once.
MAX_MESSAGE_BYTES = 4 * 2**20

#: the actions the daemon sends that the child acknowledges with a status message
DAEMON_ACTIONS = frozenset({INITIALIZE, PROCESS_RECORDS, LEASE_LOST, SHARD_ENDED,
                            SHUTDOWN_REQUESTED})


class ProtocolError(KCLError):
    """The child wrote a line that breaks the protocol. ``line`` is what it wrote."""

    def __init__(self, message: str, line: str) -> None:
        super().__init__(message)
        self.line = line


class StrayLine(ProtocolError):
    """A line that is not a protocol message at all (a ``print`` on stdout, say), as opposed
    to a message that is one but is malformed. The Java daemon skips these; kclpy may too."""


@dataclass(frozen=True)
class StatusMessage:
    """The child finished handling ``response_for``."""

    response_for: str


@dataclass(frozen=True)
class CheckpointRequest:
    """The child asks to checkpoint; ``None`` sequence number means "the last record delivered"
    (or SHARD_END in shardEnded), as ``checkpointer.checkpoint()`` without arguments does."""

    sequence_number: str | None
    sub_sequence_number: int | None


ChildMessage = StatusMessage | CheckpointRequest


def _dump(message: dict[str, Any]) -> str:
    # Compact and ASCII-only: a payload of any content stays one line, and the line is the
    # same bytes whatever the child's locale.
    return json.dumps(message, separators=(",", ":"))


def encode_initialize(shard_id: str, sequence_number: str | None,
                      sub_sequence_number: int | None) -> str:
    """``sequence_number`` is the checkpoint the shard resumes from (a sentinel such as
    ``TRIM_HORIZON`` included); the Java daemon sends a sub-sequence number whenever it sends
    a sequence number, and amazon_kclpy documents it as never null then."""
    if sequence_number is not None and sub_sequence_number is None:
        sub_sequence_number = 0
    return _dump({"action": INITIALIZE, "shardId": shard_id, "sequenceNumber": sequence_number,
                  "subSequenceNumber": sub_sequence_number})


def encode_record(record: Record) -> dict[str, Any]:
    """One record as the Java daemon's ``JsonFriendlyRecord``: base64 ``data`` and
    ``approximateArrivalTimestamp`` in epoch milliseconds."""
    return {
        "action": RECORD,
        "data": record.data,
        "partitionKey": record.partition_key,
        "sequenceNumber": record.sequence_number,
        "subSequenceNumber": record.sub_sequence_number,
        "approximateArrivalTimestamp": record.timestamp_millis,
    }


# What a record's JSON object costs besides its strings' contents and its two numbers (and
# the comma after it).
_RECORD_OVERHEAD = len(_dump({
    "action": RECORD, "data": "", "partitionKey": "", "sequenceNumber": "",
    "subSequenceNumber": 0, "approximateArrivalTimestamp": 0})) - 2 + 1
_KEY_CACHE_SIZE = 65_536


def split_process_records(
    records: Iterable[Record], millis_behind_latest: int | None,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Iterator[tuple[str, Record | None]]:
    """One batch as ``processRecords`` lines of at most ``max_bytes`` each (a record larger
    than that alone in its line), in order, with the last record of each: the checkpoint a
    child's ``checkpoint()`` without arguments may take while it handles that line. An empty
    batch is one line without records.

    Records are encoded one at a time and each line once, so what is held at a time is one
    line's worth, whatever the batch holds. A line's size is known before it is made: each
    record's strings are base64, digits and its partition key, whose JSON (escapes and all)
    is measured once per key.
    """
    head = len(_dump({"action": PROCESS_RECORDS, "records": [],
                      "millisBehindLatest": millis_behind_latest}))
    key_sizes: dict[str, int] = {}
    chunk: list[dict[str, Any]] = []
    size = head
    last: Record | None = None
    for record in records:
        encoded = encode_record(record)
        key = encoded["partitionKey"]
        key_size = key_sizes.get(key)
        if key_size is None:
            if len(key_sizes) >= _KEY_CACHE_SIZE:
                key_sizes.clear()
            key_size = key_sizes[key] = len(json.dumps(key)) - 2
        # str(None) is as long as JSON's null
        cost = (_RECORD_OVERHEAD + len(encoded["data"]) + key_size
                + len(encoded["sequenceNumber"]) + len(str(encoded["subSequenceNumber"]))
                + len(str(encoded["approximateArrivalTimestamp"])))
        if last is not None and size + cost > max_bytes:
            yield _process_records_line(chunk, millis_behind_latest), last
            chunk, size = [], head
        chunk.append(encoded)
        size += cost
        last = record
    yield _process_records_line(chunk, millis_behind_latest), last


def _process_records_line(encoded: list[dict[str, Any]], millis_behind_latest: int | None
                          ) -> str:
    return _dump({"action": PROCESS_RECORDS, "records": encoded,
                  "millisBehindLatest": millis_behind_latest})


def encode_lease_lost() -> str:
    return _dump({"action": LEASE_LOST})


def encode_shard_ended() -> str:
    return _dump({"action": SHARD_ENDED})


def encode_shutdown_requested() -> str:
    return _dump({"action": SHUTDOWN_REQUESTED})


def encode_checkpoint_reply(sequence_number: str | None, sub_sequence_number: int | None,
                            error: str | None) -> str:
    """The answer to a checkpoint request: it echoes the request, and ``error`` is the Java
    exception name (``ShutdownException``, ...) that amazon_kclpy raises as
    ``CheckpointError(error)`` in the child, or null when the checkpoint was written."""
    return _dump({"action": CHECKPOINT, "sequenceNumber": sequence_number,
                  "subSequenceNumber": sub_sequence_number, "error": error})


def decode_child_line(line: str) -> ChildMessage | None:
    """Parse one line of the child's stdout. None for a blank line: amazon_kclpy writes
    ``"\\n<message>\\n"`` so that stray output cannot share a line with a message, which
    leaves blank lines between messages.

    Raises StrayLine for a line that is not a JSON message object and ProtocolError for a
    message the child must not send, with fields of the wrong type, or nested too deeply to
    parse.
    """
    text = line.strip()
    if not text:
        return None
    try:
        message = json.loads(text)
    except ValueError:
        raise StrayLine("not JSON", line) from None
    except RecursionError:
        # JSON nested deeper than Python's recursion limit: a broken message, handled as
        # one (the child is restarted), not an exception escaping the exchange mid-message
        raise ProtocolError("a JSON message nested too deeply", line) from None
    if not isinstance(message, dict) or not isinstance(message.get("action"), str):
        raise StrayLine("not a JSON object with an action", line)
    action = message["action"]
    if action == STATUS:
        response_for = message.get("responseFor")
        if not isinstance(response_for, str):
            raise ProtocolError("status message without a responseFor action", line)
        return StatusMessage(response_for)
    if action == CHECKPOINT:
        return CheckpointRequest(_sequence_number(message, line),
                                 _sub_sequence_number(message, line))
    raise ProtocolError(f"unexpected action {action!r} from the child", line)


def _sequence_number(message: dict[str, Any], line: str) -> str | None:
    value = message.get("sequenceNumber")
    # The Java daemon reads it into a String, which accepts a JSON number too; v1 processors
    # that pass int(record["sequenceNumber"]) rely on that.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ProtocolError(f"checkpoint sequenceNumber {value!r} is not a string", line)


def _sub_sequence_number(message: dict[str, Any], line: str) -> int | None:
    value = message.get("subSequenceNumber")
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ProtocolError(f"checkpoint subSequenceNumber {value!r} is not an integer", line)
