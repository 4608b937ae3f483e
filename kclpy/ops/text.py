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


def safe_text(text: str, limit: int) -> str:
    """``text`` fit to show where it did not come from us (an exception's message on an
    endpoint, in a terminal): control and other non-printing characters escaped, so it
    cannot move a cursor or forge a line, and at most ``limit`` characters kept, the rest
    counted."""
    kept = text[:limit]
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                    for c in kept)
    if len(text) > limit:
        shown += f"... [{len(text) - limit} more characters]"
    return shown
