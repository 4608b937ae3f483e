"""The ``format("kinesis")`` source driven in this process as Spark drives it
(``latestOffset``, ``partitions``, ``read``, ``commit``): exact counts of what it asks
Kinesis for, with no Spark session to start."""

from __future__ import annotations

from typing import Any

from kclpy.spark.source import KinesisStreamReader, SourceOptions


def make_reader(url: str, stream: str, clock: Any = None, **options: str) -> KinesisStreamReader:
    opts = SourceOptions.parse({"streamName": stream, "endpointUrl": url, "region": "us-east-1",
                                **options})
    return KinesisStreamReader(opts) if clock is None else KinesisStreamReader(opts, clock)


def read_batch(reader: KinesisStreamReader, start: dict[str, Any],
               end: dict[str, Any]) -> list[bytes]:
    """What the executors would deliver for the batch (start, end]."""
    rows: list[bytes] = []
    for partition in reader.partitions(start, end):
        for batch in reader.read(partition):
            rows.extend(batch.column("data").to_pylist())
    return rows


def available_now(reader: KinesisStreamReader, limit: Any = None) -> tuple[list[bytes], int]:
    """Run the reader as Spark >= 4.2 runs Trigger.AvailableNow: the rows and the batches."""
    reader.prepareForTriggerAvailableNow()
    offset = reader.initialOffset()
    rows: list[bytes] = []
    batches = 0
    while True:
        end = reader.latestOffset(offset, limit)
        if end == offset:
            return rows, batches
        rows.extend(read_batch(reader, offset, end))
        reader.commit(end)
        batches += 1
        offset = end
