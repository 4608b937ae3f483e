"""The user-facing record, materialised lazily.

A GetRecords page can hold 10,000 records; most processors touch ``binary_data`` once and
never look at ``data`` (base64). So a record keeps whatever form it arrived in (base64 text
from the wire, or raw bytes from a KPL sub-record) and converts on first access only.
Attribute names are amazon_kclpy v3's.
"""

from __future__ import annotations

import binascii
from typing import Any

from pybase64 import b64decode


class Record:
    """One user record. For a KPL sub-record, ``sequence_number`` is the parent's."""

    __slots__ = (
        "_b64",
        "_bytes",
        "approximate_arrival_timestamp",
        "explicit_hash_key",
        "partition_key",
        "sequence_number",
        "sub_sequence_number",
    )

    # Not keyword-only: the parser and the de-aggregator build one Record per user record and
    # a positional call costs about half of a keyword call (~0.3 vs ~0.55 us on CPython 3.11).
    def __init__(
        self,
        sequence_number: str,
        partition_key: str,
        approximate_arrival_timestamp: int | None,
        sub_sequence_number: int = 0,
        data: bytes | None = None,
        b64: str | None = None,
        explicit_hash_key: str | None = None,
    ) -> None:
        if data is None and b64 is None:
            raise ValueError("a Record needs data or b64")
        self._bytes = data
        self._b64 = b64
        self.sequence_number = sequence_number
        self.sub_sequence_number = sub_sequence_number
        self.partition_key = partition_key
        #: epoch milliseconds, as amazon_kclpy reports it
        self.approximate_arrival_timestamp = approximate_arrival_timestamp
        self.explicit_hash_key = explicit_hash_key

    @property
    def binary_data(self) -> bytes:
        """The record's payload as bytes (decoded from base64 on first access)."""
        data = self._bytes
        if data is None:
            b64 = self._b64
            assert b64 is not None
            # pybase64's strict SIMD decoder, positional arguments (keywords cost more than
            # decoding 100 bytes): CPython's decoder does about 300 MB/s, which made base64
            # the largest cost of reading 10 KB records or KPL aggregates.
            try:
                data = b64decode(b64, None, True)
            except ValueError:
                # Not canonical base64 (Kinesis always sends canonical): decode it as leniently
                # as botocore does, so both give the same bytes for any input.
                data = binascii.a2b_base64(b64)
            self._bytes = data
        return data

    @property
    def data(self) -> str:
        """The payload base64-encoded, as amazon_kclpy's ``Record.data`` returns it."""
        if self._b64 is None:
            assert self._bytes is not None
            self._b64 = binascii.b2a_base64(self._bytes, newline=False).decode("ascii")
        return self._b64

    @property
    def size(self) -> int:
        """Payload length in bytes, without decoding: the bytes-processed metric sums it over
        every record, including ones the processor never reads."""
        if self._bytes is not None:
            return len(self._bytes)
        b64 = self._b64
        assert b64 is not None
        # Canonical base64 (what Kinesis sends): 4 characters per 3 bytes, "=" pads the end.
        return len(b64) * 3 // 4 - b64[-2:].count("=")

    @property
    def extended_sequence_number(self) -> tuple[int, int]:
        """Sortable position: (sequence number as int, sub-sequence number)."""
        return int(self.sequence_number), self.sub_sequence_number

    def get(self, key: str, default: Any = None) -> Any:
        """amazon_kclpy v1/v2 processors read records as dicts with camelCase keys."""
        return {
            "data": self.data,
            "partitionKey": self.partition_key,
            "sequenceNumber": self.sequence_number,
            "subSequenceNumber": self.sub_sequence_number,
            "approximateArrivalTimestamp": self.approximate_arrival_timestamp,
        }.get(key, default)

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __repr__(self) -> str:
        return (
            f"Record(sequence_number={self.sequence_number!r}, "
            f"sub_sequence_number={self.sub_sequence_number}, "
            f"partition_key={self.partition_key!r})"
        )


_MISSING = object()
