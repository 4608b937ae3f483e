"""Property tests for the retrieval hot path: de-aggregation never raises or loses a record,
and kclpy's GetRecords parse agrees with botocore's on every field."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime, timezone
from typing import Any

import botocore.session
from botocore.parsers import create_parser
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kclpy.records import Record, is_wire_record
from kclpy.retrieval.kpl import MAGIC, AggregatedRecord, deaggregate, is_aggregated
from kclpy.retrieval.page import ChildShard
from kclpy.retrieval.parse import parse_get_records
from tests.support.aggregates import (
    MAX_HASH_KEY,
    expected_outcome,
    payload,
    sub_records_of,
    valid_aggregate,
)
from tests.support.decoding import counting_decodes

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def make_record(index: int, data: bytes, as_base64: bool) -> Record:
    return Record(
        sequence_number=str(10**20 + index), partition_key=f"outer-{index}",
        timestamp_millis=1_700_000_000_000 + index,
        **({"b64": base64.b64encode(data).decode()} if as_base64 else {"data": data}),
    )


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
