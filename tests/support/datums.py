"""A CloudWatch publisher stand-in that keeps every datum recorded, in order, so a test
reads the Java KCL datums an event became (``CloudWatchBackend(DatumSink(), ...)``)."""

from __future__ import annotations

from collections.abc import Mapping

#: (operation, name, value, unit, level, dimensions or None)
Datum = tuple[str, str, float, str, int, dict[str, str] | None]


class DatumSink:
    def __init__(self) -> None:
        self.datums: list[Datum] = []

    def record(self, operation: str, name: str, value: float, unit: str, level: int,
               dimensions: Mapping[str, str] | None = None) -> None:
        self.datums.append((operation, name, value, unit, level,
                            None if dimensions is None else dict(dimensions)))

    def values(self, operation: str, name: str) -> list[float]:
        """Every value recorded under ``operation``/``name``, in order."""
        return [d[2] for d in self.datums if d[0] == operation and d[1] == name]
