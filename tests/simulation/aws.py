"""In-memory Kinesis and DynamoDB shaped like botocore clients, and the seeded fault layer.

Only the operations kclpy calls exist. A request is applied to the in-memory state at once,
inside the baton, so every conditional write is atomic; its *answer* then takes a virtual
latency, and the fault layer may make it late (around the failover time), lose it after the
write landed (botocore then retries, as its ``standard`` mode does), throttle it or answer
5xx. Errors are botocore's own ``ClientError`` with the codes AWS uses, so kclpy's error
handling is what runs.

The condition and update expressions are evaluated by a small evaluator of the grammar kclpy
writes (``#a = :v``, ``attribute_exists``, ``attribute_not_exists`` joined by AND; SET, ADD,
REMOVE) rather than by moto's in-process backend: it is a few dozen lines, has no parser to
warm up per history, and what it does not know fails the history instead of guessing.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import formatdate
from typing import Any, cast

from botocore.exceptions import ClientError, ReadTimeoutError

from kclpy.retrieval.clock import kinesis_clock
from tests.simulation import scheduler
from tests.simulation.scheduler import EPOCH, Node, Sim

ACCOUNT = "123456789012"
REGION = "us-east-1"
MAX_HASH = 2**128 - 1
Item = dict[str, dict[str, Any]]
#: single-stream lease keys name no stream: the first (only) stream is meant
STREAM_OF_SINGLE = ""


def _copy(value: Any) -> Any:
    """A deep copy of request and item documents (dicts, lists and immutable leaves),
    several times cheaper than ``copy.deepcopy``. Leaves are not passed to a call of
    their own: most of a document's values are (an item is attributes of one string
    each), and every request and every item read is copied."""
    if isinstance(value, dict):
        return {k: _copy(v) if isinstance(v, _CONTAINERS) else v for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) if isinstance(v, _CONTAINERS) else v for v in value]
    return value


_CONTAINERS = (dict, list)


def client_error(operation: str, code: str, status: int = 400, message: str | None = None,
                 **extra: Any) -> ClientError:
    response: Any = {"Error": {"Code": code, "Message": message or code},
                     "ResponseMetadata": {"HTTPStatusCode": status}, **extra}
    return ClientError(response, operation)


# -- Kinesis ---------------------------------------------------------------------------------


@dataclass
class KRecord:
    sequence_number: int
    partition_key: str
    data: bytes
    arrival: float


@dataclass
class KShard:
    shard_id: str
    start_hash: int
    end_hash: int
    parents: tuple[str, ...] = ()
    records: list[KRecord] = field(default_factory=list)
    starting_sequence: int = 0
    ending_sequence: int | None = None
    children: list[str] = field(default_factory=list)
    #: when the shard was closed (true virtual time): with a retention, a closed shard leaves
    #: ListShards once its last record could have been trimmed
    closed_at: float | None = None


@dataclass
class KStream:
    name: str
    created: float
    shards: dict[str, KShard] = field(default_factory=dict)

    @property
    def arn(self) -> str:
        return f"arn:aws:kinesis:{REGION}:{ACCOUNT}:stream/{self.name}"


class Kinesis:
    """The streams, and the operations the producer and the controller use directly."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.streams: dict[str, KStream] = {}
        self._sequence = 10**20
        self._iterators: dict[str, tuple[str, str, int]] = {}
        #: the stream's retention in virtual seconds (None: nothing is ever trimmed). Kinesis'
        #: is 24 hours at least; a history compresses it so that trimming happens within it:
        #: records older than this are no longer returned, and a closed shard leaves
        #: ListShards (and GetShardIterator answers ResourceNotFound) this long after it was
        #: closed, while leases may still name it
        self.retention_s: float | None = None

    def trimmed(self, record: KRecord) -> bool:
        """Whether retention has trimmed ``record`` by now."""
        return self.retention_s is not None and record.arrival + self.retention_s <= self.sim.now

    def expired(self, shard: KShard) -> bool:
        """Whether a closed ``shard`` has left the stream (its retention ran out)."""
        return (self.retention_s is not None and shard.closed_at is not None
                and shard.closed_at + self.retention_s <= self.sim.now)

    def _horizon(self, shard: KShard) -> int:
        """The index of the shard's oldest untrimmed record (records stay in the list, for
        the invariants; the API never returns one before this index)."""
        if self.retention_s is None:
            return 0
        cut = self.sim.now - self.retention_s
        records = shard.records
        return next((i for i, r in enumerate(records) if r.arrival > cut), len(records))

    #: lease keys are the Java multi-stream ones (``account:stream:epoch:shard``)
    multi_stream = False

    def lease_key(self, stream: str, shard_id: str) -> str:
        if not self.multi_stream:
            return shard_id
        return f"{ACCOUNT}:{stream}:{int(EPOCH + self.streams[stream].created)}:{shard_id}"

    def shard_of_lease(self, lease_key: str) -> KShard | None:
        stream, shard_id = STREAM_OF_SINGLE, lease_key
        if self.multi_stream:
            _, stream, _, shard_id = lease_key.split(":")
        found = self.streams.get(stream) if stream else next(iter(self.streams.values()), None)
        return None if found is None else found.shards.get(shard_id)

    def all_shards(self) -> list[tuple[str, str, KShard]]:
        return [(name, shard_id, shard) for name, stream in self.streams.items()
                for shard_id, shard in stream.shards.items()]

    def _next_sequence(self) -> int:
        self._sequence += 1 + self.sim.rng.randrange(3)
        return self._sequence

    def create_stream(self, name: str, shards: int) -> None:
        stream = KStream(name, self.sim.now)
        width = (MAX_HASH + 1) // shards
        for index in range(shards):
            end = MAX_HASH if index == shards - 1 else (index + 1) * width - 1
            shard = KShard(f"shardId-{index:012d}", index * width, end,
                           starting_sequence=self._next_sequence())
            stream.shards[shard.shard_id] = shard
        self.streams[name] = stream

    def _new_shard_id(self, stream: KStream) -> str:
        return f"shardId-{len(stream.shards):012d}"

    def open_shards(self, name: str) -> list[KShard]:
        return [s for s in self.streams[name].shards.values() if s.ending_sequence is None]

    def put(self, name: str, partition_key: str, data: bytes) -> tuple[str, int]:
        stream = self.streams[name]
        hashed = int.from_bytes(__import__("hashlib").md5(partition_key.encode()).digest(), "big")
        for shard in stream.shards.values():
            if shard.ending_sequence is None and shard.start_hash <= hashed <= shard.end_hash:
                seq = self._next_sequence()
                # Kinesis stamps arrivals to the millisecond: a finer stamp than the service's
                # fell between a live start and the end of a recovery gap at one instant
                shard.records.append(KRecord(seq, partition_key, data,
                                             math.floor(self.sim.now * 1000) / 1000))
                return shard.shard_id, seq
        raise AssertionError(f"no open shard of {name} covers {hashed}")

    def _close(self, shard: KShard) -> None:
        shard.ending_sequence = self._next_sequence()
        shard.closed_at = self.sim.now

    def split(self, name: str, shard_id: str) -> list[str]:
        stream = self.streams[name]
        parent = stream.shards[shard_id]
        middle = (parent.start_hash + parent.end_hash) // 2
        self._close(parent)
        children = []
        for start, end in ((parent.start_hash, middle), (middle + 1, parent.end_hash)):
            child = KShard(self._new_shard_id(stream), start, end, (shard_id,),
                           starting_sequence=self._next_sequence())
            stream.shards[child.shard_id] = child
            children.append(child.shard_id)
        parent.children = children
        return children

    def merge(self, name: str, first: str, second: str) -> str:
        stream = self.streams[name]
        a, b = stream.shards[first], stream.shards[second]
        self._close(a)
        self._close(b)
        child = KShard(self._new_shard_id(stream), min(a.start_hash, b.start_hash),
                       max(a.end_hash, b.end_hash), (first, second),
                       starting_sequence=self._next_sequence())
        stream.shards[child.shard_id] = child
        a.children = b.children = [child.shard_id]
        return child.shard_id

    def adjacent_open_pair(self, name: str) -> tuple[str, str] | None:
        shards = sorted(self.open_shards(name), key=lambda s: s.start_hash)
        for a, b in itertools.pairwise(shards):
            if a.end_hash + 1 == b.start_hash:
                return a.shard_id, b.shard_id
        return None

    # -- the API -------------------------------------------------------------------------

    def _stream(self, operation: str, kwargs: dict[str, Any]) -> KStream:
        name = kwargs.get("StreamName") or str(kwargs.get("StreamARN", "")).rsplit("/", 1)[-1]
        stream = self.streams.get(name)
        if stream is None:
            raise client_error(operation, "ResourceNotFoundException")
        return stream

    def describe_stream_summary(self, **kwargs: Any) -> dict[str, Any]:
        stream = self._stream("DescribeStreamSummary", kwargs)
        return {"StreamDescriptionSummary": {
            "StreamName": stream.name, "StreamARN": stream.arn, "StreamStatus": "ACTIVE",
            "StreamCreationTimestamp": datetime.fromtimestamp(EPOCH + stream.created,
                                                              timezone.utc),
            "OpenShardCount": len(self.open_shards(stream.name))}}

    def list_shards(self, **kwargs: Any) -> dict[str, Any]:
        stream = self._stream("ListShards", kwargs)
        shards = []
        for shard in stream.shards.values():
            if self.expired(shard):
                continue
            entry: dict[str, Any] = {
                "ShardId": shard.shard_id,
                "HashKeyRange": {"StartingHashKey": str(shard.start_hash),
                                 "EndingHashKey": str(shard.end_hash)},
                "SequenceNumberRange": {"StartingSequenceNumber": str(shard.starting_sequence)},
            }
            if shard.ending_sequence is not None:
                entry["SequenceNumberRange"]["EndingSequenceNumber"] = str(shard.ending_sequence)
            if shard.parents:
                entry["ParentShardId"] = shard.parents[0]
            if len(shard.parents) > 1:
                entry["AdjacentParentShardId"] = shard.parents[1]
            shards.append(entry)
        return {"Shards": shards}

    def get_shard_iterator(self, **kwargs: Any) -> dict[str, Any]:
        stream = self._stream("GetShardIterator", kwargs)
        shard = stream.shards.get(kwargs["ShardId"])
        if shard is None or self.expired(shard):
            raise client_error("GetShardIterator", "ResourceNotFoundException")
        kind = kwargs["ShardIteratorType"]
        records = shard.records
        if kind == "TRIM_HORIZON":
            index = 0
        elif kind == "LATEST":
            index = len(records)
        elif kind in ("AT_SEQUENCE_NUMBER", "AFTER_SEQUENCE_NUMBER"):
            seq = int(kwargs["StartingSequenceNumber"])
            index = next((i for i, r in enumerate(records)
                          if r.sequence_number > seq
                          or (kind == "AT_SEQUENCE_NUMBER" and r.sequence_number == seq)),
                         len(records))
        else:  # AT_TIMESTAMP
            at = round(kwargs["Timestamp"].timestamp() - EPOCH, 3)
            index = next((i for i, r in enumerate(records) if r.arrival >= at), len(records))
        index = max(index, self._horizon(shard))
        return {"ShardIterator": self._iterator(stream.name, shard.shard_id, index)}

    def _iterator(self, stream: str, shard: str, index: int) -> str:
        token = f"it-{len(self._iterators)}"
        self._iterators[token] = (stream, shard, index)
        return token

    def get_records(self, **kwargs: Any) -> dict[str, Any]:
        try:
            name, shard_id, index = self._iterators[kwargs["ShardIterator"]]
        except KeyError:
            raise client_error("GetRecords", "InvalidArgumentException") from None
        stream = self.streams.get(name)
        if stream is None or shard_id not in stream.shards or self.expired(
                stream.shards[shard_id]):
            raise client_error("GetRecords", "ResourceNotFoundException")
        shard = stream.shards[shard_id]
        index = max(index, self._horizon(shard))
        limit = int(kwargs.get("Limit", 10000))
        page = shard.records[index:index + limit]
        end = index + len(page)
        response: dict[str, Any] = {
            "Records": [{"SequenceNumber": str(r.sequence_number), "PartitionKey": r.partition_key,
                         "Data": r.data, "ApproximateArrivalTimestamp":
                         datetime.fromtimestamp(EPOCH + r.arrival, timezone.utc)} for r in page],
        }
        tip = end >= len(shard.records)
        behind = 0 if tip else int((self.sim.now - shard.records[end].arrival) * 1000)
        response["MillisBehindLatest"] = max(0, behind)
        if shard.ending_sequence is not None and tip:
            response["ChildShards"] = [
                {"ShardId": child, "ParentShards": list(stream.shards[child].parents),
                 "HashKeyRange": {"StartingHashKey": str(stream.shards[child].start_hash),
                                  "EndingHashKey": str(stream.shards[child].end_hash)}}
                for child in shard.children]
        else:
            response["NextShardIterator"] = self._iterator(name, shard_id, end)
        return response


# -- DynamoDB --------------------------------------------------------------------------------

_CONDITION = re.compile(
    r"^(?:attribute_(?P<fn>not_exists|exists)\((?P<fa>#\w+)\)|(?P<name>#\w+) = (?P<value>:\w+))$")


def _resolve(names: dict[str, str], token: str) -> str:
    return names.get(token, token)


def condition_holds(item: Item | None, expression: str | None, names: dict[str, str],
                    values: dict[str, Any]) -> bool:
    if not expression:
        return True
    for term in expression.split(" AND "):
        match = _CONDITION.match(term.strip())
        if match is None:
            raise AssertionError(f"condition the simulator does not know: {term!r}")
        if match["fn"]:
            present = item is not None and _resolve(names, match["fa"]) in item
            if present != (match["fn"] == "exists"):
                return False
        else:
            attribute = _resolve(names, match["name"])
            if item is None or item.get(attribute) != values[match["value"]]:
                return False
    return True


def apply_update(item: Item, expression: str, names: dict[str, str],
                 values: dict[str, Any]) -> None:
    for clause in re.split(r"\s(?=SET |ADD |REMOVE |DELETE )", expression.strip()):
        verb, _, rest = clause.partition(" ")
        for part in (p.strip() for p in rest.split(",")):
            if verb == "SET":
                name, _, value = part.partition(" = ")
                item[_resolve(names, name)] = _copy(values[value])
            elif verb == "REMOVE":
                item.pop(_resolve(names, part), None)
            elif verb == "ADD":
                name, _, value = part.partition(" ")
                attribute, operand = _resolve(names, name), values[value]
                old = item.get(attribute)
                if "N" in operand:
                    total = int(old["N"]) if old else 0
                    item[attribute] = {"N": str(total + int(operand["N"]))}
                else:
                    merged = set(old["SS"]) if old else set()
                    item[attribute] = {"SS": sorted(merged | set(operand["SS"]))}
            elif verb == "DELETE":  # elements out of a set (a recovery gap done with)
                name, _, value = part.partition(" ")
                attribute = _resolve(names, name)
                old = item.get(attribute)
                left = (set(old["SS"]) if old else set()) - set(values[value]["SS"])
                if left:
                    item[attribute] = {"SS": sorted(left)}
                else:  # DynamoDB removes a set left empty
                    item.pop(attribute, None)
            else:
                raise AssertionError(f"update the simulator does not know: {clause!r}")


class Dynamo:
    """The tables. ``on_write(table, key, old, new)`` observes every write that landed."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.tables: dict[str, tuple[str, dict[str, Item]]] = {}
        #: table -> index name -> (hash key, range key or None); every index is KEYS_ONLY
        self.indexes: dict[str, dict[str, tuple[str, str | None]]] = {}
        #: how long an index added to an existing table (UpdateTable) takes to build, in
        #: virtual seconds: on AWS it backfills for minutes, and until then DescribeTable
        #: says CREATING and a Query of it is refused
        self.index_build_s = 0.0
        #: (table, index name) -> the virtual time its backfill ends
        self._backfilled_at: dict[tuple[str, str], float] = {}
        self.on_write: Callable[[str, str, Item | None, Item | None, dict[str, Any]],
                                None] | None = None

    def _table(self, operation: str, name: str) -> tuple[str, dict[str, Item]]:
        table = self.tables.get(name)
        if table is None:
            raise client_error(operation, "ResourceNotFoundException")
        return table

    def _written(self, table: str, key: str, old: Item | None, new: Item | None,
                 request: dict[str, Any]) -> None:
        if self.on_write is not None:
            self.on_write(table, key, old, new, request)

    def describe_table(self, **kw: Any) -> dict[str, Any]:
        self._table("DescribeTable", kw["TableName"])
        table: dict[str, Any] = {"TableName": kw["TableName"], "TableStatus": "ACTIVE"}
        indexes = self.indexes.get(kw["TableName"], {})
        if indexes:
            table["GlobalSecondaryIndexes"] = [
                {"IndexName": name, "IndexStatus": "ACTIVE"} if self._built(kw["TableName"], name)
                else {"IndexName": name, "IndexStatus": "CREATING", "Backfilling": True}
                for name in sorted(indexes)]
            if not all(self._built(kw["TableName"], name) for name in indexes):
                table["TableStatus"] = "UPDATING"
        return {"Table": table}

    def _built(self, table: str, index: str) -> bool:
        return self.sim.now >= self._backfilled_at.get((table, index), 0.0)

    def create_table(self, **kw: Any) -> dict[str, Any]:
        if kw["TableName"] in self.tables:
            raise client_error("CreateTable", "ResourceInUseException")
        self.tables[kw["TableName"]] = (kw["KeySchema"][0]["AttributeName"], {})
        for index in kw.get("GlobalSecondaryIndexes", []):
            self._add_index(kw["TableName"], index)
        return {"TableDescription": {"TableName": kw["TableName"], "TableStatus": "ACTIVE"}}

    def _add_index(self, table: str, index: dict[str, Any]) -> None:
        keys = {k["KeyType"]: k["AttributeName"] for k in index["KeySchema"]}
        if index.get("Projection", {}).get("ProjectionType") != "KEYS_ONLY":
            raise AssertionError("the simulator's indexes are KEYS_ONLY")
        self.indexes.setdefault(table, {})[index["IndexName"]] = (keys["HASH"], keys.get("RANGE"))

    def update_table(self, **kw: Any) -> dict[str, Any]:
        """Only what adding a global secondary index needs; the index is ACTIVE after
        ``index_build_s``."""
        self._table("UpdateTable", kw["TableName"])
        for update in kw.get("GlobalSecondaryIndexUpdates", []):
            if "Create" not in update:
                raise AssertionError(f"index update the simulator does not know: {update}")
            if update["Create"]["IndexName"] in self.indexes.get(kw["TableName"], {}):
                raise client_error("UpdateTable", "ValidationException")
            self._add_index(kw["TableName"], update["Create"])
            self._backfilled_at[(kw["TableName"], update["Create"]["IndexName"])] = (
                self.sim.now + self.index_build_s)
        return {"TableDescription": {"TableName": kw["TableName"], "TableStatus": "ACTIVE"}}

    def query(self, **kw: Any) -> dict[str, Any]:
        """A Query of a KEYS_ONLY global secondary index on an equality of its hash key
        (``#h = :v``): the matching items' table and index keys, in range-key order, in one
        page."""
        hash_key, items = self._table("Query", kw["TableName"])
        index = self.indexes.get(kw["TableName"], {}).get(kw.get("IndexName", ""))
        if index is None:
            raise client_error("Query", "ValidationException")
        if not self._built(kw["TableName"], kw["IndexName"]):
            # DynamoDB's own words while a new index backfills
            raise client_error("Query", "ValidationException", message=(
                f"Cannot read from backfilling global secondary index: {kw['IndexName']}"))
        match = re.fullmatch(r"(#\w+) = (:\w+)", kw["KeyConditionExpression"].strip())
        if match is None:
            raise AssertionError(f"key condition the simulator does not know: {kw}")
        attribute = _resolve(kw.get("ExpressionAttributeNames", {}), match[1])
        if attribute != index[0]:
            raise client_error("Query", "ValidationException")
        wanted = kw["ExpressionAttributeValues"][match[2]]
        found = [item for item in items.values() if item.get(attribute) == wanted]
        found.sort(key=lambda item: str(item.get(index[1] or hash_key, {}).get("S", "")))
        keep = {hash_key, *(k for k in index if k is not None)}
        return {"Items": [{k: _copy(v) for k, v in item.items() if k in keep} for item in found],
                "Count": len(found)}

    def scan(self, **kw: Any) -> dict[str, Any]:
        _, items = self._table("Scan", kw["TableName"])
        return {"Items": [_copy(items[k]) for k in sorted(items)]}

    def get_item(self, **kw: Any) -> dict[str, Any]:
        hash_key, items = self._table("GetItem", kw["TableName"])
        item = items.get(kw["Key"][hash_key]["S"])
        return {} if item is None else {"Item": _copy(item)}

    def _check(self, operation: str, item: Item | None, kw: dict[str, Any]) -> None:
        if not condition_holds(item, kw.get("ConditionExpression"),
                               kw.get("ExpressionAttributeNames", {}),
                               kw.get("ExpressionAttributeValues", {})):
            extra: dict[str, Any] = {}
            if kw.get("ReturnValuesOnConditionCheckFailure") == "ALL_OLD" and item is not None:
                extra["Item"] = _copy(item)
            raise client_error(operation, "ConditionalCheckFailedException", **extra)

    def put_item(self, **kw: Any) -> dict[str, Any]:
        hash_key, items = self._table("PutItem", kw["TableName"])
        key = kw["Item"][hash_key]["S"]
        old = items.get(key)
        self._check("PutItem", old, kw)
        items[key] = _copy(kw["Item"])
        self._written(kw["TableName"], key, old, items[key], kw)
        return {}

    def update_item(self, **kw: Any) -> dict[str, Any]:
        hash_key, items = self._table("UpdateItem", kw["TableName"])
        key = kw["Key"][hash_key]["S"]
        old = items.get(key)
        self._check("UpdateItem", old, kw)
        new = _copy(old) if old is not None else _copy(kw["Key"])
        apply_update(new, kw["UpdateExpression"], kw.get("ExpressionAttributeNames", {}),
                     kw.get("ExpressionAttributeValues", {}))
        items[key] = new
        self._written(kw["TableName"], key, old, new, kw)
        return {"Attributes": _copy(new)} if kw.get("ReturnValues") == "ALL_NEW" else {}

    def delete_item(self, **kw: Any) -> dict[str, Any]:
        hash_key, items = self._table("DeleteItem", kw["TableName"])
        key = kw["Key"][hash_key]["S"]
        old = items.get(key)
        self._check("DeleteItem", old, kw)
        items.pop(key, None)
        self._written(kw["TableName"], key, old, None, kw)
        return {}

    def transact_write_items(self, **kw: Any) -> dict[str, Any]:
        entries = kw["TransactItems"]
        reasons: list[dict[str, Any]] = []
        failed = False
        for entry in entries:
            (kind, body), = entry.items()
            hash_key, items = self._table("TransactWriteItems", body["TableName"])
            key = (body["Item"] if kind == "Put" else body["Key"])[hash_key]["S"]
            current = items.get(key)
            if condition_holds(current, body.get("ConditionExpression"),
                               body.get("ExpressionAttributeNames", {}),
                               body.get("ExpressionAttributeValues", {})):
                reasons.append({"Code": "None"})
            else:
                failed = True
                reason: dict[str, Any] = {"Code": "ConditionalCheckFailed"}
                if body.get("ReturnValuesOnConditionCheckFailure") == "ALL_OLD" and current:
                    reason["Item"] = _copy(current)
                reasons.append(reason)
        if failed:
            raise client_error("TransactWriteItems", "TransactionCanceledException",
                               CancellationReasons=reasons)
        for entry in entries:
            (kind, body), = entry.items()
            hash_key, items = self._table("TransactWriteItems", body["TableName"])
            key = (body["Item"] if kind == "Put" else body["Key"])[hash_key]["S"]
            old = items.get(key)
            if kind == "Put":
                items[key] = _copy(body["Item"])
            elif kind == "Delete":
                items.pop(key, None)
            elif kind == "Update":
                new = _copy(old) if old is not None else _copy(body["Key"])
                apply_update(new, body["UpdateExpression"],
                             body.get("ExpressionAttributeNames", {}),
                             body.get("ExpressionAttributeValues", {}))
                items[key] = new
            else:
                continue
            self._written(body["TableName"], key, old, items.get(key), body)
        return {}


# -- faults and the clients ------------------------------------------------------------------


@dataclass
class FaultPlan:
    """What can go wrong with a request, and until when (virtual seconds)."""

    until: float = 0.0
    #: probabilities per request
    throttle: float = 0.0
    server_error: float = 0.0
    lost: float = 0.0
    delay: float = 0.0
    #: a delayed answer arrives after this many failover times (uniform)
    delay_range: tuple[float, float] = (0.5, 1.1)
    failover_s: float = 5.0


@dataclass
class Touch:
    """The last time a fault hit a request about one lease item (hole 6's oracle)."""

    when: float
    what: str


class FaultyClient:
    """One node's client of one service: each call yields, lands at once, answers late."""

    def __init__(self, sim: Sim, node: Node, backend: Any, service: str, plan: FaultPlan,
                 touched: dict[tuple[str, str], Touch], max_attempts: int) -> None:
        self.sim = sim
        self.node = node
        self.backend = backend
        self.service = service
        self.plan = plan
        self.touched = touched
        self.max_attempts = max_attempts
        self.meta = _Meta()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        operation = getattr(self.backend, name)

        def call(**kwargs: Any) -> Any:
            return self._call(name, operation, kwargs)

        return call

    def _lease_key(self, kwargs: dict[str, Any]) -> str | None:
        key = kwargs.get("Key", {}).get("leaseKey")
        if key is None and "TransactItems" in kwargs:
            first = next(iter(kwargs["TransactItems"][0].values()))
            key = first.get("Key", {}).get("leaseKey")
        return None if key is None else str(key["S"])

    def _call(self, name: str, operation: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        sim, plan = self.sim, self.plan
        attempt = 0
        while True:
            attempt += 1
            sim.me()
            sim.yield_now()
            rng = sim.rng
            faulty = sim.now < plan.until
            latency = 0.002 + rng.random() * 0.02
            roll = rng.random() if faulty else 1.0
            lease_key = self._lease_key(kwargs) if self.service == "dynamodb" else None
            error: Exception | None = None
            result: Any = None
            if roll < plan.throttle:
                # Kinesis and DynamoDB throttle with the same code
                error = client_error(_op_name(name), "ProvisionedThroughputExceededException")
                what = "throttled"
            elif roll < plan.throttle + plan.server_error:
                error = client_error(_op_name(name), "InternalFailure", 500)
                what = "5xx"
            else:
                what = ""
                try:
                    result = operation(**_copy(kwargs))
                except ClientError as exc:
                    error = exc
                roll -= plan.throttle + plan.server_error
                if roll < plan.lost:
                    latency += plan.failover_s * rng.uniform(*plan.delay_range)
                    error, result, what = ReadTimeoutError(endpoint_url=self.service), None, "lost"
                elif roll < plan.lost + plan.delay:
                    latency += plan.failover_s * rng.uniform(*plan.delay_range)
                    what = "delayed"
            if lease_key is not None and what:
                self.touched[(self.node.name, lease_key)] = Touch(sim.now + latency, what)
            if sim.trace is not None:  # the lease and the answer: what a replay reader needs
                answer = (what or (error.response["Error"]["Code"]
                                   if isinstance(error, ClientError) else "ok"))
                about = f" {lease_key}" if lease_key is not None else ""
                sim.log(f"{self.service}.{name}{about} {answer} {latency:.3f}s")
            answered_at = sim.now
            sim.sleep(latency * self.node.rate)
            if self.service == "kinesis" and what != "lost":
                # AWS stamps every answer with a Date header of its own clock (whole
                # seconds): kclpy's KinesisClock learns Kinesis' time from it
                clock = kinesis_clock(cast(Any, self))  # a stand-in for a KinesisClient
                clock.observe_date(formatdate(EPOCH + answered_at, usegmt=True))
            if error is None:
                return result
            if attempt < self.max_attempts and _retryable(error):
                sim.sleep(rng.random() * min(20.0, 2.0 ** (attempt - 1)) * self.node.rate)
                continue
            if isinstance(error, ClientError):  # as botocore tells how often it retried
                meta: Any = error.response.setdefault("ResponseMetadata", {})  # type: ignore[typeddict-item]
                meta["RetryAttempts"] = attempt - 1
            raise error


def _op_name(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def _retryable(error: Exception) -> bool:
    """What botocore's standard retry mode retries."""
    if isinstance(error, ReadTimeoutError):
        return True
    if isinstance(error, ClientError):
        code = error.response["Error"]["Code"]
        status = error.response["ResponseMetadata"]["HTTPStatusCode"]
        return status >= 500 or code in ("ProvisionedThroughputExceededException",
                                         "ThrottlingException", "RequestLimitExceeded",
                                         "TransactionInProgressException")
    return False


class _Events:
    def register(self, *args: object, **kwargs: object) -> None:
        """kclpy's GetRecords parse hook: the fake answers in botocore's parsed shape."""


class _Meta:
    def __init__(self) -> None:
        self.events = _Events()


class Session:
    """What ``Worker(session=...)`` needs: ``client(service, ...)``."""

    def __init__(self, clients: dict[str, FaultyClient]) -> None:
        self._clients = clients

    def client(self, service: str, **kwargs: Any) -> FaultyClient:
        return self._clients[service]


__all__ = ["Dynamo", "FaultPlan", "FaultyClient", "Kinesis", "Session", "scheduler"]
