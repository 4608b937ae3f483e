"""KPL aggregates as property tests draw them - every way one can come off the wire, valid,
hand-made, hand-encoded or damaged - and the slow, obvious account of what should become of
each, which the de-aggregator is checked against."""

from __future__ import annotations

import hashlib
from typing import Any

from aws_kinesis_agg.aggregator import RecordAggregator
from hypothesis import strategies as st

from kclpy.retrieval.kpl import MAGIC, AggregatedRecord
from tests.support.protowire import field

MAX_HASH_KEY = 2**128 - 1


def sign(body: bytes) -> bytes:
    return MAGIC + body + hashlib.md5(body).digest()


# --- payload strategies: every way an aggregate can come off the wire ----------------------

user_record = st.tuples(
    st.text(min_size=1, max_size=12),
    st.binary(max_size=40),
    st.one_of(st.none(), st.integers(0, MAX_HASH_KEY).map(str)),
)


@st.composite
def valid_aggregate(draw: st.DrawFn) -> bytes:
    aggregator = RecordAggregator()
    for partition_key, data, ehk in draw(st.lists(user_record, min_size=1, max_size=8)):
        aggregator.add_user_record(partition_key, data, ehk)
    built = aggregator.clear_and_get()
    assert built is not None
    return bytes(built.get_contents()[2])


@st.composite
def hand_made_aggregate(draw: st.DrawFn) -> bytes:
    """Tables and indexes chosen freely: some indexes point past the tables, some aggregates
    are empty, some sub-records miss a required field."""
    message = AggregatedRecord()
    message.partition_key_table.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    message.explicit_hash_key_table.extend(
        draw(st.lists(st.one_of(st.integers(-5, MAX_HASH_KEY + 5).map(str), st.text(max_size=4)),
                      max_size=3)))
    for _ in range(draw(st.integers(0, 5))):
        sub = message.records.add()
        if draw(st.booleans()) or draw(st.booleans()):
            sub.partition_key_index = draw(st.integers(0, 4))
        if draw(st.booleans()):
            sub.explicit_hash_key_index = draw(st.integers(0, 4))
        if draw(st.integers(0, 9)):
            sub.data = draw(st.binary(max_size=10))
    return sign(message.SerializePartialToString())


@st.composite
def mutated_aggregate(draw: st.DrawFn) -> bytes:
    blob = draw(valid_aggregate())
    how = draw(st.sampled_from(["truncate", "flip", "flip and re-sign", "append"]))
    if how == "truncate":
        return blob[: draw(st.integers(0, len(blob) - 1))]
    if how == "append":
        return blob + draw(st.binary(min_size=1, max_size=8))
    body = bytearray(blob[len(MAGIC):-16] if how == "flip and re-sign" else blob)
    if not body:
        return blob
    at = draw(st.integers(0, len(body) - 1))
    body[at] ^= draw(st.integers(1, 255))
    return sign(bytes(body)) if how == "flip and re-sign" else bytes(body)


@st.composite
def hand_encoded_aggregate(draw: st.DrawFn) -> bytes:
    """Sub-records written field by field, as protobuf allows but the KPL never writes: in
    any order, fields repeated (the last one counts), unknown fields, tags, now and then a
    required field missing. The de-aggregator reads the aggregates the KPL writes as columns
    and these another way; both must agree with the real schema on all of them."""
    table = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4))
    body = b"".join(field(1, key.encode()) for key in table)
    with_ehks = draw(st.integers(0, 5)) == 0
    if with_ehks:
        body += field(2, b"12345")
    index = st.integers(0, len(table) - 1)
    extra: st.SearchStrategy[tuple[int, int | bytes]] = st.one_of(
        st.tuples(st.just(1), index),  # partition_key_index again
        st.tuples(st.just(3), st.binary(max_size=6)),  # data again
        st.tuples(st.just(4), st.just(field(1, b"k") + field(2, b"v"))),  # a tag
        st.tuples(st.just(9), st.integers(0, 300)),  # a field no schema knows
        st.tuples(st.just(2), st.just(0)) if with_ehks else st.nothing(),
    )
    for _ in range(draw(st.integers(1, 5))):
        fields: list[tuple[int, int | bytes]] = [(1, draw(index)), (3, draw(st.binary(max_size=6)))]
        if draw(st.integers(0, 9)) == 0:
            fields.pop(draw(st.integers(0, 1)))
        for _ in range(draw(st.integers(0, 3))):
            fields.insert(draw(st.integers(0, len(fields))), draw(extra))
        body += field(3, b"".join(field(number, value) for number, value in fields))
    return sign(body)


payload = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=64).map(lambda b: MAGIC + b),
    st.binary(max_size=64).map(sign),
    valid_aggregate(),
    hand_made_aggregate(),
    hand_encoded_aggregate(),
    mutated_aggregate(),
)


def expected_outcome(data: bytes, low: int | None, high: int | None) -> str:
    """What should become of a record, decided the slow, obvious way: "plain", "corrupt",
    "expand" or "filtered"."""
    if not data.startswith(MAGIC):
        return "plain"
    body, digest = data[len(MAGIC):-16], data[-16:]
    if len(data) <= len(MAGIC) + 16 or hashlib.md5(body).digest() != digest:
        return "corrupt"
    try:
        message = AggregatedRecord.FromString(body)
    except Exception:
        return "corrupt"
    if not message.IsInitialized() or len(message.records) == 0:
        return "corrupt"
    pks, ehks = list(message.partition_key_table), list(message.explicit_hash_key_table)
    if not all(isinstance(key, str) for key in pks + ehks):
        return "corrupt"  # protobuf gives bytes for a string that is not UTF-8
    # Kinesis' limits on keys, which it checks on the outer record only
    if any(len(key) > 256 for key in pks):
        return "corrupt"
    if not all(key.isascii() and key.isdigit() and len(key) <= 39 for key in ehks):
        return "corrupt"
    keys: list[int] = []
    for sub in message.records:
        if sub.partition_key_index >= len(pks):
            return "corrupt"
        if sub.HasField("explicit_hash_key_index"):
            if sub.explicit_hash_key_index >= len(ehks):
                return "corrupt"
            keys.append(int(ehks[sub.explicit_hash_key_index]))
        else:
            pk_digest = hashlib.md5(pks[sub.partition_key_index].encode()).digest()
            keys.append(int.from_bytes(pk_digest, "big"))
    if low is None and high is None:
        return "expand"
    lo = 0 if low is None else low
    hi = MAX_HASH_KEY if high is None else high
    return "expand" if all(lo <= k <= hi for k in keys) else "filtered"


def sub_records_of(data: bytes) -> list[Any]:
    return list(AggregatedRecord.FromString(data[len(MAGIC):-16]).records)
