"""A child's stderr as it is written, partial lines included.

amazon_kclpy applications log to stderr, and some (the real amazon_kclpy sample among them)
write without a newline. A line reader then shows nothing until the child exits - hours for
a healthy consumer - which is what the Java daemon does. Here a partial line is shown once
the child has been quiet for ``QUIET_S`` or once it reaches ``max_bytes``; the rest of the
line follows as the next piece.
"""

from __future__ import annotations

import codecs
import os
import selectors
from collections.abc import Callable

#: how long a partial stderr line may wait for its newline before it is shown as it is
QUIET_S = 0.5


class PartialLines:
    """Bytes in, text lines out: whole lines at once, a partial one when ``flush``ed or when
    it reaches ``max_bytes``. UTF-8 split between reads is decoded whole."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    @property
    def pending(self) -> bool:
        return bool(self._partial)

    def feed(self, data: bytes) -> list[str]:
        text = self._partial + self._decoder.decode(data)
        *lines, self._partial = text.split("\n")
        out = [line.rstrip("\r") for line in lines]
        while len(self._partial.encode("utf-8")) >= self._max_bytes:
            piece, self._partial = _split_at_bytes(self._partial, self._max_bytes)
            out.append(piece)
        return out

    def flush(self) -> list[str]:
        """The partial line, if any, as it stands (and whatever the decoder held back)."""
        text = self._partial + self._decoder.decode(b"", final=True)
        self._partial = ""
        self._decoder.reset()
        return [text.rstrip("\r")] if text else []


def _split_at_bytes(text: str, max_bytes: int) -> tuple[str, str]:
    """The longest prefix of at most ``max_bytes`` UTF-8 bytes (at least one character)."""
    cut = len(text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")) or 1
    return text[:cut], text[cut:]


def pump(fd: int, emit: Callable[[str], None], *, max_bytes: int,
         quiet_s: float = QUIET_S) -> None:
    """Read ``fd`` until end of file, calling ``emit`` for every line or shown partial line."""
    lines = PartialLines(max_bytes)
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            if not selector.select(quiet_s if lines.pending else None):
                for line in lines.flush():
                    emit(line)
                continue
            chunk = os.read(fd, max_bytes)
            for line in lines.feed(chunk) if chunk else lines.flush():
                emit(line)
            if not chunk:
                return
