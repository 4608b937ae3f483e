"""Where the executors record the end a budgeted batch reached (``metadataPath``).

Spark fixes a batch's end offset before any task runs, and offers a Python source no way for
a task to tell the driver anything. A batch cut after N rows, N bytes or N seconds of
reading ends where an executor stops, which the driver could only learn by reading the same
records itself. So the end in the offset log is the budget (an ``UPTO`` position), and the
executor that reads it writes the concrete position it reached here, under a name derived
from that end. The driver reads it back to plan the next batch, and a batch Spark re-runs
(after a failed task or a killed driver) reads exactly to the recorded position.

One record per (shard, planned end), created once: the first attempt to finish wins and any
later attempt is held to its result, so a re-run yields the same rows even when the budget
was time, and a retried task that reached the same position writes nothing new. The store
is whatever the driver and every executor reach, chosen by ``metadataPath``'s scheme
(:data:`STORES`):

- a directory path: the same machine in ``local[N]``, a shared mount on a cluster; files
  are written to a temporary name, flushed and linked into place, which is atomic and
  refuses to replace on POSIX filesystems;
- ``s3://bucket/prefix``: objects created with ``If-None-Match: *``, which S3 (and the
  S3-compatible stores that implement conditional writes) refuses to replace;
- ``dynamodb://table/prefix``: items put on condition that they are absent, in a table
  created on first use (PAY_PER_REQUEST), as the lease table is.

A cluster without a shared filesystem (EMR, Databricks jobs clusters) has the last two.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import botocore.config
from botocore.exceptions import ClientError

from kclpy.errors import KCLError
from kclpy.leases.dynamo import CONDITION_FAILED, DynamoTable
from kclpy.position import Position
from kclpy.retry import GaveUp, RetryPolicy, error_code, retrying
from kclpy.spark.offsets import UptoEnd, decode_entry

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

    from kclpy.spark.options import SourceOptions

__all__ = ["STORES", "ConflictingEndError", "Location", "MetadataStore", "ObjectStore",
           "PositionStore", "TableStore", "open_store", "parse_location"]


class ConflictingEndError(KCLError, RuntimeError):
    """Another attempt at the same part of a batch recorded a different end first: this
    attempt's rows are not the batch's, so the task fails and Spark's retry reads to the
    recorded end."""


class MetadataStore(Protocol):
    """What the source needs of a place to keep budgeted ends: the driver and the executors
    reach the same one, and a record, once created, never changes."""

    def get(self, shard_key: str, end: UptoEnd) -> Position | None:
        """The position the end was recorded to have reached, None if it was not."""

    def put(self, shard_key: str, end: UptoEnd, reached: Position) -> Position:
        """Record ``reached`` unless a position is recorded already; the recorded one."""

    def forget_older(self, shard_key: str, end: UptoEnd) -> None:
        """Drop the shard's records that no batch after ``end``'s committed one can need."""


def _shard_name(shard_key: str) -> str:
    return hashlib.sha256(shard_key.encode()).hexdigest()[:24]


def _end_name(end: UptoEnd) -> str:
    return hashlib.sha256(end.encode().encode()).hexdigest()[:40]


def _body(shard_key: str, end: UptoEnd, reached: Position) -> str:
    return json.dumps({"shard": shard_key, "end": end.encode(), "reached": reached.encode()})


def _reached(where: str, end: UptoEnd, text: str) -> Position:
    item = json.loads(text)
    if item.get("end") != end.encode():
        raise ValueError(f"{where}: the record for {end.encode()} names "
                         f"{item.get('end')!r} (a hash collision or a foreign record)")
    return Position.decode(item["reached"])


def _starts_before(start: Position, other: Position) -> bool:
    """Whether a part starting at ``start`` belongs to a batch before one starting at
    ``other``. Every batch of a shard starts where the one before it stopped, so starts only
    move on; a later batch may start where an earlier one did only when that one read
    nothing. Kept when unsure (two starts before any record): a record too many, never a
    record a re-run still needs. Unlike a written time, this needs no clock that the driver
    and every executor share."""
    if not other.is_record:
        return False
    return not start.is_record or start.extended < other.extended


class PositionStore:
    """A directory the driver and every executor see."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, shard_key: str, end: UptoEnd) -> Path:
        return self.root / _shard_name(shard_key) / f"{_end_name(end)}.json"

    def get(self, shard_key: str, end: UptoEnd) -> Position | None:
        """The position the end was recorded to have reached, None if it was not."""
        try:
            text = self._path(shard_key, end).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        return _reached(str(self.root), end, text)

    def put(self, shard_key: str, end: UptoEnd, reached: Position) -> Position:
        """Record ``reached`` unless a position is recorded already; the recorded one."""
        path = self._path(shard_key, end)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(_body(shard_key, end, reached))
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        recorded = self.get(shard_key, end)
        assert recorded is not None
        return recorded

    def forget_older(self, shard_key: str, end: UptoEnd) -> None:
        """Drop the records of parts that started before ``end``'s (``_starts_before``), as
        the bucket and table stores do: not by the time a file was written, which hosts
        sharing a mount may set from clocks that disagree."""
        keep = self._path(shard_key, end)
        try:
            entries = list(keep.parent.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith(".") or entry == keep:  # a record being written
                continue
            try:
                recorded = decode_entry(json.loads(entry.read_text(encoding="utf-8"))["end"])
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError):  # not one of ours
                continue
            if isinstance(recorded, UptoEnd) and _starts_before(recorded.start, end.start):
                entry.unlink(missing_ok=True)


#: how often a write S3 answers 409 (a concurrent write of the same record) is tried, and
#: the waits between: jittered, so that the attempts racing for one record drift apart
_CONFLICT_ATTEMPTS = 5
_CONFLICT_RETRIES = RetryPolicy(0.1, 1.0, max_attempts=_CONFLICT_ATTEMPTS)


class ObjectStore:
    """An S3 bucket (or an S3-compatible store) under a key prefix: one object per record,
    named ``<prefix><shard hash>/<start>.<end hash>.json`` so that clean-up finds the
    older ones from a listing alone."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def _folder(self, shard_key: str) -> str:
        return f"{self.prefix}{_shard_name(shard_key)}/"

    def _key(self, shard_key: str, end: UptoEnd) -> str:
        start = end.start.encode().replace("/", "-")
        return f"{self._folder(shard_key)}{start}.{_end_name(end)}.json"

    def get(self, shard_key: str, end: UptoEnd) -> Position | None:
        """The position the end was recorded to have reached, None if it was not."""
        key = self._key(shard_key, end)
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        return _reached(f"s3://{self.bucket}/{key}", end, answer["Body"].read().decode())

    def put(self, shard_key: str, end: UptoEnd, reached: Position) -> Position:
        """Record ``reached`` unless a position is recorded already; the recorded one."""
        key = self._key(shard_key, end)

        def put_once() -> Position:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key,
                                       Body=_body(shard_key, end, reached).encode(),
                                       ContentType="application/json", IfNoneMatch="*")
                return reached
            except ClientError as exc:
                if error_code(exc) != "PreconditionFailed":
                    raise
                recorded = self.get(shard_key, end)
                if recorded is None:
                    raise  # gone before it could be read: the write is tried again
                return recorded

        def conflicting(exc: BaseException) -> bool:
            # 409: another attempt's write of the same key is under way; S3 asks for a retry
            return isinstance(exc, ClientError) and error_code(exc) in (
                "ConditionalRequestConflict", "PreconditionFailed")

        try:
            return retrying(put_once, _CONFLICT_RETRIES, retry_on=conflicting)
        except GaveUp as gave_up:
            raise ConflictingEndError(
                f"s3://{self.bucket}/{key}: still being written by another attempt after "
                f"{_CONFLICT_ATTEMPTS} tries") from gave_up.last

    def _listing(self, folder: str) -> Iterator[str]:
        token: dict[str, str] = {}
        while True:
            page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=folder, **token)
            yield from (item["Key"] for item in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def forget_older(self, shard_key: str, end: UptoEnd) -> None:
        """Drop the records of parts that started before ``end``'s did."""
        folder = self._folder(shard_key)
        old = []
        for key in self._listing(folder):
            start, _, _ = key[len(folder):].partition(".")
            try:
                position = Position.decode(start.replace("-", "/"))
            except ValueError:  # not one of ours
                continue
            if _starts_before(position, end.start):
                old.append({"Key": key})
        for first in range(0, len(old), 1000):  # DeleteObjects takes 1,000 keys
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": old[first:first + 1000],
                                               "Quiet": True})


#: the record table's keys: a query's shard (``<prefix><shard key>``) and the planned end
SHARD_KEY, END_KEY, REACHED = "shardKey", "batchEnd", "reached"


class TableStore:
    """A DynamoDB table, one item per record: hash key the shard (under the prefix), range
    key the planned end, so that clean-up reads a shard's few records with one query."""

    def __init__(self, client: DynamoDBClient, table_name: str, prefix: str) -> None:
        self.table = DynamoTable(client, table_name, hash_key=SHARD_KEY, range_key=END_KEY)
        self.table.kind = "Spark source metadata"
        self.prefix = prefix

    def create_if_missing(self) -> None:
        """Create the table unless it exists (several executors may race: losing is fine)."""
        self.table.create_if_missing()

    def _key(self, shard_key: str, end: UptoEnd) -> dict[str, Any]:
        return {SHARD_KEY: {"S": self.prefix + shard_key}, END_KEY: {"S": end.encode()}}

    def get(self, shard_key: str, end: UptoEnd) -> Position | None:
        """The position the end was recorded to have reached, None if it was not."""
        table = self.table
        item = table.call("GetItem", table.client.get_item, TableName=table.table_name,
                          Key=self._key(shard_key, end), ConsistentRead=True).get("Item")
        return None if item is None else Position.decode(item[REACHED]["S"])

    def put(self, shard_key: str, end: UptoEnd, reached: Position) -> Position:
        """Record ``reached`` unless a position is recorded already; the recorded one."""
        table = self.table
        try:
            table.call("PutItem", table.client.put_item, TableName=table.table_name,
                       Item={**self._key(shard_key, end), REACHED: {"S": reached.encode()}},
                       ConditionExpression="attribute_not_exists(#s)",
                       ExpressionAttributeNames={"#s": SHARD_KEY},
                       ReturnValuesOnConditionCheckFailure="ALL_OLD")
        except ClientError as exc:
            if error_code(exc) != CONDITION_FAILED:
                raise
            item: Any = exc.response.get("Item")
            if item is not None:
                return Position.decode(item[REACHED]["S"])
            recorded = self.get(shard_key, end)
            assert recorded is not None
            return recorded
        return reached

    def forget_older(self, shard_key: str, end: UptoEnd) -> None:
        """Drop the records of parts that started before ``end``'s did."""
        table = self.table
        page: dict[str, Any] = {}
        old = []
        while True:
            answer = table.call(
                "Query", table.client.query, TableName=table.table_name, ConsistentRead=True,
                KeyConditionExpression="#s = :s", ProjectionExpression="#s, #e",
                ExpressionAttributeNames={"#s": SHARD_KEY, "#e": END_KEY},
                ExpressionAttributeValues={":s": {"S": self.prefix + shard_key}}, **page)
            for item in answer.get("Items", []):
                try:
                    entry = decode_entry(item[END_KEY]["S"])
                except ValueError:  # not one of ours
                    continue
                if isinstance(entry, UptoEnd) and _starts_before(entry.start, end.start):
                    old.append({SHARD_KEY: item[SHARD_KEY], END_KEY: item[END_KEY]})
            if "LastEvaluatedKey" not in answer:
                break
            page = {"ExclusiveStartKey": answer["LastEvaluatedKey"]}
        for key in old:
            table.call("DeleteItem", table.client.delete_item, TableName=table.table_name,
                       Key=key)


@dataclass(frozen=True)
class Location:
    """``metadataPath`` taken apart: ``scheme`` ('' for a directory), then the directory,
    bucket or table, and the prefix (empty, or ending in ``/``) its records go under."""

    scheme: str
    name: str
    prefix: str = ""


_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<name>[^/]*)/?(?P<prefix>.*)$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_TABLE = re.compile(r"^[A-Za-z0-9_.-]{3,255}$")
_SCHEME_ONLY = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def parse_location(text: str) -> Location:
    """The store ``text`` names; ValueError saying what is wrong with it."""
    url = _URL.match(text)
    if url is None:
        if _SCHEME_ONLY.match(text):
            raise ValueError(f"{text!r} is not scheme://name/prefix")
        return Location("", text)
    scheme, name, prefix = url["scheme"].lower(), url["name"], url["prefix"]
    if scheme not in STORES:
        raise ValueError(f"{text!r}: a directory path, s3://bucket/prefix or "
                         f"dynamodb://table/prefix, not {scheme}://")
    pattern, what = (_BUCKET, "an S3 bucket name") if scheme == "s3" else (_TABLE,
                                                                          "a DynamoDB table name")
    if not pattern.match(name):
        raise ValueError(f"{text!r}: {name!r} is not {what}")
    return Location(scheme, name, prefix if not prefix or prefix.endswith("/") else prefix + "/")


def _config() -> botocore.config.Config:
    # A record is a few small requests per shard and batch: botocore's standard retries
    # (a conditional write retried after a lost answer finds its own record: the same end).
    return botocore.config.Config(max_pool_connections=32, retries={"mode": "standard"},
                                  connect_timeout=10, read_timeout=30,
                                  user_agent_extra="kclpy-spark-metadata")


def _directory(location: Location, options: SourceOptions) -> MetadataStore:
    return PositionStore(location.name)


def _bucket(location: Location, options: SourceOptions) -> MetadataStore:
    client = options.session().client("s3", endpoint_url=options.metadata_endpoint_url,
                                       config=_config())
    return ObjectStore(client, location.name, location.prefix)


def _table(location: Location, options: SourceOptions) -> MetadataStore:
    client = options.session().client("dynamodb", endpoint_url=options.metadata_endpoint_url,
                                      config=_config())
    store = TableStore(client, location.name, location.prefix)
    store.create_if_missing()
    return store


#: ``metadataPath``'s scheme -> how its store is opened
STORES: dict[str, Callable[[Location, SourceOptions], MetadataStore]] = {
    "": _directory, "s3": _bucket, "dynamodb": _table}

_OPEN: dict[SourceOptions, MetadataStore] = {}
_OPEN_LOCK = threading.Lock()


def open_store(options: SourceOptions) -> MetadataStore | None:
    """The store ``metadataPath`` names, None without one. One per process for the same
    options, as the source's Kinesis client is: making a client costs more than a small
    batch's records, and a table is looked up (or created) once."""
    if options.metadata_path is None:
        return None
    with _OPEN_LOCK:
        store = _OPEN.get(options)
        if store is None:
            location = parse_location(options.metadata_path)
            store = _OPEN[options] = STORES[location.scheme](location, options)
        return store
