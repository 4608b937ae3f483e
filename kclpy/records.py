"""The user-facing record, and the batch of them a processor receives.

The hot path's cost is per record, so neither is built the obvious way:

* A :class:`Record` is an immutable tuple whose fields are read by C-level descriptors,
  created with ``tuple.__new__`` mapped over rows or columns, never with a Python
  ``__init__`` per record. It keeps its payload in the form it arrived in (base64 text from
  the wire, bytes from a KPL sub-record) and converts only when read.
* :class:`Records`, what ``ProcessRecordsInput.records`` holds, keeps a page's records as the
  rows the parser picked (:class:`WireRecords`) and a KPL aggregate's user records as
  columns (:class:`UserRecords`), and builds each :class:`Record` only as the processor
  reaches it. A 10 MiB page is about 90,000 user records of 100 bytes: built all at once
  they would outlive the collector's young generation and be walked by every full
  collection; built one at a time they die young, unseen by the collector.

Attribute names are amazon_kclpy v3's.
"""

from __future__ import annotations

import binascii
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from itertools import chain, count, repeat
from operator import eq, is_, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, cast, overload

from pybase64 import b64decode

__all__ = ["Record", "Records"]


class Record(tuple[Any, ...]):
    """One user record. For a KPL sub-record, ``sequence_number`` is the parent's.

    An immutable value: records compare equal when they hold the same fields in the same
    form (a record read from the wire never equals one built from bytes), and they may be
    kept, hashed or sent to another process (they pickle). Read ``binary_data`` once per use and
    keep the result if you need it several times: a record read from the wire holds its
    payload as base64 text and decodes it on every access rather than caching it.
    """

    __slots__ = ()

    if TYPE_CHECKING:
        partition_key: str
        sequence_number: str
        sub_sequence_number: int
        #: the sub-record's explicit hash key (decimal), if the KPL producer set one
        explicit_hash_key: str | None
        _arrival_s: float | None

        @property
        def binary_data(self) -> bytes: ...

        @property
        def data(self) -> str: ...

        @property
        def size(self) -> int: ...

    if TYPE_CHECKING:
        # Installed after the subclasses (see _new_record): declared here for type checkers.
        def __new__(
            cls,
            sequence_number: str,
            partition_key: str,
            timestamp_millis: int | None,
            sub_sequence_number: int = 0,
            data: bytes | None = None,
            b64: str | None = None,
            explicit_hash_key: str | None = None,
        ) -> Record: ...

    @property
    def timestamp_millis(self) -> int | None:
        """When Kinesis accepted the record, in epoch milliseconds (amazon_kclpy's name)."""
        seconds = self._arrival_s
        # round, not int: in binary floating point 1.001 * 1000 is 1000.9999999999999
        return None if seconds is None else round(seconds * 1000)

    @property
    def approximate_arrival_timestamp(self) -> datetime | None:
        """:attr:`timestamp_millis` as amazon_kclpy's v3 ``Record`` returns it: a naive
        ``datetime`` in the machine's local time (``datetime.fromtimestamp``)."""
        millis = self.timestamp_millis
        return None if millis is None else datetime.fromtimestamp(millis / 1000)

    @property
    def extended_sequence_number(self) -> tuple[int, int]:
        """Sortable position: (sequence number as int, sub-sequence number)."""
        return int(self.sequence_number), self.sub_sequence_number

    def get(self, key: str, default: Any = None) -> Any:
        """The field under amazon_kclpy's JSON name (``data``, ``partitionKey``, ...)."""
        getter = _JSON_NAMES.get(key)
        return default if getter is None else getter(self)

    def __reduce__(self) -> tuple[Callable[..., Record], tuple[type[Record], tuple[Any, ...]]]:
        # The constructor takes named fields, not the stored tuple.
        return _restore, (type(self), tuple(self))

    def __repr__(self) -> str:
        return (
            f"Record(sequence_number={self.sequence_number!r}, "
            f"sub_sequence_number={self.sub_sequence_number}, "
            f"partition_key={self.partition_key!r})"
        )


def _restore(cls: type[Record], fields: tuple[Any, ...]) -> Record:
    return tuple.__new__(cls, fields)


def _decode(b64: str) -> bytes:
    # pybase64's strict SIMD decoder, positional arguments (keywords cost more than decoding
    # 100 bytes): CPython's decoder does about 300 MB/s, which made base64 the largest cost
    # of reading 10 KB records or KPL aggregates.
    try:
        return b64decode(b64, None, True)
    except ValueError:
        # Not canonical base64 (Kinesis always sends canonical): decode it as leniently as
        # botocore does, so both give the same bytes for any input.
        return binascii.a2b_base64(b64)


# The field layouts. Subclassing a NamedTuple would put ``_replace``, ``_asdict`` and the
# stored forms on the public type; only its C-level field descriptors are borrowed, which
# read a tuple slot without a Python call (and without going through ``__getitem__``).
class _WireLayout(NamedTuple):
    b64: str
    partition_key: str
    sequence_number: str
    arrival_s: float | None


class _BytesLayout(NamedTuple):
    data: bytes
    partition_key: str
    sequence_number: str
    sub_sequence_number: int
    arrival_s: float | None
    explicit_hash_key: str | None


class _WireRecord(Record):
    """A record as GetRecords returned it: payload still base64 text, arrival in seconds."""

    __slots__ = ()
    if TYPE_CHECKING:
        _b64: str
    else:
        # Built from one tuple of its fields by tuple's own C constructor (see _new_record).
        __new__ = tuple.__new__
        _b64 = _WireLayout.b64
        partition_key = _WireLayout.partition_key
        sequence_number = _WireLayout.sequence_number
        _arrival_s = _WireLayout.arrival_s
        sub_sequence_number = 0
        explicit_hash_key = None

    @property
    def binary_data(self) -> bytes:
        """The payload as bytes, decoded from base64 on each access."""
        return _decode(self._b64)

    @property
    def data(self) -> str:
        """The payload base64-encoded, as amazon_kclpy's ``Record.data`` returns it."""
        return self._b64

    @property
    def size(self) -> int:
        """Payload length in bytes, without decoding."""
        b64 = self._b64
        # Canonical base64 (what Kinesis sends): 4 characters per 3 bytes, "=" pads the end.
        return len(b64) * 3 // 4 - b64[-2:].count("=")


class _BytesRecord(Record):
    """A record whose payload is bytes: a KPL user record, or one built from bytes."""

    __slots__ = ()
    if not TYPE_CHECKING:
        __new__ = tuple.__new__
        binary_data = _BytesLayout.data
        partition_key = _BytesLayout.partition_key
        sequence_number = _BytesLayout.sequence_number
        sub_sequence_number = _BytesLayout.sub_sequence_number
        _arrival_s = _BytesLayout.arrival_s
        explicit_hash_key = _BytesLayout.explicit_hash_key

    @property
    def data(self) -> str:
        """The payload base64-encoded, as amazon_kclpy's ``Record.data`` returns it."""
        return binascii.b2a_base64(self.binary_data, newline=False).decode("ascii")

    @property
    def size(self) -> int:
        return len(self.binary_data)


make_wire_record = cast(Callable[[tuple[Any, ...]], Record], _WireRecord)
"""Build a wire record from ``(b64, partition_key, sequence_number, arrival_s)``; mapped
over zipped columns, the whole construction runs in C."""
make_bytes_record = cast(Callable[[tuple[Any, ...]], Record], _BytesRecord)
"""Build a bytes record from ``(data, partition_key, sequence_number, sub_sequence_number,
arrival_s, explicit_hash_key)``."""


def _new_record(
    cls: type[Record],
    sequence_number: str,
    partition_key: str,
    timestamp_millis: int | None,
    sub_sequence_number: int = 0,
    data: bytes | None = None,
    b64: str | None = None,
    explicit_hash_key: str | None = None,
) -> Record:
    """A record from its fields: the arrival time in epoch milliseconds, the payload as
    ``data`` (bytes) or ``b64`` (base64 text). Not keyword-only, to stay compatible with code
    written against the first versions."""
    arrival = None if timestamp_millis is None else timestamp_millis / 1000
    if data is None:
        if b64 is None:
            raise ValueError("a Record needs data or b64")
        if sub_sequence_number == 0 and explicit_hash_key is None:
            return make_wire_record((b64, partition_key, sequence_number, arrival))
        data = _decode(b64)
    return make_bytes_record(
        (data, partition_key, sequence_number, sub_sequence_number, arrival, explicit_hash_key))


# Record's constructor is installed only now, after its subclasses: a class whose own
# ``__new__`` is ``tuple.__new__`` gets tuple's C constructor in its type slot only if no
# base defines ``__new__`` in Python when the class is created. Defined in Record's body,
# it would put a Python-level lookup and call in every record built (about 60 ns of the
# 250 a KPL user record costs from columns to the processor). Assigning it later leaves
# the subclasses' slots alone, since they define ``__new__`` themselves.
Record.__new__ = staticmethod(_new_record)  # type: ignore[method-assign]
wire_b64: Callable[[tuple[Any, ...]], str] = itemgetter(0)
"""The base64 text of a wire record, read in C (for scans over a whole page)."""


def is_wire_record(record: Record) -> bool:
    """Whether the record still holds base64 text from the wire (reading its bytes decodes)."""
    return type(record) is _WireRecord


def all_wire_records(records: list[Record]) -> bool:
    """:func:`is_wire_record` for every record, in C: no Python call per record."""
    return all(map(is_, map(type, records), repeat(_WireRecord)))


_JSON_NAMES: dict[str, Callable[[Record], Any]] = {
    "data": lambda r: r.data,
    "partitionKey": lambda r: r.partition_key,
    "sequenceNumber": lambda r: r.sequence_number,
    "subSequenceNumber": lambda r: r.sub_sequence_number,
    "approximateArrivalTimestamp": lambda r: r.timestamp_millis,
}


class RecordSequence(Sequence[Record]):
    """A read-only sequence of records that compares like a list of them: the batches kclpy
    hands over stand in for the lists amazon_kclpy hands over."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordSequence | list | tuple):
            return len(self) == len(other) and all(map(eq, self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class UserRecords(RecordSequence):
    """One KPL aggregate's user records as columns; a :class:`Record` is built per read.

    All of them share the aggregate's sequence number and arrival time; sub-sequence numbers
    run from ``first_sub_sequence_number`` (a slice of an aggregate keeps its numbering).
    """

    __slots__ = ("arrival_s", "data", "explicit_hash_keys", "first_sub_sequence_number",
                 "partition_keys", "sequence_number")

    def __init__(
        self,
        sequence_number: str,
        arrival_s: float | None,
        data: list[bytes],
        partition_keys: list[str],
        explicit_hash_keys: list[str | None] | None = None,
        first_sub_sequence_number: int = 0,
    ) -> None:
        if len(partition_keys) != len(data) or (
                explicit_hash_keys is not None and len(explicit_hash_keys) != len(data)):
            raise ValueError("the columns of an aggregate differ in length")
        self.sequence_number = sequence_number
        self.arrival_s = arrival_s
        self.data = data
        self.partition_keys = partition_keys
        #: None when no sub-record has one (the common case: no column to keep)
        self.explicit_hash_keys = explicit_hash_keys
        self.first_sub_sequence_number = first_sub_sequence_number

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Record]:
        ehks = self.explicit_hash_keys
        return map(make_bytes_record, zip(
            self.data, self.partition_keys, repeat(self.sequence_number),
            count(self.first_sub_sequence_number), repeat(self.arrival_s),
            repeat(None) if ehks is None else ehks))

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> UserRecords: ...

    def __getitem__(self, index: int | slice) -> Record | UserRecords:
        ehks = self.explicit_hash_keys
        if isinstance(index, slice):
            start, _, step = index.indices(len(self))
            if step != 1:
                raise ValueError("user records slice with step 1 only")
            return UserRecords(self.sequence_number, self.arrival_s, self.data[index],
                               self.partition_keys[index],
                               None if ehks is None else ehks[index],
                               self.first_sub_sequence_number + start)
        if index < 0:
            index += len(self)
        return make_bytes_record((
            self.data[index], self.partition_keys[index], self.sequence_number,
            self.first_sub_sequence_number + index, self.arrival_s,
            None if ehks is None else ehks[index]))

    def payload_bytes(self) -> int:
        return sum(map(len, self.data))


WireRow = tuple[str, str, str, "float | None"]
"""A record as GetRecords returned it: ``(b64, partition_key, sequence_number, arrival_s)``."""


class WireRecords(RecordSequence):
    """A GetRecords page's records as plain rows; a :class:`Record` is built per read.

    Why rows: a tuple of strings and numbers is dropped from the garbage collector's lists the
    first time the collector looks at it, a :class:`Record` (a tuple subclass) never is. Pages
    wait in every shard's prefetch queue, up to 30,000 records per shard, so as records they
    would make every full collection of a worker following hundreds of shards walk millions
    of objects; as rows they cost it nothing.
    """

    __slots__ = ("rows",)

    def __init__(self, rows: list[WireRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Record]:
        return map(make_wire_record, self.rows)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> WireRecords: ...

    def __getitem__(self, index: int | slice) -> Record | WireRecords:
        if isinstance(index, slice):
            return WireRecords(self.rows[index])
        return make_wire_record(self.rows[index])

    def texts(self) -> list[str]:
        """Every record's base64 text, in C."""
        return list(map(wire_b64, self.rows))

    def payloads(self) -> list[bytes]:
        """Every record's payload as bytes, decoded in C: for a consumer that wants the
        whole column (kclpy.spark.arrow) rather than one record at a time."""
        texts = self.texts()
        try:
            return list(map(b64decode, texts, repeat(None), repeat(True)))
        except ValueError:
            return list(map(_decode, texts))

    def payload_bytes(self) -> int:
        texts = self.texts()
        # Canonical base64 is a multiple of 4 characters per record, and "=" only ever pads
        # the end: one pass over the lengths, one count over the text.
        return sum(map(len, texts)) * 3 // 4 - "".join(texts).count("=")

    def __repr__(self) -> str:
        return f"<WireRecords: {len(self)}>"


_Part = Sequence[Record]
"""A run of a batch: records already built, a page's records as rows (:class:`WireRecords`) or
one aggregate's user records as columns (:class:`UserRecords`)."""


class Records(RecordSequence):
    """A batch of records in order, as ``ProcessRecordsInput.records`` holds them.

    A read-only sequence: ``len``, indexing, slicing, iterating and ``==`` work as on a list
    (each pass builds the records again; ``list(records)`` keeps them). Built from runs of records
    that already exist and runs of KPL user records still held as columns.
    """

    __slots__ = ("_ends", "_parts")

    def __init__(self, parts: Sequence[_Part] = ()) -> None:
        self._parts: list[_Part] = [part for part in parts if len(part)]
        ends = []
        total = 0
        for part in self._parts:
            total += len(part)
            ends.append(total)
        #: cumulative lengths, for indexing by bisection
        self._ends: list[int] = ends

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def parts(self) -> Sequence[_Part]:
        """The runs the batch is made of, in order, none empty: what a consumer that works
        on whole columns (kclpy.spark.arrow) reads instead of building every record."""
        return self._parts

    def __iter__(self) -> Iterator[Record]:
        parts = self._parts
        if len(parts) == 1:
            return iter(parts[0])
        return chain.from_iterable(parts)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> Records: ...

    def __getitem__(self, index: int | slice) -> Record | Records:
        if isinstance(index, slice):
            return self._slice(index)
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("Records index out of range")
        i = bisect_right(self._ends, index)
        return self._parts[i][index - (self._ends[i - 1] if i else 0)]

    def _slice(self, index: slice) -> Records:
        start, stop, step = index.indices(len(self))
        if step != 1:
            return Records([list(self)[index]])
        parts: list[_Part] = []
        begin = 0
        for part, end in zip(self._parts, self._ends, strict=True):
            lo, hi = max(start - begin, 0), min(stop, end) - begin
            if lo < hi:
                parts.append(part[lo:hi] if lo or hi < len(part) else part)
            begin = end
        return Records(parts)

    def after(self, position: tuple[int, int]) -> Records:
        """The records strictly after ``position`` (an ``extended_sequence_number``): what is
        left of a batch once the records a checkpoint covers are dropped."""
        for i, record in enumerate(self):
            if record.extended_sequence_number > position:
                return self[i:] if i else self
        return EMPTY

    def payload_bytes(self) -> int:
        """The total payload length in bytes, without decoding or building records."""
        total = 0
        for part in self._parts:
            if isinstance(part, UserRecords | WireRecords):
                total += part.payload_bytes()
            else:
                total += sum(record.size for record in part)
        return total

    def __repr__(self) -> str:
        return f"<Records: {len(self)}>"


EMPTY = Records()
