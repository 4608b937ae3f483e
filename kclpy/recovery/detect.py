"""The two looks recovery takes at a shard before reading it: how old its first unprocessed
record is (is the shard too far behind?), and which record is now the oldest one kept (was
part of a gap trimmed by the stream's retention?). Both read through a one-record pipeline,
so iterators, retries and KPL de-aggregation are those of every other read."""

from __future__ import annotations

from typing import Protocol

from kclpy.records import Record, Records
from kclpy.retrieval.page import Page

#: pages an empty stretch of a shard may take before the probe gives up (Kinesis can answer
#: a few empty pages before the first record of a shard that was idle for long)
PROBE_PAGES = 20


class Probe(Protocol):
    def fetch_once(self) -> Page[Records] | None: ...

    @property
    def caught_up(self) -> bool: ...

    @property
    def finished(self) -> bool: ...


def first_record(probe: Probe, pages: int = PROBE_PAGES) -> Record | None:
    """The first record ``probe`` delivers, or None when the shard has none left (caught up,
    ended) within ``pages`` GetRecords."""
    for _ in range(pages):
        result = probe.fetch_once()
        if result is not None and result.records:
            return result.records[0]
        if probe.caught_up or probe.finished:
            return None
    return None
