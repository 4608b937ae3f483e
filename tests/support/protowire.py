"""Protobuf wire format written by hand, for aggregates no protobuf encoder would write:
fields out of order, repeated or unknown."""

from __future__ import annotations


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    """One field: a varint for an int, length-delimited for bytes."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value
