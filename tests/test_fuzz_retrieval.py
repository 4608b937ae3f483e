"""Property tests for the retrieval hot path: de-aggregation never raises or loses a record,
and kclpy's GetRecords parse agrees with botocore's on every field."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime, timezone
from typing import Any

import botocore.session
from aws_kinesis_agg.aggregator import RecordAggregator
from botocore.parsers import create_parser
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kclpy.records import Record, is_wire_record
from kclpy.retrieval.kpl import MAGIC, AggregatedRecord, deaggregate, is_aggregated
from kclpy.retrieval.parse import ChildShard, parse_get_records
from tests.support.decoding import counting_decodes
from tests.support.protowire import field

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
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


def make_record(index: int, data: bytes, as_base64: bool) -> Record:
    return Record(
        sequence_number=str(10**20 + index), partition_key=f"outer-{index}",
        timestamp_millis=1_700_000_000_000 + index,
        **({"b64": base64.b64encode(data).decode()} if as_base64 else {"data": data}),
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
    keys: list[int] = []
    for sub in message.records:
        if sub.partition_key_index >= len(pks):
            return "corrupt"
        if sub.HasField("explicit_hash_key_index"):
            if sub.explicit_hash_key_index >= len(ehks):
                return "corrupt"
            if low is not None or high is not None:
                try:
                    keys.append(int(ehks[sub.explicit_hash_key_index]))
                except ValueError:
                    return "corrupt"
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


def keys_of(data: bytes) -> list[tuple[str, str | None]]:
    """Each sub-record's partition key and explicit hash key, per the real schema."""
    message = AggregatedRecord.FromString(data[len(MAGIC):-16])
    pks, ehks = message.partition_key_table, message.explicit_hash_key_table
    return [(pks[sub.partition_key_index],
             ehks[sub.explicit_hash_key_index] if sub.HasField("explicit_hash_key_index")
             else None) for sub in message.records]


def effective_hash_keys(blob: bytes) -> list[int]:
    message = AggregatedRecord.FromString(blob[len(MAGIC):-16])
    keys = []
    for sub in message.records:
        if sub.HasField("explicit_hash_key_index"):
            keys.append(int(message.explicit_hash_key_table[sub.explicit_hash_key_index]))
        else:
            partition_key = message.partition_key_table[sub.partition_key_index]
            keys.append(int.from_bytes(hashlib.md5(partition_key.encode()).digest(), "big"))
    return keys


bounds = st.one_of(
    st.just((None, None)),
    st.tuples(st.integers(0, MAX_HASH_KEY), st.integers(0, MAX_HASH_KEY)).map(sorted).map(tuple),
    st.tuples(st.none(), st.integers(0, MAX_HASH_KEY)),
    st.tuples(st.integers(0, MAX_HASH_KEY), st.none()),
)


def check(records: list[Record], payloads: list[bytes],
          hash_range: tuple[int | None, int | None]) -> None:
    """deaggregate's output holds, in input order, each record as the oracle says: itself,
    all its user records, or nothing (filtered); the counts match."""
    plain_before = [r for r in records if not is_aggregated(r)]
    with counting_decodes() as decoded:
        result = deaggregate(records, *hash_range, filter_outside=True)
    out = result.records
    position = corrupt = filtered = 0
    for record, data in zip(records, payloads, strict=True):
        outcome = expected_outcome(data, *hash_range)
        if outcome in ("plain", "corrupt"):
            assert out[position] is record, outcome
            position += 1
            corrupt += outcome == "corrupt"
            continue
        subs = sub_records_of(data)
        if outcome == "filtered":
            filtered += len(subs)
            continue
        mine = out[position:position + len(subs)]
        position += len(subs)
        assert [r.sequence_number for r in mine] == [record.sequence_number] * len(subs)
        assert [r.sub_sequence_number for r in mine] == list(range(len(subs)))
        assert [r.binary_data for r in mine] == [s.data for s in subs]
        assert [(r.partition_key, r.explicit_hash_key) for r in mine] == keys_of(data)
        assert all(r.timestamp_millis == record.timestamp_millis
                   for r in mine)
    assert position == len(out)
    assert (result.corrupt, result.filtered) == (corrupt, filtered)
    # Plain records were not decoded to find out they are plain.
    assert not set(decoded) & {r.data for r in plain_before if is_wire_record(r)}


@FUZZ
@given(inputs=st.lists(st.tuples(payload, st.booleans()), max_size=6), hash_range=bounds)
def test_deaggregate_accounts_for_every_record(inputs: list[tuple[bytes, bool]],
                                               hash_range: tuple[int | None, int | None]) -> None:
    records = [make_record(i, data, as_b64) for i, (data, as_b64) in enumerate(inputs)]
    check(records, [data for data, _ in inputs], hash_range)


@FUZZ
@given(blob=valid_aggregate(), data=st.data())
def test_filter_bounds_at_the_edges(blob: bytes, data: st.DataObject) -> None:
    """Bounds placed on, and one off, the aggregate's own effective hash keys."""
    keys = effective_hash_keys(blob)
    low = data.draw(st.sampled_from(keys)) + data.draw(st.sampled_from([-1, 0, 1]))
    high = data.draw(st.sampled_from(keys)) + data.draw(st.sampled_from([-1, 0, 1]))
    check([make_record(0, blob, data.draw(st.booleans()))], [blob], (low, high))


@FUZZ
@given(blob=valid_aggregate(), as_b64=st.booleans())
def test_valid_aggregates_always_expand(blob: bytes, as_b64: bool) -> None:
    result = deaggregate([make_record(0, blob, as_b64)])
    assert (result.corrupt, result.filtered) == (0, 0)
    assert [r.binary_data for r in result.records] == [s.data for s in sub_records_of(blob)]


@FUZZ
@given(data=st.binary(max_size=30))
def test_is_aggregated_agrees_between_base64_and_bytes(data: bytes) -> None:
    for candidate in (data, MAGIC + data, MAGIC[:3] + data):
        assert is_aggregated(make_record(0, candidate, True)) == is_aggregated(
            make_record(0, candidate, False)) == candidate.startswith(MAGIC)


@FUZZ
@given(data=st.binary(max_size=70), as_b64=st.booleans())
def test_size_is_known_without_decoding(data: bytes, as_b64: bool) -> None:
    record = make_record(0, data, as_b64)
    with counting_decodes() as decoded:
        assert record.size == len(data)
    assert decoded == []


# --- parse_get_records against botocore's own parser ----------------------------------------

_OUTPUT_SHAPE = (botocore.session.get_session().get_service_model("kinesis")
                 .operation_model("GetRecords").output_shape)
assert _OUTPUT_SHAPE is not None
OUTPUT_SHAPE = _OUTPUT_SHAPE
BOTOCORE_JSON = create_parser("json")

# Millisecond timestamps between 2001 and 2100, as Kinesis sends them: seconds with three
# decimals.
arrival_ms = st.integers(1_000_000_000_000, 4_100_000_000_000)
hash_key = st.integers(0, MAX_HASH_KEY).map(str)
shard_id = st.integers(0, 10**12).map(lambda n: f"shardId-{n:012d}")


@st.composite
def wire_record(draw: st.DrawFn) -> dict[str, Any]:
    record: dict[str, Any] = {
        "SequenceNumber": str(draw(st.integers(0, 10**60))),
        "Data": base64.b64encode(draw(st.binary(max_size=300))).decode(),
        "PartitionKey": draw(st.text(min_size=1, max_size=256)),
    }
    if draw(st.booleans()) or draw(st.booleans()):
        record["ApproximateArrivalTimestamp"] = draw(arrival_ms) / 1000
    if draw(st.booleans()):
        record["EncryptionType"] = draw(st.sampled_from(["NONE", "KMS"]))
    return record


child_shard = st.fixed_dictionaries({
    "ShardId": shard_id,
    "ParentShards": st.lists(shard_id, min_size=1, max_size=2),
    "HashKeyRange": st.fixed_dictionaries({"StartingHashKey": hash_key,
                                           "EndingHashKey": hash_key}),
})


@st.composite
def response(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"Records": draw(st.lists(wire_record(), max_size=20))}
    optional = {
        "NextShardIterator": st.one_of(st.none(), st.text(min_size=1, max_size=300)),
        "MillisBehindLatest": st.integers(0, 2**40),
        "ChildShards": st.lists(child_shard, max_size=3),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            doc[key] = draw(strategy)
    return doc


def millis(value: datetime) -> int:
    return round(value.timestamp() * 1000)


@FUZZ
@given(doc=response(), ascii_only=st.booleans())
def test_parse_agrees_with_botocore(doc: dict[str, Any], ascii_only: bool) -> None:
    body = json.dumps(doc, ensure_ascii=ascii_only).encode()
    ours = parse_get_records(body)
    theirs = BOTOCORE_JSON.parse({"body": body, "headers": {}, "status_code": 200}, OUTPUT_SHAPE)

    assert len(ours.records) == len(theirs["Records"])
    for mine, expected in zip(ours.records, theirs["Records"], strict=True):
        assert mine.sequence_number == expected["SequenceNumber"]
        assert mine.partition_key == expected["PartitionKey"]
        assert mine.binary_data == expected["Data"]
        assert mine.sub_sequence_number == 0
        assert mine.explicit_hash_key is None
        when = expected.get("ApproximateArrivalTimestamp")
        assert mine.timestamp_millis == (None if when is None else millis(when))
    assert ours.next_shard_iterator == theirs.get("NextShardIterator")
    assert ours.millis_behind_latest == theirs.get("MillisBehindLatest")
    assert ours.child_shards == [
        ChildShard(c["ShardId"], tuple(c["ParentShards"]), c["HashKeyRange"]["StartingHashKey"],
                   c["HashKeyRange"]["EndingHashKey"])
        for c in theirs.get("ChildShards", [])
    ]
    assert ours.size_bytes == len(body)


@FUZZ
@given(ms=arrival_ms)
def test_arrival_millis_round_trip(ms: int) -> None:
    seconds = ms / 1000
    page = parse_get_records(json.dumps({"Records": [{
        "SequenceNumber": "1", "Data": "", "PartitionKey": "p",
        "ApproximateArrivalTimestamp": seconds}]}).encode())
    assert page.records[0].timestamp_millis == ms
    assert millis(datetime.fromtimestamp(seconds, timezone.utc)) == ms
