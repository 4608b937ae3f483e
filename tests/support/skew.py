"""A shard whose answers show Kinesis' own time, for reads bounded by a time computed on a
local clock running ahead of Kinesis' (botocore's Stubber: every answer carries the
``Date`` header Kinesis sends, as AWS and kinesis-mock do)."""

from __future__ import annotations

from datetime import datetime, timezone
from email.utils import formatdate
from typing import Any

from botocore.stub import Stubber

from kclpy.retrieval.clock import KinesisClock

#: Kinesis' time when the script starts (2026-01-01T00:00:00Z), epoch ms
KINESIS_MS = 1_767_225_600_000
#: how far the local clock is ahead of Kinesis' in these scripts
SKEW_MS = 5_000


def answer(kinesis_ms: int, **fields: Any) -> dict[str, Any]:
    """An answer Kinesis sent at ``kinesis_ms`` (its ``Date`` header: whole seconds)."""
    date = formatdate(kinesis_ms / 1000, usegmt=True)
    return {**fields, "ResponseMetadata": {"HTTPHeaders": {"date": date}}}


def record(n: int, arrived_ms: int) -> dict[str, Any]:
    return {"SequenceNumber": str(100 + n), "PartitionKey": "k", "Data": f"r{n}".encode(),
            "ApproximateArrivalTimestamp": datetime.fromtimestamp(arrived_ms / 1000,
                                                                  tz=timezone.utc)}


def page(kinesis_ms: int, n: int, *records: dict[str, Any]) -> dict[str, Any]:
    """A GetRecords answer at the tip (MillisBehindLatest 0) with ``records``."""
    return answer(kinesis_ms, Records=list(records), NextShardIterator=f"it-{n}",
                  MillisBehindLatest=0)


def script_late_record(stubber: Stubber) -> None:
    """One record before the tip; the tip read at Kinesis' ``KINESIS_MS``; a record that
    arrives a second later; the tip again, twice, the second time with Kinesis' time past
    ``KINESIS_MS + 4000`` (a bound 1 s before a local clock ``SKEW_MS`` ahead)."""
    k = KINESIS_MS
    stubber.add_response("get_shard_iterator", answer(k, ShardIterator="it-0"))
    stubber.add_response("get_records", page(k, 1, record(0, k - 2000)))
    stubber.add_response("get_records", page(k, 2))
    stubber.add_response("get_records", page(k + 1000, 3, record(1, k + 1000)))
    stubber.add_response("get_records", page(k + 5000, 4))
    stubber.add_response("get_records", page(k + 5000, 5))


class AgedKinesisClock(KinesisClock):
    """Kinesis' clock for tests that age records by moving time on (an emulator cannot age
    records): the time they show it (``observe``) is Kinesis' time, held still, and the
    emulator's own ``Date`` headers, which tell the real time, are not taken in."""

    def __init__(self) -> None:
        super().__init__(monotonic=lambda: 0.0)

    def observe_date(self, date: str) -> None:
        """The emulator's real time is before the test's Kinesis time."""

    def move_to(self, epoch_s: float) -> None:
        """Kinesis' time is ``epoch_s`` (to the millisecond)."""
        ms = round(epoch_s * 1000)
        self.observe(ms, ms + 1)
