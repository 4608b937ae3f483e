"""kclpy/streams.py: how a stream is configured and identified, and how a multi-stream lease key
names its stream (the Java KCL's StreamConfig, StreamIdentifier and MultiStreamLease key)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kclpy.streams import StreamIdentifier, multi_stream_lease_key, stream_of_lease_key

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
