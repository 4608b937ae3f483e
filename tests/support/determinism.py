"""A hand-driven clock and a taker that always picks the first candidate: lease tests that
would otherwise depend on time passing or on random choices."""

from __future__ import annotations

import random
from collections.abc import MutableSequence
from typing import Any


class Clock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FirstChoiceRandom(random.Random):
    """Deterministic taker: no shuffling, the first candidate is always chosen."""

    def shuffle(self, x: MutableSequence[Any]) -> None:  # type: ignore[override]
        return None

    def choice(self, seq: Any) -> Any:
        return seq[0]
