"""KPL de-aggregation: one Kinesis record carrying many user records.

Wire format (amazon-kinesis-producer's aggregation-format.md): the 4-byte magic
``f3 89 9a c2``, a protobuf ``AggregatedRecord`` (partition-key table, explicit-hash-key
table, sub-records pointing into the tables), then the 16-byte MD5 of the protobuf bytes.

Where this differs from the Java KCL's ``AggregatorUtil.deaggregate`` it is because the Java
code can lose or half-deliver records: there, an aggregate whose sub-record points outside a
key table is logged and its sub-records up to that point are delivered (the rest are lost),
and an aggregate without sub-records delivers nothing. Here both are delivered once as the
original raw record and counted in ``corrupt``, like a bad MD5 or an undecodable protobuf.

The Java KCL also drops a whole aggregate when one of its sub-records' hash keys lies outside
the shard's range. That rule suits the KPL, which predicts each record's shard and sends again
what it mispredicted; aws-kinesis-agg's ``RecordAggregator`` (the Python producer) puts
sub-records of any key in one aggregate under the first one's key, and the rule drops them
all, for good. So here it is off unless asked for (``filter_outside``): every sub-record is
delivered, and a KPL misprediction costs at worst a duplicate, which at-least-once allows.
Every reader of shards (the worker's fetcher, lag recovery's gap reader, the Spark source)
de-aggregates through :func:`deaggregate` and so follows the same rule.

Kinesis checks its partition-key limit (1 to 256 characters) and its explicit-hash-key form
(a decimal of at most 39 digits) on the outer record only: inside an aggregate anything goes,
and the MD5 proves nothing (anyone can compute it). A producer could thus share one
500,000-character key among 85,000 empty sub-records, and whatever copies the key per record
(a MultiLang message, an Arrow column) would need 40 GiB for one 1 MiB record. So an aggregate
is expanded only if its tables keep Kinesis' own limits and it stays within what a KPL
aggregate can hold (:data:`MAX_SUB_RECORDS`, :data:`MAX_EXPANSION`); otherwise it is delivered
raw and counted, like any other corrupt aggregate, with a reason (:data:`CORRUPT_REASONS`).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from aws_kinesis_agg import config_pb2
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from kclpy.records import (
    Record,
    Records,
    UserRecords,
    WireRecords,
    all_wire_records,
    is_wire_record,
    wire_b64,
)

# aws-kinesis-agg's generated messages_pb2 does a top-level ``import config_pb2`` (it was
# generated without a package path). The library's own modules make that work by putting
# their folder on sys.path, which lets every module in that folder shadow top-level names
# for the whole process. Registering the package's config_pb2 under the name the generated
# code asks for resolves the import without touching sys.path. setdefault: if
# aws_kinesis_agg.aggregator was imported first, its config_pb2 is already there and fine.
sys.modules.setdefault("config_pb2", config_pb2)

# Re-exported: importing it from here is the way that needs no sys.path or sys.modules care.
from aws_kinesis_agg.messages_pb2 import AggregatedRecord  # noqa: E402

__all__ = [
    "CORRUPT_REASONS",
    "MAGIC",
    "MAX_EXPANSION",
    "MAX_PARTITION_KEY_CHARS",
    "MAX_SUB_RECORDS",
    "AggregatedRecord",
    "DeaggregationResult",
    "HashKeyRange",
    "deaggregate",
    "is_aggregated",
]

MAGIC = b"\xf3\x89\x9a\xc2"
_DIGEST_SIZE = 16
_MIN_SIZE = len(MAGIC) + _DIGEST_SIZE
# base64 of the magic: "84ma" encodes f3 89 9a, "w" the top 6 bits of c2, and the next
# character carries c2's low bits "10", which only the characters g..v have.
_B64_PREFIX = "84maw"
_B64_SIXTH = frozenset("ghijklmnopqrstuv")
_MAX_HASH_KEY = 2**128 - 1
#: partition keys whose verdict a HashKeyRange keeps (a few MB at most)
_MAX_VERDICTS = 65_536

#: Kinesis' limit on a partition key, in characters (PutRecord refuses a longer one)
MAX_PARTITION_KEY_CHARS = 256
#: Kinesis' form of an explicit hash key: a decimal of at most 39 digits (2**128 - 1 has 39)
_EXPLICIT_HASH_KEY = re.compile(r"[0-9]{1,39}")
#: The most sub-records an aggregate may hold: what the KPL's largest aggregate (1 MiB,
#: the ceiling of its ``AggregationMaxSize``) can hold, each sub-record taking at least 6
#: bytes of it (its tag and length, the key index and an empty payload).
MAX_SUB_RECORDS = 2**20 // 6
#: How many times its own size an aggregate may grow to when expanded, counting for each
#: sub-record its payload and its keys in UTF-8 (what copying them per record costs). A
#: sub-record takes at least 6 bytes of the aggregate, so with ASCII keys within Kinesis'
#: 256 characters it grows at most 43 times (256 / 6): only keys of more than 384 UTF-8
#: bytes shared by (near-)empty sub-records reach this bound.
MAX_EXPANSION = 64

#: Why an aggregate was delivered raw (the ``reason`` label of kclpy_deaggregation_errors):
#: ``malformed`` (too short, bad MD5, undecodable, a key not UTF-8, no sub-records, a table
#: index out of range), ``key_limits`` (a partition key longer than 256 characters or an
#: explicit hash key that is not a decimal of at most 39 digits), ``too_large`` (more than
#: :data:`MAX_SUB_RECORDS` sub-records, or expanding to more than :data:`MAX_EXPANSION` times
#: its size).
MALFORMED = "malformed"
KEY_LIMITS = "key_limits"
TOO_LARGE = "too_large"
CORRUPT_REASONS = (MALFORMED, KEY_LIMITS, TOO_LARGE)

_parse_aggregate = AggregatedRecord.FromString
_md5 = hashlib.md5


def _column_schema() -> Callable[[bytes | memoryview], Any]:
    """A parser that reads an ``AggregatedRecord``'s sub-records as columns.

    The same field numbers as the KPL schema, but ``records`` is a single (not repeated)
    message whose fields are all repeated. Protobuf merges the occurrences of a non-repeated
    message field and appends to repeated ones, so one C-level parse turns the sub-records
    into a list of key indexes and a list of payloads, in order, instead of one Python
    wrapper object and two attribute reads per sub-record.

    Merging loses which sub-record a value came from; the columns are used only once
    :func:`_canonical` has shown that every sub-record holds exactly one of each.
    """
    proto = descriptor_pb2.FileDescriptorProto(
        name="kclpy_kpl_columns.proto", package="kclpy.kpl", syntax="proto2")
    f = descriptor_pb2.FieldDescriptorProto
    columns = proto.message_type.add(name="Columns")
    columns.field.add(name="partition_key_index", number=1, label=f.LABEL_REPEATED,
                      type=f.TYPE_UINT64)
    columns.field.add(name="explicit_hash_key_index", number=2, label=f.LABEL_REPEATED,
                      type=f.TYPE_UINT64)
    columns.field.add(name="data", number=3, label=f.LABEL_REPEATED, type=f.TYPE_BYTES)
    aggregate = proto.message_type.add(name="AggregatedColumns")
    aggregate.field.add(name="partition_key_table", number=1, label=f.LABEL_REPEATED,
                        type=f.TYPE_STRING)
    aggregate.field.add(name="explicit_hash_key_table", number=2, label=f.LABEL_REPEATED,
                        type=f.TYPE_STRING)
    aggregate.field.add(name="records", number=3, label=f.LABEL_OPTIONAL,
                        type=f.TYPE_MESSAGE, type_name=".kclpy.kpl.Columns")
    # A private pool: nothing else in the process can see or clash with these names.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    message = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kclpy.kpl.AggregatedColumns"))
    parse: Callable[[bytes | memoryview], Any] = message.FromString
    return parse


_parse_columns = _column_schema()


@dataclass(slots=True)
class DeaggregationResult:
    """User records in order, and what did not come out as user records.

    ``corrupt``: aggregates delivered as ONE raw record (the original object) because they
    were too short, failed their MD5, did not decode, lacked a required protobuf field, had
    a key that is not valid UTF-8, had no sub-records, had a table index that is not valid,
    had a key beyond Kinesis' limits or would expand beyond what a KPL aggregate can hold;
    ``reasons`` counts them by :data:`CORRUPT_REASONS`.
    ``filtered``: sub-records dropped by hash-key filtering (only with ``filter_outside``,
    see :func:`deaggregate`); whoever asked for it logs them at WARNING.
    """

    records: Records
    corrupt: int
    filtered: int
    reasons: Counter[str] = field(default_factory=Counter)


def is_aggregated(record: Record) -> bool:
    """Whether the record's payload starts with the KPL magic (the MD5 is not checked).

    A record still holding base64 text from the wire is recognised by the magic's base64
    prefix, so a plain record stays undecoded.
    """
    if not is_wire_record(record):
        return record.binary_data.startswith(MAGIC)
    # Going through binary_data would decode every plain record just to look at four bytes.
    b64 = wire_b64(record)
    return b64.startswith(_B64_PREFIX) and b64[5:6] in _B64_SIXTH


def deaggregate(
    records: Iterable[Record],
    starting_hash_key: int | None = None,
    ending_hash_key: int | None = None,
    *,
    key_range: HashKeyRange | None = None,
    filter_outside: bool = False,
) -> DeaggregationResult:
    """Expand KPL aggregates into their user records; other records pass through as they are.

    Each sub-record gets the parent's ``sequence_number`` and arrival time,
    ``sub_sequence_number`` = its index in the aggregate, its partition key and explicit hash
    key from the aggregate's tables, and its payload as raw bytes.

    Never raises on record contents and never drops silently: every input record comes out
    either as all its user records, as itself (not an aggregate, or ``corrupt``), or as
    ``filtered`` sub-records. An aggregate with zero sub-records counts as corrupt and is
    delivered raw, so its sequence number still reaches the processor and the checkpoint.

    Filtering, the Java KCL's rule, only with ``filter_outside`` (without it the bounds are
    not looked at, and no partition key is hashed): a sub-record's effective hash key is its
    explicit hash key, else the MD5 of its UTF-8 partition key as a 128-bit big-endian
    integer. If any sub-record's key lies outside [starting_hash_key, ending_hash_key] (a
    missing bound is 0 or 2**128-1), the WHOLE aggregate is dropped and all its sub-records
    are counted in ``filtered``. Meant for a KPL that aggregated for a stale shard map: it
    notices the aggregate landed on an unexpected shard and re-sends its user records.
    aws-kinesis-agg never re-sends, so there the rule loses records (the module docstring).
    A caller that reads one shard page after page passes the shard's :class:`HashKeyRange`
    as ``key_range`` instead of the bounds, so the MD5s of recurring partition keys are
    computed once.
    """
    bounds = key_range if filter_outside else None
    if filter_outside and bounds is None and (
            starting_hash_key is not None or ending_hash_key is not None):
        bounds = HashKeyRange(starting_hash_key, ending_hash_key)
    # A page as the parser leaves it: if no text starts like an aggregate, the page goes
    # through as it is, rows and all.
    if isinstance(records, WireRecords) and _no_aggregate_text(records.texts()):
        return DeaggregationResult(Records([records]), 0, 0)
    records = list(records)
    if all_wire_records(records) and _no_aggregate_text(map(wire_b64, records)):
        return DeaggregationResult(Records([records]), 0, 0)
    parts: list[list[Record] | UserRecords] = []
    run: list[Record] = []
    reasons: Counter[str] = Counter()
    filtered = 0
    for record in records:
        if not is_aggregated(record):
            run.append(record)
            continue
        expanded = _expand(record)
        if isinstance(expanded, str):
            run.append(record)
            reasons[expanded] += 1
            continue
        users, keys = expanded
        # Every key of the table in range: then so is every sub-record (they can only use
        # keys of the table). Otherwise look at the sub-records themselves, since a key
        # that no sub-record uses must not get the aggregate filtered.
        verdict = True
        if bounds is not None and not (keys is not None and bounds.keys_in_range(keys)):
            verdict = bounds.users_in_range(users)
        if verdict:
            if run:
                parts.append(run)
                run = []
            parts.append(users)
        else:
            filtered += len(users)
    if run:
        parts.append(run)
    return DeaggregationResult(Records(parts), reasons.total(), filtered, reasons)


def _expand(record: Record) -> tuple[UserRecords, list[str] | None] | str:
    """The aggregate's user records and, when none of them has an explicit hash key, the
    partition-key table; or, if the aggregate is corrupt in any way, why (one of
    :data:`CORRUPT_REASONS`).

    Nothing is delivered from an aggregate until all of it checked out, so a bad aggregate
    is never half-delivered. A table index out of range surfaces as the IndexError of the
    table lookup (indexes are unsigned, so never negative).
    """
    try:
        blob = record.binary_data
        if len(blob) <= _MIN_SIZE:
            return MALFORMED
        # A view, not a slice: a slice would copy the whole aggregate once more.
        body = memoryview(blob)[len(MAGIC) : -_DIGEST_SIZE]
        if _md5(body).digest() != blob[-_DIGEST_SIZE:]:
            return MALFORMED
        aggregate = _parse_aggregate(body)
        if not aggregate.records:
            return MALFORMED
        if aggregate.explicit_hash_key_table or not _canonical(aggregate, blob):
            # upb does not enforce proto2 "required" on parse; protobuf-java, which the Java
            # KCL uses, rejects such a message, and a sub-record without its data or key
            # index would otherwise come out as an empty payload or the first partition key.
            if not aggregate.IsInitialized():
                return MALFORMED
            return _expand_checked(record, aggregate, len(blob))
        columns = _parse_columns(body)
        subs = columns.records
        key_indexes = subs.partition_key_index
        if subs.explicit_hash_key_index:
            # An explicit-hash-key index with no table to point into.
            return MALFORMED
        # A list built once: indexing the protobuf container would make a new str per
        # sub-record. upb hands back bytes, not str, for a proto2 string that is not valid
        # UTF-8; the KPL only writes text, so such a table means a damaged aggregate, and
        # str.join rejects it (TypeError) in one C call. Containers are copied out by
        # slicing: list() would go through the iterator protocol, one call per item (about
        # three times the cost for the payloads).
        pks = columns.partition_key_table[:]
        "".join(pks)
        data = subs.data[:]
        pk_keys = list(map(pks.__getitem__, key_indexes[:]))
        refused = _beyond_limits(pks, (), data, pk_keys, None, len(blob))
        if refused is not None:
            return refused
        users = UserRecords(record.sequence_number, record._arrival_s, data, pk_keys)
    # The payload is untrusted bytes (an MD5 is no signature): whatever base64, the protobuf
    # runtime or a table lookup raise on it (binascii.Error, DecodeError, EncodeError,
    # IndexError, TypeError) means "not a usable aggregate".
    except Exception:
        return MALFORMED
    return users, pks


def _beyond_limits(pks: Sequence[str], ehks: Sequence[str], data: list[bytes],
                   pk_column: list[str], ehk_column: list[str | None] | None,
                   size: int) -> str | None:
    """Why the aggregate must not be expanded (:data:`KEY_LIMITS` or :data:`TOO_LARGE`), or
    None if it may be.

    The tables are checked whole (the KPL writes no entry that no sub-record uses), in C
    calls. The expanded size is first bounded from above by the longest keys; only an
    aggregate whose bound exceeds :data:`MAX_EXPANSION` has its sub-records' keys summed.
    """
    longest_key = max(map(len, pks), default=0)
    if longest_key > MAX_PARTITION_KEY_CHARS:
        return KEY_LIMITS
    if ehks and not all(map(_EXPLICIT_HASH_KEY.fullmatch, ehks)):
        return KEY_LIMITS
    count = len(data)
    if count > MAX_SUB_RECORDS:
        return TOO_LARGE
    # A key is at most 4 UTF-8 bytes a character, an explicit hash key 39 ASCII bytes.
    longest = 4 * longest_key + (39 if ehks else 0)
    allowed = MAX_EXPANSION * size
    if size + count * longest <= allowed:
        return None
    key_bytes = {key: len(key.encode("utf-8")) for key in pks}
    expanded = sum(map(len, data)) + sum(map(key_bytes.__getitem__, pk_column))
    if ehk_column is not None:
        expanded += sum(len(key) for key in ehk_column if key is not None)
    return TOO_LARGE if expanded > allowed else None


def _canonical(aggregate: Any, blob: bytes) -> bool:
    """True if encoding the parsed aggregate again gives back its bytes exactly.

    What makes the columns safe to use. Encoding raises ``EncodeError`` if a sub-record lacks
    its key index or payload (proto2 ``required``); and a field that appears twice in a
    sub-record comes back once (the parse keeps the last), so the bytes differ. Equal bytes
    thus mean exactly one key index and one payload per sub-record, and the values of each
    column line up with the sub-records. Everything the KPL writes passes (its encoder
    writes fields in order, once, with the shortest varints); anything else takes
    :func:`_expand_checked`. One C-level encode and compare, about half of what
    ``IsInitialized`` costs.
    """
    encoded = aggregate.SerializeToString()
    return len(encoded) == len(blob) - _MIN_SIZE and blob.startswith(encoded, len(MAGIC))


def _expand_checked(
    record: Record, aggregate: Any, size: int
) -> tuple[UserRecords, list[str] | None] | str:
    """The general case, explicit hash keys or a repeated field: a ``HasField`` per
    sub-record (an explicit-hash-key index must be told apart from an absent one, which
    reads as 0)."""
    try:
        pks = list(aggregate.partition_key_table)
        ehks = list(aggregate.explicit_hash_key_table)
        "".join(pks)
        "".join(ehks)
        subs = aggregate.records
        data = [sub.data for sub in subs]
        pk_column = [pks[sub.partition_key_index] for sub in subs]
        ehk_column = [ehks[sub.explicit_hash_key_index]
                      if sub.HasField("explicit_hash_key_index") else None for sub in subs]
        refused = _beyond_limits(pks, ehks, data, pk_column, ehk_column, size)
        if refused is not None:
            return refused
        users = UserRecords(record.sequence_number, record._arrival_s, data, pk_column,
                            ehk_column)
    except Exception:
        return MALFORMED
    return users, None


def _no_aggregate_text(texts: Iterable[str]) -> bool:
    """True if no base64 text starts like the magic's base64: then no record holding one
    can be an aggregate. The prefix half of :func:`is_aggregated`, made in C over a whole
    page: a page of plain records costs no Python call per record."""
    return not any(map(str.startswith, texts, repeat(_B64_PREFIX)))


class HashKeyRange:
    """A shard's hash-key range, and what is known of the partition keys seen so far.

    A partition key's hash key is the MD5 of its UTF-8 bytes, and an MD5 costs more than the
    rest of a user record's de-aggregation; keys recur (a page of 100-byte records can hold
    90,000 records under a few thousand keys), so each verdict is kept, up to
    ``_MAX_VERDICTS`` keys (then the cache starts over: streams keyed by unique ids gain
    nothing from it and must not grow it without bound). Not thread-safe: one per reader.
    """

    __slots__ = ("_everything", "_verdicts", "high", "high_digest", "low", "low_digest")

    def __init__(self, low: int | None, high: int | None) -> None:
        self.low = 0 if low is None else low
        self.high = _MAX_HASH_KEY if high is None else high
        # An MD5 compared as 16 big-endian bytes orders like the 128-bit integer it encodes,
        # so partition keys skip int.from_bytes. Clamped into the 128-bit key space; None
        # when no 128-bit key is in range.
        clamped_low, clamped_high = max(self.low, 0), min(self.high, _MAX_HASH_KEY)
        if clamped_low > clamped_high:
            self.low_digest: bytes | None = None
            self.high_digest: bytes | None = None
        else:
            self.low_digest = clamped_low.to_bytes(16, "big")
            self.high_digest = clamped_high.to_bytes(16, "big")
        #: every MD5 is in range (a stream's only shard): no partition key needs hashing
        self._everything = clamped_low == 0 and clamped_high == _MAX_HASH_KEY
        self._verdicts: dict[str, bool] = {}

    def keys_in_range(self, keys: list[str]) -> bool:
        """True if the MD5 hash key of every partition key in ``keys`` is within range."""
        if self._everything:
            return True
        verdicts = self._verdicts
        try:
            # Every key seen before (the common case): one C-level pass.
            return all(map(verdicts.__getitem__, keys))
        except KeyError:
            pass
        low_digest, high_digest = self.low_digest, self.high_digest
        if low_digest is None or high_digest is None:
            return False
        if len(verdicts) + len(keys) > _MAX_VERDICTS:
            verdicts.clear()
        for pk in keys:
            if pk not in verdicts:
                verdicts[pk] = low_digest <= _md5(pk.encode("utf-8")).digest() <= high_digest
        return all(map(verdicts.__getitem__, keys))

    def users_in_range(self, users: UserRecords) -> bool:
        """True if every user record's effective hash key is within range. Explicit hash keys
        are decimals here: an aggregate with any other is refused before it is expanded."""
        ehks = users.explicit_hash_keys
        if ehks is None:
            return self.keys_in_range(users.partition_keys)
        explicit = {int(k) for k in ehks if k is not None}
        implicit = [pk for pk, k in zip(users.partition_keys, ehks, strict=True) if k is None]
        low, high = self.low, self.high
        return all(low <= k <= high for k in explicit) and self.keys_in_range(implicit)
