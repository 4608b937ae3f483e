"""Records to Arrow: the one conversion both Spark paths share.

Spark turns a ``pyarrow.Table`` into a DataFrame by shipping its buffers to the JVM in bulk,
whereas a list of Python rows is pickled and converted value by value (bench/spark_ingest.py
measures the difference). So records become columns here, once, with no per-row objects, and
the column types match what Spark's Arrow reader expects (``timestamp[us, UTC]``), so neither
``createDataFrame`` nor a Python data source has to cast anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa

from kclpy.records import Record

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

#: The most bytes of strings and payloads one record batch holds (a record larger than that
#: is alone in its batch). A batch copies every record's partition key, and a GetRecords page
#: of 10 MiB of tiny KPL user records holds up to 1.7 million of them: as one batch, several
#: hundred MiB at once per shard.
MAX_BATCH_BYTES = 4 * 2**20
#: what a row costs in Arrow besides its strings and payload: the sub-sequence number and
#: arrival time (8 bytes each), five 4-byte offsets and a validity bit or so
_ROW_OVERHEAD = 8 + 8 + 5 * 4 + 1
_KEY_CACHE_SIZE = 65_536


def records_to_batch(stream: str, shard_id: str, records: Sequence[Record]) -> pa.RecordBatch:
    """One shard's records as a batch with :data:`SCHEMA`."""
    # One pass per column: build the records once, not once per pass (a batch may hold KPL
    # user records that are only built as they are read).
    records = records if isinstance(records, list) else list(records)
    n = len(records)
    arrival = pa.array(
        [r.timestamp_millis for r in records], type=_MS_TIMESTAMP
    ).cast(SCHEMA.field("approximate_arrival_timestamp").type)
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(stream, pa.string()), n),
            pa.repeat(pa.scalar(shard_id, pa.string()), n),
            pa.array([r.sequence_number for r in records], type=pa.string()),
            pa.array([r.sub_sequence_number for r in records], type=pa.int64()),
            pa.array([r.partition_key for r in records], type=pa.string()),
            arrival,
            pa.array([r.binary_data for r in records], type=pa.binary()),
        ],
        schema=SCHEMA,
    )


def records_to_batches(stream: str, shard_id: str, records: Iterable[Record],
                       max_bytes: int = MAX_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """One shard's records as batches with :data:`SCHEMA` of at most ``max_bytes`` each, in
    order; none when there are no records.

    A row is counted with its partition key (in UTF-8, measured once per key), sequence
    number, payload and the stream and shard names repeated in it, so the batches stay
    bounded however many records share one key. Records are built one batch at a time.
    """
    names = len(stream.encode()) + len(shard_id.encode()) + _ROW_OVERHEAD
    key_sizes: dict[str, int] = {}
    chunk: list[Record] = []
    size = 0
    for record in records:
        key = record.partition_key
        key_size = key_sizes.get(key)
        if key_size is None:
            if len(key_sizes) >= _KEY_CACHE_SIZE:
                key_sizes.clear()
            key_size = key_sizes[key] = len(key.encode("utf-8"))
        cost = names + key_size + len(record.sequence_number) + record.size
        if chunk and size + cost > max_bytes:
            yield records_to_batch(stream, shard_id, chunk)
            chunk, size = [], 0
        chunk.append(record)
        size += cost
    if chunk:
        yield records_to_batch(stream, shard_id, chunk)


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
