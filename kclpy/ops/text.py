"""Plain-text output of the ``kclpy`` inspector's commands.

Much of what it prints was written by someone else: partition keys and error messages
come from producers' records, park reasons and worker ids from whoever can write the lease
table or run a worker. Printed raw, an escape sequence among them could rewrite the
operator's terminal (move the cursor, hide lines, set the window title), so every control
character is printed as its Python escape instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import IO

#: C0 controls, DEL, C1 controls, and the bidirectional overrides that reorder what is shown
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
#: the same, but a line break of kclpy's own is kept
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]


def printable(text: str) -> str:
    """``text`` with every control character (line breaks included) escaped: a field
    printed on one line stays on that line."""
    return _CONTROL.sub(_escape, text)


class TerminalText:
    """A text stream that escapes control characters other than line breaks: the catch-all
    behind the per-field :func:`printable`, for any output a command writes."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def write(self, text: str) -> int:
        return self._out.write(_CONTROL_BUT_NEWLINE.sub(_escape, text))

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return self._out.isatty()


def print_table(rows: Sequence[Sequence[str]], out: IO[str]) -> None:
    """Left-aligned columns two spaces apart; the first row is the header."""
    rows = [[printable(cell) for cell in row] for row in rows]
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
