"""Record and Records: the values a processor receives, however they were built."""

from __future__ import annotations

import base64
import binascii
import gc
import pickle
from collections.abc import Sequence
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kclpy.records import EMPTY, Record, Records, UserRecords, WireRecords, is_wire_record
from tests.support.decoding import counting_decodes

SEQ = "49590338271490256608559692538361571095921575989136588898"


def wire(data: bytes, seq: str = SEQ, millis: int | None = 1_714_000_000_123) -> Record:
    return Record(seq, "pk", millis, b64=base64.b64encode(data).decode())


def test_a_record_from_base64_keeps_the_text_and_decodes_on_each_read() -> None:
    record = wire(b"\x00payload\xff")
    assert is_wire_record(record)
    with counting_decodes() as decoded:
        assert record.data == base64.b64encode(b"\x00payload\xff").decode()
        assert record.size == 9
        assert decoded == []
        assert record.binary_data == b"\x00payload\xff"
        assert record.binary_data == b"\x00payload\xff"
    assert decoded == [record.data, record.data]


def test_a_record_from_bytes_encodes_base64_on_demand() -> None:
    record = Record(SEQ, "pk", None, 3, b"\x01\x02", explicit_hash_key="42")
    assert not is_wire_record(record)
    assert (record.binary_data, record.data, record.size) == (b"\x01\x02", "AQI=", 2)
    assert (record.sub_sequence_number, record.explicit_hash_key) == (3, "42")


def test_base64_with_a_sub_sequence_number_is_decoded_up_front() -> None:
    record = Record(SEQ, "pk", None, 2, b64="aGk=")
    assert (record.binary_data, record.sub_sequence_number, is_wire_record(record)) == (
        b"hi", 2, False)


def test_a_record_needs_a_payload() -> None:
    with pytest.raises(ValueError, match="needs data or b64"):
        Record(SEQ, "pk", None)


@given(text=st.text(alphabet="ABCDabcd0123+/=\n ", max_size=24))
def test_non_canonical_base64_decodes_as_botocore_does(text: str) -> None:
    try:
        expected = binascii.a2b_base64(text)
    except binascii.Error:
        with pytest.raises(binascii.Error):
            _ = Record(SEQ, "pk", None, b64=text).binary_data
        return
    assert Record(SEQ, "pk", None, b64=text).binary_data == expected


@given(millis=st.integers(0, 4_102_444_800_000))
def test_arrival_time_in_milliseconds_survives_storage(millis: int) -> None:
    for record in (wire(b"x", millis=millis), Record(SEQ, "pk", millis, 0, b"x")):
        assert record.timestamp_millis == millis


def test_arrival_time_reads_like_amazon_kclpy() -> None:
    record = wire(b"x", millis=1_714_000_000_123)
    # amazon_kclpy's v3 Record: datetime.fromtimestamp(timestamp_millis / 1000.0)
    assert record.approximate_arrival_timestamp == datetime.fromtimestamp(1_714_000_000.123)
    assert record.get("approximateArrivalTimestamp") == 1_714_000_000_123
    unknown = wire(b"x", millis=None)
    assert (unknown.timestamp_millis, unknown.approximate_arrival_timestamp) == (None, None)


def test_get_reads_amazon_kclpy_json_names() -> None:
    record = Record(SEQ, "pk", 5, 7, b"hi")
    assert [record.get(name) for name in ("data", "partitionKey", "sequenceNumber",
                                          "subSequenceNumber")] == ["aGk=", "pk", SEQ, 7]
    assert record.get("nope") is None and record.get("nope", 1) == 1


def test_records_are_immutable_values() -> None:
    a, b = wire(b"same"), wire(b"same")
    assert a == b and hash(a) == hash(b) and a != wire(b"other")
    with pytest.raises(AttributeError):
        a.partition_key = "changed"
    for record in (a, Record(SEQ, "pk", 1, 4, b"bytes", explicit_hash_key="9")):
        copy = pickle.loads(pickle.dumps(record))
        assert copy == record and type(copy) is type(record)
        assert (copy.binary_data, copy.sub_sequence_number) == (
            record.binary_data, record.sub_sequence_number)


def test_extended_sequence_number_orders_sub_records() -> None:
    assert Record("10", "k", None, 2, b"").extended_sequence_number == (10, 2)


# --- Records --------------------------------------------------------------------------------

def user_records(seq: str, payloads: list[bytes], first: int = 0,
                 explicit: bool = False) -> UserRecords:
    return UserRecords(seq, 1_714_000_000.5, payloads, [f"k{i}" for i in range(len(payloads))],
                       [f"{i}" if i % 2 else None for i in range(len(payloads))]
                       if explicit else None, first)


def expected_of(users: UserRecords) -> list[Record]:
    ehks = users.explicit_hash_keys or [None] * len(users)
    return [Record(users.sequence_number, key, 1_714_000_000_500,
                   users.first_sub_sequence_number + i, data, explicit_hash_key=ehk)
            for i, (data, key, ehk) in enumerate(
                zip(users.data, users.partition_keys, ehks, strict=True))]


def rows(*payloads: bytes, seq: str = "6") -> WireRecords:
    return WireRecords([(base64.b64encode(p).decode(), "pk", f"{seq}{i}", 1_714_000_000.123)
                        for i, p in enumerate(payloads)])


def mixed() -> tuple[Records, list[Record]]:
    plain1 = [wire(b"a", seq="1"), wire(b"bb", seq="2")]
    agg1 = user_records("3", [b"u0", b"u1", b"u2"])
    plain2 = [wire(b"ccc", seq="4")]
    agg2 = user_records("5", [b"v0", b"", b"v2", b"v3"], first=1, explicit=True)
    page = rows(b"w0", b"w11")
    model = plain1 + expected_of(agg1) + plain2 + expected_of(agg2) + [
        wire(b"w0", seq="60"), wire(b"w11", seq="61")]
    return Records([plain1, agg1, [], plain2, agg2, page]), model


def test_records_read_like_the_list_they_stand_for() -> None:
    records, model = mixed()
    assert len(records) == len(model) == 12
    assert list(records) == model
    assert records == model and model == records and records != model[:-1]
    assert [records[i] for i in range(-len(model), len(model))] == model + model
    for bad in (len(model), -len(model) - 1):
        with pytest.raises(IndexError):
            records[bad]
    assert [r.explicit_hash_key for r in records][-6:-2] == [None, "1", None, "3"]
    assert [r.sub_sequence_number for r in records][-6:] == [1, 2, 3, 4, 0, 0]


def test_every_slice_matches_the_list() -> None:
    records, model = mixed()
    for start in range(-13, 14):
        for stop in [*range(-13, 14), None]:
            for step in (None, 1, 2, -1):
                sliced = records[start:stop:step]
                assert isinstance(sliced, Records)
                assert list(sliced) == model[start:stop:step], (start, stop, step)


def test_after_drops_what_a_checkpoint_covers() -> None:
    records, model = mixed()
    for position in [(0, 0), *(r.extended_sequence_number for r in model), (99, 0)]:
        assert list(records.after(position)) == [
            r for r in model if r.extended_sequence_number > position]


def test_payload_bytes_counts_without_building_or_decoding() -> None:
    records, model = mixed()
    with counting_decodes() as decoded:
        total = records.payload_bytes()
    assert decoded == []
    assert total == sum(len(r.binary_data) for r in model)
    bytes_run = Records([[Record("1", "k", None, 0, b"abc"), wire(b"de")]])
    assert bytes_run.payload_bytes() == 5


@settings(max_examples=60)
@given(runs=st.lists(st.tuples(st.sampled_from(["records", "rows", "users"]),
                               st.lists(st.binary(max_size=5), max_size=4)), max_size=5),
       start=st.integers(-12, 12), stop=st.integers(-12, 12))
def test_slicing_any_batch(runs: list[tuple[str, list[bytes]]], start: int, stop: int) -> None:
    parts: list[Sequence[Record]] = []
    model: list[Record] = []
    for i, (kind, payloads) in enumerate(runs):
        if kind == "users":
            users = user_records(str(i), payloads)
            parts.append(users)
            model += expected_of(users)
        elif kind == "rows":
            page = rows(*payloads, seq=str(i))
            parts.append(page)
            model += list(page)
        else:
            run = [wire(p, seq=str(i)) for p in payloads]
            parts.append(run)
            model += run
    records = Records(parts)
    assert list(records[start:stop]) == model[start:stop]
    assert records[start:stop].payload_bytes() == sum(
        len(r.binary_data) for r in model[start:stop])


def test_a_page_waits_as_rows_the_garbage_collector_lets_go_of() -> None:
    page = rows(*[bytes([i]) for i in range(100)])
    gc.collect()
    assert not any(map(gc.is_tracked, page.rows))
    assert all(gc.is_tracked(record) for record in page)
    assert page[3] == wire(bytes([3]), seq="63") and page[1:3] == [page[1], page[2]]
    assert page.texts()[:2] == ["AA==", "AQ=="]


def test_empty() -> None:
    assert len(EMPTY) == 0 and not EMPTY and list(EMPTY) == [] and EMPTY == []
    assert repr(Records([[wire(b"x")]])) == "<Records: 1>"


def test_columns_must_line_up() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        UserRecords("1", None, [b"a", b"b"], ["k"])
