"""KPL de-aggregation: one Kinesis record carrying many user records.

Wire format (amazon-kinesis-producer's aggregation-format.md): the 4-byte magic
``f3 89 9a c2``, a protobuf ``AggregatedRecord`` (partition-key table, explicit-hash-key
table, sub-records pointing into the tables), then the 16-byte MD5 of the protobuf bytes.

Where this differs from the Java KCL's ``AggregatorUtil.deaggregate`` it is because the Java
code can lose or half-deliver records: there, an aggregate whose sub-record points outside a
key table is logged and its sub-records up to that point are delivered (the rest are lost),
and an aggregate without sub-records delivers nothing. Here both are delivered once as the
original raw record and counted in ``corrupt``, like a bad MD5 or an undecodable protobuf.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

from aws_kinesis_agg import config_pb2
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from kclpy.records import Record

# aws-kinesis-agg's generated messages_pb2 does a top-level ``import config_pb2`` (it was
# generated without a package path). The library's own modules make that work by putting
# their folder on sys.path, which lets every module in that folder shadow top-level names
# for the whole process. Registering the package's config_pb2 under the name the generated
# code asks for resolves the import without touching sys.path. setdefault: if
# aws_kinesis_agg.aggregator was imported first, its config_pb2 is already there and fine.
sys.modules.setdefault("config_pb2", config_pb2)

# Re-exported: importing it from here is the way that needs no sys.path or sys.modules care.
from aws_kinesis_agg.messages_pb2 import AggregatedRecord  # noqa: E402

__all__ = ["MAGIC", "AggregatedRecord", "DeaggregationResult", "deaggregate", "is_aggregated"]

MAGIC = b"\xf3\x89\x9a\xc2"
_DIGEST_SIZE = 16
_MIN_SIZE = len(MAGIC) + _DIGEST_SIZE
# base64 of the magic: "84ma" encodes f3 89 9a, "w" the top 6 bits of c2, and the next
# character carries c2's low bits "10", which only the characters g..v have.
_B64_PREFIX = "84maw"
_B64_SIXTH = frozenset("ghijklmnopqrstuv")
_MAX_HASH_KEY = 2**128 - 1

_parse_aggregate = AggregatedRecord.FromString
_md5 = hashlib.md5
# The lazy forms, read without a Python call per record (package-internal, as in
# is_aggregated).
_get_bytes = attrgetter("_bytes")
_get_b64 = attrgetter("_b64")


def _plain_schema() -> Callable[[bytes | memoryview], Any]:
    """A parser for ``AggregatedRecord`` as the KPL writes it without explicit hash keys: the same
    field numbers, but sub-records without ``explicit_hash_key_index`` (and ``tags``).

    Parsed with this schema, those fields become unknown fields, and discarding the unknown
    fields is the only way re-serialising can come out shorter than the input (no field of
    it can grow: no signed or packed fields, no message fields read twice). So "no table of
    explicit hash keys, and the parse re-serialises to exactly ``len(body)``" proves that no
    sub-record names an explicit hash key, for one C-level pass over the aggregate instead
    of a ``HasField`` call per sub-record; an index into the empty table is still caught,
    because it sends the aggregate down the checked path.
    """
    proto = descriptor_pb2.FileDescriptorProto(
        name="kclpy_kpl_plain.proto", package="kclpy.kpl", syntax="proto2")
    f = descriptor_pb2.FieldDescriptorProto
    record = proto.message_type.add(name="Record")
    record.field.add(name="partition_key_index", number=1, label=f.LABEL_REQUIRED,
                     type=f.TYPE_UINT64)
    record.field.add(name="data", number=3, label=f.LABEL_REQUIRED, type=f.TYPE_BYTES)
    aggregate = proto.message_type.add(name="AggregatedRecord")
    aggregate.field.add(name="partition_key_table", number=1, label=f.LABEL_REPEATED,
                        type=f.TYPE_STRING)
    aggregate.field.add(name="explicit_hash_key_table", number=2, label=f.LABEL_REPEATED,
                        type=f.TYPE_STRING)
    aggregate.field.add(name="records", number=3, label=f.LABEL_REPEATED,
                        type=f.TYPE_MESSAGE, type_name=".kclpy.kpl.Record")
    # A private pool: nothing else in the process can see or clash with these names.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    message = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kclpy.kpl.AggregatedRecord"))
    parse: Callable[[bytes | memoryview], Any] = message.FromString
    return parse


_parse_plain = _plain_schema()


@dataclass(slots=True)
class DeaggregationResult:
    """User records in order, and what did not come out as user records.

    ``corrupt``: aggregates delivered as ONE raw record (the original object) because they
    were too short, failed their MD5, did not decode, lacked a required protobuf field, had
    a key that is not valid UTF-8, had no sub-records, or had a table index (or, when
    filtering, an explicit hash key) that is not valid.
    ``filtered``: sub-records dropped by hash-key filtering (see :func:`deaggregate`).
    """

    records: list[Record]
    corrupt: int
    filtered: int


def is_aggregated(record: Record) -> bool:
    """Whether the record's payload starts with the KPL magic (the MD5 is not checked).

    A record still holding base64 text from the wire is recognised by the magic's base64
    prefix, so a plain record stays undecoded.
    """
    # Package-internal access to the lazy forms: going through binary_data would decode
    # every plain record just to look at four bytes.
    data = record._bytes
    if data is not None:
        return data.startswith(MAGIC)
    b64 = record._b64
    assert b64 is not None
    return b64.startswith(_B64_PREFIX) and b64[5:6] in _B64_SIXTH


def deaggregate(
    records: Iterable[Record],
    starting_hash_key: int | None = None,
    ending_hash_key: int | None = None,
) -> DeaggregationResult:
    """Expand KPL aggregates into their user records; other records pass through as they are.

    Each sub-record gets the parent's ``sequence_number`` and arrival time,
    ``sub_sequence_number`` = its index in the aggregate, its partition key and explicit hash
    key from the aggregate's tables, and its payload as raw bytes.

    Never raises on record contents and never drops silently: every input record comes out
    either as all its user records, as itself (not an aggregate, or ``corrupt``), or as
    ``filtered`` sub-records. An aggregate with zero sub-records counts as corrupt and is
    delivered raw, so its sequence number still reaches the processor and the checkpoint.

    Filtering (only if a bound is given; a missing bound is 0 or 2**128-1), as the Java KCL
    does it: a sub-record's effective hash key is its explicit hash key, else the MD5 of its
    UTF-8 partition key as a 128-bit big-endian integer. If any sub-record's key lies outside
    [starting_hash_key, ending_hash_key], the WHOLE aggregate is dropped and all its
    sub-records are counted in ``filtered``. That happens when the KPL aggregated for a stale
    shard map: it notices the aggregate landed on an unexpected shard and re-sends its user
    records, so delivering any of them from here would duplicate them.
    """
    bounds = None
    if starting_hash_key is not None or ending_hash_key is not None:
        bounds = _Bounds(
            0 if starting_hash_key is None else starting_hash_key,
            _MAX_HASH_KEY if ending_hash_key is None else ending_hash_key,
        )
    # Verdicts per partition key, shared by the aggregates of this call: keys recur across
    # the aggregates of a page, and an MD5 costs more than the rest of a sub-record's
    # de-aggregation.
    records = list(records)
    if _none_aggregated(records):
        return DeaggregationResult(records, 0, 0)
    pk_verdicts: dict[str, bool] = {}
    out: list[Record] = []
    append = out.append
    extend = out.extend
    corrupt = 0
    filtered = 0
    for record in records:
        if not is_aggregated(record):
            append(record)
            continue
        expanded = _expand(record)
        if expanded is None:
            append(record)
            corrupt += 1
            continue
        subs, keys = expanded
        # Every key of the table in range: then so is every sub-record (they can only use
        # keys of the table). Otherwise look at the sub-records themselves, since a key
        # that no sub-record uses must not get the aggregate filtered.
        if bounds is None or (keys is not None and _keys_in_range(keys, bounds, pk_verdicts)):
            extend(subs)
        else:
            verdict = _in_range(subs, bounds, pk_verdicts)
            if verdict is None:
                append(record)
                corrupt += 1
            elif verdict:
                extend(subs)
            else:
                filtered += len(subs)
    return DeaggregationResult(out, corrupt, filtered)


def _expand(record: Record) -> tuple[list[Record], list[str] | None] | None:
    """The aggregate's user records and, when none of them has an explicit hash key, the
    partition-key table; None if the aggregate is corrupt in any way.

    The sub-records are built into a fresh list that is only returned whole, so a bad
    aggregate is never half-delivered. A table index out of range surfaces as the
    IndexError of the table lookup (indexes are unsigned, so never negative): validating
    by lookup costs nothing extra per sub-record.
    """
    try:
        blob = record.binary_data
        if len(blob) <= _MIN_SIZE:
            return None
        # A view, not a slice: a slice would copy the whole aggregate once more.
        body = memoryview(blob)[len(MAGIC) : -_DIGEST_SIZE]
        if _md5(body).digest() != blob[-_DIGEST_SIZE:]:
            return None
        plain = _parse_plain(body)
        # upb does not enforce proto2 "required" on parse; protobuf-java, which the Java KCL
        # uses, rejects such a message, and a sub-record without its data or key index
        # would otherwise come out as an empty payload or the first partition key. Every
        # field the plain schema requires, the full one requires too.
        if not plain.IsInitialized():
            return None
        if plain.explicit_hash_key_table:
            return _expand_checked(record, body)
        plain.DiscardUnknownFields()
        if plain.ByteSize() != len(body):
            return _expand_checked(record, body)
        # A list built once: indexing the protobuf container would make a new str per
        # sub-record. upb hands back bytes, not str, for a proto2 string that is not valid
        # UTF-8; the KPL only writes text, so such a table means a damaged aggregate, and
        # str.join rejects it (TypeError) in one C call.
        pks = list(plain.partition_key_table)
        "".join(pks)
        seq = record.sequence_number
        arrival = record.approximate_arrival_timestamp
        subs = [
            Record(seq, pks[sub.partition_key_index], arrival, index, sub.data)
            for index, sub in enumerate(plain.records)
        ]
    # The payload is untrusted bytes (an MD5 is no signature): whatever base64, the protobuf
    # runtime or a table lookup raise on it (binascii.Error, DecodeError, IndexError,
    # TypeError) means "not a usable aggregate".
    except Exception:
        return None
    return (subs, pks) if subs else None


def _expand_checked(
    record: Record, body: memoryview
) -> tuple[list[Record], list[str] | None] | None:
    """The general case: explicit hash keys, tags or unknown fields, read with the full
    schema and a ``HasField`` per sub-record (an explicit-hash-key index must be told apart
    from an absent one, which reads as 0)."""
    try:
        aggregate = _parse_aggregate(body)
        if not aggregate.IsInitialized():
            return None
        pks = list(aggregate.partition_key_table)
        ehks = list(aggregate.explicit_hash_key_table)
        "".join(pks)
        "".join(ehks)
        seq = record.sequence_number
        arrival = record.approximate_arrival_timestamp
        subs = [
            Record(
                seq,
                pks[sub.partition_key_index],
                arrival,
                index,
                sub.data,
                None,
                ehks[sub.explicit_hash_key_index]
                if sub.HasField("explicit_hash_key_index")
                else None,
            )
            for index, sub in enumerate(aggregate.records)
        ]
    except Exception:
        return None
    return (subs, None) if subs else None


def _none_aggregated(records: list[Record]) -> bool:
    """True if no record can be an aggregate: each still holds only its base64 text, and no
    text starts like the magic's base64. The same test as :func:`is_aggregated`, made in C
    over the whole page: a page of plain records then costs no Python call per record."""
    try:
        return all(map(is_, map(_get_bytes, records), repeat(None))) and not any(
            map(str.startswith, map(_get_b64, records), repeat(_B64_PREFIX))
        )
    except TypeError:
        return False


class _Bounds:
    """A hash-key range, also as 16-byte big-endian strings: an MD5 digest compared as bytes
    orders like the 128-bit integer it encodes, so partition keys skip int.from_bytes."""

    __slots__ = ("high", "high_digest", "low", "low_digest")

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high
        # Clamped into the 128-bit key space; None when no 128-bit key is in range.
        clamped_low, clamped_high = max(low, 0), min(high, _MAX_HASH_KEY)
        if clamped_low > clamped_high:
            self.low_digest: bytes | None = None
            self.high_digest: bytes | None = None
        else:
            self.low_digest = clamped_low.to_bytes(16, "big")
            self.high_digest = clamped_high.to_bytes(16, "big")


def _keys_in_range(keys: list[str], bounds: _Bounds, pk_verdicts: dict[str, bool]) -> bool:
    """True if the MD5 hash key of every partition key in ``keys`` is within bounds."""
    low_digest, high_digest = bounds.low_digest, bounds.high_digest
    if low_digest is None or high_digest is None:
        return False
    verdict = pk_verdicts.get
    for pk in keys:
        ok = verdict(pk)
        if ok is None:
            ok = pk_verdicts[pk] = low_digest <= _md5(pk.encode("utf-8")).digest() <= high_digest
        if not ok:
            return False
    return True


def _in_range(subs: list[Record], bounds: _Bounds, pk_verdicts: dict[str, bool]) -> bool | None:
    """True if every sub-record's effective hash key is within bounds; None if an explicit
    hash key is not a decimal integer (the aggregate is then corrupt, not filtered)."""
    explicit = {s.explicit_hash_key for s in subs if s.explicit_hash_key is not None}
    implicit = {s.partition_key for s in subs if s.explicit_hash_key is None}
    try:
        explicit_keys = [int(k) for k in explicit]
    except ValueError:
        return None
    low, high = bounds.low, bounds.high
    if not all(low <= k <= high for k in explicit_keys):
        return False
    low_digest, high_digest = bounds.low_digest, bounds.high_digest
    for pk in implicit:
        ok = pk_verdicts.get(pk)
        if ok is None:
            ok = pk_verdicts[pk] = (
                low_digest is not None
                and high_digest is not None
                and low_digest <= _md5(pk.encode("utf-8")).digest() <= high_digest
            )
        if not ok:
            return False
    return True
