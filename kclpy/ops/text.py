"""Plain-text tables for the ``kclpy`` inspector's commands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO


def print_table(rows: Sequence[Sequence[str]], out: IO[str]) -> None:
    """Left-aligned columns two spaces apart; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")
