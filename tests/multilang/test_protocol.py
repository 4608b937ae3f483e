"""The MultiLangDaemon messages: their exact shapes, and that the real amazon_kclpy package
reads what kclpy writes and writes what kclpy reads, for v1, v2 and v3 processors."""

from __future__ import annotations

import base64
import importlib
import io
import json
from types import ModuleType
from typing import Any

import pytest

from kclpy.multilang import protocol
from kclpy.multilang.protocol import (
    CheckpointRequest,
    ProtocolError,
    StatusMessage,
    StrayLine,
    decode_child_line,
)
from kclpy.records import Record
from tests.multilang_apps.amazon_kclpy_dist import amazon_kclpy_root


def _record(seq: str, data: bytes, *, sub: int = 0, key: str = "pk",
            ts: int | None = 1_700_000_000_123) -> Record:
    return Record(sequence_number=seq, partition_key=key, timestamp_millis=ts,
                  sub_sequence_number=sub, data=data)


# -- what kclpy writes ----------------------------------------------------------------------


def one_line(records: list[Record], millis_behind_latest: int | None) -> str:
    """A batch small enough for one processRecords line, as that line."""
    [(line, last)] = protocol.split_process_records(records, millis_behind_latest)
    assert last == (records[-1] if records else None)
    return line


def test_initialize_carries_shard_and_checkpoint() -> None:
    line = protocol.encode_initialize("shardId-000000000001", "4950000", 3)
    assert json.loads(line) == {"action": "initialize", "shardId": "shardId-000000000001",
                                "sequenceNumber": "4950000", "subSequenceNumber": 3}


def test_initialize_sentinel_gets_sub_sequence_zero_and_fresh_shard_gets_nulls() -> None:
    assert json.loads(protocol.encode_initialize("s", "TRIM_HORIZON", None)) == {
        "action": "initialize", "shardId": "s", "sequenceNumber": "TRIM_HORIZON",
        "subSequenceNumber": 0}
    # amazon_kclpy indexes both keys, so they are present even when null
    assert json.loads(protocol.encode_initialize("s", None, None)) == {
        "action": "initialize", "shardId": "s", "sequenceNumber": None,
        "subSequenceNumber": None}


def test_process_records_encodes_records_as_the_java_daemon() -> None:
    records = [
        _record("100", b"\x00\xffbinary\n", key="k\u00e9y"),
        Record(sequence_number="200", partition_key="p2", timestamp_millis=None,
               sub_sequence_number=4, b64=base64.b64encode(b"from the wire").decode()),
    ]
    line = one_line(records, 1234)
    assert "\n" not in line
    assert json.loads(line) == {
        "action": "processRecords",
        "millisBehindLatest": 1234,
        "records": [
            {"action": "record", "data": base64.b64encode(b"\x00\xffbinary\n").decode(),
             "partitionKey": "k\u00e9y", "sequenceNumber": "100", "subSequenceNumber": 0,
             "approximateArrivalTimestamp": 1_700_000_000_123},
            {"action": "record", "data": base64.b64encode(b"from the wire").decode(),
             "partitionKey": "p2", "sequenceNumber": "200", "subSequenceNumber": 4,
             "approximateArrivalTimestamp": None},
        ],
    }


def test_empty_batch_and_unknown_lag() -> None:
    assert json.loads(one_line([], None)) == {
        "action": "processRecords", "records": [], "millisBehindLatest": None}


@pytest.mark.parametrize(("line", "action"), [
    (protocol.encode_lease_lost(), "leaseLost"),
    (protocol.encode_shard_ended(), "shardEnded"),
    (protocol.encode_shutdown_requested(), "shutdownRequested"),
])
def test_lifecycle_messages_are_bare_actions(line: str, action: str) -> None:
    assert json.loads(line) == {"action": action}


def test_checkpoint_reply_echoes_the_request_and_names_the_error() -> None:
    assert json.loads(protocol.encode_checkpoint_reply("77", 2, "ThrottlingException")) == {
        "action": "checkpoint", "sequenceNumber": "77", "subSequenceNumber": 2,
        "error": "ThrottlingException"}
    assert json.loads(protocol.encode_checkpoint_reply(None, None, None)) == {
        "action": "checkpoint", "sequenceNumber": None, "subSequenceNumber": None,
        "error": None}


# -- what kclpy reads -----------------------------------------------------------------------


@pytest.mark.parametrize("line", ["", "\n", "   \r\n"])
def test_blank_lines_between_messages_are_not_messages(line: str) -> None:
    assert decode_child_line(line) is None


def test_status_message() -> None:
    assert decode_child_line('{"action": "status", "responseFor": "processRecords"}\n') == \
        StatusMessage("processRecords")


@pytest.mark.parametrize(("line", "expected"), [
    ('{"action": "checkpoint", "sequenceNumber": "123", "subSequenceNumber": 4}',
     CheckpointRequest("123", 4)),
    ('{"action": "checkpoint", "sequenceNumber": null, "subSequenceNumber": null}',
     CheckpointRequest(None, None)),
    ('{"action": "checkpoint"}', CheckpointRequest(None, None)),
    # v1 applications often pass int(record["sequenceNumber"]); Java reads it as a string
    ('{"action": "checkpoint", "sequenceNumber": 49590338271490256608559692538361571095921575989136588898, "subSequenceNumber": null}',  # noqa: E501
     CheckpointRequest("49590338271490256608559692538361571095921575989136588898", None)),
])
def test_checkpoint_requests(line: str, expected: CheckpointRequest) -> None:
    assert decode_child_line(line) == expected


@pytest.mark.parametrize("line", [
    "Was throttled while checkpointing, will attempt again in 5 seconds",
    "[1, 2, 3]",
    '"status"',
    '{"responseFor": "initialize"}',
    '{"action": 7}',
])
def test_lines_that_are_no_message_at_all_are_stray(line: str) -> None:
    with pytest.raises(StrayLine):
        decode_child_line(line)


@pytest.mark.parametrize("line", [
    '{"action": "status"}',
    '{"action": "status", "responseFor": null}',
    '{"action": "checkpoint", "sequenceNumber": 1.5}',
    '{"action": "checkpoint", "sequenceNumber": true}',
    '{"action": "checkpoint", "sequenceNumber": "1", "subSequenceNumber": "2"}',
    '{"action": "checkpoint", "sequenceNumber": "1", "subSequenceNumber": false}',
    '{"action": "initialize", "shardId": "s"}',
    '{"action": "log", "message": "hello"}',
])
def test_malformed_or_unexpected_messages_break_the_protocol(line: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_child_line(line)
    assert not isinstance(info.value, StrayLine)
    assert info.value.line == line


@pytest.mark.parametrize("line", [
    '{"action": "status", "responseFor": "initialize", "x": ' + "[" * 100_000 + "]" * 100_000
    + "}",
    "[" * 100_000 + "]" * 100_000,
])
def test_json_nested_past_the_recursion_limit_breaks_the_protocol(line: str) -> None:
    """A child's message nested deeper than the parser can follow is a broken message like
    any other (the child is restarted), not a RecursionError escaping the exchange."""
    with pytest.raises(ProtocolError) as info:
        decode_child_line(line)
    assert not isinstance(info.value, StrayLine)
    assert "nested too deeply" in str(info.value)


# -- against the real amazon_kclpy ----------------------------------------------------------


@pytest.fixture(scope="module")
def kclpy_modules(request: pytest.FixtureRequest) -> dict[str, ModuleType]:
    """amazon_kclpy's own modules, imported from the downloaded sdist."""
    root = str(amazon_kclpy_root())
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.syspath_prepend(root)
    names = ("kcl", "dispatch", "messages", "v2.processor", "v3.processor")
    return {name: importlib.import_module(f"amazon_kclpy.{name}") for name in names}


def _decode_in_amazon_kclpy(modules: dict[str, ModuleType], line: str) -> Any:
    return json.loads(line, object_hook=modules["dispatch"].message_decode)


def test_amazon_kclpy_decodes_every_message_kclpy_writes(
        kclpy_modules: dict[str, ModuleType]) -> None:
    messages = kclpy_modules["messages"]
    init = _decode_in_amazon_kclpy(kclpy_modules, protocol.encode_initialize("s-1", "9", 2))
    assert isinstance(init, messages.InitializeInput)
    assert (init.shard_id, init.sequence_number, init.sub_sequence_number) == ("s-1", "9", 2)

    batch = _decode_in_amazon_kclpy(kclpy_modules, one_line(
        [_record("100", b"hello", sub=1, key="key-a")], 42))
    assert isinstance(batch, messages.ProcessRecordsInput)
    assert batch.millis_behind_latest == 42
    (rec,) = batch.records
    assert isinstance(rec, messages.Record)
    assert rec.binary_data == b"hello"
    assert (rec.partition_key, rec.sequence_number, rec.sub_sequence_number) == \
        ("key-a", "100", 1)
    assert rec.timestamp_millis == 1_700_000_000_123
    assert rec.get("partitionKey") == "key-a"  # the v1 dict-style access

    for line, kind in ((protocol.encode_lease_lost(), messages.LeaseLostInput),
                       (protocol.encode_shard_ended(), messages.ShardEndedInput),
                       (protocol.encode_shutdown_requested(), messages.ShutdownRequestedInput)):
        assert isinstance(_decode_in_amazon_kclpy(kclpy_modules, line), kind)

    reply = _decode_in_amazon_kclpy(
        kclpy_modules, protocol.encode_checkpoint_reply("100", 1, "ShutdownException"))
    assert isinstance(reply, messages.CheckpointInput)
    assert (reply.sequence_number, reply.sub_sequence_number, reply.error) == \
        ("100", 1, "ShutdownException")


def _processor_classes(modules: dict[str, ModuleType], seen: list[Any]) -> dict[int, Any]:
    """One processor per amazon_kclpy interface version; each checkpoints at the last record
    of every batch and records what it saw (and the checkpoint error, if any) in ``seen``."""
    kcl = modules["kcl"]

    def checkpoint(checkpointer: Any, seq: str, sub: int) -> None:
        try:
            checkpointer.checkpoint(seq, sub)
            seen.append(("checkpoint", seq, None))
        except kcl.CheckpointError as exc:
            seen.append(("checkpoint", seq, exc.value))

    class V1(kcl.RecordProcessorBase):  # type: ignore[misc,name-defined]
        def initialize(self, shard_id: str) -> None:
            seen.append(("initialize", shard_id))

        def process_records(self, records: list[Any], checkpointer: Any) -> None:
            seen.append(("records", [r["sequenceNumber"] for r in records]))
            checkpoint(checkpointer, records[-1]["sequenceNumber"],
                       records[-1]["subSequenceNumber"])

        def shutdown(self, checkpointer: Any, reason: str) -> None:
            seen.append(("shutdown", reason))

    class V2(modules["v2.processor"].RecordProcessorBase):  # type: ignore[misc]
        def initialize(self, initialize_input: Any) -> None:
            seen.append(("initialize", initialize_input.shard_id))

        def process_records(self, process_records_input: Any) -> None:
            records = process_records_input.records
            seen.append(("records", [r.sequence_number for r in records]))
            checkpoint(process_records_input.checkpointer, records[-1].sequence_number,
                       records[-1].sub_sequence_number)

        def shutdown(self, shutdown_input: Any) -> None:
            seen.append(("shutdown", shutdown_input.reason))

    class V3(modules["v3.processor"].RecordProcessorBase):  # type: ignore[misc]
        def initialize(self, initialize_input: Any) -> None:
            seen.append(("initialize", initialize_input.shard_id))

        def process_records(self, process_records_input: Any) -> None:
            records = process_records_input.records
            seen.append(("records", [r.sequence_number for r in records]))
            checkpoint(process_records_input.checkpointer, records[-1].sequence_number,
                       records[-1].sub_sequence_number)

        def lease_lost(self, lease_lost_input: Any) -> None:
            seen.append(("lease_lost",))

        def shard_ended(self, shard_ended_input: Any) -> None:
            seen.append(("shard_ended",))

        def shutdown_requested(self, shutdown_requested_input: Any) -> None:
            seen.append(("shutdown_requested",))

    return {1: V1, 2: V2, 3: V3}


@pytest.mark.parametrize("version", [1, 2, 3])
def test_amazon_kclpy_process_speaks_the_protocol_both_ways(
        kclpy_modules: dict[str, ModuleType], version: int) -> None:
    """Drive amazon_kclpy's KCLProcess in memory: the daemon's side is pre-written (including
    the checkpoint reply it would send), the child's side is decoded with kclpy's decoder."""
    seen: list[Any] = []
    processor = _processor_classes(kclpy_modules, seen)[version]()
    to_child = "\n".join([
        protocol.encode_initialize("shardId-7", "TRIM_HORIZON", 0),
        one_line([_record("10", b"a"), _record("11", b"b", sub=2)], 0),
        protocol.encode_checkpoint_reply("11", 2, "ThrottlingException"),
        protocol.encode_lease_lost(),
    ]) + "\n"
    from_child = io.StringIO()
    kcl_process = kclpy_modules["kcl"].KCLProcess(
        processor, input_file=io.StringIO(to_child), output_file=from_child,
        error_file=io.StringIO())
    kcl_process.run()

    decoded = [m for m in map(decode_child_line, from_child.getvalue().splitlines())
               if m is not None]
    assert decoded == [
        StatusMessage("initialize"),
        CheckpointRequest("11", 2),
        StatusMessage("processRecords"),
        StatusMessage("leaseLost"),
    ]
    lost = {1: ("shutdown", "ZOMBIE"), 2: ("shutdown", "ZOMBIE"), 3: ("lease_lost",)}[version]
    assert seen == [("initialize", "shardId-7"), ("records", ["10", "11"]),
                    ("checkpoint", "11", "ThrottlingException"), lost]



# -- batches larger than a message --------------------------------------------------------


def _varied(count: int) -> list[Record]:
    """Records whose JSON varies in every way a line's size depends on: escaped and
    non-ASCII partition keys, empty and large payloads, missing arrival times, long
    sub-sequence numbers."""
    keys = ["pk", '"quoted\\', "\u00e9t\u00e9", "\U0001f600" * 3, "tab\there", "k" * 256]
    return [_record(str(10**40 + i), bytes(range(256))[: (i * 37) % 300] * (1 + i % 3),
                    sub=(i * 7919) ** 3, key=keys[i % len(keys)],
                    ts=None if i % 5 == 0 else 1_700_000_000_000 + i) for i in range(count)]


@pytest.mark.parametrize("cap", [1, 400, 1_000, 5_000, 100_000])
def test_a_batch_is_split_into_lines_within_the_cap_in_order(cap: int) -> None:
    records = _varied(60)
    lines = list(protocol.split_process_records(records, 77, cap))
    decoded = [json.loads(line) for line, _ in lines]
    assert all(message["millisBehindLatest"] == 77 for message in decoded)
    # every record, once, in order, as the Java daemon encodes it
    assert [r for message in decoded for r in message["records"]] == [
        json.loads(one_line([record], 77))["records"][0] for record in records]
    for (line, last), message in zip(lines, decoded, strict=True):
        assert len(line) <= cap or len(message["records"]) == 1
        assert last == records[sum(len(m["records"]) for m in decoded[:decoded.index(message)])
                               + len(message["records"]) - 1]
    # as few lines as the cap allows: each would overflow with the next line's first record
    for (line, _), following in zip(lines, decoded[1:], strict=False):
        grown = json.loads(line)
        grown["records"].append(following["records"][0])
        assert len(protocol._dump(grown)) > cap


def test_an_empty_batch_is_one_line() -> None:
    assert [json.loads(line)["records"] for line, _ in
            protocol.split_process_records([], None, 10)] == [[]]
