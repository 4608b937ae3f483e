"""kclpy/streams.py: how a stream is configured and identified, and how a multi-stream lease key
names its stream (the Java KCL's StreamConfig, StreamIdentifier and MultiStreamLease key)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kclpy.errors import ConfigError
from kclpy.streams import (
    StreamConfig,
    StreamIdentifier,
    StreamTracker,
    multi_stream_lease_key,
    stream_of_lease_key,
)

STREAM_ID = "123456789012:orders:1700000000"


def test_stream_identifiers_serialise_as_java_does() -> None:
    summary = {"StreamARN": "arn:aws:kinesis:eu-west-1:123456789012:stream/orders",
               "StreamCreationTimestamp": datetime(2023, 11, 14, 22, 13, 20,
                                                   tzinfo=timezone.utc)}
    identifier = StreamIdentifier.from_summary(summary)
    assert identifier.serialize() == STREAM_ID
    assert StreamIdentifier.parse(STREAM_ID) == identifier
    with pytest.raises(ValueError, match="account-id:stream-name:creation-epoch"):
        StreamIdentifier.parse("orders")
    assert stream_of_lease_key(f"{STREAM_ID}:shardId-000000000001") == STREAM_ID
    assert stream_of_lease_key("shardId-000000000001") is None


def test_the_documented_promql_takes_the_stream_out_of_a_lease_key() -> None:
    """docs/operations.md's label_replace, applied as Prometheus applies it (anchored at
    both ends), to the key of a stream whose name has dots, dashes and underscores."""
    docs = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    found = re.search(r'"stream", "\$1", "shard_id", "([^"]+)"', docs)
    assert found is not None, "operations.md lost its label_replace example"
    key = multi_stream_lease_key("123456789012:click-stream_v2.eu:1700000000",
                                 "shardId-000000000007")
    match = re.fullmatch(found.group(1), key)
    assert match is not None and match.group(1) == "click-stream_v2.eu"
    assert re.fullmatch(found.group(1), "shardId-000000000007") is None


def test_a_stream_given_by_arn_is_labelled_by_its_name_and_called_by_its_arn() -> None:
    arn = "arn:aws-cn:kinesis:cn-north-1:123456789012:stream/orders"
    by_arn = StreamConfig(arn=arn)
    assert by_arn.label == "orders"
    assert by_arn.api_params == {"StreamARN": arn}, "by ARN: it may be another account's"
    assert StreamConfig("orders").api_params == {"StreamName": "orders"}
    with pytest.raises(ConfigError, match="--stream-name"):
        StreamConfig()
    with pytest.raises(ConfigError, match=r"--initial-position.*'EARLIEST'"):
        StreamConfig("orders", initial_position="EARLIEST")


def test_the_creation_epoch_is_whole_seconds_whatever_form_the_time_came_in() -> None:
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/orders"
    from_float = StreamIdentifier.from_summary(
        {"StreamARN": arn, "StreamCreationTimestamp": 1700000000.9})
    from_datetime = StreamIdentifier.from_summary(
        {"StreamARN": arn,
         "StreamCreationTimestamp": datetime.fromtimestamp(1700000000.9, tz=timezone.utc)})
    assert from_float == from_datetime == StreamIdentifier.parse(STREAM_ID)
    assert str(from_float) == STREAM_ID
    with pytest.raises(ValueError, match="unexpected stream ARN"):
        StreamIdentifier.from_summary({"StreamARN": "arn:aws:s3:::bucket",
                                       "StreamCreationTimestamp": 0})


def test_only_a_key_starting_with_a_whole_stream_identifier_names_a_stream() -> None:
    assert stream_of_lease_key("orders:shardId-000000000001") is None
    assert stream_of_lease_key("123456789012:orders:notanepoch:shardId-000000000001") is None
    assert stream_of_lease_key(f"{STREAM_ID}:") == STREAM_ID


def test_any_object_with_stream_configs_is_a_tracker() -> None:
    class Fixed:
        def stream_configs(self) -> list[StreamConfig]:
            return [StreamConfig("orders")]

    assert isinstance(Fixed(), StreamTracker)
    assert not isinstance(object(), StreamTracker)
