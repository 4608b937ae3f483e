"""Watching records decode their payloads.

A record read from the wire keeps its payload as base64 text and decodes it only when
``binary_data`` is read; the hot path relies on that (a page is scanned for KPL aggregates
without decoding plain records), so tests check it by counting the decodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import kclpy.records


@contextmanager
def counting_decodes() -> Iterator[list[str]]:
    """The base64 texts records decode inside the block, in order."""
    decoded: list[str] = []
    original = kclpy.records._decode

    def counting(b64: str) -> bytes:
        decoded.append(b64)
        return original(b64)

    with mock.patch.object(kclpy.records, "_decode", counting):
        yield decoded
