"""Records to Arrow: the one conversion both Spark paths share.

Spark turns a ``pyarrow.Table`` into a DataFrame by shipping its buffers to the JVM in bulk,
whereas a list of Python rows is pickled and converted value by value (bench/spark_ingest.py
measures the difference). So records become columns here, once, with no per-row objects, and
the column types match what Spark's Arrow reader expects (``timestamp[us, UTC]``), so neither
``createDataFrame`` nor a Python data source has to cast anything.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, repeat
from operator import add
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from kclpy.records import Record, Records, UserRecords, WireRecords

__all__ = [
    "MAX_BATCH_BYTES",
    "SCHEMA",
    "SPARK_SCHEMA_DDL",
    "Decoder",
    "records_to_batch",
    "records_to_batches",
    "records_to_table",
]

#: Column order and types of every batch, in both paths.
SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string()),
        pa.field("shard_id", pa.string()),
        pa.field("sequence_number", pa.string()),
        pa.field("sub_sequence_number", pa.int64()),
        pa.field("partition_key", pa.string()),
        pa.field("approximate_arrival_timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("data", pa.binary()),
    ]
)

#: The same schema as Spark DDL. Sequence numbers are strings because they exceed 64 bits.
SPARK_SCHEMA_DDL = (
    "stream string, shard_id string, sequence_number string, sub_sequence_number bigint, "
    "partition_key string, approximate_arrival_timestamp timestamp, data binary"
)

#: Turns the ``data`` column of a batch into extra columns (one row per record, same order).
#: Working on the whole column lets a decoder use Arrow's vectorised readers (for example
#: ``pyarrow.json.read_json`` over the joined payloads) instead of a Python loop per record.
Decoder = Callable[[pa.BinaryArray], "pa.Table | pa.RecordBatch"]

_MS_TIMESTAMP = pa.timestamp("ms", tz="UTC")
_US_TIMESTAMP = SCHEMA.field("approximate_arrival_timestamp").type

#: The most bytes of strings and payloads one record batch holds (a record larger than that
#: is alone in its batch). A batch copies every record's partition key, and a GetRecords page
#: of 10 MiB of tiny KPL user records holds up to 1.7 million of them: as one batch, several
#: hundred MiB at once per shard.
MAX_BATCH_BYTES = 4 * 2**20
#: what a row costs in Arrow besides its strings and payload: the sub-sequence number and
#: arrival time (8 bytes each), five 4-byte offsets and a validity bit or so
_ROW_OVERHEAD = 8 + 8 + 5 * 4 + 1
_KEY_CACHE_SIZE = 65_536


class _Run(NamedTuple):
    """A run of records as columns, in order. Arrivals are epoch seconds (as the wire and
    :class:`~kclpy.records.Record` keep them), or None."""

    data: Sequence[bytes]
    keys: Sequence[str]
    sequences: Sequence[str]
    subs: Sequence[int]
    arrivals: Sequence[float | None]


def _runs(records: Iterable[Record]) -> Iterator[_Run]:
    """The records as column runs. A page's rows and an aggregate's columns are turned
    into columns in C (the hot path: no :class:`Record` is built); anything else is read
    record by record."""
    if isinstance(records, Records):
        for part in records.parts:
            yield from _runs(part)
    elif isinstance(records, WireRecords):
        _, keys, sequences, arrivals = zip(*records.rows, strict=True)
        yield _Run(records.payloads(), keys, sequences, [0] * len(keys), arrivals)
    elif isinstance(records, UserRecords):
        n, first = len(records), records.first_sub_sequence_number
        yield _Run(records.data, records.partition_keys, [records.sequence_number] * n,
                   range(first, first + n), [records.arrival_s] * n)
    else:
        built = records if isinstance(records, list) else list(records)
        if built:
            yield _Run([r.binary_data for r in built], [r.partition_key for r in built],
                       [r.sequence_number for r in built],
                       [r.sub_sequence_number for r in built],
                       [None if m is None else m / 1000
                        for m in (r.timestamp_millis for r in built)])


class _KeySizes(dict[str, int]):
    """UTF-8 lengths of partition keys, measured once per key (a KPL page repeats a few
    keys over thousands of user records)."""

    def __missing__(self, key: str) -> int:
        if len(self) >= _KEY_CACHE_SIZE:
            self.clear()
        size = self[key] = len(key.encode("utf-8"))
        return size


class _Chunk:
    """Columns gathered for one record batch."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.keys: list[str] = []
        self.sequences: list[str] = []
        self.subs: list[int] = []
        self.arrivals: list[float | None] = []
        #: the rows' costs as :func:`records_to_batches` counts them
        self.size = 0

    def add(self, run: _Run, start: int, stop: int, size: int) -> None:
        if start == 0 and stop == len(run.data):
            self.data.extend(run.data)
            self.keys.extend(run.keys)
            self.sequences.extend(run.sequences)
            self.subs.extend(run.subs)
            self.arrivals.extend(run.arrivals)
        else:
            self.data.extend(run.data[start:stop])
            self.keys.extend(run.keys[start:stop])
            self.sequences.extend(run.sequences[start:stop])
            self.subs.extend(run.subs[start:stop])
            self.arrivals.extend(run.arrivals[start:stop])
        self.size += size

    def batch(self, stream: str, shard_id: str) -> pa.RecordBatch:
        n = len(self.data)
        # Arrival times stay seconds until here, then become milliseconds the way
        # Record.timestamp_millis rounds them (half to even), for the whole column at once.
        seconds = pa.array(self.arrivals, type=pa.float64())
        millis = pc.round(pc.multiply(seconds, 1000.0)).cast(pa.int64())
        return pa.RecordBatch.from_arrays(
            [
                pa.repeat(pa.scalar(stream, pa.string()), n),
                pa.repeat(pa.scalar(shard_id, pa.string()), n),
                pa.array(self.sequences, type=pa.string()),
                pa.array(self.subs, type=pa.int64()),
                pa.array(self.keys, type=pa.string()),
                millis.cast(_MS_TIMESTAMP).cast(_US_TIMESTAMP),
                pa.array(self.data, type=pa.binary()),
            ],
            schema=SCHEMA,
        )


def records_to_batch(stream: str, shard_id: str, records: Iterable[Record]) -> pa.RecordBatch:
    """One shard's records as one batch with :data:`SCHEMA`, however large."""
    chunk = _Chunk()
    for run in _runs(records):
        chunk.add(run, 0, len(run.data), 0)
    return chunk.batch(stream, shard_id)


def records_to_batches(stream: str, shard_id: str, records: Iterable[Record],
                       max_bytes: int = MAX_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """One shard's records as batches with :data:`SCHEMA` of at most ``max_bytes`` each, in
    order; none when there are no records.

    A row is counted with its partition key (in UTF-8), sequence number, payload and the
    stream and shard names repeated in it, so the batches stay bounded however many
    records share one key. The costs of a run are summed in C and the cuts found by
    bisection, so a batch costs a few calls per column, not a few per record: on an
    executor this conversion is most of the source's own work per row.
    """
    names = len(stream.encode()) + len(shard_id.encode()) + _ROW_OVERHEAD
    key_sizes = _KeySizes()
    chunk = _Chunk()
    for run in _runs(records):
        keys = run.keys
        # ASCII keys (the usual case) are as long in UTF-8 as in characters.
        key_lengths = (map(len, keys) if "".join(keys).isascii()
                       else map(key_sizes.__getitem__, keys))
        costs = map(add, map(add, key_lengths, map(len, run.sequences)),
                    map(len, run.data))
        ends = list(accumulate(map(add, costs, repeat(names))))
        start, before = 0, 0
        while start < len(ends):
            stop = bisect_right(ends, before + max_bytes - chunk.size, lo=start)
            if stop == start and not chunk.data:
                stop = start + 1  # a record larger than a batch is alone in one
            if stop > start:
                chunk.add(run, start, stop, ends[stop - 1] - before)
                start, before = stop, ends[stop - 1]
            if start < len(ends):
                yield chunk.batch(stream, shard_id)
                chunk = _Chunk()
    if chunk.data:
        yield chunk.batch(stream, shard_id)


def records_to_table(
    stream: str,
    parts: Iterable[tuple[str, Sequence[Record]]],
    decode: Decoder | None = None,
    *,
    streams: Mapping[str, str] | None = None,
) -> pa.Table:
    """Several shards' records (``(shard_id, records)`` pairs) as one table, made of record
    batches of at most :data:`MAX_BATCH_BYTES` each (:func:`records_to_batches`). Their ``stream``
    column is ``stream``, or for a shard of a multi-stream application what ``streams`` maps
    its id to.

    With ``decode``, its columns are appended after the standard ones; a decoder that
    returns a different number of rows is a bug in it and raises ``ValueError`` rather than
    silently misaligning payloads and decoded values.
    """
    named = streams or {}
    batches = [batch for shard_id, records in parts
               for batch in records_to_batches(named.get(shard_id, stream), shard_id, records)]
    table = pa.Table.from_batches(batches, schema=SCHEMA)
    if decode is None:
        return table
    data = table.column("data").combine_chunks()
    decoded = decode(data)
    if decoded.num_rows != table.num_rows:
        raise ValueError(
            f"decoder returned {decoded.num_rows} rows for {table.num_rows} records"
        )
    for name, column in zip(decoded.column_names, decoded.columns, strict=True):
        table = table.append_column(name, column)
    return table
