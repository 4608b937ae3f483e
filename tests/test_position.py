"""The one position type: its order (the Java KCL's ExtendedSequenceNumber), its lease
form and its Spark offset-log form."""

from __future__ import annotations

import ast
import itertools
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kclpy.position import (
    AT_TIMESTAMP,
    LATEST,
    MAX_SEQUENCE_DIGITS,
    SENTINELS,
    SHARD_END,
    TRIM_HORIZON,
    Position,
)
from kclpy.records import Record


def test_order_is_javas() -> None:
    big = "99999999999999999999999999999999999999999999999999999999"
    ordered = [Position.at_timestamp(), Position.trim_horizon(), Position.latest(),
               Position("0"), Position("1"), Position("1", 1), Position("2"), Position(big, 9),
               Position.shard_end()]
    assert sorted(reversed(ordered)) == ordered
    for lower, higher in itertools.pairwise(ordered):
        assert lower < higher and lower <= higher and higher > lower and higher >= lower
        assert lower != higher


def test_a_lease_items_two_attributes_round_trip() -> None:
    for checkpoint, sub in ((TRIM_HORIZON, 0), (LATEST, 0), (AT_TIMESTAMP, 0), (SHARD_END, 0),
                            ("4959", 3)):
        position = Position.of(checkpoint, sub)
        assert (position.checkpoint, position.sub_sequence_number) == (checkpoint, sub)
    assert Position.of(None, None) == Position.trim_horizon()
    assert Position.of("12", None) == Position("12", 0)


@pytest.mark.parametrize("bad", ["", "12x", "\u0661\u0665\u0660", "-1", "trim_horizon"])
def test_only_ascii_digits_or_a_sentinel(bad: str) -> None:
    with pytest.raises(ValueError):
        Position(bad)


def test_a_sequence_number_too_long_to_order_is_refused() -> None:
    """Positions are ordered by int(), which refuses more than Python's digit limit: such a
    sequence number (a hand-written lease checkpoint) is refused when read, not by whatever
    comparison meets it first (a lease item holding it is unreadable, and skipped)."""
    longest = "1" * MAX_SEQUENCE_DIGITS
    assert Position(longest) > Position("1")
    with pytest.raises(ValueError, match="too many to order"):
        Position(longest + "1")


def test_a_negative_sub_sequence_or_a_stray_time_is_refused() -> None:
    with pytest.raises(ValueError):
        Position("1", -1)
    with pytest.raises(ValueError):
        Position(TRIM_HORIZON, timestamp_ms=5)


def test_a_record_position() -> None:
    record = Record("4959", "k", None, 2, data=b"x")
    position = Position.after(record)
    assert position.extended == record.extended_sequence_number == (4959, 2)
    assert position.is_record and position.kind == "AFTER" and position.sentinel is None
    assert Position.latest().extended < (0, 0) <= Position("0").extended
    assert Position.shard_end().extended > Position("9" * 60, 9).extended


def test_at_time_keeps_the_millisecond() -> None:
    moment = datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=timezone.utc)
    position = Position.at_time(moment)
    assert position.timestamp_ms == 1_767_225_600_500
    assert position.moment == moment


def test_the_offset_log_text() -> None:
    for position, text in ((Position.trim_horizon(), "TRIM_HORIZON"),
                           (Position.shard_end(), "SHARD_END"),
                           (Position.at_timestamp(1_700_000_000_123), "AT_TIMESTAMP/1700000000123"),
                           (Position("4959", 3), "AFTER/4959/3")):
        assert position.encode() == text
        assert Position.decode(text) == position
    for nameless in (Position.latest(), Position.at_timestamp()):
        with pytest.raises(ValueError):
            nameless.encode()
    for bad in ("AFTER/12x/0", "AFTER/1/-1", "AT_TIMESTAMP/", "AT_TIMESTAMP", "LATEST",
                "SHARD_END/1", "AFTER/1", "nothing"):
        with pytest.raises(ValueError):
            Position.decode(bad)


def test_the_sentinels_are_spelt_out_only_in_position_py() -> None:
    """Everything else names them by their constants, so a reader finds every use of one by
    its name. A ``ShutdownReason`` value is a processor's shutdown cause, not a position."""
    package = Path(__file__).resolve().parent.parent / "kclpy"
    allowed = {package / "position.py": None, package / "processor.py": {"SHARD_END"}}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path in allowed and allowed[path] is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # a module re-exporting a constant lists its name in __all__: no value spelt out
        exported = {id(name) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                    for name in ast.walk(node.value)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in SENTINELS
                    and id(node) not in exported
                    and node.value not in (allowed.get(path) or ())):
                found.append(f"{path.relative_to(package)}:{node.lineno}: {node.value}")
    assert found == []
