"""The one way a test waits for something another thread or process does on its own.

Tests never assert on how long a state took to come (the machine is shared and slow); they
wait for it with a generous timeout and, when it does not come, say what they waited for and
what they saw last, which is all a CI log has to go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

_SHOWN_CHARS = 500


def wait_for(
    predicate: Callable[[], _T | None],
    timeout: float = 10.0,
    message: str = "",
    interval: float = 0.05,
    seen: Callable[[], object] | None = None,
) -> _T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises AssertionError when ``timeout`` seconds pass first, naming what was awaited
    (``message``, else the predicate's name) and the last value ``predicate`` returned, or
    ``seen()`` when the predicate keeps what it saw elsewhere and only answers None.
    An exception ``predicate`` raises is not caught: a broken probe fails at once rather
    than at the timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; "
                f"last seen: {_shown(result if seen is None else seen())}")
        time.sleep(interval)


def _shown(value: object) -> str:
    text = repr(value)
    if len(text) > _SHOWN_CHARS:
        return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"
    return text
