"""KPL de-aggregation: aggregates made by aws-kinesis-agg, broken ones, hash-key filtering."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator

from kclpy.records import Record
from kclpy.retrieval import kpl
from kclpy.retrieval.kpl import (
    MAGIC,
    AggregatedRecord,
    HashKeyRange,
    deaggregate,
    is_aggregated,
)
from tests.support.decoding import counting_decodes
from tests.support.protowire import field

MAX_HASH_KEY = 2**128 - 1
ARRIVAL = 1_714_000_000_123


def wire(data: bytes, seq: str = "49590338271490256608559692538361571095921575989136588898",
         partition_key: str = "agg-pk") -> Record:
    """A record as the GetRecords parser builds it: base64 text, not yet decoded."""
    return Record(sequence_number=seq, partition_key=partition_key,
                  timestamp_millis=ARRIVAL,
                  b64=base64.b64encode(data).decode("ascii"))


def kpl_blob(users: Sequence[tuple[str, bytes, str | None]]) -> bytes:
    agg = RecordAggregator()
    for partition_key, data, ehk in users:
        assert agg.add_user_record(partition_key, data, ehk) is None
    built = agg.clear_and_get()
    assert built is not None
    return bytes(built.get_contents()[2])


def sign(body: bytes) -> bytes:
    """Wrap protobuf bytes in the KPL envelope with a correct MD5."""
    return MAGIC + body + hashlib.md5(body).digest()


def manual(pks: list[str], ehks: list[str],
           subs: list[tuple[int, int | None, bytes]]) -> bytes:
    """An aggregate built field by field, to make ones the aggregator refuses to make."""
    message = AggregatedRecord()
    message.partition_key_table.extend(pks)
    message.explicit_hash_key_table.extend(ehks)
    for pk_index, ehk_index, data in subs:
        sub = message.records.add()
        sub.partition_key_index = pk_index
        if ehk_index is not None:
            sub.explicit_hash_key_index = ehk_index
        sub.data = data
    return sign(message.SerializeToString())


def pk_hash(partition_key: str) -> int:
    return int.from_bytes(hashlib.md5(partition_key.encode()).digest(), "big")


USERS = [("alpha", b"first", None), ("beta", b"", None), ("alpha", b"\x00\xff" * 300, None),
         ("gamma \u00e9", b"last", None)]


def test_sub_records_carry_parent_position_and_own_keys() -> None:
    parent = wire(kpl_blob(USERS), seq="1234567890123")
    result = deaggregate([parent])
    assert (result.corrupt, result.filtered) == (0, 0)
    assert [(r.partition_key, r.binary_data, r.explicit_hash_key) for r in result.records] == USERS
    assert [r.sub_sequence_number for r in result.records] == [0, 1, 2, 3]
    assert {r.sequence_number for r in result.records} == {"1234567890123"}
    assert {r.timestamp_millis for r in result.records} == {ARRIVAL}
    # .data is the base64 of the user record, as amazon_kclpy gives it
    assert result.records[0].data == base64.b64encode(b"first").decode()


def test_explicit_hash_keys_come_from_the_table() -> None:
    users = [("a", b"1", "7"), ("b", b"2", None), ("c", b"3", str(MAX_HASH_KEY)), ("d", b"4", "7")]
    result = deaggregate([wire(kpl_blob(users))])
    assert [(r.partition_key, r.binary_data, r.explicit_hash_key) for r in result.records] == users


def test_plain_records_pass_through_untouched_and_undecoded() -> None:
    plain = [wire(f"plain {i}".encode(), seq=str(i)) for i in range(5)]
    with counting_decodes() as decoded:
        result = deaggregate(plain)
    assert result.records == plain
    assert all(a is b for a, b in zip(result.records, plain, strict=True))
    assert decoded == []
    assert (result.corrupt, result.filtered) == (0, 0)


def test_order_is_kept_across_plain_and_aggregated_records() -> None:
    records = [wire(b"p0", seq="1"), wire(kpl_blob(USERS[:2]), seq="2"), wire(b"p2", seq="3"),
               wire(kpl_blob(USERS[2:]), seq="4")]
    result = deaggregate(records)
    assert [(r.sequence_number, r.sub_sequence_number) for r in result.records] == [
        ("1", 0), ("2", 0), ("2", 1), ("3", 0), ("4", 0), ("4", 1)]


def test_aggregate_given_as_bytes_is_recognised() -> None:
    record = Record(sequence_number="5", partition_key="p", timestamp_millis=None,
                    data=kpl_blob(USERS))
    assert is_aggregated(record)
    assert len(deaggregate([record]).records) == len(USERS)


@pytest.mark.parametrize("payload", [
    b"", b"x", b"plain text", MAGIC[:3], b"\xf3\x89\x9a\xc3" + b"\x00" * 40, b"\x00" + MAGIC,
])
def test_is_aggregated_is_false_for_non_kpl_payloads(payload: bytes) -> None:
    assert not is_aggregated(wire(payload))
    assert not is_aggregated(Record(sequence_number="1", partition_key="p",
                                    timestamp_millis=None, data=payload))


def test_is_aggregated_does_not_decode() -> None:
    plain, aggregated = wire(b"hello world"), wire(kpl_blob(USERS))
    with counting_decodes() as decoded:
        assert not is_aggregated(plain)
        assert is_aggregated(aggregated)
    assert decoded == []


def corrupt_cases() -> dict[str, bytes]:
    good = kpl_blob(USERS)
    return {
        "bad md5": good[:-1] + bytes([good[-1] ^ 1]),
        "flipped body byte": good[:10] + bytes([good[10] ^ 0x40]) + good[11:],
        "truncated": good[:-5],
        "magic only": MAGIC,
        "magic and md5 of nothing": MAGIC + hashlib.md5(b"").digest(),
        "magic plus 10 bytes": MAGIC + b"0123456789",
        "undecodable protobuf": sign(b"\xff\xff\xff\xff\xff"),
        "missing required data": sign(b"\n\x01a\x1a\x02\x08\x00"),
        "empty aggregate": manual(["a"], [], []),
        "partition key not utf-8": sign(b"\n\x02\xe2\x80\x1a\x04\x08\x00\x1a\x00"),
        "explicit hash key not utf-8": sign(
            b"\n\x01a\x12\x01\xff\x1a\x06\x08\x00\x10\x00\x1a\x00"),
        "pk index out of range": manual(["a", "b"], [], [(0, None, b"ok"), (2, None, b"bad")]),
        "huge pk index": manual(["a"], [], [(2**64 - 1, None, b"bad")]),
        "ehk index out of range": manual(["a"], ["5"], [(0, 0, b"ok"), (0, 1, b"bad")]),
        "ehk index with empty table": manual(["a"], [], [(0, None, b"ok"), (0, 0, b"bad")]),
    }


@pytest.mark.parametrize("name", sorted(corrupt_cases()))
def test_corrupt_aggregate_is_delivered_once_raw(name: str) -> None:
    before, broken, after = wire(b"before", seq="1"), wire(corrupt_cases()[name], seq="2"), \
        wire(b"after", seq="3")
    assert is_aggregated(broken)
    result = deaggregate([before, broken, after])
    assert result.records == [before, broken, after]
    assert result.records[1] is broken
    assert broken.sub_sequence_number == 0
    assert (result.corrupt, result.filtered) == (1, 0)


def test_corrupt_aggregate_keeps_its_payload() -> None:
    payload = corrupt_cases()["pk index out of range"]
    result = deaggregate([wire(payload)])
    assert result.records[0].binary_data == payload


def test_counts_add_up_over_many_records() -> None:
    cases = list(corrupt_cases().values())
    records = [wire(kpl_blob(USERS)), *(wire(c) for c in cases), wire(b"plain")]
    result = deaggregate(records)
    assert result.corrupt == len(cases)
    assert len(result.records) == len(USERS) + len(cases) + 1


# --- hash-key filtering -----------------------------------------------------------------


def test_no_bounds_means_no_filtering() -> None:
    users = [("a", b"1", "0"), ("b", b"2", str(MAX_HASH_KEY))]
    assert deaggregate([wire(kpl_blob(users))]).filtered == 0


def test_by_default_sub_records_outside_the_range_are_delivered() -> None:
    """The Java filter is asked for, never applied by default: an aggregate whose keys
    fall outside the shard's range (aws-kinesis-agg's, or a KPL's mispredicted one) still
    delivers every sub-record, with bounds or a key range."""
    users = [("a", b"1", "150"), ("b", b"2", "999")]
    for result in (deaggregate([wire(kpl_blob(users))], 100, 200),
                   deaggregate([wire(kpl_blob(users))], key_range=HashKeyRange(100, 200))):
        assert [r.binary_data for r in result.records] == [b"1", b"2"]
        assert (result.filtered, result.corrupt) == (0, 0)


@pytest.mark.parametrize(("start", "end", "kept"), [
    (100, 200, True),     # inside
    (150, 200, True),     # lowest key on the start bound: inclusive
    (100, 180, True),     # highest key on the end bound: inclusive
    (151, 200, False),    # lowest key just below the range
    (100, 179, False),    # highest key just above the range
])
def test_explicit_hash_keys_are_checked_against_the_bounds(start: int, end: int,
                                                           kept: bool) -> None:
    users = [("a", b"1", "150"), ("b", b"2", "180"), ("c", b"3", "160")]
    result = deaggregate([wire(kpl_blob(users))], start, end, filter_outside=True)
    assert result.corrupt == 0
    if kept:
        assert [r.binary_data for r in result.records] == [b"1", b"2", b"3"]
        assert result.filtered == 0
    else:
        # As the Java KCL does: one sub-record out of range drops the whole aggregate.
        assert result.records == []
        assert result.filtered == 3


def test_partition_key_md5_is_the_hash_key_without_explicit_one() -> None:
    keys = ["k1", "k2", "k3"]
    hashes = sorted(pk_hash(k) for k in keys)
    record = wire(kpl_blob([(k, k.encode(), None) for k in keys]))
    assert len(deaggregate([record], hashes[0], hashes[-1], filter_outside=True).records) == 3
    dropped = deaggregate([record], hashes[0] + 1, MAX_HASH_KEY, filter_outside=True)
    assert (len(dropped.records), dropped.filtered) == (0, 3)
    dropped = deaggregate([record], 0, hashes[-1] - 1, filter_outside=True)
    assert (len(dropped.records), dropped.filtered) == (0, 3)


def test_explicit_hash_key_wins_over_partition_key() -> None:
    # The partition key hashes far outside [0, 10]; the explicit key 5 is inside.
    assert pk_hash("outside") > 10
    result = deaggregate([wire(kpl_blob([("outside", b"x", "5")]))], 0, 10,
                         filter_outside=True)
    assert [r.binary_data for r in result.records] == [b"x"]


def test_one_bound_alone_filters() -> None:
    record = wire(kpl_blob([("a", b"1", "50"), ("b", b"2", "60")]))
    assert deaggregate([record], starting_hash_key=55, filter_outside=True).filtered == 2
    assert deaggregate([record], ending_hash_key=55, filter_outside=True).filtered == 2
    assert len(deaggregate([record], starting_hash_key=50, filter_outside=True).records) == 2
    assert len(deaggregate([record], ending_hash_key=60, filter_outside=True).records) == 2


def test_filtering_leaves_other_records_alone() -> None:
    inside = wire(kpl_blob([("a", b"in", "10")]), seq="1")
    outside = wire(kpl_blob([("b", b"out1", "10"), ("c", b"out2", "99")]), seq="2")
    plain = wire(b"plain", seq="3")
    result = deaggregate([inside, outside, plain], 0, 50, filter_outside=True)
    assert [r.binary_data for r in result.records] == [b"in", b"plain"]
    assert (result.corrupt, result.filtered) == (0, 2)


@pytest.mark.parametrize("ehk", ["not-a-number", "-1", "", "1" * 40])
def test_an_explicit_hash_key_kinesis_would_refuse_makes_the_aggregate_corrupt(
        ehk: str) -> None:
    """Whether filtering or not: Kinesis takes a decimal of at most 39 digits, and checks
    that on the outer record only."""
    record = wire(manual(["a"], ["7", ehk], [(0, 0, b"x")]))
    for filtering in (False, True):
        result = deaggregate([record], 0, MAX_HASH_KEY, filter_outside=filtering)
        assert result.records == [record]
        assert (result.corrupt, result.filtered) == (1, 0)
        assert result.reasons == {"key_limits": 1}


@pytest.mark.parametrize(("start", "end", "kept"), [
    (-5, 2**130, True),        # bounds beyond the 128-bit key space still contain it all
    (10, 5, False),            # an empty range keeps nothing
    (2**128, 2**129, False),   # entirely above the key space
    (-10, -1, False),          # entirely below it
])
def test_bounds_outside_the_key_space(start: int, end: int, kept: bool) -> None:
    by_partition_key = wire(kpl_blob([("a", b"1", None), ("b", b"2", None)]))
    by_explicit_key = wire(kpl_blob([("a", b"1", "0"), ("b", b"2", str(MAX_HASH_KEY))]))
    for record in (by_partition_key, by_explicit_key):
        result = deaggregate([record], start, end, filter_outside=True)
        assert (len(result.records), result.filtered) == ((2, 0) if kept else (0, 2))


def test_a_partition_key_no_sub_record_uses_does_not_filter_the_aggregate() -> None:
    used = pk_hash("used")
    record = wire(manual(["used", "unused"], [], [(0, None, b"x")]))
    assert pk_hash("unused") != used
    result = deaggregate([record], used, used, filter_outside=True)
    assert [r.binary_data for r in result.records] == [b"x"]
    assert result.filtered == 0


def test_sub_records_with_tags_are_expanded() -> None:
    message = AggregatedRecord()
    message.partition_key_table.extend(["a", "b"])
    for index, data in enumerate([b"one", b"two"]):
        sub = message.records.add()
        sub.partition_key_index = index
        sub.data = data
        tag = sub.tags.add()
        tag.key = "k"
    result = deaggregate([wire(sign(message.SerializeToString()))])
    assert [(r.partition_key, r.binary_data) for r in result.records] == [("a", b"one"),
                                                                          ("b", b"two")]


@pytest.mark.parametrize(("sub_records", "expected"), [
    # payload before key index: valid protobuf, though not the order an encoder writes
    ([field(3, b"one") + field(1, 1), field(3, b"two") + field(1, 0)], [("b", b"one"),
                                                                       ("a", b"two")]),
    # a field twice: protobuf keeps the last
    ([field(1, 0) + field(3, b"old") + field(3, b"new"), field(1, 0) + field(1, 1)
      + field(3, b"x")], [("a", b"new"), ("b", b"x")]),
    # a varint longer than it needs to be (0 as two bytes)
    ([field(1, 1) + field(3, b"one"), b"\x08\x80\x00" + field(3, b"two")], [("b", b"one"),
                                                                         ("a", b"two")]),
])
def test_aggregates_the_kpl_would_not_write_read_as_protobuf_reads_them(
        sub_records: list[bytes], expected: list[tuple[str, bytes]]) -> None:
    body = field(1, b"a") + field(1, b"b") + b"".join(field(3, sub) for sub in sub_records)
    assert AggregatedRecord.FromString(body).SerializeToString() != body
    result = deaggregate([wire(sign(body))])
    assert [(r.partition_key, r.binary_data) for r in result.records] == expected
    assert [r.sub_sequence_number for r in result.records] == [0, 1]
    assert result.corrupt == 0


def test_a_tag_without_its_required_key_makes_the_aggregate_corrupt() -> None:
    message = AggregatedRecord()
    message.partition_key_table.append("a")
    sub = message.records.add()
    sub.partition_key_index = 0
    sub.data = b"x"
    sub.tags.add().value = "no key"
    broken = wire(sign(message.SerializePartialToString()))
    assert deaggregate([broken]).corrupt == 1


class _CountingMD5:
    """Counts the MD5s the de-aggregator computes, by input length: an aggregate's digest
    covers its whole protobuf body, a partition key's hash key only the key."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, data: bytes | memoryview) -> object:
        self.lengths.append(len(data))
        return hashlib.md5(data)


def key_hashes(lengths: list[int]) -> int:
    return sum(1 for n in lengths if n < 20)


def test_a_shards_key_range_hashes_each_partition_key_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _CountingMD5()
    monkeypatch.setattr(kpl, "_md5", counting)
    key_range = HashKeyRange(0, 2**127)
    blob = kpl_blob([(f"key-{i % 5}", bytes([i]), None) for i in range(40)])
    first = deaggregate([wire(blob)], key_range=key_range, filter_outside=True)
    assert key_hashes(counting.lengths) == 5
    again = deaggregate([wire(blob, seq="2")], key_range=key_range, filter_outside=True)
    assert key_hashes(counting.lengths) == 5
    fresh = deaggregate([wire(blob)], 0, 2**127, filter_outside=True)
    assert (first.filtered, len(first.records)) == (again.filtered, len(again.records)) == (
        fresh.filtered, len(fresh.records))


def test_the_verdict_cache_is_bounded_and_stays_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kpl, "_MAX_VERDICTS", 3)
    key_range = HashKeyRange(0, 2**127)
    keys = [f"unique-{i}" for i in range(10)]
    for key in keys:
        expected = int.from_bytes(hashlib.md5(key.encode()).digest(), "big") <= 2**127
        assert key_range.keys_in_range([key]) is expected
        assert len(key_range._verdicts) <= 3
    assert key_range.keys_in_range(keys) is all(
        int.from_bytes(hashlib.md5(k.encode()).digest(), "big") <= 2**127 for k in keys)


def test_the_whole_key_space_needs_no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _CountingMD5()
    monkeypatch.setattr(kpl, "_md5", counting)
    result = deaggregate([wire(kpl_blob(USERS))], 0, 2**128 - 1, filter_outside=True)
    assert key_hashes(counting.lengths) == 0 and len(result.records) == len(USERS)


def empty_subs(table: list[str], count: int) -> bytes:
    """``count`` empty sub-records all under the table's first key, hand-encoded: the
    cheapest sub-record there is (6 bytes), as a producer hoping to multiply a shared key
    writes them."""
    sub = field(3, field(1, 0) + field(3, b""))
    return sign(b"".join(field(1, key.encode()) for key in table) + sub * count)


@pytest.mark.parametrize(("key", "expanded"), [
    ("k" * 256, True),          # Kinesis' limit exactly
    ("k" * 257, False),         # one character more
    ("\u00e9" * 256, True),     # characters, not bytes
    ("k" * 500_000, False),
])
def test_a_partition_key_longer_than_kinesis_allows_makes_the_aggregate_corrupt(
        key: str, expanded: bool) -> None:
    record = wire(empty_subs([key], 10))
    result = deaggregate([record])
    if expanded:
        assert [r.partition_key for r in result.records] == [key] * 10
        assert result.corrupt == 0
    else:
        assert result.records == [record]
        assert result.reasons == {"key_limits": 1}


def test_a_long_key_in_a_table_with_explicit_hash_keys_is_refused_too() -> None:
    record = wire(manual(["a", "k" * 257], ["5"], [(0, 0, b"x")]))
    assert deaggregate([record]).reasons == {"key_limits": 1}


def test_the_largest_expansion_a_legal_ascii_key_allows_is_within_the_bound() -> None:
    """The worst a KPL aggregate within Kinesis' key limit can do with ASCII keys: a
    256-character key shared by empty sub-records, about 43 times its size."""
    record = wire(empty_subs(["k" * 256], 20_000))
    result = deaggregate([record])
    assert (len(result.records), result.corrupt) == (20_000, 0)
    assert 40 * len(record.binary_data) < 20_000 * 256 < kpl.MAX_EXPANSION * len(
        record.binary_data)


def test_an_aggregate_expanding_beyond_the_bound_is_delivered_raw() -> None:
    """256 four-byte characters (a legal key of 1,024 bytes) shared by empty sub-records:
    about 170 times the aggregate's size once every record carries its key."""
    record = wire(empty_subs(["\U0001f600" * 256], 20_000))
    result = deaggregate([record])
    assert result.records == [record]
    assert result.reasons == {"too_large": 1}


def test_an_aggregate_with_more_sub_records_than_a_kpl_aggregate_holds_is_delivered_raw(
        ) -> None:
    most = wire(empty_subs(["k"], kpl.MAX_SUB_RECORDS))
    assert len(deaggregate([most]).records) == kpl.MAX_SUB_RECORDS
    beyond = wire(empty_subs(["k"], kpl.MAX_SUB_RECORDS + 1))
    result = deaggregate([beyond])
    assert result.records == [beyond]
    assert result.reasons == {"too_large": 1}


def test_reasons_are_counted_apart() -> None:
    records = [wire(kpl_blob(USERS)), wire(sign(b"\xff")), wire(empty_subs(["k" * 300], 1)),
               wire(empty_subs(["k" * 257], 1))]
    result = deaggregate(records)
    assert result.corrupt == 3
    assert result.reasons == {"malformed": 1, "key_limits": 2}
